"""The watchdog: RabbitMQ's memory monitor and disk monitor in one process.

Theory of operation
-------------------
::

    probes (psutil) ──readings──▶ WatchdogCore ──AlarmEvents──▶ watchdog_main ──ctl socket──▶ supervisor
                                   (sans-IO)                      (the loop)                    │
    creditflow ctl set-watermark ──▶ supervisor ──{"type": "set_watermark"}──▶ watchdog_main    ▼
                                                                                 alarm tokens to every reader

:class:`WatchdogCore` holds no socket, clock or probe: it is given each
reading with the time it was taken and returns what happened, as
:class:`AlarmEvent` values — ``set`` / ``clear`` edges (from a
:class:`~alarms.watermark.Watermark`, so never a repeat) and ``log`` lines in
RabbitMQ's wording. It also says when the next readings are due: memory
every ``memory_interval_ms``, disk at the adaptive interval.

A reading that fails (``None``) raises no alarm and clears none: the alarm
keeps its state, the failure is logged once per streak (again if the reason
changes) and the recovery is logged too, so a broken probe cannot flood the
log at ten lines a second. Changing a limit re-evaluates at once with a
fresh reading, as ``set_vm_memory_high_watermark`` does: ``set-watermark 0``
sets the memory alarm within one round trip, and restoring the watermark
clears it the same way.

:func:`watchdog_main` is the process loop: wait in ``select`` on the control
socket until the next reading is due (it never spins), take the due
readings, feed the core, send what it returns to the supervisor, push
statistics every ``STATS_INTERVAL_MS``, and answer ``set_watermark``,
``set_disk_free_limit`` and ``stop``.

Messages to the supervisor (``ipc.control``)::

    {"type": "alarm", "source": "memory", "state": "set", "used": N, "limit": M, "at_ns": T}
    {"type": "alarm", "source": "disk", "state": "clear", "free": N, "limit": M, "at_ns": T}
    {"type": "log", "level": "info" | "warning" | "error", "lines": [...]}
    {"type": "stats", "name": "watchdog", "kind": "watchdog", "pid": P, "at_ns": T, ...WatchdogStatistics}
    {"type": "reply", "ok": true | false, "error": "..." (when false), ...}
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import asdict, dataclass, field

from alarms import probes
from alarms.errors import InvalidLimit, ProbeError
from alarms.limits import (DEFAULT_DISK_FREE_LIMIT_BYTES, DEFAULT_MEMORY_WATERMARK, MEMORY_POLL_INTERVAL_MS,
                           DiskLimit, MemoryLimit, parse_disk_free_limit, parse_memory_watermark)
from alarms.watermark import (Watermark, alarm_cleared_across_cluster_line, alarm_cleared_line, alarm_set_lines,
                              disk_alarmed, disk_interval_ms, disk_line, memory_alarmed, memory_watermark_line)
from ipc import control
from ipc.errors import PeerGone, WouldBlock

STATS_INTERVAL_MS = 1000
MIB = 1024 * 1024
EXIT_OK = 0                 # stopped on request, or the supervisor went away (nothing left to watch for)


@dataclass(frozen=True)
class AlarmEvent:
    """Something the watchdog must report: an alarm edge ('set' / 'clear') or a 'log' entry."""

    kind: str                       # 'set' | 'clear' | 'log'
    source: str                     # 'memory' | 'disk'
    node: str
    level: str                      # 'info' | 'warning' | 'error'
    lines: list[str]
    at_ns: int
    values: dict = field(default_factory=dict)     # set/clear: used or free, and limit, in bytes


@dataclass(frozen=True)
class WatchdogStatistics:
    memory_used: int | None
    memory_limit: int
    memory_alarm: bool
    disk_free: int | None
    disk_limit: int
    disk_alarm: bool
    total_memory: int
    memory_interval_ms: int
    disk_interval_ms: int
    polls: int
    memory_polls: int
    disk_polls: int
    failed_polls: int
    alarm_sets: int
    alarm_clears: int


class WatchdogCore:
    """Memory and disk monitors, sans-IO: readings and time in, :class:`AlarmEvent` values out."""

    def __init__(self, *, memory_limit: MemoryLimit, disk_limit: DiskLimit, total_memory_bytes: int, node: str,
                 memory_interval_ms: int = MEMORY_POLL_INTERVAL_MS, now_ns: int = 0,
                 alarmed: frozenset[str] = frozenset()):
        """``alarmed``: the alarm sources already set when this core starts (a restarted watchdog
        takes them over, so its first fresh reading clears them if they no longer hold)."""
        self.node = node
        self.total_memory = total_memory_bytes
        self.memory_limit = memory_limit
        self.disk_limit = disk_limit
        self.memory_interval_ms = memory_interval_ms
        self.memory = Watermark("memory", "memory" in alarmed)
        self.disk = Watermark("disk", "disk" in alarmed)
        self.memory_used: int | None = None
        self.disk_free: int | None = None
        self.disk_interval_ms = disk_interval_ms(None, 0, False)
        self.next_memory_due_ns = now_ns
        self.next_disk_due_ns = now_ns
        self.memory_polls = 0
        self.disk_polls = 0
        self.failed_polls = 0
        self._failing: dict[str, tuple[str, int]] = {}     # source -> (reason, failed readings in a row)

    @property
    def memory_limit_bytes(self) -> int:
        return self.memory_limit.bytes_for(self.total_memory)

    @property
    def disk_limit_bytes(self) -> int:
        return self.disk_limit.bytes_for(self.total_memory)

    @property
    def next_due_ns(self) -> int:
        """When the earlier of the two next readings is due."""
        return min(self.next_memory_due_ns, self.next_disk_due_ns)

    def start(self, free_bytes: int | None, now_ns: int, why: str = "") -> list[AlarmEvent]:
        """The lines RabbitMQ logs when its monitors start (the first readings are due at once)."""
        events = [self._memory_limit_note(now_ns)]
        if free_bytes is None:
            events.append(self._log("disk", "error", f"Free disk space monitor encountered an error: {why}; "
                                                      "no disk alarm is raised while it cannot read", now_ns))
        else:
            events.append(self._log("disk", "info", f"Enabling free disk space monitoring (disk free space: "
                                                     f"{free_bytes}, total memory: {self.total_memory})", now_ns))
        events.append(self._disk_limit_note(now_ns))
        return events

    def poll_memory(self, used_bytes: int | None, now_ns: int, why: str = "") -> list[AlarmEvent]:
        """Feed one memory reading (None: it failed, because ``why``); the next is due one interval later."""
        self.next_memory_due_ns = now_ns + self.memory_interval_ms * 1_000_000
        self.memory_polls += 1
        if used_bytes is None:
            return self._failed("memory", "Memory use", why, now_ns)
        events = self._recovered("memory", "Memory use", now_ns)
        self.memory_used = used_bytes
        limit = self.memory_limit_bytes
        edge = self.memory.update(memory_alarmed(used_bytes, limit))
        if edge is None:
            return events
        values = {"used": used_bytes, "limit": limit}
        events.append(self._log("memory", "info", memory_watermark_line(edge.edge, used_bytes, limit), now_ns))
        events.append(self._edge("memory", edge.edge, now_ns, values))
        return events

    def poll_disk(self, free_bytes: int | None, now_ns: int, why: str = "") -> list[AlarmEvent]:
        """Feed one disk reading (None: it failed); the next is due at the adaptive interval."""
        self.disk_polls += 1
        limit = self.disk_limit_bytes
        if free_bytes is None:
            self._schedule_disk(None, limit, now_ns)
            return self._failed("disk", "Free disk space", why, now_ns)
        events = self._recovered("disk", "Free disk space", now_ns)
        self.disk_free = free_bytes
        edge = self.disk.update(disk_alarmed(free_bytes, limit))
        self._schedule_disk(free_bytes, limit, now_ns)
        if edge is None:
            return events
        values = {"free": free_bytes, "limit": limit}
        events.append(self._log("disk", "info", disk_line(edge.edge, free_bytes, limit), now_ns))
        events.append(self._edge("disk", edge.edge, now_ns, values))
        return events

    def set_memory_limit(self, limit: MemoryLimit, used_bytes: int | None, now_ns: int,
                         why: str = "") -> list[AlarmEvent]:
        """Change the watermark and re-evaluate at once with ``used_bytes`` (``ctl set-watermark``)."""
        self.memory_limit = limit
        return [self._memory_limit_note(now_ns)] + self.poll_memory(used_bytes, now_ns, why)

    def set_disk_limit(self, limit: DiskLimit, free_bytes: int | None, now_ns: int,
                       why: str = "") -> list[AlarmEvent]:
        """Change the disk free limit and re-evaluate at once with ``free_bytes``."""
        self.disk_limit = limit
        return [self._disk_limit_note(now_ns)] + self.poll_disk(free_bytes, now_ns, why)

    def statistics(self) -> WatchdogStatistics:
        return WatchdogStatistics(
            memory_used=self.memory_used, memory_limit=self.memory_limit_bytes, memory_alarm=self.memory.alarmed,
            disk_free=self.disk_free, disk_limit=self.disk_limit_bytes, disk_alarm=self.disk.alarmed,
            total_memory=self.total_memory, memory_interval_ms=self.memory_interval_ms,
            disk_interval_ms=self.disk_interval_ms, polls=self.memory_polls + self.disk_polls,
            memory_polls=self.memory_polls, disk_polls=self.disk_polls, failed_polls=self.failed_polls,
            alarm_sets=self.memory.sets + self.disk.sets, alarm_clears=self.memory.clears + self.disk.clears)

    # -- helpers -------------------------------------------------------------------------------
    def _schedule_disk(self, free_bytes: int | None, limit: int, now_ns: int) -> None:
        self.disk_interval_ms = disk_interval_ms(free_bytes, limit, self.disk.alarmed)
        self.next_disk_due_ns = now_ns + self.disk_interval_ms * 1_000_000

    def _failed(self, source: str, what: str, why: str, now_ns: int) -> list[AlarmEvent]:
        self.failed_polls += 1
        reason, count = self._failing.get(source, (None, 0))
        self._failing[source] = (why, count + 1)
        if why == reason:
            return []
        state = "set" if (self.memory if source == "memory" else self.disk).alarmed else "clear"
        return [self._log(source, "error", f"{what} could not be read ({why or 'no reason given'}); no alarm is "
                                           f"raised or cleared while it cannot be read (the {source} alarm "
                                           f"stays {state})", now_ns)]

    def _recovered(self, source: str, what: str, now_ns: int) -> list[AlarmEvent]:
        failure = self._failing.pop(source, None)
        if failure is None:
            return []
        return [self._log(source, "info", f"{what} can be read again after {failure[1]} failed readings", now_ns)]

    def _memory_limit_note(self, now_ns: int) -> AlarmEvent:
        b, t = self.memory_limit_bytes, self.total_memory
        return self._log("memory", "info", f"Memory high watermark set to {b // MIB} MiB ({b} bytes) of "
                                           f"{t // MIB} MiB ({t} bytes) total", now_ns)

    def _disk_limit_note(self, now_ns: int) -> AlarmEvent:
        return self._log("disk", "info", f"Disk free limit set to {self.disk_limit_bytes // 1_000_000}MB", now_ns)

    def _log(self, source: str, level: str, line: str, now_ns: int) -> AlarmEvent:
        return AlarmEvent("log", source, self.node, level, [line], now_ns)

    def _edge(self, source: str, edge: str, now_ns: int, values: dict) -> AlarmEvent:
        if edge == "set":
            lines = alarm_set_lines(source, self.node)
        else:
            lines = [alarm_cleared_line(source, self.node), alarm_cleared_across_cluster_line(source)]
        return AlarmEvent(edge, source, self.node, "warning", lines, now_ns, values)


# -- the process ------------------------------------------------------------------------------------
class _Readings:
    """The probes the loop feeds to the core; a failure becomes (None, why)."""

    def __init__(self, strategy: str, supervisor_pid: int, data_dir: str):
        self.memory_probe = probes.BrokerMemory(strategy)
        self.supervisor_pid = supervisor_pid
        self.data_dir = data_dir

    def memory(self, now_ns: int) -> tuple[int | None, str]:
        try:
            pids = probes.broker_pids(self.supervisor_pid) if self.memory_probe.strategy == "rss" else ()
            return self.memory_probe.read(pids, now_ns), ""
        except ProbeError as exc:
            return None, str(exc)

    def disk(self) -> tuple[int | None, str]:
        try:
            return probes.disk_free_bytes(self.data_dir), ""
        except ProbeError as exc:
            return None, str(exc)


class _Stop(Exception):
    """Raised when the supervisor asks the watchdog to stop."""


class _Loop:
    """Wait in select until a reading is due or a request comes; feed the core; send what it returns."""

    def __init__(self, ctl_sock, core: WatchdogCore, readings: _Readings, clock):
        self.ctl = ctl_sock
        self.core = core
        self.readings = readings
        self.clock = clock
        self.next_stats_ns = clock()

    def run(self, first_events: list[AlarmEvent]) -> int:
        try:
            self.emit(first_events)
            while True:
                self.take_due_readings()
                self.push_statistics_when_due()
                timeout_s = max(0.0, (min(self.core.next_due_ns, self.next_stats_ns) - self.clock()) / 1e9)
                ready, _, _ = select.select([self.ctl], [], [], timeout_s)
                if ready:
                    self.handle_requests()
        except (_Stop, PeerGone):
            return EXIT_OK

    def take_due_readings(self) -> None:
        now = self.clock()
        if now >= self.core.next_memory_due_ns:
            used, why = self.readings.memory(now)
            self.emit(self.core.poll_memory(used, now, why))
        if now >= self.core.next_disk_due_ns:
            free, why = self.readings.disk()
            self.emit(self.core.poll_disk(free, now, why))

    def push_statistics_when_due(self) -> None:
        now = self.clock()
        if now < self.next_stats_ns:
            return
        self.next_stats_ns = now + STATS_INTERVAL_MS * 1_000_000
        self.send({"type": "stats", "name": "watchdog", "kind": "watchdog", "pid": os.getpid(), "at_ns": now,
                   **asdict(self.core.statistics()), **asdict(self.readings.memory_probe.statistics())})

    def handle_requests(self) -> None:
        while True:
            try:
                msg, fds = control.recv_msg_nowait(self.ctl)
            except WouldBlock:
                return
            for fd in fds:          # the watchdog takes no endpoints; do not keep what was sent by mistake
                os.close(fd)
            kind = msg.get("type")
            if kind == "stop":
                raise _Stop()
            if kind == "set_watermark":
                self.set_watermark(msg.get("value"))
            elif kind == "set_disk_free_limit":
                self.set_disk_free_limit(msg.get("value"))
            elif kind == "disk_written":       # a stage wrote a good deal: a faster disk than the poll assumes
                self.core.next_disk_due_ns = min(self.core.next_disk_due_ns, self.clock())

    def set_watermark(self, value) -> None:
        try:
            limit, warnings = parse_memory_watermark(value)
        except InvalidLimit as exc:
            self.send({"type": "reply", "ok": False, "error": str(exc)})
            return
        if warnings:
            self.send({"type": "log", "level": "warning", "lines": warnings})
        now = self.clock()
        used, why = self.readings.memory(now)
        self.emit(self.core.set_memory_limit(limit, used, now, why))
        stats = self.core.statistics()
        self.send({"type": "reply", "ok": True, "memory_limit": stats.memory_limit, "memory_used": stats.memory_used,
                   "memory_alarm": stats.memory_alarm, "warnings": warnings})

    def set_disk_free_limit(self, value) -> None:
        try:
            limit = parse_disk_free_limit(value)
        except InvalidLimit as exc:
            self.send({"type": "reply", "ok": False, "error": str(exc)})
            return
        free, why = self.readings.disk()
        self.emit(self.core.set_disk_limit(limit, free, self.clock(), why))
        stats = self.core.statistics()
        self.send({"type": "reply", "ok": True, "disk_limit": stats.disk_limit, "disk_free": stats.disk_free,
                   "disk_alarm": stats.disk_alarm})

    def emit(self, events: list[AlarmEvent]) -> None:
        for ev in events:
            self.send({"type": "log", "level": ev.level, "lines": ev.lines})
            if ev.kind in ("set", "clear"):
                self.send({"type": "alarm", "source": ev.source, "state": ev.kind, "at_ns": ev.at_ns, **ev.values})

    def send(self, msg: dict) -> None:
        control.send_msg(self.ctl, msg)


def watchdog_main(ctl_sock, *, data_dir: str, node: str, supervisor_pid: int,
                  memory_limit: MemoryLimit | str | float = DEFAULT_MEMORY_WATERMARK,
                  disk_limit: DiskLimit | str | int = DEFAULT_DISK_FREE_LIMIT_BYTES, strategy: str = "rss",
                  memory_interval_ms: int = MEMORY_POLL_INTERVAL_MS, clock=time.monotonic_ns,
                  alarmed: frozenset[str] = frozenset()) -> int:
    """Run the watchdog process until asked to stop or its supervisor goes away; returns the exit code."""
    mem_limit, warnings = ((memory_limit, []) if isinstance(memory_limit, MemoryLimit)
                           else parse_memory_watermark(memory_limit))
    dsk_limit = disk_limit if isinstance(disk_limit, DiskLimit) else parse_disk_free_limit(disk_limit)
    now = clock()
    core = WatchdogCore(memory_limit=mem_limit, disk_limit=dsk_limit, total_memory_bytes=probes.total_memory_bytes(),
                        node=node, memory_interval_ms=memory_interval_ms, now_ns=now, alarmed=frozenset(alarmed))
    readings = _Readings(strategy, supervisor_pid, data_dir)
    free, why = readings.disk()
    first = [AlarmEvent("log", "memory", node, "warning", [w], now) for w in warnings]
    first += core.start(free, now, why)
    first.append(AlarmEvent("log", "memory", node, "info", [f"Memory is measured by strategy {strategy}: "
                            + ("the broker's processes, shared pages counted once (PSS)" if strategy == "rss"
                               else "host memory in use (total - available)")], now))
    return _Loop(ctl_sock, core, readings, clock).run(first)
