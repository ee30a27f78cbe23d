"""The paged cache's bookkeeping in PyTorch ops (``eaglet.runtime.kv_cache.CacheOps``)."""

from __future__ import annotations

import torch

from eaglet.runtime.forward_batch import long_tensor


class TorchCacheOps:
    def copy_slots(self, buffer: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        moved = src != dst
        if moved.any():
            buffer[:, dst[moved]] = buffer[:, src[moved]]

    def scratch_slots(self, req_to_token: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, scratch: int) -> torch.Tensor:
        return req_to_token[rows[:, None], prefix[:, None] + torch.arange(scratch, device=prefix.device)]

    def write_block_entries(self, req_to_token: torch.Tensor, new_blocks: list[int], block_size: int) -> None:
        width = req_to_token.shape[1]
        table_index: list[int] = []
        table_slots: list[int] = []
        for row, block_index, block in zip(new_blocks[::3], new_blocks[1::3], new_blocks[2::3]):
            start = block_index * block_size
            count = min(block_size, width - start)  # the table may end inside the last block
            table_index.extend(range(row * width + start, row * width + start + count))
            table_slots.extend(range(block * block_size, block * block_size + count))
        if table_index:
            index, values = long_tensor(table_index + table_slots).view(2, -1).to(req_to_token.device).unbind(0)
            req_to_token.view(-1)[index] = values
