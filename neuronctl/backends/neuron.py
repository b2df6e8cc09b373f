"""What the two Neuron SDK backends (nxdi, tnx) share: versions, env for the compiler, errors,
the KV slots idle rows write to and the logits read from a model's output."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from importlib import metadata
from typing import TYPE_CHECKING, Any

from neuronctl import process
from neuronctl.doctor import NEURON_REPO
from neuronctl.errors import BackendUnavailableError, BuildError, NeuronctlError

if TYPE_CHECKING:
    import torch


def install_hint(packages: Sequence[str]) -> str:
    return f"pip install --extra-index-url {NEURON_REPO} " + " ".join(packages)


def sdk_versions(
    packages: Sequence[str], unavailable: Callable[[str], BackendUnavailableError]
) -> dict[str, str]:
    """Installed versions of `packages`; the first missing one raises `unavailable(name)`."""
    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise unavailable(name) from None
    return out


def env_var(name: str, value: str | None) -> AbstractContextManager[None]:
    """Set (or, with None/empty, unset) one variable the SDK reads for the duration, then
    restore it (process.environment: the SDK compilers read the environment, not ours)."""
    return process.environment({name: value})


def cc_flags_env(flags: str) -> AbstractContextManager[None]:
    """NEURON_CC_FLAGS is part of the key: compile with exactly the recorded flags."""
    return env_var("NEURON_CC_FLAGS", flags)


@contextmanager
def sdk_failure(framework: str) -> Iterator[None]:
    """The SDK's own failure becomes a BuildError: nothing gets published."""
    try:
        yield
    except NeuronctlError:
        raise
    except Exception as exc:
        raise BuildError(
            f"{framework} compile failed: {type(exc).__name__}: {exc}",
            "run again with --debug for the SDK's traceback",
        ) from exc


class SlotFill:
    """How far each KV-cache slot of a static-batch Neuron model is written, so that a decode
    step can give its idle slots (position -1) a write position no live sequence reads.

    The compiled token-generation graph writes every row of its fixed batch. A slot idle in a
    step may hold a sequence prefilled in that very step (the engine prefills newly admitted
    slots, then decodes the older ones): a write at position 0 would replace that prompt's
    first cached token. At the slot's next free position the write is harmless: the slot's
    next real token overwrites it before anything attends to it. NxD Inference parks its own
    inactive rows the same way, at a position past the live ones (modules/kvcache/
    kv_cache_manager.py, `garbage_pos`). A slot whose sequence filled it to the end gets the
    last position: nothing more can be decoded into it, so nothing live is there.
    """

    def __init__(self, batch_size: int, seq_len: int) -> None:
        self.seq_len = seq_len
        self.next_free = [0] * batch_size

    def prefilled(self, slot: int, length: int) -> None:
        self.next_free[slot] = length

    def positions(self, positions: Sequence[int]) -> list[int]:
        """Live positions as given; each idle slot's own next free position."""
        out = []
        for slot, pos in enumerate(positions):
            if pos >= 0:
                self.next_free[slot] = pos + 1
                out.append(pos)
            else:
                out.append(min(self.next_free[slot], self.seq_len - 1))
        return out


def last_logits(value: Any, rows: int, vocab_size: int, sampled: bool) -> torch.Tensor:
    """The [rows, vocab_size] float logits the engine reads from a Neuron model's output tensor.

    `sampled`: the model sampled on device and returned token ids, not logits; a one-hot row
    (0 at the token, -inf elsewhere) makes the engine's greedy pick the device's choice.
    Otherwise the output is [rows, positions, vocab] or [rows, vocab] (padded past the
    model's vocabulary): the last position, cut to the vocabulary."""
    import torch

    value = torch.as_tensor(value)
    if sampled:
        tokens = value.reshape(rows, -1)[:, -1].long()
        logits = torch.full((rows, vocab_size), float("-inf"))
        logits[torch.arange(rows), tokens] = 0.0
        return logits
    if value.dim() == 3:
        value = value[:, -1, :]
    return value.reshape(rows, -1)[:, :vocab_size].float()
