"""`neuronctl compile`: build (or reuse) the artifact for a model and spec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from neuronctl.build import compile_model, compile_with_remote, resolve_build
from neuronctl.cli._common import (
    AllowUnsignedOpt,
    ConfigOpt,
    JsonOpt,
    RevisionOpt,
    SignKeyOpt,
    StoreOpt,
    TrustKeyOpt,
    console,
    print_json,
    with_spec_options,
)
from neuronctl.cli._progress import progress_for
from neuronctl.errors import EXIT_FAILED, UsageError

ORDER = 20
ACCURACY_MODES = ("token-matching", "logit-matching")


@with_spec_options
def compile_command(
    spec_flags: dict[str, Any],
    model: str | None = typer.Argument(
        None, help="Hub id or local checkpoint directory (or `model` in -c FILE)."
    ),
    revision: RevisionOpt = None,
    config: ConfigOpt = None,
    store: StoreOpt = None,
    jobs: int | None = typer.Option(
        None,
        "--jobs",
        "-j",
        help="Parallel compile workers (default: all cores); with --ray, the CPUs of each "
        "task (default: one per bucket).",
    ),
    rehash: bool = typer.Option(
        False, "--rehash", help="Re-read every weight file for the digest."
    ),
    allow_pickle: bool = typer.Option(
        False, "--allow-pickle", help="Accept *.bin checkpoints (loaded with weights_only=True)."
    ),
    check_accuracy: str | None = typer.Option(
        None,
        "--check-accuracy",
        help="After compiling, compare with transformers: token-matching | logit-matching.",
        show_default=False,
    ),
    remote: str | None = typer.Option(
        None,
        "--remote",
        envvar="NEURONCTL_REMOTE",
        help="Remote store (s3://, file://): pull a hit instead of compiling; push after.",
        show_default=False,
    ),
    plan: Path | None = typer.Option(
        None,
        "--plan",
        help="Build one entry of a plan file (--entry), or every entry (--ray); see "
        "`neuronctl plan`.",
        show_default=False,
    ),
    entry: int | None = typer.Option(None, "--entry", help="With --plan: the entry number."),
    ray: str | None = typer.Option(
        None,
        "--ray",
        help="With --plan: build every entry on a Ray cluster, one task each: local (one "
        "in this process), auto, HOST:PORT or ray://HOST:PORT (docs/fleet-orchestrators.md).",
        show_default=False,
    ),
    logs: Path | None = typer.Option(
        None, "--logs", help="With --ray: where each build's log is written (./farm-logs).",
        show_default=False,
    ),
    sign_key: SignKeyOpt = None,
    trust_key: TrustKeyOpt = None,
    allow_unsigned: AllowUnsignedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Compile a model into a content-addressed artifact, or reuse the one that exists.

    Examples:

      neuronctl compile ./tiny-llama --compiler export --seq-len 128 --batch-size 4

      neuronctl compile meta-llama/Llama-3.2-1B -c neuronctl.toml --json

      neuronctl compile --plan builds.toml --entry 0 --remote s3://bucket/artifacts

      neuronctl compile --plan builds.toml --ray auto --remote s3://bucket/artifacts --json

    With --ray: exit 0 when every entry is built or already published, 1 when any failed.
    """
    if check_accuracy is not None and check_accuracy not in ACCURACY_MODES:
        raise UsageError(
            f"--check-accuracy: unknown mode {check_accuracy!r}",
            "use " + " or ".join(ACCURACY_MODES),
        )
    if logs is not None and ray is None:
        raise UsageError("--logs goes with --ray", "e.g. --plan builds.toml --ray auto --logs DIR")
    if ray is not None:
        from neuronctl.cli._farm import FarmRequest, run_farm_command, worker_args

        args = worker_args(rehash=rehash, allow_pickle=allow_pickle,
                           check_accuracy=check_accuracy, trust_key=trust_key,
                           allow_unsigned=allow_unsigned, sign_key=sign_key)  # fmt: skip
        run_farm_command(FarmRequest(ray, plan, entry, model or revision, config, spec_flags,
                                     remote, store, jobs, logs, args, sign_key, json_out))
        return
    if plan is not None or entry is not None:
        model, revision, spec_flags = _from_plan(plan, entry, model, config, spec_flags, revision)
    build = resolve_build(
        model,
        spec_flags,
        config,
        revision=revision,
        store_dir=store,
        rehash=rehash,
        allow_pickle=allow_pickle,
    )
    with progress_for(quiet=json_out) as progress:
        if remote:
            from neuronctl.store.signing import TrustPolicy, load_signer

            policy = TrustPolicy.load(trust_key, allow_unsigned)
            signer = load_signer(sign_key)
            outcome = compile_with_remote(build, remote, progress, jobs, signer, policy)
        else:
            outcome = compile_model(build, progress, jobs)
    data = outcome.as_dict()
    if check_accuracy:
        data["accuracy"] = _check_accuracy(build, outcome.path, check_accuracy)
    if json_out:
        print_json(data)
        _exit_if_inaccurate(data)
        return
    verb = "pulled" if outcome.pulled else "reused" if outcome.cache_hit else "compiled"
    extra = " (graphs reused, weights written again)" if outcome.graphs_reused else ""
    console.print(
        f"[green]{verb}[/green] in {outcome.compile_seconds:.1f} s{extra}: {outcome.path}",
        soft_wrap=True,
    )
    # The 64-character key alone after its label, so 80 columns never split it.
    console.print(f"artifact key {outcome.keys.artifact}", soft_wrap=True)
    console.print(f"[dim]export NEURON_COMPILED_ARTIFACTS={outcome.path}[/dim]", soft_wrap=True)
    if "accuracy" in data:
        console.print(accuracy_line(data["accuracy"]), soft_wrap=True)
        _exit_if_inaccurate(data)


def accuracy_line(report: dict[str, Any]) -> str:
    """One line: the verdict and its criterion, then the figures that decided it."""
    verdict = "[green]accuracy passed[/green]" if report["passed"] else "[red]accuracy FAILED[/red]"
    criterion = report.get("criterion") or (
        f"{report['mode']} ({report.get('numerics', report.get('dtype'))})"
    )
    exact = report.get("exact_matches")
    parts = [
        escape(criterion),
        f"{report['tokens_matched']}/{report['new_tokens']} tokens agree"
        + (f" ({exact} exactly)" if exact is not None else ""),
        f"max logit diff {report['max_logit_diff']:.3g}",
    ]
    if report.get("tolerance") is not None:
        parts.append(f"tolerance {report['tolerance']:.3g}")
    if report.get("first_divergence") is not None:
        parts.append(f"first divergence at new token {report['first_divergence']}")
    return f"{verdict}: " + ", ".join(parts)


def _exit_if_inaccurate(data: dict[str, Any]) -> None:
    """The artifact is published either way; a failed check is exit 1, for CI."""
    if "accuracy" in data and not data["accuracy"]["passed"]:
        raise typer.Exit(EXIT_FAILED)


def _from_plan(
    plan: Path | None,
    entry: int | None,
    model: str | None,
    config: Path | None,
    spec_flags: dict[str, Any],
    revision: str | None,
) -> tuple[str, str | None, dict[str, Any]]:
    if plan is None or entry is None:
        raise UsageError("--plan and --entry go together", "e.g. --plan builds.toml --entry 0")
    if model or config:
        raise UsageError("--plan names the model and spec; drop MODEL and -c")
    from neuronctl.plan import plan_entry

    chosen = plan_entry(plan, entry)
    flags = {**chosen.spec_flags, **{k: v for k, v in spec_flags.items() if v is not None}}
    return chosen.model, revision or chosen.revision, flags


def _check_accuracy(build: Any, path: Any, mode: str) -> dict[str, Any]:
    from neuronctl.backends import check_accuracy

    return check_accuracy(path, build.checkpoint.path, mode, build.spec.backend)


def register(app: typer.Typer) -> None:
    app.command("compile")(compile_command)
