"""`neuronctl compile --plan FILE --ray ADDRESS`: every entry of a plan built on a Ray cluster
(fleet/farm.py), one task each, and a summary a CI job gates on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from neuronctl.cli._common import console, err_console, print_json, print_table
from neuronctl.errors import UsageError

DEFAULT_LOGS = Path("farm-logs")
STYLE = {"published": "green", "built": "green", "skipped": "dim", "failed": "red"}


@dataclass
class FarmRequest:
    """What `compile` was given, as the farm takes it."""

    address: str
    plan: Path | None
    entry: int | None
    model: str | None  # MODEL or --revision: the plan names both
    config: Path | None
    spec_flags: dict[str, Any]
    remote: str | None
    store: Path | None
    jobs: int | None
    logs: Path | None
    worker_args: tuple[str, ...]  # compile flags every task passes on
    sign_key: str | None
    json_out: bool


def worker_args(
    *,
    rehash: bool,
    allow_pickle: bool,
    check_accuracy: str | None,
    trust_key: list[Path] | None,
    allow_unsigned: bool,
    sign_key: str | None,
) -> tuple[str, ...]:
    """The flags of this command each task's compile takes too. A signing key given as a path
    is passed on by path (it must be there on every worker); PEM text is never sent through
    Ray: workers read $NEURONCTL_SIGNING_KEY from their own environment."""
    args: list[str] = []
    args += ["--rehash"] if rehash else []
    args += ["--allow-pickle"] if allow_pickle else []
    args += ["--check-accuracy", check_accuracy] if check_accuracy else []
    for key in trust_key or []:
        args += ["--trust-key", str(Path(key).resolve())]
    args += ["--allow-unsigned"] if allow_unsigned else []
    if sign_key and not sign_key.lstrip().startswith("-----BEGIN"):
        args += ["--sign-key", str(Path(sign_key).expanduser().resolve())]
    return tuple(args)


def check_request(request: FarmRequest) -> Path:
    if request.plan is None:
        raise UsageError("--ray builds the entries of a plan", "add --plan builds.toml")
    if request.entry is not None:
        raise UsageError(
            "--ray builds every entry of the plan; --entry builds one, here",
            "drop --entry or --ray",
        )
    if request.model or request.config:
        raise UsageError("--plan names the model, revision and spec; drop MODEL, --revision, -c")
    given = sorted(k for k, v in request.spec_flags.items() if v is not None)
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(
            f"{flag}: --ray builds the plan as written",
            "put spec values in the plan's [defaults] or [[build]] tables",
        )
    if request.jobs is not None and request.jobs < 1:
        raise UsageError(f"--jobs {request.jobs}: must be at least 1")
    return request.plan


def run_farm_command(request: FarmRequest) -> None:
    from neuronctl.fleet.farm import (
        Farm,
        FarmOptions,
        check_address,
        connect,
        exit_code,
        farm_jobs,
    )

    plan = check_request(request)
    check_address(request.address)  # before the keys: a wrong address fails in a second
    if request.sign_key:
        from neuronctl.store.signing import load_signer

        load_signer(request.sign_key)  # a bad key fails here, not in every task
    remote = None
    if request.remote:
        from neuronctl.store.remote.client import open_remote

        remote = open_remote(request.remote)
    jobs = farm_jobs(
        plan,
        remote_url=remote.url if remote is not None else None,
        store_dir=request.store,
        cpus=request.jobs,
        extra_args=request.worker_args,
    )
    logs = (request.logs or DEFAULT_LOGS).resolve()
    ray, started = connect(request.address)
    try:
        options = FarmOptions(log_dir=logs, on_result=None if request.json_out else _say)
        results = Farm(jobs, remote, options).run()
    finally:
        if started:
            ray.shutdown()
    summary = [r.as_dict() for r in results]
    if request.json_out:
        print_json(
            {
                "plan": str(plan),
                "remote": remote.url if remote is not None else None,
                "ray": request.address,
                "logs": str(logs),
                "builds": summary,
                "counts": _counts(results),
                "ok": exit_code(results) == 0,
            }
        )
    else:
        _print_summary(results)
    code = exit_code(results)
    if code:
        raise typer.Exit(code)


def _counts(results: list[Any]) -> dict[str, int]:
    from neuronctl.fleet.farm import STATUSES

    return {s: sum(r.status == s for r in results) for s in STATUSES}


def _say(result: Any) -> None:
    """One stderr line as each entry ends (a CI log shows progress)."""
    style = STYLE.get(result.status, "")
    err_console.print(
        f"entry {result.entry} ({escape(result.name)}) [{style}]{result.status}[/{style}] "
        f"in {result.seconds:.1f} s" + (f": {escape(result.reason)}" if result.reason else ""),
        soft_wrap=True,
    )


def _print_summary(results: list[Any]) -> None:
    rows = [
        [r.entry, r.name, r.key or "-", r.status, f"{r.seconds:.1f}", r.log or "-"] for r in results
    ]
    print_table(None, ["entry", "name", "key", "status", "seconds", "log"], rows)
    for r in results:
        if r.status != "failed":
            continue
        console.print(f"\n[red]entry {r.entry} ({escape(r.name)}) failed[/red]: "
                      f"{escape(r.reason)}", soft_wrap=True)  # fmt: skip
        for line in r.tail:
            console.print("  " + escape(line), soft_wrap=True, markup=True)
        if r.log:
            console.print(f"full log: {escape(r.log)}", soft_wrap=True)
    counts = _counts(results)
    console.print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing to build")
