// Greedy tokens and top-k log-probabilities of logits rows (argmax_last_dim, topk_logprobs).
#include "logits.h"
#include "ops.h"

namespace eaglet {

namespace {

// The contiguous int64 offsets, one per column (an EAGLE-3 draft's d2t), or an undefined tensor.
at::Tensor column_offsets(const c10::optional<at::Tensor>& offsets, int64_t columns, const char* op) {
  if (!offsets.has_value()) return at::Tensor();
  TORCH_CHECK(offsets->dim() == 1 && offsets->size(0) == columns && offsets->scalar_type() == at::kLong, op,
              ": int64 offsets, one per column");
  return offsets->contiguous();
}

}  // namespace

// The argmax i of each row, or i + offsets[i] with ``offsets`` (an EAGLE-3 draft's d2t: draft ids to target ids).
at::Tensor argmax_last_dim(const at::Tensor& logits, const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "argmax_last_dim: a non-empty last dimension");
  const at::Tensor x = logits.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  const at::Tensor offsets_c = column_offsets(offsets, n, "argmax_last_dim");
  const int64_t* offp = offsets_c.defined() ? offsets_c.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (kParallelWork * 8) / n);
  const auto run = [&](const auto* xp) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t i = argmax_row(xp + r * n, n);
        op[r] = offp ? i + offp[i] : i;
      }
    });
  };
  with_logits(x, "argmax_last_dim", run);
  return out;
}

// The k largest log-probabilities (log_softmax) of each row of [R, V] logits, largest first and the
// lower index first among equal values: float32 values and int64 ids, i + offsets[i] with
// ``offsets`` (an EAGLE-3 draft's d2t). One pass keeps the top k, one sums the exponentials.
std::vector<at::Tensor> topk_logprobs(const at::Tensor& logits, int64_t k, const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && k >= 1 && k <= logits.size(1),
              "topk_logprobs: logits [R, V] and 1 <= k <= V");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  const at::Tensor offsets_c = column_offsets(offsets, vocab, "topk_logprobs");
  const int64_t* offp = offsets_c.defined() ? offsets_c.data_ptr<int64_t>() : nullptr;
  at::Tensor values = at::empty({rows, k}, x.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (kParallelWork * 8) / vocab);
  const auto run = [&](const auto* xp) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(vocab);
      for (int64_t r = begin; r < end; ++r) {
        load_row(row.data(), xp + r * vocab, vocab);
        float* best = vp + r * k;
        int64_t* best_ids = ip + r * k;
        int64_t count = 0;
        const auto offer = [&](int64_t i) {
          const float v = row[i];
          if (count == k && !(v > best[k - 1])) return;
          int64_t at = count < k ? count++ : k - 1;
          for (; at > 0 && v > best[at - 1]; --at) {  // after the equal ones: the lower index stays first
            best[at] = best[at - 1];
            best_ids[at] = best_ids[at - 1];
          }
          best[at] = v;
          best_ids[at] = i;
        };
        int64_t i = 0;
        for (; i < vocab && count < k; ++i) offer(i);
#if defined(__AVX512F__)
        // 16 at a time, offering only the lanes above the current k-th value (few, past the start).
        for (; i < vocab; i += kLanes) {
          const __mmask16 m = tail_mask(vocab - i);
          __mmask16 above = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, row.data() + i), _mm512_set1_ps(best[k - 1]), _CMP_GT_OQ);
          for (; above; above &= above - 1) offer(i + __builtin_ctz(above));
        }
#else
        for (; i < vocab; ++i) offer(i);
#endif
        const float row_max = best[0];
        float sum = 0.0f;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < vocab; i += kLanes) {
          const __mmask16 m = tail_mask(vocab - i);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row.data() + i), _mm512_set1_ps(row_max)));
          acc = _mm512_mask_add_ps(acc, m, acc, e);
        }
        sum = _mm512_reduce_add_ps(acc);
#else
        // kLanes partial sums, as the vector path: one serial sum over a vocabulary loses digits.
        exp_shifted_row(row.data(), row_max, vocab);
        float partial[kLanes] = {0};
        for (int64_t i = 0; i < vocab; ++i) partial[i % kLanes] += row[i];
        for (int j = 0; j < kLanes; ++j) sum += partial[j];
#endif
        const float log_normalizer = row_max + std::log(sum);
        for (int64_t j = 0; j < k; ++j) {
          best[j] -= log_normalizer;
          if (offp) best_ids[j] += offp[best_ids[j]];
        }
      }
    });
  };
  with_logits(x, "topk_logprobs", run);
  return {values, ids};
}

}  // namespace eaglet
