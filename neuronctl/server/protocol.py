"""The OpenAI request and response bodies of this server, typed, and its error JSON.

Unknown fields are ignored (clients send many optional ones); fields that would change the
result and are not implemented (n > 1, logprobs, echo, logit_bias, penalties, response_format,
tools, ...) are refused with a 400 naming the field, unless they hold their neutral value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from neuronctl.engine.errors import RequestError
from neuronctl.engine.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


# Result-changing fields this server does not implement, and the values that change nothing.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": _neutral(1),
    "best_of": _neutral(None, 1),
    "logprobs": _neutral(None, False, 0),
    "top_logprobs": _neutral(None, 0),
    "echo": _neutral(None, False),
    "suffix": _neutral(None, ""),
    "logit_bias": _neutral(None, {}),
    "presence_penalty": _neutral(None, 0),
    "frequency_penalty": _neutral(None, 0),
    "repetition_penalty": _neutral(None, 1),
    "min_p": _neutral(None, 0),
    "min_tokens": _neutral(None, 0),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "tools": _neutral(None, []),
    "tool_choice": _neutral(None, "none"),
    "functions": _neutral(None, []),
    "function_call": _neutral(None, "none"),
    "guided_json": _neutral(None),
    "guided_regex": _neutral(None),
    "guided_choice": _neutral(None),
    "guided_grammar": _neutral(None),
    "structured_outputs": _neutral(None),
    "prediction": _neutral(None),
    "audio": _neutral(None),
    "modalities": lambda v: v is None or v == ["text"],
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1  # extra parameter, as in vLLM
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # extra, as in vLLM: output token ids in each choice
    logprobs: Any = None

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        self.refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
        )

    def refuse_unsupported(self) -> None:
        given = {**(self.model_extra or {}), **{k: getattr(self, k) for k in self.model_fields_set}}
        for name, neutral in UNSUPPORTED.items():
            if name in given and not neutral(given[name]):
                raise RequestError(
                    f"{name}={given[name]!r} is not supported by this server",
                    param=name,
                    hint=f"leave {name} out; its value would change the result",
                )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise RequestError("the prompt is empty", param="prompt")
        return out

    def prompt_chars(self) -> int:
        return sum(len(p) for p in self.prompts() if isinstance(p, str))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_chars(self) -> int:
        return sum(len(m.as_template_message()["content"]) for m in self.messages)


# -- responses ----------------------------------------------------------------------------------


class _Out(BaseModel):
    """A response object; fields named in `omit_if_none` are left out rather than null."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "abort", "error"] | None


class CompletionChoice(_Out):
    omit_if_none = ("token_ids",)
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None
    token_ids: list[int] | None = None  # extra, as vLLM's return_token_ids


class Completion(_Out):
    omit_if_none = ("usage",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    omit_if_none = ("token_ids",)
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Out):
    omit_if_none = ("role", "content")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Out):
    omit_if_none = ("token_ids",)
    index: int
    delta: Delta
    finish_reason: FinishReason
    logprobs: None = None
    token_ids: list[int] | None = None


class Chunk(_Out):
    """One server-sent event of a stream; `usage` is null on choice chunks when the client
    asked for usage (it then comes in a last chunk with no choices), absent otherwise."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()
    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[CompletionChoice] | list[ChatChunkChoice]
    usage: Usage | None = None
    with_usage: bool = Field(False, exclude=True)

    @model_serializer(mode="wrap")
    def _usage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not self.with_usage and data.get("usage") is None:
            data.pop("usage", None)
        return data


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "neuronctl"
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}
