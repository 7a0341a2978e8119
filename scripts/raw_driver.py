#!/usr/bin/env python3
"""A minimal AMQP 0-9-1 load driver, written apart from creditflow's load generator.

One publisher process writes the same pre-encoded publishes (encoded once with
pamqp) as fast as the socket takes them, optionally in confirm mode with a
window of unconfirmed publishes; one consumer process reads and counts
basic.deliver frames without parsing anything else, acknowledging with one
multiple ack per socket read (or consuming with no-ack). The figure is the
consumer's deliveries during the publishing window, per second. Nothing of
``pipeline.loadgen`` is used, so a broker's ratio against another does not
depend on which load generator favours which. A publisher looks, without
waiting, for a close from the broker before each batch: if its channel or
connection was closed the run ends with the broker's reply (exit 1), not
with a rate counting publishes the broker discarded. A third connection asks
for the queue's depth (a passive queue.declare) four times a second.

Half-way through and when publishing stops, the driver reads how many bytes
wait in the kernel on both ends of the publishers' and the consumer's
connections (/proc/net/tcp: the broker is on this machine; half-way, one read
for all the publishers, whose bytes sent are kept on a shared board, since
the kernel's listing costs milliseconds with a few hundred sockets and a read
in each of a hundred publishers took CPU inside the measured window), so a run knows what the broker
itself held then: what it had read off the publishers' sockets and not yet
written to the consumer's, wherever it keeps it (queue, mailboxes, rings,
unparsed input). With many publishers most of what they "published" is still
in the sockets' buffers, and each one's credit keeps some in flight; a run is
an *overrun* (the broker took publishes faster than it delivered them) when
what it held grew over the second half by more than a tenth of what the
consumer received in the window.

usage: scripts/raw_driver.py --port 5672 [--size 100] [--seconds 10] [--publishers 1]
                             [--persistent] [--confirm 1000] [--no-ack] [--queue NAME] [--rate MSG/S]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import socket
import struct
import sys
import time

from pamqp import commands, frame, header, body as pbody
from pamqp import heartbeat as _heartbeat  # noqa: F401  (pamqp needs it loaded to unmarshal heartbeats)

FRAME_HEAD = struct.Struct(">BHI")
DELIVER = struct.pack(">HH", 60, 60)
ACK = struct.pack(">HH", 60, 80)
CLOSES = (struct.pack(">HH", 10, 50), struct.pack(">HH", 20, 40))     # connection.close, channel.close
CHUNK = 1 << 18
BATCH = 64
OVERRUN = 0.10
SEND_WAIT_S = 0.05
DEPTH_EVERY_S = 0.25


def marshal(channel: int, obj) -> bytes:
    return frame.marshal(obj, channel)


def frames_in(buf: bytes | bytearray, pos: int = 0):
    """(type, channel, payload start, payload end) of each whole frame from ``pos``; and where they end."""
    out = []
    size = len(buf)
    while pos + 7 <= size:
        ftype, channel, length = FRAME_HEAD.unpack_from(buf, pos)
        end = pos + 7 + length
        if end + 1 > size:
            break
        out.append((ftype, channel, pos + 7, end))
        pos = end + 1
    return out, pos


class Connection:
    def __init__(self, port: int, user: str = "guest", password: str = "guest"):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self.expect("Connection.Start")
        self.sock.sendall(marshal(0, commands.Connection.StartOk(
            client_properties={"product": "raw-driver", "capabilities": {"publisher_confirms": True}},
            mechanism="PLAIN", response=f"\0{user}\0{password}", locale="en_US")))
        tune = self.expect("Connection.Tune")
        self.frame_max = tune.frame_max or 131072
        self.sock.sendall(marshal(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=self.frame_max,
                                                                heartbeat=0)))
        self.sock.sendall(marshal(0, commands.Connection.Open(virtual_host="/")))
        self.expect("Connection.OpenOk")
        self.sock.sendall(marshal(1, commands.Channel.Open()))
        self.expect("Channel.OpenOk")

    def expect(self, name: str):
        while True:
            found, used = frames_in(self.buf)
            if found:
                ftype, _, ps, pe = found[0]
                _, _, obj = frame.unmarshal(bytes(self.buf[ps - 7:pe + 1]))
                del self.buf[:pe + 1]
                if obj.name == name:
                    return obj
                if obj.name in ("Connection.Close", "Channel.Close"):
                    raise SystemExit(f"raw driver: broker closed: {obj.reply_code} {obj.reply_text}")
                continue
            data = self.sock.recv(CHUNK)
            if not data:
                raise SystemExit("raw driver: broker closed the connection")
            self.buf += data

    def call(self, method, reply: str):
        self.sock.sendall(marshal(1, method))
        return self.expect(reply)


def publishes(queue: str, size: int, persistent: bool, frame_max: int, count: int) -> bytes:
    """``count`` complete publishes of a ``size``-byte body, back to back."""
    props = commands.Basic.Properties(delivery_mode=2 if persistent else 1)
    body = b"\0" * size
    one = marshal(1, commands.Basic.Publish(exchange="", routing_key=queue))
    one += marshal(1, header.ContentHeader(0, size, props))
    step = frame_max - 8
    for i in range(0, size, step):
        one += marshal(1, pbody.ContentBody(body[i:i + step]))
    return one * count


def close_reply(buf, ps: int) -> str | None:
    """The reply code and text of the method frame whose payload starts at ``ps``, if it is a
    connection.close or channel.close; else None."""
    if bytes(buf[ps:ps + 4]) not in CLOSES:
        return None
    code = struct.unpack_from(">H", buf, ps + 4)[0]
    return f"{code} {bytes(buf[ps + 7:ps + 7 + buf[ps + 6]]).decode('utf-8', 'replace')}"


def closed_in(buf: bytearray) -> str | None:
    """The reply of a connection.close or channel.close among the whole frames in ``buf`` (which are
    consumed), else None; ``buf`` keeps an incomplete frame for the next read."""
    found, used = frames_in(buf)
    reason = None
    for ftype, _, ps, pe in found:
        if ftype == 1 and reason is None:
            reason = close_reply(buf, ps)
    del buf[:used]
    return reason


def broker_closed(sock, buf: bytearray) -> str | None:
    """Whether the broker has closed the publisher's channel or connection, read without waiting: a
    publisher that never reads would go on counting publishes the broker only discards."""
    if not select.select([sock], [], [], 0)[0]:
        return None
    try:
        data = sock.recv(CHUNK)
    except (BlockingIOError, TimeoutError):
        return None
    except OSError as exc:
        return f"the connection failed: {exc}"
    if not data:
        return "the broker closed the connection"
    buf += data
    return closed_in(buf)


def end_key(host: str, port: int) -> str:
    """How /proc/net/tcp names an IPv4 end."""
    return f"{int.from_bytes(socket.inet_aton(host), sys.byteorder):08X}:{port:04X}"


def loopback_ends(sock) -> tuple[str, str]:
    """How /proc/net/tcp names this end and the peer's of an IPv4 connection (read once: a reset socket
    has no peer name any more)."""
    return end_key(*sock.getsockname()[:2]), end_key(*sock.getpeername()[:2])


def socket_queues(ends: tuple[str, str]) -> dict[str, int]:
    """Bytes waiting in the kernel on both ends of a loopback TCP connection (``loopback_ends``), from
    /proc/net/tcp: what this side wrote and the peer has not read (``to_peer``: our send queue and its
    receive queue), and what the peer wrote and we have not read (``from_peer``). Zeros where the lines
    are not found (a connection already gone)."""
    return socket_queues_of([ends])[0]


def socket_queues_of(ends_list: list[tuple[str, str]]) -> list[dict[str, int]]:
    """``socket_queues`` of many connections from one read of /proc/net/tcp (the kernel's listing of every
    socket costs milliseconds with a few hundred of them: read once, not once a connection)."""
    outs = [{"to_peer": 0, "from_peer": 0} for _ in ends_list]
    index = {}
    for out, (mine, theirs) in zip(outs, ends_list):
        index[(mine, theirs)] = (out, "to_peer", "from_peer")
        index[(theirs, mine)] = (out, "from_peer", "to_peer")
    try:
        with open("/proc/net/tcp") as f:
            lines = f.readlines()[1:]
    except OSError:
        return outs
    for line in lines:
        fields = line.split()
        found = index.get((fields[1], fields[2]))
        if found is not None:
            out, tx_key, rx_key = found
            tx, rx = (int(v, 16) for v in fields[4].split(":"))
            out[tx_key] += tx
            out[rx_key] += rx
    return outs


def publisher(port: int, queue: str, size: int, persistent: bool, confirm: int, start: float, stop: float,
              counts, rate: float | None = None, board=None, index: int = 0) -> None:
    """``board[BOARD_SLOTS * index:]``: this publisher's local port, bytes of one publish and bytes the
    kernel has taken so far, kept current for the half-way reading (``taken_by_publishers``)."""
    conn = Connection(port)
    if confirm:
        conn.call(commands.Confirm.Select(), "Confirm.SelectOk")
    per = min(BATCH, confirm) if confirm else BATCH     # a batch never exceeds the confirm window
    batch = publishes(queue, size, persistent, conn.frame_max, per)
    view = memoryview(batch)                 # what a partial send left goes on without a copy
    one = len(batch) / per                   # bytes of one publish on the wire
    sock = conn.sock
    ends = loopback_ends(sock)
    at = BOARD_SLOTS * index
    if board is not None:                    # the port last: a port on the board says the rest is there
        board[at + 1] = int(one)
        board[at] = sock.getsockname()[1]
    # A send waits at most this long, so a publisher held back by the broker still notices the half-way
    # mark and the stop in time, and counts what the kernel took to the byte.
    sock.settimeout(SEND_WAIT_S)
    while time.time() < start:
        time.sleep(0.001)
    sent = confirmed = 0                     # publishes wholly handed to the kernel
    sent_bytes = pending = 0
    buf = bytearray()
    closed = None
    gap = per / rate if rate else 0.0        # paced: a batch every gap seconds, no catching up after a stall
    due = start
    try:
        while True:
            now = time.time()
            if now >= stop:
                break
            if pending:
                try:
                    n = sock.send(view[len(batch) - pending:])
                except socket.timeout:
                    continue
                sent_bytes += n
                if board is not None:
                    board[at + 2] = sent_bytes
                pending -= n
                if not pending:
                    sent += per
                continue
            if confirm and sent - confirmed + per > confirm:
                try:
                    data = sock.recv(CHUNK)
                except socket.timeout:
                    continue
                if not data:
                    closed = "the broker closed the connection"
                    break
                buf += data
                found, used = frames_in(buf)
                for ftype, _, ps, pe in found:
                    if ftype == 1:
                        if buf[ps:ps + 4] == ACK:
                            confirmed = struct.unpack_from(">Q", buf, ps + 4)[0]
                        elif closed is None:
                            closed = close_reply(buf, ps)
                del buf[:used]
                if closed:
                    break
                continue
            closed = broker_closed(sock, buf)
            if closed:
                break
            if gap:
                if now < due:
                    time.sleep(due - now)
                due = max(due + gap, time.time() - gap)
            pending = len(batch)
    except OSError as exc:                   # reset, broken pipe: the run ends with the reason
        closed = closed or f"the connection failed: {exc}"
    finally:                                 # reported whatever happened: the run waits for both
        counts.put(("sent", sent, closed))
        counts.put(("taken", taken_by_broker(ends, sent_bytes, one)))
        sock.close()


def taken_by_broker(ends: tuple[str, str], sent_bytes: int, one: float) -> int:
    """Publishes the broker has read off this connection: what the kernel took from us less what still
    waits in the buffers of either end."""
    return int(max(0, sent_bytes - socket_queues(ends)["to_peer"]) // one)


BOARD_SLOTS = 3                              # a publisher's local port, bytes of one publish, bytes sent


def taken_by_publishers(board, publishers: int, port: int) -> int:
    """``taken_by_broker`` summed over every publisher on ``board``, from one read of /proc/net/tcp (a
    read in each of a hundred publishers, inside the window the figures come from, took CPU from both the
    broker and the rates). Publishers go on sending meanwhile: each one's bytes sent is the mean of what
    it showed before and after the read."""
    before = board[:]
    ends, at = [], []
    for i in range(publishers):
        local = before[BOARD_SLOTS * i]
        if local:                            # a publisher that has not connected has sent nothing
            ends.append((end_key("127.0.0.1", local), end_key("127.0.0.1", port)))
            at.append(BOARD_SLOTS * i)
    queues = socket_queues_of(ends)
    after = board[:]
    taken = 0
    for j, q in zip(at, queues):
        sent = (before[j + 2] + after[j + 2]) / 2
        taken += int(max(0, sent - q["to_peer"]) // before[j + 1])
    return taken


def consumer(port: int, queue: str, no_ack: bool, ready, start: float, stop: float, counts) -> None:
    conn = Connection(port)
    # auto-delete: the queue goes with this consumer, so no run leaves a backlog behind for the next
    conn.call(commands.Queue.Declare(queue=queue, durable=True, auto_delete=True), "Queue.DeclareOk")
    conn.call(commands.Basic.Consume(queue=queue, no_ack=no_ack), "Basic.ConsumeOk")
    ready.set()
    sock = conn.sock
    ends = loopback_ends(sock)
    sock.settimeout(0.2)
    buf = conn.buf
    delivered = in_window = 0
    last_tag = acked = 0
    got_bytes = 0
    # delivered half-way through and at the stop, counting what was on its way in the sockets then
    marks, passed = [(start + stop) / 2, stop], []
    while time.time() < stop + 2:
        if len(passed) < len(marks) and time.time() >= marks[len(passed)]:
            waiting = socket_queues(ends)["from_peer"] + len(buf)
            passed.append(delivered + (waiting * delivered // got_bytes if got_bytes else 0))
        try:
            data = sock.recv(CHUNK)
        except socket.timeout:
            continue
        if not data:
            break
        buf += data
        got_bytes += len(data)
        found, used = frames_in(buf)
        now = time.time()
        for ftype, _, ps, pe in found:
            if ftype == 1 and buf[ps:ps + 4] == DELIVER:
                delivered += 1
                if start <= now < stop:
                    in_window += 1
                # basic.deliver: consumer tag (shortstr), then the u64 delivery tag
                last_tag = struct.unpack_from(">Q", buf, ps + 5 + buf[ps + 4])[0]
        del buf[:used]
        if not no_ack and last_tag > acked:     # a tag acked twice is a channel error (406 unknown delivery tag)
            sock.sendall(marshal(1, commands.Basic.Ack(delivery_tag=last_tag, multiple=True)))
            acked = last_tag
    counts.put(("delivered", in_window))
    counts.put(("delivered_by_end", delivered))
    passed += [delivered] * (len(marks) - len(passed))
    counts.put(("written", (passed[1], passed[0])))
    sock.close()


def depth_sampler(port: int, queue: str, start: float, stop: float, counts) -> None:
    """The queue's ready messages every DEPTH_EVERY_S of the publishing window, asked with a passive
    queue.declare on a connection of its own (any broker answers it); reports the largest and the last."""
    deepest = last = 0
    try:
        conn = Connection(port)
        while time.time() < start:
            time.sleep(0.01)
        while time.time() < stop:
            last = conn.call(commands.Queue.Declare(queue=queue, passive=True), "Queue.DeclareOk").message_count
            deepest = max(deepest, last)
            time.sleep(DEPTH_EVERY_S)
        conn.sock.close()
    finally:                                # reported even if the broker closed it: the run waits for these
        counts.put(("depth_max", deepest))
        counts.put(("depth_end", last))


def run(port: int, size: int = 100, seconds: float = 10, publishers: int = 1, persistent: bool = False,
        confirm: int = 0, no_ack: bool = False, queue: str | None = None, rate: float | None = None) -> dict:
    """One run; ``deliver_rate`` is what the consumer received during the publishing window, per second;
    ``depth_max`` the most messages the queue held ready when sampled during it, ``depth_end`` the last
    sample. ``rate``: all publishers together publish at most this many messages a second (None: as fast
    as the socket takes them)."""
    queue = queue or f"raw-{os.getpid()}-{time.time_ns() % 10**9}"
    ctx = multiprocessing.get_context("fork")
    counts, ready = ctx.Queue(), ctx.Event()
    start = time.time() + 2.0
    stop = start + seconds
    procs = [ctx.Process(target=consumer, args=(port, queue, no_ack, ready, start, stop, counts))]
    procs[0].start()
    if not ready.wait(30):
        raise SystemExit("raw driver: the consumer did not start")
    each = rate / publishers if rate else None
    board = ctx.RawArray("q", BOARD_SLOTS * publishers)
    procs += [ctx.Process(target=publisher, args=(port, queue, size, persistent, confirm, start, stop, counts, each,
                                                  board, i))
              for i in range(publishers)]
    procs.append(ctx.Process(target=depth_sampler, args=(port, queue, start, stop, counts)))
    for p in procs[1:]:
        p.start()
    time.sleep(max(0.0, (start + stop) / 2 - time.time()))
    taken_mid = taken_by_publishers(board, publishers, port)
    got: dict = {}
    closed = []
    for _ in range(2 * len(procs) + 1):     # each publisher and the sampler report twice, the consumer thrice
        kind, n, *why = counts.get(timeout=seconds + 60)
        if type(n) is tuple:                # (at the stop, half-way)
            got[kind] = tuple(map(sum, zip(got.get(kind, (0, 0)), n)))
        else:
            got[kind] = got.get(kind, 0) + n
        if why and why[0]:
            closed.append(why[0])
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if closed:                              # what it sent after that was never taken: no rate to give
        raise SystemExit(f"raw driver: the broker closed a publisher: {closed[0]}")
    sent, delivered = got.get("sent", 0), got.get("delivered", 0)
    # What the broker held (read off the publishers' sockets, not yet written to the consumer's; wherever
    # it keeps it: queue, mailboxes, rings, unparsed input) half-way through and when publishing stopped.
    # Each publisher's credit keeps some in flight, so what tells a growing backlog is the difference.
    taken_stop, (written_stop, written_mid) = got.get("taken", 0), got.get("written", (0, 0))
    held_mid, held = max(0, taken_mid - written_mid), max(0, taken_stop - written_stop)
    return {"deliver_rate": delivered / seconds, "publish_rate": sent / seconds,
            "depth_max": got.get("depth_max", 0), "depth_end": got.get("depth_end", 0),
            "held_mid": held_mid, "held_at_stop": held,
            # over the second half what the broker held grew by more than OVERRUN of what the window
            # delivered: it took publishes faster than it delivered them, so the deliver rate is what a
            # starved consumer got, not the broker's throughput
            "overrun": held - held_mid > OVERRUN * max(1, delivered)}


def number(kind, low, *, above: bool = False):
    """An argparse type: ``kind`` of ``low`` or more (greater than ``low`` with ``above``); argparse exits 2
    with the reason otherwise."""
    def parse(text: str):
        value = kind(text)
        if value < low or above and value == low:
            raise argparse.ArgumentTypeError(f"{text} is {'not above' if above else 'below'} {low}")
        return value
    parse.__name__ = kind.__name__          # argparse's "invalid int value" names it
    return parse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=number(int, 1), required=True)
    ap.add_argument("--size", type=number(int, 0), default=100)
    ap.add_argument("--seconds", type=number(float, 0, above=True), default=10)
    ap.add_argument("--publishers", type=number(int, 1), default=1)
    ap.add_argument("--persistent", action="store_true")
    ap.add_argument("--confirm", type=number(int, 0), default=0,
                    help="unconfirmed publishes at most (0: no confirms); under 64, one batch waits for the last")
    ap.add_argument("--no-ack", action="store_true")
    ap.add_argument("--queue", default=None)
    ap.add_argument("--rate", type=number(float, 0, above=True), default=None,
                    help="msg/s of all publishers together (default: unpaced)")
    a = ap.parse_args()
    res = run(a.port, a.size, a.seconds, a.publishers, a.persistent, a.confirm, a.no_ack, a.queue, a.rate)
    # what the publishers wrote into their sockets: with many publishers most of it waits in the kernel
    print(f"delivered {res['deliver_rate']:,.0f} msg/s, written to the sockets {res['publish_rate']:,.0f} msg/s, "
          f"queue depth at most {res['depth_max']:,} (last sample {res['depth_end']:,}), held by the broker "
          f"{res['held_mid']:,} half-way and {res['held_at_stop']:,} at the stop"
          + (" (its backlog grew)" if res["overrun"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
