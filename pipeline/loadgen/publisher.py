"""A publisher process: pre-encoded publishes, latency from the intended send time.

Message body (``BODY_HEAD``, big-endian, then zero padding up to ``size``)::

    u32 sequence, low bits | u64 intended send time, ns of time.monotonic_ns |
    u32 0xCF000000 + producer id | u32 sequence, high bits

The first 12 bytes are RabbitMQ PerfTest's layout (int32 sequence, int64
``System.nanoTime``, which on Linux is the same clock as
``time.monotonic_ns``), so PerfTest's consumers measure the latency of
creditflow's messages and creditflow's consumers that of PerfTest's (see
``consumer``). The tag byte 0xCF tells creditflow's own messages, which
carry a producer id and a 64-bit sequence, from anyone else's.

``PublishTemplate`` encodes ``batch`` complete publishes (method, content
header, body frames) back to back once; before each write only the 20 head
bytes of each slot are patched, in one ``struct.pack_into``.

When a message is *intended* to go out (``schedule.SendSchedule``):
- unlimited (-r unset): a batch is intended when it is composed, so the time
  it then waits for TCP back-pressure from a blocked broker is counted;
- with a rate (or ``--variable-rate`` steps): message ``i`` is intended at
  ``start + i / rate``; a publisher stalled longer than the schedule's
  tolerance does not burst to catch up: it sends the first overdue message
  (its latency shows the stall) and skips the rest (``skipped``), whose
  latencies the consumers put back (no coordinated omission).

With confirms (-c N) ``ConfirmTracker`` holds the intended time of each
unconfirmed sequence (= the channel's delivery tag), never more than N;
basic.ack / basic.nack (``multiple`` or single) settle them and the confirm
latency is the ack's arrival minus the intended time. basic.return is
counted (its content frames are skipped).

The process loop is short: compose a batch if none is in flight, write what
the socket takes, read what arrived, and wait in ``select`` only when
neither made progress.

After the window (``finish``) the publisher completes the batch in flight,
waits for outstanding confirms, then sends connection.close and waits for
close-ok: the broker answers only once it has read every publish before the
close, so a socket buffer still full of publishes is drained, not dropped.
How the connection ended is part of the final report (``connection``):

=========  =================================================================
closed     close-ok came: the broker read every publish
refused    the broker closed the channel or connection (``refusal`` says
           with which reply code and text); it discards what follows
failed     the connection broke (reset, EOF, silence)
open       the drain ended (the harness's "end") before close-ok; publishes
           may still sit in socket buffers; the connection is dropped
=========  =================================================================
"""

from __future__ import annotations

import random
import select
import struct
import time
from dataclasses import asdict, dataclass

from ipc.errors import WouldBlock
from pipeline.amqp import frames
from pipeline.loadgen import latency
from pipeline.loadgen.client import CHANNEL, AmqpClient, ServerClosed
from pipeline.loadgen.config import BODY_HEADER_BYTES, LoadConfig
from pipeline.loadgen.report import WorkerLink
from pipeline.loadgen.schedule import SendSchedule, Steps

BODY_HEAD = struct.Struct(">IQII")
OWN_TAG = 0xCF000000                   # the head's third word: creditflow's tag, or'd with the producer id
PRODUCER_MASK = 0x00FFFFFF
SEQ_LOW = 0xFFFFFFFF
TEMPLATE_MAX_BYTES = 1024 * 1024        # a batch of big messages holds fewer of them
NS_PER_S = 1_000_000_000
REPORT_INTERVAL_NS = 1_000_000_000
CONTROL_POLL_BUSY_NS = 20_000_000
FINISH_POLL_MS = 200
BASIC_NACK = (60, 120)
BASIC_RETURN = (60, 50)
assert BODY_HEAD.size == BODY_HEADER_BYTES


class PublishTemplate:
    """``slots`` encoded publishes of one message shape; ``fill`` patches times and sequences."""

    def __init__(self, slots: int, exchange: str, routing_key: str, props_raw: bytes, body_bytes: int,
                 frame_max: int, producer_id: int, mandatory: bool = False):
        if body_bytes < BODY_HEAD.size:
            raise ValueError(f"a body of {body_bytes} bytes cannot hold the {BODY_HEAD.size}-byte header")
        body = bytearray(body_bytes)
        BODY_HEAD.pack_into(body, 0, 0, 0, OWN_TAG | producer_id, 0)
        one = frames.encode_publish(CHANNEL, exchange, routing_key, props_raw, bytes(body), frame_max, mandatory)
        head = frames.encode_publish(CHANNEL, exchange, routing_key, props_raw, b"", frame_max, mandatory)
        self.message_bytes = len(one)
        self.body_offset = len(head) + 7           # after the first body frame's own 7-byte head
        self.slots = max(1, min(slots, TEMPLATE_MAX_BYTES // self.message_bytes))
        self.tag = OWN_TAG | producer_id
        self.buffer = bytearray(one * self.slots)

    def fill(self, first_seq: int, intended_ns: list[int]) -> memoryview:
        """Patch the first ``len(intended_ns)`` slots with sequences from ``first_seq``; their bytes."""
        buf = self.buffer
        pack = BODY_HEAD.pack_into
        tag = self.tag
        step = self.message_bytes
        offset = self.body_offset
        seq = first_seq
        for ts in intended_ns:
            pack(buf, offset, seq & SEQ_LOW, ts, tag, seq >> 32)
            offset += step
            seq += 1
        return memoryview(buf)[:len(intended_ns) * step]


def encode_head(intended_ns: int, seq: int, producer: int) -> bytes:
    """The 20 head bytes of a creditflow message body."""
    return BODY_HEAD.pack(seq & SEQ_LOW, intended_ns, OWN_TAG | producer, seq >> 32)


def decode_head(body) -> tuple[int, int, int | None]:
    """(intended ns, sequence, producer id) of a body; producer None for a body not creditflow's
    (PerfTest's: its sequence is the int32 at the start)."""
    seq_low, ts, tag, seq_high = BODY_HEAD.unpack_from(body)
    if tag & ~PRODUCER_MASK != OWN_TAG:
        return ts, seq_low, None
    return ts, seq_high << 32 | seq_low, tag & PRODUCER_MASK


class ConfirmTracker:
    """Unconfirmed publishes by sequence, at most ``window``; acks become confirm latencies."""

    def __init__(self, window: int | None, recorder: latency.LatencyRecorder):
        self.window = window
        self.recorder = recorder
        self.pending: dict[int, int] = {}           # sequence -> intended ns
        self.lowest = 1                              # no pending sequence is below this
        self.confirmed = 0
        self.nacked = 0

    def room(self) -> int:
        """How many more may be published now (a large number without confirms)."""
        return (self.window - len(self.pending)) if self.window else 1 << 30

    def published(self, first_seq: int, intended_ns: list[int]) -> None:
        if self.window:
            pending = self.pending
            for i, ts in enumerate(intended_ns):
                pending[first_seq + i] = ts

    @property
    def settled_through(self) -> int:
        """Every publish up to this sequence is confirmed or nacked (0 without confirms)."""
        return self.lowest - 1

    def settle(self, tag: int, multiple: bool, nack: bool, now_ns: int) -> int:
        """Apply basic.ack / basic.nack ``tag``; how many publishes it settled."""
        pending = self.pending
        if multiple:
            settled = []
            seq = self.lowest
            while seq <= tag:
                ts = pending.pop(seq, None)
                if ts is not None:
                    settled.append(ts)
                seq += 1
            self.lowest = max(self.lowest, tag + 1)
        else:
            ts = pending.pop(tag, None)
            settled = [] if ts is None else [ts]
            if tag == self.lowest:
                self.lowest += 1
        if nack:
            self.nacked += len(settled)
        else:
            self.confirmed += len(settled)
            record = self.recorder.record_us
            for ts in settled:
                record((now_ns - ts) // 1000)
        return len(settled)


@dataclass(frozen=True)
class PublisherStatistics:
    sent: int                     # publishes completely written to the socket
    confirmed: int
    nacked: int
    returned: int
    unconfirmed: int
    settled_through: int          # every publish up to this sequence is confirmed or nacked
    blocked: bool                 # connection.blocked is in force
    blocked_count: int
    blocked_ns: int
    connection: str = "open"      # at the end: closed, refused, failed or open (see the module's table)
    refusal: str = ""
    skipped: int = 0              # sends the schedule skipped after stalls (never sent, see ``schedule``)


def declare_topology(client: AmqpClient, cfg: LoadConfig, queues) -> None:
    """Declare ``queues`` with the run's flags and arguments, and the exchange and their bindings."""
    for q in queues:
        client.queue_declare(q, cfg.durable, cfg.auto_delete, dict(cfg.queue_args))
    topology = cfg.topology
    if topology.exchange:
        if not topology.exchange.startswith("amq."):
            client.exchange_declare(topology.exchange, topology.exchange_type, cfg.durable)
        for b in topology.bindings():
            if b.queue in queues:
                client.queue_bind(b.queue, topology.exchange, b.routing_key, b.arguments)


class Publisher:
    """One publishing connection and its loop."""

    def __init__(self, cfg: LoadConfig, index: int, clock=time.monotonic_ns):
        self.cfg = cfg
        self.index = index
        self.name = f"publisher-{index}"
        self.clock = clock
        self.client = AmqpClient(cfg.host, cfg.port, name=f"creditflow-perf {self.name}",
                                 frame_max=cfg.frame_max, heartbeat_s=cfg.heartbeat_s, clock=clock,
                                 user=cfg.user, password=cfg.password, vhost=cfg.vhost)
        declare_topology(self.client, cfg, cfg.queues)
        if cfg.confirm:
            self.client.confirm_select()
        route = cfg.topology.route(index)
        props = frames.properties_raw(delivery_mode=2 if cfg.persistent else 1, headers=route.headers)
        self.templates: dict[int, PublishTemplate] = {}

        def template_for(size: int) -> PublishTemplate:
            size = max(size, BODY_HEADER_BYTES)
            if size not in self.templates:
                self.templates[size] = PublishTemplate(cfg.batch, route.exchange, route.routing_key, props, size,
                                                       self.client.frame_max, index, cfg.mandatory)
            return self.templates[size]
        self.template_for = template_for
        self.template = template_for(cfg.body_bytes)
        self.sizes: Steps | None = None          # --variable-size: the body size in force
        self.schedule: SendSchedule | None = None
        self.recorder = latency.LatencyRecorder()
        self.confirms = ConfirmTracker(cfg.confirm, self.recorder)
        self.next_seq = 1
        self.sent = 0
        self.returned = 0
        self.out = memoryview(b"")
        self.out_first_seq = 1
        self.out_done_bytes = 0
        self.connection = "open"
        self.refusal = ""

    def statistics(self) -> PublisherStatistics:
        c = self.client.statistics()
        return PublisherStatistics(sent=self.sent, confirmed=self.confirms.confirmed, nacked=self.confirms.nacked,
                                   returned=self.returned, unconfirmed=len(self.confirms.pending),
                                   settled_through=self.confirms.settled_through,
                                   blocked=c.blocked, blocked_count=c.blocked_count, blocked_ns=c.blocked_ns,
                                   connection=self.connection, refusal=self.refusal,
                                   skipped=self.schedule.skipped if self.schedule else 0)

    def ended(self, exc: BaseException) -> None:
        """The connection ended with ``exc``: refused by the broker (a close with a reply code) or failed."""
        if isinstance(exc, ServerClosed):
            self.connection = "refused"
            self.refusal = f"{exc.reply_code} {exc.reply_text} ({exc.what.split()[0]} closed)"
        else:
            self.connection = "failed"

    # -- one step each ------------------------------------------------------------------------
    def compose(self, schedule: SendSchedule, now_ns: int) -> bool:
        """Fill the template with the messages due now; False if none are (rate or confirm window)."""
        if self.sizes is not None:
            self.template = self.template_for(self.sizes.value_at(now_ns))
        room = min(self.template.slots, self.confirms.room())
        if schedule.unlimited and self.cfg.confirm and room < self.template.slots:
            # a nearly full window: wait for a useful batch unless nothing else is in flight
            if room < min(self.template.slots, self.cfg.confirm) // 4 and self.confirms.pending:
                return False
        times = schedule.due(now_ns, room)
        if not times:
            return False
        self.out = self.template.fill(self.next_seq, times)
        self.out_first_seq = self.next_seq
        self.out_done_bytes = 0
        self.confirms.published(self.next_seq, times)
        self.next_seq += len(times)
        return True

    def write_nowait(self) -> None:
        """Write what the socket takes of the batch in flight; WouldBlock when it takes nothing."""
        n = self.client.send_nowait(self.out)
        step = self.template.message_bytes
        before = self.out_done_bytes // step
        self.out_done_bytes += n
        self.sent += self.out_done_bytes // step - before
        self.out = self.out[n:]

    def read_nowait(self) -> None:
        """Handle everything the broker sent: confirms, returns, blocked/unblocked, close."""
        client = self.client
        client.receive_nowait()
        now = self.clock()
        buf = client.buffer
        next_frame = frames.next_frame
        method_id = frames.method_id
        frame_max = client.frame_max
        pos = 0
        try:
            while (found := next_frame(buf, pos, frame_max)) is not None:
                ftype, channel, ps, pe = found
                pos = pe + 1
                if ftype == 1:
                    key = method_id(buf, ps)
                    if key == frames.BASIC_ACK or key == BASIC_NACK:
                        tag, multiple = frames.decode_basic_ack(buf, ps, pe)
                        self.confirms.settle(tag, multiple, key == BASIC_NACK, now)
                        continue
                    if key == BASIC_RETURN:
                        self.returned += 1
                        continue
                client.handle_frame(ftype, channel, ps, pe)
        finally:
            client.discard(pos)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, link: WorkerLink, start_ns: int) -> None:
        """Publish from ``start_ns`` for the configured duration, or until the harness says stop.

        Messages are intended only before ``start + duration``: the publisher
        ends the window itself, so a late stop command adds nothing.
        """
        self.client.set_nonblocking()
        cfg = self.cfg
        delay_ns = int(random.uniform(0, cfg.start_delay_s) * NS_PER_S) if cfg.start_delay_s else 0
        schedule = self.schedule = SendSchedule(start_ns + delay_ns, cfg.rate, cfg.variable_rate, cfg.pmessages)
        if cfg.variable_size:
            self.sizes = Steps(cfg.variable_size, start_ns)
        stop_ns = start_ns + int(self.cfg.duration_s * NS_PER_S)
        next_report_ns = start_ns + REPORT_INTERVAL_NS
        sock_fd = self.client.fileno()
        poller = select.poll()
        poller.register(sock_fd, select.POLLIN)
        poller.register(link.control_fd, select.POLLIN)
        next_control_ns = 0
        while True:
            now = self.clock()
            if now >= next_report_ns:
                next_report_ns = self.report(link, "second", start_ns, now)
            if not self.out:
                due = schedule.next_due_ns()
                if schedule.exhausted():
                    return                                   # -C sent: ``finish`` settles
                if now < stop_ns:
                    self.compose(schedule, now)
                elif due is not None and due < stop_ns:
                    self.compose(schedule, stop_ns - 1)      # the last ones due inside the window
                else:
                    return                                   # the window is over; ``finish`` settles
            progressed = False
            if self.out:
                try:
                    self.write_nowait()
                    progressed = True
                except WouldBlock:
                    pass
            try:
                self.read_nowait()
                progressed = True
            except WouldBlock:
                pass
            if not self.out:
                self.client.tick(now)
            busy = progressed and (self.out or schedule.unlimited)
            if not busy or now >= next_control_ns:       # busy: look at the control pipe now and then
                next_control_ns = now + CONTROL_POLL_BUSY_NS
                command, value = link.command_nowait()
                if command in ("stop", "end"):
                    return                               # ``finish`` completes the batch in flight
                if command == "rate":
                    schedule.set_rate(now, value)
            if busy:
                continue
            deadline = min(next_report_ns, stop_ns) if now < stop_ns else next_report_ns
            if not self.out and self.confirms.room() > 0:
                due = schedule.next_due_ns()
                if due is not None:
                    deadline = min(deadline, due)
            beat = self.client.heartbeat.next_deadline_ns()
            if beat is not None:
                deadline = min(deadline, beat)
            poller.modify(sock_fd, select.POLLIN | select.POLLOUT if self.out else select.POLLIN)
            poller.poll(max(0, deadline - self.clock()) / 1e6)

    def finish(self, link: WorkerLink, start_ns: int) -> None:
        """After the window: complete the batch in flight, wait for outstanding confirms, close and
        wait for close-ok; until the harness says the drain is over ("end"). Then report, and drop
        the connection if the close did not complete."""
        client = self.client
        sock_fd = client.fileno()
        poller = select.poll()
        poller.register(link.control_fd, select.POLLIN)
        poller.register(sock_fd, select.POLLIN)
        closing = None                                   # the close frame's unwritten bytes, once due
        next_report_ns = self.clock() + REPORT_INTERVAL_NS
        while not client.close_ok:
            if link.command_nowait()[0] == "end":
                break
            now = self.clock()
            if now >= next_report_ns:                    # a drain can be long: keep the harness's figures fresh
                next_report_ns = self.report(link, "second", start_ns, now)
            progressed = False
            if self.out:
                try:
                    self.write_nowait()
                    progressed = True
                except WouldBlock:
                    pass
            elif closing is None and not self.confirms.pending:
                closing = memoryview(client.close_frame())
            if closing:
                try:
                    closing = closing[client.send_nowait(closing):]
                    progressed = True
                except WouldBlock:
                    pass
            try:
                self.read_nowait()
                progressed = True
            except WouldBlock:
                pass
            now = self.clock()
            if not self.out and closing is None:
                client.tick(now)                         # heartbeats only between whole frames
            if progressed:
                continue
            writing = bool(self.out or closing)
            poller.modify(sock_fd, select.POLLIN | select.POLLOUT if writing else select.POLLIN)
            poller.poll(min(FINISH_POLL_MS, max(0, next_report_ns - now) // 1_000_000))
        if client.close_ok:
            self.connection = "closed"
        self.report(link, "final", start_ns, self.clock())
        client.abort()        # after close-ok; or a frame may be half written, and the broker must not take it

    def report(self, link: WorkerLink, event: str, start_ns: int, now: int) -> int:
        """Send one report; the instant the next one is due."""
        k = (now - start_ns) // REPORT_INTERVAL_NS - 1
        hist = {"confirm": latency.encode(self.recorder.take())} if self.cfg.confirm else {}
        omitted = self.schedule.take_omitted() if self.schedule is not None else []
        if omitted:                       # skipped sends count in the consumer latency (see ``schedule``)
            waited = latency.LatencyRecorder()
            for us, count in omitted:
                waited.record_us(us, count)
            hist["consumer"] = latency.encode(waited.take())
        events = [list(e) for e in self.client.take_blocked_events()]
        link.send(event, k=k, at_ns=now, cpu_s=time.process_time(), stats=asdict(self.statistics()), hist=hist,
                  blocked_events=events)
        return start_ns + (k + 2) * REPORT_INTERVAL_NS
