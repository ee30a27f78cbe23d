"""A request's state inside the engine, and what the engine returns for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from eaglet.grammar.matcher import GrammarMatcher
from eaglet.layers.logits_processor import logprobs_of

from eaglet.multimodal.inputs import MultimodalInputs
from eaglet.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # log-probability under the raw model distribution (grammar-masked with structured output)
    top: list[tuple[int, float]]  # the most likely tokens with their log-probabilities, best first


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]  # placeholders already expanded
    sampling_params: SamplingParams
    mm_inputs: MultimodalInputs | None = None
    # (start, end, content hash) of each image's placeholder run, hashed once for prefix-cache keys.
    mm_spans: list[tuple[int, int, bytes]] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    req_pool_idx: int | None = None
    num_cached_tokens: int = 0  # tokens whose latents are in the KV cache
    finish_reason: str | None = None
    error: str | None = None  # why the request failed, with finish_reason "error"
    generator: torch.Generator | None = None
    # Target features of the last cached positions decoded while speculation was off; the draft's
    # cache entries there are written (EagleWorker.catch_up) when speculation resumes.
    draft_pending_features: list[torch.Tensor] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0  # tokens taken from the prefix cache at the last admission
    num_published_blocks: int = 0  # leading full blocks already published to the prefix cache
    num_preemptions: int = 0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs is set
    # When params.prompt_logprobs is set: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    detokenizer: Any = None  # eaglet.engine.detokenizer.IncrementalDetokenizer, with a tokenizer
    stop_checker: Any = None  # eaglet.engine.detokenizer.StopStringChecker, with a tokenizer
    final_text: str | None = None  # the output text once finished
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_accept_lengths: list[int] = field(default_factory=list)
    # The tokens that end the request (its stop token ids, and EOS unless ignore_eos), sorted.
    final_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None  # with structured output: the state after the output so far
    # Read every step; the sampling params do not change once the request exists.
    greedy_ids_suffice: bool = field(init=False)

    def __post_init__(self) -> None:
        self.greedy_ids_suffice = self.sampling_params.greedy_ids_suffice

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some are not recorded yet."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (EOS or a stop token), "length" (max_new_tokens), "abort", "error"
    spec_verify_ct: int = 0  # speculative verify steps
    spec_accepted_tokens: int = 0  # accepted draft tokens (bonus tokens excluded)
    spec_accept_lengths: list[int] = field(default_factory=list)  # per verify step: accepted + bonus
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    samples: list["RequestOutput"] = field(default_factory=list)  # all n completions when n > 1
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for; None for the first token
    error: str | None = None  # with finish_reason "error": the failure that stopped the request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def record_logprobs(requests: list[Request], raw_logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """Appends TokenLogprobs of ``tokens`` [B, K] (K tokens per request, -1 = none) under
    ``raw_logits`` [B, K, V] or [B, V] (K = 1) to each request that asked for logprobs."""
    wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not wanted:
        return
    logits = raw_logits if raw_logits.dim() == 3 else raw_logits[:, None, :]
    num_top = max(requests[i].sampling_params.logprobs for i in wanted)
    for i in wanted:
        valid = tokens[i] >= 0
        chosen_lp, top_ids, top_lps = logprobs_of(logits[i][valid], tokens[i][valid], num_top)
        k = requests[i].sampling_params.logprobs
        for token, lp, ids, lps in zip(tokens[i][valid].tolist(), chosen_lp.tolist(), top_ids.tolist(), top_lps.tolist()):
            requests[i].output_logprobs.append(TokenLogprob(token, lp, list(zip(ids[:k], lps[:k]))))


def record_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """Logprobs of prompt tokens start+1 .. from the logits at positions start .. of a prefill chunk.

    Positions already recorded (a preempted request recomputing its prompt) are skipped.
    """
    prompt = req.prompt_token_ids
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)
    if start >= len(req.prompt_logprobs):
        raise RuntimeError(
            f"prompt logprobs of request {req.request_id!r} from position {start + 1}, but only "
            f"{len(req.prompt_logprobs)} are recorded (its prefix was not computed)"
        )
    targets = list(range(start + 1, min(start + logits.shape[0], len(prompt) - 1) + 1))
    targets = [t for t in targets if t >= len(req.prompt_logprobs)]
    if not targets:
        return
    rows = torch.tensor(targets) - 1 - start
    chosen = torch.tensor([prompt[t] for t in targets])
    k = req.sampling_params.prompt_logprobs
    chosen_lp, top_ids, top_lps = logprobs_of(logits[rows], chosen, k)
    for token, lp, ids, lps in zip(chosen.tolist(), chosen_lp.tolist(), top_ids.tolist(), top_lps.tolist()):
        req.prompt_logprobs.append(TokenLogprob(token, lp, list(zip(ids, lps))))
