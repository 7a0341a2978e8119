"""The message store process: write-once fan-out, confirms after the fsync that covers them."""

from __future__ import annotations

import time

import pika
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]
BODY = b"s" * 6144          # above queue_index_embed_msgs_below: goes to the shared store


def connect(broker):
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))


def store_stats(broker) -> dict:
    return broker.process("store")


def test_a_persistent_message_routed_to_three_queues_is_stored_once(broker):
    conn = connect(broker)
    ch = conn.channel()
    ch.exchange_declare("fan", "fanout", durable=True)
    for q in ("s1", "s2", "s3"):
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, "fan")
    ch.confirm_delivery()
    for _ in range(50):
        ch.basic_publish("fan", "", BODY, pika.BasicProperties(delivery_mode=2))
    status = broker.wait_for(lambda s: s["processes"]["store"]["writes"] == 150, what="150 writes")
    seg = status["processes"]["store"]["segments"]
    assert seg["appends"] == 50, "one body on disk per message, whatever the number of queues"
    assert seg["live_messages"] == 50
    for q in ("s1", "s2", "s3"):
        for _ in range(50):
            method, _, body = ch.basic_get(q, auto_ack=True)
            assert body == BODY
    broker.wait_for(lambda s: s["processes"]["store"]["segments"]["live_messages"] == 0,
                    what="the last queue's ack to free the body")
    conn.close()


def confirm_time(broker, persistent: bool = True) -> float:
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("c", durable=True)
    ch.confirm_delivery()
    start = time.monotonic()
    ch.basic_publish("", "c", BODY, pika.BasicProperties(delivery_mode=2 if persistent else 1))
    took = time.monotonic() - start
    conn.close()
    return took


def test_confirms_wait_for_the_fsync_that_covers_the_message(start_broker):
    slow = start_broker("--fsync-delay-ms", "700", name="slow")
    assert confirm_time(slow) >= 0.7
    assert store_stats(slow)["fsyncs"] >= 1
    assert confirm_time(slow, persistent=False) < 0.5, "transient messages are confirmed on enqueue"


def test_confirm_after_write_does_not_wait_for_the_fsync(start_broker):
    b = start_broker("--fsync-delay-ms", "700", "--confirm-after", "write", name="write")
    assert confirm_time(b) < 0.5
