"""The watchdog: its sans-IO core with injected readings and time, then the real process on a socketpair."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from alarms.limits import DiskLimit, MemoryLimit, parse_disk_free_limit, parse_memory_watermark
from alarms.watchdog import EXIT_OK, AlarmEvent, WatchdogCore, WatchdogStatistics
from ipc import control
from ipc.errors import WouldBlock

ROOT = Path(__file__).resolve().parent.parent
MS = 1_000_000
MIB = 1024 * 1024
TOTAL = 8 * 1024 * MIB
NODE = "creditflow@host"


def core(watermark="0.5", disk="50MB", total=TOTAL, interval_ms=100) -> WatchdogCore:
    return WatchdogCore(memory_limit=parse_memory_watermark(watermark)[0], disk_limit=parse_disk_free_limit(disk),
                        total_memory_bytes=total, node=NODE, memory_interval_ms=interval_ms)


def kinds(events: list[AlarmEvent]) -> list[str]:
    return [e.kind for e in events]


def edges(events: list[AlarmEvent]) -> list[AlarmEvent]:
    return [e for e in events if e.kind in ("set", "clear")]


# -- the core -----------------------------------------------------------------------------------------
def test_memory_alarm_is_set_above_the_watermark_and_cleared_at_or_below_it():
    c = core(watermark="1000", total=10_000)
    assert c.poll_memory(1000, 0) == []                  # equal: not above
    events = c.poll_memory(1001, 100 * MS)
    assert kinds(events) == ["log", "set"]
    assert events[0] == AlarmEvent("log", "memory", NODE, "info",
                                   ["vm_memory_high_watermark set. Memory used:1001 allowed:1000"], 100 * MS)
    assert events[1] == AlarmEvent("set", "memory", NODE, "warning", [
        f"memory resource limit alarm set on node {NODE}.", "", "*" * 58,
        "*** Publishers will be blocked until this alarm clears ***", "*" * 58], 100 * MS,
        {"used": 1001, "limit": 1000})
    assert c.poll_memory(5000, 200 * MS) == []            # still above: nothing new
    events = c.poll_memory(1000, 300 * MS)
    assert kinds(events) == ["log", "clear"]
    assert events[0].lines == ["vm_memory_high_watermark clear. Memory used:1000 allowed:1000"]
    assert events[1].lines == [f"memory resource limit alarm cleared on node {NODE}",
                               "memory resource limit alarm cleared across the cluster"]
    assert events[1].values == {"used": 1000, "limit": 1000}
    assert c.poll_memory(10, 400 * MS) == []


def test_memory_polls_are_due_one_interval_after_the_last():
    c = core(interval_ms=250)
    assert c.next_memory_due_ns == 0
    c.poll_memory(1, 1000 * MS)
    assert c.next_memory_due_ns == 1250 * MS
    c.poll_memory(None, 1300 * MS, why="gone")
    assert c.next_memory_due_ns == 1550 * MS                # a failed reading is retried at the same pace


def test_set_watermark_zero_alarms_at_once_and_restoring_clears_at_once():
    c = core(watermark="0.6")
    used = 300 * MIB
    assert c.poll_memory(used, 0) == []
    events = c.set_memory_limit(MemoryLimit(relative=0.0), used, 5 * MS)
    assert kinds(events) == ["log", "log", "set"]
    assert events[0].lines == [f"Memory high watermark set to 0 MiB (0 bytes) of 8192 MiB ({TOTAL} bytes) total"]
    assert events[1].lines == [f"vm_memory_high_watermark set. Memory used:{used} allowed:0"]
    assert c.statistics().memory_alarm
    assert c.set_memory_limit(MemoryLimit(relative=0.0), used, 6 * MS)[1:] == []     # again: only the note
    assert c.poll_memory(used, 100 * MS) == []
    events = c.set_memory_limit(MemoryLimit(relative=0.6), used, 200 * MS)
    assert kinds(events) == ["log", "log", "clear"]
    assert events[0].lines == ["Memory high watermark set to 4915 MiB (5153960755 bytes) of 8192 MiB "
                               f"({TOTAL} bytes) total"]
    assert c.poll_memory(used, 300 * MS) == []
    stats = c.statistics()
    assert (stats.alarm_sets, stats.alarm_clears, stats.memory_alarm) == (1, 1, False)


def test_a_watermark_of_zero_alarms_on_any_use():
    c = core(watermark="0")
    assert kinds(c.poll_memory(1, 0)) == ["log", "set"]


def test_a_failed_memory_reading_raises_no_alarm_and_says_why_once():
    c = core(watermark="0")
    events = c.poll_memory(None, 0, why="permission denied reading pid 7")
    assert kinds(events) == ["log"]
    assert events[0].level == "error"
    assert "permission denied reading pid 7" in events[0].lines[0]
    assert "no alarm is raised or cleared" in events[0].lines[0]
    assert not c.memory.alarmed
    assert c.poll_memory(None, 100 * MS, why="permission denied reading pid 7") == []   # same streak: quiet
    assert kinds(c.poll_memory(None, 200 * MS, why="no such process")) == ["log"]       # a new reason is told
    events = c.poll_memory(5, 300 * MS)
    assert kinds(events) == ["log", "log", "set"]
    assert events[0].lines == ["Memory use can be read again after 3 failed readings"]
    assert c.statistics().failed_polls == 3


def test_a_failed_reading_does_not_clear_an_alarm_either():
    c = core(watermark="0")
    c.poll_memory(5, 0)
    events = c.poll_memory(None, 100 * MS, why="probe broke")
    assert kinds(events) == ["log"] and "stays set" in events[0].lines[0]
    assert c.memory.alarmed


def test_a_failed_disk_reading_raises_no_alarm_and_waits_the_longest_interval():
    c = core(disk="1000000TB")
    events = c.poll_disk(None, 0, why="cannot read free disk space of /gone")
    assert kinds(events) == ["log"] and "/gone" in events[0].lines[0]
    assert not c.disk.alarmed
    assert c.disk_interval_ms == 10_000 and c.next_disk_due_ns == 10_000 * MS


def test_disk_alarm_and_the_adaptive_interval():
    c = core(disk="50MB")
    assert c.poll_disk(1_050_000_000, 0) == []                   # 1 GB of headroom
    assert c.disk_interval_ms == 8000 and c.next_disk_due_ns == 8000 * MS
    assert c.poll_disk(60_000_000, 8000 * MS) == []              # 10 MB of headroom
    assert c.disk_interval_ms == 100 and c.next_disk_due_ns == 8100 * MS
    assert c.poll_disk(50_000_000, 8100 * MS) == []              # equal: not below
    events = c.poll_disk(49_999_999, 8200 * MS)
    assert kinds(events) == ["log", "set"]
    assert events[0].lines == ["Free disk space is insufficient. Free bytes: 49999999. Limit: 50000000"]
    assert events[1].lines[0] == f"disk resource limit alarm set on node {NODE}."
    assert events[1].values == {"free": 49_999_999, "limit": 50_000_000}
    assert c.disk_interval_ms == 10_000                          # while alarmed: the longest
    assert c.poll_disk(1, 18_200 * MS) == []
    events = c.poll_disk(300_000_000, 28_200 * MS)
    assert kinds(events) == ["log", "clear"]
    assert events[0].lines == ["Free disk space is sufficient. Free bytes: 300000000. Limit: 50000000"]
    assert events[1].lines[0] == f"disk resource limit alarm cleared on node {NODE}"
    assert c.disk_interval_ms == 2000


def test_changing_the_disk_limit_re_evaluates_at_once():
    c = core(disk="50MB")
    c.poll_disk(10 ** 9, 0)
    events = c.set_disk_limit(parse_disk_free_limit("2GB"), 10 ** 9, 1 * MS)
    assert kinds(events) == ["log", "log", "set"]
    assert events[0].lines == ["Disk free limit set to 2000MB"]
    events = c.set_disk_limit(DiskLimit(absolute_bytes=50_000_000), 10 ** 9, 2 * MS)
    assert kinds(events) == ["log", "log", "clear"]
    assert events[0].lines == ["Disk free limit set to 50MB"]


def test_limits_relative_to_ram_follow_the_total():
    c = core(watermark="0.4", disk="mem_relative:1.5", total=1000)
    assert (c.memory_limit_bytes, c.disk_limit_bytes) == (400, 1500)
    assert kinds(c.poll_disk(1499, 0)) == ["log", "set"]


def test_start_logs_what_rabbitmq_logs_when_its_monitors_start():
    c = core(watermark="0.4")
    events = c.start(123_456_789, 0)
    assert [e.lines[0] for e in events] == [
        f"Memory high watermark set to 3276 MiB (3435973836 bytes) of 8192 MiB ({TOTAL} bytes) total",
        f"Enabling free disk space monitoring (disk free space: 123456789, total memory: {TOTAL})",
        "Disk free limit set to 50MB",
    ]
    events = core().start(None, 0, why="cannot read free disk space of /x")
    assert events[1].level == "error" and "cannot read free disk space of /x" in events[1].lines[0]


def test_statistics_are_a_frozen_snapshot():
    c = core(watermark="1000", disk="100")
    c.poll_memory(2000, 0)
    c.poll_disk(1_000_100, 0)
    c.poll_memory(None, 100 * MS, why="x")
    stats = c.statistics()
    assert stats == WatchdogStatistics(
        memory_used=2000, memory_limit=1000, memory_alarm=True, disk_free=1_000_100, disk_limit=100,
        disk_alarm=False, total_memory=TOTAL, memory_interval_ms=100, disk_interval_ms=100, polls=3,
        memory_polls=2, disk_polls=1, failed_polls=1, alarm_sets=1, alarm_clears=0)
    with pytest.raises(AttributeError):
        stats.memory_used = 0


def test_the_next_due_reading_is_the_earlier_of_the_two():
    c = core()
    c.poll_memory(1, 0)
    c.poll_disk(10 ** 12, 0)
    assert c.next_due_ns == 100 * MS
    c.poll_disk(60_000_000, 50 * MS)
    assert c.next_due_ns == 100 * MS


# -- the process --------------------------------------------------------------------------------------
class WatchdogProcess:
    """``watchdog_main`` in a child Python process, watching this test process, over a control socketpair."""

    def __init__(self, data_dir: Path, memory_limit: str = "0.6", disk_limit: str = "50MB",
                 strategy: str = "rss", interval_ms: int = 100):
        self.sock, theirs = control.socketpair()
        code = ("import socket, sys\n"
                "from alarms.watchdog import watchdog_main\n"
                f"ctl = socket.socket(fileno={theirs.fileno()})\n"
                f"sys.exit(watchdog_main(ctl, memory_limit={memory_limit!r}, disk_limit={disk_limit!r}, "
                f"strategy={strategy!r}, data_dir={str(data_dir)!r}, node={NODE!r}, "
                f"supervisor_pid={os.getpid()}, memory_interval_ms={interval_ms}))\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], cwd=ROOT,
                                     start_new_session=True)
        theirs.close()
        self.seen: list[dict] = []

    def request(self, msg: dict) -> None:
        control.send_msg(self.sock, msg)

    def wait_for(self, pred, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no such message within {timeout_s} s; saw {self.seen[-20:]}")
            try:
                msg, _ = control.recv_msg(self.sock, left)
            except WouldBlock:
                continue
            self.seen.append(msg)
            if pred(msg):
                return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.sock.close()


@pytest.fixture
def watchdog(tmp_path):
    started = []

    def start(**kw) -> WatchdogProcess:
        w = WatchdogProcess(tmp_path, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def alarm(source, state):
    return lambda m: m.get("type") == "alarm" and m["source"] == source and m["state"] == state


def reply(m):
    return m.get("type") == "reply"


@pytest.mark.processes
def test_forced_memory_alarm_round_trip_and_stop(watchdog):
    w = watchdog()
    stats = w.wait_for(lambda m: m.get("type") == "stats")
    assert stats["name"] == "watchdog" and stats["memory_used"] > 0 and not stats["memory_alarm"]
    assert stats["memory_limit"] == int(0.6 * psutil.virtual_memory().total)
    w.request({"type": "set_watermark", "value": "0"})
    set_msg = w.wait_for(alarm("memory", "set"))
    assert set_msg["limit"] == 0 and set_msg["used"] > 0 and set_msg["at_ns"] > 0
    r = w.wait_for(reply)
    assert r["ok"] is True and r["memory_alarm"] is True and r["memory_limit"] == 0
    w.request({"type": "set_watermark", "value": "0.6"})
    clear_msg = w.wait_for(alarm("memory", "clear"))
    assert clear_msg["limit"] == int(0.6 * psutil.virtual_memory().total)
    assert w.wait_for(reply)["memory_alarm"] is False
    w.request({"type": "stop"})
    assert w.proc.wait(10) == EXIT_OK
    lines = [line for m in w.seen if m.get("type") == "log" for line in m["lines"]]
    assert lines.count(f"memory resource limit alarm set on node {NODE}.") == 1
    assert lines.count(f"memory resource limit alarm cleared on node {NODE}") == 1
    assert "*** Publishers will be blocked until this alarm clears ***" in lines
    assert [m["state"] for m in w.seen if m.get("type") == "alarm"] == ["set", "clear"]


@pytest.mark.processes
def test_a_bad_value_is_refused_and_the_watchdog_keeps_going(watchdog):
    w = watchdog()
    w.request({"type": "set_watermark", "value": "lots"})
    r = w.wait_for(reply)
    assert r["ok"] is False and "invalid memory watermark 'lots'" in r["error"]
    w.request({"type": "set_disk_free_limit", "value": "5 furlongs"})
    assert "unknown unit 'furlongs'" in w.wait_for(reply)["error"]
    w.request({"type": "set_watermark", "value": "1.5"})
    warning = w.wait_for(lambda m: m.get("type") == "log" and m["level"] == "warning")
    assert warning["lines"] == ["Memory high watermark of 1.5 is above the allowed maximum, falling back to 1.0"]
    assert w.wait_for(reply)["ok"] is True
    assert w.proc.poll() is None


@pytest.mark.processes
def test_disk_alarm_through_set_disk_free_limit(watchdog):
    w = watchdog()
    w.request({"type": "set_disk_free_limit", "value": "1000000TB"})
    set_msg = w.wait_for(alarm("disk", "set"))
    assert set_msg["limit"] == 10 ** 18 and set_msg["free"] > 0
    assert w.wait_for(reply)["disk_alarm"] is True
    w.request({"type": "set_disk_free_limit", "value": "50MB"})
    w.wait_for(alarm("disk", "clear"))
    assert w.wait_for(reply)["disk_alarm"] is False


@pytest.mark.processes
def test_start_up_lines_and_the_system_strategy(watchdog):
    w = watchdog(memory_limit="0", strategy="system")
    first = w.wait_for(lambda m: m.get("type") == "log")
    assert first["lines"][0].startswith("Memory high watermark set to 0 MiB (0 bytes) of ")
    w.wait_for(lambda m: m.get("type") == "log" and "Enabling free disk space monitoring" in m["lines"][0])
    set_msg = w.wait_for(alarm("memory", "set"))           # watermark 0: alarmed at the first reading
    vm = psutil.virtual_memory()
    assert abs(set_msg["used"] - (vm.total - vm.available)) < 512 * MIB


@pytest.mark.processes
def test_the_watchdog_exits_when_its_supervisor_goes_away(watchdog):
    w = watchdog()
    w.wait_for(lambda m: m.get("type") == "stats")
    w.sock.close()
    assert w.proc.wait(10) == EXIT_OK
    w.sock = socket.socket()          # so that close() in the fixture has something to close


@pytest.mark.processes
def test_the_watchdog_sleeps_between_readings(watchdog):
    w = watchdog(interval_ms=100)
    w.wait_for(lambda m: m.get("type") == "stats")
    proc = psutil.Process(w.proc.pid)
    t0, cpu0 = time.monotonic(), sum(proc.cpu_times()[:2])
    first = w.wait_for(lambda m: m.get("type") == "stats")
    then = w.wait_for(lambda m: m.get("type") == "stats", timeout_s=3)
    cpu = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
    # ten readings a second, each timed from the one before: on busy cores every late wake-up adds up, so a
    # second of the watchdog's own clock, not a count between two reports, and some slack below
    per_s = (then["memory_polls"] - first["memory_polls"]) / ((then["at_ns"] - first["at_ns"]) / 1e9)
    assert 6 <= per_s <= 12, per_s
    assert cpu < 0.25                                       # a spinning loop would use a whole core
