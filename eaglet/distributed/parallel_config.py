"""The tensor-parallel layout an engine runs with, named as SGLang names its flags."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from eaglet.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    # 1: each routed expert split across the ranks like the dense MLP; tp_size: whole experts divided
    # among the ranks.
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of rank 0's rendezvous (default: a free local port)
    cpu_omp_threads_bind: str | None = None  # "0-31|32-63": this machine's ranks' cores
    dist_timeout_s: float = 60.0  # a rank that does not reach a collective within this is declared hung

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be at least 1, got {self.tp_size}")
        if self.ep_size not in (1, self.tp_size):
            raise ConfigError(f"ep_size must be 1 or tp_size ({self.tp_size}), got {self.ep_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ConfigError(f"tp_size {self.tp_size} does not divide among nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("several nodes need --dist-init-addr host:port (node 0's address)")
        if self.dist_timeout_s <= 0:
            raise ConfigError(f"dist_timeout_s must be positive, got {self.dist_timeout_s}")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    def init_method(self) -> str:
        if self.dist_init_addr:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
            return f"tcp://{self.dist_init_addr}"
        return f"tcp://127.0.0.1:{free_port()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
