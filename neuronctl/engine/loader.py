"""Open a published artifact for running: validate, load the backend's runner, the tokenizer.

Everything comes from the artifact directory (manifest, tokenizer, generation config copied in
at compile time), never from flags, so what runs is what was compiled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuronctl import process
from neuronctl.backends import get_backend
from neuronctl.backends.base import Runner
from neuronctl.engine.engine import Engine
from neuronctl.engine.tokenizer import EngineTokenizer, TokenizedText
from neuronctl.spec import DEFAULT_GLOBAL_TOPK
from neuronctl.store.lease import Lease
from neuronctl.store.lease import hold as hold_lease
from neuronctl.store.manifest import Manifest, read_manifest, served_name
from neuronctl.validate import NotReusableError, check_reusable

if TYPE_CHECKING:
    from neuronctl.store.signing import TrustPolicy, Vouch

__all__ = ["LoadedArtifact", "NotReusableError", "check_reusable", "open_artifact"]


@dataclass
class LoadedArtifact(TokenizedText):
    path: Path
    manifest: Manifest
    runner: Runner
    tokenizer: EngineTokenizer
    eos_ids: list[int]
    global_topk: int = DEFAULT_GLOBAL_TOPK
    vouch: Vouch | None = None  # who vouches for the code in it (signing.check_origin)
    lease: Lease | None = None  # held while loaded: gc leaves the artifact alone

    @property
    def model_name(self) -> str:
        """The default served model name: the Hub id the artifact was compiled from (for a
        local checkpoint, its Hub id when it is a Hub cache snapshot, else its folder's name;
        never the path as typed, which clients cannot know)."""
        return served_name(self.manifest.source.model, self.manifest.source.revision) or (
            self.path.name
        )


def open_artifact(
    path: Path,
    validate: bool = True,
    policy: TrustPolicy | None = None,
    manifest: Manifest | None = None,
) -> LoadedArtifact:
    """Load the artifact directory `path` (what a reference names is runnable.py's to say).
    `manifest`: what the caller's reuse checks read just now (validate=False), so the
    command reads it once; the load rule and the graphs' and weights' sha256s are judged
    against it all the same.

    One identity throughout: the directory `path` resolves to now is what is leased, judged
    by the load rule and loaded, so a link to an artifact is leased as the artifact (and
    `artifacts rm` of it is refused while it is in use), whatever the link later points at."""
    path = Path(path).resolve()
    lease = hold_lease(path)  # before reading it: `artifacts gc` keeps what is in use
    try:
        loaded = _load(path, validate, policy, manifest)
    except BaseException:
        lease.release()
        raise
    loaded.lease = lease
    return loaded


def _load(
    root: Path, validate: bool, policy: TrustPolicy | None, manifest: Manifest | None
) -> LoadedArtifact:
    from neuronctl.store.signing import TrustPolicy, check_origin

    if manifest is None:
        manifest = check_reusable(root) if validate else read_manifest(root)
    # Before loading: graphs and libraries are code.
    vouch = check_origin(root, manifest, policy or TrustPolicy.load())
    with one_intra_op_thread():
        runner = get_backend(manifest.backend).load(root, manifest)
    tokenizer = load_tokenizer(root)
    eos = eos_token_ids(root)
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    return LoadedArtifact(root, manifest, runner, tokenizer, eos, global_topk(manifest), vouch)


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Load on this thread without starting an OpenMP team on it.

    The engine runs the model on its own thread. A team this (main) thread started while
    loading stays behind and takes cores from the engine's: on 2 cores, bf16 batch-1 decode
    from the engine thread ran at 21-26 tok/s after a loading team, 52-61 without one (the
    same Runner from the main thread: 53-61). docs/performance-log.md has the measurement."""
    with process.torch_threads(1):
        yield


def make_engine(loaded: LoadedArtifact, max_queue: int | None = None) -> Engine:
    return Engine(
        loaded.runner,
        loaded.tokenizer.new_decoder,
        eos_ids=loaded.eos_ids,
        global_topk=loaded.global_topk,
        max_queue=max_queue,
    )


@contextmanager
def running(loaded: LoadedArtifact) -> Iterator[Engine]:
    """An engine over `loaded`, started for the block and stopped however it ends (an error,
    Ctrl-C): what is still generating then is abandoned, not finished (`generate`, `bench`;
    the server drains on its own)."""
    engine = make_engine(loaded).start()
    try:
        yield engine
    finally:
        engine.stop(drain=False)


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
    sampling = manifest.spec.on_device_sampling
    return sampling.global_topk if sampling is not None else DEFAULT_GLOBAL_TOPK
