"""Prefix cache over full KV-cache blocks, shared by requests: a radix tree at block granularity.

Each tree node stands for one full block of ``block_size`` tokens; its key is what the block's KV
depends on beyond the path above it (the block's token ids, with image positions replaced by the
image's content hash and offset), so two requests share a node only when their whole prefix up to
and including that block is identical. Nodes hold block ids of the paged cache.

Reference counts live in the ``BlockAllocator`` only. The cache holds exactly one reference per
node; every request that matched or owns a block holds its own. A block with a count of 1 is
therefore used by no request and may be evicted, and only leaves are evicted (a child's KV is
meaningless without its parent's).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from eaglet.runtime.kv_cache import BlockAllocator
from eaglet.multimodal.inputs import MultimodalInputs

BlockKey = tuple


def image_content_hash(pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> bytes:
    """sha256 over the preprocessed pixels and grid (dtype, shape and bytes of each)."""
    h = hashlib.sha256()
    for t in (pixel_values, grid_thws):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def image_spans(mm: MultimodalInputs) -> list[tuple[int, int, bytes]]:
    """(start, end, content_hash) of each image's placeholder run in the expanded prompt."""
    patches = [int(t * h * w) for t, h, w in mm.grid_thws.tolist()]
    n_tokens = len(mm.placeholder_positions)
    # Each image gives patches // merge_size**2 placeholders; merge_size is not stored, so recover it.
    per_token = sum(patches) // n_tokens if n_tokens else 1
    if per_token * n_tokens != sum(patches):
        raise ValueError(f"{sum(patches)} patches do not divide into {n_tokens} placeholders")
    positions = mm.placeholder_positions.tolist()
    spans: list[tuple[int, int, bytes]] = []
    patch_lo = token_lo = 0
    for i, n_patches in enumerate(patches):
        n = n_patches // per_token
        run = positions[token_lo : token_lo + n]
        if run != list(range(run[0], run[0] + n)):
            raise ValueError(f"placeholders of image {i} are not contiguous")
        digest = image_content_hash(mm.pixel_values[patch_lo : patch_lo + n_patches], mm.grid_thws[i])
        spans.append((run[0], run[0] + n, digest))
        patch_lo += n_patches
        token_lo += n
    return spans


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    mm_spans: Sequence[tuple[int, int, bytes]] = (),
    *,
    lookahead: bool = False,
) -> list[BlockKey]:
    """One key per full block of token_ids; image positions become (content_hash, offset_in_image).

    With ``lookahead`` each key also carries the entry of the position right after its block, and a
    block gets a key only when that position exists. Use it when a cached block must be valid for
    an EAGLE draft too (the draft's KV at position p depends on token p+1), and to leave the last
    token of a prompt always outside the matched prefix, so the prompt's logits are recomputed
    and a request never writes into a shared block.
    """
    entries: list = list(token_ids)
    for start, end, digest in mm_spans:
        if not 0 <= start <= end <= len(entries):
            raise ValueError(f"image span [{start}, {end}) outside a prompt of {len(entries)} tokens")
        for p in range(start, end):
            entries[p] = (digest, p - start)
    n_full = (len(entries) - (1 if lookahead else 0)) // block_size
    keys: list[BlockKey] = []
    for j in range(max(n_full, 0)):
        key = tuple(entries[j * block_size : (j + 1) * block_size])
        keys.append(key + (entries[(j + 1) * block_size],) if lookahead else key)
    return keys


@dataclass(eq=False)
class _Node:
    key: BlockKey | None  # None for the root
    block: int  # -1 for the root
    parent: _Node | None
    children: dict[BlockKey, _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._clock = itertools.count(1)
        self._root = _Node(None, -1, None)
        self._by_block: dict[int, _Node] = {}
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def num_evictable_blocks(self) -> int:
        """How many blocks evict() could free now: nodes whose whole subtree no request uses."""
        # Post-order without recursion: a long prompt makes the tree thousands of blocks deep.
        free_subtree: dict[_Node, bool] = {}
        stack: list[tuple[_Node, bool]] = [(c, False) for c in self._root.children.values()]
        while stack:
            node, expanded = stack.pop()
            if not expanded:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children.values())
            else:
                free_subtree[node] = self.allocator.ref_counts[node.block] == 1 and all(
                    free_subtree[c] for c in node.children.values()
                )
        return sum(free_subtree.values())

    def match(self, keys: Sequence[BlockKey], num_tokens: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of keys; the caller now holds one reference each.

        num_tokens (default: the full blocks' tokens) is what the hit rate counts as looked up.
        """
        node, blocks, tick = self._root, [], next(self._clock)
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = tick
            blocks.append(child.block)
            node = child
        self.allocator.incref(blocks)
        self.hit_tokens += len(blocks) * self.block_size
        self.lookup_tokens += len(keys) * self.block_size if num_tokens is None else num_tokens
        return blocks

    def insert(self, keys: Sequence[BlockKey], blocks: Sequence[int]) -> None:
        """Publishes full blocks whose KV is completely written; existing nodes on the path win.

        Publishing stops at a node that caches another block for the same key (the caller computed
        its own copy): a block the caller uses must not hang below one it does not hold, which
        could then never be evicted while the caller runs. So whoever uses a node holds its
        ancestors too, and a node only the cache holds has a subtree that only the cache holds.
        """
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys for {len(blocks)} blocks")
        node, tick = self._root, next(self._clock)
        for key, block in zip(keys, blocks):
            child = node.children.get(key)
            if child is not None and child.block != block:
                child.last_used = tick
                break
            if child is None:
                if block in self._by_block:
                    raise ValueError(f"block {block} is already cached under another prefix")
                self.allocator.incref([block])
                child = _Node(key, block, node)
                node.children[key] = child
                self._by_block[block] = child
            child.last_used = tick
            node = child

    def evict(self, num_blocks: int) -> int:
        """Frees up to num_blocks blocks no request uses, least recently used leaves first."""
        heap = [(n.last_used, n.block) for n in self._by_block.values() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, block = heapq.heappop(heap)
            node = self._by_block.pop(block)
            parent = node.parent
            del parent.children[node.key]
            self.allocator.decref([block])
            freed += 1
            if parent is not self._root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, parent.block))
        return freed

    def reset(self) -> None:
        """Drops every node and the cache's reference to its block; requests keep theirs."""
        self.allocator.decref(list(self._by_block))
        self._by_block.clear()
        self._root.children.clear()

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.allocator.ref_counts[node.block] == 1
