"""Vocabulary-wide reductions of logits in eaglet's C++ kernels (``SamplingOps``): one pass per
row, 4-10x faster than the PyTorch forms for a draft's or verify's logits."""

from __future__ import annotations

import torch

from eaglet.backends.pytorch.sampling_ops import TorchSamplingOps

_DTYPES = (torch.float32, torch.bfloat16)


class CpuSamplingOps:
    def __init__(self, fallback: TorchSamplingOps) -> None:
        self.fallback = fallback

    def argmax(self, logits: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        if logits.dtype not in _DTYPES or logits.device.type != "cpu":
            return self.fallback.argmax(logits, offsets)
        return torch.ops.eaglet.argmax_last_dim(logits, offsets)

    def topk_logprobs(
        self, logits: torch.Tensor, k: int, offsets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dtype not in _DTYPES or logits.device.type != "cpu":
            return self.fallback.topk_logprobs(logits, k, offsets)
        values, ids = torch.ops.eaglet.topk_logprobs(logits, k, offsets)
        return values, ids
