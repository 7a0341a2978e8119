"""Garbage: dead segment files are deleted, mostly-dead ones compacted, acked journal files removed,
and disk use stays bounded over a long publish/consume run."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import ROOT, creditflow_cmd, kill_group
from pipeline.storage.journal import QueueJournal, held_store_ids
from pipeline.storage.record import scan
from pipeline.storage.segments import SegmentStore


def mid(i: int) -> bytes:
    return i.to_bytes(16, "little")


def ids_on_disk(directory) -> dict[bytes, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        for _, rid, start, length in scan(data).records:
            out[rid] = data[start:start + length]
    return out


def test_dead_files_are_deleted_and_mostly_dead_ones_compacted(tmp_path):
    store = SegmentStore(str(tmp_path), file_size_limit_bytes=10_000)
    for i in range(40):
        store.append(mid(i), bytes([i]) * 1000)
    store.sync()
    files_before = sorted(os.listdir(tmp_path))
    for i in range(0, 9):                       # the whole first file
        store.decref(mid(i))
    for i in range(9, 18):                      # most of the second one; 17 stays live
        if i != 17:
            store.decref(mid(i))
    reclaimed = store.collect()
    stats = store.statistics()
    assert reclaimed > 15_000 and stats.files_deleted == 2 and stats.files_compacted == 1
    assert "0.rdq" not in os.listdir(tmp_path) and "1.rdq" not in os.listdir(tmp_path)
    assert len(os.listdir(tmp_path)) < len(files_before)
    store.close()
    on_disk = ids_on_disk(tmp_path)
    for i in list(range(17, 40)):
        assert on_disk[mid(i)] == bytes([i]) * 1000, f"live message {i} must survive compaction intact"
    assert mid(3) not in on_disk


def test_a_restarted_store_reclaims_what_the_queues_no_longer_hold(tmp_path):
    store_dir, queues = tmp_path / "store", tmp_path / "queues"
    store = SegmentStore(str(store_dir), file_size_limit_bytes=5_000)
    journal = QueueJournal(str(queues / "q"))
    for i in range(20):
        store.append(mid(i), b"x" * 1000)
        journal.publish(i + 1, 2, mid(i), b"")
    journal.ack(list(range(1, 16)))             # the queue acked 15 of them
    store.close()
    journal.close()
    held = held_store_ids(str(queues))
    assert set(held) == {mid(i) for i in range(15, 20)}
    again = SegmentStore(str(store_dir), file_size_limit_bytes=5_000)
    assert again.adopt(held) == 5
    again.collect()
    assert again.statistics().live_messages == 5
    assert set(ids_on_disk(store_dir)) == {mid(i) for i in range(15, 20)}


def test_fully_acked_journal_files_are_deleted(tmp_path):
    journal = QueueJournal(str(tmp_path), file_size_limit_bytes=2_000)
    for i in range(1, 31):
        journal.publish(i, 2, None, b"m" * 200)
    assert len(os.listdir(tmp_path)) >= 3
    journal.ack(list(range(1, 26)))
    journal.close()
    again = QueueJournal(str(tmp_path), file_size_limit_bytes=2_000)
    assert [m for m, *_ in again.recover()] == list(range(26, 31))
    assert len(os.listdir(tmp_path)) <= 3


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_disk_use_stays_bounded_over_a_long_persistent_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(creditflow_cmd("run", "-s", "6144", "-f", "persistent", "-c", "500", "-z", "6",
                                           "--store-file-mb", "1", "--run-dir", str(run_dir), "--plain"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    written = summary["published"] * 6144
    on_disk = sum(os.path.getsize(run_dir / "msg_store" / n) for n in os.listdir(run_dir / "msg_store"))
    assert written > 50_000_000, "the run must write far more than the bound below"
    assert on_disk < 4 * 1024 * 1024, f"{on_disk} bytes left in the store after {written} written"


def test_a_file_whose_acks_name_an_older_file_is_not_deleted_before_it(tmp_path):
    journal = QueueJournal(str(tmp_path), file_size_limit_bytes=1_000)
    journal.publish(1, 2, None, b"a" * 400)                      # file 0: stays unacked
    journal.publish(2, 2, None, b"b" * 700)                      # file 0, now full
    journal.publish(3, 2, None, b"c" * 1100)                     # file 1
    journal.ack([2])                                             # file 2 opens: holds the ack of 2 (file 0)
    journal.publish(4, 2, None, b"d" * 1100)                     # file 2, now full
    journal.ack([3, 4])                                          # file 3; files 1 and 2 are fully acked
    journal.close()
    again = QueueJournal(str(tmp_path), file_size_limit_bytes=1_000)
    assert [m for m, *_ in again.recover()] == [1], "acked messages must not come back"


def test_a_journal_on_a_full_disk_holds_its_entries_and_writes_them_when_space_comes_back(small_tmpfs):
    """On a real 512 KiB tmpfs: sync answers False while anything is held; a retry on the still-full disk
    fails cleanly; once space is back every publish and ack is on disk, in order, and recovers."""
    from conftest import fill
    root = small_tmpfs("512k")
    filler = fill(root, 32 * 1024)
    journal = QueueJournal(str(root / "q"), file_size_limit_bytes=16 * 1024)
    synced_ok = []
    for n in range(100):
        journal.publish(n, 0, None, b"%04d" % n * 250)
        if n % 3 == 0:
            journal.ack([n])
        synced_ok.append(journal.sync())
    assert journal.full and synced_ok[0] and not synced_ok[-1]
    assert journal.retry() is False
    filler.unlink()
    assert journal.retry() is True and not journal.full and journal.sync()
    journal.close()
    recovered = QueueJournal(str(root / "q")).recover()
    assert [(n, content) for n, _flags, _store, content in recovered] == \
        [(n, b"%04d" % n * 250) for n in range(100) if n % 3]
