"""The channel: one process per AMQP channel.

It takes its reader's records off a ring, acks each publish's credit as soon
as it dequeues it (before routing, as RabbitMQ's channel does), routes it and
sends it to every target queue, spending one credit per queue. While a queue
holds it blocked it still routes (its credit goes negative) but defers the
reader's grants, which is how back-pressure climbs to the socket.

It also runs the channel's other methods (queue.declare, basic.qos/consume/
cancel/get, confirm.select), turns queues' confirms into ``basic.ack`` frames
for the publisher, and passes consumers' acks on to the queues.
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


class ChannelError(Exception):
    """Raised when a method breaks a channel-level rule; the channel is closed with ``code``."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0):
        super().__init__(text)
        self.code, self.text, self.class_id, self.method_id = code, text, class_id, method_id


class QueueLinks:
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
                 reader: str, frame_max: int, delay_us: int = 0):
        super().__init__(name, ctl_sock, inbox_fd, doorbell_fd, credit_spec)
        self.number = number
        self.reader_name = reader
        self.delay_ns = delay_us * 1000
        self.read_batch = read_batch_for(self.delay_ns)
        self.frame_max = frame_max
        self.from_reader = None
        self.to_reader = None
        self.queues: dict[bytes, QueueLinks] = {}
        self.by_in_link: dict[int, QueueLinks] = {}
        self.missing: set[bytes] = set()          # known not to exist (until a queue_created)
        self.parked: dict[bytes, list] = {}       # waiting for a link to the queue
        self.confirm = False
        self.pending: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.last_multiple_ack = 0
        self.max_seq = 0
        self.prefetch = 0
        self.consumers: dict[str, bytes] = {}     # consumer tag -> queue
        self.routed = 0
        self.unroutable = 0
        self.confirms_sent = 0
        self.out_frames: list[bytes] = []
        self.closing = False
        self.exchanges: dict[bytes, tuple[str, list]] = {}   # name -> (type, [(queue, key)]), from the supervisor
        self.routes: dict[tuple[bytes, bytes], list[bytes]] = {}
        self.awaiting: collections.deque = collections.deque()   # replies owed to the client, in order

    # -- wiring ------------------------------------------------------------------
    def on_link_attached(self, link) -> None:
        if link.peer == self.reader_name:
            if link in self.in_links.values():
                self.from_reader = link
            else:
                self.to_reader = link

    def on_control(self, msg: dict, fds) -> None:
        kind = msg.get("type")
        name = msg.get("queue", "").encode()
        if kind == "queue_linked":
            q = QueueLinks(name, self.out_links[msg["out"]], self.in_links[msg["in"]])
            self.queues[name] = q
            self.by_in_link[q.inp.link_id] = q
            self.missing.discard(name)
            for op in self.parked.pop(name, []):
                self.replay(q, op)
        elif kind == "no_queue":
            self.missing.add(name)
            for op in self.parked.pop(name, []):
                self.replay(None, op)
        elif kind == "queue_created":
            self.missing.discard(name)
        elif kind == "exchanges":
            for ex, info in msg["table"].items():
                self.exchanges[ex.encode()] = (info["type"], [(q.encode(), k.encode()) for q, k in info["bindings"]])
            self.routes.clear()
        elif kind == "reply":
            self.on_reply(msg)
        elif kind == "queue_deleted":
            self.missing.add(name)

    def need_queue(self, name: bytes, op) -> QueueLinks | None:
        """The links to queue ``name``; parks ``op`` and asks for them if there are none yet."""
        q = self.queues.get(name)
        if q is not None:
            return q
        waiting = self.parked.get(name)
        if waiting is None:
            waiting = self.parked[name] = []
            control.send_msg(self.ctl, {"type": "link_queue", "queue": name.decode()})
        waiting.append(op)
        return None

    def replay(self, q: QueueLinks | None, op) -> None:
        kind = op[0]
        try:
            if kind == "publish":
                flags, seq = wire.publish_head(op[1])
                self.route_publish(op[1], flags, seq, time.monotonic_ns())
            elif kind == "control":
                if q is None:
                    raise ChannelError(404, f"NOT_FOUND - no queue '{op[2]}' in vhost '/'", *op[3])
                q.out.put(wire.encode_control(op[1]))
            elif kind == "ack" and q is not None:
                q.out.put(op[1])
        except ChannelError as err:
            self.channel_error(err)

    # -- records ------------------------------------------------------------------
    def on_record(self, link, record) -> None:
        kind = record[0]
        if link is self.from_reader:
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
            return
        q = self.by_in_link.get(link.link_id)
        if kind == wire.Kind.CONFIRM:
            self.on_confirms(wire.decode_confirm(record))
        elif kind == wire.Kind.CONTROL and q is not None:
            self.on_queue_reply(q, wire.decode_control(record))

    def on_publish(self, record) -> None:
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
                raise ChannelError(404, f"NOT_FOUND - no exchange '{exchange.decode()}' in vhost '/'", 60, 40)
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
            q.out.put_message(record)
            self.credit.send(q.out.link_id, now)
        self.routed += 1

    def unroutable_publish(self, flags: int, seq: int, record) -> None:
        self.unroutable += 1
        if flags & wire.PUB_MANDATORY:
            exchange, rk, props, body = wire.decode_content(record, wire.PUBLISH_CONTENT_OFFSET)
            ret = commands.Basic.Return(reply_code=312, reply_text="NO_ROUTE",
                                        exchange=exchange.decode(), routing_key=rk.decode())
            self.out_frames.append(frames.encode_method(self.number, ret)
                                   + frames.encode_content(self.number, props, body, self.frame_max))
        if flags & wire.PUB_CONFIRM:
            self.pending.pop(seq, None)
            self.confirm_done([seq])

    def on_confirms(self, seqs) -> None:
        done = []
        pending = self.pending
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
        """Ack confirmed publishes: one multiple ack below the lowest still pending, single acks above it."""
        lowest = next(iter(self.pending), None)
        upto = (lowest - 1) if lowest is not None else self.max_seq
        out = self.out_frames
        if upto > self.last_multiple_ack:
            out.append(frames.encode_basic_ack(self.number, upto, True))
            self.last_multiple_ack = upto
            self.confirms_sent += 1
        for seq in seqs:
            if seq > upto:
                out.append(frames.encode_basic_ack(self.number, seq, False))
                self.confirms_sent += 1

    # -- methods ----------------------------------------------------------------------
    def on_method(self, record) -> None:
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
            self.parked.setdefault(queue.encode(), []).append(("control", op, queue, (50, 10)))
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
        self.awaiting.append((answer, ids))
        control.send_msg(self.ctl, request)

    def on_reply(self, msg: dict) -> None:
        answer, ids = self.awaiting.popleft()
        if not msg.get("ok"):
            self.channel_error(ChannelError(msg["code"], msg["text"], *ids))
        elif answer is not None:
            self.reply(answer)

    def to_queue(self, queue: str, op: dict, ids) -> None:
        q = self.need_queue(queue.encode(), ("control", op, queue, ids))
        if q is not None:
            q.out.put(wire.encode_control(op))

    def on_queue_reply(self, q: QueueLinks, msg: dict) -> None:
        op = msg.get("op")
        if op == "declare_ok":
            if not msg.get("nowait"):
                self.reply(commands.Queue.DeclareOk(queue=msg["queue"], message_count=msg["message_count"],
                                                    consumer_count=msg["consumer_count"]))
        elif op == "error":
            self.channel_error(ChannelError(msg["code"], msg["text"], msg.get("class_id", 0),
                                            msg.get("method_id", 0)))

    def reply(self, method) -> None:
        self.out_frames.append(frames.encode_method(self.number, method))

    def channel_error(self, err: ChannelError) -> None:
        self.flush_frames()
        if self.to_reader is not None:
            self.to_reader.put(wire.encode_control({"op": "channel_error", "channel": self.number,
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

    def on_peer_down(self, link_id: int) -> None:
        q = self.by_in_link.pop(link_id, None)
        if q is not None:
            self.queues.pop(q.name, None)

    def extra_stats(self, now_ns: int) -> dict:
        return {"number": self.number, "routed": self.routed, "unroutable": self.unroutable,
                "unconfirmed": len(self.pending), "confirms_sent": self.confirms_sent}


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
