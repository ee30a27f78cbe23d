"""A process's place in its tensor-parallel group and the collectives its layers call.

Every layer is built for one rank: it holds its share of the matrices (``TensorShard`` says which
slice of the checkpoint tensor) and sums or gathers the partial results through ``all_reduce`` /
``all_gather``. A single-process engine uses ``TensorParallel()`` (size 1), whose collectives do nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from eaglet.errors import ConfigError

if TYPE_CHECKING:
    from eaglet.distributed.communicator import Communicator


@dataclass(frozen=True)
class TensorShard:
    """The slice ``[start, start + length)`` along ``dim`` of a checkpoint tensor that this rank holds."""

    dim: int
    start: int
    length: int

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slicing tuple that selects this shard of an ``ndim``-dimensional tensor."""
        dims = [slice(None)] * ndim
        dims[self.dim] = slice(self.start, self.start + self.length)
        return tuple(dims)

    def sharded_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = self.length
        return tuple(out)


@dataclass
class CollectiveTime:
    """Wall time spent inside collectives since the last reset (``eaglet bench`` reports its share)."""

    seconds: float = 0.0
    calls: int = 0


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    # Routed experts divided among the ranks (each holds whole experts) instead of each expert's
    # intermediate dimension split across them.
    expert_parallel: bool = False
    comm: Communicator | None = None
    time: CollectiveTime = field(default_factory=CollectiveTime)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def part(self, total: int, what: str, multiple_of: int = 1) -> int:
        """This rank's equal share of ``total``; ``total`` must divide into ``size`` parts of a
        multiple of ``multiple_of`` each."""
        part, rest = divmod(total, self.size)
        if rest or part % multiple_of:
            unit = f" of a multiple of {multiple_of}" if multiple_of > 1 else ""
            raise ConfigError(f"tensor parallelism: {what} ({total}) does not split into {self.size} equal parts{unit}")
        return part

    def rows(self, total: int, what: str, multiple_of: int = 1) -> TensorShard | None:
        """This rank's share of a matrix's ``total`` rows (None: the whole matrix, size 1)."""
        part = self.part(total, what, multiple_of)
        return TensorShard(0, self.rank * part, part) if self.enabled else None

    def cols(self, total: int, what: str, multiple_of: int = 1) -> TensorShard | None:
        """This rank's share of a matrix's ``total`` columns (None: the whole matrix, size 1)."""
        part = self.part(total, what, multiple_of)
        return TensorShard(1, self.rank * part, part) if self.enabled else None

    def collective_time(self) -> CollectiveTime:
        """Time inside collectives, those the C++ decoder stack runs included."""
        native = getattr(self.comm, "native_time", None)
        if native is None:
            return CollectiveTime(self.time.seconds, self.time.calls)
        return CollectiveTime(self.time.seconds + float(native[0]), self.time.calls + int(native[1]))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (same bits on every rank), in place where possible."""
        return x if self.comm is None else self._timed(self.comm.all_reduce, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        return x if self.comm is None else self._timed(self.comm.all_gather, x)

    def _timed(self, collective: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = collective(x)
        self.time.seconds += time.perf_counter() - start
        self.time.calls += 1
        return out
