"""How the ranks of a tensor-parallel group talk: collectives for the layers, and one-way messages
from rank 0 (which schedules) to the others (which follow its forwards).

``ShmCommunicator`` serves ranks on one machine through a shared-memory segment; ``GlooCommunicator``
serves any group, across machines too, over torch.distributed's gloo (TCP).
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

from eaglet.errors import DistributedError


class Communicator(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in rank order (the same bits on every rank); ``x`` is overwritten."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[K, N] on each rank -> [K, size * N], rank order along the last dimension."""
        ...

    def send(self, message: Any) -> None:
        """Rank 0: hands ``message`` to every other rank."""
        ...

    def recv(self) -> Any:
        """Ranks > 0: the next message of rank 0 (waits as long as rank 0 lives)."""
        ...

    def close(self) -> None: ...


class GlooCommunicator:
    """torch.distributed's gloo group: works between machines; on one machine the shared-memory
    communicator is faster."""

    def __init__(self, rank: int, size: int, message_group: dist.ProcessGroup) -> None:
        # Collectives run on the default group (its timeout declares a rank hung); messages on
        # ``message_group``, whose timeout is as long as a rank may wait idle for rank 0's next forward.
        self.rank, self.size = rank, size
        self.message_group = message_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:
            raise DistributedError(f"tensor-parallel all-reduce failed: {exc}") from exc
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x.contiguous())
        except RuntimeError as exc:
            raise DistributedError(f"tensor-parallel all-gather failed: {exc}") from exc
        return torch.cat(parts, dim=-1)

    def send(self, message: Any) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        try:
            dist.broadcast(torch.tensor([data.numel()], dtype=torch.long), src=0, group=self.message_group)
            dist.broadcast(data, src=0, group=self.message_group)
        except RuntimeError as exc:
            raise DistributedError(f"tensor-parallel broadcast failed: {exc}") from exc

    def recv(self) -> Any:
        try:
            length = torch.zeros(1, dtype=torch.long)
            dist.broadcast(length, src=0, group=self.message_group)
            data = torch.empty(int(length), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.message_group)
        except RuntimeError as exc:
            raise DistributedError(f"rank 0 is gone: {exc}") from exc
        return pickle.loads(data.numpy().tobytes())

    def close(self) -> None:
        pass
