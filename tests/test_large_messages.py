"""Messages bigger than a ring slot: they cross every ring in pieces and arrive whole, in order."""

from __future__ import annotations

import pika
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

MIB = 1024 * 1024


def body(size: int, seed: int) -> bytes:
    return (bytes((i * 7 + seed) % 256 for i in range(256)) * (size // 256 + 1))[:size]


def test_messages_bigger_than_a_ring_arrive_whole_persistent_or_not(broker):
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("big", durable=True)
        sizes = [3 * MIB, 12 * MIB, 100, 5 * MIB]          # rings are 4 MiB: each of these but one goes in pieces
        for i, size in enumerate(sizes):
            ch.basic_publish("", "big", body(size, i), properties=pika.BasicProperties(delivery_mode=2 - i % 2))
        got = []
        for method, _props, data in ch.consume("big", inactivity_timeout=5):
            if method is None:
                break
            got.append(data)
            ch.basic_ack(method.delivery_tag)
            if len(got) == len(sizes):
                break
        assert [len(g) for g in got] == sizes
        assert all(g == body(size, i) for i, (g, size) in enumerate(zip(got, sizes)))


def test_the_default_limit_is_rabbitmqs_and_a_lower_one_refuses_with_406(start_broker):
    broker = start_broker("--max-message-bytes", str(6 * MIB))
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        ch = conn.channel()
        ch.queue_declare("limited")
        ch.basic_publish("", "limited", body(5 * MIB, 1))
        assert len(ch.basic_get("limited", auto_ack=True)[2]) == 5 * MIB
        ch.basic_publish("", "limited", body(7 * MIB, 2))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
            ch.basic_get("limited")
        assert closed.value.reply_code == 406
    from pipeline.cli import DEFAULT_MAX_MESSAGE_BYTES
    assert DEFAULT_MAX_MESSAGE_BYTES == 128 * MIB
