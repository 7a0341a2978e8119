"""A small AMQP 0-9-1 client for the load generator: handshake and set-up blocking, then raw frames.

Set-up (connection, channel 1, declares, qos, consume, confirm.select) uses
synchronous request/reply; after that the publisher and consumer loops own
the socket and parse frames themselves with ``frames.next_frame``. The client
announces the ``connection.blocked`` capability, so the broker tells it when
an alarm blocks it.
"""

from __future__ import annotations

import socket
import time

from pamqp import commands

from pipeline.amqp import frames

CLIENT_PROPERTIES = {
    "product": "creditflow-perf",
    "capabilities": {"connection.blocked": True, "publisher_confirms": True, "basic.nack": True,
                     "consumer_cancel_notify": True, "authentication_failure_close": True},
}


class BrokerClosed(RuntimeError):
    """Raised when the broker closed the connection or a channel (reply code and text attached)."""

    def __init__(self, reply_code: int, reply_text: str):
        super().__init__(f"{reply_code} {reply_text}")
        self.reply_code = reply_code
        self.reply_text = reply_text


class Client:
    def __init__(self, host: str, port: int, *, frame_max: int = 131072, timeout_s: float = 30.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.pos = 0
        self.channel = 1
        self.frame_max = frame_max
        self.blocked_events: list[tuple[int, str]] = []
        self._handshake(frame_max)

    # -- synchronous part ---------------------------------------------------------------
    def _send(self, channel: int, method) -> None:
        self.sock.sendall(frames.encode_method(channel, method))

    def _frame(self):
        while True:
            found = frames.next_frame(self.buf, self.pos)
            if found is not None:
                ftype, channel, ps, pe = found
                self.pos = pe + 1
                return ftype, channel, ps, pe
            if self.pos:
                del self.buf[:self.pos]
                self.pos = 0
            data = self.sock.recv(65536)
            if not data:
                raise BrokerClosed(320, "connection closed by the broker")
            self.buf += data

    def _expect(self, channel: int, name: str):
        while True:
            ftype, ch, ps, pe = self._frame()
            if ftype != frames.FrameType.METHOD:
                continue
            method = frames.decode_method(self.buf, ps, pe)
            self._note(method)
            if method.name in ("Connection.Close", "Channel.Close"):
                raise BrokerClosed(method.reply_code, method.reply_text)
            if ch == channel and method.name == name:
                return method

    def _note(self, method) -> None:
        if method.name == "Connection.Blocked":
            self.blocked_events.append((time.monotonic_ns(), "blocked:" + method.reason))
        elif method.name == "Connection.Unblocked":
            self.blocked_events.append((time.monotonic_ns(), "unblocked"))

    def _handshake(self, frame_max: int) -> None:
        self.sock.sendall(frames.PROTOCOL_HEADER)
        self._expect(0, "Connection.Start")
        self._send(0, commands.Connection.StartOk(client_properties=CLIENT_PROPERTIES, mechanism="PLAIN",
                                                  response="\0guest\0guest", locale="en_US"))
        tune = self._expect(0, "Connection.Tune")
        self.frame_max = min(frame_max, tune.frame_max or frame_max)
        self._send(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=self.frame_max,
                                                 heartbeat=0))
        self._send(0, commands.Connection.Open(virtual_host="/"))
        self._expect(0, "Connection.OpenOk")
        self._send(1, commands.Channel.Open())
        self._expect(1, "Channel.OpenOk")

    def queue_declare(self, queue: str, durable: bool) -> None:
        self._send(1, commands.Queue.Declare(queue=queue, durable=durable))
        self._expect(1, "Queue.DeclareOk")

    def confirm_select(self) -> None:
        self._send(1, commands.Confirm.Select())
        self._expect(1, "Confirm.SelectOk")

    def qos(self, prefetch: int) -> None:
        self._send(1, commands.Basic.Qos(prefetch_count=prefetch))
        self._expect(1, "Basic.QosOk")

    def consume(self, queue: str, no_ack: bool) -> str:
        self._send(1, commands.Basic.Consume(queue=queue, no_ack=no_ack))
        return self._expect(1, "Basic.ConsumeOk").consumer_tag

    def unread(self) -> bytes:
        """Bytes received but not parsed by the synchronous part (handed to the fast loop)."""
        data = bytes(self.buf[self.pos:])
        self.buf.clear()
        self.pos = 0
        return data

    def close(self, timeout_s: float = 1.0) -> None:
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(timeout_s)
            self._send(0, commands.Connection.Close(reply_code=200, reply_text="Goodbye", class_id=0, method_id=0))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                data = self.sock.recv(65536)
                if not data:
                    break
        except OSError:
            pass
        finally:
            self.sock.close()
