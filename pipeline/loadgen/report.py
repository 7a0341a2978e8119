"""What workers report, how it crosses the pipes, and how it is printed (PerfTest's lines).

Control pipe, harness -> worker (bytes)::

    b"G" | u64 start instant, ns of time.monotonic_ns (big-endian)   start; time reports from here
    b"S"                                                           stop: publishers stop publishing,
                                                                   settle and close; consumers close
    b"E"                                                           end: the drain is over; a publisher
                                                                   still closing reports and drops its
                                                                   connection (EOF reads as end too)
    b"R" | u64 rate in msg/s x 1000 (big-endian)                   rate: publish at this rate from now
                                                                   (``--max-rate``'s search)

Report pipe, worker -> harness: one JSON object per line (UTF-8, ``\\n``
ends a record; a record cut off by EOF is dropped as the worker's death)::

    {"event": "ready",  "worker": "consumer-0"}
    {"event": "second", "worker": ..., "k": 2, "at_ns": ..., "cpu_s": 1.25, "stats": {...},
     "hist": {"consumer": "<HdrHistogram base64>"}, "blocked_events": [[ns, "blocked", reason], ...]}
    {"event": "final",  same fields as "second"}
    {"event": "error",  "worker": ..., "error": "one line"}

``k`` is the second that ended at ``start + (k + 1) s``; ``stats`` is the
worker's ``statistics()`` (cumulative counts) as a dict; ``hist`` holds the
latencies recorded since the worker's previous report. No pickle.
"""

from __future__ import annotations

import json
import os
import struct

from pipeline.loadgen import LoadgenError

START = b"G"
STOP = b"S"
END = b"E"
RATE = b"R"
_START = struct.Struct(">cQ")
LATENCY_FIELDS = ("min", "p50", "p75", "p95", "p99", "max")


class WorkerLinkError(LoadgenError):
    """Raised when a control or report pipe carries bytes that are not a valid record."""


def encode_start(start_ns: int) -> bytes:
    return _START.pack(START, start_ns)


def encode_stop() -> bytes:
    return STOP


def encode_end() -> bytes:
    return END


def encode_rate(rate: float) -> bytes:
    return _START.pack(RATE, round(rate * 1000))


def decode_control(buf: bytes) -> tuple[str | None, int | None, int]:
    """``(command, value, bytes consumed)`` of the first command in ``buf``; command None if incomplete.
    The value is the start instant for "start", the rate for "rate"."""
    if not buf:
        return None, None, 0
    head = buf[:1]
    if head == STOP:
        return "stop", None, 1
    if head == END:
        return "end", None, 1
    if head == START or head == RATE:
        if len(buf) < _START.size:
            return None, None, 0
        value = _START.unpack_from(buf)[1]
        return ("start", value, _START.size) if head == START else ("rate", value / 1000, _START.size)
    raise WorkerLinkError(f"unknown control byte {head!r}")


def encode_record(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode("utf-8") + b"\n"


def decode_records(buf: bytes) -> tuple[list[dict], int]:
    """The whole records at the start of ``buf`` and the bytes they took; a partial line stays."""
    records = []
    pos = 0
    while (end := buf.find(b"\n", pos)) >= 0:
        line = buf[pos:end]
        pos = end + 1
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise WorkerLinkError(f"report line is not JSON: {exc}: {bytes(line[:80])!r}") from None
        if not isinstance(record, dict) or "event" not in record:
            raise WorkerLinkError(f"report line is not a report: {bytes(line[:80])!r}")
        records.append(record)
    return records, pos


class WorkerLink:
    """A worker's end of its two pipes: reports out, start/stop in."""

    def __init__(self, worker: str, report_fd: int, control_fd: int):
        self.worker = worker
        self.report_fd = report_fd
        self.control_fd = control_fd
        self._pending = b""
        os.set_blocking(control_fd, False)

    def send(self, event: str, **fields) -> None:
        data = encode_record({"event": event, "worker": self.worker, **fields})
        view = memoryview(data)
        while view:
            view = view[os.write(self.report_fd, view):]

    def command_nowait(self) -> tuple[str | None, int | None]:
        """The next command from the harness, ``(None, None)`` if none is there; EOF reads as end."""
        command, value, used = decode_control(self._pending)
        if command is None:
            try:
                data = os.read(self.control_fd, 64)
            except BlockingIOError:
                return None, None
            if not data:
                return "end", None                   # the harness went away
            self._pending += data
            command, value, used = decode_control(self._pending)
        self._pending = self._pending[used:]
        return command, value


# -- PerfTest's lines ------------------------------------------------------------------------
def _latencies(summary: dict | None) -> str:
    summary = summary or {}
    return "/".join(str(summary.get(name, 0)) for name in LATENCY_FIELDS)


def format_line(rep) -> str:
    """``time 3.000 s, sent: N msg/s, [confirmed: N msg/s, ]received: N msg/s, ... latency`` for one second."""
    parts = [f"time {rep.time_s:.3f} s", f"sent: {rep.sent_rate:.0f} msg/s"]
    if rep.confirm is not None:
        parts.append(f"confirmed: {rep.confirmed_rate:.0f} msg/s")
        if rep.nacked:
            parts.append(f"nacked: {rep.nacked}")
    if rep.returned:
        parts.append(f"returned: {rep.returned}")
    parts.append(f"received: {rep.received_rate:.0f} msg/s")
    parts.append(f"min/median/75th/95th/99th/max consumer latency: {_latencies(rep.consumer)} µs")
    if rep.confirm is not None:
        parts.append(f"confirm latency: {_latencies(rep.confirm)} µs")
    blocked = [name for name, flag in sorted(rep.blocked.items()) if flag]
    if blocked:
        parts.append("blocked: " + " ".join(blocked))
    return ", ".join(parts)


def format_summary(result) -> str:
    """PerfTest's closing block: average rates over the producing window and whole-run latencies."""
    lat = result.latency_us
    lines = [f"id: {result.run_id}, sending rate avg: {result.publish_rate:.0f} msg/s",
             f"id: {result.run_id}, receiving rate avg: {result.deliver_rate:.0f} msg/s"]
    if "confirm" in lat:
        lines.append(f"id: {result.run_id}, min/median/75th/95th/99th/max confirm latency: "
                     f"{_latencies(lat['confirm'])} µs")
    lines.append(f"id: {result.run_id}, min/median/75th/95th/99th/max consumer latency: "
                 f"{_latencies(lat.get('consumer'))} µs")
    lines.append(f"id: {result.run_id}, published {result.published}, confirmed {result.confirmed}, "
                 f"nacked {result.nacked}, returned {result.returned}, delivered {result.delivered}, "
                 f"undelivered {result.undelivered}, lost {result.lost}, rejected {result.rejected}")
    if result.errors:
        lines.extend(f"id: {result.run_id}, error: {e}" for e in result.errors)
    return "\n".join(lines)
