"""Where benchmark records go: one timestamped JSON file per run."""

from __future__ import annotations

import json
import time
from pathlib import Path


def record_text(record: dict) -> str:
    return json.dumps(record, indent=2) + "\n"


def write_record(results_dir: Path, kind: str, record: dict) -> Path:
    """Writes ``record`` to ``results_dir/<kind>-<YYYYmmdd-HHMMSS>.json`` and returns the path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    out = results_dir / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(record_text(record))
    return out
