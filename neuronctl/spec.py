"""The build spec: every knob a compile takes, where each value came from, and its validation.

Precedence: flag > config file (`-c neuronctl.toml`) > environment > default. A spec is
resolved twice: `resolve_spec` merges the sources and checks what can be checked without the
model; `finalize` fills the "auto" values (dtype, buckets) from the model's config and checks
what needs it (tp degree vs heads, seq len vs max positions).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic import Strict as _Strict

from neuronctl.errors import SpecError

BackendName = Literal["torch", "nxdi", "tnx"]
BACKENDS: tuple[str, ...] = get_args(BackendName)
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
# Strict types: a TOML `seq_len = true` or a config's "64" is refused, not read as 1 or 64.
Number = Annotated[float, _Strict()]  # an int or a float, never a bool or a string
# Upper bounds, checked before anything is allocated from them; far above any real build.
MAX_TP_DEGREE = 1 << 16
MAX_BATCH_SIZE = 65536
MAX_SEQ_LEN = 1 << 24
Buckets = list[Annotated[StrictInt, Field(le=MAX_SEQ_LEN)]] | Literal["auto"]

DTYPES = ("bfloat16", "float16", "float32")
# vLLM's --dtype spellings (vllm/config/model.py ModelDType: half, float) and the short ones.
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                 "bf16": "bfloat16"}  # fmt: skip
DEFAULT_GLOBAL_TOPK = 256


class OnDeviceSampling(BaseModel):
    """NxD Inference's OnDeviceSamplingConfig, with its defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    do_sample: StrictBool = False
    top_k: StrictInt = 1
    top_p: Number = 1.0
    temperature: Number = 1.0
    dynamic: StrictBool = False
    deterministic: StrictBool = False
    global_topk: StrictInt = Field(default=DEFAULT_GLOBAL_TOPK, ge=1, le=1 << 20)


# What an nxdi build samples with unless the spec says otherwise (`--on-device-sampling off`
# for none): the OnDeviceSamplingConfig vLLM's NxDI loaders compile themselves (vLLM 0.9
# model_loader/neuronx_distributed.py and vllm-neuron's loader, _get_default_neuron_config),
# so every vLLM generation serves the artifact, vllm-neuron 0.1.0 included (no CPU sampler).
NXDI_DEFAULT_SAMPLING = OnDeviceSampling(dynamic=True, deterministic=False)
SAMPLING_OFF = ("off", "none", "false")


class BuildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    revision: str | None = None
    backend: BackendName = "torch"
    tp_degree: StrictInt = Field(1, ge=1, le=MAX_TP_DEGREE)
    batch_size: StrictInt = Field(1, ge=1, le=MAX_BATCH_SIZE)
    seq_len: StrictInt = Field(128, ge=1, le=MAX_SEQ_LEN)
    max_context_length: StrictInt | None = Field(None, ge=1, le=MAX_SEQ_LEN)
    dtype: Dtype = "auto"
    context_buckets: Buckets = "auto"
    token_gen_buckets: Buckets = "auto"
    on_device_sampling: OnDeviceSampling | None = None
    quantized: StrictBool = False
    # NxD Inference's names (neuronx_distributed QuantizedDtype: INT8, F8E4M3 at every SDK;
    # F8E4M3FN only from 2.27). "s8" / "f8e4m3fn" (TNx, NEURON_QUANT_DTYPE) are accepted.
    quantization_dtype: Literal["int8", "f8e4m3"] = "int8"
    quantization_type: Literal["per_tensor_symmetric", "per_channel_symmetric"] = (
        "per_tensor_symmetric"
    )
    draft_model: str | None = None
    num_speculative_tokens: StrictInt = Field(0, ge=0, le=64)
    compiler: Literal["inductor", "export"] | None = "inductor"
    override_neuron_config: dict[str, Any] = Field(default_factory=dict)
    cc_flags: str = ""

    @field_validator("context_buckets", "token_gen_buckets", mode="before")
    @classmethod
    def _parse_buckets(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and value != "auto":
            return parse_int_list(value, info.field_name or "buckets")
        return value

    @field_validator("on_device_sampling", mode="before")
    @classmethod
    def _sampling_off(cls, value: Any) -> Any:
        if value is False or (isinstance(value, str) and value.strip().lower() in SAMPLING_OFF):
            return None
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("quantization_dtype", mode="before")
    @classmethod
    def _quant_dtype_alias(cls, value: Any) -> Any:
        return QUANT_DTYPES.get(value, value) if isinstance(value, str) else value

    @field_validator("override_neuron_config", mode="before")
    @classmethod
    def _parse_override(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_json_object(value, "override_neuron_config")
        return value

    def effective_max_context_length(self) -> int:
        return self.max_context_length or self.seq_len


# Which fields change what. The graph key covers GRAPH_FIELDS, the weights key WEIGHTS_FIELDS;
# RUNTIME_FIELDS never change a compiled result (they name where the weights came from, and
# the weights key covers the weights' content).
GRAPH_FIELDS = (
    "backend",
    "tp_degree",
    "batch_size",
    "seq_len",
    "max_context_length",
    "dtype",
    "context_buckets",
    "token_gen_buckets",
    "on_device_sampling",
    "quantized",
    "quantization_dtype",
    "quantization_type",
    "draft_model",
    "num_speculative_tokens",
    "compiler",
    "override_neuron_config",
    "cc_flags",
)
WEIGHTS_FIELDS = ("tp_degree", "dtype", "quantized", "quantization_dtype", "quantization_type")
RUNTIME_FIELDS = ("model", "revision")
FIELDS = tuple(BuildSpec.model_fields)

ENV_VARS = {
    "NEURON_CONTEXT_LENGTH_BUCKETS": "context_buckets",
    "NEURON_TOKEN_GEN_BUCKETS": "token_gen_buckets",
    "NEURON_QUANT_DTYPE": "quantization_dtype",
    "VLLM_NEURON_FRAMEWORK": "backend",
    "NEURON_CC_FLAGS": "cc_flags",
}
# The Neuron libraries vLLM loads an artifact with (VLLM_NEURON_FRAMEWORK's values) and the
# neuronctl backend that builds for each.
NXDI = "neuronx-distributed-inference"
TNX = "transformers-neuronx"
FRAMEWORK_BACKENDS = {NXDI: "nxdi", TNX: "tnx"}
# The backends whose compiler reads NEURON_CC_FLAGS; for the others the flags cannot matter.
USES_CC_FLAGS = frozenset({"nxdi", "tnx"})
QUANT_DTYPES = {"s8": "int8", "int8": "int8", "f8e4m3fn": "f8e4m3", "f8e4m3": "f8e4m3"}


_ASCII_INT = re.compile(r"[0-9]+")


def parse_int_list(text: str, where: str) -> list[int]:
    """ASCII digits only: int() also reads "١٢٨" (Arabic-Indic) and "1_000"."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(_ASCII_INT.fullmatch(p) for p in parts):
        raise SpecError(
            where, f"{text!r} is not a comma-separated list of integers", "e.g. 128,256,512"
        )
    return [int(p) for p in parts]


def parse_json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(where, f"malformed JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(value, dict):
        raise SpecError(where, "must be a JSON object", 'e.g. {"fused_qkv": true}')
    return value


def values_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for var, field in ENV_VARS.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        if field.endswith("buckets"):
            values[field] = parse_int_list(raw, var)
        elif var == "NEURON_QUANT_DTYPE":
            if raw not in QUANT_DTYPES:
                raise SpecError(var, f"{raw!r} is not a quantization dtype", "use s8 or f8e4m3fn")
            values[field] = QUANT_DTYPES[raw]
        elif var == "VLLM_NEURON_FRAMEWORK":
            if raw not in FRAMEWORK_BACKENDS:
                known = " or ".join(FRAMEWORK_BACKENDS)
                raise SpecError(var, f"{raw!r} is not a Neuron framework", f"use {known}")
            values[field] = FRAMEWORK_BACKENDS[raw]
        else:
            values[field] = raw
    return values


def values_from_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(str(path), "config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, binary
        raise SpecError(str(path), f"cannot read the config file: {_why(exc)}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(path), f"not valid TOML: {exc}") from None
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise SpecError(
            str(path), f"unknown key {unknown[0]!r}", "known keys: " + ", ".join(FIELDS)
        )
    return data


def _why(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    return getattr(exc, "strerror", None) or str(exc)


def resolve_spec(
    flags: Mapping[str, Any] | None = None,
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[BuildSpec, dict[str, str]]:
    """Merge the sources; return the spec and, per field, where its value came from."""
    layers: list[tuple[str, dict[str, Any]]] = [
        ("env", values_from_env(os.environ if env is None else env)),
    ]
    if config_file is not None:
        layers.append((f"file:{config_file}", values_from_file(config_file)))
    layers.append(("flag", {k: v for k, v in (flags or {}).items() if v is not None}))
    merged: dict[str, Any] = {}
    sources = {name: "default" for name in FIELDS}
    for source, values in layers:
        for name, value in values.items():
            merged[name] = value
            sources[name] = source
    if "max_context_length" not in merged:
        sources["max_context_length"] = "default (= seq_len)"
    return build_spec(merged), sources


def build_spec(values: Mapping[str, Any]) -> BuildSpec:
    try:
        spec = BuildSpec(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "spec"
        raise SpecError(field, err["msg"]) from None
    spec = normalize(spec)
    if spec.backend == "nxdi" and "on_device_sampling" not in values:
        spec = spec.model_copy(update={"on_device_sampling": NXDI_DEFAULT_SAMPLING})
    _check_consistent(spec)
    return spec


def normalize(spec: BuildSpec) -> BuildSpec:
    """Give fields that cannot matter one canonical value, so they never split a key."""
    updates: dict[str, Any] = {}
    if spec.backend != "torch":
        updates["compiler"] = None
    elif spec.compiler is None:
        updates["compiler"] = "inductor"
    if not spec.quantized:
        updates["quantization_dtype"] = "int8"
        updates["quantization_type"] = "per_tensor_symmetric"
    elif spec.backend == "tnx":
        # TNx (and vLLM over it) quantizes one way: vector_dynamic, per output channel.
        updates["quantization_type"] = "per_channel_symmetric"
    if spec.max_context_length is None:
        updates["max_context_length"] = spec.seq_len
    cc_flags = normalize_flags(spec.cc_flags) if spec.backend in USES_CC_FLAGS else ""
    if cc_flags != spec.cc_flags:
        updates["cc_flags"] = cc_flags
    for name in ("context_buckets", "token_gen_buckets"):
        value = getattr(spec, name)
        if isinstance(value, list):
            updates[name] = list(value)
    return spec.model_copy(update=updates) if updates else spec


def normalize_flags(text: str) -> str:
    """One spelling per set of compiler flags: "-O1  -x" and "-O1 -x" are the same flags."""
    try:
        return shlex.join(shlex.split(text))
    except ValueError:  # unbalanced quotes: leave the words alone
        return " ".join(text.split())


def _check_consistent(spec: BuildSpec) -> None:
    """Raise SpecError when the fields contradict each other (checks that need no model
    config). validate.check_spec is the other kind: a requested spec against a compiled one."""
    max_ctx = spec.effective_max_context_length()
    if spec.seq_len < max_ctx:
        raise SpecError(
            "seq_len",
            f"seq_len {spec.seq_len} is smaller than max_context_length {max_ctx}",
            f"raise --seq-len to at least {max_ctx} or lower --max-context-length",
        )
    _check_buckets("context_buckets", spec.context_buckets, max_ctx, "max_context_length")
    _check_buckets("token_gen_buckets", spec.token_gen_buckets, spec.seq_len, "seq_len")
    if spec.num_speculative_tokens and not spec.draft_model:
        raise SpecError(
            "num_speculative_tokens",
            "speculation needs a draft model",
            "pass --draft-model or set --num-speculative-tokens 0",
        )
    if spec.draft_model and not spec.num_speculative_tokens:
        raise SpecError("draft_model", "a draft model needs --num-speculative-tokens > 0")
    if spec.backend == "torch" and spec.draft_model:
        raise SpecError(
            "backend",
            "the torch backend does not implement speculation",
            "use --backend nxdi or tnx on a Neuron host",
        )
    if (
        spec.on_device_sampling
        and spec.on_device_sampling.top_k > spec.on_device_sampling.global_topk
    ):
        raise SpecError("on_device_sampling.top_k", "top_k is larger than global_topk")


def _check_buckets(field: str, buckets: Buckets, limit: int, limit_name: str) -> None:
    if buckets == "auto":
        return
    if not buckets:
        raise SpecError(field, "is empty", "give at least one bucket or 'auto'")
    if any(b <= 0 for b in buckets):
        raise SpecError(field, f"{buckets} has a bucket <= 0")
    if list(buckets) != sorted(set(buckets)):
        raise SpecError(
            field,
            f"{buckets} is not sorted ascending without repeats",
            f"use {sorted(set(buckets))}",
        )
    if buckets[-1] > limit:
        raise SpecError(
            field,
            f"bucket {buckets[-1]} is larger than {limit_name} {limit}",
            f"drop it or raise --{limit_name.replace('_', '-')}",
        )


def auto_buckets(limit: int) -> list[int]:
    """NxD Inference's rule: powers of two from 128 below the limit, then the limit."""
    buckets = []
    size = 128
    while size < limit:
        buckets.append(size)
        size *= 2
    return [*buckets, limit]


class ModelShape(BaseModel):
    """The few facts about a model's architecture the spec is checked against and a runner
    needs (the whole config.json stays available beside it: Manifest.architecture)."""

    model_config = ConfigDict(frozen=True)

    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int | None = None
    dtype: str | None = None
    model_type: str | None = None
    vocab_size: int | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a config.json, old or new transformers spelling (a nested text_config)."""
        text_config = config.get("text_config")
        if isinstance(text_config, Mapping) and "num_attention_heads" not in config:
            config = {**config, **text_config}
        heads = int(config.get("num_attention_heads") or 1)
        dtype = config.get("dtype") or config.get("torch_dtype")
        vocab = config.get("vocab_size")
        return cls(
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            max_position_embeddings=config.get("max_position_embeddings"),
            dtype=str(dtype) if dtype else None,
            model_type=config.get("model_type"),
            vocab_size=int(vocab) if vocab else None,
        )


def finalize(spec: BuildSpec, shape: ModelShape) -> BuildSpec:
    """Fill "auto" values from the model and check the spec against it."""
    updates: dict[str, Any] = {}
    if spec.dtype == "auto":
        updates["dtype"] = shape.dtype if shape.dtype in DTYPES else "bfloat16"
    if spec.context_buckets == "auto":
        updates["context_buckets"] = auto_buckets(spec.effective_max_context_length())
    if spec.token_gen_buckets == "auto":
        updates["token_gen_buckets"] = auto_buckets(spec.seq_len)
    spec = spec.model_copy(update=updates)
    check_against_model(spec, shape)  # a tp degree no backend could run is refused anyway
    if spec.backend in SINGLE_PROCESS_BACKENDS:
        spec = spec.model_copy(update={"tp_degree": 1})
    return spec


# Backends whose one process runs the whole model: no rank has weights or graphs of its own,
# so a tp degree cannot change the artifact and must not split a key (docs/torch-backend.md,
# "What tp means on CPU"). Here, not in `normalize`: a requested spec is normalized under the
# default backend before validate knows the artifact's, and finalize runs on the artifact's.
SINGLE_PROCESS_BACKENDS = frozenset({"torch"})


def check_against_model(spec: BuildSpec, shape: ModelShape) -> None:
    heads, kv_heads, tp = shape.num_attention_heads, shape.num_key_value_heads, spec.tp_degree
    if heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and _kv_ok(kv_heads, d)]
        raise SpecError(
            "tp_degree",
            f"tp degree {tp} does not divide the model's {heads} attention heads",
            f"use one of {divisors}",
        )
    if not _kv_ok(kv_heads, tp):
        raise SpecError(
            "tp_degree",
            f"tp degree {tp} neither divides the {kv_heads} KV heads nor is a multiple of them",
        )
    limit = shape.max_position_embeddings
    if limit and spec.seq_len > limit:
        raise SpecError(
            "seq_len",
            f"seq_len {spec.seq_len} is over the model's max_position_embeddings {limit}",
            f"use --seq-len {limit} or less",
        )


def _kv_ok(kv_heads: int, tp: int) -> bool:
    # KV heads are split when tp divides them and replicated when tp is a multiple of them.
    return kv_heads % tp == 0 or tp % kv_heads == 0


def spec_to_dict(spec: BuildSpec, fields: tuple[str, ...] = FIELDS) -> dict[str, Any]:
    data = spec.model_dump(mode="json")
    return {name: data[name] for name in fields}
