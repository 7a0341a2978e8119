"""Shared-memory ownership: one owner creates and unlinks, others attach, dead runs are cleaned.

Every segment a test makes belongs to a ``SegmentOwner`` whose finalizer
unlinks it, so nothing is left in /dev/shm even when a test fails.
"""

from __future__ import annotations

import os
import re
import subprocess

import posix_ipc
import pytest

from ipc import shm
from ipc.errors import IpcError
from ipc.ring import HEADER_BYTES


@pytest.fixture
def owners():
    """Make owners for any run id; all their segments are unlinked at teardown."""
    made: list[shm.SegmentOwner] = []

    def make(run_id: str | None = None) -> shm.SegmentOwner:
        owner = shm.SegmentOwner(run_id or shm.new_run_id())
        made.append(owner)
        return owner

    yield make
    for owner in made:
        owner.unlink_all()
        assert not shm.leftover_names(run_id=owner.run_id)


@pytest.fixture
def semaphores():
    """POSIX semaphore names to unlink at teardown."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            posix_ipc.unlink_semaphore(name)
        except posix_ipc.ExistentialError:
            pass


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_run_id_is_our_pid_and_four_random_hex_digits():
    run_id = shm.new_run_id()
    assert re.fullmatch(rf"{os.getpid()}x[0-9a-f]{{4}}", run_id)
    assert len({shm.new_run_id() for _ in range(50)}) > 1


def test_the_owner_creates_a_named_segment_that_another_mapping_sees(owners):
    owner = owners()
    seg = owner.create("q1", 4096)
    assert seg.name == f"/creditflow-{owner.run_id}-q1" and seg.size_bytes == 4096
    assert owner.names == [seg.name]
    seg.buf[:5] = b"hello"
    other = shm.attach(seg.name)
    assert bytes(other.buf[:5]) == b"hello"
    other.buf[5:11] = b" world"
    assert bytes(seg.buf[:11]) == b"hello world"
    other.close()
    seg.close()
    assert shm.leftover_names(run_id=owner.run_id) == [f"creditflow-{owner.run_id}-q1"]


def test_unlink_all_removes_every_name_and_is_idempotent(owners):
    owner = owners()
    first, second = owner.create("a", 4096), owner.create("b", 8192)
    owner.unlink(first.name)
    assert owner.names == [second.name]
    assert shm.leftover_names(run_id=owner.run_id) == [f"creditflow-{owner.run_id}-b"]
    assert owner.unlink_all() == [second.name]
    assert owner.unlink_all() == []
    assert shm.leftover_names(run_id=owner.run_id) == []
    second.buf[:3] = b"still mapped"[:3]              # unlinking leaves mappings valid
    assert bytes(second.buf[:3]) == b"sti"
    first.close()
    second.close()
    with pytest.raises(shm.SegmentNotFound, match="does not exist"):
        shm.attach(second.name)


def test_names_are_checked_and_never_taken_twice(owners):
    owner = owners()
    owner.create("link-1", 4096).close()
    with pytest.raises(shm.SegmentExists, match="already exists"):
        owner.create("link-1", 4096)
    for bad in ("", "a/b", "x" * 65, "sp ace"):
        with pytest.raises(ValueError, match="suffix"):
            owner.create(bad, 4096)
    with pytest.raises(ValueError, match="positive"):
        owner.create("empty", 0)
    assert owner.names == [f"/creditflow-{owner.run_id}-link-1"]
    assert isinstance(shm.SegmentExists("x"), (IpcError, FileExistsError))
    with pytest.raises(FileNotFoundError):
        shm.attach(f"/creditflow-{owner.run_id}-never")


def test_a_ring_made_by_the_owner_is_shared_with_an_attached_end(owners):
    owner = owners()
    seg, producer = shm.create_ring(owner, "l7", 1 << 16)
    assert producer.capacity_bytes == 1 << 16 and seg.size_bytes == HEADER_BYTES + (1 << 16)
    peer, consumer = shm.attach_ring(seg.name)
    producer.write_batch([b"publish", b"ack"])
    assert consumer.read_batch() == [b"publish", b"ack"]
    assert producer.statistics().records_read == 2
    peer.close()
    with pytest.raises(ValueError, match="released"):
        consumer.read_batch()
    peer.close()                                        # closing twice is harmless
    assert peer.closed and not seg.closed
    seg.close()


def test_attaching_a_ring_to_a_segment_without_one_is_refused(owners):
    owner = owners()
    seg = owner.create("plain", 4096)
    with pytest.raises(IpcError, match="no ring"):
        shm.attach_ring(seg.name)
    seg.close()


def test_leftover_names_match_the_prefix_only(tmp_path):
    for name in ("creditflow-1x00aa-l1", "sem.creditflow-1x00aa-s", "creditflow-2xbbbb-l1",
                 "other-creditflow-1x00aa-l1", "pulse-shm-1"):
        (tmp_path / name).write_bytes(b"")
    assert shm.leftover_names(str(tmp_path)) == ["creditflow-1x00aa-l1", "creditflow-2xbbbb-l1",
                                                 "sem.creditflow-1x00aa-s"]
    assert shm.leftover_names(str(tmp_path), run_id="1x00aa") == ["creditflow-1x00aa-l1",
                                                                  "sem.creditflow-1x00aa-s"]
    assert shm.leftover_names(str(tmp_path / "missing")) == []


@pytest.mark.alone       # a broker started beside it would clean up the dead run first
def test_cleanup_removes_a_dead_runs_segments_and_semaphores_but_not_a_live_runs(owners, semaphores):
    pid = dead_pid()
    stale, live = owners(f"{pid}xdead"), owners()
    stale.create("old", 4096).close()
    live.create("new", 4096).close()
    sem_name = f"/creditflow-{pid}xdead-lock"
    semaphores.append(sem_name)
    posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX).close()

    removed = shm.cleanup_stale()

    assert f"creditflow-{pid}xdead-old" in removed
    assert f"sem.creditflow-{pid}xdead-lock" in removed
    assert shm.leftover_names(run_id=stale.run_id) == []
    assert shm.leftover_names(run_id=live.run_id) == [f"creditflow-{live.run_id}-new"]
    assert not any(live.run_id in name for name in removed)


def test_cleanup_treats_unparsable_names_and_zombie_owners_as_dead(tmp_path):
    zombie = os.fork()
    if zombie == 0:
        os._exit(0)
    try:
        while open(f"/proc/{zombie}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            os.sched_yield()
        names = {"creditflow-garbage": True, f"creditflow-{zombie}x0001-l1": True,
                 f"creditflow-{os.getpid()}x0002-l1": False, f"sem.creditflow-{os.getppid()}x0003-s": False,
                 "creditflow-0x0004-l1": True, f"creditflow-{dead_pid()}x0005-l1": True,
                 "unrelated-1x0006-l1": False}
        for name in names:
            (tmp_path / name).write_bytes(b"")
        removed = shm.cleanup_stale(str(tmp_path))
        assert sorted(removed) == sorted(n for n, stale in names.items() if stale)
        assert sorted(os.listdir(tmp_path)) == sorted(n for n, stale in names.items() if not stale)
        assert shm.cleanup_stale(str(tmp_path)) == []
    finally:
        os.waitpid(zombie, 0)
