"""compile --check-accuracy's core: an artifact against transformers on the same prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuronctl.backends.torch.accuracy import check_accuracy
from neuronctl.build import compile_model, resolve_build
from neuronctl.errors import UsageError
from tests.conftest import TINY_SPEC
from tests.helpers import make_checkpoint


@pytest.mark.parametrize("mode", ["token-matching", "logit-matching"])
def test_a_faithful_artifact_passes(compiled_artifact: Path, tiny_llama: Path, mode: str) -> None:
    report = check_accuracy(compiled_artifact, tiny_llama, mode, max_new_tokens=16)
    assert report.passed, report
    assert report.tokens_matched == report.new_tokens == 16
    assert report.artifact_tokens == report.reference_tokens
    assert report.max_logit_diff < 1e-4
    assert report.as_dict()["numerics"] == "float32"
    assert report.summary().startswith("accuracy passed")


def test_other_weights_fail_both_modes(compiled_artifact: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "other", "llama", seed=3)
    tokens = check_accuracy(compiled_artifact, other, "token-matching", max_new_tokens=16)
    logits = check_accuracy(compiled_artifact, other, "logit-matching", max_new_tokens=16)
    assert not tokens.passed and tokens.first_divergence is not None
    assert not logits.passed and logits.max_logit_diff > logits.tolerance
    assert "FAILED" in logits.summary()


def test_bf16_and_int8_artifacts_pass_logit_matching_at_their_resolution(
    tiny_llama: Path, tmp_path: Path
) -> None:
    # A fixed 0.05 was below bf16 resolution for logits above ~12; the tolerance now scales
    # with the logits and the artifact's numerics, and the reference is float32.
    for overrides, numerics in (({"dtype": "bfloat16"}, "bfloat16"),
                                ({"quantized": True}, "int8")):
        # one slot, one bucket each: 2 graphs; the check prefills and decodes slot 0
        spec = {**TINY_SPEC, "batch_size": 1, "context_buckets": "64",
                "token_gen_buckets": "128", **overrides}
        path = compile_model(resolve_build(str(tiny_llama), spec, store_dir=tmp_path),
                             jobs=1).path  # in this process: no spawn pool to start
        report = check_accuracy(path, tiny_llama, "logit-matching", max_new_tokens=16)
        assert report.numerics == numerics
        assert report.passed, report.summary()
        assert 0 < report.max_logit_diff <= report.tolerance < 1.0


def test_unknown_mode_and_overlong_prompt_are_usage_errors(
    compiled_artifact: Path, tiny_llama: Path
) -> None:
    with pytest.raises(UsageError, match="accuracy mode"):
        check_accuracy(compiled_artifact, tiny_llama, "vibes")
    with pytest.raises(UsageError, match="largest context bucket"):
        check_accuracy(compiled_artifact, tiny_llama, prompt="x" * 100)
