"""The small offline program `generate_launch` runs inside the vLLM environment
(`python -m neuronctl.vllm generate ...`): LLM(...).generate over a prompts file, one JSON
line per prompt."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from neuronctl.vllm.rules import STDIN


def read_prompts(path: Path) -> list[str]:
    stdin = str(path) == STDIN
    text = sys.stdin.read() if stdin else path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    if path.suffix != ".jsonl" and not stdin:
        return lines
    prompts = []
    for line in lines:
        item = json.loads(line)
        prompts.append(item if isinstance(item, str) else item["prompt"])
    return prompts


def too_long(lengths: Sequence[int], cap: int | None) -> list[int]:
    """Indexes of prompts longer than the artifact's context encoding accepts."""
    return [] if cap is None else [i for i, n in enumerate(lengths) if n > cap]


def generate_main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m neuronctl.vllm generate")
    parser.add_argument("--engine-args", required=True)
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--sampling", default="{}")
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    opts = parser.parse_args(argv)
    from vllm import LLM, SamplingParams  # only present on the serving host

    llm = LLM(**json.loads(opts.engine_args))
    prompts = read_prompts(opts.prompts)
    tokenizer = llm.get_tokenizer()
    long = too_long([len(tokenizer.encode(p)) for p in prompts], opts.max_prompt_tokens)
    if long:
        sys.stderr.write(
            f"error: prompt {long[0] + 1} is longer than the artifact's max_context_length "
            f"({opts.max_prompt_tokens} tokens); NxD Inference would raise inside vLLM\n"
        )
        return 1
    outputs = llm.generate(prompts, SamplingParams(**json.loads(opts.sampling)))
    for prompt, out in zip(prompts, outputs, strict=True):
        first = out.outputs[0]
        row = {"prompt": prompt, "text": first.text, "token_ids": list(first.token_ids)}
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


def main(argv: Sequence[str]) -> int | str:
    """`generate ARGS...`: the only command (an exit message for anything else)."""
    if list(argv[:1]) != ["generate"]:
        return "usage: python -m neuronctl.vllm generate --engine-args JSON --prompts FILE"
    return generate_main(argv[1:])
