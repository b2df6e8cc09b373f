"""`neuronctl generate` (and serve's pre-flight) in-process, on the real tiny artifact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import run_in_process


def run(
    args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    return run_in_process(args, capsys, monkeypatch)


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture
def gen(compiled_artifact: Path, capsys, monkeypatch):  # type: ignore[no-untyped-def]
    def call(*args: str) -> tuple[int, str, str]:
        return run(["generate", "--artifacts", str(compiled_artifact), *args], capsys, monkeypatch)

    return call


def test_json_gives_one_object_per_prompt_and_batching_keeps_results(gen) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = gen("-p", "abc", "-p", "hello", "--max-tokens", "6", "--ignore-eos", "--json")
    assert code == 0
    both = lines(out)
    assert [o["index"] for o in both] == [0, 1]
    assert all(o["completion_tokens"] == 6 and o["finish_reason"] == "length" for o in both)
    assert both[0]["prompt_tokens"] == 3
    assert {"ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"} <= set(both[0]["timings"])
    _, out, _ = gen("-p", "hello", "--max-tokens", "6", "--ignore-eos", "--json")
    assert lines(out)[0]["token_ids"] == both[1]["token_ids"]


def test_seed_makes_sampling_reproducible(gen) -> None:  # type: ignore[no-untyped-def]
    args = ["-p", "x", "--max-tokens", "12", "--ignore-eos", "--temperature", "1.0", "--json"]
    first = lines(gen(*args, "--seed", "5")[1])[0]["token_ids"]
    again = lines(gen(*args, "--seed", "5")[1])[0]["token_ids"]
    other = lines(gen(*args, "--seed", "6")[1])[0]["token_ids"]
    assert first == again != other


def test_prompts_from_file_and_jsonl_with_per_line_fields(gen, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "one", "max_tokens": 3}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "two"}]}) + "\n"
    )  # fmt: skip
    code, out, _ = gen("--jsonl", str(jsonl), "--max-tokens", "5", "--ignore-eos", "--json")
    assert code == 0
    assert [o["completion_tokens"] for o in lines(out)] == [3, 5]
    assert lines(out)[1]["prompt_tokens"] > 10  # the chat template wrapped it
    text = tmp_path / "prompts.txt"
    text.write_text("first\n\nsecond\nthird\n")
    code, out, _ = gen("--file", str(text), "--max-tokens", "2", "--json")
    assert [o["prompt"] for o in lines(out)] == ["first", "second", "third"]


def test_stream_json_emits_tokens_then_the_result(gen) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = gen("-p", "s", "--max-tokens", "5", "--ignore-eos", "--stream", "--json")
    assert code == 0
    events = lines(out)
    tokens = [e["token_id"] for e in events if "token_id" in e]
    assert tokens == events[-1]["token_ids"] and len(tokens) == 5
    assert "".join(e["text"] for e in events[:-1]) == events[-1]["text"]


def test_human_output_and_stream(gen) -> None:  # type: ignore[no-untyped-def]
    code, out, err = gen("-p", "hi", "--max-tokens", "3", "--stream")
    assert code == 0 and "hi" in out and "tokens/s" in err


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no prompts"),
        (["--file", "a", "--jsonl", "b"], "not both"),
        (["-p", "y" * 80], "at most 64"),
        (["-p", "y", "--max-tokens", "500"], "sequence length 128"),
        (["-p", "y", "--top-k", "300"], "global top_k 256"),
        (["-p", "y", "--dry-run"], "--engine vllm"),
    ],
)
def test_usage_errors_exit_2(gen, args: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    code, _, err = gen(*args)
    assert code == 2 and message in err and "Traceback" not in err


def test_bad_jsonl_line_is_named(gen, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    code, _, err = gen("--jsonl", str(bad))
    assert code == 2 and "bad.jsonl:2" in err


def test_missing_artifact_exits_1(capsys, monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run(
        ["generate", "--artifacts", str(tmp_path / "nope"), "-p", "x"], capsys, monkeypatch
    )
    assert code == 1 and "does not exist" in err
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "gone"))
    code, _, err = run(["generate", "-p", "x"], capsys, monkeypatch)
    assert code == 1 and "gone" in err


def test_damaged_artifact_is_refused_before_loading(
    compiled_artifact: Path,
    tmp_path: Path,
    capsys,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    copy = tmp_path / "art"
    shutil.copytree(compiled_artifact, copy)
    shard = next((copy / "weights").iterdir())
    shard.unlink()
    code, _, err = run(["generate", "--artifacts", str(copy), "-p", "x"], capsys, monkeypatch)
    assert code == 1 and "cannot be used as-is" in err and shard.name in err
    code, _, err = run(["serve", "--artifacts", str(copy), "--dry-run"], capsys, monkeypatch)
    assert code == 1 and "cannot be used as-is" in err


def test_serve_dry_run_prints_the_plan(compiled_artifact: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    args = ["serve", "--artifacts", str(compiled_artifact), "--dry-run", "--json", "--port", "9"]
    code, out, _ = run(args, capsys, monkeypatch)
    plan = json.loads(out)
    assert code == 0 and plan["batch_size"] == 4 and plan["seq_len"] == 128
    assert plan["max_prompt_tokens"] == 64 and plan["url"] == "http://127.0.0.1:9/v1"
    code, _, err = run([*args[:3], "--engine", "vllm", "--dry-run"], capsys, monkeypatch)
    assert code == 2 and "vLLM cannot load" in err


def test_bench_json_report(compiled_artifact: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    args = ["bench", "--artifacts", str(compiled_artifact), "--requests", "6", "--prompt-len",
            "8", "--max-tokens", "4", "--concurrency", "3", "--json"]  # fmt: skip
    code, out, _ = run(args, capsys, monkeypatch)
    report = json.loads(out)
    assert code == 0 and report["output_tokens"] == 24 and report["requests"] == 6
    assert report["config"]["batch_size"] == 4
    assert report["ttft"]["latency_ms_p99"] >= report["ttft"]["latency_ms_p50"] > 0
    code, _, err = run([*args[:3], "--prompt-len", "100"], capsys, monkeypatch)
    assert code == 2 and "limit 64" in err


def test_serve_compile_if_missing_is_opt_in(
    compiled_artifact: Path,
    tiny_llama: Path,
    tmp_path: Path,
    capsys,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    from tests.conftest import TINY_SPEC

    missing = ["serve", "--artifacts", str(tmp_path / "none"), "--dry-run", "--json"]
    code, _, err = run(missing, capsys, monkeypatch)
    assert code == 1 and "does not exist" in err
    store = compiled_artifact.parent.parent  # <store>/neuron-compiled-artifacts/<key>
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_SPEC.items()]
    args = [*missing, "--compile-if-missing", "--model", str(tiny_llama), "--store", str(store)]
    code, out, _ = run([*args, *flags], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["artifact"] == str(compiled_artifact)  # a cache hit


def test_binary_prompt_file_and_mistyped_jsonl_fields_are_usage_errors(gen, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\xba\x00")
    code, _, err = gen("--file", str(binary))
    assert code == 2 and "not UTF-8" in err and "internal error" not in err
    for line in ('{"prompt": "hi", "max_tokens": "x"}', '{"prompt": "hi", "stop": 5}'):
        jsonl = tmp_path / "p.jsonl"
        jsonl.write_text(line + "\n")
        code, _, err = gen("--jsonl", str(jsonl))
        assert code == 2 and "internal error" not in err, (line, err)


def test_serve_refuses_an_artifact_that_does_not_match_the_requested_spec(
    compiled_artifact: Path, capsys, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    # Spec flags on serve are a request: an artifact compiled otherwise is refused, not
    # served with other shapes than asked for.
    serve = ["serve", "--artifacts", str(compiled_artifact), "--dry-run", "--json"]
    code, _, err = run([*serve, "--seq-len", "256"], capsys, monkeypatch)
    assert code == 1 and "seq_len" in err
    code, _, err = run([*serve, "--batch-size", "4"], capsys, monkeypatch)
    assert code == 0, err
