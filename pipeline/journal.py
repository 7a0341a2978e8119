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
"""

from __future__ import annotations

import os
import struct
import time

from pipeline.storage.record import MSG_ID_BYTES, encode_record, scan

FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024
NO_STORE_ID = bytes(16)
_ID = struct.Struct("<Q8x")


class QueueJournal:
    def __init__(self, directory: str, *, file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES):
        self.dir = directory
        self.limit = file_size_limit_bytes
        os.makedirs(directory, exist_ok=True)
        numbers = sorted(int(n[:-4]) for n in os.listdir(directory) if n.endswith(".jnl") and n[:-4].isdigit())
        self.current = numbers[-1] + 1 if numbers else 0
        self.fh = open(os.path.join(directory, f"{self.current}.jnl"), "ab", buffering=1 << 20)
        self.offset = 0
        self.unsynced = 0
        self.syncs = 0
        self.where: dict[int, int] = {}          # live message number -> the file holding its publish
        self.file_live: dict[int, int] = {self.current: 0}
        self.files_deleted = 0

    def _append(self, key: int, body: bytes) -> None:
        if self.offset >= self.limit:
            self.sync()
            self.fh.close()
            self.current += 1
            self.fh = open(os.path.join(self.dir, f"{self.current}.jnl"), "ab", buffering=1 << 20)
            self.offset = 0
            self.file_live.setdefault(self.current, 0)
        rec = encode_record(_ID.pack(key), body)
        self.fh.write(rec)
        self.offset += len(rec)
        self.unsynced += 1

    def publish(self, msg_id: int, flags: int, store_id: bytes | None, content) -> None:
        self._append(msg_id, b"".join((b"P", bytes((flags,)), store_id or NO_STORE_ID, content)))
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

    def sync(self) -> int:
        """Flush and fsync; returns the nanoseconds it took."""
        start = time.monotonic_ns()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.unsynced = 0
        self.syncs += 1
        return time.monotonic_ns() - start

    def close(self) -> None:
        if not self.fh.closed:
            self.sync()
            self.fh.close()

    def recover(self) -> list[tuple[int, int, bytes | None, bytes]]:
        """(message number, flags, store id or None, content) of every message not acked, in order."""
        live: dict[int, tuple[int, bytes | None, bytes]] = {}
        where: dict[int, int] = {}
        numbers = sorted(int(f[:-4]) for f in os.listdir(self.dir) if f.endswith(".jnl") and f[:-4].isdigit())
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


def read_store_bodies(store_dir: str, wanted: set[bytes]) -> dict[bytes, bytes]:
    """Bodies of ``wanted`` store ids, read from the message store's segment files."""
    found: dict[bytes, bytes] = {}
    if not wanted or not os.path.isdir(store_dir):
        return found
    for n in sorted(int(f[:-4]) for f in os.listdir(store_dir) if f.endswith(".rdq") and f[:-4].isdigit()):
        with open(os.path.join(store_dir, f"{n}.rdq"), "rb") as f:
            data = f.read()
        for _off, rid, start, length in scan(data).records:
            if rid in wanted:
                found[rid] = data[start:start + length]
    return found
