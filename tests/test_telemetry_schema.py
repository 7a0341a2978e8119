"""One statistics schema: the stages' frozen dataclasses, and everything derived from them.

The story: each stage kind's statistics are a class of ``pipeline.telemetry.schema``.
The message a stage sends is that class's ``to_dict()`` (the keys ``ctl status``
shows, which the HTTP API reads, so they are pinned here); the Parquet and Spark
schemas are generated from the classes' fields; a snapshot too big for a control
message is cut to its busiest links; a real broker's every stage sends exactly
the fields its class defines; and a run recorded before the schema, with its
``extra`` JSON column, still reads the same.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ipc.control import MAX_CONTROL_BYTES
from pipeline.broker.stage import STATS_LINKS_KEPT, busiest_links
from pipeline.telemetry import parquet as tp
from pipeline.telemetry import schema
from pipeline.telemetry.schema import (STATS_TYPES, ChannelStats, ClientProperties, ConsumerDetail, LinkStats,
                                       NoticeSent, QueueStats, ReaderStats, SchemaConflict, StageStats, StoreStats)

pytestmark = pytest.mark.timeout(120)

T0_NS = 7_000_000_000_000

# What ``ctl status`` showed per process kind before the schema was a module (the supervisor adds alive,
# host, seconds and restarts), and what was added since for the management API (user, recv_oct, send_oct,
# client_properties, channel_unacked; confirmed, prefetch_count, global_prefetch_count, consumer_count;
# consumer_details): the HTTP API is built on these names, so they do not move.
STATUS_KEYS = {
    "reader": "alarm_reasons alive at_ns block_count block_started_ns blocked blocked_by blocked_total_ns channels "
              "client_name conn_state deferred_grants deliveries first_publish_after_resume_ns first_publish_ns "
              "first_stop_ns host kind last_publish_ns links name notices pid publishes restarts resumed_ns "
              "seconds state stopped_reading_ns trims unparsed_bytes user recv_oct send_oct client_properties "
              "channel_unacked",
    "channel": "alive at_ns block_count block_started_ns blocked blocked_by blocked_total_ns confirm_mode "
               "confirms_sent deferred_grants host kind links nacks_sent name number pid restarts returned routed "
               "seconds state trims unconfirmed unroutable confirmed prefetch_count global_prefetch_count "
               "consumer_count",
    "queue": "acked alive at_ns awaiting_confirm block_count block_started_ns blocked blocked_by blocked_total_ns "
             "consumer_bias consumer_bias_engaged consumers dead_letter_cycles dead_lettered dead_letters_sent deferred_grants delivered dropped "
             "durable enqueued expired host journal_fsyncs journal_full kind links message_bytes messages name "
             "paged_in paged_messages paged_out paging pid purged queue recovered redelivered rejected restarts "
             "seconds state store_resent stored trims unacked consumer_details bodies_lent bodies_sent_by_copy",
    "store": "adopted alive at_ns block_count block_started_ns blocked blocked_by blocked_total_ns deferred_grants "
             "disk_full disk_full_episodes fsync_ms_total fsyncs held_writes host kind links name pid removes "
             "restarts seconds segments state trims writes",
    "watchdog": "alarm_clears alarm_sets alive at_ns disk_alarm disk_free disk_interval_ms disk_limit disk_polls "
                "failed_polls host kind measured_processes memory_alarm memory_interval_ms memory_limit "
                "memory_polls memory_used name pid polls pss_reads restarts rss_reads seconds state strategy "
                "total_memory",
}
LINK_KEYS = ["sent", "records", "in_flight", "max_in_flight", "overflow", "credit"]
SUPERVISOR_KEYS = {"alive", "host", "seconds", "restarts"}


def message_keys(cls) -> set[str]:
    """The keys a stage of class ``cls`` sends that ``ctl status`` shows (optional and not-column fields aside)."""
    return {f.name for f in dataclasses.fields(cls)
            if schema.is_column(f) and not f.metadata.get("optional")}


def stage_fields(name: str, kind: str, links: dict | None = None) -> dict:
    return dict(name=name, kind=kind, pid=1, at_ns=T0_NS, state="running", blocked=False, block_started_ns=None,
                blocked_total_ns=0, block_count=0, deferred_grants=0, trims=0, blocked_by=(), links=links or {})


def a_reader() -> ReaderStats:
    return ReaderStats(**stage_fields("reader-1", "reader", {"reader-1->channel-1.1": LinkStats(5, 6, 1, 9, 0, 95)}),
                       conn_state="running", publishes=5, deliveries=0, first_publish_ns=T0_NS - 10,
                       last_publish_ns=T0_NS - 1, stopped_reading_ns=0, first_stop_ns=0, resumed_ns=0,
                       first_publish_after_resume_ns=0, channels=1, client_name="app", alarm_reasons=("memory",),
                       notices=(NoticeSent(T0_NS - 5, "blocked", "low on memory", True),), unparsed_bytes=0,
                       user="guest", recv_oct=700, send_oct=900,
                       client_properties=ClientProperties.of({"product": "pika", "capabilities": {"a": 1}}),
                       channel_unacked={"1": 3})


# -- the classes, and what the stages send ---------------------------------------------------------------

def test_every_kind_has_its_class_and_the_status_keys_are_its_fields():
    for kind, keys in STATUS_KEYS.items():
        assert message_keys(STATS_TYPES[kind]) | {"state"} == set(keys.split()) - SUPERVISOR_KEYS, kind
    assert [f.name for f in dataclasses.fields(LinkStats)] == LINK_KEYS


def test_to_dict_is_the_json_a_stage_sends():
    reader = a_reader()
    msg = json.loads(json.dumps(reader.to_dict()))

    assert list(msg) == [f.name for f in dataclasses.fields(ReaderStats) if f.name != "links_omitted"]
    assert msg["links"] == {"reader-1->channel-1.1": dict(zip(LINK_KEYS, [5, 6, 1, 9, 0, 95]))}
    assert msg["notices"] == [[T0_NS - 5, "blocked", "low on memory", True]]     # an array, as status showed it
    assert msg["alarm_reasons"] == ["memory"] and msg["blocked_by"] == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        reader.publishes = 6


def test_a_field_a_class_does_not_define_cannot_be_sent():
    with pytest.raises(TypeError, match="unexpected keyword argument 'publishez'"):
        ChannelStats(**stage_fields("channel-1.1", "channel"), number=1, routed=0, unroutable=0, returned=0,
                     unconfirmed=0, confirms_sent=0, nacks_sent=0, confirm_mode="none", publishez=3)
    assert schema.unknown_fields({"type": "stats", "kind": "reader", **a_reader().to_dict(), "extra": 1}) == {"extra"}


def test_a_message_reads_back_as_its_class_and_a_missing_or_misshapen_field_is_refused():
    reader = a_reader()
    msg = json.loads(json.dumps({"type": "stats", **reader.to_dict()}))
    assert schema.stats_of({**msg, "alive": True, "seconds": {"flow": 1.0}}) == reader     # the supervisor's keys aside
    queue = a_queue(schema.CONSUMER_DETAILS_KEPT + 5)
    assert schema.stats_of(json.loads(json.dumps(queue.to_dict()))) == queue

    with pytest.raises(schema.SchemaMismatch, match="ReaderStats lacks publishes"):
        schema.stats_of({k: v for k, v in msg.items() if k != "publishes"})
    with pytest.raises(schema.SchemaMismatch, match="ReaderStats.recv_oct"):
        schema.stats_of({**msg, "recv_oct": "700"})
    with pytest.raises(schema.SchemaMismatch, match="no statistics class"):
        schema.stats_of({**msg, "kind": "host"})


def test_the_store_sends_its_fsyncs_but_they_are_no_column():
    store = StoreStats(**stage_fields("store", "store"), writes=1, removes=0, fsyncs=1, adopted=0, disk_full=False,
                       disk_full_episodes=0, held_writes=0, fsync_ms_total=1.5,
                       segments=tp.stats_schema.SegmentStatistics(*range(21)), fsync_events=((T0_NS, 1_500_000),))
    msg = {"type": "stats", **store.to_dict()}

    assert msg["fsync_events"] == [[T0_NS, 1_500_000]] and msg["segments"]["files"] == 0
    assert schema.stats_of(json.loads(json.dumps(msg))) == store
    assert "fsync_events" not in schema.row_of(msg) and "type" not in schema.row_of(msg)
    assert "fsync_events" not in tp.STATS_SCHEMA.names


def test_a_snapshot_with_thousands_of_links_is_cut_to_fit_a_control_message():
    links = {f"channel-1234.1->queue-a-queue-with-a-long-name-{i:05d}": LinkStats(i, i, i % 300, 400, 0, 10)
             for i in range(3000)}
    stats = ChannelStats(**stage_fields("channel-1234.1", "channel", links), number=1, routed=0, unroutable=0,
                         returned=0, unconfirmed=0, confirms_sent=0, nacks_sent=0, confirm_mode="none",
                         confirmed=0, prefetch_count=0, global_prefetch_count=0, consumer_count=0)
    assert "links_omitted" not in stats.to_dict()                 # only a cut snapshot has it
    assert len(json.dumps({"type": "stats", **stats.to_dict()})) > MAX_CONTROL_BYTES

    cut = busiest_links(stats, STATS_LINKS_KEPT)

    msg = {"type": "stats", **cut.to_dict()}
    assert len(json.dumps(msg).encode()) < MAX_CONTROL_BYTES
    assert msg["links_omitted"] == 3000 - STATS_LINKS_KEPT and len(msg["links"]) == STATS_LINKS_KEPT
    assert sorted({v["in_flight"] for v in msg["links"].values()}) == list(range(290, 300))   # the busiest
    assert type(cut) is ChannelStats and cut.number == 1


def test_client_properties_keep_the_usual_keys_small_and_json_safe():
    table = {"product": b"pika", "version": "1.3.2", "platform": "Python " + "x" * 1000, "copyright": "(c)",
             "capabilities": {f"cap{i}": i % 2 for i in range(100)}}
    props = ClientProperties.of(table)

    assert (props.product, props.version, props.connection_name) == ("pika", "1.3.2", None)
    assert len(props.platform) == schema.CLIENT_TEXT_MAX
    assert len(props.capabilities) == schema.CLIENT_CAPABILITIES_MAX and props.capabilities["cap1"] is True
    msg = json.loads(json.dumps(a_reader().to_dict()))
    assert msg["client_properties"]["product"] == "pika" and msg["client_properties"]["capabilities"] == {"a": True}
    assert (msg["user"], msg["recv_oct"], msg["send_oct"], msg["channel_unacked"]) == ("guest", 700, 900, {"1": 3})


def a_queue(consumers: int) -> QueueStats:
    counts = dict.fromkeys(("messages", "unacked", "message_bytes", "enqueued", "delivered", "redelivered", "acked",
                            "expired", "dead_lettered", "dropped", "rejected", "purged", "stored",
                            "awaiting_confirm", "recovered", "paged_messages", "paged_out", "paged_in",
                            "store_resent", "journal_fsyncs", "dead_letters_sent", "dead_letter_cycles",
                            "consumer_bias_engaged", "bodies_lent", "bodies_sent_by_copy"), 0)
    details = tuple(ConsumerDetail(f"amq.ctag-{i:022d}", f"channel-{i}.1", 1, True, 10, False)
                    for i in range(min(consumers, schema.CONSUMER_DETAILS_KEPT)))
    left = consumers - len(details)
    return QueueStats(**stage_fields("queue-q", "queue"), queue="q", durable=True, journal_full=False,
                      consumers=consumers, paging=False, consumer_bias=False, **counts, consumer_details=details,
                      consumer_details_omitted=left or None)


def test_a_queue_with_thousands_of_consumers_lists_the_first_hundred_and_counts_the_rest():
    assert "consumer_details_omitted" not in a_queue(3).to_dict()
    msg = {"type": "stats", **a_queue(5000).to_dict()}

    assert len(msg["consumer_details"]) == schema.CONSUMER_DETAILS_KEPT
    assert msg["consumer_details_omitted"] == 5000 - schema.CONSUMER_DETAILS_KEPT
    assert msg["consumer_details"][0] == {"consumer_tag": "amq.ctag-" + "0" * 22, "channel": "channel-0.1",
                                          "channel_number": 1, "ack_required": True, "prefetch_count": 10,
                                          "exclusive": False, "active": True}
    assert len(json.dumps(msg).encode()) < MAX_CONTROL_BYTES // 2     # room left for the links


def test_client_properties_and_consumers_are_struct_columns(tmp_path):
    tele = tmp_path / "telemetry"
    tele.mkdir()
    with open(tele / "stats.jsonl", "w") as f:
        for stats in (a_reader(), a_queue(2)):
            f.write(json.dumps(schema.row_of({"type": "stats", **stats.to_dict()})) + "\n")

    result = tp.compact(str(tele))["stats"]

    assert result["dropped_fields"] == [] and result["nulled_values"] == 0, result
    reader, queue = pq.read_table(tele / "stats.parquet").to_pylist()
    assert reader["client_properties"]["product"] == "pika"
    assert dict(reader["client_properties"]["capabilities"]) == {"a": True}
    assert dict(reader["channel_unacked"]) == {"1": 3} and reader["recv_oct"] == 700
    assert [c["channel"] for c in queue["consumer_details"]] == ["channel-0.1", "channel-1.1"]


# -- the schemas derived from them ------------------------------------------------------------------------

def test_the_arrow_schema_is_generated_from_the_dataclasses():
    columns = {}
    for cls in STATS_TYPES.values():
        hints = schema.type_hints(cls)
        for f in dataclasses.fields(cls):
            if schema.is_column(f):
                columns.setdefault(f.name, tp.arrow_type(hints[f.name]))
    assert tp.STATS_SCHEMA.names == list(columns)
    assert all(tp.STATS_SCHEMA.field(name).type == t for name, t in columns.items())
    assert "extra" not in tp.STATS_SCHEMA.names
    assert tp.LINK_TYPE == pa.struct([(name, pa.int64()) for name in LINK_KEYS])
    assert tp.STATS_SCHEMA.field("links").type == pa.map_(pa.string(), tp.LINK_TYPE)
    assert tp.STATS_SCHEMA.field("notices").type == pa.list_(pa.struct(
        [("at_ns", pa.int64()), ("state", pa.string()), ("reason", pa.string()), ("sent", pa.bool_())]))
    assert tp.STATS_SCHEMA.field("segments").type.field("sync_p99_ns").type == pa.int64()
    assert tp.STATS_SCHEMA.field("fsync_ms_total").type == pa.float64()


def test_a_field_added_to_a_class_is_a_column_of_its_python_type(monkeypatch):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ProbeStats(StageStats):
        widgets: int
        ratio: float | None
        tags: tuple[str, ...]
        per_peer: dict[str, int]

    monkeypatch.setitem(STATS_TYPES, "probe", ProbeStats)
    columns = dict(schema.stats_columns.__wrapped__())
    arrow = pa.schema([(n, tp.arrow_type(t)) for n, t in columns.items()])

    assert (arrow.field("widgets").type, arrow.field("ratio").type) == (pa.int64(), pa.float64())
    assert arrow.field("tags").type == pa.list_(pa.string())
    assert arrow.field("per_peer").type == pa.map_(pa.string(), pa.int64())


def test_one_name_with_two_types_is_refused(monkeypatch):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class OddStats(StageStats):
        messages: str                                       # QueueStats.messages is an int

    monkeypatch.setitem(STATS_TYPES, "odd", OddStats)
    with pytest.raises(SchemaConflict, match="messages"):
        schema.stats_columns.__wrapped__()


def test_the_spark_schemas_are_derived_and_seconds_has_one_spelling():
    pytest.importorskip("pyspark")
    from pyspark.sql.pandas.types import from_arrow_schema

    from pipeline.analytics import load
    from pipeline.loadgen.harness import SecondReport

    assert load.STATS_SCHEMA == from_arrow_schema(tp.STATS_SCHEMA)
    assert load.ARRAY_STRUCTS["stats"] == {"notices"}
    report_fields = {f.name for f in dataclasses.fields(SecondReport)}
    assert set(load.SECONDS_SCHEMA.fieldNames()) - {"at_ns"} <= report_fields


# -- runs recorded before the schema: an ``extra`` column of JSON text ---------------------------------------

OLD_STATS_SCHEMA = pa.schema([
    ("name", pa.string()), ("kind", pa.string()), ("pid", pa.int64()), ("at_ns", pa.int64()),
    ("state", pa.string()), ("blocked", pa.bool_()), ("links", pa.map_(pa.string(), tp.LINK_TYPE)),
    ("publishes", pa.int64()), ("first_publish_ns", pa.int64()), ("last_publish_ns", pa.int64()),
    ("messages", pa.int64()), ("fsyncs", pa.int64()), ("fsync_events", pa.list_(pa.list_(pa.int64()))),
    ("memory_used", pa.int64()), ("blocked_by", pa.list_(pa.string())), ("conn_state", pa.string()),
    ("extra", pa.string()),
])


def old_stats_file(path: Path) -> None:
    rows = [
        {"name": "reader-1", "kind": "reader", "pid": 11, "at_ns": T0_NS, "state": "flow", "publishes": 400,
         "conn_state": "flow", "links": [("reader-1->channel-1.1", dict(zip(LINK_KEYS, [400, 401, 3, 40, 0, 0])))],
         "extra": json.dumps({"trims": 2, "client_name": "app", "notices": [[T0_NS - 5, "blocked", "memory", True]],
                              "type_changed": 1})},
        {"name": "queue-q", "kind": "queue", "pid": 12, "at_ns": T0_NS + 1, "messages": 7,
         "extra": json.dumps({"unacked": 3, "durable": True})},
        {"name": "store", "kind": "store", "pid": 13, "at_ns": T0_NS + 2, "fsyncs": 2,
         "fsync_events": [[T0_NS, 1_000]], "extra": None},
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=OLD_STATS_SCHEMA), path)


def test_a_broker_appending_to_an_old_stats_file_moves_extra_into_the_columns(tmp_path):
    tele = tmp_path / "telemetry"
    tele.mkdir()
    old_stats_file(tele / "stats.parquet")
    (tele / "stats.jsonl").write_text(json.dumps(schema.row_of(a_reader().to_dict())) + "\n")

    result = tp.compact(str(tele))["stats"]

    table = pq.read_table(tele / "stats.parquet")
    assert table.schema.equals(tp.STATS_SCHEMA) and result["rows"] == 4
    old_reader, queue, store, new_reader = table.to_pylist()
    assert (old_reader["trims"], old_reader["client_name"], old_reader["publishes"]) == (2, "app", 400)
    assert old_reader["notices"] == [{"at_ns": T0_NS - 5, "state": "blocked", "reason": "memory", "sent": True}]
    assert (queue["unacked"], queue["durable"], queue["messages"]) == (3, True, 7)
    assert store["fsyncs"] == 2 and new_reader["client_name"] == "app"


@pytest.mark.spark
def test_the_report_reads_an_old_stats_file_with_its_extra_as_columns(spark, tmp_path):
    from pipeline.analytics.load import STATS_SCHEMA, load_run

    tele = tmp_path / "run" / "telemetry"
    tele.mkdir(parents=True)
    old_stats_file(tele / "stats.parquet")

    stats = load_run(spark, str(tmp_path / "run")).stats

    assert stats.schema == STATS_SCHEMA
    rows = {r["name"]: r for r in stats.collect()}
    assert (rows["reader-1"]["trims"], rows["reader-1"]["client_name"], rows["reader-1"]["publishes"]) == (2, "app", 400)
    assert rows["reader-1"]["notices"][0].asDict() == {"at_ns": T0_NS - 5, "state": "blocked", "reason": "memory",
                                                       "sent": True}
    assert rows["reader-1"]["links"]["reader-1->channel-1.1"]["sent"] == 400
    assert (rows["queue-q"]["unacked"], rows["queue-q"]["durable"]) == (3, True)
    assert rows["store"]["fsyncs"] == 2 and rows["store"]["trims"] is None


# -- a real broker -----------------------------------------------------------------------------------------

@pytest.mark.processes
def test_every_stage_of_a_real_broker_sends_exactly_its_class(broker):
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port,
                                                             client_properties={"connection_name": "app"}))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("sq", durable=True)
    for _ in range(50):
        ch.basic_publish("", "sq", b"x" * 5000, pika.BasicProperties(delivery_mode=2))
    status = broker.wait_for(lambda s: s["processes"]["queue-sq"].get("messages") == 50
                             and s["processes"]["store"].get("writes", 0) > 0, what="50 messages stored")

    shown = {}
    for p in status["processes"].values():
        shown.setdefault(p["kind"], set()).update(p)
    for kind, keys in STATUS_KEYS.items():                # the supervisor may add keys of its own, never lose one
        assert set(keys.split()) <= shown[kind], kind
    assert sorted({k for link in status["links"].values() for k in link}) == sorted(LINK_KEYS)
    for p in status["processes"].values():                # what the management API reads: the classes' fields
        assert type(schema.stats_of(p)) is STATS_TYPES[p["kind"]]

    rows: list[dict] = []
    deadline = time.monotonic() + 10                      # the Recorder flushes its JSON lines once a second
    while not {"reader", "channel", "queue", "store", "watchdog"} <= {r["kind"] for r in rows}:
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
        with open(broker.data_dir / "telemetry" / "stats.jsonl") as f:
            rows = [json.loads(line) for line in f if line.endswith("\n")]
    for row in rows:                                       # each row is what a stage sent, less type
        assert schema.unknown_fields(row) == set(), row["name"]
        assert schema.stats_of(row).name == row["name"]
        assert message_keys(STATS_TYPES[row["kind"]]) <= set(row), row["name"]
    conn.close()

    assert broker.stop() == 0, broker.output()[-3000:]
    log = (broker.data_dir / "broker.log").read_text()
    assert "telemetry compacted to Parquet" in log
    stats = pq.read_table(broker.data_dir / "telemetry" / "stats.parquet").to_pylist()
    reader = [r for r in stats if r["kind"] == "reader" and r["client_name"] == "app"][-1]
    assert reader["publishes"] == 50 and reader["conn_state"] is not None
    store = [r for r in stats if r["kind"] == "store"][-1]
    assert store["writes"] == 50 and store["segments"]["live_messages"] is not None
