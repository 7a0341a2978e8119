"""AMQP 0-9-1 frames: pamqp for everything, hand-written fast paths per message.

A frame (big-endian)::

    u8 type | u16 channel | u32 size | payload[size] | u8 0xCE

    type 1 method:    u16 class id | u16 method id | arguments
    type 2 header:    u16 class id | u16 weight (0) | u64 body size | u16 property flags | properties
    type 3 body:      body bytes (a message's body is split over frames of at most frame_max)
    type 8 heartbeat: empty payload, channel 0

``props_raw`` everywhere means the header payload after the body size
(property flags and list) exactly as sent, so it can be forwarded untouched.
The fast paths (basic.publish in, basic.deliver and basic.ack out, content
header and body) are byte-identical to pamqp's encoding; the tests hold them
to it. ``next_frame`` never consumes a partial frame: incomplete input is
``None``, not an error.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from pamqp import commands, exceptions as pamqp_exceptions, frame as pamqp_frame
from pamqp import header as pamqp_header

from pipeline.amqp.errors import FRAME_ERROR, SYNTAX_ERROR, NOT_IMPLEMENTED, ConnectionLevelError, FrameError

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_END = 0xCE
FRAME_OVERHEAD_BYTES = 8
FRAME_MIN_SIZE = 4096


class FrameType(IntEnum):
    METHOD = 1
    HEADER = 2
    BODY = 3
    HEARTBEAT = 8


BASIC_PUBLISH = (60, 40)
BASIC_DELIVER = (60, 60)
BASIC_ACK = (60, 80)

_FRAME_HEAD = struct.Struct(">BHI")
_METHOD_ID = struct.Struct(">HH")
_PUBLISH_HEAD = struct.Struct(">BHIHHH")       # frame head + class, method, reserved
_DELIVER_HEAD = struct.Struct(">BHIHH")        # frame head + class, method
_HEADER_HEAD = struct.Struct(">BHIHHQ")        # frame head + class, weight, body size
_ACK = struct.Struct(">BHIHHQBB")              # whole basic.ack frame
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_END = b"\xce"
_HEARTBEAT = bytes((8, 0, 0, 0, 0, 0, 0, FRAME_END))


def next_frame(buf, offset: int = 0, frame_max: int | None = None):
    """``(frame_type, channel, payload_start, payload_end)`` of the frame at ``offset``, or None if incomplete."""
    if len(buf) - offset < 7:
        return None
    ftype, channel, size = _FRAME_HEAD.unpack_from(buf, offset)
    if frame_max and size > frame_max - FRAME_OVERHEAD_BYTES:
        raise FrameError(FRAME_ERROR, f"FRAME_ERROR - type {ftype}, all octets = <<>>: "
                                      f"frame_too_large, {size} > {frame_max - FRAME_OVERHEAD_BYTES}")
    end = offset + 7 + size
    if len(buf) <= end:
        return None
    if buf[end] != FRAME_END:
        raise FrameError(FRAME_ERROR, f"FRAME_ERROR - type {ftype}, invalid frame end byte {buf[end]:#x}")
    return ftype, channel, offset + 7, end


def method_id(buf, payload_start: int) -> tuple[int, int]:
    return _METHOD_ID.unpack_from(buf, payload_start)


def _shortstr(buf, o: int) -> tuple[str, int]:
    n = buf[o]
    return bytes(buf[o + 1:o + 1 + n]).decode("utf-8"), o + 1 + n


def _sstr(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    if len(b) > 255:
        raise ValueError(f"short string of {len(b)} bytes is over 255")
    return bytes((len(b),)) + b


def properties_raw(properties: commands.Basic.Properties | None = None, **kwargs) -> bytes:
    props = properties if properties is not None else commands.Basic.Properties(**kwargs)
    encoded = pamqp_frame.marshal(pamqp_header.ContentHeader(0, 0, props), 0)
    return encoded[7 + 12:-1]


def delivery_mode_of(props_raw) -> int | None:
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


def encode_content(channel: int, props_raw, body, frame_max: int) -> bytes:
    parts = [_HEADER_HEAD.pack(2, channel, 12 + len(props_raw), 60, 0, len(body)), props_raw, _END]
    chunk = frame_max - FRAME_OVERHEAD_BYTES
    for start in range(0, len(body), chunk):
        piece = body[start:start + chunk]
        parts += (_FRAME_HEAD.pack(3, channel, len(piece)), piece, _END)
    return b"".join(parts)


def encode_publish(channel: int, exchange, routing_key, props_raw, body, frame_max: int,
                   mandatory: bool = False) -> bytes:
    args = _sstr(exchange) + _sstr(routing_key) + (b"\x01" if mandatory else b"\x00")
    method = _PUBLISH_HEAD.pack(1, channel, 6 + len(args), 60, 40, 0) + args + _END
    return method + encode_content(channel, props_raw, body, frame_max)


def decode_publish(buf, payload_start: int, payload_end: int) -> tuple[str, str, bool]:
    exchange, o = _shortstr(buf, payload_start + 6)
    routing_key, o = _shortstr(buf, o)
    return exchange, routing_key, bool(buf[o] & 1)


def decode_publish_raw(buf, payload_start: int) -> tuple[bytes, bytes, int]:
    """(exchange bytes, routing key bytes, bits) of a basic.publish, without decoding UTF-8."""
    o = payload_start + 6
    n = buf[o]
    exchange = bytes(buf[o + 1:o + 1 + n])
    o += 1 + n
    n = buf[o]
    return exchange, bytes(buf[o + 1:o + 1 + n]), buf[o + 1 + n]


def encode_deliver(channel: int, consumer_tag, delivery_tag: int, redelivered: bool, exchange, routing_key,
                   props_raw, body, frame_max: int) -> bytes:
    args = b"".join((_sstr(consumer_tag), _U64.pack(delivery_tag), b"\x01" if redelivered else b"\x00",
                     _sstr(exchange), _sstr(routing_key)))
    method = _DELIVER_HEAD.pack(1, channel, 4 + len(args), 60, 60) + args + _END
    return method + encode_content(channel, props_raw, body, frame_max)


def decode_deliver(buf, payload_start: int, payload_end: int) -> tuple[str, int, bool, str, str]:
    consumer_tag, o = _shortstr(buf, payload_start + 4)
    (tag,) = _U64.unpack_from(buf, o)
    redelivered = bool(buf[o + 8] & 1)
    exchange, o = _shortstr(buf, o + 9)
    routing_key, _ = _shortstr(buf, o)
    return consumer_tag, tag, redelivered, exchange, routing_key


def decode_content_header(buf, payload_start: int, payload_end: int) -> tuple[int, bytes]:
    (size,) = _U64.unpack_from(buf, payload_start + 4)
    return size, bytes(buf[payload_start + 12:payload_end])


def encode_basic_ack(channel: int, delivery_tag: int, multiple: bool = False) -> bytes:
    return _ACK.pack(1, channel, 13, 60, 80, delivery_tag, 1 if multiple else 0, FRAME_END)


def decode_basic_ack(buf, payload_start: int, payload_end: int) -> tuple[int, bool]:
    (tag,) = _U64.unpack_from(buf, payload_start + 4)
    return tag, bool(buf[payload_start + 12] & 1)


def encode_method(channel: int, method) -> bytes:
    return pamqp_frame.marshal(method, channel)


def decode_method(buf, payload_start: int, payload_end: int):
    """A pamqp method object; unknown ids raise NOT_IMPLEMENTED, bad arguments SYNTAX_ERROR."""
    data = bytes(buf[payload_start:payload_end])
    if len(data) < 4:
        raise FrameError(FRAME_ERROR, "FRAME_ERROR - method frame shorter than its class and method ids")
    class_id, mid = _METHOD_ID.unpack_from(data, 0)
    if (class_id << 16 | mid) not in commands.INDEX_MAPPING:
        raise ConnectionLevelError(NOT_IMPLEMENTED, f"NOT_IMPLEMENTED - unknown method {class_id}/{mid}",
                                   class_id, mid)
    try:
        return pamqp_frame._unmarshal_method_frame(data)
    except (pamqp_exceptions.UnmarshalingException, ValueError, IndexError, struct.error) as exc:
        raise ConnectionLevelError(SYNTAX_ERROR, f"SYNTAX_ERROR - cannot decode {class_id}/{mid}: {exc}",
                                   class_id, mid) from None


def encode_heartbeat() -> bytes:
    return _HEARTBEAT
