"""What the CLI prints for people: tables that fit 80 columns with every key whole, progress
that redraws in place on a terminal and prints sparse plain lines elsewhere."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neuronctl.store.local import Store
from neuronctl.store.manifest import read_manifest
from tests.helpers import publish_stub_artifact, run_in_process

MODELS = ("meta-llama/Llama-3.2-1B-Instruct", "TinyLlama/TinyLlama-1.1B-Chat-v1.0")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _publish(store: Store, model: str, dirname: str | None = None) -> Path:
    """An artifact with real-length keys (64 hex) and a 20-character directory name."""
    key = _sha(model)

    spec = {"tp_degree": 2, "seq_len": 2048, "batch_size": 4, "dtype": "bfloat16"}
    keys = {"graph_key": _sha("g" + key), "weights_key": _sha("w" + key), "artifact_key": key}
    return publish_stub_artifact(store, dirname or key[:20], model, spec, keys, _sha("d" + key))


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 80-column terminal (the console reads COLUMNS only when it is made)."""
    from neuronctl.cli._common import console

    monkeypatch.setattr(console, "_width", 80)


def _run(args: list[str], capsys: pytest.CaptureFixture[str], mp: pytest.MonkeyPatch) -> str:
    code, out, err = run_in_process(args, capsys, mp)
    assert code == 0, err
    return out


def _fits(out: str, titled: bool = False) -> None:
    """Every line within 80 columns; a title is a path, kept whole on its own line."""
    lines = out.splitlines()
    if titled:
        assert Path(lines.pop(0)).is_dir()
    long = [line for line in lines if len(line) > 80]
    assert not long, long


def test_artifacts_list_fits_80_columns_with_keys_whole(
    tmp_path: Path,
    narrow: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rich folded each 20-character key over four lines of a boxed table at 80 columns. Now
    one line per artifact, the key as its shortest unique prefix of 12 or more (as docker
    shows image ids), which every command takes; --no-trunc and --json give it whole."""
    store = Store(tmp_path)
    paths = [_publish(store, m) for m in MODELS]
    args = ["artifacts", "list", "--store", str(tmp_path)]
    out = _run(args, capsys, monkeypatch)
    _fits(out, titled=True)
    rows = out.splitlines()[2:]
    assert len(rows) == 2
    for path, row in zip(paths, rows, strict=True):
        assert row.split()[0] == path.name[:12]
        shown = _run(["artifacts", "show", path.name[:12], "--store", str(tmp_path), "--json"],
                     capsys, monkeypatch)
        assert json.loads(shown)["path"] == str(path)
    assert "Llama-3.2-1B-Instruct" in out  # a long model name loses its start, not its end

    whole = _run([*args, "--no-trunc"], capsys, monkeypatch)
    # The whole artifact key (it was the 20-character directory name, its prefix).
    keys = [read_manifest(p).artifact_key for p in paths]
    assert [r.split()[0] for r in whole.splitlines()[2:]] == keys and len(keys[0]) == 64
    assert all(m in whole for m in MODELS) and "CREATED" in whole
    listed = json.loads(_run([*args, "--json"], capsys, monkeypatch))["artifacts"]
    assert [a["key"] for a in listed] == [p.name for p in paths]
    assert [a["artifact_key"] for a in listed] == keys


def test_list_prefixes_grow_until_they_tell_keys_apart() -> None:
    from neuronctl.cli.artifacts import unique_prefixes

    keys = ["0123456789abcd0000ff", "0123456789abce0000ff", "ffffffffffffffffffff"]
    assert unique_prefixes(keys) == ["0123456789abcd", "0123456789abce", "ffffffffffffff"]
    assert unique_prefixes(keys[2:]) == ["ffffffffffff"]


def test_artifacts_show_keeps_each_sha256_key_on_one_line(
    tmp_path: Path,
    narrow: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _publish(Store(tmp_path), MODELS[0])
    out = _run(["artifacts", "show", path.name, "--store", str(tmp_path)], capsys, monkeypatch)
    _fits(out)
    lines = out.splitlines()
    key = _sha(MODELS[0])
    for value in (key, _sha("g" + key), _sha("w" + key), _sha("d" + key)):
        assert any(value in line for line in lines), value


def test_validate_reasons_wrap_between_words_and_keep_keys_whole(
    tmp_path: Path,
    narrow: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _publish(Store(tmp_path), MODELS[0])
    code, out, err = run_in_process(
        ["validate", path.name, "--store", str(tmp_path)], capsys, monkeypatch
    )
    assert code in (0, 1), err  # a stand-in artifact: the versions check may fail here
    lines = out.splitlines()
    assert lines[0] == str(path)  # the path as the title, whole, on its own line
    _fits(out, titled=True)
    assert any(re.search(rf"\b{path.name[:12]}\b", line) for line in lines)
    assert "│" not in out and "┃" not in out  # no box: its borders cost 10 columns


def test_doctor_puts_fixes_under_their_state_and_keeps_urls_whole(
    tmp_path: Path,
    narrow: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fix column folded pip's index URL over three lines at 80 columns."""
    monkeypatch.chdir(tmp_path)  # the store's path is in the output: a short one
    code, out, err = run_in_process(["doctor", "--store", "store"], capsys, monkeypatch)
    assert code in (0, 1), err  # healthy or not depends on the host; the layout does not
    for line in out.splitlines():
        # Over 80 only where one word (a long interpreter path) cannot fit beside the names.
        assert len(line) <= 80 or max(len(w) for w in line.split()) > 40, line
    assert "fix:" in out
    if "neuronx-cc" in out and "https://" in out:
        assert "https://pip.repos.neuron.amazonaws.com" in out


def test_plan_table_keeps_keys_whole(
    tiny_llama: Path,
    tmp_path: Path,
    narrow: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    builds = tmp_path / "builds.toml"
    builds.write_text(
        f'[[build]]\nmodel = "{tiny_llama}"\nname = "a-rather-long-build-name-for-the-matrix"\n'
        f'[[build]]\nmodel = "{tiny_llama}"\ntp_degree = 2\n'
    )
    out = _run(["plan", str(builds)], capsys, monkeypatch)
    _fits(out)
    listed = json.loads(_run(["plan", str(builds), "--json"], capsys, monkeypatch))
    dirnames = re.findall(r'"([0-9a-f]{20})"', json.dumps(listed))
    assert dirnames and all(d in out for d in dirnames)


def test_fit_wraps_prose_never_below_its_longest_word() -> None:
    from neuronctl.cli._table import Col, fit

    key = "5b85196557c5c6afee964867c94c38282c6efa6570d81a6cb093d0e00f218928"
    rows = [["ok", "versions", f"compiled for {key}, this host has another one " * 2]]
    widths = fit([Col(""), Col("check"), Col("reason")], rows, 80)
    assert widths[:2] == [2, 8]
    assert widths[2] == 80 - 2 - 8 - 4
    assert fit([Col(""), Col("check"), Col("reason")], rows, 40)[2] == len(key) + 1  # "key,"


def test_fit_leaves_out_optional_columns_last_first_then_trims() -> None:
    from neuronctl.cli._table import Col, fit

    columns = [Col("key"), Col("model", trim=10), Col("backend", optional=True),
               Col("created", optional=True)]
    rows = [["5b85196557c5", "meta-llama/Llama-3.2-1B-Instruct", "torch", "2026-11-25"]]
    assert fit(columns, rows, 200) == [12, 32, 7, 10]
    assert fit(columns, rows, 12 + 32 + 7 + 6) == [12, 32, 7, None]
    assert fit(columns, rows, 12 + 2 + 10) == [12, 10, None, None]
    assert fit(columns, rows, 10) == [12, 10, None, None]  # cannot fit: the key stays whole


BARS = """
import logging, sys, time
from neuronctl import log
from neuronctl.cli._progress import progress_for

log.setup(logging.INFO)
with progress_for(quiet=False) as progress:
    advance = progress.task("sharding weights", total=8)
    for step in range(8):
        time.sleep(0.06)  # past rich's refresh: each step is drawn
        advance(1)
        if sys.argv[1] == "logs" and step % 2 == 0:
            logging.getLogger("neuronctl.test").info("step %d", step)
"""


def _terminal(data: bytes) -> list[str]:
    """The lines a terminal shows after `data`, scrollback included: printable text, CR, LF,
    cursor up (ESC[nA) and erase line (ESC[2K); other escapes (colours, cursor show) ignored."""
    lines, row, col = [""], 0, 0
    for token in re.findall(rb"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", data):
        if token == b"\r":
            col = 0
        elif token == b"\n":
            row += 1
            col = 0
            if row == len(lines):
                lines.append("")
        elif token.startswith(b"\x1b["):
            if token.endswith(b"A"):
                row = max(0, row - int(token[2:-1] or 1))
            elif token == b"\x1b[2K":
                lines[row] = ""
        else:
            text = token.decode("utf-8", "replace")
            lines[row] = lines[row][:col].ljust(col) + text + lines[row][col + len(text) :]
            col += len(text)
    return [line.rstrip() for line in lines if line.strip()]


def _in_pty(argv: list[str]) -> bytes:
    import os
    import pty
    import sys

    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdout and stderr are the terminal
        os.environ.pop("COLUMNS", None)
        os.execv(sys.executable, [sys.executable, *argv])
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    return out


@pytest.mark.parametrize("logs", ["quiet", "logs"])
def test_bars_redraw_in_place_on_a_terminal(logs: str) -> None:
    """On a terminal the bar is redrawn with carriage returns and cursor moves, so it shows once
    however often it advances. Log lines (-v) went to the real stderr behind rich's back and
    left one copy of the bar per line; they now print above it."""
    raw = _in_pty(["-c", BARS, logs])
    assert b"\r" in raw and b"\x1b[2K" in raw  # redrawn, not appended
    shown = _terminal(raw)
    bars = [line for line in shown if "sharding weights" in line]
    assert len(bars) == 1 and "100%" in bars[0], shown
    steps = [line for line in shown if "neuronctl.test: step" in line]
    assert len(steps) == (4 if logs == "logs" else 0), shown


def test_plain_progress_is_a_start_a_heartbeat_and_a_done_line() -> None:
    from neuronctl.cli._progress import PlainProgress

    now = [0.0]
    lines: list[str] = []
    progress = PlainProgress(bytes_=True, write=lines.append, clock=lambda: now[0])
    pull = progress.task("pull 5b85196557c5", total=4 * 2**30)
    graph = progress.task("inductor context_encoding_64", total=1)
    for step in range(400):  # a 4 GiB pull in 10 MiB chunks over 60 s: no line per chunk
        now[0] += 0.15
        pull(4 * 2**30 / 400)
        if step == 199:
            progress.heartbeat()  # what the heartbeat thread does every `interval` seconds
    graph(1)
    now[0] += 15
    progress.heartbeat()  # between tasks (publishing): still a line, naming the last step
    assert lines == [
        "pull 5b85196557c5 ...",
        "inductor context_encoding_64 ...",
        "still running after 30 s: pull 5b85196557c5 50% (2.0 GiB of 4.0 GiB); "
        "inductor context_encoding_64",
        "pull 5b85196557c5: done in 60.0 s",
        "inductor context_encoding_64: done in 60.0 s",
        "still running after 75 s (past: inductor context_encoding_64)",
    ]


def test_plain_progress_beats_before_the_first_task() -> None:
    """compile's first "still running" line came at 60 s, not 30: its first task started
    after the first beat, which then had nothing to name and said nothing."""
    from neuronctl.cli._progress import PlainProgress

    now = [0.0]
    lines: list[str] = []
    progress = PlainProgress(write=lines.append, clock=lambda: now[0])
    now[0] = 30.0
    progress.heartbeat()
    assert lines == ["still running after 30 s"]


def test_plain_progress_beats_while_nothing_advances() -> None:
    """A task that advances only at its end (an NxD Inference compile) still shows life."""
    import threading

    from neuronctl.cli._progress import PlainProgress

    lines: list[str] = []
    beat = threading.Event()
    progress = PlainProgress(write=lambda line: (lines.append(line), beat.set()))
    progress.interval = 0.01
    with progress.heartbeats():
        progress.task("NxD Inference compile", total=None)
        assert beat.wait(timeout=60)  # set by the start line
        beat.clear()
        assert beat.wait(timeout=60)  # set by a heartbeat
    assert lines[0] == "NxD Inference compile ..."
    assert lines[1].startswith("still running after ") and "NxD Inference compile" in lines[1]


def test_progress_off_a_terminal_prints_sparse_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CI log got nothing at all from a long pull or compile (the bars were off when stderr
    was not a terminal); now a plain line per step, with no control characters."""
    path = _publish(Store(tmp_path), MODELS[0])
    args = ["validate", path.name, "--deep", "--store", str(tmp_path)]
    _, _, err = run_in_process(args, capsys, monkeypatch)
    assert "verifying sha256 ...\n" in err and "verifying sha256: done in" in err
    assert "\r" not in err and "\x1b" not in err
    _, out, err = run_in_process([*args, "--json"], capsys, monkeypatch)
    assert "verifying sha256" not in err  # --json: nothing but the document


@pytest.mark.parametrize("command", ["validate", "serve", "compile", "plan"])
def test_help_paragraphs_wrap_once_at_80_columns(command: str) -> None:
    """typer kept the docstrings' source line breaks, so at 80 columns each one broke again:
    "...recorded size (with" then "--deep, its sha256 too)..." on the next line. A paragraph's
    lines now fill the width; only its last may be short. Examples keep their own lines."""
    from typer.testing import CliRunner

    from neuronctl.cli.main import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    head = result.output.split("╭", 1)[0]
    paragraphs = [p.splitlines() for p in re.split(r"\n\s*\n", head) if p.strip()]
    prose = [[line.rstrip() for line in p] for p in paragraphs if not p[0].startswith("   ")]
    assert len(prose) >= 3
    for lines in prose:
        assert all(len(line) > 60 for line in lines[:-1]), lines


def test_reflow_joins_prose_lines_and_keeps_examples() -> None:
    from neuronctl.cli.main import reflow

    text = """Summary.

    Prose wrapped
    by hand.

      neuronctl x
      neuronctl y
    """
    assert reflow(text) == "Summary.\n\nProse wrapped by hand.\n\n  neuronctl x\n  neuronctl y"


def test_compile_prints_the_artifact_key_whole_within_80_columns(
    compiled_artifact: Path,
    tiny_llama: Path,
    narrow: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key line carried the compile time after the 64-character key: 87 columns, so an
    80-column terminal split the key. A cache hit here: nothing is compiled again."""
    from tests.conftest import TINY_SPEC

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_SPEC.items()]
    store = str(compiled_artifact.parent.parent)
    out = _run(["compile", str(tiny_llama), *flags, "--store", store], capsys, monkeypatch)
    keys = [line for line in out.splitlines() if line.startswith("artifact key ")]
    assert len(keys) == 1 and re.fullmatch(r"artifact key [0-9a-f]{64}", keys[0]), out
    assert str(compiled_artifact) in out


# --- what a person reads: dtype, help, pipes, tables, wording --------------------------------


def test_int8_artifacts_say_int8_not_fp32(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An int8 artifact showed as `fp32` in `artifacts list`, `show` and `inspect` (its
    compute dtype); each now says the weights are int8."""
    spec = {"tp_degree": 1, "seq_len": 64, "batch_size": 1, "dtype": "float32",
            "quantized": True, "quantization_type": "per_channel_symmetric"}  # fmt: skip
    keys = {"graph_key": _sha("g"), "weights_key": _sha("w"), "artifact_key": _sha("q")}
    path = publish_stub_artifact(Store(tmp_path), _sha("q")[:20], "org/q", spec, keys)
    store = ["--store", str(tmp_path)]
    listed = _run(["artifacts", "list", *store], capsys, monkeypatch)
    assert "int8/fp32" in listed.splitlines()[2].split()
    shown = _run(["artifacts", "show", path.name, *store], capsys, monkeypatch)
    assert re.search(r"^quantized\s+int8$", shown, re.M)
    inspected = _run(["inspect", path.name, *store], capsys, monkeypatch)
    assert "int8/fp32 (int8 weights, computed in float32)" in inspected
    data = json.loads(_run(["inspect", path.name, *store, "--json"], capsys, monkeypatch))
    assert data["quantized"] == "int8" and data["dtype"] == "float32"


def _commands() -> list[list[str]]:
    from neuronctl.cli.main import full_app

    app = full_app()
    out = [[c.name or ""] for c in app.registered_commands]
    for group in app.registered_groups:
        sub = group.typer_instance
        assert sub is not None
        out += [[group.name or "", c.name or ""] for c in sub.registered_commands]
    return out


def test_help_never_cuts_a_flag_or_variable_name_at_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rich shrank typer's options table to 80 columns by cutting names
    (`--override-neuron-conf…`, `NEURON_COMPILED_ARTIFA…`). Every command's help now shows
    them whole: no ellipsis anywhere."""
    monkeypatch.setenv("COLUMNS", "80")  # typer makes its help console per call
    for command in _commands():
        code, out, err = run_in_process([*command, "--help"], capsys, monkeypatch)
        assert code == 0, err
        assert "…" not in out, (command, out)
        assert max(len(line) for line in out.splitlines()) <= 80
        if command == ["compile"]:
            assert "--override-neuron-config" in out and "--num-speculative-tokens" in out


def test_piped_output_is_not_wrapped_inside_a_command() -> None:
    """Piped, rich wrapped at its default 80 columns: doctor's `pip install ...` fix broke
    over three lines. Off a terminal with no COLUMNS asked for, a line is never wrapped."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-m", "neuronctl.cli.main", "doctor"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    fix = "fix: pip install --extra-index-url https://pip.repos.neuron.amazonaws.com neuronx-cc"
    assert any(line.strip() == fix for line in done.stdout.splitlines()), done.stdout
    assert any(len(line) > 100 for line in done.stdout.splitlines())  # past 80, unwrapped


def test_config_migrate_fits_80_columns(
    narrow: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its table was 135 columns: a long note repeated in a column on every row."""
    override = '{"shard_over_sequence": true, "quant": {"quant_dtype": "s8"}, "fuse_qkv": true}'
    out = _run(["config", "migrate", override, "--from", "tnx"], capsys, monkeypatch)
    table = out.split("override_neuron_config for NxD Inference:")[0]
    assert max(len(line) for line in table.splitlines()) <= 80
    assert table.count("To use quantization") == 2  # two notes, each once, below the table
    assert re.search(r"quantized_checkpoints_path\s+\"quantized_checkpoint\"\s+\[1\]", table)


def test_wording_says_what_is_true(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`revision None` for a local checkpoint; "artifact trusted: NOT verified" for what
    nothing vouches for; gc's in-use warning printed twice."""
    from neuronctl.cli._common import say_vouch
    from neuronctl.store.lease import hold
    from neuronctl.store.signing import UNSIGNED, Vouch

    path = _publish(Store(tmp_path), MODELS[0])
    shown = _run(["artifacts", "show", path.name, "--store", str(tmp_path)], capsys,
                 monkeypatch)  # fmt: skip
    assert "None" not in shown and "a local checkpoint: no Hub revision" in shown
    say_vouch(Vouch(UNSIGNED, url="s3://b/k"))
    err = capsys.readouterr().err
    assert "trusted" not in err and err.startswith("artifact NOT verified")
    lease = hold(path)
    try:
        code, out, err = run_in_process(["artifacts", "gc", "--keep-last", "0", "--store",
                                         str(tmp_path)], capsys, monkeypatch)  # fmt: skip
    finally:
        lease.release()
    assert code == 0 and (out + err).count("a running process uses it") == 1, out + err


def test_one_prompt_is_one_prompt(compiled_artifact: Path) -> None:
    """generate's summary said "1 prompts"."""
    from tests.helpers import cli_in_process

    done = cli_in_process("generate", str(compiled_artifact), "-p", "hi", "--max-tokens", "1")
    assert done.returncode == 0, done.stderr
    assert "1 prompt, 1 token in" in done.stderr
