"""Tiny random EAGLE-3 draft checkpoints in the published layout, made at test time.

``write_eagle3_draft`` sizes a draft for a target written by ``eaglet.testing.checkpoints`` (DeepSeek-V3 /
Kimi-K2 text, or Kimi-K2.5 with its ``text_config``) and writes ``config.json`` +
``model.safetensors`` the way SpecForge / SGLang / ModelOpt exports look:

* ``kind="llama"``: ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, Llama
  attention keys (``num_key_value_heads``, ``head_dim``, ``rope_theta``, ``rope_scaling``);
* ``kind="mla"``: ``architectures: ["Eagle3DeepseekV2ForCausalLM"]``, the target's text model_type
  (``kimi_k2`` / ``deepseek_v3``), the target's MLA dimensions and (as ModelOpt's Kimi template
  does) its routing keys, which a draft must ignore;
* both: ``num_hidden_layers: 1``, ``target_hidden_size``, ``draft_vocab_size`` (unless None),
  ``eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}``, ``fc_norm`` /
  ``norm_output`` only when true (as the EAGLE-3.1 configs spell them).

Tensors: ``fc.weight [H, 3*H_t]``, ``fc_norm.{0,1,2}.weight``, ``{prefix}.{input_layernorm,
hidden_norm,post_attention_layernorm}.weight``, ``{prefix}.self_attn.*``, ``{prefix}.mlp.*``,
``norm.weight``, ``lm_head.weight [draft_vocab, H]``, ``d2t`` int64 offsets and ``t2d`` bool built from
a random sorted hot vocabulary (``d2t[i] = used[i] - i``, ``t2d[j] = j in used``), optional
``embed_tokens.weight``. ``root_prefix="model."`` prefixes everything but lm_head / d2t / t2d.
Linear weights have std 1/sqrt(fan_in), norms 1 + 0.1 N, like ``eaglet.testing.checkpoints``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import torch
from safetensors.torch import save_file

PathLike = str | os.PathLike

__all__ = ["write_eagle3_draft", "target_text_config", "default_aux_layer_ids"]

# Keys of the target's text config an MLA draft config carries over (ModelOpt's kimik2 template).
_MLA_KEYS = (
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rope_theta", "rope_scaling", "max_position_embeddings", "rms_norm_eps",
    "intermediate_size", "attention_bias", "first_k_dense_replace", "moe_intermediate_size", "moe_layer_freq",
    "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_experts_per_tok",
    "routed_scaling_factor", "scoring_func", "topk_group", "topk_method", "bos_token_id", "eos_token_id",
)  # fmt: skip


def target_text_config(target: dict | PathLike) -> dict:
    """The text part of a target config: a dict, or a checkpoint directory holding config.json."""
    cfg = target if isinstance(target, dict) else json.loads((pathlib.Path(target) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SpecForge's default [1, N//2-1, N-4] ("output of layer id") when it fits, else [0, N//2, N-1]."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if all(0 <= i < num_layers for i in ids):
        return ids
    return [0, num_layers // 2, num_layers - 1]


def _linear(g: torch.Generator, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=g)


def _small(g: torch.Generator, n: int) -> torch.Tensor:
    return 0.1 * torch.randn(n, generator=g)


def write_eagle3_draft(
    path: PathLike,
    target_config_dict_or_path: dict | PathLike,
    *,
    kind: str = "mla",
    seed: int = 0,
    draft_vocab_size: int | None = 64,
    prefix: str = "midlayer",
    root_prefix: str = "",
    with_embed_tokens: bool = False,
    with_lm_head: bool | None = None,
    hidden_size: int | None = None,
    fc_norm: bool = False,
    norm_output: bool = False,
    aux_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> pathlib.Path:
    """Writes a random EAGLE-3 draft for the target and returns its directory.

    ``draft_vocab_size=None`` leaves the key out of config.json and writes no d2t / t2d (the draft
    then uses the target's full vocabulary and, unless ``with_lm_head``, the target's lm_head).
    ``prefix`` is ``"midlayer"`` or ``"layers.0"``. ``hidden_size`` (default: the target's) other than
    the target's needs ``with_embed_tokens`` (and an lm_head) to make a loadable draft.
    ``config_overrides`` go into config.json last
    (tensor shapes follow the config before them, so overrides can make a draft that does not fit;
    ``attention_bias`` / ``bias`` overrides do add the bias tensors).
    """
    if kind not in ("mla", "llama"):
        raise ValueError("kind must be 'mla' or 'llama'")
    if prefix not in ("midlayer", "layers.0"):
        raise ValueError("prefix must be 'midlayer' or 'layers.0'")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tc = target_text_config(target_config_dict_or_path)
    vocab, target_hidden, n_layers = tc["vocab_size"], tc["hidden_size"], tc["num_hidden_layers"]
    aux = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n_layers)

    cfg: dict = {"num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False}
    if kind == "llama":
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            hidden_size=hidden_size or target_hidden,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=None,
            max_position_embeddings=tc.get("max_position_embeddings", 512),
            attention_bias=False,
            mlp_bias=False,
            pretraining_tp=1,
        )
    else:
        cfg.update({k: tc[k] for k in _MLA_KEYS if k in tc})
        cfg.update(
            architectures=["Eagle3DeepseekV2ForCausalLM"],
            model_type=tc.get("model_type", "kimi_k2"),
            hidden_size=hidden_size or target_hidden,
        )
    cfg.update(
        vocab_size=vocab,
        target_hidden_size=target_hidden,
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if draft_vocab_size is not None:
        cfg["draft_vocab_size"] = draft_vocab_size
    if fc_norm:
        cfg["fc_norm"] = True
    if norm_output:
        cfg["norm_output"] = True
    sized = dict(cfg)  # tensors follow the config as written before the overrides
    cfg.update(config_overrides)
    (path / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")

    g = torch.Generator().manual_seed(seed)
    H, Ht, I = sized["hidden_size"], sized["target_hidden_size"], sized["intermediate_size"]
    t: dict[str, torch.Tensor] = {}
    root, layer = root_prefix, f"{root_prefix}{prefix}."
    if with_embed_tokens:
        t[root + "embed_tokens.weight"] = torch.randn(vocab, H, generator=g)
    t[root + "fc.weight"] = _linear(g, H, len(aux) * Ht)
    if fc_norm:
        for i in range(len(aux)):
            t[f"{root}fc_norm.{i}.weight"] = _norm(g, Ht)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"{layer}{name}.weight"] = _norm(g, H)
    a = layer + "self_attn."
    if kind == "llama":
        heads, kv_heads, hd = sized["num_attention_heads"], sized["num_key_value_heads"], sized["head_dim"]
        bias = cfg.get("attention_bias") or cfg.get("bias")  # flags follow the final config
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
            t[f"{a}{name}.weight"] = _linear(g, rows, 2 * H)
            if bias:
                t[f"{a}{name}.bias"] = _small(g, rows)
        t[a + "o_proj.weight"] = _linear(g, H, heads * hd)
        if bias:
            t[a + "o_proj.bias"] = _small(g, H)
    else:
        heads, qr, kvr = sized["num_attention_heads"], sized["q_lora_rank"], sized["kv_lora_rank"]
        nope, rope, v = sized["qk_nope_head_dim"], sized["qk_rope_head_dim"], sized["v_head_dim"]
        if qr is None:
            t[a + "q_proj.weight"] = _linear(g, heads * (nope + rope), 2 * H)
        else:
            t[a + "q_a_proj.weight"] = _linear(g, qr, 2 * H)
            t[a + "q_a_layernorm.weight"] = _norm(g, qr)
            t[a + "q_b_proj.weight"] = _linear(g, heads * (nope + rope), qr)
        t[a + "kv_a_proj_with_mqa.weight"] = _linear(g, kvr + rope, 2 * H)
        t[a + "kv_a_layernorm.weight"] = _norm(g, kvr)
        t[a + "kv_b_proj.weight"] = _linear(g, heads * (nope + v), kvr)
        t[a + "o_proj.weight"] = _linear(g, H, heads * v)
    t[layer + "mlp.gate_proj.weight"] = _linear(g, I, H)
    t[layer + "mlp.up_proj.weight"] = _linear(g, I, H)
    t[layer + "mlp.down_proj.weight"] = _linear(g, H, I)
    t[root + "norm.weight"] = _norm(g, H)
    if with_lm_head is None:
        with_lm_head = draft_vocab_size is not None or H != tc["hidden_size"]
    if with_lm_head:
        t["lm_head.weight"] = _linear(g, draft_vocab_size or vocab, H, gain=2.0)
    tensors = {k: v.to(dtype).contiguous() for k, v in t.items()}
    if draft_vocab_size is not None:
        used = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
        tensors["d2t"] = (used - torch.arange(draft_vocab_size)).to(torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
