"""The prompts of an offline `generate`: flags, a text file (one per line, '-' for stdin) or
JSON lines with per-line sampling overrides. No engine here: overrides apply to any
dataclass of sampling parameters (engine.sampling.SamplingParams)."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from neuronctl.errors import UsageError

# Per-line sampling fields a JSON line may set, over the flags.
JSONL_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos")
P = TypeVar("P")


@dataclass
class Prompt:
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    overrides: dict[str, Any] | None = None

    def label(self) -> str:
        if self.text is not None:
            return self.text
        return str((self.messages or [{}])[-1].get("content", ""))


def collect_prompts(
    texts: list[str], file: Path | None, jsonl: Path | None, chat: bool
) -> list[Prompt]:
    if file is not None and jsonl is not None:
        raise UsageError("give --file or --jsonl, not both")
    prompts = [Prompt(text=t) for t in texts]
    if any(not t for t in texts):
        raise UsageError("--prompt is empty", "an empty prompt has nothing to continue")
    if file is not None:
        lines = read_text(file).splitlines()
        prompts += [Prompt(text=line) for line in lines if line.strip()]
    if jsonl is not None:
        prompts += read_jsonl(jsonl)
    if not prompts:
        raise UsageError("no prompts", "pass --prompt TEXT, --file FILE or --jsonl FILE")
    if chat:
        prompts = [
            Prompt(messages=[{"role": "user", "content": p.text}], overrides=p.overrides)
            if p.text is not None
            else p
            for p in prompts
        ]
    return prompts


def read_text(path: Path) -> str:
    if str(path) == "-":
        return sys.stdin.read()
    try:
        return path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {path}: not UTF-8 text") from None


def read_jsonl(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: not JSON: {exc.msg}") from None
        if not isinstance(obj, dict) or not (
            isinstance(obj.get("prompt"), str) or isinstance(obj.get("messages"), list)
        ):
            raise UsageError(
                f'{path}:{number}: expected {{"prompt": "..."}} or {{"messages": [...]}}'
            )
        overrides = {k: obj[k] for k in JSONL_FIELDS if k in obj}
        if isinstance(overrides.get("stop"), str):
            overrides["stop"] = [overrides["stop"]]
        if isinstance(overrides.get("stop"), list):  # anything else: the engine refuses it
            overrides["stop"] = tuple(overrides["stop"])
        prompts.append(Prompt(obj.get("prompt"), obj.get("messages"), overrides or None))
    return prompts


def params_for(prompt: Prompt, params: P) -> P:
    """The flags' sampling parameters with this prompt's JSON-line overrides applied."""
    if not prompt.overrides:
        return params
    try:
        return dataclasses.replace(params, **prompt.overrides)  # type: ignore[type-var]
    except TypeError as exc:
        raise UsageError(f"bad sampling field in --jsonl: {exc}") from None
