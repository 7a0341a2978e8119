"""The body arena over plain bytearrays: allocation, the holders' words, oldest-first reuse, dead holders."""

import collections

import pytest

from ipc.bodies import (
    HEADER_BYTES, QUEUE_ENTRIES, SLOT_HEADER_BYTES, Arena, Liveness, arena_bytes, liveness_bytes, slot_bytes,
)
from ipc.errors import CorruptRecord

CHANNEL, Q1, Q2, READER = 11, 21, 22, 31


def arena(capacity=4096):
    live = Liveness(bytearray(liveness_bytes()))
    return Arena(bytearray(arena_bytes(capacity)), live, create=True), live


def put(a, body: bytes, channel=CHANNEL):
    off = a.alloc(len(body), channel)
    if off is not None:
        a.body(off, len(body))[:] = body
    return off


def test_a_body_is_written_once_and_read_back_by_any_view_of_the_same_bytes():
    buf = bytearray(arena_bytes(4096))
    live = Liveness(bytearray(liveness_bytes()))
    owner = Arena(buf, live, create=True)
    off = put(owner, b"hello body")
    other = Arena(buf, live, create=False)        # another process's view of the same segment
    assert bytes(other.body(off, 10)) == b"hello body"
    assert owner.statistics().used_bytes == slot_bytes(10) == SLOT_HEADER_BYTES + 64


def test_attaching_to_bytes_that_hold_no_arena_is_refused():
    live = Liveness(bytearray(liveness_bytes()))
    with pytest.raises(CorruptRecord, match="no arena"):
        Arena(bytearray(arena_bytes(4096)), live, create=False)


def test_a_slot_is_free_only_once_channel_every_queue_and_every_loan_let_go():
    a, _ = arena()
    off = put(a, b"x" * 100)
    assert a.held(off)
    assert a.route(off, [Q1, Q2])                 # the channel hands it to two queues, and lets go
    e1, e2 = a.entry_of(off, Q1), a.entry_of(off, Q2)
    assert (e1, e2) == (0, 1)
    assert a.lend(off, e1, READER)
    assert not a.lend(off, e1, READER)           # one loan per entry at a time
    a.release(off, e1)
    a.release(off, e2)
    assert a.held(off)                           # the reader still sends from it
    assert a.reclaim() == 0
    a.give_back(off, e1)
    assert not a.held(off)
    assert a.reclaim() == slot_bytes(100)
    assert a.statistics().used_bytes == 0


def test_slots_come_free_oldest_first_so_a_held_slot_keeps_the_ones_behind_it():
    a, _ = arena()
    first, second = put(a, b"a" * 10), put(a, b"b" * 10)
    a.release_channel(second)
    assert a.reclaim() == 0                       # the first is still held
    a.release_channel(first)
    assert a.reclaim() == 2 * slot_bytes(10)


def test_a_full_arena_refuses_and_counts_it_then_reuses_space_once_freed():
    a, _ = arena(4096)
    size = 1024 - SLOT_HEADER_BYTES              # slots of exactly 1 KiB
    offs = [put(a, bytes([i]) * size) for i in range(4)]
    assert None not in offs
    assert put(a, b"z" * size) is None
    assert a.statistics().refused == 1
    assert a.statistics().pressure
    for off in offs[:2]:
        a.release_channel(off)
    again = put(a, b"q" * size)
    assert again == 0                             # the ring of bytes wrapped to the start
    assert not a.statistics().pressure or a.statistics().used_bytes > 2048


def test_a_slot_that_does_not_fit_before_the_end_wraps_to_the_start():
    a, _ = arena(4096)
    first = put(a, b"1" * (1500 - SLOT_HEADER_BYTES))       # 1536 bytes
    second = put(a, b"2" * (1500 - SLOT_HEADER_BYTES))      # ends at 3072
    a.release_channel(first)
    a.release_channel(second)
    third = put(a, b"3" * (1500 - SLOT_HEADER_BYTES))       # 1536 do not fit in the last 1024
    assert third == 0
    assert bytes(a.body(third, 3)) == b"333"
    a.release_channel(third)
    assert a.reclaim() > 0 and a.statistics().used_bytes == 0


def test_a_dead_holder_counts_as_let_go():
    a, live = arena()
    off = put(a, b"m" * 50)
    a.route(off, [Q1])
    a.lend(off, 0, READER)
    live.mark_dead(Q1)
    assert a.held(off)                            # the reader's loan is out
    live.mark_dead(READER)
    assert not a.held(off)
    assert a.reclaim() == slot_bytes(50)


def test_more_queues_than_entries_go_by_copy_and_the_channel_keeps_its_word():
    a, _ = arena()
    off = put(a, b"f" * 10)
    assert not a.route(off, list(range(100, 100 + QUEUE_ENTRIES + 1)))
    assert a.held(off)
    a.release_channel(off)
    assert not a.held(off)


def test_no_holder_id_or_a_body_over_half_the_arena_goes_inline():
    a, _ = arena(4096)
    assert a.alloc(10, 0) is None
    assert a.alloc(a.max_body_bytes + 1, CHANNEL) is None
    assert a.alloc(a.max_body_bytes, CHANNEL) == 0


def test_the_header_is_the_layout_the_module_draws():
    a, _ = arena(4096)
    put(a, b"abc")
    raw = a.mv[:HEADER_BYTES].cast("Q")
    assert raw[1] == 4096 and raw[2] == slot_bytes(3) and raw[4] == 1


def test_held_slots_walks_what_live_holders_still_hold():
    a, live = arena()
    first, _second = put(a, b"a" * 100), put(a, b"b" * 200)
    assert a.held_slots() == (2, 300)
    a.release_channel(first)
    assert a.held_slots() == (1, 200)
    live.mark_dead(CHANNEL)
    assert a.held_slots() == (0, 0)
    assert a.statistics().used_bytes == slot_bytes(100) + slot_bytes(200)     # until the allocator reclaims


def test_space_free_for_a_second_and_not_reused_goes_back_in_whole_pages():
    from ipc.bodies import PAGE_BYTES, PUNCH_AFTER_NS
    live = Liveness(bytearray(liveness_bytes()))
    punched = []
    a = Arena(bytearray(arena_bytes(4 * 1024 * 1024)), live, create=True,
              punch=lambda start, length: punched.append((start, length)))
    size = 64 * 1024 - SLOT_HEADER_BYTES                   # 64 KiB slots
    offs = [put(a, b"p" * size) for _ in range(20)]
    for off in offs[:17]:
        a.release_channel(off)
    t = 10**12
    a.reclaim(t)
    assert punched == [] and a.returning                   # freed, but it may come round again
    a.reclaim(t + PUNCH_AFTER_NS - 1)
    assert punched == []
    a.reclaim(t + PUNCH_AFTER_NS)
    assert punched == [(PAGE_BYTES, 17 * 64 * 1024 - PAGE_BYTES)]     # the page the header shares stays
    assert not a.returning


def test_space_the_allocator_came_round_to_again_is_not_handed_back():
    from ipc.bodies import PUNCH_AFTER_NS
    live = Liveness(bytearray(liveness_bytes()))
    punched = []
    a = Arena(bytearray(arena_bytes(1024 * 1024)), live, create=True,
              punch=lambda start, length: punched.append((start, length)))
    size = 64 * 1024 - SLOT_HEADER_BYTES
    t = 10**12
    for _ in range(8):                                     # half the area, freed at t
        a.release_channel(put(a, b"x" * size))
    a.reclaim(t)
    for i in range(16):                                    # a whole round more, in use again
        put(a, b"y" * size)
        a.reclaim(t + i)
    a.reclaim(t + PUNCH_AFTER_NS)
    assert punched == []


def test_a_steady_flow_keeps_the_pages_it_comes_round_to_and_they_go_back_once_it_stops():
    """A flow that goes round the arena in one and a half PUNCH_AFTER_MS (a big arena, 64 KiB bodies at
    a moderate rate): freed space waits longer than PUNCH_AFTER_MS for the head, but at the flow's pace
    the head comes round to it within another; handing it back would have every body fault its pages
    in afresh. Once the flow stops, what is free goes back."""
    from ipc.bodies import PUNCH_AFTER_NS
    live = Liveness(bytearray(liveness_bytes()))
    punched = []
    a = Arena(bytearray(arena_bytes(4 * 1024 * 1024)), live, create=True,
              punch=lambda start, length: punched.append((start, length)))
    size = 64 * 1024 - SLOT_HEADER_BYTES
    slots = a.capacity_bytes // (64 * 1024)
    step = PUNCH_AFTER_NS * 3 // 2 // slots                 # one round in 1.5 s
    t = 10**12
    held = collections.deque()
    for i in range(3 * slots):
        held.append(put(a, b"z" * size))
        if len(held) > 4:                                  # a few in flight, the rest freed behind them
            a.release_channel(held.popleft())
        a.reclaim(t + i * step)
    assert punched == [] and a.statistics().refused == 0
    end = t + 3 * slots * step
    for i in range(1, 31):                                 # the allocator's timer, a tenth of the wait apart
        a.reclaim(end + i * PUNCH_AFTER_NS // 10)
    assert sum(length for _, length in punched) >= a.capacity_bytes * 3 // 4 and not a.returning


def spanned(capacity: int, span: int):
    """An arena of ``capacity`` with a working span of ``span``, recording what it punches."""
    live = Liveness(bytearray(liveness_bytes()))
    punched = []
    a = Arena(bytearray(arena_bytes(capacity)), live, create=True, span_bytes=span,
              punch=lambda start, length: punched.append((start, length)))
    return a, punched


def test_a_steady_flow_stays_in_the_working_span_and_the_skips_are_not_counted_in_use():
    a, punched = spanned(1024 * 1024, 256 * 1024)
    size = 16 * 1024 - SLOT_HEADER_BYTES                   # 16 KiB slots: 16 to the span, 64 to the area
    held = collections.deque()
    offsets = set()
    for i in range(200):
        off = put(a, b"s" * size)
        offsets.add(off)
        held.append(off)
        if len(held) > 3:
            a.release_channel(held.popleft())
            a.reclaim()
        st = a.statistics()
        assert st.used_bytes <= 4 * 16 * 1024 and not st.pressure, f"message {i}: {st}"
    assert offsets == {k * 16 * 1024 for k in range(16)}    # the span's slots, over and over
    assert a.statistics().refused == 0 and punched == []


def test_a_backlog_goes_on_into_the_reserve_and_the_flow_comes_back_to_the_start_once_it_drains():
    from ipc.bodies import PAGE_BYTES, PUNCH_AFTER_NS
    a, punched = spanned(1024 * 1024, 256 * 1024)
    size = 16 * 1024 - SLOT_HEADER_BYTES
    backlog = [put(a, b"b" * size) for _ in range(40)]      # 640 KiB held: past the span, into the reserve
    assert backlog[-1] == 39 * 16 * 1024 and a.statistics().used_bytes == 40 * 16 * 1024
    assert a.statistics().pressure                         # over half the area really is in use
    for off in backlog:
        a.release_channel(off)
    t = 10**12
    assert put(a, b"n" * size) == 0                        # the start is free again: back to it
    st = a.statistics()
    assert st.used_bytes == 16 * 1024 and not st.pressure  # the skip to the end is not in use
    a.reclaim(t)
    assert a.statistics().used_bytes == 16 * 1024
    a.reclaim(t + PUNCH_AFTER_NS - 1)
    reserve = [(lo, n) for lo, n in punched if lo >= 256 * 1024]
    assert reserve == []
    a.reclaim(t + PUNCH_AFTER_NS)
    lo = (HEADER_BYTES + 256 * 1024 + PAGE_BYTES - 1) & -PAGE_BYTES
    assert (lo, ((HEADER_BYTES + a.capacity_bytes) & -PAGE_BYTES) - lo) in punched
    assert put(a, b"n" * size) == 16 * 1024                # and the flow goes on in the span


def test_a_reserve_a_new_backlog_uses_again_does_not_go_back_under_it():
    from ipc.bodies import PUNCH_AFTER_NS
    a, punched = spanned(1024 * 1024, 256 * 1024)
    size = 16 * 1024 - SLOT_HEADER_BYTES
    first = [put(a, b"1" * size) for _ in range(20)]        # into the reserve
    for off in first:
        a.release_channel(off)
    t = 10**12
    assert put(a, b"2" * size) == 0
    a.reclaim(t)
    second = [put(a, b"2" * size) for _ in range(30)]       # a new backlog: the start is held, on past the span
    assert second[-1] == 30 * 16 * 1024
    for i in range(1, 25):
        a.reclaim(t + i * PUNCH_AFTER_NS // 10)
    in_use = (HEADER_BYTES + 16 * 1024, HEADER_BYTES + 31 * 16 * 1024)
    assert punched and all(lo >= in_use[1] or lo + n <= in_use[0] for lo, n in punched), punched
    assert a.held_slots()[0] == 31                         # only what lies beyond the new backlog went back


def test_with_over_half_the_span_in_use_the_head_goes_on_into_the_reserve_though_the_start_is_free():
    a, _ = spanned(1024 * 1024, 256 * 1024)
    size = 16 * 1024 - SLOT_HEADER_BYTES
    slots = [put(a, b"h" * size) for _ in range(16)]        # the whole span
    for off in slots[:2]:
        a.release_channel(off)
    a.reclaim()
    assert put(a, b"h" * size) == 256 * 1024               # 14 held: coming back would strand the reserve


def test_a_slot_held_from_before_a_skip_back_to_the_start_presses_the_arena_after_a_second():
    import time
    from ipc.bodies import PUNCH_AFTER_NS
    a, _ = spanned(1024 * 1024, 256 * 1024)
    size = 16 * 1024 - SLOT_HEADER_BYTES
    stuck = None
    for i in range(16):
        off = put(a, b"k" * size)
        if i == 13:
            stuck = off                                    # an unacked body, say, near the span's end
        else:
            a.release_channel(off)
    assert put(a, b"k" * size) == 0                        # little in use: back to the start
    now = time.monotonic_ns()
    a.reclaim(now)
    st = a.statistics()
    assert st.used_bytes == 4 * 16 * 1024 and not st.pressure    # the stuck slot, the two freed behind it, the new
    a.reclaim(now + PUNCH_AFTER_NS + 10**8)
    assert a.statistics().pressure                         # queues copy out what they held that long
    a.release_channel(stuck)
    a.reclaim(now + PUNCH_AFTER_NS + 2 * 10**8)
    st = a.statistics()
    assert st.used_bytes == 16 * 1024 and not st.pressure


def test_arenas_shrink_to_half_of_what_dev_shm_has_free_and_go_away_below_four_mib(monkeypatch):
    import os

    from pipeline.broker import bodies

    def free(mib):
        return lambda _path: os.statvfs_result((4096, 4096, 0, 0, mib * 256, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", free(10_000))
    assert bodies.fit_arenas(64 * bodies.MIB, 3) == (64 * bodies.MIB, None)
    monkeypatch.setattr(os, "statvfs", free(60))                       # Docker's default /dev/shm, 64 MiB
    size, note = bodies.fit_arenas(64 * bodies.MIB, 3)
    assert size == 10 * bodies.MIB and "body arenas of 10 MiB instead of 64" in note
    monkeypatch.setattr(os, "statvfs", free(20))
    size, note = bodies.fit_arenas(64 * bodies.MIB, 3)
    assert size == 0 and "go by copy" in note
    assert bodies.fit_arenas(0, 3) == (0, None)


def test_records_dropped_before_their_receiver_saw_them_let_go_of_its_words():
    from pipeline.broker import wire
    from pipeline.broker import bodies
    a, live = arena()
    bodies.install(bodies.Bodies([a], live))
    try:
        off = put(a, b"d" * 100)
        publish = wire.encode_publish(wire.PUB_BODY_REF, 1, b"", b"q", b"", bodies.encode_ref(0, off, 100))
        a.route(off, [Q1, Q2])
        bodies.let_go_unsent(publish, Q2)                     # never reached Q2: its word is cleared
        assert a.entry_of(off, Q2) == -1 and a.held(off)
        assert a.lend(off, 0, READER)
        deliver = wire.encode_deliver(wire.DLV_BODY_REF, 1, 7, b"ctag", b"\x00\x01q" + bytes(4)
                                      + bodies.encode_ref(0, off, 100, 0))
        bodies.let_go_unsent(deliver, READER)                 # the reader never got the loan
        a.release(off, 0)
        assert not a.held(off)
        bodies.let_go_unsent(wire.encode_publish(0, 2, b"", b"q", b"", b"inline"), Q1)    # nothing to let go
    finally:
        bodies.install(None)
