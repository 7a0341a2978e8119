"""Readings from the operating system (the only module that imports psutil).

Memory strategies:

* ``rss``: the broker's own processes (the supervisor and every descendant),
  with pages shared between them counted once. Forked stages share their
  parent's copy-on-write pages, and every ring is mapped by two processes, so
  plain RSS would count those several times; the proportional set size (PSS,
  from ``/proc/PID/smaps_rollup``) splits each shared page among the
  processes that map it, so the sum counts it once.
* ``system``: host memory in use (total - available), like memsup's system
  memory high watermark.
"""

from __future__ import annotations

import psutil

from alarms.errors import ProbeError

STRATEGIES = ("rss", "system")


def total_memory_bytes() -> int:
    return psutil.virtual_memory().total


def broker_pids(supervisor_pid: int) -> list[int]:
    try:
        root = psutil.Process(supervisor_pid)
        return [root.pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.Error as exc:
        raise ProbeError(f"cannot list the broker's processes: {exc}") from None


def broker_memory_bytes(pids, strategy: str = "rss") -> int:
    if strategy == "system":
        vm = psutil.virtual_memory()
        return vm.total - vm.available
    if strategy != "rss":
        raise ProbeError(f"unknown memory strategy {strategy!r} (use one of {', '.join(STRATEGIES)})")
    total = 0
    counted = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
            counted += 1
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.Error as exc:
            raise ProbeError(f"cannot read memory of pid {pid}: {exc}") from None
    if not counted:
        raise ProbeError("none of the broker's processes could be measured")
    return total


def disk_free_bytes(path: str) -> int:
    try:
        return psutil.disk_usage(path).free
    except OSError as exc:
        raise ProbeError(f"cannot read free disk space of {path}: {exc}") from None


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system
