"""transformers ``generate`` as a peer: greedy decoding of the same prompts, its decode steps timed
by a ``StoppingCriteria`` that records the time of each call (once per generated token)."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from eaglet.bench.cpu_load import ForeignCPU


def load_transformers(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if dtype == torch.float32:
        from eaglet.testing.checkpoints import load_reference_deepseek_v3

        model = load_reference_deepseek_v3(path)
    else:
        model = DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return model


def run_transformers(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    """Prefill = start to the first call; decode time = last call - first call."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    clock = Clock()
    input_ids = torch.tensor(prompts, dtype=torch.long)
    gc.collect()
    foreign = ForeignCPU().__enter__()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    foreign.__exit__()
    times = clock.times
    assert len(times) == new_tokens, f"expected {new_tokens} stopping-criteria calls, got {len(times)}"
    decode_s = times[-1] - times[0]
    steps = [b - a for a, b in zip(times, times[1:])]
    return {
        "prefill_s": times[0] - t0,
        "decode_s": decode_s,
        "decode_steps": len(steps),
        "step_ms_mean": 1e3 * decode_s / len(steps),
        "step_ms_median": 1e3 * statistics.median(steps),
        "decode_tok_s": len(prompts) * len(steps) / decode_s,
        "foreign_cpu": foreign.fraction,
        "tokens": out[:, input_ids.shape[1]:].tolist(),
    }


def run_transformers_requests(model: torch.nn.Module, prompts: list[dict], new_tokens: int) -> dict:
    """run_transformers on the suite's requests, in the suite's run fields."""
    run = run_transformers(model, [p["prompt_token_ids"] for p in prompts], new_tokens)
    return {"ttft_ms": 1e3 * run["prefill_s"], "decode_s": run["decode_s"], "decode_tok_s": run["decode_tok_s"],
            "itl_ms": run["step_ms_mean"], "tokens": run["tokens"]}
