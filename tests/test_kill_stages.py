"""``scripts/kill_stages --random``: stages killed at random under publishers with confirms (100 B,
8 KiB and 64 KiB bodies) and a consumer, all reconnecting pika clients; no confirmed message lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from ipc import shm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "kill_stages")

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]


def run(*args: str, timeout_s: float = 150) -> subprocess.CompletedProcess:
    """The script as a user runs it; if it overruns, it and the broker it started are killed (and the
    broker's shared memory removed) before the test fails."""
    proc = subprocess.Popen([sys.executable, SCRIPT, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.communicate()
        shm.cleanup_stale()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_random_kills_lose_no_confirmed_message(tmp_path):
    report = tmp_path / "kills.json"
    done = run("--random", "6", "--seed", "2", "--json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(report.read_text())
    assert result["confirmed"] > 100 and result["confirmed_lost"] == 0 and result["broker_alive"] is True
    assert sum(result["kills"].values()) >= 5 and len(result["kills"]) >= 2, result["kills"]
    # each kill is reported as a death, but one whose stage was ending by itself (its client closing)
    assert 0 < len(result["deaths"]) <= sum(result["kills"].values())
    assert "confirmed but never received 0" in done.stdout


def test_a_random_run_of_no_time_is_refused_before_anything_starts():
    done = run("--random", "0")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("--random takes a number of seconds above 0")
