"""A minimal AMQP 0-9-1 client: blocking set-up, then non-blocking raw frames.

Set-up is synchronous request/reply on a blocking socket with a timeout::

    protocol header -> connection.start   <- start-ok (PLAIN user/password,
    capabilities connection.blocked, publisher_confirms, basic.nack,
    consumer_cancel_notify, authentication_failure_close)
    connection.tune <- tune-ok (frame_max, channel_max, heartbeat negotiated)
    connection.open -> open-ok; channel.open 1 -> open-ok
    then any of queue.declare, exchange.declare, queue.bind, basic.qos,
    basic.consume, confirm.select, each waiting for its -ok

After ``set_nonblocking`` the publisher and consumer loops own the socket:
``receive_nowait`` appends to ``buffer``, the loop walks it with
``frames.next_frame``, handles its own hot frames (deliveries, confirms)
and hands every other frame to ``handle_frame``, then calls ``discard``.
``handle_frame`` records ``connection.blocked`` / ``unblocked`` with their
times, answers and raises on ``connection.close`` and ``channel.close``, notes
``connection.close-ok`` (``close_ok``) and ignores heartbeats (their arrival
already counts as traffic).

Closing: ``close`` is the blocking handshake; a loop that must keep reading
while it closes writes ``close_frame()`` itself and waits for ``close_ok``.
The broker answers a close only after every frame sent before it, so
close-ok means it has read all of them.

Heartbeats: ``tick`` sends one when nothing was sent for half the negotiated
interval (the caller calls it only between whole frames) and raises
``ConnectionLost`` when nothing arrived for two intervals. Negotiation
follows the Java client: if either side says 0 the other's value wins,
otherwise the smaller one — except that ``heartbeat_s=0`` here turns
heartbeats off whatever the broker offers.
"""

from __future__ import annotations

import errno
import select
import socket
import time
from dataclasses import dataclass

from pamqp import commands

from ipc.errors import WouldBlock
from pipeline.amqp import frames
from pipeline.loadgen import LoadgenError

RECEIVE_CHUNK_BYTES = 256 * 1024
SETUP_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
CHANNEL = 1
PRODUCT = "creditflow-perf"
CAPABILITIES = {"connection.blocked": True, "publisher_confirms": True, "basic.nack": True,
                "consumer_cancel_notify": True, "authentication_failure_close": True}


class ClientError(LoadgenError):
    """Raised when an AMQP connection of the load generator fails (root of the client's errors)."""


class ServerClosed(ClientError):
    """Raised when the broker closed the connection or the channel (connection.close / channel.close)."""

    def __init__(self, what: str, reply_code: int, reply_text: str, class_id: int = 0, method_id: int = 0):
        super().__init__(f"broker closed the {what}: {reply_code} {reply_text}"
                         + (f" (after method {class_id}/{method_id})" if class_id else ""))
        self.what = what
        self.reply_code = reply_code
        self.reply_text = reply_text


class ConsumerCancelled(ClientError):
    """Raised when the broker cancelled our consumer (basic.cancel, e.g. its queue was deleted)."""


class ConnectionLost(ClientError):
    """Raised when the TCP connection ended without a close handshake, or the broker fell silent."""


def negotiate(client_value: int, server_value: int) -> int:
    """Tune negotiation: 0 on either side means "no limit", so the other value wins; else the smaller."""
    if client_value == 0 or server_value == 0:
        return max(client_value, server_value)
    return min(client_value, server_value)


class HeartbeatClock:
    """When to send a heartbeat and when the broker counts as gone; time is passed in (ns)."""

    __slots__ = ("interval_ns", "last_sent_ns", "last_received_ns")

    def __init__(self, interval_s: int, now_ns: int):
        self.interval_ns = interval_s * 1_000_000_000
        self.last_sent_ns = now_ns
        self.last_received_ns = now_ns

    def sent(self, now_ns: int) -> None:
        self.last_sent_ns = now_ns

    def received(self, now_ns: int) -> None:
        self.last_received_ns = now_ns

    def send_due(self, now_ns: int) -> bool:
        return bool(self.interval_ns) and now_ns - self.last_sent_ns >= self.interval_ns // 2

    def peer_silent(self, now_ns: int) -> bool:
        return bool(self.interval_ns) and now_ns - self.last_received_ns >= 2 * self.interval_ns

    def next_deadline_ns(self) -> int | None:
        """The next instant ``send_due`` or ``peer_silent`` can change; None with heartbeats off."""
        if not self.interval_ns:
            return None
        return min(self.last_sent_ns + self.interval_ns // 2, self.last_received_ns + 2 * self.interval_ns)


@dataclass(frozen=True)
class ClientStatistics:
    bytes_sent: int
    bytes_received: int
    heartbeats_sent: int
    blocked: bool
    blocked_count: int
    blocked_ns: int               # time spent blocked by the broker (connection.blocked) so far


class AmqpClient:
    """One AMQP connection to ``host:port`` (as ``user``, on ``vhost``) with channel 1 open."""

    def __init__(self, host: str, port: int, *, name: str = PRODUCT, frame_max: int = 131072,
                 heartbeat_s: int = 60, timeout_s: float = SETUP_TIMEOUT_S, clock=time.monotonic_ns,
                 user: str = "guest", password: str = "guest", vhost: str = "/"):
        self.clock = clock
        self.name = name
        self.buffer = bytearray()
        self.frame_max = frame_max
        self.heartbeat_s = heartbeat_s
        self.blocked = False
        self.blocked_events: list[tuple[int, str, str]] = []    # (ns, "blocked" | "unblocked", reason)
        self._blocked_since_ns = 0
        self._blocked_ns = 0
        self._blocked_count = 0
        self._bytes_sent = 0
        self._bytes_received = 0
        self._heartbeats_sent = 0
        self._closed = False
        self.close_ok = False        # connection.close-ok arrived (after our connection.close)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {host}:{port}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.heartbeat = HeartbeatClock(0, clock())
        try:
            self._handshake(frame_max, heartbeat_s, user, password, vhost)
        except BaseException:
            self._sock.close()
            self._closed = True
            raise

    # -- set-up (blocking) ----------------------------------------------------------------
    def _read_frame(self) -> tuple[int, int, int, int]:
        """The next whole frame in ``buffer`` as ``(type, channel, payload start, payload end)``."""
        while True:
            found = frames.next_frame(self.buffer, 0, self.frame_max)
            if found is not None:
                return found
            try:
                data = self._sock.recv(RECEIVE_CHUNK_BYTES)
            except socket.timeout:
                raise ConnectionLost("the broker did not answer in time") from None
            except OSError as exc:
                raise ConnectionLost(f"connection failed: {exc}") from None
            if not data:
                raise ConnectionLost("the broker closed the TCP connection")
            self._bytes_received += len(data)
            self.heartbeat.received(self.clock())
            self.buffer += data

    def _call(self, channel: int, method, reply: str):
        """Send ``method`` and return the pamqp reply named ``reply``, handling whatever comes first."""
        if method is not None:
            self.send_all(frames.encode_method(channel, method))
        while True:
            ftype, ch, ps, pe = self._read_frame()
            if ftype == frames.FrameType.METHOD and ch == channel:
                answer = frames.decode_method(self.buffer, ps, pe)
                if answer.name == reply:
                    self.discard(pe + 1)
                    return answer
            self.handle_frame(ftype, ch, ps, pe)
            self.discard(pe + 1)

    def _handshake(self, frame_max: int, heartbeat_s: int, user: str, password: str, vhost: str) -> None:
        self.send_all(frames.PROTOCOL_HEADER)
        start = self._call(0, None, "Connection.Start")
        mechanisms = start.mechanisms.split() if isinstance(start.mechanisms, str) else []
        if "PLAIN" not in mechanisms:
            raise ClientError(f"the broker offers no PLAIN authentication ({start.mechanisms!r})")
        props = {"product": PRODUCT, "connection_name": self.name, "capabilities": CAPABILITIES}
        self.send_all(frames.encode_method(0, commands.Connection.StartOk(
            client_properties=props, mechanism="PLAIN", response=f"\0{user}\0{password}", locale="en_US")))
        tune = self._call(0, None, "Connection.Tune")
        self.frame_max = negotiate(frame_max, tune.frame_max)
        self.heartbeat_s = negotiate(heartbeat_s, tune.heartbeat) if heartbeat_s else 0
        channel_max = negotiate(0, tune.channel_max)
        self.send_all(frames.encode_method(0, commands.Connection.TuneOk(
            channel_max=channel_max, frame_max=self.frame_max, heartbeat=self.heartbeat_s)))
        self.heartbeat = HeartbeatClock(self.heartbeat_s, self.clock())
        self._call(0, commands.Connection.Open(virtual_host=vhost), "Connection.OpenOk")
        self._call(CHANNEL, commands.Channel.Open(), "Channel.OpenOk")

    def queue_declare(self, queue: str, durable: bool = True, auto_delete: bool = False,
                      arguments: dict | None = None) -> int:
        """Declare ``queue`` (not exclusive); the number of messages it holds."""
        ok = self._call(CHANNEL, commands.Queue.Declare(queue=queue, durable=durable, auto_delete=auto_delete,
                                                        arguments=arguments or None), "Queue.DeclareOk")
        return ok.message_count

    def exchange_declare(self, exchange: str, exchange_type: str = "fanout", durable: bool = True) -> None:
        self._call(CHANNEL, commands.Exchange.Declare(exchange=exchange, exchange_type=exchange_type,
                                                      durable=durable), "Exchange.DeclareOk")

    def queue_bind(self, queue: str, exchange: str, routing_key: str = "", arguments: dict | None = None) -> None:
        self._call(CHANNEL, commands.Queue.Bind(queue=queue, exchange=exchange, routing_key=routing_key,
                                                arguments=arguments or None), "Queue.BindOk")

    def basic_qos(self, prefetch_count: int) -> None:
        self._call(CHANNEL, commands.Basic.Qos(prefetch_count=prefetch_count), "Basic.QosOk")

    def basic_consume(self, queue: str, no_ack: bool = False) -> str:
        """Start consuming ``queue``; the consumer tag the broker chose."""
        ok = self._call(CHANNEL, commands.Basic.Consume(queue=queue, no_ack=no_ack), "Basic.ConsumeOk")
        return ok.consumer_tag

    def confirm_select(self) -> None:
        self._call(CHANNEL, commands.Confirm.Select(), "Confirm.SelectOk")

    def set_nonblocking(self) -> None:
        """From here on, use the ``_nowait`` calls and wait on ``fileno()`` yourself."""
        self._sock.setblocking(False)

    # -- frames the fast loops do not handle themselves -----------------------------------
    def handle_frame(self, ftype: int, channel: int, ps: int, pe: int) -> None:
        """Act on a frame in ``buffer`` that is not a delivery or confirm: blocked, close, cancel."""
        if ftype != frames.FrameType.METHOD:
            return                                   # heartbeat, or content of a basic.return
        method = frames.decode_method(self.buffer, ps, pe)
        name = method.name
        if name == "Connection.Blocked":
            self._set_blocked(True, method.reason)
        elif name == "Connection.Unblocked":
            self._set_blocked(False, "")
        elif name == "Connection.CloseOk":
            self.close_ok = True
        elif name == "Connection.Close":
            self._reply_quietly(0, commands.Connection.CloseOk())
            self._closed = True
            raise ServerClosed("connection", method.reply_code, method.reply_text, method.class_id,
                               method.method_id)
        elif name == "Channel.Close":
            self._reply_quietly(channel, commands.Channel.CloseOk())
            raise ServerClosed(f"channel {channel}", method.reply_code, method.reply_text, method.class_id,
                               method.method_id)
        elif name == "Basic.Cancel":
            raise ConsumerCancelled(f"the broker cancelled consumer {method.consumer_tag!r}")

    def _set_blocked(self, blocked: bool, reason: str) -> None:
        now = self.clock()
        if blocked and not self.blocked:
            self._blocked_since_ns = now
            self._blocked_count += 1
        elif not blocked and self.blocked:
            self._blocked_ns += now - self._blocked_since_ns
        self.blocked = blocked
        self.blocked_events.append((now, "blocked" if blocked else "unblocked", reason))

    def take_blocked_events(self) -> list[tuple[int, str, str]]:
        events, self.blocked_events = self.blocked_events, []
        return events

    def _reply_quietly(self, channel: int, method) -> None:
        try:
            self._sock.send(frames.encode_method(channel, method))
        except OSError:
            pass

    # -- non-blocking I/O -----------------------------------------------------------------
    def fileno(self) -> int:
        return self._sock.fileno()

    def receive_nowait(self) -> int:
        """Append what the socket holds to ``buffer``; its byte count. WouldBlock when it holds nothing."""
        try:
            data = self._sock.recv(RECEIVE_CHUNK_BYTES)
        except (BlockingIOError, InterruptedError):
            raise WouldBlock("nothing to receive") from None
        except OSError as exc:
            raise ConnectionLost(f"connection failed: {exc}") from None
        if not data:
            raise ConnectionLost("the broker closed the TCP connection without connection.close")
        self.heartbeat.received(self.clock())
        self._bytes_received += len(data)
        self.buffer += data
        return len(data)

    def discard(self, end: int) -> None:
        """Forget ``buffer[:end]`` (frames the caller has handled)."""
        if end:
            del self.buffer[:end]

    def send_nowait(self, data) -> int:
        """Write as much of ``data`` as the socket takes now; WouldBlock when it takes nothing."""
        try:
            n = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            raise WouldBlock("socket send buffer full") from None
        except OSError as exc:
            raise ConnectionLost(f"connection failed: {exc}") from None
        self._bytes_sent += n
        self.heartbeat.sent(self.clock())
        return n

    def send_all(self, data, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Write all of ``data``, waiting for room; ConnectionLost if none comes in ``timeout_s``."""
        view = memoryview(data)
        deadline = time.monotonic() + timeout_s
        while view:
            try:
                n = self.send_nowait(view)
            except WouldBlock:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionLost(f"the broker read nothing for {timeout_s} s") from None
                select.select([], [self._sock], [], left)
                continue
            view = view[n:]

    def tick(self, now_ns: int) -> None:
        """Send a heartbeat if one is due (call between whole frames); raise if the broker fell silent."""
        if self.heartbeat.peer_silent(now_ns):
            raise ConnectionLost(f"no frame from the broker for {2 * self.heartbeat_s} s (missed heartbeats)")
        if self.heartbeat.send_due(now_ns):
            try:
                self.send_nowait(frames.encode_heartbeat())
                self._heartbeats_sent += 1
            except WouldBlock:
                pass                                 # the socket is full, so the broker is not idle-waiting

    def statistics(self) -> ClientStatistics:
        blocked_ns = self._blocked_ns + (self.clock() - self._blocked_since_ns if self.blocked else 0)
        return ClientStatistics(bytes_sent=self._bytes_sent, bytes_received=self._bytes_received,
                                heartbeats_sent=self._heartbeats_sent, blocked=self.blocked,
                                blocked_count=self._blocked_count, blocked_ns=blocked_ns)

    # -- closing ----------------------------------------------------------------------------
    @staticmethod
    def close_frame() -> bytes:
        """connection.close (200, a normal close), for a caller that writes it with ``send_nowait``."""
        return frames.encode_method(0, commands.Connection.Close(reply_code=200, reply_text="Goodbye",
                                                                 class_id=0, method_id=0))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """connection.close, then wait for close-ok; True if it came within ``timeout_s``.

        Waiting matters: the broker answers only after everything sent before the
        close, and closing the socket with frames still unread can reset the
        connection and make the kernel drop them.
        """
        if self._closed:
            return False
        self._closed = True
        ok = False
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(timeout_s)
            self.buffer.clear()
            self._sock.sendall(self.close_frame())
            deadline = time.monotonic() + timeout_s
            while not ok and time.monotonic() < deadline:
                data = self._sock.recv(RECEIVE_CHUNK_BYTES)
                if not data:
                    break
                self.buffer += data
                pos = 0
                while (found := frames.next_frame(self.buffer, pos)) is not None:
                    ftype, _, ps, pe = found
                    pos = pe + 1
                    if ftype == frames.FrameType.METHOD and frames.method_id(self.buffer, ps) in ((10, 51), (10, 50)):
                        ok = True                    # close-ok, or the broker's own close crossing ours
                del self.buffer[:pos]
        except (OSError, frames.FrameError):
            pass
        finally:
            self._sock.close()
        return ok

    def abort(self) -> None:
        """Drop the TCP connection without a handshake (or after one ``close_ok`` ended)."""
        self._closed = True
        self._sock.close()
