"""Collectives between the ranks of one machine through a shared-memory segment.

Each rank owns a slot per parity (two, so a rank may write collective n+1 while a slower one still
reads n) and a sequence flag on its own cache line. A collective copies the rank's tensor into its
slot, publishes the sequence number, waits for every rank's, then reads all slots; every rank sums
in rank order, so all hold the same bits. Tensors larger than a slot go in pieces. x86's store
order makes a flag visible only after the data written before it.

Rank 0's messages to the other ranks use their own area and flags: rank 0 writes a piece once every
rank acknowledged the previous one.

A wait that outlasts ``timeout_s`` (a rank hung) or finds a rank's process gone raises
``DistributedError``. Waiting for a message has no timeout, only the check that rank 0 lives.
"""

from __future__ import annotations

import mmap
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglet.errors import DistributedError

LINE = 8  # int64 flags per 64-byte cache line
HEADER_BYTES = 4096
LIVENESS_CHECK_S = 0.05
IDLE_SPIN_S = 0.002  # a message wait spins this long, then sleeps between looks
ALL_REDUCE, ALL_GATHER = 1, 2  # collective kinds, published beside the sequence number


def segment_bytes(size: int, slot_bytes: int, message_bytes: int) -> int:
    return HEADER_BYTES + message_bytes + 2 * size * slot_bytes


def create_segment(path: str, size: int, slot_bytes: int, message_bytes: int) -> None:
    """Rank 0, before the others start: a zero-filled segment file (its pages are allocated on use)."""
    with open(path, "wb") as f:
        f.truncate(segment_bytes(size, slot_bytes, message_bytes))


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class ShmCommunicator:
    def __init__(
        self, path: str, rank: int, size: int, pids: list[int], timeout_s: float, slot_bytes: int, message_bytes: int
    ) -> None:
        if 3 * size * LINE * 8 > HEADER_BYTES:
            raise ValueError(f"shared-memory collectives take at most {HEADER_BYTES // (3 * LINE * 8)} ranks")
        self.rank, self.size, self.pids, self.timeout_s = rank, size, pids, timeout_s
        self.slot_bytes, self.message_bytes = slot_bytes, message_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, segment_bytes(size, slot_bytes, message_bytes))
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self.mm, dtype=np.int64, count=HEADER_BYTES // 8)
        # Collectives done, shared with the C++ decoder stack's all-reduces (shm_all_reduce.cpp), which
        # also add their time and count to native_time.
        self.seq = torch.zeros(1, dtype=torch.long)
        self._seq = self.seq.numpy()
        self.native_time = torch.zeros(2, dtype=torch.float64)
        self.message_seq = 0  # message pieces sent / received
        self._views: dict[tuple[int, int, torch.dtype, int], torch.Tensor] = {}

    @property
    def address(self) -> int:
        """The segment's first byte in this process."""
        return self.flags.ctypes.data

    # ---- flags: reduce[r] at line r (sequence, then kind and bytes per parity), ack[r] at line
    # size + r, the message header at line 2 * size
    def _reduce_flag(self, rank: int) -> int:
        return rank * LINE

    def _ack_flag(self, rank: int) -> int:
        return (self.size + rank) * LINE

    @property
    def _message_flag(self) -> int:
        return 2 * self.size * LINE  # [seq, length, more]

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (parity, rank, dtype, numel)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 512:
                self._views.clear()
            offset = HEADER_BYTES + self.message_bytes + (parity * self.size + rank) * self.slot_bytes
            view = torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=offset)
            self._views[key] = view
        return view

    def _wait(self, flag_of: list[tuple[int, int]], target: int, what: str, timeout: bool = True) -> None:
        """Until flags[index] >= target for every (rank, index); checks the ranks' processes meanwhile.
        Without ``timeout`` (an idle rank waiting for work) it sleeps between looks once the wait
        outlasts ``IDLE_SPIN_S``."""
        flags = self.flags
        start = last_check = time.monotonic()
        spins = 0
        for rank, index in flag_of:
            while flags[index] < target:
                spins += 1
                if spins & 255:
                    continue
                now = time.monotonic()
                if not timeout and now - start > IDLE_SPIN_S:
                    time.sleep(0.0002)
                    spins = 255  # look at the clock again on the next pass
                if now - last_check > LIVENESS_CHECK_S:
                    last_check = now
                    if not process_alive(self.pids[rank]):
                        raise DistributedError(f"tensor-parallel rank {rank} (pid {self.pids[rank]}) exited during {what}")
                    if timeout and now - start > self.timeout_s:
                        raise DistributedError(
                            f"tensor-parallel rank {rank} did not reach {what} within {self.timeout_s:g} s"
                        )

    def _others(self, index_of: Callable[[int], int]) -> list[tuple[int, int]]:
        return [(r, index_of(r)) for r in range(self.size) if r != self.rank]

    # ---- collectives -------------------------------------------------------------------------
    def _exchange(self, chunk: torch.Tensor, kind: int) -> list[torch.Tensor]:
        """Publishes ``chunk`` and returns every rank's (views of the shared slots, valid until the
        collective after next). Beside its sequence number a rank publishes the collective's kind
        and size: ranks that disagree are out of step, and say so instead of mixing data."""
        self._seq[0] += 1
        seq = int(self._seq[0])
        parity = seq & 1
        nbytes = chunk.numel() * chunk.element_size()
        slots = [self._slot(parity, r, chunk.dtype, chunk.numel()) for r in range(self.size)]
        slots[self.rank].copy_(chunk.reshape(-1))
        # Per parity, like the slots: a rank may publish collective n+1 while this one checks n.
        described = self._reduce_flag(self.rank) + 1 + 2 * parity
        self.flags[described], self.flags[described + 1] = kind, nbytes
        self.flags[self._reduce_flag(self.rank)] = seq
        self._wait(self._others(self._reduce_flag), seq, "a collective")
        for rank in range(self.size):
            theirs = self._reduce_flag(rank) + 1 + 2 * parity
            if (self.flags[theirs], self.flags[theirs + 1]) != (kind, nbytes):
                raise DistributedError(
                    f"tensor-parallel ranks out of step: rank {rank} ran collective kind {self.flags[theirs]} of "
                    f"{self.flags[theirs + 1]} bytes where rank {self.rank} ran kind {kind} of {nbytes}"
                )
        return slots

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        per_piece = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), per_piece):
            piece = flat[start : start + per_piece]
            slots = self._exchange(piece, ALL_REDUCE)
            piece.copy_(slots[0])
            for other in slots[1:]:
                piece.add_(other)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty(rows, self.size * cols, dtype=x.dtype)
        per_piece = self.slot_bytes // max(1, cols * x.element_size())
        if per_piece == 0:
            raise ValueError(f"an all-gather row of {cols * x.element_size()} bytes exceeds the {self.slot_bytes}-byte slot")
        for start in range(0, rows, per_piece):
            piece = x[start : start + per_piece]
            slots = self._exchange(piece, ALL_GATHER)
            n = piece.shape[0]
            for r, slot in enumerate(slots):
                out[start : start + n, r * cols : (r + 1) * cols] = slot.view(n, cols)
        return out

    # ---- rank 0's messages ------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        area = HEADER_BYTES
        header = self._message_flag
        for start in range(0, max(len(data), 1), self.message_bytes):
            piece = data[start : start + self.message_bytes]
            self._wait(self._others(self._ack_flag), self.message_seq, "a message")
            self.mm[area : area + len(piece)] = piece
            self.flags[header + 1] = len(piece)
            self.flags[header + 2] = int(start + self.message_bytes < len(data))
            self.message_seq += 1
            self.flags[header] = self.message_seq

    def recv(self) -> Any:
        pieces: list[bytes] = []
        area = HEADER_BYTES
        header = self._message_flag
        while True:
            self._wait([(0, header)], self.message_seq + 1, "the next message", timeout=False)
            length, more = int(self.flags[header + 1]), int(self.flags[header + 2])
            pieces.append(self.mm[area : area + length])
            self.message_seq += 1
            self.flags[self._ack_flag(self.rank)] = self.message_seq
            if not more:
                return pickle.loads(b"".join(pieces))

    def close(self) -> None:
        self._views.clear()
        self.flags = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # a tensor still views the segment; it is unmapped with the process
