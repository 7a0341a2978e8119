"""The watchdog: RabbitMQ's memory and disk monitors in one process.

:class:`WatchdogCore` is sans-IO: readings and time are given to it and it
returns what happened (alarm edges and log lines in RabbitMQ's wording). A
failed reading raises no alarm and says why. Changing a limit re-evaluates
at once, as ``set_vm_memory_high_watermark`` does.

:func:`watchdog_main` is the process loop: it polls memory every
``memory_interval_ms`` (the supervisor and all its descendants for ``rss``),
disk at the adaptive interval, reports edges, log lines and statistics to
the supervisor over its control socket, and answers ``set_watermark`` /
``set_disk_free_limit`` requests. It sleeps in ``select`` until the next
reading is due.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

from alarms import probes
from alarms.errors import InvalidLimit, ProbeError
from alarms.limits import (DiskLimit, MemoryLimit, parse_disk_free_limit, parse_memory_watermark)
from alarms.watermark import (Watermark, alarm_cleared_line, alarm_set_lines, disk_alarmed, disk_interval_ms,
                              disk_line, memory_alarmed, memory_watermark_line)
from ipc import control
from ipc.errors import PeerGone, WouldBlock

STATS_INTERVAL_NS = 1_000_000_000
PAGING_RATIO = 0.5          # vm_memory_high_watermark_paging_ratio (RabbitMQ 3.x)
MIB = 1024 * 1024


@dataclass(frozen=True)
class AlarmEvent:
    kind: str                      # 'set' | 'clear' | 'log'
    source: str                    # 'memory' | 'disk'
    level: str
    lines: list
    at_ns: int
    values: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WatchdogStatistics:
    memory_used: int | None
    memory_limit: int
    memory_alarm: bool
    disk_free: int | None
    disk_limit: int
    disk_alarm: bool
    memory_polls: int
    disk_polls: int
    failed_polls: int
    next_disk_interval_ms: int


class WatchdogCore:
    def __init__(self, *, memory_limit: MemoryLimit, disk_limit: DiskLimit, total_memory_bytes: int, node: str,
                 memory_interval_ms: int = 100, now_ns: int = 0, paging_ratio: float = PAGING_RATIO):
        self.node = node
        self.total = total_memory_bytes
        self.memory_limit = memory_limit
        self.disk_limit = disk_limit
        self.memory_interval_ns = memory_interval_ms * 1_000_000
        self.memory = Watermark("memory")
        self.disk = Watermark("disk")
        self.paging = Watermark("paging")       # queues page to disk past paging_ratio x the watermark
        self.paging_ratio = paging_ratio
        self.memory_used: int | None = None
        self.disk_free: int | None = None
        self.next_memory_due_ns = now_ns
        self.next_disk_due_ns = now_ns
        self.disk_interval_ms = 0
        self.memory_polls = 0
        self.disk_polls = 0
        self.failed_polls = 0

    @property
    def memory_limit_bytes(self) -> int:
        return self.memory_limit.bytes_for(self.total)

    @property
    def disk_limit_bytes(self) -> int:
        return self.disk_limit.bytes_for(self.total)

    def poll_memory(self, used: int | None, now_ns: int, why: str = "") -> list[AlarmEvent]:
        self.next_memory_due_ns = now_ns + self.memory_interval_ns
        self.memory_polls += 1
        if used is None:
            self.failed_polls += 1
            return [AlarmEvent("log", "memory", "error", [f"memory reading failed, no alarm raised: {why}"],
                               now_ns)]
        self.memory_used = used
        limit = self.memory_limit_bytes
        events = []
        page_edge = self.paging.update(memory_alarmed(used, int(limit * self.paging_ratio)))
        if page_edge is not None:
            verb = "start" if page_edge.edge == "set" else "stop"
            events.append(AlarmEvent("paging", "memory", "info",
                                     [f"memory used {used} passed {self.paging_ratio} x the watermark "
                                      f"({int(limit * self.paging_ratio)}): queues {verb} paging to disk"
                                      if verb == "start" else
                                      f"memory used {used} is back under {self.paging_ratio} x the watermark: "
                                      "queues stop paging"], now_ns, {"on": verb == "start"}))
        edge = self.memory.update(memory_alarmed(used, limit))
        if edge is None:
            return events
        values = {"used": used, "limit": limit}
        if edge.edge == "set":
            return events + [AlarmEvent("set", "memory", "warning",
                                        [memory_watermark_line("set", used, limit)]
                                        + alarm_set_lines("memory", self.node), now_ns, values)]
        return events + [AlarmEvent("clear", "memory", "warning",
                                    [memory_watermark_line("clear", used, limit),
                                     alarm_cleared_line("memory", self.node)], now_ns, values)]

    def poll_disk(self, free: int | None, now_ns: int, why: str = "") -> list[AlarmEvent]:
        self.disk_polls += 1
        limit = self.disk_limit_bytes
        if free is None:
            self.failed_polls += 1
            self.disk_interval_ms = disk_interval_ms(None, limit, self.disk.alarmed)
            self.next_disk_due_ns = now_ns + self.disk_interval_ms * 1_000_000
            return [AlarmEvent("log", "disk", "error", [f"free disk space reading failed, no alarm raised: {why}"],
                               now_ns)]
        self.disk_free = free
        edge = self.disk.update(disk_alarmed(free, limit))
        self.disk_interval_ms = disk_interval_ms(free, limit, self.disk.alarmed)
        self.next_disk_due_ns = now_ns + self.disk_interval_ms * 1_000_000
        if edge is None:
            return []
        values = {"free": free, "limit": limit}
        if edge.edge == "set":
            return [AlarmEvent("set", "disk", "warning",
                               [disk_line("set", free, limit)] + alarm_set_lines("disk", self.node), now_ns, values)]
        return [AlarmEvent("clear", "disk", "warning",
                           [disk_line("clear", free, limit), alarm_cleared_line("disk", self.node)], now_ns, values)]

    def set_memory_limit(self, limit: MemoryLimit, used: int | None, now_ns: int) -> list[AlarmEvent]:
        self.memory_limit = limit
        b = self.memory_limit_bytes
        note = AlarmEvent("log", "memory", "info",
                          [f"Memory high watermark set to {b // MIB} MiB ({b} bytes) of {self.total // MIB} MiB "
                           f"({self.total} bytes) total"], now_ns)
        return [note] + self.poll_memory(used, now_ns)

    def set_disk_limit(self, limit: DiskLimit, free: int | None, now_ns: int) -> list[AlarmEvent]:
        self.disk_limit = limit
        note = AlarmEvent("log", "disk", "info", [f"Disk free limit set to {self.disk_limit_bytes // 1_000_000}MB"],
                          now_ns)
        return [note] + self.poll_disk(free, now_ns)

    def statistics(self) -> WatchdogStatistics:
        return WatchdogStatistics(self.memory_used, self.memory_limit_bytes, self.memory.alarmed, self.disk_free,
                                  self.disk_limit_bytes, self.disk.alarmed, self.memory_polls, self.disk_polls,
                                  self.failed_polls, self.disk_interval_ms)


class _Readings:
    def __init__(self, supervisor_pid: int, strategy: str, data_dir: str):
        self.supervisor_pid = supervisor_pid
        self.strategy = strategy
        self.data_dir = data_dir

    def memory(self) -> tuple[int | None, str]:
        try:
            pids = probes.broker_pids(self.supervisor_pid) if self.strategy == "rss" else []
            return probes.broker_memory_bytes(pids, self.strategy), ""
        except ProbeError as exc:
            return None, str(exc)

    def disk(self) -> tuple[int | None, str]:
        try:
            return probes.disk_free_bytes(self.data_dir), ""
        except ProbeError as exc:
            return None, str(exc)


def watchdog_main(ctl_sock, *, data_dir: str, node: str, supervisor_pid: int, memory_limit="0.6",
                  disk_limit="50MB", strategy: str = "rss", memory_interval_ms: int = 100,
                  paging_ratio: float = PAGING_RATIO) -> int:
    import select

    mem_limit, warnings = parse_memory_watermark(memory_limit) if not isinstance(memory_limit, MemoryLimit) \
        else (memory_limit, [])
    dsk_limit = parse_disk_free_limit(disk_limit) if not isinstance(disk_limit, DiskLimit) else disk_limit
    now = time.monotonic_ns()
    core = WatchdogCore(memory_limit=mem_limit, disk_limit=dsk_limit, total_memory_bytes=probes.total_memory_bytes(),
                        node=node, memory_interval_ms=memory_interval_ms, now_ns=now, paging_ratio=paging_ratio)
    readings = _Readings(supervisor_pid, strategy, data_dir)

    def send(msg: dict) -> None:
        control.send_msg(ctl_sock, msg)

    def emit(events) -> None:
        for ev in events:
            send({"type": "log", "level": ev.level, "lines": ev.lines})
            if ev.kind in ("set", "clear"):
                send({"type": "alarm", "source": ev.source, "state": ev.kind, "at_ns": ev.at_ns, **ev.values})
            elif ev.kind == "paging":
                send({"type": "paging", "on": ev.values["on"], "at_ns": ev.at_ns})

    for w in warnings:
        send({"type": "log", "level": "warning", "lines": [w]})
    b = core.memory_limit_bytes
    send({"type": "log", "level": "info", "lines": [
        f"Memory high watermark set to {b // MIB} MiB ({b} bytes) of {core.total // MIB} MiB ({core.total} bytes) "
        f"total; memory strategy {strategy}",
        f"Enabling free disk space monitoring (disk free limit {core.disk_limit_bytes} bytes)"]})
    next_stats = now
    try:
        while True:
            now = time.monotonic_ns()
            if now >= core.next_memory_due_ns:
                used, why = readings.memory()
                emit(core.poll_memory(used, time.monotonic_ns(), why))
            if now >= core.next_disk_due_ns:
                free, why = readings.disk()
                emit(core.poll_disk(free, time.monotonic_ns(), why))
            if now >= next_stats:
                send({"type": "stats", "name": "watchdog", "kind": "watchdog", "at_ns": now, "pid": os.getpid(),
                      **asdict(core.statistics())})
                next_stats = now + STATS_INTERVAL_NS
            due = min(core.next_memory_due_ns, core.next_disk_due_ns, next_stats)
            timeout = max(0.0, (due - time.monotonic_ns()) / 1e9)
            ready, _, _ = select.select([ctl_sock], [], [], timeout)
            if not ready:
                continue
            while True:
                try:
                    msg, _fds = control.recv_msg_nowait(ctl_sock)
                except WouldBlock:
                    break
                kind = msg.get("type")
                if kind == "stop":
                    return 0
                if kind == "set_watermark":
                    try:
                        limit, warns = parse_memory_watermark(msg.get("value"))
                    except InvalidLimit as exc:
                        send({"type": "reply", "ok": False, "error": str(exc)})
                        continue
                    for w in warns:
                        send({"type": "log", "level": "warning", "lines": [w]})
                    used, why = readings.memory()
                    emit(core.set_memory_limit(limit, used, time.monotonic_ns()))
                    send({"type": "reply", "ok": True, "memory_limit": core.memory_limit_bytes,
                          "memory_used": core.memory_used, "memory_alarm": core.memory.alarmed})
                elif kind == "set_disk_free_limit":
                    try:
                        limit = parse_disk_free_limit(msg.get("value"))
                    except InvalidLimit as exc:
                        send({"type": "reply", "ok": False, "error": str(exc)})
                        continue
                    free, why = readings.disk()
                    emit(core.set_disk_limit(limit, free, time.monotonic_ns()))
                    send({"type": "reply", "ok": True, "disk_limit": core.disk_limit_bytes, "disk_free": core.disk_free,
                          "disk_alarm": core.disk.alarmed})
    except PeerGone:
        return 0
