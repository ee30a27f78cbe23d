"""EAGLE-3 drafts: published-format loading, paged-cache numerics against a dense reference, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint, write_kimi_k25_checkpoint
from eaglet.testing.draft_checkpoints import write_eagle3_draft
from safetensors.torch import load_file, save_file

from eaglet import kernels
from eaglet.backends import torch_backend
from eaglet.errors import CheckpointError, ConfigError
from eaglet.models.eagle3 import load_eagle3_draft
from eaglet.models.eagle3_config import Eagle3Config
from eaglet.models.registry import load_model, parse_model_config
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.runtime.kv_cache import KVCacheManager

TORCH = torch_backend()

AUX = [0, 1, 2]  # the tiny targets have 3 layers
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("target"), seed=5, num_shards=1)
    model, config = load_model(path, "float32", backend=TORCH, show_progress=False)
    return path, model, config


def _load(draft_path: Path, target, dtype=torch.float32):
    _, model, config = target
    draft, draft_config = load_eagle3_draft(draft_path, config, dtype, TORCH)
    draft.share_target_weights(model.embed_tokens, model.lm_head)
    return draft, draft_config


def _checkpoint_name(name: str, prefix: str, root: str) -> str:
    if name.startswith("lm_head."):
        return name
    return root + name.replace("midlayer.", prefix + ".", 1)


# ----------------------------------------------------------------------------------------------
# loading round trip
# ----------------------------------------------------------------------------------------------

ROUND_TRIP = {
    "mla_midlayer_draftvocab": dict(kind="mla"),
    "mla_layers0_fullvocab_embed_fcnorm_normout": dict(
        kind="mla", prefix="layers.0", draft_vocab_size=None, with_embed_tokens=True, fc_norm=True, norm_output=True
    ),
    "mla_model_prefix_fullvocab_fcnorm": dict(kind="mla", root_prefix="model.", draft_vocab_size=None, fc_norm=True),
    "mla_draftvocab_equals_vocab": dict(kind="mla", draft_vocab_size=256, prefix="layers.0"),
    "llama_midlayer_draftvocab_embed_fcnorm_normout": dict(
        kind="llama", with_embed_tokens=True, fc_norm=True, norm_output=True
    ),
    "llama_layers0_fullvocab": dict(kind="llama", prefix="layers.0", draft_vocab_size=None),
    "llama_own_hidden32_bias_llama3": dict(
        kind="llama", hidden_size=32, with_embed_tokens=True, attention_bias=True, rope_scaling=LLAMA3_ROPE
    ),
    "llama_fullvocab_own_lm_head_bf16": dict(
        kind="llama", draft_vocab_size=None, with_lm_head=True, dtype=torch.bfloat16
    ),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_round_trip(tmp_path, target, case):
    kwargs = dict(ROUND_TRIP[case])
    dtype = kwargs.get("dtype", torch.float32)
    path = write_eagle3_draft(tmp_path / "draft", target[0], aux_layer_ids=AUX, seed=3, **kwargs)
    draft, config = _load(path, target, dtype)
    written = load_file(str(path / "model.safetensors"))
    prefix, root = kwargs.get("prefix", "midlayer"), kwargs.get("root_prefix", "")

    loaded = {_checkpoint_name(n, prefix, root): p for n, p in draft.named_parameters()}
    loaded.update({name: getattr(draft, name) for name in ("d2t", "t2d") if name in written})
    assert set(loaded) == set(written)
    for name, tensor in written.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name
    assert written.get("d2t", torch.zeros(1, dtype=torch.long)).dtype == torch.int64
    assert written.get("t2d", torch.ones(1, dtype=torch.bool)).dtype == torch.bool

    # What the checkpoint lacks comes from the target, by reference.
    _, model, _ = target
    assert (draft.embed_tokens is None) == (not kwargs.get("with_embed_tokens", False))
    if draft.embed_tokens is None:
        assert draft._module("embed_tokens") is model.embed_tokens
    if "lm_head.weight" not in written:
        assert draft._module("lm_head") is model.lm_head
    assert config.aux_layer_ids == tuple(AUX)
    assert config.fc_norm == kwargs.get("fc_norm", False) and config.norm_output == kwargs.get("norm_output", False)

    # Vocabulary mapping: offsets, and identity without a draft vocabulary.
    ids = torch.arange(config.draft_vocab_size)
    targets = draft.to_target_ids(ids)
    if "d2t" in written:
        assert torch.equal(targets, ids + written["d2t"])
        assert torch.equal(draft.t2d, written["t2d"])
    else:
        assert torch.equal(targets, ids) and bool(draft.t2d.all())
    assert bool(draft.t2d[targets].all()) and int(draft.t2d.sum()) == config.draft_vocab_size
    # The draft's greedy pick in target ids: the kernel (argmax and offset in one call) and the PyTorch ops.
    logits = torch.randint(0, 3, (5, config.draft_vocab_size)).float()  # ties: the first maximum wins
    expected = draft.to_target_ids(logits.argmax(-1))
    assert torch.equal(draft.greedy_target_ids(logits), expected)
    if kernels.available():
        assert torch.equal(torch.ops.eaglet.argmax_last_dim(logits.bfloat16(), draft.d2t), expected)
    scores = torch.randn(5, config.draft_vocab_size)
    values, target_ids = draft.top_k_target_ids(scores, 2)
    top = scores.log_softmax(-1).topk(2)
    assert torch.equal(target_ids, draft.to_target_ids(top.indices))
    torch.testing.assert_close(values, top.values, atol=1e-5, rtol=1e-6)


def test_t2d_derived_from_d2t_when_absent(tmp_path, target):
    """ModelOpt exports d2t without t2d: t2d is rebuilt from the offsets."""
    path = write_eagle3_draft(tmp_path / "draft", target[0], kind="llama", aux_layer_ids=AUX)
    tensors = load_file(str(path / "model.safetensors"))
    t2d = tensors.pop("t2d")
    save_file(tensors, str(path / "model.safetensors"))
    draft, _ = _load(path, target)
    assert torch.equal(draft.t2d, t2d)


def test_kimi_k25_target(tmp_path):
    target_path = write_kimi_k25_checkpoint(tmp_path / "kimi", seed=2, num_shards=1)
    model, config = load_model(target_path, "float32", backend=TORCH, show_progress=False)
    path = write_eagle3_draft(tmp_path / "draft", target_path, kind="mla", aux_layer_ids=[2, 1, 0])
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    draft, draft_config = load_eagle3_draft(path, config, torch.float32, TORCH)
    draft.share_target_weights(model.embed_tokens, model.language_model.lm_head)
    assert draft_config.aux_layer_ids == (2, 1, 0) and draft_config.mla.q_lora_rank == 24
    assert draft._module("embed_tokens") is model.embed_tokens


def test_aux_layer_id_sources(target):
    """Nested eagle_config ids, top-level ids, SpecForge's default [1, N//2-1, N-4] of the target."""
    raw_target = json.loads((target[0] / "config.json").read_text())
    deep = parse_model_config({**raw_target, "num_hidden_layers": 8})
    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "vocab_size": 256}  # fmt: skip
    assert Eagle3Config.from_hf(base, deep).aux_layer_ids == (1, 3, 4)
    top_level = {**base, "eagle_aux_hidden_state_layer_ids": [2, 4, 6]}
    assert Eagle3Config.from_hf(top_level, deep).aux_layer_ids == (2, 4, 6)
    nested = {**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 5, 7]}}
    assert Eagle3Config.from_hf(nested, deep).aux_layer_ids == (0, 5, 7)
    with pytest.raises(ConfigError, match="disagrees"):
        Eagle3Config.from_hf({**nested, "eagle_aux_hidden_state_layer_ids": [1, 5, 7]}, deep)
    with pytest.raises(ConfigError, match=r"default \[1, N//2-1, N-4\].*out of range"):
        Eagle3Config.from_hf(base, target[2])  # 3 layers: the default does not fit


# ----------------------------------------------------------------------------------------------
# numerics: paged cache vs a dense reference
# ----------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_rotate_half(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = pos[:, None].double() * inv_freq[None].double()
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _rope_complex(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek's own interleaved RoPE: consecutive pairs rotated as complex numbers."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    rot = torch.polar(torch.ones(len(pos), dim // 2, dtype=torch.float64), pos[:, None].double() * inv_freq)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], dim // 2, 2))
    rot = rot.view(len(pos), *([1] * (x.dim() - 2)), dim // 2)
    return torch.view_as_real(xc * rot).flatten(-2).float()


def _llama_inv_freq(cfg: dict) -> torch.Tensor:
    d, theta = cfg["head_dim"], cfg["rope_theta"]
    inv = [1.0 / theta ** (2 * i / d) for i in range(d // 2)]
    rs = cfg.get("rope_scaling")
    if rs:  # Llama-3.1, written out per frequency
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < rs["original_max_position_embeddings"] / rs["high_freq_factor"]:
                out.append(f)
            elif wavelen > rs["original_max_position_embeddings"] / rs["low_freq_factor"]:
                out.append(f / rs["factor"])
            else:
                s = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
                    rs["high_freq_factor"] - rs["low_freq_factor"]
                )
                out.append((1 - s) * f / rs["factor"] + s * f)
        inv = out
    return torch.tensor(inv, dtype=torch.float64)


class DenseReference:
    """The draft written out from the checkpoint tensors: full attention over every row so far."""

    def __init__(self, path: Path, target_path: Path, prefix: str) -> None:
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = load_file(str(path / "model.safetensors"))
        tw = load_file(str(target_path / "model.safetensors"))
        self.embed = self.w.get("embed_tokens.weight", tw["model.embed_tokens.weight"])
        self.lm_head = self.w.get("lm_head.weight", tw["lm_head.weight"])
        self.p = prefix + "."
        self.eps = self.cfg["rms_norm_eps"]

    def project_features(self, feats: torch.Tensor) -> torch.Tensor:
        if self.cfg.get("fc_norm"):
            chunks = feats.chunk(3, dim=-1)
            feats = torch.cat([_rms(c, self.w[f"fc_norm.{i}.weight"], self.eps) for i, c in enumerate(chunks)], -1)
        return feats @ self.w["fc.weight"].T

    def attention(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        a, w = self.p + "self_attn.", self.w
        if self.cfg["architectures"] == ["LlamaForCausalLMEagle3"]:
            heads, kv_heads, d = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"], self.cfg["head_dim"]
            bias = lambda n: w.get(a + n + ".bias", 0.0)  # noqa: E731
            q = (x @ w[a + "q_proj.weight"].T + bias("q_proj")).view(-1, heads, d)
            k = (x @ w[a + "k_proj.weight"].T + bias("k_proj")).view(-1, kv_heads, d)
            v = (x @ w[a + "v_proj.weight"].T + bias("v_proj")).view(-1, kv_heads, d)
            inv_freq = _llama_inv_freq(self.cfg)
            q, k = _rope_rotate_half(q, pos, inv_freq), _rope_rotate_half(k, pos, inv_freq)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            scale, o_bias = d**-0.5, bias("o_proj")
        else:
            heads, nope, rope = (self.cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim"))
            vdim, lat = self.cfg["v_head_dim"], self.cfg["kv_lora_rank"]
            q_a = _rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], self.eps)
            q = q_a @ w[a + "q_b_proj.weight"].T
            q = q.view(-1, heads, nope + rope)
            kv_a = x @ w[a + "kv_a_proj_with_mqa.weight"].T
            c, k_pe = kv_a[:, :lat], kv_a[:, lat:]
            kv = _rms(c, w[a + "kv_a_layernorm.weight"], self.eps) @ w[a + "kv_b_proj.weight"].T
            kv = kv.view(-1, heads, nope + vdim)
            q_pe = _rope_complex(q[..., nope:], pos, self.cfg["rope_theta"])
            k_pe = _rope_complex(k_pe, pos, self.cfg["rope_theta"])[:, None].expand(-1, heads, rope)
            q = torch.cat([q[..., :nope], q_pe], -1)
            k = torch.cat([kv[..., :nope], k_pe], -1)
            v = kv[..., nope:]
            scale, o_bias = (nope + rope) ** -0.5, 0.0
        scores = torch.einsum("qhd,khd->hqk", q[queries], k) * scale
        probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(len(queries), -1)
        return out @ w[a + "o_proj.weight"].T + o_bias

    def step(self, emb, h, pos, mask, queries):
        """emb, h, pos: every row of the request so far; mask [len(queries), rows]."""
        p, w = self.p, self.w
        x = torch.cat(
            [_rms(emb, w[p + "input_layernorm.weight"], self.eps), _rms(h, w[p + "hidden_norm.weight"], self.eps)], -1
        )
        out = h[queries] + self.attention(x, pos, mask, queries)
        y = _rms(out, w[p + "post_attention_layernorm.weight"], self.eps)
        gated = F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
        out = out + gated @ w[p + "mlp.down_proj.weight"].T
        normed = _rms(out, w["norm.weight"], self.eps)
        return normed @ self.lm_head.T, (normed if self.cfg.get("norm_output") else out)


def _scenario(num_prompt: int, vocab: int, feat_width: int, hidden: int, seed: int) -> dict:
    """Per request: a prefill of target features, two single-token steps, one 3-node tree step."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 4.0, 16.0]).repeat_interleave(feat_width // 3)  # aux layers differ in scale
    n = num_prompt
    tree_mask = torch.zeros(3, n + 5, dtype=torch.bool)
    tree_mask[:, : n + 2] = True  # committed prefix
    tree_mask[0, n + 2] = tree_mask[1, n + 3] = True  # siblings A, B see themselves
    tree_mask[2, [n + 2, n + 4]] = True  # C, child of A
    return {
        "prompt_ids": torch.randint(0, vocab, (n,), generator=g),
        "features": torch.randn(n, feat_width, generator=g) * scale,
        "mm_rows": torch.randn(n, hidden, generator=g),  # stand-in merged multimodal embeddings
        "step_ids": torch.randint(0, vocab, (2,), generator=g),
        "tree_ids": torch.randint(0, vocab, (3,), generator=g),
        "tree_hidden_c": torch.randn(hidden, generator=g),
        "tree_positions": torch.tensor([n + 2, n + 2, n + 3]),
        "tree_mask": tree_mask,
    }


def _run_paged(draft, scenarios: list[dict], *, use_input_embeds: bool) -> list[list[tuple]]:
    """Runs the 4 steps batched through the paged cache; per request, per step: (logits, hidden_out)."""
    cache = KVCacheManager(num_layers=1, kv_cache_dim=4, num_blocks=64, block_size=2, max_requests=8,
                           max_context_len=32, dtype=torch.float32, ops=TORCH.cache)  # fmt: skip
    pool = cache.add_pool(draft.make_kv_pool(cache.num_slots, torch.float32, "cpu"))
    backend = draft.make_attention(cache, pool)
    rows = [cache.alloc_row() for _ in scenarios]
    lengths = [0] * len(scenarios)

    def grow(new_lens: list[int]) -> torch.Tensor:
        # Interleave the requests' block allocations so no request owns contiguous slots.
        slots: list[list[torch.Tensor]] = [[] for _ in scenarios]
        while any(lengths[i] < new_lens[i] for i in range(len(scenarios))):
            for i, row in enumerate(rows):
                if lengths[i] < new_lens[i]:
                    step = min(new_lens[i], lengths[i] + 2)
                    slots[i].append(cache.grow(row, step))
                    lengths[i] = step
        return torch.cat([torch.cat(s) for s in slots])

    def split(out, counts):
        logits, hidden = out.logits.split(counts), out.hidden_out.split(counts)
        return list(zip(logits, hidden))

    results: list[list] = [[] for _ in scenarios]
    n = [len(s["prompt_ids"]) for s in scenarios]
    ids = torch.cat([s["prompt_ids"] for s in scenarios])
    embeds = torch.cat([s["mm_rows"] for s in scenarios]) if use_input_embeds else None
    batch = ForwardBatch.build(input_ids=ids, req_pool_indices=rows, extend_prefix_lens=[0] * len(n),
                               extend_seq_lens=n, out_cache_loc=grow(n), mode=ForwardMode.EXTEND,
                               input_embeds=embeds)  # fmt: skip
    out = draft(batch, backend, torch.cat([s["features"] for s in scenarios]), hidden_is_target_features=True)
    hidden = out.hidden_out
    for i, r in enumerate(split(out, [1] * len(n))):
        results[i].append(r)
    for step in range(2):
        batch = ForwardBatch.build(
            input_ids=torch.stack([s["step_ids"][step] for s in scenarios]), req_pool_indices=rows,
            extend_prefix_lens=[m + step for m in n], extend_seq_lens=[1] * len(n),
            out_cache_loc=grow([m + step + 1 for m in n]), mode=ForwardMode.DECODE,
        )  # fmt: skip
        out = draft(batch, backend, hidden, hidden_is_target_features=False)
        hidden = out.hidden_out
        for i, r in enumerate(split(out, [1] * len(n))):
            results[i].append(r)
    width = max(n) + 5
    mask = torch.zeros(3 * len(n), width, dtype=torch.bool)
    for i, s in enumerate(scenarios):
        mask[3 * i : 3 * i + 3, : n[i] + 5] = s["tree_mask"]
    tree_hidden = torch.cat([torch.stack([hidden[i], hidden[i], s["tree_hidden_c"]]) for i, s in enumerate(scenarios)])
    batch = ForwardBatch.build(
        input_ids=torch.cat([s["tree_ids"] for s in scenarios]), req_pool_indices=rows,
        extend_prefix_lens=[m + 2 for m in n], extend_seq_lens=[3] * len(n), out_cache_loc=grow([m + 5 for m in n]),
        positions=torch.cat([s["tree_positions"] for s in scenarios]), mode=ForwardMode.VERIFY,
        logits_indices=torch.arange(3 * len(n)), custom_mask=mask,
    )  # fmt: skip
    out = draft(batch, backend, tree_hidden, hidden_is_target_features=False)
    for i, r in enumerate(split(out, [3] * len(n))):
        results[i].append(r)
    return results


def _run_dense(ref: DenseReference, s: dict, *, use_input_embeds: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = len(s["prompt_ids"])
    emb = s["mm_rows"] if use_input_embeds else ref.embed[s["prompt_ids"]]
    h = ref.project_features(s["features"])
    pos = torch.arange(n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    logits, out = ref.step(emb, h, pos, causal, torch.arange(n))
    results = [(logits[-1:], out[-1:])]
    fed = out[-1]
    for step in range(2):
        emb = torch.cat([emb, ref.embed[s["step_ids"][step]][None]])
        h = torch.cat([h, fed[None]])
        pos = torch.arange(n + step + 1)
        logits, out = ref.step(emb, h, pos, torch.ones(1, n + step + 1, dtype=torch.bool), torch.tensor([n + step]))
        results.append((logits, out))
        fed = out[0]
    emb = torch.cat([emb, ref.embed[s["tree_ids"]]])
    h = torch.cat([h, torch.stack([fed, fed, s["tree_hidden_c"]])])
    pos = torch.cat([pos, s["tree_positions"]])
    logits, out = ref.step(emb, h, pos, s["tree_mask"], torch.arange(n + 2, n + 5))
    results.append((logits, out))
    return results


NUMERICS = {
    "mla_draftvocab_input_embeds": dict(kind="mla", use_input_embeds=True),
    "mla_fullvocab_embed_fcnorm_normout_layers0": dict(
        kind="mla", draft_vocab_size=None, with_embed_tokens=True, fc_norm=True, norm_output=True, prefix="layers.0"
    ),
    "llama_draftvocab_embed_fcnorm_normout_bias_llama3": dict(
        kind="llama", with_embed_tokens=True, fc_norm=True, norm_output=True, attention_bias=True,
        rope_scaling=LLAMA3_ROPE, rope_theta=100.0,
    ),  # fmt: skip
    "llama_fullvocab_gqa": dict(kind="llama", draft_vocab_size=None, prefix="layers.0"),
}


@pytest.mark.parametrize("case", list(NUMERICS))
def test_paged_forward_matches_dense_reference(tmp_path, target, case):
    kwargs = dict(NUMERICS[case])
    use_input_embeds = kwargs.pop("use_input_embeds", False)
    path = write_eagle3_draft(tmp_path / "draft", target[0], aux_layer_ids=AUX, seed=7, **kwargs)
    draft, config = _load(path, target)
    ref = DenseReference(path, target[0], kwargs.get("prefix", "midlayer"))
    feat_width = 3 * config.target_hidden_size
    scenarios = [
        _scenario(n, config.vocab_size, feat_width, config.hidden_size, seed) for seed, n in enumerate((5, 9, 3))
    ]

    with torch.no_grad():
        batched = _run_paged(draft, scenarios, use_input_embeds=use_input_embeds)
        for i, s in enumerate(scenarios):
            dense = _run_dense(ref, s, use_input_embeds=use_input_embeds)
            alone = _run_paged(draft, [s], use_input_embeds=use_input_embeds)[0]
            for step, ((logits, hidden), (ref_logits, ref_hidden)) in enumerate(zip(batched[i], dense)):
                assert logits.dtype == torch.float32 and logits.shape[-1] == config.draft_vocab_size
                torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=f"request {i} step {step}")
                torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5, msg=f"request {i} step {step}")
            for step, ((logits, hidden), (a_logits, a_hidden)) in enumerate(zip(batched[i], alone)):
                msg = f"alone: request {i} step {step}"
                torch.testing.assert_close(logits, a_logits, rtol=1e-5, atol=1e-5, msg=msg)
                torch.testing.assert_close(hidden, a_hidden, rtol=1e-5, atol=1e-5, msg=msg)


# ----------------------------------------------------------------------------------------------
# drafts that do not fit their target
# ----------------------------------------------------------------------------------------------

BAD_CONFIGS = {
    "target_hidden_size": (dict(target_hidden_size=32), r"target_hidden_size 32 != the target's hidden_size 64"),
    "vocab_size": (dict(vocab_size=300), r"vocab_size 300 != the target's vocab_size 256"),
    "aux_out_of_range": (dict(aux_layer_ids=[0, 1, 3]), r"layer ids \[3\] out of range \[0, 3\)"),
    "two_aux_ids": (dict(aux_layer_ids=[0, 1]), r"exactly 3 target layers"),
    "unknown_architecture": (
        dict(architectures=["MedusaForCausalLM"]),
        r"unknown draft architecture 'MedusaForCausalLM'",
    ),
    "mla_without_q_lora_rank": (dict(q_lora_rank=None), r"requires q_lora_rank"),
    "two_layers": (dict(num_hidden_layers=2), r"num_hidden_layers must be 1"),
    "draft_vocab_too_big": (dict(config_patch={"draft_vocab_size": 300}), r"draft_vocab_size 300 > vocab_size 256"),
    "llama_yarn_rope": (dict(kind="llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"rope type 'yarn'"),
    "hidden_without_embed": (dict(kind="llama", hidden_size=32), r"hidden_size 32 != the target's 64.*no embed_tokens"),
    "no_aux_features": (dict(eagle_config={"use_aux_hidden_state": False}), r"use_aux_hidden_state false"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_refused(tmp_path, target, case):
    kwargs, message = BAD_CONFIGS[case]
    kwargs = {"aux_layer_ids": AUX, **kwargs}
    patch = kwargs.pop("config_patch", {})
    path = write_eagle3_draft(tmp_path / "draft", target[0], **kwargs)
    if patch:  # a key the writer sizes tensors by: edit config.json afterwards
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, **patch}))
    with pytest.raises(ConfigError, match=message):
        load_eagle3_draft(path, target[2], torch.float32, TORCH)


def _edit(path: Path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


BAD_TENSORS = {
    "missing": (lambda t: t.pop("midlayer.mlp.up_proj.weight"), r"missing tensors \(1\): midlayer.mlp.up_proj.weight"),
    "misshaped_fc": (
        lambda t: t.update({"fc.weight": torch.zeros(64, 100)}),
        r"fc.weight: checkpoint \[64, 100\], model expects \[64, 192\]",
    ),
    "unexpected": (
        lambda t: t.update({"midlayer.extra.weight": torch.zeros(3)}),
        r"unexpected tensors \(1\): midlayer.extra.weight",
    ),
    "missing_d2t": (lambda t: t.pop("d2t"), r"missing tensors \(1\): d2t"),
    "d2t_out_of_range": (lambda t: t["d2t"].add_(200), r"d2t maps draft ids outside"),
    "t2d_disagrees": (lambda t: t["t2d"].logical_not_(), r"t2d does not mark"),
    "int32_d2t": (lambda t: t.update({"d2t": t["d2t"].int()}), r"d2t has dtype torch.int32"),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_refused(tmp_path, target, case):
    edit, message = BAD_TENSORS[case]
    path = write_eagle3_draft(tmp_path / "draft", target[0], aux_layer_ids=AUX)
    _edit(path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_eagle3_draft(path, target[2], torch.float32, TORCH)


def test_mixed_prefixes_refused(tmp_path, target):
    """A checkpoint naming its layer both midlayer.* and layers.0.* reports the stray names."""
    path = write_eagle3_draft(tmp_path / "draft", target[0], kind="llama", aux_layer_ids=AUX)
    _edit(path, lambda t: t.update({"layers.0.norm_extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"missing tensors"):
        load_eagle3_draft(path, target[2], torch.float32, TORCH)
