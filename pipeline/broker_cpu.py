"""Where a run's CPU goes: each kind of broker process's CPU time per message delivered.

``CpuWindow`` takes two readings while the load runs (its first full second and its last) and
divides each kind's CPU time between them by the messages delivered between them, so start-up
(imports, spawning, connection set-up) and the drain after the load are not counted. Kinds are
the processes' as ``ctl status`` names them (reader, channel, queue, store, watchdog; a host
process counts as the kind it hosts) plus ``supervisor``; a child the status does not name (the
management process) counts under its process title.

The arithmetic is pure (:func:`per_message`); :func:`read` is the one place that asks the
operating system (psutil: user + system time of the supervisor and its children).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Reading:
    delivered: int
    cpu_s: dict[int, tuple[str, float]]       # pid -> (kind, user + system seconds)


def kinds_by_pid(status: dict) -> dict[int, str]:
    """The kind of each broker process a ``ctl status`` names (hosts as the kind they host)."""
    out: dict[int, str] = {}
    for p in (status.get("processes") or {}).values():
        if p.get("alive") and p.get("pid"):
            out[int(p["pid"])] = str(p.get("kind"))
    for h in (status.get("hosts") or {}).values():
        out[int(h["pid"])] = str(h["kind"])
    if status.get("pid"):
        out[int(status["pid"])] = "supervisor"
    return out


def read(status: dict, delivered: int) -> Reading:
    """The CPU time so far of the supervisor and every process under it."""
    kinds = kinds_by_pid(status)
    cpu: dict[int, tuple[str, float]] = {}
    try:
        top = psutil.Process(int(status["pid"]))
        procs = [top, *top.children(recursive=True)]
    except (psutil.Error, KeyError, TypeError, ValueError):
        return Reading(delivered, cpu)
    for proc in procs:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                kind = kinds.get(proc.pid) or proc.name()
        except psutil.Error:
            continue
        cpu[proc.pid] = (kind, times.user + times.system)
    return Reading(delivered, cpu)


def per_message(first: Reading, last: Reading) -> dict | None:
    """Each kind's CPU µs per message delivered between the readings (a process that started between
    them counts from zero); None when nothing was delivered between them."""
    messages = last.delivered - first.delivered
    if messages <= 0:
        return None
    by_kind: dict[str, float] = {}
    for pid, (kind, cpu_s) in last.cpu_s.items():
        before = first.cpu_s.get(pid)
        spent = cpu_s - (before[1] if before is not None and before[0] == kind else 0.0)
        by_kind[kind] = by_kind.get(kind, 0.0) + max(0.0, spent)
    us = {kind: round(1e6 * s / messages, 2) for kind, s in sorted(by_kind.items())}
    return {"us_per_message": us, "total_us_per_message": round(sum(us.values()), 2), "messages": messages}


class CpuWindow:
    """Readings as the load runs: the first at its first report, the last at each later one."""

    def __init__(self) -> None:
        self.first: Reading | None = None
        self.last: Reading | None = None

    def observe(self, status: dict, delivered: int) -> None:
        reading = read(status, delivered)
        if self.first is None:
            self.first = reading
        else:
            self.last = reading

    def summary(self) -> dict | None:
        if self.first is None or self.last is None:
            return None
        return per_message(self.first, self.last)


__all__ = ["CpuWindow", "Reading", "kinds_by_pid", "per_message", "read"]
