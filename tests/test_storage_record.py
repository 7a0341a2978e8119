"""Segment records: a scan stops exactly where whole records end, wherever the file was cut."""

from __future__ import annotations

import os

import pytest

from pipeline.storage.record import MSG_ID_BYTES, encode_record, scan
from pipeline.storage.segments import SegmentStore


def sample() -> tuple[bytes, list[tuple[int, bytes, bytes]]]:
    data = b""
    records = []
    for i, size in enumerate([0, 1, 17, 300, 4096, 5]):
        msg_id = i.to_bytes(MSG_ID_BYTES, "little")
        body = bytes((i * 7 + j) % 256 for j in range(size))
        records.append((len(data), msg_id, body))
        data += encode_record(msg_id, body)
    return data, records


def test_truncating_at_every_offset_keeps_exactly_the_whole_records_before_the_cut():
    data, records = sample()
    for cut in range(len(data) + 1):
        result = scan(data[:cut])
        whole = [r for r in records if r[0] + len(encode_record(r[1], r[2])) <= cut]
        assert [(off, mid) for off, mid, _, _ in result.records] == [(r[0], r[1]) for r in whole]
        for (off, mid, start, length), r in zip(result.records, whole):
            assert data[start:start + length] == r[2]
        assert result.end_offset == (whole[-1][0] + len(encode_record(whole[-1][1], whole[-1][2])) if whole else 0)
        assert result.clean == (cut == result.end_offset)


def test_a_zero_filled_or_garbage_tail_ends_the_scan():
    data, records = sample()
    assert len(scan(data + bytes(64)).records) == len(records)
    flipped = bytearray(data)
    flipped[records[3][0] + 8 + MSG_ID_BYTES + 300] = 0      # the commit marker of record 3
    assert len(scan(bytes(flipped)).records) == 3


def test_segments_roll_at_the_limit_and_fsync_is_timed(tmp_path):
    store = SegmentStore(str(tmp_path), file_size_limit_bytes=10_000)
    for i in range(30):
        store.append(i.to_bytes(MSG_ID_BYTES, "little"), b"x" * 1000)
    result = store.sync()
    assert result.duration_ns > 0
    store.close()
    files = sorted(int(n[:-4]) for n in os.listdir(tmp_path))
    assert files == list(range(len(files))) and len(files) >= 3
    total = 0
    for n in files:
        with open(tmp_path / f"{n}.rdq", "rb") as f:
            r = scan(f.read())
        assert r.clean
        total += len(r.records)
    assert total == 30


@pytest.mark.parametrize("n_queues", [1, 4])
def test_a_message_for_several_queues_is_written_once(tmp_path, n_queues):
    store = SegmentStore(str(tmp_path))
    msg_id = b"m" * MSG_ID_BYTES
    for _ in range(n_queues):
        store.append(msg_id, b"body")
    store.close()
    with open(tmp_path / "0.rdq", "rb") as f:
        assert len(scan(f.read()).records) == 1
