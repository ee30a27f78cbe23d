"""The lm_head split by vocabulary rows across tensor-parallel ranks.

Each rank multiplies its ``ceil(vocab / size)`` rows; ``logits`` gathers every rank's columns so
the sampler sees the whole vocabulary, and ``argmax`` exchanges only each rank's best (value, id)
per row, the token ``logits(x).argmax(-1)`` gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglet.backends.base import WeightMethods
from eaglet.distributed.tensor_parallel import TensorParallel, TensorShard
from eaglet.errors import ConfigError
from eaglet.layers.linear import Linear


class VocabParallelLinear(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, weights: WeightMethods, tp: TensorParallel | None = None) -> None:
        tp = tp or TensorParallel()
        per_rank = -(-vocab_size // tp.size)
        start = min(tp.rank * per_rank, vocab_size)
        length = min(per_rank, vocab_size - start)
        if length <= 0:
            raise ConfigError(f"tensor parallelism: a vocabulary of {vocab_size} leaves rank {tp.rank} of {tp.size} no rows")
        super().__init__(hidden_size, length, False, weights)
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = per_rank
        self.vocab_start = start
        self.tensor_shard = TensorShard(0, start, length) if tp.enabled else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        local = super().logits(x)
        if not self.tp.enabled:
            return local
        padded = F.pad(local, (0, self.per_rank - local.shape[-1]))
        return self.tp.all_gather(padded)[:, : self.vocab_size]

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.tp.enabled:
            return super().argmax(x)
        best, index = super().logits(x).max(dim=-1)
        # Ids up to 2**24 are exact in float32; the first rank holding the maximum has the lowest id.
        mine = torch.stack([best, (index + self.vocab_start).float()], dim=-1)  # [K, 2]
        every = self.tp.all_gather(mine).view(x.shape[0], self.tp.size, 2)
        rank = every[:, :, 0].argmax(dim=-1, keepdim=True)
        return every[:, :, 1].gather(1, rank).squeeze(1).long()
