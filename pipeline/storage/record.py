"""Segment records (pure): what one stored message looks like on disk.

Layout (little-endian)::

    u64 size         bytes that follow up to (not including) the marker: 16 + len(body)
    16  message id
    ... body
    u8  0xFF         commit marker: the record is whole

A scan walks records from the start of a file and stops at the first one
that is incomplete or lacks its marker (a torn write, or zeros the file
system left): everything before that point is intact.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MSG_ID_BYTES = 16
COMMIT_MARKER = 0xFF
_SIZE = struct.Struct("<Q")
RECORD_OVERHEAD_BYTES = _SIZE.size + 1


def encode_record(msg_id: bytes, body) -> bytes:
    if len(msg_id) != MSG_ID_BYTES:
        raise ValueError(f"message id must be {MSG_ID_BYTES} bytes, got {len(msg_id)}")
    return b"".join((_SIZE.pack(MSG_ID_BYTES + len(body)), msg_id, body, b"\xff"))


@dataclass(frozen=True)
class ScanResult:
    records: list            # (offset, msg_id, body_start, body_len)
    end_offset: int          # first byte after the last whole record
    clean: bool              # True when the data ended exactly at a record boundary


def scan(buf, offset: int = 0) -> ScanResult:
    records = []
    n = len(buf)
    o = offset
    while True:
        if o == n:
            return ScanResult(records, o, True)
        if n - o < _SIZE.size:
            return ScanResult(records, o, False)
        (size,) = _SIZE.unpack_from(buf, o)
        end = o + _SIZE.size + size
        if size < MSG_ID_BYTES or end >= n or buf[end] != COMMIT_MARKER:
            return ScanResult(records, o, False)
        msg_id = bytes(buf[o + 8:o + 8 + MSG_ID_BYTES])
        records.append((o, msg_id, o + 8 + MSG_ID_BYTES, size - MSG_ID_BYTES))
        o = end + 1
