"""The bench's defaults that its command line shows, light to import so that ``eaglet --help``
stays fast."""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = ("deepseek-fp32", "deepseek-bf16", "kimi", "demo")
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "eaglet" / "vllm-venv"
# Relative to the directory the bench runs in: an installed eaglet has no source tree to write to.
DEFAULT_RESULTS_DIR = Path("eaglet-bench-results")
