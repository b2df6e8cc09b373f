"""One grammar for naming an artifact: every command that takes one takes it as its first
argument, ARTIFACT, and as `--artifacts` (the older spelling, still taken), resolved by the
one rule of store/resolve.py: a bare name is a key or unique prefix of the store, never a
directory of the working directory and never a Hub id."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from neuronctl.store.local import Store
from tests.helpers import publish_stub_artifact, run_in_process

SPEC = {"tp_degree": 1, "seq_len": 64, "batch_size": 1, "dtype": "float32"}


def _stub(store_root: Path, model: str = "org/tiny") -> Path:
    key = hashlib.sha256(model.encode()).hexdigest()
    keys = {"graph_key": "g" * 64, "weights_key": "w" * 64, "artifact_key": key}
    return publish_stub_artifact(Store(store_root), key[:20], model, SPEC, keys)


# Commands that only read an artifact's manifest: they answer for a stub artifact.
READERS = [["artifacts", "show"], ["inspect"]]


@pytest.mark.parametrize("command", READERS)
def test_every_reader_takes_the_argument_and_the_alias(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`artifacts show` and `inspect` refused --artifacts ("No such option")."""
    path = _stub(tmp_path / "store")
    prefix = path.name[:6]
    store = ["--store", str(tmp_path / "store")]
    for spelling in ([prefix], ["--artifacts", prefix]):
        code, out, err = run_in_process([*command, *spelling, *store, "--json"], capsys,
                                        monkeypatch)  # fmt: skip
        assert code == 0, err
        assert path.name in out
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", prefix)  # the alias' default, as generate's
    code, out, err = run_in_process([*command, *store, "--json"], capsys, monkeypatch)
    assert code == 0 and path.name in out, err


@pytest.mark.parametrize(
    "command",
    [["validate"], ["env", "--vllm-target", "v0@0.9.2"], ["artifacts", "rm"],
     ["generate", "-p", "hi"], ["serve", "--dry-run"], ["bench"]],
)  # fmt: skip
def test_every_command_takes_the_alias(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`--artifacts` is an option of every command that takes an ARTIFACT (validate refused
    it), and both spellings naming different artifacts is a usage error that says so."""
    store = ["--store", str(tmp_path / "store")]
    code, _, err = run_in_process([*command, "abc123", "--artifacts", "def456", *store],
                                  capsys, monkeypatch)  # fmt: skip
    assert code == 2 and "two artifacts given" in err, err
    code, _, err = run_in_process([*command, "--artifacts", "abc123", *store], capsys,
                                  monkeypatch)  # fmt: skip
    assert "No such option" not in err and "no artifact 'abc123'" in err, err


def test_inspect_prefix_is_the_store_artifact_not_a_directory_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inspect PREFIX` showed a directory of that name in the working directory, and a
    6-digit prefix (which validate takes) went to the Hub; now it is the store's artifact,
    as for every other command, and a key-like name no artifact has is not found here."""
    path = _stub(tmp_path / "store")
    prefix = path.name[:6]
    other = _stub(tmp_path / "elsewhere", "org/impostor")
    here = tmp_path / "cwd"
    here.mkdir()
    (here / prefix).symlink_to(other)  # an artifact under the prefix's name, right here
    monkeypatch.chdir(here)
    store = ["--store", str(tmp_path / "store")]
    code, out, err = run_in_process(["inspect", prefix, *store, "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert str(path) in out and "impostor" not in out and str(other) not in out
    code, out, _ = run_in_process(["inspect", f"./{prefix}", *store, "--json"], capsys,
                                  monkeypatch)  # fmt: skip
    assert code == 0 and str(here / prefix) in out  # spelled as a path: that directory
    code, _, err = run_in_process(["inspect", "facade", *store], capsys, monkeypatch)
    assert code == 1 and "no artifact 'facade'" in err and "ORG/NAME" in err
