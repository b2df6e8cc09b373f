"""`neuronctl hash`: the keys `compile` would use, without compiling (CI cache keys)."""

from __future__ import annotations

from typing import Any

import typer

from neuronctl.build import resolve_build
from neuronctl.cli._common import (
    ConfigOpt,
    JsonOpt,
    RevisionOpt,
    StoreOpt,
    console,
    print_json,
    with_spec_options,
)

ORDER = 25


@with_spec_options
def hash_command(
    spec_flags: dict[str, Any],
    model: str | None = typer.Argument(None, help="Hub id or local checkpoint directory."),
    revision: RevisionOpt = None,
    config: ConfigOpt = None,
    store: StoreOpt = None,
    rehash: bool = typer.Option(False, "--rehash", help="Re-read every weight file."),
    vllm: bool = typer.Option(
        False,
        "--vllm",
        help="Also print the directory vLLM 0.9 (generation B) would recompile into, "
        "<model>/neuron-compiled-artifacts/<md5>, or why there is none; and that there is "
        "no such name for vllm-neuron (generation C).",
    ),
    json_out: JsonOpt = False,
) -> None:
    """Print the graph, weights and artifact keys for a model and spec.

    Example: neuronctl hash ./Llama-3.2-1B --tp-degree 2 --seq-len 2048 --json
    """
    build = resolve_build(
        model, spec_flags, config, revision=revision, store_dir=store, rehash=rehash
    )
    data: dict[str, Any] = {**build.keys.as_dict(), "path": str(build.path)}
    if vllm:
        data.update(_vllm_dirname(build.spec, build.checkpoint.config))
    if json_out:
        print_json(data)
        return
    width = max(len(k) for k in data)
    for name, value in data.items():  # whole values, never cut: they are meant to be copied
        console.print(f"{name:<{width}}  {value}", soft_wrap=True)


def _vllm_dirname(spec: Any, config: Any) -> dict[str, Any]:
    """The `<model>/neuron-compiled-artifacts/<md5>` name vLLM B computes for `--model
    spec.model` (where it recompiles when NEURON_COMPILED_ARTIFACTS is unset), or why none."""
    from neuronctl.vllm.dirname import no_vllm_dirname, vllm_dirname_exact

    plugin = {"vllm_dirname_plugin": None, "vllm_dirname_plugin_note": PLUGIN_NOTE}
    why = no_vllm_dirname(spec)
    if why:
        return {"vllm_dirname": None, "vllm_dirname_note": why, **plugin}
    name, exact = vllm_dirname_exact(spec, config)
    note = (
        "exact for vLLM 0.9 (generation B) given --model " + str(spec.model)
        if exact
        else "approximate: exact only with NxD Inference installed and a local --model"
    )
    return {"vllm_dirname": name, "vllm_dirname_note": note, **plugin}


# vllm-neuron builds its config from its own defaults (its loader's _load_weights_common) and
# neuronctl's launch always sets NEURON_COMPILED_ARTIFACTS, so no default path is computed.
PLUGIN_NOTE = (
    "none for vllm-neuron (generation C): it hashes a config built from its own defaults, "
    "which neuronctl does not reproduce, and neuronctl always launches it with "
    "NEURON_COMPILED_ARTIFACTS set, so that default path is never used"
)


def register(app: typer.Typer) -> None:
    app.command("hash")(hash_command)
