"""`neuronctl inspect MODEL`: what a checkpoint is and how it can be built."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from neuronctl.cli._common import (
    ArtifactsOpt,
    JsonOpt,
    RevisionOpt,
    StoreOpt,
    console,
    human_size,
    one_artifact,
    print_json,
    print_table,
)
from neuronctl.store.manifest import Manifest, read_manifest

ORDER = 15

AllowPickleOpt = Annotated[
    bool,
    typer.Option("--allow-pickle", help="Read pickle (*.bin) weights; only for trusted files."),
]


def inspect_command(
    ctx: typer.Context,
    model: str | None = typer.Argument(
        None,
        help="Hub id or checkpoint directory; or an artifact: KEY, unique key prefix, PATH "
        "(a directory with a manifest.json) or URL/KEY once pulled.",
        metavar="MODEL|ARTIFACT",
        show_default=False,
    ),
    artifacts: ArtifactsOpt = None,
    revision: RevisionOpt = None,
    allow_pickle: AllowPickleOpt = False,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show a checkpoint's architecture, size, dtype, supported backends and tp degrees;
    or an artifact's matmul paths (what each row count runs, what each candidate measured).

    A Hub id is downloaded first (or read from the cache with HF_HUB_OFFLINE=1). An artifact
    is named as every command names one: a key or unique prefix of the store (a bare name
    is never a directory of the working directory: write ./NAME for that), a path to a
    directory with a manifest.json, a URL once pulled, or --artifacts.

    Examples:

      neuronctl inspect ./Llama-3.2-1B

      neuronctl inspect meta-llama/Llama-3.2-1B --json

      neuronctl inspect 3f9a2c41

    Exit codes: 0 ok, 1 unreadable or unsupported checkpoint, 2 usage error.
    """
    from neuronctl.checkpoints import open_checkpoint
    from neuronctl.checkpoints.summary import summarize
    from neuronctl.store.resolve import artifact_or_checkpoint, resolve_artifact

    if model is None:  # --artifacts or $NEURON_COMPILED_ARTIFACTS, else resolve says what to do
        artifact: Path | None = resolve_artifact(artifacts, store, fetch=False)
    else:
        one_artifact(ctx, model, artifacts)
        artifact = artifact_or_checkpoint(model, store)
    if artifact is not None:
        show_artifact(artifact, read_manifest(artifact), json_out)
        return
    assert model is not None
    info = summarize(open_checkpoint(model, revision, allow_pickle=allow_pickle))
    if json_out:
        print_json(info)
        return
    rows = [
        ("architecture", info["architecture"]),
        ("parameters", f"{info['parameters']:,}"),
        ("dtype", info["dtype"] or "unknown"),
        ("size on disk", f"{human_size(info['size_bytes'])} in {info['weight_files']} file(s)"),
        ("layers / hidden", f"{info['num_layers']} / {info['hidden_size']}"),
        ("heads / KV heads", f"{info['num_attention_heads']} / {info['num_key_value_heads']}"),
        ("vocab", info["vocab_size"]),
        ("max positions", info["max_position_embeddings"]),
        ("tied embeddings", "yes" if info["tie_word_embeddings"] else "no"),
        ("backends", ", ".join(info["backends"])),
        ("tp degrees", f"{', '.join(map(str, info['tp_degrees']))} (max {info['max_tp_degree']})"),
    ]
    if info["revision"]:
        rows.insert(0, ("revision", info["revision"]))
    console.print(f"[bold]{info['model']}[/bold]")
    print_path_line(info["path"])
    for name, value in rows:
        console.print(f"  {name:<17} {value}")


def op_rows(manifest: Manifest) -> tuple[list[str], list[list[Any]]]:
    """The op-choice table: per row count the path and compute dtype taken and each
    candidate's time."""
    ops = manifest.ops
    assert ops is not None
    candidates = list(dict.fromkeys(path for row in ops.rows for path in row.ms))
    columns = ["rows", "path", "compute", "timed at", *(f"{path} ms" for path in candidates)]
    rows = [[row.rows, row.path, row.compute, row.timed_rows or "-",
             *(f"{row.ms[p]:.3f}" if p in row.ms else "-" for p in candidates)]
            for row in ops.rows]
    return columns, rows


def print_path_line(path: Path | str) -> None:
    """The path whole on one line, past the width if it must be: a path broken over lines
    cannot be pasted back into a command."""
    console.print(f"  {'path':<17} {path}", soft_wrap=True, markup=False, highlight=False)


def show_artifact(path: Path, manifest: Manifest, json_out: bool) -> None:
    from neuronctl.cli.artifacts import dtype_label

    ops, spec = manifest.ops, manifest.spec
    quantized = spec.quantization_dtype if spec.quantized else None
    if json_out:
        print_json({"artifact": str(path), "backend": manifest.backend, "dtype": spec.dtype,
                    "quantized": quantized, "ops": ops.model_dump(mode="json") if ops else None})
        return
    console.print(f"[bold]{manifest.source.model}[/bold]  ({manifest.backend})")
    print_path_line(path)
    weights = f" ({quantized} weights, computed in {spec.dtype})" if quantized else ""
    console.print(f"  {'dtype':<17} {dtype_label(spec)}{weights}", markup=False)
    if ops is None:
        console.print("  op choice: none (only the torch backend chooses matmul paths)")
        return
    console.print(f"  weights layout    {ops.layout}")
    console.print(f"  chosen by         {ops.chosen_by}")
    print_table("matmul path per row count", *op_rows(manifest))


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_command)
