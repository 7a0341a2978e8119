"""Process lifecycle: a test killed by its timeout, a run killed outright (stage deaths: test_supervision)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import ROOT, Broker, creditflow_cmd, kill_group
from ipc import shm

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def test_a_test_killed_by_its_timeout_leaves_no_process_and_no_shared_memory(tmp_path):
    inner = tmp_path / "test_inner.py"
    inner.write_text(textwrap.dedent(f"""
        import sys, time, pytest
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from conftest import Broker

        @pytest.fixture
        def b(tmp_path):
            broker = Broker(tmp_path / "b")
            (tmp_path.parent / "info.txt").write_text(broker.info["run_id"] + " " + str(broker.proc.pid))
            yield broker
            broker.stop()

        @pytest.mark.timeout(3)
        def test_hangs(b):
            time.sleep(60)
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", str(inner), "-q", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "inner"), "-o", "timeout_method=signal"],
                          capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert "Timeout" in proc.stdout + proc.stderr, proc.stdout
    run_id, pid = (tmp_path / "inner" / "info.txt").read_text().split()
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    assert not shm.leftover_names(run_id=run_id)


@pytest.mark.alone       # any broker started beside it would clean up the killed run first
def test_a_run_killed_with_sigkill_is_cleaned_up_by_the_next_start(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(creditflow_cmd("run", "-z", "30", "--run-dir", str(run_dir), "--plain"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "broker.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)
        import json
        info = json.loads((run_dir / "broker.json").read_text())
        assert shm.leftover_names(run_id=info["run_id"])
        os.kill(info["pid"], signal.SIGKILL)          # the supervisor dies without cleaning up
        deadline = time.monotonic() + 10
        while psutil.pid_exists(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        kill_group(proc)
    assert shm.leftover_names(run_id=info["run_id"]), "nothing cleaned them yet"
    b = Broker(tmp_path / "next")
    try:
        assert not shm.leftover_names(run_id=info["run_id"]), "a new start removes what the killed run left"
    finally:
        b.stop()
