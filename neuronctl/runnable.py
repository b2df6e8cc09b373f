"""Which artifact `serve`, `generate` and `bench` run, whatever the engine: resolve the
reference, check it is reusable, and (only with --compile-if-missing) compile it when it is
not. A dry run never compiles and never pulls: it says what it would do. Every command that
runs an artifact decides here, so a reference resolves, and is refused, the same way in each."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.store.manifest import Manifest, is_intact, read_manifest
from neuronctl.store.resolve import NotPulledError, open_store, resolve_artifact
from neuronctl.validate import check_reusable, requested_spec

if TYPE_CHECKING:
    from neuronctl.engine.loader import LoadedArtifact
    from neuronctl.store.signing import TrustPolicy

logger = logging.getLogger(__name__)


@dataclass
class ArtifactToRun:
    path: Path | None  # None only for a dry run that would pull or compile first
    action: str  # "use" | "pull" | "compile"
    reason: str = ""  # why a pull or compile is (or would be) needed
    manifest: Manifest | None = None  # what the reuse checks read, when they ran

    def read_manifest(self) -> Manifest:
        """The artifact's manifest: what the reuse checks read, else read now (a compile)."""
        assert self.path is not None  # only a dry run leaves it unknown
        return self.manifest or read_manifest(self.path)

    def plan(self) -> dict[str, Any]:
        return {"artifact": str(self.path) if self.path else None, "action": self.action,
                "reason": self.reason}


def artifact_to_run(
    artifacts: str | None,
    *,
    spec_flags: Mapping[str, Any] | None = None,
    config: Path | None = None,
    store: Path | None = None,
    compile_if_missing: bool = False,
    model: str | None = None,
    dry_run: bool = False,
    policy: TrustPolicy | None = None,
    serving_host: bool = True,
) -> ArtifactToRun:
    """The artifact to load. With a requested spec (flags or -c) it must match it too.
    `serving_host` False: this host only prints a launch for another one, so the checks of
    the host that loads it are skipped (validate.check_reusable)."""
    if model and not compile_if_missing:
        raise UsageError("--model is only used with --compile-if-missing")
    if compile_if_missing and not model:
        raise UsageError("--compile-if-missing needs --model MODEL to compile")
    spec, sources = requested_spec(dict(spec_flags or {}), config)
    try:
        path = _existing(resolve_artifact(artifacts, store, fetch=not dry_run, policy=policy))
        manifest = check_reusable(path, spec, sources, serving_host)
        return ArtifactToRun(path, "use", manifest=manifest)
    except NotPulledError as exc:  # only a dry run leaves a remote artifact unpulled
        missing: NeuronctlError = exc
        if not compile_if_missing:
            where = open_store(store).artifacts
            return ArtifactToRun(None, "pull", f"{artifacts} would be pulled into {where}")
    except NeuronctlError as exc:
        missing = exc
    if not compile_if_missing:
        raise missing
    return _compile(model or "", spec_flags or {}, config, store, dry_run, missing.message)


def open_artifact_to_run(
    artifacts: str | None, *, store: Path | None, policy: TrustPolicy
) -> LoadedArtifact:
    """The artifact `generate` and `bench` run (no spec flags, never compiled), checked and
    loaded for the built-in engine as `serve` loads its own."""
    from neuronctl.engine.loader import open_artifact

    run = artifact_to_run(artifacts, store=store, policy=policy)
    assert run.path is not None  # only a dry run leaves it unknown
    # Checked just now: the load judges the manifest the checks read.
    return open_artifact(run.path, validate=False, policy=policy, manifest=run.manifest)


def _existing(path: Path) -> Path:
    if not path.exists():
        raise NotFoundError(
            f"artifact directory {path} does not exist",
            "compile one with `neuronctl compile MODEL` and pass the path it prints",
        )
    return path


def _compile(
    model: str,
    spec_flags: Mapping[str, Any],
    config: Path | None,
    store: Path | None,
    dry_run: bool,
    why: str,
) -> ArtifactToRun:
    from neuronctl.build import compile_model, resolve_build

    build = resolve_build(model, spec_flags, config, store_dir=store)
    if dry_run and is_intact(build.path):
        return ArtifactToRun(build.path, "use", f"{model} is already compiled: {build.path}")
    if dry_run:
        logger.info("dry run: would compile %s into %s", model, build.path)
        return ArtifactToRun(None, "compile", f"would compile {model} into {build.path}: {why}")
    logger.warning("compiling %s: %s", model, why)
    return ArtifactToRun(compile_model(build).path, "compile", why)
