"""A durable queue's index: small messages embedded, large ones by id, deliveries and acks journalled,
acked files deleted without bringing messages back, and recovery in publish order."""

from __future__ import annotations

import os
import random
import struct
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.storage.errors import SequenceNotIncreasing, StoreClosed, UnknownSequence
from pipeline.storage.queue_index import (QUEUE_INDEX_EMBED_MSGS_BELOW, IndexEntry, QueueIndex, embeds, recover)
from pipeline.storage.record import record_size, scan

SMALL_LIMIT_BYTES = 300     # four 75-byte publishes (40-byte bodies) to a file, so files roll and can be deleted


def mid(i: int) -> bytes:
    return i.to_bytes(16, "little")


def msg(i: int, size: int = 40) -> bytes:
    return random.Random(i).randbytes(size)


def files(directory) -> list[str]:
    return sorted(os.listdir(directory), key=lambda n: int(n.split(".")[0]))


@pytest.fixture
def index(tmp_path):
    qi = QueueIndex(str(tmp_path))
    yield qi
    qi.close()


def test_messages_under_the_embed_size_live_in_the_index(tmp_path, index):
    assert QUEUE_INDEX_EMBED_MSGS_BELOW == 4096
    assert embeds(4095) and not embeds(4096)
    assert index.publish(0, mid(0), msg(0, 4095)) is True
    assert index.publish(1, mid(1), msg(1, 4096)) is False       # the caller writes this one to the store
    assert index.publish(2, mid(2), None) is False
    assert index.publish(3, mid(3), b"") is True
    index.close()
    assert recover(str(tmp_path)) == [IndexEntry(0, mid(0), msg(0, 4095), True, False),
                                      IndexEntry(1, mid(1), None, True, False),
                                      IndexEntry(2, mid(2), None, True, False),
                                      IndexEntry(3, mid(3), b"", True, False)]
    head = 1 + 8 + 1                                          # type, seq, flags
    assert os.path.getsize(tmp_path / "0.qi") == 4 * record_size(head) + 4095, "only the small body is here"


def test_recovery_returns_the_live_messages_in_publish_order(tmp_path):
    with QueueIndex(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES) as qi:
        for seq in range(30):
            qi.publish(seq, mid(seq), msg(seq), persistent=seq % 3 != 0)
        qi.deliver([4, 5, 6, 20])
        qi.ack([0, 1, 2, 5, 17, 29])
        qi.deliver([7])
    entries = recover(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES)
    live = [s for s in range(30) if s not in {0, 1, 2, 5, 17, 29}]
    assert [e.seq for e in entries] == live
    assert all(e.msg_id == mid(e.seq) and e.body == msg(e.seq) for e in entries)
    assert [e.seq for e in entries if e.delivered] == [4, 6, 7, 20]
    assert [e.seq for e in entries if not e.persistent] == [3, 6, 9, 12, 15, 18, 21, 24, 27]


def test_index_files_roll_like_segments(tmp_path):
    with QueueIndex(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES) as qi:
        for seq in range(12):
            qi.publish(seq, mid(seq), msg(seq))
        stats = qi.statistics()
    per_record = record_size(1 + 8 + 1 + 40)            # type, seq, flags, body
    per_file = -(-SMALL_LIMIT_BYTES // per_record)      # records until the size reaches the limit
    assert files(tmp_path) == [f"{n}.qi" for n in range(-(-12 // per_file))]
    assert os.path.getsize(tmp_path / "0.qi") == per_file * per_record
    assert stats.rolls == len(files(tmp_path)) - 1 and stats.bytes_on_disk == 12 * per_record


def test_files_whose_messages_are_all_acked_are_deleted(tmp_path):
    qi = QueueIndex(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES)
    for seq in range(24):
        qi.publish(seq, mid(seq), msg(seq))
    assert files(tmp_path) == [f"{n}.qi" for n in range(6)]
    qi.ack(range(0, 12))                         # files 0..2 hold seqs 0..11; the ack goes to file 6
    assert files(tmp_path) == ["3.qi", "4.qi", "5.qi", "6.qi"] and qi.statistics().files_deleted == 3
    qi.ack(range(12, 24))
    assert files(tmp_path) == ["6.qi"], "the current file stays, whatever it holds"
    assert qi.statistics().live_messages == 0
    qi.close()
    assert recover(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES) == []
    assert files(tmp_path) == [], "opening finds nothing live and deletes the last file"


def test_a_file_of_acks_for_an_older_live_file_is_kept_so_no_acked_message_comes_back(tmp_path):
    qi = QueueIndex(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES)
    for seq in range(12):                        # file 0: seqs 0..3, file 1: 4..7, file 2: 8..11
        qi.publish(seq, mid(seq), msg(seq))
    qi.ack(list(range(1, 12)))                   # written to file 3 (file 2 was full); seq 0 stays live
    for seq in range(12, 15):                    # fill file 3, then ack them from file 4
        qi.publish(seq, mid(seq), msg(seq))
    qi.ack([12, 13, 14])
    # Files 1 and 2 are all acked and gone. File 3 is all acked too, but its ack of seqs 1..3 points into
    # file 0, which still exists: deleting file 3 would bring 1..3 back at the next recovery.
    assert files(tmp_path) == ["0.qi", "3.qi", "4.qi"]
    qi.close()
    assert [e.seq for e in recover(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES)] == [0]
    again = QueueIndex(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES)
    again.recover()
    again.ack([0])                               # written to file 5: files 0, 3 and 4 go, in that order
    assert files(tmp_path) == ["5.qi"]
    again.close()


def test_sequence_ids_only_increase_and_continue_after_a_restart(tmp_path, index):
    index.publish(5, mid(5), b"a")
    with pytest.raises(SequenceNotIncreasing, match="publish of seq 5 after seq 5"):
        index.publish(5, mid(5), b"a")
    with pytest.raises(SequenceNotIncreasing, match="publish of seq 3 after seq 5"):
        index.publish(3, mid(3), b"a")
    index.publish(9, mid(9), b"b")
    index.ack([9])
    index.close()
    assert QueueIndex(str(tmp_path)).next_seq == 10


def test_acking_or_delivering_what_is_not_live_raises_and_writes_nothing(tmp_path, index):
    index.publish(0, mid(0), b"a")
    index.sync()
    size = os.path.getsize(tmp_path / "0.qi")
    with pytest.raises(UnknownSequence, match=r"ack of sequence ids with no live publish: \[7\]"):
        index.ack([0, 7])
    with pytest.raises(UnknownSequence, match=r"deliver of .*\[3\]"):
        index.deliver([3])
    with pytest.raises(UnknownSequence, match="acked twice"):
        index.ack([0, 0])
    index.sync()
    assert os.path.getsize(tmp_path / "0.qi") == size and index.statistics().live_messages == 1


def test_sync_names_the_publishes_it_made_durable_roll_overs_included(tmp_path):
    with QueueIndex(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES) as qi:
        for seq in range(8):
            qi.publish(seq, mid(seq), msg(seq))
        assert qi.statistics().syncs == 1, "the roll-over fsynced file 0"
        result = qi.sync()
        assert result.seqs_covered == tuple(range(8)) and result.duration_ns > 0
        assert qi.sync().seqs_covered == ()


@pytest.mark.parametrize("seed", range(8))
def test_a_torn_tail_loses_only_the_entries_after_the_cut(tmp_path, seed):
    with QueueIndex(str(tmp_path)) as qi:
        for seq in range(6):
            qi.publish(seq, mid(seq), msg(seq, 100))
        qi.ack([1])
    path = tmp_path / "0.qi"
    data = path.read_bytes()
    records = scan(data).records
    rng = random.Random(seed)
    cut = rng.randrange(len(data))
    path.write_bytes(data[:cut] + bytes(rng.randrange(0, 300)))
    entries = recover(str(tmp_path))
    whole = [i for i, r in enumerate(records) if r.offset + r.size <= cut]     # 0..5 publishes, 6 the ack
    assert [e.seq for e in entries] == [i for i in whole if i < 6 and not (i == 1 and 6 in whole)]
    assert [e.body for e in entries] == [msg(e.seq, 100) for e in entries]
    if entries:
        assert os.path.getsize(path) == max(records[i].offset + records[i].size for i in whole)
    else:
        assert not path.exists(), "a file with nothing live left is deleted when the index opens"


def test_everything_synced_before_an_abrupt_stop_is_recovered(tmp_path):
    pid = os.fork()
    if pid == 0:                                # pragma: no cover - the child never returns
        try:
            qi = QueueIndex(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES)
            for seq in range(20):
                qi.publish(seq, mid(seq), msg(seq))
            qi.ack([3, 4])
            qi.sync()
            qi.publish(20, mid(20), msg(20))
            qi.ack([5])
        finally:
            os._exit(0)                         # buffered entries die with the process
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    seqs = [e.seq for e in recover(str(tmp_path), file_size_limit_bytes=SMALL_LIMIT_BYTES)]
    assert [s for s in seqs if s < 20] in ([s for s in range(20) if s not in (3, 4)],
                                           [s for s in range(20) if s not in (3, 4, 5)])


def test_a_closed_index_refuses_work(index):
    index.close()
    with pytest.raises(StoreClosed, match="was closed"):
        index.publish(0, mid(0), b"x")


def test_recover_hands_the_entries_over_once(tmp_path):
    with QueueIndex(str(tmp_path)) as qi:
        qi.publish(0, mid(0), b"x")
    qi = QueueIndex(str(tmp_path))
    assert [e.seq for e in qi.recover()] == [0]
    assert qi.recover() == [] and qi.statistics().recovered_messages == 1
    qi.ack([0])
    qi.close()


# A model check: any run of publishes, delivers, acks and restarts recovers exactly the model's live messages.
OPS = st.lists(st.one_of(st.tuples(st.just("publish"), st.integers(0, 120)),
                         st.tuples(st.just("deliver"), st.integers(0, 10 ** 6)),
                         st.tuples(st.just("ack"), st.integers(0, 10 ** 6)),
                         st.tuples(st.just("restart"), st.just(0))), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_any_history_recovers_exactly_the_unacked_messages(ops):
    with tempfile.TemporaryDirectory(prefix="creditflow-qi-") as directory:
        qi = QueueIndex(directory, file_size_limit_bytes=SMALL_LIMIT_BYTES)
        model: dict[int, tuple[bytes, bool]] = {}          # seq -> (body, delivered)
        try:
            for op, arg in ops:
                if op == "publish":
                    seq = qi.next_seq
                    qi.publish(seq, mid(seq), bytes([seq % 256]) * arg)
                    model[seq] = (bytes([seq % 256]) * arg, False)
                elif op in ("deliver", "ack") and model:
                    seq = sorted(model)[arg % len(model)]
                    if op == "ack":
                        qi.ack([seq])
                        del model[seq]
                    else:
                        qi.deliver([seq])
                        model[seq] = (model[seq][0], True)
                elif op == "restart":
                    qi.close()
                    qi = QueueIndex(directory, file_size_limit_bytes=SMALL_LIMIT_BYTES)
                    assert [(e.seq, e.body, e.delivered) for e in qi.recover()] == \
                        [(s, b, d) for s, (b, d) in sorted(model.items())]
        finally:
            qi.close()
        entries = recover(directory, file_size_limit_bytes=SMALL_LIMIT_BYTES)
        assert [(e.seq, e.body, e.delivered) for e in entries] == [(s, b, d) for s, (b, d) in sorted(model.items())]


def test_entry_layout_is_documented_bytes(tmp_path, index):
    index.publish(7, mid(7), b"hi", persistent=True)
    index.deliver([7])
    index.ack([7])
    index.sync()
    data = (tmp_path / "0.qi").read_bytes()
    publish, deliver, ack = scan(data).records
    assert publish.msg_id == mid(7)
    assert data[publish.body_start:publish.body_start + publish.body_len] == b"P" + struct.pack("<QB", 7, 3) + b"hi"
    assert data[deliver.body_start:deliver.body_start + deliver.body_len] == b"D" + struct.pack("<Q", 7)
    assert deliver.msg_id == bytes(16)
    assert data[ack.body_start:ack.body_start + ack.body_len] == b"A" + struct.pack("<Q", 7)
