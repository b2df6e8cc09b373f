"""`neuronctl inspect MODEL`: what a checkpoint is and how it can be built."""

from __future__ import annotations

from typing import Annotated

import typer

from neuronctl.cli._common import JsonOpt, ModelArg, RevisionOpt, console, human_size, print_json

ORDER = 15

AllowPickleOpt = Annotated[
    bool,
    typer.Option("--allow-pickle", help="Read pickle (*.bin) weights; only for trusted files."),
]


def inspect_command(
    model: ModelArg,
    revision: RevisionOpt = None,
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Show a checkpoint's architecture, size, dtype, supported backends and tp degrees.

    A Hub id is downloaded first (or read from the cache with HF_HUB_OFFLINE=1).

    Examples:

      neuronctl inspect ./Llama-3.2-1B

      neuronctl inspect meta-llama/Llama-3.2-1B --json

    Exit codes: 0 ok, 1 unreadable or unsupported checkpoint, 2 usage error.
    """
    from neuronctl.checkpoints import open_checkpoint
    from neuronctl.checkpoints.summary import summarize

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
    console.print(f"[bold]{info['model']}[/bold]  {info['path']}")
    for name, value in rows:
        console.print(f"  {name:<17} {value}")


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_command)
