"""A message's content properties, read where the broker needs one and rewritten for dead-lettering (pure).

The data path forwards the client's property bytes untouched (``props_raw``:
property flags, then the present properties in flag order). A few places
need a value: the headers exchange (``headers``), priority queues
(``priority``), TTL (``expiration``), dead-lettering (``headers`` and
``expiration``, rewritten). ``read`` walks the list once and decodes only
the names asked for; ``priority_expiration`` answers the queue's two
questions from the flags alone when neither property is present (the
common case). ``encode`` builds property bytes from a dict of values.

Layout (AMQP 0-9-1 basic class), in flag order::

    bit     property          encoding
    0x8000  content_type      shortstr
    0x4000  content_encoding  shortstr
    0x2000  headers           table (u32 size, entries)
    0x1000  delivery_mode     octet
    0x0800  priority          octet
    0x0400  correlation_id    shortstr
    0x0200  reply_to          shortstr
    0x0100  expiration        shortstr
    0x0080  message_id        shortstr
    0x0040  timestamp         u64
    0x0020  type              shortstr
    0x0010  user_id           shortstr
    0x0008  app_id            shortstr
    0x0004  cluster_id        shortstr
"""

from __future__ import annotations

import datetime
import struct

from pamqp import commands

from pipeline.amqp import fields, frames

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
SHORTSTR, TABLE, OCTET, U64 = "shortstr", "table", "octet", "u64"
PROPERTIES = (("content_type", 0x8000, SHORTSTR), ("content_encoding", 0x4000, SHORTSTR),
              ("headers", 0x2000, TABLE), ("delivery_mode", 0x1000, OCTET), ("priority", 0x0800, OCTET),
              ("correlation_id", 0x0400, SHORTSTR), ("reply_to", 0x0200, SHORTSTR),
              ("expiration", 0x0100, SHORTSTR), ("message_id", 0x0080, SHORTSTR), ("timestamp", 0x0040, U64),
              ("type", 0x0020, SHORTSTR), ("user_id", 0x0010, SHORTSTR), ("app_id", 0x0008, SHORTSTR),
              ("cluster_id", 0x0004, SHORTSTR))
PRIORITY_BIT, EXPIRATION_BIT, HEADERS_BIT, REPLY_TO_BIT = 0x0800, 0x0100, 0x2000, 0x0200
PRIORITY_OR_EXPIRATION = PRIORITY_BIT | EXPIRATION_BIT


def read(props_raw, names=None) -> dict:
    """The present properties among ``names`` (all when None): shortstrs as bytes, headers as a dict,
    octets and the timestamp as ints."""
    if len(props_raw) < 2:
        return {}
    flags = _U16.unpack_from(props_raw, 0)[0]
    o = 2
    out = {}
    for name, bit, kind in PROPERTIES:
        if not flags & bit:
            continue
        want = names is None or name in names
        if kind == SHORTSTR:
            n = props_raw[o]
            if want:
                out[name] = bytes(props_raw[o + 1:o + 1 + n])
            o += 1 + n
        elif kind == TABLE:
            size = _U32.unpack_from(props_raw, o)[0]
            if want:
                out[name] = fields.decode_table(props_raw, o + 4, o + 4 + size)
            o += 4 + size
        elif kind == OCTET:
            if want:
                out[name] = props_raw[o]
            o += 1
        else:
            if want:
                out[name] = _U64.unpack_from(props_raw, o)[0]
            o += 8
    return out


def priority_expiration(props_raw) -> tuple[int | None, bytes | None]:
    """(priority, expiration) of a message; from the flags alone when it carries neither."""
    if len(props_raw) < 2 or not _U16.unpack_from(props_raw, 0)[0] & PRIORITY_OR_EXPIRATION:
        return None, None
    got = read(props_raw, ("priority", "expiration"))
    return got.get("priority"), got.get("expiration")


def headers_of(props_raw) -> dict | None:
    """The message's headers table, or None when it has none."""
    if len(props_raw) < 2 or not _U16.unpack_from(props_raw, 0)[0] & HEADERS_BIT:
        return None
    return read(props_raw, ("headers",)).get("headers")


def encode(values: dict) -> bytes:
    """Property bytes for ``values`` (as ``read`` returns them; absent or None: not present)."""
    kwargs = {}
    for name, _, kind in PROPERTIES:
        value = values.get(name)
        if value is None:
            continue
        if kind == SHORTSTR:
            value = value.decode("utf-8", "surrogateescape") if isinstance(value, (bytes, bytearray)) else value
        elif kind == U64:
            value = datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
        kwargs["message_type" if name == "type" else name] = value
    return frames.properties_raw(commands.Basic.Properties(**kwargs))
