"""Four credit cores in a chain (reader -> channel -> queue -> store), joined by in-memory links.

Messages move forward and grants move back, each delivered by its own rule
in any interleaving and in batches; stages can be paused. The reader is the
only one that checks ``blocked`` (before taking a publish off its socket);
the channel acks on dequeue and forwards, the queue acks on receipt and
forwards, the store acks when it dequeues a write.

The conservation law. On a link from S to R with spec {I, M}, every one of
the I credits S started with is, at any moment, in exactly one place::

    credit(S -> R)                  unspent, at S (negative when S overspent)
    + messages in flight S -> R     spent, not yet acked by R
    + (M - countdown(R for S))      acked by R, not yet granted
    + deferred(R for S)             granted by R, held while R is blocked
    + credit in bumps in transit    granted, not yet handled by S
    == I

A send moves one unit from the first term to the second; an ack moves it to
the third; the ack that ends a countdown turns M units of the third into a
grant (fourth or fifth term); a flush moves the fourth into the fifth, and a
bump returns the fifth to the first. A lost or doubled grant breaks it.

Also checked: a process is blocked exactly while its receiver holds it at
credit <= 0; a blocked process lets no credit out, it defers it; the reader
never has more than I messages in flight to the channel; a stalled store,
with the client writing without end, leaves reader, channel and queue all
blocked; and once everything drains with no stage paused, nobody is blocked.
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ipc.credit import MSG_STORE_CREDIT_DISC_BOUND, CreditFlow, CreditSpec

STAGES = ("reader", "channel", "queue", "store")
LINKS = range(3)                       # link i: STAGES[i] -> STAGES[i + 1]
CHAIN_SPECS = [(1, 1), (2, 1), (5, 3), (4, 4), (10, 2)]
STORE_SPECS = [(40, 8), (6, 2), (3, 3), (MSG_STORE_CREDIT_DISC_BOUND.initial, MSG_STORE_CREDIT_DISC_BOUND.more_after)]


def started(machine) -> bool:
    return hasattr(machine, "cores")


class Chain(RuleBasedStateMachine):
    @initialize(spec=st.sampled_from(CHAIN_SPECS), store_spec=st.sampled_from(STORE_SPECS))
    def start(self, spec, store_spec):
        chain, store = CreditSpec(*spec), CreditSpec(*store_spec)
        self.specs = [chain, chain, store]
        self.cores = {name: CreditFlow(chain) for name in STAGES}
        self.cores["queue"].set_peer_spec("store", store)
        self.cores["store"].set_peer_spec("queue", store)
        self.msgs = [deque() for _ in LINKS]      # messages on link i
        self.bumps = [deque() for _ in LINKS]     # credit travelling back on link i
        self.paused: set[str] = set()
        self.socket_backlog = 0                   # publishes written by the client, not yet read
        self.next_msg = 0
        self.t = 0

    def _now(self) -> int:
        self.t += 1_000
        return self.t

    def _transmit(self, granter: str, grants) -> None:
        i = STAGES.index(granter)
        if grants:
            assert not self.cores[granter].blocked, f"{granter} let credit out while blocked"
        for g in grants:
            assert g.to in STAGES[:i] and g.amount > 0, f"{granter} granted {g}"
            self.bumps[STAGES.index(g.to)].append(g.amount)

    # -- the client and the reader -------------------------------------------------------
    @rule(n=st.integers(1, 5))
    def client_publishes(self, n):
        self.socket_backlog += n

    @precondition(lambda self: started(self) and self.socket_backlog > 0)
    @rule()
    def reader_reads_a_publish(self):
        reader = self.cores["reader"]
        if reader.blocked:                        # a blocked reader leaves the socket alone
            return
        self.socket_backlog -= 1
        reader.send("channel", self._now())
        self.msgs[0].append(self.next_msg)
        self.next_msg += 1

    # -- downstream stages ----------------------------------------------------------------
    @precondition(lambda self: started(self) and any(self.msgs))
    @rule(link=st.sampled_from(LINKS), n=st.integers(1, 3))
    def receiver_dequeues(self, link, n):
        receiver, sender = STAGES[link + 1], STAGES[link]
        k = min(n, len(self.msgs[link]))
        if k == 0 or receiver in self.paused:
            return
        batch = [self.msgs[link].popleft() for _ in range(k)]
        core = self.cores[receiver]
        self._transmit(receiver, core.ack(sender, n=k))      # ack first, then forward
        if link + 1 < len(STAGES) - 1:
            core.send(STAGES[link + 2], self._now(), n=k)
            self.msgs[link + 1].extend(batch)

    @precondition(lambda self: started(self) and any(self.bumps))
    @rule(link=st.sampled_from(LINKS))
    def bump_arrives(self, link):
        if not self.bumps[link]:
            return
        sender = STAGES[link]
        flushed = self.cores[sender].handle_bump(STAGES[link + 1], self.bumps[link].popleft(), self._now())
        self._transmit(sender, flushed)

    @rule(stage=st.sampled_from(STAGES[1:]))
    def pause(self, stage):
        self.paused.add(stage)

    @rule(stage=st.sampled_from(STAGES[1:]))
    def resume(self, stage):
        self.paused.discard(stage)

    @precondition(started)
    @rule()
    def a_stalled_store_blocks_the_whole_chain(self):
        """Pause the store, let the client write without end: everyone upstream ends up blocked."""
        self.paused = {"store"}
        for _ in range(100_000):
            moved = False
            if not self.cores["reader"].blocked:
                self.socket_backlog += 1
                self.reader_reads_a_publish()
                moved = True
            for link in LINKS:
                if link < 2 and self.msgs[link]:
                    self.receiver_dequeues(link, 3)
                    moved = True
                if self.bumps[link]:
                    self.bump_arrives(link)
                    moved = True
            if not moved:
                break
        assert [self.cores[name].blocked for name in STAGES] == [True, True, True, False]

    @precondition(started)
    @rule()
    def everything_drains(self):
        self.drain_and_check()

    def drain_and_check(self) -> None:
        """Unpause every stage and deliver until nothing moves; then nobody may be blocked."""
        self.paused.clear()
        for _ in range(100_000):
            moved = False
            for link in LINKS:
                if self.msgs[link]:
                    self.receiver_dequeues(link, 3)
                    moved = True
                if self.bumps[link]:
                    self.bump_arrives(link)
                    moved = True
            if not moved:
                break
        self.credit_is_conserved_on_every_link()
        blocked = [name for name, core in self.cores.items() if core.blocked]
        assert blocked == [], f"everything drained, yet {blocked} blocked"
        for i, spec in enumerate(self.specs):
            assert 0 < self.cores[STAGES[i]].credit_towards(STAGES[i + 1]) <= spec.initial

    # -- invariants ---------------------------------------------------------------------
    @precondition(started)
    @invariant()
    def credit_is_conserved_on_every_link(self):
        for i, spec in enumerate(self.specs):
            sender, receiver = STAGES[i], STAGES[i + 1]
            s, r = self.cores[sender], self.cores[receiver]
            countdown = r.statistics(self.t).credit_to.get(sender, spec.more_after)
            held = (s.credit_towards(receiver) + len(self.msgs[i]) + (spec.more_after - countdown)
                    + r.deferred_towards(sender) + sum(self.bumps[i]))
            assert held == spec.initial, f"link {sender}->{receiver} holds {held} credits, not {spec.initial}"

    @precondition(started)
    @invariant()
    def blocked_exactly_while_the_receiver_holds_credit_at_or_below_zero(self):
        for i, name in enumerate(STAGES[:-1]):
            core = self.cores[name]
            assert core.blocked == (core.credit_towards(STAGES[i + 1]) <= 0), name
            if core.blocked:
                assert core.state(self.t) == "flow"
        assert not self.cores["store"].blocked

    @precondition(started)
    @invariant()
    def credit_is_deferred_only_while_blocked(self):
        for core in self.cores.values():
            if not core.blocked:
                assert core.statistics(self.t).deferred_grants == 0

    @precondition(started)
    @invariant()
    def reader_in_flight_never_exceeds_initial_credit(self):
        assert len(self.msgs[0]) <= self.specs[0].initial

    @precondition(started)
    @invariant()
    def messages_stay_in_order(self):
        seen = [m for link in reversed(LINKS) for m in self.msgs[link]]
        assert seen == sorted(seen)

    def teardown(self):
        if started(self):
            self.drain_and_check()


Chain.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)
TestCreditChain = Chain.TestCase
