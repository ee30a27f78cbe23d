"""A request's state inside the engine, and what the engine returns for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from eaglet.multimodal.inputs import MultimodalInputs
from eaglet.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]  # placeholders already expanded
    sampling_params: SamplingParams
    mm_inputs: MultimodalInputs | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    req_pool_idx: int | None = None
    num_cached_tokens: int = 0  # tokens whose latents are in the KV cache
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    draft_state: Any = None  # eaglet.spec.eagle_worker.DraftState after a draft extend
    num_prefix_hit_tokens: int = 0  # tokens taken from the prefix cache at the last admission
    num_published_blocks: int = 0  # leading full blocks already published to the prefix cache
    num_preemptions: int = 0
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_accept_lengths: list[int] = field(default_factory=list)

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
    finish_reason: str | None  # "stop" (EOS or a stop token), "length" (max_new_tokens)
    spec_verify_ct: int = 0  # speculative verify steps
    spec_accepted_tokens: int = 0  # accepted draft tokens (bonus tokens excluded)
    spec_accept_lengths: list[int] = field(default_factory=list)  # per verify step: accepted + bonus

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
