"""The paged cache's bookkeeping in eaglet's C++ kernels (``eaglet.runtime.kv_cache.CacheOps``):
one call each where the PyTorch forms take several ops and host copies."""

from __future__ import annotations

import torch

from eaglet.backends.pytorch.cache_ops import TorchCacheOps
from eaglet.runtime.forward_batch import long_tensor


class CpuCacheOps:
    def __init__(self, fallback: TorchCacheOps) -> None:
        self.fallback = fallback

    def copy_slots(self, buffer: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            self.fallback.copy_slots(buffer, src, dst)
            return
        torch.ops.eaglet.copy_cache_slots(buffer, src, dst)

    def scratch_slots(self, req_to_token: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, scratch: int) -> torch.Tensor:
        if req_to_token.device.type != "cpu":
            return self.fallback.scratch_slots(req_to_token, rows, prefix, scratch)
        return torch.ops.eaglet.scratch_slots(req_to_token, rows, prefix, scratch)

    def write_block_entries(self, req_to_token: torch.Tensor, new_blocks: list[int], block_size: int) -> None:
        if req_to_token.device.type != "cpu":
            self.fallback.write_block_entries(req_to_token, new_blocks, block_size)
            return
        torch.ops.eaglet.write_block_entries(req_to_token, long_tensor(new_blocks).view(-1, 3), block_size)
