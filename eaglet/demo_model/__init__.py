"""The bundled demo model: a small Kimi-K2.5 target and its EAGLE-3 draft, built by
``tools/demo/build.py`` and shipped inside the package so eaglet runs without any download."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
DEMO_TARGET_DIR = DEMO_DIR / "target"
DEMO_DRAFT_DIR = DEMO_DIR / "draft"


def demo_model_available() -> bool:
    return (DEMO_TARGET_DIR / "config.json").is_file() and (DEMO_DRAFT_DIR / "config.json").is_file()
