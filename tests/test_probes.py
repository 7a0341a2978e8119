"""Readings from the OS: memory as a user sees it (shared pages once, freed memory gone), disk, processes."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from alarms import probes
from alarms.errors import ProbeError, UnknownStrategy

pytestmark = pytest.mark.processes

MIB = 1024 * 1024
PAGE = mmap.PAGESIZE
ALLOC_BYTES = 200_000_000
SHARED_BYTES = 64 * MIB


def _run_child(cmd_r: int, ack_w: int, shared: mmap.mmap | None) -> None:
    """The forked child's loop: one command byte in, one ack byte out."""
    held: list[bytes] = []
    while True:
        cmd = os.read(cmd_r, 1)
        if cmd in (b"", b"Q"):
            return
        if cmd == b"A":           # ~200 MB in 1000-byte bytes objects, as a queue's backlog of message bodies
            held = [i.to_bytes(8, "little") * 125 for i in range(ALLOC_BYTES // 1000)]
        elif cmd == b"F":         # free all but one in a thousand, spread over the heap (a few stay queued)
            held = held[::1000]
            gc.collect()
        elif cmd == b"T":
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        elif cmd == b"S":
            for off in range(0, len(shared), PAGE):
                shared[off] = 2
        os.write(ack_w, b"k")


class Child:
    """A process driven over pipes, so the test decides when it allocates, frees and touches.

    Without a shared region it is a fresh interpreter: a child forked from a
    long test run would reuse the parent's inherited, copy-on-write heap and
    skew the very readings under test. With one it is forked, to share it.
    """

    def __init__(self, shared: mmap.mmap | None = None):
        cmd_r, self.cmd_w = os.pipe()
        self.ack_r, ack_w = os.pipe()
        if shared is None:
            code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                    f"import test_probes as t; t._run_child({cmd_r}, {ack_w}, None)")
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(cmd_r, ack_w))
            self.pid = self.proc.pid
            os.close(cmd_r)
            os.close(ack_w)
            self.do(b"N")            # its loop is running: the baseline includes the interpreter
            return
        self.proc = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(self.cmd_w)
                os.close(self.ack_r)
                _run_child(cmd_r, ack_w, shared)
                code = 0
            finally:
                os._exit(code)
        os.close(cmd_r)
        os.close(ack_w)

    def do(self, cmd: bytes, timeout_s: float = 30.0) -> None:
        os.write(self.cmd_w, cmd)
        import select
        ready, _, _ = select.select([self.ack_r], [], [], timeout_s)
        assert ready and os.read(self.ack_r, 1) == b"k", f"child did not finish {cmd!r}"

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc is not None:
            self.proc.wait(10)
        else:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        os.close(self.cmd_w)
        os.close(self.ack_r)


@pytest.fixture
def child(request):
    children = []

    def make(shared=None) -> Child:
        c = Child(shared)
        children.append(c)
        return c

    yield make
    for c in children:
        c.close()


@pytest.fixture
def shared_region():
    region = mmap.mmap(-1, SHARED_BYTES)          # anonymous MAP_SHARED: the same pages in parent and child
    yield region
    region.close()


def rss_sum(pids) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids)


def test_total_memory_is_the_hosts_ram():
    with open("/proc/meminfo") as f:
        mem_total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert probes.total_memory_bytes() == mem_total_kib * 1024


def test_system_strategy_is_host_memory_in_use():
    vm = psutil.virtual_memory()
    used = probes.broker_memory_bytes([], "system")
    assert abs(used - (vm.total - vm.available)) < 64 * MIB
    assert 0 < used < probes.total_memory_bytes()


def test_an_unknown_strategy_is_refused():
    with pytest.raises(UnknownStrategy, match="unknown memory strategy 'vsz'"):
        probes.broker_memory_bytes([os.getpid()], "vsz")
    with pytest.raises(UnknownStrategy, match="use one of rss, system"):
        probes.BrokerMemory("allocated")


def test_free_disk_space_is_what_statvfs_gives_unprivileged_users(tmp_path):
    st = os.statvfs(tmp_path)
    assert abs(probes.disk_free_bytes(str(tmp_path)) - st.f_bavail * st.f_frsize) < 16 * MIB
    with pytest.raises(ProbeError, match="cannot read free disk space of /nonexistent/creditflow"):
        probes.disk_free_bytes("/nonexistent/creditflow")


@pytest.fixture
def process_tree():
    code = ("import subprocess, sys, time\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(g.pid, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        grandchild = int(proc.stdout.readline())
        yield proc.pid, grandchild
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize("via_proc_children", [True, False])
def test_broker_pids_are_the_supervisor_and_all_its_descendants(process_tree, monkeypatch, via_proc_children):
    if not via_proc_children:
        monkeypatch.setattr(probes, "_HAS_PROC_CHILDREN", False)
    child_pid, grandchild_pid = process_tree
    pids = probes.broker_pids(os.getpid())
    assert pids[0] == os.getpid()
    assert child_pid in pids and grandchild_pid in pids
    assert pids.index(child_pid) < pids.index(grandchild_pid)
    assert probes.broker_pids(child_pid) == [child_pid, grandchild_pid]


def test_listing_a_supervisor_that_is_gone_fails_with_a_reason():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(ProbeError, match=f"cannot list the broker's processes.*{dead.pid}"):
        probes.broker_pids(dead.pid)


def test_missing_pids_are_skipped_and_none_at_all_is_an_error():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alone = probes.broker_memory_bytes([os.getpid()], "rss")
    with_dead = probes.broker_memory_bytes([os.getpid(), dead.pid], "rss")
    assert abs(with_dead - alone) < 4 * MIB
    with pytest.raises(ProbeError, match="none of the broker's processes could be measured"):
        probes.broker_memory_bytes([dead.pid], "rss")
    with pytest.raises(ProbeError, match="none of the broker's processes"):
        probes.BrokerMemory("rss").read([dead.pid], 0)


def test_memory_a_child_allocates_is_seen_and_memory_it_frees_is_seen_to_go(child):
    c = child()
    pids = [c.pid]
    before = probes.broker_memory_bytes(pids, "rss")
    c.do(b"A")
    allocated = probes.broker_memory_bytes(pids, "rss")
    assert 0.9 * ALLOC_BYTES < allocated - before < 1.2 * ALLOC_BYTES
    c.do(b"F")
    c.do(b"T")      # glibc keeps the freed pages between the survivors (measured: +220 MB still after the
    trimmed = probes.broker_memory_bytes(pids, "rss")          # free, +10 MB after malloc_trim(0))
    assert trimmed - before < 0.1 * ALLOC_BYTES


def test_a_region_mapped_by_two_processes_counts_once(child, shared_region):
    c = child(shared_region)
    pids = [os.getpid(), c.pid]
    pss_before, rss_before = probes.broker_memory_bytes(pids, "rss"), rss_sum(pids)
    for off in range(0, SHARED_BYTES, PAGE):
        shared_region[off] = 1
    c.do(b"S")
    pss_grew = probes.broker_memory_bytes(pids, "rss") - pss_before
    rss_grew = rss_sum(pids) - rss_before
    assert abs(rss_grew - 2 * SHARED_BYTES) < 8 * MIB          # plain RSS would count it twice
    assert abs(pss_grew - SHARED_BYTES) < 8 * MIB              # the probe counts it once


def test_the_watchdogs_reading_follows_rss_between_pss_refreshes(child):
    c = child()
    pids = [os.getpid(), c.pid]
    reader = probes.BrokerMemory("rss", pss_refresh_ms=3_600_000)
    before = reader.read(pids, 0)
    assert reader.statistics().pss_reads == 2
    c.do(b"A")
    grown = reader.read(pids, 1)
    assert 0.9 * ALLOC_BYTES < grown - before < 1.2 * ALLOC_BYTES
    c.do(b"F")
    c.do(b"T")
    assert reader.read(pids, 2) - before < 0.1 * ALLOC_BYTES
    stats = reader.statistics()
    assert (stats.pss_reads, stats.rss_reads, stats.measured_processes) == (2, 4, 2)


def test_shared_memory_touched_after_a_refresh_is_counted_once_from_the_next_refresh(child, shared_region):
    c = child(shared_region)
    pids = [os.getpid(), c.pid]
    reader = probes.BrokerMemory("rss", pss_refresh_ms=1000)
    before = reader.read(pids, 0)
    for off in range(0, SHARED_BYTES, PAGE):
        shared_region[off] = 1
    c.do(b"S")
    carried = reader.read(pids, 500_000_000) - before
    refreshed = reader.read(pids, 1_000_000_000) - before
    assert abs(carried) < 8 * MIB                   # the documented blind spot, for < 1 s: not yet seen
    assert abs(refreshed - SHARED_BYTES) < 8 * MIB
    assert abs(reader.read(pids, 2_000_000_000) - probes.broker_memory_bytes(pids, "rss")) < 8 * MIB


def test_the_reading_forgets_processes_that_ended(child):
    c = child()
    reader = probes.BrokerMemory("rss")
    reader.read([os.getpid(), c.pid], 0)
    assert reader.statistics().measured_processes == 2
    reader.read([os.getpid()], 1)
    assert reader.statistics().measured_processes == 1


def test_reading_ten_processes_is_cheap_between_refreshes(child):
    kids = [child() for _ in range(9)]
    pids = [os.getpid()] + [k.pid for k in kids]
    reader = probes.BrokerMemory("rss", pss_refresh_ms=3_600_000)
    reader.read(pids, 0)
    rounds = 50
    t0 = time.process_time()
    for i in range(rounds):
        reader.read(pids, i + 1)
    carried_s = (time.process_time() - t0) / rounds
    t0 = time.process_time()
    for _ in range(rounds):
        probes.broker_memory_bytes(pids, "rss")
    exact_s = (time.process_time() - t0) / rounds
    assert carried_s < exact_s
    assert carried_s < 0.005        # 10 polls a second stay well under 5% of a core
