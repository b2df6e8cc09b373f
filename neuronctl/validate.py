"""Reuse validation: can this artifact be used as-is, for this spec, on this host?

Errors are values: every check returns a `Check` with a reason a person can act on, and the
report is reusable only when every check passed. The checks, in order:

1. artifact   the directory holds a manifest that parses, in a format this neuronctl reads;
2. files      every file in the manifest is there with its recorded size (`deep`: and sha256);
3. versions   backend/compiler/runtime versions match this host, the backend's own host
              checks pass, and NEURON_CC_FLAGS matches the compiled flags;
4. spec       the requested spec equals the compiled one on every field that changes the
              compiled result (only the fields the user set are compared);
5. capacity   the host has the cores/devices the tp degree needs;
6. checkpoint with `model`, the checkpoint has the digest the artifact was built from.

`quick_validate` runs 1-3 and 5: what generate and serve run before loading. It only stats
files, so it costs the same for a 100 MB and a 100 GB artifact.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.checks import Check
from neuronctl.doctor import available_cpus
from neuronctl.errors import NeuronctlError, SpecError
from neuronctl.keys import FORMAT_VERSION, canonical_json
from neuronctl.progress import NullProgress, Progress
from neuronctl.spec import (
    FIELDS,
    GRAPH_FIELDS,
    RUNTIME_FIELDS,
    USES_CC_FLAGS,
    WEIGHTS_FIELDS,
    BuildSpec,
    finalize,
    normalize,
    resolve_spec,
    spec_to_dict,
)
from neuronctl.store.manifest import (
    MANIFEST,
    Manifest,
    file_problems,
    leftover_problem,
    load_json_capped,
    sha256_file,
    stray_files,
)

if TYPE_CHECKING:
    from neuronctl.store.signing import TrustPolicy

# Recorded "versions" that describe the build host rather than software (the CPU ISA inductor
# compiled for). Equality is the wrong test for them (an AVX-512 host runs AVX2 code; export
# graphs run anywhere): the backend's host_checks judge them.
HOST_FACT_VERSIONS = frozenset({"cpu_isa", "cpu_half_units"})
# Host checks by these names already answer check 5; ours would only repeat them.
CAPACITY_CHECKS = frozenset({"cores", "devices", "capacity"})
HASH_THREADS = 4  # hashlib releases the GIL: a few threads keep the disk and the cores busy


@dataclass
class Report:
    path: Path
    checks: list[Check] = field(default_factory=list)
    manifest: Manifest | None = None

    @property
    def reusable(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {
            "reusable": self.reusable,
            "path": str(self.path),
            "checks": [
                {"name": c.name, "ok": c.ok, "reason": c.reason, "kind": c.kind}
                for c in self.checks
            ],
        }

    def summary(self) -> str:
        """One line for a refusal: the first failed check and how many more."""
        failed = self.failed
        if not failed:
            return f"{self.path} is reusable"
        more = f" (and {len(failed) - 1} more failed checks)" if len(failed) > 1 else ""
        return f"{self.path} cannot be reused: {failed[0].name}: {failed[0].reason}{more}"


def validate_artifact(
    path: Path,
    spec: BuildSpec | None = None,
    *,
    model: str | None = None,
    revision: str | None = None,
    deep: bool = False,
    progress: Progress | None = None,
    sources: Mapping[str, str] | None = None,
    serving_host: bool = True,
    policy: TrustPolicy | None = None,
) -> Report:
    """Every check. `spec` is the requested spec (from resolve_spec, not finalized) and
    `sources` where each field came from; only fields not from "default" are compared. With
    `sources` None, fields that differ from BuildSpec's defaults count as set. With
    `serving_host` False (this host only prints a launch for another) the checks that judge
    this host as the one that loads the artifact (versions, NEURON_CC_FLAGS, capacity) are
    left out. With a trust `policy`, the trust check is the very one generate and serve run
    before loading."""
    report, manifest = _open(path)
    if manifest is None:
        return report
    report.checks.extend(check_files(report.path, manifest, deep=deep, progress=progress))
    if policy is not None:
        report.checks.append(check_trust(report.path, manifest, policy))
    if serving_host:
        report.checks.extend(check_versions(manifest))
    if spec is not None:
        report.checks.extend(check_spec(manifest, spec, sources))
    if serving_host:
        report.checks.extend(_capacity_unless_done(report.checks, manifest))
    if model is not None:
        report.checks.append(check_checkpoint(manifest, model, revision))
    return report


class NotReusableError(NeuronctlError):
    """The artifact failed the checks run before a load; nothing was loaded."""


def check_reusable(
    path: Path,
    spec: BuildSpec | None = None,
    sources: Mapping[str, str] | None = None,
    serving_host: bool = True,
) -> Manifest:
    """The single call site of the reuse checks before any load (generate, serve, bench):
    the manifest they read, so the command reads it once.

    With a requested spec (serve's spec flags or -c), the artifact must also match it."""
    report = (
        quick_validate(path, serving_host)
        if spec is None
        else validate_artifact(path, spec, sources=sources, serving_host=serving_host)
    )
    if not report.reusable:
        reasons = "; ".join(f"{c.name}: {c.reason}" for c in report.failed)
        raise NotReusableError(
            f"{path} cannot be used as-is: {reasons}",
            f"run `neuronctl validate {path}` for details; serve, generate and bench never compile",
        )
    assert report.manifest is not None  # a reusable artifact has one
    return report.manifest


def requested_spec(
    spec_flags: Mapping[str, Any], config: Path | None
) -> tuple[BuildSpec | None, dict[str, str] | None]:
    """The spec a command was asked for, when any spec flag or a file was given."""
    if config is None and all(v is None for v in spec_flags.values()):
        return None, None
    return resolve_spec(spec_flags, config)


def quick_validate(path: Path, serving_host: bool = True) -> Report:
    """Checks 1-3 and 5, stat only: run before loading an artifact (2 and 5 only on the host
    that loads it, `serving_host`)."""
    report, manifest = _open(path)
    if manifest is None:
        return report
    report.checks.extend(check_files(report.path, manifest))
    if serving_host:
        report.checks.extend(check_versions(manifest))
        report.checks.extend(_capacity_unless_done(report.checks, manifest))
    return report


def _open(path: Path) -> tuple[Report, Manifest | None]:
    path = Path(path).expanduser().absolute()
    report = Report(path)
    check, manifest = check_artifact(path)
    report.checks.append(check)
    report.manifest = manifest
    return report, manifest


# --- 1. artifact ----------------------------------------------------------------------------


def check_artifact(path: Path) -> tuple[Check, Manifest | None]:
    name = "artifact"
    if not path.exists():
        return Check(name, False, f"{path} does not exist"), None
    if not path.is_dir():
        return Check(name, False, f"{path} is a file, not an artifact directory"), None
    if (leftover := leftover_problem(path)) is not None:
        return Check(name, False, leftover), None
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        empty = not any(path.iterdir())
        what = "an empty directory" if empty else f"a directory with no {MANIFEST}"
        return (
            Check(
                name,
                False,
                f"not an artifact: {what} (an interrupted build never leaves a manifest); "
                "compile one with `neuronctl compile MODEL`",
            ),
            None,
        )
    try:  # capped and depth-checked: a 6 GB sparse manifest cost 12.6 GB of memory here
        data = load_json_capped(manifest_path)
    except NeuronctlError as exc:
        return Check(name, False, f"{MANIFEST} is unreadable: {exc.message}; recompile"), None
    except OSError as exc:
        return Check(name, False, f"{MANIFEST} is unreadable: {exc}; recompile"), None
    if not isinstance(data, dict):
        return Check(name, False, f"{MANIFEST} is not a JSON object; recompile"), None
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        return Check(name, False, _format_reason(version)), None
    try:
        manifest = Manifest.model_validate(data)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        first = exc.errors()[0] if hasattr(exc, "errors") else {"msg": str(exc), "loc": ()}
        where = ".".join(str(p) for p in first["loc"]) or "manifest"
        return Check(name, False, f"{MANIFEST} is invalid at {where}: {first['msg']}"), None
    if (edited := manifest.record_problem()) is not None:
        return Check(name, False, f"{edited}; copy the artifact again or recompile"), None
    key = manifest.keys.artifact[:12]
    return Check(name, True, f"{manifest.backend} artifact {key}, format {version}"), manifest


def _format_reason(version: Any) -> str:
    if isinstance(version, int) and version > FORMAT_VERSION:
        return (
            f"made by a newer neuronctl (format {version}; this one reads {FORMAT_VERSION}): "
            "upgrade neuronctl"
        )
    if isinstance(version, int):
        return (
            f"old artifact format {version} (this neuronctl reads {FORMAT_VERSION}): "
            "recompile with this neuronctl"
        )
    return f"{MANIFEST} has no valid format_version; recompile"


# --- 2. files -------------------------------------------------------------------------------


def check_files(
    root: Path, manifest: Manifest, *, deep: bool = False, progress: Progress | None = None
) -> list[Check]:
    checks = [_files_check(manifest, *file_problems(root, manifest))]
    checks.append(_stray_check(root, manifest))
    if deep and checks[0].ok:
        checks.append(check_hashes(root, manifest, progress))
        checks.append(check_payloads(root, manifest))
    return checks


def check_trust(root: Path, manifest: Manifest, policy: TrustPolicy) -> Check:
    """Who vouches for the code in the artifact: signing.check_origin, the load rule that
    generate, serve and bench apply, under the same flags."""
    from neuronctl.store.signing import UNSIGNED, SignatureError, check_origin

    try:
        vouch = check_origin(root, manifest, policy)
    except SignatureError as exc:
        return Check("trust", False, exc.message)
    return Check(
        "trust", True, vouch.describe(), kind="note" if vouch.kind == UNSIGNED else "check"
    )


def check_payloads(root: Path, manifest: Manifest) -> Check:
    """Deep: graphs that are data by design (torch export) must not carry code (pickles)."""
    from neuronctl.backends import payload_problem

    problem = payload_problem(root, manifest)
    if problem:
        return Check("payloads", False, problem)
    return Check("payloads", True, "no graph carries code beyond what its backend compiles")


def _files_check(
    manifest: Manifest, missing: list[str], wrong_size: list[str], unsafe: list[str]
) -> Check:
    problems = []
    if missing:
        problems.append(f"missing: {_names(missing)}")
    if wrong_size:
        problems.append(f"truncated or changed: {_names(wrong_size)}")
    if unsafe:
        problems.append(f"the manifest names paths outside the artifact: {_names(unsafe)}")
    if problems:
        fix = "copy the artifact again from its source, or recompile"
        return Check("files", False, "; ".join(problems) + f"; {fix}")
    n = len(manifest.files)
    return Check("files", True, f"{n} files present, {manifest.total_size() / 2**20:.1f} MiB")


def _names(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _stray_check(root: Path, manifest: Manifest) -> Check:
    risky, harmless = stray_files(root, manifest)
    if risky:
        return Check(
            "extra files",
            False,
            f"not part of the build but a loader could read them: {_names(risky)}; "
            "remove them or recompile",
        )
    if harmless:
        return Check("extra files", True, f"ignored (not read by loaders): {_names(harmless)}")
    return Check("extra files", True, "none")


def check_hashes(root: Path, manifest: Manifest, progress: Progress | None = None) -> Check:
    """Re-hash every byte, several files at a time; name the first file (in manifest order)
    whose content differs."""
    items = list(manifest.files.items())
    advance = (progress or NullProgress()).task("verifying sha256", total=manifest.total_size())

    def digest(item: tuple[str, Any]) -> str:
        return sha256_file(root / item[0], on_bytes=advance)

    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digests = list(pool.map(digest, items))
    bad = [rel for (rel, entry), got in zip(items, digests, strict=True) if got != entry.sha256]
    if bad:
        more = f" ({len(bad) - 1} more differ)" if len(bad) > 1 else ""
        return Check(
            "sha256",
            False,
            f"{bad[0]} differs from the recorded sha256{more}: the artifact is corrupted; "
            "copy it again or recompile",
        )
    return Check("sha256", True, f"all {len(items)} files match their recorded sha256")


# --- 3. versions ----------------------------------------------------------------------------


def check_versions(manifest: Manifest) -> list[Check]:
    try:
        backend = _backend(manifest.backend)
        current = backend.versions(manifest.spec)
    except NeuronctlError as exc:
        return [Check("versions", False, str(exc))]
    except ImportError as exc:
        reason = f"the {manifest.backend} backend cannot be loaded here: {exc}"
        return [Check("versions", False, reason)]
    checks = [versions_check(manifest.backend_versions, current)]
    checks.extend(_host_checks(backend, manifest))
    checks.append(check_cc_flags(manifest, os.environ))
    return checks


def _backend(name: str) -> Any:
    from neuronctl.backends import get_backend  # lazy: the Neuron backends import the SDK

    return get_backend(name)


def versions_check(
    recorded: Mapping[str, str], current: Mapping[str, str], where: str = ""
) -> Check:
    """The recorded versions against `current`: this host's, or those of the host `where`
    names (a deploy's image), which gets no pip hint for this host."""
    diffs = []
    host = where or "this host"
    for name in sorted((set(recorded) | set(current)) - HOST_FACT_VERSIONS):
        was, now = recorded.get(name, "absent"), current.get(name, "absent")
        if was != now:
            diffs.append(f"{name} compiled with {was}, {host} has {now}")
    if diffs:
        hint = "" if where else _install_hint(recorded, current)
        return Check("versions", False, "; ".join(diffs) + f"; recompile on {host}{hint}")
    shown = ", ".join(f"{k} {v}" for k, v in sorted(recorded.items()))
    return Check("versions", True, shown or "no versions recorded")


def _install_hint(recorded: Mapping[str, str], current: Mapping[str, str]) -> str:
    pins = [
        f"{name}=={version}"
        for name, version in sorted(recorded.items())
        if name not in HOST_FACT_VERSIONS and current.get(name) != version and _is_package(name)
    ]
    return f", or install {' '.join(pins)}" if pins else ""


def _is_package(name: str) -> bool:
    # Entries like "torch" or "neuronx-cc" are pip packages; "cpu_isa" or "python" are not.
    from importlib import metadata

    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _host_checks(backend: Any, manifest: Manifest) -> list[Check]:
    try:
        results = backend.host_checks(manifest)
    except NeuronctlError as exc:
        return [Check("host", False, str(exc), kind="host")]
    return [replace(check, kind="host") for check in results]


def check_cc_flags(manifest: Manifest, env: Mapping[str, str]) -> Check:
    if manifest.backend not in USES_CC_FLAGS:
        return Check("NEURON_CC_FLAGS", True, f"not read by the {manifest.backend} backend")
    recorded = manifest.spec.cc_flags
    now = env.get("NEURON_CC_FLAGS", "")
    if _flags(recorded) == _flags(now):
        return Check("NEURON_CC_FLAGS", True, f"{recorded!r}" if recorded else "unset, as compiled")
    if not recorded:
        fix = "unset NEURON_CC_FLAGS"
    else:
        fix = f"export NEURON_CC_FLAGS={shlex.quote(recorded)}"
    return Check(
        "NEURON_CC_FLAGS",
        False,
        f"compiled with {recorded!r}, the environment has {now!r}: a runtime recompile would "
        f"use other flags; {fix}, or recompile with these flags",
    )


def _flags(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


# --- 4. spec --------------------------------------------------------------------------------


def check_spec(
    manifest: Manifest, requested: BuildSpec, sources: Mapping[str, str] | None = None
) -> list[Check]:
    """Compare the fields the user set with the compiled spec."""
    user_set = _user_set(requested, sources)
    if not user_set:
        return [Check("spec", True, "no spec fields requested")]
    try:
        wanted = _requested_values(manifest, requested, user_set)
    except SpecError as exc:
        return [Check("spec", False, f"the requested spec does not fit this model: {exc}")]
    compiled = spec_to_dict(manifest.spec)
    checks, matched = [], []
    for name in user_set:
        if name == "cc_flags" and (sources or {}).get(name) == "env":
            continue  # NEURON_CC_FLAGS is its own check
        have = compiled.get(name)
        if canonical_json(wanted[name]) == canonical_json(have):
            matched.append(name)
        elif name in RUNTIME_FIELDS:
            checks.append(
                Check(
                    f"spec.{name}",
                    True,
                    f"runtime-only, may differ: requested {_show(wanted[name])}, "
                    f"compiled {_show(have)}",
                    kind="runtime-only",
                )
            )
        else:
            checks.append(_mismatch(name, wanted[name], have, (sources or {}).get(name)))
    if matched:
        checks.insert(0, Check("spec", True, "matches the compiled spec on " + ", ".join(matched)))
    return checks


def _user_set(requested: BuildSpec, sources: Mapping[str, str] | None) -> list[str]:
    known = set(GRAPH_FIELDS) | set(WEIGHTS_FIELDS) | set(RUNTIME_FIELDS)
    compared = [f for f in FIELDS if f in known]
    if sources is not None:
        # Only what the user gave: `--seq-len 256` is not also a max_context_length request.
        return [f for f in compared if not sources.get(f, "default").startswith("default")]
    defaults = spec_to_dict(normalize(BuildSpec.model_validate({})))
    values = spec_to_dict(requested)
    return [f for f in compared if canonical_json(values[f]) != canonical_json(defaults[f])]


def _requested_values(
    manifest: Manifest, requested: BuildSpec, user_set: list[str]
) -> dict[str, Any]:
    """The user's values finalized the way a compile would finalize them here: on the
    artifact's model and backend ("auto" resolved, a torch artifact's tp degree 1), with the
    compiled values for the fields the user did not set."""
    overlay = manifest.spec.model_copy(update={name: getattr(requested, name) for name in user_set})
    resolved = spec_to_dict(finalize(overlay, manifest.shape))
    return {name: resolved[name] for name in user_set}


def _mismatch(name: str, wanted: Any, have: Any, source: str | None) -> Check:
    where = f" ({_source(source)})" if source else ""
    fix = (
        f"recompile with {_setting(name, wanted)}, or use {_setting(name, have)} to reuse this one"
    )
    return Check(
        f"spec.{name}",
        False,
        f"requested {_show(wanted)}{where}, compiled {_show(have)}; {fix}",
    )


def _source(source: str) -> str:
    if source.startswith("file:"):
        return "from " + source[5:]
    return {"flag": "flag", "env": "environment"}.get(source, source)


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return repr(value) if isinstance(value, str) else str(value)


def _setting(name: str, value: Any) -> str:
    """How a user sets a field to a value: a flag where there is one."""
    if name == "cc_flags":
        return f"NEURON_CC_FLAGS={shlex.quote(str(value))}"
    if name == "quantized":
        return "--quantized" if value else "--no-quantized"
    if name == "quantization_type":
        return f"quantization_type = {json.dumps(value)} in the config file"
    if value is None:
        return f"no --{name.replace('_', '-')}"
    if isinstance(value, list):
        text = ",".join(str(v) for v in value)
    elif isinstance(value, dict):
        text = shlex.quote(json.dumps(value, sort_keys=True, separators=(",", ":")))
    else:
        text = str(value)
    return f"--{name.replace('_', '-')} {text}"


# --- 5. capacity ----------------------------------------------------------------------------


def check_host(manifest: Manifest) -> list[Check]:
    """Checks 3 and 5 from the manifest alone: whether this host could load the artifact
    (what an install runs before downloading anything)."""
    checks = check_versions(manifest)
    return checks + _capacity_unless_done(checks, manifest)


def _capacity_unless_done(done: list[Check], manifest: Manifest) -> list[Check]:
    if any(c.kind == "host" and c.name in CAPACITY_CHECKS for c in done):
        return []
    return check_capacity(manifest)


def check_capacity(manifest: Manifest) -> list[Check]:
    tp = manifest.spec.tp_degree
    if manifest.backend == "torch":
        cores = available_cpus()
        if tp > cores:
            return [
                Check(
                    "capacity",
                    False,
                    f"tp degree {tp} needs {tp} CPU cores, this host has {cores}: "
                    f"run on a bigger host or recompile with --tp-degree {cores} or less",
                )
            ]
        return [Check("capacity", True, f"tp degree {tp} <= {cores} CPU cores")]
    from neuronctl.doctor import neuron_cores

    cores, how = neuron_cores()
    if cores < tp:
        have = f"{cores} NeuronCores ({how})" if cores else f"no NeuronCores ({how})"
        return [
            Check(
                "capacity",
                False,
                f"tp degree {tp} needs {tp} NeuronCores, this host has {have}: use a larger "
                "Inf2/Trn1/Trn2 instance or recompile with a smaller --tp-degree",
            )
        ]
    return [Check("capacity", True, f"tp degree {tp} <= {cores} NeuronCores ({how})")]


# --- 6. checkpoint --------------------------------------------------------------------------


def check_checkpoint(manifest: Manifest, model: str, revision: str | None = None) -> Check:
    try:
        from neuronctl.checkpoints import open_checkpoint

        digest = open_checkpoint(model, revision, download=False).digest()
    except NeuronctlError as exc:
        return Check("checkpoint", False, f"cannot read {model}: {exc}")
    except ImportError as exc:
        return Check("checkpoint", False, f"checkpoint support is not available: {exc}")
    built = manifest.source.digest
    if digest == built:
        return Check("checkpoint", True, f"{model} has the digest it was built from")
    named = manifest.source.model or manifest.source.path or "another checkpoint"
    return Check(
        "checkpoint",
        False,
        f"{model} has digest {digest[:12]}, the artifact was built from {named} "
        f"(digest {built[:12]}): recompile from {model}, or pass the original checkpoint",
    )
