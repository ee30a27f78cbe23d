"""EAGLE-3 draft training (eaglet/train/): the training forward against the inference draft, the
exported checkpoint against the published format, multimodal capture, resume, and a real accept
length gain measured by eaglet's own speculative decoding."""

from __future__ import annotations

import json
import random

import pytest
import torch
from eaglet.testing.checkpoints import write_deepseek_v3_checkpoint, write_kimi_k25_checkpoint
from eaglet.testing.images import make_image
from safetensors.torch import load_file
from eaglet.testing.echo_checkpoints import echo_text_target

from eaglet import LLM
from eaglet.backends import torch_backend
from eaglet.cli import main as cli_main
from eaglet.layers.norms import RMSNorm
from eaglet.models.eagle3 import Eagle3Draft, load_eagle3_draft
from eaglet.models.registry import load_model
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.runtime.kv_cache import KVCacheManager
from eaglet.train import TrainDraftConfig, train_draft
from eaglet.train.capture import CapturedSequence, capture_features, regenerate_responses
from eaglet.train.data import PromptRecord, load_prompts
from eaglet.train.export import default_aux_layer_ids, draft_config_dict, export_draft, new_draft
from eaglet.train.trainer import collate
from eaglet.train.ttt import restore_inference_weights, ttt_forward, ttt_loss
from eaglet.train.vocab import build_hot_vocab

TORCH = torch_backend()

AUX = (0, 1, 2)  # the tiny targets have 3 layers
TTT_STEPS = 3


@pytest.fixture(autouse=True)
def _one_thread():
    """The models here are tiny: one intra-op thread is fastest, and on a shared CPU two threads
    waiting on each other can be 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def text_target(tmp_path_factory):
    path = write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("target"), seed=5, num_shards=1)
    model, config = load_model(path, "float32", backend=TORCH, show_progress=False)
    return path, model, config


def _random_draft(target, kind: str, draft_vocab: int = 96, seed: int = 1):
    """A fresh trainable draft with non-trivial norms (training starts them at 1)."""
    _, model, config = target
    vocab = build_hot_vocab([[t] for t in range(0, config.text.vocab_size, 2)], config.text.vocab_size, draft_vocab)
    cfg = draft_config_dict(config, kind, draft_vocab, AUX, torch.float32)
    draft, _ = new_draft(cfg, config, model.embed_tokens, model.lm_head, vocab, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
    return draft, cfg, vocab


def _sequence(length: int, prompt_len: int, feature_dim: int, hidden: int, draft_vocab: int, seed: int) -> CapturedSequence:
    g = torch.Generator().manual_seed(seed)
    return CapturedSequence(
        input_ids=torch.randint(2, 200, (length,), generator=g),
        prompt_len=prompt_len,
        features=torch.randn(length - 1, feature_dim, generator=g),
        image_rows=torch.zeros(0, dtype=torch.long),
        image_embeds=torch.zeros(0, hidden),
        target_logits=torch.randn(length - prompt_len, draft_vocab, generator=g),
        target_in_vocab=torch.ones(length - prompt_len, dtype=torch.bool),
    )


def _inference_unroll(draft: Eagle3Draft, seq: CapturedSequence, steps: int) -> list[torch.Tensor]:
    """Logits of the loaded draft's inference path at every row, step by step over the paged cache:
    step 0 is the draft extend (causal); step k puts row t's token at row index k*N + t, position
    t + k, seeing row indices 0..t (step 0) and its own chain (as EagleWorker's draft steps)."""
    n = seq.num_rows
    cache = KVCacheManager(
        num_layers=1, kv_cache_dim=8, num_blocks=64, block_size=8, max_requests=2, max_context_len=256, dtype=torch.float32,
        ops=TORCH.cache,
    )
    pool = cache.add_pool(draft.make_kv_pool(cache.num_slots, torch.float32, "cpu"))
    backend = draft.make_attention(cache, pool)
    row = cache.alloc_row()
    slots = cache.grow(row, n * steps)
    ids = seq.input_ids[1:]
    outputs = []
    hidden = seq.features
    for step in range(steps):
        rows = torch.arange(n)
        valid = rows + step < n  # the token t+1+step exists
        mask = None
        if step:
            mask = torch.zeros(n, n * (step + 1), dtype=torch.bool)
            mask[:, :n] = torch.arange(n)[None, :] <= rows[:, None]
            for k in range(1, step + 1):
                mask[rows, k * n + rows] = True
        batch = ForwardBatch.build(
            input_ids=torch.where(valid, ids[(rows + step).clamp(max=n - 1)], 0),
            req_pool_indices=[row],
            extend_prefix_lens=[step * n],
            extend_seq_lens=[n],
            out_cache_loc=slots[step * n : (step + 1) * n],
            positions=rows + step,
            mode=ForwardMode.EXTEND if step == 0 else ForwardMode.VERIFY,
            logits_indices=rows,
            custom_mask=mask,
        )
        with torch.inference_mode():
            out = draft(batch, backend, hidden, hidden_is_target_features=step == 0)
        outputs.append(out.logits)
        hidden = out.hidden_out
    return outputs


@pytest.mark.parametrize("kind", ["mla", "llama"])
def test_training_forward_equals_inference_draft(text_target, tmp_path, kind):
    """ttt_forward's step k (dense TTT mask, autograd on) gives the logits the exported draft, loaded
    as serving loads it, gives at draft step k over the paged cache (step 0 = the causal extend)."""
    _, model, config = text_target
    draft, cfg, _ = _random_draft(text_target, kind)
    hidden = config.text.hidden_size
    sequences = [_sequence(14, 5, 3 * hidden, hidden, 96, seed=3), _sequence(9, 3, 3 * hidden, hidden, 96, seed=4)]
    batch = collate(sequences, draft.embed, TTT_STEPS)
    training = ttt_forward(draft, batch, TTT_STEPS)
    assert training[0].requires_grad

    export_draft(draft, cfg, tmp_path / "draft", torch.float32)
    loaded, _ = load_eagle3_draft(tmp_path / "draft", config, torch.float32, TORCH)
    loaded.share_target_weights(model.embed_tokens, model.lm_head)
    for i, seq in enumerate(sequences):
        inference = _inference_unroll(loaded, seq, TTT_STEPS)
        for step in range(TTT_STEPS):
            rows = seq.num_rows - step  # rows whose input token exists at this step
            torch.testing.assert_close(training[step][i, :rows], inference[step][:rows], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["mla", "llama"])
def test_every_draft_parameter_gets_a_gradient(text_target, kind):
    """Also after the inference-time fused matrices were derived (process_weights_after_loading):
    the training forward must not read a detached copy of any parameter."""
    _, _, config = text_target
    draft, _, _ = _random_draft(text_target, kind)
    restore_inference_weights(draft)
    hidden = config.text.hidden_size
    batch = collate([_sequence(12, 4, 3 * hidden, hidden, 96, seed=5)], draft.embed, TTT_STEPS)
    ttt_loss(ttt_forward(draft, batch, TTT_STEPS), batch).loss.backward()
    missing = [name for name, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize("kind", ["mla", "llama"])
def test_export_has_the_published_names_shapes_dtypes_and_keys(text_target, tmp_path, kind):
    """Tensor names / shapes / dtypes and config keys of shared/reference/eagle3.md, loadable by
    load_eagle3_draft with every tensor round-tripped."""
    _, model, config = text_target
    draft, cfg, vocab = _random_draft(text_target, kind)
    path = export_draft(draft, cfg, tmp_path / "draft", torch.bfloat16)
    tensors = load_file(path / "model.safetensors")
    written = json.loads((path / "config.json").read_text())
    text = config.text
    hidden, vocab_size, draft_vocab = text.hidden_size, text.vocab_size, 96
    m = "midlayer."
    expected = {
        "fc.weight": [hidden, 3 * hidden],
        m + "hidden_norm.weight": [hidden],
        m + "input_layernorm.weight": [hidden],
        m + "post_attention_layernorm.weight": [hidden],
        "norm.weight": [hidden],
        m + "mlp.gate_proj.weight": [written["intermediate_size"], hidden],
        m + "mlp.up_proj.weight": [written["intermediate_size"], hidden],
        m + "mlp.down_proj.weight": [hidden, written["intermediate_size"]],
        "lm_head.weight": [draft_vocab, hidden],
        "d2t": [draft_vocab],
        "t2d": [vocab_size],
    }
    keys = {
        "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
        "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "eagle_config",
    }  # fmt: skip
    if kind == "llama":
        heads, kv_heads, head_dim = written["num_attention_heads"], written["num_key_value_heads"], written["head_dim"]
        expected |= {
            m + "self_attn.q_proj.weight": [heads * head_dim, 2 * hidden],
            m + "self_attn.k_proj.weight": [kv_heads * head_dim, 2 * hidden],
            m + "self_attn.v_proj.weight": [kv_heads * head_dim, 2 * hidden],
            m + "self_attn.o_proj.weight": [hidden, heads * head_dim],
        }
        keys |= {"num_key_value_heads", "head_dim", "rope_scaling"}
        assert written["architectures"] == ["LlamaForCausalLMEagle3"] and written["model_type"] == "llama"
    else:
        heads = written["num_attention_heads"]
        qk = written["qk_nope_head_dim"] + written["qk_rope_head_dim"]
        latent = written["kv_lora_rank"]
        expected |= {
            m + "self_attn.q_a_proj.weight": [written["q_lora_rank"], 2 * hidden],
            m + "self_attn.q_a_layernorm.weight": [written["q_lora_rank"]],
            m + "self_attn.q_b_proj.weight": [heads * qk, written["q_lora_rank"]],
            m + "self_attn.kv_a_proj_with_mqa.weight": [latent + written["qk_rope_head_dim"], 2 * hidden],
            m + "self_attn.kv_a_layernorm.weight": [latent],
            m + "self_attn.kv_b_proj.weight": [heads * (written["qk_nope_head_dim"] + written["v_head_dim"]), latent],
            m + "self_attn.o_proj.weight": [hidden, heads * written["v_head_dim"]],
        }
        keys |= {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
        assert written["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and written["model_type"] == "deepseek_v3"
    assert {name: list(t.shape) for name, t in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for name, t in tensors.items() if name not in ("d2t", "t2d"))
    assert keys <= set(written)
    assert written["num_hidden_layers"] == 1 and written["draft_vocab_size"] == draft_vocab
    assert written["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(AUX), "use_aux_hidden_state": True}
    assert "embed_tokens.weight" not in tensors  # shared with the target
    # d2t offsets map draft ids onto the hot vocabulary; t2d marks exactly those ids.
    assert torch.equal(torch.arange(draft_vocab) + tensors["d2t"], vocab.used_ids)
    assert torch.equal(tensors["t2d"].nonzero().flatten(), vocab.used_ids)

    loaded, loaded_config = load_eagle3_draft(path, config, torch.bfloat16, TORCH)
    assert loaded_config.kind == kind and loaded_config.aux_layer_ids == AUX
    for name, tensor in loaded.checkpoint_weights().items():
        assert torch.equal(tensor, tensors[name]), name


def test_hot_vocab_takes_the_most_frequent_response_tokens():
    vocab = build_hot_vocab([[7, 7, 7, 3, 3, 9], [9, 9, 9, 9, 1]], vocab_size=12, draft_vocab_size=3)
    assert vocab.used_ids.tolist() == [3, 7, 9]  # counts 9:5, 7:3, 3:2, 1:1; sorted by id
    assert vocab.d2t.tolist() == [3, 6, 7]
    assert vocab.t2d.nonzero().flatten().tolist() == [3, 7, 9]
    # Fewer distinct tokens than draft ids: the lowest unused ids fill the rest.
    assert build_hot_vocab([[5, 5]], vocab_size=8, draft_vocab_size=3).used_ids.tolist() == [0, 1, 5]
    assert default_aux_layer_ids(61) == (1, 29, 57) and default_aux_layer_ids(3) == (0, 1, 2)


def test_prompt_formats(tmp_path):
    (tmp_path / "p.jsonl").write_text(
        "\n".join(
            json.dumps(obj)
            for obj in (
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"}]},
                {"prompt": "describe", "images": ["cat.png"]},
                {"prompt_token_ids": [4, 5, 6]},
            )
        )
        + "\n\n# a comment\n"
    )
    records = load_prompts(tmp_path / "p.jsonl")
    assert records[0].messages == [{"role": "user", "content": "hi"}]  # the old response is regenerated
    assert records[1].images == [str(tmp_path / "cat.png")]
    assert records[1].messages[0]["content"][0] == {"type": "image"}
    assert records[2].to_request(None) == {"prompt_token_ids": [4, 5, 6]}
    with pytest.raises(ValueError, match="exactly one of"):
        PromptRecord.from_json({"prompt": "a", "prompt_token_ids": [1]})


def test_multimodal_capture_uses_the_merged_image_features(tmp_path):
    """Captured draft input embeddings at image rows are the image features the target merged
    there, and a ragged batch of requests captures what each request captures alone."""
    target = write_kimi_k25_checkpoint(tmp_path / "kimi", {"max_position_embeddings": 256}, seed=2, with_tokenizer=True)
    for i, size in enumerate(((28, 28), (42, 28))):
        make_image(*size, seed=i).save(tmp_path / f"img{i}.png")
    llm = LLM(str(target), dtype="float32", show_progress=False, enable_prefix_caching=False)
    engine = llm.engine
    records = load_prompts(
        [
            {"prompt": "what is in the picture", "images": [str(tmp_path / "img0.png")]},
            {"prompt": "plain text"},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "image"}]}],
             "images": [str(tmp_path / "img1.png")]},
        ]
    )  # fmt: skip
    samples = regenerate_responses(llm, [r.to_request(llm.tokenizer) for r in records], max_new_tokens=4)
    vocab = build_hot_vocab([s.response_ids for s in samples], engine.model_config.text.vocab_size, 64)
    together = capture_features(engine, samples, AUX, vocab, max_batch_tokens=4096)
    alone = [capture_features(engine, [s], AUX, vocab, max_batch_tokens=4096)[0] for s in samples]
    image_token = engine.model_config.image_token_id
    assert [seq.image_rows.numel() > 0 for seq in together] == [True, False, True]
    for sample, seq, single in zip(samples, together, alone):
        prompt_ids, mm = engine._prepare_prompt(sample.request)
        assert seq.input_ids.tolist() == prompt_ids + sample.response_ids
        assert seq.features.shape == (len(prompt_ids) + len(sample.response_ids) - 1, 3 * engine.model_config.text.hidden_size)
        for name in ("features", "image_embeds", "target_logits"):
            torch.testing.assert_close(getattr(seq, name), getattr(single, name), rtol=1e-5, atol=1e-5)
        assert torch.equal(seq.image_rows, single.image_rows)
        if mm is None:
            assert seq.image_rows.numel() == 0
            continue
        # Draft row r reads token r+1: the image rows are the placeholder positions minus one.
        assert torch.equal(seq.image_rows + 1, mm.placeholder_positions)
        assert (seq.input_ids[seq.image_rows + 1] == image_token).all()
        features = engine.model.encode_images(mm.pixel_values, mm.grid_thws)
        torch.testing.assert_close(seq.image_embeds, features, rtol=1e-5, atol=1e-5)
        # The training batch feeds exactly those embeddings to the draft at the image rows.
        batch = collate([seq], engine.model.embed_tokens, TTT_STEPS)
        torch.testing.assert_close(batch.input_embeds[0, seq.image_rows], features, rtol=1e-5, atol=1e-5)


def _echo_prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, 10) for _ in range(8)]} for _ in range(count)]


@pytest.fixture(scope="module")
def echo_target(tmp_path_factory):
    """The echo target at a low dial repeats the last prompt token: a pattern a draft can learn from
    a few dozen prompts over an 8-token alphabet and apply to unseen prompts over the same alphabet."""
    return echo_text_target(tmp_path_factory.mktemp("echo"), 0.5)


@pytest.mark.parametrize("kind", ["mla", "llama"])
def test_training_raises_the_measured_accept_length(echo_target, tmp_path, kind):
    config = TrainDraftConfig(
        target=str(echo_target),
        prompts=_echo_prompts(40, seed=0),
        output_dir=str(tmp_path / "draft"),
        architecture=kind,
        draft_vocab_size=64,
        ttt_length=TTT_STEPS,
        learning_rate=3e-3,
        max_steps=60,
        batch_size=8,
        warmup_ratio=0.05,
        max_new_tokens=16,
        dtype="float32",
        num_eval_prompts=8,
        eval_max_new_tokens=16,
        evaluate_initial_draft=True,
        show_progress=False,
    )
    result = train_draft(config)
    initial = result.initial_eval_metrics["accept_length"]
    trained = result.eval_metrics["accept_length"]
    print(f"{kind}: accept length: untrained {initial:.3f}, trained {trained:.3f} after {result.num_steps} steps "
          f"({result.train_seconds:.1f} s, {result.tokens_per_second:.0f} tokens/s), step acc {result.step_accuracies}")
    assert result.num_steps == 60 and result.eval_metrics["num_verify_steps"] > 0
    assert trained >= initial + 1.0
    assert result.step_accuracies[0] > 0.5
    _, target_config = load_model(echo_target, "float32", backend=TORCH, show_progress=False)
    _, loaded_config = load_eagle3_draft(tmp_path / "draft", target_config, torch.float32, TORCH)
    assert loaded_config.kind == kind


def test_resume_continues_exactly(echo_target, tmp_path):
    """Stopping after 3 of 6 steps and resuming gives the parameters of 6 steps straight through
    (the straight run goes through the `eaglet train-draft` command)."""
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in _echo_prompts(24, seed=1)) + "\n")
    common = dict(
        target=str(echo_target), prompts=str(tmp_path / "prompts.jsonl"), architecture="llama", draft_vocab_size=32,
        ttt_length=TTT_STEPS, learning_rate=1e-3, max_steps=6, batch_size=4, max_new_tokens=8, dtype="float32",
        cache_dir=str(tmp_path / "cache"), show_progress=False, seed=3,
    )  # fmt: skip
    first = train_draft(TrainDraftConfig(output_dir=str(tmp_path / "resumed"), max_steps_this_run=3, **common))
    assert first.num_steps == 3
    assert len(list((tmp_path / "cache").glob("features-*/chunk-*.pt"))) == 1
    halfway = load_file(tmp_path / "resumed" / "model.safetensors")
    second = train_draft(TrainDraftConfig(output_dir=str(tmp_path / "resumed"), **common))
    assert second.num_steps == 6
    code = cli_main([
        "train-draft", "--model-path", str(echo_target), "--prompts", str(tmp_path / "prompts.jsonl"),
        "--output-dir", str(tmp_path / "straight"), "--draft-arch", "llama", "--draft-vocab-size", "32",
        "--ttt-length", str(TTT_STEPS), "--lr", "1e-3", "--max-steps", "6", "--batch-size", "4",
        "--max-new-tokens", "8", "--dtype", "float32", "--seed", "3", "--quiet",
    ])  # fmt: skip
    assert code == 0
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    assert resumed.keys() == straight.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(halfway["fc.weight"], straight["fc.weight"])  # the last 3 steps did train
