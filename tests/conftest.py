"""Shared fixtures: a real broker process per test, and a leak check for the session.

Every broker a test starts runs in its own session (process group) and is
stopped in the fixture's finalizer, which pytest-timeout's signal method
still runs when a test times out. At the end of the session nothing started
here may still run and no ``creditflow-`` entry may remain in /dev/shm.

``./scripts/test`` runs two pytest workers side by side (pytest-xdist). A test
marked ``alone`` runs with no other test beside it: one that reads or cleans
what every broker shares (all of /dev/shm), or one whose figures a second
test's load on the two cores would change. Each worker checks the brokers it
started; the controller checks /dev/shm once both are done.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from amqp_targets import amqp, amqp_tls, rabbitmq_target, shared_broker  # noqa: F401  (the client tests' brokers)

ROOT = Path(__file__).resolve().parent.parent
CREDITFLOW = [sys.executable, "-c", "import sys; from pipeline.cli import main; sys.exit(main())"]
_started: list[subprocess.Popen] = []


def creditflow_cmd(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("creditflow")
    return [str(exe), *args] if exe.exists() else [*CREDITFLOW, *args]


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


class Broker:
    """A ``creditflow serve`` process and what a test needs to talk to it."""

    def __init__(self, data_dir: Path, extra: tuple[str, ...] = (), nofile: int | None = None):
        self.data_dir = data_dir
        self.log_path = data_dir.parent / f"{data_dir.name}.out"
        self.log = open(self.log_path, "w")

        def limit_fds():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        self.proc = subprocess.Popen(creditflow_cmd("serve", "--port", "0", "--data-dir", str(data_dir), *extra),
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=ROOT, preexec_fn=limit_fds)
        _started.append(self.proc)
        deadline = time.monotonic() + 30
        info = data_dir / "broker.json"
        while not info.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: {self.output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start: {self.output()}")
            time.sleep(0.02)
        self.info = json.loads(info.read_text())
        self.port = self.info["port"]

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def status(self) -> dict:
        from pipeline.ctlclient import CtlClient
        with CtlClient(str(self.data_dir)) as client:
            return client.request("status")

    def kill(self, name: str, how: str = "kill") -> dict:
        """Crash one stage at once (``ctl kill``): SIGKILL for a process of its own, the stage alone in a
        shared one; with ``how="crash"`` (``ctl crash``) make it raise in its host, as a bug would.
        Returns it as ``status`` showed it just before."""
        from pipeline.ctlclient import CtlClient
        before = self.process(name)
        with CtlClient(str(self.data_dir)) as client:
            assert client.request(how, name=name)["ok"]
        return before

    def process(self, prefix: str, timeout_s: float = 10.0) -> dict:
        """The one live process named ``prefix*``, once it has reported its statistics."""
        status = self.wait_for(lambda s: [p for n, p in s["processes"].items()
                                          if n.startswith(prefix) and p.get("alive")],
                               timeout_s, what=f"a live {prefix} process")
        procs = [p for n, p in status["processes"].items() if n.startswith(prefix) and p.get("alive")]
        assert len(procs) == 1, f"expected one live {prefix} process, got {procs}"
        return procs[0]

    def wait_for(self, predicate, timeout_s: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = self.status()
            try:
                if predicate(last):
                    return last
            except (KeyError, IndexError):
                pass  # the process or link has not reported yet
            time.sleep(0.05)
        brief = {name: {k: v for k, v in st.items() if not isinstance(v, (dict, list))}
                 for name, st in ((last or {}).get("processes") or {}).items()}
        raise AssertionError(f"timed out waiting for {what}; processes: {json.dumps(brief)[:6000]}")

    def stop(self) -> int:
        kill_group(self.proc)
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def start_broker(tmp_path):
    brokers: list[Broker] = []

    def start(*extra: str, name: str = "broker", nofile: int | None = None) -> Broker:
        b = Broker(tmp_path / name, tuple(extra), nofile)
        brokers.append(b)
        return b

    yield start
    for b in brokers:
        b.stop()


@pytest.fixture
def broker(start_broker):
    return start_broker()


def _leftover_shm() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if "creditflow-" in n)
    except FileNotFoundError:
        return []


def _owner(name: str) -> str | None:
    """The pid (as text) of the supervisor whose run id names a /dev/shm entry."""
    m = re.match(r"^(?:sem\.)?creditflow-(\d+)x", name)
    return m.group(1) if m else None


def _owner_alive(name: str) -> bool:
    owner = _owner(name)
    if owner is None:
        return False
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

@pytest.fixture
def children():
    """Forked child pids; any still running at teardown is killed and reaped."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def script_module(name: str):
    """``scripts/NAME.py`` loaded as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fork(body) -> int:
    """Run ``body()`` in a child that always leaves through ``os._exit`` (its return value, or 70)."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = body()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def raw_amqp_connection(port: int) -> socket.socket:
    """A socket past AMQP's handshake as a client without capabilities (open-ok read), for tests
    that write frames by hand."""
    from pamqp import commands, frame
    from pipeline.amqp import frames
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5)
    s.sendall(frames.PROTOCOL_HEADER)
    s.recv(65536)
    s.sendall(frame.marshal(commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                                        response="\0guest\0guest"), 0))
    _, _, tune = frame.unmarshal(s.recv(65536))
    # the server's own limits (RabbitMQ refuses a channel_max over its 2047)
    s.sendall(frame.marshal(commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max,
                                                       heartbeat=0), 0)
              + frame.marshal(commands.Connection.Open(), 0))
    s.recv(65536)
    return s


def run_group(cmd: list[str], timeout_s: float, stderr=subprocess.PIPE) -> tuple[int, str, str]:
    """Run ``cmd`` from the checkout in a process group of its own, killed however it ends:
    (exit code, stdout, stderr; None with ``stderr=subprocess.STDOUT``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True, cwd=ROOT)
    _started.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        kill_group(proc)
    return proc.returncode, out, err


def run_creditflow(run_dir: Path, *args: str, timeout_s: float = 90) -> tuple[int, str, dict]:
    """``creditflow run`` into ``run_dir``, its process group killed however it ends:
    (exit code, output, summary.json or {})."""
    code, out, _ = run_group(creditflow_cmd("run", "--run-dir", str(run_dir), "--plain", *args), timeout_s,
                             stderr=subprocess.STDOUT)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return code, out, summary


@pytest.fixture(scope="session")
def spark():
    """The one local SparkSession of a test session (two cores, as CI has)."""
    pytest.importorskip("pyspark")
    from pipeline.analytics.session import new_session
    session = new_session("local[2]")
    yield session
    session.stop()


def _worker(config) -> bool:
    return hasattr(config, "workerinput")


@pytest.fixture(scope="session", autouse=True)
def no_leftovers(request):
    """Fail the session if a broker it started left shared memory behind (its supervisor's pid names it)."""
    before = set(_leftover_shm())
    yield
    for proc in _started:
        kill_group(proc, grace_s=5)
    ours = {str(p.pid) for p in _started}
    leaked = [n for n in _leftover_shm() if n not in before and _owner(n) in ours]
    if not _worker(request.config):       # alone: anything new whose owner is gone is this session's too
        leaked += [n for n in _leftover_shm() if n not in before and n not in leaked and not _owner_alive(n)]
    if leaked:
        from ipc import shm
        shm.cleanup_stale()
        pytest.fail(f"tests left shared memory behind: {leaked}")


def pytest_sessionstart(session) -> None:
    session.config.stash[_SHM_BEFORE] = set(_leftover_shm())


def pytest_sessionfinish(session) -> None:
    """With workers, the controller's check once every worker has stopped its brokers: no entry new
    since the start whose owner is gone."""
    if _worker(session.config) or not getattr(session.config.option, "numprocesses", None):
        return
    before = session.config.stash.get(_SHM_BEFORE, set())
    leaked = [n for n in _leftover_shm() if n not in before and not _owner_alive(n)]
    if leaked:
        from ipc import shm
        shm.cleanup_stale()
        session.config.get_terminal_writer().line(f"tests left shared memory behind: {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SHM_BEFORE = pytest.StashKey[set]()


class _Turns:
    """This worker's hold on the lock the workers share (see pytest_runtest_protocol)."""

    def __init__(self, root: Path):
        self.turnstile = open(root / "creditflow-turnstile.lock", "a")
        self.tests = open(root / "creditflow-tests.lock", "a")
        self.held: int | None = None        # fcntl.LOCK_SH or LOCK_EX while held

    def take(self, mode: int) -> None:
        if self.held == mode:
            return
        self.release()
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.tests, mode)
            self.held = mode
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self.tests, fcntl.LOCK_UN)
            self.held = None


_TURNS = pytest.StashKey[_Turns]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under workers, hold the shared side of a lock all workers open through a test, setup and
    teardown included, or its exclusive side through one marked ``alone`` (kept while the next test of
    this worker is one too, so that a module of them waits for the other worker once); a turnstile lets
    an ``alone`` test in ahead of the tests queued after it. The shared side is let go after each test,
    or a worker running test after test would keep an ``alone`` test waiting. Outermost, so the wait is
    not part of the test's timeout."""
    if not _worker(item.config):
        return (yield)
    turns = item.config.stash.get(_TURNS, None)
    if turns is None:
        turns = item.config.stash[_TURNS] = _Turns(item.config._tmp_path_factory.getbasetemp().parent)
    alone = item.get_closest_marker("alone") is not None
    turns.take(fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    try:
        return (yield)
    finally:
        if not alone or nextitem is None or nextitem.get_closest_marker("alone") is None:
            turns.release()


def _terminated(signum, _frame) -> None:
    """pytest itself told to stop (a CI step's timeout, a kill of the run): stop every broker and
    load run it started, with their shared memory, before leaving."""
    for proc in _started:
        kill_group(proc, grace_s=3)
    from ipc import shm
    shm.cleanup_stale()
    os._exit(128 + signum)


def pytest_configure(config) -> None:
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGHUP, _terminated)


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs of the given size at a fresh directory (root only); unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str, at: Path | None = None) -> Path:
        where = at or tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"a small file system is needed and tmpfs cannot be mounted here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(directory: Path, leave_bytes: int) -> Path:
    """A filler file that leaves about ``leave_bytes`` free on ``directory``'s file system."""
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    filler = directory / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return filler
