"""pika's BlockingConnection against the broker: AMQP 0-9-1 as RabbitMQ 3.10 serves it.

Each test is what an application written for RabbitMQ does, unmodified, and
checks what its author would check: bodies, counts, order, headers, and the
reply code and reply text of every refusal, exactly as RabbitMQ 3.10.8 sends
them. The same tests run against RabbitMQ itself: ``CREDITFLOW_TEST_RABBITMQ=start
pytest tests/test_client_*.py`` (see ``tests/amqp_targets.py``).
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, NackError

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

MAX_MESSAGE_BYTES = 128 * 1024 * 1024      # RabbitMQ's default max_message_size


def connect(target, **kw) -> pika.BlockingConnection:
    return pika.BlockingConnection(target.pika_params(**kw))


def refusal(call, *args, **kw) -> tuple[int, str]:
    """The (reply code, reply text) of the channel.close that ``call`` ends in."""
    with pytest.raises(ChannelClosedByBroker) as exc:
        call(*args, **kw)
    return exc.value.reply_code, exc.value.reply_text


def get_all(ch, queue: str, expect: int, timeout_s: float = 3.0) -> list[tuple]:
    """basic.get with auto-ack until ``expect`` messages came (or the time is up): [(props, body)]."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expect and time.monotonic() < deadline:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.02)
        else:
            got.append((props, body))
    return got


def get_one(ch, queue: str, auto_ack: bool = False, timeout_s: float = 3.0) -> tuple:
    """basic.get until a message comes: (method, props, body); fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is not None:
            return method, props, body
        time.sleep(0.02)
    pytest.fail(f"no message in {queue} after {timeout_s} s")


def bodies(ch, queue: str, expect: int, timeout_s: float = 3.0) -> list[bytes]:
    return [body for _props, body in get_all(ch, queue, expect, timeout_s)]


def depth(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def without_time(deaths: list[dict]) -> list[dict]:
    for death in deaths:
        assert isinstance(death.pop("time"), datetime.datetime)
    return deaths


# -- queues: delete, purge, reserved names, redeclare ----------------------------------------------
def test_queue_delete_and_purge_honour_if_unused_and_if_empty(amqp):
    q = amqp.name("work")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        for i in range(3):
            ch.basic_publish("", q, b"m%d" % i)
        assert refusal(ch.queue_delete, q, if_empty=True) == (
            406, f"PRECONDITION_FAILED - queue '{q}' in vhost '/' not empty")
        ch = conn.channel()
        assert ch.queue_purge(q).method.message_count == 3
        ch.basic_publish("", q, b"after purge")
        tag = ch.basic_consume(q, lambda *a: None)
        other = conn.channel()
        assert refusal(other.queue_delete, q, if_unused=True) == (
            406, f"PRECONDITION_FAILED - queue '{q}' in vhost '/' in use")
        ch.basic_cancel(tag)
        ch.close()
        ch = conn.channel()
        assert ch.queue_delete(q, if_unused=True).method.message_count == 1
        assert refusal(ch.queue_declare, q, passive=True) == (404, f"NOT_FOUND - no queue '{q}' in vhost '/'")


def test_queue_names_starting_with_amq_are_reserved(amqp):
    with connect(amqp) as conn:
        assert refusal(conn.channel().queue_declare, "amq.mine") == (
            403, "ACCESS_REFUSED - queue name 'amq.mine' contains reserved prefix 'amq.*'")
        assert refusal(conn.channel().exchange_declare, "amq.mine", "direct") == (
            403, "ACCESS_REFUSED - exchange name 'amq.mine' contains reserved prefix 'amq.*'")
        server_named = conn.channel().queue_declare("", exclusive=True).method.queue
        assert server_named.startswith("amq.gen-")


def test_redeclaring_a_queue_with_other_arguments_is_refused(amqp):
    q = amqp.name("limited")
    with connect(amqp) as conn:
        conn.channel().queue_declare(q, arguments={"x-max-length": 10})
        assert refusal(conn.channel().queue_declare, q, arguments={"x-max-length": 20}) == (
            406, (f"PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue '{q}' in vhost '/': "
                  "received '20' but current is '10'"))
        assert refusal(conn.channel().queue_declare, q, durable=True, arguments={"x-max-length": 10}) == (
            406, (f"PRECONDITION_FAILED - inequivalent arg 'durable' for queue '{q}' in vhost '/': "
                  "received 'true' but current is 'false'"))
        assert refusal(conn.channel().queue_declare, q) == (
            406, (f"PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue '{q}' in vhost '/': "
                  "received none but current is the value '10' of type 'signedint'"))
        ch = conn.channel()
        assert ch.queue_declare(q, arguments={"x-max-length": 10}).method.queue == q


# -- exclusive queues and consumers ------------------------------------------------------------------
def test_an_exclusive_queue_is_locked_to_its_connection_and_goes_with_it(amqp):
    q = amqp.name("mine")
    owner = connect(amqp)
    owner.channel().queue_declare(q, exclusive=True)
    locked = (405, (f"RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{q}' in vhost '/'. "
                    "It could be originally declared on another connection or the exclusive property value "
                    "does not match that of the original declaration."))
    with connect(amqp) as other:
        assert refusal(other.channel().queue_declare, q, passive=True) == locked
        assert refusal(other.channel().basic_consume, q, lambda *a: None) == locked
        assert refusal(other.channel().queue_delete, q) == locked
        assert refusal(other.channel().queue_purge, q) == locked
        owner.close()
        assert refusal(other.channel().queue_declare, q, passive=True) == (
            404, f"NOT_FOUND - no queue '{q}' in vhost '/'")


def test_an_exclusive_consumer_keeps_every_other_consumer_out(amqp):
    q = amqp.name("single")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.basic_consume(q, lambda *a: None, exclusive=True)
        assert refusal(conn.channel().basic_consume, q, lambda *a: None) == (
            403, f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use")
        assert refusal(ch.basic_consume, q, lambda *a: None) == (     # not even on its own channel
            403, f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.basic_consume(q, lambda *a: None)
        assert refusal(conn.channel().basic_consume, q, lambda *a: None, exclusive=True) == (
            403, f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use")


# -- exchanges: delete, headers, internal ------------------------------------------------------------
def test_exchange_delete_honours_if_unused_and_publishing_to_a_deleted_exchange_is_404(amqp):
    x, q = amqp.name("events"), amqp.name("events-q")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.exchange_declare(x, "fanout")
        ch.queue_declare(q)
        ch.queue_bind(q, x)
        assert refusal(ch.exchange_delete, x, if_unused=True) == (
            406, f"PRECONDITION_FAILED - exchange '{x}' in vhost '/' in use")
        ch = conn.channel()
        ch.exchange_delete(x)
        assert refusal(ch.exchange_declare, x, passive=True) == (404, f"NOT_FOUND - no exchange '{x}' in vhost '/'")
        ch = conn.channel()
        ch.exchange_delete(x)                         # deleting what is not there is fine
        ch.basic_publish(x, "", b"lost")
        assert refusal(ch.queue_declare, q, passive=True) == (404, f"NOT_FOUND - no exchange '{x}' in vhost '/'")
        assert refusal(conn.channel().exchange_delete, "amq.direct") == (
            403, "ACCESS_REFUSED - deletion of system exchange 'amq.direct' in vhost '/' not allowed")


def test_headers_exchange_matches_all_or_any_of_the_bound_headers(amqp):
    x, q_all, q_any = amqp.name("hdr"), amqp.name("hdr-all"), amqp.name("hdr-any")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.exchange_declare(x, "headers")
        ch.queue_declare(q_all)
        ch.queue_declare(q_any)
        ch.queue_bind(q_all, x, arguments={"x-match": "all", "format": "pdf", "type": "report"})
        ch.queue_bind(q_any, x, arguments={"x-match": "any", "format": "pdf", "type": "log"})
        ch.confirm_delivery()
        for name, headers in [("both", {"format": "pdf", "type": "report"}), ("pdf", {"format": "pdf"}),
                              ("log", {"type": "log"}), ("none", {"format": "zip"}), ("bare", None)]:
            ch.basic_publish(x, "ignored", name.encode(), pika.BasicProperties(headers=headers))
        assert bodies(ch, q_all, 1) == [b"both"]
        assert bodies(ch, q_any, 3) == [b"both", b"pdf", b"log"]
        assert depth(ch, q_all) == depth(ch, q_any) == 0


def test_an_internal_exchange_takes_messages_only_from_exchanges_bound_to_it(amqp):
    inner, front, q = amqp.name("inner"), amqp.name("front"), amqp.name("inner-q")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.exchange_declare(inner, "direct", internal=True)
        ch.exchange_declare(front, "topic")
        ch.exchange_bind(inner, front, "orders.#")
        ch.queue_declare(q)
        ch.queue_bind(q, inner, "orders.eu")
        ch.basic_publish(front, "orders.eu", b"via front")
        ch.basic_publish(front, "orders.us", b"bound but not routed on")
        assert bodies(ch, q, 1) == [b"via front"]
        ch.basic_publish(inner, "orders.eu", b"direct")
        with pytest.raises(ChannelClosedByBroker) as exc:
            ch.queue_declare(q, passive=True)
        assert (exc.value.reply_code, exc.value.reply_text) == (
            403, f"ACCESS_REFUSED - cannot publish to internal exchange '{inner}' in vhost '/'")
        ch = conn.channel()
        ch.exchange_unbind(inner, front, "orders.#")
        ch.basic_publish(front, "orders.eu", b"unbound")
        assert depth(ch, q) == 0


def test_a_queue_deleted_and_declared_again_at_once_is_a_new_empty_queue(amqp):
    """queue.delete then queue.declare of the same name, straight after, as a client that resets its
    queues does: the declare is answered, the new queue is empty, and it works."""
    q = amqp.name("again")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for n in range(10):
            assert ch.queue_declare(q, durable=True).method.message_count == 0
            ch.basic_publish("", q, b"round %d" % n, pika.BasicProperties(delivery_mode=2))
            assert ch.queue_delete(q).method.message_count == 1
        ch.queue_declare(q, durable=True)
        ch.basic_publish("", q, b"last")
        assert bodies(ch, q, 1) == [b"last"]


def test_a_route_a_channel_has_used_follows_every_change_of_bindings_and_queues(amqp):
    """A channel remembers the queues a publish's exchange and routing key went to; each later publish
    on it with the same exchange and key must still go where the bindings say now."""
    x, a, b = amqp.name("moves"), amqp.name("moves-a"), amqp.name("moves-b")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare(x, "direct")
        ch.queue_declare(a)
        ch.queue_declare(b)
        ch.queue_bind(a, x, "k")
        for n in range(3):
            ch.basic_publish(x, "k", b"a%d" % n)
        ch.queue_bind(b, x, "k")
        ch.basic_publish(x, "k", b"both")
        ch.queue_unbind(a, x, "k")
        ch.basic_publish(x, "k", b"b only")
        assert bodies(ch, a, 4) == [b"a0", b"a1", b"a2", b"both"]
        assert bodies(ch, b, 2) == [b"both", b"b only"]
        ch.basic_publish("", a, b"by name")
        ch.queue_delete(a)
        ch.queue_declare(a)                     # a new queue of the same name: its own process here
        ch.basic_publish("", a, b"to the new one")
        ch.queue_delete(b)
        ch.queue_declare(b)                     # its binding went with the old one
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish(x, "k", b"nowhere", mandatory=True)
        ch.queue_bind(b, x, "k")
        ch.basic_publish(x, "k", b"bound again")
        assert bodies(ch, a, 1) == [b"to the new one"]
        assert bodies(ch, b, 1) == [b"bound again"]
        assert depth(ch, a) == depth(ch, b) == 0


# -- transactions ----------------------------------------------------------------------------------
def test_transactions_publish_and_ack_only_on_commit(amqp):
    q = amqp.name("tx")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        assert refusal(ch.tx_commit) == (406, "PRECONDITION_FAILED - channel is not transactional")
        ch = conn.channel()
        ch.tx_select()
        ch.basic_publish("", q, b"rolled back")
        ch.tx_rollback()
        ch.basic_publish("", q, b"one")
        ch.basic_publish("", q, b"two")
        assert depth(ch, q) == 0
        ch.tx_commit()
        assert depth(ch, q) == 2
        method, _, body = ch.basic_get(q)
        assert body == b"one"
        ch.basic_ack(method.delivery_tag)
        ch.tx_rollback()                               # the ack is undone: "one" stays unacked
        ch.close()                                     # and comes back when the channel goes
        reader = conn.channel()
        assert bodies(reader, q, 2) == [b"one", b"two"]
        tx = conn.channel()
        tx.tx_select()
        assert refusal(tx.confirm_delivery) == (406, "PRECONDITION_FAILED - cannot switch from tx to confirm mode")


# -- TTL, dead-lettering and x-death --------------------------------------------------------------
def test_queue_ttl_dead_letters_expired_messages_with_x_death(amqp):
    q, dlq = amqp.name("short-lived"), amqp.name("expired")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(dlq)
        ch.queue_declare(q, arguments={"x-message-ttl": 100, "x-dead-letter-exchange": "",
                                       "x-dead-letter-routing-key": dlq})
        ch.basic_publish("", q, b"late", pika.BasicProperties(headers={"app": "billing"}))
        [(props, body)] = get_all(ch, dlq, 1)
        assert body == b"late" and depth(ch, q) == 0
        headers = props.headers
        assert without_time(headers.pop("x-death")) == [
            {"count": 1, "reason": "expired", "queue": q, "exchange": "", "routing-keys": [q]}]
        assert headers == {"app": "billing", "x-first-death-exchange": "", "x-first-death-queue": q,
                           "x-first-death-reason": "expired"}


def test_per_message_ttl_dead_letters_with_the_original_expiration(amqp):
    q, dlx, dlq = amqp.name("orders"), amqp.name("dlx"), amqp.name("orders-dead")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.exchange_declare(dlx, "fanout")
        ch.queue_declare(dlq)
        ch.queue_bind(dlq, dlx)
        ch.queue_declare(q, arguments={"x-dead-letter-exchange": dlx})
        ch.basic_publish("", q, b"keep")
        ch.basic_publish("", q, b"stale", pika.BasicProperties(expiration="50"))
        # an expired message behind a live one waits for the head, as in RabbitMQ
        time.sleep(0.2)
        assert bodies(ch, q, 1) == [b"keep"]
        [(props, body)] = get_all(ch, dlq, 1)
        assert body == b"stale" and props.expiration is None
        assert without_time(props.headers["x-death"]) == [
            {"count": 1, "reason": "expired", "queue": q, "exchange": "", "routing-keys": [q],
             "original-expiration": "50"}]
        ch.basic_publish("", q, b"zero", pika.BasicProperties(expiration="0"))
        assert bodies(ch, dlq, 1) == [b"zero"]
        ch.basic_publish("", q, b"x", pika.BasicProperties(expiration="soon"))
        assert refusal(ch.queue_declare, q, passive=True) == (
            406, "PRECONDITION_FAILED - invalid expiration 'soon': no_integer")


def test_rejected_and_nacked_messages_are_dead_lettered_and_counted(amqp):
    q, dlq = amqp.name("jobs"), amqp.name("jobs-dead")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(dlq, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q})
        ch.queue_declare(q, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
        ch.basic_publish("", q, b"job")
        method, _, _ = ch.basic_get(q)
        ch.basic_reject(method.delivery_tag, requeue=False)
        method, props, _ = get_one(ch, dlq)
        assert [(d["reason"], d["queue"], d["count"]) for d in props.headers["x-death"]] == [("rejected", q, 1)]
        ch.basic_nack(method.delivery_tag, requeue=False)         # dead-lettered back to q
        method, props, body = get_one(ch, q)
        assert body == b"job"
        assert [(d["reason"], d["queue"], d["count"]) for d in props.headers["x-death"]] == [
            ("rejected", dlq, 1), ("rejected", q, 1)]
        ch.basic_nack(method.delivery_tag, requeue=False)
        _, props, _ = get_one(ch, dlq, auto_ack=True)
        assert [(d["reason"], d["queue"], d["count"]) for d in props.headers["x-death"]] == [
            ("rejected", q, 2), ("rejected", dlq, 1)]
        assert props.headers["x-first-death-queue"] == q


# -- length limits ----------------------------------------------------------------------------------
def test_max_length_drops_the_oldest_and_dead_letters_it(amqp):
    q, dlq, qb = amqp.name("recent"), amqp.name("dropped"), amqp.name("recent-bytes")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(dlq)
        ch.queue_declare(q, arguments={"x-max-length": 2, "x-dead-letter-exchange": "",
                                       "x-dead-letter-routing-key": dlq})
        ch.queue_declare(qb, arguments={"x-max-length-bytes": 10, "x-overflow": "drop-head"})
        ch.confirm_delivery()
        for i in range(1, 5):
            ch.basic_publish("", q, b"m%d" % i)
            ch.basic_publish("", qb, b"b%03d" % i)                  # 4 bytes each: two fit in 10
        assert bodies(ch, q, 2) == [b"m3", b"m4"]
        assert bodies(ch, qb, 2) == [b"b003", b"b004"]
        dropped = get_all(ch, dlq, 2)
        assert [body for _, body in dropped] == [b"m1", b"m2"]
        assert [d["reason"] for _, d in ((p, p.headers["x-death"][0]) for p, _ in dropped)] == ["maxlen"] * 2


def test_reject_publish_overflow_nacks_the_publisher(amqp):
    q = amqp.name("full")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
        ch.confirm_delivery()
        ch.basic_publish("", q, b"1")
        ch.basic_publish("", q, b"2")
        with pytest.raises(NackError):
            ch.basic_publish("", q, b"3")
        assert bodies(ch, q, 2) == [b"1", b"2"]
        ch.basic_publish("", q, b"4")                   # room again
        assert bodies(ch, q, 1) == [b"4"]


def test_reject_publish_dlx_nacks_and_dead_letters(amqp):
    q, dlq = amqp.name("full-dlx"), amqp.name("full-dead")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(dlq)
        ch.queue_declare(q, arguments={"x-max-length": 1, "x-overflow": "reject-publish-dlx",
                                       "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
        ch.confirm_delivery()
        ch.basic_publish("", q, b"in")
        with pytest.raises(NackError):
            ch.basic_publish("", q, b"over")
        assert bodies(ch, q, 1) == [b"in"]
        [(props, body)] = get_all(ch, dlq, 1)
        assert body == b"over"
        assert without_time(props.headers["x-death"]) == [
            {"count": 1, "reason": "maxlen", "queue": q, "exchange": "", "routing-keys": [q]}]


# -- priorities, requeue order, recover ------------------------------------------------------------
def test_max_priority_delivers_higher_priorities_first(amqp):
    q = amqp.name("prio")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q, arguments={"x-max-priority": 5})
        ch.confirm_delivery()
        for body, priority in [(b"low", 1), (b"none", None), (b"high", 5), (b"mid", 3), (b"over", 9),
                               (b"low2", 1)]:
            ch.basic_publish("", q, body, pika.BasicProperties(priority=priority))
        # priorities above the maximum count as the maximum
        assert bodies(ch, q, 6) == [b"high", b"over", b"mid", b"low", b"low2", b"none"]


def _collect(conn, got: dict, who: str, n: int) -> None:
    """Dispatch deliveries until ``who`` has ``n`` (5 s at most), and a little longer: nothing more may come."""
    deadline = time.monotonic() + 5
    while len(got[who]) < n and time.monotonic() < deadline:
        conn.process_data_events(0.05)
    conn.process_data_events(0.2)


def _hold_five(params, queue: str, ready: int) -> None:
    """In a forked child: consume ``queue`` with prefetch 5, ack nothing, say so on ``ready`` once five came."""
    code = 1
    try:
        got = []
        with pika.BlockingConnection(params) as conn:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=5)
            ch.basic_consume(queue, lambda c, m, p, b: got.append(b), consumer_tag="c1")
            os.write(ready, b"c")                  # consuming
            while len(got) < 5:
                conn.process_data_events(0.05)
            os.write(ready, b"".join(got) + b"\n")
            while True:
                conn.process_data_events(1)
    finally:
        os._exit(code)


def test_a_single_active_consumer_that_dies_hands_its_unacked_and_the_rest_to_the_highest_priority(amqp, children):
    """x-single-active-consumer: c1 (a process of its own) came first and alone is delivered to, though c3
    has x-priority 10; c1's process is killed with five unacked, and c3 (not c2, which came earlier) takes
    over, those five first, redelivered, then the rest. As RabbitMQ 3.10.8 does."""
    q = amqp.name("sac")
    got: dict[str, list] = {"c2": [], "c3": []}
    with connect(amqp) as conn:
        ch2, ch3 = conn.channel(), conn.channel()
        ch2.queue_declare(q, arguments={"x-single-active-consumer": True})
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _hold_five(amqp.pika_params(), q, w)
        children.append(pid)
        os.close(w)
        assert os.read(r, 1) == b"c"
        for ch, tag, args in ((ch2, "c2", None), (ch3, "c3", {"x-priority": 10})):
            ch.basic_qos(prefetch_count=5)
            ch.basic_consume(q, lambda c, m, p, b, tag=tag: got[tag].append((m.delivery_tag, b, m.redelivered)),
                             consumer_tag=tag, arguments=args)
        for i in range(20):
            ch2.basic_publish("", q, b"%d" % i)
        with os.fdopen(r, "rb") as ready:
            assert ready.readline() == b"01234\n"
        _collect(conn, got, "c3", 0)
        assert not got["c2"] and not got["c3"]
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        _collect(conn, got, "c3", 5)
        assert [(b, r) for _, b, r in got["c3"]] == [(b"%d" % i, True) for i in range(5)] and not got["c2"]
        ch3.basic_ack(got["c3"][-1][0], multiple=True)
        _collect(conn, got, "c3", 10)
        assert [(b, r) for _, b, r in got["c3"][5:]] == [(b"%d" % i, False) for i in range(5, 10)]
        assert not got["c2"]
        assert ch2.queue_declare(q, passive=True).method.consumer_count == 2


def test_an_exclusive_consume_on_a_queue_with_a_single_active_consumer_is_refused_even_the_first(amqp):
    q = amqp.name("sac-exclusive")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q, arguments={"x-single-active-consumer": True})
        assert refusal(ch.basic_consume, q, lambda *a: None, exclusive=True) == (
            403, f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use")


def test_a_cancelled_single_active_consumer_hands_over_to_the_highest_priority_waiting_one(amqp):
    """No-ack consumers: c1 cancels, and c3 (x-priority 10) gets what comes next, c2 nothing. (RabbitMQ
    3.10.8's queue process crashes on the next publish if the cancelled one still held unacked
    deliveries; creditflow hands over then too.)"""
    q = amqp.name("sac-cancel")
    got: dict[str, list] = {"c1": [], "c2": [], "c3": []}
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q, arguments={"x-single-active-consumer": True})
        for tag, args in (("c1", None), ("c2", None), ("c3", {"x-priority": 10})):
            ch.basic_consume(q, lambda c, m, p, b, tag=tag: got[tag].append((m.delivery_tag, b, m.redelivered)),
                             auto_ack=True, consumer_tag=tag, arguments=args)
        for i in range(3):
            ch.basic_publish("", q, b"%d" % i)
        _collect(conn, got, "c1", 3)
        ch.basic_cancel("c1")
        for i in range(3, 6):
            ch.basic_publish("", q, b"%d" % i)
        _collect(conn, got, "c3", 3)
        assert {k: [b for _, b, _ in v] for k, v in got.items()} == {
            "c1": [b"0", b"1", b"2"], "c2": [], "c3": [b"3", b"4", b"5"]}


def test_requeued_messages_come_back_in_their_original_order(amqp):
    q = amqp.name("ordered")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        for i in range(6):
            ch.basic_publish("", q, b"%d" % i)
        tags = [ch.basic_get(q)[0].delivery_tag for _ in range(4)]       # 0..3 unacked, 4, 5 ready
        ch.basic_nack(tags[2], requeue=True)                              # 2
        ch.basic_reject(tags[0], requeue=True)                            # 0
        ch.basic_nack(tags[3], multiple=True, requeue=True)               # 1 and 3
        got = [ch.basic_get(q, auto_ack=True) for _ in range(6)]
        assert [body for _, _, body in got] == [b"0", b"1", b"2", b"3", b"4", b"5"]
        assert [m.redelivered for m, _, _ in got] == [True] * 4 + [False] * 2


def test_basic_recover_redelivers_what_was_not_acked(amqp):
    q = amqp.name("recover")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        for i in range(3):
            ch.basic_publish("", q, b"%d" % i)
        seen = []
        ch.basic_consume(q, lambda c, m, p, b: seen.append((b, m.redelivered)))
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            conn.process_data_events(0.05)
        ch.basic_recover(requeue=True)
        while len(seen) < 6 and time.monotonic() < deadline:
            conn.process_data_events(0.05)
        assert seen == [(b"0", False), (b"1", False), (b"2", False), (b"0", True), (b"1", True), (b"2", True)]


@pytest.mark.parametrize("case", ["the same tag twice, multiple", "a multiple ack of a tag acked alone",
                                  "the same tag twice"])
def test_a_delivery_tag_that_is_not_outstanding_closes_the_channel(amqp, case):
    q = amqp.name("acked-twice")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        for body in (b"a", b"b", b"c"):
            ch.basic_publish("", q, body)
        tags = [get_one(ch, q)[0].delivery_tag for _ in range(3)]
        if case == "the same tag twice, multiple":
            ch.basic_ack(tags[0], multiple=True)
            ch.basic_ack(tags[0], multiple=True)
            bad = tags[0]
        elif case == "a multiple ack of a tag acked alone":      # tag 1 is still outstanding: not enough
            ch.basic_ack(tags[1])
            ch.basic_ack(tags[1], multiple=True)
            bad = tags[1]
        else:
            ch.basic_ack(tags[0])
            ch.basic_ack(tags[0])
            bad = tags[0]
        assert refusal(ch.basic_get, q) == (406, f"PRECONDITION_FAILED - unknown delivery tag {bad}")
        assert depth(conn.channel(), q) == 2    # the first ack stands; the closed channel's others went back


def test_a_multiple_ack_of_tag_0_acks_all_outstanding_and_with_none_is_no_error(amqp):
    """Of five gets, the second is acked alone; tag 0 with multiple then acks the other four, and again with
    none outstanding the channel goes on (RabbitMQ's rule); a sixth get is acked by tag 0 as well."""
    q = amqp.name("ack-all")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        for i in range(6):
            ch.basic_publish("", q, b"%d" % i)
        tags = [get_one(ch, q)[0].delivery_tag for _ in range(5)]
        ch.basic_ack(tags[1])
        ch.basic_ack(0, multiple=True)
        ch.basic_ack(0, multiple=True)
        assert get_one(ch, q)[2] == b"5"        # the channel is open: the sixth is there to get
        ch.basic_ack(0, multiple=True)
        ch.close()
        assert depth(conn.channel(), q) == 0    # all six acked: none went back with the channel's close


def test_acks_rejects_and_a_bad_tag_in_one_write_are_taken_in_the_client_s_order(amqp):
    """Written in one go, so the broker reads them together: ack 1, reject 2 with requeue, ack 3, ack 99.
    The channel closes with 406 for tag 99, after the three before it took effect: 1 and 3 are gone, 2 is
    back, redelivered, and 4 and 5 (got, never acked) go back with the channel."""
    from pamqp import commands, frame

    from conftest import raw_amqp_connection
    q = amqp.name("settle-order")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.confirm_delivery()                   # all five in the queue before the gets
        for i in range(1, 6):
            ch.basic_publish("", q, b"m%d" % i)
        sock = raw_amqp_connection(amqp.port)
        try:
            sock.sendall(frame.marshal(commands.Channel.Open(), 1)
                         + b"".join(frame.marshal(commands.Basic.Get(queue=q), 1) for _ in range(5)))
            seen, buf = [], b""
            while sum(isinstance(m, commands.Basic.GetOk) for m in seen) < 5:
                buf += sock.recv(65536)
                while buf:
                    try:
                        used, _, method = frame.unmarshal(buf)
                    except Exception:          # an incomplete frame: read on
                        break
                    buf = buf[used:]
                    seen.append(method)
            tags = [m.delivery_tag for m in seen if isinstance(m, commands.Basic.GetOk)]
            sock.sendall(frame.marshal(commands.Basic.Ack(delivery_tag=tags[0]), 1)
                         + frame.marshal(commands.Basic.Reject(delivery_tag=tags[1], requeue=True), 1)
                         + frame.marshal(commands.Basic.Ack(delivery_tag=tags[2]), 1)
                         + frame.marshal(commands.Basic.Ack(delivery_tag=99), 1))
            closed = None
            while closed is None:
                buf += sock.recv(65536)
                while buf and closed is None:
                    try:
                        used, _, method = frame.unmarshal(buf)
                    except Exception:
                        break
                    buf = buf[used:]
                    if isinstance(method, commands.Channel.Close):
                        closed = method
            assert (closed.reply_code, closed.reply_text) == (406, "PRECONDITION_FAILED - unknown delivery tag 99")
        finally:
            sock.close()
        got = get_all(conn.channel(), q, 3)
        assert [body for _, body in got] == [b"m2", b"m4", b"m5"]


def test_an_ack_just_before_its_channel_closes_on_an_error_is_never_undone(amqp):
    """As RabbitMQ: the refused channel's queues have taken its ack and its unacked messages back before
    the client hears of the close, so the next channel finds exactly what was not acked, every time.
    (creditflow once let a queue hear that the channel's process had ended before it read the ack the
    channel had passed on, and put the acked message back, or answered the new channel's declare first.)"""
    with connect(amqp) as conn:
        for round_ in range(100):
            q = amqp.name(f"ack-then-close-{round_}")
            ch = conn.channel()
            ch.queue_declare(q)
            for body in (b"a", b"b", b"c"):
                ch.basic_publish("", q, body)
            tags = [get_one(ch, q)[0].delivery_tag for _ in range(3)]
            ch.basic_ack(tags[0])
            ch.basic_ack(tags[0])
            assert refusal(ch.basic_get, q)[0] == 406
            after = conn.channel()
            assert (round_, depth(after, q)) == (round_, 2)
            after.queue_delete(q)
            after.close()


# -- direct reply-to, update-secret, message size ----------------------------------------------------
def test_replying_to_amq_rabbitmq_reply_to_needs_a_consumer_on_it(amqp):
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.basic_publish("", "anything", b"ask", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
        with pytest.raises(ChannelClosedByBroker) as exc:
            ch.queue_declare("", exclusive=True)
        assert (exc.value.reply_code, exc.value.reply_text) == (
            406, "PRECONDITION_FAILED - fast reply consumer does not exist")


def test_update_secret_is_accepted_on_an_open_connection(amqp):
    q = amqp.name("rotated")
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        conn.update_secret("guest", "credentials rotated")
        ch.basic_publish("", q, b"after rotation")
        assert bodies(ch, q, 1) == [b"after rotation"]


def test_bodies_up_to_rabbitmqs_default_max_size_pass_and_bigger_ones_are_refused(amqp):
    q = amqp.name("big")
    body = bytes(range(256)) * (16 * 1024 * 1024 // 256)      # 16 MiB
    with connect(amqp) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.confirm_delivery()
        ch.basic_publish("", q, body)
        assert bodies(ch, q, 1, timeout_s=20) == [body]
        too_big = bytearray(MAX_MESSAGE_BYTES + 1)
        with pytest.raises(ChannelClosedByBroker) as exc:
            ch.basic_publish("", q, bytes(too_big))
        assert (exc.value.reply_code, exc.value.reply_text) == (
            406, (f"PRECONDITION_FAILED - message size {MAX_MESSAGE_BYTES + 1} is larger than configured "
                  f"max size {MAX_MESSAGE_BYTES}"))
