"""Alarms fire on change only, with strict conditions, RabbitMQ's disk interval and RabbitMQ's log text."""

from __future__ import annotations

import pytest

from alarms.errors import UnknownSource
from alarms.watermark import (AlarmEdge, Watermark, WatermarkStatistics, alarm_cleared_across_cluster_line,
                              alarm_cleared_line, alarm_set_lines, disk_alarmed, disk_interval_ms, disk_line,
                              memory_alarmed, memory_watermark_line)

MB = 1_000_000


def test_memory_is_alarmed_only_strictly_above_the_limit():
    assert not memory_alarmed(99, 100)
    assert not memory_alarmed(100, 100)
    assert memory_alarmed(101, 100)
    assert memory_alarmed(1, 0)            # watermark 0: any use at all alarms


def test_disk_is_alarmed_only_strictly_below_the_limit():
    assert not disk_alarmed(101, 100)
    assert not disk_alarmed(100, 100)
    assert disk_alarmed(99, 100)


def test_a_watermark_reports_the_set_and_the_clear_once_each():
    w = Watermark("memory")
    assert not w.alarmed
    assert w.update(False) is None                          # a clear while clear is nothing
    assert w.update(True) == AlarmEdge("memory", "set")
    assert w.alarmed
    assert w.update(True) is None and w.update(True) is None
    assert w.update(False) == AlarmEdge("memory", "clear")
    assert not w.alarmed
    assert w.update(False) is None
    assert w.statistics() == WatermarkStatistics("memory", False, sets=1, clears=1)


def test_a_flapping_condition_gives_alternating_edges_and_nothing_else():
    w = Watermark("disk")
    readings = [True, True, False, True, False, False, True]
    edges = [e.edge for r in readings if (e := w.update(r)) is not None]
    assert edges == ["set", "clear", "set", "clear", "set"]
    assert w.statistics() == WatermarkStatistics("disk", True, sets=3, clears=2)


def test_an_unknown_source_is_refused():
    with pytest.raises(UnknownSource, match="unknown alarm source 'cpu'"):
        Watermark("cpu")


@pytest.mark.parametrize("free, limit, alarmed, interval_ms", [
    (50 * MB + 1000 * MB, 50 * MB, False, 8000),      # 1 GB of headroom: 2 * 1e9 / 250_000
    (50 * MB + 125 * MB, 50 * MB, False, 1000),       # 125 MB: one second
    (60 * MB, 50 * MB, False, 100),                   # 10 MB: 80 ms, raised to the minimum
    (50 * MB, 50 * MB, False, 100),                   # no headroom at all
    (10 ** 12, 0, False, 10_000),                     # a huge disk: capped at the maximum
    (10, 50 * MB, True, 10_000),                      # alarmed: the maximum
    (10 ** 12, 0, True, 10_000),
    (None, 50 * MB, False, 10_000),                   # the last reading failed: the maximum
])
def test_disk_interval_follows_the_headroom(free, limit, alarmed, interval_ms):
    assert disk_interval_ms(free, limit, alarmed) == interval_ms


def test_disk_interval_bounds_can_be_changed():
    assert disk_interval_ms(60 * MB, 50 * MB, False, min_ms=10) == 80
    assert disk_interval_ms(10 ** 12, 0, False, max_ms=5000) == 5000
    assert disk_interval_ms(10, 50 * MB, True, max_ms=5000) == 5000


def test_alarm_set_text_is_rabbitmqs_with_the_banner():
    assert alarm_set_lines("memory", "creditflow@host") == [
        "memory resource limit alarm set on node creditflow@host.",
        "",
        "**********************************************************",
        "*** Publishers will be blocked until this alarm clears ***",
        "**********************************************************",
    ]
    assert alarm_set_lines("disk", "n@h")[0] == "disk resource limit alarm set on node n@h."


def test_alarm_clear_text_is_rabbitmqs():
    assert alarm_cleared_line("memory", "creditflow@host") == (
        "memory resource limit alarm cleared on node creditflow@host")
    assert alarm_cleared_across_cluster_line("disk") == "disk resource limit alarm cleared across the cluster"


def test_monitor_lines_are_rabbitmqs():
    assert memory_watermark_line("set", 123, 100) == "vm_memory_high_watermark set. Memory used:123 allowed:100"
    assert memory_watermark_line("clear", 99, 100) == "vm_memory_high_watermark clear. Memory used:99 allowed:100"
    assert disk_line("set", 10, 50_000_000) == "Free disk space is insufficient. Free bytes: 10. Limit: 50000000"
    assert disk_line("clear", 60_000_000, 50_000_000) == (
        "Free disk space is sufficient. Free bytes: 60000000. Limit: 50000000")
