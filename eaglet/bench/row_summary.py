"""A bench row: the medians of one engine's timed runs at one batch size, and its ratios against
its own plain decoding and against each peer."""

from __future__ import annotations

import statistics


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def prefill_row(engine: str, mode: str, prompt_len: int, runs: list[float], **extra: object) -> dict:
    """A prefill row: prompt tokens/s of one ``prompt_len`` prompt per run, at batch 1."""
    tps = statistics.median(runs)
    return {"engine": engine, "mode": mode, "batch": 1, "repeats": len(runs), "tokens_per_s": tps,
            "ttft_ms": 1e3 * prompt_len / tps, "itl_ms": None, "tokens_per_s_runs": runs, "prompt_len": prompt_len,
            **extra}


def summarize(engine: str, mode: str, batch: int, runs: list[dict]) -> dict:
    row = {"engine": engine, "mode": mode, "batch": batch, "repeats": len(runs),
           "tokens_per_s": _median(runs, "decode_tok_s"), "ttft_ms": _median(runs, "ttft_ms"),
           "itl_ms": _median(runs, "itl_ms"), "tokens_per_s_runs": [r["decode_tok_s"] for r in runs]}
    if "accept_length" in runs[0]:
        row["accept_length"] = _median(runs, "accept_length")
        positions = len(runs[0]["per_position_acceptance"])
        row["per_position_acceptance"] = [statistics.median(r["per_position_acceptance"][k] for r in runs)
                                          for k in range(positions)]
        row["phase_share"] = {p: statistics.median(r["phase_share"][p] for r in runs) for p in runs[0]["phase_share"]}
        row["ms_per_round"] = _median(runs, "ms_per_round")
        # Decode steps per level ("off" = plain), all timed runs together: what the adaptive policy chose.
        row["decode_steps_per_level"] = {level: sum(r["decode_steps_per_level"][level] for r in runs)
                                         for level in runs[0]["decode_steps_per_level"]}
    return row


def add_ratios(rows: list[dict], llama_cpp_type: str | None = None) -> None:
    """Each speculative mode over its own engine's plain decoding (``over_eaglet_plain`` /
    ``over_vllm_plain``), and each eaglet row over each peer at the same batch size: the peer's same
    mode where it ran it (eaglet chain vs vLLM EAGLE-3 chain), else the peer's plain decoding.
    llama.cpp: every eaglet row over each GGUF type's decoding (prefill over its prefill), and
    ``over_llama_cpp`` over ``llama_cpp_type``, the type with eaglet's weight format."""
    by_key = {(r["engine"], r["mode"], r["batch"]): r for r in rows}
    for row in rows:
        prefill = row["mode"] == "prefill"
        if row["engine"] == "eaglet":
            _add_llama_cpp_ratios(row, rows, prefill, llama_cpp_type)
        if prefill:
            continue
        plain = by_key.get((row["engine"], "plain", row["batch"]))
        if plain is not None and row["engine"] in ("eaglet", "vllm"):
            row[f"over_{row['engine']}_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
        if row["engine"] != "eaglet":
            continue
        for peer in ("transformers", "vllm"):
            mode = "chain" if row["mode"] == "adaptive" else row["mode"]  # vLLM's EAGLE-3 drafts a chain
            other = by_key.get((peer, mode, row["batch"])) or by_key.get((peer, "plain", row["batch"]))
            if other is not None:
                row[f"over_{peer}"] = row["tokens_per_s"] / other["tokens_per_s"]
                row[f"over_{peer}_mode"] = other["mode"]


def _add_llama_cpp_ratios(row: dict, rows: list[dict], prefill: bool, llama_cpp_type: str | None) -> None:
    by_type = {r["mode"].removeprefix("prefill-"): row["tokens_per_s"] / r["tokens_per_s"] for r in rows
               if r["engine"] == "llama.cpp" and r["batch"] == row["batch"] and r["mode"].startswith("prefill-") == prefill}
    if by_type:
        row["over_llama_cpp_by_type"] = by_type
        if llama_cpp_type in by_type:
            row["over_llama_cpp"] = by_type[llama_cpp_type]
