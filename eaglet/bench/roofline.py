"""The memory-bandwidth floor of a decode step: the bytes it must read at least (the batch's
embedding rows, every non-expert weight, only the distinct routed experts the step activates, the
latent cache at the mean length) over the measured read bandwidth, beside a compute floor."""

from __future__ import annotations

import statistics
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from eaglet import LLM, SamplingParams

if TYPE_CHECKING:
    from eaglet.models.config import TextConfig


class ExpertCounter:
    """Wraps RoutedExperts.forward (in this process only) to count distinct experts per decode call.

    It keeps a copy of each call's expert ids; the distinct counts are computed afterwards. While
    it counts, the model runs its layers one by one: a decoder stack routes in C++, past the
    wrapper (with the same routing and the same bits, but not the stack's speed: count on an
    untimed run)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from eaglet.layers.moe import RoutedExperts

        self.cls = RoutedExperts
        self.layer_of = {id(m): name for name, m in model.named_modules() if isinstance(m, RoutedExperts)}
        self.decoder = getattr(model, "language_model", model).model
        self.decode = False
        self.per_layer: dict[str, list[torch.Tensor]] = {name: [] for name in self.layer_of.values()}
        self._orig = None
        self._stack = None

    def __enter__(self) -> "ExpertCounter":
        self._stack, self.decoder.decoder_stack = self.decoder.decoder_stack, None
        orig = self._orig = self.cls.forward
        counter = self

        def forward(module: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor) -> torch.Tensor:
            if counter.decode:
                counter.per_layer[counter.layer_of[id(module)]].append(expert_ids.clone())
            return orig(module, x, weights, expert_ids)

        self.cls.forward = forward
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.cls.forward = self._orig
        self.decoder.decoder_stack = self._stack

    def reset(self) -> None:
        for v in self.per_layer.values():
            v.clear()

    def mean_distinct(self) -> dict[str, float]:
        return {name: (statistics.fmean(int(torch.unique(ids).numel()) for ids in v) if v else 0.0)
                for name, v in self.per_layer.items()}


def step_floor(model: torch.nn.Module, cfg: TextConfig, dtype: torch.dtype, batch: int, mean_seq_len: float,
               distinct: dict[str, float], read_gbps: float, gemm_gflops: float) -> dict:
    """Bytes a decode step must read and FLOPs it must do, from eaglet's own parameters."""
    from eaglet.layers.moe import RoutedExperts
    from eaglet.layers.quantized_weight import QuantizableWeight

    experts = {name: m for name, m in model.named_modules() if isinstance(m, RoutedExperts)}
    expert_params = {id(p) for m in experts.values() for p in (m.w13, m.w2)}
    weight_bytes = 0  # everything read in full (attention, dense, shared, router, norms, lm_head)
    linear_numel = 0  # weights every token multiplies with (for FLOPs)
    embed_bytes = 0
    for name, p in model.named_parameters():
        if id(p) in expert_params:
            continue
        if "embed_tokens" in name:
            embed_bytes = batch * p.shape[-1] * p.element_size()
            continue
        if p.dim() == 2:
            linear_numel += p.numel()
        if not p.is_meta:  # a meta stand-in: the weight is read in its quantized form (below)
            weight_bytes += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, QuantizableWeight) and m.quantized_weight is not None:
            weight_bytes += m.quantized_weight.nbytes
    expert_bytes = 0.0
    expert_numel_per_token = 0
    for name, m in experts.items():
        expert_bytes += distinct.get(name, 0.0) * m.bytes_per_expert()
        expert_numel_per_token += cfg.num_experts_per_tok * (m.w13[0].numel() + m.w2[0].numel())
    layers, kv_dim = cfg.num_hidden_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    kv_bytes = layers * batch * mean_seq_len * kv_dim * dtype.itemsize
    total_bytes = embed_bytes + weight_bytes + expert_bytes + kv_bytes
    attn_flops = layers * 2 * cfg.num_attention_heads * mean_seq_len * (kv_dim + cfg.kv_lora_rank)
    flops = batch * (2 * (linear_numel + expert_numel_per_token) + attn_flops)
    mem_ms = 1e3 * total_bytes / (read_gbps * 1e9)
    compute_ms = 1e3 * flops / (gemm_gflops * 1e9)
    return {
        "bytes": {
            "embedding_rows": embed_bytes,
            "dense_weights": weight_bytes,
            "active_experts": expert_bytes,
            "kv_cache": kv_bytes,
            "total": total_bytes,
        },
        "mean_distinct_experts_per_moe_layer": statistics.fmean(distinct.values()) if distinct else 0.0,
        "flops": flops,
        "mem_floor_ms": mem_ms,
        "compute_floor_ms": compute_ms,
        "roofline_floor_ms": max(mem_ms, compute_ms),
    }


def plain_step_floor(llm: LLM, prompts: list, new_tokens: int, prompt_len: int, read_gbps: float,
                     dtype: torch.dtype) -> dict:
    """Bytes a plain decode step must read, counted on an untimed run (distinct experts per decode
    step: the prefill's forwards, which route every prompt token, are not counted)."""
    model, engine = llm.engine.model, llm.engine
    counter = ExpertCounter(model)
    params = SamplingParams(max_new_tokens=min(new_tokens, 16), temperature=0.0, ignore_eos=True)
    requests = [engine.requests[engine.add_request(p, params)] for p in prompts]
    with counter:
        while engine.has_unfinished() and not all(r.output_token_ids for r in requests):
            engine.step(stream_text=False)
        counter.decode = True
        while engine.has_unfinished():
            engine.step(stream_text=False)
    text = llm.engine.model_config.text
    return step_floor(model, text, dtype, len(prompts), prompt_len + new_tokens / 2,
                      counter.mean_distinct(), read_gbps, gemm_gflops=float("inf"))
