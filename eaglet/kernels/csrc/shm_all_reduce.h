// The shared-memory all-reduce of eaglet.distributed.shm_communicator, callable from C++ (the
// decoder stack under tensor parallelism runs its layers' all-reduces without returning to Python).
// Same segment layout, sequence counter and summation as the Python side, so the two interleave on
// one group and give the same bits.
#pragma once

#include "common.h"

#include <vector>

namespace eaglet {

struct ShmGroup {
  uint8_t* base = nullptr;  // the segment's first byte in this process
  int64_t rank = 0, size = 1, slot_bytes = 0, message_bytes = 0;
  at::Tensor seq;  // int64 [1]: collectives done, shared with the Python communicator
  at::Tensor time;  // float64 [2]: seconds inside collectives here, their count
  std::vector<int64_t> pids;  // each rank's process, to notice one that exited
  double timeout_s = 60.0;
};

// x (contiguous) becomes the sum over ranks of every rank's x, in rank order, rounded to x's dtype
// after each addition (what the Python side's copy_ / add_ give).
void shm_all_reduce(const ShmGroup& group, at::Tensor& x);

}  // namespace eaglet
