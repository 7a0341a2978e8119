"""Publisher confirms and transactions of one channel, with no process, ring or clock.

Stories first, one rule each (the reply texts and the frames of the
reject-publish stories as a RabbitMQ 3.10.8 node sent them); then a
hypothesis state machine: a channel publishing to three queues that
confirm, reject, end and crash in any order, with a client that reads every
frame as a real client would: each publish gets exactly one outcome, the
right one, never both, never twice; a multiple frame covers no pending tag
and none reported the other way; and once nothing is pending, everything has
been reported. A second machine does the same for transactions.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeline.amqp.errors import ChannelLevelError, ConnectionLevelError
from pipeline.broker.confirms import ACK, COMMIT_OK, CONFIRM, NACK, NONE, TX, Commit, Confirms


def refused(code: int, text: str, hard: bool = False):
    return pytest.raises(ConnectionLevelError if hard else ChannelLevelError,
                         match="^" + re.escape(f"{code} {text}") + "$")


def confirming() -> Confirms:
    c = Confirms()
    c.select_confirm()
    return c


# -- confirm mode ------------------------------------------------------------------------------------------
def test_without_confirm_select_nothing_is_tracked():
    c = Confirms()
    assert c.mode == NONE and c.publish(1, ["q"]) == () and c.unconfirmed == 0


def test_a_publish_is_acked_when_its_queue_confirms_it_and_in_order_ones_coalesce():
    c = confirming()
    for seq in (1, 2, 3):
        assert c.publish(seq, ["q"]) == ()
    assert c.unconfirmed == 3
    assert c.confirmed("q", [1]) == ((ACK, 1, False),)          # one publish: a single ack
    assert c.confirmed("q", [2, 3]) == ((ACK, 3, True),)        # several: one multiple ack
    assert c.unconfirmed == 0


def test_a_publish_routed_nowhere_is_acked_at_once():
    c = confirming()
    assert c.publish(1, []) == ((ACK, 1, False),)
    c.publish(2, ["q"])
    assert c.publish(3, ()) == ((ACK, 3, False),)               # above a pending one: single
    assert c.confirmed("q", [2]) == ((ACK, 2, False),)


def test_acks_above_the_lowest_pending_publish_go_single():
    c = confirming()
    c.publish(1, ["slow"])
    for seq in (2, 3, 4):
        c.publish(seq, ["fast"])
    assert c.confirmed("fast", [2, 3, 4]) == ((ACK, 2, False), (ACK, 3, False), (ACK, 4, False))
    assert c.confirmed("slow", [1]) == ((ACK, 1, False),)
    c.publish(5, ["slow"])
    c.publish(6, ["slow"])
    assert c.confirmed("slow", [5, 6]) == ((ACK, 6, True),)


def test_a_publish_to_several_queues_waits_for_all_of_them():
    c = confirming()
    c.publish(1, ["a", "b"])
    c.publish(2, ["a"])
    assert c.confirmed("a", [1, 2]) == ((ACK, 2, False),)
    assert c.confirmed("b", [1]) == ((ACK, 1, False),)
    assert c.confirmed("b", [1]) == () and c.confirmed("a", [2]) == ()       # repeats change nothing
    assert c.confirmed("zzz", [7]) == ()


def test_per_queue_sets_exist_only_while_pending_publishes_span_queues():
    c = confirming()
    c.publish(1, ["a"])
    c.publish(2, ["a"])
    assert c._by_queue is None and c.statistics().queues_tracked == 1
    c.publish(3, ["b"])
    assert c._by_queue == {"a": {1, 2}, "b": {3}} and c.statistics().queues_tracked == 2
    c.confirmed("a", [1, 2])
    c.confirmed("b", [3])
    c.publish(4, ["b"])                         # nothing pending any more: back to one queue, no sets
    assert c._by_queue is None and c._single == "b"


def test_a_rejected_publish_is_nacked_even_if_another_queue_took_it():
    # RabbitMQ 3.10.8, x-max-length=2 x-overflow=reject-publish: 3 publishes to the full queue then 3 to
    # another, settled together, gave exactly these frames
    c = confirming()
    for seq in range(1, 7):
        c.publish(seq, ["rp"] if seq <= 3 else ["ok"])
    assert c.rejected("rp", [1, 2, 3]) + c.confirmed("ok", [4, 5, 6]) == ((NACK, 3, True), (ACK, 6, True))
    c.publish(7, ["rp", "ok"])
    assert c.confirmed("ok", [7]) == ()
    assert c.rejected("rp", [7]) == ((NACK, 7, False),)
    assert c.confirmed("ok", [7]) == ()


def test_a_multiple_nack_never_spans_an_acked_publish():
    c = confirming()
    for seq in range(1, 7):
        c.publish(seq, ["rp", "ok"])
    c.confirmed("ok", range(1, 7))
    c.confirmed("rp", [4, 5, 6])
    # acks 4-6 went single (1 was pending); the nacks of 1-3 then coalesce up to just below them
    assert c.queue_down("rp", crashed=True) == ((NACK, 3, True),)
    c2 = confirming()
    for seq in range(1, 7):
        c2.publish(seq, ["a", "b"])
    c2.confirmed("b", range(1, 7))
    c2.confirmed("a", [1, 2])
    assert c2.unconfirmed == 4
    c2.publish(7, ["b"])
    assert c2.queue_down("a", crashed=True) == ((NACK, 6, True),)
    assert c2.confirmed("b", [7]) == ((ACK, 7, False),)


def test_a_multiple_ack_never_spans_a_nacked_publish():
    c = confirming()
    c.publish(1, ["slow"])
    c.publish(2, ["bad"])
    c.publish(3, ["fast"])
    assert c.rejected("bad", [2]) == ((NACK, 2, False),)         # above pending 1: single
    assert c.confirmed("fast", [3]) == ((ACK, 3, False),)
    c.publish(4, ["fast"])
    assert c.confirmed("slow", [1]) + c.confirmed("fast", [4]) == ((ACK, 1, False), (ACK, 4, False))
    c.publish(5, ["slow"])
    c.publish(6, ["slow"])
    assert c.confirmed("slow", [5, 6]) == ((ACK, 6, True),)     # (4, 6]: past the nack, coalescing again


def test_a_crashed_queue_nacks_what_it_had_not_confirmed_even_if_others_had():
    c = confirming()
    c.publish(1, ["a", "b"])
    c.publish(2, ["a", "b"])
    c.publish(3, ["b"])
    c.confirmed("a", [1, 2])
    assert c.queue_down("b", crashed=True) == ((NACK, 3, True),)
    assert c.unconfirmed == 0
    c.publish(4, ["b"])                                          # a new incarnation of b
    assert c.confirmed("b", [4]) == ((ACK, 4, False),)


def test_a_queue_that_ends_normally_counts_as_having_confirmed():
    c = confirming()
    c.publish(1, ["a", "b"])
    c.publish(2, ["b"])
    assert c.queue_down("b", crashed=False) == ((ACK, 2, False),)       # 1 still waits for a
    assert c.confirmed("a", [1]) == ((ACK, 1, False),)
    c.publish(3, ["a"])
    c.publish(4, ["a"])
    assert c.queue_down("a", crashed=False) == ((ACK, 4, True),)
    assert c.queue_down("a", crashed=True) == ()


def test_seqs_must_increase():
    c = confirming()
    c.publish(5, ["q"])
    with pytest.raises(ValueError, match="does not follow 5"):
        c.publish(5, ["q"])


def test_the_lowest_pending_publish_is_found_across_wide_gaps():
    c = confirming()
    c.publish(1, ["q"])
    c.publish(1_000_000, ["r"])
    assert c.confirmed("q", [1]) == ((ACK, 1, False),)
    assert c._lowest() == 1_000_000
    assert c.confirmed("r", [1_000_000]) == ((ACK, 1_000_000, False),)


# -- modes ---------------------------------------------------------------------------------------------
def test_a_channel_is_either_confirming_or_transactional():
    c = confirming()
    c.select_confirm()                                                  # again: fine
    with refused(406, "PRECONDITION_FAILED - cannot switch from confirm to tx mode") as err:
        c.select_tx()
    assert (err.value.class_id, err.value.method_id) == (90, 10) and c.mode == CONFIRM
    t = Confirms()
    t.select_tx()
    t.select_tx()
    with refused(406, "PRECONDITION_FAILED - cannot switch from tx to confirm mode") as err:
        t.select_confirm()
    assert (err.value.class_id, err.value.method_id) == (85, 10) and t.mode == TX


def test_commit_and_rollback_need_tx_select():
    c = Confirms()
    with refused(406, "PRECONDITION_FAILED - channel is not transactional") as err:
        c.commit()
    assert (err.value.class_id, err.value.method_id) == (90, 20)
    with refused(406, "PRECONDITION_FAILED - channel is not transactional") as err:
        c.rollback()
    assert (err.value.class_id, err.value.method_id) == (90, 30)
    with pytest.raises(ValueError):
        c.buffer_publish(1, ["q"])
    with pytest.raises(ValueError):
        c.buffer_ack("ack")


# -- transactions ---------------------------------------------------------------------------------------
def transactional() -> Confirms:
    c = Confirms()
    c.select_tx()
    return c


def test_a_transaction_buffers_publishes_and_acks_until_commit_then_releases_them_in_order():
    c = transactional()
    assert c.transactional
    with pytest.raises(ValueError, match="buffer_publish"):
        c.publish(1, ["q"])
    c.buffer_publish(1, ["q"], "p1")
    c.buffer_ack("ack 5")
    c.buffer_publish(2, ["q", "r"], "p2")
    c.buffer_ack("reject 6")
    assert c.statistics().tx_publishes == 2 and c.statistics().tx_acks == 2
    commit = c.commit()
    assert commit == Commit(publishes=((1, ("q",), "p1"), (2, ("q", "r"), "p2")), acks=("ack 5", "reject 6"),
                            frames=())
    assert c.confirmed("q", [1, 2]) == ()                      # no basic.ack in a transaction
    assert c.confirmed("r", [2]) == ((COMMIT_OK, 0, False),)   # every queue has them: commit-ok
    assert c.statistics().commits == 1 and not c.statistics().committing


def test_a_commit_with_nothing_to_wait_for_is_answered_at_once():
    c = transactional()
    assert c.commit() == Commit((), (), ((COMMIT_OK, 0, False),))
    c.buffer_publish(1, [], "unroutable")
    c.buffer_ack("ack 1")
    assert c.commit().frames == ((COMMIT_OK, 0, False),)


def test_rollback_drops_the_publishes_and_hands_back_the_acks():
    c = transactional()
    c.buffer_publish(1, ["q"], "p1")
    c.buffer_ack("ack 1")
    c.buffer_ack("nack 2")
    assert c.rollback() == ("ack 1", "nack 2")
    assert c.commit() == Commit((), (), ((COMMIT_OK, 0, False),))
    assert c.statistics().rollbacks == 1


def test_while_a_commit_waits_for_its_queues_any_method_closes_the_connection():
    # RabbitMQ 3.10.8: publish, tx.commit, publish pipelined -> 504 on the connection
    c = transactional()
    c.buffer_publish(1, ["q"], "p1")
    c.commit()
    text = "CHANNEL_ERROR - unexpected command while processing 'tx.commit'"
    with refused(504, text, hard=True) as err:
        c.buffer_publish(2, ["q"], "p2")
    assert err.value.hard and (err.value.class_id, err.value.method_id) == (60, 40)
    for attempt in (c.commit, c.rollback, c.select_tx, lambda: c.check_method(50, 10), lambda: c.buffer_ack("a")):
        with refused(504, text, hard=True):
            attempt()
    assert c.confirmed("q", [1]) == ((COMMIT_OK, 0, False),)
    c.check_method(50, 10)
    c.buffer_publish(2, ["q"], "p2")


def test_a_commit_whose_publish_a_queue_rejects_fails_once_nothing_else_is_pending():
    # RabbitMQ 3.10.8: 3 publishes to a queue with x-max-length=2 x-overflow=reject-publish, tx.commit
    c = transactional()
    for seq in (1, 2, 3):
        c.buffer_publish(seq, ["rp", "ok"], seq)
    c.commit()
    assert c.rejected("rp", [3]) == ()
    assert c.confirmed("rp", [1, 2]) == ()
    with refused(406, "PRECONDITION_FAILED - partial tx completion") as err:
        c.confirmed("ok", [1, 2, 3])
    assert (err.value.class_id, err.value.method_id) == (90, 20)
    assert c.statistics().committing is False


def test_a_queue_crashing_during_a_commit_fails_it_and_one_ending_normally_does_not():
    c = transactional()
    c.buffer_publish(1, ["a", "b"])
    c.commit()
    assert c.queue_down("b", crashed=False) == ()
    assert c.queue_down("a", crashed=False) == ((COMMIT_OK, 0, False),)
    c.buffer_publish(2, ["a"])
    c.commit()
    with refused(406, "PRECONDITION_FAILED - partial tx completion"):
        c.queue_down("a", crashed=True)


def test_statistics():
    c = confirming()
    for seq in range(1, 5):
        c.publish(seq, ["q"])
    c.confirmed("q", [1, 2, 3])
    c.rejected("q", [4])
    s = c.statistics()
    assert (s.mode, s.published, s.acked, s.nacked, s.ack_frames, s.nack_frames, s.multiple_frames,
            s.unconfirmed) == ("confirm", 4, 3, 1, 1, 1, 1, 0)


# -- the state machines -----------------------------------------------------------------------------------
QUEUES = ("a", "b", "c")


class Client:
    """What a client makes of the frames: each tag settled once, multiple frames by range."""

    def __init__(self) -> None:
        self.outcome: dict[int, str] = {}
        self.watermark = 0          # every tag up to here is settled (or was never published)

    def read(self, frames, published: int, pending: set, expected: dict) -> None:
        for kind, tag, multiple in frames:
            assert kind in (ACK, NACK)
            assert tag not in self.outcome, f"tag {tag} settled twice"
            covered = range(self.watermark + 1, tag + 1) if multiple else [tag]
            for t in covered:
                assert t not in pending, f"{kind} {tag} multiple={multiple} covers pending {t}"
                if t in self.outcome:
                    assert self.outcome[t] == kind, f"{kind} {tag} multiple covers {t}, settled otherwise"
                    continue
                assert expected.get(t) == kind, f"tag {t}: {kind}, expected {expected.get(t)}"
                self.outcome[t] = kind
            while self.watermark + 1 <= published and (self.watermark + 1 in self.outcome):
                self.watermark += 1


class ConfirmMachine(RuleBasedStateMachine):
    """Publishes to any set of queues; queues confirm, reject, end or crash; the client checks every frame."""

    def __init__(self):
        super().__init__()
        self.core = confirming()
        self.seq = 0
        self.holds = {q: set() for q in QUEUES}      # what each queue has and has not yet answered
        self.waiting: dict[int, set] = {}            # seq -> queues it still waits for
        self.expected: dict[int, str] = {}           # seq -> the outcome it must get (once decided)
        self.client = Client()

    def read(self, frames):
        pending = set(self.waiting)
        self.client.read(frames, self.seq, pending, self.expected)

    def decide(self, seq: int, outcome: str) -> None:
        self.waiting.pop(seq, None)
        self.expected.setdefault(seq, outcome)

    @rule(queues=st.sets(st.sampled_from(QUEUES)))
    def publish(self, queues):
        self.seq += 1
        if queues:
            self.waiting[self.seq] = set(queues)
            for q in queues:
                self.holds[q].add(self.seq)
        else:
            self.decide(self.seq, ACK)
        self.read(self.core.publish(self.seq, sorted(queues)))

    @rule(q=st.sampled_from(QUEUES), data=st.data())
    def queue_confirms(self, q, data):
        if not self.holds[q]:
            return
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.holds[q])), min_size=1, unique=True))
        for s in seqs:
            self.holds[q].discard(s)
            if s in self.waiting:
                self.waiting[s].discard(q)
                if not self.waiting[s]:
                    self.decide(s, ACK)
        self.read(self.core.confirmed(q, seqs))

    @rule(q=st.sampled_from(QUEUES), data=st.data())
    def queue_rejects(self, q, data):
        if not self.holds[q]:
            return
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.holds[q])), min_size=1, unique=True))
        for s in seqs:
            self.holds[q].discard(s)
            if s in self.waiting:
                self.decide(s, NACK)
        self.read(self.core.rejected(q, seqs))

    @rule(q=st.sampled_from(QUEUES), seq=st.integers(1, 40))
    def a_stale_or_repeated_confirm_changes_nothing(self, q, seq):
        if seq in self.holds[q] or seq > self.seq:
            return
        assert self.core.confirmed(q, [seq]) == ()

    @rule(q=st.sampled_from(QUEUES), crashed=st.booleans())
    def queue_ends(self, q, crashed):
        for s in sorted(self.holds[q]):
            if s in self.waiting:
                if crashed:
                    self.decide(s, NACK)
                else:
                    self.waiting[s].discard(q)
                    if not self.waiting[s]:
                        self.decide(s, ACK)
        self.holds[q].clear()
        self.read(self.core.queue_down(q, crashed))

    @invariant()
    def every_decided_publish_is_reported_and_no_pending_one(self):
        for seq in range(1, self.seq + 1):
            if seq in self.waiting:
                assert seq not in self.client.outcome
            else:
                assert self.client.outcome.get(seq) == self.expected[seq], seq
        assert self.core.unconfirmed == len(self.waiting)

    @invariant()
    def with_nothing_pending_everything_is_reported(self):
        if not self.waiting:
            assert self.client.watermark == self.seq

    @invariant()
    def frames_add_up(self):
        s = self.core.statistics()
        assert s.acked == sum(1 for o in self.client.outcome.values() if o == ACK)
        assert s.nacked == sum(1 for o in self.client.outcome.values() if o == NACK)
        assert s.ack_frames <= s.acked and s.nack_frames <= s.nacked


ConfirmMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestConfirmMachine = ConfirmMachine.TestCase


class TxMachine(RuleBasedStateMachine):
    """Transactions: commit-ok once nothing waits for a queue, 406 if a queue refused one, 504 meanwhile."""

    def __init__(self):
        super().__init__()
        self.core = transactional()
        self.seq = 0
        self.buffered: list = []
        self.acks: list = []
        self.holds = {q: set() for q in QUEUES}
        self.waiting: dict[int, set] = {}
        self.failed = False
        self.committing = False

    def settle(self, call):
        done = not any(self.waiting.values())
        try:
            frames = call()
        except ChannelLevelError as err:
            assert done and self.failed and "partial tx completion" in err.reply_text
            self.committing = self.failed = False
            return
        if self.committing and done:
            assert not self.failed and frames == ((COMMIT_OK, 0, False),)
            self.committing = False
        else:
            assert frames == ()

    @precondition(lambda self: not self.committing)
    @rule(queues=st.sets(st.sampled_from(QUEUES)), ack=st.booleans())
    def publish_or_ack(self, queues, ack):
        if ack:
            self.acks.append(f"ack{len(self.acks)}")
            self.core.buffer_ack(self.acks[-1])
            return
        self.seq += 1
        self.buffered.append((self.seq, tuple(sorted(queues)), self.seq))
        self.core.buffer_publish(self.seq, sorted(queues), self.seq)

    @precondition(lambda self: not self.committing)
    @rule()
    def commit(self):
        commit = self.core.commit()
        assert commit.publishes == tuple(self.buffered) and commit.acks == tuple(self.acks)
        for seq, queues, _ in self.buffered:
            for q in queues:
                self.holds[q].add(seq)
                self.waiting.setdefault(seq, set()).add(q)
        self.buffered, self.acks = [], []
        if any(self.waiting.values()):
            assert commit.frames == ()
            self.committing = True
        else:
            assert commit.frames == ((COMMIT_OK, 0, False),)

    @precondition(lambda self: not self.committing)
    @rule()
    def rollback(self):
        assert self.core.rollback() == tuple(self.acks)
        self.buffered, self.acks = [], []

    @precondition(lambda self: self.committing)
    @rule()
    def a_method_while_committing_is_refused(self):
        with pytest.raises(ConnectionLevelError, match="504"):
            self.core.check_method(60, 40)

    @rule(q=st.sampled_from(QUEUES), reject=st.booleans(), crash=st.booleans(), ends=st.booleans())
    def queue_answers(self, q, reject, crash, ends):
        held = sorted(self.holds[q])
        if not held:
            return
        self.holds[q].clear()
        refused = (ends and crash) or (not ends and reject)
        for s in held:
            if self.waiting.get(s):
                self.waiting[s].discard(q)
                if refused:                     # a refused publish fails the commit and waits for no other queue
                    self.waiting[s].clear()
                    self.failed = True
        if ends:
            self.settle(lambda: self.core.queue_down(q, crash))
        elif reject:
            self.settle(lambda: self.core.rejected(q, held))
        else:
            self.settle(lambda: self.core.confirmed(q, held))
        self.waiting = {s: qs for s, qs in self.waiting.items() if qs}

    @invariant()
    def committing_matches(self):
        assert self.core.statistics().committing == self.committing


TxMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestTxMachine = TxMachine.TestCase
