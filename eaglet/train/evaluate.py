"""Held-out evaluation: accept length measured by eaglet's own speculative decoding.

The exported draft is loaded exactly as serving loads it (``LLM(..., speculative_algorithm="EAGLE3",
speculative_draft_model_path=...)``) and decodes the held-out prompts greedily; the numbers are
``LLM.spec_metrics()``: accept length (bonus token included), acceptance rate, per-position
acceptance. Adaptive drafting is off so every decode step is a full speculative round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.api import LLM
from eaglet.sampling_params import SamplingParams


def measure_accept_length(
    target: str | Path,
    draft_dir: str | Path,
    requests: list[dict[str, Any]],
    *,
    dtype: str,
    max_new_tokens: int,
    num_steps: int = 3,
    eagle_topk: int = 1,
    num_draft_tokens: int = 4,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """``LLM.spec_metrics()`` after greedy speculative decoding of ``requests`` with the draft."""
    if not requests:
        raise ValueError("the evaluation needs at least one prompt")
    engine_kwargs.setdefault("show_progress", False)
    llm = LLM(
        model=str(target),
        dtype=dtype,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(draft_dir),
        speculative_num_steps=num_steps,
        speculative_eagle_topk=eagle_topk,
        speculative_num_draft_tokens=num_draft_tokens,
        speculative_adaptive=False,
        **engine_kwargs,
    )
    llm.generate(list(requests), SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    metrics = llm.spec_metrics()
    assert metrics is not None  # speculation is on
    return metrics
