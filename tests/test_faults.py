"""Faults and hostile inputs leave a working host: a dead engine fails what it held and says so
on /health; one request's cost is capped; a client that leaves costs nothing but its own work.

The server tests run the app in-process over tests/fake_runner.py (no compiled artifact).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuronctl.engine.engine import Engine
from neuronctl.engine.errors import EngineDeadError, RequestError
from neuronctl.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from neuronctl.engine.scheduler import Scheduler, SchedulerOutput
from neuronctl.server.app import create_app
from neuronctl.store.gc import collect
from neuronctl.store.lease import unused
from neuronctl.store.local import Store
from tests.conftest import SMALLEST_SPEC
from tests.fake_runner import EOS_ID, FakeRunner, byte_decoder
from tests.hang_worker import Job, hang, hang_below
from tests.helpers import cli_in_process, spec_flags, wait_until
from tests.test_store import manifest

ROOT = Path(__file__).resolve().parents[1]

DEADLINE = 30  # seconds: a wait that passes this is the hang under test


class ByteModel:
    """The TextModel the app needs: one token per Latin-1 byte."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("latin-1", "replace"))

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        return self.encode("".join(str(m.get("content", "")) for m in messages))


class FailingScheduler(Scheduler):
    """Schedules normally until `fail` is set, then raises inside the engine loop."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self.fail = threading.Event()

    def schedule(self) -> SchedulerOutput:
        if self.fail.is_set():
            raise RuntimeError("injected scheduler failure")
        return super().schedule()


def engine_over(runner: FakeRunner, **kw: Any) -> Engine:
    return Engine(runner, byte_decoder, eos_ids=[EOS_ID], **kw)


def result_within(handle: Any, seconds: float = DEADLINE) -> Any:
    """handle.result() in a thread, with a deadline: a hang fails the test, not the suite."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(handle.result()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"no result within {seconds} s: the request hangs"
    return box[0]


# -- a dead engine -------------------------------------------------------------------------------


def test_a_dead_engine_fails_what_it_held_and_refuses_new_work() -> None:
    """Any exception escaping the engine loop used to end the thread silently: every request
    waited forever. Now each held request ends with an error and submit raises
    EngineDeadError (HTTP 503)."""
    runner = FakeRunner(batch_size=2, seq_len=64, step_delay=0.01)
    scheduler = FailingScheduler(2)
    engine = engine_over(runner, scheduler=scheduler)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    handles = [engine.submit([1 + i, 2], params) for i in range(3)]  # 2 running, 1 waiting
    engine.start()
    scheduler.fail.set()
    outputs = [result_within(h) for h in handles]
    assert all(o.finish_reason == "error" for o in outputs)
    assert all("injected scheduler failure" in (o.error or "") for o in outputs)
    with pytest.raises(EngineDeadError, match="engine failed"):
        engine.submit([1], params)


def test_health_turns_503_when_the_engine_dies(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM answers /health with 503 once its engine is dead
    (vllm-project/vllm, vllm/entrypoints/serve/instrumentator/health.py: `except
    EngineDeadError: return Response(status_code=503)`); a new request gets 503 too."""
    scheduler = FailingScheduler(1)
    engine = engine_over(FakeRunner(batch_size=1), scheduler=scheduler).start()
    app = create_app(engine, ByteModel(), "fake")

    async def probe() -> tuple[int, int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            before = (await client.get("/health")).status_code
            scheduler.fail.set()
            handle = engine.submit([1], SamplingParams(temperature=0, max_tokens=2))
            await asyncio.to_thread(result_within, handle)
            after = (await client.get("/health")).status_code
            body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
            refused = (await client.post("/v1/completions", json=body)).status_code
            return before, after, refused

    with caplog.at_level(logging.ERROR, logger="neuronctl.engine.engine"):
        assert asyncio.run(probe()) == (200, 503, 503)
    assert "engine thread failed" in caplog.text  # the traceback is logged, once


def test_a_failed_batched_prefill_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The engine retries a failed batched prefill one prompt at a time; the failure was
    swallowed without a line in the log."""
    runner = FakeRunner(batch_size=4, fail_prefill_on=99)
    engine = engine_over(runner)
    params = SamplingParams(temperature=0, max_tokens=3)
    handles = [engine.submit(p, params) for p in ([99, 1], [2], [3])]
    with caplog.at_level(logging.WARNING, logger="neuronctl.engine.engine"):
        engine.start()
        outputs = [result_within(h) for h in handles]
        engine.stop()
    assert [o.finish_reason for o in outputs] == ["error", "length", "length"]
    assert "batched prefill of 3 prompts failed" in caplog.text
    assert "injected prefill failure" in caplog.text


# -- per-request caps ----------------------------------------------------------------------------


def test_stop_strings_are_capped_in_count_and_total_length() -> None:
    """400,000 stop strings (7.8 MB, under the body limit) made every token of every request
    in the batch pay for matching them on the engine thread."""
    engine = engine_over(FakeRunner(batch_size=1))
    many = tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))
    with pytest.raises(RequestError, match="stop strings") as err:
        engine.submit([1], SamplingParams(stop=many))
    assert err.value.param == "stop"
    with pytest.raises(RequestError, match="characters"):
        engine.submit([1], SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),)))
    at_cap = tuple("ab"[i % 2] * (MAX_STOP_CHARS // MAX_STOP_STRINGS) for i in range(16))
    engine.start()
    out = engine.submit([1], SamplingParams(temperature=0, max_tokens=2, stop=at_cap)).result()
    engine.stop()
    assert out.finish_reason in ("length", "stop")


def test_a_tiny_top_p_samples_the_top_token() -> None:
    """top_p=1e-300 passed validation and then, compared in float32 (where it is 0), kept no
    token at all: multinomial failed and the request was a 500."""
    engine = engine_over(FakeRunner(batch_size=1)).start()
    greedy = engine.submit([7, 8], SamplingParams(temperature=0, max_tokens=4)).result()
    tiny = engine.submit([7, 8], SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=4))
    out = tiny.result()
    engine.stop()
    assert out.finish_reason == "length", out.error
    assert out.token_ids == greedy.token_ids  # only the most likely token survives top_p


def test_a_non_streaming_client_that_leaves_is_a_499_not_a_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`whole` cancelled its collector and read the result of the still-pending task:
    InvalidStateError escaped as an ASGI traceback and /metrics counted a 500."""
    runner = FakeRunner(batch_size=1, seq_len=512, step_delay=0.02)
    engine = engine_over(runner).start()
    app = create_app(engine, ByteModel(), "fake")
    body = json.dumps(
        {"model": "fake", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    ).encode()
    statuses: list[int] = []

    async def leave() -> None:
        first = True

        async def receive() -> dict[str, Any]:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            while engine.stats()["running"] == 0:  # disconnect once generation is under way
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        }  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), DEADLINE)

    with caplog.at_level(logging.ERROR):
        asyncio.run(leave())
    metrics = app.state.metrics.render().decode()
    engine.stop()
    assert statuses == [499]
    assert "InvalidStateError" not in caplog.text
    assert 'code="500"' not in metrics and 'code="499"' in metrics


# -- gc and running servers ----------------------------------------------------------------------

HOLDER = """
import sys
from neuronctl.store.lease import hold
lease = hold(sys.argv[1])
print("held" if lease.held else "no lease", flush=True)
sys.stdin.read()
"""


def test_gc_keeps_an_artifact_a_running_process_holds_until_it_dies(tmp_path: Path) -> None:
    """`artifacts gc` removed the artifact a running server used; its next request was a 500
    while /health said ok. A loading process holds a lease (a shared flock) that gc will not
    break; SIGKILL drops it and the next gc removes the artifact."""
    store = Store(tmp_path)
    for key in ("old", "new"):
        store.publish(key, lambda staging, key=key: manifest(key))
    old = store.path("old")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(old)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        report = collect(store, keep_last=0)
        assert report.in_use == [old] and old.is_dir()
        assert [p.name for p in report.removed] == ["new"]
        refused = cli_in_process("artifacts", "rm", "old", "--store", str(tmp_path))
        assert refused.returncode == 1 and "in use by a running process" in refused.stderr
        assert old.is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(DEADLINE)
    assert [p.name for p in collect(store, keep_last=0).removed] == ["old"]
    assert not old.exists()


def test_loading_an_artifact_takes_its_lease(tmp_path: Path, monkeypatch: Any) -> None:
    """open_artifact holds the lease before it reads anything (serve, generate, bench)."""
    from neuronctl.engine import loader

    store = Store(tmp_path)
    store.publish("k", lambda staging: manifest("k"))
    seen: list[bool] = []

    def fail_load(root: Path) -> None:
        with unused(root) as free:
            seen.append(free)
        raise RuntimeError("stop here")

    monkeypatch.setattr(loader, "check_reusable", fail_load)
    with pytest.raises(RuntimeError, match="stop here"):
        loader.open_artifact(store.path("k"))
    assert seen == [False]
    with unused(store.path("k")) as free:  # a load that fails lets go of its lease
        assert free


# -- the kernel build ----------------------------------------------------------------------------

def hold_build_lock(folder: Path, locked: Any) -> None:
    """A forked holder of the build lock: the lock module imports torch, which a fresh
    interpreter would take seconds to import again."""
    import time

    from neuronctl.backends.torch.kernel import build_lock

    with build_lock(folder, 60):
        locked.set()
        time.sleep(600)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_build_lock_whose_holder_was_killed_is_taken_over(tmp_path: Path) -> None:
    """torch's cpp_extension lock is a file that exists while a build runs; its waiters loop
    while it exists (pytorch/pytorch, torch/utils/file_baton.py, FileBaton.wait), so a build
    killed with SIGKILL made every later kernel build hang forever. neuronctl's build lock is
    a flock, which dies with its holder, and under it the stale torch file is removed."""
    import multiprocessing

    from neuronctl.backends.torch.internals import CPP_EXTENSION_BATON
    from neuronctl.backends.torch.kernel import build_lock

    fork = multiprocessing.get_context("fork")
    locked = fork.Event()
    holder = fork.Process(target=hold_build_lock, args=(tmp_path, locked), daemon=True)
    holder.start()
    assert locked.wait(DEADLINE), "the holder never took the lock"
    (tmp_path / CPP_EXTENSION_BATON).write_text("")  # what a killed cpp_extension build leaves
    from neuronctl.errors import BuildError

    with pytest.raises(BuildError, match="another process"):  # alive: waited for, bounded
        with build_lock(tmp_path, 0.3):
            pass
    holder.kill()  # SIGKILL
    holder.join(DEADLINE)
    with build_lock(tmp_path, DEADLINE):  # dead: taken over at once
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_kernel_build_past_its_timeout_is_killed_with_its_compilers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpp_extension.load had no timeout, and its ninja and compiler processes outlived a
    killed compile. ninja puts each command in a process group of its own (ninja-build/ninja,
    src/subprocess-posix.cc, Subprocess::Start: POSIX_SPAWN_SETPGROUP, "so ctrl-c won't reach
    it"), so a group kill misses them. At the timeout the build child kills every process
    below it."""
    import time

    from neuronctl.backends.torch import kernel
    from neuronctl.errors import BuildError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built: a full build
    monkeypatch.setenv(kernel.BUILD_TIMEOUT_ENV, "8")  # past start-up, inside the compile
    build_dir = kernel.kernel_cache_dir()
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            seen.update(command(pid) for pid in working_in(build_dir))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(BuildError, match="did not finish in 8 s"):
            kernel._build()
    finally:
        done.set()
        watcher.join()
    assert seen & COMPILERS, f"no compiler ran before the timeout: {seen}"
    deadline = time.monotonic() + 5  # SIGKILLed already; their exits may take a moment
    while working_in(build_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [command(p) for p in working_in(build_dir)] == []
    with kernel.build_lock(build_dir, 1):  # nothing of the build holds it
        pass


def working_in(folder: Path) -> list[int]:
    """Live processes whose working directory is `folder` (ninja and what it runs)."""
    pids = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)) == folder and alive(int(cwd.parent.name)):
                pids.append(int(cwd.parent.name))
        except OSError:
            continue
    return pids


def test_a_stamped_library_skips_the_build_child_until_it_changes(tmp_path: Path) -> None:
    """Loading an already-built kernel starts no build child; a library left half-written
    by a killed link (no stamp) or rebuilt since (another mtime) is built again."""
    import os

    from neuronctl.backends.torch import kernel

    library = tmp_path / "neuronctl_kernel_x.so"
    library.write_bytes(b"half a link")
    assert not kernel._built(library)
    kernel._stamp(library)
    assert kernel._built(library)
    os.utime(library, ns=(1, 1))
    assert not kernel._built(library)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_during_a_kernel_build_leaves_no_compiler_and_the_next_build_proceeds(
    tmp_path: Path,
) -> None:
    """SIGKILL a compile in the middle of the kernel build: its compiler processes die with
    it (seven survived), and the next build in the same cache finishes (it hung forever on
    the lock file the killed build left)."""
    import os
    import time

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = "from neuronctl.backends.torch import kernel; kernel.load(); print('built')"
    first = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    compilers: list[int] = []
    while not compilers and time.monotonic() < deadline:
        time.sleep(0.05)  # until a compiler runs under the build
        compilers = [p for p in descendants(first.pid) if command(p) in COMPILERS]
    assert compilers, "no compiler ever ran"
    below = descendants(first.pid)
    first.send_signal(signal.SIGKILL)
    first.wait(DEADLINE)
    deadline = time.monotonic() + DEADLINE
    while [p for p in below if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [f"{p} {command(p)}" for p in below if alive(p)]
    assert not survivors, f"processes of the build survived: {survivors}"
    second = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert second.returncode == 0 and "built" in second.stdout, second.stderr


COMPILERS = {"ninja", "c++", "g++", "cc1plus", "clang++", "clang", "ld", "collect2", "as"}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_during_an_inductor_compile_leaves_no_compiler_and_the_next_compile_proceeds(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """SIGKILL a compile while AOTInductor runs the C++ compiler below a graph worker. The
    workers died with the compile, but the compilers AOTInductor started in them
    (pytorch/pytorch, torch/_inductor/cpp_builder.py, _run_compile_cmd: subprocess.run of the
    compile command; line 693 in torch 2.13.0) ran on, orphaned: for minutes, and gigabytes,
    on a large model. The tiny model's compilers finish in seconds, so the test stops them
    (SIGSTOP) before the kill: only a kill ends them then. The next compile, in the same
    inductor cache, finishes."""
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip
    spec = {**SMALLEST_SPEC, "compiler": "inductor", "context_buckets": "16,32"}  # 3 graphs
    argv = [sys.executable, "-m", "neuronctl.cli.main", "compile", str(tiny_llama)]
    argv += [*spec_flags(spec), "--store", str(tmp_path / "store"), "--jobs", "2", "--json"]
    first = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    stopped: list[int] = []

    def stop_graph_compilers() -> bool:
        assert first.poll() is None, "the compile finished before a graph compiler was seen"
        table = parents()
        for worker in graph_workers(first.pid):
            # AOTInductor's own, not the kernel build's (whose child runs ninja)
            for pid in [p for p, ppid in table.items() if ppid == worker]:
                if command(pid) in COMPILERS:
                    stopped.extend(p for p in [pid, *descendants(pid)] if stop(p))
        return bool(stopped)

    try:
        wait_until(stop_graph_compilers, 300, "a C++ compiler below a graph worker")
        below = descendants(first.pid)
    finally:
        first.kill()  # SIGKILL
        first.wait(DEADLINE)
    deadline = time.monotonic() + 10
    while [p for p in below if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in below if alive(p)]
    report = [f"{p} {command(p)}" for p in survivors]
    for pid in survivors:  # before failing
        kill(pid)
    assert not report, f"processes of the compile survived it: {report}"
    second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert Path(json.loads(second.stdout)["path"]).is_dir()


def graph_workers(compile_pid: int) -> list[int]:
    """The compile's spawned pool workers (not the resource tracker, also a child)."""
    return [pid for pid in descendants(compile_pid) if b"spawn_main" in cmdline(pid)]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def stop(pid: int) -> bool:
    """SIGSTOP `pid`; False when it is gone already."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    return alive(pid)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def parents() -> dict[int, int]:
    """pid -> parent pid of every live process (/proc/PID/stat, field 4)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = int(fields[1])
    return table


def descendants(root: int) -> list[int]:
    table = parents()
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in table.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# -- config and spec bounds ----------------------------------------------------------------------


def with_config(tiny_llama: Path, tmp_path: Path, text: str) -> Path:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "config.json").write_text(text)
    return ckpt


def edited(tiny_llama: Path, **changes: Any) -> str:
    config = json.loads((tiny_llama / "config.json").read_text())
    return json.dumps({**config, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": 10**8}, "num_hidden_layers is 100000000; it must be an integer"),
        ({"hidden_size": "64"}, "hidden_size is '64'"),
        ({"num_attention_heads": True}, "num_attention_heads is True"),
        ({"vocab_size": 0}, "vocab_size is 0"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps is -1.0"),
    ],
)
def test_config_values_are_range_checked_before_anything_is_built(
    tiny_llama: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    """num_hidden_layers 10**8 drove compile to 20.8 GB before any tensor was compared; a
    string "64" was read as 64."""
    from neuronctl.checkpoints.reader import open_local
    from neuronctl.errors import CheckpointError

    ckpt = with_config(tiny_llama, tmp_path, edited(tiny_llama, **changes))
    with pytest.raises(CheckpointError, match=message):
        open_local(str(ckpt), ckpt)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"rope_theta": NaN, "architectures": ["LlamaForCausalLM"]}', "NaN is not a number"),
        ("DEEP", "nested too deeply"),
        ('{"a": ' * 40 + "1" + "}" * 40, "nested over 32 levels"),
    ],
    ids=["nan", "100k-deep", "40-deep"],
)
def test_nan_and_deep_configs_are_one_line_errors(
    tiny_llama: Path, tmp_path: Path, text: str, message: str
) -> None:
    """NaN rope_theta and a 100,000-deep config.json were "internal error" (exit 70)."""
    if text == "DEEP":
        text = "[" * 100_000 + "]" * 100_000
    ckpt = with_config(tiny_llama, tmp_path, text)
    result = cli_in_process("inspect", str(ckpt))
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "internal error" not in result.stderr


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("seq_len = true", "seq_len"),
        ("batch_size = 1e9", "batch_size"),
        ("seq_len = 100000000", "seq_len"),
        ("quantized = 1", "quantized"),
        ("context_buckets = [true]", "context_buckets"),
        ("on_device_sampling = {do_sample = 'yes'}", "on_device_sampling"),
    ],
)
def test_spec_types_are_strict_and_bounded(tmp_path: Path, toml: str, field: str) -> None:
    """`seq_len = true` in a TOML was read as seq_len 1."""
    from neuronctl.errors import SpecError
    from neuronctl.spec import resolve_spec

    path = tmp_path / "neuronctl.toml"
    path.write_text(toml + "\n")
    with pytest.raises(SpecError) as err:
        resolve_spec(config_file=path, env={})
    assert field in str(err.value)


@pytest.mark.parametrize("value", ["١٢٨,٢٥٦", "1_28", "128,２５６"])
def test_bucket_variables_take_ascii_digits_only(value: str) -> None:
    """int() reads Arabic-Indic and full-width digits and underscores: NEURON_*_BUCKETS
    written in them passed as buckets."""
    from neuronctl.errors import SpecError
    from neuronctl.spec import resolve_spec

    with pytest.raises(SpecError, match="comma-separated list of integers"):
        resolve_spec(env={"NEURON_CONTEXT_LENGTH_BUCKETS": value})


# -- graph workers -------------------------------------------------------------------------------


def test_a_graph_worker_that_hangs_is_killed_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graph workers had no timeout: one stuck compile held `compile` forever."""
    import os

    from neuronctl.backends.torch import graphs
    from neuronctl.errors import BuildError

    monkeypatch.setenv(graphs.GRAPH_TIMEOUT_ENV, "5")
    jobs = [Job(f"context_encoding_{bucket}", str(tmp_path)) for bucket in (64, 128)]
    bars = {job.name: (lambda _: None) for job in jobs}
    with pytest.raises(BuildError, match="no graph finished in 5 s"):
        graphs._build_in_pool(jobs, 2, bars, build=hang)  # type: ignore[arg-type]
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert pids, "the workers never started"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_graph_workers_killed_at_the_timeout_take_what_runs_below_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed at the graph timeout with SIGKILL left its compiler running, orphaned
    (and a compiler that hangs is what the timeout is for): the workers are asked to stop
    first, and kill what runs below them."""
    from neuronctl.backends.torch import graphs
    from neuronctl.errors import BuildError

    monkeypatch.setenv(graphs.GRAPH_TIMEOUT_ENV, "5")
    jobs = [Job(f"context_encoding_{bucket}", str(tmp_path)) for bucket in (64, 128)]
    bars = {job.name: (lambda _: None) for job in jobs}
    with pytest.raises(BuildError, match="no graph finished in 5 s"):
        graphs._build_in_pool(jobs, 2, bars, build=hang_below)  # type: ignore[arg-type]
    trees = [int(p) for note in tmp_path.glob("*.tree") for p in note.read_text().split()]
    assert len(trees) == 4, "the workers never started"
    try:
        wait_until(lambda: not any(alive(p) for p in trees), 10, "the workers and below them")
    finally:
        for pid in trees:
            if alive(pid):
                kill(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_graph_workers_kill_what_runs_below_them_and_not_their_group_when_the_compile_dies(
    tmp_path: Path,
) -> None:
    """A SIGKILLed compile's graph workers die with it and take what runs below them along
    (AOTInductor's compiler ran on, orphaned), but leave the compile's process group alone: it
    may hold the user's shell pipeline or a test runner (here, a bystander in the group)."""
    code = (
        "import subprocess, sys\n"
        "from neuronctl.backends.torch import graphs\n"
        "from tests.hang_worker import Job, hang_below\n"
        "print(subprocess.Popen(['sleep', '600']).pid, flush=True)\n"
        "jobs = [Job(f'context_encoding_{b}', sys.argv[1]) for b in (64, 128)]\n"
        "graphs._build_in_pool(jobs, 2, {j.name: print for j in jobs}, build=hang_below)\n"
    )
    compile_ = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True, text=True,
    )  # fmt: skip
    assert compile_.stdout is not None
    bystander = int(compile_.stdout.readline())
    try:
        wait_until(lambda: len(list(tmp_path.glob("*.tree"))) == 2, DEADLINE, "both workers")
        trees = [int(p) for note in tmp_path.glob("*.tree") for p in note.read_text().split()]
    finally:
        compile_.kill()  # SIGKILL
        compile_.wait(DEADLINE)
    try:
        wait_until(lambda: not any(alive(p) for p in trees), 10, "the workers and below them")
        assert alive(bystander), "a graph worker killed its compile's process group"
    finally:
        for pid in [bystander, *trees]:
            if alive(pid):
                kill(pid)


# -- generate --engine vllm ----------------------------------------------------------------------


def test_generate_with_vllm_leaves_no_prompts_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each `generate --engine vllm` run wrote its prompts to a mkstemp file (and leaked the
    descriptor) that nothing removed after exec; now the file lives while the program runs."""
    import tempfile

    from neuronctl.vllm.launch import VllmLaunch, run_with_prompts

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "seen.txt"
    reader = "import sys, pathlib; pathlib.Path(sys.argv[2]).write_text(open(sys.argv[1]).read())"

    def launch_for(prompts_file: Path | None) -> VllmLaunch:
        return VllmLaunch([sys.executable, "-c", reader + "; sys.exit(3)", str(prompts_file),
                           str(out)], {})  # fmt: skip

    lines = '{"prompt": "hi"}\n'
    for _ in range(2):
        assert run_with_prompts(lines, launch_for) == 3  # its exit status comes back
        assert out.read_text() == lines
    assert list((tmp_path / "tmp").iterdir()) == []


EXEC_HOLDER = """
import os, sys
from neuronctl.store.lease import hold
hold(sys.argv[1], across_exec=True)
after = "import sys; print('exec', flush=True); sys.stdin.read()"
os.execv(sys.executable, [sys.executable, "-c", after])
"""


def test_a_lease_taken_across_exec_is_held_by_the_program_execd(tmp_path: Path) -> None:
    """`serve --engine vllm` execs vLLM: the lease it takes first must outlive the exec, or
    gc would remove what vLLM serves."""
    store = Store(tmp_path)
    store.publish("k", lambda staging: manifest("k"))
    held = subprocess.Popen(
        [sys.executable, "-c", EXEC_HOLDER, str(store.path("k"))],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert held.stdout is not None and held.stdout.readline().strip() == "exec"
        assert collect(store, keep_last=0).in_use == [store.path("k")]
    finally:
        held.kill()
        held.wait(DEADLINE)
    assert [p.name for p in collect(store, keep_last=0).removed] == ["k"]


def test_a_request_dropped_in_the_step_that_killed_the_engine_still_ends() -> None:
    """A cancelled request leaves the scheduler when the step is scheduled; if ending it
    raises (here its detokenizer's flush), the engine dies with it out of the scheduler's
    reach, and it must still get its last event."""

    class FlushFails:
        def __call__(self, token_id: int) -> str:
            return chr(token_id) if token_id < 256 else ""

        def flush(self) -> str:
            raise RuntimeError("injected flush failure")

    runner = FakeRunner(batch_size=1, seq_len=512, step_delay=0.01)
    engine = Engine(runner, FlushFails, eos_ids=[EOS_ID])
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    handle = engine.submit([1, 2], params)
    engine.start()
    next(iter(handle))  # generating
    handle.cancel()
    out = result_within(handle)
    assert out.finish_reason == "error" and "injected flush failure" in (out.error or "")


@pytest.mark.parametrize("text", ["abc", "0", "-5", "inf", "nan"])
def test_a_timeout_variable_that_is_not_seconds_is_a_usage_error(monkeypatch, text):
    """A typo in a timeout variable must not turn the timeout off or crash: both the kernel
    build's and the graph workers' say what they want (exit 2), and unset means the default."""
    from neuronctl.backends.torch import graphs, kernel
    from neuronctl.errors import UsageError

    for name, read in ((kernel.BUILD_TIMEOUT_ENV, kernel.build_timeout),
                       (graphs.GRAPH_TIMEOUT_ENV, graphs.graph_timeout)):
        monkeypatch.setenv(name, text)
        with pytest.raises(UsageError, match=name):
            read()
        monkeypatch.delenv(name)
    assert kernel.build_timeout() == kernel.DEFAULT_BUILD_TIMEOUT
    assert graphs.graph_timeout() == graphs.DEFAULT_GRAPH_TIMEOUT
