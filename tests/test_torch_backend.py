"""TorchBackend contract: what it refuses, how a failed graph is reported, how a runner behaves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from neuronctl.backends import get_backend
from neuronctl.backends.torch import TorchBackend
from neuronctl.backends.torch.attention import inv_freq
from neuronctl.backends.torch.config import Numerics, args_from_config
from neuronctl.backends.torch.graphs import TOKEN_GEN, GraphJob, build_graph
from neuronctl.backends.torch.host import cpu_isa
from neuronctl.backends.torch.layout import graph_weights
from neuronctl.backends.torch.model import TokenGeneration
from neuronctl.build import compile_model, resolve_build
from neuronctl.checkpoints import open_checkpoint
from neuronctl.errors import BuildError, CheckpointError, SpecError, UsageError
from neuronctl.spec import resolve_spec
from neuronctl.store.manifest import read_manifest
from tests.conftest import SMALLEST_SPEC, TINY_SPEC
from tests.helpers import graph_weights_qwen2, make_checkpoint, read_config


def compile_tiny(ckpt: Path, store: Path, **overrides: Any) -> Any:
    # jobs=1: graphs traced in this process; a spawn pool re-imports torch per worker.
    return compile_model(resolve_build(str(ckpt), {**TINY_SPEC, **overrides}, store_dir=store),
                         jobs=1)


def published(store: Path) -> list[Path]:
    root = store / "neuron-compiled-artifacts"
    return [p for p in root.iterdir() if not p.name.startswith(".")] if root.exists() else []


def edit_config(ckpt: Path, **changes: Any) -> None:
    config = read_config(ckpt)
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


# The smallest Llama config.json the modeling code accepts.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 8,
    "hidden_size": 64,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
}


def test_old_and_new_rope_spellings_give_the_same_frequencies() -> None:
    base = TINY_CONFIG
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    new = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    old = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}
    plain = {**base, "rope_theta": 5e5}
    f_new, f_old = (
        inv_freq(args_from_config(new)),
        inv_freq(args_from_config(old)),
    )
    assert torch.equal(f_new, f_old)
    assert not torch.equal(f_new, inv_freq(args_from_config(plain)))


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, CheckpointError, "not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            CheckpointError,
            "yarn",
        ),
        ({"mlp_bias": True}, CheckpointError, "mlp_bias"),
        ({"hidden_act": "gelu"}, CheckpointError, "gelu"),
    ],
)
def test_check_refuses_configs_it_cannot_compute_exactly(
    changes: dict[str, Any], error: type[Exception], words: str
) -> None:
    config = {**TINY_CONFIG, **changes}
    spec = resolve_spec({"seq_len": 64})[0]
    with pytest.raises(error, match=words):
        TorchBackend().check(spec, config)


def test_sliding_window_shorter_than_seq_len_is_refused_and_nothing_published(
    tmp_path: Path,
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "mistral", sliding_window=64)
    with pytest.raises(SpecError, match="sliding window of 64"):
        compile_tiny(ckpt, tmp_path / "store", seq_len=128)
    assert published(tmp_path / "store") == []
    # A window that covers the whole sequence changes nothing and is accepted (the smallest
    # spec with that sequence length: 2 graphs).
    assert compile_tiny(ckpt, tmp_path / "store", **SMALLEST_SPEC).path


def test_qwen2_sliding_layers_are_refused(tmp_path: Path) -> None:
    ckpt = make_checkpoint(
        tmp_path / "ckpt", "qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1
    )
    with pytest.raises(SpecError, match="sliding window"):
        compile_tiny(ckpt, tmp_path / "store")


def test_tensors_that_do_not_match_config_are_refused_before_any_work(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(CheckpointError, match="mlp.*shape"):
        compile_tiny(ckpt, tmp_path / "store")
    assert published(tmp_path / "store") == []


def test_a_failing_graph_names_its_bucket_and_keeps_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(TokenGeneration, "forward", broken)
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    job = GraphJob(
        TOKEN_GEN, 64, args_from_config(read_config(ckpt)), 2, 128, "float32", "export",
        str(tmp_path / "staging"),
        path="aten",
    )
    with pytest.raises(BuildError, match="token_generation_64.*lowering exploded"):
        build_graph(job)
    log = (tmp_path / "staging" / "report" / "token_generation_64.log").read_text()
    assert "lowering exploded" in log


@pytest.mark.parametrize(
    ("dtype", "compute", "quantized", "batch", "kernel"),
    [
        ("bfloat16", "float32", False, 8, "gemv"),  # widened as it streams (AVX2 host)
        ("bfloat16", "float32", False, 16, "linear"),
        ("float32", "", False, 8, "packed_linear"),  # packed: oneDNN's packed GEMM
        ("float32", "", False, 4, "gemv"),
        ("bfloat16", "float32", True, 8, "int8_linear"),
    ],
)
def test_token_generation_picks_its_matmul_by_rows_and_numerics(
    tmp_path: Path, dtype: str, compute: str, quantized: bool, batch: int, kernel: str
) -> None:
    from neuronctl.backends.torch import opchoice
    from neuronctl.backends.torch.graphs import module_for
    from neuronctl.backends.torch.opchoice import TORCH_DTYPES

    # The rules' path (opchoice.rule_path) at the batch's rows, on the layout the rules give
    # these numerics where the kernel does not run, is the matmul the graph runs.
    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))
    layout = "packed" if kernel == "packed_linear" else "plain"
    numerics = Numerics(TORCH_DTYPES[dtype], TORCH_DTYPES[compute or dtype], quantized)
    target = opchoice.ChoiceInputs(args_from_config(config), numerics, "inductor", batch, (batch,),
                             kernel=False, onednn=layout == "packed")
    job = GraphJob(TOKEN_GEN, 64, args_from_config(config), batch, 128, dtype, "inductor",
                   str(tmp_path),
                   compute=compute, quantized=quantized, layout=layout,
                   path=opchoice.rule_path(target, layout, batch))
    assert module_for(job).linear.__name__ == kernel


def test_runner_refuses_prompts_and_positions_beyond_its_buckets(
    compiled_artifact: Path,
) -> None:
    runner = get_backend("torch").load(compiled_artifact, read_manifest(compiled_artifact))
    assert runner.context_buckets == [32, 64] and runner.token_gen_buckets == [64, 128]
    with pytest.raises(UsageError, match="largest context bucket 64"):
        runner.prefill(0, [1] * 65)
    with pytest.raises(UsageError, match="slot 4"):
        runner.prefill(4, [1, 2])
    with pytest.raises(UsageError, match="token-generation bucket 128"):
        runner.decode([1] * 4, [128, -1, -1, -1])
    with pytest.raises(UsageError, match="one token and one position per slot"):
        runner.decode([1], [3])


def test_manifest_records_versions_and_host_checks_pass_here(compiled_artifact: Path) -> None:
    manifest = read_manifest(compiled_artifact)
    versions = TorchBackend().versions(manifest.spec)
    assert manifest.backend_versions == versions
    assert versions["torch"] == torch.__version__
    # An exported float32 program depends on no ISA, units or kernel; the host facts say
    # where it was built.
    assert set(versions) == {"torch", "modeling"}
    assert manifest.host["cpu_isa"] == cpu_isa()
    assert all(check.ok for check in TorchBackend().host_checks(manifest))
    config = json.loads((compiled_artifact / "neuron_config.json").read_text())
    assert config["graphs"]["token_generation_128"] == "graphs/token_generation_128.pt2"
    assert sorted(manifest.graphs) == sorted(config["graphs"].values())


def test_host_checks_explain_a_foreign_artifact(compiled_artifact: Path) -> None:
    manifest = read_manifest(compiled_artifact)
    foreign = manifest.model_copy(
        update={
            "backend_versions": {
                **manifest.backend_versions,
                "torch": "1.0.0",
                "cpu_isa": "sve256",
            },
            "spec": manifest.spec.model_copy(update={"compiler": "inductor"}),
        }
    )
    failed = {c.name: c.reason for c in TorchBackend().host_checks(foreign) if not c.ok}
    assert set(failed) == {"cpu isa"}  # versions are compared by validate itself
    assert "compiled for sve256" in failed["cpu isa"]


def test_passing_host_checks_say_why(compiled_artifact: Path) -> None:
    manifest = read_manifest(compiled_artifact)
    inductor = manifest.model_copy(
        update={"spec": manifest.spec.model_copy(update={"compiler": "inductor"})}
    )
    checks = TorchBackend().host_checks(inductor)
    assert [c.name for c in checks] == ["cpu isa", "half-precision units"]
    assert all(c.ok and c.reason for c in checks)


def test_an_artifact_computing_in_bf16_needs_bf16_units(
    compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuronctl.backends.torch import host

    manifest = read_manifest(compiled_artifact)
    assert manifest.ops is not None
    # the op choice records each row count's compute dtype: one graph in bf16 is enough
    bf16_rows = [row.model_copy(update={"compute": "bfloat16"}) if i == 0 else row
                 for i, row in enumerate(manifest.ops.rows)]
    native = manifest.model_copy(update={
        "backend_versions": {**manifest.backend_versions, "cpu_half_units": "bf16"},
        "spec": manifest.spec.model_copy(update={"dtype": "bfloat16"}),
        "ops": manifest.ops.model_copy(update={"rows": bf16_rows}),
    })
    monkeypatch.setattr(host, "half_units", lambda: "none")
    failed = [c.reason for c in TorchBackend().host_checks(native) if not c.ok]
    assert failed and "compute in bfloat16" in failed[0] and "recompile here" in failed[0]
    assert "on a CPU with bf16 units, this host has no half-precision units" in failed[0]
    monkeypatch.setattr(host, "half_units", lambda: "bf16 fp16")
    assert all(c.ok for c in TorchBackend().host_checks(native))
    # Built where bf16 is emulated, it computes in float32 and runs anywhere.
    emulated = native.model_copy(update={
        "backend_versions": {**manifest.backend_versions, "cpu_half_units": "none"},
        "ops": manifest.ops})
    monkeypatch.setattr(host, "half_units", lambda: "none")
    checks = {c.name: c for c in TorchBackend().host_checks(emulated)}
    assert all(c.ok for c in checks.values())
    assert checks["half-precision units"].reason == (
        "computes in float32; this host has no half-precision units")


def test_cpu_isa_off_x86_is_cached_across_processes(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Off x86 inductor's pick imports torch; on x86 the ISA comes from the CPU flags.
    from neuronctl.backends.torch import host

    host.cpu_isa.cache_clear()
    monkeypatch.setattr(host, "is_x86", lambda: False)
    probes = []
    monkeypatch.setattr(host, "_detect_isa", lambda: probes.append(1) or "asimd")
    assert host.cpu_isa() == "asimd"
    host.cpu_isa.cache_clear()  # a new process: only the on-disk cache is left
    assert host.cpu_isa() == "asimd" and len(probes) == 1
    host.cpu_isa.cache_clear()


@pytest.mark.slow
def test_graphs_build_in_parallel_spawn_workers(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    build = resolve_build(str(ckpt), TINY_SPEC, store_dir=tmp_path / "store")
    path = compile_model(build, jobs=2).path
    names = sorted(p.name for p in (path / "graphs").iterdir())
    assert names == [  # batch 4: a one-prompt and a four-prompt graph per context bucket
        "context_encoding_32.pt2",
        "context_encoding_32x4.pt2",
        "context_encoding_64.pt2",
        "context_encoding_64x4.pt2",
        "token_generation_128.pt2",
        "token_generation_64.pt2",
    ]
    runner = get_backend("torch").load(path, read_manifest(path))
    assert runner.prefill(0, [1, 2, 3]).shape == (runner.vocab_size,)


def test_a_host_without_a_compiler_still_runs_the_isa_it_has(
    compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without a C++ compiler inductor's probes answer "none" (cpu_isa, supported_isas), but
    # serving compiled code needs the instructions, not a compiler: judged from the CPU.
    from neuronctl.backends.torch import host

    monkeypatch.setattr(host, "supported_isas", lambda: {"none"})
    monkeypatch.setattr(host, "is_x86", lambda: True)
    monkeypatch.setattr(host, "cpu_flags",
                        lambda: "fma avx2 avx512f avx512vl avx512bw avx512dq")
    manifest = read_manifest(compiled_artifact)
    built_for = {**manifest.backend_versions, "cpu_isa": "avx2"}
    here = {**manifest.backend_versions, "cpu_isa": "none"}
    check = host.isa_check(manifest.model_copy(update={"backend_versions": built_for}), here)
    assert check.ok and "which this CPU runs" in check.reason
    amx = {**built_for, "cpu_isa": "avx512 avx512_vnni amx_tile"}
    check = host.isa_check(manifest.model_copy(update={"backend_versions": amx}), here)
    assert not check.ok and "recompile here" in check.reason


@pytest.mark.parametrize(
    "quantized,tied,layout",
    [(False, False, "plain"), (False, True, "blocked"), (False, True, "packed"),
     (True, False, "blocked"), (True, True, "plain"), (True, True, "packed")],
)
def test_weights_load_in_their_graph_form_as_the_checkpoint_assembled_whole(
    tmp_path: Path, quantized: bool, tied: bool, layout: str
) -> None:
    # compile writes each graph tensor fused, converted and blocked into one file, one
    # tensor at a time (weights.write_graph_weights); the loader maps it. The reference
    # holds the whole checkpoint in memory and makes every graph tensor at once
    # (layout.graph_weights). A packed artifact's tied head is the embedding's view.
    from neuronctl.backends.torch.weights import ALIGN, load_graph_weights

    packed, blocked = layout == "packed", layout == "blocked"
    weights_dir, args = graph_weights_qwen2(tmp_path, tied, quantized, blocked)
    got = load_graph_weights(weights_dir, args, torch.bfloat16, quantized, packed, blocked)
    ckpt = open_checkpoint(str(tmp_path / "ckpt"), None)
    if quantized:
        from types import SimpleNamespace

        from neuronctl.backends.torch.quantize import QuantizedCheckpoint

        ckpt = QuantizedCheckpoint.wrap(
            ckpt, SimpleNamespace(quantization_type="per_channel_symmetric"))  # type: ignore[arg-type]
    full = {n: t if t.dtype == torch.int8 else t.to(torch.bfloat16)
            for n in ckpt.tensor_names() for t in [ckpt.tensor(n)]}
    want = graph_weights(full, args, packed, quantized, blocked)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
        assert got[name].data_ptr() % ALIGN == 0, name


def test_a_weights_file_that_is_not_what_the_graphs_take_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader maps the file and hands the graphs views of it: the header is checked
    against the graphs' layout, the mapping against the header it checked."""
    import safetensors.torch

    from neuronctl.backends.torch import arena
    from neuronctl.backends.torch.weights import GRAPH_WEIGHTS, load_graph_weights

    weights_dir, args = graph_weights_qwen2(tmp_path, False, False, False)
    file = weights_dir / GRAPH_WEIGHTS
    good = file.read_bytes()

    def refused(match: str, **kw: bool) -> None:
        with pytest.raises(CheckpointError, match=match):
            load_graph_weights(weights_dir, args, torch.bfloat16, kw.get("quantized", False),
                               False, kw.get("blocked", False))

    refused("does not hold the graphs' weights", quantized=True)  # another spec's layout
    refused("the graphs take", blocked=True)  # blocked matrices have other shapes
    # The same tensors written by another tool: no neuronctl metadata, no alignment.
    tensors = load_graph_weights(weights_dir, args, torch.bfloat16, False, False, False)
    safetensors.torch.save_file({n: t.clone() for n, t in tensors.items()}, str(file))
    refused("not written by this neuronctl")
    # Replaced between the header check and the mapping.
    file.write_bytes(good)
    other = tmp_path / "other.safetensors"
    other.write_bytes(good[:-64])
    real_map = arena.map_file
    monkeypatch.setattr(arena, "map_file", lambda path: real_map(other))
    refused("changed while it was being loaded")
    monkeypatch.undo()
    # No weights file at all.
    file.unlink()
    refused("has no graph_weights.safetensors")


def test_a_build_parses_config_json_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json becomes ModelArgs once per build: the graph jobs, their traced modules and
    example inputs, neuron_config.json and the weights all take that one value (it was
    parsed four times on the way to torch.export, once more in every graph worker)."""
    from neuronctl.backends.torch import config as torch_config

    parsed: list[int] = []
    real = torch_config.args_from_config

    def counted(config: Any) -> Any:
        parsed.append(1)
        return real(config)

    monkeypatch.setattr(torch_config, "args_from_config", counted)
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    build = resolve_build(str(ckpt), {**TINY_SPEC, "compiler": "export"},
                          store_dir=tmp_path / "store")
    parsed.clear()  # resolve_build's check parses its own (it runs without a build)
    compile_model(build, jobs=1)
    assert len(parsed) == 1


def test_no_backend_reaches_back_into_the_registry_and_the_kernel_build_not_into_doctor() -> None:
    """backends/__init__.py imports each backend (lazily); a backend importing it back made a
    cycle (accuracy.py took get_backend from it). The kernel build found ninja through
    doctor; both now ask toolchain.py."""
    import ast

    root = Path(__file__).resolve().parents[1] / "neuronctl" / "backends"
    back = []
    for path in sorted(root.glob("*/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "neuronctl.backends":
                back.append(f"{path.relative_to(root)}:{node.lineno}")
    assert back == []
    kernel_source = (root / "torch" / "kernel.py").read_text()
    assert "neuronctl.doctor" not in kernel_source and "neuronctl.toolchain" in kernel_source
