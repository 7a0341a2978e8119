"""The shared store's segment files: roll-over, large messages, write-once refcounts, the timed fsync,
compaction, and recovery after an abrupt stop — all with real files."""

from __future__ import annotations

import os
import random

import pytest

from pipeline.storage.errors import CorruptSegment, StoreClosed, UnknownMessage
from pipeline.storage.record import encode_record, record_size, scan
from pipeline.storage.segments import (FILE_SIZE_LIMIT_BYTES, LARGE_MESSAGE_BYTES, SYNC_INTERVAL_MS, SegmentStore,
                                       read_bodies, recover)

BODY_BYTES = 1000
RECORD_BYTES = record_size(BODY_BYTES)          # 1025
LIMIT_BYTES = 10_000                            # reached by the 10th record of a file


def mid(i: int) -> bytes:
    return i.to_bytes(16, "little")


def body(i: int, size: int = BODY_BYTES) -> bytes:
    return random.Random(i).randbytes(size)


def files_on_disk(directory) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}


def records_on_disk(directory) -> dict[bytes, list[bytes]]:
    found: dict[bytes, list[bytes]] = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        for r in scan(data).records:
            found.setdefault(r.msg_id, []).append(data[r.body_start:r.body_start + r.body_len])
    return found


@pytest.fixture
def store(tmp_path):
    s = SegmentStore(str(tmp_path), file_size_limit_bytes=LIMIT_BYTES)
    yield s
    s.close()


def test_defaults_are_rabbitmqs():
    assert SYNC_INTERVAL_MS == 200 and FILE_SIZE_LIMIT_BYTES == 16 * 1024 * 1024
    assert LARGE_MESSAGE_BYTES == 4_000_000


def test_files_roll_over_once_they_reach_the_limit(tmp_path, store):
    for i in range(25):
        store.append(mid(i), body(i))
    store.sync()
    # A file takes records until its size has reached the limit: 10 records of 1025 bytes = 10,250.
    assert files_on_disk(tmp_path) == {"0.rdq": 10 * RECORD_BYTES, "1.rdq": 10 * RECORD_BYTES,
                                       "2.rdq": 5 * RECORD_BYTES}
    stats = store.statistics()
    assert stats.files == 3 and stats.current_file == 2 and stats.rolls == 2
    assert stats.bytes_on_disk == stats.live_bytes == 25 * RECORD_BYTES and stats.garbage_bytes == 0
    assert store.locations()[mid(10)].file == 1 and store.locations()[mid(10)].offset == 0


def test_a_roll_over_fsyncs_the_old_file_and_the_next_sync_names_what_it_covered(store):
    for i in range(10):
        store.append(mid(i), body(i))
    assert store.statistics().syncs == 0 and store.statistics().unsynced_bytes == 10 * RECORD_BYTES
    store.append(mid(10), body(10))             # file 0 had reached the limit: this write rolls it
    stats = store.statistics()
    assert stats.rolls == 1 and stats.syncs == 1 and stats.unsynced_bytes == RECORD_BYTES
    result = store.sync()
    assert result.msg_ids_covered == tuple(mid(i) for i in range(11))
    assert result.bytes == 11 * RECORD_BYTES and result.duration_ns > 0
    assert store.statistics().syncs == 2 and store.statistics().unsynced_bytes == 0
    again = store.sync()
    assert again.msg_ids_covered == () and again.bytes == 0 and again.duration_ns == 0


def test_a_planted_fsync_delay_shows_in_every_sync_and_in_the_statistics(tmp_path):
    with SegmentStore(str(tmp_path), fsync_delay_ms=30) as slow:
        slow.append(mid(1), b"x")
        result = slow.sync()
        stats = slow.statistics()
    assert result.duration_ns >= 30_000_000
    assert stats.last_sync_ns == result.duration_ns and stats.sync_p99_ns >= 30_000_000


def test_a_large_message_gets_a_file_of_its_own(tmp_path):
    with SegmentStore(str(tmp_path)) as store:
        big = body(7, LARGE_MESSAGE_BYTES)
        store.append(mid(1), b"small before")
        store.append(mid(2), big)
        store.append(mid(3), b"small after")
        assert store.read(mid(2)) == big
    assert files_on_disk(tmp_path) == {"0.rdq": record_size(12), "1.rdq": record_size(LARGE_MESSAGE_BYTES),
                                       "2.rdq": record_size(11)}
    with open(tmp_path / "1.rdq", "rb") as f:
        assert [r.msg_id for r in scan(f.read()).records] == [mid(2)]


def test_a_message_just_under_the_large_size_shares_a_file(tmp_path):
    with SegmentStore(str(tmp_path)) as store:
        store.append(mid(1), b"a")
        store.append(mid(2), bytes(LARGE_MESSAGE_BYTES - 1))
        store.append(mid(3), b"b")
    assert list(files_on_disk(tmp_path)) == ["0.rdq"]


@pytest.mark.parametrize("n_queues", [1, 3, 8])
def test_a_message_routed_to_n_queues_is_written_once_and_removed_by_the_last_decref(tmp_path, store, n_queues):
    payload = body(99)
    store.append(mid(1), payload)
    for _ in range(n_queues - 1):
        store.append(mid(1), payload)           # each further queue only adds a reference
    store.append(mid(2), b"other")
    store.sync()
    assert {k: len(v) for k, v in records_on_disk(tmp_path).items()} == {mid(1): 1, mid(2): 1}
    assert store.refcount(mid(1)) == n_queues
    assert store.statistics().appends == 2 and store.statistics().duplicate_appends == n_queues - 1
    for left in range(n_queues - 1, 0, -1):
        assert store.decref(mid(1)) == left
        assert store.read(mid(1)) == payload
    live_before = store.statistics().live_bytes
    assert store.decref(mid(1)) == 0
    assert store.statistics().live_bytes == live_before - RECORD_BYTES
    with pytest.raises(UnknownMessage, match="no message 01000000"):
        store.read(mid(1))


def test_incref_adds_a_reference_only_to_a_stored_message(store):
    store.append(mid(1), b"x")
    assert store.incref(mid(1)) == 2
    with pytest.raises(UnknownMessage, match="to reference"):
        store.incref(mid(2))
    assert store.decref(mid(5)) == 0 and store.statistics().unknown_decrefs == 1


def test_a_message_still_in_the_write_buffer_reads_back(store):
    store.append(mid(1), b"fresh")
    assert store.statistics().syncs == 0
    assert store.read(mid(1)) == b"fresh"


def test_a_read_checks_the_record_it_lands_on(tmp_path, store):
    store.append(mid(1), b"a" * 50)
    store.sync()
    with open(tmp_path / "0.rdq", "r+b") as f:
        f.seek(record_size(50) - 1)
        f.write(b"\x00")                        # the commit marker
    with pytest.raises(CorruptSegment, match="no commit marker"):
        store.read(mid(1))


def fill(store, count: int) -> None:
    for i in range(count):
        store.append(mid(i), body(i))
    store.sync()


def test_compaction_shrinks_the_disk_and_every_live_message_reads_back_identical(tmp_path, store):
    fill(store, 45)                             # files 0..3 full, 4 current
    live = set(range(45))
    for i in list(range(0, 10)) + [i for i in range(10, 20) if i % 5] + [i for i in range(20, 30) if i % 2]:
        store.decref(mid(i))                    # file 0: all dead; 1: 2/10 live; 2: 5/10 live (exactly half)
        live.discard(i)
    before = sum(files_on_disk(tmp_path).values())
    reclaimed = store.compact()
    after = files_on_disk(tmp_path)
    assert "0.rdq" not in after and "1.rdq" not in after, "dead and mostly dead files are gone"
    assert after["2.rdq"] == 10 * RECORD_BYTES, "a file at half live is left alone"
    assert "3.rdq" in after and after["3.rdq"] == 10 * RECORD_BYTES
    assert sum(after.values()) == before - reclaimed == before - 18 * RECORD_BYTES
    stats = store.statistics()
    assert stats.files_deleted == 2 and stats.files_compacted == 1 and stats.bytes_moved == 2 * RECORD_BYTES
    assert stats.bytes_on_disk == sum(after.values()) and stats.live_bytes == len(live) * RECORD_BYTES
    for i in live:
        assert store.read(mid(i)) == body(i)
    on_disk = records_on_disk(tmp_path)
    assert set(on_disk) == {mid(i) for i in live | set(range(20, 30))}
    assert all(len(copies) == 1 for copies in on_disk.values())


def test_the_current_file_is_never_compacted_or_deleted(tmp_path, store):
    fill(store, 3)
    for i in range(3):
        store.decref(mid(i))
    assert store.compact() == 0
    assert list(files_on_disk(tmp_path)) == ["0.rdq"]
    store.append(mid(50), b"next")
    assert store.read(mid(50)) == b"next"


def test_compaction_does_not_lose_messages_written_after_it(tmp_path, store):
    fill(store, 25)
    for i in range(10, 19):
        store.decref(mid(i))
    store.compact()                             # file 1's last live message moves to file 2
    store.append(mid(100), b"later")
    store.close()
    again, locations = recover(str(tmp_path), file_size_limit_bytes=LIMIT_BYTES)
    with again:
        assert set(locations) == {mid(i) for i in list(range(10)) + list(range(19, 25)) + [100]}
        assert locations[mid(19)].file == 2
        assert again.read(mid(19)) == body(19) and again.read(mid(100)) == b"later"


def test_recovery_after_a_clean_stop_finds_every_message_and_appends_to_a_new_file(tmp_path, store):
    fill(store, 25)
    store.close()
    again, locations = recover(str(tmp_path), file_size_limit_bytes=LIMIT_BYTES)
    with again:
        assert set(locations) == {mid(i) for i in range(25)}
        assert all(again.read(mid(i)) == body(i) for i in range(25))
        assert again.append(mid(25), b"new").file == 3
        assert again.statistics().truncated_bytes == 0


def crash_while_writing(directory: str, synced: int, unsynced: int) -> None:
    """A child process writes ``synced`` messages and fsyncs, writes ``unsynced`` more, and dies at once."""
    pid = os.fork()
    if pid == 0:                                # pragma: no cover - the child never returns
        try:
            store = SegmentStore(directory, file_size_limit_bytes=LIMIT_BYTES)
            for i in range(synced):
                store.append(mid(i), body(i))
            store.sync()
            for i in range(synced, synced + unsynced):
                store.append(mid(i), body(i))
        finally:
            os._exit(0)                         # no flush, no close: what is buffered is lost
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_recovery_after_an_abrupt_stop_keeps_every_synced_message(tmp_path):
    crash_while_writing(str(tmp_path), synced=23, unsynced=4)
    store, locations = recover(str(tmp_path), file_size_limit_bytes=LIMIT_BYTES)
    with store:
        assert {mid(i) for i in range(23)} <= set(locations)
        for message_id in locations:
            i = int.from_bytes(message_id, "little")
            assert store.read(message_id) == body(i)


@pytest.mark.parametrize("seed", range(12))
def test_recovery_truncates_a_torn_or_garbage_tail_and_keeps_every_whole_record(tmp_path, seed):
    rng = random.Random(seed)
    with SegmentStore(str(tmp_path), file_size_limit_bytes=LIMIT_BYTES) as store:
        fill(store, 23)                         # files 0 and 1 full, 2 holds 3 records
    last = tmp_path / "2.rdq"
    size = last.stat().st_size
    cut = rng.randrange(size + 1)
    garbage = rng.choice([b"", bytes(rng.randrange(1, 5000)), b"\x13\x00\x00\x00\x00\x00\x00\x00garbage"])
    with open(last, "r+b") as f:
        f.truncate(cut)
        f.seek(cut)
        f.write(garbage)
    whole = cut // RECORD_BYTES                 # records of the last file wholly before the cut
    store, locations = recover(str(tmp_path), file_size_limit_bytes=LIMIT_BYTES)
    with store:
        assert set(locations) == {mid(i) for i in range(20 + whole)}
        assert all(store.read(mid(i)) == body(i) for i in range(20 + whole))
        assert store.statistics().truncated_bytes == cut + len(garbage) - whole * RECORD_BYTES
        store.append(mid(500), b"after the crash")
        assert store.read(mid(500)) == b"after the crash"
    assert last.stat().st_size == whole * RECORD_BYTES, "the torn tail is cut away on disk"


def test_recovery_claims_only_what_the_queues_hold_and_the_rest_is_collected(tmp_path, store):
    fill(store, 30)
    store.close()
    held = {mid(i): 2 for i in range(20, 24)} | {mid(3): 1}
    again, locations = recover(str(tmp_path), held=held, file_size_limit_bytes=LIMIT_BYTES)
    with again:
        assert set(locations) == set(held)
        assert again.refcount(mid(22)) == 2 and again.refcount(mid(3)) == 1 and again.refcount(mid(10)) == 0
        again.compact()
        assert set(records_on_disk(tmp_path)) == set(held)
        assert all(again.read(m) == body(int.from_bytes(m, "little")) for m in held)


def test_a_compaction_cut_short_leaves_two_copies_and_recovery_keeps_one(tmp_path):
    # The copy of message 1 reached file 1 and was fsynced; the crash came before file 0 was deleted.
    (tmp_path / "0.rdq").write_bytes(encode_record(mid(1), b"same") + encode_record(mid(2), b"dead"))
    (tmp_path / "1.rdq").write_bytes(encode_record(mid(1), b"same"))
    store, locations = recover(str(tmp_path), held={mid(1): 1})
    with store:
        assert locations[mid(1)].file == 1
        assert store.statistics().live_bytes == record_size(4)
        store.compact()
        assert sorted(os.listdir(tmp_path)) == ["1.rdq"]
        assert store.read(mid(1)) == b"same"


def test_bodies_read_without_a_store_are_the_wanted_ones_whole_and_the_later_copy(tmp_path):
    # what a durable queue recovering before the store runs reads: a compaction's two copies of message 1
    # (the later one wins, as recovery's), message 3 torn off the end of file 1, message 2 not wanted
    (tmp_path / "0.rdq").write_bytes(encode_record(mid(1), b"old") + encode_record(mid(2), b"two"))
    torn = encode_record(mid(3), b"three")
    (tmp_path / "1.rdq").write_bytes(encode_record(mid(1), b"new") + torn[:-1])
    (tmp_path / "notes.txt").write_bytes(b"not a segment")
    assert read_bodies(str(tmp_path), {mid(1), mid(3)}) == {mid(1): b"new"}
    assert read_bodies(str(tmp_path), set()) == {}
    assert read_bodies(str(tmp_path / "missing"), {mid(1)}) == {}


def test_a_closed_store_refuses_work(store):
    store.append(mid(1), b"x")
    assert store.close().msg_ids_covered == (mid(1),)
    assert store.close() is None
    with pytest.raises(StoreClosed, match="was closed"):
        store.append(mid(2), b"y")


def test_a_full_disk_holds_the_writes_it_refused_and_retry_writes_them_once_there_is_space(small_tmpfs):
    """On a real 1 MiB tmpfs: what the disk refuses is never reported durable, stays readable, and is
    written by a retry once space is back; a recovery then finds every message whole."""
    from conftest import fill
    from pipeline.storage.errors import DiskFull
    from pipeline.storage.segments import recover
    root = small_tmpfs("1m")
    directory = root / "store"
    filler = fill(root, 256 * 1024)
    store = SegmentStore(str(directory), file_size_limit_bytes=128 * 1024)
    bodies = {f"{i:016d}".encode(): bytes([i % 251]) * 20_000 for i in range(30)}
    durable, full_at = [], None
    for i, (msg_id, body) in enumerate(bodies.items()):
        try:
            store.append(msg_id, body)
            durable.extend(store.sync().msg_ids_covered)
        except DiskFull:
            full_at = i if full_at is None else full_at
    assert full_at is not None and store.held() > 0, "the tmpfs never filled up"
    refused = list(bodies)[full_at:]
    assert durable == list(bodies)[:full_at] and not set(durable) & set(refused), "a refused write reported durable"
    assert all(store.read(msg_id) == body for msg_id, body in bodies.items())      # held ones from memory
    with pytest.raises(DiskFull):
        store.retry()                                                            # still full
    filler.unlink()
    result = store.retry()
    assert store.held() == 0
    assert set(durable) | set(result.msg_ids_covered) == set(bodies)
    store.close()
    again, where = recover(str(directory))
    assert set(where) == set(bodies)
    assert all(again.read(msg_id) == body for msg_id, body in bodies.items())
    again.close()
