"""Numbered segment files ``N.rdq`` for the shared message store.

Appends go through a buffered file; ``sync`` is the named, timed fsync
policy's one action (flush, then ``os.fsync``), called by the store process
every ``SYNC_INTERVAL_MS`` while writes are pending and when its inbox has
drained. A file rolls over to ``N+1`` at ``FILE_SIZE_LIMIT_BYTES``, and the
roll fsyncs the old file first. Messages are refcounted: ``decref`` to zero
forgets a message (its bytes become garbage in its file).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pipeline.storage.record import RECORD_OVERHEAD_BYTES, encode_record

SYNC_INTERVAL_MS = 200
FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Location:
    file: int
    offset: int
    size: int


@dataclass(frozen=True)
class SyncResult:
    duration_ns: int
    bytes: int


@dataclass(frozen=True)
class SegmentStatistics:
    files: int
    current_file: int
    bytes_written: int
    live_messages: int
    appends: int
    syncs: int


class SegmentStore:
    def __init__(self, directory: str, *, file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES,
                 fsync_delay_ms: int = 0):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.limit = file_size_limit_bytes
        self.fsync_delay_s = fsync_delay_ms / 1000
        existing = sorted(int(n[:-4]) for n in os.listdir(directory) if n.endswith(".rdq") and n[:-4].isdigit())
        self.current = (existing[-1] + 1) if existing else 0
        self.files = set(existing)
        self.index: dict[bytes, list] = {}      # msg id -> [Location, refcount]
        self._open(self.current)
        self.bytes_written = 0
        self.unsynced_bytes = 0
        self.appends = 0
        self.syncs = 0

    def _open(self, number: int) -> None:
        self.fh = open(os.path.join(self.dir, f"{number}.rdq"), "ab", buffering=1 << 20)
        self.offset = self.fh.tell()
        self.files.add(number)

    def append(self, msg_id: bytes, body) -> Location:
        entry = self.index.get(msg_id)
        if entry is not None:
            entry[1] += 1
            return entry[0]
        if self.offset >= self.limit:
            self.roll()
        rec = encode_record(msg_id, body)
        self.fh.write(rec)
        loc = Location(self.current, self.offset, len(rec) - RECORD_OVERHEAD_BYTES)
        self.offset += len(rec)
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

    def close(self) -> None:
        if not self.fh.closed:
            self.sync()
            self.fh.close()

    def statistics(self) -> SegmentStatistics:
        return SegmentStatistics(len(self.files), self.current, self.bytes_written, len(self.index),
                                 self.appends, self.syncs)
