"""Checking what deploy writes against the real schemas, offline: Kubernetes' own objects with
the `kubernetes-validate` package (the API's OpenAPI schemas per Kubernetes version), each
custom resource against its project's CRD schema, vendored under schemas/ (README.md there
says where each comes from), and production-stack values against the chart's
values.schema.json.

A CRD's openAPIV3Schema is what the API server checks, with one difference: it prunes unknown
fields silently. Strict field validation (kubectl's default since 1.27) refuses them instead,
and so does this check: every object schema that lists its properties, and does not keep
unknown fields, gets `additionalProperties: false`.

`python -m neuronctl.fleet.schemacheck refresh NAME=CHECKOUT ...` rewrites the vendored files
from git checkouts of the projects (see schemas/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError, UsageError

SCHEMA_DIR = Path(__file__).parent / "schemas"
DEFAULT_KUBERNETES = "1.33"


@dataclass(frozen=True)
class SchemaSource:
    """A vendored schema: the project's repository and the file in it."""

    repo: str
    path: str
    kind: str  # the custom resource kind, or "values" for a chart's values schema
    version: str = ""  # the CRD version served


SOURCES: dict[str, SchemaSource] = {
    "inferenceservice": SchemaSource(
        "kserve/kserve", "config/crd/full/serving.kserve.io_inferenceservices.yaml",
        "InferenceService", "v1beta1",
    ),
    "clusterstoragecontainer": SchemaSource(
        "kserve/kserve",
        "config/crd/full/clusterstoragecontainer/serving.kserve.io_clusterstoragecontainers.yaml",
        "ClusterStorageContainer", "v1alpha1",
    ),
    "leaderworkerset": SchemaSource(
        "kubernetes-sigs/lws", "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
        "LeaderWorkerSet", "v1",
    ),
    "rayservice": SchemaSource(
        "ray-project/kuberay", "ray-operator/config/crd/bases/ray.io_rayservices.yaml",
        "RayService", "v1",
    ),
    "production-stack-values": SchemaSource(
        "vllm-project/production-stack", "helm/values.schema.json", "values"
    ),
}  # fmt: skip
CRD_KINDS = {s.kind: name for name, s in SOURCES.items() if s.kind != "values"}


class SchemaError(NeuronctlError):
    """A document deploy wrote does not validate: a bug in deploy, or in the user's input."""


# -- checking ---------------------------------------------------------------------------------


def check_documents(documents: list[dict[str, Any]], kubernetes: str) -> list[str]:
    """What each document was checked against; raises SchemaError at the first that fails."""
    return [check_document(doc, kubernetes) for doc in documents]


def check_document(doc: dict[str, Any], kubernetes: str) -> str:
    kind = doc.get("kind")
    if kind is None:  # chart values
        validate(doc, "production-stack-values", "production-stack values")
        return f"values.schema.json of {SOURCES['production-stack-values'].repo}"
    name = CRD_KINDS.get(str(kind))
    if name is not None:
        wanted = f"{_group(SOURCES[name])}"
        if not str(doc.get("apiVersion", "")).endswith("/" + SOURCES[name].version):
            raise SchemaError(f"{kind}: apiVersion {doc.get('apiVersion')} is not {wanted}")
        validate(doc, name, f"{kind} {doc['metadata'].get('name', '')}")
        return f"{kind}: CRD schema of {SOURCES[name].repo}"
    return check_builtin(doc, kubernetes)


def _group(source: SchemaSource) -> str:
    return f"{source.kind} {source.version}"


def check_builtin(doc: dict[str, Any], kubernetes: str) -> str:
    import kubernetes_validate as kv
    from kubernetes_validate.utils import VersionNotSupportedError

    what = f"{doc['kind']} {doc['metadata'].get('name', '')}"
    try:
        used = kv.validate(doc, kubernetes, strict=True)
    except kv.ValidationError as exc:
        reason = _where(exc)
        raise SchemaError(f"{what} is invalid for Kubernetes {exc.version}: {reason}") from None
    except VersionNotSupportedError:
        raise UsageError(
            f"--kubernetes {kubernetes}: kubernetes-validate has no schemas for it",
            f"use {kv.utils.all_versions()[0]} to {kv.latest_version()}",
        ) from None
    except kv.SchemaNotFoundError as exc:
        raise SchemaError(exc.message) from None
    return f"{doc['kind']}: Kubernetes {used} API schema"


def validate(doc: dict[str, Any], name: str, what: str) -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema(name))
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        raise SchemaError(f"{what} does not match {SOURCES[name].repo}'s schema: {_where(error)}")


def _where(error: Any) -> str:
    path = ".".join(str(p) for p in error.absolute_path) or "(top)"
    message = str(error.message)
    return f"{path}: {message[:300]}"


@cache
def schema(name: str) -> dict[str, Any]:
    data = json.loads((SCHEMA_DIR / f"{name}.json").read_text())
    return strict(data["schema"]) if SOURCES[name].kind != "values" else data["schema"]


def strict(node: Any) -> Any:
    """Unknown fields refused, as strict field validation does."""
    if isinstance(node, list):
        return [strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    keeps = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not keeps:
        out["additionalProperties"] = False
    return out


# -- refreshing the vendored files ------------------------------------------------------------


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    return node


def crd_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return dict(served["schema"]["openAPIV3Schema"])
    raise NeuronctlError(f"{crd['metadata']['name']} serves no version {version}")


def refresh(name: str, checkout: Path) -> Path:
    """Rewrite schemas/NAME.json from HEAD of a git checkout of its project."""
    import yaml

    source = SOURCES[name]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(checkout), *args], check=True, capture_output=True, text=True
        ).stdout

    commit = git("rev-parse", "HEAD").strip()
    text = git("show", f"HEAD:{source.path}")
    if source.kind == "values":
        body = json.loads(text)
    else:
        body = crd_schema(yaml.safe_load(text), source.version)
    out = SCHEMA_DIR / f"{name}.json"
    record = {
        "source": {"repo": source.repo, "path": source.path, "commit": commit},
        "schema": strip_descriptions(body),
    }
    out.write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "refresh" or len(argv) < 2:
        print("usage: python -m neuronctl.fleet.schemacheck refresh NAME=CHECKOUT ...\n"
              f"names: {', '.join(SOURCES)}", file=sys.stderr)  # fmt: skip
        return 2
    for pair in argv[1:]:
        name, _, checkout = pair.partition("=")
        if name not in SOURCES or not checkout:
            print(f"unknown {pair!r}: use NAME=CHECKOUT, names {', '.join(SOURCES)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(refresh(name, Path(checkout)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
