"""The CLI shell: help, version, JSON output, and user errors as one line with an exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuronctl.store.local import Store
from tests.helpers import cli, cli_in_process, publish_stub_artifact, run_in_process


def test_version_and_help_list_every_command() -> None:
    assert cli("--version").stdout.startswith("neuronctl ")
    out = cli("--help").stdout
    for command in ("compile", "hash", "artifacts", "config"):
        assert command in out


def test_config_show_json_with_explain() -> None:
    result = cli_in_process(
        "config",
        "show",
        "--tp-degree",
        "2",
        "--explain",
        "--json",
        env={"NEURON_TOKEN_GEN_BUCKETS": "128"},
    )
    data = json.loads(result.stdout)
    assert data["spec"]["tp_degree"] == 2 and data["sources"]["tp_degree"] == "flag"
    assert (
        data["spec"]["token_gen_buckets"] == [128] and data["sources"]["token_gen_buckets"] == "env"
    )


def test_usage_error_is_one_line_exit_2_no_traceback() -> None:
    result = cli("config", "show", "--context-buckets", "256,128")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "context_buckets" in result.stderr and "hint:" in result.stderr


def test_usage_error_with_json_prints_json_error() -> None:
    result = cli_in_process("config", "show", "--dtype", "float8", "--json")
    assert result.returncode == 2
    assert "dtype" in json.loads(result.stdout)["error"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["compile", "./m", "--tp-degree", "x"], "Invalid value for '--tp-degree'"),
        (["download"], "Missing argument"),
        (["compile", "--no-such-flag"], "No such option: --no-such-flag"),
        (["no-such-command"], "No such command"),
    ],
)
def test_parse_errors_are_one_line_and_a_hint(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README promises one line and a hint for a user mistake; typer's click prints a
    5-6 line box for the errors its parser finds. Exit code 2 either way."""
    code, out, err = run_in_process(args, capsys, monkeypatch)
    assert code == 2 and out == ""
    error, hint = err.splitlines()
    assert error.startswith("error: ") and says in error
    assert hint.startswith("hint: see 'neuronctl") and hint.endswith("--help'")


def test_parse_error_with_json_prints_json_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = run_in_process(["compile", "--no-such-flag", "--json"], capsys, monkeypatch)
    assert code == 2 and "--no-such-flag" in json.loads(out)["error"]


def test_ctrl_c_prints_interrupted_and_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """typer turns KeyboardInterrupt into a silent exit 130; a user should see why it stopped."""
    import neuronctl.cli.config as config_cli

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(config_cli, "resolve_spec", interrupted)
    code, out, err = run_in_process(["config", "show"], capsys, monkeypatch)
    assert (code, out, err.strip()) == (130, "", "interrupted")


NOISY_COMMAND = """
import subprocess, sys, warnings
import neuronctl.cli.config as config_cli
from neuronctl.cli.main import main

def noisy(*args):
    warnings.warn("parent noise", FutureWarning)
    child = "import warnings; warnings.warn('child noise', FutureWarning)"
    subprocess.run([sys.executable, "-c", child], check=True)  # as a graph worker inherits
    raise SystemExit(0)

config_cli.resolve_spec = noisy
sys.argv = ["neuronctl", *sys.argv[1:]]
main()
"""


def test_third_party_warnings_hidden_unless_verbose() -> None:
    """torch's FutureWarning printed on every inductor graph, in the CLI and in the spawned
    graph workers, even with --json. Hidden by default, shown with -v; a real process, since
    pytest records warnings itself."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}

    def stderr(*args: str) -> str:
        run = [sys.executable, "-c", NOISY_COMMAND, *args]
        result = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stderr

    assert "noise" not in stderr("config", "show", "--json")
    shown = stderr("-v", "config", "show")
    assert "parent noise" in shown and "child noise" in shown


def _publish(store: Store, key: str, model: str) -> Path:
    spec = {"tp_degree": 1, "seq_len": 128, "batch_size": 2, "dtype": "float32"}
    keys = {"graph_key": "g", "weights_key": "w", "artifact_key": key * 4}
    return publish_stub_artifact(store, key, model, spec, keys)


def test_artifacts_list_show_rm(tmp_path: Path) -> None:
    store = Store(tmp_path)
    _publish(store, "aaaa", "org/model-a")
    _publish(store, "bbbb", "org/model-b")
    store_flag = ["--store", str(tmp_path)]
    listing = json.loads(cli_in_process("artifacts", "list", *store_flag, "--json").stdout)
    assert [a["model"] for a in listing["artifacts"]] == ["org/model-a", "org/model-b"]
    assert listing["artifacts"][0]["size"] == 100

    shown = json.loads(cli_in_process("artifacts", "show", "bb", *store_flag, "--json").stdout)
    assert shown["source"]["model"] == "org/model-b"
    assert "weights/tp0_sharded_checkpoint.safetensors" in shown["files"]

    table = cli_in_process("artifacts", "list", "--store", str(tmp_path)).stdout
    assert "org/model-a" in table and "100 B" in table

    assert cli_in_process("artifacts", "rm", "aaaa", "--store", str(tmp_path)).returncode == 0
    missing = cli_in_process("artifacts", "show", "aaaa", "--store", str(tmp_path))
    assert missing.returncode == 1 and "no artifact" in missing.stderr


def test_artifacts_gc_dry_run_then_for_real(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for key in ("k1", "k2", "k3"):
        _publish(store, key, key)
    (store.artifacts / ".staging" / "k9.123.abcd").mkdir(parents=True)
    dry = json.loads(
        cli_in_process(
            "artifacts", "gc", "--keep-last", "1", "--dry-run", "--json", "--store", str(tmp_path)
        ).stdout
    )
    assert len(dry["removed"]) == 2 and len(dry["leftovers"]) == 1
    assert len(list(store.iter_artifacts())) == 3
    real = cli_in_process("artifacts", "gc", "--keep-last", "1", "--store", str(tmp_path))
    assert real.returncode == 0
    assert len(list(store.iter_artifacts())) == 1
    bad = cli_in_process("artifacts", "gc", "--older-than", "soon", "--store", str(tmp_path))
    assert bad.returncode == 2


def test_artifacts_rm_accepts_a_path_and_refuses_a_non_artifact(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    path = _publish(store, "aaaa", "org/model-a")
    (tmp_path / "empty").mkdir()
    refused = cli_in_process("artifacts", "rm", str(tmp_path / "empty"))
    assert refused.returncode == 2 and (tmp_path / "empty").is_dir()
    assert cli_in_process("artifacts", "rm", str(path)).returncode == 0
    assert not path.exists() and list(store.iter_artifacts()) == []


def test_artifacts_gc_negative_keep_last_is_a_usage_error_and_removes_nothing(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    for key in ("k1", "k2"):
        _publish(store, key, key)
    result = cli_in_process("artifacts", "gc", "--keep-last", "-1", "--store", str(tmp_path))
    assert result.returncode == 2 and "--keep-last" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(list(store.iter_artifacts())) == 2


def test_serve_bad_port_or_log_level_is_a_usage_error_before_loading(tmp_path: Path) -> None:
    for flags in (["--port", "99999"], ["--port", "-1"], ["--uvicorn-log-level", "loud"]):
        result = cli_in_process("serve", "--artifacts", str(tmp_path), *flags)
        assert result.returncode == 2, (flags, result.stderr)
        assert "Traceback" not in result.stderr and "internal error" not in result.stderr


def test_help_keeps_square_brackets_that_rich_would_read_as_markup() -> None:
    assert "[defaults] and [[build]]" in cli_in_process("plan", "--help").stdout


def test_cli_start_up_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, neuronctl.cli.main; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False"


def test_validate_an_unknown_key_says_it_is_not_in_the_store(tmp_path: Path) -> None:
    result = cli_in_process("validate", "abcd12", "--store", str(tmp_path))
    assert result.returncode == 1
    assert "no artifact 'abcd12'" in result.stderr


def test_quick_validate_does_not_import_torch(compiled_artifact: Path) -> None:
    # Quick validation must answer well under a second; importing torch alone takes more.
    import subprocess
    import sys

    from neuronctl.backends.torch import host

    host.cpu_isa.cache_clear()
    host.cpu_isa()  # the first run on a host probes the ISA (and imports torch) once
    code = (
        "import sys; from pathlib import Path; from neuronctl.validate import quick_validate; "
        f"r = quick_validate(Path({str(compiled_artifact)!r})); "
        "print(r.reusable, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["True", "False"], result.stderr


def test_readme_tour_compile_then_push_by_key_with_no_environment(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`compile ./model` then `artifacts push KEY`: one default store, found by every command
    (conftest clears NEURONCTL_STORE; the default is the user cache). The smallest spec: what
    is compiled does not matter here, only where it goes."""
    from tests.conftest import SMALLEST_SPEC

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALLEST_SPEC.items()]
    # --jobs=1: no worker pool, the graphs compile in this process
    compiled = cli_in_process("compile", str(tiny_llama), *flags, "--jobs=1", "--json")
    assert compiled.returncode == 0, compiled.stderr
    data = json.loads(compiled.stdout)
    key, path = data["artifact_key"][:8], Path(data["path"])
    assert not (tiny_llama / "neuron-compiled-artifacts").exists()  # the model dir is untouched
    pushed = cli_in_process("artifacts", "push", key, f"file://{tmp_path / 'remote'}")
    assert pushed.returncode == 0, pushed.stderr
    remote = tmp_path / "remote" / "neuron-compiled-artifacts" / path.name
    assert (remote / "manifest.json").is_file()
    # --store given the directory compile printed the artifact under finds it too
    shown = cli_in_process("artifacts", "show", key, "--store", str(path.parent), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["path"] == str(path)
    assert cli_in_process("validate", key).returncode == 0


def test_errors_and_hints_keep_their_brackets(tmp_path: Path) -> None:
    """rich markup used to eat `[[build]]` from plan's hint (and any `[...]` in a message)."""
    builds = tmp_path / "builds.toml"
    builds.write_text("[defaults]\n")
    result = cli_in_process("plan", str(builds))
    assert result.returncode == 2
    assert "no [[build]] entries" in result.stderr


def test_serve_dry_run_never_compiles(tiny_llama: Path, tmp_path: Path) -> None:
    from tests.conftest import TINY_SPEC

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_SPEC.items()]
    store = tmp_path / "store"
    args = ["serve", "--compile-if-missing", "--model", str(tiny_llama), "--store", str(store)]
    result = cli_in_process(*args, *flags, "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["action"] == "compile" and plan["artifact"] is None
    assert "would compile" in plan["reason"]
    artifacts = store / "neuron-compiled-artifacts"
    assert not artifacts.exists() or not [p for p in artifacts.iterdir() if p.name[0] != "."]


def test_serve_dry_run_of_a_url_never_pulls(compiled_artifact: Path, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    pushed = cli_in_process("artifacts", "push", str(compiled_artifact), f"file://{remote}")
    assert pushed.returncode == 0, pushed.stderr
    url = f"file://{remote}/{compiled_artifact.name}"
    # unsigned, so the dry run needs the say-so a real run would (test_signing has the refusal)
    result = cli_in_process("serve", "--artifacts", url, "--dry-run", "--json", "--allow-unsigned")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["action"] == "pull"
    assert not (tmp_path / "xdg-cache" / "neuronctl" / "neuron-compiled-artifacts").exists()


def test_pull_takes_a_plain_path_as_push_does(compiled_artifact: Path, tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    assert cli_in_process("artifacts", "push", str(compiled_artifact), str(mount)).returncode == 0
    store = tmp_path / "store"
    # A mounted directory holds another machine's bytes, like any remote: unsigned needs a say-so.
    pulled = cli_in_process("artifacts", "pull", str(mount / compiled_artifact.name),
                            "--store", str(store), "--allow-unsigned")
    assert pulled.returncode == 0, pulled.stderr
    pulled_dir = store / "neuron-compiled-artifacts" / compiled_artifact.name
    assert (pulled_dir / "manifest.json").is_file()


def test_serve_dry_run_of_a_url_the_remote_lacks_says_so(tmp_path: Path) -> None:
    """A dry run plans a pull only for what the remote holds; otherwise it fails as the
    real run would (exit 1, one line naming the remote)."""
    url = f"file://{tmp_path / 'remote'}/0123456789abcdef0123"
    result = cli_in_process("serve", "--artifacts", url, "--dry-run", "--json", "--allow-unsigned")
    assert result.returncode == 1 and "no artifact 0123456789abcdef0123" in result.stderr
    assert "would be pulled" not in result.stdout and "Traceback" not in result.stderr


def test_every_spec_flag_states_its_default() -> None:
    """`--compiler` help hid its default; each spec flag's help now names the BuildSpec default
    (hand-written, so the CLI starts without importing pydantic: this keeps them in step)."""
    from neuronctl.cli._common import SPEC_OPTIONS
    from neuronctl.spec import BuildSpec

    for name, (_, option) in SPEC_OPTIONS.items():
        default = BuildSpec.model_fields[name].get_default(call_default_factory=True)
        if default is None or isinstance(default, (dict, list)):
            continue  # no value to state: the flag is off unless given
        shown = {False: "off", True: "on"}[default] if isinstance(default, bool) else default
        assert f"default {shown}" in option.help, (name, option.help)


def test_serve_help_groups_the_build_spec_flags_apart() -> None:
    """serve's own flags come first; the 15 spec flags (used only with --compile-if-missing)
    sit in their own panel after them."""
    from typer.testing import CliRunner

    from neuronctl.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "120"})
    options, spec = result.output.split("Build spec", 1)
    assert "--port" in options and "--tp-degree" not in options
    assert "--tp-degree" in spec and "--compiler" in spec and "--port" not in spec


def test_generate_and_bench_take_the_artifact_as_validate_does(
    compiled_artifact: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate/env/artifacts take KEY|PATH|URL as their first argument with --store; generate
    and bench took only --artifacts and had no --store, so a key from another store could not
    be named. --artifacts stays, as the older spelling."""
    monkeypatch.delenv("NEURON_COMPILED_ARTIFACTS", raising=False)
    store = str(compiled_artifact.parent.parent)
    key = compiled_artifact.name[:12]
    generate = ["-p", "Hello", "--max-tokens", "2", "--store", store, "--json"]
    code, out, err = run_in_process(["generate", key, *generate], capsys, monkeypatch)
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 2
    older = ["generate", "--artifacts", key, *generate]
    code, out, err = run_in_process(older, capsys, monkeypatch)
    assert code == 0, err
    bench = ["--requests", "1", "--prompt-len", "4", "--max-tokens", "2", "--warmup", "0"]
    code, out, err = run_in_process(
        ["bench", key, *bench, "--store", store, "--json"], capsys, monkeypatch
    )
    assert code == 0, err
    assert json.loads(out)["artifact"] == str(compiled_artifact)


def test_two_different_artifacts_named_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run_in_process(["bench", "abc", "--artifacts", "def"], capsys, monkeypatch)
    assert code == 2 and "two artifacts given" in err


@pytest.mark.parametrize("ref", ["missing", "file", "empty", "unknown-key", None])
def test_generate_bench_and_serve_refuse_a_reference_alike(
    ref: str | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All three decide their artifact in runnable.artifact_to_run. generate and bench used to
    resolve it on their own: a missing path was "artifact directory ... does not exist" there
    and "cannot be used as-is" in serve, a file "does not exist" in them only, and no
    artifact at all had another hint."""
    (tmp_path / "file").write_text("not an artifact")
    (tmp_path / "empty").mkdir()
    named = [] if ref is None else [ref if ref == "unknown-key" else str(tmp_path / ref)]
    refusals = set()
    for command in (["generate", "-p", "Hello"], ["bench"], ["serve", "--dry-run"]):
        code, out, err = run_in_process([*command, *named], capsys, monkeypatch)
        assert out == "" and "Traceback" not in err
        refusals.add((code, err))
    assert len(refusals) == 1, refusals
    code, err = refusals.pop()
    expected = {
        "missing": (1, "does not exist\nhint: compile one with `neuronctl compile MODEL`"),
        "file": (1, "is a file, not an artifact directory"),
        "empty": (1, "not an artifact: an empty directory"),
        "unknown-key": (1, "no artifact 'unknown-key' in "),
        None: (2, "no artifact given\nhint: pass an artifact KEY, PATH or URL (--artifacts, or"),
    }[ref]
    assert code == expected[0] and expected[1] in err
