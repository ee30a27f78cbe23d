"""Response regeneration and target feature capture for draft training.

1. ``regenerate_responses``: the target answers every prompt through eaglet's own batched engine
   (``eaglet.api.LLM``; greedy by default), so the draft learns what the target actually says.
2. ``capture_features``: one target forward over prompt + response per sequence, in ragged
   batches, through the engine's ``ModelRunner.extend`` with ``capture_layers`` = the draft's aux
   layer ids (exactly the call ``EagleWorker.prefill`` makes), with logits at every position. The
   draft's inputs come from ``eaglet.spec.draft_inputs.draft_extend_inputs``, the function the
   worker's draft extend uses, so a placeholder row's input embedding is the merged image feature
   exactly as at inference.

Per sequence of L tokens (P prompt tokens), draft row t in [0, L-1) pairs target features at t with
token t+1 (as draft slot t at inference):

* ``features [L-1, 3*H_t]``: the captured residual streams at positions 0..L-2;
* ``image_rows`` / ``image_embeds``: draft rows whose input token t+1 is an image placeholder, and
  their input embeddings (the image features the target merged there);
* ``target_logits [L-P, draft_vocab]``: the target's logits at positions P-1..L-2 (the positions
  that predict the response tokens), restricted to the hot vocabulary, and ``target_in_vocab``:
  whether the target's full-vocabulary argmax there is in it (the loss skips positions where not).

``CaptureCache`` keeps responses and captured sequences on disk in chunks of ``chunk_size``
sequences under a fingerprint of everything they depend on, so a second run with the same target,
prompts and settings reuses them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.api import LLM
from eaglet.engine.engine import Engine
from eaglet.executor.request import Request
from eaglet.sampling_params import SamplingParams
from eaglet.spec.draft_inputs import draft_extend_inputs
from eaglet.train.vocab import HotVocab

logger = logging.getLogger(__name__)


@dataclass
class GeneratedSample:
    request: dict[str, Any]  # the engine request of the prompt: prompt_token_ids (+ images)
    response_ids: list[int]


@dataclass
class CapturedSequence:
    input_ids: torch.Tensor  # [L] int64: prompt (placeholders expanded) + response
    prompt_len: int  # P
    features: torch.Tensor  # [L-1, len(aux) * H_t]
    image_rows: torch.Tensor  # [n] int64 draft rows whose input token is an image placeholder
    image_embeds: torch.Tensor  # [n, H_t]
    target_logits: torch.Tensor  # [L-P, draft_vocab] at positions P-1 .. L-2
    target_in_vocab: torch.Tensor  # [L-P] bool

    @property
    def num_rows(self) -> int:
        return int(self.features.shape[0])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def regenerate_responses(
    llm: LLM, requests: list[dict[str, Any]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> list[GeneratedSample]:
    """The target's own responses to ``requests`` (engine request dicts), all in one engine run."""
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i if temperature else None)
        for i in range(len(requests))
    ]
    outputs = llm.generate(list(requests), params)
    return [GeneratedSample(request, list(out.token_ids)) for request, out in zip(requests, outputs)]


@torch.inference_mode()
def capture_batch(
    engine: Engine, samples: list[GeneratedSample], capture_layers: tuple[int, ...], vocab: HotVocab
) -> list[CapturedSequence]:
    """One ragged target forward over every sample's prompt + response (see the module docstring)."""
    requests: list[Request] = []
    prompt_lens: list[int] = []
    for i, sample in enumerate(samples):
        prompt_ids, mm_inputs = engine._prepare_prompt(sample.request)
        token_ids = prompt_ids + sample.response_ids
        requests.append(Request(f"capture-{i}", token_ids, SamplingParams(max_new_tokens=1), mm_inputs))
        prompt_lens.append(len(prompt_ids))
    for req in requests:
        req.req_pool_idx = engine.cache.alloc_row()
    try:
        lengths = [req.num_tokens for req in requests]
        batch, output = engine.runner.extend(requests, lengths, capture_layers=capture_layers, all_logits=True)
    finally:
        for req in requests:
            engine.cache.free_row(req.req_pool_idx)
    # Tails (the token after each sequence) do not exist in training; their rows are dropped below.
    tails = torch.zeros(len(requests), dtype=torch.long)
    tail_embeds = None
    if batch.input_embeds is not None:
        tail_embeds = batch.input_embeds.new_zeros(len(requests), batch.input_embeds.shape[-1])
    draft_ids, draft_embeds = draft_extend_inputs(batch, tails, tail_embeds)
    image_token = engine.model_config.image_token_id
    used = vocab.used_ids
    captured = []
    for req, start, length, prompt_len in zip(requests, batch.extend_start_loc.tolist(), lengths, prompt_lens):
        rows = slice(start, start + length - 1)
        is_image = (
            draft_ids[rows] == image_token if image_token is not None and draft_embeds is not None
            else torch.zeros(length - 1, dtype=torch.bool)
        )
        image_rows = torch.nonzero(is_image).flatten()
        logits = output.logits[start + prompt_len - 1 : start + length - 1]
        captured.append(
            CapturedSequence(
                input_ids=torch.tensor(req.prompt_token_ids, dtype=torch.long),
                prompt_len=prompt_len,
                features=output.aux_hidden_states[rows].clone(),
                image_rows=image_rows,
                image_embeds=(
                    draft_embeds[rows][image_rows].clone() if draft_embeds is not None
                    else output.aux_hidden_states.new_zeros(0, engine.model_config.text.hidden_size)
                ),
                target_logits=logits[:, used].to(output.aux_hidden_states.dtype),
                target_in_vocab=vocab.t2d[logits.argmax(dim=-1)],
            )
        )
    return captured


def capture_features(
    engine: Engine,
    samples: list[GeneratedSample],
    capture_layers: tuple[int, ...],
    vocab: HotVocab,
    max_batch_tokens: int,
) -> list[CapturedSequence]:
    """``capture_batch`` over groups of samples of at most ``max_batch_tokens`` tokens (and at most
    the engine's max_running_requests), in input order."""
    captured: list[CapturedSequence] = []
    group: list[GeneratedSample] = []
    group_tokens = 0
    max_requests = engine.config.max_running_requests
    for sample in samples:
        tokens = len(sample.request["prompt_token_ids"]) + len(sample.response_ids)
        if group and (group_tokens + tokens > max_batch_tokens or len(group) == max_requests):
            captured += capture_batch(engine, group, capture_layers, vocab)
            group, group_tokens = [], 0
        group.append(sample)
        group_tokens += tokens
    if group:
        captured += capture_batch(engine, group, capture_layers, vocab)
    return captured


def request_fingerprint(request: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(request["prompt_token_ids"]).encode())
    for image in request.get("images", []):
        if isinstance(image, (str, Path)):
            digest.update(Path(image).read_bytes())
        else:  # a PIL image
            digest.update(image.tobytes())
    return digest.hexdigest()


class CaptureCache:
    """Responses and captured sequences on disk, reused when their fingerprint matches.

    Layout: ``responses-<key>.json``; ``features-<key>/chunk-00000.pt ...`` (lists of sequences,
    ``chunk_size`` each) and ``features-<key>/done`` once every chunk is written.
    """

    def __init__(self, directory: str | Path, chunk_size: int = 256) -> None:
        self.directory = Path(directory)
        self.chunk_size = chunk_size

    @staticmethod
    def key(**parts: Any) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def load_responses(self, key: str) -> list[list[int]] | None:
        path = self.directory / f"responses-{key}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def save_responses(self, key: str, responses: list[list[int]]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"responses-{key}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(responses))
        tmp.replace(path)

    def load_features(self, key: str) -> list[CapturedSequence] | None:
        folder = self.directory / f"features-{key}"
        if not (folder / "done").is_file():
            return None
        sequences = []
        for chunk in sorted(folder.glob("chunk-*.pt")):
            sequences += [CapturedSequence(**item) for item in torch.load(chunk, weights_only=True)]
        return sequences

    def save_features(self, key: str, sequences: list[CapturedSequence]) -> None:
        folder = self.directory / f"features-{key}"
        folder.mkdir(parents=True, exist_ok=True)
        for index, start in enumerate(range(0, len(sequences), self.chunk_size)):
            chunk = [s.to_dict() for s in sequences[start : start + self.chunk_size]]
            torch.save(chunk, folder / f"chunk-{index:05d}.pt")
        (folder / "done").write_text(f"{len(sequences)}\n")
        logger.info("cached %d captured sequences under %s", len(sequences), folder)
