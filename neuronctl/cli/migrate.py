"""`neuronctl config migrate`: a Transformers NeuronX override_neuron_config -> NxD Inference."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from neuronctl.cli._common import JsonOpt, console, err_console, print_json, print_table
from neuronctl.cli._groups import config_app
from neuronctl.errors import UsageError

HELP = (
    "Turn a Transformers NeuronX override_neuron_config into NxD Inference's.\n\n"
    "Follows every row of the AWS guide 'Migrating from Transformers NeuronX to NxD Inference' "
    "(Neuron Config Migration table): sub-config keys such as quant.quant_dtype and "
    "continuous_batching.max_num_seqs included, and every other key the TNx NeuronConfig "
    "accepts. Values are translated (s8 -> int8, f8e4m3fn -> f8e4m3, vector_dynamic -> "
    "per_channel_symmetric); a sub-config given at all, even {}, maps to the NxD Inference "
    "switch it stands for (quant -> quantized + quantized_checkpoints_path). Every setting "
    "made is listed as mapped, every key with no NxD Inference equivalent as dropped, with the "
    "guide's note; an unknown key or a value TNx rejects is an error. Last it prints the "
    "neuronctl flags for the same build: the spec's own flags (--batch-size, --quantized, "
    "...) for what the spec owns, --override-neuron-config for the rest, ready for "
    "`neuronctl compile` or `neuronctl hash`.\n\n"
    "SOURCE is a JSON object, vLLM's key:value,key:value form, a file holding either, or - "
    "(stdin, the default).\n\n"
    "Examples:\n\n"
    "  neuronctl config migrate '{\"fuse_qkv\": true, \"quant\": {\"quant_dtype\": \"s8\"}}' "
    "--from tnx\n\n"
    "  neuronctl config migrate tnx_override.json --from tnx --json\n\n"
    "  neuronctl config migrate 'shard_over_sequence:True' --from tnx\n\n"
    "Exit codes: 0 ok, 2 unknown key or value, unreadable input or unsupported --from."
)


def read_source(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    stripped = source.strip()
    if stripped.startswith("{") or (":" in stripped and not Path(source).exists()):
        return source
    path = Path(source)
    if not path.is_file():
        raise UsageError(f"{source} is neither a file nor a JSON object")
    return path.read_text()


@config_app.command("migrate", help=HELP)
def migrate_command(
    source: Annotated[
        str, typer.Argument(help="FILE, JSON object, key:value pairs, or - for stdin.")
    ] = "-",
    from_: Annotated[
        str, typer.Option("--from", help="The library the config is written for: tnx.")
    ] = "tnx",
    quantized_checkpoints_path: Annotated[
        str,
        typer.Option(
            "--quantized-checkpoints-path",
            help="Where NxD Inference keeps (or writes) the quantized checkpoint, when the "
            "config quantizes.",
        ),
    ] = "quantized_checkpoint",
    json_out: JsonOpt = False,
) -> None:
    from neuronctl.migrate import migrate_tnx, parse_override

    if from_ != "tnx":
        raise UsageError(f"cannot migrate from {from_!r}", "only --from tnx is supported")
    result = migrate_tnx(parse_override(read_source(source)), quantized_checkpoints_path)
    if json_out:
        print_json(result.as_dict())
        return
    entries = [(m["tnx"], m["nxdi"], m["value"], m["note"]) for m in result.mapped]
    entries += [(d["tnx"], "dropped", d["value"], d["note"]) for d in result.dropped]
    # Each note once, below the table, by number: in a column, a note repeated on every row
    # its key maps to made the table 135 columns wide.
    notes_by_text: dict[str, int] = {}
    rows = []
    for tnx, nxdi, value, note in entries:
        ref = f"[{notes_by_text.setdefault(note, len(notes_by_text) + 1)}]" if note else ""
        rows.append([tnx, nxdi, json.dumps(value), ref])
    print_table("Transformers NeuronX -> NxD Inference", ["TNx", "NxDI", "value", "note"], rows)
    for text, number in notes_by_text.items():
        console.print(f"[{number}] {text}", markup=False)
    console.print("override_neuron_config for NxD Inference:")
    typer.echo(json.dumps(result.nxdi, indent=2, sort_keys=True))
    _spec, _override, notes = result.for_neuronctl()
    console.print("neuronctl compile / hash flags (the spec's own, the rest as an override):")
    typer.echo(shlex.join(result.neuronctl_flags()))
    for note in notes:
        err_console.print(f"note: {note}", soft_wrap=True, markup=False)


def register(app: typer.Typer) -> None:
    """The command lives on config_app, which cli/config.py registers."""
