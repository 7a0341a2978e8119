"""Resource alarms end to end: pika's blocked/unblocked callbacks, consumers that keep going, ctl."""

from __future__ import annotations

import socket
import time

import pika
import pytest
from pamqp import commands, frame

from pipeline.amqp import frames
from pipeline.ctlclient import CtlClient

from conftest import raw_amqp_connection

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def ctl(broker, cmd: str, value: str) -> dict:
    with CtlClient(str(broker.data_dir)) as c:
        reply = c.request(cmd, value=value)
    assert reply["ok"], reply
    return reply


class Watched:
    """A pika connection that records connection.blocked / unblocked."""

    def __init__(self, broker):
        self.conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port, heartbeat=0))
        self.events: list[str] = []
        self.conn.add_on_connection_blocked_callback(
            lambda _c, m: self.events.append("blocked:" + m.method.reason))
        self.conn.add_on_connection_unblocked_callback(lambda _c, m: self.events.append("unblocked"))
        self.ch = self.conn.channel()

    def pump(self, seconds: float = 0.3) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.conn.process_data_events(0.05)


def reader_states(status: dict) -> dict:
    return {n: p["state"] for n, p in status["processes"].items() if n.startswith("reader") and p["alive"]}


def queue_stat(broker, q: str, key: str):
    return broker.process(f"queue-{q}")[key]


def test_memory_alarm_blocks_the_publisher_while_a_consumer_drains(broker):
    pub, con = Watched(broker), Watched(broker)
    pub.ch.queue_declare("a")
    for i in range(50):
        pub.ch.basic_publish("", "a", b"before %d" % i)
    broker.wait_for(lambda s: s["processes"]["queue-a"].get("enqueued") == 50, what="50 enqueued")

    ctl(broker, "set_watermark", "0")
    broker.wait_for(lambda s: set(reader_states(s).values()) == {"blocking"}, what="both connections blocking")
    for i in range(20):
        pub.ch.basic_publish("", "a", b"held %d" % i)
    pub.pump(0.5)
    assert pub.events == ["blocked:low on memory"]
    status = broker.wait_for(lambda s: "blocked" in reader_states(s).values(), what="the publisher blocked")
    assert sorted(reader_states(status).values()) == ["blocked", "blocking"]

    got = []
    for method, _, body in con.ch.consume("a", inactivity_timeout=2):
        if method is None:
            break
        got.append(body)
        con.ch.basic_ack(method.delivery_tag)
        if len(got) == 50:
            break
    assert len(got) == 50, "the consumer keeps consuming and acking during the alarm"
    assert con.events == [], "a connection that never published is not told it is blocked"
    assert queue_stat(broker, "a", "enqueued") <= 51, "held publishes are not read"

    ctl(broker, "set_watermark", "0.6")
    pub.pump(0.5)
    assert pub.events == ["blocked:low on memory", "unblocked"]
    broker.wait_for(lambda s: s["processes"]["queue-a"].get("enqueued") == 70, what="held publishes to flow")
    broker.wait_for(lambda s: set(reader_states(s).values()) == {"running"}, what="running again")
    con.ch.cancel()
    for c in (pub, con):
        c.conn.close()


def test_both_alarms_need_both_clears_and_the_reason_names_both(broker):
    pub = Watched(broker)
    pub.ch.queue_declare("b")
    ctl(broker, "set_watermark", "0")
    ctl(broker, "set_disk_free_limit", "1000000TB")
    broker.wait_for(lambda s: {a["state"] for a in s["alarms"].values()} == {"set"} and len(s["alarms"]) == 2,
                    what="both alarms")
    pub.ch.basic_publish("", "b", b"x")
    pub.pump(0.5)
    assert pub.events == ["blocked:low on memory & disk"]
    ctl(broker, "set_watermark", "0.6")
    pub.pump(0.5)
    assert pub.events == ["blocked:low on memory & disk"], "one alarm left: still blocked, nothing sent"
    assert "blocked" in reader_states(broker.status()).values()
    ctl(broker, "set_disk_free_limit", "50MB")
    pub.pump(0.5)
    assert pub.events[-1] == "unblocked" and len(pub.events) == 2
    pub.conn.close()


def test_a_connection_opened_during_an_alarm_blocks_on_its_first_publish(broker):
    ctl(broker, "set_watermark", "0")
    broker.wait_for(lambda s: s["alarms"].get("memory", {}).get("state") == "set", what="alarm")
    late = Watched(broker)
    late.ch.queue_declare("c")
    broker.wait_for(lambda s: list(reader_states(s).values()) == ["blocking"], what="late connection blocking")
    late.ch.basic_publish("", "c", b"x")
    late.pump(0.5)
    assert late.events == ["blocked:low on memory"]
    ctl(broker, "set_watermark", "0.6")
    late.pump(0.5)
    assert late.events[-1] == "unblocked"
    late.conn.close()


def test_repeated_sets_and_clears_produce_nothing_new(broker):
    for value in ("0", "0", "0.6", "0.6"):
        ctl(broker, "set_watermark", value)
    time.sleep(0.3)
    log = (broker.data_dir / "broker.log").read_text()
    assert log.count("memory resource limit alarm set on node") == 1
    assert log.count("memory resource limit alarm cleared on node") == 1
    assert "*** Publishers will be blocked until this alarm clears ***" in log


def test_a_client_without_the_capability_is_paused_with_no_frame_sent(broker):
    s = raw_amqp_connection(broker.port)
    s.sendall(frame.marshal(commands.Channel.Open(), 1))
    time.sleep(0.3)
    s.recv(65536)
    s.sendall(frame.marshal(commands.Queue.Declare(queue="d"), 1))
    time.sleep(0.3)
    s.recv(65536)
    ctl(broker, "set_watermark", "0")
    broker.wait_for(lambda st: "blocking" in reader_states(st).values(), what="blocking")
    pub = frames.encode_publish(1, "", "d", frames.properties_raw(), b"x", 131072)
    s.sendall(pub * 10)
    time.sleep(0.5)
    s.settimeout(0.5)
    with pytest.raises(socket.timeout):
        s.recv(65536)
    status = broker.status()
    reader = [p for n, p in status["processes"].items() if n.startswith("reader")][0]
    assert reader["state"] == "blocked" and reader["publishes"] == 1
    ctl(broker, "set_watermark", "0.6")
    broker.wait_for(lambda st: st["processes"]["queue-d"].get("enqueued") == 10, what="all 10 after the clear")
    s.settimeout(0.5)
    with pytest.raises(socket.timeout):
        s.recv(65536)  # still no connection.unblocked: it never asked for it
    s.close()


def test_ctl_reports_alarms_and_refuses_bad_values(broker):
    with CtlClient(str(broker.data_dir)) as c:
        assert c.request("set_watermark", value="lots")["ok"] is False
        assert c.request("alarms")["alarms"] == {}


def test_a_publish_sent_after_ctl_returns_meets_the_alarm(broker):
    """ctl set-watermark returns once every reader holds the alarm, and a reader handles its inbox
    before its socket: the first publish sent afterwards is read (RabbitMQ's `blocking` rule) and
    the connection is then blocked, so a second one stays unread in the socket."""
    for attempt in range(5):
        queue = f"after-{attempt}"
        w = Watched(broker)
        w.ch.queue_declare(queue)
        ctl(broker, "set_watermark", "0")
        w.ch.basic_publish("", queue, b"first")
        w.pump(0.5)
        w.ch.basic_publish("", queue, b"second")
        w.pump(0.5)
        assert w.events == ["blocked:low on memory"], w.events
        with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as other:
            assert other.channel().queue_declare(queue, passive=True).method.message_count == 1
        ctl(broker, "set_watermark", "0.6")
        w.pump(0.5)
        assert w.events == ["blocked:low on memory", "unblocked"]
        w.conn.close()


def test_dead_lettering_waits_for_the_alarm_to_clear(broker):
    """Dead-lettered copies are publishes too: during a memory alarm they stay with their source queue
    (RabbitMQ lets them through, its issue #14657), and all of them arrive once it clears."""
    w = Watched(broker)
    w.ch.queue_declare("dlq")
    w.ch.queue_declare("src", arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
    for i in range(20):
        w.ch.basic_publish("", "src", b"m%d" % i)
    broker.wait_for(lambda s: s["processes"]["queue-src"].get("enqueued") == 20, what="20 enqueued")
    ctl(broker, "set_watermark", "0")
    rejected = 0
    for method, _, _body in w.ch.consume("src", inactivity_timeout=2):
        if method is None:
            break
        w.ch.basic_reject(method.delivery_tag, requeue=False)
        rejected += 1
        if rejected == 20:
            break
    w.ch.cancel()
    w.pump(1.0)
    assert rejected == 20
    assert w.ch.queue_declare("dlq", passive=True).method.message_count == 0
    assert w.ch.queue_declare("src", passive=True).method.message_count == 0
    ctl(broker, "set_watermark", "0.6")
    broker.wait_for(lambda s: s["processes"]["queue-dlq"].get("enqueued") == 20, what="the copies to arrive")
    assert w.ch.queue_declare("dlq", passive=True).method.message_count == 20
    w.conn.close()
