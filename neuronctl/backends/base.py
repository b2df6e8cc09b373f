"""The one small interface every backend implements.

A backend turns (finalized spec, checkpoint) into files in a staging directory, and loads such a
directory into a Runner the engine can drive. Keys, manifest, store, validation, serving and
generation are backend-independent and live outside this package.

The shape fits all three backends:
- torch: `build` exports one graph per bucket and shards the weights; `load` reads them back.
- nxdi: `build` is NeuronConfig + `model.compile(staging)`; `load` is `model.load(path)`.
- tnx:  `build` is `from_pretrained(...).to_neuron()` + `save(staging)`; `load` is
        `load(path)` + `to_neuron()`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from neuronctl.progress import NullProgress, Progress

if TYPE_CHECKING:
    import torch

    from neuronctl.checkpoints import Checkpoint
    from neuronctl.checks import Check
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import Manifest, OpChoice

# An artifact's settings file, under NxD Inference's name: nxdi's compile writes it, the torch
# backend writes its own in the same place so that tools reading artifacts find one file name.
NEURON_CONFIG = "neuron_config.json"


@dataclass
class BuildRequest:
    spec: BuildSpec  # finalized: no "auto" left
    checkpoint: Checkpoint
    staging: Path  # empty directory to fill; becomes the artifact on success
    # A published artifact with the same graph key: copy its graphs, only shard weights.
    reuse_graphs_from: Path | None = None
    progress: Progress = field(default_factory=NullProgress)
    jobs: int = 1  # parallel compile workers allowed


@dataclass
class BuildResult:
    graphs: list[str]  # relative paths of compiled graph files in staging
    graphs_reused: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the manifest host facts
    ops: OpChoice | None = None  # torch: the matmul paths chosen (manifest `ops`)


class Runner(Protocol):
    """A loaded artifact, driven one step at a time by the engine.

    The KV cache has `batch_size` slots of `seq_len` positions (Neuron's static layout). Slot
    ids are 0..batch_size-1. Logits are float32 on the CPU.
    """

    batch_size: int
    seq_len: int
    max_context_length: int
    context_buckets: Sequence[int]
    token_gen_buckets: Sequence[int]
    vocab_size: int

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Context-encode one prompt into `slot`; return the last position's logits [vocab]."""
        ...

    # Optional (the engine checks with getattr): context-encode several prompts in one graph
    # call, one per slot, and return the last positions' logits [len(slots), vocab]. A runner
    # without it gets one `prefill` call per prompt.
    # def prefill_batch(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> Tensor

    def decode(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One token-generation step over all slots; return logits [batch_size, vocab].

        `token_ids[s]` is written at `positions[s]` of slot s; idle slots pass position -1
        and their row of the result is undefined.

        Invariant: a decode never writes into the history of any slot. An idle slot may
        hold a live sequence (one prefilled in this very step, decoded from the next), so a
        runner whose compiled batch must write every row writes an idle row at or past that
        slot's next free position, where the slot's next real token overwrites it before
        anything attends to it (never at position 0).
        """
        ...


class Backend(Protocol):
    name: str

    def versions(self, spec: BuildSpec | None = None) -> dict[str, str]:
        """Versions the compiled result of `spec` depends on (part of the graph key and the
        manifest); without a spec, every version the backend's results can depend on."""
        ...

    def architectures(self) -> Mapping[str, str]:
        """HF architecture name -> note, for what this backend supports."""
        ...

    def check(self, spec: BuildSpec, config: Mapping[str, Any]) -> None:
        """Refuse a spec/model this backend cannot build exactly (raise SpecError)."""
        ...

    def build(self, request: BuildRequest) -> BuildResult:
        """Fill request.staging with graphs, sharded weights and the backend's config.
        `request.spec` has passed `check` (build.resolve_build, the one place that asks)."""
        ...

    def load(self, path: Path, manifest: Manifest) -> Runner:
        """Load a published artifact for running."""
        ...

    def host_checks(self, manifest: Manifest) -> list[Check]:
        """Can this host run the artifact as-is (versions, ISA, cores/devices)?"""
        ...
