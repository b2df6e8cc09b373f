"""Compile orchestration: spec + checkpoint -> keys -> (cache hit | backend build) -> artifact.

Backend-neutral: the backend fills a staging directory; this module decides whether to build
at all, what the artifact is called, what goes beside the backend's files, and what the
manifest records. The store makes it atomic.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends import get_backend
from neuronctl.backends.base import Backend, BuildRequest, NullProgress, Progress
from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.keys import Keys, compute_keys
from neuronctl.spec import BuildSpec, finalize, resolve_spec, spec_to_dict
from neuronctl.store.local import Published, Store, default_store_root, is_artifact
from neuronctl.store.manifest import Manifest, Source, host_facts, read_manifest, sha256_file

if TYPE_CHECKING:
    from neuronctl.checkpoints import Checkpoint
    from neuronctl.store.signing import Signer, TrustPolicy


@dataclass
class ResolvedBuild:
    spec: BuildSpec  # finalized
    sources: dict[str, str]  # field -> flag | file:PATH | env | default
    checkpoint: Checkpoint
    backend: Backend
    keys: Keys
    store: Store
    versions: dict[str, str]  # what the keys were computed with; recorded in the manifest
    digest: str  # the checkpoint content digest in the weights key

    @property
    def path(self) -> Path:
        return self.store.path(self.keys.dirname)


@dataclass
class CompileOutcome:
    path: Path
    keys: Keys
    cache_hit: bool
    graphs_reused: bool
    compile_seconds: float
    pulled: bool = False  # came from the remote store instead of being compiled
    pushed: bool | None = None  # None: no remote store; False: it already had the artifact

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            **self.keys.as_dict(),
            "cache_hit": self.cache_hit,
            "graphs_reused": self.graphs_reused,
            "compile_seconds": round(self.compile_seconds, 3),
            "pulled": self.pulled,
            "pushed": self.pushed,
        }


def resolve_build(
    model: str | None,
    spec_flags: Mapping[str, Any],
    config_file: Path | None = None,
    *,
    revision: str | None = None,
    store_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    rehash: bool = False,
    allow_pickle: bool = False,
) -> ResolvedBuild:
    """Everything `compile` needs, and all `hash` prints, without compiling anything."""
    from neuronctl.checkpoints import open_checkpoint
    from neuronctl.checkpoints.registry import check_supported

    flags = {**spec_flags, "model": model, "revision": revision}
    spec, sources = resolve_spec(flags, config_file, env)
    if not spec.model:
        raise UsageError(
            "no model given", "name a Hub id or a local directory, or set `model` in -c FILE"
        )
    checkpoint = open_checkpoint(spec.model, spec.revision, allow_pickle=allow_pickle)
    check_supported(checkpoint.architecture, spec.backend)
    spec = finalize(spec, checkpoint.shape())
    backend = get_backend(spec.backend)
    backend.check(spec, checkpoint.config)
    versions = backend.versions()
    digest = checkpoint.digest(rehash)
    keys = compute_keys(
        spec,
        checkpoint.config,
        versions,
        digest,
        model_files=checkpoint.model_files_digest(rehash),
    )
    local_model = checkpoint.path if checkpoint.revision is None else None
    store = Store(store_dir or default_store_root(local_model))
    return ResolvedBuild(spec, sources, checkpoint, backend, keys, store, versions, digest)


def compile_model(
    build: ResolvedBuild, progress: Progress | None = None, jobs: int | None = None
) -> CompileOutcome:
    """Publish the artifact for `build`, compiling only what no artifact already has."""
    started = time.monotonic()
    reuse_from = find_graph_donor(build.store, build.keys)
    reused: list[bool] = []

    def fill(staging: Path) -> Manifest:
        result = build.backend.build(
            BuildRequest(
                spec=build.spec,
                checkpoint=build.checkpoint,
                staging=staging,
                reuse_graphs_from=reuse_from,
                progress=progress or NullProgress(),
                jobs=jobs or os.cpu_count() or 1,
            )
        )
        reused.append(result.graphs_reused)
        copy_model_files(build.checkpoint.path, staging)
        return new_manifest(build, result.graphs, result.extra)

    published: Published = build.store.publish(build.keys.dirname, fill, reuse=is_intact)
    return CompileOutcome(
        path=published.path,
        keys=build.keys,
        cache_hit=published.cache_hit,
        graphs_reused=bool(reused and reused[0]),
        compile_seconds=time.monotonic() - started,
    )


def compile_with_remote(
    build: ResolvedBuild,
    remote_url: str,
    progress: Progress | None = None,
    jobs: int | None = None,
    signer: Signer | None = None,
    policy: TrustPolicy | None = None,
) -> CompileOutcome:
    """A remote hit is pulled (signature checked against `policy`), not compiled; a fresh
    compile is pushed (signed by `signer` when given)."""
    from neuronctl.store.remote import open_remote

    started = time.monotonic()
    remote = open_remote(remote_url)
    dirname = build.keys.dirname
    if not is_intact(build.path) and remote.has(dirname):
        published = remote.pull(dirname, build.store, progress, policy)
        return CompileOutcome(
            path=published.path,
            keys=build.keys,
            cache_hit=True,
            graphs_reused=False,
            compile_seconds=time.monotonic() - started,
            pulled=not published.cache_hit,
        )
    outcome = compile_model(build, progress, jobs)
    outcome.pushed = not remote.push(outcome.path, progress, signer=signer).noop
    return outcome


def new_manifest(build: ResolvedBuild, graphs: list[str], extra: Mapping[str, Any]) -> Manifest:
    checkpoint = build.checkpoint
    return Manifest(
        backend=build.spec.backend,
        backend_versions=build.versions,
        host={**host_facts(), **extra},
        spec=spec_to_dict(build.spec),
        keys=build.keys.as_dict(),
        source=Source(
            model=build.spec.model,
            path=str(checkpoint.path),
            revision=checkpoint.revision,
            digest=build.digest,
        ),
        architecture=dict(checkpoint.config),
        graphs=graphs,
    )


def copy_model_files(model_dir: Path, staging: Path) -> None:
    """Config and tokenizer files, so an artifact is self-contained: serve/generate need
    nothing else. They are the files a download always fetches."""
    from neuronctl.checkpoints.hub import model_files

    for src in model_files(model_dir):
        if not (staging / src.name).exists():
            shutil.copyfile(src, staging / src.name)


def is_intact(path: Path) -> bool:
    """Good enough for a cache hit: a manifest, and every file it lists at its size.

    A damaged artifact is rebuilt (and replaced atomically) rather than reused.
    """
    from neuronctl.validate import file_problems  # the same rule as validate's files check

    if not is_artifact(path):
        return False
    try:
        return not any(file_problems(path, read_manifest(path)))
    except (NeuronctlError, OSError):
        return False


def find_graph_donor(store: Store, keys: Keys) -> Path | None:
    """A published artifact with the same graph key but other weights: its graphs are ours.

    Its graphs are re-hashed first: a copied graph gets a fresh manifest entry, so a damaged
    donor would otherwise pass its damage on under a record that vouches for it.
    """
    for path, manifest in store.iter_artifacts():
        if (
            manifest is not None
            and manifest.keys.get("graph_key") == keys.graph
            and manifest.keys.get("artifact_key") != keys.artifact
            and is_intact(path)
            and graphs_match(path, manifest)
            and _vouched(path, manifest)
        ):
            return path
    return None


def _vouched(path: Path, manifest: Manifest) -> bool:
    """Graphs are code: a donor pulled without a trusted signature must not pass its graphs
    into an artifact that then looks built here."""
    from neuronctl.store.signing import SignatureError, TrustPolicy, check_origin

    try:
        check_origin(path, manifest, TrustPolicy.load())
    except SignatureError:
        return False
    return True


def graphs_match(path: Path, manifest: Manifest) -> bool:
    """Every graph the manifest names has its recorded sha256."""
    for rel in manifest.graphs:
        entry = manifest.files.get(rel)
        try:
            if entry is None or sha256_file(path / rel) != entry.sha256:
                return False
        except OSError:
            return False
    return bool(manifest.graphs)
