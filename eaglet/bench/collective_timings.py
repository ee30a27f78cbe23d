"""All-reduce latency between two ranks of this machine: eaglet's shared-memory communicator
against gloo (TCP), at the sizes a decode step all-reduces (one hidden-state row per token).

``python -m eaglet.bench.collective_timings --hidden 7168 --tokens 1,16``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from datetime import timedelta
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.distributed as dist

from eaglet.distributed.communicator import GlooCommunicator
from eaglet.distributed.parallel_config import free_port
from eaglet.distributed.shm_communicator import ShmCommunicator, create_segment
from eaglet.executor.tp_launch import SLOT_BYTES

MESSAGE_BYTES = 2**20  # no messages here


def _rank(rank: int, size: int, init: str, shm_path: str, shapes: list[tuple[int, int]], iters: int, queue) -> None:
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=60))
    pids: list = [None] * size
    dist.all_gather_object(pids, os.getpid())
    comms = {
        "shm": ShmCommunicator(shm_path, rank, size, pids, 60.0, SLOT_BYTES, MESSAGE_BYTES),
        "gloo": GlooCommunicator(rank, size, dist.new_group(backend="gloo")),
    }
    results = {}
    for name, comm in comms.items():
        for shape in shapes:
            x = torch.randn(*shape).to(torch.bfloat16)
            for _ in range(10):
                comm.all_reduce(x)
            samples = []
            for _ in range(iters):
                start = time.perf_counter()
                comm.all_reduce(x)
                samples.append(time.perf_counter() - start)
            results[(name, shape)] = 1e6 * statistics.median(samples)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def measure(hidden: int, tokens: list[int], iters: int = 300) -> dict[tuple[str, tuple[int, int]], float]:
    """Median microseconds per bfloat16 all-reduce of [tokens, hidden], per communicator."""
    context = get_context("spawn")
    shm_path = str(Path(tempfile.gettempdir() if not Path("/dev/shm").is_dir() else "/dev/shm") / f"eaglet-bench-{uuid.uuid4().hex}")
    create_segment(shm_path, 2, SLOT_BYTES, MESSAGE_BYTES)
    queue = context.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    shapes = [(t, hidden) for t in tokens]
    procs = []
    try:
        procs = [context.Process(target=_rank, args=(r, 2, init, shm_path, shapes, iters, queue), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        results = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
        Path(shm_path).unlink(missing_ok=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    results = measure(args.hidden, [int(t) for t in args.tokens.split(",")], args.iters)
    print(f"{'communicator':<14}{'shape':>14}{'median us':>12}")
    for (name, shape), us in results.items():
        print(f"{name:<14}{str(list(shape)):>14}{us:>12.1f}")


if __name__ == "__main__":
    main()
