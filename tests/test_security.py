"""Security probes, as an attacker and a careless user would run them."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from neuronctl.errors import NeuronctlError
from neuronctl.store.local import Store
from neuronctl.store.manifest import (
    MANIFEST,
    FileEntry,
    read_manifest,
    record_files,
    write_manifest,
)
from neuronctl.store.remote.client import open_remote
from neuronctl.store.remote.errors import RemoteArtifactError
from neuronctl.store.signing import SIGNATURE, sign
from tests.conftest import TINY_SPEC
from tests.helpers import cli_in_process, spec_flags
from tests.test_remote import (  # noqa: F401  (fixtures)
    SIGNER,
    TRUST,
    _client,
    bucket,
    make_artifact,
    s3server,
    sample_files,
    tree_bytes,
    trusted_env,
    visible,
)

ROOT = Path(__file__).resolve().parents[1]


def _workers_of(proc: psutil.Process) -> list[psutil.Process]:
    """The pool's spawned interpreters (not the resource tracker, which exits on its own)."""
    found = []
    for child in proc.children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cmdline:
            found.append(child)
    return found


def test_sigkill_of_compile_leaves_no_worker_behind(tiny_llama: Path, tmp_path: Path) -> None:
    # Many graphs and two workers: the pool is busy when the compile process is killed.
    spec = {**TINY_SPEC, "context_buckets": ",".join(str(8 * i) for i in range(1, 9))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "neuronctl.cli.main", "compile", str(tiny_llama),
         *spec_flags(spec), "--store", str(tmp_path / "store"), "--jobs", "2", "--json"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    workers: list[psutil.Process] = []
    while len(workers) < 2:
        assert proc.poll() is None, "compile finished before its workers were seen"
        assert time.monotonic() < deadline, "no compile workers appeared"
        time.sleep(0.05)
        workers = _workers_of(parent)

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    gone, alive = psutil.wait_procs(workers, timeout=20)
    for orphan in alive:  # clean up before failing
        orphan.kill()
    assert not alive, f"orphaned compile workers: {[p.pid for p in alive]}"
    assert len(gone) == len(workers)


# -- a .pt2 that would run code when torch unpickles it ---------------------------------------


class _Touch:
    """Unpickling this creates a file: the stand-in for any command an attacker runs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def poison_graph(pt2: Path, marker: Path) -> None:
    """Put a pickle payload where torch.export.load unpickles with weights_only=False as a
    fallback (the sample inputs), keeping everything else of the archive."""
    with zipfile.ZipFile(pt2) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    payload = pickle.dumps(_Touch(str(marker)), protocol=2)
    with zipfile.ZipFile(pt2, "w") as archive:
        for info, data in members:
            poisoned = info.filename.endswith("data/sample_inputs/model.pt")
            archive.writestr(info, payload if poisoned else data)


def tampered_copy(
    compiled_artifact: Path, tmp_path: Path, tamper: Callable[[Path, Path], None]
) -> tuple[Path, Path]:
    """A copy of the tiny artifact whose graphs `tamper` gave a payload that touches the
    marker, with its manifest re-recorded the way an attacker would (so every sha256 matches):
    (artifact, marker)."""
    artifact = tmp_path / "store" / "neuron-compiled-artifacts" / compiled_artifact.name
    shutil.copytree(compiled_artifact, artifact)
    marker = tmp_path / "pwned"
    for rel in read_manifest(artifact).graphs:
        tamper(artifact / rel, marker)
    write_manifest(artifact, record_files(artifact, read_manifest(artifact)))
    return artifact, marker


def load_with_torch(artifact: Path) -> None:
    """torch.export.load of the first graph, errors ignored: what a loader without the scan
    does. In this process, where torch is imported already: the payload only creates the
    marker file."""
    import torch

    graph = artifact / read_manifest(artifact).graphs[0]
    try:
        torch.export.load(str(graph))
    except Exception:
        pass


@pytest.fixture()
def poisoned_artifact(compiled_artifact: Path, tmp_path: Path) -> tuple[Path, Path]:
    return tampered_copy(compiled_artifact, tmp_path, poison_graph)


def test_the_payload_is_live_when_torch_loads_it_directly(
    poisoned_artifact: tuple[Path, Path],
) -> None:
    artifact, marker = poisoned_artifact
    load_with_torch(artifact)
    assert marker.exists()  # so the refusals below are refusals of a real exploit


def test_validate_deep_refuses_a_pickled_payload(poisoned_artifact: tuple[Path, Path]) -> None:
    artifact, marker = poisoned_artifact
    result = cli_in_process("validate", str(artifact), "--deep", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["sha256"]["ok"]  # every hash matches: only the content scan can tell
    assert not checks["payloads"]["ok"]
    assert "a pickle that references io.open" in checks["payloads"]["reason"]
    assert not marker.exists()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_refuse_a_pickled_payload_without_running_it(
    poisoned_artifact: tuple[Path, Path], command: str
) -> None:
    artifact, marker = poisoned_artifact
    extra = ["-p", "hello", "--max-tokens", "2"] if command == "generate" else ["--dry-run"]
    result = cli_in_process(command, "--artifacts", str(artifact), *extra)
    assert result.returncode == 1, result.stderr
    assert "refusing to load" in result.stderr and "references io.open" in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()


def _describe(obj: object, protocol: int) -> str | None:
    from neuronctl.backends.torch.safeload import _member_problem

    return _member_problem("m/data/sample_inputs/model.pt", pickle.dumps(obj, protocol=protocol))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_pickle_scan_names_the_global_in_every_protocol(protocol: int, tmp_path: Path) -> None:
    problem = _describe(_Touch(str(tmp_path / "x")), protocol)
    assert problem is not None and problem.endswith("references io.open"), problem
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_pickle_scan_refuses_any_pickle_even_a_harmless_one(protocol: int) -> None:
    """neuronctl's graphs carry no pickle, so none is allowed-listed: not plain data, not a
    torch.save of tensors."""
    import torch

    from neuronctl.backends.torch.safeload import _member_problem

    assert "is a pickle" in str(_describe({"a": [1, 2.0, "s"]}, protocol))
    saved = io.BytesIO()
    torch.save({"w": torch.ones(3)}, saved)
    assert "torch.save" in str(_member_problem("m/data/weights/weight_0", saved.getvalue()))
    computed = b"\x80\x04(\x8c\x02osK\x01\x93."  # STACK_GLOBAL whose name is not a string
    assert "computed" in str(_member_problem("m/x.bin", computed))
    assert "not data" in str(_member_problem("m/x.bin", b"cos\nsystem\n(S'x'\ntR"[:9]))


def test_neuronctl_graphs_carry_no_pickle_and_no_payload(compiled_artifact: Path) -> None:
    """What the scan's refuse-every-pickle rule relies on: our own graphs pass it, and their
    payload configs declare nothing."""
    from neuronctl.backends.torch.safeload import check_export_graph

    for rel in read_manifest(compiled_artifact).graphs:
        check_export_graph(compiled_artifact / rel)
        with zipfile.ZipFile(compiled_artifact / rel) as archive:
            for name in archive.namelist():
                data = archive.read(name)
                if name.endswith("_config.json"):
                    assert json.loads(data) == {"config": {}}, name
                assert not data.startswith(b"\x80"), f"{name} looks like a pickle"


def case_swap_graph(pt2: Path, marker: Path) -> None:
    """The bypass: the real config names `weight_0` as pickled, a decoy config names
    `WEIGHT_0` as raw bytes, and the member `WEIGHT_0` holds the payload. torch finds
    `weight_0` as `WEIGHT_0`: PyTorchStreamReader::getRecordID calls
    mz_zip_reader_locate_file(..., flags=0), i.e. without MZ_ZIP_FLAG_CASE_SENSITIVE
    (pytorch caffe2/serialize/inline_container.cc), and unpickles it in
    torch/export/pt2_archive/_package.py `_load_state_dict` (`if payload_meta.use_pickle:
    torch.load(..., weights_only=False)`)."""
    with zipfile.ZipFile(pt2) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    prefix = members[0][0].filename.split("/")[0]
    weights = f"{prefix}/data/weights"
    meta = {"path_name": "weight_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
    decoy = {**meta, "path_name": "WEIGHT_0", "use_pickle": False}
    with zipfile.ZipFile(pt2, "w") as archive:
        for info, data in members:
            if info.filename == f"{weights}/model_weights_config.json":
                data = json.dumps({"config": {"w": meta}}).encode()
            archive.writestr(info, data)
        archive.writestr(f"{weights}/decoy_weights_config.json",
                         json.dumps({"config": {"d": decoy}}))
        archive.writestr(f"{weights}/WEIGHT_0", pickle.dumps(_Touch(str(marker)), protocol=2))


@pytest.fixture()
def case_swapped_artifact(compiled_artifact: Path, tmp_path: Path) -> tuple[Path, Path]:
    return tampered_copy(compiled_artifact, tmp_path, case_swap_graph)


def test_the_case_swapped_payload_is_live_in_torch(
    case_swapped_artifact: tuple[Path, Path],
) -> None:
    artifact, marker = case_swapped_artifact
    load_with_torch(artifact)
    assert marker.exists()  # so the refusal below is the refusal of a real exploit


def test_validate_deep_refuses_a_case_swapped_payload(
    case_swapped_artifact: tuple[Path, Path],
) -> None:
    artifact, marker = case_swapped_artifact
    result = cli_in_process("validate", str(artifact), "--deep", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert "declares a pickled payload weight_0" in checks["payloads"]["reason"]
    assert not marker.exists()


def test_pickle_scan_compares_member_names_case_folded(tmp_path: Path) -> None:
    """Without the pickled declaration: a raw-declared member that is a pickle, and two
    members that torch cannot tell apart, are each refused."""
    from neuronctl.backends.torch.safeload import UnsafeGraphError, check_export_graph

    raw = {"config": {"d": {"path_name": "WEIGHT_0", "use_pickle": False}}}
    cases = {
        "raw.pt2": {"m/data/weights/model_weights_config.json": json.dumps(raw).encode(),
                    "m/data/weights/weight_0": pickle.dumps(_Touch("x"), protocol=2)},
        "twins.pt2": {"m/models/model.json": b"{}", "m/models/MODEL.json": b"{}"},
    }  # fmt: skip
    for name, members in cases.items():
        with zipfile.ZipFile(tmp_path / name, "w") as archive:
            for member, data in members.items():
                archive.writestr(member, data)
        with pytest.raises(UnsafeGraphError, match="references io.open|differ only in case"):
            check_export_graph(tmp_path / name)


def test_a_missing_kernel_library_is_refused_not_compiled_on_the_serving_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An artifact whose kernel .so is gone had the kernel compiled at load (`kernel.load`),
    on the serving host, into code nobody vouched for."""
    from neuronctl.backends.torch import kernel
    from neuronctl.backends.torch.runner import _load_kernel
    from neuronctl.errors import NotFoundError

    def compiled(*args: object) -> None:
        raise AssertionError("the serving path compiled the kernel")

    monkeypatch.setattr(kernel, "load", compiled)
    monkeypatch.setattr(kernel, "_build", compiled)
    with pytest.raises(NotFoundError, match=r"lacks kernels/.*\.so.*recompile"):
        _load_kernel(kernel.digest(), tmp_path, {})


# -- push and pull stay inside the artifact and the remote root -------------------------------


def _list_entry(artifact: Path, rel: str, data: bytes) -> None:
    """Make the local manifest list `rel` (as a hostile or broken manifest would)."""
    manifest = read_manifest(artifact)
    files = dict(manifest.files)
    files[rel] = FileEntry(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_manifest(artifact, manifest.model_copy(update={"files": files}))


@pytest.mark.parametrize("escape", ["../../outside.bin", "/ABS/outside.bin", "a/../../x.bin"])
def test_push_never_reads_or_writes_outside(tmp_path: Path, escape: str) -> None:
    artifact = make_artifact(tmp_path / "store", sample_files(big=10_000))
    secret = b"secret bytes from outside the artifact"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(secret)
    rel = escape.replace("/ABS", str(tmp_path))
    _list_entry(artifact, rel, secret)
    remote_root = tmp_path / "remote" / "root"

    # the manifest's path rule refuses the entry as the manifest is read, before push opens
    # anything it names
    with pytest.raises(NeuronctlError, match="is not allowed"):
        open_remote(str(remote_root)).push(artifact, signer=SIGNER)

    written = [p for p in (tmp_path / "remote").rglob("*") if p.is_file()]
    assert written == []  # refused before anything was uploaded, inside or out
    assert outside.read_bytes() == secret


def test_push_refuses_a_symlink_to_outside(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "store", sample_files(big=10_000))
    target = tmp_path / "private.key"
    target.write_bytes(b"k" * 2000)
    (artifact / "graphs" / "tkg_128.pt2").unlink()
    (artifact / "graphs" / "tkg_128.pt2").symlink_to(target)
    # record_files refuses to record a symlink, so list it by hand as a hostile builder would
    _list_entry(artifact, "graphs/tkg_128.pt2", target.read_bytes())

    # signing refuses it first (the load rule: no link inside an artifact), and push's own
    # check refuses it unsigned
    with pytest.raises(NeuronctlError, match="symbolic link"):
        open_remote(str(tmp_path / "remote")).push(artifact, signer=SIGNER)
    with pytest.raises(RemoteArtifactError, match="symbolic link"):
        open_remote(str(tmp_path / "remote")).push(artifact)
    assert not (tmp_path / "remote").exists()


@pytest.mark.parametrize(
    "reserved", ["manifest.json.tmp", "provenance.json", "manifest.sig", "model.sig"]
)
def test_pull_refuses_a_remote_manifest_listing_reserved_names(
    tmp_path: Path, reserved: str
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact, signer=SIGNER)
    directory = tmp_path / "remote" / "neuron-compiled-artifacts" / artifact.name
    # Even the publisher's own key cannot make a reserved name acceptable.
    (directory / reserved).write_bytes(b"{}")
    _list_entry(directory, reserved, b"{}")
    (directory / SIGNATURE).write_bytes(sign((directory / MANIFEST).read_bytes(), SIGNER))
    dest = Store(tmp_path / "host")

    with pytest.raises(RemoteArtifactError, match="reserves|is the manifest itself"):
        remote.pull(artifact.name, dest, policy=TRUST)
    assert visible(dest) == []


def test_a_failed_pull_leaves_nothing_that_validates(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact, signer=SIGNER)
    rel = "graphs/tkg_128.pt2"
    remote_file = tmp_path / "remote" / "neuron-compiled-artifacts" / artifact.name / rel
    flipped = bytearray(remote_file.read_bytes())
    flipped[0] ^= 0xFF  # same size, signed manifest untouched: only the hash can tell
    remote_file.write_bytes(bytes(flipped))
    dest = Store(tmp_path / "host")

    with pytest.raises(RemoteArtifactError, match=f"{rel} is corrupted"):
        remote.pull(artifact.name, dest, policy=TRUST)

    leftovers = [p for p in dest.artifacts.glob(".*/*") if p.is_dir()]
    assert leftovers, "the failed pull's staging directory is kept for inspection"
    for leftover in leftovers:
        assert not (leftover / MANIFEST).exists()
        result = cli_in_process("validate", str(leftover), "--deep", "--json")
        assert result.returncode == 1 and not json.loads(result.stdout)["reusable"]
    assert visible(dest) == []


def test_pull_accepts_a_plain_path_as_push_does(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    mount = tmp_path / "mount"
    assert cli_in_process("artifacts", "push", str(artifact), str(mount)).returncode == 0

    pulled = cli_in_process("artifacts", "pull", str(mount / artifact.name[:8]), "--store",
                            str(tmp_path / "host"), "--json")  # fmt: skip

    assert pulled.returncode == 0, pulled.stderr
    assert tree_bytes(Path(json.loads(pulled.stdout)["path"])) == tree_bytes(artifact)


def test_push_repairs_remote_bytes_changed_at_the_same_size(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact, signer=SIGNER)
    rel = "weights/tp0_sharded_checkpoint.safetensors"
    remote_file = tmp_path / "remote" / "neuron-compiled-artifacts" / artifact.name / rel
    remote_file.write_bytes(bytes(len(remote_file.read_bytes())))  # same size, other bytes

    repaired = remote.push(artifact, signer=SIGNER)

    assert repaired.uploaded == [rel, SIGNATURE, MANIFEST]
    assert remote_file.read_bytes() == (artifact / rel).read_bytes()
    assert remote.push(artifact, signer=SIGNER).noop


def test_s3_push_repairs_an_object_rewritten_at_the_same_size(
    tmp_path: Path,
    bucket: str,  # noqa: F811
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    remote = open_remote(f"s3://{bucket}")
    remote.push(artifact, signer=SIGNER)
    rel = "graphs/tkg_128.pt2"
    key = f"neuron-compiled-artifacts/{artifact.name}/{rel}"
    size = len((artifact / rel).read_bytes())
    _client().put_object(Bucket=bucket, Key=key, Body=bytes(size))  # another tool, no metadata

    repaired = remote.push(artifact, signer=SIGNER)

    assert repaired.uploaded == [rel, SIGNATURE, MANIFEST]
    body = _client().get_object(Bucket=bucket, Key=key)["Body"].read()
    assert body == (artifact / rel).read_bytes()
