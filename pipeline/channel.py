"""The channel: one process per AMQP channel.

It takes its reader's records off a ring, acks each publish's credit as soon
as it dequeues it (before routing, as RabbitMQ's channel does), routes it and
sends it to every target queue, spending one credit per queue. While a queue
holds it blocked it still routes (its credit goes negative) but defers the
reader's grants, which is how back-pressure climbs to the socket.

It also runs the channel's other methods (queue.declare, basic.qos/consume/
cancel/get, confirm.select), turns queues' confirms into ``basic.ack`` frames
for the publisher, and passes consumers' acks on to the queues.

One client record at a time, as RabbitMQ's channel handles its frames: a
method answered by the broker or a queue (declare, bind, consume, get...),
or a record that needs a link to a queue first, is finished before the next
record is looked at. Those answers arrive asynchronously here, so while one
is awaited (``waiting``) the records after it wait in ``held``, unhandled
and their credit not yet acked, and the reader's ring is left unread; the
answer resumes them in order. Pipelined methods are therefore answered in
the order they were sent.
"""

from __future__ import annotations

import collections
import os
import time

from pamqp import commands

from ipc import control
from pipeline import wire
from pipeline.amqp import frames
from pipeline.stage import Stage, read_batch_for

CHANNEL_FLOW = (20, 20)
# AMQP 0-9-1's hard errors: the connection is closed, not just the channel
HARD_ERROR_CODES = frozenset((320, 402, 501, 502, 503, 504, 505, 506, 530, 540, 541))


class ChannelError(Exception):
    """Raised when a method breaks a channel-level rule; the channel is closed with ``code``."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0):
        super().__init__(text)
        self.code, self.text, self.class_id, self.method_id = code, text, class_id, method_id


class QueueLinks:
    """The two links to one queue process, and the publishes it has not yet confirmed to this channel."""

    __slots__ = ("name", "out", "inp", "unconfirmed")

    def __init__(self, name: bytes, out, inp):
        self.name, self.out, self.inp = name, out, inp
        self.unconfirmed: set[int] = set()


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
        self.queues: dict[bytes, QueueLinks] = {}
        self.by_in_link: dict[int, QueueLinks] = {}
        self.missing: dict[bytes, tuple[int, str]] = {}   # known not to exist (until a queue_created): why
        self.waiting: tuple | None = None         # ("link"|"queue", name) or ("broker",): the answer awaited
        self.then = None                          # what to do with it (an op for ``replay``, or an answer)
        self.held: collections.deque = collections.deque()   # client records after the one that waits
        self.confirm = False
        self.pending: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.last_multiple_ack = 0
        self.nacked: set[int] = set()             # nacked above last_multiple_ack: no multiple ack may span them
        self.max_seq = 0
        self.prefetch = 0
        self.consumers: dict[str, bytes] = {}     # consumer tag -> queue
        self.routed = 0
        self.unroutable = 0
        self.confirms_sent = 0
        self.nacks_sent = 0
        self.out_frames: list[bytes] = []
        self.closing = False
        self.exchanges: dict[bytes, tuple[str, list]] = {}   # name -> (type, [(queue, key)]), from the supervisor
        self.routes: dict[tuple[bytes, bytes], list[bytes]] = {}

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
                self.by_in_link[q.inp.link_id] = q
                self.missing.pop(name, None)
            self.answered(("link", name), q)
        elif kind == "no_queue":
            self.missing[name] = (msg.get("code", 404),
                                  msg.get("text") or f"NOT_FOUND - no queue '{shown(name)}' in vhost '/'")
            self.answered(("link", name), None)
        elif kind == "queue_created":
            self.missing.pop(name, None)
        elif kind == "exchanges":
            for ex, info in msg["table"].items():
                self.exchanges[ex.encode()] = (info["type"], [(q.encode(), k.encode()) for q, k in info["bindings"]])
            self.routes.clear()
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
        if what[0] == "link":
            self.replay(value, then)
        elif what[0] == "broker":
            self.on_broker_reply(value, then)
        else:
            self.on_queue_answer(value, then)
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
        try:
            if kind == "publish":
                flags, seq = wire.publish_head(op[1])
                self.route_publish(op[1], flags, seq, time.monotonic_ns())
            elif kind == "control":
                if q is None:
                    code, text = self.missing.get(op[2].encode("utf-8", "surrogateescape"),
                                                  (404, f"NOT_FOUND - no queue '{shown(op[2])}' in vhost '/'"))
                    raise ChannelError(code, text, *op[3])
                self.send_to_queue(q, op[1], op[3])
            elif kind == "ack" and q is not None:
                q.out.put(op[1])
        except ChannelError as err:
            self.channel_error(err)

    def send_to_queue(self, q: QueueLinks, op: dict, ids) -> None:
        """An operation the queue answers (declare_ok, done or error) before the next client record."""
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
        if kind == wire.Kind.CONFIRM:
            self.on_confirms(wire.decode_confirm(record), q)
        elif kind == wire.Kind.CONTROL and q is not None:
            self.answered(("queue", q.name), wire.decode_control(record))

    def client_record(self, record) -> None:
        kind = record[0]
        if kind == wire.Kind.PUBLISH:
            self.on_publish(record)
        elif kind == wire.Kind.METHOD:
            self.on_method(record)
        elif kind == wire.Kind.ACK:
            _, queue, _ = wire.decode_ack(record)
            q = self.need_queue(queue, ("ack", record))
            if q is not None:
                q.out.put(record)
        elif kind == wire.Kind.CONTROL and wire.decode_control(record).get("op") == "close":
            self.close()

    def on_publish(self, record) -> None:
        if self.from_reader is not None:
            self.send_grants(self.credit.ack(self.from_reader.link_id))
        if self.closing:
            return
        if self.delay_ns:
            busy_wait_ns(self.delay_ns)
        flags, seq = wire.publish_head(record)
        if flags & wire.PUB_CONFIRM:
            self.max_seq = seq
            self.pending[seq] = 0          # holds its place in confirm order until routed
        try:
            self.route_publish(record, flags, seq, time.monotonic_ns())
        except ChannelError as err:
            self.pending.pop(seq, None)
            self.channel_error(err)

    def route(self, exchange: bytes, routing_key: bytes) -> list[bytes]:
        """Target queues of a publish (RabbitMQ's default, direct, fanout and topic exchanges)."""
        if not exchange:
            return [routing_key]
        key = (exchange, routing_key)
        targets = self.routes.get(key)
        if targets is None:
            info = self.exchanges.get(exchange)
            if info is None:
                raise ChannelError(404, f"NOT_FOUND - no exchange '{shown(exchange)}' in vhost '/'", 60, 40)
            kind, bindings = info
            if kind == "fanout":
                targets = list(dict.fromkeys(q for q, _ in bindings))
            elif kind == "topic":
                targets = list(dict.fromkeys(q for q, k in bindings if topic_matches(k, routing_key)))
            else:
                targets = list(dict.fromkeys(q for q, k in bindings if k == routing_key))
            self.routes[key] = targets
        return targets

    def route_publish(self, record, flags: int, seq: int, now: int) -> None:
        exchange, routing_key = wire.content_route(record)
        targets = self.route(exchange, routing_key)
        queues = self.queues
        for name in targets:
            if name not in queues and name not in self.missing:
                self.need_queue(name, ("publish", record))      # comes back here once linked
                return
        linked = [queues[name] for name in targets if name in queues]
        if not linked:
            self.unroutable_publish(flags, seq, record)
            return
        if flags & wire.PUB_CONFIRM:
            self.pending[seq] = len(linked)
            for q in linked:
                q.unconfirmed.add(seq)
        for q in linked:
            q.out.put_message(record)
            self.credit.send(q.out.link_id, now)
        self.routed += 1

    def unroutable_publish(self, flags: int, seq: int, record) -> None:
        self.unroutable += 1
        if flags & wire.PUB_MANDATORY:
            exchange, rk, props, body = wire.decode_content(record, wire.PUBLISH_CONTENT_OFFSET)
            self.out_frames.append(frames.encode_basic_return(self.number, 312, "NO_ROUTE", exchange, rk, props, body,
                                                              self.frame_max))
        if flags & wire.PUB_CONFIRM:
            self.pending.pop(seq, None)
            self.confirm_done([seq])

    def on_confirms(self, seqs, q: QueueLinks | None) -> None:
        done = []
        pending = self.pending
        if q is not None:
            q.unconfirmed.difference_update(seqs)
        for seq in seqs:
            left = pending.get(seq)
            if left is None:
                continue
            if left <= 1:
                del pending[seq]
                done.append(seq)
            else:
                pending[seq] = left - 1
        if done:
            self.confirm_done(done)

    def confirm_done(self, seqs) -> None:
        """Ack confirmed publishes: one multiple ack below the lowest still pending, single acks above it.
        A multiple ack never spans a nacked publish: over such a range each one is acked alone."""
        lowest = next(iter(self.pending), None)
        upto = (lowest - 1) if lowest is not None else self.max_seq
        out = self.out_frames
        singles = seqs
        if upto > self.last_multiple_ack:
            nacked = self.nacked
            if nacked and any(self.last_multiple_ack < n <= upto for n in nacked):
                self.nacked = {n for n in nacked if n > upto}
            else:
                out.append(frames.encode_basic_ack(self.number, upto, True))
                self.confirms_sent += 1
                singles = [seq for seq in seqs if seq > upto]
            self.last_multiple_ack = upto
        for seq in singles:
            out.append(frames.encode_basic_ack(self.number, seq, False))
            self.confirms_sent += 1

    # -- methods ----------------------------------------------------------------------
    def on_method(self, record) -> None:
        if self.closing:
            return                 # after a channel error only the client's close-ok matters
        payload = bytes(record[1:])
        try:
            method = frames.decode_method(payload, 0, len(payload))
            self.dispatch(method)
        except ChannelError as err:
            self.channel_error(err)

    def dispatch(self, m) -> None:
        name = m.name
        if name == "Queue.Declare":
            queue = m.queue or f"amq.gen-{os.urandom(11).hex()}"
            op = {"op": "declare", "channel": self.number, "queue": queue, "durable": m.durable,
                  "exclusive": m.exclusive, "auto_delete": m.auto_delete, "passive": m.passive,
                  "nowait": m.nowait, "reader": self.reader_name}
            control.send_msg(self.ctl, {"type": "declare_queue", "queue": queue, "passive": m.passive,
                                        "durable": m.durable, "auto_delete": m.auto_delete,
                                        "exclusive": m.exclusive})
            self.wait(("link", queue.encode()), ("control", op, queue, (50, 10)))
        elif name == "Basic.Qos":
            self.prefetch = m.prefetch_count
            self.reply(commands.Basic.QosOk())
        elif name == "Confirm.Select":
            self.confirm = True
            if not m.nowait:
                self.reply(commands.Confirm.SelectOk())
        elif name == "Basic.Consume":
            tag = m.consumer_tag or f"amq.ctag-{os.urandom(11).hex()}"
            if tag in self.consumers:
                raise ChannelError(530, f"NOT_ALLOWED - attempt to reuse consumer tag '{tag}'", 60, 20)
            self.consumers[tag] = m.queue.encode()
            op = {"op": "consume", "channel": self.number, "ctag": tag, "no_ack": m.no_ack,
                  "prefetch": self.prefetch, "nowait": m.nowait, "reader": self.reader_name,
                  "exclusive": m.exclusive}
            self.to_queue(m.queue, op, (60, 20))
        elif name == "Basic.Cancel":
            queue = self.consumers.pop(m.consumer_tag, None)
            if queue is None:
                if not m.nowait:
                    self.reply(commands.Basic.CancelOk(consumer_tag=m.consumer_tag))
                return
            self.to_queue(queue.decode(), {"op": "cancel", "channel": self.number, "ctag": m.consumer_tag,
                                           "nowait": m.nowait, "reader": self.reader_name}, (60, 30))
        elif name == "Basic.Get":
            self.to_queue(m.queue, {"op": "get", "channel": self.number, "no_ack": m.no_ack,
                                    "reader": self.reader_name}, (60, 70))
        elif name == "Basic.Recover":
            for q in self.queues.values():
                q.out.put(wire.encode_control({"op": "recover", "channel": self.number,
                                               "reader": self.reader_name}))
            self.reply(commands.Basic.RecoverOk())
        elif name == "Channel.Flow":
            if not m.active:
                raise ChannelError(540, "NOT_IMPLEMENTED - active=false", *CHANNEL_FLOW)
            self.reply(commands.Channel.FlowOk(active=True))
        elif name == "Exchange.Declare":
            self.ask({"type": "declare_exchange", "exchange": m.exchange, "kind": m.exchange_type,
                      "durable": m.durable, "passive": m.passive},
                     None if m.nowait else commands.Exchange.DeclareOk(), (40, 10))
        elif name == "Queue.Bind":
            self.ask({"type": "bind", "queue": m.queue, "exchange": m.exchange, "routing_key": m.routing_key},
                     None if m.nowait else commands.Queue.BindOk(), (50, 20))
        elif name == "Queue.Unbind":
            self.ask({"type": "unbind", "queue": m.queue, "exchange": m.exchange, "routing_key": m.routing_key},
                     commands.Queue.UnbindOk(), (50, 50))
        else:
            raise ChannelError(540, f"NOT_IMPLEMENTED - {name}", *_ids(m))

    def ask(self, request: dict, answer, ids) -> None:
        """A request the supervisor decides (exchanges, bindings); the client's answer waits for it."""
        control.send_msg(self.ctl, request)
        self.wait(("broker",), (answer, ids))

    def on_broker_reply(self, msg: dict, then) -> None:
        answer, ids = then
        if not msg.get("ok"):
            self.channel_error(ChannelError(msg["code"], msg["text"], *ids))
        elif answer is not None:
            self.reply(answer)

    def to_queue(self, queue: str, op: dict, ids) -> None:
        q = self.need_queue(queue.encode(), ("control", op, queue, ids))
        if q is not None:
            self.send_to_queue(q, op, ids)

    def on_queue_answer(self, msg: dict, ids) -> None:
        """The queue's answer to the operation this channel waited on: declare_ok, done, or error."""
        op = msg.get("op")
        if op == "declare_ok":
            if not msg.get("nowait"):
                self.out_frames.append(frames.encode_reply(
                    self.number, commands.Queue.DeclareOk, queue=msg["queue"], message_count=msg["message_count"],
                    consumer_count=msg["consumer_count"]))
        elif op == "error":
            self.channel_error(ChannelError(msg["code"], msg["text"], msg.get("class_id", 0),
                                            msg.get("method_id", 0)))

    def reply(self, method) -> None:
        self.out_frames.append(frames.encode_method(self.number, method))

    def channel_error(self, err: ChannelError) -> None:
        """Close the channel with ``err``; a hard error (AMQP's connection-level codes, as RabbitMQ
        treats ``not_allowed`` or ``command_invalid``) closes the whole connection."""
        self.flush_frames()
        if self.to_reader is not None:
            op = "connection_error" if err.code in HARD_ERROR_CODES else "channel_error"
            self.to_reader.put(wire.encode_control({"op": op, "channel": self.number,
                                                    "code": err.code, "text": err.text,
                                                    "class_id": err.class_id, "method_id": err.method_id}))
        self.closing = True

    def close(self) -> None:
        """The client (or our error) closed the channel: tell the queues, answer the reader, stop."""
        for q in self.queues.values():
            q.out.put(wire.encode_control({"op": "channel_closed", "channel": self.number,
                                           "reader": self.reader_name}))
        self.flush_frames()
        if self.to_reader is not None:
            self.to_reader.put(wire.encode_control({"op": "closed", "channel": self.number}))
        self.running = False

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
        self.by_in_link.pop(q.inp.link_id, None)
        self.queue_gone(q, crashed=reason == "crashed")
        if self.waiting == ("queue", q.name):     # it will never answer what we asked
            self.answered(self.waiting, {"op": "error", "code": 404, "class_id": self.then[0], "method_id": self.then[1],
                                         "text": f"NOT_FOUND - queue '{shown(q.name)}' in vhost '/' process is "
                                                 "stopped by supervisor"})

    def queue_gone(self, q: QueueLinks, crashed: bool) -> None:
        """A queue process this channel used has ended (RabbitMQ's handle_publishing_queue_down and
        handle_consuming_queue_down). If it crashed, every publish it had not confirmed is nacked,
        whatever other queues it also went to; if it ended as it should, it counts as confirmed there.
        Its consumers are cancelled: basic.cancel to a client that announced consumer_cancel_notify;
        a client that did not would wait forever, so after a crash its channel is closed (404)."""
        if q.unconfirmed:
            if crashed:
                self.nack(sorted(q.unconfirmed))
            else:
                self.on_confirms(sorted(q.unconfirmed), None)
            q.unconfirmed.clear()
        tags = [tag for tag, name in self.consumers.items() if name == q.name]
        for tag in tags:
            del self.consumers[tag]
        if not tags:
            return
        if self.cancel_notify:
            for tag in tags:
                self.reply(commands.Basic.Cancel(consumer_tag=tag, nowait=True))
        elif crashed:
            # a soft code: only this channel closes (AMQP's 541 would close the connection)
            self.channel_error(ChannelError(404, f"NOT_FOUND - queue '{shown(q.name)}' in vhost '/' crashed; "
                                                 f"consumer{'s' if len(tags) > 1 else ''} "
                                                 f"{', '.join(tags)} cancelled"))

    def nack(self, seqs) -> None:
        """basic.nack each publish in ``seqs``: it will never be confirmed now."""
        for seq in seqs:
            if self.pending.pop(seq, None) is not None:
                self.nacked.add(seq)
                self.out_frames.append(frames.encode_method(self.number, commands.Basic.Nack(delivery_tag=seq)))
                self.nacks_sent += 1
        self.confirm_done([])

    def extra_stats(self, now_ns: int) -> dict:
        return {"number": self.number, "routed": self.routed, "unroutable": self.unroutable,
                "unconfirmed": len(self.pending), "confirms_sent": self.confirms_sent, "nacks_sent": self.nacks_sent}


def shown(name) -> str:
    """A name as text for a reply: bytes that are not UTF-8 are shown as U+FFFD, never raised on."""
    if isinstance(name, str):
        name = name.encode("utf-8", "surrogateescape")
    return bytes(name).decode("utf-8", "replace")


def topic_matches(pattern: bytes, routing_key: bytes) -> bool:
    """RabbitMQ topic matching: words split on '.', '*' is one word, '#' zero or more."""
    return _topic(pattern.split(b"."), routing_key.split(b".") if routing_key else [])


def _topic(p: list, k: list) -> bool:
    if not p:
        return not k
    if p[0] == b"#":
        return any(_topic(p[1:], k[i:]) for i in range(len(k) + 1))
    if not k:
        return False
    return (p[0] == b"*" or p[0] == k[0]) and _topic(p[1:], k[1:])


def _ids(method) -> tuple[int, int]:
    idx = getattr(method, "index", None) or getattr(type(method), "index", None)
    if isinstance(idx, int):
        return idx >> 16, idx & 0xFFFF
    return 0, 0
