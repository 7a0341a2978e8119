"""Publisher confirms and transactions for one channel: RabbitMQ 3.10's rules, sans-IO.

::

    client ──basic.publish (seq)──▶ channel ──▶ queue A ──┐ confirmed(A, seqs)    every queue has it
                                          └───▶ queue B ──┤ rejected(A, seqs)     x-overflow=reject-publish
    client ◀──basic.ack / basic.nack (seq, multiple)──────┘ queue_down(A, crashed)

Confirm mode (``select_confirm``). A publish routed to some queues is pending
until every one of them has confirmed it; then it is acked. It is nacked as
soon as one of its queues rejects it, or crashes before confirming it, even
if the others had confirmed it (RabbitMQ's ``rejected`` queue action, which
a classic queue's abnormal exit also produces). A queue that ends normally
(deleted) counts as having confirmed its share. A publish routed nowhere is
acked at once (a mandatory one is also returned: the shell's business).

Frames are coalesced as RabbitMQ's ``coalesce_and_send`` does, with one rule
added. Each call returns at once the frames of the publishes it decided
(all acks, or all nacks): those below the *cutoff* -- the lowest publish
still pending, or the lowest tag reported the other way above it -- as one
``multiple`` frame of the highest of them, the rest as single frames. So a
multiple frame covers the tags from the last one below which everything was
reported up to its own: never a pending one, and (the rule added; RabbitMQ
may span a tag nacked in an earlier flush) never one reported the other
way. A frame that would settle one tag only is sent single. Nothing is
held back, so no ack is ever owed below a nack.

Transactions (``select_tx``). Publishes (``buffer_publish``: routed by the
shell at once, as RabbitMQ routes them, so its refusals come at once) and
the client's acks, nacks and rejects (``buffer_ack``) wait for ``commit``,
which hands them back in order to be sent to the queues, or are dropped by
``rollback``. ``tx.commit-ok`` goes once every queue the commit's publishes
went to has confirmed them (RabbitMQ 3.x waits for the queues); if a queue
rejected one or crashed holding one, the commit fails instead, with 406
"partial tx completion", once no other publish of it is pending. Until then
any method but channel.close is a 504 hard error.

Cost per publish in confirm mode: one dict entry (seq -> queues left) while
every pending publish went to the same queue; a set per queue only while
pending publishes span several. The lowest pending seq is a pointer moved
up over settled seqs. ``seq`` is the client's count of publishes (1, 2, ...
from confirm.select; transactional publishes are numbered too, as RabbitMQ
numbers them) and must increase. Frames are ``(kind, delivery_tag,
multiple)`` tuples, ``kind`` one of ``ACK``, ``NACK``, ``COMMIT_OK`` (tag 0).
Refusals raise ``ChannelLevelError`` / ``ConnectionLevelError``
(``pipeline.amqp.errors``) and change nothing, but for "partial tx
completion", raised by the queue event that ends a failed commit (it is
over: the shell closes the channel); misuse by the shell raises
``ValueError``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Any, Sequence

from pipeline.amqp.errors import (CHANNEL_ERROR, PRECONDITION_FAILED, SOFT_ERROR_CODES, ChannelLevelError,
                                  ConnectionLevelError, reply_text)

ACK, NACK, COMMIT_OK = "ack", "nack", "commit-ok"
NO_FRAMES: tuple = ()
NONE, CONFIRM, TX = "none", "confirm", "tx"

# class and method ids of the methods whose refusals are raised here
CONFIRM_SELECT, TX_SELECT, TX_COMMIT, TX_ROLLBACK = (85, 10), (90, 10), (90, 20), (90, 30)
BASIC_PUBLISH, BASIC_ACK = (60, 40), (60, 80)

# (mode, mode asked for) -> the new mode, or RabbitMQ's refusal
MODE_CHANGES = {
    (NONE, CONFIRM): CONFIRM, (CONFIRM, CONFIRM): CONFIRM, (NONE, TX): TX, (TX, TX): TX,
    (TX, CONFIRM): "cannot switch from tx to confirm mode",
    (CONFIRM, TX): "cannot switch from confirm to tx mode",
}
_LOW_SCAN_STEPS = 64           # seqs stepped over before the lowest pending is looked for with min()


def _refuse(code: int, explanation: str, method: tuple[int, int]):
    cls = ChannelLevelError if code in SOFT_ERROR_CODES else ConnectionLevelError
    return cls(code, reply_text(code, explanation), *method)


@dataclass(frozen=True)
class Commit:
    """What ``commit`` hands back: the shell sends these on now, in order."""

    publishes: tuple            # (seq, queues, item): deliver each to its queues
    acks: tuple                 # the client's buffered acks, nacks and rejects: pass each on to its queue
    frames: tuple               # ((COMMIT_OK, 0, False),) when nothing is left to wait for, else ()


@dataclass(frozen=True)
class ConfirmsStatistics:
    mode: str                   # 'none', 'confirm' or 'tx'
    unconfirmed: int            # publishes some queue has yet to confirm
    published: int              # publishes tracked (confirm mode, and transactional ones once committed)
    acked: int                  # publishes acked to the client
    nacked: int
    ack_frames: int             # basic.ack frames (fewer than acked when coalesced)
    nack_frames: int
    multiple_frames: int        # frames with multiple set
    queues_tracked: int         # queues with pending publishes: 0 or 1 while all went to one queue
    tx_publishes: int           # buffered, not yet committed
    tx_acks: int
    committing: bool            # a tx.commit waits for its queues
    commits: int                # tx.commit-ok sent
    rollbacks: int


class Confirms:
    """One channel's publisher confirms or transaction."""

    def __init__(self) -> None:
        self._mode = NONE
        self._pending: dict[int, int] = {}       # seq -> queues still to confirm it
        self._single: Any = None                 # the queue every pending publish went to (no per-queue sets)
        self._by_queue: dict | None = None       # queue -> seqs it has not confirmed, while pending spans queues
        self._low = 0                            # no pending seq is below this
        self._max_seq = 0
        self._acked_open: list[int] = []         # heap: tags acked singly above the lowest pending
        self._nacked_open: list[int] = []        # heap: tags nacked singly above the lowest pending
        self._tx_publishes: list = []
        self._tx_acks: list = []
        self._committing = False
        self._tx_failed = False
        self._published = self._acked = self._nacked = 0
        self._ack_frames = self._nack_frames = self._multiple_frames = 0
        self._commits = self._rollbacks = 0

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def transactional(self) -> bool:
        """Publishes and client acks go to ``buffer_publish`` / ``buffer_ack``, not to the queues."""
        return self._mode is TX

    @property
    def unconfirmed(self) -> int:
        return len(self._pending)

    # -- modes ------------------------------------------------------------------------------------------
    def check_method(self, class_id: int, method_id: int) -> None:
        """Call before handling any client method but channel.close(-ok): refused while a commit waits."""
        if self._committing:
            raise _refuse(CHANNEL_ERROR, "unexpected command while processing 'tx.commit'", (class_id, method_id))

    def select_confirm(self) -> None:
        """confirm.select (the shell answers select-ok unless nowait)."""
        self._select(CONFIRM, CONFIRM_SELECT)

    def select_tx(self) -> None:
        """tx.select (the shell answers select-ok)."""
        self._select(TX, TX_SELECT)

    def _select(self, mode: str, method: tuple[int, int]) -> None:
        self.check_method(*method)
        new = MODE_CHANGES[self._mode, mode]
        if new not in (CONFIRM, TX):
            raise _refuse(PRECONDITION_FAILED, new, method)
        self._mode = new

    # -- confirm mode ---------------------------------------------------------------------------------------
    def publish(self, seq: int, queues: Sequence) -> tuple:
        """Publish ``seq`` was sent to ``queues`` (distinct names); the frames to send now.

        Outside confirm mode there is nothing to track (in tx mode use ``buffer_publish``).
        """
        mode = self._mode
        if mode is not CONFIRM:
            if mode is TX:
                raise ValueError("a transactional publish goes to buffer_publish()")
            return NO_FRAMES
        if seq <= self._max_seq:
            raise ValueError(f"publish seq {seq} does not follow {self._max_seq}")
        self._max_seq = seq
        self._published += 1
        return self._track(seq, queues)

    def _track(self, seq: int, queues: Sequence) -> tuple:
        pending = self._pending
        if not queues:
            return self._settle(ACK, (seq,))
        if not pending:
            self._low = seq
            self._single = self._by_queue = None
        if self._by_queue is None and len(queues) == 1:
            q = queues[0]
            single = self._single
            if single is None or single == q:
                self._single = q
                pending[seq] = 1
                return NO_FRAMES
        by = self._by_queue
        if by is None:                           # publishes pending on two queues now: sets from here on
            by = self._by_queue = {}
            if pending:
                by[self._single] = set(pending)
            self._single = None
        for q in queues:
            mine = by.get(q)
            if mine is None:
                mine = by[q] = set()
            mine.add(seq)
        pending[seq] = len(queues)
        return NO_FRAMES

    def confirmed(self, queue, seqs) -> tuple:
        """``queue`` has the publishes ``seqs`` (safely, as the shell's confirm policy says)."""
        pending = self._pending
        if not pending:
            return NO_FRAMES
        by = self._by_queue
        if by is None:
            if queue != self._single:
                return NO_FRAMES
            pop = pending.pop
            done = [s for s in seqs if pop(s, None) is not None]
        else:
            mine = by.get(queue)
            if not mine:
                return NO_FRAMES
            done = []
            for s in seqs:
                if s in mine:
                    mine.discard(s)
                    left = pending.get(s)
                    if left is None:             # nacked already
                        continue
                    if left == 1:
                        del pending[s]
                        done.append(s)
                    else:
                        pending[s] = left - 1
        return self._settle(ACK, done) if done else NO_FRAMES

    def rejected(self, queue, seqs) -> tuple:
        """``queue`` refused the publishes ``seqs`` (x-overflow=reject-publish): each is nacked."""
        pop = self._pending.pop
        gone = [s for s in seqs if pop(s, None) is not None]
        return self._settle(NACK, gone) if gone else NO_FRAMES

    def queue_down(self, queue, crashed: bool) -> tuple:
        """``queue`` ended: if it crashed, whatever it had not confirmed is nacked; if not, it counts as confirmed."""
        pending = self._pending
        by = self._by_queue
        if by is None:
            if queue != self._single or not pending:
                return NO_FRAMES
            seqs = list(pending)
            pending.clear()
            self._single = None
            return self._settle(NACK if crashed else ACK, seqs)
        mine = by.pop(queue, None)
        if not mine:
            return NO_FRAMES
        if crashed:
            return self.rejected(queue, mine)
        done = []
        for s in mine:
            left = pending.get(s)
            if left is None:
                continue
            if left == 1:
                del pending[s]
                done.append(s)
            else:
                pending[s] = left - 1
        return self._settle(ACK, done) if done else NO_FRAMES

    def _lowest(self) -> int | None:
        pending = self._pending
        if not pending:
            return None
        low = self._low
        if low in pending:
            return low
        for _ in range(_LOW_SCAN_STEPS):
            low += 1
            if low in pending:
                self._low = low
                return low
        low = self._low = min(pending)
        return low

    def _settle(self, kind: str, tags) -> tuple:
        """Frames for publishes just decided, all acked or all nacked (already out of ``_pending``)."""
        if self._mode is TX:
            return self._tx_settled(kind is NACK)
        low = self._lowest()
        top = self._max_seq + 1 if low is None else low          # every tag below it is decided
        if kind is ACK:
            mine, other = self._acked_open, self._nacked_open
        else:
            mine, other = self._nacked_open, self._acked_open
        cutoff = min(top, other[0]) if other else top
        tags = sorted(tags)
        below = bisect_left(tags, cutoff)
        out = []
        if below >= 2:                                            # one multiple frame up to just below cutoff
            out.append((kind, tags[below - 1], True))
            self._multiple_frames += 1
            singles = tags[below:]
        else:
            singles = tags
        for tag in singles:
            out.append((kind, tag, False))
            if tag > top:                                          # a later multiple frame must stop below it
                heappush(mine, tag)
        if kind is ACK:
            self._acked += len(tags)
            self._ack_frames += len(out)
        else:
            self._nacked += len(tags)
            self._nack_frames += len(out)
        for heap in (mine, other):                                 # below top no multiple frame reaches them
            while heap and heap[0] < top:
                heappop(heap)
        return tuple(out)

    # -- transactions -------------------------------------------------------------------------------------
    def buffer_publish(self, seq: int, queues: Sequence, item: Any = None, method=BASIC_PUBLISH) -> None:
        """A publish in tx mode, already routed to ``queues``; ``item`` (the shell's) comes back at commit."""
        self.check_method(*method)
        if self._mode is not TX:
            raise ValueError("buffer_publish() is for transactional channels")
        if seq <= self._max_seq:
            raise ValueError(f"publish seq {seq} does not follow {self._max_seq}")
        self._max_seq = seq
        self._tx_publishes.append((seq, tuple(queues), item))

    def buffer_ack(self, item: Any, method=BASIC_ACK) -> None:
        """A client basic.ack / nack / reject in tx mode: ``item`` comes back at commit."""
        self.check_method(*method)
        if self._mode is not TX:
            raise ValueError("buffer_ack() is for transactional channels")
        self._tx_acks.append(item)

    def commit(self) -> Commit:
        """tx.commit: what to send to the queues now; commit-ok now, or from a later call once they confirm."""
        self.check_method(*TX_COMMIT)
        if self._mode is not TX:
            raise _refuse(PRECONDITION_FAILED, "channel is not transactional", TX_COMMIT)
        publishes, acks = tuple(self._tx_publishes), tuple(self._tx_acks)
        self._tx_publishes, self._tx_acks = [], []
        for seq, queues, _ in publishes:
            self._track(seq, queues)
        self._published += len(publishes)
        if self._pending:
            self._committing = True
            return Commit(publishes, acks, NO_FRAMES)
        self._commits += 1
        return Commit(publishes, acks, ((COMMIT_OK, 0, False),))

    def rollback(self) -> tuple:
        """tx.rollback: buffered publishes are dropped; returns the dropped client acks (their deliveries are
        unacked again, as in RabbitMQ)."""
        self.check_method(*TX_ROLLBACK)
        if self._mode is not TX:
            raise _refuse(PRECONDITION_FAILED, "channel is not transactional", TX_ROLLBACK)
        dropped = tuple(self._tx_acks)
        self._tx_publishes, self._tx_acks = [], []
        self._rollbacks += 1
        return dropped

    def _tx_settled(self, refused: bool) -> tuple:
        if refused:
            self._tx_failed = True
        if not self._committing or self._pending:
            return NO_FRAMES
        self._committing = False
        if self._tx_failed:
            self._tx_failed = False
            raise _refuse(PRECONDITION_FAILED, "partial tx completion", TX_COMMIT)
        self._commits += 1
        return ((COMMIT_OK, 0, False),)

    # -- reporting -------------------------------------------------------------------------------------
    def statistics(self) -> ConfirmsStatistics:
        by = self._by_queue
        tracked = sum(1 for seqs in by.values() if seqs) if by is not None else int(bool(self._pending))
        return ConfirmsStatistics(
            mode=self._mode, unconfirmed=len(self._pending), published=self._published, acked=self._acked,
            nacked=self._nacked, ack_frames=self._ack_frames, nack_frames=self._nack_frames,
            multiple_frames=self._multiple_frames, queues_tracked=tracked, tx_publishes=len(self._tx_publishes),
            tx_acks=len(self._tx_acks), committing=self._committing, commits=self._commits,
            rollbacks=self._rollbacks)
