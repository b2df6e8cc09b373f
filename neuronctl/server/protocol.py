"""The OpenAI request and response bodies of this server, typed, and its error JSON.

Requests are read as vLLM reads them: `null` is the field's default, `model` may be left out,
unknown fields are ignored. Types are strict (`"stream": "yes"` and `"max_tokens": true` are
400s, not coerced). Fields that would change the result and are not implemented (suffix,
response_format json_object, tools, guided decoding, ...) are refused with a 400 naming the
field, unless they hold their neutral value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from neuronctl.engine.errors import RequestError
from neuronctl.engine.request import FinishReason
from neuronctl.engine.sampling import MAX_LOGPROBS, SamplingParams


class _Strict(BaseModel):
    # strict: no "yes" for true, no true for 1, no "0.5" for 0.5 (vLLM's pydantic models
    # are lax; clients that send those mean something else, so they get a 400 naming it).
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


# Result-changing fields this server does not implement, and the values that change nothing.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _neutral(None, ""),
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
    "use_beam_search": _neutral(None, False),
    "prompt_logprobs": _neutral(None),
    # vLLM's extra fields this server does not implement (docs/runtime.md says why).
    "bad_words": _neutral(None, []),
    "skip_special_tokens": _neutral(None, True),
    "spaces_between_special_tokens": _neutral(None, True),
    "chat_template": _neutral(None),
    "chat_template_kwargs": _neutral(None, {}),
    "documents": _neutral(None, []),
    "media_io_kwargs": _neutral(None, {}),
    "mm_processor_kwargs": _neutral(None, {}),
    "prompt_embeds": _neutral(None),
    "logprob_token_ids": _neutral(None),
    "return_tokens_as_token_ids": _neutral(None, False),
    "return_token_offsets": _neutral(None, False),
    "return_prompt_text": _neutral(None, False),
    "return_mm_kwargs": _neutral(None, False),
    "return_weight_versions": _neutral(None, False),
    "routed_experts_prompt_start": _neutral(None),
    "mm_payload": _neutral(None),
    "reasoning_effort": _neutral(None),
    "thinking_token_budget": _neutral(None),
    "include_reasoning": _neutral(None, True),
    "parallel_tool_calls": _neutral(None, True, False),
    "watermarking": _neutral(None),
    "length_penalty": _neutral(None, 1, 1.0),
    "priority": _neutral(None, 0),
    "kv_transfer_params": _neutral(None),
    "ec_transfer_params": _neutral(None),
    "vllm_xargs": _neutral(None, {}),
    "repetition_detection": _neutral(None),
    "stream_interval": _neutral(None, 1),
}

# vLLM request fields that carry no result here by their own definition: a tag (user,
# request_id, session_id) or a prefix-cache salt (cache_salt; this server has no prefix cache).
NO_EFFECT = frozenset({"user", "request_id", "session_id", "cache_salt"})


def refuse_fields(body: BaseModel) -> None:
    """400 naming the first field of UNSUPPORTED that holds a value other than its neutral
    ones. `tools` is accepted with tool_choice "none" (many clients send both by default):
    the template sees them, as vLLM's does unless --exclude-tools-when-tool-choice-none."""
    given = {**(body.model_extra or {}), **{k: getattr(body, k) for k in body.model_fields_set}}
    if given.get("tool_choice") == "none":
        given.pop("tools", None)
    for name, neutral in UNSUPPORTED.items():
        if name in given and not neutral(given[name]):
            raise RequestError(
                f"{name}={given[name]!r} is not supported by this server",
                param=name,
                hint=f"leave {name} out; its value would change the result",
            )


# -- bounds: what one request may ask for, so that it costs a bounded share of the server --
# logit_bias keys: vLLM's own per-request limit (vllm-project/vllm,
# vllm/v1/worker/gpu/sample/logit_bias.py: MAX_NUM_LOGIT_BIAS_TOKENS = 1024).
MAX_LOGIT_BIAS = 1024
# Prompts in one completion request (each is tokenized, then queued as its own sequences).
MAX_PROMPTS = 64
# Chat messages in one request, checked while the body is validated: before any templating.
MAX_MESSAGES = 1024
# What the chat template adds per message (role markers, separators), counted with the
# content against the character limit: empty messages are not free to template.
MESSAGE_OVERHEAD_CHARS = 16


def template_chars(messages: list[dict[str, str]]) -> int:
    """The characters a template sees: each message's content and its overhead."""
    return sum(len(m["content"]) + MESSAGE_OVERHEAD_CHARS for m in messages)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None  # extra parameter, as in vLLM
    min_p: float | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None  # extra, as in vLLM: output token ids in each choice
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra parameters (vllm/entrypoints/openai/completion/protocol.py)
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """The engine's parameters for one choice (`choice_params` varies the seed)."""
        self.refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=_or(self.temperature, 1.0),
            top_k=_or(self.top_k, -1),
            top_p=_or(self.top_p, 1.0),
            min_p=_or(self.min_p, 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=_or(self.ignore_eos, False),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            min_tokens=_or(self.min_tokens, 0),
            logit_bias=self._bias(),
            logprobs=self.logprobs_k(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            allowed_token_ids=(
                None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
            ),
            include_stop_str_in_output=_or(self.include_stop_str_in_output, False),
        )

    def truncate(self, ids: list[int], longest: int) -> list[int]:
        """truncate_prompt_tokens as vLLM applies it (vllm/renderers/params.py,
        _truncation_slice): k keeps k tokens, -1 the most the model takes (`longest`); the
        last ones unless truncation_side is "right" (vLLM loads tokenizers with
        truncation_side "left": vllm/tokenizers/registry.py)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = longest if k < 0 else k
        if k > longest:
            raise RequestError(
                f"truncate_prompt_tokens={k} is more than this artifact takes ({longest})",
                param="truncate_prompt_tokens",
            )
        if k >= len(ids):
            return ids
        if k == 0:
            raise RequestError("truncate_prompt_tokens=0: no prompt left", "truncate_prompt_tokens")
        return ids[:k] if self.truncation_side == "right" else ids[-k:]

    def _bias(self) -> tuple[tuple[int, float], ...]:
        """One (token id, bias) per id: "12", " 12" and "0012" name the same token, the last
        one given wins. Capped in count before any key is parsed; never NaN or infinite
        (min(100, nan) is 100: a NaN would force its token)."""
        given = self.logit_bias or {}
        if len(given) > MAX_LOGIT_BIAS:
            raise RequestError(
                f"logit_bias has {len(given)} entries; at most {MAX_LOGIT_BIAS}",
                param="logit_bias",
            )
        out: dict[int, float] = {}
        for key, value in given.items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(
                    f"logit_bias keys are token ids, not {key!r}", param="logit_bias"
                ) from None
            if not math.isfinite(value):
                raise RequestError(
                    f"logit_bias[{key!r}] is {value}, not a finite number", param="logit_bias"
                )
            out[token] = max(-100.0, min(100.0, value))  # OpenAI's range, clamped as vLLM
        return tuple(out.items())

    def logprobs_k(self) -> int | None:
        """How many top logprobs each output token reports; None: no logprobs."""
        raise NotImplementedError

    @property
    def choices_per_prompt(self) -> int:
        return _or(self.n, 1)

    @property
    def sequences_per_prompt(self) -> int:
        """How many sequences are generated per prompt: n (completions: best_of)."""
        return self.choices_per_prompt

    def sequences_within(self, prompts: int, capacity: int | None) -> int:
        """sequences_per_prompt, checked against what the server holds at once (`capacity`:
        its batch slots and waiting places; None: no bound). vLLM runs a request's n
        sequences through its queue whatever max_num_seqs is; so does this server: past the
        batch's slots they wait. A request that could never be held whole is refused."""
        per_prompt = self.sequences_per_prompt
        if capacity is not None and per_prompt * prompts > capacity:
            name = "n" if self.choices_per_prompt == per_prompt else "best_of"
            raise RequestError(
                f"{name}={per_prompt} for {prompts} prompt(s) is {per_prompt * prompts} "
                f"sequences; this server holds at most {capacity} at once (batch and queue)",
                param=name,
                hint="send several requests, or start the server with a larger --max-queue",
            )
        return per_prompt

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def refuse_unsupported(self) -> None:
        refuse_fields(self)
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def return_ids(self) -> bool:
        return bool(self.return_token_ids)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)

    @property
    def max_new_tokens(self) -> int:
        """OpenAI's default for completions is 16; 0 only with echo (the prompt is the answer)."""
        tokens = _or(self.max_tokens, 16)
        if tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        return int(tokens)

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        params = super().sampling(max_tokens)
        if self.echo and (self.logprobs is not None or max_tokens == 0):
            return replace(params, prompt_logprobs=self.logprobs or 0)
        return params

    @property
    def sequences_per_prompt(self) -> int:
        """best_of: how many are generated per prompt, of which the n best are returned."""
        n, best_of = self.choices_per_prompt, _or(self.best_of, self.choices_per_prompt)
        if best_of < n:
            raise RequestError(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
        if best_of > n and self.stream:
            raise RequestError("best_of > n cannot be streamed", param="best_of")
        return int(best_of)

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
        if len(out) > MAX_PROMPTS:
            raise RequestError(
                f"{len(out)} prompts in one request; at most {MAX_PROMPTS}",
                param="prompt",
                hint="send the prompts in several requests",
            )
        return out

    def prompt_chars(self) -> int:
        return sum(len(p) for p in self.prompts() if isinstance(p, str))


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatOptions(_Strict):
    """How messages become a prompt, as vLLM's chat and /tokenize requests say it
    (vllm/entrypoints/openai/chat_completion/protocol.py, ChatCompletionRequest)."""

    add_generation_prompt: bool | None = None  # default true
    continue_final_message: bool | None = None  # default false
    add_special_tokens: bool | None = None  # default false: the template writes them
    tools: list[dict[str, Any]] | None = None  # only with tool_choice "none" (refuse_fields)
    tool_choice: Any = None

    def template_options(self) -> dict[str, Any]:
        add_prompt = _or(self.add_generation_prompt, True)
        final = _or(self.continue_final_message, False)
        if add_prompt and final:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
                hint="send add_generation_prompt: false with continue_final_message: true",
            )
        return {
            "add_generation_prompt": add_prompt,
            "continue_final_message": final,
            "add_special_tokens": _or(self.add_special_tokens, False),
            "tools": self.tools or None,
        }


class ChatRequest(ChatOptions, _Sampling):  # type: ignore[misc]
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    echo: bool | None = None  # the last message's content opens the answer, if its role is
    # the answer's (assistant), as vLLM's serving_chat does
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def max_new_tokens(self) -> int | None:
        tokens = _or(self.max_completion_tokens, self.max_tokens)
        if tokens == 0:
            raise RequestError("max_tokens must be >= 1", param="max_tokens")
        return tokens  # type: ignore[no-any-return]

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= _or(self.top_logprobs, 0) <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        return _or(self.top_logprobs, 0) if self.logprobs else None

    def check_messages(self) -> None:
        """A message that says nothing would generate from the template alone."""
        for i, message in enumerate(self.messages):
            if message.role in ("user", "system", "developer") and message.content is None:
                raise RequestError(
                    f"messages[{i}] ({message.role}) has no content", param=f"messages.{i}.content"
                )

    def prompt_chars(self) -> int:
        return template_chars([m.as_template_message() for m in self.messages])


class TokenizeRequest(ChatOptions):
    """vLLM's /tokenize: a `prompt` (TokenizeCompletionRequest: add_special_tokens defaults
    to true), or chat `messages` through the template (TokenizeChatRequest: false)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    return_token_strs: bool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


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




class CompletionLogprobs(_Out):
    """The legacy completions shape: parallel lists, one entry per token; an echoed prompt's
    first token has no logprob (null)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class CompletionChoice(_Out):
    omit_if_none = ("token_ids",)
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None
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
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None
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
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None
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
