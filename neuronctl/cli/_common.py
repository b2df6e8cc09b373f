"""What every command shares: option types declared once, output for people and for machines.

Commands are thin: parse, call the core, render. A command module exposes `register(app)`;
`neuronctl.cli.main` discovers the modules of this package and calls it.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from neuronctl.cli._table import Col, print_rows
from neuronctl.cli._typer_internals import ParameterSource

if TYPE_CHECKING:
    from neuronctl.store.signing import Vouch

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
UNWRAPPED = 1_000_000  # the width a table is laid out for where lines are not wrapped


def wraps(c: Console) -> bool:
    """Whether output to `c` is wrapped to a width: on a terminal, or where one was asked for
    (COLUMNS). In a pipe or a log it is not: rich's default of 80 columns broke lines inside
    a command, a URL or a path, which then could not be pasted."""
    return c.is_terminal or c._width is not None


def unwrap_when_piped() -> None:
    """At start-up: no console wraps what it prints where `wraps` says it should not."""
    for c in (console, err_console):
        c.soft_wrap = not wraps(c)

ENGINES = ("builtin", "vllm")  # serve's and generate's --engine
REMOTE_ENV = "NEURONCTL_REMOTE"  # the default remote store of every command that takes one

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document for machines.")]
StoreOpt = Annotated[
    Path | None,
    typer.Option(
        "--store",
        help="Artifact store: its root or its neuron-compiled-artifacts directory "
        "(default: $NEURONCTL_STORE, else ~/.cache/neuronctl).",
        show_default=False,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="A neuronctl.toml with spec fields.", show_default=False),
]
ArtifactsOpt = Annotated[
    str | None,
    typer.Option(
        "--artifacts",
        envvar="NEURON_COMPILED_ARTIFACTS",
        help="The ARTIFACT argument's older spelling (default: $NEURON_COMPILED_ARTIFACTS).",
        show_default=False,
    ),
]
# For a command that deletes: the alias, without the variable's default (a variable left set
# in a shell must not pick what is removed).
ArtifactsNoEnvOpt = Annotated[
    str | None,
    typer.Option("--artifacts", help="The ARTIFACT argument's older spelling.", show_default=False),
]
ArtifactArg = Annotated[
    str | None,
    typer.Argument(
        help="Artifact: KEY, unique key prefix, PATH or URL/KEY (default: --artifacts, else "
        "$NEURON_COMPILED_ARTIFACTS).",
        metavar="ARTIFACT",
        show_default=False,
    ),
]


def one_artifact(ctx: typer.Context, artifact: str | None, artifacts: str | None) -> str | None:
    """Every command names its artifact as its first argument; `--artifacts` stays for the
    scripts that use it. Both on the command line, naming different ones, is a mistake."""
    if artifact is None:
        return artifacts
    given = ctx.get_parameter_source("artifacts") is ParameterSource.COMMANDLINE
    if given and artifacts != artifact:
        from neuronctl.errors import UsageError

        raise UsageError(
            f"two artifacts given: {artifact} and --artifacts {artifacts}", "name one"
        )
    return artifact


TrustKeyOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--trust-key",
        help="Trust signatures by this public key (.pub); repeat for several. Also "
        "$NEURONCTL_TRUSTED_KEYS and ~/.config/neuronctl/trusted-keys/*.pub.",
        show_default=False,
    ),
]
AllowUnsignedOpt = Annotated[
    bool,
    typer.Option(
        "--allow-unsigned",
        help="Load an artifact that neither a local build in your store nor a trusted signature "
        "vouches for (its code runs here unverified); needed at every use.",
    ),
]
SignKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--sign-key",
        help="Sign what is pushed with this private key (default: $NEURONCTL_SIGNING_KEY, a "
        "path or the PEM text).",
        show_default=False,
    ),
]
ModelArg = Annotated[str, typer.Argument(help="Hugging Face Hub id or local checkpoint directory.")]
RevisionOpt = Annotated[
    str | None,
    typer.Option("--revision", help="Hub branch, tag or commit sha.", show_default=False),
]

_SPEC = "Build spec"


def _opt(flag: str, help: str, **kw: Any) -> Any:
    return typer.Option(flag, help=help, rich_help_panel=_SPEC, show_default=False, **kw)


# The spec flags, declared once. Each maps to the BuildSpec field of the same name; a flag
# left unset (None) lets the file, the environment or the default decide.
SPEC_OPTIONS: dict[str, tuple[Any, Any]] = {
    "backend": (str | None, _opt("--backend", "torch | nxdi | tnx (default torch).")),
    "tp_degree": (int | None, _opt("--tp-degree", "Tensor-parallel degree (default 1).")),
    "batch_size": (int | None, _opt("--batch-size", "Max concurrent sequences (default 1).")),
    "seq_len": (int | None, _opt("--seq-len", "Max model length, prompt + output (default 128).")),
    "max_context_length": (
        int | None,
        _opt("--max-context-length", "Longest prompt (default: seq len)."),
    ),
    "dtype": (
        str | None,
        _opt("--dtype", "bfloat16 | float16 | float32 | auto (default auto; vLLM's half and "
                        "float, and bf16, fp16 accepted)."),
    ),
    "context_buckets": (
        str | None,
        _opt("--context-buckets", "Context-encoding buckets, e.g. 64,128, or auto (default auto)."),
    ),
    "token_gen_buckets": (
        str | None,
        _opt(
            "--token-gen-buckets", "Token-generation buckets, e.g. 128,256, or auto (default auto)."
        ),
    ),
    "compiler": (
        str | None,
        _opt("--compiler", "torch backend: inductor | export (default inductor)."),
    ),
    "override_neuron_config": (
        str | None,
        _opt("--override-neuron-config", "JSON object merged into the Neuron config."),
    ),
    "on_device_sampling": (
        str | None,
        _opt(
            "--on-device-sampling",
            'JSON, e.g. {"do_sample": true, "top_k": 50}, or off. nxdi default: '
            '{"dynamic": true} (what vLLM compiles itself).',
        ),
    ),
    "quantized": (
        bool | None,
        _opt("--quantized/--no-quantized", "Quantize weights (default off)."),
    ),
    "quantization_dtype": (
        str | None,
        _opt("--quantization-dtype", "int8 | f8e4m3 (default int8; s8, f8e4m3fn accepted)."),
    ),
    "quantization_type": (
        str | None,
        _opt(
            "--quantization-type",
            "per_tensor_symmetric | per_channel_symmetric (default per_tensor_symmetric).",
        ),
    ),
    "draft_model": (str | None, _opt("--draft-model", "Draft model for speculation.")),
    "num_speculative_tokens": (
        int | None,
        _opt("--num-speculative-tokens", "Tokens proposed per speculation step (default 0)."),
    ),
}


def with_spec_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add every spec flag to a command; it receives them as one dict `spec_flags`."""
    sig = inspect.signature(func)
    # Resolve string annotations (from __future__) in the command's own module: typer reads
    # the wrapper, whose globals are this module's.
    hints = typing.get_type_hints(func, include_extras=True)
    params = [
        p.replace(annotation=hints.get(name, p.annotation))
        for name, p in sig.parameters.items()
        if name != "spec_flags"
    ]
    for name, (annotation, option) in SPEC_OPTIONS.items():
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=Annotated[annotation, option],
                default=None,
            )
        )

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in SPEC_OPTIONS}
        sampling = flags.get("on_device_sampling")
        from neuronctl.spec import SAMPLING_OFF

        if isinstance(sampling, str) and sampling.strip().lower() not in SAMPLING_OFF:
            flags["on_device_sampling"] = _json_flag("--on-device-sampling", sampling)
        return func(spec_flags=flags, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def _json_flag(flag: str, text: str) -> Any:
    from neuronctl.spec import parse_json_object

    return parse_json_object(text, flag)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def print_table(
    title: str | None, columns: Sequence[str | Col], rows: Sequence[Sequence[Any]]
) -> None:
    """A borderless table that fits the terminal with every key and path whole (cli/_table.py);
    the title (often a path) on its own line above it, never wrapped."""
    if title:
        console.print(title, style="bold", soft_wrap=True, markup=False)
    budget = console.width if wraps(console) else UNWRAPPED
    print_rows(console, [c if isinstance(c, Col) else Col(c) for c in columns], rows, budget)


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def say_vouch(vouch: Vouch | None) -> None:
    """One stderr line: who vouches for the code about to be loaded."""
    if vouch is None:
        return
    from neuronctl.store.signing import UNSIGNED

    if vouch.kind == UNSIGNED:  # not "trusted": nothing vouches for it
        err_console.print(f"[yellow]artifact {vouch.describe()}[/yellow]", soft_wrap=True)
        return
    err_console.print(f"[dim]artifact trusted: {vouch.describe()}[/dim]", soft_wrap=True)
