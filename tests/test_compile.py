"""`neuronctl compile` end to end on tiny checkpoints: artifact contents, cache hits, graph
reuse for fine-tunes, remote hits, plans, and bad inputs that publish nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from neuronctl.store.local import Store
from neuronctl.store.manifest import read_manifest
from tests.conftest import SMALLEST_SPEC
from tests.helpers import cli_in_process, make_checkpoint
from tests.test_remote import (  # noqa: F401  (fixtures)
    bucket,  # moto on 127.0.0.1
    s3server,
    trusted_env,  # the publisher's signing key and the pullers' trust, as env vars
)

FLAGS = [
    "--compiler", "export", "--dtype", "float32", "--seq-len", "128",
    "--max-context-length", "64", "--batch-size", "4",
    "--context-buckets", "32,64", "--token-gen-buckets", "64,128",
]  # fmt: skip


# What cache hits, graph reuse and remotes are tested on: the 2-graph spec (FLAGS builds 6).
# --jobs 1: graphs traced in the compile's own process (a spawn pool re-imports torch per
# worker); the pool has its own tests (test_torch_backend.py, test_security.py).
SMALL_SPEC = [f"--{name.replace('_', '-')}={value}" for name, value in SMALLEST_SPEC.items()]
SMALL_FLAGS = [*SMALL_SPEC, "--jobs=1"]


def compile_json(model: Path, store: Path, *extra: str, env: dict[str, str] | None = None) -> Any:
    result = cli_in_process(
        "compile", str(model), *SMALL_FLAGS, "--store", str(store), "--json", *extra, env=env
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_artifact_is_complete_and_self_contained(compiled_artifact: Path) -> None:
    manifest = read_manifest(compiled_artifact)
    names = set(manifest.files)
    assert "neuron_config.json" in names
    assert "weights/graph_weights.safetensors" in names
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert name in names
    assert manifest.graphs and all(g in names for g in manifest.graphs)
    # per context bucket one graph for a prompt and one for batch_size prompts (batched
    # prefill), plus one per token-generation bucket
    assert sorted(manifest.graphs) == sorted(
        ["graphs/context_encoding_32.pt2", "graphs/context_encoding_32x4.pt2",
         "graphs/context_encoding_64.pt2", "graphs/context_encoding_64x4.pt2",
         "graphs/token_generation_64.pt2", "graphs/token_generation_128.pt2"]
    )  # fmt: skip
    assert manifest.spec.context_buckets == [32, 64]
    assert manifest.source.digest and manifest.keys.artifact.startswith(
        compiled_artifact.name
    )
    # Nothing in the artifact points back at where it was built.
    for name in manifest.files:
        if name.endswith(".json"):
            assert str(compiled_artifact) not in (compiled_artifact / name).read_text()


def test_second_compile_is_a_cache_hit_and_hash_agrees(tiny_llama: Path, tmp_path: Path) -> None:
    first = compile_json(tiny_llama, tmp_path)
    assert first["cache_hit"] is False and first["graphs_reused"] is False
    mtimes = {p: p.stat().st_mtime_ns for p in Path(first["path"]).rglob("*")}
    second = compile_json(tiny_llama, tmp_path)
    assert second["cache_hit"] is True and second["path"] == first["path"]
    assert {p: p.stat().st_mtime_ns for p in Path(first["path"]).rglob("*")} == mtimes
    hashed = json.loads(cli_in_process("hash", str(tiny_llama), *SMALL_SPEC, "--json").stdout)
    for key in ("graph_key", "weights_key", "artifact_key"):
        assert hashed[key] == first[key]


def test_fine_tune_reuses_graphs_and_only_reshards(tiny_llama: Path, tmp_path: Path) -> None:
    tuned = make_checkpoint(tmp_path / "tuned", "llama", seed=7)
    base = compile_json(tiny_llama, tmp_path / "store")
    result = compile_json(tuned, tmp_path / "store")
    assert result["graph_key"] == base["graph_key"]
    assert result["weights_key"] != base["weights_key"]
    assert result["cache_hit"] is False and result["graphs_reused"] is True
    a, b = read_manifest(Path(base["path"])), read_manifest(Path(result["path"]))
    for graph in a.graphs:
        assert a.files[graph].sha256 == b.files[graph].sha256
    shard = "weights/graph_weights.safetensors"
    assert a.files[shard].sha256 != b.files[shard].sha256


def test_compile_remote_pulls_a_hit_instead_of_compiling(tiny_llama: Path, tmp_path: Path) -> None:
    remote = (tmp_path / "shared").as_uri()
    built = compile_json(tiny_llama, tmp_path / "ci", "--remote", remote)
    assert built["pushed"] is True and built["pulled"] is False
    again = compile_json(tiny_llama, tmp_path / "ci", "--remote", remote)
    assert again["cache_hit"] is True and again["pushed"] is False
    # A fresh host: the remote has it, so it is pulled, bit for bit, and nothing compiles.
    pulled = compile_json(tiny_llama, tmp_path / "host", "--remote", remote)
    assert pulled["pulled"] is True and pulled["cache_hit"] is True
    assert pulled_files(Path(pulled["path"])) == read_manifest(Path(built["path"])).files


def test_compile_remote_hit_over_s3_is_pulled_not_compiled(
    tiny_llama: Path,
    tmp_path: Path,
    bucket: str,  # noqa: F811
    s3server: Any,  # noqa: F811
) -> None:
    remote = f"s3://{bucket}/team"
    built = compile_json(tiny_llama, tmp_path / "ci", "--remote", remote)
    assert built["pushed"] is True
    s3server.reset_counts()
    pulled = compile_json(tiny_llama, tmp_path / "host", "--remote", remote)
    assert pulled["pulled"] is True and pulled["graphs_reused"] is False
    assert s3server.requests["PUT"] == 0  # a hit uploads nothing
    assert pulled_files(Path(pulled["path"])) == read_manifest(Path(built["path"])).files


def pulled_files(path: Path) -> dict[str, Any]:
    """A pulled artifact's files: the remote's, bit for bit, plus where it came from."""
    files = dict(read_manifest(path).files)
    assert files.pop("provenance.json", None) is not None
    return files


def test_compile_plan_entry(tiny_llama: Path, tmp_path: Path) -> None:
    plan = tmp_path / "builds.toml"
    spec = "\n".join(f"{k} = {json.dumps(_toml_value(v))}" for k, v in SMALLEST_SPEC.items())
    plan.write_text(
        f'[defaults]\n{spec}\n\n[[build]]\nmodel = "{tiny_llama}"\n'
        "matrix = { batch_size = [1, 2] }\n"
    )
    listed = json.loads(cli_in_process("plan", str(plan), "--json").stdout)
    entries = listed if isinstance(listed, list) else listed.get("builds", listed.get("include"))
    result = cli_in_process(
        "compile", "--plan", str(plan), "--entry", "1", "--store", str(tmp_path), "--json",
        "--jobs=1",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert read_manifest(Path(data["path"])).spec.batch_size == 2
    assert data["artifact_key"] in json.dumps(entries)
    out_of_range = cli_in_process(
        "compile", "--plan", str(plan), "--entry", "5", "--store", str(tmp_path)
    )
    assert out_of_range.returncode == 2 and "entries 0..1" in out_of_range.stderr


def _toml_value(value: Any) -> Any:
    if isinstance(value, str) and "," in value:
        return [int(v) for v in value.split(",")]
    return value


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--token-gen-buckets", "64,256"], "larger than seq_len"),
        (["--seq-len", "1024", "--token-gen-buckets", "1024"], "max_position_embeddings"),
        (["--tp-degree", "3"], "tp degree 3"),
    ],
)
def test_bad_spec_publishes_nothing(
    tiny_llama: Path, tmp_path: Path, extra: list[str], message: str
) -> None:
    result = cli_in_process("compile", str(tiny_llama), *FLAGS, *extra, "--store", str(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert list(Store(tmp_path).iter_artifacts()) == []


def test_unsupported_architecture_lists_what_is_supported(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "odd"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = cli_in_process("compile", str(model), *FLAGS, "--store", str(tmp_path / "s"))
    assert result.returncode == 1  # a checkpoint no backend supports: CheckpointError
    assert "LlamaForCausalLM" in result.stderr
    assert not (tmp_path / "s").exists() or list(Store(tmp_path / "s").iter_artifacts()) == []


def test_tensors_that_do_not_match_the_config_publish_nothing(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = tmp_path / "lying"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 96  # the tensors have 128
    (model / "config.json").write_text(json.dumps(config))
    result = cli_in_process("compile", str(model), *FLAGS, "--store", str(tmp_path / "s"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert list(Store(tmp_path / "s").iter_artifacts()) == []


@pytest.mark.parametrize("passed", [True, False])
def test_check_accuracy_is_one_line_and_a_failed_check_exits_1(
    compiled_artifact: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, passed: bool
) -> None:
    """The check itself is backends' (tests/test_torch_accuracy.py); the CLI renders its
    verdict in one line (never a raw dict) and exits 1 when it fails, for CI."""
    from typer.testing import CliRunner

    import neuronctl.backends as backends
    from neuronctl.cli.main import app

    report = {
        "mode": "logit-matching", "passed": passed, "dtype": "float32", "prompt_tokens": 7,
        "new_tokens": 16, "tokens_matched": 16 if passed else 3, "token_agreement": 1.0,
        "first_divergence": None if passed else 3, "max_logit_diff": 0.5,
        "tolerance": 1e-3, "artifact_tokens": [], "reference_tokens": [],
    }  # fmt: skip
    monkeypatch.setattr(backends, "check_accuracy", lambda *args: report)
    store = compiled_artifact.parent.parent  # a cache hit: nothing is compiled again
    args = ["compile", str(tiny_llama), *FLAGS, "--store", str(store)]
    result = CliRunner().invoke(app, [*args, "--check-accuracy", "logit-matching"])
    assert result.exit_code == (0 if passed else 1), result.output
    line = next(x for x in result.output.splitlines() if "accuracy" in x)
    assert ("passed" if passed else "FAILED") in line and "{" not in line
    assert "16/16 tokens agree" in line if passed else "first divergence at new token 3" in line
