"""The SPSC ring: over a plain bytearray, and across two real processes over shared memory.

Producer and consumer are separate ``Ring`` objects over the same bytes, as
they are in two stages; a third one plays the supervisor reading statistics.
"""

from __future__ import annotations

import os
import struct
import time

import pytest
from hypothesis import given, settings, strategies as st

from ipc import shm
from ipc.doorbell import Doorbell
from ipc.errors import CorruptRecord, IpcError, WouldBlock
from ipc.ring import HEADER_BYTES, REWIND_AFTER_BYTES, RecordTooLarge, Ring, record_bytes
from conftest import fork


def make_ring(capacity_bytes: int, rewind_after_bytes: int = REWIND_AFTER_BYTES) -> tuple[Ring, Ring]:
    """A producer end and a consumer end over one fresh buffer."""
    buf = bytearray(HEADER_BYTES + capacity_bytes)
    return Ring(buf, create=True, rewind_after_bytes=rewind_after_bytes), Ring(buf, create=False)


def length_at(ring: Ring, offset: int) -> int:
    """The length word at ``offset`` of the data area (what the consumer will read there)."""
    return struct.unpack_from("<I", ring.mv, HEADER_BYTES + offset)[0]


# -- records in, records out ----------------------------------------------------------------

def test_a_committed_record_reaches_the_consumer_unchanged():
    producer, consumer = make_ring(4096)
    producer.write_nowait(b"basic.publish")
    producer.write_nowait(memoryview(b"x" * 100)[10:20])
    producer.write_nowait(b"")
    assert producer.commit() == 3
    assert consumer.read_batch() == [b"basic.publish", b"x" * 10, b""]
    assert consumer.read_batch() == []


def test_staged_records_are_invisible_until_commit():
    producer, consumer = make_ring(4096)
    producer.write_nowait(b"a")
    producer.write_nowait(b"b")
    assert consumer.read_batch() == []
    assert consumer.statistics().records_written == 0
    assert producer.commit() == 2
    assert producer.commit() == 0
    assert consumer.read_batch() == [b"a", b"b"]


def test_records_keep_order_and_content_across_many_wrap_arounds():
    producer, consumer = make_ring(1000)
    sent, got = [], []
    for i in range(3000):
        record = bytes([i % 251]) * ((i * 37) % (producer.max_record_bytes + 1))
        while True:
            try:
                producer.write_nowait(record)
                break
            except WouldBlock:
                producer.commit()
                got += consumer.read_batch()
        sent.append(record)
        if i % 3 == 0:
            producer.commit()
        if i % 7 == 0:
            got += consumer.read_batch(max_records=2)
    producer.commit()
    got += consumer.read_batch()
    assert got == sent
    stats = consumer.statistics()
    assert stats.records_read == 3000 and stats.used_bytes == 0
    assert sum(map(len, sent)) > 100 * producer.capacity_bytes, "the positions went round many times"


def write_in_batches(producer: Ring, records: int, per_batch: int, size: int = 100) -> None:
    for first in range(0, records, per_batch):
        for i in range(first, min(records, first + per_batch)):
            producer.write_nowait(bytes([i % 256]) * size)
        producer.commit()


def test_a_drained_ring_is_written_again_from_its_front():
    producer, consumer = make_ring(1 << 20, rewind_after_bytes=4096)
    for _ in range(3):
        write_in_batches(producer, 60, per_batch=10)     # 6,240 bytes in, batches of 1,040
        assert [r[0] for r in consumer.read_batch()] == list(range(60))
        producer.write_nowait(b"next")
        producer.commit()
        assert length_at(producer, 0) == 4               # at the front again, not 6,240 bytes in
        assert consumer.read_batch() == [b"next"]
        assert consumer.statistics().used_bytes == 0
        for _ in range(6):
            producer.write_batch([b"a" * 100] * 10)    # and write_batch likewise
        consumer.read_batch()
        producer.write_batch([b"batch"])
        assert length_at(producer, 0) == 5
        assert consumer.read_batch() == [b"batch"]


def test_a_ring_the_consumer_has_not_drained_goes_on_where_it_stands():
    producer, consumer = make_ring(1 << 20, rewind_after_bytes=4096)
    write_in_batches(producer, 60, per_batch=10)
    assert len(consumer.read_batch(max_records=59)) == 59   # one record still unread
    producer.write_nowait(b"next")
    producer.commit()
    assert length_at(producer, 0) == 100                 # the front still holds the first record
    assert length_at(producer, 60 * record_bytes(100)) == 4
    assert [len(r) for r in consumer.read_batch()] == [100, 4]


def test_a_drained_ring_goes_back_only_past_twice_its_biggest_batch():
    # until the consumer passes the wrap marker the producer has only the front: a batch as big as
    # the last ones must fit there, or it waits for the consumer
    producer, consumer = make_ring(1 << 20, rewind_after_bytes=4096)
    write_in_batches(producer, 60, per_batch=60)         # one batch of 6,240 bytes
    consumer.read_batch()
    producer.write_nowait(b"next")
    producer.commit()
    assert length_at(producer, 60 * record_bytes(100)) == 4    # 6,240 in: short of 12,480
    consumer.read_batch()
    write_in_batches(producer, 60, per_batch=10)         # now 12,484 in
    consumer.read_batch()
    producer.write_nowait(b"next")
    producer.commit()
    assert length_at(producer, 0) == 4


def test_a_drained_ring_stays_put_for_a_record_bigger_than_the_room_before_it():
    producer, consumer = make_ring(1 << 16, rewind_after_bytes=4096)
    producer.write_nowait(b"x" * 5000)
    producer.commit()
    consumer.read_batch()
    producer.write_nowait(b"y" * 6000)                  # would not fit in the 5,004 bytes before it
    producer.commit()
    assert length_at(producer, record_bytes(5000)) == 6000
    assert consumer.read_batch() == [b"y" * 6000]


def test_read_batch_takes_at_most_max_records():
    producer, consumer = make_ring(4096)
    producer.write_batch([b"%d" % i for i in range(10)])
    assert consumer.read_batch(max_records=0) == []
    assert consumer.read_batch(max_records=1) == [b"0"]
    assert consumer.read_batch(max_records=4) == [b"1", b"2", b"3", b"4"]
    assert consumer.read_batch() == [b"5", b"6", b"7", b"8", b"9"]


# -- a full ring, and records that can never fit ---------------------------------------------

def test_a_full_ring_would_block_until_the_consumer_frees_space():
    producer, consumer = make_ring(256)
    assert record_bytes(50) == 56                       # u32 length + 50 bytes + 2 bytes padding
    assert producer.write_batch([b"y" * 50] * 10) == 4  # 4 x 56 = 224 of 256 bytes
    with pytest.raises(WouldBlock, match="ring is full"):
        producer.write_nowait(b"z" * 50)
    assert producer.commit() == 0, "a refused record is not staged"
    assert consumer.read_batch(max_records=1) == [b"y" * 50]
    # 32 bytes are left before the end: the record wraps to offset 0, taking 32 + 56 = 88 free bytes
    producer.write_nowait(b"z" * 50)
    producer.commit()
    assert consumer.read_batch() == [b"y" * 50] * 3 + [b"z" * 50]


def test_write_batch_stops_at_the_first_record_that_does_not_fit():
    producer, consumer = make_ring(256)
    records = [bytes([i]) * 40 for i in range(10)]      # 44 bytes each: 5 fit in 256
    done = producer.write_batch(records)
    assert done == 5
    assert producer.write_batch(records[done:]) == 0
    assert consumer.read_batch(max_records=2) == records[:2]
    done += producer.write_batch(records[done:])
    assert done == 7
    assert consumer.read_batch() == records[2:7]


def test_a_record_that_can_never_fit_is_refused():
    producer, _ = make_ring(256)
    assert producer.max_record_bytes == 256 // 2 - 4
    with pytest.raises(RecordTooLarge, match="record of 125 bytes exceeds this ring's limit of 124"):
        producer.write_nowait(b"x" * 125)
    with pytest.raises(ValueError):
        producer.write_batch([b"x" * 125])
    assert producer.statistics().records_written == 0


def test_the_largest_record_fits_an_empty_ring_wherever_the_positions_stand():
    for offset in range(0, 256, 4):
        producer, consumer = make_ring(256)
        producer.write_batch([b""] * (offset // 4))     # empty records take 4 bytes each
        consumer.read_batch()
        largest = b"L" * producer.max_record_bytes
        producer.write_nowait(largest)
        producer.commit()
        assert consumer.read_batch() == [largest], offset


def test_write_batch_commits_the_records_before_one_too_large():
    producer, consumer = make_ring(256)
    with pytest.raises(RecordTooLarge):
        producer.write_batch([b"a", b"b", b"x" * 200, b"c"])
    assert consumer.read_batch() == [b"a", b"b"]


# -- statistics and the writer_waiting flag ------------------------------------------------------

def test_statistics_count_records_in_flight_and_the_high_water_mark():
    buf = bytearray(HEADER_BYTES + 4096)
    producer, consumer = Ring(buf, create=True), Ring(buf, create=False)
    supervisor = Ring(buf, create=False)
    producer.write_batch([b"m" * 10] * 5)
    s = supervisor.statistics()
    assert (s.records_written, s.records_read, s.in_flight, s.max_in_flight) == (5, 0, 5, 5)
    assert s.used_bytes == 5 * record_bytes(10) and s.capacity_bytes == 4096
    consumer.read_batch(max_records=3)
    producer.write_batch([b"m"])
    s = supervisor.statistics()
    assert (s.records_written, s.records_read, s.in_flight, s.max_in_flight) == (6, 3, 3, 5)
    producer.write_batch([b"m"] * 4)
    assert supervisor.statistics().max_in_flight == 7
    consumer.read_batch()
    s = supervisor.statistics()
    assert (s.in_flight, s.used_bytes, s.max_in_flight) == (0, 0, 7)


def test_writer_waiting_is_set_by_the_producer_and_seen_by_the_consumer():
    producer, consumer = make_ring(4096)
    assert not consumer.writer_waiting
    producer.writer_waiting = True
    assert consumer.writer_waiting and consumer.statistics().writer_waiting
    producer.writer_waiting = False
    assert not consumer.writer_waiting


def test_a_producer_attaching_later_continues_where_the_ring_stands():
    buf = bytearray(HEADER_BYTES + 512)
    first = Ring(buf, create=True)
    consumer = Ring(buf, create=False)
    first.write_batch([b"one", b"two"])
    second = Ring(buf, create=False)                     # e.g. a restarted producer
    second.write_batch([b"three"])
    assert consumer.read_batch() == [b"one", b"two", b"three"]
    assert consumer.statistics().records_written == 3


# -- zero-copy reads ----------------------------------------------------------------------------

def test_read_into_hands_out_views_that_expire_when_the_handler_returns():
    producer, consumer = make_ring(4096)
    producer.write_batch([b"alpha", b"beta", b"gamma"])
    seen, kept = [], []

    def handle(view):
        assert isinstance(view, memoryview)
        seen.append(bytes(view))
        kept.append(view)

    assert consumer.read_into(handle, max_records=2) == 2
    assert seen == [b"alpha", b"beta"]
    with pytest.raises(ValueError, match="released"):
        bytes(kept[0])
    assert consumer.read_into(handle) == 1
    assert seen[-1] == b"gamma"
    assert consumer.read_into(handle) == 0
    assert consumer.statistics().records_read == 3


def test_read_into_keeps_the_record_whose_handler_raised():
    producer, consumer = make_ring(4096)
    producer.write_batch([b"ok", b"bad", b"later"])
    handled = []

    def handle(view):
        if bytes(view) == b"bad":
            raise RuntimeError("handler failed")
        handled.append(bytes(view))

    with pytest.raises(RuntimeError):
        consumer.read_into(handle)
    assert handled == [b"ok"]
    assert consumer.read_batch() == [b"bad", b"later"]


# -- what is not a ring ---------------------------------------------------------------------

def test_attaching_to_a_buffer_that_holds_no_ring_is_refused():
    with pytest.raises(CorruptRecord, match="no ring"):
        Ring(bytearray(HEADER_BYTES + 4096), create=False)
    buf = bytearray(HEADER_BYTES + 4096)
    Ring(buf, create=True)
    with pytest.raises(CorruptRecord, match="no ring"):
        Ring(memoryview(buf)[:HEADER_BYTES + 2048], create=False)   # a different capacity
    with pytest.raises(ValueError, match="at least"):
        Ring(bytearray(HEADER_BYTES + 8), create=True)
    with pytest.raises(ValueError, match="writable"):
        Ring(bytes(HEADER_BYTES + 4096), create=True)


def test_a_corrupt_record_length_is_reported_not_returned():
    buf = bytearray(HEADER_BYTES + 4096)
    producer, consumer = Ring(buf, create=True), Ring(buf, create=False)
    producer.write_batch([b"fine", b"fine"])
    struct.pack_into("<I", buf, HEADER_BYTES + record_bytes(4), 3000)   # second record's length
    with pytest.raises(CorruptRecord, match="exceeds"):
        consumer.read_batch()
    assert isinstance(CorruptRecord("x"), IpcError)


# -- any interleaving -----------------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("write"), st.binary(max_size=140)),
    st.tuples(st.just("batch"), st.lists(st.binary(max_size=60), max_size=8)),
    st.tuples(st.just("commit"), st.none()),
    st.tuples(st.just("read"), st.integers(0, 6)),
    st.tuples(st.just("read_into"), st.integers(1, 6)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=150), capacity=st.sampled_from([296, 600, 1024]),
       rewind=st.sampled_from([64, 200, REWIND_AFTER_BYTES]))
def test_any_interleaving_of_writes_commits_and_reads_preserves_the_sequence(ops, capacity, rewind):
    producer, consumer = make_ring(capacity, rewind)
    committed, staged, got = [], [], []
    high_water = 0

    def publish():
        nonlocal staged, high_water
        committed.extend(staged)
        staged = []
        high_water = max(high_water, len(committed) - len(got))

    for kind, arg in ops:
        if kind == "write":
            try:
                producer.write_nowait(arg)
                staged.append(arg)
            except (WouldBlock, RecordTooLarge):
                pass
        elif kind == "batch":
            n = producer.write_batch(arg)
            staged += arg[:n]
            publish()
        elif kind == "commit":
            assert producer.commit() == len(staged)
            publish()
        elif kind == "read":
            got += consumer.read_batch(max_records=arg)
        else:
            consumer.read_into(lambda view: got.append(view.tobytes()), max_records=arg)
        assert got == committed[:len(got)]
        s = consumer.statistics()
        assert (s.records_written, s.records_read, s.max_in_flight) == (len(committed), len(got), high_water)
        assert (s.used_bytes == 0) == (s.in_flight == 0)
        assert 0 <= s.used_bytes <= capacity
    producer.commit()
    publish()
    got += consumer.read_batch()
    assert got == committed


# -- across two processes over shared memory ------------------------------------------------------

@pytest.fixture
def owner():
    """A segment owner for the test; every segment is unlinked even if the test fails."""
    segment_owner = shm.SegmentOwner(shm.new_run_id())
    yield segment_owner
    segment_owner.unlink_all()
    assert not shm.leftover_names(run_id=segment_owner.run_id)


def wait_exit_code(pid: int, children: list[int]) -> int:
    _, status = os.waitpid(pid, 0)
    children.remove(pid)
    return os.waitstatus_to_exitcode(status)


RECORDS = 100_000


def numbered(i: int) -> bytes:
    return struct.pack("<Q", i) + bytes([i % 256]) * (i % 90)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_hundred_thousand_records_cross_between_processes_in_order(owner, children):
    seg, ring = shm.create_ring(owner, "ring-test", 1 << 16)
    bell = Doorbell()

    def consumer() -> int:
        _, cring = shm.attach_ring(seg.name)
        deadline = time.monotonic() + 50
        n = 0
        while n < RECORDS:
            records = cring.read_batch()
            if not records:
                if time.monotonic() > deadline:
                    return 4
                try:
                    bell.wait_rung(1.0)
                except WouldBlock:
                    pass
                continue
            for record in records:
                if record != numbered(n):
                    return 3
                n += 1
        return 0

    pid = fork(consumer)
    children.append(pid)
    sent = 0
    while sent < RECORDS:
        done = ring.write_batch([numbered(i) for i in range(sent, min(sent + 64, RECORDS))])
        if done:
            sent += done
            bell.ring()
        else:
            os.sched_yield()
    assert wait_exit_code(pid, children) == 0, "the child saw every record, in order (3: out of order, 4: stalled)"
    stats = ring.statistics()
    assert (stats.records_written, stats.records_read, stats.in_flight, stats.used_bytes) == (RECORDS, RECORDS, 0, 0)
    assert 64 <= stats.max_in_flight < RECORDS
    bell.close()
    seg.close()
