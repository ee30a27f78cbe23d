"""Rank 0 drives the other tensor-parallel ranks: every forward of the target model and every move of
its cache entries is sent to them first, then run on rank 0 too, so all ranks run the same
collectives in the same order.

Only rank 0 schedules, samples, drafts and keeps the prefix cache; the others hold their share of
the target's layers and their own copy of the latent cache, written at the slots rank 0 chose (the
batch carries them and the rows of the request-to-slot table it reads).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import torch
from torch import nn

from eaglet.distributed.communicator import Communicator
from eaglet.errors import DistributedError
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.runtime.kv_cache import KVCacheManager

logger = logging.getLogger(__name__)

# Captured layers are rank 0's (the draft's inputs); the memo is rebuilt where the batch is read.
_LOCAL_FIELDS = ("_memo", "capture_layers")
BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(ForwardBatch) if f.name not in _LOCAL_FIELDS)


@dataclasses.dataclass(frozen=True)
class PackedTensor:
    """A tensor as raw bytes: pickled as a numpy byte array, about 20x faster than a torch tensor
    (whose pickling goes through its storage's reduction)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: np.ndarray

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PackedTensor:
        flat = tensor.detach().contiguous().reshape(-1)
        return cls(tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy())

    def unpack(self) -> torch.Tensor:
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)


def batch_message(batch: ForwardBatch, cache: KVCacheManager, known_table: torch.Tensor) -> dict[str, Any]:
    """What another rank needs to run ``batch``: its fields, and the entries of the request-to-slot
    table its requests read that differ from ``known_table`` (the other ranks' copy, updated here):
    a decode step sends its new slots, not every row's whole history."""
    message: dict[str, Any] = {}
    for name in BATCH_FIELDS:
        value = getattr(batch, name)
        message[name] = PackedTensor.of(value) if isinstance(value, torch.Tensor) else value
    max_len = max(batch.seq_lens_cpu, default=0)
    rows = batch.req_pool_indices
    current = cache.req_to_token[rows, :max_len]
    changed_row, col = (current != known_table[rows, :max_len]).nonzero(as_tuple=True)
    row = rows[changed_row]
    values = current[changed_row, col]
    known_table[row, col] = values
    message["table_updates"] = PackedTensor.of(torch.stack([row, col, values]))
    return message


def followed_batch(message: dict[str, Any], cache: KVCacheManager) -> ForwardBatch:
    """The batch of ``batch_message``, its table updates written into this rank's table."""
    fields = {k: v.unpack() if isinstance(v, PackedTensor) else v for k, v in message.items()}
    row, col, values = fields.pop("table_updates")
    cache.req_to_token[row, col] = values
    return ForwardBatch(**fields)


class Followers:
    """Rank 0's handle on the other ranks: ``forward`` / ``copy_slots`` before doing the same locally."""

    def __init__(self, comm: Communicator, processes: list[BaseProcess]) -> None:
        self.comm = comm
        self.processes = processes  # the other ranks this machine started
        self.failed: DistributedError | None = None
        self.known_table: torch.Tensor | None = None  # the other ranks' request-to-slot table

    def _send(self, message: tuple) -> None:
        self.check()
        try:
            self.comm.send(message)
        except DistributedError as exc:
            self.failed = exc
            raise
        except BaseException as exc:  # Ctrl-C between a message's pieces: the ranks would join two messages
            self.failed = DistributedError(f"a message to the other ranks stopped midway ({type(exc).__name__})")
            raise

    def forward(self, batch: ForwardBatch, cache: KVCacheManager) -> None:
        self._send(("forward", batch_message(batch, cache, self.known_table)))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send(("copy_slots", PackedTensor.of(src), PackedTensor.of(dst)))

    def setup_cache(self, geometry: dict[str, Any]) -> None:
        """The other ranks make their cache of ``geometry`` (their table starts zeroed, as rank 0's)."""
        self.known_table = torch.zeros(geometry["max_requests"], geometry["max_context_len"], dtype=torch.long)
        self._send(("cache", geometry))

    def check(self) -> None:
        """Raises DistributedError once a rank failed or one of this machine's other ranks exited."""
        if self.failed is not None:
            raise self.failed
        for process in self.processes:
            if not process.is_alive():
                self.failed = DistributedError(
                    f"tensor-parallel rank process {process.name} (pid {process.pid}) exited with code {process.exitcode}"
                )
                raise self.failed

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.failed is None:
            try:
                self.comm.send(("stop",))
            except DistributedError:
                pass
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()
                process.join(timeout_s)
        self.comm.close()


def follow(
    comm: Communicator, model: nn.Module, make_cache: Callable[[dict[str, Any]], tuple[KVCacheManager, Any]]
) -> None:
    """A rank > 0's loop: runs rank 0's forwards on its share of the model until told to stop.
    ``make_cache(geometry)`` -> (cache, attention backend), called on rank 0's first message."""
    cache: KVCacheManager | None = None
    attention = None
    with torch.inference_mode():
        while True:
            message = comm.recv()
            kind = message[0]
            if kind == "forward":
                model(followed_batch(message[1], cache), attention)
            elif kind == "copy_slots":
                cache.copy_slots(cache.target, message[1].unpack(), message[2].unpack())
            elif kind == "cache":
                cache, attention = make_cache(message[1])
            elif kind == "stop":
                return
            else:
                raise DistributedError(f"unknown message from rank 0: {kind!r}")
