"""The events' data: one frozen dataclass, and every key the broker puts in an event is a field of it.

The story: ``EventData``'s fields are exactly the keys events carry. Those keys are
taken from the source itself, not copied here: the dict of every ``….event(kind,
name, {...})`` call, the watchdog's alarm messages as its own loop builds them
(the supervisor records each as it came), the management sampler's alarms and
the Recorder's fsyncs. Written by a real Recorder and compacted, each lands in a
struct field of its own and nothing is dropped. An events file of before the
derived schema, with its ``extra`` JSON column, reads the same through
compaction and through the report's loader.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alarms.limits import DiskLimit, MemoryLimit
from alarms.watchdog import WatchdogCore, _Loop
from conftest import ROOT
from pipeline.loadgen.management import Observer
from pipeline.telemetry import Recorder
from pipeline.telemetry import parquet as tp
from pipeline.telemetry.events import EventData, data_row

pytestmark = pytest.mark.timeout(120)

T0_NS = 7_000_000_000_000
FIELDS = [f.name for f in dataclasses.fields(EventData)]
SAMPLE = {int: 7, str: "x", bool: True}       # a value of each field type, for a call site's keys
# Calls whose data is no dict literal, and where their keys come from instead (the functions below).
PASSED_THROUGH = {("supervisor.py", "on_alarm"): "the watchdog's alarm message, as it came",
                  ("runner.py", "sample"): "the management sampler's events"}


# -- where events come from ------------------------------------------------------------------------------

class _EventCalls(ast.NodeVisitor):
    """Every ``X.event(kind, name, data, ...)`` call, with the function it is in."""

    def __init__(self, filename: str):
        self.filename = filename
        self.function = "<module>"
        self.calls: list[tuple[str, str, ast.expr, ast.expr]] = []

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node):
        if isinstance(node.func, ast.Attribute) and node.func.attr == "event" and len(node.args) >= 3:
            self.calls.append((self.filename, self.function, node.args[0], node.args[2]))
        self.generic_visit(node)


def event_calls() -> list[tuple[str, str, ast.expr, ast.expr]]:
    """(file, function, kind, data) of every event the broker's source records."""
    calls = []
    for package in ("pipeline", "alarms", "ipc"):
        for path in sorted((ROOT / package).rglob("*.py")):
            visitor = _EventCalls(path.name)
            visitor.visit(ast.parse(path.read_text()))
            calls += visitor.calls
    return calls


def literal_events() -> list[tuple[str, dict]]:
    """(kind, data) for each call whose data is a dict literal: its keys, each with a value of its field's
    type (a key no field names gets text, which compaction would drop and name)."""
    hints = typing.get_type_hints(EventData)
    events = []
    for filename, function, kind, data in event_calls():
        if not isinstance(data, ast.Dict):
            continue
        keys = [k.value for k in data.keys]
        label = kind.value if isinstance(kind, ast.Constant) else f"{filename}:{function}"
        events.append((label, {k: SAMPLE[typing.get_args(hints[k])[0]] if k in hints else "no field" for k in keys}))
    return events


def watchdog_alarms() -> list[tuple[str, str, dict]]:
    """The watchdog's alarm messages for a memory and a disk alarm set and cleared, built by its own loop,
    as the supervisor records them: ``event("alarm_" + state, source, msg)``."""
    core = WatchdogCore(memory_limit=MemoryLimit(absolute_bytes=1000), disk_limit=DiskLimit(absolute_bytes=1000),
                        total_memory_bytes=10_000, node="creditflow@host")
    loop = _Loop(None, core, None, clock=lambda: T0_NS)
    sent: list[dict] = []
    loop.send = sent.append
    loop.emit(core.poll_memory(2000, T0_NS) + core.poll_memory(10, T0_NS + 1)
              + core.poll_disk(10, T0_NS + 2) + core.poll_disk(5000, T0_NS + 3))
    return [("alarm_" + m["state"], m["source"], m) for m in sent if m["type"] == "alarm"]


def management_alarms() -> list[tuple[str, str, dict]]:
    """A RabbitMQ node's memory and disk alarms set and cleared, as the management sampler records them."""
    observer = Observer()
    events = []
    for at, alarm in enumerate((False, True, False)):
        node = {"name": "rabbit@host", "mem_used": 100, "mem_limit": 1000, "mem_alarm": alarm,
                "disk_free": 10**9, "disk_free_limit": 5 * 10**7, "disk_free_alarm": alarm}
        events += observer.observe(T0_NS + at, [], [], [], [node]).events
    return [(e["event"], e["name"], e["data"]) for e in events]


def test_every_call_whose_data_is_no_literal_is_accounted_for():
    passed = {(filename, function) for filename, function, _, data in event_calls() if not isinstance(data, ast.Dict)}
    assert passed == set(PASSED_THROUGH)
    kinds = {label for label, _ in literal_events()}
    assert {"spawn", "connection", "fd_alarm_set", "fd_alarm_cleared", "queue_deleted", "paging", "host_ended",
            "stage_died", "stage_restarted", "stage_given_up", "fsync"} <= kinds


# -- the schema ----------------------------------------------------------------------------------------

def test_the_data_struct_is_derived_from_the_dataclass_and_there_is_no_extra_column():
    assert tp.EVENT_DATA_TYPE == tp.arrow_type(EventData)
    assert [f.name for f in tp.EVENT_DATA_TYPE] == FIELDS
    assert tp.EVENT_DATA_TYPE.field("on").type == pa.bool_() and tp.EVENT_DATA_TYPE.field("was").type == pa.int64()
    assert tp.EVENTS_SCHEMA.names == ["at_ns", "event", "name", "data"]
    assert all(f.default is None for f in dataclasses.fields(EventData))


def test_an_alarm_message_is_recorded_without_its_type():
    _, _, msg = watchdog_alarms()[0]
    assert msg["type"] == "alarm" and "type" not in data_row(msg)
    assert data_row({"pid": 3}) == {"pid": 3}


def test_every_key_the_broker_puts_in_an_event_becomes_a_field_of_its_own(tmp_path, monkeypatch):
    written = [(kind, "supervisor", data) for kind, data in literal_events()]
    written += watchdog_alarms() + management_alarms()
    results = {}
    compact = tp.compact
    monkeypatch.setattr(tp, "compact", lambda d: results.update(compact(d)) or results)

    rec = Recorder(str(tmp_path))
    for i, (kind, name, data) in enumerate(written):
        rec.event(kind, name, data, at_ns=T0_NS + i)
    rec.stats({"type": "stats", "name": "store", "kind": "store", "fsync_events": [[T0_NS + len(written), 1_500]]})
    rec.close({})

    assert results["events"]["dropped_fields"] == [] and results["events"]["nulled_values"] == 0
    rows = pq.read_table(tmp_path / "telemetry" / "events.parquet").to_pylist()
    assert rows[-1]["event"] == "fsync" and rows[-1]["data"]["duration_ns"] == 1_500
    for (kind, name, data), row in zip(written, rows):
        assert (row["event"], row["name"]) == (kind, name)
        assert {k: row["data"][k] for k in data_row(data)} == data_row(data), kind
    keys = {k for _, _, data in written for k in data_row(data)}
    assert sorted(keys) == sorted(FIELDS)                      # and no field that no event sets


def test_a_key_no_field_names_is_dropped_and_named(tmp_path):
    tele = tmp_path / "telemetry"
    tele.mkdir()
    (tele / "events.jsonl").write_text(json.dumps({"at_ns": T0_NS, "event": "connection", "name": "reader-1",
                                                   "data": {"peer": "127.0.0.1:5555", "cipher": "TLS"}}) + "\n")

    result = tp.compact(str(tele))["events"]

    assert result["dropped_fields"] == ["data.cipher"]
    assert pq.read_table(tele / "events.parquet").to_pylist()[0]["data"]["peer"] == "127.0.0.1:5555"


# -- runs recorded before: the data struct's first nine fields and an ``extra`` column of JSON text --------

OLD_DATA_TYPE = pa.struct([("duration_ns", pa.int64()), ("source", pa.string()), ("state", pa.string()),
                           ("used", pa.int64()), ("free", pa.int64()), ("limit", pa.int64()),
                           ("at_ns", pa.int64()), ("kind", pa.string()), ("pid", pa.int64())])
OLD_EVENTS_SCHEMA = pa.schema([("at_ns", pa.int64()), ("event", pa.string()), ("name", pa.string()),
                               ("data", OLD_DATA_TYPE), ("extra", pa.string())])

OLD_EVENTS = [   # as they were written: (at_ns, event, name, data)
    (T0_NS, "spawn", "reader-1", {"pid": 11, "kind": "reader", "host": "host-reader-0"}),
    (T0_NS + 1, "connection", "reader-1", {"peer": "127.0.0.1:5555"}),
    (T0_NS + 2, "alarm_set", "memory", {"type": "alarm", "source": "memory", "state": "set", "at_ns": T0_NS + 2,
                                        "used": 2000, "limit": 1000}),
    (T0_NS + 3, "fsync", "store", {"duration_ns": 1_500}),
    (T0_NS + 4, "stage_died", "queue-q", {"how": "signal 9", "action": "restart", "kind": "queue", "pid": 12}),
]


def old_events_file(path: Path) -> None:
    """``OLD_EVENTS`` as an events.parquet of before the derived schema: what its struct did not name in
    ``extra``, as ``{"data": {...}}``."""
    known = set(OLD_DATA_TYPE.names)
    rows = []
    for at_ns, event, name, data in OLD_EVENTS:
        more = {k: v for k, v in data.items() if k not in known}
        rows.append({"at_ns": at_ns, "event": event, "name": name, "data": data,
                     "extra": json.dumps({"data": more}) if more else None})
    pq.write_table(pa.Table.from_pylist(rows, schema=OLD_EVENTS_SCHEMA), path)


def expected_data(data: dict) -> dict:
    return {f: data_row(data).get(f) for f in FIELDS}


def test_a_broker_appending_to_an_old_events_file_moves_extra_into_the_struct(tmp_path):
    tele = tmp_path / "telemetry"
    tele.mkdir()
    old_events_file(tele / "events.parquet")
    later = {"at_ns": T0_NS + 10, "event": "stage_restarted", "name": "queue-q", "data": {"pid": 13, "was": 12}}
    (tele / "events.jsonl").write_text(json.dumps(later) + "\n")

    result = tp.compact(str(tele))["events"]

    table = pq.read_table(tele / "events.parquet")
    assert table.schema.equals(tp.EVENTS_SCHEMA) and result["rows"] == len(OLD_EVENTS) + 1
    rows = table.to_pylist()
    assert [r["data"] for r in rows[:-1]] == [expected_data(data) for *_, data in OLD_EVENTS]
    assert rows[-1]["data"] == expected_data(later["data"])


def test_an_old_events_file_without_extra_gains_the_new_fields_as_null(tmp_path):
    tele = tmp_path / "telemetry"
    tele.mkdir()
    first = pa.schema([f for f in OLD_EVENTS_SCHEMA if f.name != "extra"])
    pq.write_table(pa.Table.from_pylist([{"at_ns": T0_NS, "event": "spawn", "name": "store",
                                          "data": {"pid": 13, "kind": "store"}}], schema=first),
                   tele / "events.parquet")
    (tele / "events.jsonl").write_text(json.dumps({"at_ns": T0_NS + 1, "event": "connection", "name": "reader-1",
                                                   "data": {"peer": "127.0.0.1:5555"}}) + "\n")

    tp.compact(str(tele))

    rows = pq.read_table(tele / "events.parquet").to_pylist()
    assert [r["data"] for r in rows] == [expected_data({"pid": 13, "kind": "store"}),
                                         expected_data({"peer": "127.0.0.1:5555"})]


@pytest.mark.spark
def test_the_report_reads_an_old_events_file_as_a_new_run(spark, tmp_path):
    from test_telemetry_parquet import rows_of

    from pipeline.analytics.load import EVENTS_SCHEMA, load_run

    old_tele = tmp_path / "old" / "telemetry"
    old_tele.mkdir(parents=True)
    old_events_file(old_tele / "events.parquet")
    new_tele = tmp_path / "new" / "telemetry"
    new_tele.mkdir(parents=True)
    with open(new_tele / "events.jsonl", "w") as f:
        f.writelines(json.dumps({"at_ns": at, "event": e, "name": n, "data": data_row(d)}) + "\n"
                     for at, e, n, d in OLD_EVENTS)
    compacted = tmp_path / "compacted" / "telemetry"
    shutil.copytree(old_tele, compacted)
    (compacted / "events.jsonl").write_text("")
    tp.compact(str(compacted))

    old, new, again = (load_run(spark, str(t.parent)).events for t in (old_tele, new_tele, compacted))

    assert old.schema == new.schema == again.schema == EVENTS_SCHEMA
    assert rows_of(old) == rows_of(new) == rows_of(again)
    spawn = old.where("event = 'spawn'").first()["data"]
    assert (spawn["host"], spawn["pid"]) == ("host-reader-0", 11)
    assert old.where("event = 'connection'").first()["data"]["peer"] == "127.0.0.1:5555"
