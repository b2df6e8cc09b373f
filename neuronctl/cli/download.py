"""`neuronctl download MODEL_ID`: a Hub snapshot pinned to a commit sha, safetensors preferred."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from neuronctl.cli._common import JsonOpt, RevisionOpt, console, human_size, print_json

ORDER = 10
_NO_DEFAULT: dict[str, Any] = {"show_default": False}

IncludeOpt = Annotated[
    list[str] | None,
    typer.Option("--include", help="Only files matching this glob (repeatable).", **_NO_DEFAULT),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option("--exclude", help="Skip files matching this glob (repeatable).", **_NO_DEFAULT),
]
LocalDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--local-dir",
        help="Put the files in this directory instead of the Hugging Face cache.",
        show_default=False,
    ),
]


def download_command(
    model_id: Annotated[str, typer.Argument(help="Hugging Face Hub id, e.g. org/model.")],
    revision: RevisionOpt = None,
    local_dir: LocalDirOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Download a model from the Hugging Face Hub, pinned to the commit REV resolves to.

    Safetensors preferred: *.bin, *.pth, original/, consolidated* skipped when it has them.

    config.json, generation_config.json and tokenizer files are always downloaded.

    Gated models need HF_TOKEN. HF_HUB_OFFLINE=1 uses the local cache only.

    Examples:

      neuronctl download meta-llama/Llama-3.2-1B --revision main

      neuronctl download Qwen/Qwen2.5-0.5B --local-dir ./qwen --exclude '*.gguf' --json

    Exit codes: 0 ok, 1 not found / gated / network error, 2 usage error.
    """
    from neuronctl.checkpoints.hub import download

    result = download(
        model_id,
        revision,
        local_dir=local_dir,
        include=include or (),
        exclude=exclude or (),
        show_progress=not json_out,
    )
    size = sum((result.path / f).stat().st_size for f in result.files if (result.path / f).exists())
    if json_out:
        print_json(
            {
                "model": result.repo_id,
                "revision": result.revision,
                "sha": result.sha,
                "path": str(result.path),
                "files": result.files,
                "size_bytes": size,
            }
        )
        return
    console.print(
        f"{result.repo_id} @ {result.sha} ({len(result.files)} files, {human_size(size)})"
    )
    console.print(str(result.path))


def register(app: typer.Typer) -> None:
    app.command("download")(download_command)
