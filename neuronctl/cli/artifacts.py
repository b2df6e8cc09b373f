"""`neuronctl artifacts list | show | rm | gc` over a local store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from neuronctl.cli._common import (
    ArtifactArg,
    ArtifactsNoEnvOpt,
    ArtifactsOpt,
    JsonOpt,
    StoreOpt,
    console,
    human_size,
    one_artifact,
    print_json,
    print_table,
)
from neuronctl.cli._groups import artifacts_app
from neuronctl.cli._table import Col
from neuronctl.errors import NeuronctlError
from neuronctl.spec import BuildSpec
from neuronctl.store.gc import collect, parse_duration, parse_size
from neuronctl.store.lease import unused
from neuronctl.store.local import Store, spelled_as_path
from neuronctl.store.manifest import Manifest, read_manifest
from neuronctl.store.resolve import open_store

ORDER = 40


def summary(path: Path, manifest: Manifest) -> dict[str, Any]:
    spec = manifest.spec
    return {
        "key": path.name,
        "artifact_key": manifest.artifact_key,
        "path": str(path),
        "model": manifest.source.model,
        "backend": manifest.backend,
        "tp_degree": spec.tp_degree,
        "seq_len": spec.seq_len,
        "batch_size": spec.batch_size,
        "dtype": spec.dtype,
        # Quantized weights: the dtype above is what they are dequantized to and computed in.
        "quantized": spec.quantization_dtype if spec.quantized else None,
        "size": manifest.total_size(),
        "created": manifest.created,
    }


@artifacts_app.command("list")
def list_command(
    store: StoreOpt = None,
    no_trunc: bool = typer.Option(
        False, "--no-trunc", help="Print whole keys and model names, every column, at any width."
    ),
    json_out: JsonOpt = False,
) -> None:
    """List the artifacts in a store, one per line.

    As `docker images` does, keys show as their shortest unique prefix of at least 12
    characters (every command takes it); --no-trunc and --json print them whole. On a narrow
    terminal the created column is left out and long model names lose their start, never a
    key.

    Example: neuronctl artifacts list --store /mnt/artifacts
    """
    s = open_store(store)
    found = [(p, m) for p, m in s.iter_artifacts() if m is not None]
    rows = [summary(p, m) for p, m in found]
    if json_out:
        print_json({"store": str(s.artifacts), "artifacts": rows})
        return
    if not rows:
        console.print(f"no artifacts in {s.artifacts}", soft_wrap=True)
        return
    # --no-trunc: the whole artifact key (the directory name is its first 20 characters).
    keys = [m.artifact_key if no_trunc else p.name for p, m in found]
    short = keys if no_trunc else unique_prefixes(keys)
    columns = [
        Col("key"),
        Col("model", trim=0 if no_trunc else 20),
        Col("backend"),
        Col("tp"),
        Col("batch"),
        Col("seq len"),
        Col("dtype"),
        Col("size"),
        Col("created", optional=not no_trunc),
    ]
    cells = [
        [
            key,
            r["model"],
            r["backend"],
            r["tp_degree"],
            r["batch_size"],
            r["seq_len"],
            dtype_label(manifest.spec),
            human_size(float(r["size"])),
            str(r["created"])[:10],  # the day; --json has the time
        ]
        for key, r, (_, manifest) in zip(short, rows, found, strict=True)
    ]
    print_table(str(s.artifacts), columns, cells)


SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def dtype_label(spec: BuildSpec) -> str:
    """The dtype column: `int8/fp32` for int8 weights computed in fp32, else the dtype."""
    short = SHORT_DTYPES.get(spec.dtype, spec.dtype)
    return f"{spec.quantization_dtype}/{short}" if spec.quantized else short
SHORT_KEY = 12  # as `docker images` shows image ids


def unique_prefixes(keys: list[str], least: int = SHORT_KEY) -> list[str]:
    """Each key cut to one length, the shortest of at least `least` that tells them apart."""
    length = least
    while len({k[:length] for k in keys}) < len(set(keys)):
        length += 1
    return [k[:length] for k in keys]


@artifacts_app.command("show")
def show_command(
    ctx: typer.Context,
    artifact: ArtifactArg = None,
    artifacts: ArtifactsOpt = None,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show an artifact's manifest: spec, keys, source, versions and files.

    Example: neuronctl artifacts show 3f9a2c --json
    """
    from neuronctl.store.resolve import resolve_artifact

    path = resolve_artifact(one_artifact(ctx, artifact, artifacts), store, fetch=False)
    manifest = read_manifest(path)
    if json_out:
        print_json({"path": str(path), **manifest.model_dump(mode="json")})
        return
    console.print(f"[bold]{path}[/bold]")
    info = summary(path, manifest)
    info["size"] = human_size(manifest.total_size())
    rows = [[k, v] for k, v in info.items() if k not in ("key", "artifact_key", "path")]
    rows += [[name, value] for name, value in manifest.keys.as_dict().items()]
    rows = [r for r in rows if r[0] != "quantized" or r[1] is not None]
    revision = manifest.source.revision or "- (a local checkpoint: no Hub revision)"
    rows += [["source digest", manifest.source.digest], ["revision", revision]]
    rows += [[f"version {k}", v] for k, v in manifest.backend_versions.items()]
    print_table(None, ["field", "value"], rows)
    files = [[n, human_size(e.size), e.sha256[:16]] for n, e in manifest.files.items()]
    print_table("files", ["file", "size", "sha256"], files)


@artifacts_app.command("rm")
def rm_command(
    ctx: typer.Context,
    artifact: ArtifactArg = None,
    artifacts: ArtifactsNoEnvOpt = None,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Remove one artifact (atomically: it is never seen half-deleted). An artifact a running
    process has loaded (serve, generate, bench) is kept: stop that process first.

    Example: neuronctl artifacts rm 3f9a2c
    """
    key = one_artifact(ctx, artifact, artifacts)
    if not key:
        from neuronctl.errors import UsageError

        raise UsageError("no artifact given", "pass the KEY (or ./PATH) of the one to remove")
    if spelled_as_path(key):  # a path, as the ARTIFACT help says
        path = Path(key).expanduser().absolute()
        s = Store.containing(path)
    else:
        s = open_store(store)
        path = s.find(key)
    with unused(path) as free:
        if not free:
            raise NeuronctlError(
                f"{path.name} is in use by a running process (serve, generate or bench)",
                "stop that process first; `artifacts gc` keeps it too while it runs",
            )
        s.remove(path)
    if json_out:
        print_json({"removed": str(path)})
    else:
        console.print(f"removed {path}")


@artifacts_app.command("gc")
def gc_command(
    store: StoreOpt = None,
    keep_last: int | None = typer.Option(None, "--keep-last", help="Keep the N newest artifacts."),
    older_than: str | None = typer.Option(
        None, "--older-than", help="Remove artifacts created longer ago than this (e.g. 7d, 12h)."
    ),
    max_size: str | None = typer.Option(
        None, "--max-size", help="Remove the oldest artifacts until the store fits (e.g. 50G)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would go; remove nothing."),
    json_out: JsonOpt = False,
) -> None:
    """Remove what killed or failed builds left behind, and artifacts past a policy.

    Example: neuronctl artifacts gc --keep-last 5 --dry-run
    """
    report = collect(
        open_store(store),
        keep_last=keep_last,
        older_than=parse_duration(older_than) if older_than else None,
        max_size=parse_size(max_size) if max_size else None,
        dry_run=dry_run,
    )
    if json_out:
        print_json(report.as_dict())
        return
    verb = "would remove" if dry_run else "removed"
    for path in report.removed:
        console.print(f"{verb} artifact {path}")
    for path in report.leftovers:
        console.print(f"{verb} leftover {path}")
    for path in report.in_use:
        console.print(f"kept artifact {path}: a running process uses it")
    console.print(
        f"{verb} {len(report.removed)} artifacts, {len(report.leftovers)} leftovers, "
        f"{human_size(report.freed_bytes)}"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(artifacts_app, name="artifacts")
