from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import make_checkpoint

# Tests never reach the network and never touch the user's caches.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for var in (
        "NEURONCTL_STORE",
        "NEURON_COMPILED_ARTIFACTS",
        "NEURON_CONTEXT_LENGTH_BUCKETS",
        "NEURON_TOKEN_GEN_BUCKETS",
        "NEURON_QUANT_DTYPE",
        "VLLM_NEURON_FRAMEWORK",
        "NEURON_CC_FLAGS",
        "NEURONCTL_DEBUG",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared read-only tiny Llama checkpoint; copy it before modifying."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama")
