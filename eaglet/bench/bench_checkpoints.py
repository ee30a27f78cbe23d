"""The bench's checkpoints, each shared by every engine that runs on it: random DeepSeek-V3 and
Kimi-K2.5 targets turned into echo acceptance dials (eaglet.testing.echo_checkpoints) with echo
MLA EAGLE-3 drafts, and the bundled demo model with its trained draft."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from eaglet.bench.settings import CHECKPOINTS, REAL_SIZE_CHECKPOINTS
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint, write_kimi_k25_checkpoint
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, echo_draft, make_echo_target

CHECKPOINT_SEED = 1234
# ~72.5M parameters. The embedding + lm_head (2 x 32000 x 512 = 32.8M) dominate; the routed
# experts are sized so that a batch-1 step reads a realistic fraction of the model.
DEEPSEEK_FULL = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    intermediate_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
)
# DeepSeek-V3 of about 0.55B parameters (DeepSeek-V3's per-head attention sizes, 8 experts of 768):
# a decode step reads about 0.6 GB in bfloat16, so the weights' bandwidth outweighs per-call costs.
DEEPSEEK_LARGE = dict(
    vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    intermediate_size=5632, moe_intermediate_size=768, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
)
# Text model of the Kimi-K2.5 checkpoint: about 25M parameters plus the tiny vision tower.
KIMI_TEXT = dict(
    vocab_size=8000, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
    q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
)
KIMI_IMAGE_TOKEN = IMAGE_TOKEN


ECHO_ALPHA = 1.0
MOONLIGHT_ALPHA = 0.05


def build_checkpoint(name: str, workdir: Path, alpha: float | None, size: str = "full") -> dict:
    """{"target", "draft", "dtype", "images", "echo"} for a checkpoint name; ``size="tiny"``: test-sized
    models; ``size="large"``: the ~0.55B DeepSeek-V3 (Kimi as "full"); ``alpha`` None: the
    checkpoint's own default dial."""
    if name == "demo":
        from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR

        return {"target": DEMO_TARGET_DIR, "draft": DEMO_DRAFT_DIR, "dtype": "auto", "images": True, "echo": False}
    if name == "moonlight-int4":
        from eaglet.bench.moonlight_checkpoint import moonlight_int4_checkpoint

        return {**moonlight_int4_checkpoint(alpha=MOONLIGHT_ALPHA if alpha is None else alpha),
                "weight_format": "int4", "one_engine_at_a_time": True}
    alpha = ECHO_ALPHA if alpha is None else alpha
    full = size != "tiny"
    if name.startswith("deepseek"):
        target = workdir / f"deepseek-{size}-alpha{alpha}"
        if not (target / "tokenizer.json").is_file():
            config = {"full": DEEPSEEK_FULL, "large": DEEPSEEK_LARGE}.get(size)
            # The tokenizer is for llama.cpp's GGUF converter; every engine is fed token ids.
            write_deepseek_v3_checkpoint(target, config, seed=CHECKPOINT_SEED, num_shards=1, dtype=torch.float32,
                                         with_tokenizer=True)
            make_echo_target(target, alpha)
        dtype = "float32" if name.endswith("fp32") else "bfloat16"
        images = False
    elif name == "kimi":
        target = workdir / f"kimi-{size}-alpha{alpha}"
        if not (target / "config.json").is_file():
            write_kimi_k25_checkpoint(target, KIMI_TEXT if full else None, seed=11, num_shards=1,
                                      image_token_id=KIMI_IMAGE_TOKEN)
            make_echo_target(target, alpha, prefix="language_model.")
        dtype, images = "float32", True
    else:
        raise ValueError(f"unknown checkpoint {name!r}; choose from {CHECKPOINTS + REAL_SIZE_CHECKPOINTS}")
    draft = target.with_name(target.name + "-draft")
    if not (draft / "config.json").is_file():
        # model_type kimi_k2: the MLA-draft spelling vLLM reads as EAGLE-3 (deepseek_v3 it takes for MTP).
        echo_draft(target, draft, kind="mla", seed=4, model_type="kimi_k2")
    return {"target": target, "draft": draft, "dtype": dtype, "images": images, "echo": True}


def random_deepseek_checkpoint(workdir: Path) -> Path:
    """The plain random DeepSeek-V3 of DEEPSEEK_FULL (no echo edit), written once per workdir."""
    key = json.dumps({"cfg": DEEPSEEK_FULL, "seed": CHECKPOINT_SEED}, sort_keys=True)
    path = workdir / f"deepseek_v3-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    marker = path / "bench_config.json"
    if marker.is_file() and marker.read_text() == key:
        return path
    t = time.perf_counter()
    write_deepseek_v3_checkpoint(path, DEEPSEEK_FULL, seed=CHECKPOINT_SEED, num_shards=1, dtype=torch.float32)
    marker.write_text(key)
    print(f"wrote checkpoint {path} in {time.perf_counter() - t:.1f}s")
    return path


def checkpoint_param_counts(path: Path) -> dict[str, int]:
    """Exact parameter count from the safetensors headers, split by kind."""
    from safetensors import safe_open

    counts = {"embedding": 0, "lm_head": 0, "attention": 0, "dense_mlp": 0, "routed_experts": 0,
              "shared_experts": 0, "router": 0, "norms": 0}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                numel = 1
                for d in f.get_slice(name).get_shape():
                    numel *= d
                if "embed_tokens" in name:
                    kind = "embedding"
                elif name.startswith("lm_head"):
                    kind = "lm_head"
                elif "norm" in name:
                    kind = "norms"
                elif ".self_attn." in name:
                    kind = "attention"
                elif ".mlp.experts." in name:
                    kind = "routed_experts"
                elif ".mlp.shared_experts." in name:
                    kind = "shared_experts"
                elif ".mlp.gate." in name:
                    kind = "router"
                else:
                    kind = "dense_mlp"
                counts[kind] += numel
    counts["total"] = sum(counts.values())
    return counts
