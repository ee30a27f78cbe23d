"""Per-request sampling parameters, the vLLM / SGLang set, validated on construction.

Every bad value raises :class:`eaglet.errors.InvalidRequestError` with a message that names the field
and the allowed range. Token ids inside ``logit_bias`` and ``stop_token_ids`` can only be checked
against the model's vocabulary, which the parameters do not know: the engine calls
:meth:`SamplingParams.validate_for_vocab` when it admits the request.

How the fields are applied (see ``eaglet/layers/logits_processor.py`` and ``eaglet/layers/sampler.py``,
the same with and without speculative decoding):

1. logits processing (changes greedy results too): ``min_tokens``, ``logit_bias``,
   ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``;
2. shaping for sampling (ignored by greedy rows): ``temperature``, ``min_p``, ``top_k``, ``top_p``;
3. ``logprobs`` / ``prompt_logprobs`` are computed from the raw model logits (before 1 and 2);
   with ``structured_output``, output logprobs are those of the grammar-masked raw logits (as vLLM:
   its grammar bitmask is applied before the sampler computes logprobs).

``structured_output`` (``StructuredOutput``) constrains the output to a JSON schema, any JSON
object, or a Lark grammar: the grammar's token mask applies before 1 (``eaglet/grammar/``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from eaglet.errors import InvalidRequestError

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))


def _bad(name: str, expected: str, value: object) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; exactly one of the fields is set. The grammar itself is compiled
    (and a bad schema refused) when the engine admits the request, where the tokenizer is known."""

    json_schema: dict[str, Any] | None = None  # a JSON schema (OpenAI's response_format json_schema)
    json_object: bool = False  # any JSON object (response_format json_object)
    lark: str | None = None  # a Lark grammar in llguidance's syntax (constrained tool calls)

    def __post_init__(self) -> None:
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise _bad("structured_output.json_schema", "a JSON schema (a dict)", self.json_schema)
        if not isinstance(self.json_object, bool):
            raise _bad("structured_output.json_object", "a bool", self.json_object)
        if self.lark is not None and (not isinstance(self.lark, str) or not self.lark.strip()):
            raise _bad("structured_output.lark", "a non-empty Lark grammar", self.lark)
        chosen = [self.json_schema is not None, self.json_object, self.lark is not None]
        if sum(chosen) != 1:
            raise InvalidRequestError("structured_output needs exactly one of json_schema, json_object, lark")


@dataclass
class SamplingParams:
    # The first seven fields keep their historical positions (positional construction still works).
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = -1  # -1 = off, or >= 1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    min_p: float = 0.0  # [0, 1]; drop tokens with prob < min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off; over prompt + generated tokens
    presence_penalty: float = 0.0  # [-2, 2]; over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2]; over generated tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    stop: list[str] = field(default_factory=list)  # a str is turned into [str]
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = off; k >= 0: chosen token's logprob + top-k per token
    prompt_logprobs: int | None = None  # None = off; k >= 0 as above, per prompt token
    n: int = 1
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise _bad("max_new_tokens", "a positive integer (>= 1)", self.max_new_tokens)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise _bad("min_tokens", f"an integer in [0, max_new_tokens={self.max_new_tokens}]", self.min_tokens)
        if not _is_real(self.temperature) or self.temperature < 0:
            raise _bad("temperature", ">= 0 and finite (0 = greedy)", self.temperature)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise _bad("top_k", "-1 (off) or a positive integer", self.top_k)
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise _bad("seed", f"None or an integer in [{_SEED_MIN}, {_SEED_MAX}]", self.seed)
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", "> 0 and finite (1 = off)", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise _bad(name, "in [-2, 2]", value)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "a bool", getattr(self, name))
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", "a positive integer (>= 1)", self.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise _bad(name, "None or an integer >= 0", value)

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise _bad("stop_token_ids", "a list of token ids (integers >= 0)", self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", "a list of token ids (integers >= 0)", self.stop_token_ids)
        self.stop_token_ids = list(self.stop_token_ids)

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise _bad("stop", "a string or a list of strings", self.stop)
        if any(s == "" for s in self.stop):
            raise _bad("stop", "non-empty strings", self.stop)
        self.stop = list(self.stop)

        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise _bad("structured_output", "None or a StructuredOutput", self.structured_output)

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise _bad("logit_bias", "a dict of token id -> bias in [-100, 100]", bias)
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = key
            if isinstance(key, str):  # JSON object keys arrive as strings
                try:
                    token = int(key)
                except ValueError:
                    token = key
            if not _is_int(token) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            if not _is_real(value) or not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value!r} for token {token}")
            out[token] = float(value)
        return out

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raises InvalidRequestError if a token id in ``logit_bias`` or ``stop_token_ids`` is outside
        [0, vocab_size). The engine calls it at admission, when the vocabulary is known."""
        for name, ids in (("logit_bias", self.logit_bias.keys()), ("stop_token_ids", self.stop_token_ids)):
            bad = sorted(t for t in ids if not 0 <= t < vocab_size)
            if bad:
                raise InvalidRequestError(
                    f"{name} token ids must be in [0, {vocab_size}) (the vocabulary size), got {bad[:8]}"
                )

    def per_sample(self) -> list[SamplingParams]:
        """The parameters of each of the n samples, which run as n requests. Sample j of a seeded
        request uses seed (seed + j) mod 2**64: torch reads seeds modulo 2**64 (-1 is 2**64 - 1),
        so sample 0 draws what an n = 1 request with the same seed draws, the samples differ, and
        every valid seed works, the largest included."""
        if self.n == 1:
            return [self]
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + j) % 2**64)
            for j in range(self.n)
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def greedy_ids_suffice(self) -> bool:
        """True if the argmax of the raw logits is all a decode step needs (greedy, no logits
        processing, no grammar, no logprobs): a forward may then skip writing the logits."""
        return self.greedy and not self.needs_logits_processing and self.logprobs is None and self.structured_output is None

    @property
    def needs_logits_processing(self) -> bool:
        """True if a history-dependent or biasing processor is on (see ``process_logits``)."""
        return bool(
            self.min_tokens > 0
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
