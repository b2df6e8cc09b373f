"""The artifact's tokenizer, read with the `tokenizers` library and jinja2 directly.

Importing transformers costs seconds of cold start; what serving needs is the fast
tokenizer (`tokenizer.json`), the special tokens and chat template from `tokenizer_config.json`
/ `chat_template.jinja`, and incremental decoding (tokenizers' `DecodeStream`). A checkpoint
with only a sentencepiece model falls back to transformers' AutoTokenizer.

The chat template renders the way transformers renders it: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, loop controls, a `tojson` that does not escape HTML, and the
`raise_exception` and `strftime_now` globals templates call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from neuronctl.engine.errors import RequestError
from neuronctl.engine.text import TokenDecoder, WindowDecoder
from neuronctl.errors import NotFoundError, UsageError

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class EngineTokenizer:
    """encode / decode / chat template / a fresh incremental decoder per request."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | None) -> None:
        self._tok = backend  # tokenizers.Tokenizer
        self.config = config
        self.chat_template = chat_template
        self.specials = {n: s for n in SPECIAL_NAMES if (s := _token_text(config.get(n)))}
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False))

    @classmethod
    def load(cls, path: Path) -> EngineTokenizer:
        config = _read_json(path / "tokenizer_config.json") or {}
        template = _chat_template(path, config)
        if not (path / "tokenizer.json").is_file():
            return TransformersTokenizer.load(path, config, template)
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # a corrupt file: say which, not a Rust panic string
            raise NotFoundError(
                f"{path / 'tokenizer.json'} cannot be read: {exc}",
                "the artifact should contain the tokenizer files copied at compile time; recompile",
            ) from None
        tokenizer = cls(backend, config, template)
        if _transformers_major() >= 5:
            model_type = (_read_json(path / "config.json") or {}).get("model_type")
            rebuild = _REBUILDS.get(_tokenizer_class(config, model_type, path) or "")
            if rebuild is not None:
                rebuild(backend, config)
        else:
            tokenizer._set_post_processor()
        return tokenizer

    @property
    def eos_token_id(self) -> int | None:
        eos = self.specials.get("eos_token")
        return None if eos is None else self.token_id(eos)

    def token_id(self, token: str) -> int | None:
        value = self._tok.token_to_id(token)
        return None if value is None else int(value)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        text = str(self._tok.decode(list(token_ids), skip_special_tokens=True))
        return _clean_up(text) if self._cleanup else text

    def token_str(self, token_id: int) -> str:
        """One token's text as logprobs report it (special tokens spelled out)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def new_decoder(self) -> TokenDecoder:
        if self._cleanup:  # the clean-up looks across tokens: decode a window instead
            return WindowDecoder(self.decode)
        return StreamDecoder(self._tok)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_special_tokens: bool = False, **options: Any
    ) -> list[int]:
        """The template writes any BOS itself; add_special_tokens adds the tokenizer's on
        top (vLLM's chat field of that name, false by default)."""
        text = self.apply_chat_template(messages, **options)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render as transformers' apply_chat_template does; with continue_final_message the
        text ends where the last message's content ends (no end-of-turn after it)."""
        if not self.chat_template:
            raise UsageError(
                "this model's tokenizer has no chat template",
                "use plain completions (no --chat, /v1/completions)",
            )
        if continue_final_message:
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _TAG}]
        text = str(self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            **self.specials,
        ))  # fmt: skip
        return _cut_at_tag(text, messages[-1]["content"]) if continue_final_message else text

    @cached_property
    def _template(self) -> Any:
        return _compile_template(self.chat_template or "")

    def _set_post_processor(self) -> None:
        """Before transformers 5, tokenizer_config's add_bos_token / add_eos_token, where either
        is given, replace the post-processor in tokenizer.json with BOS? $A EOS?
        (update_post_processor); a flag whose token is unknown adds nothing. transformers 5
        drops both flags when there is a tokenizer.json
        (tokenization_utils_base.py, from_pretrained)."""
        from tokenizers import processors

        if "add_bos_token" not in self.config and "add_eos_token" not in self.config:
            return
        ends = []
        for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
            token = self.specials.get(name)
            tid = None if token is None else self.token_id(token)
            ends.append((token, tid) if self.config.get(flag) and tid is not None else None)
        bos, eos = ends
        single = " ".join(
            [*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])]
        )
        pair = " ".join(
            [single, *([f"{bos[0]}:1"] if bos else []), "$B:1", *([f"{eos[0]}:1"] if eos else [])]
        )
        self._tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[e for e in ends if e is not None]
        )


class TokenizedText:
    """The text side the server needs (server.routes.TextModel), over `self.tokenizer`: shared by
    a loaded artifact and the tests' fake model, so both refuse and count text alike."""

    tokenizer: EngineTokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:  # a BOS alone is no prompt (docs/runtime.md: empty prompts are refused)
            raise RequestError("the prompt is empty", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        return self.tokenizer.encode_chat(messages, **options)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens) if text else []

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.token_str(token_id)


class StreamDecoder:
    """tokenizers' DecodeStream, plus the ids it still holds at the end of the output.

    DecodeStream returns nothing while the text ends in an incomplete character; if the
    output ends there, `flush` decodes those ids after the last ones that gave text (so
    merges and spaces come out as a whole-output decode gives them)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._context: list[int] = []  # the ids of the last step that gave text
        self._held: list[int] = []  # ids since then

    def __call__(self, token_id: int) -> str:
        self._held.append(token_id)
        text = self._stream.step(self._tok, token_id)
        if not text:
            return ""
        self._context, self._held = self._held, []
        return str(text)

    def flush(self) -> str:
        if not self._held:
            return ""
        decode = self._tok.decode
        before = decode(self._context, skip_special_tokens=True)
        text = decode(self._context + self._held, skip_special_tokens=True)
        self._context, self._held = self._context + self._held, []
        return str(text[len(before) :])


class TransformersTokenizer(EngineTokenizer):
    """The fallback for checkpoints without tokenizer.json (sentencepiece only)."""

    @classmethod
    def load(  # type: ignore[override]
        cls, path: Path, config: dict[str, Any], template: str | None
    ) -> TransformersTokenizer:
        from transformers import AutoTokenizer

        try:
            backend = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise NotFoundError(
                f"{path} has no usable tokenizer: {exc}",
                "the artifact should contain the tokenizer files copied at compile time; recompile",
            ) from None
        return cls(backend, config, template or getattr(backend, "chat_template", None))

    def token_id(self, token: str) -> int | None:
        value = self._tok.convert_tokens_to_ids(token)
        return None if value is None else int(value)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def token_str(self, token_id: int) -> str:
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def new_decoder(self) -> TokenDecoder:
        return WindowDecoder(self.decode)


# continue_final_message, as transformers does it (utils/chat_template_utils.py,
# render_jinja_template): tag the last message's content, render, cut the text at the tag.
_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str, tagged: str) -> str:
    if tagged[: -len(_TAG)].strip() not in text or _TAG.strip() not in text:
        raise RequestError(
            "continue_final_message: the chat template drops part of the last message",
            param="continue_final_message",
        )
    at = text.rindex(_TAG.strip())
    if text[at : at + len(_TAG)] == _TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config's (possibly a list
    of named templates: the "default" one)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = (_read_json(path / "chat_template.json") or {}).get("chat_template")
    value = value or config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _compile_template(source: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise UsageError(f"the model's chat template does not parse: {exc}") from None


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text


def _transformers_major() -> int:
    """The installed transformers' major version, read without importing it (seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 5


# transformers 5 does not serve tokenizer.json as saved. AutoTokenizer picks a class by
# tokenizer_config's "tokenizer_class" (models/auto/tokenization_auto.py); a class with its own
# __init__ takes only the vocabulary, merges and post-processor from tokenizer.json and builds
# its own normalizer, pre-tokenizer, decoder and BPE options around them
# (tokenization_utils_tokenizers.py, TokenizersBackend.convert_to_native_format). The functions
# below do what each such class's __init__ does, on the loaded tokenizer; classes not named here
# (PreTrainedTokenizerFast, TokenizersBackend) use tokenizer.json as saved.

# Qwen2Tokenizer's pre-tokenizer split (models/qwen2/tokenization_qwen2.py, PRETOKENIZE_REGEX):
# one digit per piece, unlike GPT-2's byte-level regex.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bpe_options(tok: Any, **options: Any) -> None:
    """The BPE options the class passes; the rest are BPE's defaults (as a fresh BPE has)."""
    defaults = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                "ignore_merges": False}  # fmt: skip
    for name, value in {**defaults, **options}.items():
        if hasattr(tok.model, name):  # a tokenizer.json whose model is not BPE: left as saved
            setattr(tok.model, name, value)


def _qwen2(tok: Any, config: dict[str, Any]) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    _bpe_options(tok, continuing_subword_prefix="", end_of_word_suffix="")
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(
            add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False
        ),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()


def _llama(tok: Any, config: dict[str, Any]) -> None:
    """LlamaTokenizer: sentencepiece-style Metaspace; with add_prefix_space (the default) the
    space goes before the first piece only unless the config says legacy."""
    from tokenizers import decoders, pre_tokenizers

    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    _bpe_options(tok, fuse_unk=True, byte_fallback=True)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))


def _gpt2(tok: Any, config: dict[str, Any]) -> None:
    from tokenizers import decoders, pre_tokenizers

    _bpe_options(tok, continuing_subword_prefix="", end_of_word_suffix="")
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(config.get("add_prefix_space", False))
    )
    tok.decoder = decoders.ByteLevel()


def _gemma(tok: Any, config: dict[str, Any]) -> None:
    from tokenizers import decoders, normalizers, pre_tokenizers

    unk = _token_text(config.get("unk_token")) or "<unk>"
    _bpe_options(tok, fuse_unk=True, unk_token=unk, byte_fallback=True)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )


_REBUILDS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "Qwen2Tokenizer": _qwen2,
    "LlamaTokenizer": _llama,
    "GPT2Tokenizer": _gpt2,
    "GemmaTokenizer": _gemma,
}

# Model types AutoTokenizer serves with tokenizer.json as saved whatever tokenizer_class says
# (registered as TokenizersBackend when mistral-common is absent).
_AS_SAVED_MODEL_TYPES = frozenset({"mistral", "mixtral"})


def _tokenizer_class(config: dict[str, Any], model_type: Any, path: Path) -> str | None:
    """The class AutoTokenizer would build, as far as it changes the tokenizer."""
    name = config.get("tokenizer_class")
    if not isinstance(name, str) or model_type in _AS_SAVED_MODEL_TYPES:
        return None
    name = name.removesuffix("Fast")
    if name == "LlamaTokenizer" and _byte_level(path / "tokenizer.json"):  # Llama 3: as saved
        return None
    return name


def _byte_level(tokenizer_json: Path) -> bool:
    """transformers' own test: the file names ByteLevel anywhere. Read only for Llama's class,
    so other loads read the file once (from_file; from_str of the text is slower)."""
    try:
        return '"ByteLevel"' in tokenizer_json.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
