"""A consumer process: deliveries parsed in place, latency from the intended send time, acks.

``DeliveryStream`` is the sans-IO core. It walks whole frames in a buffer
with ``frames.next_frame``: basic.deliver starts a message, its content
header gives the body size, the first body frame holds the publisher's body
header (``publisher.BODY_HEAD``: intended send time, sequence, producer id)
and the message is complete when its body is. Any other frame goes to the
caller's ``on_other`` (connection.close, basic.cancel, heartbeats). Once one
delivery has been walked this way, the following ones of the same byte
layout are read in one step each (``DeliveryShape``), which halves what a
consumer spends per message.

Measurements, per complete message:
- latency = receive time - intended send time. ``time.monotonic_ns`` is one
  clock for every process on the machine. The receive time is the instant
  the socket read returned, or, with -L, the instant the message's turn
  came (messages queued behind a slow one wait, as in PerfTest);
- messages intended before this run started (left in a durable queue by an
  earlier run) or with a body too short for the header are counted as
  ``stale`` and not measured;
- ``SequenceChecker``: per producer, a sequence above the next expected one
  opens a gap, one below it closes a gap (``reordered``) or is a
  ``duplicate``. It only makes sense when this consumer is its queue's only
  consumer;
- the highest sequence received from each producer (``highest``): the broker
  reads a connection's publishes in order, so every publish up to it was
  read. The harness counts what came after it as still on its way when a
  drain ends early (see ``harness``).

With -L the stream spends that long per message: busy-waiting below a
millisecond (sleep cannot be that precise), sleeping above.

Acknowledgement (no -a): after each socket read, one basic.ack with
``multiple=True`` for the last delivery tag read, which acknowledges every
message read so far — PerfTest's ``--multi-ack-every`` behaviour with the
batch being whatever one read brought.
"""

from __future__ import annotations

import select
import struct
import time
from dataclasses import asdict, dataclass

from ipc.errors import WouldBlock
from pipeline.amqp import frames
from pipeline.loadgen import latency
from pipeline.loadgen.client import CHANNEL, RECEIVE_CHUNK_BYTES, AmqpClient
from pipeline.loadgen.config import LoadConfig
from pipeline.loadgen.publisher import BODY_HEAD, OWN_TAG, PRODUCER_MASK, declare_topology
from pipeline.loadgen.report import WorkerLink
from pipeline.loadgen.schedule import Steps

REPORT_INTERVAL_NS = 1_000_000_000
BUSY_WAIT_BELOW_US = 1000
FRAME_END = frames.FRAME_END
CONTROL_POLL_BUSY_NS = 20_000_000
OWN_MASK = ~PRODUCER_MASK & 0xFFFFFFFF
PACE_BURST_NS = 100_000_000             # --consumer-rate: credit saved up while idle, at most this long's worth
PERFTEST_HEAD = struct.Struct(">IQ")     # PerfTest's body: int32 sequence, int64 System.nanoTime
WALL_CLOCK_SLACK_NS = 1_000_000_000      # another machine's clock may run this far ahead


def spend_us(us: int) -> None:
    """Take ``us`` microseconds: busy below a millisecond, asleep above."""
    if us >= BUSY_WAIT_BELOW_US:
        time.sleep(us / 1e6)
        return
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


class SequenceChecker:
    """Per-producer order check (omq's --detect-gaps-in-messages, RabbitTestTool's model): a sequence
    above the next expected one opens a gap of the skipped ones; one below it is a late arrival
    (``reordered``, and its gap closes) if it was missing, else a ``duplicate``. ``gaps`` is what
    is still missing. Memory grows with the gaps, not with the messages."""

    __slots__ = ("expected", "gaps", "duplicates", "reordered", "missing")

    def __init__(self) -> None:
        self.expected: dict[int, int] = {}
        self.gaps = 0
        self.duplicates = 0
        self.reordered = 0
        self.missing: dict[int, list[list[int]]] = {}     # producer -> [[first, last], ...] not yet seen

    def observe(self, producer: int, seq: int) -> None:
        expected = self.expected.get(producer, 1)
        if seq == expected:
            self.expected[producer] = seq + 1
        elif seq > expected:
            self.skipped(producer, expected, seq)
            self.expected[producer] = seq + 1
        else:
            self.behind(producer, seq)

    def skipped(self, producer: int, expected: int, seq: int) -> None:
        """``seq`` came where ``expected`` was due: ``expected .. seq - 1`` are missing."""
        self.gaps += seq - expected
        self.missing.setdefault(producer, []).append([expected, seq - 1])

    def behind(self, producer: int, seq: int) -> None:
        """``seq`` is below the next expected one: late if it was missing, else seen before."""
        for gap in self.missing.get(producer, ()):
            first, last = gap
            if first <= seq <= last:
                self.reordered += 1
                self.gaps -= 1
                if first == last:
                    self.missing[producer].remove(gap)
                elif seq == first:
                    gap[0] += 1
                elif seq == last:
                    gap[1] -= 1
                else:
                    gap[1] = seq - 1
                    self.missing[producer].append([seq + 1, last])
                return
        self.duplicates += 1


@dataclass(frozen=True)
class ConsumerStatistics:
    received: int                 # messages of this run, completely received
    stale: int                    # messages from before this run, or without a time to measure
    gaps: int                     # sequences still missing (see ``SequenceChecker``)
    duplicates: int
    acked_tag: int                # highest delivery tag acknowledged
    highest: dict                 # producer id -> highest sequence received from it
    foreign: int = 0              # messages of this run from another tool (PerfTest, omq): measured, not checked
    last_ns: int = 0              # when the last message was taken (monotonic ns)
    reordered: int = 0            # sequences that came after a later one (a gap that closed)


class DeliveryShape:
    """The byte layout consecutive deliveries share, checked and read with one ``struct`` call.

    Once ``next_frame`` has walked one delivery — a basic.deliver of
    ``method_bytes`` payload, a content header of ``header_bytes`` and a body
    in one frame of ``body_bytes`` — every later message of a run usually has
    the same layout: only the delivery tag, the redelivered bit and the body
    header differ. One unpack then reads the whole message's frame types,
    channels, sizes, class/method ids, body size and frame-end octets (which
    must equal the learned ones, ``fixed``) and the body header; any
    difference hands the bytes back to ``next_frame``. The delivery tag is
    read with ``frames.decode_deliver`` once per buffer, for the last one.
    """

    def __init__(self, channel: int, method_bytes: int, header_bytes: int, body_bytes: int):
        self.struct = struct.Struct(f">BHIHH{method_bytes - 4}xB"
                                    f"BHIHHQ{header_bytes - 12}xB"
                                    f"BHIIQII{body_bytes - BODY_HEAD.size}xB")
        self.size = self.struct.size
        self.method_end = 7 + method_bytes
        self.fixed = (1, channel, method_bytes, *frames.BASIC_DELIVER, FRAME_END,
                      2, channel, header_bytes, frames.CLASS_BASIC, 0, body_bytes, FRAME_END,
                      3, channel, body_bytes)


class DeliveryStream:
    """Turns frames into measured messages (sans-IO: bytes and times in, counts out)."""

    def __init__(self, run_start_ns: int, recorder: latency.LatencyRecorder, *, frame_max: int | None = None,
                 check_sequence: bool = True, delay_us: int = 0, spend=spend_us, clock=time.monotonic_ns):
        self.run_start_ns = run_start_ns
        self.recorder = recorder
        self.frame_max = frame_max
        self.sequence = SequenceChecker() if check_sequence else None
        self.top: dict[int, int] = {}   # producer -> highest sequence, when ``sequence`` does not keep it
        self.delay_us = delay_us
        self.spend = spend
        self.clock = clock
        self.received = 0
        self.stale = 0
        self.foreign = 0
        self.last_ns = 0
        self.run_start_wall_ns = time.time_ns() - (time.monotonic_ns() - run_start_ns)
        self.last_tag = 0
        self._in_content = False     # a basic.deliver was read and its header is awaited
        self._body_left = 0          # body bytes still to come for the current message
        self._head = None            # (intended ns, seq, producer) of the current message, or None
        self.shape: DeliveryShape | None = None

    def feed(self, buf, now_ns: int, on_other, limit: int | None = None) -> int:
        """Consume the whole frames at the start of ``buf``; the number of bytes they took. With
        ``limit``, stop after that many complete messages (the rest stays for a later call).

        ``on_other(ftype, channel, payload_start, payload_end)`` is called for
        frames that are not part of a delivery, before ``feed`` returns. The
        loop runs once per message and is most of what a consumer spends, so
        its state lives in locals; a message of the learned ``DeliveryShape``
        is taken in one step, anything else frame by frame with ``next_frame``.
        """
        if limit is not None and limit <= 0:
            return 0
        next_frame = frames.next_frame
        method_id = frames.method_id
        content_header = frames.decode_content_header
        unpack_head = BODY_HEAD.unpack_from
        head_size = BODY_HEAD.size
        deliver = frames.BASIC_DELIVER
        frame_max = self.frame_max
        counts = self.recorder.counts
        expected = self.sequence.expected if self.sequence is not None else None
        top = self.top
        run_start_ns = self.run_start_ns
        delay_us = self.delay_us
        in_content, body_left, head = self._in_content, self._body_left, self._head
        shape = self.shape
        if shape is not None:
            shape_unpack, shape_size, shape_fixed, shape_method = (shape.struct.unpack_from, shape.size,
                                                                   shape.fixed, shape.method_end)
        msg_start = None                 # where the message being assembled began, if in this buffer
        method_len = header_len = 0
        received = stale = foreign = 0
        size = len(buf)
        pos = 0
        last_deliver = None
        try:
            while True:
                if shape is not None and body_left <= 0 and not in_content and size - pos >= shape_size:
                    v = shape_unpack(buf, pos)
                    if v[:16] == shape_fixed and v[20] == FRAME_END:
                        last_deliver = (pos + 7, pos + shape_method)
                        pos += shape_size
                        head = v[16:20]
                    else:
                        shape = self.shape = None        # the stream changed shape; learn it again
                        continue
                else:
                    found = next_frame(buf, pos, frame_max)
                    if found is None:
                        break
                    ftype, channel, ps, pe = found
                    pos = pe + 1
                    if ftype == 3 and body_left > 0:
                        if head is None and pe - ps >= head_size:
                            head = unpack_head(buf, ps)
                        elif head is None and pe - ps >= PERFTEST_HEAD.size:     # PerfTest's 12 bytes
                            head = PERFTEST_HEAD.unpack_from(buf, ps) + (0, 0)
                        body_left -= pe - ps
                        if body_left > 0:
                            msg_start = None             # several body frames: not a shape to learn
                            continue
                        if shape is None and msg_start is not None and head is not None and pe - ps >= head_size:
                            shape = self.shape = DeliveryShape(channel, method_len, header_len, pe - ps)
                            shape_unpack, shape_size, shape_fixed, shape_method = (
                                shape.struct.unpack_from, shape.size, shape.fixed, shape.method_end)
                    elif ftype == 2 and in_content:
                        in_content = False
                        body_left = content_header(buf, ps, pe)[0]
                        header_len = pe - ps
                        head = None
                        if body_left > 0:
                            continue
                    elif ftype == 1 and method_id(buf, ps) == deliver:
                        last_deliver = (ps, pe)
                        in_content = True
                        msg_start, method_len = ps - 7, pe - ps
                        continue
                    else:
                        on_other(ftype, channel, ps, pe)
                        continue
                # a message is complete
                if delay_us:
                    now_ns = self.clock()
                if head is None or head[1] < run_start_ns:
                    stale += 1
                elif (tag := head[2]) & OWN_MASK != OWN_TAG:      # another tool's: measured, order unchecked
                    lat = (now_ns - head[1]) // 1000 if head[1] <= now_ns else self.wall_clock_latency_us(head[1])
                    if lat is None:
                        stale += 1                        # a wall-clock stamp from before the run
                    else:
                        received += 1
                        foreign += 1
                        self.recorder.record_us(lat)
                else:
                    received += 1
                    lat = (now_ns - head[1]) // 1000      # latency.clamp_us, inline
                    if lat < latency.LOWEST_US:
                        lat = latency.LOWEST_US
                    elif lat >= 1 << latency.RESOLUTION_BITS:
                        if lat > latency.HIGHEST_US:
                            lat = latency.HIGHEST_US
                        shift = lat.bit_length() - latency.RESOLUTION_BITS
                        lat = lat >> shift << shift
                    counts[lat] = counts.get(lat, 0) + 1
                    seq = head[3] << 32 | head[0]
                    producer = tag & PRODUCER_MASK
                    if expected is not None:              # SequenceChecker.observe, inline
                        want = expected.get(producer, 1)
                        if seq == want:
                            expected[producer] = seq + 1
                        elif seq > want:
                            self.sequence.skipped(producer, want, seq)
                            expected[producer] = seq + 1
                        else:
                            self.sequence.behind(producer, seq)
                    else:
                        if seq > top.get(producer, 0):
                            top[producer] = seq
                if delay_us:
                    self.spend(delay_us)
                if limit is not None and received + stale >= limit:
                    break
        finally:
            self._in_content, self._body_left, self._head = in_content, body_left, head
            self.received += received
            self.stale += stale
            self.foreign += foreign
            if received:
                self.last_ns = now_ns
        if last_deliver is not None:
            self.last_tag = frames.decode_deliver(buf, *last_deliver)[1]
        return pos

    def wall_clock_latency_us(self, stamp: int) -> int | None:
        """Latency of a message stamped with wall-clock ns (omq's default), None if it is from before
        the run or from the future (not a time at all)."""
        now = time.time_ns()
        if not self.run_start_wall_ns <= stamp <= now + WALL_CLOCK_SLACK_NS:
            return None
        return max(0, now - stamp) // 1000

    def highest(self) -> dict[int, int]:
        """Producer id -> the highest sequence received from it (this run's messages only)."""
        if self.sequence is not None:
            return {producer: nxt - 1 for producer, nxt in self.sequence.expected.items()}
        return dict(self.top)


class Consumer:
    """One consuming connection and its loop."""

    def __init__(self, cfg: LoadConfig, index: int, clock=time.monotonic_ns):
        self.cfg = cfg
        self.index = index
        self.name = f"consumer-{index}"
        self.queue = cfg.consumer_queue(index)
        self.clock = clock
        self.client = AmqpClient(cfg.host, cfg.port, name=f"creditflow-perf {self.name}",
                                 frame_max=cfg.frame_max, heartbeat_s=cfg.heartbeat_s, clock=clock,
                                 user=cfg.user, password=cfg.password, vhost=cfg.vhost)
        declare_topology(self.client, cfg, (self.queue,))
        if cfg.prefetch:
            self.client.basic_qos(cfg.prefetch)
        self.client.basic_consume(self.queue, no_ack=cfg.autoack)
        self.recorder = latency.LatencyRecorder()
        self.stream: DeliveryStream | None = None
        self.acked_tag = 0
        self.held = False                          # the last take stopped at -D or --consumer-rate
        self.pace_ns = 0                           # --consumer-rate: when the next message may be taken
        self.latencies: Steps | None = None       # --variable-latency: the per-message latency in force

    def statistics(self) -> ConsumerStatistics:
        s = self.stream
        seq = s.sequence if s is not None else None
        return ConsumerStatistics(received=s.received if s else 0, stale=s.stale if s else 0,
                                  foreign=s.foreign if s else 0, last_ns=s.last_ns if s else 0,
                                  gaps=seq.gaps if seq else 0, duplicates=seq.duplicates if seq else 0,
                                  reordered=seq.reordered if seq else 0,
                                  acked_tag=self.acked_tag, highest=s.highest() if s else {})

    def read_nowait(self) -> int:
        """Take in what the socket holds, measure and acknowledge it; its byte count. WouldBlock if none."""
        got = self.client.receive_nowait()
        self.take_buffered()
        return got

    def take_buffered(self) -> None:
        """Measure the whole frames already buffered (as many as -D and --consumer-rate allow) and
        acknowledge them: one multiple ack per read, or per ``--multi-ack-every`` messages."""
        client = self.client
        stream = self.stream
        now = self.clock()
        if self.latencies is not None:
            stream.delay_us = self.latencies.value_at(now)
        used = 0
        allowed = self.allowed(now)
        before = self.taken()
        try:
            used = stream.feed(client.buffer, now, client.handle_frame, allowed)
        finally:
            client.discard(used)
        self.held = allowed is not None and self.taken() - before >= allowed   # more may wait in the buffer
        self.paced(self.taken() - before)
        every = self.cfg.multi_ack_every or 1
        if not self.cfg.autoack and stream.last_tag - self.acked_tag >= every:
            self.acked_tag = stream.last_tag
            client.send_all(frames.encode_basic_ack(CHANNEL, self.acked_tag, True))

    def taken(self) -> int:
        return self.stream.received + self.stream.stale

    def allowed(self, now_ns: int) -> int | None:
        """How many more messages may be taken now (None: any number): -D and --consumer-rate, whose
        credit after an idle spell is at most ``PACE_BURST_NS`` worth (a rate, not a catch-up)."""
        cfg = self.cfg
        left = None
        if cfg.cmessages:
            left = max(0, cfg.cmessages - self.taken())
        if cfg.consumer_rate:
            self.pace_ns = max(self.pace_ns, now_ns - PACE_BURST_NS)
            due = 0 if now_ns < self.pace_ns else int((now_ns - self.pace_ns) * cfg.consumer_rate / 1e9) + 1
            left = due if left is None else min(left, due)
        return left

    def paced(self, taken: int) -> None:
        """``taken`` messages went under --consumer-rate: the next may go that many intervals later."""
        if self.cfg.consumer_rate and taken:
            self.pace_ns += round(taken * 1e9 / self.cfg.consumer_rate)

    def flush_ack(self) -> None:
        """Acknowledge what was taken and not yet acknowledged (-A leaves up to N-1 behind)."""
        if not self.cfg.autoack and self.stream is not None and self.stream.last_tag > self.acked_tag:
            self.acked_tag = self.stream.last_tag
            self.client.send_all(frames.encode_basic_ack(CHANNEL, self.acked_tag, True))

    def run(self, link: WorkerLink, start_ns: int) -> None:
        cfg = self.cfg
        self.stream = DeliveryStream(start_ns, self.recorder, frame_max=self.client.frame_max,
                                     check_sequence=cfg.consumers_on(self.queue) == 1,
                                     delay_us=cfg.consumer_latency_us, clock=self.clock)
        self.pace_ns = start_ns
        if cfg.variable_latency:
            self.latencies = Steps(cfg.variable_latency, start_ns)
        self.client.set_nonblocking()
        next_report_ns = start_ns + REPORT_INTERVAL_NS
        next_control_ns = 0
        poller = select.poll()
        poller.register(self.client.fileno(), select.POLLIN)
        poller.register(link.control_fd, select.POLLIN)
        self.take_buffered()                    # deliveries that arrived with the set-up replies
        control_fd = link.control_fd
        events: list = []
        while True:
            now = self.clock()
            if now >= next_report_ns:
                next_report_ns = self.report(link, "second", start_ns, now)
            held_back = bool(cfg.consumer_rate) and len(self.client.buffer) >= RECEIVE_CHUNK_BYTES
            try:
                if held_back:                        # paced: what is buffered first, the socket can wait
                    self.take_buffered()
                    got = 0
                else:
                    got = self.read_nowait()
            except WouldBlock:
                got = 0
                if self.held:                        # nothing new, but buffered messages whose turn came
                    self.take_buffered()
            if now >= next_control_ns or any(fd == control_fd for fd, _ in events):
                next_control_ns = now + CONTROL_POLL_BUSY_NS
                if link.command_nowait()[0] in ("stop", "end"):
                    return
            if cfg.cmessages and self.taken() >= cfg.cmessages:
                self.flush_ack()
                return                               # -D taken: ``finish`` reports and closes
            if got == RECEIVE_CHUNK_BYTES and not cfg.consumer_rate:   # a full read: more is probably waiting
                events = []
                continue
            if held_back:
                self.client.heartbeat.received(now)  # unread bytes wait: the broker is alive
            self.client.tick(now)
            deadline = next_report_ns
            if self.held and cfg.consumer_rate:      # buffered messages wait for their turn
                if self.pace_ns <= self.clock():
                    events = []
                    continue
                deadline = min(deadline, self.pace_ns)
            beat = self.client.heartbeat.next_deadline_ns()
            if beat is not None:
                deadline = min(deadline, beat)
            poller.modify(self.client.fileno(), 0 if held_back else select.POLLIN)
            events = poller.poll(max(0, deadline - self.clock()) / 1e6)

    def finish(self, link: WorkerLink, start_ns: int) -> None:
        self.flush_ack()
        self.report(link, "final", start_ns, self.clock())
        self.client.close()

    def report(self, link: WorkerLink, event: str, start_ns: int, now: int) -> int:
        """Send one report; the instant the next one is due."""
        k = (now - start_ns) // REPORT_INTERVAL_NS - 1
        link.send(event, k=k, at_ns=now, cpu_s=time.process_time(), stats=asdict(self.statistics()),
                  hist={"consumer": latency.encode(self.recorder.take())})
        return start_ns + (k + 2) * REPORT_INTERVAL_NS
