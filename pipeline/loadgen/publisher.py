"""A publisher process: pre-encoded publishes, latency measured from the intended send time.

The frames of ``batch`` publishes are encoded once into a template; before
each write only the 20-byte body header of each message is patched (intended
send time, sequence, producer id). Unthrottled, a batch's intended time is
when it was composed, so time spent blocked by TCP back-pressure counts. With
``rate`` the intended times follow the schedule ``start + i / rate`` whether
or not the socket let the publisher keep up (no coordinated omission).

The socket is non-blocking; the loop waits in ``select`` for room to write,
for confirms and ``connection.blocked`` frames, for the stop pipe, and for
the next one-second report.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time

from pipeline.amqp import frames
from pipeline.loadgen import latency
from pipeline.loadgen.client import BrokerClosed, Client
from pipeline.loadgen.config import BODY_HEADER_BYTES, LoadConfig

_BODY_HEAD = struct.Struct("<QQI")
REPORT_INTERVAL_NS = 1_000_000_000


class Publisher:
    def __init__(self, cfg: LoadConfig, index: int, report_fd: int, stop_fd: int, start_ns: int):
        self.cfg = cfg
        self.index = index
        self.report_fd = report_fd
        self.stop_fd = stop_fd
        self.start_ns = start_ns
        self.client = Client(cfg.host, cfg.port, frame_max=cfg.frame_max)
        for q in cfg.target_queues:
            self.client.queue_declare(q, cfg.queue_durable)
        if cfg.confirm:
            self.client.confirm_select()
        self.sock = self.client.sock
        self.sock.setblocking(False)
        self.inbuf = bytearray(self.client.unread())
        props = frames.properties_raw(delivery_mode=2 if cfg.persistent else 1)
        body = bytes(cfg.body_bytes)
        self.batch = max(1, cfg.batch if cfg.rate is None else 1)
        self.msg_templates = []
        self.queues = cfg.target_queues
        one = frames.encode_publish(1, "", self.queues[0], props, body, self.client.frame_max)
        self.msg_len = len(one)
        # the body starts after the method frame, the header frame and its own frame header
        self.body_at = len(frames.encode_publish(1, "", self.queues[0], props, b"", self.client.frame_max)) + 7
        self.template = bytearray(one * self.batch)
        self.seq = 0
        self.sent = 0
        self.confirmed = 0
        self.nacked = 0
        self.returned = 0
        self.pending: dict[int, int] = {}        # seq -> intended ns (confirm mode)
        self.lowest = 1
        self.confirm_counts: dict[int, int] = {}
        self.confirm_hist = latency.new_histogram()
        self.out = memoryview(b"")
        self.out_sent = 0
        self.stopping = False
        self.blocked = False
        self.blocked_events: list = list(self.client.blocked_events)
        self.next_report_ns = start_ns + REPORT_INTERVAL_NS
        self.second = 0

    def compose(self, count: int, intended) -> None:
        """Fill the first ``count`` template slots; ``intended(i)`` gives message i's intended time."""
        tmpl = self.template
        pid = self.index
        for i in range(count):
            seq = self.seq + i + 1
            ts = intended(i)
            _BODY_HEAD.pack_into(tmpl, i * self.msg_len + self.body_at, ts, seq, pid)
            if self.cfg.confirm:
                self.pending[seq] = ts
        self.seq += count
        self.out = memoryview(tmpl)[:count * self.msg_len]
        self.out_sent = 0

    def run(self) -> int:
        cfg = self.cfg
        rate_interval_ns = int(1e9 / cfg.rate) if cfg.rate else 0
        next_due = self.start_ns
        try:
            while True:
                now = time.monotonic_ns()
                if now >= self.next_report_ns:
                    self.report(now)
                if self.stopping and not self.out:
                    break
                if not self.out and not self.stopping:
                    room = (cfg.confirm - len(self.pending)) if cfg.confirm else self.batch
                    room = min(room, self.batch)
                    if rate_interval_ns:
                        due = (now - next_due) // rate_interval_ns + 1 if now >= next_due else 0
                        count = min(room, due)
                        if count > 0:
                            base = next_due
                            self.compose(count, lambda i: base + i * rate_interval_ns)
                            next_due += count * rate_interval_ns
                    elif room > 0:
                        self.compose(room, lambda i, t=now: t)
                wait_write = bool(self.out)
                timeout_ns = self.next_report_ns - now
                if not wait_write and rate_interval_ns and not self.stopping:
                    timeout_ns = min(timeout_ns, max(0, next_due - now))
                if wait_write:
                    self.try_send()
                    if self.out:
                        self.wait(True, timeout_ns)
                    else:
                        self.read_nowait()
                else:
                    self.wait(False, timeout_ns)
        except BrokerClosed as exc:
            self.report(time.monotonic_ns(), error=str(exc))
            return 1
        self.settle_confirms()
        self.report(time.monotonic_ns(), final=True)
        # wait for close-ok: closing earlier, with publishes still unread by a blocked broker,
        # would reset the connection and the kernel would drop them
        self.client.close(timeout_s=self.cfg.drain_timeout_s)
        return 0

    def try_send(self) -> None:
        try:
            n = self.sock.send(self.out)
        except BlockingIOError:
            return
        except OSError as exc:
            raise BrokerClosed(320, f"socket error: {exc}") from None
        before = self.out_sent // self.msg_len
        self.out_sent += n
        self.out = self.out[n:]
        self.sent += self.out_sent // self.msg_len - before

    def wait(self, for_write: bool, timeout_ns: int) -> None:
        r, w, _ = select.select([self.sock, self.stop_fd], [self.sock] if for_write else [],
                                [], max(0, timeout_ns) / 1e9)
        if self.stop_fd in r:
            self.stopping = True
        if self.sock in r:
            self.read_nowait()

    def read_nowait(self) -> None:
        try:
            data = self.sock.recv(262144)
        except BlockingIOError:
            return
        if not data:
            raise BrokerClosed(320, "connection closed by the broker")
        self.inbuf += data
        buf = self.inbuf
        pos = 0
        while True:
            found = frames.next_frame(buf, pos)
            if found is None:
                break
            ftype, _, ps, pe = found
            pos = pe + 1
            if ftype != frames.FrameType.METHOD:
                continue
            cls, mid = frames.method_id(buf, ps)
            if (cls, mid) == frames.BASIC_ACK:
                tag, multiple = frames.decode_basic_ack(buf, ps, pe)
                self.on_confirm(tag, multiple, False)
            elif (cls, mid) == (60, 120):
                tag, multiple = frames.decode_basic_ack(buf, ps, pe)
                self.on_confirm(tag, multiple, True)
            elif (cls, mid) == (60, 50):
                self.returned += 1
            else:
                method = frames.decode_method(buf, ps, pe)
                if method.name == "Connection.Blocked":
                    self.blocked = True
                    self.blocked_events.append((time.monotonic_ns(), "blocked:" + method.reason))
                elif method.name == "Connection.Unblocked":
                    self.blocked = False
                    self.blocked_events.append((time.monotonic_ns(), "unblocked"))
                elif method.name in ("Connection.Close", "Channel.Close"):
                    raise BrokerClosed(method.reply_code, method.reply_text)
        del buf[:pos]

    def on_confirm(self, tag: int, multiple: bool, nack: bool) -> None:
        now_us = time.monotonic_ns() // 1000
        counts = self.confirm_counts
        pending = self.pending
        seqs = range(self.lowest, tag + 1) if multiple else (tag,)
        for seq in seqs:
            ts = pending.pop(seq, None)
            if ts is None:
                continue
            if nack:
                self.nacked += 1
            else:
                self.confirmed += 1
                lat = now_us - ts // 1000
                counts[lat] = counts.get(lat, 0) + 1
        while self.lowest <= self.seq and self.lowest not in pending:
            self.lowest += 1

    def settle_confirms(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            r, _, _ = select.select([self.sock], [], [], 0.1)
            if r:
                self.read_nowait()

    def report(self, now: int, final: bool = False, error: str | None = None) -> None:
        latency.fold(self.confirm_hist, self.confirm_counts)
        msg = {"role": "publisher", "index": self.index, "second": self.second, "at_ns": now,
               "sent": self.sent, "confirmed": self.confirmed, "nacked": self.nacked,
               "returned": self.returned, "blocked": self.blocked, "final": final, "error": error,
               "confirm_hist": latency.encode(self.confirm_hist) if self.cfg.confirm else "",
               "blocked_events": self.blocked_events}
        self.blocked_events = []
        self.confirm_hist = latency.new_histogram()
        os.write(self.report_fd, json.dumps(msg).encode() + b"\n")
        self.second += 1
        while self.next_report_ns <= now:
            self.next_report_ns += REPORT_INTERVAL_NS


def publisher_main(cfg: LoadConfig, index: int, report_fd: int, stop_fd: int, start_ns: int) -> int:
    try:
        pub = Publisher(cfg, index, report_fd, stop_fd, start_ns)
    except (OSError, BrokerClosed) as exc:
        os.write(report_fd, json.dumps({"role": "publisher", "index": index, "final": True,
                                        "error": f"cannot start: {exc}"}).encode() + b"\n")
        return 1
    return pub.run()


assert BODY_HEADER_BYTES == _BODY_HEAD.size
