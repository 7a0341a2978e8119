"""Message bodies by reference inside the broker: the arenas every process maps, and the refs records carry.

The supervisor makes one arena per reader host it may run (``ipc.bodies``)
and the liveness table, before it forks anything, and installs them here; every
stage process inherits the mappings. A reader host claims one arena and is the
only allocator in it. A publish whose body is at least ``REF_MIN_BODY_BYTES``
(and that finds room) travels as a PUBLISH record with ``wire.PUB_BODY_REF``
set and a ``REF_BYTES`` reference where its body would be; a delivery from it
carries ``wire.DLV_BODY_REF`` and the queue's entry in the slot. Everywhere else
(returns, dead letters, the journal, the store, pages, basic.get) the body is
copied out first with ``inline``: by reference is the hot path, never a second
format to get right everywhere.

Holder ids are the supervisor's: one per stage, never reused in a run, marked
in the liveness table when the stage ends. Id 0 means none: bodies go by copy.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from ipc.bodies import LIVENESS_IDS, REF, REF_BYTES, Arena, ArenaStatistics, Liveness, arena_bytes, liveness_bytes
from ipc.shm import SHM_DIR
from pipeline.broker import wire

__all__ = ["LIVENESS_IDS", "REF_BYTES", "Bodies", "NotHolder", "install", "installed", "claim", "encode_ref",
           "decode_ref", "copy_out", "arena_of", "let_go_unsent", "fit_arenas"]

REF_MIN_BODY_BYTES = 8192          # below this the copies cost less than the slot's bookkeeping (measured: 4 KiB
                                   # 10% slower by reference, 8 KiB even, 16 KiB 24-33% faster)
MIB = 1024 * 1024
MIN_ARENA_BYTES = 4 * MIB
MAX_ARENA_MB = 2048                 # slot offsets in a reference are u32
ARENA_MB = 256                     # per reader host: a steady flow keeps to the first 64 (ipc.bodies'
                                   # working span), a backlog of big bodies has the rest


class NotHolder(RuntimeError):
    """Raised when a stage gets a body by reference in a slot that lists no word of its own (a bug)."""


@dataclass
class Bodies:
    arenas: list[Arena]
    liveness: Liveness
    own: int | None = None        # the arena this process allocates in (a reader host's), None: none
    segments: tuple = ()

    @classmethod
    def create(cls, owner, count: int, capacity_bytes: int) -> Bodies:
        """The supervisor's: the liveness table and ``count`` arenas, each a segment of its own."""
        segments = [owner.create("live", liveness_bytes())]
        liveness = Liveness(segments[0].buf)
        made = []
        for i in range(count):
            seg = owner.create(f"b{i}", arena_bytes(capacity_bytes))
            segments.append(seg)
            made.append(Arena(seg.buf, liveness, create=True, punch=_puncher(seg.buf)))
        return cls(made, liveness, None, tuple(segments))

    def allocator(self) -> Arena | None:
        return self.arenas[self.own] if self.own is not None else None

    def statistics(self) -> list[ArenaStatistics]:
        return [a.statistics() for a in self.arenas]


def fit_arenas(wanted_bytes: int, count: int, shm_dir: str = SHM_DIR) -> tuple[int, str | None]:
    """Each arena's size: ``wanted_bytes``, or less when ``count`` of them would take over half of what is
    free in ``shm_dir`` (a container's small /dev/shm: a write into a full tmpfs is a SIGBUS, not an
    error); 0 (bodies by copy) below MIN_ARENA_BYTES. And a line to log when it is not what was asked."""
    if not wanted_bytes:
        return 0, None
    try:
        st = os.statvfs(shm_dir)
        budget = st.f_bavail * st.f_frsize // 2 // count
    except OSError:
        budget = wanted_bytes
    size = min(wanted_bytes, budget) & -MIB
    if size >= wanted_bytes:
        return wanted_bytes, None
    if size < MIN_ARENA_BYTES:
        return 0, (f"{shm_dir} has {budget * 2 * count // MIB} MiB free: message bodies go by copy "
                   f"(no arenas)")
    return size, (f"{shm_dir} has {budget * 2 * count // MIB} MiB free: body arenas of {size // MIB} MiB "
                  f"instead of {wanted_bytes // MIB}")


def _puncher(buf: mmap.mmap):
    """Free a byte range's pages of a shared-memory mapping (the file's too, not just this mapping's)."""
    def punch(start: int, length: int) -> None:
        buf.madvise(mmap.MADV_REMOVE, start, length)
    return punch


_installed: Bodies | None = None


def install(bodies: Bodies | None) -> None:
    """Set in the supervisor before any fork (and in tests); a forked stage finds it with ``installed``."""
    global _installed
    _installed = bodies


def installed() -> Bodies | None:
    return _installed


def claim(index: int | None) -> None:
    """In a freshly forked reader host: allocate in arena ``index`` from now on."""
    if _installed is not None:
        _installed.own = index


def encode_ref(arena: int, off: int, size: int, entry: int = 0) -> bytes:
    return REF.pack(arena, off, size, entry)


def decode_ref(view) -> tuple[int, int, int, int]:
    """(arena, offset, body bytes, entry) of a reference (the last REF_BYTES of a record)."""
    return REF.unpack_from(view, len(view) - REF_BYTES)


def copy_out(record, flag: int) -> tuple[bytes, Arena, int, int]:
    """A record (PUBLISH, or DELIVER: flags in its second byte) whose content ends in a reference, as the
    same record carrying its body instead, ``flag`` cleared; and where the body was: (record, arena, slot
    offset, entry). The caller lets go of its own word in the slot afterwards."""
    a, at, size, entry = decode_ref(record)
    arena = _installed.arenas[a]
    view = memoryview(record)
    return b"".join((view[:1], bytes((record[1] & ~flag,)), view[2:len(record) - REF_BYTES],
                     arena.body(at, size))), arena, at, entry


def arena_of(record) -> tuple[Arena, int]:
    """(arena, slot offset) of the body a record refers to."""
    a, at, _, _ = decode_ref(record)
    return _installed.arenas[a], at


def let_go_unsent(record, receiver: int) -> None:
    """A record that never reached ``receiver`` (dropped from a dead or departing stage's overflow): clear
    the word the receiver would have cleared, as the VM frees what a dead process's mailbox held. Only
    its receiver writes that word, and it never saw the record, so nobody else is writing it."""
    if _installed is None or len(record) < 2:
        return
    kind, flags = record[0], record[1]
    if kind == wire.Kind.PUBLISH and flags & wire.PUB_BODY_REF:
        arena, at = arena_of(record)
        entry = arena.entry_of(at, receiver) if receiver else -1
        if entry >= 0:
            arena.release(at, entry)
    elif kind == wire.Kind.DELIVER and flags & wire.DLV_BODY_REF:
        a, at, _, entry = decode_ref(record)
        _installed.arenas[a].give_back(at, entry)
