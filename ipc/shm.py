"""POSIX shared memory with one owner, and the names that let a later run clean up.

Theory of operation
-------------------
The supervisor is the only process that creates or unlinks segments
(:class:`SegmentOwner`). A link's two stages are handed a descriptor of its
ring (:func:`descriptor`, passed over their control sockets), not its name alone:
they map it and close the descriptor at once, so a mapping is all they hold.
Unlinking only removes the name: mappings and descriptors stay valid until
their holders close them or exit, so the supervisor may unlink a link's ring
while its two stages still drain, and even before one of them has mapped it
(a channel that published and ended before its queue attached the ring).

Every name is ``/creditflow-<run id>-<suffix>`` and the run id is
``<supervisor pid>x<4 hex digits>``. On Linux the segment appears as
``/dev/shm/creditflow-<run id>-<suffix>`` (a POSIX semaphore as
``/dev/shm/sem.creditflow-...``), so a leak can be listed with
:func:`leftover_names`, and :func:`cleanup_stale` can tell a killed run's
leftovers (its pid is gone, or a zombie) from a live run's (left alone).
A pid reused by an unrelated process keeps a dead run's segments until that
process exits: the cleanup errs on the side of never touching a live run.
"""

from __future__ import annotations

import mmap
import os
import re

import posix_ipc

from ipc.errors import IpcError
from ipc.ring import HEADER_BYTES, Ring

SHM_PREFIX = "creditflow-"
SEM_PREFIX = "sem." + SHM_PREFIX           # how a POSIX semaphore's name shows in /dev/shm
SHM_DIR = "/dev/shm"
_SUFFIX = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_RUN_PID = re.compile(r"^(?:sem\.)?creditflow-([1-9]\d{0,9})x[0-9a-f]+-")


class SegmentExists(IpcError, FileExistsError):
    """Raised when the owner creates a segment whose name is already taken."""


class SegmentNotFound(IpcError, FileNotFoundError):
    """Raised when attaching to a segment that does not exist (never created, or unlinked)."""


def new_run_id() -> str:
    """``<this pid>x<4 random hex digits>``: the pid tells a later start whether the run lives."""
    return f"{os.getpid()}x{os.urandom(2).hex()}"


class Segment:
    """A mapped segment, the owner's or an attached one. ``buf`` is the mmap.

    ``close`` releases the rings built on it by :func:`create_ring` or
    :func:`attach_ring`, then unmaps; it does not unlink the name.
    """

    def __init__(self, name: str, buf: mmap.mmap):
        self.name = name
        self.buf = buf
        self.size_bytes = len(buf)
        self._rings: list[Ring] = []

    def ring(self, *, create: bool) -> Ring:
        """A :class:`Ring` over this segment, released when the segment closes."""
        ring = Ring(self.buf, create=create)
        self._rings.append(ring)
        return ring

    def close(self) -> None:
        """Unmap (idempotent). Using a ring of this segment afterwards raises ``ValueError``."""
        for ring in self._rings:
            ring.release()
        self._rings.clear()
        try:
            self.buf.close()
        except BufferError:
            pass  # a view made outside this module still points in; the mapping goes with the process

    @property
    def closed(self) -> bool:
        return self.buf.closed

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size_bytes} bytes{', closed' if self.closed else ''})"


def _map(mem: posix_ipc.SharedMemory, name: str) -> Segment:
    try:
        return Segment(name, mmap.mmap(mem.fd, mem.size))
    finally:
        mem.close_fd()


class SegmentOwner:
    """The supervisor's side: creates every segment of one run, unlinks them all at the end."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.names: list[str] = []

    def name_for(self, suffix: str) -> str:
        if not _SUFFIX.match(suffix):
            raise ValueError(f"segment suffix {suffix!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        return f"/{SHM_PREFIX}{self.run_id}-{suffix}"

    def create(self, suffix: str, size_bytes: int) -> Segment:
        """Create, size and map ``/creditflow-<run id>-<suffix>`` (fails if it exists)."""
        name = self.name_for(suffix)
        if size_bytes <= 0:
            raise ValueError(f"segment size must be positive, got {size_bytes}")
        try:
            mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size_bytes)
        except posix_ipc.ExistentialError:
            raise SegmentExists(f"shared memory {name} already exists") from None
        self.names.append(name)           # recorded before mapping, so a failure still unlinks it
        return _map(mem, name)

    def unlink(self, name: str) -> None:
        """Remove one name (already gone is fine); mappings of it stay valid until closed."""
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        if name in self.names:
            self.names.remove(name)

    def unlink_all(self) -> list[str]:
        """Unlink every segment this owner created and still holds; idempotent."""
        gone = list(self.names)
        for name in gone:
            self.unlink(name)
        return gone


def attach(name: str) -> Segment:
    """Open an existing segment, map it whole and close the descriptor at once."""
    try:
        mem = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise SegmentNotFound(f"shared memory {name} does not exist") from None
    return _map(mem, name)


def descriptor(name: str) -> int:
    """A new descriptor of the segment ``name``: what a process is given to map it, whatever then
    becomes of the name. The caller closes it."""
    try:
        mem = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise SegmentNotFound(f"shared memory {name} does not exist") from None
    return mem.fd


def create_ring(owner: SegmentOwner, suffix: str, capacity_bytes: int) -> tuple[Segment, Ring]:
    """A new segment holding an initialised ring with ``capacity_bytes`` of data area."""
    capacity_bytes = (capacity_bytes + 7) & -8
    seg = owner.create(suffix, HEADER_BYTES + capacity_bytes)
    return seg, seg.ring(create=True)


def attach_ring(name: str, fd: int | None = None) -> tuple[Segment, Ring]:
    """Attach to a segment made by :func:`create_ring` (checks the ring's header): by its name, or
    by ``fd``, a :func:`descriptor` of it (closed here), which maps it even once the name is gone."""
    if fd is None:
        seg = attach(name)
    else:
        try:
            seg = Segment(name, mmap.mmap(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    try:
        return seg, seg.ring(create=False)
    except BaseException:
        seg.close()
        raise


def leftover_names(shm_dir: str = SHM_DIR, run_id: str | None = None) -> list[str]:
    """creditflow segments and semaphores present in ``shm_dir`` (of one run if given), sorted."""
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    rest = f"{run_id}-" if run_id else ""
    prefixes = (SHM_PREFIX + rest, SEM_PREFIX + rest)
    return sorted(n for n in names if n.startswith(prefixes))


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True              # another user's live process
    except OverflowError:
        return False             # no such pid can exist
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True              # no /proc: trust kill()
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")   # a zombie owns nothing any more


def cleanup_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink creditflow segments and semaphores whose run's pid is dead (or unparsable).

    Returns the entry names removed. Entries of live runs are never touched.
    On Linux ``shm_unlink``/``sem_unlink`` are the unlinking of these files,
    which is how this works on any ``shm_dir``.
    """
    removed = []
    for name in leftover_names(shm_dir):
        m = _RUN_PID.match(name)
        if m and _owner_alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue             # another cleaner got there first
        removed.append(name)
    return removed
