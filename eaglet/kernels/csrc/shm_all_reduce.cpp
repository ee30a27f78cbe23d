// The all-reduce of shm_all_reduce.h. Layout (eaglet/distributed/shm_communicator.py): int64 flags
// from the segment's start, rank r's on cache line r (sequence number, then the collective's kind
// and byte count per parity); slots after a 4096-byte header and the message area, one per parity
// and rank.
#include "shm_all_reduce.h"

#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

namespace eaglet {
namespace {

constexpr int64_t kLine = 8;  // int64 flags per 64-byte cache line
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kAllReduce = 1;  // the kind the Python side publishes for an all-reduce

bool process_alive(int64_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');
  if (!close || close[1] == 0 || close[2] == 0) return false;
  return close[2] != 'Z' && close[2] != 'X';
}

// Waits until rank's sequence flag reaches target; raises where it exited or outlasts the timeout.
void wait_for(const ShmGroup& g, int64_t* flags, int64_t rank, int64_t target) {
  int64_t* flag = flags + rank * kLine;
  if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= target) return;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto last_check = start;
  for (uint64_t spins = 1;; ++spins) {
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= target) return;
    _mm_pause();
    if (spins % 4096) continue;
    const auto now = clock::now();
    if (std::chrono::duration<double>(now - last_check).count() < 0.05) continue;
    last_check = now;
    TORCH_CHECK(process_alive(g.pids[rank]), "tensor-parallel rank ", rank, " (pid ", g.pids[rank],
                ") exited during a collective");
    TORCH_CHECK(std::chrono::duration<double>(now - start).count() <= g.timeout_s, "tensor-parallel rank ", rank,
                " did not reach a collective within ", g.timeout_s, " s");
  }
}

}  // namespace

void shm_all_reduce(const ShmGroup& g, at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous(), "shm_all_reduce: a contiguous tensor");
  if (g.size == 1) return;
  const auto start = std::chrono::steady_clock::now();
  int64_t* flags = reinterpret_cast<int64_t*>(g.base);
  int64_t* seq = g.seq.data_ptr<int64_t>();
  at::Tensor flat = x.view({-1});
  const int64_t elem = x.element_size(), per_piece = g.slot_bytes / elem;
  for (int64_t first = 0; first < flat.numel(); first += per_piece) {
    at::Tensor piece = flat.narrow(0, first, std::min(per_piece, flat.numel() - first));
    const int64_t n = piece.numel(), bytes = n * elem, target = ++seq[0], parity = target & 1;
    auto slot = [&](int64_t r) {
      return g.base + kHeaderBytes + g.message_bytes + (parity * g.size + r) * g.slot_bytes;
    };
    std::memcpy(slot(g.rank), piece.data_ptr(), bytes);
    int64_t* mine = flags + g.rank * kLine;
    mine[1 + 2 * parity] = kAllReduce;
    mine[2 + 2 * parity] = bytes;
    __atomic_store_n(mine, target, __ATOMIC_RELEASE);
    for (int64_t r = 0; r < g.size; ++r) {
      if (r != g.rank) wait_for(g, flags, r, target);
    }
    for (int64_t r = 0; r < g.size; ++r) {
      const int64_t* theirs = flags + r * kLine;
      TORCH_CHECK(theirs[1 + 2 * parity] == kAllReduce && theirs[2 + 2 * parity] == bytes, "tensor-parallel ranks out of "
                  "step: rank ", r, " ran collective kind ", theirs[1 + 2 * parity], " of ", theirs[2 + 2 * parity],
                  " bytes where rank ", g.rank, " ran kind ", kAllReduce, " of ", bytes);
    }
    auto view = [&](int64_t r) { return at::from_blob(slot(r), {n}, piece.options()); };
    piece.copy_(view(0));
    for (int64_t r = 1; r < g.size; ++r) piece.add_(view(r));
  }
  double* time = g.time.data_ptr<double>();
  time[0] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  time[1] += 1;
}

}  // namespace eaglet
