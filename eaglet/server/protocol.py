"""OpenAI-compatible request and response bodies (the subset eaglet serves).

Requests are validated strictly (no string-to-number coercion, no bools as numbers, no infinite
numbers); ranges that SamplingParams also checks are repeated here so that the error names the
OpenAI field. Fields OpenAI clients send that eaglet has no use for (``user``, ``tools`` ...) are
ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

StrictInt = Annotated[int, Field(strict=True)]
Number = Annotated[float, Field(strict=True)]  # strict float still takes JSON integers


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """The sampling fields chat and completions requests share."""

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=-1, ge=-1, le=2**63 - 1)  # the sampler holds it in an int64
    min_p: Number = Field(default=0.0, ge=0, le=1)
    seed: StrictInt | None = None
    n: StrictInt = Field(default=1, ge=1)
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(default=1.0, gt=0)
    logit_bias: dict[str, Number] | None = None
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them, each with n choices; its shape is checked
    # by eaglet.server.completion_prompts.
    prompt: Any
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before each choice's


# ---- responses ----------------------------------------------------------------------------


class SpeculativeStats(BaseModel):
    """Per choice, under EAGLE-3: accept_length = (accepted_tokens + verify_steps) / verify_steps."""

    accept_length: float
    verify_steps: int
    accepted_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    speculative: SpeculativeStats | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    speculative: SpeculativeStats | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    speculative: SpeculativeStats | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "eaglet"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def dump(model: BaseModel) -> dict[str, Any]:
    """A response as JSON-ready data, with unset optional extras (speculative, usage) left out."""
    return model.model_dump(exclude_none=True)
