"""Building a fresh trainable draft, and writing it as a standard EAGLE-3 checkpoint.

The checkpoint is what SpecForge exports and SGLang / vLLM / eaglet read (shared/reference/eagle3.md):

* ``config.json``: ``architectures`` (``Eagle3DeepseekV2ForCausalLM`` for ``mla``,
  ``LlamaForCausalLMEagle3`` for ``llama``), ``model_type``, ``hidden_size``, ``intermediate_size``,
  attention keys, ``num_hidden_layers: 1``, ``vocab_size``, ``draft_vocab_size``,
  ``target_hidden_size``, ``rms_norm_eps``, RoPE keys, ``max_position_embeddings``,
  ``eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state: true}``;
* ``model.safetensors``: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``
  ``[draft_vocab, H]``, ``d2t`` int64, ``t2d`` bool; no ``embed_tokens`` (shared with the target).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from eaglet.backends import torch_backend
from eaglet.models.config import ModelConfig
from eaglet.layers.norms import RMSNorm
from eaglet.models.eagle3 import Eagle3Draft
from eaglet.models.eagle3_config import Eagle3Config
from eaglet.train.vocab import HotVocab

ARCHITECTURES = {"mla": "Eagle3DeepseekV2ForCausalLM", "llama": "LlamaForCausalLMEagle3"}
# Keys an MLA draft copies from its target's text config (attention shape, RoPE, norms).
_MLA_KEYS = (
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave",
    "max_position_embeddings", "rms_norm_eps", "intermediate_size", "attention_bias", "bos_token_id",
    "eos_token_id",
)  # fmt: skip


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """SpecForge's default low / middle / high layers [1, N//2-1, N-4] ("output of layer id"); targets
    too shallow for it (N < 5) get [0, N//2, N-1]."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids):
        return ids
    return (0, num_layers // 2, num_layers - 1)


def draft_config_dict(
    target: ModelConfig,
    architecture: str,
    draft_vocab_size: int,
    aux_layer_ids: tuple[int, ...],
    dtype: torch.dtype,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config.json of a new draft for ``target`` (``overrides`` last, e.g. intermediate_size)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"draft architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}")
    text = target.text
    raw = target.raw or {}
    text_raw = raw.get("text_config", raw)
    cfg: dict[str, Any] = {"architectures": [ARCHITECTURES[architecture]], "num_hidden_layers": 1, "hidden_act": "silu"}
    if architecture == "mla":
        cfg.update({k: text_raw[k] for k in _MLA_KEYS if k in text_raw})
        cfg["model_type"] = text_raw.get("model_type", "deepseek_v3")
        if cfg.get("q_lora_rank") is None:  # the MLA draft's q_a_proj reads the 2H concatenation
            cfg["q_lora_rank"] = text.kv_lora_rank * 3
    else:
        heads = text.num_attention_heads
        cfg.update(
            model_type="llama",
            intermediate_size=text.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=text.hidden_size // heads,
            rope_theta=float(text.rope.theta),
            rope_scaling=None,
            max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=text.rms_norm_eps,
            attention_bias=False,
            mlp_bias=False,
        )
    cfg.update(
        hidden_size=text.hidden_size,
        target_hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        draft_vocab_size=draft_vocab_size,
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    cfg.update(overrides or {})
    return dict(sorted(cfg.items()))


def new_draft(
    config_dict: dict[str, Any],
    target: ModelConfig,
    embed_tokens: nn.Embedding,
    target_lm_head: nn.Linear,
    vocab: HotVocab,
    seed: int,
) -> tuple[Eagle3Draft, Eagle3Config]:
    """A float32 draft with fresh weights (seeded): Linear layers in torch's default init, norms 1,
    lm_head = the target's lm_head rows of the hot vocabulary; embed_tokens shared with the target
    (frozen, as at inference)."""
    config = Eagle3Config.from_hf(config_dict, target)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        # Trained under autograd: PyTorch ops throughout.
        draft = Eagle3Draft(
            config, torch_backend(), own_embed_tokens=False, own_lm_head=True, checkpoint_d2t=True, checkpoint_t2d=True
        )
        for module in draft.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()  # seeded: the same draft for the same seed
    finally:
        torch.random.set_rng_state(generator_state)
    for module in draft.modules():
        if isinstance(module, RMSNorm):
            module.weight.data = torch.ones(module.weight.shape)
    for param in draft.parameters():
        param.data = param.data.float()
        param.requires_grad_(True)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target_lm_head.weight[vocab.used_ids].float())
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
    draft.process_weights_after_loading()
    frozen = nn.Embedding.from_pretrained(embed_tokens.weight.detach().float().clone(), freeze=True)
    draft.share_target_weights(frozen, None)
    return draft, config


def export_draft(draft: Eagle3Draft, config_dict: dict[str, Any], output_dir: str | Path, dtype: torch.dtype) -> Path:
    """Writes config.json + model.safetensors (weights in ``dtype``, d2t int64, t2d bool)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: param.detach().to(dtype).contiguous()
        for name, param in draft.checkpoint_weights().items()
        if name not in ("d2t", "t2d")
    }
    tensors["d2t"] = draft.d2t.detach().to(torch.int64).contiguous()
    tensors["t2d"] = draft.t2d.detach().to(torch.bool).contiguous()
    config = dict(config_dict, torch_dtype=str(dtype).removeprefix("torch."))
    save_file(tensors, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return output_dir
