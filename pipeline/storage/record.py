"""Store records (pure): what one stored message looks like on disk.

Both the shared message store's segment files (``N.rdq``) and the queues'
journals (``N.jnl``) are plain sequences of these records, appended and
never rewritten in place. Layout, little-endian::

    offset  size  field
    0       8     u64 size      bytes that follow, up to (not including) the
                                marker: 16 + len(body)
    8       16    message id
    24      n     body          n = size - 16
    24+n    1     u8 0xFF       commit marker: the record is whole

    whole record = 8 + 16 + n + 1 = n + RECORD_OVERHEAD_BYTES bytes

The marker is written last, in the same buffered write as the rest, so a
record cut short by a crash (or a tail of zeros a file system left after a
power cut) has no marker where the size says it should be.

``scan`` walks records from an offset and stops at the first one that is not
whole: the data ends inside it, its size is impossible (under 16), or the
byte after it is not the marker. Everything before ``end_offset`` is intact;
``clean`` says whether the data ended exactly there (at a record boundary).
A torn tail is reported, never raised: after a crash it is expected, and the
writer truncates it away. ``decode_record`` reads the one record that must be
whole (a read through the index) and raises ``TornRecord`` when the data
ends inside it and ``CorruptSegment`` when it is not a record.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.storage.errors import CorruptSegment, TornRecord

MSG_ID_BYTES = 16
COMMIT_MARKER = 0xFF
_SIZE = struct.Struct("<Q")
SIZE_FIELD_BYTES = _SIZE.size
HEADER_BYTES = SIZE_FIELD_BYTES + MSG_ID_BYTES                  # size field + id: where the body starts
RECORD_OVERHEAD_BYTES = HEADER_BYTES + 1                        # header + commit marker
_MARKER = bytes((COMMIT_MARKER,))


class ScanRecord(NamedTuple):
    offset: int         # where the record starts
    msg_id: bytes
    body_start: int     # offset of the body's first byte in the scanned buffer
    body_len: int

    @property
    def size(self) -> int:
        """The whole record's bytes on disk."""
        return self.body_len + RECORD_OVERHEAD_BYTES


@dataclass(frozen=True)
class ScanResult:
    records: list[ScanRecord]   # every whole record from the start offset, in file order
    end_offset: int             # first byte after the last whole record
    clean: bool                 # True when the data ended exactly at end_offset (a record boundary)


def record_size(body_len: int) -> int:
    """Bytes on disk of a record whose body is ``body_len`` bytes."""
    return body_len + RECORD_OVERHEAD_BYTES


def encode_record(msg_id: bytes, body) -> bytes:
    """The record for ``msg_id`` and ``body`` (any bytes-like object), marker included."""
    if len(msg_id) != MSG_ID_BYTES:
        raise ValueError(f"message id must be {MSG_ID_BYTES} bytes, got {len(msg_id)}")
    return b"".join((_SIZE.pack(MSG_ID_BYTES + len(body)), msg_id, body, _MARKER))


def decode_record(buf, offset: int = 0) -> tuple[ScanRecord, int]:
    """The record that must start at ``offset``, and how many bytes it took.

    Raises ``TornRecord`` when ``buf`` ends inside it (including at
    ``offset`` itself: a record was required) and ``CorruptSegment`` when the
    size is impossible or the commit marker is missing.
    """
    n = len(buf)
    if n - offset < SIZE_FIELD_BYTES:
        raise TornRecord(f"data ends {n - offset} bytes into the size field at offset {offset}")
    (size,) = _SIZE.unpack_from(buf, offset)
    if size < MSG_ID_BYTES:
        raise CorruptSegment(f"record at offset {offset} claims {size} bytes, less than its id")
    end = offset + SIZE_FIELD_BYTES + size
    if end >= n:
        raise TornRecord(f"record at offset {offset} needs {end + 1 - offset} bytes, {n - offset} remain")
    if buf[end] != COMMIT_MARKER:
        raise CorruptSegment(f"record at offset {offset} has no commit marker at offset {end}")
    msg_id = bytes(buf[offset + SIZE_FIELD_BYTES:offset + HEADER_BYTES])
    return ScanRecord(offset, msg_id, offset + HEADER_BYTES, size - MSG_ID_BYTES), end + 1 - offset


def scan(buf, offset: int = 0) -> ScanResult:
    """Every whole record of ``buf`` from ``offset`` on, up to the first that is not whole."""
    n = len(buf)
    if not 0 <= offset <= n:
        raise ValueError(f"offset {offset} outside a buffer of {n} bytes")
    records: list[ScanRecord] = []
    unpack_from = _SIZE.unpack_from
    o = offset
    while True:
        if o == n:
            return ScanResult(records, o, True)
        if n - o < SIZE_FIELD_BYTES:
            return ScanResult(records, o, False)
        (size,) = unpack_from(buf, o)
        end = o + SIZE_FIELD_BYTES + size
        if size < MSG_ID_BYTES or end >= n or buf[end] != COMMIT_MARKER:
            return ScanResult(records, o, False)
        records.append(ScanRecord(o, bytes(buf[o + SIZE_FIELD_BYTES:o + HEADER_BYTES]), o + HEADER_BYTES,
                                  size - MSG_ID_BYTES))
        o = end + 1
