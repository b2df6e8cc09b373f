"""lm-eval-harness against `neuronctl serve`: how a user checks that a compiled artifact kept
its model's accuracy. The real `lm-eval` package (the `eval` extra), two local tasks of our own
(JSONL data, no network), each run twice: through the server (`local-completions` for
loglikelihood, `local-chat-completions` for generate_until) and through lm-eval's own `hf`
model on the same fp32 checkpoint. The per-sample results must agree: loglikelihoods within
1e-3 (and the same is_greedy), generations identical.

lm-eval's request shapes (lm_eval/models/openai_completions.py, LocalCompletionsAPI): a
loglikelihood request is {prompt: token ids, max_tokens: 1, logprobs: 1, echo: true,
temperature: 0}; it reads choices[].logprobs.token_logprobs[ctxlen:-1] and top_logprobs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_server import Server, serving

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install .[eval])")

pytestmark = pytest.mark.slow

CHOICES = [  # short: the tiny artifact's byte tokenizer spends a token per character
    {"question": "2 + 2 =", "choices": [" 4", " 5", " 22"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
    {"question": "Cats say", "choices": [" meow", " woof", " moo"], "answer": 0},
]
PROMPTS = [{"question": "Hi", "answer": "x"}, {"question": "Say a word", "answer": "y"}]

TASKS = {
    "neuronctl_choice": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    },
    "neuronctl_generate": {
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
}


def write_tasks(folder: Path) -> None:
    for name, config in TASKS.items():
        rows = CHOICES if name == "neuronctl_choice" else PROMPTS
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        task = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **config,
        }
        (folder / f"{name}.yaml").write_text(json.dumps(task))  # JSON is YAML


@pytest.fixture(scope="module")
def server(compiled_artifact: Path) -> Iterator[Server]:
    with serving(compiled_artifact, "--served-model-name", "tiny") as srv:
        yield srv


def evaluate(tasks_dir: Path, task: str, model: str, args: dict[str, Any], chat: bool) -> Any:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        apply_chat_template=chat,
        batch_size=1,
    )
    return sorted(out["samples"][task], key=lambda s: (s["doc_id"], json.dumps(s["arguments"])))


def test_lm_eval_through_the_server_equals_lm_eval_on_the_checkpoint(
    server: Server, tiny_llama: Path, compiled_artifact: Path, tmp_path: Path
) -> None:
    write_tasks(tmp_path)
    hf = {"pretrained": str(tiny_llama), "dtype": "float32", "device": "cpu"}
    remote = {
        "model": "tiny",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(compiled_artifact),
        "add_bos_token": True,  # docs/runtime.md: as the hf model, whatever the tokenizer
        "max_retries": 1,
    }

    def served_and_local(task: str, model: str, endpoint: str, chat: bool) -> tuple[Any, Any]:
        """The task through neuronctl's server, and through lm-eval's own hf model."""
        args = {**remote, "base_url": server.url + endpoint}
        served = evaluate(tmp_path, task, model, args, chat=chat)
        return served, evaluate(tmp_path, task, "hf", hf, chat=chat)

    served, local = served_and_local(
        "neuronctl_choice", "local-completions", "/v1/completions", chat=False
    )
    ours = [r[0] for s in served for r in s["resps"]]  # one (loglikelihood, is_greedy) a choice
    theirs = [r[0] for s in local for r in s["resps"]]
    assert len(ours) == len(theirs) == sum(len(c["choices"]) for c in CHOICES)
    for (logprob, greedy), (ref_logprob, ref_greedy) in zip(ours, theirs, strict=True):
        assert logprob == pytest.approx(ref_logprob, abs=1e-3)
        assert greedy == ref_greedy

    served, local = served_and_local(
        "neuronctl_generate", "local-chat-completions", "/v1/chat/completions", chat=True
    )
    assert [s["resps"] for s in served] == [s["resps"] for s in local]
    assert all(s["resps"][0][0] for s in served)  # something was generated
