"""What computes is visible: /metrics names the engine's backend, the kernels' tile GEMM, and why
the engine fell back to PyTorch ops if it did; the bench's machine record says the same."""

import contextlib

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import serve

from eaglet import kernels
from eaglet.bench.machine import machine_info
from eaglet.demo_model import DEMO_TARGET_DIR, demo_model_available
from eaglet.engine.engine import Engine, EngineConfig
from eaglet.server import ServerConfig

pytestmark = pytest.mark.skipif(not demo_model_available(), reason="the demo model is not built")


def _backend_info(cpu_kernels: bool) -> dict[str, str]:
    engine = Engine(EngineConfig(model=str(DEMO_TARGET_DIR), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels))
    with contextlib.contextmanager(serve)(engine, ServerConfig(model_name="demo")) as server:
        text = httpx.get(f"{server.base_url}/metrics").text
    [sample] = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "eaglet:backend_info"]
    assert sample.value == 1
    return {k: v for k, v in sample.labels.items() if k != "model_name"}


def test_metrics_say_the_engine_fell_back_and_why():
    assert _backend_info(cpu_kernels=False) == {"backend": "pytorch", "tile_backend": "",
                                                "fallback_reason": "turned off (cpu_kernels=False)"}


@pytest.mark.skipif(not kernels.available(), reason=f"kernels not built: {kernels.unavailable_reason()}")
def test_metrics_name_the_kernels_tile_gemm():
    assert _backend_info(cpu_kernels=True) == {"backend": "cpu", "tile_backend": kernels.tile_backend() or "",
                                               "fallback_reason": ""}


def test_the_bench_records_why_kernels_are_unavailable():
    assert machine_info()["kernels_unavailable"] == kernels.unavailable_reason()
