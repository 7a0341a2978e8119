"""The machine a benchmark says it ran on: read from /proc, printed above the figures, kept in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from pipeline import machine


def fake_proc(tmp_path, cpuinfo=None, loadavg=None, congestion=None) -> str:
    if cpuinfo is not None:
        (tmp_path / "cpuinfo").write_text(cpuinfo)
    if loadavg is not None:
        (tmp_path / "loadavg").write_text(loadavg)
    if congestion is not None:
        (tmp_path / "sys/net/ipv4").mkdir(parents=True)
        (tmp_path / "sys/net/ipv4/tcp_congestion_control").write_text(congestion)
    return str(tmp_path)


def test_it_reads_the_cpu_model_the_tcp_congestion_control_and_the_load_from_proc(tmp_path):
    proc = fake_proc(tmp_path, cpuinfo="processor\t: 0\nmodel name\t: AMD EPYC 7B13\n\nprocessor\t: 1\n"
                                       "model name\t: AMD EPYC 7B13\n",
                     loadavg="1.79 0.92 0.41 3/211 4242\n", congestion="bbr\n")
    m = machine.describe(proc)
    assert (m["cpu_model"], m["tcp_congestion_control"], m["load_average_1m"]) == ("AMD EPYC 7B13", "bbr", 1.79)
    assert m["cpus"] == os.cpu_count() and m["python_executable"] == os.path.realpath(sys.executable)
    assert machine.line(m) == (f"machine: {os.cpu_count()} cores (AMD EPYC 7B13), {m['python']} "
                               f"({os.path.realpath(sys.executable)}), TCP congestion control bbr, load average 1.79")


def test_what_it_cannot_read_is_said_to_be_unknown(tmp_path):
    m = machine.describe(fake_proc(tmp_path))
    assert (m["cpu_model"], m["tcp_congestion_control"], m["load_average_1m"]) == (None, None, None)
    assert machine.line(m).endswith("TCP congestion control unknown, load average unknown")
    assert "()" not in machine.line(m)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_creditflow_bench_prints_the_machine_first_and_keeps_it_in_its_json(tmp_path):
    """``--only`` picks a micro-benchmark by name as it picks scenarios: here the credit core's alone."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "--only", "credit core", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    first, *rest = proc.stdout.splitlines()
    results = json.loads(out.read_text())
    kept = results["machine"]
    assert first == machine.line(kept)
    assert kept["cpus"] == os.cpu_count()
    congestion = "/proc/sys/net/ipv4/tcp_congestion_control"
    if os.path.exists(congestion):
        with open(congestion) as f:
            assert f"TCP congestion control {f.read().strip()}," in first
    assert len(rest) == 1 and rest[0].startswith("credit core send+ack") and rest[0].endswith("messages/s")
    assert list(results["micro"]) == ["credit core send+ack"] and results["scenarios"] == []
    assert "alarm_reaction" not in results and "tracing" not in results
