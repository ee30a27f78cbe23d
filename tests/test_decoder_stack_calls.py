"""DecoderStack's calls by name (torch.classes.eaglet.DecoderStack): each method takes its
arguments as keywords and hands them, gathered into its structs, to the checks it runs before any
tile-layout kernel. So this runs wherever the kernels build, with a tile GEMM or without; the stack's
results are tests/test_decoder_stack.py's."""

import pytest
import torch

from eaglet import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are unavailable")

HIDDEN, VOCAB, ROWS, WIDTH = 8, 16, 3, 12


def _empty_stack() -> torch.ScriptObject:
    return torch.classes.eaglet.DecoderStack(
        hidden_size=HIDDEN, num_heads=2, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, kv_lora_rank=16,
        q_lora_rank=0, rope_interleave=False, rms_norm_eps=1e-6, softmax_scale=0.5, num_experts_per_tok=0, n_group=1,
        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
    )


def _midlayer_weights() -> dict[str, torch.Tensor]:
    """An EAGLE-3 midlayer's weights by role, zero (only names and shapes matter here)."""
    names = ("input_norm", "post_norm", "kv_a_norm", "hidden_norm", "first", "q_proj", "w_uk", "w_uv_t", "o_proj", "mlp_w13",
             "mlp_w2")
    return {name: torch.zeros(1) for name in names}


def _stack() -> torch.ScriptObject:
    """A one-layer EAGLE-3 midlayer stack."""
    stack = _empty_stack()
    stack.add_layer(_midlayer_weights(), mlp_inter=4, expert_inter=0)
    return stack


def _with_head(stack: torch.ScriptObject) -> torch.ScriptObject:
    stack.set_draft_head(
        fc=None, fc_out=HIDDEN, embed=torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16), norm_weight=torch.ones(HIDDEN),
        norm_eps=1e-6, lm_head=torch.zeros(1), vocab=VOCAB, lm_head_bias=None, d2t=torch.zeros(VOCAB, dtype=torch.long),
        norm_output=False,
    )
    return stack


def _attention(tokens: int) -> dict[str, torch.Tensor | None]:
    longs = torch.zeros(tokens, dtype=torch.long)
    return {"kv": torch.zeros(1, 4, 20), "out_cache_loc": longs, "slots": longs.view(1, -1), "kv_lens": torch.tensor([tokens]),
            "token_starts": torch.tensor([0, tokens]), "custom_mask": None}


def _round(state_token: int = 1, prefix: int = 2) -> dict[str, torch.Tensor | int]:
    """A drafting round of two requests in rows 0 and 2 of the worker's state tables."""
    return {"roots": torch.tensor([5, 6]), "state_rows": torch.tensor([0, 2]), "prefix": torch.tensor([prefix, 1]),
            "state_tokens": torch.full((ROWS, 2), state_token), "state_hidden": torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16),
            "rope_table": torch.zeros(WIDTH, 2, 2, dtype=torch.bfloat16), "kv": torch.zeros(1, 4, 20),
            "req_to_token": torch.arange(ROWS * WIDTH).view(ROWS, WIDTH), "steps": 3}


def test_add_layer_takes_its_sizes_by_name():
    stack = _empty_stack()
    with pytest.raises(RuntimeError, match="a layer needs a dense MLP or experts"):
        stack.add_layer(_midlayer_weights(), mlp_inter=0, expert_inter=0)
    stack.add_layer(_midlayer_weights(), mlp_inter=4, expert_inter=0)
    assert stack.num_layers() == 1


def test_add_layer_checks_its_quantized_roles():
    """A role given as codes and scales needs a known format and a group; a layer's routed experts
    are all tile copies or all quantized."""
    quantized = _midlayer_weights() | {"o_proj_codes": torch.zeros(1), "o_proj_scales": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="quantized matrix format 'int4', 'int8' or 'fp8', got 'int3'"):
        _empty_stack().add_layer(quantized, mlp_inter=4, expert_inter=0, quant_format="int3", quant_group=32)
    with pytest.raises(RuntimeError, match="o_proj is quantized: quant_group > 0"):
        _empty_stack().add_layer(quantized, mlp_inter=4, expert_inter=0, quant_format="int4")
    moe = _midlayer_weights() | {"router_weight": torch.zeros(1), "router_bias": torch.zeros(1), "experts_w13": torch.zeros(1),
                                 "experts_w2_codes": torch.zeros(1), "experts_w2_scales": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="routed experts quantized all alike or not at all"):
        _empty_stack().add_layer(moe, mlp_inter=0, expert_inter=4, quant_format="int4", quant_group=32)
    stack = _empty_stack()
    stack.add_layer(quantized, mlp_inter=4, expert_inter=0, quant_format="int8", quant_group=32, int8_activations=True)
    assert stack.num_layers() == 1


def test_forwards_check_their_named_inputs():
    stack = _stack()
    hidden = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=rf"DecoderStack: bfloat16 hidden \[T, {HIDDEN}\]"):
        stack.forward(hidden=hidden.float(), cos=hidden, sin=hidden, capture_layers=[], **_attention(2))
    with pytest.raises(RuntimeError, match=r"DecoderStack: cache pool \[1, slots, L \+ R\]"):
        stack.forward(hidden=hidden, cos=hidden, sin=hidden, capture_layers=[], **(_attention(2) | {"kv": torch.zeros(2, 4, 20)}))
    with pytest.raises(RuntimeError, match="forward_eagle3: emb and hidden differ in shape"):
        stack.forward_eagle3(emb=hidden[:1], hidden=hidden, cos=hidden, sin=hidden, **_attention(2))


@pytest.mark.parametrize("call", ["extend_proposals", "draft_chain", "draft_tree"])
def test_drafting_needs_the_draft_head(call):
    arguments = {
        "extend_proposals": {"ids": torch.zeros(2, dtype=torch.long), "features": torch.zeros(2, 4), "feature_rows": None,
                             "positions": torch.zeros(2, dtype=torch.long), "rope_table": torch.zeros(4, 2, 2),
                             "logits_rows": torch.zeros(1, dtype=torch.long), "k": 1, "state_rows": torch.zeros(1, dtype=torch.long),
                             "state_tokens": torch.zeros(ROWS, 1, dtype=torch.long), "state_logprobs": torch.zeros(ROWS, 1),
                             "state_hidden": torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16), **_attention(2)},
        "draft_chain": _round() | {"final_ids": None},
        "draft_tree": _round() | {"state_logprobs": torch.zeros(ROWS, 2), "k": 2, "num_nodes": 4},
    }[call]
    with pytest.raises(RuntimeError, match=rf"DecoderStack.{call}: no draft head \(set_draft_head\)"):
        getattr(_stack(), call)(**arguments)


def test_draft_chain_checks_its_named_round():
    stack = _with_head(_stack())
    with pytest.raises(RuntimeError, match=f"draft_chain: token id {VOCAB} out of range"):
        stack.draft_chain(**_round(state_token=VOCAB), final_ids=None)
    with pytest.raises(RuntimeError, match=r"draft_chain: int64 final_ids \[B, S\]"):
        stack.draft_chain(**_round(), final_ids=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="draft_chain: req_to_token or rope_table too short for 3 steps"):
        stack.draft_chain(**_round(prefix=WIDTH), final_ids=None)
    with pytest.raises(RuntimeError, match="draft_chain: a negative prefix"):
        stack.draft_chain(**_round(prefix=-1), final_ids=None)


def test_draft_tree_checks_its_named_round():
    stack = _with_head(_stack())
    tree = {"state_logprobs": torch.zeros(ROWS, 2), "num_nodes": 4}
    with pytest.raises(RuntimeError, match="draft_tree: int64 state_tokens and float32 state_logprobs"):
        stack.draft_tree(**_round(), **tree, k=3)
    with pytest.raises(RuntimeError, match="draft_tree: req_to_token or rope_table too short"):
        stack.draft_tree(**_round(prefix=WIDTH), **tree, k=2)
    with pytest.raises(RuntimeError, match="draft_tree: 12 nodes from 10 candidates"):
        stack.draft_tree(**_round(), state_logprobs=tree["state_logprobs"], num_nodes=12, k=2)


def test_extend_proposals_checks_its_named_inputs():
    stack = _with_head(_stack())
    inputs = {"ids": torch.zeros(2, dtype=torch.long), "features": torch.zeros(2, 4), "feature_rows": None,
              "positions": torch.zeros(2, dtype=torch.long), "rope_table": torch.zeros(4, 2, 2),
              "logits_rows": torch.zeros(1, dtype=torch.long), "k": 2, "state_rows": torch.zeros(1, dtype=torch.long),
              "state_tokens": torch.zeros(ROWS, 2, dtype=torch.long), "state_logprobs": torch.zeros(ROWS, 2),
              "state_hidden": torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16), **_attention(2)}
    with pytest.raises(RuntimeError, match="extend_proposals: int64 ids"):
        stack.extend_proposals(**(inputs | {"ids": torch.zeros(2)}))
    with pytest.raises(RuntimeError, match=r"extend_proposals: features \[T, F\]"):
        stack.extend_proposals(**(inputs | {"features": torch.zeros(3, 4)}))
    with pytest.raises(RuntimeError, match="extend_proposals: contiguous state tables"):
        stack.extend_proposals(**(inputs | {"k": 3}))
    with pytest.raises(IndexError, match="out of range"):  # feature rows past the features
        stack.extend_proposals(**(inputs | {"feature_rows": torch.tensor([0, 5])}))
    with pytest.raises(RuntimeError, match="extend_proposals: the draft head has no fc tile copy"):
        stack.extend_proposals(**inputs)
