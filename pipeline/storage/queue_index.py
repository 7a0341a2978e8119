"""A durable queue's own index: its messages, their deliveries and acks, in order.

Theory of operation
-------------------
Each durable queue keeps a journal in its own directory, as numbered files
``N.qi`` holding records of ``pipeline.storage.record`` (size, 16-byte id,
body, commit marker), appended and never rewritten. The record's body starts
with an entry type::

    publish  id = the message id
             body = b"P" | u64 seq | u8 flags | message bytes (only when embedded)
             flags: bit 0 persistent, bit 1 embedded
    deliver  id = 16 zero bytes
             body = b"D" | u64 seq * k
    ack      id = 16 zero bytes
             body = b"A" | u64 seq * k

(integers little-endian). A message smaller than
``QUEUE_INDEX_EMBED_MSGS_BELOW`` bytes is embedded: its bytes live here and
never touch the shared message store. A larger one is recorded by id only;
the caller writes it to the shared store (``publish`` says which it was).

Sequence ids increase with every publish; ``next_seq`` continues after the
highest id the files mention. A file rolls like a segment file: once it has
reached the size limit, the next write fsyncs it and opens ``N+1``.
``sync`` is the index's fsync, called by the queue on its 200 ms timer and
when it has drained with confirms waiting; it names the publishes that
became durable since the previous ``sync`` (a roll-over's included).

Opening an index recovers it: every file is scanned up to its last whole
record (a torn tail is truncated away) and replayed in order; a publish
makes a message live, an ack removes it, a deliver marks it delivered.
``recover`` hands over what is live, in publish order.

Deleting acked files: a file other than the current one may go once every
message published in it has been acked *and* every earlier file its acks
and delivers refer to is gone (otherwise deleting it would bring those
messages back at the next recovery). Deletions cascade in file order, each
made durable before the next.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from pipeline.storage.errors import SequenceNotIncreasing, StoreClosed, UnknownSequence
from pipeline.storage.record import MSG_ID_BYTES, encode_record, scan
from pipeline.storage.segments import FILE_SIZE_LIMIT_BYTES, fsync_directory, numbered_files

QUEUE_INDEX_EMBED_MSGS_BELOW = 4096
INDEX_FILE_SIZE_LIMIT_BYTES = FILE_SIZE_LIMIT_BYTES
WRITE_BUFFER_BYTES = 256 * 1024
INDEX_SUFFIX = ".qi"
MAX_SEQ = 2 ** 64 - 1

PUBLISH, DELIVER, ACK = b"P", b"D", b"A"
FLAG_PERSISTENT = 0x01
FLAG_EMBEDDED = 0x02
NO_MSG_ID = bytes(MSG_ID_BYTES)
_PUBLISH_HEAD = struct.Struct("<cQB")           # type, seq, flags


class IndexEntry(NamedTuple):
    seq: int
    msg_id: bytes
    body: bytes | None      # the embedded message, or None when the shared store holds it
    persistent: bool
    delivered: bool         # a deliver was recorded before the stop (redelivered on recovery)


@dataclass(frozen=True)
class IndexSyncResult:
    duration_ns: int                # the fsync's own time (0 when nothing was left to fsync)
    bytes: int                      # bytes written since the previous sync() that are now durable
    seqs_covered: tuple[int, ...]   # publishes since the previous sync(), now durable, in order


@dataclass(frozen=True)
class QueueIndexStatistics:
    files: int
    current_file: int
    bytes_on_disk: int
    live_messages: int
    publishes: int
    embedded_publishes: int
    delivers: int
    acks: int
    syncs: int                  # every fsync: sync() and roll-overs
    last_sync_ns: int           # how long the last fsync took
    rolls: int
    files_deleted: int
    recovered_messages: int
    truncated_bytes: int        # torn tails cut away when the index was opened


def embeds(size_bytes: int, embed_below_bytes: int = QUEUE_INDEX_EMBED_MSGS_BELOW) -> bool:
    """Whether a message of ``size_bytes`` lives in the queue index rather than the shared store."""
    return size_bytes < embed_below_bytes


class QueueIndex:
    """One durable queue's journal; opening it recovers what the files hold."""

    def __init__(self, directory: str, *, file_size_limit_bytes: int = INDEX_FILE_SIZE_LIMIT_BYTES,
                 embed_below_bytes: int = QUEUE_INDEX_EMBED_MSGS_BELOW):
        if file_size_limit_bytes <= 0:
            raise ValueError(f"file_size_limit_bytes must be positive, got {file_size_limit_bytes}")
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.file_size_limit_bytes = file_size_limit_bytes
        self.embed_below_bytes = embed_below_bytes
        self._file_bytes: dict[int, int] = {}
        self._live_count: dict[int, int] = {}      # file -> publishes in it not yet acked
        self._refers_to: dict[int, set[int]] = {}  # file -> earlier files its delivers and acks point into
        self._where: dict[int, int] = {}           # live seq -> file holding its publish
        self._last_seq = -1
        self._fh = None
        self._offset = 0
        self._dirty = False
        self._dir_dirty = False
        self._unsynced_seqs: list[int] = []
        self._unsynced_bytes = 0
        self._closed = False
        self.publishes = self.embedded_publishes = self.delivers = self.acks = 0
        self.syncs = self.last_sync_ns = self.rolls = self.files_deleted = self.truncated_bytes = 0
        self._recovered = self._replay()
        self.recovered_messages = len(self._recovered)
        existing = sorted(self._file_bytes)
        self._current = existing[-1] + 1 if existing else 0
        self._collect()

    @property
    def next_seq(self) -> int:
        """The lowest sequence id the next publish may use."""
        return self._last_seq + 1

    def recover(self) -> list[IndexEntry]:
        """The messages live when the index was opened, in publish order (handed over once; later calls: [])."""
        entries, self._recovered = self._recovered, []
        return entries

    # -- writing --------------------------------------------------------------------------------------

    def publish(self, seq: int, msg_id: bytes, body: bytes | None = None, *, persistent: bool = True) -> bool:
        """Record a publish; returns True when ``body`` was embedded, False when the shared store must hold it."""
        self._check_open()
        if not 0 <= seq <= MAX_SEQ:
            raise ValueError(f"sequence id {seq} is not a u64")
        if seq <= self._last_seq:
            raise SequenceNotIncreasing(f"publish of seq {seq} after seq {self._last_seq}")
        embedded = body is not None and embeds(len(body), self.embed_below_bytes)
        flags = (FLAG_PERSISTENT if persistent else 0) | (FLAG_EMBEDDED if embedded else 0)
        head = _PUBLISH_HEAD.pack(PUBLISH, seq, flags)
        file = self._write(msg_id, b"".join((head, body)) if embedded else head)
        self._last_seq = seq
        self._where[seq] = file
        self._live_count[file] += 1
        self._unsynced_seqs.append(seq)
        self.publishes += 1
        self.embedded_publishes += embedded
        return embedded

    def deliver(self, seqs: Iterable[int]) -> None:
        """Record that these live messages went to a consumer."""
        seqs = self._known(seqs, "deliver")
        if seqs:
            file = self._write(NO_MSG_ID, DELIVER + struct.pack(f"<{len(seqs)}Q", *seqs))
            self._refer(file, seqs)
            self.delivers += len(seqs)

    def ack(self, seqs: Iterable[int]) -> None:
        """Record acks: the messages stop being live, and files left with nothing live may be deleted."""
        seqs = self._known(seqs, "ack")
        if not seqs:
            return
        if len(set(seqs)) != len(seqs):
            raise UnknownSequence(f"a sequence id is acked twice in {seqs}")
        file = self._write(NO_MSG_ID, ACK + struct.pack(f"<{len(seqs)}Q", *seqs))
        self._refer(file, seqs)
        for seq in seqs:
            self._live_count[self._where.pop(seq)] -= 1
        self.acks += len(seqs)
        self._collect()

    def sync(self) -> IndexSyncResult:
        """Flush and fsync; names the publishes that became durable since the previous call."""
        self._check_open()
        duration_ns = self._fsync_current() if self._dirty else 0
        seqs, self._unsynced_seqs = tuple(self._unsynced_seqs), []
        nbytes, self._unsynced_bytes = self._unsynced_bytes, 0
        return IndexSyncResult(duration_ns, nbytes, seqs)

    def _known(self, seqs: Iterable[int], what: str) -> list[int]:
        self._check_open()
        seqs = list(seqs)
        missing = [s for s in seqs if s not in self._where]
        if missing:
            raise UnknownSequence(f"{what} of sequence ids with no live publish: {missing[:10]}")
        return seqs

    def _refer(self, file: int, seqs: list[int]) -> None:
        refers = self._refers_to[file]
        for seq in seqs:
            origin = self._where[seq]
            if origin != file:
                refers.add(origin)

    def _write(self, msg_id: bytes, body: bytes) -> int:
        record = encode_record(msg_id, body)    # a bad id raises before anything changes
        if self._fh is not None and self._offset >= self.file_size_limit_bytes:
            self._fsync_current()
            self._fh.close()
            self._fh = None
            self._current += 1
            self.rolls += 1
        if self._fh is None:
            self._fh = open(self._path(self._current), "xb", buffering=WRITE_BUFFER_BYTES)
            self._offset = 0
            self._file_bytes[self._current] = 0
            self._live_count[self._current] = 0
            self._refers_to[self._current] = set()
            self._dir_dirty = True
        self._fh.write(record)
        self._offset += len(record)
        self._file_bytes[self._current] = self._offset
        self._unsynced_bytes += len(record)
        self._dirty = True
        return self._current

    def _fsync_current(self) -> int:
        start = time.monotonic_ns()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self._dir_dirty:
            fsync_directory(self.directory)
            self._dir_dirty = False
        duration_ns = time.monotonic_ns() - start
        self._dirty = False
        self.syncs += 1
        self.last_sync_ns = duration_ns
        return duration_ns

    # -- deleting acked files -------------------------------------------------------------------------

    def _collect(self) -> None:
        for file in sorted(self._file_bytes):
            if file == self._current or self._live_count[file] > 0:
                continue
            if any(origin in self._file_bytes for origin in self._refers_to[file]):
                continue
            os.unlink(self._path(file))
            fsync_directory(self.directory)     # durable before a later deletion can depend on it
            del self._file_bytes[file], self._live_count[file], self._refers_to[file]
            self.files_deleted += 1

    # -- recovery -------------------------------------------------------------------------------------

    def _replay(self) -> list[IndexEntry]:
        live: dict[int, IndexEntry] = {}
        for file in numbered_files(self.directory, INDEX_SUFFIX):
            self._live_count[file] = 0
            self._refers_to[file] = set()
            for msg_id, body in self._scan_file(file):
                kind = body[:1]
                if kind == PUBLISH and len(body) >= _PUBLISH_HEAD.size:
                    _, seq, flags = _PUBLISH_HEAD.unpack_from(body)
                    embedded = body[_PUBLISH_HEAD.size:] if flags & FLAG_EMBEDDED else None
                    if seq in live:
                        self._live_count[self._where[seq]] -= 1
                    live[seq] = IndexEntry(seq, msg_id, embedded, bool(flags & FLAG_PERSISTENT), False)
                    self._where[seq] = file
                    self._live_count[file] += 1
                    self._last_seq = max(self._last_seq, seq)
                elif kind in (DELIVER, ACK):
                    seqs = struct.unpack_from(f"<{(len(body) - 1) // 8}Q", body, 1)
                    self._last_seq = max(self._last_seq, *seqs) if seqs else self._last_seq
                    known = [s for s in seqs if s in live]
                    self._refer(file, known)
                    for seq in known:
                        if kind == ACK:
                            del live[seq]
                            self._live_count[self._where.pop(seq)] -= 1
                        else:
                            live[seq] = live[seq]._replace(delivered=True)
        return list(live.values())

    def _scan_file(self, file: int) -> list[tuple[bytes, bytes]]:
        with open(self._path(file), "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            entries = []
            if size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                    result = scan(view)
                    entries = [(r.msg_id, view[r.body_start:r.body_start + r.body_len]) for r in result.records]
                if not result.clean:
                    f.truncate(result.end_offset)
                    os.fsync(f.fileno())
                    self.truncated_bytes += size - result.end_offset
                size = result.end_offset
        self._file_bytes[file] = size
        return entries

    # -- lifecycle ------------------------------------------------------------------------------------

    def close(self) -> IndexSyncResult | None:
        """Fsync what is pending and close the current file; returns the last sync (None if already closed)."""
        if self._closed:
            return None
        result = self.sync()
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self._closed = True
        return result

    def __enter__(self) -> QueueIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def statistics(self) -> QueueIndexStatistics:
        return QueueIndexStatistics(
            files=len(self._file_bytes), current_file=self._current, bytes_on_disk=sum(self._file_bytes.values()),
            live_messages=len(self._where), publishes=self.publishes, embedded_publishes=self.embedded_publishes,
            delivers=self.delivers, acks=self.acks, syncs=self.syncs, last_sync_ns=self.last_sync_ns,
            rolls=self.rolls, files_deleted=self.files_deleted, recovered_messages=self.recovered_messages,
            truncated_bytes=self.truncated_bytes)

    def _path(self, file: int) -> str:
        return os.path.join(self.directory, f"{file}{INDEX_SUFFIX}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"queue index in {self.directory} was closed")


def recover(directory: str, **options) -> list[IndexEntry]:
    """The live messages of the queue index in ``directory``, in publish order (opens, recovers, closes)."""
    with QueueIndex(directory, **options) as index:
        return index.recover()
