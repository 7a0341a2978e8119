"""A queue's page file: message records moved out of RAM under memory pressure (RabbitMQ 3.5-3.11 paging).

Past ``paging_ratio`` x the memory watermark the supervisor tells every queue
to page; each round the queue moves up to ``PAGE_BATCH_MESSAGES`` record
payloads, ready messages newest first (they are delivered last) or pending
acks, whichever kind grew faster, into this file, and reads each back when it
is delivered or requeued. The file is emptied once nothing in it is live.
"""

from __future__ import annotations

import os

PAGE_BATCH_MESSAGES = 2048        # messages and pending acks paged out per round
PAGE_ROUND_INTERVAL_NS = 50_000_000


class Paged:
    """A record that was paged out: where it lies in the queue's page file."""

    __slots__ = ("offset", "length")

    def __init__(self, offset: int, length: int):
        self.offset, self.length = offset, length

    def __len__(self) -> int:
        return self.length


class PageFile:
    """Records paged out of RAM, appended and read back by position; emptied when nothing is paged."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1
        self.end = 0
        self.count = 0

    def write(self, record) -> Paged:
        if self.fd < 0:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(self.fd, record, self.end)
        ref = Paged(self.end, len(record))
        self.end += len(record)
        self.count += 1
        return ref

    def read(self, ref: Paged) -> bytes:
        data = os.pread(self.fd, ref.length, ref.offset)
        self.release()
        return data

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            os.ftruncate(self.fd, 0)
            self.end = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
