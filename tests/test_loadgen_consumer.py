"""The consumer's core: deliveries parsed from bytes, latency from the intended time, order checked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from pamqp import body as pbody, commands, frame, header

from pipeline.amqp import frames
from pipeline.amqp.errors import FrameError
from pipeline.loadgen import latency
from pipeline.loadgen.consumer import DeliveryStream, SequenceChecker
from pipeline.loadgen.publisher import BODY_HEAD, encode_head

START_NS = 1_000_000_000
PROPS = frames.properties_raw(delivery_mode=1)


def body(intended_ns: int, seq: int, producer: int = 0, size: int = 100) -> bytes:
    b = bytearray(size)
    b[:BODY_HEAD.size] = encode_head(intended_ns, seq, producer)
    return bytes(b)


def deliver(tag: int, payload: bytes, frame_max: int = 131072) -> bytes:
    return frames.encode_deliver(1, "ctag", tag, False, "", "creditflow-perf", PROPS, payload, frame_max)


def stream(**kwargs) -> tuple[DeliveryStream, latency.LatencyRecorder]:
    rec = latency.LatencyRecorder()
    return DeliveryStream(START_NS, rec, **kwargs), rec


def feed_all(s: DeliveryStream, data: bytes, now_ns: int, other=None) -> int:
    buf = bytearray(data)
    used = s.feed(buf, now_ns, other if other is not None else (lambda *a: None))
    return used


def test_latency_is_receive_time_minus_intended_time():
    s, rec = stream()
    data = b"".join(deliver(i + 1, body(START_NS + i * 1000, i + 1)) for i in range(3))
    assert feed_all(s, data, now_ns=START_NS + 1_500_000) == len(data)
    assert (s.received, s.stale, s.last_tag) == (3, 0, 3)
    p = latency.percentiles(rec.take())
    assert (p["count"], p["min"], p["p50"], p["max"]) == (3, 1498, 1499, 1500)


def test_pamqp_encoded_deliveries_parse_the_same():
    s, _ = stream()
    payload = body(START_NS, 1)
    data = (frame.marshal(commands.Basic.Deliver("amq.ctag-x", 77, True, "ex", "rk"), 1)
            + frame.marshal(header.ContentHeader(0, len(payload), commands.Basic.Properties(delivery_mode=2)), 1)
            + frame.marshal(pbody.ContentBody(payload), 1))
    feed_all(s, data, START_NS + 1000)
    assert (s.received, s.last_tag) == (1, 77)


def test_partial_input_is_kept_for_later_at_every_split_point():
    data = deliver(1, body(START_NS, 1)) + deliver(2, body(START_NS, 2))
    for cut in range(len(data) + 1):
        s, rec = stream()
        buf = bytearray(data[:cut])
        used = s.feed(buf, START_NS + 2000, lambda *a: None)
        del buf[:used]
        buf += data[cut:]
        assert s.feed(buf, START_NS + 2000, lambda *a: None) == len(buf)
        assert (s.received, s.last_tag, s.sequence.gaps) == (2, 2, 0), cut
        assert rec.take().get_total_count() == 2


def test_a_body_split_over_frames_is_one_message():
    s, rec = stream(frame_max=4096)
    data = deliver(1, body(START_NS, 1, size=10_000), frame_max=4096)
    assert frames.count_frames(data) == 5
    feed_all(s, data, START_NS + 3000)
    assert s.received == 1 and rec.take().get_total_count() == 1


def test_messages_from_before_the_run_or_without_our_header_are_stale():
    s, rec = stream()
    data = deliver(1, body(START_NS - 1, 1)) + deliver(2, b"hello") + deliver(3, b"") + deliver(4, body(START_NS, 1))
    feed_all(s, data, START_NS + 1000)
    assert (s.received, s.stale, s.last_tag) == (1, 3, 4)
    assert rec.take().get_total_count() == 1


def test_other_frames_go_to_the_caller_in_order():
    s, _ = stream()
    blocked = frames.encode_method(0, commands.Connection.Blocked("low on memory"))
    data = frames.encode_heartbeat() + deliver(1, body(START_NS, 1)) + blocked
    seen = []
    feed_all(s, data, START_NS, lambda ftype, ch, ps, pe: seen.append((ftype, ch)))
    assert seen == [(8, 0), (1, 0)] and s.received == 1


def test_gaps_duplicates_and_late_arrivals_per_producer():
    s, _ = stream()
    order = [(0, 1), (1, 1), (0, 2), (0, 5), (1, 2), (0, 5), (0, 3), (1, 3)]
    data = b"".join(deliver(i + 1, body(START_NS, seq, producer)) for i, (producer, seq) in enumerate(order))
    feed_all(s, data, START_NS)
    # producer 0: 3 and 4 skipped, 5 twice, then 3 late: 4 is still missing
    seq = s.sequence
    assert (seq.gaps, seq.duplicates, seq.reordered, s.received) == (1, 1, 1, 8)


def test_sequence_checker_alone():
    c = SequenceChecker()
    for seq in (1, 2, 3, 7, 8, 8, 2):
        c.observe(9, seq)
    assert (c.gaps, c.duplicates, c.expected) == (3, 2, {9: 9})
    for seq in (5, 5, 4, 6):                     # 5 closes the middle of the gap 4..6, then the rest
        c.observe(9, seq)
    assert (c.gaps, c.duplicates, c.reordered, c.missing[9]) == (0, 3, 3, [])


def test_competing_consumers_skip_the_order_check():
    s, _ = stream(check_sequence=False)
    feed_all(s, deliver(1, body(START_NS, 50)), START_NS)
    assert s.sequence is None and s.received == 1


def test_consumer_latency_spends_time_per_message_and_measures_each_at_its_turn():
    clock = [START_NS + 10_000]
    spent = []

    def spend(us):
        spent.append(us)
        clock[0] += us * 1000

    s, rec = stream(delay_us=500, spend=spend, clock=lambda: clock[0])
    data = b"".join(deliver(i + 1, body(START_NS, i + 1)) for i in range(3))
    feed_all(s, data, now_ns=0)
    assert spent == [500, 500, 500]
    p = latency.percentiles(rec.take())
    assert (p["min"], p["max"]) == (10, 1010)       # the third waited for the two before it


def test_after_one_delivery_the_same_shape_is_read_in_one_step():
    s, rec = stream()
    data = b"".join(deliver(i + 1, body(START_NS, i + 1)) for i in range(5))
    feed_all(s, data, START_NS + 1000)
    assert s.shape is not None and s.shape.size == len(deliver(1, body(START_NS, 1)))
    assert (s.received, s.last_tag, s.sequence.gaps) == (5, 5, 0)
    assert rec.take().get_total_count() == 5


def test_a_change_of_shape_falls_back_and_is_learned_again():
    s, _ = stream()
    props2 = frames.properties_raw(delivery_mode=2, content_type="text/plain")
    other = frames.encode_deliver(1, "ctag", 3, True, "amq.fanout", "", props2, body(START_NS, 3, size=60), 131072)
    data = (deliver(1, body(START_NS, 1)) + deliver(2, body(START_NS, 2)) + other
            + deliver(4, body(START_NS, 4)) + frames.encode_heartbeat() + deliver(5, body(START_NS, 5)))
    seen = []
    feed_all(s, data, START_NS, lambda *frame: seen.append(frame[0]))
    assert (s.received, s.last_tag, s.sequence.gaps, s.sequence.duplicates) == (5, 5, 0, 0)
    assert seen == [8]


def test_a_bad_frame_end_inside_a_learned_shape_is_still_a_frame_error():
    s, _ = stream()
    good = deliver(1, body(START_NS, 1))
    bad = bytearray(deliver(2, body(START_NS, 2)))
    bad[-1] = 0x00
    with pytest.raises(FrameError, match="invalid_frame_end_marker"):
        feed_all(s, good + bytes(bad), START_NS)
    assert s.received == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["q", "queue-two", ""]), st.sampled_from([20, 100, 5000]),
                          st.booleans()), min_size=1, max_size=12),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=4))
def test_any_mix_of_shapes_and_cuts_counts_every_message(kinds, cuts):
    data = b""
    for i, (routing_key, size, heartbeat) in enumerate(kinds):
        data += frames.encode_deliver(1, "ctag", i + 1, False, "", routing_key, PROPS, body(START_NS, i + 1, size=size),
                                      4096)
        if heartbeat:
            data += frames.encode_heartbeat()
    s, rec = stream(frame_max=4096)
    buf = bytearray()
    sent = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        buf += data[sent:max(sent, cut)]
        sent = max(sent, cut)
        del buf[:s.feed(buf, START_NS + 1000, lambda *a: None)]
    assert not buf
    assert (s.received, s.last_tag, s.sequence.gaps, s.sequence.duplicates) == (len(kinds), len(kinds), 0, 0)
    assert rec.take().get_total_count() == len(kinds)


def test_bodies_of_other_tools_are_measured_on_their_clock_and_not_order_checked():
    """PerfTest's 12 bytes (int32 sequence, int64 System.nanoTime = our monotonic clock) and omq's
    (1234, then wall-clock UnixNano): both measured, counted as foreign; a wall-clock stamp from
    before the run is stale."""
    import struct
    import time
    now = time.monotonic_ns()
    s, rec = stream()
    s.run_start_ns = now - 1_000_000_000
    s.run_start_wall_ns = time.time_ns() - 1_000_000_000
    perftest = struct.pack(">iq", 7, now - 30_000_000)                    # 30 ms ago, monotonic
    omq = struct.pack(">iq", 1234, time.time_ns() - 50_000_000) + bytes(20)  # 50 ms ago, wall clock
    old = struct.pack(">iq", 1234, time.time_ns() - 5_000_000_000)         # before the run
    feed_all(s, deliver(1, perftest) + deliver(2, omq) + deliver(3, old), now)
    assert (s.received, s.foreign, s.stale) == (2, 2, 1)
    lat = latency.percentiles(rec.take())
    assert 29_000 <= lat["min"] <= 31_000 and 49_000 <= lat["max"] <= 60_000
    assert (s.sequence.gaps, s.sequence.duplicates) == (0, 0)
