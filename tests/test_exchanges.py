"""Exchanges and bindings: direct, fanout and topic routing with pika, confirms across queues."""

from __future__ import annotations

import time

import pika
import pytest

from pipeline.broker.routing import RoutingTable


def topic_matches(pattern: bytes, key: bytes) -> bool:
    table = RoutingTable()
    table.declare_exchange(b"t", "topic")
    table.add_queue(b"q", durable=False)
    table.bind_queue(b"t", b"q", pattern)
    return table.route(b"t", key).queues == (b"q",)


@pytest.mark.parametrize("pattern, key, hit", [
    ("a.b", "a.b", True), ("a.*", "a.b", True), ("a.*", "a.b.c", False), ("a.#", "a", True),
    ("a.#", "a.b.c", True), ("#", "", True), ("#.c", "a.b.c", True), ("*.b.#", "a.b", True),
    ("*", "", False), ("a.*.c", "a.x.c", True), ("a.*.c", "a.c", False),
])
def test_topic_matching_follows_rabbitmq(pattern, key, hit):
    assert topic_matches(pattern.encode(), key.encode()) is hit


def drain(ch, queue: str, expect: int, timeout_s: float = 5) -> list[bytes]:
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expect and time.monotonic() < deadline:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.05)
        else:
            got.append(body)
    return got


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_fanout_direct_and_topic_route_with_confirms(broker):
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    ch = conn.channel()
    ch.exchange_declare("fan", "fanout")
    ch.exchange_declare("logs", "topic", durable=True)
    for q in ("f1", "f2", "f3", "errors", "all"):
        ch.queue_declare(q)
    for q in ("f1", "f2", "f3"):
        ch.queue_bind(q, "fan")
    ch.queue_bind("errors", "logs", "*.error")
    ch.queue_bind("all", "logs", "#")
    ch.queue_bind("f1", "amq.direct", "k")
    ch.confirm_delivery()
    ch.basic_publish("fan", "ignored", b"to-all-three")
    ch.basic_publish("logs", "db.error", b"err")
    ch.basic_publish("logs", "db.info", b"info")
    ch.basic_publish("amq.direct", "k", b"direct")
    ch.basic_publish("amq.direct", "other", b"nowhere")
    assert drain(ch, "f1", 2) == [b"to-all-three", b"direct"]
    assert drain(ch, "f2", 1) == [b"to-all-three"] and drain(ch, "f3", 1) == [b"to-all-three"]
    assert drain(ch, "errors", 1) == [b"err"]
    assert sorted(drain(ch, "all", 2)) == [b"err", b"info"]
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as exc:
        ch.exchange_declare("fan", "direct")
    assert exc.value.reply_code == 406
    ch2 = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as exc:
        ch2.queue_bind("f1", "no-such-exchange")
    assert exc.value.reply_code == 404
    conn.close()
