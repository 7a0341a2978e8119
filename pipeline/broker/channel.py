"""The channel: one process per AMQP channel, a shell over two pure cores.

It takes its reader's records off a ring, acks each publish's credit as soon
as it dequeues it (before routing, as RabbitMQ's channel does; counted with
``Stage.owe`` and acked to the core once a batch), routes it
with its copy of the broker's routing table (``pipeline.broker.routing``,
kept current by the supervisor) and sends it to every target queue,
spending one credit per queue. While a queue holds it blocked it still
routes (its credit goes negative) but defers the reader's grants, which is
how back-pressure climbs to the socket. Publisher confirms and transactions
are ``pipeline.broker.confirms``: the channel feeds it what was routed where
and what each queue confirmed, nacked or did when it ended, and writes the
frames it returns.

The channel's other methods go where RabbitMQ decides them: exchanges,
bindings, queue declares and deletes to the supervisor (which owns the
definitions); consume, cancel, get, purge, recover, qos to the queue.

One client record at a time, as RabbitMQ's channel handles its frames: a
method answered by the broker or a queue, or a record that needs a link to a
queue first, is finished before the next record is looked at. Those answers
arrive asynchronously here, so while one is awaited (``waiting``) the
records after it wait in ``held``, unhandled and their credit not yet acked,
and the reader's ring is left unread; the answer resumes them in order.
Pipelined methods are therefore answered in the order they were sent.
"""

from __future__ import annotations

import base64
import collections
import os
import time

from pamqp import commands

from ipc import control
from pipeline.broker import wire
from pipeline.amqp import frames
from pipeline.amqp.errors import AmqpError
from pipeline.broker import props
from pipeline.broker.args import QueueError, consumer_priority, parse_expiration
from pipeline.broker.confirms import ACK, COMMIT_OK, NACK, Confirms
from pipeline.broker.definitions import arguments_to_json
from pipeline.broker.routing import RoutingTable
from pipeline.broker import bodies
from pipeline.broker.stage import Stage, read_batch_for
from pipeline.telemetry.schema import ChannelStats

# AMQP 0-9-1's hard errors: the connection is closed, not just the channel
HARD_ERROR_CODES = frozenset((320, 402, 501, 502, 503, 504, 505, 506, 530, 540, 541))
QUEUE_DECLARE, QUEUE_BIND, QUEUE_PURGE, QUEUE_DELETE, QUEUE_UNBIND = (50, 10), (50, 20), (50, 30), (50, 40), (50, 50)
EXCHANGE_DECLARE, EXCHANGE_DELETE, EXCHANGE_BIND, EXCHANGE_UNBIND = (40, 10), (40, 20), (40, 30), (40, 40)
BASIC_CONSUME, BASIC_CANCEL, BASIC_GET = (60, 20), (60, 30), (60, 70)
REPLY_TO = "amq.rabbitmq.reply-to"
REPLY_TO_BIT_HIGH = props.REPLY_TO_BIT >> 8      # the reply_to flag, in the first byte of the property flags
EXPIRATION_BIT_HIGH = props.EXPIRATION_BIT >> 8
KNOWN_ROUTES_MAX = 1024      # routes a channel remembers (forgotten all at once past this, and on any change)


class ChannelError(Exception):
    """Raised when a method breaks a channel-level rule; the channel is closed with ``code``."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0):
        super().__init__(text)
        self.code, self.text, self.class_id, self.method_id = code, text, class_id, method_id


def from_amqp(exc, class_id: int = 0, method_id: int = 0) -> ChannelError:
    """A core's refusal (``AmqpError`` or ``QueueError``) as the channel error it closes with."""
    return ChannelError(exc.reply_code, exc.reply_text, getattr(exc, "class_id", 0) or class_id,
                        getattr(exc, "method_id", 0) or method_id)


class QueueLinks:
    """The two links to one queue process."""

    __slots__ = ("name", "out", "inp")

    def __init__(self, name: bytes, out, inp):
        self.name, self.out, self.inp = name, out, inp


def busy_wait_ns(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


class Channel(Stage):
    kind = "channel"

    def __init__(self, name, ctl_sock, inbox_fd, doorbell_fd, credit_spec, *, number: int,
                 reader: str, frame_max: int, delay_us: int = 0, cancel_notify: bool = False):
        super().__init__(name, ctl_sock, inbox_fd, doorbell_fd, credit_spec)
        self.number = number
        self.reader_name = reader
        self.cancel_notify = cancel_notify        # the client announced consumer_cancel_notify
        self.delay_ns = delay_us * 1000
        self.read_batch = read_batch_for(self.delay_ns)
        self.frame_max = frame_max
        self.from_reader = None
        self.to_reader = None
        self.routing = RoutingTable()
        self.queues: dict[bytes, QueueLinks] = {}
        self.by_in_link: dict[int, QueueLinks] = {}
        self.missing: dict[bytes, tuple[int, str]] = {}   # known not to exist (until a routing change): why
        # exchange and routing key as they stand in a publish -> (queue names, their links): routes whose
        # queues are all linked, forgotten when the bindings, the links or the channel's mode change
        self.known_routes: dict[bytes, tuple[tuple, list]] = {}
        self.waiting: tuple | None = None         # ("link"|"queue", name) or ("broker",): the answer awaited
        self.then = None                          # what to do with it (an op for ``replay``, or an answer)
        self.held: collections.deque = collections.deque()   # client records after the one that waits
        self.confirms = Confirms()
        self.prefetch = 0                         # basic.qos for consumers made from now on
        self.channel_prefetch = 0                 # basic.qos global=true
        self.consumers: dict[str, bytes] = {}     # consumer tag -> queue
        self.routed = 0
        self.unroutable = 0
        self.returned = 0
        self.out_frames: list[bytes] = []
        self.closing = False
        self.queues_told = False                  # channel_closed sent to every queue linked
        self.reply_to: bytes | None = None        # this channel's direct reply-to queue, once it consumes one

    # -- wiring ------------------------------------------------------------------
    def on_link_attached(self, link) -> None:
        if link.peer == self.reader_name:
            if link in self.in_links.values():
                self.from_reader = link
            else:
                self.to_reader = link

    def on_control(self, msg: dict, fds) -> None:
        kind = msg.get("type")
        name = msg.get("queue", "").encode("utf-8", "surrogateescape")
        if kind == "queue_linked":
            out, inp = self.out_links.get(msg["out"]), self.in_links.get(msg["in"])
            q = None
            if out is not None and inp is not None:
                q = QueueLinks(name, out, inp)
                self.queues[name] = q
                self.known_routes.clear()
                self.by_in_link[q.inp.link_id] = q
                self.missing.pop(name, None)
            self.answered(("link", name), q)
        elif kind == "no_queue":
            self.missing[name] = (msg.get("code", 404),
                                  msg.get("text") or f"NOT_FOUND - no queue '{shown(name)}' in vhost '/'")
            self.answered(("link", name), None)
        elif kind == "declare_refused":
            self.answered(("link", name), ChannelError(msg["code"], msg["text"], *QUEUE_DECLARE))
        elif kind == "routing":
            if "snapshot" in msg:
                self.routing = RoutingTable.from_snapshot(msg["snapshot"])
            else:
                self.routing.apply(msg["changes"])
            self.missing.clear()                  # a queue may exist now
            self.known_routes.clear()
        elif kind == "reply":
            self.answered(("broker",), msg)

    # -- one client record at a time -------------------------------------------------
    def wait(self, what: tuple, then=None) -> None:
        """Hold every later client record until ``what`` is answered; ``then`` is what to do with it."""
        self.waiting, self.then = what, then

    def answered(self, what: tuple, value) -> None:
        """``what`` came back with ``value`` (a QueueLinks, None, or a reply): finish what waited, go on."""
        if self.waiting != what:
            return
        then = self.then
        self.waiting = self.then = None
        try:
            if isinstance(value, ChannelError):
                raise value
            if what[0] == "link":
                self.replay(value, then)
            elif what[0] == "broker":
                then(value)
            else:
                self.on_queue_answer(value, then)
        except ChannelError as err:
            self.channel_error(err)
        self.resume()

    def resume(self) -> None:
        while self.held and self.waiting is None and self.running:
            self.client_record(self.held.popleft())
        self.backlog = True            # and read the reader's ring again straight away

    def wants_records(self, link) -> bool:
        return self.waiting is None or link is not self.from_reader

    def need_queue(self, name: bytes, op) -> QueueLinks | None:
        """The links to queue ``name``; without them, asks for them and waits, ``op`` to be replayed."""
        q = self.queues.get(name)
        if q is not None:
            return q
        control.send_msg(self.ctl, {"type": "link_queue", "queue": name.decode("utf-8", "surrogateescape")})
        self.wait(("link", name), op)
        return None

    def replay(self, q: QueueLinks | None, op) -> None:
        kind = op[0]
        if kind == "publish":
            self.route_publish(*op[1:])
        elif kind == "control":
            if q is None:
                code, text = self.missing.get(op[2].encode("utf-8", "surrogateescape"),
                                              (404, f"NOT_FOUND - no queue '{shown(op[2])}' in vhost '/'"))
                raise ChannelError(code, text, *op[3])
            self.send_to_queue(q, op[1], op[3])
        elif kind == "ack" and q is not None:
            q.out.put(op[1])
        elif kind == "commit":
            self.deliver_commit(op[1])
        elif kind == "delete":
            self.send_delete(q, op[1])
        elif kind == "permits":
            self.pass_permits(q, op[1])

    def pass_permits(self, q: QueueLinks | None, msg: dict) -> None:
        """basic.qos global=true: the reader's limiter lets queue ``q`` deliver ``count`` more."""
        if q is not None and not self.closing:
            q.out.put(wire.encode_control({"op": "permits", "count": msg["count"]}))

    def send_to_queue(self, q: QueueLinks, op: dict, ids) -> None:
        """An operation the queue answers (declare_ok, done, purge_ok or error) before the next client record."""
        q.out.put(wire.encode_control(op))
        self.wait(("queue", q.name), ids)

    # -- records ------------------------------------------------------------------
    def on_record(self, link, record) -> None:
        if link is self.from_reader:
            if self.waiting is not None or self.held:
                self.held.append(record)
            else:
                self.client_record(record)
            return
        kind = record[0]
        q = self.by_in_link.get(link.link_id)
        if q is None:
            return
        if kind == wire.Kind.CONFIRM:
            self.frames_out(self.confirms.confirmed(q.name, wire.decode_confirm(record)))
        elif kind == wire.Kind.CONTROL:
            msg = wire.decode_control(record)
            if msg.get("op") == "nack":        # x-overflow reject-publish: the queue refused these
                self.frames_out(self.confirms.rejected(q.name, msg["seqs"]))
            else:
                self.answered(("queue", q.name), msg)

    def client_record(self, record) -> None:
        kind = record[0]
        try:
            if kind == wire.Kind.PUBLISH:
                self.on_publish(record)
            elif kind == wire.Kind.METHOD:
                self.on_method(record)
            elif kind == wire.Kind.ACK:
                self.on_client_ack(record)
            elif kind == wire.Kind.CONTROL:
                msg = wire.decode_control(record)
                if msg.get("op") == "close":
                    self.close()
                elif msg.get("op") == "fail" and not self.closing:    # the reader refused an ack's tag or a message
                    raise ChannelError(msg["code"], msg["text"], msg["class_id"], msg["method_id"])
                elif msg.get("op") == "permits":
                    self.pass_permits(self.need_queue(msg["queue"].encode("utf-8", "surrogateescape"),
                                                      ("permits", msg)), msg)
        except ChannelError as err:
            self.channel_error(err)
        except (AmqpError, QueueError) as exc:
            self.channel_error(from_amqp(exc))

    def on_client_ack(self, record) -> None:
        if self.closing:
            return
        if self.confirms.transactional:
            self.confirms.buffer_ack(record)
            return
        _, queue, _ = wire.decode_ack(record)
        q = self.need_queue(queue, ("ack", record))
        if q is not None:
            q.out.put(record)

    # -- publishing ----------------------------------------------------------------
    def on_publish(self, record) -> None:
        if self.from_reader is not None:
            self.owe(self.from_reader.link_id)
        if self.closing:
            if record[1] & wire.PUB_BODY_REF:
                self.by_copy(record)            # lets go of the body
            return
        names, high_flags = wire.content_names(record)
        known = self.known_routes.get(names)
        if known is not None and not high_flags & (REPLY_TO_BIT_HIGH | EXPIRATION_BIT_HIGH):
            flags, seq = wire.publish_head(record)     # a route seen before: what route_publish would do
            if flags & wire.PUB_CONFIRM:
                self.frames_out(self.confirms.publish(seq, known[0]))
            self.send_publish(record, flags, known[1])
            return
        try:
            record, flags, seq, targets = self.route(record)
        except BaseException:
            if record[1] & wire.PUB_BODY_REF:   # refused before routing: nobody else holds it yet
                self.by_copy(record)
            raise
        self.route_publish(record, flags, seq, targets)
        self.remember_route(names, targets)

    def remember_route(self, names: bytes, targets) -> None:
        """Remember the route of a publish just routed, where the next with the same exchange and
        routing key would take it again without looking: not through a headers exchange (the route
        depends on each message), not in tx mode, only to queues that are all linked."""
        if self.delay_ns or not targets or self.confirms.transactional or self.closing:
            return
        queues = self.queues
        if not all(name in queues for name in targets):
            return
        if self.routing.needs_headers(names[1:1 + names[0]]):
            return
        if len(self.known_routes) >= KNOWN_ROUTES_MAX:
            self.known_routes.clear()
        self.known_routes[names] = (tuple(targets), [queues[name] for name in targets])

    def route(self, record) -> tuple:
        """Check one publish and find its queues: (record, flags, seq, target queue names)."""
        if self.delay_ns:
            busy_wait_ns(self.delay_ns)
        flags, seq = wire.publish_head(record)
        props_raw = wire.content_props(record)
        if len(props_raw) > 1 and props_raw[0] & (REPLY_TO_BIT_HIGH | EXPIRATION_BIT_HIGH):
            if props_raw[0] & EXPIRATION_BIT_HIGH:       # RabbitMQ's channel refuses a bad one at once
                try:
                    parse_expiration(props.read(props_raw, ("expiration",)).get("expiration"))
                except QueueError as exc:
                    raise from_amqp(exc, 60, 40) from None
            if props_raw[0] & REPLY_TO_BIT_HIGH:
                record = self.direct_reply_to(record, flags, seq)
        exchange, routing_key = wire.content_route(record)
        headers = None
        if self.routing.needs_headers(exchange):
            headers = props.headers_of(wire.content_views(record, wire.PUBLISH_CONTENT_OFFSET)[2])
        try:
            targets = self.routing.route(exchange, routing_key, headers).queues
        except AmqpError as exc:
            raise from_amqp(exc) from None
        if self.confirms.transactional:
            flags |= wire.PUB_CONFIRM              # the commit waits for the queues to have it
        return record, flags, seq, targets

    def direct_reply_to(self, record, flags: int, seq: int):
        """A request whose reply_to is amq.rabbitmq.reply-to: give it this channel's reply queue's name."""
        exchange, routing_key, props_raw, body = wire.decode_content(record, wire.PUBLISH_CONTENT_OFFSET)
        values = props.read(props_raw)
        if values.get("reply_to") != REPLY_TO.encode():
            return record
        if self.reply_to is None:
            raise ChannelError(406, "PRECONDITION_FAILED - fast reply consumer does not exist", 60, 40)
        values["reply_to"] = self.reply_to
        return wire.encode_publish(flags, seq, exchange, routing_key, props.encode(values), body)

    def route_publish(self, record, flags: int, seq: int, targets) -> None:
        """Send a routed publish on to its queues (linking to them first), or handle it as unroutable."""
        queues = self.queues
        for name in targets:
            if name not in queues and name not in self.missing:
                self.need_queue(name, ("publish", record, flags, seq, targets))    # comes back here once linked
                return
        linked = [queues[name] for name in targets if name in queues]
        if flags & wire.PUB_BODY_REF and (not linked or self.confirms.transactional):
            record = self.by_copy(record)       # returned, dropped, or kept until a commit: no longer shared
            flags &= ~wire.PUB_BODY_REF
        if not linked:
            self.unroutable_publish(flags, record)
        if self.confirms.transactional:
            self.confirms.buffer_publish(seq, [q.name for q in linked], (record, flags))
            return
        if flags & wire.PUB_CONFIRM:
            self.frames_out(self.confirms.publish(seq, [q.name for q in linked]))
        if linked:
            self.send_publish(record, flags, linked)

    def send_publish(self, record, flags: int, linked) -> None:
        if flags & wire.PUB_BODY_REF:
            # hand the body to the queues' words in its slot (and let go of the channel's), or copy it
            # out when a queue has no holder id or there are more queues than a slot has words
            arena, at = bodies.arena_of(record)
            holders = [q.out.peer_holder for q in linked]
            if not all(holders) or not arena.route(at, holders):
                record = self.by_copy(record)
                flags &= ~wire.PUB_BODY_REF
        if flags != record[1]:
            record = bytearray(record)
            record[1] = flags
        now = self.batch_ns or time.monotonic_ns()
        for q in linked:
            q.out.put_message(record)
            self.credit.send(q.out.link_id, now)
        self.routed += 1

    def by_copy(self, record) -> bytes:
        """A publish by reference as one that carries its body; the channel lets go of the slot."""
        record, arena, at, _ = bodies.copy_out(record, wire.PUB_BODY_REF)
        arena.release_channel(at)
        return record

    def unroutable_publish(self, flags: int, record) -> None:
        self.unroutable += 1
        if flags & wire.PUB_MANDATORY:
            exchange, rk, properties, body = wire.decode_content(record, wire.PUBLISH_CONTENT_OFFSET)
            self.out_frames.append(frames.encode_basic_return(self.number, 312, "NO_ROUTE", exchange, rk, properties,
                                                              body, self.frame_max))
            self.returned += 1

    def frames_out(self, settled) -> None:
        """The confirms core's (kind, tag, multiple) frames, encoded for the client."""
        out = self.out_frames
        for kind, tag, multiple in settled:
            if kind == ACK:
                out.append(frames.encode_basic_ack(self.number, tag, multiple))
            elif kind == NACK:
                out.append(frames.encode_method(self.number, commands.Basic.Nack(delivery_tag=tag, multiple=multiple,
                                                                                  requeue=False)))
            elif kind == COMMIT_OK:
                out.append(frames.encode_method(self.number, commands.Tx.CommitOk()))

    # -- transactions ----------------------------------------------------------------
    def commit(self) -> None:
        self.deliver_commit(self.confirms.commit())

    def deliver_commit(self, commit) -> None:
        """Send a commit's publishes and acks on to their queues, linking to every one first; a queue
        that is gone by now counts as having taken its share (RabbitMQ's handling of a deleted queue)."""
        needed = {name for _, names, _ in commit.publishes for name in names}
        needed |= {wire.decode_ack(item)[1] for item in commit.acks}
        unlinked = needed - self.queues.keys() - self.missing.keys()
        if unlinked:
            self.need_queue(min(unlinked), ("commit", commit))
            return
        for name in needed - self.queues.keys():
            self.frames_out(self.confirms.queue_down(name, crashed=False))
        for _seq, names, (record, flags) in commit.publishes:
            linked = [self.queues[n] for n in names if n in self.queues]
            if linked:
                self.send_publish(record, flags, linked)
        for item in commit.acks:
            q = self.queues.get(wire.decode_ack(item)[1])
            if q is not None:
                q.out.put(item)
        self.frames_out(commit.frames)

    # -- methods ----------------------------------------------------------------------
    def on_method(self, record) -> None:
        if self.closing:
            return                 # after a channel error only the client's close-ok matters
        payload = bytes(record[1:])
        method = frames.decode_method(payload, 0, len(payload))
        key = _ids(method)
        try:
            self.confirms.check_method(*key)
            self.dispatch(method)
        except (AmqpError, QueueError) as exc:
            raise from_amqp(exc, *key) from None

    def dispatch(self, m) -> None:
        name = m.name
        handler = getattr(self, "m_" + name.replace(".", "_"), None)
        if handler is None:
            raise ChannelError(540, f"NOT_IMPLEMENTED - {name}", *_ids(m))
        handler(m)

    # queue class
    def m_Queue_Declare(self, m) -> None:
        if m.queue == REPLY_TO and m.passive:       # the pseudo-queue exists for every channel
            self.out_frames.append(frames.encode_reply(self.number, commands.Queue.DeclareOk, queue=REPLY_TO,
                                                       message_count=0, consumer_count=0))
            return
        # a server-named queue, as RabbitMQ names them (amq.gen- and a 128-bit guid, base64url)
        queue = m.queue or "amq.gen-" + base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        op = {"op": "declare", "channel": self.number, "queue": queue, "nowait": m.nowait, "passive": m.passive}
        control.send_msg(self.ctl, {"type": "declare_queue", "queue": queue, "passive": m.passive,
                                    "durable": m.durable, "auto_delete": m.auto_delete, "exclusive": m.exclusive,
                                    "arguments": arguments_to_json(m.arguments), "generated": not m.queue})
        self.wait(("link", queue.encode()), ("control", op, queue, QUEUE_DECLARE))

    def m_Queue_Bind(self, m) -> None:
        self.ask({"op": "bind", "queue": m.queue, "exchange": m.exchange, "routing_key": m.routing_key,
                  "arguments": arguments_to_json(m.arguments)}, None if m.nowait else commands.Queue.BindOk(),
                 QUEUE_BIND)

    def m_Queue_Unbind(self, m) -> None:
        self.ask({"op": "unbind", "queue": m.queue, "exchange": m.exchange, "routing_key": m.routing_key,
                  "arguments": arguments_to_json(m.arguments)}, commands.Queue.UnbindOk(), QUEUE_UNBIND)

    def m_Queue_Purge(self, m) -> None:
        self.to_queue(m.queue, {"op": "purge", "channel": self.number, "nowait": m.nowait,
                                "reader": self.reader_name}, QUEUE_PURGE)

    def m_Queue_Delete(self, m) -> None:
        q = self.need_queue(m.queue.encode(), ("delete", m))
        if q is not None:
            self.send_delete(q, m)

    def send_delete(self, q: QueueLinks | None, m) -> None:
        """queue.delete goes over the queue's ring, so the queue checks if-empty after this channel's
        earlier publishes; the queue tells the supervisor, which answers once the queue is gone."""
        def deleted(msg) -> None:
            if not msg.get("ok"):
                raise ChannelError(msg["code"], msg["text"], *QUEUE_DELETE)
            if not m.nowait:
                self.reply(commands.Queue.DeleteOk(message_count=msg.get("message_count", 0)))
        if q is None:                          # no such queue: RabbitMQ 3.10 answers delete-ok all the same
            deleted({"ok": True, "message_count": 0})
            return
        q.out.put(wire.encode_control({"op": "delete", "if_unused": m.if_unused, "if_empty": m.if_empty,
                                       "reader": self.reader_name}))
        self.wait(("broker",), deleted)

    # exchange class
    def m_Exchange_Declare(self, m) -> None:
        self.ask({"op": "declare", "exchange": m.exchange, "kind": m.exchange_type, "durable": m.durable,
                  "auto_delete": m.auto_delete, "internal": m.internal, "passive": m.passive,
                  "arguments": arguments_to_json(m.arguments)},
                 None if m.nowait else commands.Exchange.DeclareOk(), EXCHANGE_DECLARE)

    def m_Exchange_Delete(self, m) -> None:
        self.ask({"op": "delete", "exchange": m.exchange, "if_unused": m.if_unused},
                 None if m.nowait else commands.Exchange.DeleteOk(), EXCHANGE_DELETE)

    def m_Exchange_Bind(self, m) -> None:
        self.ask({"op": "bind_exchange", "source": m.source, "destination": m.destination,
                  "routing_key": m.routing_key, "arguments": arguments_to_json(m.arguments)},
                 None if m.nowait else commands.Exchange.BindOk(), EXCHANGE_BIND)

    def m_Exchange_Unbind(self, m) -> None:
        self.ask({"op": "unbind_exchange", "source": m.source, "destination": m.destination,
                  "routing_key": m.routing_key, "arguments": arguments_to_json(m.arguments)},
                 None if m.nowait else commands.Exchange.UnbindOk(), EXCHANGE_UNBIND)

    # basic class
    def m_Basic_Qos(self, m) -> None:
        if m.global_:
            self.channel_prefetch = m.prefetch_count
            for q in self.queues.values():
                q.out.put(wire.encode_control({"op": "qos_global", "channel": self.number,
                                               "reader": self.reader_name, "count": m.prefetch_count}))
        else:
            self.prefetch = m.prefetch_count
        self.reply(commands.Basic.QosOk())

    def m_Basic_Consume(self, m) -> None:
        tag = m.consumer_tag or f"amq.ctag-{os.urandom(11).hex()}"
        if tag in self.consumers:
            raise ChannelError(530, f"NOT_ALLOWED - attempt to reuse consumer tag '{tag}'", *BASIC_CONSUME)
        priority = consumer_priority(m.queue, m.arguments)
        op = {"op": "consume", "channel": self.number, "ctag": tag, "no_ack": m.no_ack,
              "prefetch": self.prefetch, "channel_prefetch": self.channel_prefetch, "nowait": m.nowait,
              "reader": self.reader_name, "exclusive": m.exclusive, "priority": priority}
        if m.queue == REPLY_TO:
            self.consume_reply_to(tag, op, m)
            return
        self.consumers[tag] = m.queue.encode()
        self.to_queue(m.queue, op, BASIC_CONSUME)

    def consume_reply_to(self, tag: str, op: dict, m) -> None:
        """Direct reply-to: the pseudo-queue amq.rabbitmq.reply-to is a queue of this channel's own
        (exclusive, auto-delete, named amq.rabbitmq.reply-to.<token>), consumed without acks; a publish
        on this channel whose reply_to is amq.rabbitmq.reply-to gets that name instead."""
        if not m.no_ack:
            raise ChannelError(406, "PRECONDITION_FAILED - reply consumer cannot acknowledge", *BASIC_CONSUME)
        if self.reply_to is not None:
            raise ChannelError(406, "PRECONDITION_FAILED - reply consumer already set", *BASIC_CONSUME)
        name = f"{REPLY_TO}.{base64.urlsafe_b64encode(os.urandom(12)).decode()}"
        self.reply_to = name.encode()
        self.consumers[tag] = self.reply_to
        control.send_msg(self.ctl, {"type": "declare_queue", "queue": name, "exclusive": True, "auto_delete": True,
                                    "durable": False, "reply_to": True})
        self.wait(("link", self.reply_to), ("control", op, name, BASIC_CONSUME))

    def m_Basic_Cancel(self, m) -> None:
        queue = self.consumers.pop(m.consumer_tag, None)
        if queue is None:
            if not m.nowait:
                self.out_frames.append(frames.encode_reply(self.number, commands.Basic.CancelOk,
                                                           consumer_tag=m.consumer_tag))
            return
        self.to_queue(queue.decode(), {"op": "cancel", "channel": self.number, "ctag": m.consumer_tag,
                                       "nowait": m.nowait, "reader": self.reader_name}, BASIC_CANCEL)

    def m_Basic_Get(self, m) -> None:
        self.to_queue(m.queue, {"op": "get", "channel": self.number, "no_ack": m.no_ack,
                                "reader": self.reader_name}, BASIC_GET)

    def m_Basic_Recover(self, m) -> None:
        if not m.requeue:
            raise ChannelError(540, "NOT_IMPLEMENTED - requeue=false", 60, 110)
        self.recover()
        self.reply(commands.Basic.RecoverOk())

    def m_Basic_RecoverAsync(self, m) -> None:
        self.recover()

    def recover(self) -> None:
        for q in self.queues.values():
            q.out.put(wire.encode_control({"op": "recover", "channel": self.number, "reader": self.reader_name}))

    # confirms and transactions
    def m_Confirm_Select(self, m) -> None:
        self.confirms.select_confirm()
        if not m.nowait:
            self.reply(commands.Confirm.SelectOk())

    def m_Tx_Select(self, m) -> None:
        self.confirms.select_tx()
        self.known_routes.clear()
        self.reply(commands.Tx.SelectOk())

    def m_Tx_Commit(self, m) -> None:
        self.commit()

    def m_Tx_Rollback(self, m) -> None:
        self.confirms.rollback()
        self.reply(commands.Tx.RollbackOk())

    def m_Access_Request(self, m) -> None:
        self.reply(commands.Access.RequestOk(ticket=1))     # deprecated, but RabbitMQ still answers it

    # channel class
    def m_Channel_Flow(self, m) -> None:
        if not m.active:
            raise ChannelError(540, "NOT_IMPLEMENTED - active=false", 20, 20)
        self.reply(commands.Channel.FlowOk(active=True))

    # -- asking ------------------------------------------------------------------------
    def ask(self, request: dict, answer, ids) -> None:
        """A request the supervisor decides (exchanges, bindings); the client's answer waits for it."""
        control.send_msg(self.ctl, {"type": "exchange", **request})

        def answered(msg) -> None:
            if not msg.get("ok"):
                raise ChannelError(msg["code"], msg["text"], *ids)
            if answer is not None:
                self.reply(answer)
        self.wait(("broker",), answered)

    def to_queue(self, queue: str, op: dict, ids) -> None:
        q = self.need_queue(queue.encode(), ("control", op, queue, ids))
        if q is not None:
            self.send_to_queue(q, op, ids)

    def on_queue_answer(self, msg: dict, ids) -> None:
        """The queue's answer to the operation this channel waited on."""
        op = msg.get("op")
        if op == "declare_ok":
            if not msg.get("nowait"):
                self.out_frames.append(frames.encode_reply(
                    self.number, commands.Queue.DeclareOk, queue=msg["queue"], message_count=msg["message_count"],
                    consumer_count=msg["consumer_count"]))
        elif op == "purge_ok":
            if not msg.get("nowait"):
                self.reply(commands.Queue.PurgeOk(message_count=msg["message_count"]))
        elif op == "error":
            raise ChannelError(msg["code"], msg["text"], msg.get("class_id") or ids[0], msg.get("method_id") or ids[1])

    def reply(self, method) -> None:
        self.out_frames.append(frames.encode_method(self.number, method))

    def channel_error(self, err: ChannelError) -> None:
        """Close the channel with ``err``; a hard error (AMQP's connection-level codes, as RabbitMQ
        treats ``not_allowed`` or ``command_invalid``) closes the whole connection. As RabbitMQ's
        channel, it tells its queues first: what it held is back in them before the client hears of
        the close, so a channel the client opens next finds it there."""
        self.tell_queues_closed()
        self.flush_frames()
        if self.to_reader is not None:
            op = "connection_error" if err.code in HARD_ERROR_CODES else "channel_error"
            self.to_reader.put(wire.encode_control({"op": op, "channel": self.number,
                                                    "code": err.code, "text": err.text,
                                                    "class_id": err.class_id, "method_id": err.method_id}))
        self.closing = True

    def close(self) -> None:
        """The client (or our error) closed the channel: tell the queues, answer the reader, stop."""
        self.tell_queues_closed()
        self.flush_frames()
        if self.to_reader is not None:
            self.to_reader.put(wire.encode_control({"op": "closed", "channel": self.number}))
        self.running = False

    def tell_queues_closed(self) -> None:
        """Once: the channel's consumers go and its unacked messages go back (RabbitMQ's notify_queues)."""
        if self.queues_told:
            return
        self.queues_told = True
        for q in self.queues.values():
            q.out.put(wire.encode_control({"op": "channel_closed", "channel": self.number,
                                           "reader": self.reader_name}))

    def flush_frames(self) -> None:
        if self.out_frames and self.to_reader is not None:
            self.to_reader.put(wire.encode_frames(b"".join(self.out_frames)))
            self.out_frames.clear()

    def after_io(self, now_ns: int) -> None:
        self.flush_frames()

    def on_peer_down(self, link_id: int, reason: str) -> None:
        if self.to_reader is not None and self.to_reader.link_id == link_id:
            self.to_reader = None          # the reader is gone: nothing more can be said to the client
            self.out_frames.clear()
            return
        if self.from_reader is not None and self.from_reader.link_id == link_id:
            self.from_reader = None
            return
        q = self.by_in_link.pop(link_id, None)
        if q is None:
            q = next((q for q in self.queues.values() if q.out.link_id == link_id), None)
        if q is None or self.queues.get(q.name) is not q:
            return
        del self.queues[q.name]
        self.known_routes.clear()
        self.by_in_link.pop(q.inp.link_id, None)
        self.queue_gone(q, crashed=reason == "crashed")
        if self.waiting == ("queue", q.name):     # it will never answer what we asked
            ids = self.then or (0, 0)
            # RabbitMQ retries a call whose queue process exited: a queue that ended as it should (deleted)
            # is then not found, as when the queue itself answers what reached it after its deletion
            text = (f"NOT_FOUND - queue '{shown(q.name)}' in vhost '/' process is stopped by supervisor"
                    if reason == "crashed" else f"NOT_FOUND - no queue '{shown(q.name)}' in vhost '/'")
            self.answered(self.waiting, {"op": "error", "code": 404, "class_id": ids[0], "method_id": ids[1],
                                         "text": text})

    def queue_gone(self, q: QueueLinks, crashed: bool) -> None:
        """A queue process this channel used has ended (RabbitMQ's handle_publishing_queue_down and
        handle_consuming_queue_down). If it crashed, every publish it had not confirmed is nacked,
        whatever other queues it also went to; if it ended as it should (deleted), it counts as
        confirmed there. Its consumers are cancelled: basic.cancel to a client that announced
        consumer_cancel_notify; a client that did not would wait forever after a crash, so its
        channel is closed then (404)."""
        self.frames_out(self.confirms.queue_down(q.name, crashed))
        tags = [tag for tag, name in self.consumers.items() if name == q.name]
        for tag in tags:
            del self.consumers[tag]
        if not tags:
            return
        if self.cancel_notify:
            for tag in tags:
                self.out_frames.append(frames.encode_reply(self.number, commands.Basic.Cancel, consumer_tag=tag,
                                                           nowait=True))
        elif crashed:
            # a soft code: only this channel closes (AMQP's 541 would close the connection)
            self.channel_error(ChannelError(404, f"NOT_FOUND - queue '{shown(q.name)}' in vhost '/' crashed; "
                                                 f"consumer{'s' if len(tags) > 1 else ''} "
                                                 f"{', '.join(tags)} cancelled"))

    def statistics(self, now_ns: int) -> ChannelStats:
        cs = self.confirms.statistics()
        return ChannelStats(**self.stage_fields(now_ns), number=self.number, routed=self.routed,
                            unroutable=self.unroutable, returned=self.returned, unconfirmed=cs.unconfirmed,
                            confirms_sent=cs.ack_frames, nacks_sent=cs.nack_frames, confirm_mode=cs.mode,
                            confirmed=cs.acked, prefetch_count=self.prefetch,
                            global_prefetch_count=self.channel_prefetch, consumer_count=len(self.consumers))


def shown(name) -> str:
    """A name as text for a reply: bytes that are not UTF-8 are shown as U+FFFD, never raised on."""
    if isinstance(name, str):
        name = name.encode("utf-8", "surrogateescape")
    return bytes(name).decode("utf-8", "replace")


def _ids(method) -> tuple[int, int]:
    idx = getattr(method, "index", None) or getattr(type(method), "index", None)
    if isinstance(idx, int):
        return idx >> 16, idx & 0xFFFF
    return 0, 0
