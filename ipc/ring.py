"""A single-producer/single-consumer ring of variable-length records.

It works over any writable buffer (bytearray, mmap, memoryview), so tests
need no shared memory; the supervisor puts one in each POSIX shared-memory
segment it creates, one per link between two stages.

Layout (little-endian; producer and consumer fields on separate cache lines)::

    offset   0  u64 write_pos        bytes ever committed (producer writes)
    offset   8  u64 records_written  records ever committed (producer writes)
    offset  16  u64 max_in_flight    max records_written - records_read seen at a commit (producer writes)
    offset  24  u64 flags            bit 0: writer_waiting (producer writes)
    offset  64  u64 read_pos         bytes ever released (consumer writes)
    offset  72  u64 records_read     records ever released (consumer writes)
    offset 128  data area of capacity = len(buf) - 128 bytes

    a record at data[pos % capacity]:  u32 length | payload
    a record never wraps: when it does not fit before the end, the producer
    writes u32 0xFFFFFFFF there (if 4 bytes are left) and starts at offset 0;
    the consumer skips the same way.

Positions only grow, so ``write_pos - read_pos`` is the bytes in use. The
producer publishes records by storing ``write_pos`` after their bytes; the
consumer releases space by storing ``read_pos`` after copying them out. On
x86-64 (total store order) these plain stores are enough: stores become
visible in program order and loads are not reordered with older loads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ipc.errors import IpcError, WouldBlock

HEADER_BYTES = 128
_WRAP = 0xFFFFFFFF
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PROD = struct.Struct("<QQQ")        # write_pos, records_written, max_in_flight
_CONS = struct.Struct("<QQ")         # read_pos, records_read
_W_POS, _W_REC, _MAX, _FLAGS = 0, 8, 16, 24
_R_POS, _R_REC = 64, 72


class RecordTooLarge(IpcError, ValueError):
    """Raised when a record is bigger than the ring can ever hold (``max_record_bytes``)."""


@dataclass(frozen=True)
class RingStatistics:
    capacity_bytes: int
    used_bytes: int
    records_written: int
    records_read: int
    in_flight: int
    max_in_flight: int
    writer_waiting: bool


class Ring:
    def __init__(self, buf, *, create: bool):
        self.mv = memoryview(buf).cast("B")
        if len(self.mv) <= HEADER_BYTES + 64:
            raise ValueError(f"ring buffer of {len(self.mv)} bytes is too small")
        self.capacity_bytes = len(self.mv) - HEADER_BYTES
        self.max_record_bytes = self.capacity_bytes // 2 - 4
        if create:
            self.mv[:HEADER_BYTES] = bytes(HEADER_BYTES)
        # producer-local view
        self._wpos, self._written, self._max = _PROD.unpack_from(self.mv, 0)
        self._staged = 0
        self._rpos_seen = _U64.unpack_from(self.mv, _R_POS)[0]
        # consumer-local view
        self._rpos, self._read = _CONS.unpack_from(self.mv, _R_POS)

    # -- producer ---------------------------------------------------------------------
    def write_nowait(self, record) -> None:
        n = len(record)
        if n > self.max_record_bytes:
            raise RecordTooLarge(f"record of {n} bytes exceeds this ring's limit of {self.max_record_bytes}")
        need = n + 4
        cap = self.capacity_bytes
        wpos = self._wpos
        off = wpos % cap
        tail = cap - off
        total = need if need <= tail else tail + need
        if wpos + total - self._rpos_seen > cap:
            self._rpos_seen = _U64.unpack_from(self.mv, _R_POS)[0]
            if wpos + total - self._rpos_seen > cap:
                raise WouldBlock("ring is full")
        mv = self.mv
        if need > tail:
            if tail >= 4:
                _U32.pack_into(mv, HEADER_BYTES + off, _WRAP)
            wpos += tail
            off = 0
        base = HEADER_BYTES + off
        _U32.pack_into(mv, base, n)
        mv[base + 4:base + 4 + n] = record
        self._wpos = wpos + need
        self._staged += 1

    def commit(self) -> int:
        staged = self._staged
        if not staged:
            return 0
        self._written += staged
        self._staged = 0
        in_flight = self._written - _U64.unpack_from(self.mv, _R_REC)[0]
        if in_flight > self._max:
            self._max = in_flight
        # counters first, write_pos last: a reader never sees a position ahead of its records
        _U64.pack_into(self.mv, _MAX, self._max)
        _U64.pack_into(self.mv, _W_REC, self._written)
        _U64.pack_into(self.mv, _W_POS, self._wpos)
        return staged

    def records_committed(self) -> int:
        """Records this producer has published (its own count; no shared read)."""
        return self._written

    def records_released(self) -> int:
        """Records the consumer has read and released (read from the shared header)."""
        return _U64.unpack_from(self.mv, _R_REC)[0]

    def write_batch(self, records) -> int:
        count = 0
        try:
            for record in records:
                self.write_nowait(record)
                count += 1
        except WouldBlock:
            pass
        self.commit()
        return count

    @property
    def writer_waiting(self) -> bool:
        return bool(_U64.unpack_from(self.mv, _FLAGS)[0] & 1)

    @writer_waiting.setter
    def writer_waiting(self, on: bool) -> None:
        _U64.pack_into(self.mv, _FLAGS, 1 if on else 0)

    def free_bytes(self) -> int:
        self._rpos_seen = _U64.unpack_from(self.mv, _R_POS)[0]
        return self.capacity_bytes - (self._wpos - self._rpos_seen)

    # -- consumer ---------------------------------------------------------------------
    def read_batch(self, max_records: int | None = None) -> list[bytes]:
        wpos = _U64.unpack_from(self.mv, _W_POS)[0]
        rpos = self._rpos
        if rpos == wpos:
            return []
        out = []
        append = out.append
        mv = self.mv
        cap = self.capacity_bytes
        limit = max_records or -1
        unpack = _U32.unpack_from
        while rpos < wpos and limit != 0:
            off = rpos % cap
            tail = cap - off
            if tail < 4:
                rpos += tail
                continue
            base = HEADER_BYTES + off
            (n,) = unpack(mv, base)
            if n == _WRAP:
                rpos += tail
                continue
            append(mv[base + 4:base + 4 + n].tobytes())
            rpos += 4 + n
            limit -= 1
        self._release(rpos, len(out))
        return out

    def read_into(self, handle, max_records: int | None = None) -> int:
        wpos = _U64.unpack_from(self.mv, _W_POS)[0]
        rpos = self._rpos
        mv = self.mv
        cap = self.capacity_bytes
        limit = max_records or -1
        count = 0
        while rpos < wpos and limit != 0:
            off = rpos % cap
            tail = cap - off
            if tail < 4:
                rpos += tail
                continue
            base = HEADER_BYTES + off
            (n,) = _U32.unpack_from(mv, base)
            if n == _WRAP:
                rpos += tail
                continue
            handle(mv[base + 4:base + 4 + n])
            rpos += 4 + n
            limit -= 1
            count += 1
        self._release(rpos, count)
        return count

    def _release(self, rpos: int, count: int) -> None:
        self._rpos = rpos
        self._read += count
        _U64.pack_into(self.mv, _R_REC, self._read)
        _U64.pack_into(self.mv, _R_POS, rpos)

    # -- anyone -----------------------------------------------------------------------------
    def statistics(self) -> RingStatistics:
        wpos, written, mx = _PROD.unpack_from(self.mv, 0)
        rpos, read = _CONS.unpack_from(self.mv, _R_POS)
        return RingStatistics(capacity_bytes=self.capacity_bytes, used_bytes=wpos - rpos,
                              records_written=written, records_read=read, in_flight=written - read,
                              max_in_flight=mx, writer_waiting=self.writer_waiting)

    def release(self) -> None:
        self.mv.release()
