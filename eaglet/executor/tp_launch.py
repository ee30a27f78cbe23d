"""Starting a tensor-parallel group: one process per rank, rank 0 in the engine's process.

Rank 0 starts this machine's other ranks (spawned processes), every rank joins the gloo group (the
rendezvous at ``dist_init_addr``), pins itself to its cores, and picks its communicator: shared
memory when all ranks are on this machine, gloo otherwise. Each rank then loads only its slices of
the checkpoint; the ranks compare outcomes, so a rank that cannot load stops them all with its
message. A machine other than rank 0's (``node_rank`` > 0) runs ``run_node``: its ranks only.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from eaglet.backends import select_backend
from eaglet.backends.base import Backend
from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
from eaglet.distributed.communicator import Communicator, GlooCommunicator
from eaglet.distributed.cpu_binding import (
    CpuBinding,
    apply_binding,
    memory_policy,
    pin_threads,
    plan_bindings,
    set_memory_policy,
)
from eaglet.distributed.parallel_config import ParallelConfig
from eaglet.distributed.shm_communicator import ShmCommunicator, create_segment
from eaglet.distributed.tensor_parallel import TensorParallel
from eaglet.errors import ConfigError, DistributedError
from eaglet.executor.tp_followers import Followers, follow
from eaglet.kernels import tile_backend
from eaglet.models.registry import load_model
from eaglet.runtime.kv_cache import KVCacheManager

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 * 2**20  # per rank and parity; larger tensors are reduced in pieces
MESSAGE_BYTES = 8 * 2**20
LOAD_TIMEOUT = timedelta(hours=2)  # ranks wait this long for each other to finish loading
IDLE_TIMEOUT = timedelta(days=365)  # a rank > 0 waits for rank 0's next forward this long


@dataclass(frozen=True)
class RankLoad:
    """What every rank loads, the same on all."""

    model: str
    dtype: str  # as rank 0 resolved it
    cpu_kernels: bool
    quantize: LoadTimeQuantization | None
    int8_activations: bool = False


@dataclass(frozen=True)
class RankSpec:
    parallel: ParallelConfig
    rank: int
    init_method: str
    shm_path: str | None
    binding: CpuBinding | None
    load: RankLoad


@dataclass
class Joined:
    tp: TensorParallel
    load_group: dist.ProcessGroup


def join_group(spec: RankSpec) -> Joined:
    parallel = spec.parallel
    if spec.binding is not None:
        apply_binding(spec.binding)
    timeout = timedelta(seconds=parallel.dist_timeout_s)
    dist.init_process_group("gloo", init_method=spec.init_method, rank=spec.rank, world_size=parallel.tp_size, timeout=timeout)
    load_group = dist.new_group(backend="gloo", timeout=LOAD_TIMEOUT)
    pids: list[int | None] = [None] * parallel.tp_size
    dist.all_gather_object(pids, os.getpid())
    comm: Communicator
    if spec.shm_path is not None:
        comm = ShmCommunicator(
            spec.shm_path, spec.rank, parallel.tp_size, [int(p) for p in pids], parallel.dist_timeout_s, SLOT_BYTES, MESSAGE_BYTES
        )
    else:
        comm = GlooCommunicator(spec.rank, parallel.tp_size, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
    dist.barrier()  # every rank mapped the segment: rank 0 may unlink its file
    return Joined(TensorParallel(spec.rank, parallel.tp_size, parallel.ep_size > 1, comm), load_group)


def agree_loaded(joined: Joined, error: str | None, kernels: str) -> None:
    """Every rank's load outcome; raises ConfigError with the first failed rank's message, or where
    ranks would run different kernels or dtypes (each rank routes every token itself: the same
    kernels give the same experts on every rank)."""
    outcomes: list[tuple[str | None, str] | None] = [None] * joined.tp.size
    dist.all_gather_object(outcomes, (error, kernels), group=joined.load_group)
    for rank, (outcome, _) in enumerate(outcomes):
        if outcome is not None:
            raise ConfigError(f"tensor-parallel rank {rank} could not load the model: {outcome}")
    for rank, (_, theirs) in enumerate(outcomes):
        if theirs != kernels:
            raise ConfigError(
                f"tensor-parallel rank {rank} runs {theirs}, rank {joined.tp.rank} runs {kernels}: give every "
                "machine the same CPU kind and an explicit --dtype"
            )


def kernels_signature(backend: Backend, dtype: str) -> str:
    tiles = tile_backend() if backend.kernels else None
    return f"the {backend.name} backend, {tiles or 'no'} tile GEMM, {dtype}"


def rank_main(spec: RankSpec) -> None:
    """Entry point of a spawned rank > 0."""
    # Ctrl-C in the terminal reaches every process of its group; rank 0 stops the others itself
    # (and they stop when it is gone), so a rank does not die of it first and look like a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"[%(asctime)s tp{spec.rank} %(levelname)s %(name)s] %(message)s")
    joined = join_group(spec)
    backend = select_backend(spec.load.cpu_kernels, spec.load.int8_activations)
    try:
        model, _ = load_model(
            spec.load.model, spec.load.dtype, backend=backend, show_progress=False, quantize=spec.load.quantize, tp=joined.tp
        )
        error = None
    except Exception as exc:  # reported to rank 0, which raises it
        error = f"{type(exc).__name__}: {exc}"
    try:
        agree_loaded(joined, error, kernels_signature(backend, spec.load.dtype))
    except ConfigError:
        sys.exit(1)

    def make_cache(geometry: dict) -> tuple[KVCacheManager, MLAAttentionBackend]:
        cache = KVCacheManager(**geometry, ops=backend.cache)
        return cache, backend.mla_attention(cache, None)

    try:
        follow(joined.tp.comm, model, make_cache)
    except DistributedError as exc:
        logger.error("tensor-parallel rank %d stops: %s", spec.rank, exc)
        sys.exit(1)
    finally:
        joined.tp.comm.close()
    dist.destroy_process_group()


class RankGroup:
    """Rank 0's tensor-parallel group: its ``tp`` for the model, ``followers`` for the runner."""

    def __init__(self, parallel: ParallelConfig, load: RankLoad) -> None:
        if parallel.node_rank != 0:
            raise ConfigError("only node 0 runs the engine; other nodes run their ranks with run_node")
        require_x86()
        self.load = load
        self.saved_affinity = os.sched_getaffinity(0)
        self.saved_threads = torch.get_num_threads()
        self.saved_memory_policy = memory_policy()
        bindings = plan_bindings(parallel.ranks_per_node, parallel.cpu_omp_threads_bind)
        init_method = parallel.init_method()
        shm_path = None
        if parallel.nnodes == 1:
            shm_path = str(Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()) / f"eaglet-tp-{uuid.uuid4().hex}")
            create_segment(shm_path, parallel.tp_size, SLOT_BYTES, MESSAGE_BYTES)
        self.processes: list[BaseProcess] = []
        try:
            self.processes = start_ranks(parallel, init_method, shm_path, bindings, load, skip_first=True)
            self.joined = join_group(RankSpec(parallel, 0, init_method, shm_path, bindings[0], load))
        except Exception as exc:
            exited = [p for p in self.processes if not p.is_alive()]
            for process in self.processes:
                process.terminate()
                process.join(10)
            self._leave()
            if exited:
                raise DistributedError(
                    f"rank process {exited[0].name} exited (code {exited[0].exitcode}) before joining the group; a "
                    "script that starts tensor parallelism must run it under `if __name__ == '__main__':`"
                ) from exc
            raise
        finally:
            if shm_path is not None:
                Path(shm_path).unlink(missing_ok=True)
        self.tp = self.joined.tp
        self.followers = Followers(self.tp.comm, self.processes)

    def agree_loaded(self, error: str | None, backend: Backend) -> None:
        agree_loaded(self.joined, error, kernels_signature(backend, self.load.dtype))

    def close(self) -> None:
        self.followers.stop()
        self._leave()

    def _leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # The engine's process goes back to what it had (a test run or an embedding application).
        pin_threads(self.saved_affinity)
        torch.set_num_threads(self.saved_threads)
        set_memory_policy(*self.saved_memory_policy)


def start_ranks(
    parallel: ParallelConfig, init_method: str, shm_path: str | None, bindings: list[CpuBinding], load: RankLoad,
    skip_first: bool,
) -> list[BaseProcess]:
    """Spawns this machine's ranks (all but the first with ``skip_first``: rank 0 is the caller)."""
    context = get_context("spawn")
    processes = []
    for local, rank in enumerate(parallel.local_ranks):
        if skip_first and local == 0:
            continue
        spec = RankSpec(parallel, rank, init_method, shm_path, bindings[local], load)
        process = context.Process(target=rank_main, args=(spec,), name=f"eaglet-tp{rank}", daemon=True)
        process.start()
        processes.append(process)
    return processes


def require_x86() -> None:
    """The shared-memory collectives rely on x86's store order and the memory policy on its system
    call numbers."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ConfigError(f"tensor parallelism runs on x86-64 CPUs; this one is {platform.machine()}")


def run_node(parallel: ParallelConfig, load: RankLoad) -> int:
    """A machine other than rank 0's: runs its ranks until they exit; the worst exit code."""
    if parallel.node_rank == 0:
        raise ConfigError("node 0 runs the engine (eaglet serve without --node-rank, or --node-rank 0)")
    require_x86()
    bindings = plan_bindings(parallel.ranks_per_node, parallel.cpu_omp_threads_bind)
    processes = start_ranks(parallel, parallel.init_method(), None, bindings, load, skip_first=False)
    for process in processes:
        process.join()
    return max((abs(p.exitcode or 0) for p in processes), default=0)
