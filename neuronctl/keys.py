"""Content keys: canonical JSON hashed with sha256.

- graph key: what the compiled graphs depend on (architecture, graph fields of the spec,
  backend and its versions, compiler flags, artifact format). Weights are not in it, so a
  fine-tune of the same architecture reuses the compiled graphs.
- weights key: the checkpoint's content digest plus what the sharded weights depend on.
- artifact key: both, plus the digest of the tokenizer/generation files the artifact carries;
  its prefix names the artifact directory.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuronctl.spec import GRAPH_FIELDS, WEIGHTS_FIELDS, BuildSpec, spec_to_dict

# Bump when the artifact layout or the meaning of a recorded field changes.
FORMAT_VERSION = 3
KEY_LENGTH = 20  # hex chars of the artifact key used as the directory name (80 bits)

# config.json fields that never change the compiled graph: provenance, tooling and
# generation defaults. Everything else in the architecture config is kept.
NON_GRAPH_CONFIG_FIELDS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures_auto_map",
        "auto_map",
        "torch_dtype",
        "dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "task_specific_params",
        "_attn_implementation_autoset",
        "attn_implementation",
    }
)


def _normalize(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot key a non-finite number: {value}")
        # 1.0 and 1 are the same knob; -0.0 and 0 too.
        return int(value) if value.is_integer() else value
    if isinstance(value, int):
        return value
    if isinstance(value, Mapping):
        return {str(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    raise TypeError(f"cannot key a {type(value).__name__}")


def canonical_json(value: Any) -> str:
    return json.dumps(_normalize(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def graph_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in NON_GRAPH_CONFIG_FIELDS}


@dataclass(frozen=True)
class Keys:
    graph: str
    weights: str
    artifact: str

    @property
    def dirname(self) -> str:
        return self.artifact[:KEY_LENGTH]

    def as_dict(self) -> dict[str, str]:
        return {"graph_key": self.graph, "weights_key": self.weights, "artifact_key": self.artifact}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Keys:
        """The manifest's spelling (graph_key, weights_key, artifact_key) back into Keys."""
        return cls(
            graph=str(data["graph_key"]),
            weights=str(data["weights_key"]),
            artifact=str(data["artifact_key"]),
        )


def graph_key(
    spec: BuildSpec, config: Mapping[str, Any], backend_versions: Mapping[str, str]
) -> str:
    return digest(
        {
            "format": FORMAT_VERSION,
            "architecture": graph_config(config),
            "spec": spec_to_dict(spec, GRAPH_FIELDS),
            "backend": spec.backend,
            "versions": dict(backend_versions),
        }
    )


def weights_key(spec: BuildSpec, checkpoint_digest: str) -> str:
    return digest(
        {
            "format": FORMAT_VERSION,
            "checkpoint": checkpoint_digest,
            "spec": spec_to_dict(spec, WEIGHTS_FIELDS),
        }
    )


def compute_keys(
    spec: BuildSpec,
    config: Mapping[str, Any],
    backend_versions: Mapping[str, str],
    checkpoint_digest: str,
    *,
    model_files: str | None = None,
) -> Keys:
    """The one place keys are computed. `spec` must be finalized (no "auto" left).

    `model_files` is the digest of the tokenizer/generation files the artifact carries
    (checkpoints.digest.model_files_digest): they change what serve does, not the graphs or
    the weights, so only the artifact key covers them.
    """
    if spec.dtype == "auto" or "auto" in (spec.context_buckets, spec.token_gen_buckets):
        raise ValueError("keys need a finalized spec (call spec.finalize first)")
    g = graph_key(spec, config, backend_versions)
    w = weights_key(spec, checkpoint_digest)
    parts = {"graph": g, "weights": w}
    if model_files is not None:
        parts["model_files"] = model_files
    return Keys(graph=g, weights=w, artifact=digest(parts))
