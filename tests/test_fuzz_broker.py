"""Ten thousand malformed inputs against a live broker: none may stop it, none may leak.

Every input goes to the broker on a TCP connection of its own: a few in place
of the protocol header, most right after it (before authentication), and a
good share after a full handshake with channels open, so that channel and
queue processes see them too. The makers, in the shares of ``SHARES``, all
seeded (hypothesis with ``derandomize``, ``random`` with ``SEED``), so CI sends
the same inputs every run:

* frames (hypothesis strategies): structured but wrong -- real and unknown
  class/method ids with arguments drawn field by field (strings that are not
  UTF-8 or lie about their length, tables nested thousands deep or holding
  unknown types), content headers with absurd body sizes and broken
  properties, bodies and heartbeats where they do not belong, frame sizes
  that lie, bad frame ends; some of these mutated as below;
* mutants: the frames a pika client sends (handshake, declare, confirm,
  publish, consume, ack, close) with bytes flipped, cut or inserted, frames
  dropped, repeated or swapped, channel and size fields rewritten;
* bytes: raw random bytes, a few of them many kilobytes long; and, in place
  of the protocol header, other protocols' greetings and random bytes.

After every batch a well-behaved pika client must still declare a queue,
publish with confirms and consume its message back; the broker must be
alive; and once the fuzzed connections' processes have exited, the broker's
processes, the supervisor's open descriptors and the run's /dev/shm entries
must be back at their baseline. Queues are the one thing a fuzzed input may
create for good: queue names come from a pool declared up front, but a
mutated declare can name a new one, and then the baseline is taken again
(the new queue's process, links and segments are its own). At the end no
stage process may have died.

The summary line (``-s``) says how each connection ended: closed by the
broker's connection.close with which reply code, by a channel.close, closed
without a frame (RabbitMQ's way before tune-ok), or left open by the broker
until the client hung up.
"""

from __future__ import annotations

import collections
import os
import random
import re
import socket
import struct
import time
import uuid
import concurrent.futures
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import pika
import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from pamqp import commands

from pipeline.amqp import frames

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(600)]

INPUTS = int(os.environ.get("CREDITFLOW_FUZZ_INPUTS", "10000"))   # at least 10,000 in CI
BATCH = 500
WORKERS = 32
REPLY_WAIT_S = 0.2            # how long a connection is watched after its input went out
SETUP_TIMEOUT_S = 10.0
SETTLE_S = 30.0
HEALTH_TIMEOUT_S = 60.0               # for the fuzzed connections' processes to exit and their links to go
POOL_QUEUES = ("fuzz-q", "fuzz-q2")
HEALTH_QUEUE = "fuzz-health"
EXCHANGES = ("", "amq.direct", "amq.fanout", "amq.topic", "fuzz-x", "amq.nope")
CAPABILITIES = {"authentication_failure_close": True, "connection.blocked": True, "publisher_confirms": True,
                "basic.nack": True, "consumer_cancel_notify": True, "exchange_exchange_bindings": True}
TRANSIENT_STAGES = ("reader-", "channel-")


def frame(ftype: int, channel: int, payload: bytes, size: int | None = None, end: int = frames.FRAME_END) -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload) if size is None else size) + payload + bytes((end,))


def method(channel: int, m) -> bytes:
    return frames.encode_method(channel, m)


def start_ok() -> bytes:
    return method(0, commands.Connection.StartOk(
        client_properties={"product": "fuzz", "platform": "Python", "capabilities": CAPABILITIES},
        mechanism="PLAIN", response="\0guest\0guest", locale="en_US"))


def tune_ok() -> bytes:
    return method(0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0))


def split(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while (found := frames.next_frame(data, pos)) is not None:
        out.append(data[pos:found[3] + 1])
        pos = found[3] + 1
    return out


PROPS = frames.properties_raw(content_type="text/plain", delivery_mode=2, priority=1, message_id="m-1",
                              headers={"h": [1, "x", {"n": None}], "t": True})
# what pika sends, frame by frame: after the protocol header, and after the handshake with channel 1 open
PRE_SESSION = [start_ok(), tune_ok(), method(0, commands.Connection.Open()), method(1, commands.Channel.Open()),
               method(1, commands.Queue.Declare(queue="fuzz-q", passive=True)),
               method(1, commands.Confirm.Select()),
               *split(frames.encode_publish(1, "", "fuzz-q", PROPS, b"m" * 300, 131072)),
               method(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0)),
               method(0, commands.Connection.Close(reply_code=200, reply_text="", class_id=0, method_id=0))]
OPEN_SESSION = [method(1, commands.Queue.Declare(queue="fuzz-q", passive=True)),
                method(1, commands.Basic.Qos(prefetch_count=5)), method(1, commands.Confirm.Select()),
                *split(frames.encode_publish(1, "amq.direct", "fuzz-q", PROPS, b"p" * 5000, 4096)),
                method(1, commands.Basic.Consume(queue="fuzz-q", consumer_tag="fz")),
                frames.encode_basic_ack(1, 1), method(1, commands.Basic.Cancel(consumer_tag="fz")),
                method(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0)),
                method(0, commands.Connection.Close(reply_code=200, reply_text="", class_id=0, method_id=0))]
ALL_METHODS = sorted((index >> 16, index & 0xFFFF) for index in commands.INDEX_MAPPING)
CONNECTION_METHODS = [key for key in ALL_METHODS if key[0] == 10]
PUBLISH = method(1, commands.Basic.Publish(exchange="", routing_key="fuzz-q"))


@dataclass(frozen=True)
class Input:
    stage: str            # "raw": in place of the protocol header; "pre": after it; "open": after the handshake
    maker: str            # "header", "frames", "framed mutant", "mutant", "bytes"
    data: bytes
    channels: tuple[int, ...] = ()


# -- strategies ------------------------------------------------------------------------------------------

@st.composite
def shortstr(draw, pool=None) -> bytes:
    how = draw(st.sampled_from(["pool"] * 6 + ["text", "not utf-8", "longer than said", "shorter than said"]))
    if how == "pool" and pool:
        raw = draw(st.sampled_from(pool)).encode()
    elif how == "not utf-8":
        raw = draw(st.binary(max_size=6)) + b"\xff" + draw(st.binary(max_size=3))
    else:
        raw = draw(st.text(max_size=20)).encode()[:200]
    if pool == POOL_QUEUES and how == "text":
        raw = POOL_QUEUES[0].encode()           # no fuzzed declare may name a queue of its own on purpose
    if how == "longer than said":
        return bytes((max(0, len(raw) - 1),)) + raw + b"x"
    if how == "shorter than said":
        return bytes((min(255, len(raw) + draw(st.integers(1, 40))),)) + raw
    return bytes((len(raw),)) + raw


def nested_table(depth: int, kind: bytes) -> bytes:
    """A table nesting ``depth`` levels of tables (F) or arrays (A), with its size."""
    if kind == b"F":
        table = struct.pack(">I", 7) + b"\x01aI\x00\x00\x00\x01"
        for _ in range(depth - 1):
            table = struct.pack(">I", len(table) + 3) + b"\x01aF" + table
        return table
    array = struct.pack(">I", 0)
    for _ in range(depth - 1):
        array = struct.pack(">I", len(array) + 1) + b"A" + array
    return struct.pack(">I", len(array) + 3) + b"\x01aA" + array


_FIXED = {b"t": 1, b"b": 1, b"B": 1, b"s": 2, b"u": 2, b"I": 4, b"i": 4, b"l": 8, b"L": 8, b"f": 4, b"d": 8,
          b"D": 5, b"T": 8, b"V": 0}


@st.composite
def field_value(draw, depth: int) -> bytes:
    kinds = list(_FIXED) + [b"S", b"x"] + ([b"F", b"A"] if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    if kind in _FIXED:
        return kind + draw(st.binary(min_size=_FIXED[kind], max_size=_FIXED[kind]))
    if kind in (b"S", b"x"):
        raw = draw(st.binary(max_size=12))
        return kind + struct.pack(">I", len(raw)) + raw
    if kind == b"F":
        return kind + draw(table(depth + 1, valid_only=True))
    items = b"".join(draw(st.lists(field_value(depth + 1), max_size=3)))
    return kind + struct.pack(">I", len(items)) + items


@st.composite
def table(draw, depth: int = 0, valid_only: bool = False) -> bytes:
    how = "valid" if valid_only else draw(st.sampled_from(
        ["valid"] * 6 + ["empty", "nested", "nested arrays", "unknown type", "size lies", "entry cut short"]))
    if how in ("nested", "nested arrays"):
        depth_levels = draw(st.sampled_from([60, 65, 200, 600, 3000]))
        return nested_table(depth_levels, b"F" if how == "nested" else b"A")
    if how == "empty":
        return b"\x00\x00\x00\x00"
    entries = b"".join(draw(shortstr()) + draw(field_value(depth)) for _ in range(draw(st.integers(0, 4))))
    if how == "unknown type":
        entries += b"\x01z" + draw(st.sampled_from([b"Z", b"U", b"\x00", b"\xff", b"c"])) + b"\x00\x00"
    elif how == "entry cut short":
        entries += b"\x01zI\x00"
    size = len(entries)
    if how == "size lies":
        size = min(2 ** 32 - 1, max(0, size + draw(st.sampled_from([-3, -1, 1, 7, 2 ** 31, 2 ** 32 - 1]))))
    return struct.pack(">I", size) + entries


@st.composite
def argument(draw, name: str, kind: str) -> bytes:
    if kind == "shortstr":
        pool = POOL_QUEUES if name == "queue" else EXCHANGES if name in ("exchange", "destination", "source") else None
        return draw(shortstr(pool))
    if kind == "longstr":
        raw = draw(st.binary(max_size=30))
        return struct.pack(">I", len(raw) + draw(st.sampled_from([0] * 5 + [1, 100]))) + raw
    if kind == "table":
        return draw(table())
    size = {"octet": 1, "short": 2, "long": 4, "longlong": 8, "timestamp": 8}[kind]
    return draw(st.sampled_from([b"\x00" * size, b"\xff" * size, b"\x00" * (size - 1) + b"\x01"])
                | st.binary(min_size=size, max_size=size))


@st.composite
def method_payload(draw, stage: str) -> bytes:
    ids = draw(st.sampled_from(CONNECTION_METHODS if stage == "pre" and draw(st.booleans()) else ALL_METHODS)
               | st.tuples(st.sampled_from([10, 20, 40, 50, 60, 85, 90, 0, 99, 65535]), st.integers(0, 255)))
    cls = commands.INDEX_MAPPING.get(ids[0] << 16 | ids[1])
    if cls is None:
        args = draw(st.binary(max_size=16))
    else:
        parts, in_bits = [], False
        for name in cls.__slots__:
            kind = cls.amqp_type(name)
            if kind == "bit":
                if not in_bits:
                    parts.append(draw(st.integers(0, 255)).to_bytes(1, "big"))
                in_bits = True
                continue
            in_bits = False
            parts.append(draw(argument(name, kind)))
        args = b"".join(parts)
    tail = draw(st.sampled_from(["whole"] * 6 + ["cut", "extra"]))
    if tail == "cut" and args:
        args = args[:draw(st.integers(0, len(args) - 1))]
    elif tail == "extra":
        args += draw(st.binary(min_size=1, max_size=8))
    return struct.pack(">HH", *ids) + args


@st.composite
def properties(draw) -> bytes:
    how = draw(st.sampled_from(["none", "valid", "valid", "headers", "random", "cut"]))
    if how == "none":
        return b"\x00\x00"
    if how == "valid":
        return PROPS
    if how == "headers":
        return b"\x20\x00" + draw(table())
    if how == "cut":
        return PROPS[:draw(st.integers(1, len(PROPS) - 1))]
    return draw(st.binary(min_size=2, max_size=40))


@st.composite
def header_payload(draw) -> bytes:
    class_id = draw(st.sampled_from([60] * 6 + [50, 0, 65535]))
    weight = draw(st.sampled_from([0] * 8 + [1, 65535]))
    size = draw(st.sampled_from([0, 1, 3, 100, 5000, 2 ** 31, 600 * 2 ** 20, 2 ** 63, 2 ** 64 - 1]))
    payload = struct.pack(">HHQ", class_id, weight, size) + draw(properties())
    if draw(st.integers(0, 9)) == 0:
        payload = payload[:draw(st.integers(0, 11))]          # shorter than a header can be
    return payload


@st.composite
def bad_frame(draw, stage: str) -> bytes:
    ftype = draw(st.sampled_from([1] * 7 + [2] * 3 + [3] * 2 + [8, 0, 4, 9, 206, 255]))
    channels = [0] * 6 + [1, 2] if stage == "pre" else [0, 0, 1, 1, 1, 1, 2, 3, 2047, 2048, 65535]
    channel = draw(st.sampled_from(channels))
    if ftype == 1:
        payload = draw(method_payload(stage))
    elif ftype == 2:
        payload = draw(header_payload())
    elif ftype == 3:
        payload = draw(st.binary(max_size=64))
    elif ftype == 8:
        payload = draw(st.sampled_from([b"", b"", b"x"]))
    else:
        payload = draw(st.binary(max_size=16))
    size = len(payload)
    lie = draw(st.sampled_from(["none"] * 10 + ["more", "less", "4097", "131073", "2^32-1"]))
    size = {"more": size + 3, "less": max(0, size - 1), "4097": 4097, "131073": 131073,
            "2^32-1": 2 ** 32 - 1}.get(lie, size)
    end = draw(st.sampled_from([frames.FRAME_END] * 14 + [0, 0xCD, 0xFF]))
    return frame(ftype, channel, payload, size, end)


@st.composite
def frames_input(draw, stage: str) -> bytes:
    if stage == "pre":
        prefix = draw(st.sampled_from([b"", b"", start_ok(), start_ok() + tune_ok()]))
    else:
        prefix = draw(st.sampled_from([b"", b"", PUBLISH, PUBLISH + frame(2, 1, struct.pack(">HHQ", 60, 0, 10)
                                                                            + b"\x00\x00")]))
    return prefix + b"".join(draw(st.lists(bad_frame(stage), min_size=1, max_size=4)))


def mutate(parts: list[bytes], rng: random.Random) -> bytes:
    """``parts`` (frames) with one to four changes: bytes flipped, set, cut or inserted, frames dropped,
    repeated or swapped, channel or size fields rewritten; the sequence may also stop early."""
    parts = list(parts)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(parts))
        part = bytearray(parts[i])
        how = rng.choice(["flip", "set", "cut", "insert", "drop", "repeat", "swap", "channel", "size"])
        if how in ("flip", "set") and part:
            at = rng.randrange(len(part))
            part[at] = (part[at] ^ (1 << rng.randrange(8)) if how == "flip"
                        else rng.choice([0, 1, 0x7F, 0x80, 0xCE, 0xFF]))
        elif how == "cut":
            del part[rng.randint(0, len(part)):]
        elif how == "insert":
            at = rng.randint(0, len(part))
            part[at:at] = rng.randbytes(rng.randint(1, 24))
        elif how == "drop":
            part = bytearray()
        elif how == "repeat":
            part = part * 2
        elif how == "swap":
            j = rng.randrange(len(parts))
            parts[i], parts[j] = parts[j], parts[i]
            continue
        elif how == "channel" and len(part) >= 3:
            part[1:3] = struct.pack(">H", rng.choice([0, 1, 2, 7, 2047, 2048, 65535]))
        elif how == "size" and len(part) >= 7:
            part[3:7] = struct.pack(">I", rng.choice([0, 1, 4, 4089, 4097, 131065, 2 ** 32 - 1]))
        parts[i] = bytes(part)
    return b"".join(parts[:rng.randint(1, len(parts))])


def split_loosely(data: bytes) -> list[bytes]:
    """``data`` cut where its frame headers say, whatever they say (the rest as one piece)."""
    parts, pos = [], 0
    while len(data) - pos >= 8:
        end = pos + 8 + struct.unpack_from(">I", data, pos + 3)[0]
        if end > len(data):
            break
        parts.append(data[pos:end])
        pos = end
    if pos < len(data):
        parts.append(data[pos:])
    return parts


def raw_bytes(rng: random.Random) -> bytes:
    if rng.random() < 0.02:
        return rng.randbytes(rng.choice([4096, 4105, 20_000, 140_000]))
    return rng.randbytes(rng.randint(1, 300))


NOT_A_HEADER = st.one_of(st.sampled_from([b"AMQP\x00\x00\x09\x02", b"AMQP\x00\x00\x08\x00", b"AMQP\x01\x01\x00\x0a",
                                          b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"AMQP", b"\x16\x03\x01\x02\x00\x01",
                                          b"\x00" * 8, b"amqp\x00\x00\x09\x01"]),
                         st.binary(min_size=8, max_size=64))
SEED = 20_261_123
SHARES = {            # (stage, maker) -> share of the inputs
    ("raw", "header"): 0.04,
    ("pre", "frames"): 0.14, ("open", "frames"): 0.10,
    ("pre", "framed mutant"): 0.05, ("open", "framed mutant"): 0.03,
    ("pre", "mutant"): 0.26, ("open", "mutant"): 0.18,
    ("pre", "bytes"): 0.12, ("open", "bytes"): 0.08,
}


def hypothesis_examples(strategy, n: int) -> list:
    """``n`` examples of ``strategy``, the same ones every run (a fixed seed, nothing stored)."""
    out: list = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        out.append(example)

    collect()
    return out


def counts(n: int) -> dict[tuple[str, str], int]:
    count = {key: round(share * n) for key, share in SHARES.items()}
    count[("pre", "mutant")] += n - sum(count.values())
    return count


def _examples(stage: str, n: int) -> list[bytes]:
    if stage == "raw":
        return hypothesis_examples(NOT_A_HEADER, counts(n)[("raw", "header")])
    return hypothesis_examples(frames_input(stage), counts(n)[(stage, "frames")])


def structured_examples(n: int, makers: ProcessPoolExecutor) -> dict[str, concurrent.futures.Future]:
    """Start making the hypothesis examples of ``generate`` for ``n`` inputs (most of its time) on
    ``makers``, by stage: they are made while the broker is set up."""
    return {stage: makers.submit(_examples, stage, n) for stage in ("pre", "open", "raw")}


def generate(n: int, structured: dict[str, list[bytes]]) -> list[Input]:
    """``n`` inputs in the proportions of ``SHARES``, shuffled, the same every run: structured frames
    from hypothesis (``structured``, by stage: ``structured_examples``; some of them mutated), mutated
    pika sessions and raw bytes from a seeded generator."""
    rng = random.Random(SEED)
    count = counts(n)
    made = [("raw", "header", data) for data in structured["raw"]]
    for stage in ("pre", "open"):
        made += [(stage, "frames", data) for data in structured[stage]]
        made += [(stage, "framed mutant", mutate(split_loosely(rng.choice(structured[stage])), rng))
                 for _ in range(count[(stage, "framed mutant")])]
        session = PRE_SESSION if stage == "pre" else OPEN_SESSION
        made += [(stage, "mutant", mutate(session, rng)) for _ in range(count[(stage, "mutant")])]
        made += [(stage, "bytes", raw_bytes(rng)) for _ in range(count[(stage, "bytes")])]
    rng.shuffle(made)
    return [Input(stage, maker, data, rng.choice([(1,), (1,), (1, 2)]) if stage == "open" else ())
            for stage, maker, data in made]


# -- one connection per input ----------------------------------------------------------------------------

class SetupFailed(Exception):
    """Raised when the handshake before an input did not go through."""


def _read_until(sock: socket.socket, key: tuple[int, int], buf: bytearray) -> None:
    """Read until a method ``key`` on any channel is in ``buf`` (which keeps whatever follows it)."""
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while True:
        pos = 0
        while (found := frames.next_frame(buf, pos)) is not None:
            ftype, _, ps, pe = found
            pos = pe + 1
            if ftype == 1 and pe - ps >= 4 and frames.method_id(buf, ps) == key:
                del buf[:pos]
                return
        if time.monotonic() > deadline:
            raise SetupFailed(f"no {key} in time")
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            raise SetupFailed(f"closed while waiting for {key}")
        buf += chunk


def _outcome(sock: socket.socket, buf: bytearray) -> str:
    """How the broker ended the connection after the input: read replies for ``REPLY_WAIT_S``."""
    deadline = time.monotonic() + REPLY_WAIT_S
    channel_codes: list[int] = []
    pos = 0
    while True:
        try:
            while (found := frames.next_frame(buf, pos)) is not None:
                ftype, _, ps, pe = found
                pos = pe + 1
                if ftype != 1 or pe - ps < 4:
                    continue
                key = frames.method_id(buf, ps)
                if key in (frames.CONNECTION_CLOSE, frames.CHANNEL_CLOSE):
                    code = struct.unpack_from(">H", buf, ps + 4)[0]
                    if key == frames.CONNECTION_CLOSE:
                        try:
                            sock.sendall(method(0, commands.Connection.CloseOk()))
                        except OSError:
                            pass
                        return f"connection.close {code}"
                    channel_codes.append(code)
        except frames.FrameError:
            return "garbled reply"
        left = deadline - time.monotonic()
        if left <= 0:
            return f"channel.close {channel_codes[0]}" if channel_codes else "left open"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return "reset without a frame"
        if not chunk:
            if channel_codes:
                return f"channel.close {channel_codes[0]}"
            return "protocol header" if bytes(buf[:4]) == b"AMQP" else "closed without a frame"
        buf += chunk


def send_one(port: int, item: Input) -> str:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=SETUP_TIMEOUT_S)
    except OSError as exc:
        return f"connect failed: {exc.__class__.__name__}"
    buf = bytearray()
    try:
        try:
            if item.stage != "raw":
                sock.sendall(frames.PROTOCOL_HEADER)
                _read_until(sock, frames.CONNECTION_START, buf)
            if item.stage == "open":
                sock.sendall(start_ok())
                _read_until(sock, frames.CONNECTION_TUNE, buf)
                sock.sendall(tune_ok() + method(0, commands.Connection.Open()))
                _read_until(sock, frames.CONNECTION_OPEN_OK, buf)
                for channel in item.channels:
                    sock.sendall(method(channel, commands.Channel.Open()))
                    _read_until(sock, frames.CHANNEL_OPEN_OK, buf)
        except (OSError, SetupFailed) as exc:
            return f"setup failed: {exc.__class__.__name__}"
        buf.clear()
        try:
            sock.sendall(item.data)
        except OSError:
            pass                    # closed while we wrote: what came back says why
        return _outcome(sock, buf)
    finally:
        sock.close()


# -- the broker's health -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Footprint:
    fixed: tuple[str, ...]        # stage processes other than queues and the fuzzed connections'
    queues: int
    transient: int                # readers and channels
    fds: int
    shm: int

    def settled_like(self, base: Footprint) -> bool:
        return (self.transient == 0 and self.fixed == base.fixed and self.queues == base.queues
                and self.fds == base.fds and self.shm == base.shm)


def footprint(broker, shm_prefix: str) -> Footprint:
    """Processes (the hosts, the store, the watchdog), the stages ``ctl status`` lists alive, the
    supervisor's descriptors and the run's shared-memory entries.

    The descriptors are counted before ``ctl status`` asks: counted after, they sometimes included the
    supervisor's end of that request's connection, not yet closed. A baseline taken with it never came
    back until a later count happened to catch the same moment (15 s for one batch, twice the test's
    usual time in all), and would have failed the test had none done so within ``SETTLE_S``."""
    pid = broker.proc.pid
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    fixed = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            fixed.append(child.name())
        except psutil.NoSuchProcess:
            continue
    alive = [n for n, p in broker.status()["processes"].items() if p.get("alive")]
    transient = sum(1 for n in alive if n.startswith(TRANSIENT_STAGES))
    queues = sum(1 for n in alive if n.startswith("queue-"))
    return Footprint(tuple(sorted(fixed)), queues, transient, fds,
                     sum(1 for n in os.listdir("/dev/shm") if shm_prefix in n))


def wait_settled(broker, shm_prefix: str, base: Footprint | None) -> tuple[Footprint, Footprint | None]:
    """Wait for the footprint to come back to ``base``; returns (the footprint, the baseline from now on).

    Without a ``base``, the first steady footprint with no fuzzed connection
    left is the baseline. Queues a fuzzed declare created stay: once the rest
    has settled with a new number of queue processes, that is the new baseline.
    """
    deadline = time.monotonic() + SETTLE_S
    last = None
    while True:
        now = footprint(broker, shm_prefix)
        if base is not None and now.settled_like(base):
            return now, base
        if now.transient == 0 and now == last and (
                base is None or (now.fixed == base.fixed and now.queues != base.queues)):
            return now, now
        if time.monotonic() > deadline:
            return now, base
        last = now
        time.sleep(0.5)


def pika_round_trip(port: int, broker, when: str) -> None:
    """A well-behaved client must still declare, publish with confirms and consume its message back
    (within ``HEALTH_TIMEOUT_S``: a broker that hangs fails here, with its log, not at the test's timeout)."""
    with ThreadPoolExecutor(1) as one:
        try:
            one.submit(_round_trip, port).result(HEALTH_TIMEOUT_S)
        except Exception as exc:
            raise AssertionError(f"{when}, a pika client could not declare, publish with confirms and consume: "
                                 f"{exc!r}\nlast log lines:\n{broker.output()[-4000:]}") from exc


def _round_trip(port: int) -> None:
    params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=3, retry_delay=1, socket_timeout=10,
                                       blocked_connection_timeout=30)
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        ch.queue_declare(HEALTH_QUEUE)
        ch.confirm_delivery()
        body = uuid.uuid4().hex.encode()
        ch.basic_publish("", HEALTH_QUEUE, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
        for method_frame, _, got in ch.consume(HEALTH_QUEUE, inactivity_timeout=15):
            assert method_frame is not None, "the health check's message never came back"
            ch.basic_ack(method_frame.delivery_tag)
            if got == body:
                break
        ch.cancel()
    finally:
        conn.close()


STAGE_DEATH = re.compile(r"had child (\S+) \(pid \d+\) exit with reason (.*)")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")   # the supervisor's, interleaved with tracebacks
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def crashes(log: str) -> list[str]:
    """The exception that ended each traceback a stage printed (a chain counted once, by its last),
    and each stage death the supervisor logged."""
    lines = log.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last):"):
            i += 1
            while i < len(lines) and (lines[i][:1] in (" ", "\t", "") or LOG_LINE.match(lines[i])):
                i += 1
            ending = lines[i] if i < len(lines) else "(cut short)"
            k = i + 1
            while k < len(lines) and (not lines[k] or LOG_LINE.match(lines[k])):
                k += 1
            if k >= len(lines) or not lines[k].startswith(CHAINED):
                out.append(ending)
        i += 1
    out += [f"{m.group(1)} exited: {m.group(2)}" for m in STAGE_DEATH.finditer(log)]
    return out


def first_tracebacks(log: str, limit: int = 2) -> str:
    starts = [m.start() for m in re.finditer(r"^Traceback \(most recent call last\):", log, re.MULTILINE)]
    return "\n".join(log[a:a + 3000] for a in starts[:limit])


# -- the test ----------------------------------------------------------------------------------------------

def test_no_malformed_input_stops_the_broker_or_leaks(broker):
    started = time.monotonic()
    pid, port = broker.proc.pid, broker.port
    shm_prefix = f"creditflow-{broker.info['run_id']}"
    # the hypothesis examples are made in two processes of their own while the broker is set up
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as makers:
        structured = structured_examples(INPUTS, makers)
        # Hosts start as stages need them and stay: a connection with a channel for each reader host the
        # pool may start (two per core) and each channel host (one per core), so all of them are running
        # before the baseline is taken, not counted as a leak later.
        conns = [pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
                 for _ in range(2 * (os.cpu_count() or 1))]
        channels = [conn.channel() for conn in conns]
        for name in (*POOL_QUEUES, HEALTH_QUEUE):
            channels[0].queue_declare(name)
        for conn in conns:
            conn.close()
        pika_round_trip(port, broker, "before any input")
        _, base = wait_settled(broker, shm_prefix, None)
        assert base is not None, "the broker never settled after the setup's connections"
        rss_before_mb = psutil.Process(pid).memory_info().rss / 2 ** 20
        inputs = generate(INPUTS, {stage: made.result() for stage, made in structured.items()})
    ready_s = time.monotonic() - started
    assert len(inputs) >= INPUTS
    outcomes: collections.Counter = collections.Counter()
    by_stage: collections.Counter = collections.Counter(item.stage for item in inputs)
    new_queue_batches = 0
    with ThreadPoolExecutor(WORKERS) as pool:
        for first in range(0, len(inputs), BATCH):
            batch = inputs[first:first + BATCH]
            outcomes.update(pool.map(lambda item: send_one(port, item), batch))
            assert broker.proc.poll() is None, (f"the broker died after input {first + len(batch)}:\n"
                                                f"{broker.output()[-6000:]}")
            pika_round_trip(port, broker, f"after {first + len(batch)} inputs")
            now, new_base = wait_settled(broker, shm_prefix, base)
            assert now.settled_like(new_base), (
                f"after {first + len(batch)} inputs the broker did not return to its baseline within "
                f"{SETTLE_S} s: now {now}, baseline {base}\nlast log lines:\n{broker.output()[-3000:]}")
            if new_base is not base:
                new_queue_batches += 1
                base = new_base

    rss_after_mb = psutil.Process(pid).memory_info().rss / 2 ** 20
    log = broker.output()
    deaths = crashes(log)
    closes = {k.split()[1]: v for k, v in sorted(outcomes.items()) if k.startswith("connection.close")}
    channel_closes = {k.split()[1]: v for k, v in sorted(outcomes.items()) if k.startswith("channel.close")}
    others = {k: v for k, v in sorted(outcomes.items()) if not k.startswith(("connection.close", "channel.close"))}
    print(f"\nfuzz: {len(inputs)} inputs ({by_stage['raw']} in place of the protocol header, {by_stage['pre']} "
          f"before authentication, {by_stage['open']} after the handshake) in {time.monotonic() - started:.0f} s "
          f"({ready_s:.0f} s setting up and generating); connection.close by reply code {closes}; channel.close {channel_closes}; "
          f"{others}; broker deaths 0; stage processes crashed {len(deaths)} {dict(collections.Counter(deaths))}; "
          f"batches that left new queues {new_queue_batches} (queue processes now {base.queues}); "
          f"supervisor RSS {rss_before_mb:.0f} -> {rss_after_mb:.0f} MiB")
    assert not deaths, (f"{len(deaths)} stage processes crashed on client input: "
                        f"{dict(collections.Counter(deaths))}\n{first_tracebacks(log)}")
