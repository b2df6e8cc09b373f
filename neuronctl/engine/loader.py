"""Open a published artifact for running: validate, load the backend's runner, the tokenizer.

Everything comes from the artifact directory (manifest, tokenizer, generation config copied in
at compile time), never from flags, so what runs is what was compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends import get_backend
from neuronctl.backends.base import Runner
from neuronctl.engine.engine import Engine
from neuronctl.engine.errors import RequestError
from neuronctl.engine.sampling import DEFAULT_GLOBAL_TOPK
from neuronctl.engine.tokenizer import EngineTokenizer
from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.store.manifest import Manifest, read_manifest

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec
    from neuronctl.store.signing import TrustPolicy, Vouch


class NotReusableError(NeuronctlError):
    """The artifact failed the quick validation checks; nothing was loaded."""


@dataclass
class LoadedArtifact:
    path: Path
    manifest: Manifest
    runner: Runner
    tokenizer: EngineTokenizer
    eos_ids: list[int]
    global_topk: int = DEFAULT_GLOBAL_TOPK
    vouch: Vouch | None = None  # who vouches for the code in it (signing.check_origin)

    @property
    def model_name(self) -> str:
        """The default served model name: what the user compiled (a Hub id or a path)."""
        return self.manifest.source.model or self.path.name

    def encode(self, text: str) -> list[int]:
        if not text:  # a BOS alone is no prompt (docs/runtime.md: empty prompts are refused)
            raise RequestError("the prompt is empty", param="prompt")
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode_chat(messages)


def resolve_artifact_path(path: str | Path | None, policy: TrustPolicy | None = None) -> Path:
    if not path:
        raise UsageError(
            "no artifact given",
            "pass --artifacts PATH or set NEURON_COMPILED_ARTIFACTS",
        )
    if "://" in str(path):  # s3://bucket/prefix/KEY: pull (verified) into the local store first
        from neuronctl.store.local import Store, default_store_root
        from neuronctl.store.remote import resolve_artifacts_arg

        return resolve_artifacts_arg(str(path), Store(default_store_root()), policy=policy)
    resolved = Path(path).expanduser()
    if not resolved.is_dir():
        raise NotFoundError(
            f"artifact directory {resolved} does not exist",
            "compile one with `neuronctl compile MODEL` and pass the path it prints",
        )
    return resolved


def open_artifact(
    path: str | Path | None, validate: bool = True, policy: TrustPolicy | None = None
) -> LoadedArtifact:
    root = resolve_artifact_path(path, policy)
    if validate:
        check_reusable(root)
    manifest = read_manifest(root)
    vouch = vouch_for(root, policy)  # before loading: graphs and libraries are code
    runner = get_backend(manifest.backend).load(root, manifest)
    tokenizer = load_tokenizer(root)
    eos = eos_token_ids(root)
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    return LoadedArtifact(
        root, manifest, runner, tokenizer, eos, global_topk(manifest), vouch=vouch
    )


def vouch_for(path: Path, policy: TrustPolicy | None = None) -> Vouch:
    """Who vouches for an artifact's code: a build on this host, a trusted signature, or
    --allow-unsigned; a pulled artifact with none of them is refused (SignatureError)."""
    from neuronctl.store.signing import TrustPolicy, check_origin

    return check_origin(path, read_manifest(path), policy or TrustPolicy.load())


def check_reusable(
    path: Path, spec: BuildSpec | None = None, sources: dict[str, str] | None = None
) -> None:
    """The single call site of the reuse checks before any load (generate, serve, bench).

    With a requested spec (serve's spec flags or -c), the artifact must also match it."""
    from neuronctl.validate import quick_validate, validate_artifact

    report = (
        quick_validate(path) if spec is None else validate_artifact(path, spec, sources=sources)
    )
    if not report.reusable:
        reasons = "; ".join(f"{c.name}: {c.reason}" for c in report.failed)
        raise NotReusableError(
            f"{path} cannot be used as-is: {reasons}",
            f"run `neuronctl validate {path}` for details; serve and generate never compile",
        )


def make_engine(loaded: LoadedArtifact, max_queue: int | None = None) -> Engine:
    return Engine(
        loaded.runner,
        loaded.tokenizer.new_decoder,
        eos_ids=loaded.eos_ids,
        global_topk=loaded.global_topk,
        max_queue=max_queue,
    )


def load_tokenizer(path: Path) -> EngineTokenizer:
    return EngineTokenizer.load(path)


def eos_token_ids(path: Path) -> list[int]:
    """EOS ids from generation_config.json, else config.json (an int or a list in either)."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((path / name).read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value:
            return [int(v) for v in value]
    return []


def global_topk(manifest: Manifest) -> int:
    sampling = manifest.spec.get("on_device_sampling") or {}
    return int(sampling.get("global_topk", DEFAULT_GLOBAL_TOPK))
