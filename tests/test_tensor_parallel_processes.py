"""Tensor parallelism as processes: cores and memory policy per rank, ranks on separate "nodes"
over TCP, and what a server does when a rank dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from runtime_utils import wait_until_healthy

from eaglet import LLM
from eaglet.distributed.cpu_binding import parse_cpu_list, plan_bindings
from eaglet.errors import ConfigError, DistributedError
from eaglet.sampling_params import SamplingParams
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint

PROMPTS = [[3, 17, 33, 2, 99, 100, 7, 45], list(range(10, 40)), [200, 5]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_processes(pid: int) -> list[int]:
    """The tensor-parallel ranks a process spawned (multiprocessing's spawn children, not its resource tracker)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp-processes")
    write_deepseek_v3_checkpoint(path, {}, seed=3)
    return path


@pytest.fixture(scope="module")
def single_rank_tokens(checkpoint) -> list[list[int]]:
    llm = LLM(str(checkpoint), dtype="float32", show_progress=False)
    return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def test_cpu_lists_and_bindings() -> None:
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ConfigError, match="runs backwards"):
        parse_cpu_list("3-1")
    with pytest.raises(ConfigError, match="names 1 core lists for 2 ranks"):
        plan_bindings(2, "0")
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="not available"):
        plan_bindings(1, str(max(allowed) + 64))
    halves = plan_bindings(2) if len(allowed) >= 2 else []
    if halves:
        assert sorted(c for b in halves for c in b.cores) == allowed
        assert not set(halves[0].cores) & set(halves[1].cores)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to give each rank one")
def test_each_rank_runs_on_its_cores_with_memory_on_its_node(checkpoint, single_rank_tokens) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    before = os.sched_getaffinity(0)
    llm = LLM(str(checkpoint), dtype="float32", show_progress=False, tp_size=2, cpu_omp_threads_bind=f"{cores[0]}|{cores[1]}")
    try:
        import torch

        (rank1,) = rank_processes(os.getpid())
        assert os.sched_getaffinity(0) == {cores[0]} and torch.get_num_threads() == 1
        assert os.sched_getaffinity(rank1) == {cores[1]}
        node_dirs = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
        if node_dirs:  # the rank's memory policy binds its allocations to its cores' node
            assert "bind:" in Path(f"/proc/{rank1}/numa_maps").read_text()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        assert [o.token_ids for o in outs] == single_rank_tokens
    finally:
        llm.engine.close()
    assert os.sched_getaffinity(0) == before  # the engine's process gets its cores back
    assert rank_processes(os.getpid()) == []


def test_ranks_on_two_nodes_over_tcp(checkpoint, single_rank_tokens) -> None:
    """Node 1 started as users start it (`eaglet serve --node-rank 1`), node 0 in this process; the
    gloo path between them is the one separate machines take."""
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--model-path", str(checkpoint), "--dtype", "float32", "--speculative-algorithm", "NONE", "--tp-size", "2",
             "--nnodes", "2", "--dist-init-addr", addr, "--log-level", "warning"]
    node1 = subprocess.Popen([sys.executable, "-m", "eaglet.cli", "serve", *flags, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        llm = LLM(str(checkpoint), dtype="float32", show_progress=False, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
            assert [o.token_ids for o in outs] == single_rank_tokens
            assert type(llm.engine.tp_group.tp.comm).__name__ == "GlooCommunicator"
        finally:
            llm.engine.close()
        assert node1.wait(timeout=30) == 0, node1.communicate()[0]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_config_that_does_not_split_is_refused_and_leaves_no_process(tmp_path) -> None:
    write_deepseek_v3_checkpoint(tmp_path, {"num_attention_heads": 3, "num_key_value_heads": 3}, seed=1)
    with pytest.raises(ConfigError, match="num_attention_heads \\(3\\) does not split into 2"):
        LLM(str(tmp_path), dtype="float32", show_progress=False, tp_size=2)
    deadline = time.monotonic() + 15
    while rank_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_processes(os.getpid()) == []


def test_server_exits_when_a_rank_is_killed_mid_generation() -> None:
    """A rank killed while a stream is generating: the stream ends with an error and the server
    process exits non-zero within the stated timeout (10 s here; the rank's death is seen within
    ~50 ms, shutting uvicorn down takes the rest)."""
    from eaglet.demo_model import demo_model_available

    if not demo_model_available():
        pytest.skip("the bundled demo model is not installed")
    port = free_port()
    command = [sys.executable, "-m", "eaglet.cli", "serve", "--tp-size", "2", "--port", str(port),
               "--dist-timeout", "10", "--log-level", "warning"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, base, 90)
        (rank1,) = rank_processes(server.pid)
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'eaglet:tensor_parallel_info{communicator="shm",ep_size="1",model_name="target",tp_size="2"} 1.0' in metrics
        body = {"model": "target", "prompt": "Describe the scene.", "max_tokens": 900, "temperature": 0,
                "ignore_eos": True, "stream": True}
        chunks = 0
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and '"choices"' in line:
                    chunks += 1
                    if chunks == 5:
                        os.kill(rank1, signal.SIGKILL)
                        killed_at = time.monotonic()
                        break
            rest = list(lines)
        assert chunks == 5
        assert any("error" in line for line in rest) or not any(line == "data: [DONE]" for line in rest)
        code = server.wait(timeout=10)
        exited_after = time.monotonic() - killed_at
        output = server.communicate()[0]
        assert code != 0
        assert "tensor-parallel rank" in output, output
        assert exited_after < 10
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_hung_rank_fails_the_step_within_the_timeout(checkpoint) -> None:
    llm = LLM(str(checkpoint), dtype="float32", show_progress=False, tp_size=2, dist_timeout_s=2.0)
    (rank1,) = rank_processes(os.getpid())
    try:
        os.kill(rank1, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(DistributedError, match="did not reach .* within 2 s"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
        assert time.monotonic() - start < 6
        with pytest.raises(DistributedError):  # the group stays broken: no forward runs out of step
            llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)
    finally:
        os.kill(rank1, signal.SIGKILL)
        llm.engine.close()
    assert rank_processes(os.getpid()) == []


def _mismatched_rank(rank: int, path: str, pids: list[int], results) -> None:
    import torch

    from eaglet.distributed.shm_communicator import ShmCommunicator

    comm = ShmCommunicator(path, rank, 2, pids, 10.0, 2**16, 2**12)
    x = torch.ones(4, 8)
    try:
        comm.all_reduce(x)  # in step
        comm.all_reduce(x) if rank == 0 else comm.all_gather(x)  # out of step
        results.put((rank, "no error"))
    except DistributedError as exc:
        results.put((rank, str(exc)))


def test_ranks_running_different_collectives_say_so() -> None:
    """Shared memory: ranks that call different collectives (a desync) raise instead of mixing data."""
    import multiprocessing
    import uuid

    from eaglet.distributed.shm_communicator import create_segment

    path = f"/dev/shm/eaglet-test-{uuid.uuid4().hex}" if Path("/dev/shm").is_dir() else f"/tmp/eaglet-test-{uuid.uuid4().hex}"
    create_segment(path, 2, 2**16, 2**12)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    try:
        # Forked ranks: their pids are known only once started, so each gets the parent's for the other
        # (alive throughout) and the liveness check has nothing to find.
        procs = [context.Process(target=_mismatched_rank, args=(r, path, [os.getpid(), os.getpid()], results))
                 for r in range(2)]
        for p in procs:
            p.start()
        outcomes = dict(results.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(10)
    finally:
        Path(path).unlink(missing_ok=True)
    for rank in (0, 1):
        assert "out of step" in outcomes[rank], outcomes
