"""Which cores (and NUMA node's memory) each tensor-parallel rank of this machine uses.

As SGLang's ``SGLANG_CPU_OMP_THREADS_BIND``: ``"0-31|32-63"`` gives rank 0 cores 0-31 and rank 1
cores 32-63 (``--cpu-omp-threads-bind`` or ``EAGLET_CPU_OMP_THREADS_BIND``). Without it, when the
machine's ranks divide evenly among its NUMA nodes each node's cores go to its share of the ranks,
else the cores this process may use are divided among them; either way every rank gets the same
number of cores (a remainder is left idle), so every rank runs its kernels with the same thread
split and routes each token to the same experts. A rank whose cores lie in one NUMA node allocates
its memory there (``set_mempolicy(MPOL_BIND)``), so its weights and cache sit next to its cores.

Affinity and memory policy belong to a thread: binding pins every thread of the process (torch's
worker threads may already exist).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.errors import ConfigError

BIND_ENV = "EAGLET_CPU_OMP_THREADS_BIND"
NODES_DIR = Path("/sys/devices/system/node")
MPOL_BIND = 2
SYS_SET_MEMPOLICY = 238  # x86-64
SYS_GET_MEMPOLICY = 239


@dataclass(frozen=True)
class CpuBinding:
    cores: tuple[int, ...]
    numa_node: int | None  # the node holding every one of the cores, if one does


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11]."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ConfigError(f"cpu list {text!r}: {part!r} is not a core number or range") from None
        if last < first:
            raise ConfigError(f"cpu list {text!r}: range {part!r} runs backwards")
        cores.extend(range(first, last + 1))
    return cores


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its cores (empty where the machine does not say)."""
    nodes: dict[int, list[int]] = {}
    for node_dir in sorted(NODES_DIR.glob("node[0-9]*")):
        cpulist = node_dir / "cpulist"
        if cpulist.is_file():
            nodes[int(node_dir.name[4:])] = parse_cpu_list(cpulist.read_text())
    return nodes


def node_of(cores: list[int], nodes: dict[int, list[int]]) -> int | None:
    for node, node_cores in nodes.items():
        if set(cores) <= set(node_cores):
            return node
    return None


def plan_bindings(local_ranks: int, bind: str | None = None) -> list[CpuBinding]:
    """The cores of each of this machine's ``local_ranks`` ranks."""
    nodes = numa_nodes()
    bind = bind if bind is not None else os.environ.get(BIND_ENV)
    allowed = sorted(os.sched_getaffinity(0))
    if bind:
        groups = [parse_cpu_list(part) for part in bind.split("|")]
        if len(groups) != local_ranks:
            raise ConfigError(
                f"cpu-omp-threads-bind {bind!r} names {len(groups)} core lists for {local_ranks} ranks on this machine"
            )
        for group in groups:
            if not group:
                raise ConfigError(f"cpu-omp-threads-bind {bind!r}: an empty core list")
            outside = sorted(set(group) - set(allowed))
            if outside:
                raise ConfigError(f"cpu-omp-threads-bind {bind!r}: cores {outside} are not available to this process")
    else:
        usable = {n: [c for c in cores if c in allowed] for n, cores in nodes.items()}
        usable = {n: cores for n, cores in usable.items() if cores}
        per_node = local_ranks // len(usable) if usable else 0
        if len(usable) > 1 and local_ranks % len(usable) == 0 and min(map(len, usable.values())) >= per_node:
            size = min(len(cores) for cores in usable.values()) // per_node
            groups = [cores[i * size : (i + 1) * size] for cores in usable.values() for i in range(per_node)]
        else:
            if local_ranks > len(allowed):
                raise ConfigError(f"{local_ranks} ranks on this machine but only {len(allowed)} cores to divide among them")
            groups = _divide(allowed, local_ranks)
    return [CpuBinding(tuple(g), node_of(g, nodes)) for g in groups]


def _divide(cores: list[int], parts: int) -> list[list[int]]:
    size = len(cores) // parts
    return [cores[i * size : (i + 1) * size] for i in range(parts)]


def pin_threads(cores: set[int] | tuple[int, ...]) -> None:
    """Every thread of this process on ``cores``."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def apply_binding(binding: CpuBinding) -> None:
    """Pins this process to the binding's cores, one torch thread per core, memory on its node."""
    pin_threads(binding.cores)
    torch.set_num_threads(len(binding.cores))
    if binding.numa_node is not None:
        set_memory_policy(MPOL_BIND, 1 << binding.numa_node)


def set_memory_policy(mode: int, node_mask: int) -> None:
    """The calling thread's NUMA memory policy (mode 0, mask 0: the default, first touch)."""
    mask = ctypes.c_ulong(node_mask)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_SET_MEMPOLICY, mode, ctypes.byref(mask) if node_mask else None, ctypes.c_ulong(64)) != 0:
        raise OSError(ctypes.get_errno(), f"set_mempolicy({mode}, {node_mask:#x}) failed")


def memory_policy() -> tuple[int, int]:
    """This process's (mode, node mask) as the kernel reports it (0, 0: the default policy)."""
    mode, mask = ctypes.c_int(0), ctypes.c_ulong(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_GET_MEMPOLICY, ctypes.byref(mode), ctypes.byref(mask), ctypes.c_ulong(64), None, ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "get_mempolicy failed")
    return mode.value, mask.value
