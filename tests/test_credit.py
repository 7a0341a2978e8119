"""The credit-flow core, one rule per test (SPEC §2; rabbitmq-internals §9 scenarios 1-9)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from ipc.credit import (DEFAULT_CREDIT, STATE_CHANGE_INTERVAL_NS, CreditFlow, CreditSpec, Grant,
                        InvalidCreditSpec)

S = 1_000_000_000


def test_the_send_that_spends_the_last_credit_blocks():
    c = CreditFlow(DEFAULT_CREDIT)
    for _ in range(399):
        c.send("ch", 0)
    assert not c.blocked
    c.send("ch", 0)
    assert c.blocked and c.credit_towards("ch") == 0
    c.send("ch", 0)
    assert c.credit_towards("ch") == -1
    assert c.statistics(0).blocked_by == ("ch",), "only the 1 -> 0 send adds a blocker"


def test_a_receiver_grants_more_after_every_more_after_acks():
    r = CreditFlow(DEFAULT_CREDIT)
    grants_at = []
    for i in range(1, 601):
        for g in r.ack("reader"):
            grants_at.append((i, g))
    assert grants_at == [(200, Grant("reader", 200)), (400, Grant("reader", 200)), (600, Grant("reader", 200))]


def test_bump_arithmetic_unblocks_only_when_credit_turns_positive():
    c = CreditFlow(CreditSpec(400, 200))
    c.send("q", 0, n=400)
    assert c.blocked
    c.handle_bump("q", 200, 1)
    assert not c.blocked and c.credit_towards("q") == 200

    d = CreditFlow(CreditSpec(400, 200))
    d.send("q", 0, n=650)
    assert d.credit_towards("q") == -250
    d.handle_bump("q", 200, 1)
    assert d.blocked and d.credit_towards("q") == -50
    d.handle_bump("q", 200, 2)
    assert not d.blocked and d.credit_towards("q") == 150


def test_a_blocked_granter_defers_grants_until_it_unblocks():
    spec = CreditSpec(4, 2)
    channel = CreditFlow(spec)
    channel.send("queue", 0, n=4)                 # the queue holds the channel blocked
    assert channel.blocked
    assert channel.ack("reader", n=2) == ()       # would grant, but it is blocked itself
    assert channel.ack("reader", n=2) == ()
    assert channel.statistics(0).deferred_grants == 4
    released = channel.handle_bump("queue", 2, 1)
    assert released == [Grant("reader", 4)], "every deferred grant goes out in the same step"
    assert channel.statistics(1).deferred_grants == 0


def test_every_blocker_must_clear_before_deferred_grants_flow():
    c = CreditFlow(CreditSpec(1, 1))
    c.send("q1", 0)
    c.send("q2", 0)
    assert c.ack("reader") == ()
    assert c.handle_bump("q1", 1, 1) == ()
    assert c.blocked
    assert c.handle_bump("q2", 1, 2) == [Grant("reader", 1)]
    assert not c.blocked


def test_peer_down_unblocks_flushes_and_forgets_the_peer():
    c = CreditFlow(CreditSpec(2, 1))
    c.send("q", 0, n=2)
    assert c.ack("reader") == ()
    assert c.peer_down("q", 5) == [Grant("reader", 1)]
    assert not c.blocked
    assert c.credit_towards("q") == 2, "a later send starts again from InitialCredit"
    c.send("q", 6)
    assert c.credit_towards("q") == 1


def test_state_window_is_measured_from_the_block_start():
    c = CreditFlow(CreditSpec(1, 1))
    assert c.state(0) == "running"
    c.send("q", 10 * S)
    assert c.state(10 * S) == "flow"
    c.handle_bump("q", 1, 10 * S + S // 2)
    assert c.state(10 * S + S // 2) == "flow", "unblocked 0.5 s after the block started"
    assert c.state(10 * S + STATE_CHANGE_INTERVAL_NS) == "running"

    long = CreditFlow(CreditSpec(1, 1))
    long.send("q", 0)
    long.handle_bump("q", 1, 10 * S)
    assert long.state(10 * S) == "running", "blocked 10 s, then unblocked: running at once"


def test_zero_zero_disables_credit_flow():
    c = CreditFlow(CreditSpec(0, 0))
    grants = []
    for _ in range(10_000):
        c.send("ch", 0)
        grants += c.ack("reader")
    assert not c.blocked and grants == []
    assert CreditSpec(0, 0).disabled


@pytest.mark.parametrize("text, reason", [
    ("100,200", "MoreCreditAfter \\(200\\) must not exceed InitialCredit \\(100\\)"),
    ("-1,0", "must not be negative"),
    ("1.5,1", "whole numbers"),
    ("abc", "expected InitialCredit,MoreCreditAfter"),
    ("4,x", "whole numbers"),
])
def test_invalid_specs_are_refused_with_a_clear_message(text, reason):
    with pytest.raises(InvalidCreditSpec, match=reason):
        CreditSpec.parse(text)


def test_valid_specs_parse():
    assert CreditSpec.parse("{400,200}") == DEFAULT_CREDIT
    assert CreditSpec.parse(" 0 , 0 ") == CreditSpec(0, 0)
    with pytest.raises(InvalidCreditSpec):
        CreditSpec(True, 0)


def test_per_peer_spec_overrides_the_default():
    c = CreditFlow(CreditSpec(2, 1))
    c.set_peer_spec("store", CreditSpec(4000, 800))
    c.send("store", 0, n=3999)
    assert not c.blocked
    c.send("store", 0)
    assert c.blocked


@given(spec=st.tuples(st.integers(0, 50), st.integers(0, 50)).filter(lambda t: t[1] <= t[0]),
       steps=st.lists(st.tuples(st.sampled_from(["send", "ack", "bump"]), st.integers(1, 40)), max_size=60))
def test_a_batch_of_n_equals_n_single_calls(spec, steps):
    one, many = CreditFlow(CreditSpec(*spec)), CreditFlow(CreditSpec(*spec))
    for t, (op, n) in enumerate(steps):
        if op == "send":
            for _ in range(n):
                one.send("p", t)
            many.send("p", t, n=n)
        elif op == "ack":
            single = sum(g.amount for _ in range(n) for g in one.ack("p"))
            batched = sum(g.amount for g in many.ack("p", n=n))
            assert single == batched
        else:
            a = sum(g.amount for g in one.handle_bump("p", n, t))
            b = sum(g.amount for g in many.handle_bump("p", n, t))
            assert a == b
        s1, s2 = one.statistics(t), many.statistics(t)
        assert (s1.blocked, s1.credit_from, s1.credit_to, s1.deferred_grants) == \
               (s2.blocked, s2.credit_from, s2.credit_to, s2.deferred_grants)


def test_walked_example_exactly_four_get_past_the_channel():
    """{2,1}, the queue paused, 100 publishes: the reader checks ``blocked`` before each send."""
    spec = CreditSpec(2, 1)
    reader, channel = CreditFlow(spec), CreditFlow(spec)
    to_channel, to_queue, to_reader = [], [], []
    published = 0
    for _ in range(1000):
        progressed = False
        if published < 100 and not reader.blocked:
            reader.send("channel", 0)
            to_channel.append(published)
            published += 1
            progressed = True
        while to_reader:
            reader.handle_bump("channel", to_reader.pop(0), 0)
            progressed = True
        if to_channel:
            msg = to_channel.pop(0)
            to_reader += [g.amount for g in channel.ack("reader")]
            channel.send("queue", 0)
            to_queue.append(msg)
            progressed = True
        if not progressed:
            break
    assert len(to_queue) == 4
    assert reader.blocked and reader.state(0) == "flow"
    assert published == 4
