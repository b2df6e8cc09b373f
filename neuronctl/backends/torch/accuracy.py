"""`compile --check-accuracy`: the compiled artifact against Hugging Face transformers on CPU.

After NxD Inference's inference_demo: both generate greedily from the same prompt; token
matching passes when every generated token agrees, logit matching when the largest logit
difference (transformers teacher-forced along the artifact's tokens, so every step compares
the same prefix) is within the artifact's tolerance. The reference is transformers in
float32: what the checkpoint computes, whatever the artifact stores or computes in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from neuronctl.errors import UsageError

MODES = ("token-matching", "logit-matching")
DEFAULT_PROMPT = "I believe the meaning of life is"
# Logit-matching tolerance relative to the largest reference logit (never below 1.0), by the
# artifact's numerics: 32 units of the last place of its narrowest format, since rounding
# compounds over the layers (bf16 has 8 significant bits, fp16 11, int8 weights ~7). A bf16
# logit of 10 is only resolved to 0.04, so a fixed 0.05 failed every bf16 artifact with
# logits above ~12. float32 keeps the parity bound.
RELATIVE_TOLERANCES = {
    "float32": 1e-3,
    "float16": 32 * 2.0**-11,
    "bfloat16": 32 * 2.0**-8,
    "int8": 32 * 2.0**-7,
}


def tolerance_for(numerics: str, reference_logits: torch.Tensor) -> float:
    """The largest logit difference logit-matching accepts (see RELATIVE_TOLERANCES)."""
    scale = max(1.0, float(reference_logits.abs().max()))
    return RELATIVE_TOLERANCES.get(numerics, 1e-3) * scale


@dataclass(frozen=True)
class AccuracyResult:
    """What `--check-accuracy` found; `passed` decides the exit code."""

    mode: str
    passed: bool
    numerics: str  # "float32" | "bfloat16" | "float16" | "int8": what the tolerance is for
    reference: str
    prompt_tokens: int
    new_tokens: int
    tokens_matched: int  # generated tokens identical to the reference before the first miss
    token_agreement: float  # fraction of steps whose greedy token agrees
    first_divergence: int | None
    max_logit_diff: float
    tolerance: float
    artifact_tokens: list[int]
    reference_tokens: list[int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        tokens = f"{self.tokens_matched}/{self.new_tokens} tokens match"
        if self.first_divergence is not None:
            tokens += f" (first divergence at step {self.first_divergence})"
        return (
            f"accuracy {verdict} ({self.mode}, {self.numerics} vs {self.reference}): {tokens};"
            f" max logit difference {self.max_logit_diff:.4g} (tolerance {self.tolerance:.4g})"
        )


def check_accuracy(
    artifact_path: Path,
    checkpoint_path: Path,
    mode: str = "token-matching",
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 32,
    tolerance: float | None = None,
) -> AccuracyResult:
    """Run both on `prompt`; return the comparison (see module doc)."""
    from neuronctl.backends import get_backend
    from neuronctl.store.manifest import read_manifest

    if mode not in MODES:
        raise UsageError(f"unknown accuracy mode {mode!r}", "use " + " or ".join(MODES))
    manifest = read_manifest(artifact_path)
    runner = get_backend(manifest.backend).load(artifact_path, manifest)
    spec = manifest.spec
    numerics = "int8" if spec.quantized else str(spec.dtype)
    prompt_ids = _encode(artifact_path, prompt)
    if len(prompt_ids) > max(runner.context_buckets):
        raise UsageError(
            f"the prompt has {len(prompt_ids)} tokens, more than the largest context bucket "
            f"{max(runner.context_buckets)}", "use a shorter --prompt",
        )
    steps = max(1, min(max_new_tokens, runner.seq_len - len(prompt_ids)))
    got_tokens, got_logits = _generate_artifact(runner, prompt_ids, steps)
    model = _reference_model(checkpoint_path, "float32")
    ref_tokens = _generate_reference(model, prompt_ids, steps)
    ref_logits = _teacher_forced(model, prompt_ids + got_tokens[:-1])[len(prompt_ids) - 1:]
    matched = _common_prefix(got_tokens, ref_tokens)
    max_diff = float((got_logits - ref_logits).abs().max())
    tol = tolerance_for(numerics, ref_logits) if tolerance is None else tolerance
    passed = matched == steps if mode == "token-matching" else max_diff <= tol
    return AccuracyResult(
        mode=mode,
        passed=passed,
        numerics=numerics,
        reference="transformers float32",
        prompt_tokens=len(prompt_ids),
        new_tokens=steps,
        tokens_matched=matched,
        token_agreement=sum(map(int.__eq__, got_tokens, ref_tokens)) / steps,
        first_divergence=None if matched == steps else matched,
        max_logit_diff=max_diff,
        tolerance=tol,
        artifact_tokens=got_tokens,
        reference_tokens=ref_tokens,
    )


def _encode(artifact_path: Path, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(artifact_path)
    ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise UsageError("the prompt encodes to no tokens", "give a non-empty --prompt")
    return ids


def _generate_artifact(
    runner: Any, prompt: list[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    slots = runner.batch_size
    logits = runner.prefill(0, prompt)
    tokens, rows = [], []
    for step in range(steps):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        if step + 1 < steps:
            position = len(prompt) + step
            logits = runner.decode([tokens[-1]] + [0] * (slots - 1),
                                   [position] + [-1] * (slots - 1))[0]
    return tokens, torch.stack(rows).float()


def _reference_model(checkpoint_path: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_path, dtype=getattr(torch, dtype))
    return model.eval()


@torch.no_grad()
def _generate_reference(model: Any, prompt: list[int], steps: int) -> list[int]:
    # A plain greedy loop: generate() would stop at EOS or mask it, the artifact does neither.
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens


@torch.no_grad()
def _teacher_forced(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
