"""Paged KV cache over one slot space shared by the target and the draft.

A cache slot stands for one logical token position of one request. Every model keeps its own
buffers (a pool) indexed by the same slots, so the target's and the draft's entries in a slot
always describe the same position, and freeing a request frees both.

For MLA models, per token per layer the pool stores ``kv_lora_rank + qk_rope_head_dim`` values:
the normalized compressed latent c_kv followed by the roped shared key k_pe. K and V are never
stored decompressed. Slots are grouped into fixed-size blocks; a block allocator with reference
counts hands blocks to requests (a block shared by a prefix cache holds several references).

Block 0 is reserved: its slots are the padding target of unused table entries, never written by a
real token, so a padded gather can never read another request's data by accident.

The request-to-slots table is written a block at a time: a row's entries hold the slots of every
position its blocks cover (also those past its length, which are its own slots), and 0 past its
blocks. So growing or cutting a row within its blocks (a speculative round's scratch, a decode
step) writes nothing to the table.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from eaglet.errors import EagletError
from eaglet.runtime.forward_batch import long_tensor


class CacheOps(Protocol):
    """The cache's bookkeeping that a backend implements (``eaglet.backends``)."""

    def copy_slots(self, buffer: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's entries of slots ``src`` of a [layers, slots, ...] buffer go to slots
        ``dst`` (distinct slots); entries already in place are skipped."""
        ...

    def scratch_slots(self, req_to_token: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, scratch: int) -> torch.Tensor:
        """[B, scratch]: the slots of row indices prefix[b] .. prefix[b] + scratch - 1 of ``rows``."""
        ...

    def write_block_entries(self, req_to_token: torch.Tensor, new_blocks: list[int], block_size: int) -> None:
        """Writes the table entries of new blocks, given as flattened (row, block index, block) triples."""
        ...


class OutOfCacheBlocks(EagletError):
    """Not enough free KV-cache blocks for the requested allocation."""


class BlockAllocator:
    def __init__(self, num_blocks: int, reserved: int = 1) -> None:
        if num_blocks <= reserved:
            raise ValueError(f"need more than {reserved} cache blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(reserved, num_blocks))
        self.num_usable = num_blocks - reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfCacheBlocks(f"asked for {n} cache blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free cache block {b}")
            self.ref_counts[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of cache block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class LatentKVPool:
    """One model's MLA latent buffers [num_layers, num_slots, kv_lora_rank + qk_rope_head_dim]."""

    def __init__(self, num_layers: int, num_slots: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.kv = torch.zeros(num_layers, num_slots, dim, dtype=dtype, device=device)

    def write(self, layer_id: int, out_cache_loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        latent_dim = c_kv.shape[-1]
        buf = self.kv[layer_id]
        buf[out_cache_loc, :latent_dim] = c_kv.to(buf.dtype)
        buf[out_cache_loc, latent_dim:] = k_pe.to(buf.dtype)

    def buffers(self) -> list[torch.Tensor]:
        return [self.kv]


class GQAKVPool:
    """One model's K and V buffers [num_layers, num_slots, num_kv_heads, head_dim] over the shared slots."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.k = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)

    def write(self, layer_id: int, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer_id][out_cache_loc] = k.to(self.k.dtype)
        self.v[layer_id][out_cache_loc] = v.to(self.v.dtype)

    def buffers(self) -> list[torch.Tensor]:
        layers, slots = self.k.shape[:2]
        return [self.k.view(layers, slots, -1), self.v.view(layers, slots, -1)]


class KVCacheManager:
    """Owns the block allocator, the request-to-slots table and the pools of every model."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_cache_dim: int,
        num_blocks: int,
        block_size: int,
        max_requests: int,
        max_context_len: int,
        dtype: torch.dtype,
        ops: CacheOps,
        device: torch.device | str = "cpu",
    ) -> None:
        self.ops = ops
        self.block_size = block_size
        self.max_context_len = max_context_len
        self.allocator = BlockAllocator(num_blocks)
        self.num_slots = num_blocks * block_size
        self.device = device
        self.target = LatentKVPool(num_layers, self.num_slots, kv_cache_dim, dtype, device)
        self.pools: list = [self.target]
        # req_to_token[row, i] = cache slot of the row's i-th token; 0 (reserved) where unused.
        self.req_to_token = torch.zeros(max_requests, max_context_len, dtype=torch.long, device=device)
        self._free_rows: deque[int] = deque(range(max_requests))
        self.row_blocks: dict[int, list[int]] = {}
        self.row_len: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_new_tokens_per_row: list[tuple[int | None, int]]) -> bool:
        """Whether every (row or None, target length) can grow to its length at once."""
        need = 0
        for row, target in num_new_tokens_per_row:
            have = len(self.row_blocks[row]) if row is not None else 0
            need += max(0, self.blocks_needed(target) - have)
        return need <= self.allocator.num_free

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise OutOfCacheBlocks("no free request rows in the request-to-slots table")
        row = self._free_rows.popleft()
        self.row_blocks[row] = []
        self.row_len[row] = 0
        return row

    def adopt_blocks(self, row: int, blocks: list[int], num_tokens: int) -> None:
        """Starts an empty row with blocks it already holds a reference to (a prefix-cache hit)."""
        if self.row_blocks[row] or self.row_len[row]:
            raise RuntimeError("adopt_blocks needs an empty row")
        if self.blocks_needed(num_tokens) != len(blocks):
            raise ValueError(f"{len(blocks)} blocks cannot hold exactly {num_tokens} tokens")
        self.row_blocks[row] = list(blocks)
        new_blocks: list[int] = []
        self._new_blocks(row, 0, new_blocks)
        self._write_blocks(new_blocks)
        self.grow(row, num_tokens)

    def grow(self, row: int, new_len: int) -> torch.Tensor:
        """Extends the row to new_len tokens; returns the slots of positions [old_len, new_len)."""
        return self.grow_rows([row], [new_len])

    def grow_rows(self, rows: list[int], new_lens: list[int]) -> torch.Tensor:
        """Extends each row to its new length; returns the slots of every row's new positions,
        concatenated in row order, computed block by block in Python (a decode step adds one
        position per row)."""
        old_lens = [self.row_len[row] for row in rows]
        self.reserve_rows(rows, new_lens)
        size = self.block_size
        slots: list[int] = []
        for row, old, new in zip(rows, old_lens, new_lens):
            blocks = self.row_blocks[row]
            for block_index in range(old // size, (new - 1) // size + 1) if new > old else ():
                base = blocks[block_index] * size
                slots.extend(range(base + max(old - block_index * size, 0), base + min(new - block_index * size, size)))
        return long_tensor(slots)

    def reserve_rows(self, rows: list[int], new_lens: list[int]) -> None:
        """``grow_rows`` for callers that read the new slots from the table; the table is written
        only for newly allocated blocks."""
        if any(new < self.row_len[row] for row, new in zip(rows, new_lens)):
            raise ValueError("grow_rows only grows rows; truncate shortens them")
        longest = max(new_lens, default=0)
        if longest > self.max_context_len:
            raise OutOfCacheBlocks(f"sequence of {longest} tokens exceeds the table width {self.max_context_len}")
        new_blocks: list[int] = []
        size = self.block_size
        try:
            for row, new in zip(rows, new_lens):
                blocks = self.row_blocks[row]
                missing = -(-new // size) - len(blocks)
                if missing > 0:
                    first = len(blocks)
                    blocks.extend(self.allocator.allocate(missing))
                    self._new_blocks(row, first, new_blocks)
        finally:  # out of blocks part way: the rows keep what they got, in the table, at their old lengths
            self._write_blocks(new_blocks)
        for row, new in zip(rows, new_lens):
            self.row_len[row] = new

    def reserve_scratch(self, rows: list[int], lens: list[int], scratch: int) -> None:
        """Grows each row, which must hold exactly its ``lens`` tokens, by ``scratch`` positions (a
        speculative round's; ``scratch_slots`` reads their slots). One pass over the rows: their
        blocks usually hold the scratch already (truncate keeps it), and a decode round calls this
        for every request."""
        size, width = self.block_size, self.max_context_len
        if max(lens, default=0) + scratch > width:
            raise OutOfCacheBlocks(f"sequence of {max(lens) + scratch} tokens exceeds the table width {width}")
        grow_rows, grow_lens = [], []
        row_len, row_blocks = self.row_len, self.row_blocks
        for row, n in zip(rows, lens):
            if row_len[row] != n:
                raise RuntimeError("a speculative round needs every cache row to hold exactly its request's committed tokens")
            if len(row_blocks[row]) * size < n + scratch:
                grow_rows.append(row)
                grow_lens.append(n + scratch)
        if grow_rows:  # out of blocks: raises with every row at its old length
            self.reserve_rows(grow_rows, grow_lens)
        for row, n in zip(rows, lens):
            row_len[row] = n + scratch

    def scratch_slots(self, rows: torch.Tensor, prefix: torch.Tensor, scratch: int) -> torch.Tensor:
        """[B, scratch]: the cache slots of row indices prefix[b] .. prefix[b] + scratch - 1 of each
        of ``rows``."""
        return self.ops.scratch_slots(self.req_to_token, rows, prefix, scratch)

    def truncate(self, row: int, new_len: int) -> None:
        """Drops positions >= new_len (rejected speculative tokens); frees blocks no longer needed."""
        self.truncate_rows([row], [new_len])

    def truncate_rows(self, rows: list[int], new_lens: list[int], reserve: int = 0) -> None:
        """``truncate`` for several rows; the table is cleared only where blocks are freed. Each row
        keeps the blocks of ``reserve`` more positions (a speculative round's scratch: the next round
        would allocate them again, and the scheduler counts them as taken by a decoding request)."""
        size, width = self.block_size, self.max_context_len
        table_index: list[int] = []
        for row, new_len in zip(rows, new_lens):
            keep = -(-(new_len + reserve) // size)
            blocks = self.row_blocks[row]
            if len(blocks) > keep:
                table_index.extend(range(row * width + keep * size, row * width + min(len(blocks) * size, width)))
                self.allocator.decref(blocks[keep:])
                del blocks[keep:]
            self.row_len[row] = min(self.row_len[row], new_len)
        self._write_table(table_index, [0] * len(table_index))

    def free_row(self, row: int) -> None:
        blocks = self.row_blocks.pop(row)
        self.allocator.decref(blocks)
        self.req_to_token[row, : len(blocks) * self.block_size] = 0
        self.row_len.pop(row)
        self._free_rows.append(row)

    def _new_blocks(self, row: int, first: int, new_blocks: list[int]) -> None:
        """Appends (row, block index, block) of the row's blocks from block index ``first`` on."""
        for block_index, block in enumerate(self.row_blocks[row][first:], start=first):
            new_blocks += (row, block_index, block)

    def _write_blocks(self, new_blocks: list[int]) -> None:
        """Writes the table entries of ``_new_blocks``' blocks (a speculative round at batch 16
        grows a row's blocks most rounds)."""
        if new_blocks:
            self.ops.write_block_entries(self.req_to_token, new_blocks, self.block_size)

    def _write_table(self, table_index: list[int], values: list[int]) -> None:
        """Writes table entries (flat indices) in one host-to-tensor copy and one scatter."""
        if not table_index:
            return
        index, values_t = long_tensor(table_index + values).view(2, -1).to(self.req_to_token.device).unbind(0)
        self.req_to_token.view(-1)[index] = values_t

    def add_pool(self, pool: LatentKVPool | GQAKVPool) -> LatentKVPool | GQAKVPool:
        """Registers another model's buffers (an EAGLE-3 draft) over the same slots."""
        self.pools.append(pool)
        return pool

    def copy_slots(self, pool: LatentKVPool | GQAKVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Moves the pool's entries from slots src to slots dst (an accepted tree path); entries
        already in place are skipped."""
        for buffer in pool.buffers():
            self.ops.copy_slots(buffer, src, dst)
