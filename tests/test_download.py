"""Hub downloads against a local stand-in server (tests/hubserver.py); nothing goes online."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuronctl.checkpoints import digest as digest_mod
from neuronctl.checkpoints import hub, open_checkpoint
from neuronctl.errors import CheckpointError, NotFoundError
from tests.helpers import cli, cli_in_process, make_checkpoint
from tests.hubserver import HubServer

REPO = "acme/tiny-llama"
GATED = "gated: accept its license on the Hub and set HF_TOKEN"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hub-src") / "tiny", "llama")


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    from huggingface_hub import constants

    with HubServer() as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        # huggingface_hub reads these once at import: point them at the stand-in too.
        monkeypatch.setattr(constants, "ENDPOINT", srv.url)
        template = srv.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield srv


def go_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_branch_resolves_to_a_commit_sha_and_sha_pins_old_content(server: HubServer) -> None:
    old = server.add_commit(REPO, {"config.json": b'{"v": 1}', "model.safetensors": b"old"})
    new = server.add_commit(REPO, {"config.json": b'{"v": 2}', "model.safetensors": b"new"})
    server.repos[REPO].refs["v1.0"] = old
    latest = hub.download(REPO, "main")
    assert latest.sha == new
    assert (latest.path / "config.json").read_bytes() == b'{"v": 2}'
    assert hub.download(REPO).sha == new  # default branch
    tagged = hub.download(REPO, "v1.0")
    assert tagged.sha == old
    assert (tagged.path / "model.safetensors").read_bytes() == b"old"
    pinned = hub.download(REPO, old)
    assert pinned.path == tagged.path


def test_safetensors_preferred_and_essentials_always(server: HubServer) -> None:
    files = {
        "config.json": b"{}",
        "generation_config.json": b"{}",
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "model-00001-of-00002.safetensors": b"a",
        "model-00002-of-00002.safetensors": b"b",
        "model.safetensors.index.json": b"{}",
        "pytorch_model.bin": b"pickle",
        "original/consolidated.00.pth": b"pickle",
        "consolidated.safetensors": b"dup",
        "README.md": b"hi",
    }
    server.add_commit(REPO, files)
    got = hub.download(REPO)
    assert set(got.files) == set(files) - {
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "consolidated.safetensors",
    }
    on_disk = {p.relative_to(got.path).as_posix() for p in got.path.rglob("*") if p.is_file()}
    assert on_disk == set(got.files)
    body_paths = " ".join(server.body_gets())
    assert "pytorch_model.bin" not in body_paths and "original" not in body_paths


def test_pickle_only_repository_still_downloads_its_weights(server: HubServer) -> None:
    server.add_commit(REPO, {"config.json": b"{}", "pytorch_model.bin": b"pickle"})
    assert hub.download(REPO).files == ["config.json", "pytorch_model.bin"]


def test_include_and_exclude_never_drop_config_or_tokenizer(server: HubServer) -> None:
    files = {
        "config.json": b"{}",
        "tokenizer.json": b"{}",
        "model.safetensors": b"w",
        "extra/notes.txt": b"n",
        "model.gguf": b"g",
    }
    server.add_commit(REPO, files)
    only = hub.download(REPO, include=["*.safetensors"])
    assert only.files == ["config.json", "model.safetensors", "tokenizer.json"]
    skipped = hub.download(REPO, exclude=["*.gguf", "extra/*", "tokenizer.json", "config.json"])
    assert skipped.files == ["config.json", "model.safetensors", "tokenizer.json"]


def test_rerun_downloads_nothing(server: HubServer, tiny_files: Path) -> None:
    server.add_directory(REPO, tiny_files)
    first = hub.download(REPO)
    assert len(server.body_gets()) == len(first.files) > 3
    before = len(server.body_gets())
    again = hub.download(REPO)
    assert again.path == first.path
    assert len(server.body_gets()) == before  # no file body fetched twice


def test_gated_repository_needs_a_token(server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server.add_commit(REPO, {"config.json": b"{}", "model.safetensors": b"w"}, token="hf_secret")
    with pytest.raises(CheckpointError, match=GATED):
        hub.download(REPO)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert hub.download(REPO).files == ["config.json", "model.safetensors"]


def test_unknown_revision_and_repository(server: HubServer) -> None:
    server.add_commit(REPO, {"config.json": b"{}"})
    with pytest.raises(NotFoundError, match="no revision 'nope'"):
        hub.download(REPO, "nope")
    with pytest.raises(CheckpointError):  # the Hub answers 401 for a repo it does not show
        hub.download("acme/missing")


def test_offline_uses_the_cache_or_fails_clearly(
    server: HubServer, tiny_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = server.add_directory(REPO, tiny_files)
    online = hub.download(REPO)
    go_offline(monkeypatch)
    requests_before = len(server.requests)
    cached = hub.download(REPO)
    assert (cached.path, cached.sha) == (online.path, sha)
    ckpt = open_checkpoint(REPO, download=False)
    assert ckpt.revision == sha
    assert len(server.requests) == requests_before  # offline means no request at all
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        hub.download("acme/never-downloaded")


def test_open_checkpoint_accepts_a_hub_id_and_reuses_blob_hashes(
    server: HubServer, tiny_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = server.add_directory(REPO, tiny_files)
    ckpt = open_checkpoint(REPO)
    assert ckpt.revision == sha
    assert ckpt.architecture == "LlamaForCausalLM"
    hashed: list[str] = []
    real = digest_mod.sha256_file
    monkeypatch.setattr(
        digest_mod, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a)
    )
    hub_digest = ckpt.digest()
    # The weights are named by their sha256 in the cache: only config.json (a git blob) is read.
    assert hashed == ["config.json"]
    assert hub_digest == open_checkpoint(str(tiny_files)).digest()


def test_local_dir_download(server: HubServer, tiny_files: Path, tmp_path: Path) -> None:
    server.add_directory(REPO, tiny_files)
    got = hub.download(REPO, local_dir=tmp_path / "here")
    assert got.path == (tmp_path / "here").resolve()
    assert open_checkpoint(str(got.path)).digest() == open_checkpoint(str(tiny_files)).digest()


def test_cli_download_json_and_gated_exit_code(server: HubServer, tmp_path: Path) -> None:
    sha = server.add_commit(REPO, {"config.json": b"{}", "model.safetensors": b"w"})
    server.add_commit("acme/gated", {"config.json": b"{}"}, token="t")
    env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    ok = cli_in_process("download", REPO, "--json", env=env)
    assert ok.returncode == 0, ok.stderr
    assert f'"sha": "{sha}"' in ok.stdout
    gated = cli_in_process("download", "acme/gated", env=env)
    assert gated.returncode == 1
    assert GATED in gated.stderr
    assert "Traceback" not in gated.stderr


def test_cli_download_shows_huggingface_hub_bars_unless_turned_off(
    server: HubServer, tmp_path: Path
) -> None:
    server.add_commit(REPO, {"config.json": b"{}", "model.safetensors": b"w"})
    env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    bar = "Fetching 2 files"
    shown = cli_in_process("download", REPO, env=env)
    assert shown.returncode == 0 and bar in shown.stderr, shown.stderr
    as_json = cli_in_process("download", REPO, "--json", env=env)
    assert as_json.returncode == 0 and bar not in as_json.stderr
    # huggingface_hub reads HF_HUB_DISABLE_PROGRESS_BARS once, at import: a real process
    off = cli("download", REPO, env={**env, "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    assert off.returncode == 0 and bar not in off.stderr


def test_download_logs_each_step(server: HubServer, caplog: pytest.LogCaptureFixture) -> None:
    sha = server.add_commit(REPO, {"config.json": b"{}", "model.safetensors": b"w"})
    caplog.set_level(logging.INFO, logger="neuronctl.checkpoints.hub")
    got = hub.download(REPO, "main")
    assert f"{REPO} at main is commit {sha} (2 files)" in caplog.text
    assert f"fetching 2 of 2 files of {REPO}@{sha}" in caplog.text
    assert f"{REPO}@{sha} is at {got.path}" in caplog.text


def test_cli_download_malformed_hub_id_is_a_usage_error() -> None:
    result = cli_in_process("download", "not a valid id!!", "--json")
    assert result.returncode == 2
    assert "is not a Hub model id" in result.stderr and "Traceback" not in result.stderr
    assert json.loads(result.stdout)["exit_code"] == 2


@pytest.mark.hub
@pytest.mark.skipif(os.environ.get("NEURONCTL_TEST_HUB") != "1", reason="NEURONCTL_TEST_HUB=1")
def test_real_hub_download(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    got = hub.download("hf-internal-testing/tiny-random-LlamaForCausalLM")
    assert len(got.sha) == 40
    assert (got.path / "config.json").is_file()


def test_hub_errors_map_without_a_client_the_hub_may_not_use(
    server: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """map_hub_error imported httpx2, which only huggingface_hub 1.x-2.x depends on (0.x uses
    requests): every Hub error became "internal error: ModuleNotFoundError" there. Simulated
    here by making httpx2 unimportable; the mapping must stand on huggingface_hub.errors."""
    import sys

    from huggingface_hub import HfApi, errors

    server.add_commit(REPO, {"config.json": b"{}"})
    with pytest.raises(errors.RevisionNotFoundError) as raw:
        HfApi(endpoint=server.url).model_info(REPO, revision="nope")
    monkeypatch.setitem(sys.modules, "httpx2", None)  # `import httpx2` now fails
    mapped = hub.map_hub_error(raw.value, REPO, "nope")
    assert isinstance(mapped, NotFoundError) and "no revision 'nope'" in mapped.message
    offline = hub.map_hub_error(errors.OfflineModeIsEnabled("off"), REPO, None)
    assert isinstance(offline, CheckpointError) and "local Hugging Face cache" in offline.message

    class ConnectionRefused(Exception):  # what requests / httpx raise, unwrapped by the hub
        __module__ = "requests.exceptions"

    refused = hub.map_hub_error(ConnectionRefused("refused"), REPO, None)
    assert isinstance(refused, CheckpointError) and "cannot download" in refused.message


def test_a_mistyped_local_path_is_not_reported_as_a_hub_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotFoundError, match=r"models/llama-typo does not exist \(models/ is a"):
        open_checkpoint("models/llama-typo")
    result = cli_in_process("inspect", "models/llama-typo", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "does not exist (models/ is a local directory)" in result.stderr
    assert "Hugging Face cache" not in result.stderr and "Traceback" not in result.stderr
