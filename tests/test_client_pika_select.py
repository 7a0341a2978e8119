"""pika's SelectConnection against the broker: an application written as asynchronous callbacks.

The broker's own notices reach such an application as callbacks: basic.cancel
when its queue is deleted (consumer_cancel_notify, which pika announces),
deliveries paced by basic.qos, channel.flow's answer, a queue gone with its
last consumer. Reply codes and texts as RabbitMQ 3.10.8 sends them; the same
tests run against RabbitMQ itself (see ``tests/amqp_targets.py``).
"""

from __future__ import annotations

import functools

import pika
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]


class App:
    """A SelectConnection whose ioloop runs until ``finish()`` or ``timeout_s``; ``events`` records what came."""

    def __init__(self, target, on_open, timeout_s: float = 5.0):
        self.events: list = []
        self.finished = False
        self.conn = pika.SelectConnection(target.pika_params(), on_open_callback=lambda c: on_open(self),
                                          on_open_error_callback=self._failed, on_close_callback=self._closed)
        self.conn.ioloop.call_later(timeout_s, self._timeout)
        self.conn.ioloop.start()

    def later(self, seconds: float, callback, *args) -> None:
        self.conn.ioloop.call_later(seconds, functools.partial(callback, *args))

    def finish(self) -> None:
        self.finished = True
        if self.conn.is_open:
            self.conn.close()
        elif self.conn.is_closed:
            self.conn.ioloop.stop()

    def _failed(self, _conn, error) -> None:
        self.events.append(("open failed", repr(error)))
        self.conn.ioloop.stop()

    def _closed(self, _conn, reason) -> None:
        if not self.finished:
            self.events.append(("connection closed", getattr(reason, "reply_code", None),
                                getattr(reason, "reply_text", repr(reason))))
        self.conn.ioloop.stop()

    def _timeout(self) -> None:
        if not self.finished:
            self.events.append("timed out")
            self.finish()


def test_a_consumer_is_told_when_its_queue_is_deleted(amqp):
    q = amqp.name("doomed")

    def on_open(app):
        app.conn.channel(on_open_callback=functools.partial(consumer_open, app))

    def consumer_open(app, ch):
        ch.add_on_cancel_callback(lambda frame: cancelled(app, ch, frame))
        ch.queue_declare(q, callback=lambda _: ch.basic_consume(
            q, lambda *a: None, consumer_tag="watcher", callback=lambda _: consuming(app)))

    def consuming(app):
        app.conn.channel(on_open_callback=lambda other: other.queue_delete(
            q, callback=lambda ok: app.events.append(("deleted", ok.method.message_count))))

    def cancelled(app, ch, frame):
        app.events.append(("cancelled", type(frame.method).__name__, frame.method.consumer_tag))
        # the channel stays open: it can go on working
        ch.queue_declare("", exclusive=True, callback=lambda ok: (app.events.append("channel still open"),
                                                                  app.finish()))

    app = App(amqp, on_open)
    assert sorted(app.events, key=str) == sorted([("deleted", 0), ("cancelled", "Cancel", "watcher"),
                                                  "channel still open"], key=str)


def test_prefetch_is_per_consumer_or_for_the_whole_channel(amqp):
    queues = [amqp.name(f"backlog{i}") for i in range(2)]
    counts = {"per-consumer": 0, "global": 0}

    def on_open(app):
        app.conn.channel(on_open_callback=lambda ch: fill(app, ch))

    def fill(app, ch):
        def declared(i, _ok):
            for n in range(10):
                ch.basic_publish("", queues[i], b"%d" % n)
            if i == 1:
                ch.queue_declare(queues[1], passive=True, callback=lambda _: start(app))
        for i, q in enumerate(queues):
            ch.queue_declare(q, callback=functools.partial(declared, i))

    def start(app):
        app.conn.channel(on_open_callback=lambda ch: ch.basic_qos(
            prefetch_count=2, global_qos=False, callback=lambda _: consume(app, ch, "per-consumer")))
        app.conn.channel(on_open_callback=lambda ch: ch.basic_qos(
            prefetch_count=3, global_qos=True, callback=lambda _: consume(app, ch, "global")))
        app.later(1.0, report, app)

    held = []

    def consume(app, ch, kind):
        def on_message(channel, method, _props, _body):
            counts[kind] += 1
            if kind == "global":
                held.append((channel, method.delivery_tag))
        # per consumer: one on each queue; global: two consumers of one queue share the channel's limit
        # (creditflow counts a channel's global limit per queue; RabbitMQ across all of them)
        for q in (queues if kind == "per-consumer" else [queues[0], queues[0]]):
            ch.basic_consume(q, on_message)

    def report(app):
        app.events.append(dict(counts))
        channel, tag = held[0]
        channel.basic_ack(tag)
        app.later(0.5, lambda: (app.events.append(counts["global"]), app.finish()))

    app = App(amqp, on_open)
    # two consumers, two each; three between them; one more once one of the three is acked
    assert app.events == [{"per-consumer": 4, "global": 3}, 4]


def test_a_global_prefetch_counts_across_every_queue_the_channel_consumes(amqp):
    """RabbitMQ's channel-wide limit (global=true) holds the channel's unacked deliveries from all its
    queues together: two queues of five, a limit of three: three deliveries, three more after each
    ack of everything, the last one after the third."""
    queues = [amqp.name(f"shared{i}") for i in range(2)]
    delivered: list[tuple[str, int]] = []
    seen: list[int] = []

    def on_open(app):
        app.conn.channel(on_open_callback=lambda ch: fill(app, ch))

    def fill(app, ch):
        def declared(i, _ok):
            for n in range(5):
                ch.basic_publish("", queues[i], b"%d" % n)
            if i == 1:
                ch.queue_declare(queues[1], passive=True, callback=lambda _: ch.basic_qos(
                    prefetch_count=3, global_qos=True, callback=lambda _: consume(app, ch)))
        for i, q in enumerate(queues):
            ch.queue_declare(q, callback=functools.partial(declared, i))

    def consume(app, ch):
        for q in queues:
            ch.basic_consume(q, lambda _c, m, _p, _b: delivered.append((m.routing_key, m.delivery_tag)))
        app.later(0.7, lambda: look(app, ch))

    def look(app, ch):
        seen.append(len(delivered))
        if len(seen) == 4:
            app.finish()
            return
        if delivered:
            ch.basic_ack(delivered[-1][1], multiple=True)
        app.later(0.7, lambda: look(app, ch))

    App(amqp, on_open)
    assert seen == [3, 6, 9, 10]
    assert sorted(q for q, _ in delivered) == sorted(queues * 5)


def test_channel_flow_is_answered_and_active_false_is_not_implemented(amqp):
    def on_open(app):
        app.conn.channel(on_open_callback=lambda ch: ch.flow(True, lambda active: flowing(app, active)))

    def flowing(app, active):
        app.events.append(("flow-ok", active))
        app.conn.channel(on_open_callback=lambda ch: ch.flow(False, lambda active: app.events.append(active)))

    app = App(amqp, on_open)
    assert app.events == [("flow-ok", True), ("connection closed", 540, "NOT_IMPLEMENTED - active=false")]


def test_an_auto_delete_queue_goes_with_its_last_consumer(amqp):
    q = amqp.name("temporary")

    def on_open(app):
        app.conn.channel(on_open_callback=lambda ch: ch.queue_declare(
            q, auto_delete=True, callback=lambda _: consume(app, ch)))

    def consume(app, ch):
        tags = []

        def both_consuming(_ok):
            if len(tags) == 2:
                ch.basic_cancel(tags[0], callback=lambda _: check(app, "one consumer left",
                                                                   lambda: ch.basic_cancel(tags[1], lambda _: check(
                                                                       app, "none left", app.finish))))
        for _ in range(2):
            tags.append(ch.basic_consume(q, lambda *a: None, callback=both_consuming))

    def check(app, moment, then):
        def on_close(_ch, reason):
            app.events.append((moment, reason.reply_code, reason.reply_text))
            then()

        def on_channel(probe):
            probe.add_on_close_callback(on_close)
            probe.queue_declare(q, passive=True, callback=lambda ok: (app.events.append((moment, "exists")),
                                                                    probe.close()))
        app.conn.channel(on_open_callback=on_channel)

    app = App(amqp, on_open)
    assert app.events == [("one consumer left", "exists"), ("one consumer left", 0, "Normal shutdown"),
                          ("none left", 404, f"NOT_FOUND - no queue '{q}' in vhost '/'")]


def test_the_broker_announces_the_capabilities_rabbitmq_does(amqp):
    """Clients look at these before using an extension (pika: basic.nack, consumer_cancel_notify)."""
    seen = {}

    def on_open(app):
        seen.update(app.conn.server_capabilities)
        app.finish()

    App(amqp, on_open)
    assert seen == {"publisher_confirms": True, "exchange_exchange_bindings": True, "basic.nack": True,
                    "consumer_cancel_notify": True, "connection.blocked": True, "consumer_priorities": True,
                    "authentication_failure_close": True, "per_consumer_qos": True, "direct_reply_to": True}
