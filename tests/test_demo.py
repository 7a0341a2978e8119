"""``creditflow demo`` end to end: every phase of a memory alarm, in order, and RabbitMQ's log lines.

The alarm must clear because memory came down with the backlog (not because
a watermark was raised), exactly once, and publishing must resume without
setting it again.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import ROOT, creditflow_cmd, kill_group

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(400)]
MIB = 1024 * 1024
ORDER = ["backlog growing", "watermark lowered", "alarm set", "connection blocked", "publishing stopped",
         "backlog halved|backlog drained", "alarm cleared", "watermark restored", "publishing resumed"]


def test_the_demo_sees_every_phase_in_order(tmp_path):
    run_dir = tmp_path / "demo"
    proc = subprocess.Popen(creditflow_cmd("demo", "--plain", "--run-dir", str(run_dir)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=380)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    at, notes = summary["phases"], summary["phase_notes"]
    seen = []
    for slot in ORDER:
        names = [n for n in slot.split("|") if n in at]
        assert len(names) == 1, f"{slot}: {at}"
        seen.append(names[0])
    assert [at[p] for p in seen] == sorted(at[p] for p in seen), at
    assert summary["lost"] == 0 and summary["undelivered"] == 0

    # the account tells the truth about the backlog: halved means at most half the peak, drained nearly none
    drain = seen[ORDER.index("backlog halved|backlog drained")]
    left, peak = map(int, re.match(r"(\d+) messages left of a peak of (\d+)", notes[drain]).groups())
    assert left * 2 <= peak if drain == "backlog halved" else left <= peak * 0.05, notes[drain]

    # the alarm cleared by memory coming down under the lowered watermark, once, and was not set again
    assert summary["memory_alarm_edges"] == {"set": 1, "cleared": 1}
    used, allowed = map(float, re.match(r"([\d.]+) MiB used <= ([\d.]+) MiB allowed", notes["alarm cleared"]).groups())
    lowered = summary["memory_line"]["target"] / MIB
    assert used <= allowed and abs(allowed - lowered) < 0.1, (notes["alarm cleared"], lowered)
    alarmed = [(t, used) for t, used, _, alarm, _ in summary["memory_timeline"] if alarm]
    assert alarmed[-1][1] < alarmed[0][1] - 32 * MIB, f"memory should fall while the alarm holds: {alarmed}"

    log = (run_dir / "broker.log").read_text()
    assert log.count("memory resource limit alarm set on node") == 1
    assert "*** Publishers will be blocked until this alarm clears ***" in log
    assert log.count("memory resource limit alarm cleared on node") == 1
    assert "What happened:" in out and "publishing resumed" in out and "memory alarm: set 1 time, cleared 1 time" in out
