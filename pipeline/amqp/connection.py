"""The server side of one AMQP 0-9-1 connection, sans-IO (no socket, no clock).

The reader feeds it the client's bytes (``receive_data``) and asks for one
event at a time (``next_event``). It never parses ahead of the event it
returns: a reader that is blocked by credit flow or an alarm simply stops
asking, and everything after stays as unparsed bytes, which is how
back-pressure reaches the client's socket. Replies it makes itself
(handshake, heartbeats, close handshakes, errors) and the frames the reader
asks it to send pile up until ``data_to_send`` takes them. Time is passed in
(``now_ns``) and only matters for heartbeats and the handshake timeout.

Connection states (``_TRANSITIONS`` is the whole table)::

    awaiting_header --protocol header--> starting --start-ok--> tuning --tune-ok--> opening
        --open--> open
    starting/tuning/opening/open --we send connection.close--> closing --close-ok--> closed
    starting/tuning/opening/open --client's connection.close (close-ok queued)--> closed
    any state --EOF, heartbeat timeout, bad header, refused login--> closed
    awaiting_header..opening --handshake_timeout without connection.open--> closed

Channel states::

    (none) --channel.open--> opening --open_channel_ok()--> open
    opening/open --client's channel.close--> client_closing --close_channel_ok()--> (none)
    opening/open --close_channel() or a channel error--> server_closing --client's close-ok--> (none)

While a channel is closing, frames on it are dropped (the client's
channel.close still gets its close-ok). While the connection is closing,
everything but connection.close/close-ok is dropped.

Content assembly: basic.publish starts an assembly on its channel that the
content header and body frames complete; the ``Publish`` event comes when the
whole body is in. Anything else on that channel in between is 505
UNEXPECTED_FRAME; other channels may interleave. When the header and body
frames are already buffered behind the method frame (the usual case), they
are taken in one step without building the assembly.

Errors: a connection error queues connection.close and returns
``ProtocolError``; after a framing error (bad frame end, oversized frame) the
stream is out of sync and nothing more is parsed. Before tune-ok the client
is not trusted and nothing is queued: the connection is just dropped, as
RabbitMQ drops it (a refused login and a refused tune-ok are the exceptions).
A channel error (message over ``max_message_bytes``) queues channel.close,
returns ``ChannelError``, and the connection carries on. No input makes
``next_event`` raise: a fault of our own while parsing ends this connection
with 541 INTERNAL_ERROR. Input is bounded too: 4096-byte frames until
tune-ok, frame_max after it, tables nested at most ``fields.FIELD_NESTING_MAX``
deep and decoded without recursion, and once the connection is closing at
most ``CLOSING_BUFFER_MAX_BYTES`` kept unparsed. ``pipeline.amqp.errors``
lists which reply code RabbitMQ uses for which input.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, Union

from pamqp import commands

from pipeline.amqp import errors as E
from pipeline.amqp import fields, frames
from pipeline.amqp.errors import (AmqpError, ChannelLevelError, ConnectionLevelError, FrameError, UsageError,
                                  reply_text)

PRODUCT = "creditflow"
VERSION = "0.1.0"
AUTH_MECHANISMS = "PLAIN AMQPLAIN"
SERVER_CAPABILITIES = ("publisher_confirms", "exchange_exchange_bindings", "basic.nack", "consumer_cancel_notify",
                       "connection.blocked", "consumer_priorities", "authentication_failure_close",
                       "per_consumer_qos", "direct_reply_to")
CHANNEL_MAX_NO_LIMIT = 65535
VIEW_BODY_MIN_BYTES = 2048          # a Publish carries a body of this size or more as a view, not a copy
STREAM_BODY_MIN_BYTES = 16384       # a body frame this big is taken as its bytes arrive, not joined whole first
FRAME_SIZE_SLACK_BYTES = 8          # RabbitMQ accepts frames up to 8 bytes over frame_max - 8
HEARTBEAT_MISSES_ALLOWED = 2        # a client silent for more than 2 intervals has timed out
NS_PER_S = 1_000_000_000
CLOSING_BUFFER_MAX_BYTES = 1024 * 1024  # unparsed input kept while waiting for the client's close-ok

# -- events ------------------------------------------------------------------------------------


class BodyParts:
    """A body that arrived in pieces (views of the bytes read, in order), handed on unjoined.

    Like a view, use it at once: ``copy_into`` writes it where it goes in
    one copy; ``bytes()`` joins it for whoever needs one buffer.
    """

    __slots__ = ("pieces", "size")

    def __init__(self, pieces: list, size: int):
        self.pieces = pieces
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)

    def __eq__(self, other) -> bool:
        return bytes(self) == (bytes(other) if isinstance(other, BodyParts) else other)

    __hash__ = None

    def copy_into(self, dest: memoryview) -> None:
        at = 0
        for piece in self.pieces:
            end = at + len(piece)
            dest[at:end] = piece
            at = end


class Publish(NamedTuple):
    """A whole message published on ``channel``: method, header and body frames, body frames joined.

    Built once per message, so it is a tuple (a tenth of the cost of a frozen
    dataclass) and keeps the exchange and routing key as the UTF-8 bytes they
    arrived as, which is what the reader forwards; ``exchange`` and
    ``routing_key`` decode them on demand.
    """

    channel: int
    exchange_b: bytes
    routing_key_b: bytes
    mandatory: bool
    props_raw: bytes
    body: bytes | memoryview | BodyParts   # VIEW_BODY_MIN_BYTES or more: views of the bytes read, use at once
    delivery_mode: int | None

    @property
    def exchange(self) -> str:
        return self.exchange_b.decode("utf-8", "surrogateescape")

    @property
    def routing_key(self) -> str:
        return self.routing_key_b.decode("utf-8", "surrogateescape")


@dataclass(frozen=True, slots=True)
class Opened:
    """connection.open succeeded (open-ok is queued)."""
    vhost: str
    user: str
    client_properties: dict


@dataclass(frozen=True, slots=True)
class ChannelOpen:
    """The client opened ``channel``; answer with ``open_channel_ok`` once its process exists."""
    channel: int


@dataclass(frozen=True, slots=True)
class ChannelClose:
    """The client closed ``channel``; answer with ``close_channel_ok`` once its process has stopped."""
    channel: int
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class ChannelCloseOk:
    """The client answered our channel.close; the channel number is free again."""
    channel: int


@dataclass(frozen=True, slots=True)
class ChannelError:
    """We closed ``channel`` ourselves because of its input (channel.close queued; ChannelCloseOk follows)."""
    channel: int
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class Method:
    """Any other client method on a channel; ``payload`` is the raw method payload (re-decode with decode_method)."""
    channel: int
    class_id: int
    method_id: int
    payload: bytes
    method: object


@dataclass(frozen=True, slots=True)
class CloseRequested:
    """The client sent connection.close; close-ok is already queued."""
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class Closed:
    """The close handshake finished, or the peer closed its side."""
    reason: str


@dataclass(frozen=True, slots=True)
class ProtocolError:
    """Bad input: connection.close with this code is queued (for a bad protocol header, our header;
    before tune-ok nothing, the connection is dropped)."""
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class HeartbeatTimeout:
    """The client sent nothing for more than two heartbeat intervals while the monitor was running."""


@dataclass(frozen=True, slots=True)
class HandshakeTimeout:
    """The client did not reach connection.open within ``handshake_timeout`` (RabbitMQ's, 10 s): dropped."""


Event = Union[Publish, Opened, ChannelOpen, ChannelClose, ChannelCloseOk, ChannelError, Method, CloseRequested,
              Closed, ProtocolError, HeartbeatTimeout, HandshakeTimeout]


@dataclass(frozen=True)
class ConnectionStatistics:
    state: str
    bytes_in: int
    bytes_out: int
    frames_in: int
    frames_out: int
    publishes: int
    methods: int
    open_channels: int
    unparsed_bytes: int
    heartbeats_sent: int


# -- state tables ------------------------------------------------------------------------------

STATES = ("awaiting_header", "starting", "tuning", "opening", "open", "closing", "client_closing", "closed")
_HANDSHAKE = ("starting", "tuning", "opening")
_BEFORE_OPEN = ("awaiting_header", *_HANDSHAKE)
_TRANSITIONS: dict[tuple[str, str], str] = {
    ("awaiting_header", "header"): "starting",
    ("starting", "start_ok"): "tuning",
    ("tuning", "tune_ok"): "opening",
    ("opening", "open"): "open",
    ("closing", "close_ok"): "closed",
    **{(s, "close_sent"): "closing" for s in (*_HANDSHAKE, "open")},
    **{(s, "client_close"): "closed" for s in _HANDSHAKE},
    ("open", "client_close"): "client_closing",       # close-ok once the channels have finished
    ("client_closing", "close_ok_sent"): "closed",
    **{(s, "drop"): "closed" for s in STATES if s != "closed"},
}
# the one method the client may send on channel 0 in each handshake state
_EXPECTED = {"starting": frames.CONNECTION_START_OK, "tuning": frames.CONNECTION_TUNE_OK,
             "opening": frames.CONNECTION_OPEN}
_RABBIT_STATE_NAMES = {"open": "running"}
# before tune-ok a bad client is dropped without a word (RabbitMQ's handshake_error); only a refused
# login (to a client with authentication_failure_close) and a refused tune-ok are told why
_UNTRUSTED = frozenset({"starting", "tuning"})

CH_OPENING, CH_OPEN, CH_CLIENT_CLOSING, CH_SERVER_CLOSING = "opening", "open", "client_closing", "server_closing"
_CHANNEL_TRANSITIONS: dict[tuple[str | None, str], str | None] = {
    (None, "open"): CH_OPENING,
    (CH_OPENING, "open_ok"): CH_OPEN,
    (CH_OPENING, "client_close"): CH_CLIENT_CLOSING,
    (CH_OPEN, "client_close"): CH_CLIENT_CLOSING,
    (CH_CLIENT_CLOSING, "close_ok_sent"): None,
    (CH_OPENING, "server_close"): CH_SERVER_CLOSING,
    (CH_OPEN, "server_close"): CH_SERVER_CLOSING,
    (CH_SERVER_CLOSING, "close_ok_received"): None,
    (CH_SERVER_CLOSING, "client_close_while_held"): CH_CLIENT_CLOSING,    # our close was never sent
}


def _k(key: tuple[int, int]) -> int:
    return key[0] << 16 | key[1]


_PUBLISH = _k(frames.BASIC_PUBLISH)
_CHANNEL_OPEN = _k(frames.CHANNEL_OPEN)
_CHANNEL_CLOSE = _k(frames.CHANNEL_CLOSE)
_CHANNEL_CLOSE_OK = _k(frames.CHANNEL_CLOSE_OK)
_CHANNEL_FLOW = _k(frames.CHANNEL_FLOW)
_CONNECTION_CLOSE = _k(frames.CONNECTION_CLOSE)
_CONNECTION_CLOSE_OK = _k(frames.CONNECTION_CLOSE_OK)
# what a client may send on an open channel besides publish/open/close: forwarded as Method events
_CLIENT_CHANNEL_METHODS = frozenset(_k(key) for key in (
    frames.CHANNEL_FLOW, frames.CHANNEL_FLOW_OK,
    frames.EXCHANGE_DECLARE, frames.EXCHANGE_DELETE, frames.EXCHANGE_BIND, frames.EXCHANGE_UNBIND,
    frames.QUEUE_DECLARE, frames.QUEUE_BIND, frames.QUEUE_PURGE, frames.QUEUE_DELETE, frames.QUEUE_UNBIND,
    frames.BASIC_QOS, frames.BASIC_CONSUME, frames.BASIC_CANCEL, frames.BASIC_GET, frames.BASIC_ACK,
    frames.BASIC_REJECT, frames.BASIC_RECOVER_ASYNC, frames.BASIC_RECOVER, frames.BASIC_NACK,
    frames.CONFIRM_SELECT, frames.TX_SELECT, frames.TX_COMMIT, frames.TX_ROLLBACK))

_FRAME_HEAD = frames.FRAME_HEAD
_PUBLISH_HEAD = frames.PUBLISH_FRAME_HEAD
_HEADER_HEAD = frames.HEADER_FRAME_HEAD
_HEADER_PAYLOAD = frames.HEADER_PAYLOAD_HEAD
_HEADER_MIN_BYTES = frames.HEADER_PAYLOAD_MIN_BYTES
_CH_ACCEPTING = frozenset({"opening", "open"})
_new_publish = tuple.__new__


class _Assembly:
    """A basic.publish waiting for its content header and body frames."""

    __slots__ = ("exchange", "routing_key", "mandatory", "size", "props_raw", "delivery_mode", "parts", "got",
                 "oversized")

    def __init__(self, exchange: bytes, routing_key: bytes, mandatory: bool):
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.size = -1                  # -1 until the content header arrives
        self.props_raw = b""
        self.delivery_mode = None
        self.parts: list[bytes] = []
        self.got = 0
        self.oversized = False


_BAD_PROPERTIES = object()


def _checked_mode(props_raw):
    """The delivery mode of a content header's properties (None: not set); _BAD_PROPERTIES when they do not
    decode (the fast path then leaves the frame to the general path, which reports it)."""
    if len(props_raw) == 3 and props_raw[0] == 0x10 and props_raw[1] == 0:
        return props_raw[2]                     # delivery mode alone: the common case
    try:
        return frames.check_properties(props_raw)
    except FrameError:
        return _BAD_PROPERTIES


def _unexpected(explanation: str, key: tuple[int, int] = (0, 0)) -> ConnectionLevelError:
    return ConnectionLevelError(E.UNEXPECTED_FRAME, reply_text(E.UNEXPECTED_FRAME, explanation), *key)


def _unknown_frame(ftype: int, buf, ps: int, pe: int) -> FrameError:
    return FrameError(E.FRAME_ERROR, reply_text(E.FRAME_ERROR, f"type {ftype}, {frames.octets(buf, ps, pe)}: "
                                                               "unknown_frame"))


_clip = E.clip_reply_text


class ServerConnection:
    """One client's AMQP connection, as the broker sees it (see the module docstring)."""

    def __init__(self, *, node_name: str = "creditflow@localhost", heartbeat_s: int = 60,
                 frame_max: int = 131072, channel_max: int = 2047, max_message_bytes: int = 16 * 1024 * 1024,
                 users: Mapping[str, str] = MappingProxyType({"guest": "guest"}), now_ns: int = 0,
                 refuse_open: str | None = None, handshake_timeout_s: float = 10.0,
                 loopback_users: frozenset = frozenset({"guest"}), peer_is_loopback: bool = True,
                 hold_channel_closes: bool = False):
        if frame_max and frame_max < frames.FRAME_MIN_SIZE:
            raise ValueError(f"frame_max {frame_max} is below the protocol minimum {frames.FRAME_MIN_SIZE}")
        self.node_name = node_name
        self.refuse_open = refuse_open      # reply text for a 530 in place of open-ok (a limit is reached;
                                            # ``{user}`` in it becomes the user who logged in)
        self.server_heartbeat_s = heartbeat_s
        self.server_frame_max = frame_max
        self.server_channel_max = channel_max
        self.max_message_bytes = max_message_bytes
        self._users = dict(users)
        # RabbitMQ's loopback_users: these may log in only over a loopback address
        self._loopback_users = loopback_users if not peer_is_loopback else frozenset()
        self._handshake_deadline_ns = now_ns + int(handshake_timeout_s * NS_PER_S) if handshake_timeout_s else None
        self.login_refused: str | None = None   # why, for the log; the reader delays a refused login's answer
        self.state = "awaiting_header"
        # negotiated at tune-ok; until then RabbitMQ's initial limits apply
        self.frame_max = frames.FRAME_MIN_SIZE
        self._payload_max = frames.FRAME_MIN_SIZE - frames.FRAME_OVERHEAD_BYTES + FRAME_SIZE_SLACK_BYTES
        self.channel_max = channel_max or CHANNEL_MAX_NO_LIMIT
        self.heartbeat_s = 0
        self.client_properties: dict = {}
        self.capabilities: dict = {}
        self.user: str | None = None
        self.vhost: str | None = None
        self._buf = b""                     # received bytes; parsing has reached _pos
        self._pos = 0
        self._chunks: list[bytes] = []      # received after _buf, not joined to it yet
        self._chunk_bytes = 0
        self._need_bytes = 0                # _buf must hold this much from _pos before parsing can go on
        self._stream_left = 0               # a big body frame being taken as it arrives: payload left + frame end
        self._stream_channel = 0
        self._stream_head = b""
        self._out: list[bytes] = []
        self._eof = False
        self._desynced = False
        self._channels: dict[int, str] = {}
        self._assembly: dict[int, _Assembly] = {}
        # hold_channel_closes: a channel.close for a channel's own input waits for send_held_close, so the
        # channel's process can hand back what it held first (RabbitMQ's channel notifies its queues, then
        # sends the close); the channel drops its frames meanwhile, as after any server close
        self._hold_closes = hold_channel_closes
        self._held_closes: dict[int, commands.Channel.Close] = {}
        self._fresh_bytes = False
        self._last_in_ns = now_ns
        self._last_out_ns = now_ns
        self._monitor_paused = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.frames_in = 0
        self.frames_out = 0
        self.publishes = 0
        self.methods = 0
        self.heartbeats_sent = 0

    # -- bytes in and out ------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        """Client bytes, as read from the socket; ``b""`` means the client closed its side.

        Bytes that cannot complete the frame being waited for are only
        collected, so a big frame arriving in many reads is joined once.
        """
        if not data:
            self._eof = True
            self._join()
            return
        self.bytes_in += len(data)
        self._fresh_bytes = True
        if self.state == "closed" or self._desynced:
            return                              # nothing after this point will ever be parsed
        if self.state == "closing" and self.buffered_bytes() + len(data) > CLOSING_BUFFER_MAX_BYTES:
            # we sent connection.close and the peer keeps sending: stop looking for its close-ok,
            # keep nothing more, and let the reader end on EOF or its close timeout
            self._desynced = True
            self._buf, self._pos = b"", 0
            self._chunks.clear()
            self._chunk_bytes = 0
            return
        self._chunks.append(data)
        self._chunk_bytes += len(data)
        if len(self._buf) - self._pos + self._chunk_bytes >= self._need_bytes:
            self._join()

    def _join(self) -> None:
        chunks = self._chunks
        if chunks:
            if self._pos < len(self._buf):
                self._buf = b"".join((self._buf[self._pos:], *chunks))
            else:                               # nothing left over: one chunk is taken as it is, not copied
                self._buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self._pos = 0
            self._chunks.clear()
            self._chunk_bytes = 0

    def data_to_send(self) -> bytes:
        """Everything queued for the client since the last call (and forget it)."""
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        self.bytes_out += len(data)
        return data

    def parts_to_send(self) -> list:
        """``data_to_send`` unjoined: the pieces in order (bytes, or views a scatter-gather send takes)."""
        out = self._out
        if not out:
            return out
        self._out = []
        self.bytes_out += sum(map(len, out))
        return out

    def buffered_bytes(self) -> int:
        """Received bytes not parsed yet."""
        return len(self._buf) - self._pos + self._chunk_bytes

    def note_sent(self, now_ns: int) -> None:
        """The reader wrote to the socket at ``now_ns`` (any traffic postpones our next heartbeat)."""
        self._last_out_ns = now_ns

    @property
    def open_channels(self) -> frozenset[int]:
        return frozenset(self._channels)

    def channel_state(self, channel: int) -> str | None:
        """``'opening'``, ``'open'``, ``'client_closing'``, ``'server_closing'`` or None."""
        return self._channels.get(channel)

    def _method(self, channel: int, method) -> None:
        self._out.append(frames.encode_method(channel, method))
        self.frames_out += 1

    def _advance(self, event: str) -> None:
        new = _TRANSITIONS.get((self.state, event))
        if new is None:
            raise UsageError(f"connection cannot '{event}' in state '{self.state}'")
        self.state = new

    def _advance_channel(self, channel: int, event: str) -> None:
        key = (self._channels.get(channel), event)
        if key not in _CHANNEL_TRANSITIONS:
            raise UsageError(f"channel {channel} cannot '{event}' in state '{key[0]}'")
        new = _CHANNEL_TRANSITIONS[key]
        if new is None:
            del self._channels[channel]
            self._assembly.pop(channel, None)
            self._held_closes.pop(channel, None)
        else:
            self._channels[channel] = new

    # -- parsing ---------------------------------------------------------------------------------
    def next_event(self, now_ns: int) -> Event | None:
        """Parse until one event is complete and return it; None means more bytes are needed.

        No input makes this raise: whatever the bytes, the answer is an event
        (at worst a ``ProtocolError``: 541 INTERNAL_ERROR, as RabbitMQ closes
        a connection whose channel process crashed, should parsing itself
        fail), and only this connection ends.
        """
        try:
            return self._next_event(now_ns)
        except Exception as exc:              # a fault of ours that odd input reached
            self._desynced = True
            self._chunks.clear()
            return self._hard(ConnectionLevelError(E.INTERNAL_ERROR, _clip(reply_text(
                E.INTERNAL_ERROR, f"{type(exc).__name__} while parsing: {exc}"))))

    def _next_event(self, now_ns: int) -> Event | None:
        if self._fresh_bytes:
            self._fresh_bytes = False
            self._last_in_ns = now_ns
        while True:
            if self.state in ("closed", "client_closing"):
                return None
            if self._desynced:
                return self._drop("peer closed the connection") if self._eof else None
            pos = self._pos
            buf = self._buf
            if self._stream_left:
                if pos == len(buf):
                    if self._chunks:            # collected while waiting for an earlier, bigger frame
                        self._join()
                        continue
                    if self._eof:
                        return self._drop("peer closed the connection in the middle of a frame")
                    self._need_bytes = 1
                    return None
                try:
                    event = self._stream_body(buf, pos)
                except FrameError as err:
                    self._desynced = True
                    return self._hard(err)
                if event is not None:
                    return event
                continue
            if self.state == "open":
                if len(buf) - pos > 13 and buf[pos] == 1:
                    event = self._whole_publish(buf, pos)
                    if event is not None:
                        return event
                    if self._stream_left:       # its body frame is still arriving: taken as it comes
                        continue
            elif self.state == "awaiting_header":
                event = self._protocol_header()
                if event is not None or self.state == "awaiting_header":
                    return event
                continue
            try:
                found = frames.next_frame(buf, pos, self.frame_max, slack_bytes=FRAME_SIZE_SLACK_BYTES)
            except FrameError as err:
                self._desynced = True
                return self._hard(err)
            if found is None:
                if self._eof:
                    leftover = " in the middle of a frame" if pos < len(buf) else ""
                    return self._drop(f"peer closed the connection{leftover}")
                if self._wait_for_frame(buf, pos):
                    continue
                return None
            ftype, channel, ps, pe = found
            self._pos = pe + 1
            self.frames_in += 1
            try:
                event = self._frame(ftype, channel, buf, ps, pe)
            except ChannelLevelError as err:
                event = self._channel_error(channel, err)
            except AmqpError as err:
                return self._hard(err)
            if event is not None:
                return event

    def _wait_for_frame(self, buf: bytes, pos: int) -> bool:
        """Note how many bytes the incomplete frame at ``pos`` needs; True if collected bytes complete it."""
        have = len(buf) - pos
        if have < frames.FRAME_HEADER_BYTES:
            self._need_bytes = frames.FRAME_HEADER_BYTES
        else:
            ftype, channel, size = _FRAME_HEAD.unpack_from(buf, pos)
            if ftype == 3 and size >= STREAM_BODY_MIN_BYTES and self._streams(channel, size):
                self._begin_stream(channel, size, pos)
                return True
            self._need_bytes = frames.FRAME_OVERHEAD_BYTES + size
        if self._chunks and have + self._chunk_bytes >= self._need_bytes:
            self._join()
            return True
        return False

    def _begin_stream(self, channel: int, size: int, pos: int) -> None:
        """Take the body frame of ``size`` on ``channel`` whose header is at ``pos`` as its bytes arrive."""
        self._pos = pos + frames.FRAME_HEADER_BYTES
        self._stream_left = size + 1
        self._stream_channel = channel
        self._stream_head = b""                 # its first 16 octets, as they come, for a frame error's text

    def _streams(self, channel: int, size: int) -> bool:
        """Whether a body frame of ``size`` on ``channel`` may be taken as it arrives: only one the whole-frame
        path would take without complaint (an open connection and channel, a publish whose header came and
        whose size it fits), so every error is still reported by that path, with the whole frame in."""
        if self.state != "open" or self._channels.get(channel) not in _CH_ACCEPTING:
            return False
        asm = self._assembly.get(channel)
        return asm is not None and asm.size >= 0 and not asm.oversized and asm.got + size <= asm.size

    def _stream_body(self, buf: bytes, pos: int):
        """Take what has arrived of the body frame being streamed; the Publish once its last byte is in."""
        left = self._stream_left
        n = min(left, len(buf) - pos)
        take = min(n, left - 1)                 # payload bytes; the last of ``left`` is the frame-end octet
        asm = self._assembly.get(self._stream_channel)  # gone if the channel or connection closed meanwhile
        head = self._stream_head
        if take and len(head) < 16:
            self._stream_head = head + bytes(buf[pos:pos + min(take, 16 - len(head))])
        if take and asm is not None:
            asm.parts.append(memoryview(buf)[pos:pos + take])
            asm.got += take
        self._pos = pos + n
        self._stream_left = left = left - n
        if left:
            return None
        if buf[pos + n - 1] != frames.FRAME_END:
            raise FrameError(E.FRAME_ERROR, f"FRAME_ERROR - type 3, first 16 octets = "
                                            f"{E.erlang_binary(self._stream_head)}: "
                                            f"{{invalid_frame_end_marker,{buf[pos + n - 1]}}}")
        self.frames_in += 1
        if asm is not None and asm.got == asm.size and self.state == "open":
            return self._complete(self._stream_channel, asm)
        return None

    def _protocol_header(self) -> Event | None:
        """Check the 8-byte protocol header; None once it is good (or while it is incomplete)."""
        self._join()
        buf = self._buf
        if len(buf) < len(frames.PROTOCOL_HEADER):
            if self._eof:
                return self._drop("peer closed before sending the protocol header")
            self._need_bytes = len(frames.PROTOCOL_HEADER)
            return None
        header = bytes(buf[:8])
        self._pos = 8
        if header not in (frames.PROTOCOL_HEADER, b"AMQP\x01\x01\x00\x09"):   # 0-9 is served as 0-9-1
            self._out.append(frames.PROTOCOL_HEADER)
            self._advance("drop")
            return ProtocolError(E.FRAME_ERROR, f"client did not start with the AMQP 0-9-1 protocol header: "
                                                f"{header!r}")
        self._advance("header")
        self._send_start()
        return None

    def _drop(self, reason: str) -> Closed:
        self._advance("drop")
        self._assembly.clear()
        return Closed(reason)

    def _hard(self, err: AmqpError) -> ProtocolError | None:
        """Queue connection.close for ``err`` (unless already closing) and report it.

        Before tune-ok nothing is queued: the connection is dropped, as
        RabbitMQ drops a client it does not trust yet (``_UNTRUSTED``).
        """
        if self.state in ("closing", "closed"):
            return None
        if self.state in _UNTRUSTED:
            self._drop("")
        else:
            self.close(err.reply_code, err.reply_text, err.class_id, err.method_id)
        return ProtocolError(err.reply_code, err.reply_text)

    def _channel_error(self, channel: int, err: AmqpError) -> ChannelError:
        self.close_channel(channel, err.reply_code, err.reply_text, err.class_id, err.method_id,
                           hold=self._hold_closes)
        return ChannelError(channel, err.reply_code, err.reply_text)

    def _frame(self, ftype: int, channel: int, buf, ps: int, pe: int):
        if self.state == "closing":
            return self._while_closing(ftype, channel, buf, ps, pe)
        if ftype == frames.FrameType.METHOD:
            if pe - ps < 4:
                raise _unknown_frame(ftype, buf, ps, pe)
            key = frames.method_id(buf, ps)
            if _k(key) not in commands.INDEX_MAPPING:
                raise ConnectionLevelError(E.NOT_IMPLEMENTED, reply_text(
                    E.NOT_IMPLEMENTED, f"unknown method {key[0]}/{key[1]}"), *key)
            if channel == 0:
                return self._connection_method(key, buf, ps, pe)
            if self.state != "open":
                raise _unexpected(f"type 1, {frames.octets(buf, ps, pe)}")
            return self._channel_method(channel, key, buf, ps, pe)
        if ftype == frames.FrameType.HEADER or ftype == frames.FrameType.BODY:
            if channel == 0 or self.state != "open":
                raise _unexpected(f"type {ftype}, {frames.octets(buf, ps, pe)}")
            if ftype == frames.FrameType.HEADER:
                return self._content_header(channel, buf, ps, pe)
            return self._content_body(channel, buf, ps, pe)
        if ftype == frames.FrameType.HEARTBEAT and pe == ps:
            if channel != 0:
                raise _unexpected(f"type 8, {frames.octets(buf, ps, pe)}")
            return None
        raise _unknown_frame(ftype, buf, ps, pe)

    def _while_closing(self, ftype: int, channel: int, buf, ps: int, pe: int):
        # we sent connection.close: only close-ok (or the client's own close) matters now
        if ftype != frames.FrameType.METHOD or channel != 0 or pe - ps < 4:
            return None
        key = _k(frames.method_id(buf, ps))
        if key == _CONNECTION_CLOSE_OK:
            self._advance("close_ok")
            self._assembly.clear()
            return Closed("close handshake finished")
        if key == _CONNECTION_CLOSE:
            self._method(0, commands.Connection.CloseOk())
        return None

    # -- channel 0: the connection class ----------------------------------------------------------------
    def _connection_method(self, key: tuple[int, int], buf, ps: int, pe: int):
        method = frames.decode_method(buf, ps, pe)
        if key == frames.CONNECTION_CLOSE:
            if self.state != "open":
                self._method(0, commands.Connection.CloseOk())
            self._advance("client_close")     # when open: close-ok waits for send_close_ok
            self._assembly.clear()
            return CloseRequested(method.reply_code, method.reply_text)
        if key == frames.CONNECTION_UPDATE_SECRET and self.state == "open":
            # RabbitMQ's internal users have no expiring credentials: the new secret is taken as is
            self._method(0, commands.Connection.UpdateSecretOk())
            return None
        if _EXPECTED.get(self.state) != key:
            raise ConnectionLevelError(E.CHANNEL_ERROR, reply_text(
                E.CHANNEL_ERROR, f"unexpected method in connection state "
                                 f"{_RABBIT_STATE_NAMES.get(self.state, self.state)}"), *key)
        if key == frames.CONNECTION_START_OK:
            return self._start_ok(method)
        if key == frames.CONNECTION_TUNE_OK:
            return self._tune_ok(method)
        return self._open(method)

    def _send_start(self) -> None:
        props = {"product": PRODUCT, "version": VERSION,
                 "platform": f"Python {sys.version_info.major}.{sys.version_info.minor}",
                 "capabilities": {name: True for name in SERVER_CAPABILITIES},
                 "cluster_name": self.node_name,
                 "information": "creditflow: RabbitMQ's publish pipeline and flow control, reproduced"}
        self._method(0, commands.Connection.Start(server_properties=props, mechanisms=AUTH_MECHANISMS,
                                                  locales="en_US"))

    def _start_ok(self, method) -> ProtocolError | None:
        self.client_properties = dict(method.client_properties or {})
        caps = self.client_properties.get("capabilities")
        self.capabilities = dict(caps) if isinstance(caps, dict) else {}
        mechanism = method.mechanism
        if mechanism not in AUTH_MECHANISMS.split():
            raise ConnectionLevelError(E.COMMAND_INVALID, reply_text(
                E.COMMAND_INVALID, f"unknown authentication mechanism '{mechanism}'"), *frames.CONNECTION_START_OK)
        user, password = _credentials(mechanism, method.response)
        if user not in self._users or self._users[user] != password:
            return self._refuse_login(mechanism, f"user '{user}' - invalid credentials")
        if user in self._loopback_users:
            return self._refuse_login(mechanism, f"user '{user}' can only connect via localhost")
        self.user = user
        self._method(0, commands.Connection.Tune(channel_max=self.server_channel_max,
                                                 frame_max=self.server_frame_max,
                                                 heartbeat=self.server_heartbeat_s))
        self._advance("start_ok")
        return None

    def _refuse_login(self, mechanism: str, why: str) -> ProtocolError:
        # RabbitMQ sends connection.close only to clients announcing authentication_failure_close;
        # other clients are simply disconnected, as the specification asks
        text = reply_text(E.ACCESS_REFUSED, f"Login was refused using authentication mechanism {mechanism}. "
                                            "For details see the broker logfile.")
        self.login_refused = f"{mechanism} login refused: {why}"
        if self.capabilities.get("authentication_failure_close"):
            self.close(E.ACCESS_REFUSED, text, *frames.CONNECTION_START_OK)
        else:
            self._advance("drop")
        return ProtocolError(E.ACCESS_REFUSED, text)

    def _tune_ok(self, method) -> ProtocolError | None:
        try:
            frame_max = _negotiated("frame_max", method.frame_max, self.server_frame_max, frames.FRAME_MIN_SIZE)
            channel_max = _negotiated("channel_max", method.channel_max, self.server_channel_max, 1)
        except ConnectionLevelError as err:
            # RabbitMQ tells a client why its tune-ok was refused, though it is not trusted yet
            self.close(err.reply_code, err.reply_text, err.class_id, err.method_id)
            return ProtocolError(err.reply_code, err.reply_text)
        self.frame_max = frame_max
        self._payload_max = (frame_max - frames.FRAME_OVERHEAD_BYTES + FRAME_SIZE_SLACK_BYTES if frame_max
                             else 0xFFFFFFFF)
        self.channel_max = channel_max or CHANNEL_MAX_NO_LIMIT
        self.heartbeat_s = method.heartbeat
        self._advance("tune_ok")
        return None

    def _open(self, method) -> Opened:
        vhost = method.virtual_host
        if vhost != "/":
            raise ConnectionLevelError(E.NOT_ALLOWED, reply_text(E.NOT_ALLOWED, f"vhost {vhost} not found"),
                                       *frames.CONNECTION_OPEN)
        if self.refuse_open:
            raise ConnectionLevelError(E.NOT_ALLOWED, self.refuse_open.format(user=self.user),
                                       *frames.CONNECTION_OPEN)
        self.vhost = vhost
        self._method(0, commands.Connection.OpenOk())
        self._advance("open")
        return Opened(vhost, self.user, self.client_properties)

    # -- channels -------------------------------------------------------------------------------------
    def _channel_method(self, channel: int, key: tuple[int, int], buf, ps: int, pe: int):
        k = _k(key)
        state = self._channels.get(channel)
        if state is None:
            if channel > self.channel_max:
                raise ConnectionLevelError(E.NOT_ALLOWED, reply_text(
                    E.NOT_ALLOWED, f"channel number {channel} is over the negotiated channel_max "
                                   f"({self.channel_max})"), *key)
            frames.decode_method(buf, ps, pe)
            if k != _CHANNEL_OPEN:
                raise ConnectionLevelError(E.CHANNEL_ERROR, reply_text(E.CHANNEL_ERROR, "expected 'channel.open'"),
                                           *key)
            self._advance_channel(channel, "open")
            return ChannelOpen(channel)
        if state == CH_SERVER_CLOSING:
            if k == _CHANNEL_CLOSE_OK:
                self._advance_channel(channel, "close_ok_received")
                return ChannelCloseOk(channel)
            if k == _CHANNEL_CLOSE:
                if self._held_closes.pop(channel, None) is not None:
                    # the client closes first, not knowing of ours: its close, answered as any other
                    self._advance_channel(channel, "client_close_while_held")
                    method = frames.decode_method(buf, ps, pe)
                    return ChannelClose(channel, method.reply_code, method.reply_text)
                self._method(channel, commands.Channel.CloseOk())
            return None
        if state == CH_CLIENT_CLOSING:
            return None
        if channel in self._assembly:
            raise _unexpected("expected content header for class 60, got non content header frame instead",
                              frames.BASIC_PUBLISH)
        if k == _PUBLISH:
            return self._start_assembly(channel, buf, ps, pe)
        method = frames.decode_method(buf, ps, pe)
        if k == _CHANNEL_CLOSE:
            self._advance_channel(channel, "client_close")
            self._assembly.pop(channel, None)
            return ChannelClose(channel, method.reply_code, method.reply_text)
        if k == _CHANNEL_OPEN:
            raise ConnectionLevelError(E.CHANNEL_ERROR, reply_text(E.CHANNEL_ERROR, "second 'channel.open' seen"),
                                       *key)
        if k not in _CLIENT_CHANNEL_METHODS:     # a server's method, or a close-ok for no close of ours
            raise ConnectionLevelError(E.COMMAND_INVALID, reply_text(E.COMMAND_INVALID, "unimplemented method"),
                                       *key)
        if k == _CHANNEL_FLOW and not method.active:
            raise ConnectionLevelError(E.NOT_IMPLEMENTED, reply_text(E.NOT_IMPLEMENTED, "active=false"), *key)
        self.methods += 1
        return Method(channel, key[0], key[1], bytes(buf[ps:pe]), method)

    def _start_assembly(self, channel: int, buf, ps: int, pe: int) -> None:
        exchange, routing_key, bits = frames.decode_publish_raw(buf, ps, pe)
        if bits & 2:
            raise ConnectionLevelError(E.NOT_IMPLEMENTED, reply_text(E.NOT_IMPLEMENTED, "immediate=true"),
                                       *frames.BASIC_PUBLISH)
        self._assembly[channel] = _Assembly(exchange, routing_key, bool(bits & 1))
        return None

    def _whole_publish(self, buf, pos: int) -> Publish | None:
        """The fast path: a basic.publish at ``pos`` whose header and body frames are all buffered.

        Returns None, consuming nothing, for anything else (another method,
        content still arriving, a body over several frames, any irregularity);
        the general path then takes the frame and reports what is wrong.
        """
        ftype, channel, size, cls, mid, _ = _PUBLISH_HEAD.unpack_from(buf, pos)
        if (cls != 60 or mid != 40 or not channel or size > self._payload_max
                or self._channels.get(channel) not in _CH_ACCEPTING or channel in self._assembly):
            return None
        # method arguments: u16 reserved | shortstr exchange | shortstr routing key | bits
        pe = pos + 7 + size
        buf_size = len(buf)
        if pe >= buf_size:
            return None
        o = pos + 13
        e = o + 1 + buf[o]
        if e >= pe:
            return None
        r = e + 1 + buf[e]
        if r + 1 != pe or buf[r] & 2:
            return None
        hpos = pe + 1
        if buf_size - hpos < 22 or buf[pe] != 0xCE:
            return None
        ftype, hch, hsize, cls, weight, body_size = _HEADER_HEAD.unpack_from(buf, hpos)
        hend = hpos + 7 + hsize
        if (ftype != 2 or hch != channel or cls != 60 or weight != 0 or hsize < _HEADER_MIN_BYTES
                or hsize > self._payload_max or hend >= buf_size or buf[hend] != 0xCE
                or body_size > self.max_message_bytes):
            return None
        bpos = hend + 1
        if body_size == 0:
            body, nxt = b"", bpos
        else:
            nxt = bpos + 8 + body_size
            if body_size > self._payload_max:
                return None
            if nxt > buf_size:
                if body_size >= STREAM_BODY_MIN_BYTES and buf_size - bpos >= frames.FRAME_HEADER_BYTES:
                    self._stream_publish(buf, channel, o, e, r, hpos, hend, body_size)
                return None
            ftype, bch, bsize = _FRAME_HEAD.unpack_from(buf, bpos)
            if ftype != 3 or bch != channel or bsize != body_size or buf[nxt - 1] != 0xCE:
                return None
            # a big body is handed on as a view of the bytes read (copied once, where it goes next)
            body = buf[bpos + 7:nxt - 1] if body_size < VIEW_BODY_MIN_BYTES else memoryview(buf)[bpos + 7:nxt - 1]
        props_raw = buf[hpos + 19:hend]
        mode = _checked_mode(props_raw)
        if mode is _BAD_PROPERTIES:
            return None
        self._pos = nxt
        self.frames_in += 3 if body_size else 2
        self.publishes += 1
        return _new_publish(Publish, (channel, buf[o + 1:e], buf[e + 1:r], bool(buf[r] & 1), props_raw, body, mode))

    def _stream_publish(self, buf, channel: int, o: int, e: int, r: int, hpos: int, hend: int,
                        body_size: int) -> None:
        """The fast path's second half: a publish whose method and header frames are in and whose one big
        body frame has begun, taken as the general path would take its frames one by one (the body then
        streamed as it arrives) in one step. Takes nothing when the body frame or the properties are
        irregular: the general path reports them."""
        bpos = hend + 1
        ftype, bch, bsize = _FRAME_HEAD.unpack_from(buf, bpos)
        if ftype != 3 or bch != channel or bsize != body_size:
            return
        props_raw = buf[hpos + 19:hend]
        mode = _checked_mode(props_raw)
        if mode is _BAD_PROPERTIES:
            return
        asm = _Assembly(buf[o + 1:e], buf[e + 1:r], bool(buf[r] & 1))
        asm.size = body_size
        asm.props_raw = props_raw
        asm.delivery_mode = mode
        self._assembly[channel] = asm
        self.frames_in += 2
        self._begin_stream(channel, body_size, bpos)

    def _content_state(self, channel: int) -> _Assembly | None:
        """The assembly a content frame on ``channel`` belongs to; None if the frame is to be dropped."""
        state = self._channels.get(channel)
        if state == CH_SERVER_CLOSING:
            return None
        if state is None and channel > self.channel_max:
            raise ConnectionLevelError(E.NOT_ALLOWED, reply_text(
                E.NOT_ALLOWED, f"channel number {channel} is over the negotiated channel_max ({self.channel_max})"))
        asm = self._assembly.get(channel)
        if asm is None:
            raise _unexpected("expected method frame, got non method frame instead")
        return asm

    def _content_header(self, channel: int, buf, ps: int, pe: int):
        asm = self._content_state(channel)
        if asm is None:
            return None
        if asm.size >= 0:
            raise _unexpected("expected content body, got non content body frame instead", frames.BASIC_PUBLISH)
        if pe - ps < _HEADER_MIN_BYTES:
            raise _unknown_frame(2, buf, ps, pe)
        cls, weight, size = _HEADER_PAYLOAD.unpack_from(buf, ps)
        if weight != 0:
            raise _unexpected("expected content header for class 60, got non content header frame instead",
                              frames.BASIC_PUBLISH)
        if cls != 60:
            raise _unexpected(f"expected content header for class 60, got one for class {cls} instead",
                              frames.BASIC_PUBLISH)
        asm.props_raw = bytes(buf[ps + 12:pe])
        asm.delivery_mode = frames.check_properties(asm.props_raw)
        asm.size = size
        asm.oversized = size > self.max_message_bytes
        return self._complete(channel, asm) if size == 0 else None

    def _content_body(self, channel: int, buf, ps: int, pe: int):
        asm = self._content_state(channel)
        if asm is None:
            return None
        if asm.size < 0:
            raise _unexpected("expected content header for class 60, got non content header frame instead",
                              frames.BASIC_PUBLISH)
        asm.got += pe - ps
        if asm.got > asm.size:
            raise FrameError(E.FRAME_ERROR, reply_text(E.FRAME_ERROR, "content body frame exceeds remaining "
                                                                      "content size"), *frames.BASIC_PUBLISH)
        if not asm.oversized:
            asm.parts.append(bytes(buf[ps:pe]) if pe - ps < VIEW_BODY_MIN_BYTES else memoryview(buf)[ps:pe])
        return self._complete(channel, asm) if asm.got == asm.size else None

    def _complete(self, channel: int, asm: _Assembly):
        del self._assembly[channel]
        if asm.oversized:
            raise ChannelLevelError(E.PRECONDITION_FAILED, reply_text(
                E.PRECONDITION_FAILED, f"message size {asm.size} is larger than configured max size "
                                       f"{self.max_message_bytes}"), *frames.BASIC_PUBLISH)
        parts = asm.parts
        if len(parts) == 1:
            body = parts[0]
        elif asm.size >= VIEW_BODY_MIN_BYTES:
            body = BodyParts(parts, asm.size)
        else:
            body = b"".join(parts)
        self.publishes += 1
        return _new_publish(Publish, (channel, asm.exchange, asm.routing_key, asm.mandatory, asm.props_raw, body,
                                      asm.delivery_mode))

    # -- answers and frames the reader asks for -------------------------------------------------------------
    def open_channel_ok(self, channel: int) -> None:
        """Answer a ChannelOpen (once the channel's process exists); ignored if the channel has moved on."""
        if self.state == "open" and self._channels.get(channel) == CH_OPENING:
            self._advance_channel(channel, "open_ok")
            self._method(channel, commands.Channel.OpenOk())

    def close_channel_ok(self, channel: int) -> None:
        """Answer a ChannelClose (once the channel's process has stopped); frees the channel number."""
        if self._channels.get(channel) != CH_CLIENT_CLOSING:
            return
        self._advance_channel(channel, "close_ok_sent")
        if self.state == "open":
            self._method(channel, commands.Channel.CloseOk())

    def close_channel(self, channel: int, reply_code: int, reply_text: str, class_id: int = 0,
                      method_id: int = 0, *, hold: bool = False) -> None:
        """Server-initiated channel.close; frames on the channel are dropped until the client's close-ok.
        ``hold``: the close frame itself waits for ``send_held_close``."""
        if self.state != "open" or self._channels.get(channel) not in (CH_OPEN, CH_OPENING):
            return
        self._advance_channel(channel, "server_close")
        self._assembly.pop(channel, None)
        close = commands.Channel.Close(reply_code=reply_code, reply_text=_clip(reply_text), class_id=class_id,
                                       method_id=method_id)
        if hold:
            self._held_closes[channel] = close
        else:
            self._method(channel, close)

    def held_close(self, channel: int) -> commands.Channel.Close | None:
        """The channel.close held for ``channel`` (see ``hold_channel_closes``), if any."""
        return self._held_closes.get(channel)

    def send_held_close(self, channel: int) -> bool:
        """Send the channel.close held for ``channel``; False when none was held."""
        close = self._held_closes.pop(channel, None)
        if close is None:
            return False
        if self.state == "open" and self._channels.get(channel) == CH_SERVER_CLOSING:
            self._method(channel, close)
        return True

    def send_close_ok(self) -> None:
        """Answer the client's connection.close, once what its channels still had to say is queued
        (RabbitMQ's reader shuts its channels down before it sends close-ok)."""
        if self.state == "client_closing":
            self._method(0, commands.Connection.CloseOk())
            self._advance("close_ok_sent")

    def close(self, reply_code: int, reply_text: str, class_id: int = 0, method_id: int = 0) -> None:
        """Server-initiated connection.close; afterwards only close/close-ok from the client count."""
        if self.state == "client_closing":
            self.send_close_ok()            # the client is closing anyway: just finish its handshake
            return
        if self.state in ("closing", "closed"):
            return
        if self.state == "awaiting_header":
            self._advance("drop")
            return
        self._method(0, commands.Connection.Close(reply_code=reply_code, reply_text=_clip(reply_text),
                                                  class_id=class_id, method_id=method_id))
        self._advance("close_sent")
        self._assembly.clear()

    def send_raw(self, data: bytes) -> None:
        """Pre-encoded frames from a channel or queue process (dropped once we close the connection;
        while the client's close waits for close-ok, its channels' last answers still go out)."""
        if (self.state == "open" or self.state == "client_closing") and data:
            self._out.append(data)
            self.frames_out += frames.count_frames(data)

    def send_frames(self, data: bytes, frames_in_it: int) -> None:
        """``send_raw`` for frames whose count the caller knows (a delivery it just encoded)."""
        if self.state == "open" or self.state == "client_closing":
            self._out.append(data)
            self.frames_out += frames_in_it

    def send_parts(self, parts: list, frames_in_them: int) -> bool:
        """``send_frames`` for frames in pieces (``frames.deliver_parts``); False if they were dropped."""
        if self.state == "open" or self.state == "client_closing":
            self._out += parts
            self.frames_out += frames_in_them
            return True
        return False

    def send_deliver(self, channel: int, consumer_tag: str, delivery_tag: int, redelivered: bool, exchange: str,
                     routing_key: str, props_raw: bytes, body: bytes) -> None:
        """One basic.deliver with its content, split to the negotiated frame_max."""
        if self.state != "open" or self._channels.get(channel) not in (CH_OPEN, CH_OPENING):
            return
        self._out.append(frames.encode_deliver(channel, consumer_tag, delivery_tag, redelivered, exchange,
                                               routing_key, props_raw, body, self.frame_max))
        chunk = self.frame_max - frames.FRAME_OVERHEAD_BYTES if self.frame_max else len(body) or 1
        self.frames_out += 2 + -(-len(body) // chunk)

    def send_blocked(self, reason: str) -> bool:
        """connection.blocked, only to a client that announced the capability; True if queued."""
        if self.state != "open" or self.capabilities.get("connection.blocked") is not True:
            return False
        self._method(0, commands.Connection.Blocked(reason=_clip(reason)))
        return True

    def send_unblocked(self) -> bool:
        """connection.unblocked, only to a client that announced the capability; True if queued."""
        if self.state != "open" or self.capabilities.get("connection.blocked") is not True:
            return False
        self._method(0, commands.Connection.Unblocked())
        return True

    # -- heartbeats -------------------------------------------------------------------------------------------
    def tick(self, now_ns: int) -> HeartbeatTimeout | HandshakeTimeout | None:
        """Queue a heartbeat if we have been quiet for half an interval; report a silent client.

        The client times out once nothing has arrived for more than
        ``HEARTBEAT_MISSES_ALLOWED`` intervals, unless the monitor is paused
        (it is while the reader is blocked and not reading). Heartbeats run
        from tune-ok until the connection starts closing.
        """
        if self._fresh_bytes:
            self._fresh_bytes = False
            self._last_in_ns = now_ns
        if self.state in _BEFORE_OPEN and self._handshake_deadline_ns is not None \
                and now_ns >= self._handshake_deadline_ns:
            self._advance("drop")
            return HandshakeTimeout()
        hb = self.heartbeat_s
        if not hb or self.state not in ("opening", "open"):
            return None
        interval_ns = hb * NS_PER_S
        if now_ns - self._last_out_ns >= interval_ns // 2:
            self._out.append(frames.encode_heartbeat())
            self.frames_out += 1
            self.heartbeats_sent += 1
            self._last_out_ns = now_ns
        if not self._monitor_paused and now_ns - self._last_in_ns > HEARTBEAT_MISSES_ALLOWED * interval_ns:
            self._advance("drop")
            return HeartbeatTimeout()
        return None

    def next_tick_ns(self) -> int | None:
        """When ``tick`` next has something to do (a handshake deadline, a heartbeat to send, a silent
        client to drop); None while it has nothing to time."""
        if self.state in _BEFORE_OPEN and self._handshake_deadline_ns is not None:
            return self._handshake_deadline_ns
        hb = self.heartbeat_s
        if not hb or self.state not in ("opening", "open"):
            return None
        interval_ns = hb * NS_PER_S
        due = self._last_out_ns + interval_ns // 2
        # bytes that came since the last tick put the client's deadline later than any tick can know
        # yet: the next heartbeat out is soon enough to count them
        if not self._monitor_paused and not self._fresh_bytes:
            due = min(due, self._last_in_ns + HEARTBEAT_MISSES_ALLOWED * interval_ns + 1)
        return due

    def pause_heartbeat_monitor(self) -> None:
        """Stop timing out a silent client (RabbitMQ does this while the connection is blocked)."""
        self._monitor_paused = True

    def resume_heartbeat_monitor(self, now_ns: int) -> None:
        """Time the client again, counting from ``now_ns``."""
        self._monitor_paused = False
        self._last_in_ns = now_ns

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(self.state, self.bytes_in, self.bytes_out, self.frames_in, self.frames_out,
                                    self.publishes, self.methods, len(self._channels), self.buffered_bytes(),
                                    self.heartbeats_sent)


def _negotiated(field: str, client: int, server: int, minimum: int) -> int:
    """The value a tune-ok settles on: the client may lower the server's limit, never raise it.

    0 from the client means it sets no limit of its own, so the server's
    applies (RabbitMQ itself refuses 0 when it has a limit); 0 on both sides
    means no limit. A value under ``minimum`` or over the server's is 530
    NOT_ALLOWED with RabbitMQ's wording.
    """
    if client == 0:
        return server
    if client < minimum:
        explanation = f"negotiated {field} = {client} is lower than the minimum allowed value ({minimum})"
    elif server != 0 and client > server:
        explanation = f"negotiated {field} = {client} is higher than the maximum allowed value ({server})"
    else:
        return client
    raise ConnectionLevelError(E.NOT_ALLOWED, reply_text(E.NOT_ALLOWED, explanation), *frames.CONNECTION_TUNE)


def _credentials(mechanism: str, response) -> tuple[str, str]:
    """``(user, password)`` from a start-ok response; a malformed response is 502 SYNTAX_ERROR."""
    raw = response.encode("utf-8") if isinstance(response, str) else bytes(response or b"")
    if mechanism == "PLAIN":
        parts = raw.split(b"\x00")
        if len(parts) == 3:
            try:
                return parts[1].decode("utf-8"), parts[2].decode("utf-8")
            except UnicodeDecodeError:
                pass
        explanation = f"response {E.erlang_binary(raw)} invalid"
    else:
        try:
            table = fields.decode_table(raw, 0, len(raw))
        except FrameError:
            table = {}
        user, password = table.get("LOGIN"), table.get("PASSWORD")
        if isinstance(user, str) and isinstance(password, str):
            return user, password
        explanation = "AMQPLAIN auth info is missing LOGIN or PASSWORD field"
    raise ConnectionLevelError(E.SYNTAX_ERROR, reply_text(E.SYNTAX_ERROR, explanation), *frames.CONNECTION_START_OK)
