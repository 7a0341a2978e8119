"""AMQP 0-9-1 field values: tables, arrays and method arguments, decoded with no recursion.

Every byte here comes from a client that may not have authenticated yet, so
the decoder keeps three rules. It walks nested tables and arrays with an
explicit stack, never by recursion, so no input can exhaust Python's stack;
it refuses nesting deeper than ``FIELD_NESTING_MAX`` levels (the root table
is level 1); and it reads every value in place, never slicing off the rest of
the buffer, so a table of many small entries costs linear time. Decoders say
how far they read; anything that does not add up is an ``AmqpError``.

Layout, big-endian::

    table     u32 size | entries filling exactly size bytes: shortstr name | u8 type | value
    array     u32 size | entries filling exactly size bytes: u8 type | value
    shortstr  u8 length | bytes            longstr  u32 length | bytes

Value types, RabbitMQ's set (``rabbit_binary_parser``)::

    t bool (u8, non-zero is true)   b i8    B u8    s i16   u u16   I i32   i u32
    l i64   L u64   f float32   d float64   D decimal: u8 scale | u32 unscaled value
    S longstr   x byte array (u32 length | bytes)   T timestamp u64 (seconds)
    F table     A array         V void (no bytes)

Method arguments follow the class's field list; consecutive bits share
octets, eight to an octet, lowest bit first. ``short``/``long``/``longlong``
are u16/u32/u64, ``octet`` u8.

Values come out as pamqp's decoder gives them, so pamqp-encoded input
round-trips: longstr as ``str`` when it is UTF-8, else ``bytes``; byte
arrays as ``bytearray``; decimals as ``decimal.Decimal``; timestamps as UTC
``datetime`` (above 2^32 read as milliseconds, as pamqp does), or the raw
integer when no ``datetime`` can hold it. Where RabbitMQ's parser is the
reference (it accepts any timestamp, reads ``L`` as unsigned), it wins.

UTF-8: a shortstr argument of a method that carries no content must be UTF-8
(501 "Malformed UTF-8 in shortstr", as RabbitMQ's generated decoder asserts);
those of content-bearing methods (basic.publish, .deliver, .return, .get-ok)
are not checked, as in RabbitMQ, and decode with ``surrogateescape``. Field
names in tables must be UTF-8 too when the table is decoded (RabbitMQ takes
any bytes; a Python mapping needs ``str`` keys). ``check_table`` only walks a
table, keys unchecked: message headers are forwarded as they came.
"""

from __future__ import annotations

import datetime
import decimal
import struct

from pipeline.amqp.errors import FRAME_ERROR, FrameError, erlang_binary, reply_text

FIELD_NESTING_MAX = 64          # tables and arrays inside each other, the outermost counted as 1

_U32 = struct.Struct(">I")
_DECIMAL = struct.Struct(">BI")
_U64 = struct.Struct(">Q")
_F, _A, _S, _X, _T, _D, _V, _BOOL = (ord(c) for c in "FASxTDVt")
_FIXED_VALUES = {ord(code): struct.Struct(fmt) for code, fmt in (
    ("b", ">b"), ("B", ">B"), ("s", ">h"), ("u", ">H"), ("I", ">i"), ("i", ">I"), ("l", ">q"), ("L", ">Q"),
    ("f", ">f"), ("d", ">d"))}
_FIXED_ARGUMENTS = {"octet": struct.Struct(">B"), "short": struct.Struct(">H"), "long": struct.Struct(">I"),
                    "longlong": struct.Struct(">Q"), "timestamp": struct.Struct(">Q")}
_CONTENT_METHODS = frozenset(k[0] << 16 | k[1] for k in ((60, 40), (60, 50), (60, 60), (60, 71)))
_ARGUMENTS: dict[int, tuple[tuple[str, str], ...]] = {}
_UNIX_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


class _Undecodable(Exception):
    """Raised inside this module when lengths or types do not add up; callers add the context."""


def _too_deep() -> FrameError:
    return FrameError(FRAME_ERROR, reply_text(FRAME_ERROR, f"field table nested deeper than "
                                                           f"{FIELD_NESTING_MAX} levels"))


def _bad_utf8() -> FrameError:
    return FrameError(FRAME_ERROR, reply_text(FRAME_ERROR, "Malformed UTF-8 in shortstr"))


def cannot_decode(data, class_id: int = 0, method_id: int = 0) -> FrameError:
    """501 with RabbitMQ's text for fields it cannot decode: ``FRAME_ERROR - cannot decode <<0,0,5,97>>``."""
    return FrameError(FRAME_ERROR, reply_text(FRAME_ERROR, f"cannot decode {erlang_binary(data, text=False)}"),
                      class_id, method_id)


def _timestamp(raw: int):
    try:
        return _UNIX_EPOCH + datetime.timedelta(seconds=raw / 1000.0 if raw > 0xFFFFFFFF else raw)
    except OverflowError:
        return raw


def _longstr(raw: bytes):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _walk(buf, o: int, end: int, build: bool):
    """The entries of the table in ``buf[o:end]``: a dict if ``build``, else only checked (None)."""
    root = {} if build else None
    stack = [(root, end, True)]           # (container, where it ends, is a table)
    while True:
        container, cend, is_table = stack[-1]
        if o >= cend:
            if o > cend:
                raise _Undecodable
            stack.pop()
            if not stack:
                return root
            continue
        key = None
        if is_table:
            k = o + 1 + buf[o]
            if k >= cend:
                raise _Undecodable         # a name with no type octet after it
            if build:
                try:
                    key = bytes(buf[o + 1:k]).decode("utf-8")
                except UnicodeDecodeError:
                    raise _bad_utf8() from None
            o = k
        kind = buf[o]
        o += 1
        fixed = _FIXED_VALUES.get(kind)
        if fixed is not None:
            if o + fixed.size > cend:
                raise _Undecodable
            value = fixed.unpack_from(buf, o)[0] if build else None
            o += fixed.size
        elif kind == _F or kind == _A:
            if o + 4 > cend:
                raise _Undecodable
            inner_end = o + 4 + _U32.unpack_from(buf, o)[0]
            if inner_end > cend:
                raise _Undecodable
            if len(stack) >= FIELD_NESTING_MAX:
                raise _too_deep()
            value = ({} if kind == _F else []) if build else None
            if build:
                if is_table:
                    container[key] = value
                else:
                    container.append(value)
            stack.append((value, inner_end, kind == _F))
            o += 4
            continue
        elif kind == _S or kind == _X:
            if o + 4 > cend:
                raise _Undecodable
            e = o + 4 + _U32.unpack_from(buf, o)[0]
            if e > cend:
                raise _Undecodable
            if build:
                raw = bytes(buf[o + 4:e])
                value = _longstr(raw) if kind == _S else bytearray(raw)
            o = e
        elif kind == _BOOL:
            if o >= cend:
                raise _Undecodable
            value = buf[o] != 0 if build else None
            o += 1
        elif kind == _T:
            if o + 8 > cend:
                raise _Undecodable
            value = _timestamp(_U64.unpack_from(buf, o)[0]) if build else None
            o += 8
        elif kind == _D:
            if o + 5 > cend:
                raise _Undecodable
            if build:
                scale, unscaled = _DECIMAL.unpack_from(buf, o)
                value = decimal.Decimal(unscaled) * (decimal.Decimal(10) ** -scale)
            o += 5
        elif kind == _V:
            value = None
        else:
            raise _Undecodable             # a type RabbitMQ does not know either
        if o > cend:
            raise _Undecodable
        if build:
            if is_table:
                container[key] = value
            else:
                container.append(value)


def decode_table(buf, start: int, end: int) -> dict:
    """The field table whose entries fill ``buf[start:end]`` (its u32 size already read)."""
    try:
        return _walk(buf, start, end, True)
    except (_Undecodable, IndexError, struct.error):
        raise cannot_decode(buf[start:end]) from None


def check_table(buf, start: int, end: int) -> None:
    """Check, without building anything, that ``buf[start:end]`` holds well-formed table entries."""
    try:
        _walk(buf, start, end, False)
    except (_Undecodable, IndexError, struct.error):
        raise cannot_decode(buf[start:end]) from None


def _arguments(cls, index: int) -> tuple[tuple[str, str], ...]:
    args = _ARGUMENTS.get(index)
    if args is None:
        args = _ARGUMENTS[index] = tuple((name, cls.amqp_type(name)) for name in cls.__slots__)
    return args


def decode_arguments(cls, data: bytes, class_id: int, method_id: int):
    """A pamqp method object of class ``cls`` with its arguments read from all of ``data``.

    Raises ``FrameError`` (501): "cannot decode <<...>>" when the fields are
    truncated, have bytes left over or hold an unknown field type;
    "Malformed UTF-8 in shortstr"; or a table nested too deep.
    """
    index = class_id << 16 | method_id
    strict_utf8 = index not in _CONTENT_METHODS
    method = cls()
    size = len(data)
    o = 0
    bits = bit = 0
    in_bits = False
    try:
        for name, kind in _arguments(cls, index):
            if kind == "bit":
                if not in_bits or bit == 8:
                    bits = data[o]
                    o += 1
                    bit = 0
                    in_bits = True
                value = bool(bits >> bit & 1)
                bit += 1
            else:
                in_bits = False
                if kind == "shortstr":
                    e = o + 1 + data[o]
                    if e > size:
                        raise _Undecodable
                    raw = data[o + 1:e]
                    try:
                        value = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        if strict_utf8:
                            raise _bad_utf8() from None
                        value = raw.decode("utf-8", "surrogateescape")
                elif kind == "longstr" or kind == "table":
                    if o + 4 > size:
                        raise _Undecodable
                    e = o + 4 + _U32.unpack_from(data, o)[0]
                    if e > size:
                        raise _Undecodable
                    value = _longstr(data[o + 4:e]) if kind == "longstr" else _walk(data, o + 4, e, True)
                else:
                    fixed = _FIXED_ARGUMENTS[kind]
                    e = o + fixed.size
                    if e > size:
                        raise _Undecodable
                    value = fixed.unpack_from(data, o)[0]
                o = e
            setattr(method, name, value)
    except (_Undecodable, IndexError, struct.error):
        raise cannot_decode(data, class_id, method_id) from None
    except FrameError as err:
        err.class_id, err.method_id = class_id, method_id
        raise
    if o != size:
        raise cannot_decode(data, class_id, method_id)
    return method
