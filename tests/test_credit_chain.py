"""Four credit cores in a chain (reader -> channel -> queue -> store), joined by in-memory links.

Messages move forward and grants move back, each delivered by its own rule
in any interleaving; stages can be paused. Per link from S to R with spec
{I, M}, credit is conserved::

    credit(S->R) + messages in flight + credit in grants in transit
        + credit R defers for S + (M - R's countdown for S) == I

and a process is blocked exactly while some peer holds it at credit <= 0.
The reader (the only one that checks ``blocked``) never has more than I
messages in flight, and once everything drains nobody is blocked.
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ipc.credit import CreditFlow, CreditSpec

STAGES = ("reader", "channel", "queue", "store")


class Chain(RuleBasedStateMachine):
    @initialize(spec=st.sampled_from([(2, 1), (5, 3), (4, 4), (10, 2)]),
                store_spec=st.sampled_from([(40, 8), (6, 2), (3, 3)]))
    def start(self, spec, store_spec):
        self.specs = [CreditSpec(*spec), CreditSpec(*spec), CreditSpec(*store_spec)]
        self.cores = {name: CreditFlow(CreditSpec(*spec)) for name in STAGES}
        self.cores["queue"].set_peer_spec("store", self.specs[2])
        self.cores["store"].set_peer_spec("queue", self.specs[2])
        self.msgs = [deque() for _ in range(3)]      # link i: STAGES[i] -> STAGES[i+1]
        self.grants = [deque() for _ in range(3)]    # credit travelling back on link i
        self.paused = set()
        self.t = 0

    def _tick(self) -> int:
        self.t += 1
        return self.t

    def _send_grants(self, granter: str, grants) -> None:
        i = STAGES.index(granter)
        for g in grants:
            link = i - 1 if g.to == STAGES[i - 1] else i
            self.grants[link].append(g.amount)

    @rule()
    def publish(self):
        if not self.cores["reader"].blocked:
            self.cores["reader"].send("channel", self._tick())
            self.msgs[0].append(object())

    @rule(link=st.integers(0, 2))
    def deliver(self, link):
        receiver = STAGES[link + 1]
        if not self.msgs[link] or receiver in self.paused:
            return
        self.msgs[link].popleft()
        core = self.cores[receiver]
        self._send_grants(receiver, core.ack(STAGES[link]))
        if link < 2:
            core.send(STAGES[link + 2], self._tick())
            self.msgs[link + 1].append(object())

    @rule(link=st.integers(0, 2))
    def grant_arrives(self, link):
        if not self.grants[link]:
            return
        sender = STAGES[link]
        flushed = self.cores[sender].handle_bump(STAGES[link + 1], self.grants[link].popleft(), self._tick())
        self._send_grants(sender, flushed)

    @rule(stage=st.sampled_from(STAGES[1:]))
    def pause(self, stage):
        self.paused.add(stage)

    @rule(stage=st.sampled_from(STAGES[1:]))
    def resume(self, stage):
        self.paused.discard(stage)

    @precondition(lambda self: hasattr(self, "cores"))
    @invariant()
    def credit_is_conserved_on_every_link(self):
        for i, spec in enumerate(self.specs):
            s, r = self.cores[STAGES[i]], self.cores[STAGES[i + 1]]
            rs = r.statistics(self.t)
            countdown = rs.credit_to.get(STAGES[i], spec.more_after)
            deferred = r._deferred.get(STAGES[i], 0)
            total = (s.credit_towards(STAGES[i + 1]) + len(self.msgs[i]) + sum(self.grants[i]) + deferred
                     + (spec.more_after - countdown))
            assert total == spec.initial, f"link {STAGES[i]}->{STAGES[i + 1]} lost or doubled credit"

    @precondition(lambda self: hasattr(self, "cores"))
    @invariant()
    def blocked_exactly_while_a_peer_holds_credit_at_or_below_zero(self):
        for i, name in enumerate(STAGES[:-1]):
            core = self.cores[name]
            assert core.blocked == (core.credit_towards(STAGES[i + 1]) <= 0), name
        assert not self.cores["store"].blocked

    @precondition(lambda self: hasattr(self, "cores"))
    @invariant()
    def reader_in_flight_never_exceeds_initial_credit(self):
        assert len(self.msgs[0]) <= self.specs[0].initial

    def teardown(self):
        if not hasattr(self, "cores"):
            return
        self.paused.clear()
        for _ in range(100_000):
            moved = False
            for link in range(3):
                if self.msgs[link]:
                    self.deliver(link)
                    moved = True
                if self.grants[link]:
                    self.grant_arrives(link)
                    moved = True
            if not moved:
                break
        self.credit_is_conserved_on_every_link()
        assert not any(c.blocked for c in self.cores.values()), "everything drained, yet blocked"


Chain.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestCreditChain = Chain.TestCase
