"""Telemetry as Parquet: compaction of the broker's JSON lines, and the report reading either form.

The story: a broker appends JSON lines while it runs; when it stops, its
Recorder compacts them into Parquet (int64-ns columns) and deletes the JSONL,
unless anything goes wrong, in which case the JSONL stays. A broker killed
before that leaves JSONL, a crash leaves a torn last line, and the report
must see the same rows whichever files it finds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from pipeline.telemetry import parquet as tp
from pipeline.telemetry import Recorder
from test_report import write_run

pytestmark = pytest.mark.timeout(120)

T0_NS = 7_000_000_000_000


def link(sent: int, credit: int | None = 100) -> dict:
    return {"sent": sent, "records": sent + 1, "in_flight": 3, "max_in_flight": 40, "overflow": 0,
            "credit": credit}


def stats_rows() -> list[dict]:
    return [
        {"name": "reader-1", "kind": "reader", "pid": 11, "at_ns": T0_NS, "state": "flow", "blocked": True,
         "block_count": 1, "blocked_total_ns": 5_000_000, "publishes": 400, "first_publish_ns": T0_NS - 9,
         "unknown_field": {"nested": [1, 2]}, "conn_state": "flow", "alarm_reasons": ["memory"],
         "notices": [[T0_NS - 5, "blocked", "low on memory", True], [T0_NS - 2, "unblocked", None, False]],
         "links": {"reader-1->channel-1.1": link(400, 0)}},
        {"name": "queue-q", "kind": "queue", "pid": 12, "at_ns": T0_NS + 100_000_000, "messages": 7,
         "links": {"queue-q->store": link(10), "queue-q->reader-2": link(9, None)}},
        {"name": "store", "kind": "store", "pid": 13, "at_ns": T0_NS + 200_000_000, "fsyncs": 2,
         "fsync_ms_total": 2.1, "segments": {"files": 1, "live_bytes": 4096},
         "fsync_events": [[T0_NS + 150_000_000, 1_200_000], [T0_NS + 190_000_000, 900_000]], "links": {}},
        {"name": "watchdog", "kind": "watchdog", "pid": 14, "at_ns": T0_NS + 300_000_000,
         "memory_used": 3 << 30, "memory_limit": 4 << 30, "memory_alarm": False, "disk_free": 9 << 40,
         "disk_limit": 50_000_000, "disk_alarm": False},
    ]


def states_rows() -> list[dict]:
    return [{"at_ns": T0_NS + i * 100_000_000, "name": name, "kind": kind, "state": "running"}
            for i in range(5) for name, kind in (("reader-1", "reader"), ("store", "store"))]


def events_rows() -> list[dict]:
    return [
        {"at_ns": T0_NS - 1, "event": "spawn", "name": "store", "data": {"pid": 13, "kind": "store"}},
        {"at_ns": T0_NS, "event": "connection", "name": "reader-1", "data": {"peer": "127.0.0.1:5555"}},
        {"at_ns": T0_NS + 150_000_000, "event": "fsync", "name": "store", "data": {"duration_ns": 1_200_000}},
        {"at_ns": T0_NS + 2, "event": "alarm_set", "name": "memory",
         "data": {"source": "memory", "state": "set", "used": 5 << 30, "limit": 4 << 30, "at_ns": T0_NS + 2}},
    ]


def write_jsonl(path: Path, rows: list[dict], tail: str = "") -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write(tail)


TORN = '{"name":"reader-1","kind":"rea'


def telemetry_dir(root: Path) -> Path:
    """A telemetry dir as a crashed-then-restarted broker may leave it: a torn line, foreign keys."""
    tele = root / "telemetry"
    tele.mkdir(parents=True)
    write_jsonl(tele / "stats.jsonl", stats_rows(), tail=TORN)          # torn last line, no newline
    write_jsonl(tele / "states.jsonl", states_rows())
    write_jsonl(tele / "events.jsonl", events_rows())
    return tele


# -- the schemas -------------------------------------------------------------------------------------------

def test_timestamps_and_durations_are_int64_nanoseconds():
    for schema in tp.TABLES.values():
        assert schema.field("at_ns").type == pa.int64()
        ns = [f for f in schema if f.name.endswith("_ns")]
        assert all(f.type == pa.int64() for f in ns), ns
    assert tp.EVENT_DATA_TYPE.field("duration_ns").type == pa.int64()
    links = tp.STATS_SCHEMA.field("links").type
    assert isinstance(links, pa.MapType) and links.key_type == pa.string()
    assert [f.name for f in links.item_type] == ["sent", "records", "in_flight", "max_in_flight", "overflow",
                                                 "credit"]
    assert all(f.type == pa.int64() for f in links.item_type)


# -- compaction --------------------------------------------------------------------------------------------

def test_compact_converts_each_file_skips_a_torn_line_and_deletes_the_jsonl(tmp_path):
    tele = telemetry_dir(tmp_path)
    sizes = {n: (tele / f"{n}.jsonl").stat().st_size for n in tp.TABLES}

    results = tp.compact(str(tele))

    assert sorted(os.listdir(tele)) == ["events.parquet", "states.parquet", "stats.parquet"]
    assert {n: r["rows"] for n, r in results.items()} == {"stats": 4, "states": 10, "events": 4}
    assert results["stats"]["skipped_lines"] == 1 and results["states"]["skipped_lines"] == 0
    # what no statistics class defines is named, not kept (the Recorder never writes fsync_events)
    assert results["stats"]["dropped_fields"] == ["fsync_events", "unknown_field"]
    for name, r in results.items():
        assert r["jsonl_bytes"] == sizes[name]
        assert r["parquet_bytes"] == (tele / f"{name}.parquet").stat().st_size > 0
        assert r["nulled_values"] == 0

    stats = pq.read_table(tele / "stats.parquet")
    assert stats.schema.equals(tp.STATS_SCHEMA)
    assert "unknown_field" not in stats.column_names and "extra" not in stats.column_names
    rows = stats.to_pylist()
    assert rows[0]["conn_state"] == "flow" and rows[0]["alarm_reasons"] == ["memory"]
    assert rows[0]["notices"] == [{"at_ns": T0_NS - 5, "state": "blocked", "reason": "low on memory", "sent": True},
                                  {"at_ns": T0_NS - 2, "state": "unblocked", "reason": None, "sent": False}]
    assert [r["at_ns"] for r in rows] == [T0_NS, T0_NS + 100_000_000, T0_NS + 200_000_000, T0_NS + 300_000_000]
    assert dict(rows[0]["links"]) == {"reader-1->channel-1.1": link(400, 0)}
    assert dict(rows[1]["links"])["queue-q->reader-2"]["credit"] is None
    assert rows[1]["publishes"] is None                      # missing -> null
    assert rows[2]["fsync_ms_total"] == 2.1 and rows[2]["segments"]["live_bytes"] == 4096
    assert rows[2]["segments"]["files"] == 1 and rows[2]["segments"]["syncs"] is None
    assert rows[3]["memory_used"] == 3 << 30 and rows[3]["disk_free"] == 9 << 40

    events = pq.read_table(tele / "events.parquet")
    assert events.schema.equals(tp.EVENTS_SCHEMA) and "extra" not in events.column_names
    assert results["events"]["dropped_fields"] == []
    events = events.to_pylist()
    assert events[1]["data"] == {f.name: "127.0.0.1:5555" if f.name == "peer" else None for f in tp.EVENT_DATA_TYPE}
    assert events[3]["data"]["used"] == 5 << 30 and events[3]["data"]["source"] == "memory"
    assert pq.read_table(tele / "states.parquet").to_pylist() == states_rows()


def test_a_value_of_the_wrong_type_becomes_null_and_the_rest_of_its_row_stays(tmp_path):
    tele = tmp_path / "telemetry"
    tele.mkdir()
    rows = states_rows()[:3]
    rows[1]["at_ns"] = "yesterday"
    write_jsonl(tele / "states.jsonl", rows + [[1, 2], "text"])    # JSON, but no objects: skipped

    result = tp.compact(str(tele))["states"]

    assert (result["rows"], result["nulled_values"], result["skipped_lines"]) == (3, 1, 2)
    table = pq.read_table(tele / "states.parquet").to_pylist()
    assert table[1] == dict(rows[1], at_ns=None)
    assert table[0] == rows[0] and table[2] == rows[2]


def test_compacting_again_appends_to_the_existing_parquet(tmp_path):
    tele = telemetry_dir(tmp_path)
    tp.compact(str(tele))
    later = [dict(r, at_ns=r["at_ns"] + 10**12) for r in states_rows()]
    write_jsonl(tele / "states.jsonl", later)            # the next broker on the same data dir

    results = tp.compact(str(tele))

    assert list(results) == ["states"]                   # a table without JSONL is left alone
    assert results["states"]["rows"] == 20 and results["states"]["jsonl_rows"] == 10
    assert pq.read_table(tele / "states.parquet").to_pylist() == states_rows() + later


def test_chunks_make_one_file_of_all_rows(tmp_path):
    tele = tmp_path / "telemetry"
    tele.mkdir()
    rows = [dict(r, at_ns=T0_NS + i) for i, r in enumerate(states_rows() * 7)]
    write_jsonl(tele / "states.jsonl", rows, tail="\n\n")   # blank lines are not records, nor skipped ones

    result = tp.compact(str(tele), chunk_lines=8)["states"]

    assert (result["rows"], result["skipped_lines"]) == (70, 0)
    assert pq.ParquetFile(tele / "states.parquet").metadata.num_row_groups == 9
    assert pq.read_table(tele / "states.parquet").column("at_ns").to_pylist() == [r["at_ns"] for r in rows]


def test_a_directory_in_the_way_keeps_that_jsonl_and_compacts_the_others(tmp_path):
    tele = telemetry_dir(tmp_path)
    (tele / "stats.parquet").mkdir()
    before = (tele / "stats.jsonl").read_bytes()

    with pytest.raises(tp.CompactionFailed, match="stats: ") as failed:
        tp.compact(str(tele))

    assert list(failed.value.failures) == ["stats"]
    assert set(failed.value.results) == {"states", "events"}
    assert (tele / "stats.jsonl").read_bytes() == before
    assert (tele / "states.parquet").is_file() and not (tele / "states.jsonl").exists()
    assert not [n for n in os.listdir(tele) if n.endswith(tp.TMP_SUFFIX)]


def test_a_failing_writer_leaves_the_jsonl_and_no_parquet(tmp_path, monkeypatch):
    tele = telemetry_dir(tmp_path)
    before = {n: (tele / f"{n}.jsonl").read_bytes() for n in tp.TABLES}

    def disk_full(self, table, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", disk_full)
    with pytest.raises(tp.CompactionFailed, match="No space left on device"):
        tp.compact(str(tele))

    assert sorted(os.listdir(tele)) == ["events.jsonl", "states.jsonl", "stats.jsonl"]
    assert {n: (tele / f"{n}.jsonl").read_bytes() for n in tp.TABLES} == before


def test_a_corrupt_old_parquet_file_is_not_overwritten(tmp_path):
    tele = telemetry_dir(tmp_path)
    (tele / "events.parquet").write_bytes(b"not parquet")

    with pytest.raises(tp.CompactionFailed, match="events: "):
        tp.compact(str(tele))

    assert (tele / "events.parquet").read_bytes() == b"not parquet"
    assert (tele / "events.jsonl").exists() and (tele / "stats.parquet").exists()


# -- the Recorder ------------------------------------------------------------------------------------------

def record_a_little(data_dir: Path) -> Recorder:
    rec = Recorder(str(data_dir))
    for row in stats_rows():
        rec.stats(dict(row, type="stats"))
    rec.state(T0_NS, "store", "store", "running")
    rec.event("spawn", "store", {"pid": 13, "kind": "store"}, at_ns=T0_NS)
    return rec


def test_recorder_close_compacts_and_logs_it(tmp_path):
    record_a_little(tmp_path).close({"run_id": "r1"})

    tele = tmp_path / "telemetry"
    assert sorted(os.listdir(tele)) == ["events.parquet", "final.json", "states.parquet", "stats.parquet"]
    assert pq.read_table(tele / "stats.parquet").num_rows == 4
    # the store's fsync_events became events of their own
    assert pq.read_table(tele / "events.parquet").column("event").to_pylist() == ["fsync", "fsync", "spawn"]
    assert "telemetry compacted to Parquet: stats 4 rows" in (tmp_path / "broker.log").read_text()


def test_recorder_keeps_the_jsonl_when_compaction_fails(tmp_path, monkeypatch):
    def broken(telemetry_dir):
        raise tp.CompactionFailed({"stats": "OSError: boom"}, {})

    monkeypatch.setattr(tp, "compact", broken)
    record_a_little(tmp_path).close({"run_id": "r1"})

    tele = tmp_path / "telemetry"
    assert len((tele / "stats.jsonl").read_text().splitlines()) == 4
    assert not list(tele.glob("*.parquet"))
    assert "[warning] telemetry kept as JSON lines: CompactionFailed" in (tmp_path / "broker.log").read_text()


def test_pyarrow_is_loaded_only_when_the_recorder_closes(tmp_path):
    code = ("import sys; from pipeline.telemetry import Recorder; import pipeline.broker.supervisor; "
            f"r = Recorder({str(tmp_path)!r}); r.state(1, 'store', 'store', 'running'); r.flush(); "
            "print('pyarrow' in sys.modules); r.close({}); print('pyarrow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr


@pytest.mark.parametrize("process_ends, pandas_after_close", [(True, False), (False, True)])
def test_a_process_that_ends_after_closing_compacts_without_importing_pandas(tmp_path, process_ends,
                                                                            pandas_after_close):
    """The supervisor's close: the same Parquet, pandas never imported (it was half of a broker's stop),
    and pandas importable afterwards. A close that the process outlives lets pyarrow import it."""
    code = ("import sys; from pipeline.telemetry import Recorder; "
            f"r = Recorder({str(tmp_path)!r}); r.state(1, 'store', 'store', 'running'); r.flush(); "
            f"r.close({{}}, process_ends={process_ends}); print('pandas' in sys.modules); "
            "import pandas; print(pandas.DataFrame({'a': [1]}).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == [str(pandas_after_close), "(1,", "1)"], out.stdout + out.stderr
    assert not (tmp_path / "telemetry" / "states.jsonl").exists()
    assert pq.read_table(tmp_path / "telemetry" / "states.parquet").column("state").to_pylist() == ["running"]


# -- the report reads either form --------------------------------------------------------------------------

def rows_of(df) -> list[str]:
    from pyspark.sql import functions as F

    return sorted(r[0] for r in df.select(F.to_json(F.struct(*df.columns))).collect())


@pytest.mark.spark
def test_parquet_and_jsonl_read_to_the_same_dataframes(spark, tmp_path):
    from pipeline.analytics.load import load_run

    jsonl_run = tmp_path / "jsonl"
    telemetry_dir(jsonl_run)
    parquet_run = tmp_path / "parquet"
    shutil.copytree(jsonl_run, parquet_run)
    tp.compact(str(parquet_run / "telemetry"))

    a, b = load_run(spark, str(jsonl_run)), load_run(spark, str(parquet_run))

    for name in ("stats", "states", "events"):
        da, db = getattr(a, name), getattr(b, name)
        assert da.schema == db.schema, name
        assert rows_of(da) == rows_of(db), name
    assert a.stats.count() == 4                       # the torn line is no row of nulls
    assert b.stats.where("name = 'reader-1'").first()["links"]["reader-1->channel-1.1"]["credit"] == 0


@pytest.mark.spark
def test_both_files_are_read_and_neither_is_an_empty_table(spark, tmp_path):
    from pipeline.analytics.load import STATES_SCHEMA, STATS_SCHEMA, load_run

    tele = telemetry_dir(tmp_path / "run")
    tp.compact(str(tele))
    write_jsonl(tele / "states.jsonl", [dict(r, at_ns=r["at_ns"] + 10**12) for r in states_rows()])
    os.unlink(tele / "stats.parquet")

    frames = load_run(spark, str(tmp_path / "run"))

    assert frames.states.count() == 20                 # a killed later broker's JSONL after the Parquet
    assert frames.stats.count() == 0 and frames.stats.schema == STATS_SCHEMA
    assert frames.states.schema == STATES_SCHEMA


@pytest.mark.spark
def test_the_report_says_the_same_of_a_compacted_run(spark, tmp_path):
    from pipeline.analytics.report import build_report

    jsonl_run, parquet_run = tmp_path / "jsonl" / "run", tmp_path / "parquet" / "run"   # one label
    write_run(jsonl_run, 0.6, 1.0, 1.0, alarm=True)
    shutil.copytree(jsonl_run, parquet_run)
    tp.compact(str(parquet_run / "telemetry"))

    build_report([str(jsonl_run)])
    build_report([str(parquet_run)])

    assert (json.loads((jsonl_run / "report" / "diagnosis.json").read_text())
            == json.loads((parquet_run / "report" / "diagnosis.json").read_text()))
    for table in sorted(os.listdir(jsonl_run / "report" / "tables")):
        assert ((jsonl_run / "report" / "tables" / table).read_text()
                == (parquet_run / "report" / "tables" / table).read_text()), table


# -- a real broker -----------------------------------------------------------------------------------------

@pytest.mark.processes
def test_a_broker_leaves_parquet_telemetry_when_it_stops(broker):
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    ch = conn.channel()
    ch.queue_declare("pq")
    for i in range(200):
        ch.basic_publish("", "pq", b"x" * 100)
    broker.wait_for(lambda s: s["processes"]["queue-pq"].get("messages") == 200, what="200 messages queued")
    conn.close()

    assert broker.stop() == 0, broker.output()[-3000:]

    tele = broker.data_dir / "telemetry"
    assert sorted(p.name for p in tele.iterdir()) == ["events.parquet", "final.json", "states.parquet",
                                                      "stats.parquet"]
    stats = pq.read_table(tele / "stats.parquet")
    assert stats.num_rows > 0 and stats.schema.equals(tp.STATS_SCHEMA)
    assert {"reader", "channel", "queue", "store", "watchdog"} <= set(stats.column("kind").to_pylist())
    assert pq.read_table(tele / "states.parquet").num_rows > 0
    assert "spawn" in pq.read_table(tele / "events.parquet").column("event").to_pylist()
    assert "telemetry compacted to Parquet" in (broker.data_dir / "broker.log").read_text()



def test_with_many_stages_each_stages_snapshots_are_thinned_and_its_last_one_kept(tmp_path):
    """A thousand busy stages must not write gigabytes: past STATS_ROWS_PER_S / 10 stages each stage's
    snapshot is written at most every stages / STATS_ROWS_PER_S s, and its newest one when it ends."""
    from pipeline.telemetry import STATS_ROWS_PER_S, Recorder
    rec = Recorder(str(tmp_path))
    ms = 1_000_000
    for t in range(0, 2000, 100):                        # 2 s of a push every 100 ms
        rec.stats({"type": "stats", "name": "few", "n": t}, stages=3, now_ns=t * ms)
        rec.stats({"type": "stats", "name": "many", "n": t}, stages=STATS_ROWS_PER_S, now_ns=t * ms)
    rec.stage_ended("many")
    rec.flush()
    rows = [json.loads(line) for line in (tmp_path / "telemetry" / "stats.jsonl").read_text().splitlines()]
    assert [r["n"] for r in rows if r["name"] == "few"] == list(range(0, 2000, 100))
    assert [r["n"] for r in rows if r["name"] == "many"] == [0, 1000, 1900]     # one a second, then its last
    assert all("type" not in r for r in rows)
    rec.close({})
