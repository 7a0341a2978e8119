"""The publisher's pure parts: frame templates pamqp reads back, the send schedule, the confirm window."""

from __future__ import annotations

import pytest
from pamqp import body as pbody, commands, frame, header

from pipeline.amqp import frames
from pipeline.loadgen import latency
from pipeline.loadgen.publisher import BODY_HEAD, ConfirmTracker, PublishTemplate, decode_head, encode_head
from pipeline.loadgen.schedule import SendSchedule


def unmarshal_all(data: bytes) -> list:
    """Every frame in ``data`` as (channel, pamqp object), through pamqp alone."""
    out, data = [], bytes(data)
    while data:
        used, channel, obj = frame.unmarshal(data)
        out.append((channel, obj))
        data = data[used:]
    return out


def messages(data: bytes) -> list[tuple]:
    """(publish method, content header, whole body) per message."""
    out, current = [], None
    for channel, obj in unmarshal_all(data):
        assert channel == 1
        if isinstance(obj, commands.Basic.Publish):
            current = [obj, None, b""]
            out.append(current)
        elif isinstance(obj, header.ContentHeader):
            current[1] = obj
        else:
            assert isinstance(obj, pbody.ContentBody)
            current[2] += obj.value
    return [tuple(m) for m in out]


def test_template_frames_decode_in_pamqp_with_patched_times_and_sequences():
    props = frames.properties_raw(delivery_mode=2)
    tpl = PublishTemplate(8, "", "creditflow-perf", props, 100, 131072, producer_id=7)
    times = [1_000_000_000 + 1000 * i for i in range(5)]
    data = tpl.fill(41, times)
    assert len(data) == 5 * tpl.message_bytes
    msgs = messages(data)
    assert len(msgs) == 5
    for i, (method, head, body) in enumerate(msgs):
        assert (method.exchange, method.routing_key, method.mandatory) == ("", "creditflow-perf", False)
        assert head.body_size == 100 == len(body)
        assert head.properties.delivery_mode == 2
        assert decode_head(body) == (times[i], 41 + i, 7)
        assert body[BODY_HEAD.size:] == bytes(100 - BODY_HEAD.size)


def test_refilling_changes_only_times_and_sequences():
    props = frames.properties_raw(delivery_mode=1)
    tpl = PublishTemplate(4, "x", "", props, 20, 4096, producer_id=3, mandatory=True)
    first = bytes(tpl.fill(1, [10, 10, 10, 10]))
    second = bytes(tpl.fill(5, [99, 99, 99, 99]))
    changed = [i for i in range(len(first)) if first[i] != second[i]]
    assert changed and all((i % tpl.message_bytes) - tpl.body_offset in range(12) for i in changed)
    method, head, body = messages(second)[3]
    assert (method.exchange, method.mandatory) == ("x", True)
    assert decode_head(body) == (99, 8, 3)


def test_a_body_over_frame_max_is_split_and_the_header_stays_in_the_first_frame():
    props = frames.properties_raw(delivery_mode=1)
    tpl = PublishTemplate(2, "", "q", props, 10_000, 4096, producer_id=1)
    data = tpl.fill(1, [5, 6])
    body_frames = [obj for _, obj in unmarshal_all(data) if isinstance(obj, pbody.ContentBody)]
    assert [len(b.value) for b in body_frames] == [4088, 4088, 1824] * 2
    assert [decode_head(m[2]) for m in messages(data)] == [(5, 1, 1), (6, 2, 1)]


def test_big_messages_get_fewer_slots():
    props = frames.properties_raw()
    assert PublishTemplate(64, "", "q", props, 100, 131072, 0).slots == 64
    assert PublishTemplate(64, "", "q", props, 600_000, 131072, 0).slots == 1


def test_template_refuses_a_body_without_room_for_the_header():
    with pytest.raises(ValueError, match="cannot hold"):
        PublishTemplate(1, "", "q", frames.properties_raw(), 10, 4096, 0)


def test_unlimited_schedule_intends_now():
    s = SendSchedule(0)
    assert s.due(5_000, 3) == [5_000] * 3
    assert s.due(6_000, 0) == []
    assert s.next_due_ns() is None


def test_rated_schedule_follows_start_plus_i_over_rate():
    s = SendSchedule(1_000_000_000, 1000)            # one message a millisecond
    assert s.due(999_999_999, 10) == []                         # nothing before the start
    assert s.due(1_000_000_000, 10) == [1_000_000_000]
    assert s.next_due_ns() == 1_001_000_000
    assert s.due(1_000_999_999, 10) == []                       # never early
    assert s.due(1_003_000_000, 10) == [1_001_000_000, 1_002_000_000, 1_003_000_000]


def test_a_publisher_late_by_jitter_keeps_the_original_intended_times():
    """Late by 10 ms (within STALL_TOLERANCE_NS), it owes 10 messages whose latency counts from when they were due."""
    s = SendSchedule(0, 1000)
    assert s.due(0, 64) == [0]
    late = s.due(10_000_000, 4)                                 # the batch limit caps how many go now
    assert late == [1_000_000, 2_000_000, 3_000_000, 4_000_000]
    assert s.due(10_000_000, 64) == [i * 1_000_000 for i in range(5, 11)]


def test_fractional_rates():
    s = SendSchedule(0, 0.5)                                    # one every two seconds
    assert s.due(0, 5) == [0]
    assert s.due(1_999_999_999, 5) == []
    assert s.due(2_000_000_000, 5) == [2_000_000_000]
    s = SendSchedule(0, 3)
    assert [t for now in range(0, 1_000_000_001, 50_000_000) for t in s.due(now, 10)] == \
        [0, 333_333_333, 666_666_667, 1_000_000_000]


def test_after_a_stall_the_schedule_skips_instead_of_bursting():
    """Blocked for a second at 1000 msg/s: the first overdue message goes (its latency shows the whole
    stall), the 999 others behind it are skipped, and sending goes on at 1000 msg/s from then."""
    s = SendSchedule(0, 1000)
    assert s.due(0, 64) == [0]
    assert s.due(1_000_000_000, 64) == [1_000_000, 1_000_000_000]
    assert s.skipped == 998                                     # intended at 2 .. 999 ms
    assert s.due(1_000_500_000, 64) == []
    assert s.due(1_003_000_000, 64) == [1_001_000_000, 1_002_000_000, 1_003_000_000]
    waited = s.take_omitted()
    assert sum(n for _, n in waited) == 998 and s.take_omitted() == []
    assert max(us for us, _ in waited) < 1_000_000 and min(us for us, _ in waited) < 10_000


def test_variable_rate_steps_repeat_in_turn_and_a_zero_rate_pauses():
    s = SendSchedule(0, steps=((2, 1.0), (0, 1.0), (4, 1.0)))
    sent = [t for now in range(0, 6_000_000_001, 50_000_000) for t in s.due(now, 100)]
    assert sent == [0, 500_000_000, 2_000_000_000, 2_250_000_000, 2_500_000_000, 2_750_000_000,
                    3_000_000_000, 3_500_000_000, 5_000_000_000, 5_250_000_000, 5_500_000_000, 5_750_000_000,
                    6_000_000_000]
    assert s.skipped == 0


def test_a_message_limit_counts_sent_messages_not_skipped_ones():
    s = SendSchedule(0, 1000, limit=1000)
    sent = len(s.due(0, 64)) + len(s.due(500_000_000, 64))                # a half-second stall
    sent += sum(len(s.due(500_000_000 + t * 1_000_000, 64)) for t in range(1, 2000))
    assert sent == 1000 and s.skipped == 498 and s.exhausted()


def test_a_start_delay_holds_back_unlimited_publishing_too():
    s = SendSchedule(5_000_000_000)
    assert s.due(0, 64) == [] and s.next_due_ns() == 5_000_000_000
    assert len(s.due(5_000_000_000, 64)) == 64 and s.next_due_ns() is None


def test_a_message_limit_ends_the_schedule():
    s = SendSchedule(0, limit=5)                                # unlimited rate, -C 5
    assert s.due(0, 3) == [0, 0, 0] and s.due(1, 64) == [1, 1]
    assert s.exhausted() and s.due(2, 64) == [] and s.next_due_ns() is None


def test_confirm_window_limits_publishing_and_acks_become_latencies():
    rec = latency.LatencyRecorder()
    t = ConfirmTracker(4, rec)
    assert t.room() == 4
    t.published(1, [100_000, 100_000, 200_000])
    assert t.room() == 1
    assert t.settle(2, True, False, now_ns=1_100_000) == 2      # multiple: 1 and 2
    assert t.room() == 3 and t.confirmed == 2
    t.published(4, [300_000, 300_000])
    assert t.settle(5, False, False, now_ns=2_300_000) == 1     # a single ack out of order
    assert t.settle(5, False, False, now_ns=2_300_000) == 0     # a repeat settles nothing
    assert t.settle(5, True, True, now_ns=9_000_000) == 2       # nack 3 and 4; 5 is already gone
    assert (t.confirmed, t.nacked, len(t.pending), t.room()) == (3, 2, 0, 4)
    p = latency.percentiles(rec.take())
    assert (p["count"], p["min"], p["max"]) == (3, 1000, 2000)  # nacks are not latencies


def test_without_confirms_nothing_is_tracked():
    t = ConfirmTracker(None, latency.LatencyRecorder())
    t.published(1, [0] * 1000)
    assert t.room() > 10**6 and not t.pending
