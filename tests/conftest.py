from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import make_checkpoint

# Tests never reach the network and never touch the user's caches.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Session fixtures run before the per-test isolation below: keep them off the user's cache too.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="neuronctl-test-cache-")
# The torch backend's matmul paths by the ISA rules, not timed: timings on a loaded test host
# are noise and cost seconds per build. tests/test_opchoice.py measures where it means to.
OP_CHOICE_RULES = {"NEURONCTL_OP_CHOICE": "rules"}
os.environ.update(OP_CHOICE_RULES)

# The spec of the shared tiny artifact: small buckets so several graphs exist, 4 slots so
# continuous batching has something to do, the fast export compiler.
TINY_SPEC: dict[str, Any] = {
    "compiler": "export",
    "dtype": "float32",
    "seq_len": 128,
    "max_context_length": 64,
    "batch_size": 4,
    "context_buckets": "32,64",
    "token_gen_buckets": "64,128",
}

# The smallest spec that builds: one slot, one context bucket, one token-generation bucket
# (2 graphs where TINY_SPEC has 6). For tests about keys, cache hits, reuse, stores and
# remotes, where what is compiled does not matter, only that it is a real artifact.
SMALLEST_SPEC: dict[str, Any] = {
    "compiler": "export",
    "dtype": "float32",
    "seq_len": 64,
    "max_context_length": 32,
    "batch_size": 1,
    "context_buckets": "32",
    "token_gen_buckets": "64",
}


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
        "NEURONCTL_LOG_LEVEL",
    ):
        monkeypatch.delenv(var, raising=False)
    for var, value in OP_CHOICE_RULES.items():
        monkeypatch.setenv(var, value)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared read-only tiny Llama checkpoint; copy it before modifying."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def compiled_artifact(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """A real artifact of `tiny_llama` (torch backend, export compiler); copy before mutating."""
    from neuronctl.build import compile_model, resolve_build

    store = tmp_path_factory.mktemp("store")
    build = resolve_build(str(tiny_llama), TINY_SPEC, store_dir=store)
    return compile_model(build, jobs=1).path
