"""The queue's pure core, one rule at a time, then every rule at once under a hypothesis state machine.

Each story drives a :class:`Backlog` with a fake clock (monotonic ns passed
in) and reads the actions it returns; no process, ring or file. Where a
story says "as RabbitMQ", the same steps were run against a real RabbitMQ
3.10.8 node with pika and gave the result asserted here.

The state machine keeps its own model of every message and checks, after
every step, that each message taken in is exactly one of: ready, unacked by
exactly one channel, or gone with exactly one outcome; that every message
leaving ready is the head (the oldest of the highest priority, so order
within a priority survives any requeues); that nothing is delivered once
expired; that no delivery exceeds a consumer's prefetch, its channel's
limit or its transport's room; that the statistics add up; and, at the end,
that every publisher got exactly one confirm or nack per message.
"""

from __future__ import annotations

import datetime
import re

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pipeline.broker.args import (InequivalentArgument, InvalidArgument, InvalidExpiration, QueueArgs, QueueSpec,
                                  ResourceLocked, Typed, check_redeclare, consumer_priority, parse_expiration,
                                  parse_queue_args)
from pipeline.broker.backlog import (AccessRefused, AskPermits, Backlog, Confirm, DeadLetter, Death, DeleteQueue,
                                     Deliver, Forget, GetEmpty, GetOk, Message, Nack, QueueInUse, QueueNotEmpty,
                                     ReturnPermits, ShellMisuse, dead_letter_cycles, record_death)
from pipeline.broker.limiter import ChannelLimit

MS = 1_000_000


class Clock:
    def __init__(self):
        self.now = 1_000 * MS

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: float) -> int:
        self.now += int(ms * MS)
        return self.now


def m(body="x", size=None, **kw) -> Message:
    return Message(body, len(body) if size is None else size, **kw)


def bodies(actions, kind=Deliver) -> list:
    return [a.message.payload for a in actions if isinstance(a, kind)]


def answer(actions):
    """The GetOk or GetEmpty among a basic.get's actions."""
    [one] = [a for a in actions if isinstance(a, (GetOk, GetEmpty))]
    return one


def drain(q: Backlog, clock: Clock, channel="get") -> list:
    """Every ready message by basic.get (no-ack), as (body, redelivered)."""
    out = []
    while True:
        got = answer(q.get(channel, clock(), no_ack=True))
        if isinstance(got, GetEmpty):
            return out
        out.append((got.message.payload, got.redelivered))


def queue(clock, name="q", **args) -> Backlog:
    auto_delete = args.pop("auto_delete", False)
    first_id = args.pop("first_id", 1)
    return Backlog(name, clock(), QueueArgs(**args), auto_delete=auto_delete, first_id=first_id)


# -- publishing and delivering ---------------------------------------------------------------------
def test_a_message_with_no_consumer_waits_and_goes_to_the_first_consumer_in_order():
    clock = Clock()
    q = queue(clock)
    for b in "abc":
        assert q.publish(m(b), clock()) == ()
    assert q.statistics().messages_ready == 3
    q.consume("c1", "ch1", clock())
    out = q.deliver(clock())
    assert bodies(out) == ["a", "b", "c"] and all(not a.redelivered and not a.no_ack for a in out)
    assert [a.message.id for a in out] == [1, 2, 3]
    s = q.statistics()
    assert (s.messages_ready, s.messages_unacknowledged, s.message_bytes_unacknowledged) == (0, 3, 3)


def test_a_publish_goes_straight_to_a_consumer_with_room():
    clock = Clock()
    q = queue(clock)
    q.consume("c1", "ch1", clock())
    [d] = q.publish(m("a"), clock())
    assert d == Deliver("c1", d.message, False, False)
    assert q.statistics().messages_ready == 0


def test_consumers_take_turns():
    clock = Clock()
    q = queue(clock)
    for key in ("c1", "c2", "c3"):
        q.consume(key, "ch1", clock())
    out = [q.publish(m(str(i)), clock())[0].consumer for i in range(7)]
    assert out == ["c1", "c2", "c3", "c1", "c2", "c3", "c1"]


def test_a_higher_priority_consumer_is_served_first_and_lower_ones_only_when_it_is_full_as_rabbitmq():
    clock = Clock()
    q = queue(clock)
    q.consume("low", "ch1", clock(), priority=0)
    q.consume("high-a", "ch2", clock(), priority=10, prefetch=2)
    q.consume("high-b", "ch3", clock(), priority=10, prefetch=1)
    got = [q.publish(m(str(i)), clock())[0].consumer for i in range(6)]
    assert got == ["high-a", "high-b", "high-a", "low", "low", "low"]


def test_a_single_active_consumer_gets_everything_and_the_highest_priority_waiting_one_takes_over_as_rabbitmq():
    """As RabbitMQ 3.10.8: c1 came first and is the active one, c3's x-priority 10 does not take it over;
    when c1 goes, c3 (priority 10) takes over before c2 (came earlier); what c1 held stays with its channel
    until that closes, then goes back in order. (3.10.8's queue process crashes on the next publish after
    an active consumer holding unacked deliveries is cancelled; here the next one takes over at once.)"""
    clock = Clock()
    q = queue(clock, single_active_consumer=True)
    q.consume("c1", "ch1", clock(), prefetch=5)
    q.consume("c2", "ch2", clock(), prefetch=5)
    q.consume("c3", "ch3", clock(), prefetch=5, priority=10)
    assert q.single_active_consumer == "c1"
    out = [a for i in range(20) for a in q.publish(m(str(i)), clock())]
    assert [a.consumer for a in out] == ["c1"] * 5 and bodies(out) == ["0", "1", "2", "3", "4"]
    assert q.statistics().consumers == 3
    q.cancel("c1", clock())
    assert q.single_active_consumer == "c3"
    to_c3 = q.deliver(clock())
    assert [(a.consumer, a.message.payload) for a in to_c3] == [("c3", str(i)) for i in range(5, 10)]
    q.channel_closed("ch1", clock())                # c1's five come back, ahead of the rest
    assert q.deliver(clock()) == []                 # c3 is at its prefetch
    q.ack("ch3", [to_c3[0].message.id])
    got = q.deliver(clock())
    assert [(a.consumer, a.message.payload, a.redelivered) for a in got] == [("c3", "0", True)]
    q.channel_closed("ch3", clock())
    assert q.single_active_consumer == "c2"
    assert [a.consumer for a in q.deliver(clock())] == ["c2"] * 5
    q.cancel("c2", clock())
    assert q.single_active_consumer is None and q.statistics().consumers == 0


def test_a_queue_with_a_single_active_consumer_refuses_every_exclusive_consume_as_rabbitmq():
    clock = Clock()
    q = queue(clock, single_active_consumer=True)
    with pytest.raises(AccessRefused, match="in exclusive use"):
        q.consume("c1", "ch1", clock(), exclusive=True)
    q.consume("c1", "ch1", clock())
    with pytest.raises(AccessRefused, match="in exclusive use"):
        q.consume("c2", "ch2", clock(), exclusive=True)
    assert q.statistics().consumers == 1


def test_without_single_active_consumer_no_consumer_waits():
    clock = Clock()
    q = queue(clock)
    q.consume("c1", "ch1", clock())
    q.consume("c2", "ch2", clock())
    assert q.single_active_consumer is None
    assert [q.publish(m(str(i)), clock())[0].consumer for i in range(4)] == ["c1", "c2", "c1", "c2"]


def test_prefetch_holds_a_consumer_at_its_limit_until_it_acks():
    clock = Clock()
    q = queue(clock)
    for i in range(5):
        q.publish(m(str(i)), clock())
    q.consume("c", "ch", clock(), prefetch=2)
    first = q.deliver(clock())
    assert bodies(first) == ["0", "1"] and q.deliver(clock()) == []
    [forget] = q.ack("ch", [first[0].message.id])
    assert forget == Forget(first[0].message, "acked")
    assert bodies(q.deliver(clock())) == ["2"]


def test_a_global_prefetch_is_shared_by_the_channels_queues_and_holds_its_no_ack_consumers_too_as_rabbitmq():
    """Two queues, one channel limited to 3: the limiter's permits, not each queue, bound the channel."""
    clock = Clock()
    limit = ChannelLimit()
    limit.set_limit(3, unacked=0)
    one, two = queue(clock), queue(clock)
    for q in (one, two):
        for i in range(5):
            q.publish(m(str(i)), clock())
        q.set_channel_prefetch("ch", 3)
    one.consume("a", "ch", clock())
    two.consume("b", "ch", clock())
    assert one.deliver(clock()) == [AskPermits("ch", 5)] and two.deliver(clock()) == [AskPermits("ch", 5)]
    assert one.deliver(clock()) == []                      # asked once, until answered
    assert limit.want("one", 5, unacked=0) == [("one", 3)] and limit.want("two", 5, unacked=0) == []
    one.grant("ch", 3)
    delivered = one.deliver(clock())
    assert bodies(delivered[:3]) == ["0", "1", "2"] and delivered[3:] == [AskPermits("ch", 2)]
    for _ in range(3):
        limit.used("one")
    one.ack("ch", [delivered[0].message.id, delivered[1].message.id])
    assert limit.settled(unacked=1) == [("two", 2)]        # the queue that asked first, then the next
    two.grant("ch", 2)
    assert bodies(two.deliver(clock())[:2]) == ["0", "1"]
    one.consume("auto", "ch", clock(), no_ack=True)
    assert one.deliver(clock()) == []                      # RabbitMQ's limiter holds a no-ack consumer too
    for q in (one, two):
        q.set_channel_prefetch("ch", 0)                    # basic.qos global=true prefetch_count=0 lifts it
    assert [(d.consumer, d.message.payload) for d in one.deliver(clock())] == [("a", "3"), ("auto", "4")]


def test_permits_a_queue_cannot_use_go_back_to_the_limiter():
    clock = Clock()
    q = queue(clock)
    q.set_channel_prefetch("ch", 4)
    q.consume("a", "ch", clock())
    q.publish(m("0"), clock())
    assert q.deliver(clock()) == [AskPermits("ch", 1)]
    q.grant("ch", 4)
    [delivered, back] = q.deliver(clock())
    assert bodies([delivered]) == ["0"] and back == ReturnPermits("ch", 3)
    q.grant("ch", 2)                                       # arrives after its messages are gone
    assert q.deliver(clock()) == [ReturnPermits("ch", 2)]


def test_a_channel_limit_waits_for_acks_across_queues():
    limit = ChannelLimit()
    assert limit.want("q1", 2, unacked=0) == []            # no limit set: nothing to grant
    limit.set_limit(2, unacked=1)                          # as RabbitMQ, what is unacked already counts
    assert limit.want("q1", 5, unacked=1) == [("q1", 1)]
    assert limit.want("q2", 5, unacked=1) == []
    limit.used("q1")
    assert limit.settled(unacked=2) == []
    assert limit.settled(unacked=0) == [("q2", 2)]
    assert limit.give_back("q2", 2, unacked=0) == []
    assert limit.want("q1", 1, unacked=0) == [("q1", 1)]
    assert limit.forget("q1", unacked=0) == [] and limit.free(unacked=0) == 2
    assert limit.set_limit(0, unacked=0) == [] and not limit.out and not limit.waiting


def test_room_on_the_transport_bounds_each_delivery_round():
    clock = Clock()
    q = queue(clock)
    for i in range(5):
        q.publish(m(str(i)), clock())
    q.consume("c1", "ch1", clock(), transport="reader-1")
    q.consume("c2", "ch2", clock(), transport="reader-1")
    room = {"reader-1": 3}
    assert [a.consumer for a in q.deliver(clock(), room)] == ["c1", "c2", "c1"]
    assert room == {"reader-1": 0}
    assert bodies(q.deliver(clock(), {"reader-1": 10})) == ["3", "4"]
    assert q.deliver(clock(), {}) == ()    # nothing ready: nothing to do


def test_a_no_ack_consumer_ends_each_message_as_it_is_sent():
    clock = Clock()
    q = queue(clock)
    q.consume("c", "ch", clock(), no_ack=True)
    [d] = q.publish(m("a"), clock())
    assert d.no_ack and q.statistics().messages_unacknowledged == 0 and q.statistics().acked == 1


def test_an_exclusive_consumer_keeps_others_out_as_rabbitmq_says():
    clock = Clock()
    q = queue(clock, name="x1")
    q.consume("c1", "ch1", clock(), exclusive=True)
    with pytest.raises(AccessRefused, match=re.escape("ACCESS_REFUSED - queue 'x1' in vhost '/' in exclusive use")):
        q.consume("c2", "ch2", clock())
    q.cancel("c1", clock())
    q.consume("c2", "ch2", clock())
    with pytest.raises(AccessRefused) as refused:
        q.consume("c3", "ch3", clock(), exclusive=True)
    assert refused.value.reply_code == 403
    with pytest.raises(ShellMisuse):
        q.consume("c2", "ch2", clock())


def test_basic_get_with_and_without_ack():
    clock = Clock()
    q = queue(clock)
    assert q.get("ch", clock()) == [GetEmpty("ch")]
    for b in "abc":
        q.publish(m(b), clock())
    [ok] = q.get("ch", clock(), no_ack=True)
    assert (ok.message.payload, ok.remaining, ok.no_ack) == ("a", 2, True)
    [ok] = q.get("ch", clock())
    assert (ok.message.payload, ok.remaining) == ("b", 1) and q.statistics().messages_unacknowledged == 1
    assert q.ack("other-channel", [ok.message.id]) == ()      # not its to ack
    assert q.holds("ch", ok.message.id)
    assert q.ack("ch", [ok.message.id]) == [Forget(ok.message, "acked")]
    assert q.ack("ch", [ok.message.id]) == []                 # a second ack finds nothing


# -- requeue ------------------------------------------------------------------------------------------
def test_requeued_messages_go_back_in_their_original_order_as_rabbitmq():
    clock = Clock()
    q = queue(clock)
    for i in range(1, 9):
        q.publish(m(str(i)), clock())
    ids = {}
    for _ in range(6):
        ok = answer(q.get("ch", clock()))
        ids[ok.message.payload] = ok.message.id
    for b in ("5", "2", "6", "1"):            # nacked one at a time, in this order
        q.reject("ch", [ids[b]], clock(), requeue=True)
    assert drain(q, clock) == [("1", True), ("2", True), ("5", True), ("6", True), ("7", False), ("8", False)]
    q.recover("ch", clock())
    assert drain(q, clock) == [("3", True), ("4", True)]


def test_a_message_requeued_twice_still_goes_back_to_its_place():
    clock = Clock()
    q = queue(clock)
    for i in range(1, 5):
        q.publish(m(str(i)), clock())
    m1 = answer(q.get("ch", clock())).message
    m2 = answer(q.get("ch", clock())).message
    q.reject("ch", [m2.id], clock(), requeue=True)
    again = answer(q.get("ch", clock()))
    assert again.message is m2 and again.redelivered
    q.reject("ch", [m1.id, m2.id], clock(), requeue=True)
    assert drain(q, clock) == [("1", True), ("2", True), ("3", False), ("4", False)]


def test_reject_without_requeue_dead_letters_or_drops():
    clock = Clock()
    q = queue(clock, dead_letter_exchange="dlx", dead_letter_routing_key="dead")
    q.publish(m("a", routing_keys=("q",)), clock())
    ok = answer(q.get("ch", clock()))
    [dl] = q.reject("ch", [ok.message.id], clock(), requeue=False)
    assert (dl.reason, dl.exchange, dl.routing_keys, dl.queue, dl.at_ns) == ("rejected", "dlx", ("dead",), "q",
                                                                           clock())
    plain = queue(clock)
    plain.publish(m("a"), clock())
    ok = answer(plain.get("ch", clock()))
    assert plain.reject("ch", [ok.message.id], clock(), requeue=False) == [Forget(ok.message, "rejected")]
    assert plain.statistics().rejected == 1


def test_a_closed_channel_gives_back_what_it_held_in_order_and_loses_its_consumers():
    clock = Clock()
    q = queue(clock)
    for i in range(4):
        q.publish(m(str(i)), clock())
    q.consume("c1", "ch1", clock(), prefetch=2)
    q.consume("c2", "ch2", clock(), prefetch=1)
    assert [a.consumer for a in q.deliver(clock())] == ["c1", "c2", "c1"]
    q.ack("ch2", [2])
    assert q.channel_closed("ch1", clock()) == []
    s = q.statistics()
    assert (s.consumers, s.messages_unacknowledged, s.messages_ready, s.requeued) == (1, 0, 3, 2)
    out = q.deliver(clock())
    assert [(a.message.payload, a.redelivered, a.consumer) for a in out] == [("0", True, "c2")]


def test_a_cancelled_consumers_deliveries_stay_with_its_channel():
    clock = Clock()
    q = queue(clock)
    q.consume("c", "ch", clock())
    d = q.publish(m("a"), clock())[0]
    q.cancel("c", clock())
    assert q.statistics().messages_unacknowledged == 1
    assert q.ack("ch", [d.message.id]) == [Forget(d.message, "acked")]


# -- TTL ----------------------------------------------------------------------------------------------
def test_a_queue_ttl_expires_messages_at_their_deadline_and_never_delivers_them():
    clock = Clock()
    q = queue(clock, message_ttl_ms=100)
    q.publish(m("a"), clock())
    clock.advance(50)
    q.publish(m("b"), clock())
    assert q.next_deadline_ns() == clock() + 50 * MS
    clock.advance(50)                                           # "a" is due now, "b" in 50 ms
    q.consume("c", "ch", clock())
    out = q.deliver(clock())
    assert bodies(out, Forget) == ["a"] and bodies(out) == ["b"]
    assert q.statistics().expired == 1


def test_expire_dead_letters_expired_heads_on_the_shells_timer():
    clock = Clock()
    q = queue(clock, message_ttl_ms=10, dead_letter_exchange="dlx")
    q.publish(m("a", routing_keys=("q", "cc")), clock())
    assert q.expire(clock.advance(9)) == []
    [dl] = q.expire(clock.advance(1))
    assert (dl.reason, dl.routing_keys, dl.routing_key) == ("expired", ("q", "cc"), None)
    assert q.next_deadline_ns() is None


def test_a_per_message_expiration_waits_behind_a_longer_lived_head_as_rabbitmq():
    clock = Clock()
    q = queue(clock, message_ttl_ms=1000)
    q.publish(m("long", expiration_ms=100_000), clock())        # the queue's 1000 ms is the shorter
    q.publish(m("short", expiration_ms=50), clock())
    clock.advance(300)
    assert q.expire(clock()) == []                              # only heads expire
    assert q.next_deadline_ns() == clock() + 700 * MS
    ok, gone = q.get("ch", clock(), no_ack=True)                # the new head is checked after the fetch
    assert (ok.message.payload, ok.remaining) == ("long", 0)
    assert (gone.message.payload, gone.outcome) == ("short", "expired")


def test_ttl_zero_with_nobody_to_take_it_expires_at_once_as_rabbitmq():
    clock = Clock()
    q = queue(clock, message_ttl_ms=0)
    [gone] = q.publish(m("a"), clock())
    assert gone.outcome == "expired" and q.statistics().messages_ready == 0
    dlq = queue(clock, message_ttl_ms=0, dead_letter_exchange="dlx")
    [dl] = dlq.publish(m("a"), clock())
    assert isinstance(dl, DeadLetter) and dl.reason == "expired"
    q.consume("c", "ch", clock())
    assert bodies(q.publish(m("b"), clock())) == ["b"]           # a waiting consumer still gets it
    [gone] = q.publish(m("c"), clock(), room={})                 # one with no room does not
    assert (gone.message.payload, gone.outcome) == ("c", "expired")


def test_an_expiration_of_zero_to_a_busy_consumer_expires_too():
    clock = Clock()
    q = queue(clock)
    q.consume("c", "ch", clock(), prefetch=1)
    q.publish(m("a"), clock())
    [gone] = q.publish(m("b", expiration_ms=0), clock())
    assert gone.outcome == "expired" and gone.message.payload == "b"


# -- max length -------------------------------------------------------------------------------------------
def test_drop_head_drops_the_oldest_and_dead_letters_it_when_there_is_a_dlx():
    clock = Clock()
    q = queue(clock, max_length=2)
    q.publish(m("a"), clock())
    q.publish(m("b"), clock())
    [gone] = q.publish(m("c"), clock())
    assert (gone.message.payload, gone.outcome) == ("a", "dropped")
    dlq = queue(clock, max_length=1, dead_letter_exchange="dlx")
    dlq.publish(m("a"), clock())
    [dl] = dlq.publish(m("b"), clock())
    assert (dl.message.payload, dl.reason) == ("a", "maxlen")


def test_max_length_bytes_counts_ready_bodies_and_drops_a_body_bigger_than_the_limit_as_rabbitmq():
    clock = Clock()
    q = queue(clock, max_length_bytes=10)
    for body in ("aaaa", "bbbb", "cccc", "dddddddddddd"):
        q.publish(m(body), clock())
    assert q.statistics().messages_ready == 0 and q.statistics().dropped == 4


def test_max_length_zero_still_feeds_a_waiting_consumer_with_drop_head_as_rabbitmq():
    clock = Clock()
    q = queue(clock, max_length=0)
    assert bodies(q.publish(m("a"), clock()), Forget) == ["a"]
    q.consume("c", "ch", clock(), no_ack=True)
    assert bodies(q.publish(m("b"), clock())) == ["b"]


def test_reject_publish_nacks_the_publisher_and_never_enqueues_even_for_a_waiting_consumer():
    clock = Clock()
    q = queue(clock, max_length=1, overflow="reject-publish")
    assert q.publish(m("a", publisher="p", seq=1), clock()) == [Confirm("p", 1)]
    nack, gone = q.publish(m("b", publisher="p", seq=2), clock())
    assert nack == Nack("p", 2) and gone.outcome == "rejected"
    zero = queue(clock, max_length=0, overflow="reject-publish")
    zero.consume("c", "ch", clock(), no_ack=True)
    assert [type(a) for a in zero.publish(m("x", publisher="p", seq=3), clock())] == [Nack, Forget]


def test_reject_publish_dlx_nacks_and_dead_letters_the_new_message():
    clock = Clock()
    q = queue(clock, max_length=1, overflow="reject-publish-dlx", dead_letter_exchange="dlx")
    q.publish(m("a"), clock())
    nack, dl = q.publish(m("b", publisher="p", seq=7), clock())
    assert nack == Nack("p", 7) and (dl.message.payload, dl.reason) == ("b", "maxlen")
    assert drain(q, clock) == [("a", False)]


def test_a_priority_queue_over_its_length_drops_its_highest_priority_head_as_rabbitmq():
    clock = Clock()
    q = queue(clock, max_priority=5, max_length=3)
    for i, p in enumerate([1, 5, 1, 3, 0]):
        q.publish(m(f"m{i}p{p}", priority=p), clock())
    assert [b for b, _ in drain(q, clock)] == ["m0p1", "m2p1", "m4p0"]


# -- priorities -------------------------------------------------------------------------------------------
def test_a_priority_queue_serves_high_first_fifo_within_a_level_and_keeps_that_after_requeues():
    clock = Clock()
    q = queue(clock, max_priority=5)
    for i, p in enumerate([1, 5, 1, 3, 0, 9, None]):
        q.publish(m(f"m{i}p{p}", priority=p), clock())
    got = [answer(q.get("ch", clock())).message for _ in range(7)]
    for msg in reversed(got):
        q.reject("ch", [msg.id], clock(), requeue=True)
    assert [b for b, _ in drain(q, clock)] == ["m1p5", "m5p9", "m3p3", "m0p1", "m2p1", "m4p0", "m6pNone"]


def test_priority_is_ignored_without_x_max_priority():
    clock = Clock()
    q = queue(clock)
    for i, p in enumerate([0, 9, 3]):
        q.publish(m(str(i), priority=p), clock())
    assert [b for b, _ in drain(q, clock)] == ["0", "1", "2"]


# -- confirms -----------------------------------------------------------------------------------------------
def test_confirms_come_once_when_safe_or_when_the_queue_is_done_with_the_message():
    clock = Clock()
    q = queue(clock, max_length=1)
    assert q.publish(m("t", publisher="p", seq=1), clock()) == [Confirm("p", 1)]      # transient: at once
    actions = q.publish(m("d", publisher="p", seq=2), clock(), safe=False)           # drops "t"
    assert [type(a) for a in actions] == [Forget]
    assert q.statistics().unconfirmed == 1
    assert q.mark_safe([2]) == [Confirm("p", 2)] and q.mark_safe([2]) == []
    q.publish(m("e", publisher="p", seq=3), clock(), safe=False)                      # drops "d", confirmed
    dropped = q.publish(m("f", publisher="p", seq=4), clock(), safe=False)            # drops "e" before safe
    assert dropped == [Forget(dropped[0].message, "dropped"), Confirm("p", 3)]
    assert q.mark_safe([3, 4]) == [Confirm("p", 4)]


def test_a_delivered_and_acked_message_is_confirmed_at_the_ack_if_not_safe_before():
    clock = Clock()
    q = queue(clock)
    q.consume("c", "ch", clock())
    [d] = q.publish(m("a", publisher="p", seq=9), clock(), safe=False)
    assert q.ack("ch", [d.message.id]) == [Forget(d.message, "acked"), Confirm("p", 9)]


# -- lifecycle ----------------------------------------------------------------------------------------------
def test_auto_delete_asks_for_deletion_when_the_last_consumer_goes_after_having_had_one():
    clock = Clock()
    q = queue(clock, auto_delete=True)
    assert q.get("ch", clock()) == [GetEmpty("ch")]             # no consumer yet: nothing to delete
    q.consume("a", "ch1", clock())
    q.consume("b", "ch2", clock())
    assert q.cancel("a", clock()) == ()
    assert q.channel_closed("ch2", clock()) == [DeleteQueue("auto_delete")]


def test_x_expires_counts_from_the_last_use_and_not_while_consumed():
    clock = Clock()
    q = queue(clock, expires_ms=1000)
    assert q.next_deadline_ns() == clock() + 1000 * MS
    clock.advance(600)
    q.get("ch", clock())                                        # a basic.get is a use
    clock.advance(600)
    assert q.expire(clock()) == []
    q.touch(clock())                                            # so is a declare
    q.consume("c", "ch", clock())
    assert q.next_deadline_ns() is None
    clock.advance(5000)
    q.cancel("c", clock())
    assert q.expire(clock.advance(999)) == []
    assert q.expire(clock.advance(1)) == [DeleteQueue("expires")]
    assert q.expire(clock.advance(1)) == [] and q.next_deadline_ns() is None


def test_a_deleted_queue_does_not_ask_to_be_deleted_again_when_its_x_expires_runs_out():
    clock = Clock()
    q = queue(clock, expires_ms=1000)
    q.consume("c", "ch", clock())
    clock.advance(5000)
    q.delete(clock())                   # its consumer goes with it: nothing keeps x-expires from running
    assert q.next_deadline_ns() is None
    assert q.expire(clock.advance(2000)) == []


def test_purge_forgets_ready_messages_only():
    clock = Clock()
    q = queue(clock)
    for b in "abc":
        q.publish(m(b), clock())
    q.get("ch", clock())
    count, actions = q.purge(clock())
    assert count == 2 and bodies(actions, Forget) == ["b", "c"]
    assert q.statistics().messages_unacknowledged == 1


def test_delete_checks_if_empty_then_if_unused_as_rabbitmq_and_then_forgets_everything():
    clock = Clock()
    q = queue(clock, name="x3")
    q.publish(m("a", publisher="p", seq=1), clock(), safe=False)
    q.publish(m("b"), clock())
    q.consume("c", "ch", clock(), prefetch=1)
    q.deliver(clock())
    with pytest.raises(QueueNotEmpty, match=re.escape("PRECONDITION_FAILED - queue 'x3' in vhost '/' not empty")):
        q.delete(clock(), if_empty=True, if_unused=True)
    with pytest.raises(QueueInUse, match=re.escape("PRECONDITION_FAILED - queue 'x3' in vhost '/' in use")):
        q.delete(clock(), if_unused=True)
    assert not q.deleted                # refused deletions leave it as it was
    count, actions = q.delete(clock())
    assert q.deleted
    assert count == 1
    assert [(type(a).__name__, getattr(a, "outcome", None)) for a in actions] == [
        ("Forget", "deleted"), ("Forget", "deleted"), ("Confirm", None)]
    with pytest.raises(ShellMisuse):
        q.publish(m("c"), clock())


def test_ids_start_where_the_shell_says_and_a_restarted_queue_restores_its_backlog_first():
    clock = Clock()
    q = queue(clock, first_id=1000)
    q.restore(Message("old-1", 1, id=7, redelivered=True))
    q.restore(Message("old-2", 1, id=9))
    with pytest.raises(ShellMisuse):
        q.restore(Message("late", 1, id=8))
    assert q.publish(m("new"), clock()) == () and q.statistics().restored == 2
    assert drain(q, clock) == [("old-1", True), ("old-2", False), ("new", False)]


# -- dead-letter headers and cycles ---------------------------------------------------------------------------
T0 = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
NOW_S = 1_700_000_000
NOW = datetime.datetime.fromtimestamp(NOW_S, datetime.UTC)


def test_the_first_death_writes_x_death_and_the_first_death_headers_as_rabbitmq():
    death = Death("t2", "rejected", "", ("t2", "cc1"), NOW_S, "60000")
    out = record_death({"CC": ["cc1"], "zz": 1}, death, drop_cc=True)
    assert list(out) == ["x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason", "zz"]
    assert out["x-death"] == [{"count": 1, "reason": "rejected", "queue": "t2", "time": NOW, "exchange": "",
                               "routing-keys": ["t2", "cc1"], "original-expiration": "60000"}]
    assert list(out["x-death"][0]) == ["count", "reason", "queue", "time", "exchange", "routing-keys",
                                       "original-expiration"]
    assert (out["x-first-death-reason"], out["x-first-death-queue"]) == ("rejected", "t2")


def test_a_repeated_death_counts_up_keeps_the_old_entry_and_moves_it_first_as_rabbitmq():
    old = [{"count": 1, "queue": "B", "reason": "rejected", "time": T0, "exchange": "e", "routing-keys": ["b"]},
           {"count": 5, "queue": "s5", "reason": "rejected", "time": T0, "exchange": "old", "routing-keys": ["old"]}]
    out = record_death({"x-death": old}, Death("s5", "rejected", "", ("s5",), NOW_S))
    assert out["x-death"] == [
        {"count": 6, "exchange": "old", "queue": "s5", "reason": "rejected", "routing-keys": ["old"], "time": T0},
        old[0]]
    assert "x-first-death-queue" not in out


def test_a_new_death_goes_first_after_rabbitmqs_grouping_which_reverses_the_rest():
    old = [{"count": 3, "queue": "A", "reason": "expired", "time": T0, "exchange": "e", "routing-keys": ["a"]},
           {"count": 1, "queue": "B", "reason": "rejected", "time": T0, "exchange": "e", "routing-keys": ["b"]},
           {"queue": "A", "reason": "expired", "time": T0, "exchange": "e2", "routing-keys": ["a2"]}]
    out = record_death({"x-death": old, "zz": 1, "aa": 2}, Death("s5", "rejected", "", ("s5",), NOW_S))
    assert list(out) == ["aa", "x-death", "zz"]
    assert out["x-death"] == [
        {"count": 1, "exchange": "", "queue": "s5", "reason": "rejected", "routing-keys": ["s5"], "time": NOW},
        old[1], old[0]]


def test_an_x_death_that_is_not_an_array_is_replaced():
    out = record_death({"x-death": "oops"}, Death("s5", "rejected", "", ("s5",), NOW_S))
    assert out == {"x-death": [{"count": 1, "reason": "rejected", "queue": "s5", "time": NOW, "exchange": "",
                                "routing-keys": ["s5"]}]}


def test_a_dead_letter_action_describes_its_death():
    clock = Clock()
    q = queue(clock, name="t1", message_ttl_ms=0, dead_letter_exchange="dlx")
    [dl] = q.publish(m("a", exchange="ex", routing_keys=("k", "cc")), clock())
    assert dl.death(NOW_S, "50") == Death("t1", "expired", "ex", ("k", "cc"), NOW_S, "50")


def test_an_automatic_loop_back_into_a_queue_is_dropped_and_a_rejection_breaks_it_as_rabbitmq():
    once = record_death(None, Death("c1", "expired", "", ("c1",), NOW_S))
    assert dead_letter_cycles("expired", once, ["c1", "watch"]) == (["watch"], ["c1"])
    rejected = record_death(None, Death("c2", "rejected", "", ("c2",), NOW_S))
    assert dead_letter_cycles("rejected", rejected, ["c2"]) == (["c2"], [])
    a_then_b = record_death(once, Death("B", "expired", "", ("B",), NOW_S))
    assert dead_letter_cycles("expired", a_then_b, ["c1", "B"]) == ([], ["c1", "B"])
    through_a_reject = record_death(rejected, Death("B", "maxlen", "", ("B",), NOW_S))
    assert dead_letter_cycles("maxlen", through_a_reject, ["c2"]) == (["c2"], [])


# -- arguments, as a RabbitMQ 3.10.8 node answered ---------------------------------------------------------------
@pytest.mark.parametrize("arguments, text", [
    ({"x-max-length": -1}, "invalid arg 'x-max-length' for queue 'q' in vhost '/': {value_negative,-1}"),
    ({"x-max-length": "5"}, "invalid arg 'x-max-length' for queue 'q' in vhost '/': \"expected integer, got longstr\""),
    ({"x-max-length": True}, "invalid arg 'x-max-length' for queue 'q' in vhost '/': \"expected integer, got bool\""),
    ({"x-message-ttl": -5}, "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-5}"),
    ({"x-message-ttl": 315360000001},
     "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_too_large,315360000001}"),
    ({"x-expires": 0}, "invalid arg 'x-expires' for queue 'q' in vhost '/': {value_zero,0}"),
    ({"x-expires": -1}, "invalid arg 'x-expires' for queue 'q' in vhost '/': {value_negative,-1}"),
    ({"x-max-priority": 256}, "invalid arg 'x-max-priority' for queue 'q' in vhost '/': {max_value_exceeded,256}"),
    ({"x-overflow": "foo"}, "invalid arg 'x-overflow' for queue 'q' in vhost '/': invalid_overflow"),
    ({"x-overflow": 3}, "invalid arg 'x-overflow' for queue 'q' in vhost '/': {unacceptable_type,signedint}"),
    ({"x-dead-letter-routing-key": "k"},
     "invalid arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': routing_key_but_no_dlx_defined"),
    ({"x-dead-letter-exchange": 5},
     "invalid type 'signedint' for arg 'x-dead-letter-exchange' in queue 'q' in vhost '/'"),
    ({"x-queue-mode": "weird"},
     "invalid arg 'x-queue-mode' for queue 'q' in vhost '/': \"unsupported queue mode 'weird'\""),
    ({"x-queue-type": "nope"},
     "invalid arg 'x-queue-type' for queue 'q' in vhost '/': \"unsupported queue type 'nope'\""),
    ({"x-queue-type": 1}, "invalid arg 'x-queue-type' for queue 'q' in vhost '/': {unacceptable_type,signedint}"),
    ({"x-max-age": "1D"}, "invalid arg 'x-max-age' for queue 'q' in vhost '/' of queue type rabbit_classic_queue"),
    ({"x-delivery-limit": 3, "x-foo": 1},
     "invalid arg 'x-delivery-limit' for queue 'q' in vhost '/' of queue type rabbit_classic_queue"),
    ({"x-dead-letter-routing-key": 5, "x-dead-letter-exchange": "dlx"},
     "invalid arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': {unacceptable_type,signedint}"),
    ({"x-max-length-bytes": -3, "x-max-length": -1},
     "invalid arg 'x-max-length' for queue 'q' in vhost '/': {value_negative,-1}"),
    ({"x-single-active-consumer": "yes"},
     "invalid arg 'x-single-active-consumer' for queue 'q' in vhost '/': {unacceptable_type,longstr}"),
    ({"x-queue-version": 3},
     "invalid arg 'x-queue-version' for queue 'q' in vhost '/': \"unsupported queue version '3'\""),
    ({"x-max-length": Typed("double", 1.5)},
     "invalid arg 'x-max-length' for queue 'q' in vhost '/': \"expected integer, got double\""),
])
def test_invalid_queue_arguments_are_refused_with_rabbitmqs_text(arguments, text):
    with pytest.raises(InvalidArgument) as refused:
        parse_queue_args("q", arguments)
    assert refused.value.reply_text == "PRECONDITION_FAILED - " + text and refused.value.reply_code == 406


def test_valid_queue_arguments_mean_what_rabbitmq_means():
    args = parse_queue_args("q", {"x-message-ttl": 0, "x-expires": 5, "x-max-length": 2 ** 40,
                                  "x-max-length-bytes": 0, "x-overflow": "reject-publish-dlx",
                                  "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "rk",
                                  "x-max-priority": 10, "x-queue-mode": "lazy", "x-queue-type": "classic",
                                  "x-queue-version": 2, "x-foo": "ignored"})
    assert args == QueueArgs(message_ttl_ms=0, expires_ms=5, max_length=2 ** 40, max_length_bytes=0,
                             overflow="reject-publish-dlx", dead_letter_exchange="", dead_letter_routing_key="rk",
                             max_priority=10, queue_mode="lazy", queue_version=2)
    assert parse_queue_args("q", None) == QueueArgs()
    with pytest.raises(InvalidArgument, match="unsupported queue type 'quorum'"):
        parse_queue_args("q", {"x-queue-type": "quorum"})
    assert parse_queue_args("q", {"x-single-active-consumer": True}) == QueueArgs(single_active_consumer=True)
    assert parse_queue_args("q", {"x-single-active-consumer": False}) == QueueArgs()


@pytest.mark.parametrize("current, requested, text", [
    ({}, {"arguments": {"x-message-ttl": 2000}},
     "inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received the value '2000' of type 'signedint' "
     "but current is none"),
    ({}, {"durable": True}, "inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is "
                            "'false'"),
    ({}, {"auto_delete": True}, "inequivalent arg 'auto_delete' for queue 'q' in vhost '/': received 'true' but "
                                "current is 'false'"),
    ({"arguments": {"x-message-ttl": 1000}}, {"arguments": {"x-message-ttl": 2000}},
     "inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '2000' but current is '1000'"),
    ({"arguments": {"x-message-ttl": 1000}}, {},
     "inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received none but current is the value '1000' of "
     "type 'signedint'"),
    ({"arguments": {"x-message-ttl": 1000}}, {"arguments": {"x-message-ttl": "1000"}},
     "inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '1000' but current is '1000'"),
    ({"arguments": {"x-dead-letter-exchange": "dlx"}}, {"arguments": {"x-dead-letter-exchange": "other"}},
     "inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received 'other' but current is 'dlx'"),
    ({"arguments": {}}, {"arguments": {"x-overflow": "drop-head"}},
     "inequivalent arg 'x-overflow' for queue 'q' in vhost '/': received the value 'drop-head' of type 'longstr' but "
     "current is none"),
    ({"arguments": {"x-single-active-consumer": True}}, {"arguments": {"x-single-active-consumer": False}},
     "inequivalent arg 'x-single-active-consumer' for queue 'q' in vhost '/': received 'false' but current is 'true'"),
])
def test_an_inequivalent_redeclare_is_refused_with_rabbitmqs_text(current, requested, text):
    with pytest.raises(InequivalentArgument) as refused:
        check_redeclare(QueueSpec("q", **current), QueueSpec("q", **requested))
    assert refused.value.reply_text == "PRECONDITION_FAILED - " + text


def test_an_equivalent_redeclare_passes_and_an_exclusive_mismatch_is_locked():
    same = {"x-message-ttl": 1000, "x-dead-letter-exchange": "dlx"}
    check_redeclare(QueueSpec("q", arguments=same), QueueSpec("q", arguments={**same, "x-queue-type": "classic",
                                                                               "x-foo": 1}))
    check_redeclare(QueueSpec("q", arguments={"x-max-length": 5}),
                    QueueSpec("q", arguments={"x-max-length": Typed("long", 5)}))
    with pytest.raises(ResourceLocked) as locked:
        check_redeclare(QueueSpec("e1"), QueueSpec("e1", owner="conn-1"))
    assert locked.value.reply_code == 405 and locked.value.reply_text == (
        "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'e1' in vhost '/'. It could be originally "
        "declared on another connection or the exclusive property value does not match that of the original "
        "declaration.")


@pytest.mark.parametrize("expiration, text", [
    ("abc", "invalid expiration 'abc': no_integer"),
    ("-1", "invalid expiration '-1': {value_negative,-1}"),
    ("10x", "invalid expiration '10x': {leftover_string,\"x\"}"),
    ("315360000001", "invalid expiration '315360000001': {value_too_large,315360000001}"),
    (" 5", "invalid expiration ' 5': no_integer"),
])
def test_a_bad_expiration_is_refused_with_rabbitmqs_text(expiration, text):
    with pytest.raises(InvalidExpiration) as refused:
        parse_expiration(expiration)
    assert refused.value.reply_text == "PRECONDITION_FAILED - " + text


def test_expirations_and_consumer_priorities_that_pass():
    assert [parse_expiration(x) for x in (None, "0", "+5", b"60000")] == [None, 0, 5, 60000]
    assert consumer_priority("q", None) == 0 and consumer_priority("q", {"x-priority": -3}) == -3
    with pytest.raises(InvalidArgument, match=re.escape("\"expected integer, got longstr\"")):
        consumer_priority("q", {"x-priority": "high"})


# -- every rule at once ------------------------------------------------------------------------------------
CHANNELS = ("ch1", "ch2", "ch3")
TRANSPORTS = ("r1", "r2")
ALLOWED_FROM = {"acked": {"unacked"}, "expired": {"ready", "new"}, "dropped": {"ready"},
                "rejected": {"unacked", "new"}, "purged": {"ready"}, "deleted": {"ready", "unacked"}}
rooms = st.one_of(st.none(), st.none(), st.dictionaries(st.sampled_from(CHANNELS + TRANSPORTS), st.integers(0, 4)))


def started(machine) -> bool:
    return hasattr(machine, "q")


class QueueMachine(RuleBasedStateMachine):
    """A model of every message's state, checked against each action the core returns."""

    @initialize(ttl=st.sampled_from([None, None, 0, 30, 200]), max_len=st.sampled_from([None, None, 0, 3, 8]),
                max_bytes=st.sampled_from([None, None, 25]),
                overflow=st.sampled_from(["drop-head", "reject-publish", "reject-publish-dlx"]),
                dlx=st.sampled_from([None, "dlx"]), max_priority=st.sampled_from([None, None, 3]))
    def start(self, ttl, max_len, max_bytes, overflow, dlx, max_priority):
        self.t = 5_000 * MS
        self.args = QueueArgs(message_ttl_ms=ttl, max_length=max_len, max_length_bytes=max_bytes, overflow=overflow,
                              dead_letter_exchange=dlx, max_priority=max_priority)
        self.q = Backlog("q", self.t, self.args)
        # id -> "new" | "ready" | ("unacked", channel, consumer or None) | ("gone", how)
        self.state: dict[int, object] = {}
        self.msgs: dict[int, Message] = {}
        self.delivered_before: set[int] = set()
        self.consumers: dict[str, dict] = {}
        self.next_consumer = 0
        self.exclusive = None
        self.limits: dict[str, int] = {}         # the most a channel may hold while permits are out
        self.limiters: dict[str, ChannelLimit] = {}
        self.grants: list[tuple[str, int]] = []  # permits on their way from a limiter to the queue
        self.answers: dict[tuple, list] = {}     # (publisher, seq) -> [Confirm/Nack, ...]
        self.refused: set[tuple] = set()
        self.unsafe: set[int] = set()            # ids whose confirm waits for mark_safe or their end
        self.seq = 0

    # -- the model's view ----------------------------------------------------------------------------------
    def ready(self) -> list[int]:
        return [i for i, s in self.state.items() if s == "ready"]

    def held(self, channel) -> list[int]:
        return [i for i, s in self.state.items() if isinstance(s, tuple) and s[0] == "unacked" and s[1] == channel]

    def head(self) -> int:
        ready = self.ready()
        top = max(self.msgs[i].level for i in ready)
        return min(i for i in ready if self.msgs[i].level == top)

    def ends(self, how) -> int:
        return sum(1 for s in self.state.values() if s == ("gone", how))

    def leave_ready(self, msg, why) -> None:
        assert self.state[msg.id] == "ready", (why, msg, self.state[msg.id])
        assert msg.id == self.head(), f"{why} took {msg.id}, the head is {self.head()}"

    # -- applying the core's actions to the model ---------------------------------------------------------
    def apply(self, actions, *, new=None, room=None) -> None:
        used = {}
        for a in actions:
            if isinstance(a, (Confirm, Nack)):
                key = (a.publisher, a.seq)
                assert not self.answers.get(key), f"{key} answered twice"
                self.answers.setdefault(key, []).append(type(a))
                assert isinstance(a, Confirm) or key in self.refused
                self.unsafe.discard(a.seq)
                continue
            assert not isinstance(a, DeleteQueue), "no auto_delete or x-expires here"
            if isinstance(a, (AskPermits, ReturnPermits)):
                lim = self.limiters[a.channel]
                assert lim.active, "permits asked or given back for a channel without a limit"
                if isinstance(a, AskPermits):
                    self.send(a.channel, lim.want("q", a.want, self.consumer_held(a.channel)))
                else:
                    self.send(a.channel, lim.give_back("q", a.count, self.consumer_held(a.channel)))
                continue
            if isinstance(a, GetEmpty):
                assert not self.ready()
                continue
            msg = a.message
            was = self.state[msg.id]
            if isinstance(a, (Deliver, GetOk)):
                if was == "new":
                    assert isinstance(a, Deliver) and not self.ready(), "straight to a consumer past a backlog"
                else:
                    self.leave_ready(msg, "a delivery")
                    assert msg.expires_ns is None or self.t < msg.expires_ns, "delivered after its expiry"
                assert a.redelivered == (msg.id in self.delivered_before)
                self.delivered_before.add(msg.id)
                if isinstance(a, Deliver):
                    c = self.consumers[a.consumer]
                    mine = [i for i in self.held(c["channel"]) if self.state[i][2] == a.consumer]
                    theirs = [i for i in self.held(c["channel"]) if self.state[i][2] is not None]
                    if c["prefetch"] and not c["no_ack"]:
                        assert len(mine) < c["prefetch"], "over the consumer's prefetch"
                    if self.limits.get(c["channel"]):
                        assert len(theirs) < self.limits[c["channel"]], "over the channel's limit"
                    lim = self.limiters.get(c["channel"])
                    if lim is not None and lim.active and not c["no_ack"]:
                        lim.used("q")
                    if room is not None:
                        used[c["transport"]] = used.get(c["transport"], 0) + 1
                        assert used[c["transport"]] <= room.get(c["transport"], 0), "over the transport's room"
                    channel, consumer = c["channel"], a.consumer
                else:
                    channel, consumer = a.channel, None
                if a.no_ack:
                    self.state[msg.id] = ("gone", "acked")
                else:
                    self.state[msg.id] = ("unacked", channel, consumer)
                continue
            how = a.outcome if isinstance(a, Forget) else "dead_lettered"
            source = was if isinstance(was, str) else was[0]
            if isinstance(a, Forget):
                assert source in ALLOWED_FROM[how], (how, was)
            else:
                assert a.exchange == self.args.dead_letter_exchange is not None
                assert (a.reason, source) in {("expired", "ready"), ("expired", "new"), ("maxlen", "ready"),
                                              ("maxlen", "new"), ("rejected", "unacked")}, (a.reason, was)
            reason = a.outcome if isinstance(a, Forget) else a.reason
            if source == "ready" and reason in ("expired", "dropped", "maxlen"):
                self.leave_ready(msg, reason)
            if reason == "expired":
                assert msg.expires_ns is not None and self.t >= msg.expires_ns, "expired early"
            self.state[msg.id] = ("gone", how)
        if new is not None:
            assert self.state[new.id] != "new", "a publish left its message nowhere"
        for channel, lim in self.limiters.items():
            if lim.waiting:
                self.send(channel, lim.settled(self.consumer_held(channel)))
            if not lim.out:
                self.limits[channel] = lim.limit

    def consumer_held(self, channel) -> int:
        return sum(1 for i in self.held(channel) if self.state[i][2] is not None)

    def send(self, channel, grants) -> None:
        self.grants.extend((channel, n) for _, n in grants)

    # -- rules -----------------------------------------------------------------------------------------------
    @precondition(started)
    @rule(batch=st.lists(st.tuples(st.integers(0, 12), st.sampled_from([None, 0, 1, 2, 5]),
                                   st.sampled_from([None, None, None, 0, 20, 100]),
                                   st.sampled_from(["none", "safe", "unsafe"])), min_size=1, max_size=4),
          room=rooms)
    def publish_some(self, batch, room):
        for size, priority, expiration, confirm in batch:
            self.publish(size, priority, expiration, confirm, room)

    def publish(self, size, priority, expiration, confirm, room):
        self.seq += 1
        publisher = None if confirm == "none" else "p"
        msg = Message(f"m{self.seq}", size, priority=priority, expiration_ms=expiration, publisher=publisher,
                      seq=self.seq)
        ready = self.ready()
        a = self.args
        over = ((a.max_length is not None and len(ready) + 1 > a.max_length) or
                (a.max_length_bytes is not None and sum(self.msgs[i].size for i in ready) + size > a.max_length_bytes))
        refused = a.overflow != "drop-head" and over
        if refused and publisher:
            self.refused.add(("p", self.seq))
        given = None if room is None else dict(room)
        actions = self.q.publish(msg, self.t, safe=confirm != "unsafe", room=room)
        self.msgs[msg.id] = msg
        assert msg.id == len(self.msgs)
        ttls = [x for x in (a.message_ttl_ms, expiration) if x is not None]
        assert msg.expires_ns == (self.t + min(ttls) * MS if ttls else None)
        assert msg.level == (min(priority or 0, a.max_priority) if a.max_priority else 0)
        direct = any(isinstance(x, Deliver) and x.message is msg for x in actions)
        self.state[msg.id] = "new" if refused or direct or (a.message_ttl_ms == 0 and a.dead_letter_exchange is None) \
            else "ready"
        if confirm == "unsafe" and not refused:
            self.unsafe.add(self.seq)
        self.apply(actions, new=msg, room=given)

    def holding(self) -> list[str]:
        return [ch for ch in CHANNELS if self.held(ch)]

    @precondition(lambda self: started(self) and len(self.consumers) < 4)
    @rule(channel=st.sampled_from(CHANNELS), transport=st.sampled_from([None, "r1", "r2"]), no_ack=st.booleans(),
          prefetch=st.sampled_from([0, 0, 1, 3]), priority=st.sampled_from([0, 0, 1]),
          exclusive=st.sampled_from([False, False, False, True]))
    def consume(self, channel, transport, no_ack, prefetch, priority, exclusive):
        self.next_consumer += 1
        key = f"c{self.next_consumer}"
        refused = self.exclusive is not None or (exclusive and bool(self.consumers))
        try:
            self.q.consume(key, channel, self.t, no_ack=no_ack, prefetch=prefetch, priority=priority,
                           exclusive=exclusive, transport=transport)
        except AccessRefused:
            assert refused
            return
        assert not refused
        self.consumers[key] = {"channel": channel, "transport": transport or channel, "no_ack": no_ack,
                               "prefetch": prefetch}
        if exclusive:
            self.exclusive = key

    @precondition(lambda self: started(self) and self.consumers)
    @rule(data=st.data())
    def cancel(self, data):
        key = data.draw(st.sampled_from(sorted(self.consumers)))
        del self.consumers[key]
        if self.exclusive == key:
            self.exclusive = None
        self.apply(self.q.cancel(key, self.t))

    @precondition(started)
    @rule(channel=st.sampled_from(CHANNELS), limit=st.sampled_from([0, 1, 1, 2]))
    def set_channel_prefetch(self, channel, limit):
        for ch, n in [g for g in self.grants if g[0] == channel]:   # ahead of it on the channel's ring
            self.q.grant(ch, n)
        self.grants = [g for g in self.grants if g[0] != channel]
        lim = self.limiters.setdefault(channel, ChannelLimit())
        old = self.limits.get(channel, 0)
        self.send(channel, lim.set_limit(limit, self.consumer_held(channel)))
        self.q.set_channel_prefetch(channel, limit)
        self.limits[channel] = max(old, limit) if old and limit else limit

    @precondition(lambda self: started(self) and self.grants)
    @rule()
    def permits_arrive(self):
        channel, n = self.grants.pop(0)
        self.q.grant(channel, n)

    @precondition(lambda self: started(self) and self.ready() and self.consumers)
    @rule(room=rooms)
    def deliver(self, room):
        given = None if room is None else dict(room)
        self.apply(self.q.deliver(self.t, room), room=given)

    @precondition(lambda self: started(self) and self.ready())
    @rule(channel=st.sampled_from(CHANNELS), no_ack=st.booleans())
    def get(self, channel, no_ack):
        actions = self.q.get(channel, self.t, no_ack=no_ack)
        got = answer(actions)
        self.apply(actions)
        if isinstance(got, GetOk):
            assert got.remaining == len(self.ready())

    @precondition(lambda self: started(self) and self.holding())
    @rule(data=st.data(), stale=st.booleans())
    def ack(self, data, stale):
        channel = data.draw(st.sampled_from(self.holding()))
        ids = data.draw(st.lists(st.sampled_from(self.held(channel)), unique=True))
        if stale:
            ids = ids + [i for i in self.held("ch1" if channel != "ch1" else "ch2")][:1] + [10_000]
        self.apply(self.q.ack(channel, ids))

    @precondition(lambda self: started(self) and self.holding())
    @rule(data=st.data(), requeue=st.booleans())
    def reject(self, data, requeue):
        channel = data.draw(st.sampled_from(self.holding()))
        ids = data.draw(st.permutations(self.held(channel)))[:data.draw(st.integers(1, 4))]
        actions = self.q.reject(channel, ids, self.t, requeue=requeue)
        if requeue:
            self.put_back(ids)
        self.apply(actions)

    def put_back(self, ids) -> None:
        """A requeue returns no action: the messages are simply ready again."""
        for i in ids:
            self.state[i] = "ready"

    @precondition(lambda self: started(self) and self.holding())
    @rule(data=st.data(), rarely=st.integers(0, 2))
    def recover(self, data, rarely):
        if rarely:
            return
        channel = data.draw(st.sampled_from(self.holding()))
        held = self.held(channel)
        actions = self.q.recover(channel, self.t)
        self.put_back(held)
        self.apply(actions)

    @precondition(lambda self: started(self) and (self.consumers or self.holding()))
    @rule(channel=st.sampled_from(CHANNELS), rarely=st.integers(0, 3))
    def channel_closed(self, channel, rarely):
        if rarely:
            return
        for key in [k for k, c in self.consumers.items() if c["channel"] == channel]:
            del self.consumers[key]
            if self.exclusive == key:
                self.exclusive = None
        self.limits.pop(channel, None)
        self.limiters.pop(channel, None)
        self.grants = [g for g in self.grants if g[0] != channel]
        held = self.held(channel)
        actions = self.q.channel_closed(channel, self.t)
        self.put_back(held)
        self.apply(actions)
        assert not self.held(channel)

    @precondition(started)
    @rule(ms=st.integers(0, 60))
    def time_passes(self, ms):
        self.t += ms * MS
        due = self.q.next_deadline_ns()
        self.apply(self.q.expire(self.t))
        if due is not None and due <= self.t:
            assert not self.ready() or self.msgs[self.head()].expires_ns is None \
                or self.msgs[self.head()].expires_ns > self.t

    @precondition(lambda self: started(self) and self.unsafe)
    @rule(data=st.data())
    def mark_safe(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.unsafe)), unique=True))
        confirms = self.q.mark_safe(seqs)            # seq == id here: one publish, one id
        assert sorted(c.seq for c in confirms) == sorted(seqs)
        self.apply(confirms)

    @precondition(lambda self: started(self) and self.ready())
    @rule(rarely=st.integers(0, 5))
    def purge(self, rarely):
        if rarely:
            return
        count, actions = self.q.purge(self.t)
        assert count == len(self.ready()) == len(actions) - sum(isinstance(a, Confirm) for a in actions)
        self.apply(actions)
        assert not self.ready()

    # -- invariants -------------------------------------------------------------------------------------------
    @precondition(started)
    @invariant()
    def every_message_is_in_exactly_one_place_and_the_statistics_add_up(self):
        s = self.q.statistics()
        ready = self.ready()
        unacked = [i for i, st_ in self.state.items() if isinstance(st_, tuple) and st_[0] == "unacked"]
        assert "new" not in self.state.values()
        assert (s.messages_ready, s.messages_unacknowledged) == (len(ready), len(unacked))
        assert s.message_bytes_ready == sum(self.msgs[i].size for i in ready)
        assert s.message_bytes_unacknowledged == sum(self.msgs[i].size for i in unacked)
        assert s.consumers == len(self.consumers) and s.published == len(self.msgs)
        # what the shell reads every turn instead of the whole statistics
        assert (self.q.ready, self.q.held, self.q.consuming) == (len(ready), len(ready) + len(unacked),
                                                                 bool(self.consumers))
        for how in ("acked", "expired", "dead_lettered", "dropped", "rejected", "purged", "deleted"):
            assert getattr(s, how) == self.ends(how), how
        assert s.published == len(ready) + len(unacked) + sum(
            getattr(s, how) for how in ("acked", "expired", "dead_lettered", "dropped", "rejected", "purged",
                                        "deleted"))
        assert s.unconfirmed == len(self.unsafe)

    @precondition(started)
    @invariant()
    def the_next_deadline_is_the_heads_expiry(self):
        due = self.q.next_deadline_ns()
        assert due == (self.msgs[self.head()].expires_ns if self.ready() else None)

    def teardown(self):
        if not started(self):
            return
        self.apply(self.q.delete(self.t)[1])
        assert all(s[0] == "gone" for s in self.state.values())
        for msg in self.msgs.values():
            if msg.publisher is not None:
                answers = self.answers.get(("p", msg.seq), [])
                assert len(answers) == 1, f"publish {msg.seq} answered {answers}"


QueueMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestQueueMachine = QueueMachine.TestCase
