"""``creditflow demo`` end to end: every phase of a memory alarm, in order, and RabbitMQ's log lines."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, creditflow_cmd, kill_group

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_demo_sees_every_phase_in_order(tmp_path):
    run_dir = tmp_path / "demo"
    proc = subprocess.Popen(creditflow_cmd("demo", "--plain", "--run-dir", str(run_dir)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=280)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    at = summary["phases"]
    order = ["watermark lowered", "alarm set", "connection blocked", "publishing stopped", "backlog drained",
             "alarm cleared", "publishing resumed"]
    assert [at[p] for p in order] == sorted(at[p] for p in order), at
    assert summary["lost"] == 0
    assert any(a["source"] == "memory" for a in summary["alarms"])
    log = (run_dir / "broker.log").read_text()
    assert "memory resource limit alarm set on node" in log
    assert "*** Publishers will be blocked until this alarm clears ***" in log
    assert "memory resource limit alarm cleared on node" in log
    assert "What happened:" in out and "publishing resumed" in out
