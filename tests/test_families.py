"""neuronctl/families.py is the one table of model families: what else lists families is read
from it or checked against it here (docs/checkpoints.md in tests/test_docs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuronctl.backends import get_backend
from neuronctl.backends.torch.config import args_from_config
from neuronctl.families import BY_ARCHITECTURE, FAMILIES, architectures, model_types
from neuronctl.spec import BACKENDS
from tests.helpers import make_checkpoint


def test_every_row_names_known_backends_once() -> None:
    assert len(BY_ARCHITECTURE) == len(FAMILIES)
    for family in FAMILIES:
        assert family.builds and set(family.builds) <= set(BACKENDS), family.architecture


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_builds_what_the_table_says(backend: str) -> None:
    assert dict(get_backend(backend).architectures()) == architectures(backend)


def test_the_neuron_backends_have_a_class_for_each_of_their_model_types() -> None:
    """NxD Inference and Transformers NeuronX pick a model class by model_type: each of
    their families has one, and no class is kept for a family the table does not list."""
    from neuronctl.backends.nxdi.sdk import MODEL_CLASSES, MOE_MODEL_TYPES
    from neuronctl.backends.tnx.config import MODEL_TYPES

    assert set(MODEL_CLASSES) == set(model_types("nxdi"))
    assert MOE_MODEL_TYPES == {f.model_type for f in FAMILIES if f.moe}
    assert set(MODEL_TYPES) == set(model_types("tnx"))


def test_the_parity_tests_cover_every_torch_family() -> None:
    from tests.test_torch_parity import ARCHS

    assert set(ARCHS) == set(model_types("torch"))


@pytest.mark.parametrize("model_type", model_types("torch"))
def test_a_test_checkpoint_of_each_torch_family_is_that_family(
    model_type: str, tmp_path: Path
) -> None:
    """make_checkpoint writes each torch family by its model_type (transformers' own config
    class): its config.json names the table's architecture, and the modeling reads the
    family's traits from the table."""
    out = make_checkpoint(tmp_path, model_type, tokenizer=False)
    config = json.loads((out / "config.json").read_text())
    family = BY_ARCHITECTURE[config["architectures"][0]]
    assert family.model_type == config["model_type"] == model_type
    args = args_from_config(config)
    assert args.qkv_bias == family.qkv_bias
