"""`compile --check-accuracy`: the compiled artifact against Hugging Face transformers on CPU.

The reference is transformers in the artifact's own dtype (bf16 against bf16, fp16 against
fp16; float32 for fp32 and for int8 weights, which transformers cannot run as compiled), run
teacher-forced along the artifact's own tokens, so every step compares the same prefix and one
step's rounding does not change every later one:

- token-matching passes when, at every step, the artifact's greedy token is transformers'
  greedy token, or a near-tie: one transformers scores within the tolerance of its best
  (the dtype's rounding decides those; a free-running comparison called them divergences and
  then compared different prefixes for the rest of the run);
- logit-matching passes when the largest logit difference is within the tolerance.

The prompt is a fixed sentence, cut to the artifact's longest context when it is shorter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from neuronctl.backends.torch import TorchBackend
from neuronctl.errors import UsageError
from neuronctl.store.manifest import read_manifest

MODES = ("token-matching", "logit-matching")
DEFAULT_PROMPT = "I believe the meaning of life is"
# The tolerance relative to the largest reference logit (never below 1.0), by the
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
    criterion: str  # what `passed` means, in words
    prompt_tokens: int
    new_tokens: int
    tokens_matched: int  # steps whose greedy token agrees (exactly or as a near-tie)
    exact_matches: int  # steps whose greedy token is transformers' own
    token_agreement: float  # tokens_matched / new_tokens
    first_divergence: int | None  # the first step that does not agree
    max_logit_diff: float
    tolerance: float
    artifact_tokens: list[int]
    reference_tokens: list[int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        tokens = f"{self.tokens_matched}/{self.new_tokens} tokens agree"
        if self.first_divergence is not None:
            tokens += f" (first divergence at step {self.first_divergence})"
        return (
            f"accuracy {verdict} ({self.criterion}): {tokens};"
            f" max logit difference {self.max_logit_diff:.4g} (tolerance {self.tolerance:.4g})"
        )


def compare_with_transformers(
    artifact_path: Path,
    checkpoint_path: Path,
    mode: str = "token-matching",
    prompt: str | None = None,
    max_new_tokens: int = 32,
    tolerance: float | None = None,
) -> AccuracyResult:
    """Run both on `prompt` (None: DEFAULT_PROMPT, cut to the artifact's longest context);
    return the comparison (see module doc)."""
    if mode not in MODES:
        raise UsageError(f"unknown accuracy mode {mode!r}", "use " + " or ".join(MODES))
    manifest = read_manifest(artifact_path)
    if manifest.backend != "torch":
        raise UsageError(f"{artifact_path} is a {manifest.backend} artifact; --check-accuracy "
                         "runs torch artifacts here", "on Neuron use inference_demo")
    runner = TorchBackend().load(artifact_path, manifest)
    spec = manifest.spec
    numerics = "int8" if spec.quantized else str(spec.dtype)
    longest = min(runner.max_context_length, max(runner.context_buckets), runner.seq_len - 1)
    prompt_ids = _encode(artifact_path, prompt or DEFAULT_PROMPT)
    if len(prompt_ids) > longest:
        if prompt is not None:
            raise UsageError(
                f"the prompt has {len(prompt_ids)} tokens; this artifact takes {longest}",
                "give a shorter prompt",
            )
        prompt_ids = prompt_ids[: max(1, longest)]  # the fixed sentence, cut to fit
    steps = max(1, min(max_new_tokens, runner.seq_len - len(prompt_ids)))
    got_tokens, got_logits = _generate_artifact(runner, prompt_ids, steps)
    reference_dtype = REFERENCE_DTYPES.get(numerics, "float32")
    model = _reference_model(checkpoint_path, reference_dtype)
    ref_logits = _teacher_forced(model, prompt_ids + got_tokens[:-1])[len(prompt_ids) - 1:]
    max_diff = float((got_logits - ref_logits).abs().max())
    tol = tolerance_for(numerics, ref_logits) if tolerance is None else tolerance
    ref_tokens = [int(row.argmax()) for row in ref_logits]
    agree = [_agrees(row, got, tol) for row, got in zip(ref_logits, got_tokens, strict=True)]
    first = agree.index(False) if False in agree else None
    passed = first is None if mode == "token-matching" else max_diff <= tol
    return AccuracyResult(
        mode=mode,
        passed=passed,
        numerics=numerics,
        reference=f"transformers {reference_dtype}",
        criterion=_criterion(mode, numerics, reference_dtype),
        prompt_tokens=len(prompt_ids),
        new_tokens=steps,
        tokens_matched=sum(agree),
        exact_matches=sum(map(int.__eq__, got_tokens, ref_tokens)),
        token_agreement=sum(agree) / steps,
        first_divergence=first,
        max_logit_diff=max_diff,
        tolerance=tol,
        artifact_tokens=got_tokens,
        reference_tokens=ref_tokens,
    )


# transformers runs the artifact's own dtype; int8 weights dequantize to float32 here.
REFERENCE_DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}


def _agrees(reference: torch.Tensor, token: int, tolerance: float) -> bool:
    """The artifact's greedy token is the reference's, or one the reference scores within
    `tolerance` of its best: a tie at this precision, which rounding decides."""
    return float(reference.max() - reference[token]) <= tolerance


def _criterion(mode: str, numerics: str, reference_dtype: str) -> str:
    against = f"{numerics} artifact vs transformers {reference_dtype}, same prefix each step"
    if mode == "token-matching":
        return f"token-matching: every greedy token equal or a near-tie; {against}"
    return f"logit-matching: max logit difference within tolerance; {against}"


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' and the Hub's progress bars and warnings are not this command's output."""
    import warnings

    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_bars_off = hub.are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hub.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            hub.enable_progress_bars()


def _encode(artifact_path: Path, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    with _quiet_transformers():
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

    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(checkpoint_path, dtype=getattr(torch, dtype))
    return model.eval()


@torch.no_grad()
def _teacher_forced(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()
