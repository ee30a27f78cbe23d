"""eaglet's DeepSeek-V3 runtime against transformers 5.24 on tiny random published-format checkpoints."""

import pytest
import torch
from eaglet.testing.checkpoints import load_reference_deepseek_v3, write_deepseek_v3_checkpoint
from runtime_utils import greedy, prompt_logits

from eaglet import LLM

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

VARIANTS = {
    "q_lora-dense1-group2": {},
    "no_q_lora-yarn-dense0": {"q_lora_rank": None, "rope_scaling": YARN, "first_k_dense_replace": 0},
    "groups4-topk_group2-dense2": {
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 3,
        "first_k_dense_replace": 2,
        "num_hidden_layers": 4,
    },
    "yarn-mscale0.707-no_norm_topk": {
        "rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        "norm_topk_prob": False,
        "rope_theta": 50000.0,
    },
}

PROMPTS = [[3, 17, 33, 2, 99, 100, 7, 45], list(range(10, 79)), [200, 5], [77] * 13]


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_deepseek_v3_checkpoint(path, VARIANTS[request.param], seed=1, num_shards=2)
    return path


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "pytorch-ops"])
def test_prompt_logits_match_transformers(checkpoint, cpu_kernels):
    llm = LLM(str(checkpoint), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels)
    reference = load_reference_deepseek_v3(checkpoint)
    ours = prompt_logits(llm, [{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "pytorch-ops"])
def test_greedy_tokens_match_transformers(checkpoint, cpu_kernels):
    llm = LLM(str(checkpoint), dtype="float32", show_progress=False, cpu_kernels=cpu_kernels)
    reference = load_reference_deepseek_v3(checkpoint)
    prompts = PROMPTS[:2]  # transformers' generate is the slow part; logits cover all prompts
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(32))
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out.token_ids == expected
        assert out.finish_reason == "length"


def test_captured_layers_are_the_residual_stream_after_each_layer(checkpoint):
    """EAGLE-3 aux ids mean "output of layer id": transformers' hidden_states[id + 1]."""
    llm = LLM(str(checkpoint), dtype="float32", show_progress=False)
    reference = load_reference_deepseek_v3(checkpoint)
    prompt = PROMPTS[0]
    engine = llm.engine
    from eaglet.executor.request import Request
    from eaglet.sampling_params import SamplingParams

    req = Request("aux", prompt, SamplingParams(max_new_tokens=1))
    req.req_pool_idx = engine.cache.alloc_row()
    try:
        _, out = engine.runner.extend([req], [len(prompt)], capture_layers=(1, 0))
    finally:
        engine.cache.free_row(req.req_pool_idx)
    with torch.no_grad():
        hidden_states = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden_states[2][0], hidden_states[1][0]], dim=-1)
    torch.testing.assert_close(out.aux_hidden_states, expected, atol=1e-4, rtol=0)
