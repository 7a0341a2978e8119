"""AMQP 0-9-1 frames: pamqp for everything, hand-written fast paths per message.

Every frame is big-endian::

    offset 0  u8   type         1 method, 2 content header, 3 content body, 8 heartbeat
    offset 1  u16  channel      0 for the connection itself
    offset 3  u32  size         payload bytes; at most frame_max - 8
    offset 7  payload[size]
    offset 7+size  u8  0xCE     frame end

Payloads::

    method     u16 class id | u16 method id | arguments
    header     u16 class id (60) | u16 weight (0) | u64 body size | props_raw
    body       body bytes; a message's body is split over as many body frames
               as frame_max needs, each payload at most frame_max - 8 bytes
    heartbeat  (empty), channel 0

    props_raw  u16 property flags | the present properties in flag order:
               bit 15 content-type shortstr   bit 14 content-encoding shortstr
               bit 13 headers table           bit 12 delivery-mode octet
               bit 11 priority octet          bit 10 correlation-id shortstr
               bit  9 reply-to shortstr       bit  8 expiration shortstr
               bit  7 message-id shortstr     bit  6 timestamp u64
               bit  5 type shortstr           bit  4 user-id shortstr
               bit  3 app-id shortstr         bit  2 cluster-id shortstr

The per-message methods (field types as in the specification)::

    basic.publish  60/40  u16 reserved | shortstr exchange | shortstr routing key
                          | octet bits (1 mandatory, 2 immediate)
    basic.deliver  60/60  shortstr consumer tag | u64 delivery tag | octet bits
                          (1 redelivered) | shortstr exchange | shortstr routing key
    basic.ack      60/80  u64 delivery tag | octet bits (1 multiple)

    shortstr = u8 length | UTF-8 bytes; table and longstr = u32 length | bytes

A message travels as method frame, header frame, then body frames (none for
an empty body), all on the same channel. ``props_raw`` is forwarded untouched
from publisher to consumer. The fast paths here are byte-identical to pamqp's
encoding (the tests hold them to it); anything else goes through pamqp.

Decoders are pure functions over ``(buf, payload_start, payload_end)``, so
they read frames in place in a receive buffer. ``next_frame`` never consumes
a partial frame: incomplete input is ``None``, never an error. Malformed
input raises ``FrameError`` (or another ``AmqpError``) with the reply code a
RabbitMQ broker would close the connection with.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from pamqp import commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from pipeline.amqp import fields
from pipeline.amqp.errors import (FRAME_ERROR, NOT_IMPLEMENTED, AmqpError, ConnectionLevelError,
                                  FrameError, erlang_binary)

__all__ = [
    "PROTOCOL_HEADER", "FRAME_END", "FRAME_OVERHEAD_BYTES", "FRAME_MIN_SIZE", "FRAME_HEADER_BYTES",
    "FrameType", "FrameError", "AmqpError", "next_frame", "method_id", "count_frames", "properties_raw",
    "delivery_mode_of", "check_properties", "encode_content", "encode_publish", "decode_publish",
    "decode_publish_raw", "encode_deliver", "decode_deliver", "decode_content_header", "encode_basic_ack",
    "decode_basic_ack", "encode_method", "decode_method", "method_name", "encode_heartbeat", "octets",
]

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_END = 0xCE
FRAME_HEADER_BYTES = 7
FRAME_OVERHEAD_BYTES = 8          # header + frame-end octet
FRAME_MIN_SIZE = 4096             # the smallest frame_max a peer may ask for


class FrameType(IntEnum):
    METHOD = 1
    HEADER = 2
    BODY = 3
    HEARTBEAT = 8


CLASS_CONNECTION = 10
CLASS_CHANNEL = 20
CLASS_EXCHANGE = 40
CLASS_QUEUE = 50
CLASS_BASIC = 60
CLASS_CONFIRM = 85
CLASS_TX = 90

CONNECTION_START = (10, 10)
CONNECTION_START_OK = (10, 11)
CONNECTION_SECURE = (10, 20)
CONNECTION_SECURE_OK = (10, 21)
CONNECTION_TUNE = (10, 30)
CONNECTION_TUNE_OK = (10, 31)
CONNECTION_OPEN = (10, 40)
CONNECTION_OPEN_OK = (10, 41)
CONNECTION_CLOSE = (10, 50)
CONNECTION_CLOSE_OK = (10, 51)
CONNECTION_BLOCKED = (10, 60)
CONNECTION_UNBLOCKED = (10, 61)
CONNECTION_UPDATE_SECRET = (10, 70)
CHANNEL_OPEN = (20, 10)
CHANNEL_OPEN_OK = (20, 11)
CHANNEL_FLOW = (20, 20)
CHANNEL_FLOW_OK = (20, 21)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)
EXCHANGE_DECLARE = (40, 10)
EXCHANGE_DELETE = (40, 20)
EXCHANGE_BIND = (40, 30)
EXCHANGE_UNBIND = (40, 40)
QUEUE_DECLARE = (50, 10)
QUEUE_BIND = (50, 20)
QUEUE_PURGE = (50, 30)
QUEUE_DELETE = (50, 40)
QUEUE_UNBIND = (50, 50)
BASIC_QOS = (60, 10)
BASIC_CONSUME = (60, 20)
BASIC_CANCEL = (60, 30)
BASIC_CANCEL_OK = (60, 31)
BASIC_PUBLISH = (60, 40)
BASIC_RETURN = (60, 50)
BASIC_DELIVER = (60, 60)
BASIC_GET = (60, 70)
BASIC_GET_OK = (60, 71)
BASIC_GET_EMPTY = (60, 72)
BASIC_ACK = (60, 80)
BASIC_REJECT = (60, 90)
BASIC_RECOVER_ASYNC = (60, 100)
BASIC_RECOVER = (60, 110)
BASIC_NACK = (60, 120)
CONFIRM_SELECT = (85, 10)
TX_SELECT = (90, 10)
TX_COMMIT = (90, 20)
TX_ROLLBACK = (90, 30)


# struct layouts; the public ones are also used by the connection's whole-publish fast path
FRAME_HEAD = struct.Struct(">BHI")                  # type, channel, payload size
PUBLISH_FRAME_HEAD = struct.Struct(">BHIHHH")       # frame head + class, method, reserved
HEADER_FRAME_HEAD = struct.Struct(">BHIHHQ")        # frame head + class, weight, body size
HEADER_PAYLOAD_HEAD = struct.Struct(">HHQ")         # class, weight, body size
HEADER_PAYLOAD_MIN_BYTES = 14                       # class, weight, body size, property flags
_METHOD_ID = struct.Struct(">HH")
_DELIVER_HEAD = struct.Struct(">BHIHH")             # frame head + class, method
_ACK = struct.Struct(">BHIHHQBB")                   # a whole basic.ack frame
_TAG_BITS = struct.Struct(">QB")                    # delivery tag, bits
_BODY_SIZE = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_END = b"\xce"
_HEARTBEAT = bytes((8, 0, 0, 0, 0, 0, 0, FRAME_END))

# property flag bit -> how its value is laid out (in flag order)
_SHORTSTR, _TABLE, _DELIVERY_MODE = -1, -2, -3      # anything >= 0 is a fixed size in bytes
_PROPERTY_KINDS = ((0x8000, _SHORTSTR), (0x4000, _SHORTSTR), (0x2000, _TABLE), (0x1000, _DELIVERY_MODE),
                   (0x0800, 1), (0x0400, _SHORTSTR), (0x0200, _SHORTSTR), (0x0100, _SHORTSTR),
                   (0x0080, _SHORTSTR), (0x0040, 8), (0x0020, _SHORTSTR), (0x0010, _SHORTSTR),
                   (0x0008, _SHORTSTR), (0x0004, _SHORTSTR))
_PROPERTY_LAYOUTS: dict[int, tuple[int, ...]] = {}


# -- frames ---------------------------------------------------------------------------------

def next_frame(buf, offset: int = 0, frame_max: int | None = None, *,
               slack_bytes: int = 0) -> tuple[int, int, int, int] | None:
    """``(frame_type, channel, payload_start, payload_end)`` of the frame at ``offset``, or None if incomplete.

    The frame-end octet is at ``payload_end``; the next frame starts at
    ``payload_end + 1``. Raises ``FrameError`` (501) for a payload over
    ``frame_max - 8`` (+ ``slack_bytes``, RabbitMQ tolerates 8 more) as soon
    as the 7-byte frame header is in, and for a wrong frame-end octet.
    """
    if len(buf) - offset < FRAME_HEADER_BYTES:
        return None
    ftype, channel, size = FRAME_HEAD.unpack_from(buf, offset)
    if frame_max and size > frame_max - FRAME_OVERHEAD_BYTES + slack_bytes:
        raise FrameError(FRAME_ERROR, f"FRAME_ERROR - type {ftype}, all octets = <<>>: "
                                      f"{{frame_too_large,{size},{frame_max - FRAME_OVERHEAD_BYTES}}}")
    end = offset + FRAME_HEADER_BYTES + size
    if len(buf) <= end:
        return None
    if buf[end] != FRAME_END:
        raise FrameError(FRAME_ERROR, f"FRAME_ERROR - type {ftype}, {octets(buf, offset + 7, end)}: "
                                      f"{{invalid_frame_end_marker,{buf[end]}}}")
    return ftype, channel, offset + FRAME_HEADER_BYTES, end


def method_id(buf, payload_start: int) -> tuple[int, int]:
    """``(class_id, method_id)`` of the method frame whose payload starts at ``payload_start``."""
    return _METHOD_ID.unpack_from(buf, payload_start)


def count_frames(data) -> int:
    """How many whole frames ``data`` holds (walking frame headers only)."""
    n, pos, size = 0, 0, len(data)
    while size - pos >= FRAME_OVERHEAD_BYTES:
        pos += FRAME_OVERHEAD_BYTES + _U32.unpack_from(data, pos + 3)[0]
        if pos > size:
            break
        n += 1
    return n


def octets(buf, start: int, end: int) -> str:
    """The first 16 payload octets the way RabbitMQ's frame errors show them (``all octets = <<"xx">>``)."""
    which = "all" if end - start <= 16 else "first 16"
    return f"{which} octets = {erlang_binary(buf[start:min(end, start + 16)])}"


def encode_heartbeat() -> bytes:
    return _HEARTBEAT


# -- properties and content -------------------------------------------------------------------

def properties_raw(properties: commands.Basic.Properties | None = None, **kwargs) -> bytes:
    """Property flags and list, as they follow the body size in a content header (via pamqp)."""
    props = properties if properties is not None else commands.Basic.Properties(**kwargs)
    encoded = pamqp_frame.marshal(pamqp_header.ContentHeader(0, 0, props), 0)
    return encoded[FRAME_HEADER_BYTES + 12:-1]


def delivery_mode_of(props_raw) -> int | None:
    """The delivery mode in ``props_raw``, or None when absent; skips only what precedes it."""
    if len(props_raw) < 2:
        return None
    flags = _U16.unpack_from(props_raw, 0)[0]
    if not flags & 0x1000:
        return None
    o = 2
    if flags & 0x8000:
        o += 1 + props_raw[o]
    if flags & 0x4000:
        o += 1 + props_raw[o]
    if flags & 0x2000:
        o += 4 + _U32.unpack_from(props_raw, o)[0]
    return props_raw[o]


def _layout(flags: int) -> tuple[int, ...]:
    layout = _PROPERTY_LAYOUTS.get(flags)
    if layout is None:
        layout = tuple(kind for bit, kind in _PROPERTY_KINDS if flags & bit)
        _PROPERTY_LAYOUTS[flags] = layout
    return layout


def check_properties(props_raw) -> int | None:
    """Check that the present properties fill ``props_raw`` exactly; return the delivery mode (or None).

    The headers table is walked (``fields.check_table``: known types, lengths
    that add up, nesting within ``fields.FIELD_NESTING_MAX``) but not built.
    Raises ``FrameError`` (501) for a property list that is truncated, has
    bytes left over, or holds a malformed headers table.
    """
    size = len(props_raw)
    if size == 2 and props_raw[0] == 0 and props_raw[1] == 0:
        return None                              # no properties
    if size == 3 and props_raw[0] == 0x10 and props_raw[1] == 0:
        return props_raw[2]                      # delivery mode only: the common case
    try:
        flags = _U16.unpack_from(props_raw, 0)[0]
        o = 2
        mode = None
        for kind in _layout(flags):
            if kind == _SHORTSTR:
                o += 1 + props_raw[o]
            elif kind == _TABLE:
                start = o + 4
                o = start + _U32.unpack_from(props_raw, o)[0]
                if o <= size:
                    fields.check_table(props_raw, start, o)
            elif kind == _DELIVERY_MODE:
                mode = props_raw[o]
                o += 1
            else:
                o += kind
    except (IndexError, struct.error):
        o = size + 1
    except FrameError as err:               # from the headers table
        err.class_id, err.method_id = BASIC_PUBLISH
        raise
    if o != size:
        raise FrameError(FRAME_ERROR, f"FRAME_ERROR - cannot decode content properties "
                                      f"{erlang_binary(props_raw, text=False)}", *BASIC_PUBLISH)
    return mode


def _content_parts(channel: int, props_raw, body, frame_max: int) -> list:
    size = len(body)
    parts = [HEADER_FRAME_HEAD.pack(2, channel, 12 + len(props_raw), 60, 0, size), props_raw, _END]
    chunk = frame_max - FRAME_OVERHEAD_BYTES if frame_max else size
    if chunk >= size:
        if size:
            parts += (FRAME_HEAD.pack(3, channel, size), body, _END)
    else:
        for start in range(0, size, chunk):
            piece = body[start:start + chunk]
            parts += (FRAME_HEAD.pack(3, channel, len(piece)), piece, _END)
    return parts


def encode_content(channel: int, props_raw, body, frame_max: int) -> bytes:
    """Header frame (class 60, weight 0, body size) and body frames of at most ``frame_max`` bytes each."""
    return b"".join(_content_parts(channel, props_raw, body, frame_max))


def decode_content_header(buf, payload_start: int, payload_end: int) -> tuple[int, bytes]:
    """``(body_size, props_raw)`` of a content header payload."""
    if payload_end - payload_start < HEADER_PAYLOAD_MIN_BYTES:
        raise FrameError(FRAME_ERROR, f"FRAME_ERROR - type 2, {octets(buf, payload_start, payload_end)}: "
                                      "unknown_frame")
    (size,) = _BODY_SIZE.unpack_from(buf, payload_start + 4)
    return size, bytes(buf[payload_start + 12:payload_end])


# -- the per-message methods -------------------------------------------------------------------

_SHORTSTR_CACHE: dict = {}
_SHORTSTR_CACHE_ENTRIES = 4096


def _sstr(s) -> bytes:
    """A shortstr (length octet + UTF-8); names repeat from message to message, so they are cached."""
    encoded = _SHORTSTR_CACHE.get(s) if isinstance(s, (str, bytes)) else None
    if encoded is None:
        raw = s.encode("utf-8") if isinstance(s, str) else bytes(s)
        if len(raw) > 255:
            raise ValueError(f"short string of {len(raw)} bytes is over 255")
        encoded = bytes((len(raw),)) + raw
        if isinstance(s, (str, bytes)):
            if len(_SHORTSTR_CACHE) >= _SHORTSTR_CACHE_ENTRIES:
                _SHORTSTR_CACHE.clear()
            _SHORTSTR_CACHE[s] = encoded
    return encoded


def _cannot_decode(key: tuple[int, int], buf, start: int, end: int) -> FrameError:
    return fields.cannot_decode(buf[start:end], *key)


def encode_publish(channel: int, exchange, routing_key, props_raw, body, frame_max: int,
                   mandatory: bool = False) -> bytes:
    """basic.publish method, header and body frames: one whole message as a client sends it."""
    ex, rk = _sstr(exchange), _sstr(routing_key)
    parts = [PUBLISH_FRAME_HEAD.pack(1, channel, 7 + len(ex) + len(rk), 60, 40, 0), ex, rk,
             b"\x01\xce" if mandatory else b"\x00\xce"]
    parts += _content_parts(channel, props_raw, body, frame_max)
    return b"".join(parts)


def decode_publish_raw(buf, payload_start: int, payload_end: int | None = None) -> tuple[bytes, bytes, int]:
    """``(exchange, routing_key, bits)`` of a basic.publish payload, names left as UTF-8 bytes."""
    o = payload_start + 6
    try:
        n = buf[o]
        e = o + 1 + n
        exchange = bytes(buf[o + 1:e])
        n = buf[e]
        r = e + 1 + n
        routing_key = bytes(buf[e + 1:r])
        bits = buf[r]
    except IndexError:
        r = -2
    if payload_end is not None and r + 1 != payload_end or r < 0:
        end = len(buf) if payload_end is None else payload_end
        raise _cannot_decode(BASIC_PUBLISH, buf, payload_start + 4, end)
    return exchange, routing_key, bits


def decode_publish(buf, payload_start: int, payload_end: int) -> tuple[str, str, bool]:
    """``(exchange, routing_key, mandatory)`` of a basic.publish payload."""
    exchange, routing_key, bits = decode_publish_raw(buf, payload_start, payload_end)
    try:
        return exchange.decode("utf-8"), routing_key.decode("utf-8"), bool(bits & 1)
    except UnicodeDecodeError:
        raise _cannot_decode(BASIC_PUBLISH, buf, payload_start + 4, payload_end) from None


def encode_deliver(channel: int, consumer_tag, delivery_tag: int, redelivered: bool, exchange, routing_key,
                   props_raw, body, frame_max: int) -> bytes:
    """basic.deliver method, header and body frames: one whole message as a consumer receives it."""
    ct, ex, rk = _sstr(consumer_tag), _sstr(exchange), _sstr(routing_key)
    parts = [_DELIVER_HEAD.pack(1, channel, 13 + len(ct) + len(ex) + len(rk), 60, 60), ct,
             _TAG_BITS.pack(delivery_tag, 1 if redelivered else 0), ex, rk, _END]
    parts += _content_parts(channel, props_raw, body, frame_max)
    return b"".join(parts)


def encode_deliver_names(channel: int, consumer_tag, delivery_tag: int, redelivered: bool, names, props_raw, body,
                         frame_max: int) -> tuple[bytes, int]:
    """``encode_deliver`` for a message whose exchange and routing key are at hand already as the two
    shortstrs a publish carried (``names``, passed on as they are), and how many frames it made."""
    parts, count = deliver_parts(channel, consumer_tag, delivery_tag, redelivered, names, props_raw, body, frame_max)
    return b"".join(parts), count


def deliver_parts(channel: int, consumer_tag, delivery_tag: int, redelivered: bool, names, props_raw, body,
                  frame_max: int) -> tuple[list, int]:
    """The pieces of ``encode_deliver_names``'s bytes, the body (a view, or its slices) among them uncopied,
    for a scatter-gather send; and how many frames they make."""
    ct = _sstr(consumer_tag)
    size = len(body)
    chunk = frame_max - FRAME_OVERHEAD_BYTES if frame_max else size
    head = [_DELIVER_HEAD.pack(1, channel, 13 + len(ct) + len(names), 60, 60), ct,
            _TAG_BITS.pack(delivery_tag, 1 if redelivered else 0), names, _END]
    if chunk >= size:
        head += (HEADER_FRAME_HEAD.pack(2, channel, 12 + len(props_raw), 60, 0, size), props_raw, _END)
        if size:
            head += (FRAME_HEAD.pack(3, channel, size), body, _END)
            return head, 3
        return head, 2
    return head + _content_parts(channel, props_raw, body, frame_max), 2 + -(-size // chunk)


_HEADER_AFTER_END = struct.Struct(">BBHIHHQ")       # the method frame's end, then the header frame's head
_BODY_AFTER_END = struct.Struct(">BBHI")            # the header frame's end, then the body frame's head
DELIVER_TEMPLATES_KEPT = 1024


class DeliverTemplates:
    """basic.deliver from a template: what every delivery to one consumer shares (the method frame's head,
    its size and the consumer tag, for one length of exchange and routing key) is packed once and kept,
    and a delivery adds its tag, names, properties and body. Byte for byte ``encode_deliver_names``, for
    a body that fits one frame (and is not empty)."""

    def __init__(self):
        self.heads: dict = {}

    def encode(self, channel: int, ctag_sstr: bytes, delivery_tag: int, redelivered: bool, names, props_raw,
               body) -> bytes:
        """The three frames; ``ctag_sstr`` and ``names`` are shortstrs as they came (see ``deliver_offsets``)."""
        key = (channel, ctag_sstr, len(names))
        head = self.heads.get(key)
        if head is None:
            if len(self.heads) >= DELIVER_TEMPLATES_KEPT:
                self.heads.clear()
            head = self.heads[key] = _DELIVER_HEAD.pack(1, channel, 13 + len(ctag_sstr) + len(names),
                                                        60, 60) + ctag_sstr
        size = len(body)
        return b"".join((head, _TAG_BITS.pack(delivery_tag, 1 if redelivered else 0), names,
                         _HEADER_AFTER_END.pack(FRAME_END, 2, channel, 12 + len(props_raw), 60, 0, size), props_raw,
                         _BODY_AFTER_END.pack(FRAME_END, 3, channel, size), body, _END))


def encode_get_ok(channel: int, delivery_tag: int, redelivered: bool, exchange, routing_key, message_count: int,
                  props_raw, body, frame_max: int) -> bytes:
    """basic.get-ok method, header and body frames; names go out as the bytes they came in."""
    ex, rk = _sstr(exchange), _sstr(routing_key)
    parts = [_DELIVER_HEAD.pack(1, channel, 17 + len(ex) + len(rk), 60, 71),
             _TAG_BITS.pack(delivery_tag, 1 if redelivered else 0), ex, rk, _U32.pack(message_count), _END]
    parts += _content_parts(channel, props_raw, body, frame_max)
    return b"".join(parts)


def encode_basic_return(channel: int, reply_code: int, reply_text: str, exchange, routing_key, props_raw, body,
                        frame_max: int) -> bytes:
    """basic.return method, header and body frames; names go out as the bytes they came in."""
    text, ex, rk = _sstr(reply_text), _sstr(exchange), _sstr(routing_key)
    parts = [_DELIVER_HEAD.pack(1, channel, 6 + len(text) + len(ex) + len(rk), 60, 50), _U16.pack(reply_code),
             text, ex, rk, _END]
    parts += _content_parts(channel, props_raw, body, frame_max)
    return b"".join(parts)


def decode_deliver(buf, payload_start: int, payload_end: int) -> tuple[str, int, bool, str, str]:
    """``(consumer_tag, delivery_tag, redelivered, exchange, routing_key)`` of a basic.deliver payload."""
    try:
        o = payload_start + 4
        e = o + 1 + buf[o]
        consumer_tag = bytes(buf[o + 1:e]).decode("utf-8")
        tag, bits = _TAG_BITS.unpack_from(buf, e)
        o = e + 9
        e = o + 1 + buf[o]
        exchange = bytes(buf[o + 1:e]).decode("utf-8")
        r = e + 1 + buf[e]
        routing_key = bytes(buf[e + 1:r]).decode("utf-8")
    except (IndexError, struct.error, UnicodeDecodeError):
        r = -1
    if r != payload_end:
        raise _cannot_decode(BASIC_DELIVER, buf, payload_start + 4, payload_end)
    return consumer_tag, tag, bool(bits & 1), exchange, routing_key


def encode_basic_ack(channel: int, delivery_tag: int, multiple: bool = False) -> bytes:
    return _ACK.pack(1, channel, 13, 60, 80, delivery_tag, 1 if multiple else 0, FRAME_END)


def decode_basic_ack(buf, payload_start: int, payload_end: int) -> tuple[int, bool]:
    """``(delivery_tag, multiple)`` of a basic.ack payload."""
    if payload_end - payload_start != 13:
        raise _cannot_decode(BASIC_ACK, buf, payload_start + 4, payload_end)
    tag, bits = _TAG_BITS.unpack_from(buf, payload_start + 4)
    return tag, bool(bits & 1)


# -- every other method -----------------------------------------------------------------------------

def method_name(key: tuple[int, int]) -> str:
    """``'basic.publish'`` style name of a (class_id, method_id), or ``'unknown 60/99'``."""
    cls = commands.INDEX_MAPPING.get(key[0] << 16 | key[1])
    if cls is None:
        return f"unknown {key[0]}/{key[1]}"
    return _dotted(cls.name)


def _dotted(pamqp_name: str) -> str:
    klass, _, method = pamqp_name.partition(".")
    words = "".join("-" + c.lower() if c.isupper() else c for c in method).lstrip("-")
    return f"{klass.lower()}.{words}"


def encode_method(channel: int, method) -> bytes:
    """One method frame for any pamqp method object (via pamqp)."""
    return pamqp_frame.marshal(method, channel)


def encode_reply(channel: int, cls, **fields) -> bytes:
    """A method frame the broker sends, built without pamqp's client-side name checks: pamqp
    refuses queue and exchange names RabbitMQ accepts (``café``, ``orders!``, exchange names over
    127 bytes), and a server must echo back whatever name it was given."""
    unchecked = _UNCHECKED.get(cls)
    if unchecked is None:
        unchecked = _UNCHECKED[cls] = type(cls.__name__, (cls,), {"validate": lambda self: None})
    method = unchecked.__new__(unchecked)
    defaults = cls.__init__.__defaults__ or ()
    params = cls.__init__.__code__.co_varnames[1:cls.__init__.__code__.co_argcount]
    for name, value in zip(params[len(params) - len(defaults):], defaults):
        setattr(method, name, value)
    for name, value in fields.items():
        setattr(method, name, value)
    return pamqp_frame.marshal(method, channel)


_UNCHECKED: dict = {}


def decode_method(buf, payload_start: int, payload_end: int):
    """The pamqp method object of a method frame payload (arguments read by ``fields``, never recursively).

    Unknown class/method ids raise ``ConnectionLevelError`` (540
    NOT_IMPLEMENTED); arguments that are truncated, have bytes left over or do
    not decode raise ``FrameError`` (501 "cannot decode <<...>>", or
    "Malformed UTF-8 in shortstr"), as RabbitMQ does.
    """
    if payload_end - payload_start < 4:
        raise FrameError(FRAME_ERROR, f"FRAME_ERROR - type 1, {octets(buf, payload_start, payload_end)}: "
                                      "unknown_frame")
    class_id, mid = _METHOD_ID.unpack_from(buf, payload_start)
    index = class_id << 16 | mid
    fast = _FAST_DECODERS.get(index)
    if fast is not None:
        return fast(buf, payload_start, payload_end)
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        raise ConnectionLevelError(NOT_IMPLEMENTED, f"NOT_IMPLEMENTED - unknown method {class_id}/{mid}",
                                   class_id, mid)
    return fields.decode_arguments(cls, bytes(buf[payload_start + 4:payload_end]), class_id, mid)


def _fast_ack(buf, ps, pe):
    tag, multiple = decode_basic_ack(buf, ps, pe)
    return commands.Basic.Ack(tag, multiple)


def _fast_nack(buf, ps, pe):
    if pe - ps != 13:
        raise _cannot_decode(BASIC_NACK, buf, ps + 4, pe)
    tag, bits = _TAG_BITS.unpack_from(buf, ps + 4)
    return commands.Basic.Nack(tag, bool(bits & 1), bool(bits & 2))


def _fast_reject(buf, ps, pe):
    if pe - ps != 13:
        raise _cannot_decode(BASIC_REJECT, buf, ps + 4, pe)
    tag, bits = _TAG_BITS.unpack_from(buf, ps + 4)
    return commands.Basic.Reject(tag, bool(bits & 1))


_FAST_DECODERS = {60 << 16 | 80: _fast_ack, 60 << 16 | 120: _fast_nack, 60 << 16 | 90: _fast_reject}
