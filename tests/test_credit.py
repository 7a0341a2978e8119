"""The credit-flow core, one rule per test (SPEC §2; rabbitmq-internals §9 scenarios 1-9)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings, strategies as st

from ipc.credit import (DEFAULT_CREDIT, MSG_STORE_CREDIT_DISC_BOUND, NO_GRANTS, STATE_CHANGE_INTERVAL_NS,
                        CreditFlow, CreditSpec, Grant, InvalidCreditSpec)
from ipc.errors import IpcError

S = 1_000_000_000


def total(grants) -> int:
    return sum(g.amount for g in grants)


# -- sender side -----------------------------------------------------------------------
def test_the_send_that_spends_the_last_credit_blocks():
    c = CreditFlow(DEFAULT_CREDIT)
    for _ in range(399):
        c.send("ch", 0)
    assert not c.blocked and c.credit_towards("ch") == 1
    c.send("ch", 0)
    assert c.blocked and c.credit_towards("ch") == 0
    c.send("ch", 0)
    assert c.credit_towards("ch") == -1
    assert c.statistics(0).blocked_by == ("ch",), "only the 1 -> 0 send adds a blocker"


def test_with_initial_credit_one_the_first_send_blocks():
    c = CreditFlow(CreditSpec(1, 1))
    c.send("ch", 0)
    assert c.blocked


def test_credit_towards_a_peer_never_sent_to_is_the_initial_credit():
    c = CreditFlow(CreditSpec(7, 3))
    assert c.credit_towards("anyone") == 7
    assert c.statistics(0).credit_from == {}


# -- receiver side ---------------------------------------------------------------------
def test_a_receiver_grants_more_after_every_more_after_acks():
    r = CreditFlow(DEFAULT_CREDIT)
    grants_at = []
    for i in range(1, 601):
        for g in r.ack("reader"):
            grants_at.append((i, g))
    assert grants_at == [(200, Grant("reader", 200)), (400, Grant("reader", 200)), (600, Grant("reader", 200))]


def test_an_ack_that_grants_nothing_returns_the_shared_empty_result():
    r = CreditFlow(DEFAULT_CREDIT)
    assert r.ack("reader") is NO_GRANTS and NO_GRANTS == ()


def test_each_sender_has_its_own_countdown():
    r = CreditFlow(CreditSpec(4, 2))
    assert r.ack("a") == () and r.ack("b") == ()
    assert r.ack("a") == [Grant("a", 2)]
    assert r.statistics(0).credit_to == {"a": 2, "b": 1}


# -- bumps -------------------------------------------------------------------------------
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


def test_a_bump_from_an_unknown_peer_counts_from_zero_and_is_a_harmless_unblock():
    c = CreditFlow(CreditSpec(2, 1))
    c.send("q", 0, n=2)
    assert c.handle_bump("stranger", 5, 1) == ()
    assert c.blocked, "another peer's bump does not lift q's block"
    assert c.credit_towards("stranger") == 5, "unknown credit counts as 0, not InitialCredit"

    e = CreditFlow(CreditSpec(2, 1))
    e.block("x", 0)                       # an explicit blocker named like a peer we never sent to
    assert e.ack("reader") == ()
    assert e.handle_bump("x", 1, 1) == [Grant("reader", 1)], "C=0, C+More>0: unblock(x) flushes"
    assert not e.blocked


def test_a_bump_to_credit_that_was_still_positive_unblocks_nothing():
    c = CreditFlow(CreditSpec(4, 2))
    c.send("q", 0)
    c.block("q", 0)                       # an explicit blocker under the same key
    assert c.handle_bump("q", 2, 1) == ()
    assert c.blocked and c.credit_towards("q") == 5, "only a bump from <= 0 to > 0 unblocks"


# -- deferral: back-pressure travels upstream ---------------------------------------------
def test_a_blocked_granter_defers_grants_until_it_unblocks():
    """R -> C -> Q: while Q holds C, C's acks of R's messages grant nothing and R stays blocked."""
    spec = CreditSpec(4, 2)
    reader, channel, queue = CreditFlow(spec), CreditFlow(spec), CreditFlow(spec)
    to_channel, to_queue = deque(), deque()

    for m in range(4):                         # the reader spends all its credit
        reader.send("C", 0)
        to_channel.append(m)
    assert reader.blocked
    channel.send("Q", 0, n=4)                  # earlier traffic used up C's credit towards a stalled Q
    assert channel.blocked

    back_to_reader = []
    while to_channel:
        to_queue.append(to_channel.popleft())
        back_to_reader += channel.ack("R")     # ack on dequeue, then forward (credit goes negative)
        channel.send("Q", 0)
    assert back_to_reader == [], "a blocked channel withholds the reader's credit"
    assert channel.deferred_towards("R") == 4 and channel.statistics(0).deferred_grants == 4
    assert reader.blocked and channel.credit_towards("Q") == -4

    grants_for_channel = []
    for _ in range(8):                         # Q catches up: 4 old + 4 forwarded messages
        grants_for_channel += queue.ack("C")
    released = []
    for g in grants_for_channel:
        released += channel.handle_bump("Q", g.amount, 1)
    assert channel.credit_towards("Q") == 4 and not channel.blocked
    assert released == [Grant("R", 4)], "every deferred grant goes out in the same step"
    assert channel.statistics(1).deferred_grants == 0
    reader.handle_bump("C", released[0].amount, 1)
    assert not reader.blocked and reader.credit_towards("C") == 4


def test_every_blocker_must_clear_before_deferred_grants_flow():
    c = CreditFlow(CreditSpec(1, 1))
    c.send("q1", 0)
    c.send("q2", 0)
    assert c.ack("reader") == ()
    assert c.handle_bump("q1", 1, 1) == ()
    assert c.blocked and c.statistics(1).blocked_by == ("q2",)
    assert c.statistics(1).deferred_grants == 1, "still held"
    assert c.handle_bump("q2", 1, 2) == [Grant("reader", 1)]
    assert not c.blocked


def test_a_second_blocker_does_not_restart_the_block():
    c = CreditFlow(CreditSpec(1, 1))
    c.send("q1", 0)
    c.send("q2", 5 * S)
    c.handle_bump("q1", 1, 5 * S)
    c.handle_bump("q2", 1, 5 * S + S // 2)
    stats = c.statistics(5 * S + S // 2)
    assert (stats.block_count, stats.block_started_ns, stats.blocked_total_ns) == (1, 0, 5 * S + S // 2)
    assert c.state(5 * S + S // 2) == "running", "one block, started 5.5 s ago"


def test_explicit_blockers_stack_and_each_needs_its_own_unblock():
    c = CreditFlow(CreditSpec(2, 1))
    c.block("qq", 0)
    c.block("qq", 0)
    assert c.ack("reader") == ()
    assert c.unblock("qq", 1) == () and c.blocked
    assert c.unblock("qq", 2) == [Grant("reader", 1)] and not c.blocked
    assert c.unblock("qq", 3) == (), "unblocking a key that is not there changes nothing"


# -- peer_down --------------------------------------------------------------------------
def test_peer_down_unblocks_flushes_and_forgets_the_peer():
    c = CreditFlow(CreditSpec(2, 1))
    c.send("q", 0, n=2)
    assert c.ack("reader") == ()
    assert c.peer_down("q", 5) == [Grant("reader", 1)]
    assert not c.blocked
    assert c.credit_towards("q") == 2, "a later send starts again from InitialCredit"
    c.send("q", 6)
    assert c.credit_towards("q") == 1


def test_peer_down_of_one_blocker_keeps_the_others():
    c = CreditFlow(CreditSpec(1, 1))
    c.send("q1", 0)
    c.send("q2", 0)
    assert c.ack("reader") == ()
    assert c.peer_down("q1", 1) == ()
    assert c.blocked and c.statistics(1).deferred_grants == 1


def test_peer_down_drops_the_grants_deferred_to_that_peer():
    c = CreditFlow(CreditSpec(1, 1))
    c.send("q", 0)
    c.ack("gone")
    c.ack("alive")
    assert c.peer_down("gone", 1) == ()
    assert c.statistics(1).credit_to == {"alive": 1}
    assert c.handle_bump("q", 1, 2) == [Grant("alive", 1)], "nothing is sent to the dead peer"


# -- state and statistics ---------------------------------------------------------------
def test_state_window_is_measured_from_the_block_start():
    c = CreditFlow(CreditSpec(1, 1))
    assert c.state(0) == "running"
    c.send("q", 10 * S)
    assert c.state(10 * S) == "flow"
    c.handle_bump("q", 1, 10 * S + S // 2)
    assert c.state(10 * S + S // 2) == "flow", "unblocked 0.5 s after the block started"
    assert c.state(10 * S + STATE_CHANGE_INTERVAL_NS - 1) == "flow"
    assert c.state(10 * S + STATE_CHANGE_INTERVAL_NS) == "running"

    long = CreditFlow(CreditSpec(1, 1))
    long.send("q", 0)
    assert long.state(10 * S) == "flow", "blocked now reads flow however long ago it started"
    long.handle_bump("q", 1, 10 * S)
    assert long.state(10 * S) == "running", "blocked 10 s, then unblocked: running at once"


def test_statistics_count_blocks_and_time_spent_blocked():
    c = CreditFlow(CreditSpec(1, 1))
    c.send("q", 1 * S)
    mid = c.statistics(3 * S)
    assert (mid.blocked, mid.block_started_ns, mid.blocked_total_ns, mid.block_count, mid.state) == \
           (True, 1 * S, 2 * S, 1, "flow")
    c.handle_bump("q", 1, 4 * S)
    c.send("q", 10 * S)
    c.handle_bump("q", 1, 10 * S + S // 4)
    end = c.statistics(20 * S)
    assert (end.blocked, end.block_started_ns, end.blocked_total_ns, end.block_count, end.state) == \
           (False, 10 * S, 3 * S + S // 4, 2, "running")
    assert end.credit_from == {"q": 1}


# -- {0,0} and configuration ----------------------------------------------------------
def test_zero_zero_disables_credit_flow():
    c = CreditFlow(CreditSpec(0, 0))
    grants = []
    for _ in range(10_000):
        c.send("ch", 0)
        grants += c.ack("reader")
    assert not c.blocked and grants == []
    assert c.credit_towards("ch") == -10_000 and c.statistics(0).credit_to == {"reader": -10_000}
    assert CreditSpec(0, 0).disabled and not DEFAULT_CREDIT.disabled


@pytest.mark.parametrize("text, reason", [
    ("100,200", r"invalid credit spec '100,200': MoreCreditAfter \(200\) must not exceed InitialCredit \(100\)"),
    ("{100,200}", r"MoreCreditAfter \(200\) must not exceed InitialCredit \(100\)"),
    ("-1,0", r"InitialCredit \(-1\) must not be negative"),
    ("{-1,0}", r"InitialCredit \(-1\) must not be negative"),
    ("4,-1", r"MoreCreditAfter \(-1\) must not be negative"),
    ("1.5,1", "must be whole numbers"),
    ("4,x", "must be whole numbers"),
    ("abc", "expected InitialCredit,MoreCreditAfter"),
    ("", "expected InitialCredit,MoreCreditAfter"),
    ("1,2,3", "expected InitialCredit,MoreCreditAfter"),
    ("{400,200", "expected InitialCredit,MoreCreditAfter"),
])
def test_invalid_specs_are_refused_with_a_clear_message(text, reason):
    with pytest.raises(InvalidCreditSpec, match=reason):
        CreditSpec.parse(text)


@pytest.mark.parametrize("initial, more", [(1.5, 1), ("4", 2), (True, 0), (4, None)])
def test_a_spec_built_from_non_integers_is_refused(initial, more):
    with pytest.raises(InvalidCreditSpec, match="must be whole numbers"):
        CreditSpec(initial, more)


def test_an_invalid_spec_is_an_ipc_error_and_a_value_error():
    with pytest.raises(IpcError):
        CreditSpec(1, 2)
    with pytest.raises(ValueError):
        CreditSpec(1, 2)


def test_valid_specs_parse():
    assert CreditSpec.parse("400,200") == DEFAULT_CREDIT
    assert CreditSpec.parse("{4000,800}") == MSG_STORE_CREDIT_DISC_BOUND
    assert CreditSpec.parse(" 400 , 200 ") == DEFAULT_CREDIT
    assert CreditSpec.parse(" { 0 , 0 } ") == CreditSpec(0, 0)
    assert str(DEFAULT_CREDIT) == "400,200"


def test_per_peer_spec_overrides_the_default():
    c = CreditFlow(CreditSpec(2, 1))
    c.set_peer_spec("store", MSG_STORE_CREDIT_DISC_BOUND)
    assert c.credit_towards("store") == 4000
    c.send("store", 0, n=3999)
    assert not c.blocked
    c.send("store", 0)
    assert c.blocked

    store = CreditFlow(CreditSpec(2, 1))
    store.set_peer_spec("queue", MSG_STORE_CREDIT_DISC_BOUND)
    assert store.ack("queue", n=799) == ()
    assert store.ack("queue") == [Grant("queue", 800)]
    assert store.ack("other") == [Grant("other", 1)], "other peers keep the default"


def test_a_batch_of_zero_is_nothing_and_a_negative_batch_is_refused():
    c = CreditFlow(CreditSpec(2, 1))
    c.send("q", 0, n=0)
    assert c.ack("r", n=0) == ()
    assert c.statistics(0).credit_from == {} and c.statistics(0).credit_to == {}
    with pytest.raises(ValueError, match="cannot send -1"):
        c.send("q", 0, n=-1)
    with pytest.raises(ValueError, match="cannot ack -3"):
        c.ack("r", n=-3)


# -- batching --------------------------------------------------------------------------
PEERS = ["p", "q"]
OPS = st.one_of(
    st.tuples(st.sampled_from(["send", "ack", "bump"]), st.sampled_from(PEERS), st.integers(1, 40)),
    st.tuples(st.sampled_from(["block", "unblock", "peer_down"]), st.sampled_from(PEERS + ["x"]), st.just(1)),
)


@settings(max_examples=300)
@given(spec=st.tuples(st.integers(0, 50), st.integers(0, 50)).filter(lambda t: t[1] <= t[0]),
       steps=st.lists(OPS, max_size=60))
def test_a_batch_of_n_equals_n_single_calls(spec, steps):
    one, many = CreditFlow(CreditSpec(*spec)), CreditFlow(CreditSpec(*spec))
    for t, (op, peer, n) in enumerate(steps):
        if op == "send":
            for _ in range(n):
                one.send(peer, t)
            many.send(peer, t, n=n)
            single = batched = []
        elif op == "ack":
            single = [g for _ in range(n) for g in one.ack(peer)]
            batched = list(many.ack(peer, n=n))
            assert len(batched) <= 1 and all(g.to == peer for g in single + batched)
            if spec[1]:
                assert len(single) == total(single) // spec[1], "each single grant carries MoreCreditAfter"
        else:
            call = {"bump": lambda c: c.handle_bump(peer, n, t), "block": lambda c: c.block(peer, t) or (),
                    "unblock": lambda c: c.unblock(peer, t), "peer_down": lambda c: c.peer_down(peer, t)}[op]
            single, batched = list(call(one)), list(call(many))
        assert {p: total(g for g in single if g.to == p) for p in PEERS} == \
               {p: total(g for g in batched if g.to == p) for p in PEERS}
        assert one.statistics(t) == many.statistics(t)
        assert [one.deferred_towards(p) for p in PEERS] == [many.deferred_towards(p) for p in PEERS]


class ForwardingStage:
    """A channel's credit, receiving from "up" and sending each record on to "down": acking every
    record as it comes, or counting them and acking a batch at a time, as ``Stage.settle_owed``
    does (settled after each batch, before a bump is read, and by ``before_block``)."""

    def __init__(self, spec, batched: bool):
        self.credit, self.batched, self.owed, self.granted = CreditFlow(spec), batched, 0, 0
        if batched:
            self.credit.before_block = self.settle

    def settle(self):
        if self.owed:
            self.granted += total(self.credit.ack("up", self.owed))
            self.owed = 0

    def forward(self, t):
        if self.batched:
            self.owed += 1
        else:
            self.granted += total(self.credit.ack("up"))
        self.credit.send("down", t)

    def bump(self, amount, t):
        self.settle()
        self.granted += total(self.credit.handle_bump("down", amount, t))


@settings(max_examples=300)
@given(spec=st.tuples(st.integers(1, 30), st.integers(1, 30)).filter(lambda t: t[1] <= t[0]),
       turns=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), max_size=30))
def test_acks_counted_a_batch_at_a_time_grant_and_defer_exactly_as_one_by_one(spec, turns):
    """Batches of records forwarded downstream, bumps from downstream between them: upstream is
    granted the same credit at every batch's end, and the same is deferred, block for block."""
    one, batched = ForwardingStage(CreditSpec(*spec), False), ForwardingStage(CreditSpec(*spec), True)
    for t, (records, bump) in enumerate(turns):
        for stage in (one, batched):
            for _ in range(records):
                stage.forward(t)
            stage.settle()
        assert batched.granted == one.granted
        assert batched.credit.statistics(t) == one.credit.statistics(t)
        for stage in (one, batched):
            if bump:
                stage.bump(bump, t)
        assert batched.granted == one.granted


def test_a_batch_that_blocks_halfway_grants_what_came_before_the_block_and_defers_the_rest():
    stage = ForwardingStage(CreditSpec(4, 2), batched=True)
    for _ in range(6):              # the 4th send spends the last credit: 4 acks before it, 2 after
        stage.forward(0)
    stage.settle()
    assert stage.credit.blocked
    assert (stage.granted, stage.credit.deferred_towards("up")) == (4, 2)


# -- the walked example: a paused queue lets exactly 4 messages past the channel --------------
def test_walked_example_exactly_four_get_past_the_channel():
    """{2,1}, the queue paused, 100 publishes; the reader checks ``blocked`` before each send."""
    spec = CreditSpec(2, 1)
    reader, channel, queue = CreditFlow(spec), CreditFlow(spec), CreditFlow(spec)
    socket = deque(range(100))                     # publishes the client has written
    to_channel, to_queue = deque(), deque()        # ring contents
    to_reader, to_channel_bumps = deque(), deque()  # bumps on pipes
    enqueued = []
    queue_paused = True
    now = 0

    def step() -> bool:
        nonlocal now
        now += 1_000                               # 1 µs per step
        moved = False
        while to_reader:
            reader.handle_bump("C", to_reader.popleft(), now)
            moved = True
        while to_channel_bumps:
            to_reader.extend(g.amount for g in channel.handle_bump("Q", to_channel_bumps.popleft(), now))
            moved = True
        if socket and not reader.blocked:
            reader.send("C", now)
            to_channel.append(socket.popleft())
            moved = True
        if to_channel:
            msg = to_channel.popleft()
            to_reader.extend(g.amount for g in channel.ack("R"))
            channel.send("Q", now)
            to_queue.append(msg)
            moved = True
        if to_queue and not queue_paused:
            msg = to_queue.popleft()
            to_channel_bumps.extend(g.amount for g in queue.ack("C"))
            enqueued.append(msg)
            moved = True
        return moved

    while step():
        pass
    assert list(to_queue) == [0, 1, 2, 3], "exactly 4 deliveries wait at the queue"
    assert len(socket) == 96, "the rest stay unread in the socket"
    assert reader.blocked and reader.state(now) == "flow"
    assert channel.blocked and channel.credit_towards("Q") == -2 and channel.deferred_towards("R") == 2

    queue_paused = False
    while step():
        pass
    assert enqueued == list(range(100)), "on resume all 100 arrive, in order"
    assert not reader.blocked and not channel.blocked
    assert reader.state(now + STATE_CHANGE_INTERVAL_NS) == "running"


def test_with_credit_flow_off_all_publishes_pass_a_paused_queue():
    spec = CreditSpec(0, 0)
    reader, channel = CreditFlow(spec), CreditFlow(spec)
    at_queue = 0
    for _ in range(100):
        assert not reader.blocked
        reader.send("C", 0)
        assert channel.ack("R") == ()
        channel.send("Q", 0)
        at_queue += 1
    assert at_queue == 100 and reader.state(0) == "running"
