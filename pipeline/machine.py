"""What a benchmark's figures were measured on, printed above them.

Rates on one 2-core machine differ from another's by more than any change to the broker: the same code
delivered 120,300 msg/s of 100 B on one machine and 51,350 on another, and on a machine whose TCP
congestion control is BBR, which paces sends even on loopback, 64 KiB messages moved 7-18% slower
through creditflow than under CUBIC (3 alternated runs; RabbitMQ gained too: README *Side by side with
RabbitMQ*). So ``creditflow bench`` and the scripts that measure against RabbitMQ say which machine
they ran on.
"""

from __future__ import annotations

import os
import platform
import sys


def _first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def cpu_model(proc: str = "/proc") -> str | None:
    try:
        with open(os.path.join(proc, "cpuinfo")) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip() or None
    except OSError:
        pass
    return None


def describe(proc: str = "/proc") -> dict:
    """This machine, as a benchmark's JSON keeps it (a field it cannot read is None)."""
    loadavg = _first_line(os.path.join(proc, "loadavg"))
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(proc),
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "python_executable": os.path.realpath(sys.executable),
            "tcp_congestion_control": _first_line(os.path.join(proc, "sys/net/ipv4/tcp_congestion_control")),
            "load_average_1m": float(loadavg.split()[0]) if loadavg else None}


def line(machine: dict) -> str:
    """One line for the top of a benchmark's output."""
    model = f" ({machine['cpu_model']})" if machine.get("cpu_model") else ""
    cc = machine.get("tcp_congestion_control") or "unknown"
    load = machine.get("load_average_1m")
    return (f"machine: {machine.get('cpus')} cores{model}, {machine.get('python')} ({machine.get('python_executable')}), "
            f"TCP congestion control {cc}, load average {'unknown' if load is None else f'{load:.2f}'}")
