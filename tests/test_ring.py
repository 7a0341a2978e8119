"""The SPSC ring: over a plain bytearray, and across two real processes over shared memory."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings, strategies as st

from ipc import shm
from ipc.errors import WouldBlock
from ipc.ring import HEADER_BYTES, RecordTooLarge, Ring


def test_records_come_out_in_order_across_wrap_around():
    ring = Ring(bytearray(HEADER_BYTES + 1000), create=True)
    sent, got = [], []
    for i in range(500):
        rec = bytes([i % 251]) * (i % 97)
        while True:
            try:
                ring.write_nowait(rec)
                break
            except WouldBlock:
                ring.commit()
                got += ring.read_batch()
        ring.commit()
        sent.append(rec)
        if i % 7 == 0:
            got += ring.read_batch(max_records=3)
    got += ring.read_batch()
    assert got == sent


def test_staged_records_are_invisible_until_commit():
    ring = Ring(bytearray(HEADER_BYTES + 4096), create=True)
    ring.write_nowait(b"a")
    assert ring.read_batch() == []
    assert ring.commit() == 1
    assert ring.read_batch() == [b"a"]


def test_full_ring_would_block_and_too_large_is_refused():
    ring = Ring(bytearray(HEADER_BYTES + 256), create=True)
    with pytest.raises(RecordTooLarge, match="exceeds"):
        ring.write_nowait(b"x" * 200)
    assert ring.write_batch([b"y" * 50] * 10) == 4
    with pytest.raises(WouldBlock):
        ring.write_nowait(b"z" * 50)
    assert len(ring.read_batch()) == 4
    ring.write_nowait(b"z" * 50)


def test_statistics_count_in_flight_and_the_maximum():
    ring = Ring(bytearray(HEADER_BYTES + 4096), create=True)
    ring.write_batch([b"m"] * 5)
    s = ring.statistics()
    assert (s.records_written, s.records_read, s.in_flight, s.max_in_flight) == (5, 0, 5, 5)
    ring.read_batch(max_records=3)
    ring.write_batch([b"m"])
    s = ring.statistics()
    assert (s.in_flight, s.max_in_flight) == (3, 5)
    ring.writer_waiting = True
    assert Ring(ring.mv, create=False).statistics().writer_waiting


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.binary(max_size=120), st.just(None), st.integers(1, 5)), max_size=200))
def test_any_interleaving_preserves_the_sequence(ops):
    ring = Ring(bytearray(HEADER_BYTES + 600), create=True)
    sent, got, pending = [], [], []
    for op in ops:
        if isinstance(op, bytes):
            try:
                ring.write_nowait(op)
                pending.append(op)
            except WouldBlock:
                pass
        elif op is None:
            ring.commit()
            sent += pending
            pending = []
        else:
            got += ring.read_batch(max_records=op)
    ring.commit()
    sent += pending
    got += ring.read_batch()
    assert got == sent


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_hundred_thousand_records_cross_between_processes_in_order():
    owner = shm.SegmentOwner(shm.new_run_id())
    try:
        seg, ring = shm.create_ring(owner, "test", 1 << 16)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                cseg, cring = shm.attach_ring(seg.name)
                n = 0
                while n < 100_000:
                    for rec in cring.read_batch():
                        if struct.unpack("<Q", rec[:8])[0] != n:
                            os._exit(3)
                        n += 1
                code = 0
            finally:
                os._exit(code)
        i = 0
        while i < 100_000:
            batch = [struct.pack("<Q", j) + b"p" * (j % 50) for j in range(i, min(i + 64, 100_000))]
            i += ring.write_batch(batch)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ring.statistics().records_read == 100_000
    finally:
        owner.unlink_all()
    assert not shm.leftover_names(run_id=owner.run_id)
