// What every kernel file shares: the ATen headers, when a kernel is worth the thread pool, and
// zeroed scratch buffers.
//
// Every kernel computes a row (a token, or a token's head) with the same arithmetic whatever else
// is in the batch: loops over a row's elements run in a fixed order with fixed-width partial sums,
// and no work is split inside a row. So a token's result does not depend on how many tokens share
// the call, which is what lossless greedy speculation needs (a verify pass must reproduce decoding).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
// The ATen functions the kernels call, by their own headers: <ATen/ATen.h> declares every op, and
// parsing it again in each file multiplies the build's time.
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace eaglet {

// Below this many multiply-adds a kernel runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelWork = 1 << 15;

// v = n zero bfloat16 values, by memset (vector::assign fills BFloat16 element by element, several
// times slower, which shows in a decode step's small buffers).
inline void assign_zeros(std::vector<at::BFloat16>& v, int64_t n) {
  v.resize(n);
  std::memset(v.data(), 0, n * sizeof(at::BFloat16));
}

}  // namespace eaglet
