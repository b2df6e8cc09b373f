"""The torch backend computes what transformers computes, through real compiled artifacts."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from neuronctl.backends import get_backend
from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.host import cpu_flags, kernel_runs_on
from neuronctl.backends.torch.quantize import quantize
from neuronctl.backends.torch.runner import TorchRunner
from neuronctl.build import compile_model, resolve_build
from neuronctl.errors import SpecError, UsageError
from neuronctl.store.manifest import read_manifest
from tests.helpers import make_checkpoint

TOL = 1e-4
# Three context buckets and two token-generation ones: the tests below cross each bucket
# boundary (no sequence they run goes past 64 tokens), 8 graphs per artifact.
SPEC: dict[str, Any] = {
    "compiler": "export",
    "dtype": "float32",
    "seq_len": 64,
    "max_context_length": 64,
    "batch_size": 4,
    "context_buckets": "16,32,64",
    "token_gen_buckets": "32,64",
}
ARCHS: dict[str, dict[str, Any]] = {
    # (make_checkpoint kwargs): cover the index-sharded layout, tied embeddings, qkv bias.
    "llama": {"sharded": True},
    "mistral": {},
    "qwen2": {"tie_word_embeddings": True},
}


def one_bucket(context: int, token_gen: int) -> dict[str, Any]:
    """The smallest spec for a test that is not about buckets: one context bucket (graphs for
    1 and `batch_size` prompts) and one token-generation bucket, 3 graphs where SPEC has 8."""
    return {"context_buckets": str(context), "max_context_length": context,
            "token_gen_buckets": str(token_gen), "seq_len": token_gen}


def build(ckpt: Path, store: Path, **overrides: Any) -> Any:
    outcome = compile_model(resolve_build(str(ckpt), {**SPEC, **overrides}, store_dir=store),
                            jobs=1)
    return outcome


# Loaded graphs per artifact path. A graph holds no tensors (weights, rope frequencies and
# the KV cache are its inputs), so runners of one artifact may share them while each keeps
# its own weights and cache: the module's artifacts load each graph once, not once per test.
_GRAPHS: dict[Path, dict[str, Any]] = {}


def load(path: Path) -> Any:
    runner = get_backend("torch").load(path, read_manifest(path))
    assert isinstance(runner, TorchRunner)
    runner._graphs = _GRAPHS.setdefault(path, {})
    return runner


def hf_model(ckpt: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(ARCHS))
def artifact(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    ckpt = make_checkpoint(root / "ckpt", arch, **ARCHS[arch])
    outcome = build(ckpt, root / "store")
    return ckpt, outcome.path, hf_model(ckpt)


def test_context_and_16_decode_steps_match_transformers_across_buckets(artifact: Any) -> None:
    ckpt, path, hf = artifact
    runner = load(path)
    ids = random_ids(20 + 16, seed=1)
    ref = hf_logits(hf, ids)
    got = [runner.prefill(2, ids[:20])]  # 20 tokens: context bucket 32
    for pos in range(20, 36):  # positions 20..35: token-gen buckets 32 then 64
        positions = [-1, -1, pos, -1]
        got.append(runner.decode([0, 0, ids[pos], 0], positions)[2])
    diff = (torch.stack(got) - ref[19:36]).abs().max().item()
    assert diff < TOL, f"max abs logit difference {diff}"


def test_greedy_32_tokens_identical_to_transformers(artifact: Any) -> None:
    ckpt, path, hf = artifact
    runner = load(path)
    prompt = random_ids(9, seed=2)
    tokens = list(prompt)
    logits = runner.prefill(0, prompt)
    for _ in range(32):
        tokens.append(int(logits.argmax()))
        logits = runner.decode([tokens[-1], 0, 0, 0], [len(tokens) - 1, -1, -1, -1])[0]
    # transformers' greedy choice after every prefix of `tokens`, from one causal forward
    # over all of them (position i sees tokens[:i + 1] only): equal to `tokens` exactly
    # when greedy transformers generates the same 32 tokens from the prompt.
    ref = hf_logits(hf, tokens[:-1])
    expected = prompt + [int(ref[i].argmax()) for i in range(len(prompt) - 1, len(tokens) - 1)]
    assert tokens == expected


def test_mixed_prompt_lengths_in_different_slots(artifact: Any) -> None:
    ckpt, path, hf = artifact
    runner = load(path)
    lengths = {0: 5, 1: 40, 3: 17}  # slot 2 stays idle throughout
    seqs = {slot: random_ids(n + 8, seed=10 + slot) for slot, n in lengths.items()}
    # One causal forward per sequence: row i is transformers' logits after seq[:i + 1].
    refs = {slot: hf_logits(hf, seq) for slot, seq in seqs.items()}
    for slot, n in lengths.items():
        first = runner.prefill(slot, seqs[slot][:n])
        assert (first - refs[slot][n - 1]).abs().max() < TOL
    for step in range(8):
        tokens, positions = [0] * 4, [-1] * 4
        for slot, n in lengths.items():
            tokens[slot], positions[slot] = seqs[slot][n + step], n + step
        out = runner.decode(tokens, positions)
        for slot, n in lengths.items():
            ref = refs[slot][n + step]
            assert (out[slot] - ref).abs().max() < TOL, f"slot {slot} step {step}"


def test_artifact_loads_after_being_moved(artifact: Any, tmp_path: Path) -> None:
    _ckpt, path, _hf = artifact
    ids = random_ids(12, seed=3)
    before = load(path).prefill(1, ids)
    moved = tmp_path / "elsewhere"
    shutil.copytree(path, moved)
    assert torch.equal(load(moved).prefill(1, ids), before)


def test_tp2_names_the_tp1_artifact(tmp_path: Path) -> None:
    """One process runs the whole model on a CPU: a tp 2 build wrote the very bytes of a tp 1
    build and gave bit-identical results under another key. Now tp cannot split a torch key:
    the tp 2 compile is a cache hit on the tp 1 artifact, which records tp 1."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    small = {**one_bucket(32, 64), "batch_size": 1}
    one = build(ckpt, tmp_path / "store", tp_degree=1, **small)
    two = build(ckpt, tmp_path / "store", tp_degree=2, **small)
    assert two.keys == one.keys and two.path == one.path and two.cache_hit
    assert read_manifest(two.path).spec.tp_degree == 1


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", rope_parameters=rope)
    runner = load(build(ckpt, tmp_path / "store", batch_size=1, **one_bucket(64, 64)).path)
    ids = random_ids(60, seed=5)
    ref = hf_logits(hf_model(ckpt), ids)
    got = [runner.prefill(0, ids[:50])]
    got += [runner.decode([ids[p]], [p])[0] for p in range(50, 60)]
    assert (torch.stack(got) - ref[49:60]).abs().max() < TOL


def test_fine_tune_reuses_graphs_and_runs_its_own_weights(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base", "llama", seed=0)
    tuned = make_checkpoint(tmp_path / "tuned", "llama", seed=7)
    small = {**one_bucket(16, 32), "batch_size": 1}  # a 10-token prompt in one slot
    first = build(base, tmp_path / "store", **small)
    second = build(tuned, tmp_path / "store", **small)
    assert second.graphs_reused and not first.graphs_reused
    graphs = sorted(p.name for p in (second.path / "graphs").iterdir())
    for name in graphs:
        same = (first.path / "graphs" / name).read_bytes() == (
            second.path / "graphs" / name).read_bytes()
        assert same, name
    ids = random_ids(10, seed=6)
    ref = hf_logits(hf_model(tuned), ids)[-1]
    assert (load(second.path).prefill(0, ids) - ref).abs().max() < TOL


def test_prefill_batch_equals_one_prefill_per_prompt(artifact: Any) -> None:
    # Three prompts of different lengths in one call: graph context_encoding_32x4 with a
    # padding row; then each slot decodes on from what the batched call wrote.
    _ckpt, path, hf = artifact
    batched, single = load(path), load(path)
    slots, lengths = [3, 0, 1], [9, 30, 17]
    seqs = [random_ids(n + 4, seed=20 + n) for n in lengths]
    refs = [hf_logits(hf, seq) for seq in seqs]  # row i: transformers after seq[:i + 1]
    got = batched.prefill_batch(slots, [s[:n] for s, n in zip(seqs, lengths, strict=True)])
    assert got.shape == (3, hf.config.vocab_size)
    for row, (slot, seq, n) in enumerate(zip(slots, seqs, lengths, strict=True)):
        assert (got[row] - single.prefill(slot, seq[:n])).abs().max() < 1e-5
    for step in range(4):
        tokens, positions = [0] * 4, [-1] * 4
        for slot, seq, n in zip(slots, seqs, lengths, strict=True):
            tokens[slot], positions[slot] = seq[n + step], n + step
        out = batched.decode(tokens, positions)
        for slot, ref, n in zip(slots, refs, lengths, strict=True):
            assert (out[slot] - ref[n + step]).abs().max() < TOL, f"slot {slot} step {step}"


def test_prefill_batch_splits_more_prompts_than_a_graph_takes(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    # batch 3: graphs for 1 and 3 prompts; 5 prompts go as 3 (one graph) + 2 (padded to 3).
    runner = load(build(ckpt, tmp_path / "store", batch_size=3, **one_bucket(64, 64)).path)
    assert runner.prompt_counts == [1, 3]
    prompts = [random_ids(n, seed=n) for n in (5, 40, 12, 7, 16)]
    slots = [2, 0, 1, 0, 2]
    got = runner.prefill_batch(slots[:3], prompts[:3])
    rest = runner.prefill_batch(slots[3:], prompts[3:])
    for row, (slot, ids) in enumerate(zip(slots, prompts, strict=True)):
        expected = runner.prefill(slot, ids)
        assert ((got[row] if row < 3 else rest[row - 3]) - expected).abs().max() < 1e-5
    with pytest.raises(UsageError, match="same slot"):
        runner.prefill_batch([1, 1], prompts[:2])


def rounded_reference(ckpt: Path, dtype: torch.dtype) -> Any:
    """transformers in float32 on the checkpoint's weights rounded to `dtype`."""
    model = hf_model(ckpt)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype).float())
    return model


def test_bf16_without_bf16_units_computes_in_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What an AVX2 host builds (forced here, whatever this CPU has): bf16 weights in the
    # artifact and in memory, float32 activations and matmuls. Against float32 transformers
    # on the same bf16-rounded weights only the bf16 KV cache rounds.
    from neuronctl.backends.torch import host

    monkeypatch.setattr(host, "half_units", lambda: "none")
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", tie_word_embeddings=True)
    path = build(ckpt, tmp_path / "store", dtype="bfloat16", **one_bucket(32, 64)).path
    config = json.loads((path / "neuron_config.json").read_text())
    assert config["numerics"] == {
        "storage": "bfloat16", "compute": "float32", "quantized": None,
        "matmul": "plain weights, chosen by rules; 4 rows: aten; 32 rows: aten; 128 rows: aten",
        "attention": "masked batched matmuls, the cache widened to the compute dtype",
    }
    assert read_manifest(path).backend_versions["cpu_half_units"] == "none"
    runner = load(path)
    assert runner.weights["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.bfloat16
    ids = random_ids(40, seed=11)
    ref = hf_logits(rounded_reference(ckpt, torch.bfloat16), ids)
    got = [runner.prefill(1, ids[:24])]
    got += [runner.decode([0, ids[p], 0, 0], [-1, p, -1, -1])[1] for p in range(24, 40)]
    assert (torch.stack(got) - ref[23:40]).abs().max() < 2e-2
    assert torch.equal(torch.stack(got).argmax(-1), ref[23:40].argmax(-1))


def test_bf16_with_bf16_units_computes_in_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuronctl.backends.torch import host

    monkeypatch.setattr(host, "half_units", lambda: "bf16")
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    path = build(ckpt, tmp_path / "store", dtype="bfloat16", batch_size=1,
                 **one_bucket(16, 32)).path
    config = json.loads((path / "neuron_config.json").read_text())
    assert config["numerics"]["compute"] == "bfloat16"
    assert read_manifest(path).host["compute_dtype"] == "bfloat16"


@pytest.mark.parametrize("kind", ["per_channel_symmetric", "per_tensor_symmetric"])
def test_int8_artifact_matches_its_dequantized_weights(tmp_path: Path, kind: str) -> None:
    # int8 projections and a tied int8 LM head/embedding, one bf16 scale per output channel
    # (per tensor: all equal). Against float32 transformers on the dequantized weights the
    # only other rounding is the bf16 activations int8_linear feeds its kernel; against the
    # original float32 model the greedy tokens of this tiny model still agree.
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", tie_word_embeddings=True)
    path = build(ckpt, tmp_path / "store", quantized=True, quantization_type=kind,
                 **one_bucket(32, 64)).path
    runner = load(path)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert runner.weights[qkv].dtype == torch.int8
    scales = runner.weights["model.layers.0.self_attn.o_proj.weight_scale"]  # not fused
    assert scales.dtype == torch.bfloat16 and (kind == "per_channel_symmetric") == bool(
        (scales != scales[0]).any())
    ref_model = hf_model(ckpt)
    dequantized = hf_model(ckpt)
    with torch.no_grad():
        for param in dequantized.parameters():
            if param.dim() == 2:  # every projection and the (tied) embedding
                q, scale = quantize(param, kind == "per_channel_symmetric")
                param.copy_(q.float() * scale.float()[:, None])
    ids = random_ids(40, seed=12)
    got = [runner.prefill(2, ids[:24])]
    got += [runner.decode([0, 0, ids[p], 0], [-1, -1, p, -1])[2] for p in range(24, 40)]
    got_t = torch.stack(got)
    ref = hf_logits(dequantized, ids)[23:40]
    assert (got_t - ref).abs().max() < 2e-2 * max(1.0, ref.abs().max().item())
    assert torch.equal(got_t.argmax(-1), hf_logits(ref_model, ids)[23:40].argmax(-1))
    batched = runner.prefill_batch([0, 3], [ids[:24], ids[:10]])
    assert (batched[0] - got[0]).abs().max() < 1e-5


def test_torch_refuses_fp8_quantization(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    with pytest.raises(SpecError, match="int8"):
        build(ckpt, tmp_path / "store", quantized=True, quantization_dtype="f8e4m3fn")


def test_graph_files_hold_no_tensor_data(artifact: Any) -> None:
    _ckpt, path, _hf = artifact
    for graph in (path / "graphs").iterdir():
        with zipfile.ZipFile(graph) as archive:
            for entry in archive.infolist():
                # Weights, constants and sample inputs would live under data/; only the
                # small JSON configs saying "none" may be there.
                if "/data/" in entry.filename:
                    assert entry.file_size < 1024, f"{graph.name}: {entry.filename}"


@pytest.mark.slow
def test_inductor_artifact_matches_transformers(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", tie_word_embeddings=True)
    outcome = build(ckpt, tmp_path / "store", compiler="inductor", context_buckets="32",
                    token_gen_buckets="64", batch_size=2, seq_len=64, max_context_length=32)
    runner = load(outcome.path)
    # float32 on an AVX2 host: every projection by neuronctl's kernel on blocked weights,
    # and token generation's attention by its attend op, from the library the artifact
    # carries (listed, so hashed and signed like the graphs)
    assert runner.blocked == kernel_runs_on(cpu_flags())
    if runner.blocked:
        assert kernel.artifact_library() in read_manifest(outcome.path).files
        numerics = json.loads((outcome.path / "neuron_config.json").read_text())["numerics"]
        assert numerics["attention"].startswith("neuronctl::attend")
    ids = random_ids(40, seed=8)
    ref = hf_logits(hf_model(ckpt), ids)
    got = [runner.prefill(1, ids[:24])]
    got += [runner.decode([0, ids[p]], [-1, p])[1] for p in range(24, 40)]
    assert (torch.stack(got) - ref[23:40]).abs().max() < TOL
    assert get_backend("torch").host_checks(read_manifest(outcome.path))[-1].ok


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True])
def test_inductor_bf16_and_int8_match_their_traced_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantized: bool
) -> None:
    # bf16 weights on a CPU without bf16 units, and int8 ones: the kernel widens them in
    # registers; the traced graphs (aten) widen whole matrices. Same artifact spec otherwise.
    from neuronctl.backends.torch import host

    monkeypatch.setattr(host, "half_units", lambda: "none")
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", tie_word_embeddings=True)
    ids = random_ids(40, seed=13)
    outs = []
    for compiler in ("export", "inductor"):
        path = build(ckpt, tmp_path / "store", compiler=compiler, dtype="bfloat16",
                     quantized=quantized, context_buckets="32", token_gen_buckets="64",
                     batch_size=2, seq_len=64, max_context_length=32).path
        runner = load(path)
        got = [runner.prefill(1, ids[:24])]
        got += [runner.decode([0, ids[p]], [-1, p])[1] for p in range(24, 40)]
        outs.append(torch.stack(got))
    assert runner.blocked == kernel_runs_on(cpu_flags())
    # int8's traced graphs round activations to bf16 for aten's int8 kernel; the kernel not
    assert (outs[0] - outs[1]).abs().max() < (1e-2 if quantized else 1e-4)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


@pytest.mark.slow
def test_inductor_prepacked_batch_matches_transformers(tmp_path: Path) -> None:
    # Above the GEMV's batch range the graphs read oneDNN-prepacked weights (a tied head is
    # packed as lm_head.weight); same tolerance, still no weight in any graph, still movable.
    # A hidden size of 72 is not a multiple of neuronctl's kernel's 16 columns, so even an
    # AVX2 host takes oneDNN here.
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", tie_word_embeddings=True,
                           hidden_size=72)
    outcome = build(ckpt, tmp_path / "store", compiler="inductor", context_buckets="32",
                    token_gen_buckets="64", batch_size=6, seq_len=64, max_context_length=32)
    moved = tmp_path / "moved"
    shutil.copytree(outcome.path, moved)
    runner = load(moved)
    assert runner.packed and runner.weights["lm_head.weight"].is_mkldnn
    ids = random_ids(40, seed=9)
    ref = hf_logits(hf_model(ckpt), ids)
    got = [runner.prefill(4, ids[:24])]
    for p in range(24, 40):
        positions = [-1] * 6
        positions[4] = p
        got.append(runner.decode([0, 0, 0, 0, ids[p], 0], positions)[4])
    assert (torch.stack(got) - ref[23:40]).abs().max() < TOL
    for graph in (moved / "graphs").iterdir():
        with zipfile.ZipFile(graph) as archive:
            # AOTInductor keeps its generated code under data/aotinductor/; weights would be
            # data/constants/ or a weights blob next to the shared library.
            for entry in archive.infolist():
                name = entry.filename
                assert "constants" not in name and "weights" not in name, name
                if "/data/" in name:
                    assert name.endswith((".cpp", ".so", ".json")), name
