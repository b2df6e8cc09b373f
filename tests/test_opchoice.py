"""The torch backend's op choice (opchoice.py): which matmul path each row count takes.

The logic is pinned with injected timings (the suite runs with NEURONCTL_OP_CHOICE=rules,
conftest.py); the slow tests build inductor artifacts, one with a forced choice and one
with the real measurement, and check that the record is what the graphs and the runner do.
Speed is never asserted.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from neuronctl.backends.torch import opchoice
from neuronctl.backends.torch.config import Numerics, args_from_config
from neuronctl.backends.torch.host import cpu_flags, kernel_runs_on
from neuronctl.backends.torch.layout import is_matrix
from neuronctl.backends.torch.linear import can_pack
from neuronctl.spec import ModelShape, finalize, resolve_spec
from neuronctl.store.manifest import MANIFEST, read_manifest
from tests.helpers import make_checkpoint, run_in_process

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512}
ARGS = args_from_config(CONFIG)
FP32 = Numerics(torch.float32, torch.float32)
BF16_ON_AVX2 = Numerics(torch.bfloat16, torch.float32)
BF16_NATIVE = Numerics(torch.bfloat16, torch.bfloat16)  # a CPU with bf16 units


def target(numerics: Numerics = FP32, rows: tuple[int, ...] = (1, 64),
           kernel: bool = True, onednn: bool = True) -> opchoice.ChoiceInputs:
    return opchoice.ChoiceInputs(ARGS, numerics, "inductor", rows[0], rows, kernel, onednn)


def timings(table: dict[tuple[str, int], float], calls: list[int] | None = None
            ) -> opchoice.Timer:
    def timer(target: opchoice.ChoiceInputs, rows: int) -> dict[str, float]:
        if calls is not None:
            calls.append(rows)
        return {name: table[(name, rows)] for name in target.candidates}

    return timer


def by_rows(choice: Any) -> dict[int, str]:
    return {row.rows: row.path for row in choice.rows}


@pytest.fixture
def measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(opchoice.ENV, opchoice.MEASURE)


def test_the_rules_layout_stays_unless_another_beats_it_by_the_margin(measuring: None) -> None:
    # float32 on an AVX2 host: the rules block the weights for the kernel. oneDNN 3 % faster
    # is within the noise the margin absorbs; 20 % faster is a real win.
    close = {("kernel/blocked/fp32", 1): 1.0, ("kernel/plain/fp32", 1): 2.0,
             ("onednn/packed/fp32", 1): 0.97, ("aten/plain/fp32", 1): 2.0,
             ("kernel/blocked/fp32", 64): 10.0, ("kernel/plain/fp32", 64): 20.0,
             ("onednn/packed/fp32", 64): 9.7, ("aten/plain/fp32", 64): 20.0}
    choice = opchoice.choose(target(), timings(close))
    assert choice.layout == "blocked" and choice.chosen_by == "measure"
    assert by_rows(choice) == {1: "kernel", 64: "kernel"}
    assert choice.rows[1].ms == {"kernel/blocked/fp32": 10.0, "kernel/plain/fp32": 20.0,
                                 "onednn/packed/fp32": 9.7, "aten/plain/fp32": 20.0}
    faster = {**close, ("onednn/packed/fp32", 1): 0.8, ("onednn/packed/fp32", 64): 8.0}
    choice = opchoice.choose(target(), timings(faster))
    assert choice.layout == "packed" and by_rows(choice) == {1: "onednn", 64: "onednn"}


def test_each_row_count_takes_the_fastest_path_reading_the_layout(measuring: None) -> None:
    # Two paths reading plain weights: the kernel (linear_rows) for one row, aten's GEMM for
    # a bucket; the kernel on blocked weights is no faster at one row and slower at 64.
    table = {("kernel/plain/fp32", 1): 1.0, ("kernel/blocked/fp32", 1): 1.0,
             ("aten/plain/fp32", 1): 3.0, ("kernel/plain/fp32", 64): 20.0,
             ("kernel/blocked/fp32", 64): 20.0, ("aten/plain/fp32", 64): 5.0}
    choice = opchoice.choose(target(BF16_ON_AVX2, onednn=False), timings(table))
    assert choice.layout == "plain"
    assert by_rows(choice) == {1: "kernel", 64: "aten"}
    assert {row.compute for row in choice.rows} == {"float32"}  # no bf16 units: no bf16


# A bf16 host's table (AMD EPYC Zen 4: AVX-512, AVX512-BF16), SmolLM2-135M shapes, batch 1:
# ms per step's projections. The unweighted sum of time ratios over the row counts picked
# packed weights (oneDNN 2.2x faster at the 64-row prompt) and every decode step paid.
ZEN4 = {("kernel/blocked/fp32", 1): 6.7, ("kernel/plain/fp32", 1): 8.0,
        ("onednn/packed/bf16", 1): 7.8, ("aten/plain/bf16", 1): 15.4,
        ("aten/plain/fp32", 1): 16.0,
        ("kernel/blocked/fp32", 64): 89.7, ("kernel/plain/fp32", 64): 96.4,
        ("onednn/packed/bf16", 64): 40.6, ("aten/plain/bf16", 64): 56.3,
        ("aten/plain/fp32", 64): 60.0}


def test_the_layout_is_weighed_by_a_request_prompt_once_then_a_step_per_token(
    measuring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request: the 64-row prompt once, then GENERATED steps at one row. Blocked costs
    # 6.7 * 128 + 89.7 = 947 ms, packed 7.8 * 128 + 40.6 = 1039, plain 8.0 * 128 + 56.3.
    bf16 = target(BF16_NATIVE)
    assert bf16.candidates == ["kernel/blocked/fp32", "kernel/plain/fp32",
                               "onednn/packed/bf16", "aten/plain/fp32", "aten/plain/bf16"]
    choice = opchoice.choose(bf16, timings(ZEN4))
    assert choice.layout == "blocked"
    assert [(r.rows, r.path, r.compute) for r in choice.rows] == [
        (1, "kernel", "float32"), (64, "kernel", "float32")]
    # Requests that generate one token each are all prompt: oneDNN's 64 rows win.
    monkeypatch.setattr(opchoice, "GENERATED", 1)
    choice = opchoice.choose(bf16, timings(ZEN4))
    assert choice.layout == "packed"
    assert [(r.rows, r.path, r.compute) for r in choice.rows] == [
        (1, "onednn", "bfloat16"), (64, "onednn", "bfloat16")]


def test_each_graph_gets_its_own_compute_dtype(measuring: None) -> None:
    # Plain weights serve both: token generation by the kernel computing in float32, the
    # context bucket by aten's bf16 GEMM on the same bf16 weights.
    table = {**ZEN4, ("kernel/plain/fp32", 1): 6.0, ("aten/plain/bf16", 64): 30.0}
    choice = opchoice.choose(target(BF16_NATIVE), timings(table))
    assert choice.layout == "plain"
    assert [(r.rows, r.path, r.compute) for r in choice.rows] == [
        (1, "kernel", "float32"), (64, "aten", "bfloat16")]
    # The rules compute where the units are, everywhere: no timing tells them otherwise.
    rules = opchoice.by_rules(target(BF16_NATIVE))
    assert {r.compute for r in rules.rows} == {"bfloat16"}
    assert "kernel" not in rules.paths


def test_the_avx2_hosts_recorded_tables_keep_their_choice(measuring: None) -> None:
    """The tables bench/peers.py's artifacts recorded on the AVX2 EPYC (docs/performance.md,
    2026-11-26): weighed by a request they choose what the ratio sum chose, blocked weights
    and the kernel everywhere, so those artifacts and their figures stay as they were."""
    fp32_b8 = {"kernel/blocked/fp32": (34.6, 118.7, 461.7),
               "kernel/plain/fp32": (37.4, 112.9, 463.1),
               "onednn/packed/fp32": (44.5, 124.1, 410.2), "aten/plain/fp32": (75.0, 151.6, 436.9)}
    table = {(name, rows): ms for name, column in fp32_b8.items()
             for rows, ms in zip((8, 64, 256), column, strict=True)}
    t = opchoice.ChoiceInputs(ARGS, FP32, "inductor", 8, (8, 64, 512), True, True)
    choice = opchoice.choose(t, timings(table))
    assert (choice.layout, by_rows(choice)) == ("blocked", {8: "kernel", 64: "kernel",
                                                            512: "kernel"})
    bf16_b1 = {("kernel/blocked/fp32", 1): 11.0, ("kernel/plain/fp32", 1): 13.8,
               ("aten/plain/fp32", 1): 93.3, ("kernel/blocked/fp32", 64): 123.0,
               ("kernel/plain/fp32", 64): 118.5, ("aten/plain/fp32", 64): 209.4}
    choice = opchoice.choose(target(BF16_ON_AVX2, onednn=False), timings(bf16_b1))
    assert (choice.layout, by_rows(choice)) == ("blocked", {1: "kernel", 64: "kernel"})


def test_request_weights_count_one_prompt_and_the_generated_steps() -> None:
    t = opchoice.ChoiceInputs(ARGS, FP32, "inductor", 4, (4, 32, 64, 128, 256), True, True,
                        context_rows=(32, 64, 128, 256))
    assert opchoice.request_weights(t) == {4: opchoice.GENERATED, 32: 0.25, 64: 0.25,
                                           128: 0.25, 256: 0.25}
    # a bucket at the batch's rows: both kinds run there
    t = opchoice.ChoiceInputs(ARGS, FP32, "inductor", 16, (4, 16), True, True, context_rows=(4, 16))
    assert opchoice.request_weights(t) == {4: 0.5, 16: opchoice.GENERATED + 0.5}


def noisy(table: dict[tuple[str, int], float], seed: int) -> opchoice.Timer:
    """A shared host: most rounds near the true time, one in three slowed 30-100 % (another
    process held a core), each candidate and row count independently."""
    import random

    rng = random.Random(seed)

    def timer(target: opchoice.ChoiceInputs, rows: int) -> dict[str, float]:
        def sample(true: float) -> float:
            burst = rng.uniform(0.3, 1.0) if rng.random() < 1 / 3 else rng.uniform(0, 0.02)
            return true * (1 + burst)

        return {name: sample(table[(name, rows)]) for name in target.candidates}

    return timer


def test_two_builds_under_noise_choose_alike(measuring: None) -> None:
    # Candidates 10-15 % apart: past the margin, well inside the noise of one round.
    table = {("kernel/blocked/fp32", 1): 1.0, ("kernel/plain/fp32", 1): 1.12,
             ("onednn/packed/fp32", 1): 1.15, ("aten/plain/fp32", 1): 1.3,
             ("kernel/blocked/fp32", 64): 12.0, ("kernel/plain/fp32", 64): 13.0,
             ("onednn/packed/fp32", 64): 10.0, ("aten/plain/fp32", 64): 11.0}
    quiet = opchoice.choose(target(), timings(table))
    assert (quiet.layout, by_rows(quiet)) == ("blocked", {1: "kernel", 64: "kernel"})
    for seed in range(12):
        choice = opchoice.choose(target(), noisy(table, seed))
        assert (choice.layout, by_rows(choice)) == (quiet.layout, by_rows(quiet)), seed
    # the per-row choice too: plain weights, kernel at 1 row against aten 11 % slower
    plain = {**table, ("kernel/blocked/fp32", 1): 1.3, ("kernel/plain/fp32", 1): 1.0,
             ("aten/plain/fp32", 1): 1.11, ("aten/plain/fp32", 64): 9.0}
    quiet = opchoice.choose(target(onednn=False), timings(plain))
    assert (quiet.layout, by_rows(quiet)) == ("plain", {1: "kernel", 64: "aten"})
    for seed in range(12):
        choice = opchoice.choose(target(onednn=False), noisy(plain, seed))
        assert (choice.layout, by_rows(choice)) == (quiet.layout, by_rows(quiet)), seed


def test_every_row_count_is_timed_in_interleaved_rounds(measuring: None) -> None:
    calls: list[int] = []
    table = {(c, r): 1.0 for c in ("kernel/blocked/fp32", "kernel/plain/fp32",
                                   "aten/plain/fp32") for r in (4, opchoice.MAX_TIMED_ROWS)}
    choice = opchoice.choose(target(BF16_ON_AVX2, rows=(4, 2048), onednn=False),
                             timings(table, calls))
    assert calls == [4, opchoice.MAX_TIMED_ROWS] * opchoice.ROUNDS
    assert [(row.rows, row.timed_rows) for row in choice.rows] == [
        (4, 4), (2048, opchoice.MAX_TIMED_ROWS)]


def test_the_lm_head_is_timed_at_token_generation_rows_only() -> None:
    head = (ARGS.vocab_size, ARGS.hidden_size)
    t = target(rows=(2, 32))
    assert (head, 1) in opchoice.projection_shapes(t, 2)
    assert head not in [shape for shape, _ in opchoice.projection_shapes(t, 32)]
    assert {n for _, n in opchoice.projection_shapes(t, 32)} == {ARGS.num_layers}


def spec_target(flags: str, **spec: Any) -> opchoice.ChoiceInputs:
    base = {"model": "m", "compiler": "inductor", "dtype": "float32", "seq_len": 64,
            "batch_size": 8, "context_buckets": "32", **spec}
    finalized = finalize(resolve_spec(base, None, {})[0], ModelShape.from_config(CONFIG))
    storage = getattr(torch, str(finalized.dtype))
    compute = torch.float32 if finalized.quantized else storage
    numerics = Numerics(storage, compute, finalized.quantized)
    return opchoice.inputs_for(finalized, ARGS, numerics, (8, 32), flags)


def test_what_may_be_measured_where(measuring: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronctl.backends.torch import host

    avx2 = "sse4_2 avx fma avx2"
    monkeypatch.setattr(host.platform, "machine", lambda: "x86_64")
    assert spec_target(avx2).measurable
    assert spec_target(avx2).candidates[:2] == ["kernel/blocked/fp32", "kernel/plain/fp32"]
    assert "onednn/packed/fp32" not in spec_target(avx2, quantized=True).candidates  # int8
    # export graphs run aten everywhere; a CPU the kernel does not run on keeps gemv, which
    # cannot be timed eagerly: both by the rules, no timing
    for untimed in (spec_target(avx2, compiler="export"), spec_target("sse4_2 avx")):
        assert not untimed.measurable
        choice = opchoice.choose(untimed, timings({}))  # an empty table: any call fails
        assert choice.chosen_by == "rules"
    monkeypatch.setattr(host.platform, "machine", lambda: "aarch64")
    arm = spec_target("fp asimd asimdhp bf16")
    assert not arm.measurable
    assert by_rows(opchoice.choose(arm, timings({}))) in (
        {8: "gemv", 32: "aten"}, {8: "onednn", 32: "onednn"})  # packed where oneDNN runs


def test_rules_mode_times_nothing_and_a_bad_mode_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from neuronctl.errors import UsageError

    monkeypatch.setenv(opchoice.ENV, "rules")
    choice = opchoice.choose(target(), timings({}))
    assert choice.chosen_by == "rules" and all(not row.ms for row in choice.rows)
    monkeypatch.setenv(opchoice.ENV, "fastest")
    with pytest.raises(UsageError, match="NEURONCTL_OP_CHOICE"):
        opchoice.choose(target(), timings({}))


def test_the_manifest_records_the_choice_and_inspect_shows_it(
    compiled_artifact: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = read_manifest(compiled_artifact)
    assert manifest.ops is not None
    assert (manifest.ops.layout, manifest.ops.chosen_by) == ("plain", "rules")
    # TINY_SPEC: batch 4, context buckets 32 and 64 at 1 and 4 prompts
    assert by_rows(manifest.ops) == {4: "aten", 32: "aten", 64: "aten", 128: "aten",
                                     256: "aten"}
    code, out, _ = run_in_process(["inspect", str(compiled_artifact), "--json"], capsys,
                                  monkeypatch)
    assert code == 0
    assert json.loads(out)["ops"] == manifest.ops.model_dump(mode="json")
    code, out, _ = run_in_process(["inspect", str(compiled_artifact)], capsys, monkeypatch)
    assert code == 0 and "matmul path per row count" in out and "plain" in out
    assert "float32" in out  # each row count's compute dtype
    assert {row.compute for row in manifest.ops.rows} == {"float32"}  # no bf16 units here
    assert f"  path              {compiled_artifact}\n" in out


def test_inspect_keeps_a_long_path_on_one_line_at_80_columns(
    compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the header put model, path and backend on one line, and rich broke the path
    at 80 columns where it could not be copied back into a command."""
    import io

    from rich.console import Console

    from neuronctl.cli import inspect as inspect_cli

    screen = io.StringIO()
    monkeypatch.setattr(inspect_cli, "console", Console(file=screen, width=80))
    assert len(str(compiled_artifact)) > 80 - len("  path              ")
    inspect_cli.show_artifact(compiled_artifact, read_manifest(compiled_artifact), False)
    assert f"  path              {compiled_artifact}" in screen.getvalue().splitlines()


def test_inspect_finds_an_artifact_by_its_store_key(
    compiled_artifact: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key prefix names the artifact in --store, as in validate and generate; a bare name
    that is no key stays a model id."""
    manifest = read_manifest(compiled_artifact)
    store = compiled_artifact.parent.parent  # <store>/neuron-compiled-artifacts/<dir>
    argv = ["inspect", manifest.artifact_key[:12], "--store", str(store), "--json"]
    code, out, _ = run_in_process(argv, capsys, monkeypatch)
    assert code == 0, out
    assert json.loads(out)["artifact"] == str(compiled_artifact)
    argv = ["inspect", "ffffffffffff", "--store", str(store)]
    code, out, err = run_in_process(argv, capsys, monkeypatch)
    assert code == 1 and "ffffffffffff" in out + err


def test_the_choice_is_part_of_the_record(compiled_artifact: Path, tmp_path: Path) -> None:
    # It decides how the weights are read: an edited choice must not pass for the build's.
    from neuronctl.store.manifest import intact_problem

    copy = tmp_path / "copy"
    shutil.copytree(compiled_artifact, copy)
    data = json.loads((copy / MANIFEST).read_text())
    data["ops"]["layout"] = "packed"
    (copy / MANIFEST).write_text(json.dumps(data))
    assert "edited" in (intact_problem(copy) or "")


def test_an_artifact_from_before_the_choice_is_refused_with_recompile(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    """The op choice decides how the weights are laid out: the format that made it part of
    every torch manifest has no reader for artifacts without it. validate refuses the old
    format by its number; a manifest without the record never loads, and is no graph donor."""
    from neuronctl.backends.torch import TorchBackend, donor_choice
    from neuronctl.errors import BuildError, CheckpointError
    from neuronctl.keys import FORMAT_VERSION
    from neuronctl.store.manifest import write_manifest
    from neuronctl.validate import quick_validate

    copy = tmp_path / "old"
    shutil.copytree(compiled_artifact, copy)
    data = json.loads((copy / MANIFEST).read_text())
    data["format_version"] = FORMAT_VERSION - 1
    (copy / MANIFEST).write_text(json.dumps(data))
    reasons = [c.reason for c in quick_validate(copy).checks if not c.ok]
    assert any(f"old artifact format {FORMAT_VERSION - 1}" in r and "recompile" in r
               for r in reasons), reasons

    manifest = read_manifest(compiled_artifact).model_copy(update={"ops": None})
    with pytest.raises(CheckpointError, match="records no op choice.*") as info:
        TorchBackend().load(compiled_artifact, manifest)
    assert "recompile" in (info.value.hint or "")
    check = next(c for c in TorchBackend().host_checks(manifest)
                 if c.name == "half-precision units")
    assert not check.ok and "records no op choice" in check.reason
    donor = tmp_path / "donor"
    donor.mkdir()
    write_manifest(donor, manifest)
    with pytest.raises(BuildError, match="records no op choice"):
        donor_choice(donor)


# --- built artifacts -------------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(not kernel_runs_on(cpu_flags()),
                                  reason="the kernel needs an x86-64 CPU with AVX2 and FMA")
SPEC = {"compiler": "inductor", "dtype": "float32", "seq_len": 32, "max_context_length": 16,
        "batch_size": 1, "context_buckets": "16", "token_gen_buckets": "32"}


def compile_spec(ckpt: Path, store: Path, **spec: Any) -> Path:
    from neuronctl.build import compile_model, resolve_build

    return compile_model(resolve_build(str(ckpt), {**SPEC, **spec}, store_dir=store),
                         jobs=1).path


def graph_code(path: Path, name: str) -> str:
    """The C++ AOTInductor generated for one graph (what it calls)."""
    with zipfile.ZipFile(path / "graphs" / f"{name}.pt2") as archive:
        return "".join(archive.read(n).decode(errors="replace") for n in archive.namelist()
                       if n.endswith(".cpp"))


def decode_logits(runner: Any, ids: list[int]) -> torch.Tensor:
    got = [runner.prefill(0, ids[:12])]
    got += [runner.decode([ids[p]], [p])[0] for p in range(12, 20)]
    return torch.stack(got)


@pytest.mark.slow
@needs_kernel
def test_an_injected_choice_is_honoured_and_a_graph_donor_passes_it_on(
    tmp_path: Path, measuring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers import fine_tuned_copy
    from tests.test_torch_parity import TOL, hf_logits, hf_model, load, random_ids

    # plain weights; the kernel at one row (token generation), aten at the 16-row bucket
    table = {("kernel/plain/fp32", 1): 1.0, ("kernel/blocked/fp32", 1): 1.5,
             ("aten/plain/fp32", 1): 3.0, ("onednn/packed/fp32", 1): 3.0,
             ("kernel/plain/fp32", 16): 10.0, ("kernel/blocked/fp32", 16): 10.0,
             ("aten/plain/fp32", 16): 5.0, ("onednn/packed/fp32", 16): 9.0}
    monkeypatch.setattr(opchoice, "step_ms", timings(table))
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    path = compile_spec(ckpt, tmp_path / "store")
    ops = read_manifest(path).ops
    assert ops is not None and ops.layout == "plain" and ops.chosen_by == "measure"
    assert by_rows(ops) == {1: "kernel", 16: "aten"}
    runner = load(path)
    assert not runner.blocked and not runner.packed
    assert all(w.dim() == 2 for n, w in runner.weights.items() if is_matrix(n))
    assert "neuronctl" in graph_code(path, "token_generation_32")  # the kernel's ops
    assert "neuronctl" not in graph_code(path, "context_encoding_16")
    ids = random_ids(20, seed=21)
    assert (decode_logits(runner, ids) - hf_logits(hf_model(ckpt), ids)[11:20]).abs().max() < TOL

    # A fine-tune with the same graph key reuses those graphs, so it must read its weights
    # as they were compiled for, whatever a measurement here would say now.
    def must_not_measure(*_args: Any) -> float:
        raise AssertionError("a graph donor's choice is adopted, not measured again")

    monkeypatch.setattr(opchoice, "step_ms", must_not_measure)
    tuned = fine_tuned_copy(ckpt, tmp_path / "tuned")
    reused = compile_spec(tuned, tmp_path / "store")
    assert read_manifest(reused).ops == ops
    runner = load(reused)
    assert not runner.blocked
    diff = decode_logits(runner, ids) - hf_logits(hf_model(tuned), ids)[11:20]
    assert diff.abs().max() < TOL


@pytest.mark.slow
@needs_kernel
def test_the_real_measurement_is_recorded_and_honoured(
    tmp_path: Path, measuring: None
) -> None:
    from tests.test_torch_parity import TOL, hf_logits, hf_model, load, random_ids

    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", tie_word_embeddings=True)
    path = compile_spec(ckpt, tmp_path / "store")
    ops = read_manifest(path).ops
    assert ops is not None and ops.chosen_by == "measure"
    available = {"kernel/blocked/fp32", "kernel/plain/fp32", "aten/plain/fp32"}
    if can_pack(torch.float32):
        available.add("onednn/packed/fp32")
    for row in ops.rows:
        assert set(row.ms) == available and all(ms > 0 for ms in row.ms.values())
        assert ops.layout in opchoice.READS[row.path]
    runner = load(path)
    assert (runner.blocked, runner.packed) == (ops.layout == "blocked", ops.layout == "packed")
    config = json.loads((path / "neuron_config.json").read_text())
    assert config["numerics"]["matmul"].startswith(f"{ops.layout} weights, chosen by measure")
    ids = random_ids(20, seed=22)
    assert (decode_logits(runner, ids) - hf_logits(hf_model(ckpt), ids)[11:20]).abs().max() < TOL
