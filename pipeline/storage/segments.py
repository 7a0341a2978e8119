"""Numbered segment files ``N.rdq`` for the shared message store.

Appends go through a buffered file; ``sync`` is the named, timed fsync
policy's one action (flush, then ``os.fsync``), called by the store process
every ``SYNC_INTERVAL_MS`` while writes are pending and when its inbox has
drained. A file rolls over to ``N+1`` at ``FILE_SIZE_LIMIT_BYTES``, and the
roll fsyncs the old file first.

Messages are refcounted: a message routed to several queues is appended
once, and ``decref`` to zero makes its bytes garbage. ``collect`` reclaims
them: a file that is not the current one is deleted when nothing in it is
live, and compacted when less than half of it is (its live records are
copied to the current file, fsynced, and only then is the old file
deleted, so a crash in between leaves two copies, never none).

At start, ``adopt`` takes the ids the queues still hold (from their
journals) and rebuilds the refcounts and per-file live bytes by scanning
the files, so garbage left before a restart is reclaimed too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pipeline.storage.record import RECORD_OVERHEAD_BYTES, encode_record, scan

SYNC_INTERVAL_MS = 200
FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024
COMPACT_BELOW_LIVE_FRACTION = 0.5


@dataclass(frozen=True)
class Location:
    file: int
    offset: int
    size: int           # the record's whole size on disk


@dataclass(frozen=True)
class SyncResult:
    duration_ns: int
    bytes: int


@dataclass(frozen=True)
class SegmentStatistics:
    files: int
    current_file: int
    bytes_on_disk: int
    live_bytes: int
    bytes_written: int
    live_messages: int
    appends: int
    syncs: int
    files_deleted: int
    files_compacted: int


class SegmentStore:
    def __init__(self, directory: str, *, file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES,
                 fsync_delay_ms: int = 0):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.limit = file_size_limit_bytes
        self.fsync_delay_s = fsync_delay_ms / 1000
        existing = sorted(int(n[:-4]) for n in os.listdir(directory) if n.endswith(".rdq") and n[:-4].isdigit())
        self.current = (existing[-1] + 1) if existing else 0
        self.file_bytes: dict[int, int] = {n: os.path.getsize(self._path(n)) for n in existing}
        self.live: dict[int, int] = {n: 0 for n in existing}          # file -> live bytes
        self.index: dict[bytes, list] = {}                              # msg id -> [Location, refcount]
        self._open(self.current)
        self.bytes_written = 0
        self.unsynced_bytes = 0
        self.appends = 0
        self.syncs = 0
        self.files_deleted = 0
        self.files_compacted = 0

    def _path(self, number: int) -> str:
        return os.path.join(self.dir, f"{number}.rdq")

    def _open(self, number: int) -> None:
        self.fh = open(self._path(number), "ab", buffering=1 << 20)
        self.offset = self.fh.tell()
        self.file_bytes[number] = self.offset
        self.live.setdefault(number, 0)

    def adopt(self, held: dict[bytes, int]) -> int:
        """Refcounts from the queues' journals (id -> number of queues holding it); returns messages found."""
        found = 0
        for number in sorted(n for n in self.file_bytes if n != self.current):
            with open(self._path(number), "rb") as f:
                data = f.read()
            for off, msg_id, _start, length in scan(data).records:
                count = held.get(msg_id)
                if count and msg_id not in self.index:
                    size = length + 16 + RECORD_OVERHEAD_BYTES
                    self.index[msg_id] = [Location(number, off, size), count]
                    self.live[number] += size
                    found += 1
        return found

    def append(self, msg_id: bytes, body) -> Location:
        entry = self.index.get(msg_id)
        if entry is not None:
            entry[1] += 1
            return entry[0]
        if self.offset >= self.limit:
            self.roll()
        rec = encode_record(msg_id, body)
        self.fh.write(rec)
        loc = Location(self.current, self.offset, len(rec))
        self.offset += len(rec)
        self.file_bytes[self.current] = self.offset
        self.live[self.current] += len(rec)
        self.bytes_written += len(rec)
        self.unsynced_bytes += len(rec)
        self.index[msg_id] = [loc, 1]
        self.appends += 1
        return loc

    def decref(self, msg_id: bytes) -> None:
        entry = self.index.get(msg_id)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.index[msg_id]
            self.live[entry[0].file] -= entry[0].size

    def roll(self) -> SyncResult:
        result = self.sync()
        self.fh.close()
        self.current += 1
        self._open(self.current)
        return result

    def sync(self) -> SyncResult:
        start = time.monotonic_ns()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        if self.fsync_delay_s:
            time.sleep(self.fsync_delay_s)
        synced, self.unsynced_bytes = self.unsynced_bytes, 0
        self.syncs += 1
        return SyncResult(time.monotonic_ns() - start, synced)

    def collect(self) -> int:
        """Delete dead files and compact mostly-dead ones; returns bytes reclaimed."""
        reclaimed = 0
        for number in sorted(self.file_bytes):
            if number == self.current:
                continue
            total, live = self.file_bytes[number], self.live.get(number, 0)
            if live <= 0:
                reclaimed += self._delete(number)
            elif live < total * COMPACT_BELOW_LIVE_FRACTION:
                reclaimed += self._compact(number)
        return reclaimed

    def _delete(self, number: int) -> int:
        size = self.file_bytes.pop(number)
        self.live.pop(number, None)
        os.unlink(self._path(number))
        self.files_deleted += 1
        return size

    def _compact(self, number: int) -> int:
        moving = [(mid, e) for mid, e in self.index.items() if e[0].file == number]
        with open(self._path(number), "rb") as f:
            data = f.read()
        for msg_id, entry in moving:
            loc = entry[0]
            record = data[loc.offset:loc.offset + loc.size]
            if self.offset >= self.limit:
                self.roll()
            self.fh.write(record)
            entry[0] = Location(self.current, self.offset, loc.size)
            self.offset += loc.size
            self.file_bytes[self.current] = self.offset
            self.live[self.current] += loc.size
        self.sync()                       # the copies are durable before the original goes
        self.live[number] = 0
        self.files_compacted += 1
        return self._delete(number) - sum(e[0].size for _, e in moving)

    def close(self) -> None:
        if not self.fh.closed:
            self.sync()
            self.fh.close()

    def statistics(self) -> SegmentStatistics:
        return SegmentStatistics(
            files=len(self.file_bytes), current_file=self.current, bytes_on_disk=sum(self.file_bytes.values()),
            live_bytes=sum(self.live.values()), bytes_written=self.bytes_written, live_messages=len(self.index),
            appends=self.appends, syncs=self.syncs, files_deleted=self.files_deleted,
            files_compacted=self.files_compacted)
