"""Keys: stable under order, source and defaults; sensitive to every compile-relevant field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronctl.errors import SpecError
from neuronctl.keys import canonical_json, compute_keys
from neuronctl.spec import GRAPH_FIELDS, WEIGHTS_FIELDS, ModelShape, finalize, resolve_spec

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 320,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
}
SHAPE = ModelShape(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
VERSIONS = {"torch": "2.13.0"}
DIGEST = "a" * 64

# A value set for every spec flag, used in any order and through any source.
BASE: dict[str, Any] = {
    "backend": "torch",
    "tp_degree": 2,
    "batch_size": 4,
    "seq_len": 512,
    "max_context_length": 256,
    "dtype": "bfloat16",
    "context_buckets": [128, 256],
    "token_gen_buckets": [256, 512],
    "compiler": "export",
}


def keys_for(
    flags: dict[str, Any] | None = None,
    cfg: Path | None = None,
    env: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
    digest: str = DIGEST,
):
    spec, _ = resolve_spec(flags or {}, cfg, env or {})
    return compute_keys(finalize(spec, SHAPE), config or CONFIG, VERSIONS, digest)


@settings(max_examples=50, deadline=None)
@given(st.permutations(list(BASE.items())))
def test_flag_order_does_not_change_keys(items) -> None:
    assert keys_for(dict(items)) == keys_for(BASE)


def test_same_spec_from_flags_file_and_env_gives_same_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "neuronctl.toml"
    cfg.write_text(
        'backend = "torch"\ntp_degree = 2\nbatch_size = 4\nseq_len = 512\n'
        'max_context_length = 256\ndtype = "bfloat16"\ncontext_buckets = [128, 256]\n'
        'compiler = "export"\n'
    )
    env = {"NEURON_TOKEN_GEN_BUCKETS": "256,512"}
    assert keys_for(cfg=cfg, env=env) == keys_for(BASE)


def test_defaults_filled_in_equal_explicit_defaults() -> None:
    implicit = {k: v for k, v in BASE.items() if k != "compiler"}
    assert keys_for(implicit | {"compiler": "inductor"}) == keys_for(implicit)
    assert keys_for(BASE | {"max_context_length": None, "context_buckets": [128, 256, 512]}) == (
        keys_for(BASE | {"max_context_length": 512, "context_buckets": [128, 256, 512]})
    )


def test_config_key_order_and_provenance_fields_do_not_change_keys() -> None:
    reordered = dict(reversed(list(CONFIG.items())))
    noisy = CONFIG | {"_name_or_path": "/home/me/llama", "transformers_version": "4.99"}
    assert keys_for(BASE, config=reordered) == keys_for(BASE) == keys_for(BASE, config=noisy)


@settings(max_examples=40, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6))
def test_numbers_are_normalized(x: float) -> None:
    assert canonical_json({"v": x}) == canonical_json({"v": float(x)})
    if x.is_integer():
        assert canonical_json({"v": x}) == canonical_json({"v": int(x)})


# One changed value per compile-relevant field (tp_degree: of a Neuron backend, below).
CHANGES: dict[str, Any] = {
    "batch_size": 8,
    "seq_len": 1024,
    "max_context_length": 128,
    "dtype": "float32",
    "context_buckets": [256],
    "token_gen_buckets": [512],
    "compiler": "inductor",
    "override_neuron_config": {"fused_qkv": True},
    "on_device_sampling": {"do_sample": True, "top_k": 50},
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_each_compile_relevant_field_changes_the_graph_key(field: str) -> None:
    changed = BASE | {field: CHANGES[field]}
    if field == "max_context_length":
        changed["context_buckets"] = [128]
    before, after = keys_for(BASE), keys_for(changed)
    assert field in GRAPH_FIELDS
    assert after.graph != before.graph
    assert after.artifact != before.artifact
    assert (after.weights != before.weights) == (field in WEIGHTS_FIELDS)


NXDI = {k: v for k, v in BASE.items() if k != "compiler"} | {"backend": "nxdi"}


def test_the_tp_degree_splits_neuron_keys_and_never_a_torch_one() -> None:
    """A Neuron artifact holds a weights file and graphs per rank: its tp degree changes
    both. The torch backend runs every rank in one process, and tp 1, 2 and 4 made
    byte-identical artifacts under three keys: it cannot matter, so it is 1 there."""
    before, after = keys_for(NXDI), keys_for(NXDI | {"tp_degree": 4})
    assert after.graph != before.graph and after.weights != before.weights
    assert "tp_degree" in GRAPH_FIELDS and "tp_degree" in WEIGHTS_FIELDS
    torch_keys = {keys_for(BASE | {"tp_degree": tp}) for tp in (1, 2, 4)}
    assert len(torch_keys) == 1
    spec, _ = resolve_spec(BASE | {"tp_degree": 4}, None, {})
    assert finalize(spec, SHAPE).tp_degree == 1
    with pytest.raises(SpecError, match="tp degree 3"):  # one no backend could run
        keys_for(BASE | {"tp_degree": 3})


def test_cc_flags_key_neuron_backends_only_and_by_meaning() -> None:
    nxdi = {k: v for k, v in BASE.items() if k != "compiler"} | {"backend": "nxdi"}
    assert keys_for(nxdi | {"cc_flags": "--optlevel=1"}).graph != keys_for(nxdi).graph
    assert keys_for(nxdi | {"cc_flags": "-O1  --x 'a b'"}) == keys_for(
        nxdi | {"cc_flags": "-O1 --x 'a b'"}
    )
    # The torch backend never reads NEURON_CC_FLAGS: they must not split its artifacts.
    assert keys_for(BASE | {"cc_flags": "--optlevel=1"}) == keys_for(BASE)


def test_backend_changes_the_graph_key() -> None:
    nxdi = {k: v for k, v in BASE.items() if k != "compiler"} | {"backend": "nxdi"}
    assert keys_for(nxdi).graph != keys_for(BASE).graph


def test_backend_version_changes_the_graph_key() -> None:
    spec, _ = resolve_spec(BASE, None, {})
    spec = finalize(spec, SHAPE)
    a = compute_keys(spec, CONFIG, {"torch": "2.13.0"}, DIGEST)
    b = compute_keys(spec, CONFIG, {"torch": "2.14.1"}, DIGEST)
    assert a.graph != b.graph and a.weights == b.weights


def test_architecture_changes_the_graph_key() -> None:
    assert keys_for(BASE, config=CONFIG | {"num_hidden_layers": 3}).graph != keys_for(BASE).graph


def test_new_weights_change_only_the_weights_key() -> None:
    a, b = keys_for(BASE), keys_for(BASE, digest="b" * 64)
    assert a.graph == b.graph
    assert a.weights != b.weights and a.artifact != b.artifact


def test_runtime_fields_change_no_key() -> None:
    assert keys_for(BASE | {"model": "a/b", "revision": "main"}) == keys_for(BASE)


def test_keys_need_a_finalized_spec() -> None:
    spec, _ = resolve_spec({}, None, {})
    with pytest.raises(ValueError, match="finalized"):
        compute_keys(spec, CONFIG, VERSIONS, DIGEST)


# Two host classes the torch backend meets, as /proc/cpuinfo spells their flags (the
# relevant ones). x86 capabilities as aten reads them: aten/src/ATen/cpu/Utils.cpp in
# pytorch/pytorch (is_avx512_supported needs avx512 f, vl, bw and dq).
EPYC_FLAGS = "sse4_2 avx f16c fma avx2 bmi2"
XEON_FLAGS = (EPYC_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
              " amx_bf16 amx_tile amx_int8")


@pytest.fixture
def cpu_class(monkeypatch: pytest.MonkeyPatch):
    """Simulate a host: its CPU flags (the ISA and half units derive from them)."""
    from neuronctl.backends.torch import host

    def use(flags: str, machine: str = "x86_64") -> None:
        monkeypatch.setattr(host, "cpu_flags", lambda: flags)
        monkeypatch.setattr(host.platform, "machine", lambda: machine)
        host.cpu_isa.cache_clear()

    yield use
    host.cpu_isa.cache_clear()


def torch_keys(
    cpu_class, flags: str, machine: str = "x86_64", **spec: Any
) -> tuple[dict[str, str], str]:
    from neuronctl.backends.torch import TorchBackend

    cpu_class(flags, machine)
    finalized = finalize(resolve_spec({**BASE, **spec}, None, {})[0], SHAPE)
    versions = TorchBackend().versions(finalized)
    return versions, compute_keys(finalized, CONFIG, versions, DIGEST).graph


@pytest.mark.parametrize(
    "spec",
    [
        {"compiler": "export", "dtype": "bfloat16"},  # export: no ISA; bf16 on both
        {"compiler": "export", "dtype": "float32"},
        {"compiler": "export", "dtype": "bfloat16", "quantized": True},
    ],
)
def test_graph_key_is_equal_across_cpu_classes_where_the_graph_is(cpu_class, spec) -> None:
    # An exported program is ISA-independent: only a half dtype's compute (units) could differ.
    epyc, epyc_key = torch_keys(cpu_class, EPYC_FLAGS, **spec)
    xeon, xeon_key = torch_keys(cpu_class, XEON_FLAGS, **spec)
    if spec["dtype"] == "bfloat16" and not spec.get("quantized"):
        # bf16 computes natively on the Xeon, in float32 on the EPYC: a different graph.
        assert (epyc["cpu_half_units"], xeon["cpu_half_units"]) == ("none", "bf16")
        assert epyc_key != xeon_key
        return
    assert epyc == xeon and epyc_key == xeon_key
    assert not {"cpu_isa", "cpu_half_units", "kernel"} & set(epyc)
    assert torch_keys(cpu_class, "fp asimd asimdhp bf16", "aarch64", **spec)[1] == epyc_key


def test_inductor_keys_hold_the_isa_and_the_kernel_only_where_used(cpu_class) -> None:
    epyc, epyc_key = torch_keys(cpu_class, EPYC_FLAGS, compiler="inductor", dtype="float32")
    xeon, xeon_key = torch_keys(cpu_class, XEON_FLAGS, compiler="inductor", dtype="float32")
    assert epyc["cpu_isa"] == "avx2" and xeon["cpu_isa"] == "avx512 avx512_vnni amx_tile"
    assert epyc_key != xeon_key
    assert "kernel" in epyc and "kernel" in xeon  # the op choice may pick the kernel
    assert "cpu_half_units" not in epyc  # float32 computes in float32 everywhere
    # bf16 native on the Xeon: the measured choice may still pick the kernel (it computes
    # in float32 and rounds to bf16), and a key never depends on a measurement.
    native, _ = torch_keys(cpu_class, XEON_FLAGS, compiler="inductor", dtype="bfloat16")
    assert "kernel" in native and native["cpu_half_units"] == "bf16"
    # A CPU without AVX2+FMA never runs the kernel.
    old, _ = torch_keys(cpu_class, "sse4_2 avx", compiler="inductor", dtype="float32")
    assert old["cpu_isa"] == "none" and "kernel" not in old


def test_the_isa_in_a_key_does_not_depend_on_a_compiler(cpu_class, monkeypatch) -> None:
    # Inductor's own pick compiles probes, and answers "none" where no g++ is installed: a CI
    # runner's `plan` would key differently from the builder on the same CPU.
    from neuronctl.backends.torch import host

    monkeypatch.setattr(host, "_detect_isa", lambda: "none")  # inductor, no g++
    with_gxx, key = torch_keys(cpu_class, EPYC_FLAGS, compiler="inductor", dtype="float32")
    assert with_gxx["cpu_isa"] == "avx2"
    monkeypatch.setenv("PATH", "")
    assert torch_keys(cpu_class, EPYC_FLAGS, compiler="inductor", dtype="float32")[1] == key


def test_the_op_choice_mode_changes_no_key(cpu_class, monkeypatch) -> None:
    # Measured or by the rules, the graphs of one spec share a key: a graph donor's graphs
    # come with its recorded choice (opchoice), which a reusing build adopts.
    monkeypatch.setenv("NEURONCTL_OP_CHOICE", "measure")
    measured = torch_keys(cpu_class, EPYC_FLAGS, compiler="inductor", dtype="bfloat16")
    monkeypatch.setenv("NEURONCTL_OP_CHOICE", "rules")
    assert torch_keys(cpu_class, EPYC_FLAGS, compiler="inductor", dtype="bfloat16") == measured
