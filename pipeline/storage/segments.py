"""Numbered segment files ``N.rdq`` for the shared message store.

Theory of operation
-------------------
The store process is the only writer. Every message it is given is appended
once, as a record of ``pipeline.storage.record``, to the *current* file
through a write buffer of ``WRITE_BUFFER_BYTES``; an in-memory index maps the
message id to its ``Location`` and a reference count::

    append(id, body) ──▶ [write buffer] ──▶ N.rdq   (current file)
                                             │ offset has reached FILE_SIZE_LIMIT_BYTES:
                                             ▼ the next write rolls (flush + fsync N) and opens N+1
    sync() ─ flush + fsync: the group commit the store runs every SYNC_INTERVAL_MS
             while writes are pending, and as soon as its inbox drains with
             confirms waiting

fsync is a named, timed policy with a single action, ``sync``. It returns a
``SyncResult``: how long the fsync took, and which ids (and how many bytes)
became durable since the previous ``sync`` call, including those a roll-over
fsynced in between, so a store that confirms exactly the ids it is given
never misses one. ``fsync_delay_ms`` adds a planted delay to every fsync (a
slow disk). A roll-over and a compaction fsync too; every fsync is counted
and timed in ``statistics()``. A message of ``LARGE_MESSAGE_BYTES`` or more
gets a file of its own: the file before it is rolled, the record goes
straight past the buffer, and the next write rolls again.

Reference counts: a message routed to N queues is written once. ``append``
of an id the store already holds, or ``incref``, adds a reference;
``decref`` drops one, and at zero the record becomes garbage: its bytes stop
counting as live in their file.

Garbage: ``compact`` deletes every file other than the current one with no
live bytes, and compacts every other non-current file whose live bytes are
under half its size (and above zero): its live records are copied to the
current file (the index follows each copy), the copies are fsynced, and
only then is the old file deleted. A crash in between leaves two copies of
a record, never none; recovery keeps the later one. ``read`` follows the
index, so reads keep working across compactions.

A full disk: when a write or an fsync fails with ENOSPC (or EDQUOT), the
current file is cut back to its last fsync, the records that were past it
are *held* in memory (still readable, still counted), later writes go on
being held, and ``DiskFull`` is raised. ``retry`` writes what is held to a new
file and fsyncs it; until one succeeds no id is reported durable, so no
publisher is confirmed for a message that is not on disk, and nothing is
lost or torn.

Recovery: the store never appends to a file it found on disk; a new store
starts a new file after the highest number present. The files it found are
garbage until claimed: ``adopt(held)`` scans each of them up to its last
whole record (truncating a torn tail away, fsynced) and indexes the ids the
queues still hold, with their counts; ``recover(directory)`` does the same
and claims every record found, once.
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import time
from dataclasses import dataclass
from typing import Mapping

from pipeline.storage.errors import CorruptSegment, DiskFull, StoreClosed, UnknownMessage
from pipeline.storage.record import (HEADER_BYTES, RECORD_OVERHEAD_BYTES, SIZE_FIELD_BYTES, decode_record,
                                     encode_record, scan)

SYNC_INTERVAL_MS = 200
FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024
LARGE_MESSAGE_BYTES = 4_000_000
WRITE_BUFFER_BYTES = 1024 * 1024
COMPACT_BELOW_LIVE_FRACTION = 0.5
SYNC_HISTORY_SAMPLES = 1024         # fsync durations kept for the percentile in statistics()
READ_FDS_CACHED = 16
SEGMENT_SUFFIX = ".rdq"
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Location:
    file: int           # N of N.rdq
    offset: int         # where the record starts
    size: int           # the whole record's bytes on disk


@dataclass(frozen=True)
class SyncResult:
    duration_ns: int                    # the fsync's own time (0 when nothing was left to fsync)
    bytes: int                          # bytes appended since the previous sync() that are now durable
    msg_ids_covered: tuple[bytes, ...]  # ids appended since the previous sync(), now durable, in order


@dataclass(frozen=True)
class SegmentStatistics:
    files: int                  # segment files on disk
    current_file: int           # N of the file appends go to
    bytes_on_disk: int          # every file's size, the write buffer included
    live_bytes: int             # bytes of records still referenced
    garbage_bytes: int          # bytes_on_disk - live_bytes
    live_messages: int
    appends: int                # records written for new messages
    duplicate_appends: int      # appends and increfs that only added a reference
    bytes_written: int          # bytes of new records (compaction copies not included)
    unsynced_bytes: int         # appended since the last fsync
    syncs: int                  # every fsync: sync(), roll-overs, compactions
    last_sync_ns: int           # how long the last fsync took
    sync_p99_ns: int            # 99th percentile of the last SYNC_HISTORY_SAMPLES fsyncs
    sync_max_ns: int
    rolls: int
    files_deleted: int          # dead files, and compacted files once their copies were durable
    files_compacted: int
    bytes_moved: int            # live bytes copied by compaction
    bytes_reclaimed: int
    truncated_bytes: int        # torn tails cut away by recovery
    unknown_decrefs: int        # decrefs for ids the store did not hold (ignored)


def numbered_files(directory: str, suffix: str) -> list[int]:
    """The numbers N of every ``N<suffix>`` file in ``directory``, ascending."""
    numbers = []
    for name in os.listdir(directory):
        stem = name[:-len(suffix)]
        if name.endswith(suffix) and stem.isdigit():
            numbers.append(int(stem))
    return sorted(numbers)


def fsync_directory(directory: str) -> None:
    """Make the creation, deletion or truncation of files in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Entry:
    __slots__ = ("location", "refs")

    def __init__(self, location: Location, refs: int):
        self.location = location
        self.refs = refs


class SegmentStore:
    """The shared store's files, index and refcounts; one writer (the store process)."""

    def __init__(self, directory: str, *, file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES,
                 fsync_delay_ms: float = 0):
        if file_size_limit_bytes <= 0:
            raise ValueError(f"file_size_limit_bytes must be positive, got {file_size_limit_bytes}")
        if fsync_delay_ms < 0:
            raise ValueError(f"fsync_delay_ms must not be negative, got {fsync_delay_ms}")
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.file_size_limit_bytes = file_size_limit_bytes
        self.fsync_delay_ms = fsync_delay_ms
        existing = numbered_files(self.directory, SEGMENT_SUFFIX)
        self._file_bytes: dict[int, int] = {n: os.path.getsize(self._path(n)) for n in existing}
        self._live: dict[int, int] = {n: 0 for n in existing}
        self._index: dict[bytes, _Entry] = {}
        self._current = existing[-1] + 1 if existing else 0
        self._fh = None                 # the current file, opened by its first write
        self._offset = 0                # bytes written to the current file, buffered ones included
        self._flushed = 0               # bytes of the current file the OS has (readable with pread)
        self._synced = 0                # bytes of the current file known durable
        self._full = False              # the next write rolls first (limit reached, or a large message)
        self._dirty = False             # the current file has bytes not yet fsynced
        self._dir_dirty = False         # a file was created since the directory was last fsynced
        self._read_fds: dict[int, int] = {}
        self._unsynced_ids: list[bytes] = []
        self._unsynced_bytes = 0
        self._pending: list[tuple[bytes, bytes]] = []    # (id, record) in the current file past its fsync
        self._held: dict[bytes, bytes] = {}              # id -> record the disk refused, to write again
        self.disk_full_errors = 0
        self._sync_ns: collections.deque[int] = collections.deque(maxlen=SYNC_HISTORY_SAMPLES)
        self._closed = False
        self.appends = self.duplicate_appends = self.bytes_written = 0
        self.syncs = self.last_sync_ns = self.rolls = 0
        self.files_deleted = self.files_compacted = self.bytes_moved = self.bytes_reclaimed = 0
        self.truncated_bytes = self.unknown_decrefs = 0

    # -- writing --------------------------------------------------------------------------------------

    def append(self, msg_id: bytes, body) -> Location:
        """Store ``body`` under ``msg_id``; an id already held only gains a reference (written once)."""
        self._check_open()
        entry = self._index.get(msg_id)
        if entry is not None:
            entry.refs += 1
            self.duplicate_appends += 1
            return entry.location
        record = encode_record(msg_id, body)
        self._unsynced_ids.append(msg_id)
        self._unsynced_bytes += len(record)
        self.appends += 1
        self.bytes_written += len(record)
        if self._held:                  # the disk is full: behind what is held already
            entry = self._index[msg_id] = _Entry(Location(-1, 0, len(record)), 1)
            self._held[msg_id] = record
            raise DiskFull(f"message {msg_id.hex()} held: the disk is full")
        try:
            location = self._write_record(record, len(body), msg_id)
        except OSError as exc:
            self._index[msg_id] = _Entry(Location(-1, 0, len(record)), 1)
            self._hold(exc, msg_id, record)
        self._index[msg_id] = _Entry(location, 1)
        return location

    def incref(self, msg_id: bytes) -> int:
        """Add a reference to a message the store holds; returns its count."""
        self._check_open()
        entry = self._index.get(msg_id)
        if entry is None:
            raise UnknownMessage(f"no message {msg_id.hex()} to reference")
        entry.refs += 1
        self.duplicate_appends += 1
        return entry.refs

    def decref(self, msg_id: bytes) -> int:
        """Drop a reference; returns the count left. At zero the record is garbage.

        An id the store does not hold is ignored and counted (a remove can
        outlive its message across a restart).
        """
        self._check_open()
        entry = self._index.get(msg_id)
        if entry is None:
            self.unknown_decrefs += 1
            return 0
        entry.refs -= 1
        if entry.refs > 0:
            return entry.refs
        del self._index[msg_id]
        if self._held.pop(msg_id, None) is None:
            self._live[entry.location.file] -= entry.location.size
        return 0

    def sync(self) -> SyncResult:
        """The fsync policy's action: flush and fsync, and name what became durable."""
        self._check_open()
        if self._held:
            raise DiskFull(f"{len(self._held)} messages held: the disk is full")
        duration_ns = 0
        if self._dirty:
            try:
                duration_ns = self._fsync_current()
            except OSError as exc:
                self._hold(exc)
        elif self._dir_dirty:
            fsync_directory(self.directory)
            self._dir_dirty = False
        ids, self._unsynced_ids = tuple(self._unsynced_ids), []
        nbytes, self._unsynced_bytes = self._unsynced_bytes, 0
        return SyncResult(duration_ns, nbytes, ids)

    def retry(self) -> SyncResult:
        """Write what a full disk refused to a new file and fsync it; ``DiskFull`` again if it still is.
        On success, the result names every id appended since the last successful sync."""
        self._check_open()
        held, self._held = self._held, {}
        try:
            for msg_id, record in held.items():
                self._index[msg_id].location = self._write_record(record, len(record) - RECORD_OVERHEAD_BYTES,
                                                                  msg_id)
        except OSError as exc:
            self._held = held           # all of it again; _hold cuts off what went into the file
            self._hold(exc)
        return self.sync()

    def _hold(self, exc: OSError, msg_id: bytes | None = None, record: bytes | None = None):
        """A write or fsync failed: a full disk is held over (raises DiskFull), anything else re-raised."""
        if exc.errno not in FULL_ERRNOS:
            raise exc
        self.disk_full_errors += 1
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()              # its buffer cannot be written either; the descriptor closes
            except OSError:
                pass
            path = self._path(self._current)
            os.truncate(path, self._synced)         # shrinking needs no space
            self._file_bytes[self._current] = self._synced
            for pending_id, pending in self._pending:
                self._live[self._current] -= len(pending)
                if pending_id in self._index:
                    self._index[pending_id].location = Location(-1, 0, len(pending))
                    self._held[pending_id] = pending
            self._current += 1                      # the cut file stays as it is; writes go to a new one
            self._dirty = False
        self._pending = []
        if msg_id is not None:
            self._held[msg_id] = record
        raise DiskFull(f"{len(self._held)} messages held: {exc}") from exc

    def _write_record(self, record: bytes, body_len: int, msg_id: bytes | None = None) -> Location:
        large = body_len >= LARGE_MESSAGE_BYTES
        if self._fh is not None and (self._full or (large and self._offset > 0)):
            self._roll()                # at the limit, behind a large message, or before one
        if self._fh is None:
            self._open_current()
        location = Location(self._current, self._offset, len(record))
        self._fh.write(record)          # over the buffer's size, this goes straight to the file
        if msg_id is not None:
            self._pending.append((msg_id, record))
        self._offset += len(record)
        self._file_bytes[self._current] = self._offset
        self._live[self._current] += len(record)
        self._dirty = True
        self._full = large or self._offset >= self.file_size_limit_bytes
        return location

    def _open_current(self) -> None:
        self._fh = open(self._path(self._current), "xb", buffering=WRITE_BUFFER_BYTES)
        self._offset = self._flushed = self._synced = 0
        self._full = False
        self._file_bytes[self._current] = 0
        self._live[self._current] = 0
        self._dir_dirty = True

    def _roll(self) -> None:
        if self._dirty:
            self._fsync_current()
        self._fh.close()
        self._fh = None
        self._current += 1
        self.rolls += 1

    def _fsync_current(self) -> int:
        start = time.monotonic_ns()
        self._fh.flush()
        self._flushed = self._offset
        os.fsync(self._fh.fileno())
        if self._dir_dirty:
            fsync_directory(self.directory)
            self._dir_dirty = False
        if self.fsync_delay_ms:
            time.sleep(self.fsync_delay_ms / 1000)
        duration_ns = time.monotonic_ns() - start
        self._dirty = False
        self._synced = self._offset
        self._pending = []
        self.syncs += 1
        self.last_sync_ns = duration_ns
        self._sync_ns.append(duration_ns)
        return duration_ns

    # -- reading --------------------------------------------------------------------------------------

    def read(self, msg_id: bytes) -> bytes:
        """The body stored under ``msg_id``, checked against its record's size, id and commit marker."""
        self._check_open()
        entry = self._index.get(msg_id)
        if entry is None:
            raise UnknownMessage(f"no message {msg_id.hex()} in the store")
        record = self._held.get(msg_id) or self._read_record(entry.location)
        if record[SIZE_FIELD_BYTES:HEADER_BYTES] != msg_id:
            found = record[SIZE_FIELD_BYTES:HEADER_BYTES].hex()
            raise CorruptSegment(f"{entry.location} holds message {found}, not {msg_id.hex()}")
        return record[HEADER_BYTES:-1]

    def held(self) -> int:
        """How many records a full disk refused that wait for ``retry``."""
        return len(self._held)

    def refcount(self, msg_id: bytes) -> int:
        """How many references the store holds for ``msg_id`` (0 when none)."""
        entry = self._index.get(msg_id)
        return entry.refs if entry is not None else 0

    def locations(self) -> dict[bytes, Location]:
        """Where every live message is, by id."""
        return {msg_id: entry.location for msg_id, entry in self._index.items()}

    def _read_record(self, location: Location) -> bytes:
        if location.file == self._current and location.offset + location.size > self._flushed:
            self._fh.flush()            # the record is still in the write buffer
            self._flushed = self._offset
        data = os.pread(self._read_fd(location.file), location.size, location.offset)
        _, consumed = decode_record(data)
        if consumed != location.size:
            raise CorruptSegment(f"{location} holds a record of {consumed} bytes")
        return data

    def _read_fd(self, number: int) -> int:
        fd = self._read_fds.get(number)
        if fd is None:
            if len(self._read_fds) >= READ_FDS_CACHED:
                os.close(self._read_fds.pop(next(iter(self._read_fds))))
            fd = self._read_fds[number] = os.open(self._path(number), os.O_RDONLY | os.O_CLOEXEC)
        return fd

    # -- garbage --------------------------------------------------------------------------------------

    def compact(self) -> int:
        """Delete dead non-current files, compact mostly-dead ones; returns the bytes reclaimed."""
        self._check_open()
        if self._held:
            return 0                    # nothing is copied while the disk is full
        others = [n for n in sorted(self._file_bytes) if n != self._current]
        dead = [n for n in others if self._live[n] <= 0]
        sparse = [n for n in others
                  if 0 < self._live[n] < self._file_bytes[n] * COMPACT_BELOW_LIVE_FRACTION]
        moved = 0
        if sparse:
            wanted = set(sparse)
            moving = sorted(((e.location.file, e.location.offset), i, e) for i, e in self._index.items()
                            if e.location.file in wanted)
            try:
                for _, msg_id, entry in moving:
                    record = self._read_record(entry.location)
                    entry.location = self._write_record(record, entry.location.size - RECORD_OVERHEAD_BYTES,
                                                        msg_id)
                    moved += entry.location.size
                if self._dirty:
                    self._fsync_current()       # the copies are durable before the originals go
            except OSError as exc:
                self._hold(exc)                 # the originals stay; the copies are held
            for n in sparse:
                self._live[n] = 0
            self.files_compacted += len(sparse)
            self.bytes_moved += moved
        reclaimed = sum(self._delete(n) for n in dead + sparse) - moved
        if dead or sparse:
            fsync_directory(self.directory)
        self.bytes_reclaimed += reclaimed
        return reclaimed

    def collect(self) -> int:
        """Same as ``compact`` (the store process's name for its garbage pass)."""
        return self.compact()

    def _delete(self, number: int) -> int:
        fd = self._read_fds.pop(number, None)
        if fd is not None:
            os.close(fd)
        os.unlink(self._path(number))
        del self._live[number]
        self.files_deleted += 1
        return self._file_bytes.pop(number)

    # -- recovery -------------------------------------------------------------------------------------

    def adopt(self, held: Mapping[bytes, int] | None = None) -> int:
        """Claim records in the files found at start; returns how many messages were claimed.

        ``held`` maps an id to the number of queues still holding it (those
        become its reference count; other records stay garbage). ``None``
        claims every record found, with one reference. Each file is scanned
        up to its last whole record and a torn tail is truncated away. Where
        an id was written twice (a compaction cut short), the later copy wins.
        """
        self._check_open()
        claimed = 0
        for number in sorted(self._file_bytes):
            if number == self._current:
                continue
            for rec in self._scan_file(number):
                refs = 1 if held is None else held.get(rec.msg_id, 0)
                if refs <= 0:
                    continue
                location = Location(number, rec.offset, rec.size)
                entry = self._index.get(rec.msg_id)
                if entry is None:
                    self._index[rec.msg_id] = _Entry(location, refs)
                    claimed += 1
                elif (entry.location.file, entry.location.offset) < (number, rec.offset):
                    self._live[entry.location.file] -= entry.location.size
                    entry.location = location
                else:
                    continue
                self._live[number] += rec.size
        return claimed

    def _scan_file(self, number: int) -> list:
        path = self._path(number)
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return []
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                result = scan(view)
            if not result.clean:
                f.truncate(result.end_offset)
                os.fsync(f.fileno())
                self.truncated_bytes += size - result.end_offset
        self._file_bytes[number] = result.end_offset
        return result.records

    # -- lifecycle ------------------------------------------------------------------------------------

    def close(self) -> SyncResult | None:
        """Fsync what is pending and close every file; returns the last sync (None if already closed)."""
        if self._closed:
            return None
        try:
            result = self.sync()
        except DiskFull:
            result = None               # what is held was never reported durable: nobody was confirmed
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()
        self._closed = True
        return result

    def __enter__(self) -> SegmentStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def statistics(self) -> SegmentStatistics:
        on_disk = sum(self._file_bytes.values())
        live = sum(self._live.values())
        samples = sorted(self._sync_ns)
        return SegmentStatistics(
            files=len(self._file_bytes), current_file=self._current, bytes_on_disk=on_disk, live_bytes=live,
            garbage_bytes=on_disk - live, live_messages=len(self._index), appends=self.appends,
            duplicate_appends=self.duplicate_appends, bytes_written=self.bytes_written,
            unsynced_bytes=self._offset - self._synced if self._fh is not None else 0, syncs=self.syncs,
            last_sync_ns=self.last_sync_ns,
            sync_p99_ns=samples[min(len(samples) - 1, len(samples) * 99 // 100)] if samples else 0,
            sync_max_ns=samples[-1] if samples else 0, rolls=self.rolls, files_deleted=self.files_deleted,
            files_compacted=self.files_compacted, bytes_moved=self.bytes_moved,
            bytes_reclaimed=self.bytes_reclaimed, truncated_bytes=self.truncated_bytes,
            unknown_decrefs=self.unknown_decrefs)

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, f"{number}{SEGMENT_SUFFIX}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"segment store in {self.directory} was closed")


def recover(directory: str, *, held: Mapping[bytes, int] | None = None,
            file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES,
            fsync_delay_ms: float = 0) -> tuple[SegmentStore, dict[bytes, Location]]:
    """A store over ``directory`` after a stop, clean or not, and where each claimed message is.

    Every file is scanned up to its last whole record (torn tails are
    truncated away); see ``SegmentStore.adopt`` for ``held``. New appends
    go to a new file after the highest one found.
    """
    store = SegmentStore(directory, file_size_limit_bytes=file_size_limit_bytes, fsync_delay_ms=fsync_delay_ms)
    store.adopt(held)
    return store, store.locations()


def read_bodies(directory: str, wanted: set[bytes]) -> dict[bytes, bytes]:
    """The bodies of the ``wanted`` ids found in ``directory``'s files, read without a store (a durable
    queue recovering before the store process runs); where a compaction left two copies, the later."""
    found: dict[bytes, bytes] = {}
    if not wanted or not os.path.isdir(directory):
        return found
    for number in numbered_files(directory, SEGMENT_SUFFIX):
        with open(os.path.join(directory, f"{number}{SEGMENT_SUFFIX}"), "rb") as f:
            data = f.read()
        for _off, msg_id, start, length in scan(data).records:
            if msg_id in wanted:
                found[msg_id] = data[start:start + length]
    return found
