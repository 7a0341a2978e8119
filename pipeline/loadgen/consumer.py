"""A consumer process: parses deliveries, measures latency from the intended send time, acks.

Latency is the receive time minus the intended send time the publisher wrote
into the body (``time.monotonic_ns`` is one clock for every process on the
machine). With ``consumer_latency_us`` it spends that long per message (busy
below a millisecond, asleep above), as PerfTest's ``-L``. Without autoack it
acks once per socket read with ``multiple=True`` (PerfTest's
``--multi-ack-every`` behaviour), which acknowledges every message read.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time

from pipeline.amqp import frames
from pipeline.loadgen import latency
from pipeline.loadgen.client import BrokerClosed, Client
from pipeline.loadgen.config import LoadConfig

_BODY_HEAD = struct.Struct("<QQI")
_U64 = struct.Struct(">Q")
REPORT_INTERVAL_NS = 1_000_000_000


def spend(us: int) -> None:
    if us >= 1000:
        time.sleep(us / 1e6)
        return
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


class Consumer:
    def __init__(self, cfg: LoadConfig, index: int, report_fd: int, stop_fd: int, start_ns: int,
                 queue: str):
        self.cfg = cfg
        self.index = index
        self.report_fd = report_fd
        self.stop_fd = stop_fd
        self.client = Client(cfg.host, cfg.port, frame_max=cfg.frame_max)
        self.client.queue_declare(queue, cfg.queue_durable)
        if cfg.prefetch:
            self.client.qos(cfg.prefetch)
        self.client.consume(queue, no_ack=cfg.autoack)
        self.sock = self.client.sock
        self.sock.setblocking(False)
        self.buf = bytearray(self.client.unread())
        self.received = 0
        self.counts: dict[int, int] = {}
        self.hist = latency.new_histogram()
        self.last_seq: dict[int, int] = {}
        self.gaps = 0
        self.duplicates = 0
        self.last_tag = 0
        self.acked_tag = 0
        self.body_left = -1       # bytes still expected for the current message's body
        self.body_head = b""
        self.next_report_ns = start_ns + REPORT_INTERVAL_NS
        self.second = 0
        self.stopping = False

    def run(self) -> int:
        try:
            while not self.stopping:
                now = time.monotonic_ns()
                if now >= self.next_report_ns:
                    self.report(now)
                r, _, _ = select.select([self.sock, self.stop_fd], [], [],
                                        max(0, self.next_report_ns - now) / 1e9)
                if self.sock in r:
                    self.read()
                if self.stop_fd in r:
                    self.stopping = True
        except BrokerClosed as exc:
            self.report(time.monotonic_ns(), error=str(exc))
            return 1
        self.report(time.monotonic_ns(), final=True)
        self.client.close()
        return 0

    def read(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        if not data:
            raise BrokerClosed(320, "connection closed by the broker")
        buf = self.buf
        buf += data
        pos = 0
        delay = self.cfg.consumer_latency_us
        counts = self.counts
        next_frame = frames.next_frame
        while True:
            found = next_frame(buf, pos)
            if found is None:
                break
            ftype, _, ps, pe = found
            pos = pe + 1
            if ftype == 3:
                if self.body_left > 0:
                    if not self.body_head:
                        self.body_head = bytes(buf[ps:ps + 20])
                    self.body_left -= pe - ps
                    if self.body_left <= 0:
                        self.message(counts)
                        if delay:
                            spend(delay)
            elif ftype == 2:
                (size,) = _U64.unpack_from(buf, ps + 4)
                self.body_left = size
                self.body_head = b""
                if size == 0:
                    self.message(counts)
            elif ftype == 1:
                key = frames.method_id(buf, ps)
                if key == frames.BASIC_DELIVER:
                    o = ps + 4
                    o += 1 + buf[o]
                    (self.last_tag,) = _U64.unpack_from(buf, o)
                else:
                    method = frames.decode_method(buf, ps, pe)
                    if method.name in ("Connection.Close", "Channel.Close"):
                        raise BrokerClosed(method.reply_code, method.reply_text)
        del buf[:pos]
        if not self.cfg.autoack and self.last_tag > self.acked_tag:
            self.sock.setblocking(True)
            try:
                self.sock.sendall(frames.encode_basic_ack(1, self.last_tag, True))
            finally:
                self.sock.setblocking(False)
            self.acked_tag = self.last_tag

    def message(self, counts) -> None:
        self.received += 1
        head = self.body_head
        if len(head) < 20:
            return
        ts, seq, pid = _BODY_HEAD.unpack(head)
        lat = (time.monotonic_ns() - ts) // 1000
        counts[lat] = counts.get(lat, 0) + 1
        last = self.last_seq.get(pid, 0)
        if seq == last + 1:
            self.last_seq[pid] = seq
        elif seq > last + 1:
            self.gaps += seq - last - 1
            self.last_seq[pid] = seq
        else:
            self.duplicates += 1

    def report(self, now: int, final: bool = False, error: str | None = None) -> None:
        latency.fold(self.hist, self.counts)
        msg = {"role": "consumer", "index": self.index, "second": self.second, "at_ns": now,
               "received": self.received, "gaps": self.gaps, "duplicates": self.duplicates,
               "final": final, "error": error, "consumer_hist": latency.encode(self.hist)}
        self.hist = latency.new_histogram()
        os.write(self.report_fd, json.dumps(msg).encode() + b"\n")
        self.second += 1
        while self.next_report_ns <= now:
            self.next_report_ns += REPORT_INTERVAL_NS


def consumer_main(cfg: LoadConfig, index: int, report_fd: int, stop_fd: int, start_ns: int, queue: str) -> int:
    try:
        con = Consumer(cfg, index, report_fd, stop_fd, start_ns, queue)
    except (OSError, BrokerClosed) as exc:
        os.write(report_fd, json.dumps({"role": "consumer", "index": index, "final": True,
                                        "error": f"cannot start: {exc}"}).encode() + b"\n")
        return 1
    return con.run()
