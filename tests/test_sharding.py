"""Streaming TP sharding: the shards put back together are the original tensors, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from neuronctl.checkpoints import open_checkpoint
from neuronctl.checkpoints.reader import valid_tp_degrees
from neuronctl.errors import SpecError
from neuronctl.sharding import load_full_tensors, shard_checkpoint
from tests.helpers import make_checkpoint

CASES = {
    "llama-single-untied": dict(arch="llama", sharded=False, tie_word_embeddings=False),
    "llama-index-tied": dict(arch="llama", sharded=True, tie_word_embeddings=True),
    "qwen2-index-untied-bias": dict(arch="qwen2", sharded=True, tie_word_embeddings=False),
    "mistral-single-tied-oddvocab": dict(
        arch="mistral", sharded=False, tie_word_embeddings=True, vocab_size=322
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shard-ckpts")
    out = {}
    for i, (name, kw) in enumerate(CASES.items()):
        kw = dict(kw)
        arch = kw.pop("arch")
        # 8 query heads, 2 KV heads: tp 4 and 8 replicate KV heads (GQA with KV heads < tp).
        out[name] = make_checkpoint(
            root / name, arch, num_heads=8, num_kv_heads=2, tokenizer=False, seed=i, **kw
        )
    return out


def originals(path: Path) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(str(path))
    return {name: ckpt.tensor(name) for name in ckpt.tensor_names()}


def read_shards(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    out = []
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            out.append({k: f.get_tensor(k) for k in f.keys()})
    return out


def expected_dim(name: str, vocab: int, tp: int) -> int | None:
    """The split dim by the documented rules, written independently of the implementation."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0 if vocab % tp == 0 else None
    if any(m in name for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return 0
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    return None


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_concatenated_shards_reproduce_every_tensor(
    checkpoints: dict[str, Path], case: str, tp: int, tmp_path: Path
) -> None:
    path = checkpoints[case]
    ckpt = open_checkpoint(str(path))
    orig = originals(path)
    tied = ckpt.config["tie_word_embeddings"]
    vocab, kv = ckpt.config["vocab_size"], ckpt.config["num_key_value_heads"]
    paths = shard_checkpoint(ckpt, tp, torch.float32, tmp_path / "weights")
    assert [p.name for p in paths] == [f"tp{r}_sharded_checkpoint.safetensors" for r in range(tp)]
    shards = read_shards(paths)
    expected_names = {n for n in orig if not (tied and n == "lm_head.weight")}
    for rank_tensors in shards:
        assert set(rank_tensors) == expected_names
    for name in expected_names:
        pieces = [s[name] for s in shards]
        is_kv = ("k_proj" in name or "v_proj" in name) and tp > kv
        dim = expected_dim(name, vocab, tp)
        if is_kv:
            heads = orig[name].chunk(kv, dim=0)
            for rank, piece in enumerate(pieces):
                assert torch.equal(piece, heads[rank * kv // tp]), (name, rank)
            rebuilt = torch.cat([pieces[h * tp // kv] for h in range(kv)], dim=0)
        elif dim is None:
            assert all(torch.equal(p, orig[name]) for p in pieces), name
            rebuilt = pieces[0]
        else:
            rebuilt = torch.cat(pieces, dim=dim)
        assert rebuilt.dtype == orig[name].dtype
        assert torch.equal(rebuilt, orig[name]), name
    full = load_full_tensors(tmp_path / "weights")
    assert set(full) == expected_names
    assert all(torch.equal(full[n], orig[n]) for n in expected_names)


def test_dtype_conversion_on_the_way(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = checkpoints["qwen2-index-untied-bias"]
    ckpt = open_checkpoint(str(path))
    shard_checkpoint(ckpt, 2, torch.bfloat16, tmp_path)
    full = load_full_tensors(tmp_path)
    for name, tensor in originals(path).items():
        assert full[name].dtype == torch.bfloat16
        assert torch.equal(full[name], tensor.to(torch.bfloat16)), name


def test_shard_metadata_is_readable(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    ckpt = open_checkpoint(str(checkpoints["llama-index-tied"]))
    paths = shard_checkpoint(ckpt, 4, torch.float16, tmp_path)
    with safe_open(str(paths[3]), framework="pt") as f:
        meta = f.metadata()
    assert meta["neuronctl.tp_rank"] == "3"
    assert meta["neuronctl.tp_degree"] == "4"
    assert meta["neuronctl.tie_word_embeddings"] == "true"
    assert meta["format"] == "pt"


def test_progress_reports_all_bytes(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    ckpt = open_checkpoint(str(checkpoints["llama-single-untied"]))
    seen: dict[str, float] = {}

    class Recorder:
        def task(self, description: str, total: float | None = None):  # type: ignore[no-untyped-def]
            seen["total"] = total or 0
            seen["done"] = 0

            def advance(n: float) -> None:
                seen["done"] += n

            return advance

    shard_checkpoint(ckpt, 2, torch.float32, tmp_path, progress=Recorder())
    assert seen["total"] > 0 and seen["done"] == seen["total"]


@pytest.mark.parametrize("tp", [3, 16])
def test_tp_not_dividing_heads_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path, tp: int
) -> None:
    ckpt = open_checkpoint(str(checkpoints["llama-single-untied"]))
    with pytest.raises(SpecError, match="does not divide the model's 8 attention heads"):
        shard_checkpoint(ckpt, tp, torch.float32, tmp_path / "w")
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())


def test_valid_tp_degrees_follow_heads_and_kv_heads() -> None:
    assert valid_tp_degrees(8, 2) == [1, 2, 4, 8]
    assert valid_tp_degrees(12, 4) == [1, 2, 4, 12]
    assert valid_tp_degrees(32, 8) == [1, 2, 4, 8, 16, 32]
