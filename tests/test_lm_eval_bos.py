"""The lm-eval recipe of docs/runtime.md, on a tokenizer that adds a BOS.

lm-eval's API models tokenize the requests themselves and send token ids; `TemplateAPI.tok_encode`
(lm_eval 0.4.13, lm_eval/models/api_models.py:396-423) passes
`add_special_tokens = False or self.add_bos_token`, so without `add_bos_token=True` no context
has a BOS. Its `hf` model passes the tokenizer's default (lm_eval/models/huggingface.py:1040-1057,
`_add_special_kwargs` in lm_eval/models/utils.py:982-987 returns {} when `add_bos_token` is
None), which adds the BOS. The task here (30 documents, 3 choices each, a local JSONL file) runs
through `neuronctl serve` with the docs' `--model_args`, read from docs/runtime.md, and through
lm-eval's `hf` model on the same fp32 checkpoint; every loglikelihood must agree within 1e-3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALLEST_SPEC
from tests.helpers import make_tokenizer
from tests.test_server import Server, serving

# Nothing reaches the network: the task's data is a local file, the models local folders.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install .[eval])")

pytestmark = pytest.mark.eval  # `make test-eval`, which CI runs

REPO = Path(__file__).resolve().parent.parent
TASK = "neuronctl_bos_choice"
N_DOCS = 30
# Eight slots, and lm-eval sends eight prompts a request: the scored prompts share decode steps.
SPEC = {**SMALLEST_SPEC, "batch_size": 8}
BATCH = 8


def docs() -> list[dict[str, Any]]:
    """Short sums (the byte tokenizer spends a token per character; the artifact takes 32)."""
    rows = []
    for i in range(N_DOCS):
        a, b = i % 9 + 1, i // 9 + 2
        right = a + b
        choices = [f" {right}", f" {right + 1}", f" {right - 2}"]
        rows.append({"question": f"{a} + {b} =", "choices": choices, "answer": 0})
    return rows


def write_task(folder: Path) -> None:
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in docs()))
    task = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    }
    (folder / f"{TASK}.yaml").write_text(json.dumps(task))  # JSON is YAML


def recipe_args(model: str) -> dict[str, str]:
    """The `--model_args` of docs/runtime.md's `lm_eval --model MODEL` line."""
    text = (REPO / "docs" / "runtime.md").read_text()
    line = re.search(rf"^lm_eval --model {model} .*--model_args (\S+)", text, re.M)
    assert line, f"docs/runtime.md has no `lm_eval --model {model} ... --model_args` line"
    return dict(pair.split("=", 1) for pair in line.group(1).split(","))


@pytest.fixture(scope="module")
def bos_checkpoint(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama's weights with a tokenizer whose post-processor adds <s>."""
    out = tmp_path_factory.mktemp("bos") / "bos-llama"
    shutil.copytree(tiny_llama, out)
    make_tokenizer(out, adds_bos=True)
    return out


@pytest.fixture(scope="module")
def bos_artifact(bos_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from neuronctl.build import compile_model, resolve_build

    store = tmp_path_factory.mktemp("bos-store")
    build = resolve_build(str(bos_checkpoint), SPEC, store_dir=store)
    return compile_model(build, jobs=1).path


@pytest.fixture(scope="module")
def server(bos_artifact: Path) -> Iterator[Server]:
    with serving(bos_artifact, "--served-model-name", "m") as srv:
        yield srv


def loglikelihoods(
    tasks_dir: Path, model: str, args: dict[str, Any], batch: int = 1
) -> list[float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=",".join(f"{k}={v}" for k, v in args.items()),  # as the CLI passes them
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        batch_size=batch,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: (s["doc_id"], json.dumps(s["arguments"])))
    return [float(r[0][0]) for s in samples for r in s["resps"]]


def test_the_tokenizer_adds_a_bos(bos_artifact: Path) -> None:
    from transformers import AutoTokenizer

    from neuronctl.engine.tokenizer import EngineTokenizer

    ref = AutoTokenizer.from_pretrained(str(bos_artifact))
    assert ref("1 + 2 =").input_ids[0] == ref.bos_token_id is not None
    assert EngineTokenizer.load(bos_artifact).encode("1 + 2 =") == ref("1 + 2 =").input_ids


def test_lm_eval_through_serve_equals_hf_on_a_bos_tokenizer(
    server: Server,
    bos_artifact: Path,
    bos_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_task(tmp_path)
    served_args = {
        **recipe_args("local-completions"),
        "base_url": server.url + "/v1/completions",
        "model": "m",
        "tokenizer": str(bos_artifact),
        "max_retries": "1",
    }
    hf_args = {**recipe_args("hf"), "pretrained": str(bos_checkpoint), "device": "cpu"}
    served = loglikelihoods(tmp_path, "local-completions", served_args, batch=BATCH)
    local = loglikelihoods(tmp_path, "hf", hf_args)
    assert len(served) == len(local) == 3 * N_DOCS
    worst = max(abs(a - b) for a, b in zip(served, local, strict=True))
    assert worst < 1e-3, f"a loglikelihood differs from lm-eval's hf model by {worst:.3f} nats"
