"""The server side of one AMQP 0-9-1 connection, sans-IO (no socket, no clock).

The reader feeds it bytes (``receive_data``) and asks for one event at a
time (``next_event``); it never parses ahead, so a reader that is blocked
simply stops asking and the rest stays unparsed. Replies it produces itself
(handshake, heartbeats, close handshakes) and frames the reader asks it to
send accumulate in ``data_to_send``.

Connection states::

    awaiting_header --header--> starting --start-ok--> tuning --tune-ok--> opening
        --open--> open --close (either side)--> closing --close-ok--> closed

Channels: open, closing-by-server (we sent channel.close; everything but
close/close-ok is dropped until the client's close-ok), closing-by-client
(the reader answers with ``close_channel_ok`` once the channel's process
has stopped). A content-bearing method (basic.publish) starts an assembly on
its channel that its header and body frames complete; anything else on that
channel in between is UNEXPECTED_FRAME.
"""

from __future__ import annotations

from dataclasses import dataclass

from pamqp import commands

from pipeline.amqp import errors as E
from pipeline.amqp import frames
from pipeline.amqp.errors import AmqpError, ChannelLevelError, ConnectionLevelError, FrameError

PRODUCT = "creditflow"
VERSION = "0.1.0"
_COMPACT_BYTES = 1 << 16

CHANNEL_OPEN = (20, 10)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)


class Publish:
    """A whole message published on ``channel`` (created per message; keep it cheap)."""

    __slots__ = ("channel", "exchange_b", "routing_key_b", "mandatory", "props_raw", "body", "delivery_mode")

    def __init__(self, channel, exchange_b, routing_key_b, mandatory, props_raw, body, delivery_mode):
        self.channel = channel
        self.exchange_b = exchange_b
        self.routing_key_b = routing_key_b
        self.mandatory = mandatory
        self.props_raw = props_raw
        self.body = body
        self.delivery_mode = delivery_mode

    @property
    def exchange(self) -> str:
        return self.exchange_b.decode("utf-8")

    @property
    def routing_key(self) -> str:
        return self.routing_key_b.decode("utf-8")


@dataclass(frozen=True, slots=True)
class Opened:
    vhost: str
    user: str
    client_properties: dict


@dataclass(frozen=True, slots=True)
class ChannelOpen:
    channel: int


@dataclass(frozen=True, slots=True)
class ChannelClose:
    channel: int
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class ChannelCloseOk:
    channel: int


@dataclass(frozen=True, slots=True)
class Method:
    channel: int
    class_id: int
    method_id: int
    payload: bytes
    method: object


@dataclass(frozen=True, slots=True)
class CloseRequested:
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class Closed:
    reason: str


@dataclass(frozen=True, slots=True)
class ProtocolError:
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class HeartbeatTimeout:
    pass


@dataclass(frozen=True)
class ConnectionStatistics:
    state: str
    bytes_in: int
    bytes_out: int
    frames_in: int
    publishes: int
    open_channels: int
    unparsed_bytes: int


class _Assembly:
    __slots__ = ("exchange", "routing_key", "mandatory", "size", "props_raw", "parts", "got", "oversized")

    def __init__(self, exchange, routing_key, mandatory):
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.size = -1
        self.props_raw = b""
        self.parts: list = []
        self.got = 0
        self.oversized = False


class ServerConnection:
    def __init__(self, *, node_name: str = "creditflow@localhost", heartbeat_s: int = 60,
                 frame_max: int = 131072, channel_max: int = 2047, max_message_bytes: int = 16 * 1024 * 1024,
                 users=None, now_ns: int = 0, refuse_open: str | None = None):
        self.node_name = node_name
        self.refuse_open = refuse_open      # reply text for a 530 in place of open-ok (over a limit)
        self.server_heartbeat_s = heartbeat_s
        self.server_frame_max = frame_max
        self.server_channel_max = channel_max
        self.max_message_bytes = max_message_bytes
        self.users = dict(users or {"guest": "guest"})
        self.state = "awaiting_header"
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat_s = 0
        self.client_properties: dict = {}
        self.capabilities: dict = {}
        self.user: str | None = None
        self.vhost: str | None = None
        self._buf = bytearray()
        self._pos = 0
        self._out: list[bytes] = []
        self._eof = False
        self._channels: set[int] = set()
        self._server_closing: set[int] = set()
        self._client_closing: set[int] = set()
        self._assembly: dict[int, _Assembly] = {}
        self._last_in_ns = now_ns
        self._last_out_ns = now_ns
        self._monitor_paused = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.frames_in = 0
        self.publishes = 0

    # -- bytes in and out ---------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        self._buf += data
        self.bytes_in += len(data)

    def data_to_send(self) -> bytes:
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        self.bytes_out += len(data)
        return data

    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos

    @property
    def open_channels(self) -> frozenset[int]:
        return frozenset(self._channels)

    def _send(self, data: bytes) -> None:
        self._out.append(data)

    def _method(self, channel: int, method) -> None:
        self._out.append(frames.encode_method(channel, method))

    # -- parsing ----------------------------------------------------------------------------
    def next_event(self, now_ns: int):
        while True:
            if self.state == "closed":
                return None
            if self._pos >= _COMPACT_BYTES:
                self._compact()
            buf = self._buf
            pos = self._pos
            if self.state == "awaiting_header":
                if len(buf) < 8:
                    return Closed("peer closed before the protocol header") if self._eof else None
                header = bytes(buf[:8])
                self._pos = 8
                self._compact()
                if header != frames.PROTOCOL_HEADER:
                    self._send(frames.PROTOCOL_HEADER)
                    self.state = "closed"
                    return ProtocolError(E.FRAME_ERROR, f"bad protocol header {header!r}")
                self.state = "starting"
                self._send_start()
                continue
            try:
                found = frames.next_frame(buf, pos, self.frame_max)
            except FrameError as err:
                return self._hard(err)
            if found is None:
                if self._eof:
                    self.state = "closed"
                    return Closed("peer closed the connection")
                return None
            ftype, channel, ps, pe = found
            self._pos = pe + 1
            self.frames_in += 1
            self._last_in_ns = now_ns
            try:
                event = self._frame(ftype, channel, buf, ps, pe)
            except ChannelLevelError as err:
                self.close_channel(channel, err.reply_code, err.reply_text, err.class_id, err.method_id)
                continue
            except AmqpError as err:
                return self._hard(err)
            if event is not None:
                return event

    def _compact(self) -> None:
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0

    def _hard(self, err: AmqpError):
        if self.state in ("closing", "closed"):
            return None
        self.close(err.reply_code, err.reply_text, err.class_id, err.method_id)
        return ProtocolError(err.reply_code, err.reply_text)

    def _frame(self, ftype: int, channel: int, buf, ps: int, pe: int):
        if ftype == frames.FrameType.METHOD:
            if pe - ps < 4:
                raise FrameError(E.FRAME_ERROR, "FRAME_ERROR - method frame too short")
            key = frames.method_id(buf, ps)
            if channel == 0:
                return self._connection_method(key, buf, ps, pe)
            return self._channel_method(channel, key, buf, ps, pe)
        if ftype == frames.FrameType.HEADER:
            return self._content_header(channel, buf, ps, pe)
        if ftype == frames.FrameType.BODY:
            return self._content_body(channel, buf, ps, pe)
        if ftype == frames.FrameType.HEARTBEAT:
            if channel != 0:
                raise ConnectionLevelError(E.FRAME_ERROR, "FRAME_ERROR - heartbeat frame on a channel other than 0")
            return None
        raise FrameError(E.FRAME_ERROR, f"FRAME_ERROR - unknown frame type {ftype}")

    # -- connection class (channel 0) ------------------------------------------------------------
    def _connection_method(self, key, buf, ps, pe):
        method = frames.decode_method(buf, ps, pe)
        name = method.name
        if self.state == "closing":
            if name == "Connection.CloseOk":
                self.state = "closed"
                return Closed("close handshake finished")
            if name == "Connection.Close":
                self._method(0, commands.Connection.CloseOk())
            return None
        if name == "Connection.Close":
            self._method(0, commands.Connection.CloseOk())
            self.state = "closed"
            return CloseRequested(method.reply_code, method.reply_text)
        expected = {"starting": "Connection.StartOk", "tuning": "Connection.TuneOk",
                    "opening": "Connection.Open"}.get(self.state)
        if expected is not None and name != expected:
            raise ConnectionLevelError(E.COMMAND_INVALID, f"COMMAND_INVALID - expected '{expected}', got "
                                                          f"'{name}'", *key)
        if name == "Connection.StartOk":
            return self._start_ok(method, key)
        if name == "Connection.TuneOk":
            self._tune_ok(method)
            return None
        if name == "Connection.Open":
            if method.virtual_host != "/":
                raise ConnectionLevelError(E.NOT_ALLOWED, f"NOT_ALLOWED - access to vhost "
                                                          f"'{method.virtual_host}' refused for user "
                                                          f"'{self.user}'", *key)
            if self.refuse_open:
                raise ConnectionLevelError(E.NOT_ALLOWED, self.refuse_open, *key)
            self.vhost = method.virtual_host
            self._method(0, commands.Connection.OpenOk())
            self.state = "open"
            return Opened(self.vhost, self.user, self.client_properties)
        if name in ("Connection.Blocked", "Connection.Unblocked"):
            return None
        raise ConnectionLevelError(E.COMMAND_INVALID, f"COMMAND_INVALID - unexpected '{name}' on channel 0", *key)

    def _send_start(self) -> None:
        caps = {k: True for k in ("publisher_confirms", "exchange_exchange_bindings", "basic.nack",
                                  "consumer_cancel_notify", "connection.blocked", "authentication_failure_close",
                                  "per_consumer_qos", "direct_reply_to")}
        props = {"product": PRODUCT, "version": VERSION, "platform": "Python", "capabilities": caps,
                 "cluster_name": self.node_name,
                 "information": "creditflow: RabbitMQ's flow control, reproduced"}
        self._method(0, commands.Connection.Start(server_properties=props, mechanisms="PLAIN AMQPLAIN",
                                                  locales="en_US"))

    def _start_ok(self, method, key):
        self.client_properties = dict(method.client_properties or {})
        self.capabilities = dict(self.client_properties.get("capabilities") or {})
        user, password = _credentials(method.mechanism, method.response)
        if user is None or self.users.get(user) != password:
            raise ConnectionLevelError(E.ACCESS_REFUSED, f"ACCESS_REFUSED - Login was refused using "
                                                         f"authentication mechanism {method.mechanism}. "
                                                         "For details see the broker logfile.", *key)
        self.user = user
        self._method(0, commands.Connection.Tune(channel_max=self.server_channel_max,
                                                 frame_max=self.server_frame_max,
                                                 heartbeat=self.server_heartbeat_s))
        self.state = "tuning"
        return None

    def _tune_ok(self, method) -> None:
        if method.frame_max and method.frame_max < frames.FRAME_MIN_SIZE:
            raise ConnectionLevelError(E.NOT_ALLOWED, f"NOT_ALLOWED - frame_max={method.frame_max} < "
                                                      f"{frames.FRAME_MIN_SIZE} min size", 10, 31)
        self.frame_max = min(self.server_frame_max, method.frame_max or self.server_frame_max)
        self.channel_max = min(self.server_channel_max, method.channel_max or self.server_channel_max)
        self.heartbeat_s = method.heartbeat
        self.state = "opening"

    # -- channels ----------------------------------------------------------------------------
    def _channel_method(self, channel: int, key, buf, ps, pe):
        if self.state != "open":
            if self.state == "closing":
                return None
            raise ConnectionLevelError(E.COMMAND_INVALID, "COMMAND_INVALID - channel method before "
                                                          "connection.open", *key)
        if channel in self._server_closing:
            if key == CHANNEL_CLOSE_OK:
                self._server_closing.discard(channel)
                self._channels.discard(channel)
                self._assembly.pop(channel, None)
                return ChannelCloseOk(channel)
            if key == CHANNEL_CLOSE:
                self._method(channel, commands.Channel.CloseOk())
            return None
        if channel not in self._channels:
            if key != CHANNEL_OPEN:
                raise ConnectionLevelError(E.CHANNEL_ERROR, "CHANNEL_ERROR - expected 'channel.open'", *key)
            if channel > self.channel_max:
                raise ConnectionLevelError(E.NOT_ALLOWED, f"NOT_ALLOWED - channel number {channel} is above "
                                                          f"the negotiated channel_max {self.channel_max}", *key)
            self._channels.add(channel)
            return ChannelOpen(channel)
        if channel in self._assembly:
            raise ConnectionLevelError(E.UNEXPECTED_FRAME, f"UNEXPECTED_FRAME - expected content header for "
                                                           f"class 60, got non content header frame instead", *key)
        if channel in self._client_closing:
            return None
        if key == frames.BASIC_PUBLISH:
            exchange, routing_key, bits = frames.decode_publish_raw(buf, ps)
            self._assembly[channel] = _Assembly(exchange, routing_key, bool(bits & 1))
            return None
        if key == CHANNEL_OPEN:
            raise ConnectionLevelError(E.CHANNEL_ERROR, "CHANNEL_ERROR - second 'channel.open' seen", *key)
        method = frames.decode_method(buf, ps, pe)
        if key == CHANNEL_CLOSE:
            self._client_closing.add(channel)
            return ChannelClose(channel, method.reply_code, method.reply_text)
        if key == CHANNEL_CLOSE_OK:
            return None
        return Method(channel, key[0], key[1], bytes(buf[ps:pe]), method)

    def _content_header(self, channel, buf, ps, pe):
        asm = self._assembly.get(channel)
        if asm is None or asm.size >= 0:
            if channel in self._server_closing or channel in self._client_closing:
                return None
            raise ConnectionLevelError(E.UNEXPECTED_FRAME, "UNEXPECTED_FRAME - unexpected content header "
                                                           "frame", 60, 40)
        size, props_raw = frames.decode_content_header(buf, ps, pe)
        asm.size = size
        asm.props_raw = props_raw
        if size > self.max_message_bytes:
            asm.oversized = True
        if size == 0:
            return self._complete(channel, asm)
        return None

    def _content_body(self, channel, buf, ps, pe):
        asm = self._assembly.get(channel)
        if asm is None or asm.size < 0:
            if channel in self._server_closing or channel in self._client_closing:
                return None
            raise ConnectionLevelError(E.UNEXPECTED_FRAME, "UNEXPECTED_FRAME - unexpected content body frame",
                                       60, 40)
        asm.got += pe - ps
        if asm.got > asm.size:
            raise ConnectionLevelError(E.FRAME_ERROR, f"FRAME_ERROR - content body of {asm.got} bytes is larger "
                                                      f"than the header's {asm.size}", 60, 40)
        if not asm.oversized:
            asm.parts.append(bytes(buf[ps:pe]))
        if asm.got == asm.size:
            return self._complete(channel, asm)
        return None

    def _complete(self, channel, asm: _Assembly):
        del self._assembly[channel]
        if asm.oversized:
            raise ChannelLevelError(E.PRECONDITION_FAILED, f"PRECONDITION_FAILED - message size {asm.size} is "
                                                           f"larger than configured max size "
                                                           f"{self.max_message_bytes}", 60, 40)
        parts = asm.parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.publishes += 1
        return Publish(channel, asm.exchange, asm.routing_key, asm.mandatory, asm.props_raw, body,
                       frames.delivery_mode_of(asm.props_raw))

    # -- answers and frames the reader asks for ----------------------------------------------------
    def open_channel_ok(self, channel: int) -> None:
        self._method(channel, commands.Channel.OpenOk())

    def close_channel_ok(self, channel: int) -> None:
        if channel in self._client_closing:
            self._client_closing.discard(channel)
            self._channels.discard(channel)
            self._assembly.pop(channel, None)
            self._method(channel, commands.Channel.CloseOk())

    def close_channel(self, channel: int, reply_code: int, reply_text: str, class_id: int = 0,
                      method_id: int = 0) -> None:
        if channel in self._server_closing or channel not in self._channels:
            return
        self._server_closing.add(channel)
        self._assembly.pop(channel, None)
        self._method(channel, commands.Channel.Close(reply_code=reply_code, reply_text=reply_text[:255],
                                                     class_id=class_id, method_id=method_id))

    def close(self, reply_code: int, reply_text: str, class_id: int = 0, method_id: int = 0) -> None:
        if self.state in ("closing", "closed"):
            return
        if self.state == "awaiting_header":
            self.state = "closed"
            return
        self._method(0, commands.Connection.Close(reply_code=reply_code, reply_text=reply_text[:255],
                                                  class_id=class_id, method_id=method_id))
        self.state = "closing"

    def send_raw(self, data: bytes) -> None:
        self._out.append(data)

    def send_deliver(self, channel, consumer_tag, delivery_tag, redelivered, exchange, routing_key,
                     props_raw, body) -> None:
        self._out.append(frames.encode_deliver(channel, consumer_tag, delivery_tag, redelivered, exchange,
                                               routing_key, props_raw, body, self.frame_max))

    def send_blocked(self, reason: str) -> bool:
        if not self.capabilities.get("connection.blocked") or self.state != "open":
            return False
        self._method(0, commands.Connection.Blocked(reason=reason))
        return True

    def send_unblocked(self) -> bool:
        if not self.capabilities.get("connection.blocked") or self.state != "open":
            return False
        self._method(0, commands.Connection.Unblocked())
        return True

    # -- heartbeats --------------------------------------------------------------------------------
    def note_sent(self, now_ns: int) -> None:
        self._last_out_ns = now_ns

    def tick(self, now_ns: int):
        hb = self.heartbeat_s
        if not hb or self.state != "open":
            return None
        interval = hb * 1_000_000_000
        if now_ns - self._last_out_ns >= interval // 2:
            self._send(frames.encode_heartbeat())
            self._last_out_ns = now_ns
        if not self._monitor_paused and now_ns - self._last_in_ns > 2 * interval:
            self.state = "closed"
            return HeartbeatTimeout()
        return None

    def pause_heartbeat_monitor(self) -> None:
        self._monitor_paused = True

    def resume_heartbeat_monitor(self, now_ns: int) -> None:
        self._monitor_paused = False
        self._last_in_ns = now_ns

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(self.state, self.bytes_in, self.bytes_out, self.frames_in, self.publishes,
                                    len(self._channels), self.buffered_bytes())


def _credentials(mechanism: str, response) -> tuple[str | None, str | None]:
    raw = response.encode("utf-8") if isinstance(response, str) else bytes(response or b"")
    if mechanism == "PLAIN":
        parts = raw.split(b"\x00")
        if len(parts) != 3:
            return None, None
        return parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
    if mechanism == "AMQPLAIN":
        from pamqp import decode
        try:
            _, table = decode.field_table(_U32(len(raw)) + raw)
        except Exception:
            return None, None
        return table.get("LOGIN"), table.get("PASSWORD")
    return None, None


def _U32(n: int) -> bytes:
    return n.to_bytes(4, "big")
