"""Bad configs, bad checkpoints and bad requests: each a precise exception, nothing half-done."""

import json
import shutil

import pytest
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint
from runtime_utils import greedy
from safetensors.torch import load_file, save_file

from eaglet import LLM, SamplingParams
from eaglet.errors import CheckpointError, ConfigError, InvalidRequestError


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    write_deepseek_v3_checkpoint(path, {"max_position_embeddings": 64}, seed=5, num_shards=2)
    return path


@pytest.fixture
def checkpoint(good_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, path)
    return path


@pytest.fixture(scope="module")
def llm(good_checkpoint):
    return LLM(str(good_checkpoint), dtype="float32", show_progress=False)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def shard_holding(path, name):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][name]


def rewrite_shard(path, name, fn):
    """Applies fn to the tensors of the shard holding `name` (and keeps the index consistent)."""
    shard = shard_holding(path, name)
    tensors = load_file(shard)
    tensors = fn(tensors)
    save_file(tensors, shard)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k != name or name in tensors}
    index["weight_map"].update({k: shard.name for k in tensors})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"hidden_size": None}, "missing required key 'hidden_size'"),
        ({"num_attention_heads": "four"}, "'num_attention_heads' must be int"),
        ({"kv_lora_rank": -4}, "'kv_lora_rank' must be positive"),
        ({"n_group": 3}, "must be divisible by n_group"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method='gptq' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"weight_block_size=None is not supported"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope type 'longrope' is not supported"),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim must be even"),
    ],
)
def test_malformed_config(checkpoint, change, message):
    edit_config(checkpoint, **change)
    with pytest.raises(ConfigError, match=message):
        LLM(str(checkpoint), dtype="float32", show_progress=False)


def test_config_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(str(checkpoint), show_progress=False)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        LLM(str(tmp_path / "nope"), show_progress=False)


def test_bad_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        LLM(str(checkpoint), dtype="int8", show_progress=False)


def test_missing_unexpected_and_misshaped_tensors_reported_together(checkpoint):
    missing = "model.layers.1.mlp.experts.3.up_proj.weight"
    misshaped = "model.layers.0.self_attn.kv_b_proj.weight"

    def drop(tensors):
        tensors.pop(missing)
        return tensors

    def shrink(tensors):
        tensors[misshaped] = tensors[misshaped][:-1].clone()
        return tensors

    rewrite_shard(checkpoint, missing, drop)
    rewrite_shard(checkpoint, misshaped, shrink)
    rewrite_shard(checkpoint, "lm_head.weight", lambda t: {**t, "model.layers.0.mlp.bogus.weight": t["lm_head.weight"].clone()})
    with pytest.raises(CheckpointError) as info:
        LLM(str(checkpoint), dtype="float32", show_progress=False)
    text = str(info.value)
    assert f"missing tensors (1): {missing}" in text
    assert "unexpected tensors (1): model.layers.0.mlp.bogus.weight" in text
    assert f"mis-shaped tensors (1): {misshaped}: checkpoint [63, 16], model expects [64, 16]" in text


def test_missing_shard_and_corrupt_shard(checkpoint):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    (checkpoint / first_shard).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        LLM(str(checkpoint), show_progress=False)
    (checkpoint / first_shard).unlink()
    with pytest.raises(CheckpointError, match="shards listed in the index are missing"):
        LLM(str(checkpoint), show_progress=False)


def test_no_weights_at_all(checkpoint):
    for f in checkpoint.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        LLM(str(checkpoint), show_progress=False)


@pytest.mark.parametrize(
    "request_, params, message",
    [
        ({"prompt_token_ids": list(range(60))}, greedy(8), "exceeds the context length 64"),
        ({"prompt_token_ids": list(range(70))}, greedy(1), "exceeds the context length 64"),
        ({"prompt_token_ids": [1, 2, 256]}, greedy(1), r"out of range \[0, 256\): \[256\]"),
        ({"prompt_token_ids": [1, -2]}, greedy(1), "out of range"),
        ({"prompt_token_ids": []}, greedy(1), "the prompt is empty"),
        ("hello", greedy(1), "has no tokenizer"),
        ({"prompt_token_ids": [1], "images": ["x"]}, greedy(1), "no vision tower"),
        ({"prompt_token_ids": [1], "extra": 1}, greedy(1), "unknown request fields"),
        (42, greedy(1), "a request is a string or a dict"),
    ],
)
def test_bad_requests(llm, request_, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, request_], params)
    # Nothing was queued or allocated, and the engine still serves.
    assert not llm.engine.has_unfinished()
    assert llm.engine.num_free_blocks() == llm.engine.cache.allocator.num_usable
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2))[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)
