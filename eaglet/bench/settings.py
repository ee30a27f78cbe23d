"""The bench's defaults that its command line shows, light to import so that ``eaglet --help``
stays fast."""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = ("deepseek-fp32", "deepseek-bf16", "kimi", "demo")
# Named only on request (not in 'all'): 11.2 GB, written once to the bench cache (eaglet.bench.moonlight_checkpoint).
REAL_SIZE_CHECKPOINTS = ("moonlight-int4",)
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "eaglet" / "vllm-venv"
# Relative to the directory the bench runs in: an installed eaglet has no source tree to write to.
DEFAULT_RESULTS_DIR = Path("eaglet-bench-results")
