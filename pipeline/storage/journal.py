"""A durable queue's journal: its persistent messages and their acks, in order.

Files ``N.jnl`` in the queue's directory hold segment records
(``pipeline.storage.record``: size, 16-byte id, body, commit marker). The id
is the queue's message number (u64) padded to 16 bytes; the body starts with
an entry type::

    b"P" u8 flags | 16-byte store id (zeros when embedded) | content
    b"A" u64 message number * n                      (acks, id field unused)

``content`` is a publish's exchange, routing key, properties and body for
messages under ``queue_index_embed_msgs_below`` (embedded); for larger ones
it is empty: the shared message store keeps their whole content once, found
by store id. ``sync`` is the journal's fsync (group commit, called by the queue on its
200 ms timer or when it has drained with confirms waiting). ``recover`` scans
every file up to its last whole record and returns the messages published
and not acked, in order. Files are deleted from the oldest forward once every
message published in them has been acked.

A full disk (ENOSPC, EDQUOT on a write or an fsync) is held over, as the
message store holds it: the current file is cut back to its last fsync, what
was past it and every later entry are kept in memory in order, ``sync``
answers False (nothing more is durable, so nobody is confirmed), and
``retry`` writes them to a new file and fsyncs it once there is space. A
message whose publish entry is held counts in no file until it is written.
"""

from __future__ import annotations

import errno
import os
import struct

from pipeline.storage.record import HEADER_BYTES, MSG_ID_BYTES, encode_record, scan
from pipeline.storage.segments import numbered_files

FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024
NO_STORE_ID = bytes(16)
_ID = struct.Struct("<Q8x")
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _is_publish(record: bytes) -> bool:
    return record[HEADER_BYTES:HEADER_BYTES + 1] == b"P"


class QueueJournal:
    def __init__(self, directory: str, *, file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES):
        self.dir = directory
        self.limit = file_size_limit_bytes
        os.makedirs(directory, exist_ok=True)
        numbers = numbered_files(directory, ".jnl")
        self.current = numbers[-1] + 1 if numbers else 0
        self.fh = self._open_current()
        self.offset = 0
        self.synced = 0                          # bytes of the current file known durable
        self.pending: list[tuple[int, bytes]] = []   # (key, record) in the current file past its fsync
        self.held: list[tuple[int, bytes]] = []      # refused by a full disk, in order, to write again
        self.disk_full_errors = 0
        self.unsynced = 0
        self.syncs = 0
        self.where: dict[int, int] = {}          # live message number -> the file holding its publish
        self.file_live: dict[int, int] = {self.current: 0}
        self.files_deleted = 0

    @property
    def full(self) -> bool:
        """A full disk refused entries that wait for ``retry``."""
        return bool(self.held)

    def _open_current(self):
        return open(os.path.join(self.dir, f"{self.current}.jnl"), "ab", buffering=1 << 20)

    def _append(self, key: int, body: bytes) -> None:
        rec = encode_record(_ID.pack(key), body)
        self.unsynced += 1
        if self.held:
            self.held.append((key, rec))
            return
        try:
            self._write(key, rec)
        except OSError as exc:
            self._hold(exc, [(key, rec)])

    def _write(self, key: int, rec: bytes) -> None:
        if self.offset >= self.limit:
            self._sync_current()
            self.fh.close()
            self.current += 1
            self.fh = self._open_current()
            self.offset = self.synced = 0
            self.file_live.setdefault(self.current, 0)
        self.fh.write(rec)
        self.pending.append((key, rec))
        self.offset += len(rec)

    def _sync_current(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.synced = self.offset
        self.pending = []

    def _hold(self, exc: OSError, rest: list) -> None:
        """A write or fsync failed: hold over a full disk (anything else is raised)."""
        if exc.errno not in FULL_ERRNOS:
            raise exc
        self.disk_full_errors += 1
        if self.fh is not None:
            try:
                self.fh.close()                  # its buffer cannot be written either
            except OSError:
                pass
            self.fh = None
            os.truncate(os.path.join(self.dir, f"{self.current}.jnl"), self.synced)   # shrinking needs no space
        for key, rec in self.pending:
            if _is_publish(rec) and self.where.get(key) == self.current:
                self.file_live[self.current] -= 1
                self.where[key] = None           # counted again where it is written
        self.held = self.pending + rest
        self.pending = []
        self.current += 1                        # the cut file stays as it is; a new one follows
        self.offset = self.synced = 0
        self.file_live.setdefault(self.current, 0)

    def retry(self) -> bool:
        """Write what a full disk refused to a new file and fsync it; True once all of it is durable."""
        if not self.held:
            return True
        held, self.held = self.held, []
        i = 0
        try:
            if self.fh is None:
                self.fh = self._open_current()
            for i, (key, rec) in enumerate(held):
                self._write(key, rec)
                if _is_publish(rec) and key in self.where and self.where[key] is None:
                    self.where[key] = self.current
                    self.file_live[self.current] += 1
            i = len(held)
            self._sync_current()
        except OSError as exc:
            self._hold(exc, held[i:])
            return False
        self.unsynced = 0
        self.syncs += 1
        return True

    def publish(self, msg_id: int, flags: int, store_id: bytes | None, content) -> None:
        self._append(msg_id, b"".join((b"P", bytes((flags,)), store_id or NO_STORE_ID, content)))
        if self.held:
            self.where[msg_id] = None            # held: counted in the file it is written to
        else:
            self.where[msg_id] = self.current
            self.file_live[self.current] += 1

    def ack(self, msg_ids) -> None:
        self._append(0, b"A" + struct.pack(f"<{len(msg_ids)}Q", *msg_ids))
        for msg_id in msg_ids:
            f = self.where.pop(msg_id, None)
            if f is not None:
                self.file_live[f] -= 1
        self.collect()

    def collect(self) -> None:
        """Delete fully acked files from the oldest forward, never past one still holding a live publish.

        Only the oldest file may go: a newer file's ack records may name publishes in an older file,
        and deleting the newer one first would bring those messages back at the next recovery.
        """
        for f in sorted(self.file_live):
            if f == self.current or self.file_live[f] > 0:
                return
            del self.file_live[f]
            try:
                os.unlink(os.path.join(self.dir, f"{f}.jnl"))
                self.files_deleted += 1
            except FileNotFoundError:
                pass

    def sync(self) -> bool:
        """Flush and fsync; False (nothing more is durable) while a full disk holds entries back."""
        if self.held:
            return False
        try:
            self._sync_current()
        except OSError as exc:
            self._hold(exc, [])
            return False
        self.unsynced = 0
        self.syncs += 1
        return True

    def close(self) -> None:
        """Sync and close; entries a still-full disk refuses are dropped (nobody was confirmed for them)."""
        if self.held:
            self.retry()
        if self.fh is not None and not self.fh.closed:
            self.sync()
            try:
                self.fh.close()
            except OSError:
                pass

    def recover(self) -> list[tuple[int, int, bytes | None, bytes]]:
        """(message number, flags, store id or None, content) of every message not acked, in order."""
        live: dict[int, tuple[int, bytes | None, bytes]] = {}
        where: dict[int, int] = {}
        numbers = numbered_files(self.dir, ".jnl")
        for n in numbers:
            with open(os.path.join(self.dir, f"{n}.jnl"), "rb") as f:
                data = f.read()
            for _off, rid, start, length in scan(data).records:
                body = data[start:start + length]
                if body[:1] == b"P":
                    store_id = body[2:2 + MSG_ID_BYTES]
                    msg_id = _ID.unpack(rid)[0]
                    live[msg_id] = (body[1], None if store_id == NO_STORE_ID else store_id, body[2 + MSG_ID_BYTES:])
                    where[msg_id] = n
                elif body[:1] == b"A":
                    for msg_id in struct.unpack_from(f"<{(len(body) - 1) // 8}Q", body, 1):
                        live.pop(msg_id, None)
                        where.pop(msg_id, None)
        self.where = where
        self.file_live = {n: 0 for n in numbers}
        self.file_live.setdefault(self.current, 0)
        for f in where.values():
            self.file_live[f] += 1
        self.collect()
        return [(k, *v) for k, v in live.items()]


def held_store_ids(queues_dir: str) -> dict[bytes, int]:
    """Store id -> number of durable queues whose journal still holds that message."""
    held: dict[bytes, int] = {}
    if not os.path.isdir(queues_dir):
        return held
    for name in os.listdir(queues_dir):
        journal = QueueJournal.__new__(QueueJournal)
        journal.dir = os.path.join(queues_dir, name)
        journal.current = -1
        for _msg_id, _flags, store_id, _content in journal.recover():
            if store_id is not None:
                held[store_id] = held.get(store_id, 0) + 1
    return held
