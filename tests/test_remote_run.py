"""`generate --artifacts URL/KEY`: pull (verified), validate, then run — same output as local."""

from __future__ import annotations

import json
from pathlib import Path

from neuronctl.store.remote.client import open_remote
from tests.helpers import cli_in_process
from tests.test_remote import SIGNER, trusted_env  # noqa: F401  (fixture)


def generate(artifacts: str, store: Path) -> list[int]:
    result = cli_in_process(  # what generate prints is tested, not a process
        "generate", "--artifacts", artifacts, "-p", "hello", "--max-tokens", "4", "--json",
        env={"NEURONCTL_STORE": str(store)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[0])["token_ids"]


def test_generate_from_a_remote_artifact(compiled_artifact: Path, tmp_path: Path) -> None:
    url = (tmp_path / "remote").as_uri()
    open_remote(url).push(compiled_artifact, signer=SIGNER)
    remote_tokens = generate(f"{url}/{compiled_artifact.name}", tmp_path / "host")
    assert (tmp_path / "host" / "neuron-compiled-artifacts" / compiled_artifact.name).is_dir()
    assert remote_tokens == generate(str(compiled_artifact), tmp_path / "other")
