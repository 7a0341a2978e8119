"""AMQPStorm against the broker: a client written apart from pika, with its own frame handling
(pamqp), a heartbeat thread, publisher confirms that answer each publish, and channel errors raised
on the next call. The same tests run against RabbitMQ itself (see ``tests/amqp_targets.py``).
"""

from __future__ import annotations

import time

import amqpstorm
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]


def connect(amqp) -> amqpstorm.Connection:
    return amqpstorm.Connection(amqp.host, "guest", "guest", port=amqp.port, heartbeat=10, timeout=10)


def test_confirmed_publishes_through_a_topic_exchange_come_back_with_their_properties(amqp):
    queue, exchange = amqp.name("storm"), amqp.name("storm-x")
    headers = {"i": 7, "list": [1, "x", {"k": 1.5}], "flag": True}
    with connect(amqp) as conn, conn.channel() as ch:
        ch.confirm_deliveries()
        ch.queue.declare(queue, durable=True, arguments={"x-max-length": 1000})
        ch.exchange.declare(exchange, "topic", durable=True)
        ch.queue.bind(queue, exchange, "a.#")
        for i in range(100):
            assert ch.basic.publish(f"m{i}", "a.b.c", exchange, mandatory=True,
                                    properties={"delivery_mode": 2, "headers": {**headers, "i": i},
                                                "correlation_id": f"c{i}", "priority": 3})
        assert ch.queue.declare(queue, passive=True) == {"queue": queue, "message_count": 100, "consumer_count": 0}
        first = ch.basic.get(queue, no_ack=False)
        assert first.body == "m0"
        assert first.properties["headers"] == {**headers, "i": 0}
        assert (first.properties["delivery_mode"], first.properties["correlation_id"],
                first.properties["priority"]) == (2, "c0", 3)
        assert first.method["redelivered"] is False and first.method["message_count"] == 99
        first.reject(requeue=True)
        again = ch.basic.get(queue, no_ack=False)
        assert (again.body, again.method["redelivered"]) == ("m0", True)
        again.ack()

        got = []

        def on_message(message):
            got.append(message.body)
            message.ack()
            if len(got) == 99:
                ch.stop_consuming()

        ch.basic.qos(10)
        tag = ch.basic.consume(on_message, queue, no_ack=False)
        ch.start_consuming(to_tuple=False)
        assert got == [f"m{i}" for i in range(1, 100)]
        ch.basic.cancel(tag)
        assert ch.queue.purge(queue) == {"message_count": 0}
        assert ch.queue.delete(queue) == {"message_count": 0}
        ch.exchange.delete(exchange)


def test_a_publish_to_a_missing_exchange_closes_the_channel_with_404_and_the_connection_goes_on(amqp):
    queue = amqp.name("storm-after")
    missing = amqp.name("no-such-exchange")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.basic.publish("lost", "key", missing)
        with pytest.raises(amqpstorm.AMQPChannelError) as err:
            deadline = time.monotonic() + 5            # the close comes in its own time: no reply is awaited
            while time.monotonic() < deadline:
                ch.check_for_errors()
                time.sleep(0.02)
        assert err.value.error_code == 404
        assert f"NOT_FOUND - no exchange '{missing}' in vhost '/'" in str(err.value)
        with conn.channel() as other:            # the connection still serves a new channel
            other.queue.declare(queue, auto_delete=False)
            other.basic.publish("kept", queue)
            assert other.basic.get(queue, no_ack=True).body == "kept"
            other.queue.delete(queue)
        assert conn.is_open


def test_an_unroutable_mandatory_publish_is_returned_before_its_confirm(amqp):
    with connect(amqp) as conn, conn.channel() as ch:
        ch.confirm_deliveries()
        with pytest.raises(amqpstorm.AMQPMessageError) as err:
            ch.basic.publish("nowhere", amqp.name("unbound-key"), "", mandatory=True)
        assert "NO_ROUTE" in str(err.value)
        assert ch.basic.publish("fine, unroutable without mandatory", amqp.name("unbound-key"), "") is True
