"""Worker reports: the pipe codecs and PerfTest's lines."""

from __future__ import annotations

import os

import pytest

from pipeline.loadgen.harness import LoadResult, SecondReport
from pipeline.loadgen.report import (WorkerLink, WorkerLinkError, decode_control, decode_records, encode_record,
                                     encode_end, encode_start, encode_stop, format_line, format_summary)

S = 1_000_000_000


def con(worker, k, at_ns, received, hist="", stale=0, gaps=0, event="second"):
    return {"event": event, "worker": worker, "k": k, "at_ns": at_ns, "cpu_s": 0.25,
            "stats": {"received": received, "stale": stale, "gaps": gaps, "duplicates": 0, "acked_tag": received},
            "hist": {"consumer": hist}}


# -- pipe codecs -------------------------------------------------------------------------------
def test_control_commands_round_trip_and_wait_for_whole_records():
    data = encode_start(123456789) + encode_stop() + encode_end()
    assert decode_control(data[:5]) == (None, None, 0)
    assert decode_control(data) == ("start", 123456789, 9)
    assert decode_control(data[9:]) == ("stop", None, 1)
    assert decode_control(data[10:]) == ("end", None, 1)
    with pytest.raises(WorkerLinkError, match="unknown control byte"):
        decode_control(b"X")


def test_report_lines_split_only_at_newlines():
    data = encode_record({"event": "ready", "worker": "consumer-0"}) + encode_record(con("consumer-0", 0, S, 5))
    records, used = decode_records(data[:-3])
    assert [r["event"] for r in records] == ["ready"] and data[used:].startswith(b"{")
    records, used = decode_records(data)
    assert used == len(data) and records[1]["stats"]["received"] == 5
    with pytest.raises(WorkerLinkError, match="not JSON"):
        decode_records(b"{oops\n")
    with pytest.raises(WorkerLinkError, match="not a report"):
        decode_records(b"[1, 2]\n")


def test_worker_link_over_real_pipes():
    report_r, report_w = os.pipe()
    control_r, control_w = os.pipe()
    try:
        link = WorkerLink("publisher-3", report_w, control_r)
        assert link.command_nowait() == (None, None)
        os.write(control_w, encode_start(42)[:4])
        assert link.command_nowait() == (None, None)          # half a start command waits
        os.write(control_w, encode_start(42)[4:] + encode_stop())
        assert link.command_nowait() == ("start", 42)
        assert link.command_nowait() == ("stop", None)
        link.send("ready")
        records, _ = decode_records(os.read(report_r, 4096))
        assert records == [{"event": "ready", "worker": "publisher-3"}]
        os.close(control_w)
        control_w = -1
        assert link.command_nowait() == ("end", None)         # the harness going away ends the worker
    finally:
        for fd in (report_r, report_w, control_r, control_w):
            if fd >= 0:
                os.close(fd)


# -- PerfTest's lines ------------------------------------------------------------------------
def second(**kw) -> SecondReport:
    base = dict(time_s=3.0, sent_rate=1234.4, confirmed_rate=1200.0, received_rate=1100.6, nacked=0, returned=0,
                consumer={"min": 1, "p50": 2, "p75": 3, "p95": 4, "p99": 5, "max": 6}, confirm=None,
                blocked={"publisher-0": False}, published=0, delivered=0)
    return SecondReport(**{**base, **kw})


def test_the_line_without_confirms():
    assert format_line(second()) == ("time 3.000 s, sent: 1234 msg/s, received: 1101 msg/s, "
                                     "min/median/75th/95th/99th/max consumer latency: 1/2/3/4/5/6 µs")


def test_the_line_with_confirms_and_a_blocked_publisher():
    rep = second(confirm={"min": 10, "p50": 20, "p75": 30, "p95": 40, "p99": 50, "max": 60},
                 blocked={"publisher-0": True, "publisher-1": False}, nacked=2)
    assert format_line(rep) == ("time 3.000 s, sent: 1234 msg/s, confirmed: 1200 msg/s, nacked: 2, "
                                "received: 1101 msg/s, min/median/75th/95th/99th/max consumer latency: "
                                "1/2/3/4/5/6 µs, confirm latency: 10/20/30/40/50/60 µs, blocked: publisher-0")


def test_the_summary_block():
    pct = {"count": 1, "min": 700, "p50": 700, "p75": 700, "p95": 700, "p99": 700, "max": 700}
    result = LoadResult(run_id="test-1", published=100, confirmed=100, nacked=0, returned=0, delivered=99, lost=1,
                        stale=0, gaps=1, duplicates=0, publish_rate=100.4, deliver_rate=99.0, window_s=1.0,
                        latency_us={"consumer": {**pct, "max": 900}, "confirm": pct}, histograms={},
                        errors=("consumer-0: broker closed the connection: 320 CONNECTION_FORCED",))
    assert format_summary(result).splitlines() == [
        "id: test-1, sending rate avg: 100 msg/s",
        "id: test-1, receiving rate avg: 99 msg/s",
        "id: test-1, min/median/75th/95th/99th/max confirm latency: 700/700/700/700/700/700 µs",
        "id: test-1, min/median/75th/95th/99th/max consumer latency: 700/700/700/700/700/900 µs",
        "id: test-1, published 100, confirmed 100, nacked 0, returned 0, delivered 99, undelivered 0, lost 1, "
        "rejected 0",
        "id: test-1, error: consumer-0: broker closed the connection: 320 CONNECTION_FORCED",
    ]
