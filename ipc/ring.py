"""A single-producer/single-consumer ring of variable-length records.

Theory of operation
-------------------
One ring joins two stages in one direction (reader -> channel, channel ->
queue, queue -> store, queue -> consumer's reader). The supervisor creates
it inside a POSIX shared-memory segment; the producer and the consumer each
attach their own :class:`Ring` object to the same bytes. The ring itself
works over any writable buffer (bytearray, mmap, memoryview), so its tests
need no shared memory.

The producer *stages* records (``write_nowait``), which writes their bytes
into free space but leaves them invisible, then *commits*, which publishes
them all with one store of ``write_pos``. The consumer copies or hands out
every record below the ``write_pos`` it loaded, then *releases* their space
with one store of ``read_pos``. Positions count bytes since the ring was
created and only grow, so ``write_pos - read_pos`` is the space in use and
neither side ever mistakes a full ring for an empty one.

Each header word has exactly one writer: the producer owns the first cache
line, the consumer the second, so the two never write the same line (magic
and capacity are written once, by the creator, before either attaches). A
third process (the supervisor) may read both to build ``statistics()``.

Byte layout
-----------
Header words are u64, little-endian, 8-byte aligned::

    offset   0  u64 write_pos        bytes ever committed              (producer)
    offset   8  u64 records_written  records ever committed            (producer)
    offset  16  u64 max_in_flight    max(records_written - records_read)
                                     seen at a commit                  (producer)
    offset  24  u64 flags            bit 0 writer_waiting: the producer
                                     holds records it could not fit    (producer)
    offset  32  u64 magic            RING_MAGIC, written once at creation
    offset  40  u64 capacity_bytes   written once at creation
    offset  64  u64 read_pos         bytes ever released               (consumer)
    offset  72  u64 records_read     records ever released             (consumer)
    offset  80  u64 reader_flags     bit 0 congested: the consumer has stopped
                                     reading because where it sends what it
                                     reads does not take it             (consumer)
    offset 128  data area: capacity_bytes = len(buf) - 128, rounded down
                to a multiple of 8 (the rest of the buffer is unused)

    a record at data[pos % capacity_bytes], pos a multiple of 4:
        u32 length (little-endian) | payload (length bytes) | 0-3 bytes padding

Records start 4-byte aligned so their lengths are aligned u32 words. A record
never wraps. When one does not fit between its position and the end of the
data area, the producer writes the wrap marker ``0xFFFFFFFF`` there (the tail
is a multiple of 4, so the marker always fits) and puts the record at offset
0; the skipped tail counts as used until the consumer passes it. So a record
takes ``4 + length`` rounded up to 4 bytes, plus up to that many again when
it arrives near the end, which is why the largest payload is
``max_record_bytes = capacity_bytes // 2 - 4``: such a record fits in an
empty ring wherever the positions stand.

A producer that finds the ring empty (the consumer has released everything
it committed) when it starts a batch goes back to offset 0 the same way, with
a wrap marker where it stands, once it stands ``REWIND_AFTER_BYTES`` and
twice its biggest batch so far into the data area. A ring drained as fast as
it is written then keeps to its front instead of sweeping its whole capacity,
touching every page of it in time: with a hundred publishers, their 4 MiB
rings (five a connection) held 482 MiB of shared memory after 20 s, 50 with
this. Until the consumer passes the marker the producer has only the front
to write in, hence twice its biggest batch: a batch that hits the consumer
there waits for a SPACE token (going back after 4 KiB whatever the batches,
one publisher's rate fell by a third).

Memory ordering
---------------
Header words are read and written through a native ``"Q"`` memoryview, one
aligned 8-byte load or store each (record lengths likewise through ``"I"``),
so a reader never sees half a position (``struct``'s ``"<Q"`` goes byte by
byte and could tear). The producer
stores record bytes, then the counters, then ``write_pos``; the consumer
loads ``write_pos`` before the records. x86-64 keeps stores in program order
and loads in program order (total store order), which is all this needs;
a weakly ordered CPU would need fences that Python cannot express.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ipc.errors import CorruptRecord, IpcError, WouldBlock

if sys.byteorder != "little":  # the header words are native "Q"; the layout above says little-endian
    raise ImportError("ipc.ring assumes a little-endian CPU")

HEADER_BYTES = 128
RING_MAGIC = 0x31474E4952464321           # b"!CFRING1" read as a little-endian u64
LENGTH_BYTES = 4
WRAP_MARKER = 0xFFFFFFFF
MIN_CAPACITY_BYTES = 64
REWIND_AFTER_BYTES = 64 * 1024            # a drained ring's producer goes back to offset 0 past this

# header word indices (byte offset // 8)
_W_POS, _W_REC, _MAX, _FLAGS, _MAGIC, _CAP = 0, 1, 2, 3, 4, 5
_R_POS, _R_REC, _R_FLAGS = 8, 9, 10
_WRITER_WAITING = 1
_CONGESTED = 1


def record_bytes(payload_bytes: int) -> int:
    """Ring space one record of ``payload_bytes`` takes (length word and padding included)."""
    return (payload_bytes + 7) & -4


class RecordTooLarge(IpcError, ValueError):
    """Raised when a record is bigger than the ring can ever hold (``max_record_bytes``)."""


@dataclass(frozen=True)
class RingStatistics:
    capacity_bytes: int
    used_bytes: int          # committed and not yet released, padding included
    records_written: int     # committed since creation
    records_read: int        # released since creation
    in_flight: int           # records_written - records_read
    max_in_flight: int       # the most in flight at any commit
    writer_waiting: bool     # the producer holds records it could not fit


class Ring:
    """One end (or an observer) of an SPSC ring laid out over ``buf``.

    ``create=True`` initialises the header (done once, by the creator, before
    either end attaches); ``create=False`` attaches to an initialised ring and
    checks its magic and capacity. The producer uses ``write_nowait``,
    ``commit``, ``write_batch`` and ``writer_waiting``; the consumer uses
    ``read_batch``, ``read_into`` and ``congested``; anyone may call ``statistics``.
    ``rewind_after_bytes`` is how far in, at least, a producer that finds the ring drained goes back to
    offset 0.
    """

    __slots__ = ("mv", "capacity_bytes", "max_record_bytes", "_hdr", "_data", "_lens",
                 "_wpos", "_written", "_max", "_staged", "_rpos_seen", "_rpos", "_read", "_rewind", "_batch")

    def __init__(self, buf, *, create: bool, rewind_after_bytes: int = REWIND_AFTER_BYTES):
        mv = memoryview(buf)
        if mv.readonly:
            raise ValueError("a ring needs a writable buffer")
        mv = mv.cast("B")
        cap = (len(mv) - HEADER_BYTES) & -8
        if cap < MIN_CAPACITY_BYTES:
            raise ValueError(f"a ring needs at least {HEADER_BYTES + MIN_CAPACITY_BYTES} bytes, got {len(mv)}")
        self.mv = mv
        self.capacity_bytes = cap
        self.max_record_bytes = cap // 2 - LENGTH_BYTES
        self._hdr = hdr = mv[:HEADER_BYTES].cast("Q")
        self._data = mv[HEADER_BYTES:HEADER_BYTES + cap]
        self._lens = self._data.cast("I")
        if create:
            mv[:HEADER_BYTES] = bytes(HEADER_BYTES)
            hdr[_CAP] = cap
            hdr[_MAGIC] = RING_MAGIC
        elif hdr[_MAGIC] != RING_MAGIC or hdr[_CAP] != cap:
            raise CorruptRecord(f"buffer holds no ring of {cap} bytes (magic {hdr[_MAGIC]:#x}, "
                                f"capacity {hdr[_CAP]})")
        # producer-local state: write_pos including staged records, and the last read_pos seen
        self._wpos = hdr[_W_POS]
        self._written = hdr[_W_REC]
        self._max = hdr[_MAX]
        self._staged = 0
        self._rpos_seen = hdr[_R_POS]
        self._rewind = rewind_after_bytes     # raised to twice the biggest batch committed
        self._batch = 0                       # bytes of the records staged (wrap skips not counted)
        # consumer-local state
        self._rpos = hdr[_R_POS]
        self._read = hdr[_R_REC]

    # -- producer -------------------------------------------------------------------------
    def write_nowait(self, record) -> None:
        """Stage one record (bytes-like); it stays invisible to the consumer until ``commit``.

        Raises ``WouldBlock`` when there is no room now (nothing is staged) and
        ``RecordTooLarge`` when the record could never fit.
        """
        n = len(record)
        if n > self.max_record_bytes:
            raise RecordTooLarge(f"record of {n} bytes exceeds this ring's limit of {self.max_record_bytes}")
        size = (n + 7) & -4
        cap = self.capacity_bytes
        wpos = self._wpos
        off = wpos % cap
        if not self._staged and off >= self._rewind and self._back_to_front(wpos, off, size):
            wpos += cap - off
            off = 0
        skip = cap - off if off + size > cap else 0
        after = wpos + skip + size
        if after - self._rpos_seen > cap:
            self._rpos_seen = self._hdr[_R_POS]
            if after - self._rpos_seen > cap:
                raise WouldBlock(f"ring is full ({wpos - self._rpos_seen} of {cap} bytes in use)")
        lens = self._lens
        if skip:
            lens[off >> 2] = WRAP_MARKER
            off = 0
        lens[off >> 2] = n
        self._data[off + LENGTH_BYTES:off + LENGTH_BYTES + n] = record
        self._wpos = after
        self._staged += 1
        self._batch += size

    def commit(self) -> int:
        """Publish every staged record; return how many were published."""
        staged = self._staged
        if not staged:
            return 0
        hdr = self._hdr
        if 2 * self._batch > self._rewind:
            self._rewind = 2 * self._batch
        self._batch = 0
        self._staged = 0
        self._written += staged
        in_flight = self._written - hdr[_R_REC]
        if in_flight > self._max:
            self._max = in_flight
            hdr[_MAX] = in_flight
        hdr[_W_REC] = self._written
        hdr[_W_POS] = self._wpos          # last: the consumer sees no position ahead of its bytes
        return staged

    def write_batch(self, records) -> int:
        """Stage records in order until one does not fit, commit, and return how many went in.

        The caller resumes with ``records[count:]`` (pass a sequence: from an
        iterator, the record that did not fit is consumed). If a record can
        never fit, the ones before it are committed and ``RecordTooLarge`` is
        raised.
        """
        cap = self.capacity_bytes
        max_n = self.max_record_bytes
        lens = self._lens
        data = self._data
        wpos = self._wpos
        off = wpos % cap
        limit = self._rpos_seen + cap         # the producer may not write past this position
        count = 0
        staged_bytes = 0
        try:
            for record in records:
                n = len(record)
                if n > max_n:
                    raise RecordTooLarge(f"record of {n} bytes exceeds this ring's limit of {max_n}")
                size = (n + 7) & -4
                if not count and off >= self._rewind and self._back_to_front(wpos, off, size):
                    limit = wpos + cap
                    wpos += cap - off
                    off = 0
                if off + size > cap:            # no room before the end: wrap to offset 0
                    if wpos + cap - off + size > limit:
                        limit = self._refresh_limit()
                        if wpos + cap - off + size > limit:
                            break
                    if off < cap:
                        lens[off >> 2] = WRAP_MARKER
                    wpos += cap - off
                    off = 0
                elif wpos + size > limit:
                    limit = self._refresh_limit()
                    if wpos + size > limit:
                        break
                lens[off >> 2] = n
                data[off + LENGTH_BYTES:off + LENGTH_BYTES + n] = record
                off += size
                wpos += size
                staged_bytes += size
                count += 1
        finally:
            self._batch += staged_bytes
            self._wpos = wpos
            self._staged += count
            self.commit()       # also publishes records staged by write_nowait before this call
        return count

    def _back_to_front(self, wpos: int, off: int, size: int) -> bool:
        """At a batch's first record, ``off`` past the threshold: if the consumer has read everything and
        the record fits before ``off``, write the wrap marker there (the caller goes on at offset 0)."""
        if off < size or wpos != self._hdr[_R_POS]:
            return False
        self._lens[off >> 2] = WRAP_MARKER
        self._rpos_seen = wpos
        return True

    def _refresh_limit(self) -> int:
        self._rpos_seen = self._hdr[_R_POS]
        return self._rpos_seen + self.capacity_bytes

    def records_committed(self) -> int:
        """Records this producer has published (its own count; no shared load)."""
        return self._written

    def position_committed(self) -> int:
        """How far the writer has committed, in bytes since the ring was made (loaded from the header)."""
        return self._hdr[_W_POS]

    def position_read(self) -> int:
        """How far this reader has read, in the same bytes as ``position_committed``."""
        return self._rpos

    def records_released(self) -> int:
        """Records the consumer has read and released (loaded from the header)."""
        return self._hdr[_R_REC]

    def in_flight(self) -> int:
        """Records committed and not yet read (``statistics().in_flight`` without building the snapshot)."""
        hdr = self._hdr
        read = hdr[_R_REC]
        return hdr[_W_REC] - read

    def free_bytes(self) -> int:
        """Bytes the producer could stage now, before any wrap padding."""
        self._rpos_seen = self._hdr[_R_POS]
        return self.capacity_bytes - (self._wpos - self._rpos_seen)

    @property
    def writer_waiting(self) -> bool:
        """Set by the producer while it holds records that did not fit; the consumer
        answers by telling it when it has freed space."""
        return bool(self._hdr[_FLAGS] & _WRITER_WAITING)

    @writer_waiting.setter
    def writer_waiting(self, on: bool) -> None:
        flags = self._hdr[_FLAGS]
        self._hdr[_FLAGS] = flags | _WRITER_WAITING if on else flags & ~_WRITER_WAITING

    @property
    def congested(self) -> bool:
        """Set by the consumer while it leaves records unread because its own output is backed up (a
        reader whose client does not take its deliveries); the producer may read it."""
        return bool(self._hdr[_R_FLAGS] & _CONGESTED)

    @congested.setter
    def congested(self, on: bool) -> None:
        flags = self._hdr[_R_FLAGS]
        self._hdr[_R_FLAGS] = flags | _CONGESTED if on else flags & ~_CONGESTED

    # -- consumer -------------------------------------------------------------------------
    def read_batch(self, max_records: int | None = None) -> list[bytes]:
        """Copy out up to ``max_records`` committed records (all when None), release their
        space and return them; ``[]`` when there is nothing to read."""
        wpos = self._hdr[_W_POS]
        rpos = self._rpos
        if rpos == wpos or max_records == 0:
            return []
        cap = self.capacity_bytes
        max_n = self.max_record_bytes
        lens = self._lens
        data = self._data
        out: list[bytes] = []
        append = out.append
        left = -1 if max_records is None else max_records
        off = rpos % cap
        while rpos < wpos:
            if off == cap:
                off = 0
            n = lens[off >> 2]
            if n > max_n:
                if n != WRAP_MARKER:
                    raise CorruptRecord(f"record length {n} at ring offset {off} exceeds {max_n}")
                rpos += cap - off
                off = 0
                continue
            append(data[off + LENGTH_BYTES:off + LENGTH_BYTES + n].tobytes())
            size = (n + 7) & -4
            rpos += size
            off += size
            left -= 1
            if not left:
                break
        if rpos > wpos:
            raise CorruptRecord(f"ring records run past the committed position ({rpos} > {wpos})")
        self._rpos = rpos                  # _release, inlined on this hot path
        self._read += len(out)
        hdr = self._hdr
        hdr[_R_REC] = self._read
        hdr[_R_POS] = rpos
        return out

    def read_into(self, handle, max_records: int | None = None) -> int:
        """Zero-copy read: call ``handle(view)`` with a memoryview of each record's payload,
        then release the records; return how many were handled.

        The view points into the ring and is released when ``handle`` returns, so
        ``handle`` must copy what it keeps. A record is released only after its
        ``handle`` call returns: if ``handle`` raises, that record and those after
        it stay in the ring and the ones before it are released.
        """
        wpos = self._hdr[_W_POS]
        rpos = self._rpos
        if rpos == wpos or max_records == 0:
            return 0
        cap = self.capacity_bytes
        max_n = self.max_record_bytes
        lens = self._lens
        data = self._data
        left = -1 if max_records is None else max_records
        count = 0
        done = rpos                                # position after the last handled record
        off = rpos % cap
        try:
            while rpos < wpos:
                if off == cap:
                    off = 0
                n = lens[off >> 2]
                if n > max_n:
                    if n != WRAP_MARKER:
                        raise CorruptRecord(f"record length {n} at ring offset {off} exceeds {max_n}")
                    rpos += cap - off
                    off = 0
                    continue
                size = (n + 7) & -4
                if rpos + size > wpos:
                    raise CorruptRecord(f"ring records run past the committed position ({rpos + size} > {wpos})")
                view = data[off + LENGTH_BYTES:off + LENGTH_BYTES + n]
                handle(view)
                view.release()
                rpos += size
                off += size
                done = rpos
                count += 1
                left -= 1
                if not left:
                    break
        finally:
            if count:
                self._release(done, count)
        return count

    def _release(self, rpos: int, count: int) -> None:
        self._rpos = rpos
        self._read += count
        hdr = self._hdr
        hdr[_R_REC] = self._read
        hdr[_R_POS] = rpos                 # last: the producer sees no space still being read

    # -- anyone ---------------------------------------------------------------------------
    def statistics(self) -> RingStatistics:
        """A snapshot from the shared header; safe from a third process."""
        hdr = self._hdr
        # consumer words first: they never pass the producer's, so the differences stay >= 0
        rpos, read = hdr[_R_POS], hdr[_R_REC]
        wpos, written, mx, flags = hdr[_W_POS], hdr[_W_REC], hdr[_MAX], hdr[_FLAGS]
        return RingStatistics(capacity_bytes=self.capacity_bytes, used_bytes=wpos - rpos,
                              records_written=written, records_read=read, in_flight=written - read,
                              max_in_flight=mx, writer_waiting=bool(flags & _WRITER_WAITING))

    def release(self) -> None:
        """Drop this object's views of the buffer so the mapping under it can be closed."""
        for view in (self._lens, self._data, self._hdr, self.mv):
            view.release()
