"""OpenAI-compatible request and response bodies (the subset eaglet serves).

Requests are validated strictly (no string-to-number coercion, no bools as numbers, no infinite
numbers); ranges that SamplingParams also checks are repeated here so that the error names the
OpenAI field. Fields OpenAI clients send that eaglet has no use for (``user``, ``metadata`` ...)
are ignored. ``response_format`` (json_object, json_schema) constrains the output
(``structured_output.py``). Tool calls (``tools``, ``tool_choice``, ``role: "tool"`` messages) and thinking
(``chat_template_kwargs``, ``reasoning_content``) follow OpenAI's and vLLM's spelling.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)
from pydantic_core import PydanticCustomError

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


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Request):
    """A call in an assistant message: in the history a request sends, and in a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    reasoning_content: str | None = None  # assistant messages: their thinking, for templates that show it


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceMode = Literal["none", "auto", "required"]


def _tool_choice(value: Any) -> ToolChoiceMode | NamedToolChoice:
    # By hand: pydantic would name both union members in every error (tool_choice.literal[...]).
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return value  # type: ignore[return-value]
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise PydanticCustomError("tool_choice", "{where}: {msg}", {"where": where, "msg": first["msg"]}) from None
    raise PydanticCustomError(
        "tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"
    )


ToolChoice = Annotated[ToolChoiceMode | NamedToolChoice, PlainValidator(_tool_choice)]


class JsonSchemaFormat(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # ``schema`` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # "auto" with tools, "none" without (OpenAI's defaults)
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template ({"thinking": false})
    response_format: ResponseFormat | None = None


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
    content: str | None  # None when the answer is only tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _keep_null_content(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI writes "content": null beside tool calls; dump() leaves other Nones out.
        return {"role": self.role, "content": self.content, **handler(self)}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    speculative: SpeculativeStats | None = None
    tool_choice_unmet: str | None = None  # why the calls do not satisfy tool_choice (it is not enforced)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A call's first chunk has its id, type and name (and arguments ""); later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    speculative: SpeculativeStats | None = None
    tool_choice_unmet: str | None = None


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
