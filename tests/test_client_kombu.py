"""kombu against the broker: Connection, Producer, Consumer and SimpleQueue over py-amqp.

kombu declares what it uses from ``Exchange`` and ``Queue`` objects, queue
arguments included (``max_priority``, ``message_ttl``, ``expires``,
``max_length``), serialises payloads itself and reconnects on its own; Celery
sits on top of it. The same tests run against RabbitMQ itself (see
``tests/amqp_targets.py``).
"""

from __future__ import annotations

import socket
import time

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]


def drain(conn: Connection, expect: int, got: list, timeout_s: float = 3.0) -> list:
    """Run ``conn``'s consumers until ``got`` holds ``expect`` items or the time is up."""
    deadline = time.monotonic() + timeout_s
    while len(got) < expect and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.1)
        except TimeoutError:
            pass
    return got


def test_a_simple_queue_carries_payloads_both_ways(amqp):
    name = amqp.name("simple")
    with Connection(amqp.url) as conn:
        queue = conn.SimpleQueue(name)
        for i in range(3):
            queue.put({"job": i, "tags": ["a", "b"]}, serializer="json")
        deadline = time.monotonic() + 3
        while queue.qsize() < 3 and time.monotonic() < deadline:    # publishes are not confirmed
            time.sleep(0.02)
        assert queue.qsize() == 3
        first = queue.get(timeout=3)
        assert first.payload == {"job": 0, "tags": ["a", "b"]}
        first.ack()
        second = queue.get(timeout=3)
        second.requeue()
        # with no prefetch limit the consumer may already hold job 2 when job 1 goes back (then job 1
        # comes after it), or not (then job 1, back in its original place, comes first): both are right
        rest = [queue.get(timeout=3) for _ in range(2)]
        assert sorted((m.payload["job"], m.delivery_info["redelivered"]) for m in rest) == [(1, True), (2, False)]
        for message in rest:
            message.ack()
        assert queue.clear() == 0
        queue.close()


def test_producer_and_consumer_route_through_a_headers_exchange(amqp):
    exchange = Exchange(amqp.name("by-format"), type="headers")
    pdfs = Queue(amqp.name("pdfs"), exchange, binding_arguments={"x-match": "all", "format": "pdf"})
    any_report = Queue(amqp.name("reports"), exchange,
                       binding_arguments={"x-match": "any", "kind": "report", "urgent": True})
    got: list = []
    with Connection(amqp.url) as conn:
        with Consumer(conn, [pdfs, any_report], accept=["json"],
                      callbacks=[lambda body, message: (got.append((message.delivery_info["routing_key"],
                                                                   body["n"])), message.ack())]):
            producer = Producer(conn.default_channel, exchange=exchange, serializer="json")
            producer.publish({"n": 1}, routing_key="r1", headers={"format": "pdf"}, declare=[exchange])
            producer.publish({"n": 2}, routing_key="r2", headers={"format": "pdf", "kind": "report"})
            producer.publish({"n": 3}, routing_key="r3", headers={"urgent": True})
            producer.publish({"n": 4}, routing_key="r4", headers={"format": "zip", "urgent": False})
            drain(conn, 4, got)
            time.sleep(0.2)
            drain(conn, 5, got, timeout_s=0.3)
    assert sorted(got) == [("r1", 1), ("r2", 2), ("r2", 2), ("r3", 3)]


def test_a_priority_queue_declared_by_kombu_serves_the_highest_first(amqp):
    queue = Queue(amqp.name("urgent-first"), max_priority=10)
    with Connection(amqp.url) as conn:
        bound = queue(conn.default_channel)
        bound.declare()
        producer = Producer(conn.default_channel, serializer="json")
        for n, priority in [(1, 0), (2, 7), (3, 3), (4, 10)]:
            producer.publish({"n": n}, routing_key=queue.name, priority=priority)
        order = []
        deadline = time.monotonic() + 3
        while len(order) < 4 and time.monotonic() < deadline:
            message = bound.get(no_ack=True)
            if message is None:
                time.sleep(0.02)
            else:
                order.append(message.payload["n"])
        assert order == [4, 2, 3, 1]


def test_queue_arguments_from_kombu_expire_and_dead_letter_messages(amqp):
    dead = Queue(amqp.name("dead"))
    short = Queue(amqp.name("short"), message_ttl=0.1, max_length=2,
                  queue_arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead.name})
    got: list = []
    with Connection(amqp.url) as conn:
        channel = conn.default_channel
        dead(channel).declare()
        short(channel).declare()
        producer = Producer(channel, serializer="json")
        for n in range(3):                                  # the first is dropped at once: maxlen
            producer.publish({"n": n}, routing_key=short.name)
        with Consumer(conn, [dead], accept=["json"],
                      callbacks=[lambda body, message: (got.append(
                          (body["n"], message.headers["x-death"][0]["reason"])), message.ack())]):
            drain(conn, 3, got)
    assert got == [(0, "maxlen"), (1, "expired"), (2, "expired")]


def test_a_rejected_message_goes_to_the_dead_letter_exchange(amqp):
    dlx = Exchange(amqp.name("rejects"), type="fanout")
    parked = Queue(amqp.name("parked"), dlx)
    work = Queue(amqp.name("work"), Exchange(amqp.name("work-x"), type="direct"), routing_key="job",
                 queue_arguments={"x-dead-letter-exchange": dlx.name})
    got: list = []
    with Connection(amqp.url) as conn:
        channel = conn.default_channel
        parked(channel).declare()
        with Consumer(conn, [work], accept=["json"], prefetch_count=1,
                      callbacks=[lambda body, message: message.reject()]):
            Producer(channel, exchange=work.exchange, serializer="json").publish({"bad": True}, routing_key="job")
            deadline = time.monotonic() + 3
            while not got and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.1)
                except TimeoutError:
                    pass
                message = parked(channel).get(no_ack=True)
                if message is not None:
                    got.append(message)
    [message] = got
    assert message.payload == {"bad": True}
    death = message.headers["x-death"][0]
    assert (death["reason"], death["queue"], death["exchange"], death["routing-keys"], death["count"]) == (
        "rejected", work.name, work.exchange.name, ["job"], 1)


def test_kombu_connects_over_ipv6(amqp):
    if not amqp.ipv6:
        pytest.skip("the RabbitMQ node's ::1 listener is not named (CREDITFLOW_TEST_RABBITMQ_IPV6=1)")
    name = amqp.name("v6")
    with Connection(f"amqp://guest:guest@[::1]:{amqp.port}//") as conn:
        queue = conn.SimpleQueue(name)
        queue.put("over ipv6")
        assert queue.get(timeout=3).payload == "over ipv6"
        assert conn.connection.sock.family == socket.AF_INET6
        queue.close()


def test_every_delivery_sent_before_cancel_ok_reaches_the_consumer(amqp):
    """The pattern of kombu's own integration tests: one drain_events, then leave the consumer.
    py-amqp hands every delivery it reads while waiting for basic.cancel-ok to the callback, so all
    the messages the queue pushed on basic.consume must come before cancel-ok, as in RabbitMQ."""
    queue = Queue(amqp.name("drained"))
    got: list = []
    with Connection(amqp.url) as conn:
        channel = conn.default_channel
        queue(channel).declare()
        producer = Producer(channel, serializer="json")
        for n in range(20):
            producer.publish({"n": n}, routing_key=queue.name)
        deadline = time.monotonic() + 3
        while queue(channel).queue_declare(passive=True).message_count < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        with Consumer(conn, [queue], accept=["json"], callbacks=[lambda body, message: got.append(body["n"])]):
            conn.drain_events(timeout=3)
    assert got == list(range(20))
