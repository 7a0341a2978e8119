"""The store's record format: what a record looks like, and a scan that stops exactly where whole records end,
wherever a crash cut the file."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.storage.errors import CorruptSegment, TornRecord
from pipeline.storage.record import (COMMIT_MARKER, HEADER_BYTES, MSG_ID_BYTES, RECORD_OVERHEAD_BYTES,
                                     decode_record, encode_record, record_size, scan)

# Bodies chosen to be awkward: empty, one byte, all markers, all zeros, a size field's worth, a page, odd sizes.
BODIES = [b"", b"\x01", b"\xff" * 9, bytes(16), bytes(range(256)) * 2, b"z" * 4096, b"\xff\x00" * 37, b"end"]


def sample_file(bodies=BODIES) -> tuple[bytes, list[tuple[int, bytes, bytes]]]:
    """A file of records: its bytes and (offset, id, body) of each record."""
    data = bytearray()
    records = []
    for i, body in enumerate(bodies):
        msg_id = bytes([i]) * MSG_ID_BYTES
        records.append((len(data), msg_id, body))
        data += encode_record(msg_id, body)
    return bytes(data), records


def whole_before(records, cut: int):
    return [r for r in records if r[0] + record_size(len(r[2])) <= cut]


def test_the_layout_is_size_id_body_marker():
    msg_id = bytes(range(16))
    record = encode_record(msg_id, b"hello")
    assert record == struct.pack("<Q", 16 + 5) + msg_id + b"hello" + b"\xff"
    assert len(record) == record_size(5) == 5 + RECORD_OVERHEAD_BYTES == 5 + 8 + 16 + 1
    assert COMMIT_MARKER == 0xFF and HEADER_BYTES == 24


def test_a_message_id_must_be_sixteen_bytes():
    with pytest.raises(ValueError, match="message id must be 16 bytes, got 3"):
        encode_record(b"abc", b"body")


def test_truncating_at_every_offset_keeps_exactly_the_records_wholly_before_the_cut():
    data, records = sample_file()
    boundaries = {0} | {off + record_size(len(body)) for off, _, body in records}
    for cut in range(len(data) + 1):
        result = scan(data[:cut])
        whole = whole_before(records, cut)
        assert [(r.offset, r.msg_id) for r in result.records] == [(off, mid) for off, mid, _ in whole], cut
        assert [data[r.body_start:r.body_start + r.body_len] for r in result.records] == [b for *_, b in whole]
        expected_end = whole[-1][0] + record_size(len(whole[-1][2])) if whole else 0
        assert result.end_offset == expected_end, cut
        assert result.clean == (cut in boundaries), cut


def test_a_zero_filled_tail_ends_the_scan_after_the_last_whole_record():
    data, records = sample_file()
    result = scan(data + bytes(4096))           # what a file system can leave after a power cut
    assert len(result.records) == len(records)
    assert result.end_offset == len(data) and not result.clean


def test_garbage_after_the_records_ends_the_scan():
    data, records = sample_file()
    for garbage in (b"\x07", b"\xff" * 40, struct.pack("<Q", 2 ** 60) + b"x" * 30, struct.pack("<Q", 3) + b"\xff" * 20):
        result = scan(data + garbage)
        assert len(result.records) == len(records), garbage
        assert result.end_offset == len(data) and not result.clean


def test_a_record_without_its_marker_ends_the_scan_there():
    data, records = sample_file()
    broken = bytearray(data)
    off, _, body = records[4]
    broken[off + record_size(len(body)) - 1] = 0x00
    result = scan(bytes(broken))
    assert [r.msg_id for r in result.records] == [mid for _, mid, _ in records[:4]]
    assert result.end_offset == off and not result.clean


def test_a_scan_can_start_at_a_record_boundary():
    data, records = sample_file()
    start = records[3][0]
    result = scan(data, start)
    assert [r.offset for r in result.records] == [off for off, _, _ in records[3:]]
    assert result.clean and result.end_offset == len(data)
    with pytest.raises(ValueError, match="outside a buffer"):
        scan(data, len(data) + 1)


def test_a_scan_works_on_any_buffer():
    data, records = sample_file()
    for buf in (bytearray(data), memoryview(data)):
        result = scan(buf)
        assert [r.msg_id for r in result.records] == [mid for _, mid, _ in records] and result.clean


def test_decoding_one_record_says_how_many_bytes_it_took():
    data, records = sample_file()
    off, msg_id, body = records[5]
    parsed, consumed = decode_record(data, off)
    assert consumed == record_size(len(body)) == parsed.size
    assert parsed.msg_id == msg_id and data[parsed.body_start:parsed.body_start + parsed.body_len] == body


def test_decoding_a_record_the_data_ends_inside_is_a_torn_record():
    record = encode_record(b"i" * 16, b"payload")
    with pytest.raises(TornRecord, match="size field"):
        decode_record(record[:5])
    with pytest.raises(TornRecord, match="needs 32 bytes, 31 remain"):
        decode_record(record[:-1])


def test_decoding_bytes_that_are_not_a_record_is_corruption():
    record = bytearray(encode_record(b"i" * 16, b"payload"))
    record[-1] = 0xFE
    with pytest.raises(CorruptSegment, match="no commit marker"):
        decode_record(bytes(record))
    with pytest.raises(CorruptSegment, match="less than its id"):
        decode_record(struct.pack("<Q", 4) + bytes(30))


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(st.binary(max_size=300), max_size=12), data=st.data())
def test_any_file_cut_anywhere_scans_to_the_records_before_the_cut(bodies, data):
    raw, records = sample_file(bodies)
    cut = data.draw(st.integers(0, len(raw)))
    tail = data.draw(st.sampled_from([b"", bytes(64)]))          # nothing, or the zeros a file system leaves
    result = scan(raw[:cut] + tail)
    whole = whole_before(records, cut)
    assert [(r.offset, r.msg_id) for r in result.records] == [(off, mid) for off, mid, _ in whole]
