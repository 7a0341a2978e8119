"""PerfTest's topology and traffic-shape flags against a real broker, and the routing table behind them.

Each real run is short: a broker of its own (``broker`` fixture), a few
hundred messages counted per queue from the broker's own status, so the
routing the load generator set up is checked by what the broker holds and
delivers, not by what the load generator believes.
"""

from __future__ import annotations

import struct
import subprocess
import threading
import time

import pytest

from pipeline.amqp import frames
from pipeline.loadgen.client import AmqpClient
from pipeline.loadgen.config import InvalidLoadConfig, LoadConfig
from pipeline.loadgen.harness import run_load
from pipeline.loadgen.publisher import BODY_HEAD, decode_head, encode_head
from pipeline.loadgen.topology import DEFAULT, DIRECT, FANOUT, HEADERS, TOPIC, Topology

from conftest import ROOT, creditflow_cmd


# -- the routing table (pure) ------------------------------------------------------------------
def test_without_a_key_producers_and_queues_pair_round_robin():
    t = Topology("direct", DIRECT, ("q1", "q2"))
    assert [(b.queue, b.routing_key) for b in t.bindings()] == [("q1", "q1"), ("q2", "q2")]
    assert [t.route(i).routing_key for i in range(3)] == ["q1", "q2", "q1"]
    assert [t.reaches(i) for i in range(3)] == [("q1",), ("q2",), ("q1",)]


def test_a_routing_key_fans_out_through_any_exchange_type():
    for kind in (DIRECT, TOPIC):
        t = Topology("x", kind, ("a", "b", "c"), routing_key="k")
        assert {b.routing_key for b in t.bindings()} == {"k"} and t.reaches(1) == ("a", "b", "c")
    f = Topology("f", FANOUT, ("a", "b"))
    assert f.route(0).routing_key == "" and f.reaches(0) == ("a", "b")
    h = Topology("h", HEADERS, ("a", "b"))
    assert h.route(1).headers == {"creditflow-route": "b"} and h.reaches(1) == ("b",)
    assert h.bindings()[0].arguments == {"x-match": "all", "creditflow-route": "a"}


def test_the_default_exchange_routes_by_queue_name_only():
    t = Topology("", DEFAULT, ("q",), routing_key="nowhere")
    assert t.bindings() == [] and t.reaches(0) == ()
    assert Topology("", DEFAULT, ("q",)).reaches(0) == ("q",)


def test_defaults_resolve_as_before_and_as_perftest():
    assert LoadConfig().topology == Topology("", DEFAULT, ("creditflow-perf",))
    assert LoadConfig(queues=("a", "b")).topology.exchange_type == FANOUT           # the bench's fan-out
    assert LoadConfig(exchange="ex").topology.exchange_type == DIRECT               # PerfTest's -t default
    assert LoadConfig(routing_key="k").topology == Topology("creditflow-perf-direct", DIRECT, ("creditflow-perf",), "k")
    assert LoadConfig(queue_args=(("x-max-length", 5), ("x-overflow", "reject-publish"))).queues_may_drop
    assert not LoadConfig(confirm=10, queue_args=(("x-max-length", 5), ("x-overflow", "reject-publish"))).queues_may_drop
    assert LoadConfig(exchange_type=TOPIC, queues=("a", "b")).topology.exchange == "creditflow-perf-topic"


@pytest.mark.parametrize("kwargs, says", [
    (dict(multi_ack_every=50, prefetch=10), "above the prefetch"),
    (dict(multi_ack_every=5, autoack=True), "nothing to acknowledge"),
    (dict(exchange="", exchange_type="headers"), "needs a named exchange"),
    (dict(rate=5, variable_rate=((10, 1.0),)), "give one"),
    (dict(variable_size=((100, 0),)), "SECONDS above 0"),
    (dict(consumer_rate=0), "positive"),
    (dict(exchange_type="nope"), "one of direct"),
    (dict(variable_rate=((0, 5.0),)), "all 0 msg/s"),
])
def test_options_that_cannot_work_are_refused(kwargs, says):
    with pytest.raises(InvalidLoadConfig, match=says):
        LoadConfig(**kwargs)


@pytest.mark.parametrize("argv, says", [
    (["-A", "50", "-q", "10"], "--multi-ack-every 50 is above the prefetch (-q 10)"),
    (["--queue-pattern", "perf", "--queue-pattern-to", "3"], "needs one %d"),
    (["--queue-pattern", "perf-%d"], "needs --queue-pattern-to"),
    (["--queue-args", "x-max-length"], "expected NAME=VALUE"),
    (["--variable-rate", "100"], "expected VALUE:SECONDS"),
])
def test_the_cli_refuses_them_with_exit_2_and_one_line(tmp_path, argv, says):
    done = subprocess.run(creditflow_cmd("run", "-z", "1", "--run-dir", str(tmp_path / "r"), *argv),
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()                     # nothing started


# -- the body layout -------------------------------------------------------------------------
def test_the_body_starts_with_perftests_int32_sequence_and_int64_nanotime():
    head = encode_head(123_456_789_000, 7, 3)
    seq, nano = struct.unpack_from(">iq", head)             # what PerfTest's consumer reads
    assert (seq, nano) == (7, 123_456_789_000)
    assert decode_head(head) == (123_456_789_000, 7, 3)
    assert decode_head(head[:12] + bytes(8)) == (123_456_789_000, 7, None)     # PerfTest's own: no producer
    assert decode_head(encode_head(5, 2**32 + 9, 1)) == (5, 2**32 + 9, 1)      # 64-bit sequences survive
    assert BODY_HEAD.size == 20


# -- against a real broker -------------------------------------------------------------------
def queue_counts(broker) -> dict[str, int]:
    """Messages each queue took in (enqueued), from the broker's status."""
    return {p["queue"]: p.get("enqueued", 0) for p in broker.status()["processes"].values()
            if p.get("kind") == "queue"}


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_queue_patterns_spread_producers_and_a_key_or_fanout_copies_to_all(broker):
    spread = run_load(LoadConfig(port=broker.port, producers=2, consumers=2, queues=("perf-1", "perf-2"),
                                 exchange_type=DIRECT, pmessages=150, confirm=50, duration_s=10))
    assert (spread.published, spread.delivered, spread.lost) == (300, 300, 0)
    counts = queue_counts(broker)
    assert counts["perf-1"] == counts["perf-2"] == 150       # each producer into its own queue

    topic = run_load(LoadConfig(port=broker.port, producers=1, consumers=3, queues=("t-1", "t-2", "t-3"),
                                exchange="tx", exchange_type=TOPIC, routing_key="orders.eu", pmessages=100,
                                confirm=50, duration_s=10))
    assert (topic.published, topic.delivered, topic.lost) == (100, 300, 0)
    assert [queue_counts(broker)[q] for q in ("t-1", "t-2", "t-3")] == [100, 100, 100]

    headers = run_load(LoadConfig(port=broker.port, producers=2, consumers=2, queues=("h-1", "h-2"),
                                  exchange="hx", exchange_type=HEADERS, pmessages=80, confirm=40, duration_s=10))
    assert (headers.published, headers.delivered, headers.lost) == (160, 160, 0)
    assert [queue_counts(broker)[q] for q in ("h-1", "h-2")] == [80, 80]


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_mandatory_is_really_set_and_queue_limits_reject_or_drop(broker):
    unroutable = run_load(LoadConfig(port=broker.port, producers=1, consumers=0, exchange="", routing_key="nowhere",
                                     mandatory=True, pmessages=50, duration_s=5))
    assert unroutable.returned == 50 and unroutable.rejections == {"returned unroutable": 50}

    args = (("x-max-length", 20), ("x-overflow", "reject-publish"))
    rejecting = run_load(LoadConfig(port=broker.port, producers=1, consumers=1, queue="limited", queue_args=args,
                                    prefetch=5, consumer_latency_us=5000, confirm=100, pmessages=300,
                                    duration_s=10, drain_s=20))
    assert rejecting.nacked > 0 and rejecting.lost == 0 and rejecting.dropped == 0
    assert rejecting.delivered + rejecting.nacked == 300

    dropping = run_load(LoadConfig(port=broker.port, producers=1, consumers=1, queue="head-dropping",
                                   queue_args=(("x-max-length", 20),), prefetch=5, consumer_latency_us=5000,
                                   pmessages=300, rate=1000, duration_s=10, drain_s=20))
    assert dropping.lost == 0 and dropping.dropped > 0
    assert dropping.delivered + dropping.dropped == 300


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_message_counts_and_a_consumer_rate_limit_hold(broker):
    counted = run_load(LoadConfig(port=broker.port, producers=2, consumers=1, pmessages=250, cmessages=400,
                                  queue="counted", duration_s=10, drain_s=5))
    assert counted.published == 500 and counted.delivered == 400
    assert counted.undelivered == 100 and counted.lost == 0            # left in the queue, -D reached

    started = time.monotonic()
    paced = run_load(LoadConfig(port=broker.port, producers=1, consumers=1, queue="paced", rate=400,
                                consumer_rate=100, duration_s=2, drain_s=1))
    took = time.monotonic() - started
    assert paced.published == 800
    assert paced.delivered <= 100 * took + 1                           # never faster than 100 msg/s
    assert paced.delivered >= 100 * 2                                  # and it did consume at that rate
    assert paced.lost == 0 and paced.undelivered == 800 - paced.delivered
    assert paced.cpu_s["consumer-0"] < took / 4                         # waits for its turn, does not spin

    acked = run_load(LoadConfig(port=broker.port, producers=1, consumers=1, queue="acked-in-30s", pmessages=100,
                                multi_ack_every=30, prefetch=60, duration_s=5))
    assert acked.delivered == 100
    q = broker.status()["processes"]["queue-acked-in-30s"]
    assert (q["messages"], q["unacked"]) == (0, 0)                     # the last 10 were acknowledged too


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_creditflow_consumers_measure_messages_in_perftests_layout(broker):
    """A publisher writing PerfTest's 12-byte bodies (int32 sequence, int64 System.nanoTime, the same
    clock as time.monotonic_ns on Linux): creditflow's consumer measures each one and counts it as
    another tool's, without order checks."""
    pub = AmqpClient("127.0.0.1", broker.port, heartbeat_s=0)
    pub.queue_declare("from-perftest")
    results = {}

    def consume():
        results["r"] = run_load(LoadConfig(port=broker.port, producers=0, consumers=1, queue="from-perftest",
                                           duration_s=3, drain_s=0))
    t = threading.Thread(target=consume)
    t.start()
    broker.wait_for(lambda st: st["processes"].get("queue-from-perftest", {}).get("consumers") == 1,
                    timeout_s=20, what="the consumer")
    time.sleep(0.5)                                                    # its run has started: later stamps count
    for seq in range(40):
        body = struct.pack(">iq", seq, time.monotonic_ns())
        pub.send_all(frames.encode_publish(1, "", "from-perftest", frames.properties_raw(), body, pub.frame_max))
    t.join(30)
    pub.close()
    r = results["r"]
    assert r.delivered == 0 and r.foreign == 40 and r.stale == 0       # received, but not this run's publishes
    lat = r.latency_us["consumer"]
    assert lat["count"] == 40 and 0 < lat["max"] < 2_000_000                   # µs, from the PerfTest stamps


# -- outputs ------------------------------------------------------------------------------------
PERFTEST_CSV_HEADER = ("id,time (s),published (msg/s),returned (msg/s),confirmed (msg/s),nacked (msg/s),"
                       "received (msg/s),min consumer latency (µs),median consumer latency (µs),"
                       "75th p. consumer latency (µs),95th p. consumer latency (µs),99th p. consumer latency (µs),"
                       "min confirm latency (µs),median confirm latency (µs),75th p. confirm latency (µs),"
                       "95th p. confirm latency (µs),99th p. confirm latency (µs)")


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_cli_run_writes_perftests_csv_and_a_json_summary(tmp_path):
    import csv
    import json
    out_csv, out_json = tmp_path / "perf.csv", tmp_path / "summary.json"
    done = subprocess.run(creditflow_cmd("run", "-x", "2", "-y", "2", "-r", "300", "-c", "50", "-z", "3",
                                         "--queue-pattern", "perf-%d", "--queue-pattern-to", "2", "--plain",
                                         "--run-dir", str(tmp_path / "run"), "-o", str(out_csv),
                                         "--json", str(out_json)),
                          capture_output=True, text=True, cwd=ROOT, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = out_csv.read_text(encoding="utf-8").splitlines()
    assert lines[0] == PERFTEST_CSV_HEADER
    rows = list(csv.reader(lines[1:]))
    # 2 x 300 msg/s each second; the last second's cut may come a few ms after the producers stopped at the
    # window's end, which its rate counts too (600 over the 1.012 s of one run's last row is 593): the 1,800
    # published in all, below, hold it to the rate
    assert len(rows) == 3 and all(590 <= int(r[2]) <= 610 for r in rows[:2]) and 570 <= int(rows[2][2]) <= 610
    assert all(int(r[7]) <= int(r[8]) <= int(r[11]) for r in rows)                 # min <= median <= p99
    j = json.loads(out_json.read_text())
    assert list(j)[:3] == ["elapsed_seconds", "avg_pub_rate", "avg_consume_rate"]  # lavinmqperf's, first
    assert j["published"] == j["delivered"] == 1800 and j["lost"] == 0 and j["latency_count"] == 1800
    assert set(j["order"]) == {"perf-1", "perf-2"}
    assert all(o == {"gaps": 0, "duplicates": 0, "reordered": 0} for o in j["order"].values())
    conns = j["connections"]
    assert set(conns) == {"publisher-0", "publisher-1"}
    assert all(c["flow_s"] is not None and c["running_s"] > 0 and c["blocked_s"] == 0 for c in conns.values())
