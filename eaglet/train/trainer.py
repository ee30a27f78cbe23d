"""``train_draft``: regenerate responses, capture target features, train an EAGLE-3 draft with the
training-time-test unroll, export it, and measure its accept length with real speculative decoding.

Data order is a function of (seed, step) alone (epoch e visits the sequences in
``randperm(n, seed + e)`` order), so resuming from ``training_state.pt`` (draft, optimizer,
schedule, step) continues exactly where an uninterrupted run would be.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eaglet.api import LLM
from eaglet.models.eagle3 import Eagle3Draft
from eaglet.models.registry import resolve_dtype
from eaglet.train.capture import (
    CaptureCache,
    CapturedSequence,
    GeneratedSample,
    capture_features,
    regenerate_responses,
    request_fingerprint,
)
from eaglet.train.data import load_prompts
from eaglet.train.evaluate import measure_accept_length
from eaglet.train.export import default_aux_layer_ids, draft_config_dict, export_draft, new_draft
from eaglet.train.ttt import TTTBatch, restore_inference_weights, ttt_forward, ttt_loss
from eaglet.train.vocab import build_hot_vocab

logger = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"


@dataclass
class TrainDraftConfig:
    target: str  # target checkpoint directory
    prompts: str | Path | list[dict[str, Any]]  # JSONL path (eaglet/train/data.py) or its objects
    output_dir: str  # the exported draft (config.json + model.safetensors) and training_state.pt
    architecture: str = "mla"  # "mla" (Eagle3DeepseekV2ForCausalLM) or "llama" (LlamaForCausalLMEagle3)
    draft_vocab_size: int = 32000  # capped at the target's vocabulary
    aux_layer_ids: tuple[int, ...] | None = None  # "output of layer id"; default [1, N//2-1, N-4]
    draft_config_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. {"intermediate_size": 4096}
    ttt_length: int = 7
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.02  # of the total steps, linear from 0
    lr_schedule: str = "cosine"  # decay after warmup to 0: "cosine" or "linear"
    num_epochs: int = 1
    max_steps: int | None = None  # total optimizer steps (default: num_epochs over the data)
    max_steps_this_run: int | None = None  # stop (checkpointed) after this many steps in this call
    batch_size: int = 8  # sequences per step
    max_length: int = 2048  # prompt + response tokens kept per sequence
    grad_clip: float = 0.5
    seed: int = 0
    max_new_tokens: int = 256  # response length when regenerating
    temperature: float = 0.0  # 0: greedy responses
    dtype: str = "bfloat16"  # the target's dtype in the engine, and the exported draft's
    cache_dir: str | None = None  # responses + captured features on disk, reused across runs
    cache_chunk_size: int = 256  # captured sequences per file
    save_every: int = 0  # checkpoint training_state.pt every this many steps (0: only at the end)
    resume: bool = True  # continue from output_dir/training_state.pt when present
    num_eval_prompts: int = 0  # prompts held out of training to measure accept length on
    eval_max_new_tokens: int = 64
    evaluate_initial_draft: bool = False  # also measure the untrained draft (exported to output_dir/initial)
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    max_num_batched_tokens: int = 2048  # engine token budget, also per capture forward
    kv_cache_memory_gb: float = 2.0
    show_progress: bool = True


@dataclass
class TrainDraftResult:
    output_dir: Path
    num_steps: int  # optimizer steps done in total (including resumed ones)
    total_steps: int
    num_train_sequences: int
    final_loss: float  # mean over the last logged window
    step_accuracies: list[float]  # top-1 agreement per unroll step, last window
    train_seconds: float  # this call's training loop
    tokens_per_second: float
    eval_metrics: dict[str, Any] | None = None
    initial_eval_metrics: dict[str, Any] | None = None


@dataclass
class PreparedData:
    llm: LLM
    train_samples: list[GeneratedSample]
    eval_requests: list[dict[str, Any]]
    responses_key: str


def collate(
    sequences: list[CapturedSequence], embed: Callable[[torch.Tensor], torch.Tensor], ttt_length: int
) -> TTTBatch:
    """Pads sequences to the longest; rows past a sequence's end carry no loss (see ttt.py for rows)."""
    batch_size = len(sequences)
    rows = max(s.num_rows for s in sequences)
    width = rows + ttt_length - 1
    feature_dim = sequences[0].features.shape[-1]
    draft_vocab = sequences[0].target_logits.shape[-1]
    features = torch.zeros(batch_size, rows, feature_dim)
    token_ids = torch.zeros(batch_size, width, dtype=torch.long)
    target_probs = torch.zeros(batch_size, width, draft_vocab)
    loss_mask = torch.zeros(batch_size, width, dtype=torch.bool)
    for i, seq in enumerate(sequences):
        n = seq.num_rows
        features[i, :n] = seq.features.float()
        token_ids[i, :n] = seq.input_ids[1:]
        # Row r holds the target at position r+1; the stored logits start at position P-1.
        first = seq.prompt_len - 2
        skip = max(0, -first)
        probs = seq.target_logits[skip:].float().softmax(dim=-1)
        target_probs[i, first + skip : first + skip + probs.shape[0]] = probs
        loss_mask[i, first + skip : first + skip + probs.shape[0]] = seq.target_in_vocab[skip:]
    with torch.no_grad():
        input_embeds = embed(token_ids).float()
        for i, seq in enumerate(sequences):
            if seq.image_rows.numel():
                input_embeds[i, seq.image_rows] = seq.image_embeds.float()
    return TTTBatch(features, input_embeds, target_probs, loss_mask)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Linear warmup from 0 over warmup_steps, then cosine or linear decay to 0 at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"lr_schedule must be 'cosine' or 'linear', got {schedule!r}")


def batch_indices(step: int, num_sequences: int, batch_size: int, seed: int) -> list[int]:
    """The sequences of optimizer step ``step``: epoch e visits randperm(n, seed + e) in order."""
    steps_per_epoch = math.ceil(num_sequences / batch_size)
    epoch, index = divmod(step, steps_per_epoch)
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed + epoch))
    return order[index * batch_size : (index + 1) * batch_size].tolist()


def prepare_data(config: TrainDraftConfig) -> PreparedData:
    """Loads the target, splits off the held-out prompts, and regenerates the training responses."""
    records = load_prompts(config.prompts)
    llm = LLM(
        model=config.target,
        dtype=config.dtype,
        enable_prefix_caching=False,
        show_progress=config.show_progress,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory_gb=config.kv_cache_memory_gb,
    )
    requests = [record.to_request(llm.tokenizer) for record in records]
    if config.num_eval_prompts >= len(requests):
        raise ValueError(
            f"num_eval_prompts {config.num_eval_prompts} leaves none of the {len(requests)} prompts to train on"
        )
    order = torch.randperm(len(requests), generator=torch.Generator().manual_seed(config.seed)).tolist()
    eval_requests = [requests[i] for i in order[: config.num_eval_prompts]]
    train_requests = [requests[i] for i in sorted(order[config.num_eval_prompts :])]
    responses_key = CaptureCache.key(
        target=str(Path(config.target).resolve()),
        dtype=config.dtype,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        seed=config.seed,
        prompts=[request_fingerprint(r) for r in train_requests],
    )
    cache = CaptureCache(config.cache_dir, config.cache_chunk_size) if config.cache_dir else None
    responses = cache.load_responses(responses_key) if cache else None
    if responses is None:
        logger.info("regenerating %d responses with the target", len(train_requests))
        samples = regenerate_responses(llm, train_requests, config.max_new_tokens, config.temperature, config.seed)
        if cache:
            cache.save_responses(responses_key, [s.response_ids for s in samples])
    else:
        samples = [GeneratedSample(r, ids) for r, ids in zip(train_requests, responses)]
    return PreparedData(llm, samples, eval_requests, responses_key)


def _truncate(samples: list[GeneratedSample], max_length: int) -> list[GeneratedSample]:
    """Responses cut so prompt + response fits max_length; samples with no response token left dropped."""
    kept = []
    for sample in samples:
        room = max_length - len(sample.request["prompt_token_ids"])
        if room > 0 and sample.response_ids:
            kept.append(GeneratedSample(sample.request, sample.response_ids[:room]))
    return kept


def train_draft(config: TrainDraftConfig) -> TrainDraftResult:
    """The whole pipeline (module docstring); see TrainDraftConfig for the settings."""
    if config.architecture not in ("mla", "llama"):
        raise ValueError(f"architecture must be 'mla' or 'llama', got {config.architecture!r}")
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_data(config)
    llm = data.llm
    engine = llm.engine
    target_config = engine.model_config
    text = target_config.text
    samples = _truncate(data.train_samples, config.max_length)
    if not samples:
        raise ValueError("no training sequence has a response token (check max_length and max_new_tokens)")
    draft_vocab_size = min(config.draft_vocab_size, text.vocab_size)
    vocab = build_hot_vocab((s.response_ids for s in samples), text.vocab_size, draft_vocab_size)
    aux = tuple(config.aux_layer_ids or default_aux_layer_ids(text.num_hidden_layers))
    cache = CaptureCache(config.cache_dir, config.cache_chunk_size) if config.cache_dir else None
    features_key = CaptureCache.key(
        responses=data.responses_key, aux=list(aux), used=vocab.used_ids.tolist(), max_length=config.max_length
    )
    sequences = cache.load_features(features_key) if cache else None
    if sequences is None:
        logger.info("capturing target features of %d sequences", len(samples))
        sequences = capture_features(engine, samples, aux, vocab, config.max_num_batched_tokens)
        if cache:
            cache.save_features(features_key, sequences)
    export_dtype = resolve_dtype(config.dtype)
    config_dict = draft_config_dict(
        target_config, config.architecture, vocab.draft_vocab_size, aux, export_dtype, config.draft_config_overrides
    )
    lm_head = getattr(engine.model, "language_model", engine.model).lm_head
    draft, _ = new_draft(config_dict, target_config, engine.model.embed_tokens, lm_head, vocab, config.seed)
    eval_requests = data.eval_requests
    del llm, engine, data  # the target is not needed while training (evaluation reloads it)

    initial_metrics = None
    if config.evaluate_initial_draft and config.num_eval_prompts:
        initial_dir = export_draft(draft, config_dict, output_dir / "initial", export_dtype)
        initial_metrics = _evaluate(config, initial_dir, eval_requests)

    result = _train(config, draft, sequences, output_dir)
    export_draft(draft, config_dict, output_dir, export_dtype)
    logger.info("exported the draft to %s", output_dir)
    if config.num_eval_prompts:
        result.eval_metrics = _evaluate(config, output_dir, eval_requests)
    result.initial_eval_metrics = initial_metrics
    return result


def _evaluate(config: TrainDraftConfig, draft_dir: Path, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return measure_accept_length(
        config.target,
        draft_dir,
        requests,
        dtype=config.dtype,
        max_new_tokens=config.eval_max_new_tokens,
        num_steps=config.speculative_num_steps,
        eagle_topk=config.speculative_eagle_topk,
        num_draft_tokens=config.speculative_num_draft_tokens,
        kv_cache_memory_gb=config.kv_cache_memory_gb,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )


def _train(
    config: TrainDraftConfig,
    draft: Eagle3Draft,
    sequences: list[CapturedSequence],
    output_dir: Path,
) -> TrainDraftResult:
    steps_per_epoch = math.ceil(len(sequences) / config.batch_size)
    total_steps = config.max_steps or config.num_epochs * steps_per_epoch
    warmup_steps = round(config.warmup_ratio * total_steps)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.learning_rate, betas=config.adam_betas, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup_steps, config.lr_schedule)
    )
    state_path = output_dir / STATE_FILE
    step = 0
    if config.resume and state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        if state["total_steps"] != total_steps:
            raise ValueError(
                f"{state_path} was written for {state['total_steps']} total steps, this run has {total_steps}; "
                "delete it or pass resume=False"
            )
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
        logger.info("resuming from %s at step %d of %d", state_path, step, total_steps)
    stop = total_steps if config.max_steps_this_run is None else min(total_steps, step + config.max_steps_this_run)

    def save() -> None:
        state = {
            "step": step,
            "total_steps": total_steps,
            "draft": draft.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        torch.save(state, state_path.with_suffix(".tmp"))
        state_path.with_suffix(".tmp").replace(state_path)

    window: list[tuple[float, list[float]]] = []
    tokens = 0
    start = time.perf_counter()
    draft.train()
    progress = _progress_bar(total_steps, step, config.show_progress)
    while step < stop:
        chosen = [sequences[i] for i in batch_indices(step, len(sequences), config.batch_size, config.seed)]
        batch = collate(chosen, draft.embed, config.ttt_length)
        losses = ttt_loss(ttt_forward(draft, batch, config.ttt_length), batch)
        optimizer.zero_grad(set_to_none=True)
        losses.loss.backward()
        nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        tokens += sum(s.num_rows for s in chosen)
        window = (window + [(float(losses.loss.detach()), losses.step_accuracies)])[-20:]
        elapsed = time.perf_counter() - start
        if progress is not None:
            progress.update(1)
            progress.set_postfix(
                loss=f"{window[-1][0]:.3f}",
                acc="/".join(f"{a:.2f}" for a in losses.step_accuracies),
                tok_s=f"{tokens / max(elapsed, 1e-9):.0f}",
            )
        if config.save_every and step % config.save_every == 0:
            save()
    if progress is not None:
        progress.close()
    save()
    elapsed = time.perf_counter() - start
    draft.eval()
    restore_inference_weights(draft)
    return TrainDraftResult(
        output_dir=output_dir,
        num_steps=step,
        total_steps=total_steps,
        num_train_sequences=len(sequences),
        final_loss=sum(w[0] for w in window) / len(window) if window else float("nan"),
        step_accuracies=[sum(a) / len(a) for a in zip(*(w[1] for w in window))] if window else [],
        train_seconds=elapsed,
        tokens_per_second=tokens / elapsed if elapsed > 0 else 0.0,
    )


def _progress_bar(total: int, initial: int, show: bool):  # -> tqdm | None
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train-draft", unit="step")
