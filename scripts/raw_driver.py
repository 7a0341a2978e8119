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

Half-way through and when publishing stops, the driver asks the kernel
(sock_diag over netlink: the broker is on this machine) for the byte counts
of the broker's end of every connection: what it has read off each
publisher's socket and what it has written to the consumer's, each to the
byte, all in one dump a few microseconds long (the listing in /proc/net/tcp
counts bytes sent and not yet acknowledged at both ends, and readings taken
apart in time by a publisher and the consumer differed by what moved in
between). The publishers keep their sockets open until the reading at the
stop has been taken.
So a run knows what the broker itself held then: publishes it had read and
deliveries it had not yet written, wherever it keeps them (queue, mailboxes,
rings, unparsed input). With many publishers most of what they "published"
is still in the sockets' buffers, and each one's credit keeps some in
flight; a run is an *overrun* (the broker took publishes faster than it
delivered them) when what it held grew over the second half by more than a
tenth of what the consumer received in the window.

usage: scripts/raw_driver.py --port 5672 [--size 100] [--seconds 10] [--publishers 1]
                             [--persistent] [--confirm 1000] [--no-ack] [--queue NAME] [--rate MSG/S]
"""

from __future__ import annotations

import argparse
import errno
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
READ_WAIT_S = 30                             # a publisher keeps its socket open for the reading at the stop
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
        self.sent = self.received = 0       # bytes, while the connection is set up
        self.send(b"AMQP\x00\x00\x09\x01")
        self.expect("Connection.Start")
        self.send(marshal(0, commands.Connection.StartOk(
            client_properties={"product": "raw-driver", "capabilities": {"publisher_confirms": True}},
            mechanism="PLAIN", response=f"\0{user}\0{password}", locale="en_US")))
        tune = self.expect("Connection.Tune")
        self.frame_max = tune.frame_max or 131072
        self.send(marshal(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=self.frame_max,
                                                        heartbeat=0)))
        self.send(marshal(0, commands.Connection.Open(virtual_host="/")))
        self.expect("Connection.OpenOk")
        self.send(marshal(1, commands.Channel.Open()))
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
            self.received += len(data)
            self.buf += data

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)
        self.sent += len(data)

    def call(self, method, reply: str):
        self.send(marshal(1, method))
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


SOCK_DIAG = struct.Struct("=IHHII BBBxI HH32xI8x")   # nlmsghdr, inet_diag_req_v2 (sport set: the broker's)
DIAG_MSG = struct.Struct("=IHHII BBBB HH32xI 8x IIIII")  # nlmsghdr, inet_diag_msg
NLMSG_ERROR, NLMSG_DONE, SOCK_DIAG_BY_FAMILY = 2, 3, 20
INET_DIAG_INFO = 2
TCP_INFO_BYTES = struct.Struct("=QQ")          # tcp_info's tcpi_bytes_acked, tcpi_bytes_received
TCP_INFO_BYTES_AT = 120


def broker_ends(port: int) -> dict[int, tuple[int, int]]:
    """For each connection to the broker on ``port`` (by the client's port): the bytes the broker has read
    off it and written to it, from sock_diag dumps of the broker's ends, IPv4 and IPv6 (a dual-stack
    listener's end of a connection to 127.0.0.1 is IPv6): its receive count less what waits unread; its
    acknowledged bytes plus what waits to be sent or acknowledged."""
    ends: dict[int, tuple[int, int]] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)   # NETLINK_SOCK_DIAG
        try:
            nl.sendto(SOCK_DIAG.pack(SOCK_DIAG.size, SOCK_DIAG_BY_FAMILY, 0x301, 1, 0,      # request, dump
                                     family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 1 << 1,
                                     socket.htons(port), 0, 0), (0, 0))                # established only
            while _read_dump(nl.recv(1 << 16), port, ends):
                pass
        finally:
            nl.close()
    return ends


def _read_dump(data: bytes, port: int, ends: dict) -> bool:
    """Add one netlink answer's sockets to ``ends``; False once the dump is done."""
    at = 0
    while at < len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if kind == NLMSG_DONE:
            return False
        if kind == NLMSG_ERROR:
            raise OSError(-struct.unpack_from("=i", data, at + 16)[0], "the kernel refused the dump")
        *_, sport, dport, _, _, unread, unsent, _, _ = DIAG_MSG.unpack_from(data, at)
        attr, end = at + DIAG_MSG.size, at + length
        while attr < end:
            size, attr_kind = struct.unpack_from("=HH", data, attr)
            if attr_kind == INET_DIAG_INFO and socket.ntohs(sport) == port:
                if size - 4 < TCP_INFO_BYTES_AT + TCP_INFO_BYTES.size:
                    raise OSError(errno.ENOTSUP, "the kernel's tcp_info has no byte counts (Linux 4.1 has)")
                acked, received = TCP_INFO_BYTES.unpack_from(data, attr + 4 + TCP_INFO_BYTES_AT)
                ends[socket.ntohs(dport)] = (received - unread, acked + unsent)
            attr += (size + 3) & ~3
        at += (length + 3) & ~3
    return True


def publisher(port: int, queue: str, size: int, persistent: bool, confirm: int, start: float, stop: float,
              counts, rate: float | None = None, board=None, index: int = 0, read=None) -> None:
    """``board[BOARD_SLOTS * index:]``: this publisher's local port, bytes of one publish and bytes it sent
    setting up the connection, for the readings of what the broker holds (``held_now``); the socket stays
    open until ``read`` is set, so the reading at the stop still finds it."""
    conn = Connection(port)
    if confirm:
        conn.call(commands.Confirm.Select(), "Confirm.SelectOk")
    per = min(BATCH, confirm) if confirm else BATCH     # a batch never exceeds the confirm window
    batch = publishes(queue, size, persistent, conn.frame_max, per)
    view = memoryview(batch)                 # what a partial send left goes on without a copy
    one = len(batch) / per                   # bytes of one publish on the wire
    sock = conn.sock
    at = BOARD_SLOTS * index
    if board is not None:                    # the port last: a port on the board says the rest is there
        board[at + 1], board[at + 2] = int(one), conn.sent
        board[at] = sock.getsockname()[1]
    # A send waits at most this long, so a publisher held back by the broker still notices the half-way
    # mark and the stop in time, and counts what the kernel took to the byte.
    sock.settimeout(SEND_WAIT_S)
    while time.time() < start:
        time.sleep(0.001)
    sent = confirmed = 0                     # publishes wholly handed to the kernel
    pending = 0
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
    finally:                                 # reported whatever happened: the run waits for it
        counts.put(("sent", sent, closed))
        if read is not None:
            read.wait(READ_WAIT_S)
        sock.close()


BOARD_SLOTS = 3                              # a publisher's local port, bytes of one publish, of its set-up
SEEN_SLOTS = 3                               # the consumer's local port, bytes of its set-up, of one delivery


def held_now(board, publishers: int, seen, port: int) -> int:
    """Messages the broker holds at this instant: publishes it has read off the publishers' sockets less
    deliveries it has written to the consumer's (``broker_ends``: one dump for every connection)."""
    ends = broker_ends(port)
    taken = 0
    for at in range(0, BOARD_SLOTS * publishers, BOARD_SLOTS):
        local, one, setup = board[at:at + BOARD_SLOTS]
        if local in ends:                    # a publisher that has not connected has sent nothing
            taken += (ends[local][0] - setup) // one
    local, setup, one = seen[:]
    written = (ends[local][1] - setup) // one if local in ends and one else 0
    return max(0, taken - written)


def consumer(port: int, queue: str, no_ack: bool, ready, start: float, stop: float, counts, seen) -> None:
    """``seen``: this consumer's local port, bytes it received setting up the connection and bytes of one
    delivery (once one came), for the readings of what the broker holds (``held_now``)."""
    conn = Connection(port)
    # auto-delete: the queue goes with this consumer, so no run leaves a backlog behind for the next
    conn.call(commands.Queue.Declare(queue=queue, durable=True, auto_delete=True), "Queue.DeclareOk")
    conn.call(commands.Basic.Consume(queue=queue, no_ack=no_ack), "Basic.ConsumeOk")
    sock = conn.sock
    sock.settimeout(0.2)
    buf = conn.buf
    delivered = in_window = 0
    last_tag = acked = 0
    parsed, first_at = 0, None               # bytes parsed before ``buf``; where the first delivery began
    seen[1] = conn.received - len(buf)       # the port last: a port on the board says the rest is there
    seen[0] = sock.getsockname()[1]
    ready.set()
    while time.time() < stop + 2:
        try:
            data = sock.recv(CHUNK)
        except socket.timeout:
            continue
        if not data:
            break
        buf += data
        found, used = frames_in(buf)
        now = time.time()
        for ftype, _, ps, pe in found:
            if ftype == 1 and buf[ps:ps + 4] == DELIVER:
                if not seen[2]:              # every delivery the same size: from one start to the next
                    if first_at is not None:
                        seen[2] = parsed + ps - first_at
                    first_at = parsed + ps
                delivered += 1
                if start <= now < stop:
                    in_window += 1
                # basic.deliver: consumer tag (shortstr), then the u64 delivery tag
                last_tag = struct.unpack_from(">Q", buf, ps + 5 + buf[ps + 4])[0]
        del buf[:used]
        parsed += used
        if not no_ack and last_tag > acked:     # a tag acked twice is a channel error (406 unknown delivery tag)
            sock.sendall(marshal(1, commands.Basic.Ack(delivery_tag=last_tag, multiple=True)))
            acked = last_tag
    counts.put(("delivered", in_window))
    counts.put(("delivered_by_end", delivered))
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
    try:
        broker_ends(port)                   # the readings of what the broker holds need it: asked first
    except OSError as exc:
        raise SystemExit(f"raw driver: the kernel does not give sockets' byte counts (sock_diag): {exc}")
    ctx = multiprocessing.get_context("fork")
    counts, ready, read = ctx.Queue(), ctx.Event(), ctx.Event()
    start = time.time() + 2.0
    stop = start + seconds
    seen = ctx.RawArray("q", SEEN_SLOTS)
    procs = [ctx.Process(target=consumer, args=(port, queue, no_ack, ready, start, stop, counts, seen))]
    procs[0].start()
    if not ready.wait(30):
        raise SystemExit("raw driver: the consumer did not start")
    try:
        if seen[0] not in broker_ends(port):
            raise OSError(errno.ENOENT, "the consumer's connection is not in it")
    except OSError as exc:
        procs[0].kill()
        raise SystemExit(f"raw driver: the kernel's dump of the broker's sockets will not do: {exc}")
    each = rate / publishers if rate else None
    board = ctx.RawArray("q", BOARD_SLOTS * publishers)
    procs += [ctx.Process(target=publisher, args=(port, queue, size, persistent, confirm, start, stop, counts, each,
                                                  board, i, read))
              for i in range(publishers)]
    procs.append(ctx.Process(target=depth_sampler, args=(port, queue, start, stop, counts)))
    for p in procs[1:]:
        p.start()
    # What the broker held (read off the publishers' sockets, not yet written to the consumer's; wherever
    # it keeps it: queue, mailboxes, rings, unparsed input) half-way through and when publishing stopped.
    # Each publisher's credit keeps some in flight, so what tells a growing backlog is the difference.
    held, failed = [], None
    try:
        for mark in ((start + stop) / 2, stop):
            time.sleep(max(0.0, mark - time.time()))
            held.append(held_now(board, publishers, seen, port))
    except OSError as exc:
        failed = f"raw driver: the kernel's dump of the broker's sockets failed: {exc}"
    finally:
        read.set()                          # the publishers close their sockets
    got: dict = {}
    closed = []
    for _ in range(len(procs) + 2):         # each publisher reports once, the consumer and the sampler twice
        kind, n, *why = counts.get(timeout=seconds + 60)
        got[kind] = got.get(kind, 0) + n
        if why and why[0]:
            closed.append(why[0])
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if closed:                              # what it sent after that was never taken: no rate to give
        raise SystemExit(f"raw driver: the broker closed a publisher: {closed[0]}")
    if failed:
        raise SystemExit(failed)
    sent, delivered = got.get("sent", 0), got.get("delivered", 0)
    held_mid, held_stop = held
    return {"deliver_rate": delivered / seconds, "publish_rate": sent / seconds,
            "depth_max": got.get("depth_max", 0), "depth_end": got.get("depth_end", 0),
            "held_mid": held_mid, "held_at_stop": held_stop,
            # over the second half what the broker held grew by more than OVERRUN of what the window
            # delivered: it took publishes faster than it delivered them, so the deliver rate is what a
            # starved consumer got, not the broker's throughput
            "overrun": held_stop - held_mid > OVERRUN * max(1, delivered)}


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
