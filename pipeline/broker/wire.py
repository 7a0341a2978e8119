"""Records that stages exchange over shared-memory rings (pure codec).

Every record starts with one ``kind`` byte. Integers are little-endian.
Strings are length-prefixed UTF-8 bytes. Only PUBLISH and WRITE records are
counted by credit flow; the rest travel "noflow", as RabbitMQ's ``do/2``.

The *content* part is shared by PUBLISH and DELIVER so a queue can turn a
stored publish into a delivery with one concatenation::

    content = u8 exlen | exchange | u8 rklen | routing_key | u32 propslen | props | body

``props`` is the content-header payload after body-size (property flags and
list) exactly as the client sent it, so it is forwarded to consumers untouched.

Layouts::

    PUBLISH  reader -> channel -> queue
             u8 kind | u8 flags | u64 seq | content
             flags: 1 mandatory, 2 persistent, 4 confirm (channel in confirm mode), 8 body by reference:
             the content's body is a ``pipeline.broker.bodies`` reference into an arena
    METHOD   reader -> channel: u8 kind | AMQP method payload (class id onward)
    ACK      reader -> channel -> queue
             u8 kind | u8 flags | u8 qlen | queue | u64 msg_id * n
             flags: 1 reject (nack/reject), 2 requeue
    CONTROL  any -> any, rare: u8 kind | UTF-8 JSON object
    FRAMES   channel/queue -> reader: u8 kind | encoded AMQP frames for the socket
    CONFIRM  queue -> channel: u8 kind | u64 seq * n
    DELIVER  queue -> reader
             u8 kind | u8 flags | u16 channel | u64 msg_id | u8 ctaglen | ctag | content
             flags: 1 redelivered, 2 no_ack, 4 body by reference (lent to this reader: give it back once sent)
    GET_OK   queue -> reader: as DELIVER, with u32 message_count after msg_id
    WRITE    queue -> store: u8 kind | 16-byte message id | body
    REMOVE   queue -> store: u8 kind | 16-byte message id * n
    ON_DISK  store -> queue: u8 kind | 16-byte message id * n
    FRAGMENT any -> any: u8 kind | u8 last | a piece of a record too big for its ring; the receiving
             link joins the pieces and hands on the whole record (``pipeline.broker.stage``)
"""

from __future__ import annotations

import json
import struct

MSG_ID_BYTES = 16


class Kind:
    """A record's first byte: what it carries. Plain ints, not an IntEnum: every record is dispatched on
    these, and an enum member costs three times an int to look up (per record, per hop)."""

    PUBLISH = 1
    METHOD = 2
    ACK = 3
    CONTROL = 4
    FRAMES = 5
    CONFIRM = 6
    DELIVER = 7
    GET_OK = 8
    WRITE = 9
    REMOVE = 10
    ON_DISK = 11
    FRAGMENT = 12


class WireError(ValueError):
    """Raised when a stage record is malformed (a bug in a stage, never client input)."""


PUB_MANDATORY = 1
PUB_PERSISTENT = 2
PUB_CONFIRM = 4
PUB_BODY_REF = 8

DLV_REDELIVERED = 1
DLV_NO_ACK = 2
DLV_BODY_REF = 4

ACK_REJECT = 1
ACK_REQUEUE = 2

_PUBLISH_HEAD = struct.Struct("<BBQ")        # kind, flags, seq
_DELIVER_HEAD = struct.Struct("<BBHQB")      # kind, flags, channel, msg_id, ctaglen
_GET_OK_HEAD = struct.Struct("<BBHQIB")      # kind, flags, channel, msg_id, message_count, ctaglen
_ACK_HEAD = struct.Struct("<BBB")            # kind, flags, qlen
_U32 = struct.Struct("<I")
_PROP_FLAGS = struct.Struct(">H")        # AMQP property flags, network order
_U64 = struct.Struct("<Q")

PUBLISH_CONTENT_OFFSET = _PUBLISH_HEAD.size

_PUBLISH = bytes([Kind.PUBLISH])
_METHOD = bytes([Kind.METHOD])
_CONTROL = bytes([Kind.CONTROL])
_FRAMES = bytes([Kind.FRAMES])
_CONFIRM = bytes([Kind.CONFIRM])
_WRITE = bytes([Kind.WRITE])
_REMOVE = bytes([Kind.REMOVE])
_ON_DISK = bytes([Kind.ON_DISK])


def encode_content(exchange: bytes, routing_key: bytes, props: bytes, body: bytes) -> bytes:
    return b"".join((bytes((len(exchange),)), exchange, bytes((len(routing_key),)), routing_key,
                     _U32.pack(len(props)), props, body))


def decode_content(rec, offset: int) -> tuple[bytes, bytes, bytes, bytes]:
    """Return (exchange, routing_key, props, body) of the content starting at ``offset``, copied."""
    exchange, routing_key, props, body = content_views(rec, offset)
    return exchange, routing_key, bytes(props), bytes(body)


def content_views(rec, offset: int) -> tuple[bytes, bytes, memoryview, memoryview]:
    """Like ``decode_content`` but props and body are views into ``rec`` (no copy)."""
    mv = memoryview(rec)
    exlen = rec[offset]
    exchange = bytes(mv[offset + 1:offset + 1 + exlen])
    o = offset + 1 + exlen
    rklen = rec[o]
    routing_key = bytes(mv[o + 1:o + 1 + rklen])
    o += 1 + rklen
    (plen,) = _U32.unpack_from(rec, o)
    o += 4
    return exchange, routing_key, mv[o:o + plen], mv[o + plen:]


def content_route(rec, offset: int = PUBLISH_CONTENT_OFFSET) -> tuple[bytes, bytes]:
    """(exchange, routing_key) of a record's content, without copying the body."""
    exlen = rec[offset]
    o = offset + 1 + exlen
    return bytes(rec[offset + 1:offset + 1 + exlen]), bytes(rec[o + 1:o + 1 + rec[o]])


def content_props(rec, offset: int = PUBLISH_CONTENT_OFFSET) -> memoryview:
    """The properties part of a record's content, as a view (no copy)."""
    o = offset + 1 + rec[offset]
    o += 1 + rec[o]
    (plen,) = _U32.unpack_from(rec, o)
    return memoryview(rec)[o + 4:o + 4 + plen]


def content_names(rec, offset: int = PUBLISH_CONTENT_OFFSET) -> tuple[bytes, int]:
    """A content's exchange and routing key as they stand in the record (its two shortstrs as one
    bytes, a key to remember a route by), and the high byte of its property flags (0 with fewer than
    two bytes of properties)."""
    o = offset + 1 + rec[offset]
    o += 1 + rec[o]
    (plen,) = _U32.unpack_from(rec, o)
    return rec[offset:o], (rec[o + 4] if plen > 1 else 0)


def content_sizes(rec, offset: int = PUBLISH_CONTENT_OFFSET) -> tuple[int, int]:
    """(body bytes, property flags) of a record's content, in one pass (flags 0 with no properties)."""
    o = offset + 1 + rec[offset]
    o += 1 + rec[o]
    (plen,) = _U32.unpack_from(rec, o)
    return len(rec) - (o + 4 + plen), (_PROP_FLAGS.unpack_from(rec, o + 4)[0] if plen >= 2 else 0)


def content_body_len(rec, offset: int = PUBLISH_CONTENT_OFFSET) -> int:
    o = offset + 1 + rec[offset]
    o += 1 + rec[o]
    (plen,) = _U32.unpack_from(rec, o)
    return len(rec) - (o + 4 + plen)


def encode_publish(flags: int, seq: int, exchange: bytes, routing_key: bytes,
                   props: bytes, body: bytes) -> bytes:
    return b"".join((_PUBLISH_HEAD.pack(Kind.PUBLISH, flags, seq), bytes((len(exchange),)), exchange,
                     bytes((len(routing_key),)), routing_key, _U32.pack(len(props)), props, body))


def encode_publish_record(flags: int, seq: int, content) -> bytes:
    """A PUBLISH record around an already encoded content part."""
    return _PUBLISH_HEAD.pack(Kind.PUBLISH, flags, seq) + bytes(content)


def publish_head(rec) -> tuple[int, int]:
    """(flags, seq) of a PUBLISH record."""
    _, flags, seq = _PUBLISH_HEAD.unpack_from(rec, 0)
    return flags, seq


def encode_deliver(flags: int, channel: int, msg_id: int, consumer_tag: bytes, content) -> bytes:
    return b"".join((_DELIVER_HEAD.pack(Kind.DELIVER, flags, channel, msg_id, len(consumer_tag)),
                     consumer_tag, content))


DELIVER_CTAG_AT = _DELIVER_HEAD.size - 1       # the consumer tag's length byte: rec[12:names_at] is its shortstr


def deliver_offsets(rec) -> tuple[int, int, int, int, int, int]:
    """(flags, channel, msg_id, names_at, props_at, body_at) of a DELIVER record, without copying: the
    consumer tag as its AMQP shortstr is ``rec[DELIVER_CTAG_AT:names_at]``, the exchange and routing key as
    theirs ``rec[names_at:props_at - 4]``, the properties ``rec[props_at:body_at]``, the body the rest."""
    _, flags, channel, msg_id, ctaglen = _DELIVER_HEAD.unpack_from(rec, 0)
    names_at = _DELIVER_HEAD.size + ctaglen
    o = names_at + 1 + rec[names_at]
    o += 1 + rec[o]
    props_at = o + 4
    return flags, channel, msg_id, names_at, props_at, props_at + _U32.unpack_from(rec, o)[0]


def encode_get_ok(flags: int, channel: int, msg_id: int, message_count: int, content) -> bytes:
    return b"".join((_GET_OK_HEAD.pack(Kind.GET_OK, flags, channel, msg_id, message_count, 0), content))


def decode_get_ok(rec) -> tuple[int, int, int, int, int]:
    """(flags, channel, msg_id, message_count, content_offset) of a GET_OK record."""
    _, flags, channel, msg_id, count, ctaglen = _GET_OK_HEAD.unpack_from(rec, 0)
    return flags, channel, msg_id, count, _GET_OK_HEAD.size + ctaglen


def encode_method(payload: bytes) -> bytes:
    return _METHOD + payload


def encode_ack(flags: int, queue: bytes, msg_ids) -> bytes:
    return b"".join((_ACK_HEAD.pack(Kind.ACK, flags, len(queue)), queue,
                     struct.pack(f"<{len(msg_ids)}Q", *msg_ids)))


def decode_ack(rec) -> tuple[int, bytes, tuple[int, ...]]:
    _, flags, qlen = _ACK_HEAD.unpack_from(rec, 0)
    o = _ACK_HEAD.size
    queue = bytes(rec[o:o + qlen])
    o += qlen
    n = (len(rec) - o) // 8
    return flags, queue, struct.unpack_from(f"<{n}Q", rec, o)


def encode_control(msg: dict) -> bytes:
    return _CONTROL + json.dumps(msg, separators=(",", ":")).encode()


def decode_control(rec) -> dict:
    try:
        return json.loads(bytes(rec[1:]))
    except ValueError as exc:
        raise WireError(f"bad CONTROL record: {exc}") from None


def encode_frames(data: bytes) -> bytes:
    return _FRAMES + data


def encode_confirm(seqs) -> bytes:
    return _CONFIRM + struct.pack(f"<{len(seqs)}Q", *seqs)


def decode_confirm(rec) -> tuple[int, ...]:
    return struct.unpack_from(f"<{(len(rec) - 1) // 8}Q", rec, 1)


def encode_write(msg_id: bytes, body) -> bytes:
    return b"".join((_WRITE, msg_id, body))


def decode_write(rec) -> tuple[bytes, bytes]:
    return bytes(rec[1:1 + MSG_ID_BYTES]), bytes(rec[1 + MSG_ID_BYTES:])


def encode_ids(kind: int, msg_ids) -> bytes:
    return bytes((kind,)) + b"".join(msg_ids)


def decode_ids(rec) -> list[bytes]:
    return [bytes(rec[o:o + MSG_ID_BYTES]) for o in range(1, len(rec), MSG_ID_BYTES)]
