"""Memory watermark and disk limit parsing, edges, intervals and RabbitMQ's wording (pure)."""

from __future__ import annotations

import pytest

from alarms.errors import InvalidLimit
from alarms.limits import DiskLimit, MemoryLimit, parse_disk_free_limit, parse_memory_watermark, parse_size
from alarms.watchdog import WatchdogCore
from alarms.watermark import (Watermark, alarm_cleared_line, alarm_set_lines, disk_alarmed, disk_interval_ms,
                              memory_alarmed)

GIB = 1024 ** 3


@pytest.mark.parametrize("text, limit", [
    ("0.4", MemoryLimit(relative=0.4)), ("0", MemoryLimit(relative=0.0)), ("1", MemoryLimit(relative=1.0)),
    ("512MiB", MemoryLimit(absolute_bytes=512 * 1024 ** 2)), ("50MB", MemoryLimit(absolute_bytes=50_000_000)),
    ("absolute 1GiB", MemoryLimit(absolute_bytes=GIB)), ("2048", MemoryLimit(absolute_bytes=2048)),
])
def test_memory_watermarks_parse(text, limit):
    assert parse_memory_watermark(text) == (limit, [])


def test_relative_above_one_is_clamped_with_rabbitmqs_warning():
    limit, warnings = parse_memory_watermark("1.5")
    assert limit == MemoryLimit(relative=1.0)
    assert warnings == ["Memory high watermark of 1.5 is above the allowed maximum, falling back to 1.0"]


@pytest.mark.parametrize("text", ["lots", "-0.2", "12 parsecs", "nan"])
def test_invalid_watermarks_are_refused(text):
    with pytest.raises(InvalidLimit, match="invalid"):
        parse_memory_watermark(text)


def test_limits_in_bytes():
    assert MemoryLimit(relative=0.5).bytes_for(1001) == 500
    assert MemoryLimit(absolute_bytes=10 * GIB).bytes_for(GIB) == GIB
    assert parse_size("70MiB") == 73_400_320 and parse_size("50MB") == 50_000_000
    assert parse_disk_free_limit("50MB") == DiskLimit(absolute_bytes=50_000_000)
    assert parse_disk_free_limit("mem_relative:1.5").bytes_for(1000) == 1500
    assert parse_disk_free_limit("1.5") == DiskLimit(mem_relative=1.5)
    with pytest.raises(InvalidLimit, match="unknown unit"):
        parse_disk_free_limit("5 furlongs")


def test_conditions_are_strict_and_edges_fire_once():
    assert not memory_alarmed(100, 100) and memory_alarmed(101, 100)
    assert not disk_alarmed(100, 100) and disk_alarmed(99, 100)
    w = Watermark("memory")
    assert w.update(True).edge == "set"
    assert w.update(True) is None
    assert w.update(False).edge == "clear"
    assert w.update(False) is None


def test_disk_interval_formula():
    assert disk_interval_ms(50_000_000 + 1_000_000_000, 50_000_000, False) == 8000
    assert disk_interval_ms(60_000_000, 50_000_000, False) == 100
    assert disk_interval_ms(10 ** 12, 0, False) == 10_000
    assert disk_interval_ms(10, 50_000_000, True) == 10_000
    assert disk_interval_ms(None, 50_000_000, False) == 10_000


def test_log_lines_use_rabbitmqs_wording():
    assert alarm_set_lines("memory", "n@h")[0] == "memory resource limit alarm set on node n@h."
    assert "*** Publishers will be blocked until this alarm clears ***" in alarm_set_lines("disk", "n@h")
    assert alarm_cleared_line("disk", "n@h") == "disk resource limit alarm cleared on node n@h"


def core(watermark="0.5", disk="50MB") -> WatchdogCore:
    return WatchdogCore(memory_limit=parse_memory_watermark(watermark)[0], disk_limit=parse_disk_free_limit(disk),
                        total_memory_bytes=1000, node="n@h")


def test_set_watermark_zero_alarms_at_once_and_restoring_clears_once():
    c = core()
    assert c.poll_memory(100, 0) == []
    events = [e for e in c.set_memory_limit(MemoryLimit(relative=0.0), 100, 1) if e.kind != "paging"]
    assert [e.kind for e in events] == ["log", "set"]
    assert events[1].lines[0] == "vm_memory_high_watermark set. Memory used:100 allowed:0"
    assert c.poll_memory(100, 2) == []
    events = [e for e in c.set_memory_limit(MemoryLimit(relative=0.5), 100, 3) if e.kind != "paging"]
    assert [e.kind for e in events] == ["log", "clear"]
    assert c.poll_memory(100, 4) == []


def test_a_failed_reading_raises_no_alarm_and_says_why():
    c = core(watermark="0")
    events = c.poll_memory(None, 0, why="permission denied")
    assert [e.kind for e in events] == ["log"] and "permission denied" in events[0].lines[0]
    assert not c.memory.alarmed
    events = c.poll_disk(None, 0, why="no such directory")
    assert not c.disk.alarmed and c.disk_interval_ms == 10_000


def test_disk_alarm_sets_clears_and_adapts_the_interval():
    c = core(disk="100")
    assert c.poll_disk(1_000_100, 0) == [] and c.disk_interval_ms == 100
    assert [e.kind for e in c.poll_disk(99, 1)] == ["set"] and c.disk_interval_ms == 10_000
    assert [e.kind for e in c.poll_disk(250_000_100, 2)] == ["clear"] and c.disk_interval_ms == 2000


def test_paging_starts_past_half_the_watermark_and_stops_below_it():
    c = core(watermark="0.5")                    # limit 500 of 1000, paging past 250
    assert c.poll_memory(200, 0) == []
    events = c.poll_memory(300, 1)
    assert [(e.kind, e.values) for e in events] == [("paging", {"on": True})]
    assert c.poll_memory(400, 2) == []
    assert [(e.kind, e.values) for e in c.poll_memory(100, 3)] == [("paging", {"on": False})]
