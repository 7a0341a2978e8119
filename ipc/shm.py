"""POSIX shared memory with one owner.

The supervisor is the only process that creates or unlinks segments; stages
attach by name and close their mapping. Every name is
``/creditflow-<run id>-<suffix>``, where the run id starts with the owner's
pid, so a later start can find what a killed run left (its pid is dead) and
remove it without touching a live run's segments.
"""

from __future__ import annotations

import mmap
import os
import re

import posix_ipc

from ipc.ring import Ring

SHM_PREFIX = "creditflow-"
_NAME = re.compile(r"^(?:sem\.)?creditflow-(\d+)x[0-9a-f]+-")


def new_run_id() -> str:
    return f"{os.getpid()}x{os.urandom(2).hex()}"


class Segment:
    """A mapped segment; ``buf`` is the mmap."""

    def __init__(self, name: str, buf: mmap.mmap):
        self.name = name
        self.buf = buf

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:
            pass  # a ring still holds a view; the mapping goes with the process


class SegmentOwner:
    def __init__(self, run_id: str):
        self.run_id = run_id
        self.names: list[str] = []

    def create(self, suffix: str, size_bytes: int) -> Segment:
        name = f"/{SHM_PREFIX}{self.run_id}-{suffix}"
        mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size_bytes)
        try:
            buf = mmap.mmap(mem.fd, size_bytes)
        finally:
            mem.close_fd()
        self.names.append(name)
        return Segment(name, buf)

    def unlink(self, name: str) -> None:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        if name in self.names:
            self.names.remove(name)

    def unlink_all(self) -> list[str]:
        gone = list(self.names)
        for name in gone:
            self.unlink(name)
        return gone


def attach(name: str) -> Segment:
    mem = posix_ipc.SharedMemory(name)
    try:
        buf = mmap.mmap(mem.fd, mem.size)
    finally:
        mem.close_fd()
    return Segment(name, buf)


def create_ring(owner: SegmentOwner, suffix: str, capacity_bytes: int) -> tuple[Segment, Ring]:
    seg = owner.create(suffix, capacity_bytes)
    return seg, Ring(seg.buf, create=True)


def attach_ring(name: str) -> tuple[Segment, Ring]:
    seg = attach(name)
    return seg, Ring(seg.buf, create=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_names(shm_dir: str = "/dev/shm", run_id: str | None = None) -> list[str]:
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    marker = f"{SHM_PREFIX}{run_id}-" if run_id else SHM_PREFIX
    return sorted(n for n in names if marker in n)


def cleanup_stale(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink creditflow segments and semaphores whose owning run is dead."""
    removed = []
    for name in leftover_names(shm_dir):
        m = _NAME.match(name)
        if m and _pid_alive(int(m.group(1))):
            continue
        try:
            if name.startswith("sem."):
                posix_ipc.unlink_semaphore("/" + name[4:])
            else:
                posix_ipc.unlink_shared_memory("/" + name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            pass
    return removed
