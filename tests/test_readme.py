"""Every command the README shows, run as written.

The README's ```sh blocks are parsed here; each `neuronctl ...` line runs through the real
entry point. What cannot run on a test host as written is said per command, and only these
substitutions are made:

- the Hub (`download`, `inspect` of a Hub id): the Hub stand-in (tests/hubserver.py) serves a
  tiny Llama under the README's id;
- S3 (`artifacts push ... s3://my-bucket/...`): the S3 stand-in (tests/s3server.py), under a
  fresh bucket in place of `my-bucket`;
- `3f9a2c`, the key `compile` prints: the key of the shared compiled artifact (the fast test)
  or of what the README's own `compile` line just built (the slow test);
- `serve` runs with `--dry-run` (a server does not exit by itself);
- `plan builds.toml`: a builds.toml naming the README's checkpoint is written first;
- the lines that are not `neuronctl` (the Quick start's venv, `make install`, `make test`)
  are what CI itself runs (.ci/run), not run here; the test fails on any new one.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import cli_in_process, make_checkpoint
from tests.hubserver import HubServer
from tests.test_remote import bucket, s3server  # noqa: F401  (fixtures)

README = Path(__file__).resolve().parent.parent / "README.md"
NOT_RUN = {"python3 -m venv .venv && . .venv/bin/activate", "make install", "make test"}
KEY_IN_README = "3f9a2c"


def readme_lines() -> list[str]:
    """Each line of the README's sh blocks, its trailing `# comment` dropped."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for b in blocks for line in b.splitlines()]
    return [line for line in lines if line]


def commands() -> list[list[str]]:
    return [shlex.split(line)[1:] for line in readme_lines() if line.startswith("neuronctl ")]


def test_the_readme_has_no_example_this_test_does_not_run() -> None:
    others = {line for line in readme_lines() if not line.startswith("neuronctl ")}
    assert others == NOT_RUN
    assert {c[0] for c in commands()} >= {"download", "compile", "generate", "serve"}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubServer]:
    """The Hub stand-in, serving a tiny Llama as the README's model (its context long enough
    for the README's --seq-len)."""
    from huggingface_hub import constants

    model = make_checkpoint(tmp_path / "hub-src", "llama", max_position_embeddings=4096)
    with HubServer() as srv:
        srv.add_directory("meta-llama/Llama-3.2-1B", model)
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", srv.url)
        template = srv.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield srv


def as_run(args: list[str], key: str, bucket_name: str) -> list[str]:
    args = [key if a == KEY_IN_README else a for a in args]
    args = [a.replace("s3://my-bucket/", f"s3://{bucket_name}/") for a in args]
    if args[0] == "serve":
        args.append("--dry-run")
    return args


def run_readme(
    tmp_path: Path, store: Path, key: str | None, bucket_name: str, compile_it: bool
) -> dict[str, str]:
    """Run the README's commands in order in a fresh working directory; their stdout."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "builds.toml").write_text('[[build]]\nmodel = "./Llama-3.2-1B"\nseq_len = 128\n')
    outputs: dict[str, str] = {}
    for args in commands():
        if args[0] == "compile" and not compile_it:
            continue  # an AOTInductor compile: the slow test runs it
        run = as_run(args, key or "", bucket_name)
        done = cli_in_process(*run, env={"NEURONCTL_STORE": str(store)}, cwd=work)
        assert done.returncode == 0, f"neuronctl {shlex.join(run)}:\n{done.stderr}"
        outputs[args[1] if args[0] == "artifacts" else args[0]] = done.stdout
        if args[0] == "compile":
            key = re.findall(r"\b[0-9a-f]{12,64}\b", done.stdout + done.stderr)[0]
    return outputs


def test_every_readme_example_runs(
    hub: HubServer, bucket: str, compiled_artifact: Path, tmp_path: Path,  # noqa: F811
) -> None:  # fmt: skip
    """All but `compile` (its output, the key, is the shared compiled artifact's here)."""
    store = tmp_path / "store"
    shutil.copytree(compiled_artifact.parent.parent, store, symlinks=True)
    key = compiled_artifact.name[:6]
    out = run_readme(tmp_path, store, key, bucket, compile_it=False)
    assert "LlamaForCausalLM" in out["inspect"]
    assert compiled_artifact.name[:12] in out["list"]
    assert "vllm" not in out["serve"] and "8000" in out["serve"]


@pytest.mark.slow
def test_every_readme_example_runs_with_its_compile(
    hub: HubServer, bucket: str, tmp_path: Path,  # noqa: F811
) -> None:  # fmt: skip
    """The README in order, its own compile included: what follows uses the key it printed."""
    run_readme(tmp_path, tmp_path / "store", None, bucket, compile_it=True)
