"""Compile orchestration: spec + checkpoint -> keys -> (cache hit | backend build) -> artifact.

Backend-neutral: the backend fills a staging directory; this module decides whether to build
at all, what the artifact is called, what goes beside the backend's files, and what the
manifest records. The store makes it atomic.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends import get_backend
from neuronctl.backends.base import Backend, BuildRequest
from neuronctl.errors import CheckpointError, UsageError
from neuronctl.keys import Keys, compute_keys
from neuronctl.progress import NullProgress, Progress
from neuronctl.spec import BuildSpec, finalize, resolve_spec
from neuronctl.store.local import Published, Store, default_store_root
from neuronctl.store.manifest import (
    Manifest,
    OpChoice,
    Source,
    host_facts,
    intact_problem,
    is_intact,
    sha256_file,
)

if TYPE_CHECKING:
    from neuronctl.checkpoints import Checkpoint
    from neuronctl.store.signing import Signer, TrustPolicy

logger = logging.getLogger(__name__)


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
    versions = backend.versions(spec)
    digest = checkpoint.digest(rehash)
    keys = compute_keys(
        spec,
        checkpoint.config,
        versions,
        digest,
        model_files=checkpoint.model_files_digest(rehash),
    )
    logger.info(
        "keys for %s: artifact %s (graph %s, weights %s)",
        spec.model, keys.artifact[:12], keys.graph[:12], keys.weights[:12],
    )
    store = Store(store_dir or default_store_root())
    logger.info("store: %s", store.artifacts)
    return ResolvedBuild(spec, sources, checkpoint, backend, keys, store, versions, digest)


def compile_model(
    build: ResolvedBuild, progress: Progress | None = None, jobs: int | None = None
) -> CompileOutcome:
    """Publish the artifact for `build`, compiling only what no artifact already has."""
    started = time.monotonic()
    problem = intact_problem(build.path)
    if problem is None:
        logger.info("cache hit: %s is intact (every listed file at its size)", build.path)
    else:
        logger.info("cache miss: %s", problem)
        check_tokenizer(build.checkpoint)
    reuse_from = find_graph_donor(build.store, build.keys)
    if reuse_from is not None:
        logger.info("graph key %s already compiled in %s: reusing its graphs",
                    build.keys.graph[:12], reuse_from)
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
        if result.graphs_reused and reuse_from is not None:
            carry_graph_origin(reuse_from, staging, result.graphs)
        from neuronctl.checkpoints.hub import copy_model_files

        copy_model_files(build.checkpoint.path, staging)
        return new_manifest(build, result.graphs, result.extra, result.ops)

    published: Published = build.store.publish(
        build.keys.dirname, fill, reuse=is_intact, on_step=_log_step
    )
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
    from neuronctl.store.remote.client import open_remote

    started = time.monotonic()
    remote = open_remote(remote_url)
    dirname = build.keys.dirname
    if not is_intact(build.path) and remote.has(dirname):
        logger.info("remote %s has %s: pulling instead of compiling", remote_url, dirname)
        published = remote.pull(dirname, build.store, progress, policy, build.keys.artifact)
        return CompileOutcome(
            path=published.path,
            keys=build.keys,
            cache_hit=True,
            graphs_reused=False,
            compile_seconds=time.monotonic() - started,
            pulled=not published.cache_hit,
        )
    outcome = compile_model(build, progress, jobs)
    logger.info("pushing %s to %s", outcome.path.name, remote_url)
    outcome.pushed = not remote.push(outcome.path, progress, signer=signer).noop
    return outcome


def _log_step(name: str) -> None:
    logger.info("publish: %s", name)


def new_manifest(
    build: ResolvedBuild, graphs: list[str], extra: Mapping[str, Any],
    ops: OpChoice | None = None,
) -> Manifest:
    checkpoint = build.checkpoint
    return Manifest(
        backend=build.spec.backend,
        backend_versions=build.versions,
        host={**host_facts(), **extra},
        spec=build.spec,
        keys=build.keys,
        source=Source(
            model=build.spec.model,
            path=str(checkpoint.path),
            revision=checkpoint.revision,
            digest=build.digest,
        ),
        architecture=dict(checkpoint.config),
        graphs=graphs,
        ops=ops,
    )


# Any one of these makes a tokenizer transformers can load (with tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", ".tiktoken")


def check_tokenizer(checkpoint: Checkpoint) -> None:
    """An artifact carries its tokenizer (generate and serve read nothing else): refuse to
    build one from a checkpoint that has none, before compiling anything."""
    from neuronctl.checkpoints.hub import model_files

    names = [p.name for p in model_files(checkpoint.path)]
    if not any(name.endswith(TOKENIZER_FILES) for name in names):
        raise CheckpointError(
            f"{checkpoint.path} has no tokenizer files (tokenizer.json, tokenizer.model, "
            "vocab.json or *.tiktoken): generate and serve could not run the artifact",
            "copy the tokenizer files of the base model into the checkpoint directory, e.g. "
            "`huggingface-cli download BASE_MODEL tokenizer.json tokenizer_config.json "
            f"--local-dir {checkpoint.path}`",
        )


def find_graph_donor(store: Store, keys: Keys) -> Path | None:
    """A published artifact with the same graph key but other weights: its graphs are ours.

    Its graphs are re-hashed first: a copied graph gets a fresh manifest entry, so a damaged
    donor would otherwise pass its damage on under a record that vouches for it.
    """
    for path, manifest in store.iter_artifacts():
        if (
            manifest is not None
            and manifest.keys.graph == keys.graph
            and manifest.keys.artifact != keys.artifact
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


def carry_graph_origin(donor: Path, staging: Path, graphs: list[str]) -> None:
    """Graphs copied from a pulled artifact stay that artifact's: the new one records who
    signed them, and every load checks that key is still trusted (signing.check_origin)."""
    from neuronctl.store.signing import GRAPH_ORIGIN, graph_origin_record

    record = graph_origin_record(donor, graphs)
    if record is not None:
        (staging / GRAPH_ORIGIN).write_text(record)


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
