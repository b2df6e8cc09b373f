"""Build plans: a file listing models and specs -> one CI job per artifact that is missing.

builds.toml:

    [defaults]                    # spec fields every build starts from (as in neuronctl.toml)
    backend = "nxdi"
    seq_len = 2048

    [[build]]                     # one artifact...
    model = "meta-llama/Llama-3.2-1B"
    revision = "main"             # optional
    name = "llama-1b"             # optional; default: the model's last path component
    tp_degree = 2

    [[build]]                     # ...or several: `matrix` crosses lists of spec values
    model = "./models/qwen2-0.5b" # relative paths are relative to this file
    matrix = { tp_degree = [1, 2], batch_size = [1, 4] }

    [gitlab]                      # optional: keys merged into every generated GitLab job
    image = "public.ecr.aws/neuron/pytorch-inference-neuronx:latest"
    tags = ["inf2"]

Entries are numbered in file order after matrix expansion; `neuronctl compile --plan FILE
--entry N` builds entry N. A build's keys come from the same `resolve_build` compile uses, so
the plan's keys are exactly the keys compile will publish.
"""

from __future__ import annotations

import copy
import itertools
import json
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.errors import NeuronctlError, SpecError, UsageError
from neuronctl.spec import FIELDS

if TYPE_CHECKING:
    from neuronctl.store.remote.client import RemoteStore
    from neuronctl.store.remote.oci import OciStore

SPEC_KEYS = frozenset(FIELDS) - {"model", "revision"}
ENTRY_KEYS = SPEC_KEYS | {"model", "revision", "name", "matrix"}
TOP_KEYS = ("defaults", "build", "gitlab")
FORMATS = ("table", "github", "gitlab")  # and --json


@dataclass(frozen=True)
class PlanEntry:
    index: int
    name: str
    model: str
    revision: str | None
    spec_flags: dict[str, Any]


@dataclass
class PlannedBuild:
    entry: PlanEntry
    keys: dict[str, str]  # graph_key, weights_key, artifact_key
    dirname: str
    remote: bool | None  # None: no remote store was asked about

    @property
    def needed(self) -> bool:
        return not self.remote

    def as_dict(self) -> dict[str, Any]:
        return {
            "entry": self.entry.index,
            "name": self.entry.name,
            "model": self.entry.model,
            "revision": self.entry.revision,
            "key": self.dirname,
            **self.keys,
            "remote": self.remote,
            "compile": self.needed,
            "spec": self.entry.spec_flags,
        }


@dataclass
class Plan:
    path: Path
    builds: list[PlannedBuild]
    remote_url: str | None = None
    gitlab_job: dict[str, Any] = field(default_factory=dict)

    def missing(self) -> list[PlannedBuild]:
        return [b for b in self.builds if b.needed]


def read_plan_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: build plan not found") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, binary
        reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror
        raise UsageError(f"{path}: cannot read the build plan: {reason}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise UsageError(
            f"{path}: unknown table {unknown[0]!r}", "use [defaults], [[build]], [gitlab]"
        )
    if not data.get("build"):
        raise UsageError(f"{path}: no [[build]] entries", "add one per model, see docs/ci.md")
    return data


def load_plan(path: Path) -> list[PlanEntry]:
    """Every build of a plan file, matrices expanded, in file order."""
    path = Path(path)
    data = read_plan_file(path)
    defaults = _spec_table(data.get("defaults", {}), f"{path} [defaults]", SPEC_KEYS)
    entries: list[PlanEntry] = []
    for number, raw in enumerate(data["build"], start=1):
        where = f"{path} [[build]] #{number}"
        table = _spec_table(raw, where, ENTRY_KEYS)
        if not isinstance(table.get("model"), str):
            raise SpecError(where, "needs `model`", 'e.g. model = "meta-llama/Llama-3.2-1B"')
        model = _model_ref(table.pop("model"), path.parent)
        name = table.pop("name", None) or model.rstrip("/").rsplit("/", 1)[-1]
        revision = table.pop("revision", None)
        matrix = _matrix(table.pop("matrix", {}), where)
        for combo in matrix:
            flags = {**defaults, **table, **combo}
            suffix = "".join(f"-{_short(k)}{v}" for k, v in combo.items())
            entries.append(PlanEntry(len(entries), name + suffix, model, revision, flags))
    return entries


def plan_entry(path: Path, index: int) -> PlanEntry:
    """Entry `index` of a plan file (what `compile --plan FILE --entry N` builds)."""
    entries = load_plan(path)
    if not 0 <= index < len(entries):
        raise UsageError(
            f"--entry {index}: {path} has entries 0..{len(entries) - 1}",
            "see `neuronctl plan FILE` for the list",
        )
    return entries[index]


def _spec_table(raw: Any, where: str, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SpecError(where, "must be a table")
    table = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise SpecError(
            where, f"unknown key {unknown[0]!r}", "known: " + ", ".join(sorted(allowed))
        )
    return table


def _matrix(raw: Any, where: str) -> list[dict[str, Any]]:
    table = _spec_table(raw, f"{where} matrix", SPEC_KEYS)
    for name, values in table.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{where} matrix.{name}", "must be a non-empty list of values")
    names = list(table)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*table.values())]


def _short(field_name: str) -> str:
    short = {"tp_degree": "tp", "batch_size": "bs", "seq_len": "seq", "dtype": ""}
    return short.get(field_name, field_name.replace("_", "-") + "=")


def _model_ref(model: str, base: Path) -> str:
    """A relative local path means relative to the plan file; anything else is a Hub id."""
    if model.startswith(("./", "../")) or (base / model).is_dir():
        return str((base / model).resolve())
    return model


def make_plan(
    path: Path, remote: RemoteStore | OciStore | None = None, store_dir: Path | None = None
) -> Plan:
    """Keys for every entry (without compiling) and whether the remote already has each."""
    from neuronctl.build import resolve_build

    data = read_plan_file(path)
    builds = []
    for entry in load_plan(path):
        try:
            resolved = resolve_build(
                entry.model, entry.spec_flags, revision=entry.revision, store_dir=store_dir
            )
        except NeuronctlError as exc:
            exc.message = f"{path} entry {entry.index} ({entry.name}): {exc.message}"
            raise
        dirname = resolved.keys.dirname
        has = remote.has(dirname) if remote is not None else None
        builds.append(PlannedBuild(entry, resolved.keys.as_dict(), dirname, has))
    return Plan(Path(path), builds, remote.url if remote else None, data.get("gitlab", {}))


# -- renderers ----------------------------------------------------------------------------------


def render_json(plan: Plan) -> str:
    return json.dumps(
        {
            "plan": str(plan.path),
            "remote": plan.remote_url,
            "builds": [b.as_dict() for b in plan.builds],
            "to_compile": [b.entry.index for b in plan.missing()],
        },
        indent=2,
        sort_keys=True,
    )


def github_matrix_entry(build: PlannedBuild) -> dict[str, Any]:
    return {
        "entry": build.entry.index,
        "name": build.entry.name,
        "model": build.entry.model,
        "key": build.dirname,
    }


def render_github(plan: Plan) -> str:
    """Lines for $GITHUB_OUTPUT: the matrix of builds to compile, their count, every key.

    GitHub refuses an empty matrix, so workflows gate the compile job on `count != '0'`.
    """
    include = [github_matrix_entry(b) for b in plan.missing()]
    keys = [b.dirname for b in plan.builds]
    return "\n".join(
        [
            "matrix=" + json.dumps({"include": include}, separators=(",", ":")),
            f"count={len(include)}",
            "keys=" + json.dumps(keys, separators=(",", ":")),
        ]
    )


def render_gitlab(plan: Plan, plan_arg: str) -> str:
    """A child pipeline: one compile job per missing artifact (GitLab needs at least one job)."""
    import yaml

    remote = shlex.quote(plan.remote_url) if plan.remote_url else '"$NEURONCTL_REMOTE"'
    plan_arg = shlex.quote(plan_arg)
    jobs: dict[str, Any] = {}
    for build in plan.missing():
        job = copy.deepcopy(plan.gitlab_job)  # no YAML anchors shared between jobs
        job["stage"] = "compile"
        job["variables"] = {
            **job.get("variables", {}),
            "NEURONCTL_PLAN_ENTRY": str(build.entry.index),
            "NEURONCTL_ARTIFACT_KEY": build.dirname,
        }
        job["script"] = [
            f"neuronctl compile --plan {plan_arg} --entry {build.entry.index} --remote {remote}"
        ]
        jobs[f"compile {build.entry.index} {build.entry.name}"] = job
    if not jobs:
        jobs["nothing to compile"] = {
            **copy.deepcopy(plan.gitlab_job),
            "stage": "compile",
            "script": [f"echo every artifact of {plan_arg} is already in {remote}"],
        }
    document = {"stages": ["compile"], **jobs}
    header = f"# generated by: neuronctl plan {plan_arg} --format gitlab\n"
    return header + yaml.safe_dump(document, sort_keys=False, width=1000)
