"""The headline figures of every kept ``eaglet bench`` run, oldest first (``eaglet bench --history``).

Each ``bench-*.json`` in the results directory is one run of ``eaglet bench``; this reads them
back and prints one line per run with the figures issue goals are stated in, so a regression shows
as a break in a column:

* deepseek-bf16 plain decoding over vLLM-CPU's plain decoding and over transformers ``generate``,
  eaglet's EAGLE-3 chain over vLLM's (batch 1 and 16), and batch 1's step time over the
  memory-bandwidth floor;
* the demo model's default speculation (``adaptive``) over its plain decoding at batch 1, 16 and
  64, and the slowest speculative mode over plain at batch 64;
* the largest bookkeeping share of a speculative round at batch 16, on the demo and elsewhere;
* how many speculative rows made exactly plain decoding's tokens.

A figure the run did not measure (a checkpoint or peer left out, an older record without the
field) prints as ``-``. Ratios compare engines within one run only: the machine is shared and
noisy, so absolute tokens/s of different runs do not compare. The ``machine`` column names the
CPU family and what eaglet's bfloat16 GEMM kernels ran on (``tile_backend``; older records did
not say): runs on a Xeon with AMX and an EPYC with AVX512-BF16 only compare within each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Column:
    header: str
    spec: str  # format spec of the value


COLUMNS: dict[str, Column] = {
    "plain_vllm_1": Column("plain/vLLM B1", ".2f"),
    "plain_vllm_16": Column("plain/vLLM B16", ".2f"),
    "chain_vllm_1": Column("chain/vLLM B1", ".2f"),
    "chain_vllm_16": Column("chain/vLLM B16", ".2f"),
    "plain_hf_1": Column("plain/HF B1", ".2f"),
    "plain_hf_16": Column("plain/HF B16", ".2f"),
    "floor_1": Column("B1 step/floor", ".2f"),
    "demo_adaptive_1": Column("demo adaptive B1", ".2f"),
    "demo_adaptive_16": Column("demo adaptive B16", ".2f"),
    "demo_adaptive_64": Column("demo adaptive B64", ".2f"),
    "demo_slowest_64": Column("demo slowest B64", ".2f"),
    "demo_bookkeeping_16": Column("demo max bookkeep B16", ".1%"),
    "other_bookkeeping_16": Column("others max bookkeep B16", ".1%"),
    "lossless": Column("lossless rows", ""),
}


def _eaglet_rows(record: dict, checkpoint: str) -> dict[tuple[str, int], dict]:
    """The checkpoint's eaglet rows by (mode, batch)."""
    for entry in record.get("checkpoints", []):
        if entry.get("checkpoint") == checkpoint:
            return {(r.get("mode"), r.get("batch")): r for r in entry.get("rows", []) if r.get("engine") == "eaglet"}
    return {}


def headline(record: dict) -> dict[str, float | str | None]:
    """One run's figures by COLUMNS key (None where the run did not measure it)."""
    bf16 = _eaglet_rows(record, "deepseek-bf16")
    demo = _eaglet_rows(record, "demo")
    out: dict[str, float | str | None] = dict.fromkeys(COLUMNS)
    for batch in (1, 16):
        plain, chain = bf16.get(("plain", batch), {}), bf16.get(("chain", batch), {})
        out[f"plain_vllm_{batch}"] = plain.get("over_vllm")
        out[f"plain_hf_{batch}"] = plain.get("over_transformers")
        out[f"chain_vllm_{batch}"] = chain.get("over_vllm") if chain.get("over_vllm_mode") == "chain" else None
    out["floor_1"] = bf16.get(("plain", 1), {}).get("roofline", {}).get("step_over_floor")
    for batch in (1, 16, 64):
        out[f"demo_adaptive_{batch}"] = demo.get(("adaptive", batch), {}).get("over_eaglet_plain")
    speculative_64 = [r["over_eaglet_plain"] for (mode, batch), r in demo.items()
                      if batch == 64 and mode != "plain" and r.get("over_eaglet_plain") is not None]
    out["demo_slowest_64"] = min(speculative_64, default=None)
    shares: dict[bool, list[float]] = {True: [], False: []}
    same = total = 0
    for entry in record.get("checkpoints", []):
        for row in entry.get("rows", []):
            if row.get("engine") != "eaglet" or row.get("mode") == "plain":
                continue
            share = row.get("phase_share", {}).get("bookkeeping")
            if row.get("batch") == 16 and share is not None:
                shares[entry.get("checkpoint") == "demo"].append(share)
            if "same_tokens_as_eaglet_plain" in row:
                total += 1
                same += bool(row["same_tokens_as_eaglet_plain"])
    out["demo_bookkeeping_16"] = max(shares[True], default=None)
    out["other_bookkeeping_16"] = max(shares[False], default=None)
    out["lossless"] = f"{same}/{total}" if total else None
    return out


def machine_label(record: dict) -> str:
    """``family/tile backend`` of a run's machine (``Xeon/amx``, ``EPYC/avx512_bf16``), as far as
    the record says."""
    machine = record.get("machine", {})
    cpu = machine.get("cpu_model") or ""
    family = next((name for name in ("Xeon", "EPYC", "Ryzen", "Core") if name in cpu), cpu.split(" ")[0] if cpu else "-")
    backend = machine.get("tile_backend")
    return f"{family}/{backend}" if backend else family


def _cell(value: float | str | None, column: Column) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, column.spec)


def history_table(results_dir: Path) -> str:
    """A markdown table: one line per ``bench-*.json`` in ``results_dir``, oldest first."""
    files = sorted(results_dir.glob("bench-*.json"))
    if not files:
        raise FileNotFoundError(f"no bench-*.json in {results_dir}")
    lines = ["| run | git | machine | " + " | ".join(c.header for c in COLUMNS.values()) + " |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for path in files:
        run = path.stem.removeprefix("bench-")
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            lines.append(f"| {run} | unreadable: {exc} |")
            continue
        if not isinstance(record, dict):
            lines.append(f"| {run} | unreadable: not a bench record (a JSON {type(record).__name__}) |")
            continue
        if record.get("benchmark") not in (None, "eaglet-bench"):
            continue  # another benchmark's record (bench-tp-*: tensor parallelism)
        figures = headline(record)
        cells = [_cell(figures[key], column) for key, column in COLUMNS.items()]
        git = record.get("machine", {}).get("eaglet_git") or "-"
        lines.append(f"| {run} | {git} | {machine_label(record)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
