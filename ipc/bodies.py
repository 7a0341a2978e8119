"""Message bodies by reference: arenas of slots in shared memory, and who still holds each slot.

Theory of operation
-------------------
RabbitMQ keeps a message body as one reference-counted binary that the
reader, the channel, every queue it was routed to and the consumer's writer
share. Here a reader host copies a big body once, from the bytes it read off
the socket, into a slot of its *arena*, a shared-memory segment the supervisor
made before it forked any stage; the rings then carry a small reference
(arena, offset, size, entry) in place of the body, and the consumer's reader
hands the slot's bytes to its socket with a scatter-gather send.

Python has no atomic read-modify-write on shared memory, so there is no shared
count to decrement. Each slot lists its holders instead, one u32 word each,
and every word has exactly one writer at any time::

    channel   set by the allocator to the publishing channel's holder id;
              cleared by that channel once it has routed the message
    queue[i]  set by the channel, before it clears its own word, to the
              holder id of the i-th queue it routes to; cleared by that queue
              once the message is gone from it (acked, dropped, paged, copied)
    lent[i]   set by queue i, only while 0, to the holder id of the reader it
              hands a delivery to; cleared by that reader once the bytes are
              in its socket or copied aside

A slot is free when every word is 0. Only the allocator (the one reader host
that owns the arena) frees slots, oldest first, and only it writes the
arena's header. It reads a slot's words in the order they are cleared
(channel, then each queue, then its lent), so on x86-64 (stores and loads each
in program order) a word set before another was cleared is always seen. A
holder that died clears nothing: the supervisor marks every stage that ended
in the :class:`Liveness` table, and the allocator counts a dead holder's word
as clear. Holder ids are never reused within a run; 0 means "no holder", and a
stage without an id (the table is full) simply moves bodies by copy.

A slot held long (a message that waits in a queue, unacked) stops the oldest-
first reuse behind it; allocation then fails and the reader sends the body
inline, as before. While over half the arena is in use the allocator sets
``pressure``, and queues copy the bodies they hold out of the arena.

A steady flow needs only the bodies in flight, so the allocator keeps to a
*working span* at the start of the data area (WORKING_SPAN_BYTES; the whole
area when it is smaller): once the head has gone past the span it comes back
to the start, skipping the rest of the area as a wrap does, whenever the
start is free and at most half the span is in use (until the tail has passed
the skip, the head can only come up to the tail's offset, so coming back with
more in use would leave the rest out of reach). It goes on into the rest, the
*reserve*, only while a backlog needs it. A slow flow then cycles through pages it keeps, however big
the arena; the reserve costs nothing until a backlog needs it, and its pages
go back PUNCH_AFTER_MS after the backlog has left it (the head, having come
back to the start, does not come round to them). The bytes skipped so are not
in use: ``skipped`` counts those the tail has not passed yet, and what is in
use is head - tail - skipped. A skip the tail has not passed for
PUNCH_AFTER_MS (a slot held since before it) sets ``pressure`` too, so its
holder copies the body out as it would from a full arena.

Freed space goes back to the OS, but not at once: the allocator reuses
the data area in a circle, and handing back pages it is about to come round
to would only make the next bodies fault them in afresh. Space that has
stayed free for PUNCH_AFTER_MS without being reused has its whole pages
handed back (``punch``, an ``madvise(MADV_REMOVE)`` on the shared-memory
file) unless, at the pace the allocator went over the last PUNCH_AFTER_MS
or more, its head comes round to it within another PUNCH_AFTER_MS; so a
steady flow keeps the pages it cycles through however big the arena, and
once a backlog has drained (or the flow stopped) the arena's memory, which
the memory alarm counts, follows it down.

Byte layout
-----------
Integers are native little-endian words (``ipc.ring`` checks the byte order).
Arena header, 64 bytes, written only by the allocator (and by the creator)::

    offset  0  u64 magic       ARENA_MAGIC
    offset  8  u64 capacity    bytes of the data area (a multiple of SLOT_ALIGN_BYTES)
    offset 16  u64 head        bytes ever allocated (wrap skips included)
    offset 24  u64 tail        bytes ever freed
    offset 32  u64 allocated   slots ever allocated
    offset 40  u64 refused     allocations refused for want of room
    offset 48  u64 pressure    1 while what is in use (head - tail - skipped) > capacity / 2, or a skip waits
    offset 56  u64 skipped     bytes skipped to come back to the start before the end, not yet passed by tail

A slot at data[pos % capacity], pos a multiple of SLOT_ALIGN_BYTES::

    u32 slot_bytes | u32 body_bytes | u32 channel | u32 queues (how many entries the channel set)
    QUEUE_ENTRIES x (u32 queue | u32 lent) | body | padding to SLOT_ALIGN_BYTES

A slot never wraps: when one does not fit before the end of the data area,
``slot_bytes`` there is WRAP_MARKER and the slot starts at offset 0.

The liveness table is a bitmap over holder ids, bit set = that holder ended;
only the supervisor writes it.
"""

from __future__ import annotations

import struct
import collections
import time
from dataclasses import dataclass

from ipc.errors import CorruptRecord

ARENA_MAGIC = 0x31414E4552414643          # b"CFARENA1" read as a little-endian u64
HEADER_BYTES = 64
SLOT_ALIGN_BYTES = 64
SLOT_HEADER_BYTES = 64
QUEUE_ENTRIES = 6
WRAP_MARKER = 0xFFFFFFFF
MIN_CAPACITY_BYTES = 4 * SLOT_ALIGN_BYTES
LIVENESS_IDS = 1 << 23                    # holder ids 1 .. LIVENESS_IDS - 1; the table is 1 MiB
WORKING_SPAN_BYTES = 64 * 1024 * 1024     # the allocator comes back to the start past this, if it is free
PUNCH_AFTER_MS = 1000                     # free space not reused for this long goes back to the OS
PAGE_BYTES = 4096
PUNCH_AFTER_NS = PUNCH_AFTER_MS * 1_000_000

# header word indices (u64)
_MAGIC, _CAP, _HEAD, _TAIL, _ALLOCATED, _REFUSED, _PRESSURE, _SKIPPED = range(8)
# slot word indices (u32), relative to the slot's first word
_SLOT_BYTES, _BODY_BYTES, _CHANNEL, _QUEUES, _ENTRIES = 0, 1, 2, 3, 4

REF = struct.Struct("<IIII")              # arena index, slot offset, body bytes, queue entry (deliveries)
REF_BYTES = REF.size


def slot_bytes(body_bytes: int) -> int:
    """Arena space one body of ``body_bytes`` takes, its slot header included."""
    return SLOT_HEADER_BYTES + ((body_bytes + SLOT_ALIGN_BYTES - 1) & -SLOT_ALIGN_BYTES)


@dataclass(frozen=True)
class ArenaStatistics:
    capacity_bytes: int
    used_bytes: int          # allocated and not yet freed (a wrap's skip at the end of the area included)
    allocated: int           # slots ever allocated
    refused: int             # allocations refused: no room (the body went inline)
    pressure: bool           # over half full: holders copy their bodies out


class Liveness:
    """Which holders have ended: the supervisor marks, allocators ask."""

    __slots__ = ("bits",)

    def __init__(self, buf):
        self.bits = memoryview(buf).cast("B")
        if len(self.bits) * 8 < LIVENESS_IDS:
            raise ValueError(f"a liveness table needs {LIVENESS_IDS // 8} bytes, got {len(self.bits)}")

    def mark_dead(self, holder: int) -> None:
        if 0 < holder < LIVENESS_IDS:
            self.bits[holder >> 3] |= 1 << (holder & 7)

    def dead(self, holder: int) -> bool:
        return 0 < holder < LIVENESS_IDS and bool(self.bits[holder >> 3] & (1 << (holder & 7)))


class Arena:
    """An arena over ``buf``: its allocator (one process), or a holder's view of it (any process).

    ``create=True`` initialises the header (the supervisor, once, before any
    stage maps it). The allocator uses ``alloc``, ``body`` and ``reclaim``;
    channels ``route`` and ``release_channel``; queues ``entry_of``,
    ``release``, ``lend``; readers ``give_back``; anyone ``body`` and
    ``statistics``.
    """

    __slots__ = ("mv", "capacity_bytes", "max_body_bytes", "_hdr", "_data", "_words", "liveness", "punch",
                 "_punched_to", "_freed", "_pace_mark", "_pace", "span_bytes", "_skips", "_reserve_free_since")

    def __init__(self, buf, liveness: Liveness, *, create: bool, punch=None, span_bytes: int = WORKING_SPAN_BYTES):
        """``punch(start, length)``: give the pages of that byte range of ``buf`` back (None: keep them);
        ``span_bytes``: the working span (the whole data area when that is smaller)."""
        mv = memoryview(buf).cast("B")
        cap = (len(mv) - HEADER_BYTES) & -SLOT_ALIGN_BYTES
        if cap < MIN_CAPACITY_BYTES:
            raise ValueError(f"an arena needs at least {HEADER_BYTES + MIN_CAPACITY_BYTES} bytes, got {len(mv)}")
        self.mv = mv
        self.liveness = liveness
        self.capacity_bytes = cap
        self.max_body_bytes = cap // 2 - SLOT_HEADER_BYTES
        self._hdr = hdr = mv[:HEADER_BYTES].cast("Q")
        self._data = mv[HEADER_BYTES:HEADER_BYTES + cap]
        self._words = self._data.cast("I")
        if create:
            mv[:HEADER_BYTES] = bytes(HEADER_BYTES)
            hdr[_CAP] = cap
            hdr[_MAGIC] = ARENA_MAGIC
        elif hdr[_MAGIC] != ARENA_MAGIC or hdr[_CAP] != cap:
            raise CorruptRecord(f"buffer holds no arena of {cap} bytes (magic {hdr[_MAGIC]:#x})")
        self.punch = punch
        # allocator-local: space freed before _punched_to went back (or was reused); _freed lists
        # [position freed up to, when] since, oldest first; _pace: bytes allocated over the last whole
        # PUNCH_AFTER_MS (and its length) as of _pace_mark, [when, head]
        self._punched_to = hdr[_TAIL]
        self._freed: collections.deque = collections.deque()
        self._pace_mark = [0, hdr[_HEAD]]
        self._pace = (0, PUNCH_AFTER_NS)
        # the working span; (position, when) of each skip back to the start the tail has not passed,
        # oldest first; since when the reserve has held nothing after a backlog used it (0: in use; None:
        # not used since its pages went back)
        self.span_bytes = max(MIN_CAPACITY_BYTES, min(cap, span_bytes & -SLOT_ALIGN_BYTES))
        self._skips: collections.deque = collections.deque()
        self._reserve_free_since: int | None = None

    # -- the allocator ----------------------------------------------------------------------
    def alloc(self, body_bytes: int, channel: int) -> int | None:
        """A slot for ``body_bytes`` held by ``channel`` (its offset), or None when there is no room."""
        need = slot_bytes(body_bytes)
        if body_bytes > self.max_body_bytes or not channel:
            return None
        hdr = self._hdr
        cap = self.capacity_bytes
        head = hdr[_HEAD]
        off = head % cap
        skip = cap - off if off + need > cap else 0
        if not skip and off + need > self.span_bytes:
            skip = self.back_to_start(head, off, need)
        if head + skip + need - hdr[_TAIL] > cap:
            self.reclaim()
            if head + skip + need - hdr[_TAIL] > cap:
                hdr[_REFUSED] += 1
                return None
        words = self._words
        if skip:
            words[off >> 2] = WRAP_MARKER
            off = 0
        w = off >> 2
        words[w:w + SLOT_HEADER_BYTES // 4] = _EMPTY_SLOT_HEADER
        words[w + _SLOT_BYTES] = need
        words[w + _BODY_BYTES] = body_bytes
        words[w + _CHANNEL] = channel
        hdr[_HEAD] = head + skip + need
        hdr[_ALLOCATED] += 1
        if off + need > self.span_bytes:
            self._reserve_free_since = 0        # a backlog is in the reserve: its pages go back once it has left
        if self.in_use_bytes() > cap // 2:
            self.reclaim()
        return off

    def back_to_start(self, head: int, off: int, need: int) -> int:
        """Past the working span: the bytes to skip to the end of the data area so that the slot goes at
        the start, when the start is free and at most half the span is in use; 0 (go on into the reserve)
        otherwise. Until the tail has passed the skip, the head can only come up to the tail's offset:
        with more in use (a backlog), coming back would leave the reserve out of reach."""
        hdr = self._hdr
        cap = self.capacity_bytes
        skip = cap - off

        def fits() -> bool:
            return head + skip + need - hdr[_TAIL] <= cap and self.in_use_bytes() <= self.span_bytes // 2
        if not fits():
            self.reclaim()
            if not fits():
                return 0
        self._skips.append((head, time.monotonic_ns()))
        hdr[_SKIPPED] += skip
        if off > self.span_bytes and self._reserve_free_since is None:
            self._reserve_free_since = 0            # the head leaves the reserve behind: its pages go back
        return skip

    def reclaim(self, now_ns: int | None = None) -> int:
        """Free the oldest slots that nobody holds any more; return how many bytes came free. With the
        time, also hand back the pages of space freed PUNCH_AFTER_MS ago and not reused since."""
        hdr = self._hdr
        cap = self.capacity_bytes
        head = hdr[_HEAD]
        tail = start = hdr[_TAIL]
        for pos, off, size in self._slots(tail, head):
            if size is None:
                raise CorruptRecord(f"arena slot at {off} claims {self._words[off >> 2]} bytes")
            tail = pos
            if self.held(off):
                break
            tail = pos + size
        else:
            tail = head
        if tail != start:
            hdr[_TAIL] = tail
        skips = self._skips
        while skips and skips[0][0] < tail:       # the tail has jumped over that skip
            hdr[_SKIPPED] -= cap - skips.popleft()[0] % cap
        # pressed: over half in use, or a slot held since before a skip back to the start PUNCH_AFTER_MS
        # ago keeps the tail from passing it (holders then copy out what they have held that long)
        hdr[_PRESSURE] = 1 if (self.in_use_bytes() > cap // 2 or (
            skips and (now_ns or time.monotonic_ns()) - skips[0][1] > PUNCH_AFTER_NS)) else 0
        if now_ns is not None and self.punch is not None:
            self.return_pages(tail, head, now_ns)
            if self._reserve_free_since is not None:
                self.return_reserve(tail, head, now_ns)
        return tail - start

    def return_reserve(self, tail: int, head: int, now_ns: int) -> None:
        """Hand back the reserve's pages PUNCH_AFTER_MS after a backlog has left it: every slot in use then
        lies in the working span, and the head, back at the start, does not come round to the reserve."""
        cap = self.capacity_bytes
        span = self.span_bytes
        if tail == head and head % cap > span:
            self._reserve_free_since = None       # idle in the reserve: it goes back as freed space does anywhere
        elif tail // cap != head // cap or head % cap > span:
            self._reserve_free_since = 0          # still in use (or the head is in it again)
        elif not self._reserve_free_since:
            self._reserve_free_since = now_ns
        elif now_ns - self._reserve_free_since >= PUNCH_AFTER_NS:
            lo = (HEADER_BYTES + span + PAGE_BYTES - 1) & -PAGE_BYTES
            hi = (HEADER_BYTES + cap) & -PAGE_BYTES
            if hi > lo:
                self.punch(lo, hi - lo)
            self._reserve_free_since = None

    def return_pages(self, tail: int, head: int, now_ns: int) -> None:
        freed = self._freed
        if tail > (freed[-1][0] if freed else self._punched_to):
            if freed and now_ns - freed[-1][1] < PUNCH_AFTER_NS // 10:
                freed[-1][0] = tail               # one entry per tenth of the wait
            else:
                freed.append([tail, now_ns])
        mark = self._pace_mark                    # the allocator's pace over its last whole PUNCH_AFTER_MS
        if now_ns - mark[0] >= PUNCH_AFTER_NS:
            self._pace = (head - mark[1], now_ns - mark[0])
            mark[0], mark[1] = now_ns, head
        while freed and now_ns - freed[0][1] >= PUNCH_AFTER_NS:
            end = freed[0][0]
            start = max(self._punched_to, head - self.capacity_bytes)    # what the head came round to is in use
            if end > start and comes_round_in_time(end + self.capacity_bytes - head, *self._pace):
                break                             # the flow reuses it before it could be faulted back in
            freed.popleft()
            if end > start:
                self.give_pages_back(start, end)
            self._punched_to = max(self._punched_to, end)

    @property
    def returning(self) -> bool:
        """Whether freed space waits to go back to the OS (the allocator's timer keeps running for it)."""
        return bool(self._freed) or self._reserve_free_since is not None

    def give_pages_back(self, start: int, end: int) -> None:
        """Punch the whole pages of freed positions [start, end) (at most one wrap of the data area)."""
        cap = self.capacity_bytes
        if end - start >= cap:
            start = end - cap
        a, b = start % cap, end % cap
        for lo, hi in ((a, b),) if a < b else ((a, cap), (0, b)):
            lo = (HEADER_BYTES + lo + PAGE_BYTES - 1) & -PAGE_BYTES       # offsets in the segment,
            hi = (HEADER_BYTES + hi) & -PAGE_BYTES                        # pages wholly inside the range
            if hi > lo:
                self.punch(lo, hi - lo)

    def held(self, off: int) -> bool:
        """Whether anyone alive still holds the slot at ``off`` (read in the order words are cleared)."""
        words = self._words
        dead = self.liveness.dead
        w = off >> 2
        holder = words[w + _CHANNEL]
        if holder and not dead(holder):
            return True
        for e in range(w + _ENTRIES, w + _ENTRIES + 2 * QUEUE_ENTRIES, 2):
            holder = words[e]
            if holder and not dead(holder):
                return True
            holder = words[e + 1]
            if holder and not dead(holder):
                return True
        return False

    # -- every holder ---------------------------------------------------------------------
    def body(self, off: int, body_bytes: int) -> memoryview:
        """The body in the slot at ``off`` (a view: valid while the caller's word holds the slot)."""
        start = off + SLOT_HEADER_BYTES
        return self._data[start:start + body_bytes]

    def route(self, off: int, queues) -> bool:
        """The channel's step: hand the slot to ``queues`` (holder ids, one entry each), then let go of it.
        False (and nothing written) when there are more queues than entries: the body goes by copy."""
        if len(queues) > QUEUE_ENTRIES:
            return False
        words = self._words
        w = off >> 2
        e = w + _ENTRIES
        for q in queues:
            words[e] = q
            e += 2
        words[w + _QUEUES] = len(queues)
        words[w + _CHANNEL] = 0
        return True

    def release_channel(self, off: int) -> None:
        """The channel lets go of a slot it routed nowhere (or sent on by copy)."""
        self._words[(off >> 2) + _CHANNEL] = 0

    def entry_of(self, off: int, queue: int) -> int:
        """Which of the slot's entries is ``queue``'s (-1: none)."""
        words = self._words
        e = (off >> 2) + _ENTRIES
        for i in range(QUEUE_ENTRIES):
            if words[e + 2 * i] == queue:
                return i
        return -1

    def release(self, off: int, entry: int) -> None:
        """Queue ``entry`` lets go of the slot (its message is gone from the queue, or copied out)."""
        self._words[(off >> 2) + _ENTRIES + 2 * entry] = 0

    def lend(self, off: int, entry: int, reader: int) -> bool:
        """Queue ``entry`` lends the slot to ``reader`` for one delivery; False while an earlier loan is out."""
        i = (off >> 2) + _ENTRIES + 2 * entry + 1
        words = self._words
        if words[i] or not reader:
            return False
        words[i] = reader
        return True

    def give_back(self, off: int, entry: int) -> None:
        """The reader is done with a loan: the delivery's bytes are in its socket, or copied aside."""
        self._words[(off >> 2) + _ENTRIES + 2 * entry + 1] = 0

    def held_slots(self) -> tuple[int, int]:
        """(slots, body bytes) still held by a live holder now: a walk from the oldest slot, read only, so
        any process may take it (the header's ``used_bytes`` lags until the allocator reclaims)."""
        slots = body = 0
        for _, off, size in self._slots(self._hdr[_TAIL], self._hdr[_HEAD]):
            if size is None:
                break                       # the allocator is writing it: count what came before
            if self.held(off):
                slots += 1
                body += self._words[(off >> 2) + _BODY_BYTES]
        return slots, body

    def _slots(self, pos: int, head: int):
        """(position, offset, slot bytes) of each slot from ``pos`` up to ``head``, wrap markers skipped;
        slot bytes None (and the walk ends) where a length word is no slot's."""
        cap = self.capacity_bytes
        words = self._words
        while pos < head:
            off = pos % cap
            size = words[off >> 2]
            if size == WRAP_MARKER:
                pos += cap - off
                continue
            if size < SLOT_HEADER_BYTES or size > cap or size & (SLOT_ALIGN_BYTES - 1):
                yield pos, off, None
                return
            yield pos, off, size
            pos += size

    @property
    def in_use(self) -> bool:
        """Whether any slot is not yet freed (held, or let go and not reclaimed yet)."""
        return self._hdr[_HEAD] != self._hdr[_TAIL]

    def in_use_bytes(self) -> int:
        """Bytes allocated and not freed yet: head - tail, less the skips back to the start in between."""
        hdr = self._hdr
        return hdr[_HEAD] - hdr[_TAIL] - hdr[_SKIPPED]

    @property
    def pressure(self) -> bool:
        return bool(self._hdr[_PRESSURE])

    def statistics(self) -> ArenaStatistics:
        hdr = self._hdr
        return ArenaStatistics(self.capacity_bytes, self.in_use_bytes(), hdr[_ALLOCATED], hdr[_REFUSED],
                               bool(hdr[_PRESSURE]))

    def release_views(self) -> None:
        """Drop this object's views so the mapping under it can close."""
        for view in (self._words, self._data, self._hdr, self.mv):
            view.release()


def comes_round_in_time(ahead_bytes: int, allocated_bytes: int, over_ns: int) -> bool:
    """Whether the allocator, going on at the pace it allocated ``allocated_bytes`` in the last
    ``over_ns``, comes round to the end of freed space ``ahead_bytes`` before its head within
    PUNCH_AFTER_MS: then its pages stay (handing them back would only have the next bodies fault
    them in afresh)."""
    return allocated_bytes * PUNCH_AFTER_NS >= ahead_bytes * over_ns


_EMPTY_SLOT_HEADER = memoryview(bytes(SLOT_HEADER_BYTES)).cast("I")


def arena_bytes(capacity_bytes: int) -> int:
    """Segment size for an arena with ``capacity_bytes`` of data area."""
    return HEADER_BYTES + (capacity_bytes & -SLOT_ALIGN_BYTES)


def liveness_bytes() -> int:
    return LIVENESS_IDS // 8
