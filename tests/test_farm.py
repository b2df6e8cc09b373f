"""The build farm (`neuronctl compile --plan FILE --ray ADDRESS`, neuronctl/fleet/farm.py) on a
real local Ray cluster. The fast tests inject a cheap task in place of the compile (it
publishes a manifest to the remote, or fails with a log) to test the farm's own logic:
scheduling, skip-if-published, claims across overlapping plans, failure reports, the summary
and the exit code. The slow test runs real compiles of three entries, one failing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from neuronctl.fleet.farm import Farm, FarmJob, FarmOptions, exit_code, farm_jobs, outcome
from neuronctl.store.remote.claim import live_holder, try_claim
from neuronctl.store.remote.client import open_remote
from tests.conftest import SMALLEST_SPEC
from tests.helpers import cli, cli_in_process, make_checkpoint
from tests.test_remote import bucket, s3server  # noqa: F401  (fixtures)

pytest.importorskip("ray", reason="pip install 'neuronctl[ray]'")

REPO = Path(__file__).resolve().parent.parent
SPEC_LINES = "\n".join(
    f"{k} = {json.dumps(v)}" for k, v in SMALLEST_SPEC.items() if k != "batch_size"
)


def plan_text(*entries: tuple[str, int]) -> str:
    """A plan of the tiny model: one [[build]] per (name, batch_size)."""
    builds = "".join(
        f'\n[[build]]\nmodel = "./llama"\nname = "{name}"\nbatch_size = {bs}\n'
        for name, bs in entries
    )
    return f"[defaults]\n{SPEC_LINES}\n{builds}"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("farm-models")
    make_checkpoint(root / "llama", "llama")
    return root


@pytest.fixture(scope="module")
def local_ray() -> Any:
    """One local Ray for the module, its workers able to import this repository (the cheap
    task below lives in this test module)."""
    import ray

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved]))
    # Ray's memory resource is a number it schedules by, not an allocation: fixed here so two
    # tiny builds (2 GiB each by the farm's rule) fit at once on any test host.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", _memory=16 << 30)  # fmt: skip
    yield ray
    ray.shutdown()
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


def fake_compile(job: FarmJob) -> dict[str, Any]:
    """The cheap task: takes a second like a (very) small build, records that it built, then
    publishes (a manifest in the remote is what `has` looks for) or fails with a log."""
    args = list(job.args)
    remote = Path(args[args.index("--remote") + 1].removeprefix("file://"))
    with open(remote.parent / "built.txt", "a") as f:
        f.write(job.key + "\n")
    time.sleep(1.0)
    if job.name.startswith("broken"):
        log = "compiling entry\n" * 30 + "error: no tokenizer files\n  hint: copy them\n"
        return {"returncode": 1, "stdout": "", "log": log, "seconds": 1.0, "node": "n"}
    target = remote / "neuron-compiled-artifacts" / job.key
    target.mkdir(parents=True, exist_ok=True)
    (target / "manifest.json").write_text("{}")
    summary = {"artifact_key": job.artifact_key, "pushed": True, "pulled": False}
    return {"returncode": 0, "stdout": json.dumps(summary), "log": "compiled\n",
            "seconds": 1.0, "node": "n"}  # fmt: skip


def write_plan(folder: Path, models: Path, name: str, *entries: tuple[str, int]) -> Path:
    if not (folder / "llama").exists():
        (folder / "llama").symlink_to(models / "llama")
    path = folder / name
    path.write_text(plan_text(*entries))
    return path


def jobs_for(plan: Path, remote_url: str) -> list[FarmJob]:
    return farm_jobs(plan, remote_url=remote_url, cpus=1)


def built_keys(tmp_path: Path) -> list[str]:
    path = tmp_path / "built.txt"
    return path.read_text().split() if path.exists() else []


def test_a_plan_of_three_with_one_failing_publishes_two_and_reports_the_third_with_its_log(
    local_ray: Any, models: Path, tmp_path: Path
) -> None:
    plan = write_plan(tmp_path, models, "builds.toml", ("a", 1), ("b", 2), ("broken", 4))
    remote = open_remote(str(tmp_path / "remote"))
    jobs = jobs_for(plan, remote.url)
    assert [j.args[j.args.index("--entry") + 1] for j in jobs] == ["0", "1", "2"]

    results = Farm(jobs, remote, FarmOptions(tmp_path / "logs", poll_s=0.2), fake_compile).run()

    assert [(r.name, r.status) for r in results] == [
        ("a", "published"), ("b", "published"), ("broken", "failed"),
    ]
    assert exit_code(results) == 1
    failed = results[2]
    assert failed.reason == "error: no tokenizer files"
    assert failed.tail[-2:] == ["error: no tokenizer files", "  hint: copy them"]
    assert len(failed.tail) == 20
    assert failed.log is not None and "hint: copy them" in Path(failed.log).read_text()
    assert all(remote.has(j.key) for j in jobs[:2]) and not remote.has(jobs[2].key)
    assert sorted(built_keys(tmp_path)) == sorted(j.key for j in jobs)

    # Again: what is published is skipped without a task; the failure is tried again.
    again = Farm(jobs, remote, FarmOptions(tmp_path / "logs", poll_s=0.2), fake_compile).run()
    assert [(r.status, r.reason) for r in again[:2]] == [("skipped", "already published")] * 2
    assert again[2].status == "failed"
    assert len(built_keys(tmp_path)) == 4


def test_an_entry_whose_checkpoint_cannot_be_read_fails_and_the_others_build(
    local_ray: Any, models: Path, tmp_path: Path
) -> None:
    shutil.copytree(models / "llama", tmp_path / "damaged")
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"not a safetensors file")
    plan = write_plan(tmp_path, models, "builds.toml", ("a", 1))
    plan.write_text(plan.read_text() + '\n[[build]]\nmodel = "./damaged"\n')
    remote = open_remote(str(tmp_path / "remote"))
    jobs = jobs_for(plan, remote.url)

    results = Farm(jobs, remote, FarmOptions(tmp_path / "logs", poll_s=0.2), fake_compile).run()

    assert [(r.name, r.status) for r in results] == [("a", "published"), ("damaged", "failed")]
    assert results[1].reason.startswith("error: ") and "safetensors" in results[1].reason
    assert built_keys(tmp_path) == [jobs[0].key]


def test_two_overlapping_plans_run_at_once_build_the_shared_entry_once(
    local_ray: Any, models: Path, tmp_path: Path
) -> None:
    first = write_plan(tmp_path, models, "one.toml", ("a", 1), ("shared", 2))
    second = write_plan(tmp_path, models, "two.toml", ("shared", 2), ("c", 4))
    remote = open_remote(str(tmp_path / "remote"))
    farms = [
        Farm(jobs_for(plan, remote.url), open_remote(remote.url),
             FarmOptions(tmp_path / f"logs-{plan.stem}", poll_s=0.1), fake_compile)
        for plan in (first, second)
    ]  # fmt: skip
    results: dict[int, list[Any]] = {}
    threads = [
        threading.Thread(target=lambda i=i, f=f: results.__setitem__(i, f.run()))
        for i, f in enumerate(farms)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    shared = farms[0].results[1].key
    assert built_keys(tmp_path).count(shared) == 1
    assert len(built_keys(tmp_path)) == 3
    statuses = sorted([results[0][1].status, results[1][0].status])
    assert statuses == ["published", "skipped"]
    assert all(exit_code(r) == 0 for r in results.values())
    assert not list((tmp_path / "remote" / "neuron-compiled-artifacts" / ".claims").iterdir())


def crashing_compile(job: FarmJob) -> dict[str, Any]:
    if job.name.startswith("crash"):
        raise RuntimeError("the worker ran out of disk")
    return fake_compile(job)


def test_a_task_that_raises_is_that_entry_failed_and_the_others_go_on(
    local_ray: Any, models: Path, tmp_path: Path
) -> None:
    plan = write_plan(tmp_path, models, "builds.toml", ("crash", 1), ("fine", 2))
    remote = open_remote(str(tmp_path / "remote"))
    jobs = jobs_for(plan, remote.url)

    results = Farm(jobs, remote, FarmOptions(tmp_path / "logs", poll_s=0.2),
                   crashing_compile).run()  # fmt: skip

    assert [r.status for r in results] == ["failed", "published"]
    assert results[0].reason == "error: the task raised RuntimeError: the worker ran out of disk"
    assert live_holder(remote, jobs[0].key) is None  # its claim let go


class PublishedMeanwhile:
    """A remote whose artifact appears between the farm's first look and its claim: the
    other builder published and let go of its claim in between."""

    def __init__(self, remote: Any) -> None:
        self.remote, self.looks = remote, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.remote, name)

    def has(self, dirname: str) -> bool:
        self.looks += 1
        return self.looks > 1


def test_an_entry_published_between_the_first_look_and_the_claim_is_not_built(
    local_ray: Any, models: Path, tmp_path: Path
) -> None:
    plan = write_plan(tmp_path, models, "builds.toml", ("a", 1))
    remote = open_remote(str(tmp_path / "remote"))
    farm = Farm(jobs_for(plan, remote.url), remote, FarmOptions(tmp_path / "logs"), fake_compile)
    farm.remote = PublishedMeanwhile(remote)

    results = farm.run()

    assert [(r.status, r.reason) for r in results] == [("skipped", "already published")]
    assert built_keys(tmp_path) == []
    assert live_holder(remote, results[0].key) is None  # the claim taken to look is let go


def test_a_build_no_node_can_hold_fails_at_once_and_the_others_run(
    local_ray: Any, models: Path, tmp_path: Path
) -> None:
    plan = write_plan(tmp_path, models, "builds.toml", ("huge", 1), ("small", 2))
    remote = open_remote(str(tmp_path / "remote"))
    jobs = jobs_for(plan, remote.url)
    jobs[0] = replace(jobs[0], memory=1 << 50)

    results = Farm(jobs, remote, FarmOptions(tmp_path / "logs", poll_s=0.2), fake_compile).run()

    assert results[0].status == "failed"
    assert results[0].reason == (
        "needs 1048576.0 GiB of memory; the largest Ray node offers 16.0 GiB"
    )
    assert results[1].status == "published"
    assert built_keys(tmp_path) == [jobs[1].key]


def test_the_cli_summary_lists_every_entry_and_exits_1_when_one_failed(
    local_ray: Any, models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("neuronctl.fleet.farm.compile_task", fake_compile)
    write_plan(tmp_path, models, "builds.toml", ("a", 1), ("broken", 2))
    url = (tmp_path / "remote").as_uri()
    base = ["compile", "--plan", "builds.toml", "--ray", "auto", "--remote", url, "-j", "1"]

    done = cli_in_process(*base, "--json", cwd=tmp_path)

    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] is False
    assert summary["counts"] == {"published": 1, "built": 0, "skipped": 0, "failed": 1}
    rows = summary["builds"]
    assert [(r["name"], r["status"]) for r in rows] == [("a", "published"), ("broken", "failed")]
    assert all(len(r["key"]) == 20 and r["seconds"] > 0 for r in rows)
    assert Path(rows[1]["log"]).parent == tmp_path / "farm-logs"

    table = cli_in_process(*base, cwd=tmp_path)
    assert table.returncode == 1
    assert "skipped" in table.stdout and "entry 1 (broken) failed" in table.stdout
    assert "  hint: copy them" in table.stdout and "full log: " in table.stdout
    assert "1 skipped, 1 failed" in table.stdout

    # A plan whose entries are all published now or before: exit 0, the gate passes.
    write_plan(tmp_path, models, "done.toml", ("a", 1))
    passed = cli_in_process("compile", "--plan", "done.toml", *base[3:], "--json", cwd=tmp_path)
    assert passed.returncode == 0, passed.stderr
    assert json.loads(passed.stdout)["ok"] is True
    assert json.loads(passed.stdout)["counts"]["skipped"] == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ray", "local"], "--ray builds the entries of a plan"),
        (["--plan", "builds.toml", "--entry", "0", "--ray", "local"], "--entry builds one"),
        (["--plan", "builds.toml", "--ray", "local", "--seq-len", "64"], "--seq-len: --ray"),
        (["--plan", "builds.toml", "--logs", "x"], "--logs goes with --ray"),
        (["--plan", "builds.toml", "--ray", "nonsense"], "--ray nonsense: not an address"),
        (["--plan", "builds.toml", "--ray", "127.0.0.1:1"], "no Ray cluster answers there"),
    ],
)
def test_usage_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    (tmp_path / "builds.toml").write_text('[[build]]\nmodel = "x"\n')
    done = cli_in_process("compile", *extra, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_without_ray_the_error_names_the_extra(
    tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_plan(tmp_path, models, "builds.toml", ("a", 1))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    done = cli_in_process("compile", "--plan", "builds.toml", "--ray", "local", cwd=tmp_path)
    assert done.returncode == 2
    assert "pip install 'neuronctl[ray]'" in done.stderr


def test_a_worker_that_computes_another_key_is_a_failure() -> None:
    job = FarmJob(0, "a", "0" * 20, "0" * 64, (), 1, 1)
    other = {"returncode": 0, "stdout": json.dumps({"artifact_key": "1" * 64, "pushed": True}),
             "log": ""}  # fmt: skip
    status, reason = outcome(job, other, remote=True)
    assert status == "failed" and "versions differ" in reason
    same = {**other, "stdout": json.dumps({"artifact_key": "0" * 64, "pushed": False})}
    assert outcome(job, same, remote=True) == ("skipped", "published by another build meanwhile")
    local = {**other, "stdout": json.dumps({"artifact_key": "0" * 64, "cache_hit": False})}
    assert outcome(job, local, remote=False) == ("built", "")
    killed = {**other, "returncode": -9}
    assert outcome(job, killed, remote=True) == (
        "failed", "compile killed by signal 9 (out of memory?)"
    )


def test_a_compile_dies_with_the_worker_that_started_it(tmp_path: Path) -> None:
    """A Ray worker killed (a cancelled task, a lost node) takes its compile with it: the
    task's child stands in for the compile and records its pid; its parent is SIGKILLed."""
    import psutil

    pid_file = tmp_path / "compile.pid"
    sleeper = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    worker_code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "import neuronctl.fleet.farm as farm\n"
        f"farm.NEURONCTL_MAIN = ('-c', {sleeper!r})\n"
        f"farm.compile_task(farm.FarmJob(0, 'a', '0' * 20, '0' * 64, ({str(pid_file)!r},), 1, 1))\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", worker_code])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = psutil.Process(int(pid_file.read_text()))
    worker.kill()
    worker.wait()
    try:
        child.wait(timeout=10)  # gone (reaped by whoever adopted it), not left compiling
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the compile outlived the worker that started it")


# -- claims (store/remote/claim.py) -------------------------------------------------------------


def test_a_claim_is_held_once_until_released_or_expired(tmp_path: Path) -> None:
    remote = open_remote(str(tmp_path / "remote"))
    key = "ab" * 10
    mine = try_claim(remote, key, ttl_s=60, owner="me")
    assert mine is not None
    assert try_claim(remote, key, ttl_s=60) is None
    assert live_holder(remote, key) == "me"
    mine.release()
    assert live_holder(remote, key) is None

    short = try_claim(remote, key, ttl_s=0.05, owner="dead")
    assert short is not None
    time.sleep(0.1)
    taker = try_claim(remote, key, ttl_s=60, owner="taker")  # the dead holder's is taken over
    assert taker is not None and live_holder(remote, key) == "taker"
    assert short.refresh() is False  # the old holder learns it lost it
    short.release()  # and its release leaves the new holder's claim alone
    assert live_holder(remote, key) == "taker"
    assert taker.refresh() is True


def test_a_claim_on_s3_is_a_conditional_put(bucket: str) -> None:  # noqa: F811
    """s3fs's exclusive mode sends `If-None-Match: *` (fsspec/s3fs 2026.9.0, s3fs/core.py
    line 2800, S3File.commit) and maps the 412 answer to FileExistsError (s3fs/errors.py lines
    146-149, translate_boto_error): the second claimer is refused by the server, not by a
    look before the write."""
    remote = open_remote(f"s3://{bucket}/neuron")
    key = "ef" * 10
    first = try_claim(remote, key, ttl_s=60, owner="ci-1")
    assert first is not None
    assert try_claim(remote, key, ttl_s=60, owner="ci-2") is None
    assert live_holder(remote, key) == "ci-1"
    first.release()
    assert try_claim(remote, key, ttl_s=60, owner="ci-2") is not None


def test_a_claim_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    from neuronctl.store.remote.errors import RemoteArtifactError

    remote = open_remote(str(tmp_path / "remote"))
    outside = tmp_path / "outside"
    outside.mkdir()
    artifacts = tmp_path / "remote" / "neuron-compiled-artifacts"
    artifacts.mkdir(parents=True)
    (artifacts / ".claims").symlink_to(outside)
    with pytest.raises(RemoteArtifactError, match="symbolic link"):
        try_claim(remote, "cd" * 10, ttl_s=60)
    assert not list(outside.iterdir())


# -- real compiles ------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_compiles_of_three_entries_on_local_ray_one_failing(tmp_path: Path) -> None:
    """`neuronctl compile --plan --ray local` in its own process: two tiny models compiled
    and pushed by Ray tasks, the third (a checkpoint without tokenizer files, which compile
    refuses) reported failed with its log; exit 1."""
    make_checkpoint(tmp_path / "llama", "llama")
    make_checkpoint(tmp_path / "other", "llama", seed=1)
    make_checkpoint(tmp_path / "broken", "llama", seed=2, tokenizer=False)
    spec = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SMALLEST_SPEC.items())
    builds = "".join(f'\n[[build]]\nmodel = "./{m}"\n' for m in ("llama", "other", "broken"))
    (tmp_path / "builds.toml").write_text(f"[defaults]\n{spec}\n{builds}")
    remote = tmp_path / "remote"

    done = cli("compile", "--plan", "builds.toml", "--ray", "local", "--remote", str(remote),
               "--store", str(tmp_path / "store"), "-j", "1", "--json",
               cwd=tmp_path, env={"PYTHONPATH": str(REPO)})  # fmt: skip

    assert done.returncode == 1, done.stderr
    rows = json.loads(done.stdout)["builds"]
    assert [(r["name"], r["status"]) for r in rows] == [
        ("llama", "published"), ("other", "published"), ("broken", "failed"),
    ]
    assert "no tokenizer files" in rows[2]["reason"]
    assert "no tokenizer files" in Path(rows[2]["log"]).read_text()
    client = open_remote(str(remote))
    assert client.has(rows[0]["key"]) and client.has(rows[1]["key"])
    assert not client.has(rows[2]["key"])
