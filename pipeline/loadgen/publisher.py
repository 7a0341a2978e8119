"""A publisher process: pre-encoded publishes, latency from the intended send time.

Message body (``BODY_HEAD``, big-endian, then zero padding up to ``size``)::

    u64 intended send time, ns of time.monotonic_ns | u64 sequence (1, 2, ...) | u32 producer id

``PublishTemplate`` encodes ``batch`` complete publishes (method, content
header, body frames) back to back once; before each write only the first
16 body bytes of each slot (time and sequence) are patched with
``struct.pack_into``. The producer id is written once.

When a message is *intended* to go out (``RateSchedule``):
- unlimited (-r unset): a batch is intended when it is composed, so the time
  it then waits for TCP back-pressure from a blocked broker is counted;
- with a rate: message ``i`` is intended at ``start + i / rate`` whether or
  not the socket let the publisher keep up — a stalled publisher sends its
  backlog late and the latency shows it (no coordinated omission).

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

BODY_HEAD = struct.Struct(">QQI")
_TIME_SEQ = struct.Struct(">QQ")
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
        BODY_HEAD.pack_into(body, 0, 0, 0, producer_id)
        one = frames.encode_publish(CHANNEL, exchange, routing_key, props_raw, bytes(body), frame_max, mandatory)
        head = frames.encode_publish(CHANNEL, exchange, routing_key, props_raw, b"", frame_max, mandatory)
        self.message_bytes = len(one)
        self.body_offset = len(head) + 7           # after the first body frame's own 7-byte head
        self.slots = max(1, min(slots, TEMPLATE_MAX_BYTES // self.message_bytes))
        self.buffer = bytearray(one * self.slots)

    def fill(self, first_seq: int, intended_ns: list[int]) -> memoryview:
        """Patch the first ``len(intended_ns)`` slots with sequences from ``first_seq``; their bytes."""
        buf = self.buffer
        pack = _TIME_SEQ.pack_into
        step = self.message_bytes
        offset = self.body_offset
        seq = first_seq
        for ts in intended_ns:
            pack(buf, offset, ts, seq)
            offset += step
            seq += 1
        return memoryview(buf)[:len(intended_ns) * step]


class RateSchedule:
    """Intended send times: ``now`` for unlimited publishing, else ``start + i / rate``."""

    def __init__(self, rate: float | None, start_ns: int):
        self.rate = rate
        self.start_ns = start_ns
        self.next_index = 0

    def intended_at(self, index: int) -> int:
        return self.start_ns + round(index * 1e9 / self.rate)

    def due(self, now_ns: int, limit: int) -> list[int]:
        """Intended times of the messages due by ``now_ns`` (at most ``limit``); they count as taken."""
        if limit <= 0:
            return []
        if self.rate is None:
            self.next_index += limit
            return [now_ns] * limit
        if now_ns < self.start_ns:
            return []
        due_total = int((now_ns - self.start_ns) * self.rate / 1e9) + 1
        while due_total > 0 and self.intended_at(due_total - 1) > now_ns:
            due_total -= 1                           # float rounding must never schedule early
        count = min(limit, due_total - self.next_index)
        if count <= 0:
            return []
        first = self.next_index
        self.next_index += count
        return [self.intended_at(i) for i in range(first, first + count)]

    def next_due_ns(self) -> int | None:
        """When the next message is due; None when publishing is unlimited."""
        return None if self.rate is None else self.intended_at(self.next_index)


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
    refusal: str = ""             # refused: "<reply code> <reply text> (<channel|connection> closed)"


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
        for q in cfg.queues:
            self.client.queue_declare(q, cfg.durable)
        if cfg.fanout:
            self.client.exchange_declare(cfg.exchange, "fanout", cfg.durable)
            for q in cfg.queues:
                self.client.queue_bind(q, cfg.exchange)
            exchange, routing_key = cfg.exchange, ""
        else:
            exchange, routing_key = "", cfg.queue
        if cfg.confirm:
            self.client.confirm_select()
        props = frames.properties_raw(delivery_mode=2 if cfg.persistent else 1)
        self.template = PublishTemplate(cfg.batch, exchange, routing_key,
                                        props, cfg.body_bytes, self.client.frame_max, index, cfg.mandatory)
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
                                   connection=self.connection, refusal=self.refusal)

    def ended(self, exc: BaseException) -> None:
        """The connection ended with ``exc``: refused by the broker (a close with a reply code) or failed."""
        if isinstance(exc, ServerClosed):
            self.connection = "refused"
            self.refusal = f"{exc.reply_code} {exc.reply_text} ({exc.what.split()[0]} closed)"
        else:
            self.connection = "failed"

    # -- one step each ------------------------------------------------------------------------
    def compose(self, schedule: RateSchedule, now_ns: int) -> bool:
        """Fill the template with the messages due now; False if none are (rate or confirm window)."""
        room = min(self.template.slots, self.confirms.room())
        if self.cfg.rate is None and self.cfg.confirm and room < self.template.slots:
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
        schedule = RateSchedule(self.cfg.rate, start_ns)
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
                if now < stop_ns:
                    self.compose(schedule, now)
                elif self.cfg.rate is not None and schedule.next_due_ns() < stop_ns:
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
            busy = progressed and (self.out or self.cfg.rate is None)
            if not busy or now >= next_control_ns:       # busy: look at the control pipe now and then
                next_control_ns = now + CONTROL_POLL_BUSY_NS
                if link.command_nowait()[0] in ("stop", "end"):
                    return                               # ``finish`` completes the batch in flight
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
        events = [list(e) for e in self.client.take_blocked_events()]
        link.send(event, k=k, at_ns=now, cpu_s=time.process_time(), stats=asdict(self.statistics()), hist=hist,
                  blocked_events=events)
        return start_ns + (k + 2) * REPORT_INTERVAL_NS
