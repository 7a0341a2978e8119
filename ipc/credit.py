"""Credit flow between processes: RabbitMQ's ``credit_flow``, sans-IO.

The publish chain, and the two directions things move in::

              messages ──────────────────────────────────────────────▶
    socket ─▶ reader ──msg──▶ channel ──msg──▶ queue ──msg──▶ message store
                     ◀─bump──         ◀─bump──       ◀─bump──
              ◀────────────────────────────────────────────── credit

Every process keeps one :class:`CreditFlow` and plays both roles in it.

*As a sender* it has credit towards each receiver, starting at
``InitialCredit`` and spent one per message (``send``). The send that takes
it from 1 to 0 blocks the sender on that receiver. Credit may go negative:
only socket readers check ``blocked`` before reading more from their socket;
every other process (channel, queue) keeps forwarding whatever it is given,
so its credit towards a slow receiver goes -1, -2, ... A bump (``handle_bump``)
adds credit; it unblocks the sender on that receiver only when it takes the
credit from <= 0 to > 0. A process is blocked while any blocker remains.

*As a receiver* it counts down ``MoreCreditAfter`` messages per sender
(``ack``) and at the last one grants that sender ``MoreCreditAfter`` more
credit (a ``bump_credit``), then starts counting again. A grant goes out at
once unless the granter is blocked itself; then it is deferred, and every
deferred grant goes out when the granter's last blocker clears. That is how
a slow store ends up holding the reader: the queue, blocked by the store,
withholds the channel's credit; the channel, blocked by the queue, withholds
the reader's; the reader, blocked, stops reading its socket.

Where each stage counts: the reader sends one credit per ``basic.publish``;
the channel acks when it dequeues the message (before routing) and sends one
per target queue; the queue acks on receipt and sends one per store write;
the store acks when it dequeues the write.

``{0,0}`` turns credit flow off: both counters run 0, -1, -2, ... and never
reach the 1 that blocks or grants.

This module has no pipe, ring, clock or process in it. ``ack``,
``handle_bump``, ``unblock`` and ``peer_down`` return the grants the caller
must transmit, in order; when there are none they return the shared empty
tuple :data:`NO_GRANTS` (callers iterate, never mutate). Time is passed in as
monotonic nanoseconds. Peers are any hashable key (stages use link ids); one
pair of processes must use the same spec at both ends. ``n`` in
``send``/``ack`` stands for that many single calls, so a stage can count a
batch at once; several grants to one peer produced by one call come back as
one :class:`Grant` of the summed amount, and deferred grants are kept summed
per peer.

One deliberate difference from RabbitMQ: ``peer_down(p)`` also drops the
grants deferred *to* ``p`` (RabbitMQ later sends them "into the void"), so a
caller never writes a bump to a closed link, and a peer that comes back under
the same key starts from ``InitialCredit`` without stale credit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Hashable, Sequence

from ipc.errors import IpcError

STATE_CHANGE_INTERVAL_NS = 1_000_000_000   # a block keeps the state at 'flow' this long after it starts
NO_GRANTS: tuple = ()                      # the shared "nothing to transmit" result

_WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+")


class InvalidCreditSpec(IpcError, ValueError):
    """Raised when a credit spec is not two whole numbers with 0 <= MoreCreditAfter <= InitialCredit."""


@dataclass(frozen=True)
class CreditSpec:
    """``{InitialCredit, MoreCreditAfter}``; ``{0,0}`` disables credit flow.

    ``initial`` is the credit a sender starts with towards one receiver;
    ``more_after`` is both how many messages the receiver acks between
    grants and how much credit each grant carries.
    """

    initial: int
    more_after: int

    def __post_init__(self) -> None:
        i, m = self.initial, self.more_after
        shown = f"{i!r},{m!r}"
        if type(i) is not int or type(m) is not int:
            raise InvalidCreditSpec(f"invalid credit spec '{shown}': InitialCredit and MoreCreditAfter "
                                    f"must be whole numbers")
        if i < 0:
            raise InvalidCreditSpec(f"invalid credit spec '{shown}': InitialCredit ({i}) must not be negative")
        if m < 0:
            raise InvalidCreditSpec(f"invalid credit spec '{shown}': MoreCreditAfter ({m}) must not be negative")
        if m > i:
            raise InvalidCreditSpec(f"invalid credit spec '{shown}': MoreCreditAfter ({m}) must not "
                                    f"exceed InitialCredit ({i})")

    @classmethod
    def parse(cls, text: str) -> "CreditSpec":
        """Read ``"400,200"``, ``"{400,200}"`` or ``" 400 , 200 "``; refuse anything else."""
        if not isinstance(text, str):
            raise InvalidCreditSpec(f"invalid credit spec {text!r}: expected text like '400,200'")
        body = text.strip()
        if body.startswith("{") and body.endswith("}"):
            body = body[1:-1]
        parts = [p.strip() for p in body.split(",")]
        if len(parts) != 2 or "{" in body or "}" in body:
            raise InvalidCreditSpec(f"invalid credit spec '{text}': expected InitialCredit,MoreCreditAfter "
                                    f"such as '400,200'")
        if not all(_WHOLE_NUMBER.fullmatch(p) for p in parts):
            raise InvalidCreditSpec(f"invalid credit spec '{text}': InitialCredit and MoreCreditAfter "
                                    f"must be whole numbers")
        return cls(int(parts[0]), int(parts[1]))

    @property
    def disabled(self) -> bool:
        """True for ``{0,0}``: nothing ever blocks and nothing is ever granted."""
        return self.initial == 0 and self.more_after == 0

    def __str__(self) -> str:
        return f"{self.initial},{self.more_after}"


DEFAULT_CREDIT = CreditSpec(400, 200)                # credit_flow_default_credit
MSG_STORE_CREDIT_DISC_BOUND = CreditSpec(4000, 800)  # msg_store_credit_disc_bound (queue -> store)


@dataclass(frozen=True)
class Grant:
    """A ``bump_credit`` of ``amount`` that the caller must send to peer ``to``."""

    to: Hashable
    amount: int


@dataclass(frozen=True)
class CreditStatistics:
    """A snapshot of one :class:`CreditFlow`, taken at a given ``now_ns``."""

    blocked: bool                  # some blocker remains
    blocked_by: tuple              # current blocker keys, oldest first (a key may repeat)
    block_started_ns: int | None   # when the current or last block started; None if never blocked
    blocked_total_ns: int          # time spent blocked so far, the current block counted up to now_ns
    block_count: int               # not-blocked -> blocked transitions
    credit_from: dict              # peer -> credit left as a sender towards that peer
    credit_to: dict                # peer -> acks left before the next grant to that peer
    deferred_grants: int           # credit held back from upstream peers while blocked
    state: str                     # 'flow' or 'running' at now_ns


class CreditFlow:
    """One process's credit towards its receivers and countdowns for its senders."""

    def __init__(self, spec: CreditSpec = DEFAULT_CREDIT) -> None:
        if not isinstance(spec, CreditSpec):
            raise TypeError(f"spec must be a CreditSpec, not {type(spec).__name__}")
        self.spec = spec
        self._peer_spec: dict = {}       # peer -> CreditSpec overriding self.spec
        self._more_after: dict = {}      # peer -> MoreCreditAfter, for overridden peers only
        self._credit_from: dict = {}     # peer -> credit left as a sender
        self._credit_to: dict = {}       # peer -> acks left before the next grant
        self._deferred: dict = {}        # peer -> credit held back while blocked
        self._blocked_by: list = []      # blocker keys, oldest first
        self._block_started_ns: int | None = None
        self._blocked_total_ns = 0
        self._block_count = 0
        # Called just before a send blocks this process. A receiver that counts its acks a batch at
        # a time settles them here, so that what it received before the block is granted as if acked
        # one by one, and only what it receives after the block is deferred.
        self.before_block = None

    def set_peer_spec(self, peer, spec: CreditSpec) -> None:
        """Use ``spec`` instead of the default with ``peer`` (set it before the first message)."""
        if not isinstance(spec, CreditSpec):
            raise TypeError(f"spec must be a CreditSpec, not {type(spec).__name__}")
        self._peer_spec[peer] = spec
        self._more_after[peer] = spec.more_after

    def spec_for(self, peer) -> CreditSpec:
        """The spec in force with ``peer``."""
        return self._peer_spec.get(peer, self.spec)

    # -- sender side ---------------------------------------------------------------
    def send(self, to, now_ns: int, n: int = 1) -> None:
        """Spend ``n`` credits on messages to ``to``; block if credit crosses from >= 1 to <= 0."""
        if n < 1:
            if n == 0:
                return
            raise ValueError(f"cannot send {n} messages")
        credit = self._credit_from
        c = credit.get(to)
        if c is None:
            c = self._peer_spec.get(to, self.spec).initial
        after = c - n
        credit[to] = after
        if c >= 1 and after <= 0:
            if self.before_block is not None:
                self.before_block()
            self._block(to, now_ns)

    def handle_bump(self, frm, amount: int, now_ns: int) -> Sequence[Grant]:
        """Add ``amount`` credit from ``frm``; return the deferred grants an unblock flushes."""
        c = self._credit_from.get(frm, 0)
        after = c + amount
        self._credit_from[frm] = after
        if c <= 0 < after:
            return self.unblock(frm, now_ns)
        return NO_GRANTS

    def credit_towards(self, peer) -> int:
        """Credit left as a sender towards ``peer`` (``InitialCredit`` if nothing was sent yet)."""
        c = self._credit_from.get(peer)
        return self.spec_for(peer).initial if c is None else c

    # -- receiver side ---------------------------------------------------------------
    def ack(self, frm, n: int = 1) -> Sequence[Grant]:
        """Count ``n`` messages received from ``frm``; return the grants to transmit now."""
        if n < 1:
            if n == 0:
                return NO_GRANTS
            raise ValueError(f"cannot ack {n} messages")
        more = self._more_after.get(frm, self.spec.more_after) if self._more_after else self.spec.more_after
        countdown = self._credit_to
        c = countdown.get(frm)
        if c is None:
            c = more
        if c > n or c < 1 or more < 1:          # the countdown does not reach its last ack
            countdown[frm] = c - n
            return NO_GRANTS
        # The grant falls on ack number c, then on every `more` acks after it.
        grants = 1 + (n - c) // more
        countdown[frm] = more - (n - c) % more
        return self._grant(frm, grants * more)

    def deferred_towards(self, peer) -> int:
        """Credit currently held back from ``peer`` because this process is blocked."""
        return self._deferred.get(peer, 0)

    def _grant(self, to, amount: int) -> Sequence[Grant]:
        if self._blocked_by:
            self._deferred[to] = self._deferred.get(to, 0) + amount
            return NO_GRANTS
        return [Grant(to, amount)]

    # -- blocking ----------------------------------------------------------------------
    @property
    def blocked(self) -> bool:
        """True while any blocker remains (a socket reader must not read while this holds)."""
        return bool(self._blocked_by)

    @property
    def block_started_ns(self) -> int | None:
        """When the current or last block started; None if this process never blocked."""
        return self._block_started_ns

    def _block(self, key, now_ns: int) -> None:
        if not self._blocked_by:
            self._block_started_ns = now_ns
            self._block_count += 1
        self._blocked_by.append(key)

    def block(self, key, now_ns: int) -> None:
        """Add ``key`` as a blocker, like RabbitMQ's ``credit_flow:block/1``; each needs one unblock."""
        self._block(key, now_ns)

    def unblock(self, key, now_ns: int) -> Sequence[Grant]:
        """Remove one occurrence of ``key``; if no blocker remains, return every deferred grant."""
        blockers = self._blocked_by
        if not blockers:
            return NO_GRANTS
        try:
            blockers.remove(key)
        except ValueError:
            return NO_GRANTS
        if blockers:
            return NO_GRANTS
        self._blocked_total_ns += now_ns - self._block_started_ns
        if not self._deferred:
            return NO_GRANTS
        deferred, self._deferred = self._deferred, {}
        return [Grant(to, amount) for to, amount in deferred.items()]

    def peer_down(self, peer, now_ns: int) -> Sequence[Grant]:
        """Forget ``peer``: drop what is deferred to it, unblock it, reset both its counters."""
        self._deferred.pop(peer, None)
        grants = self.unblock(peer, now_ns)
        self._credit_from.pop(peer, None)
        self._credit_to.pop(peer, None)
        return grants

    # -- reporting ---------------------------------------------------------------------
    def state(self, now_ns: int) -> str:
        """'flow' if blocked now or the current/last block started < 1 s ago, else 'running'."""
        if self._blocked_by:
            return "flow"
        started = self._block_started_ns
        if started is not None and now_ns - started < STATE_CHANGE_INTERVAL_NS:
            return "flow"
        return "running"

    def statistics(self, now_ns: int) -> CreditStatistics:
        total = self._blocked_total_ns
        if self._blocked_by:
            total += now_ns - self._block_started_ns
        return CreditStatistics(
            blocked=bool(self._blocked_by), blocked_by=tuple(self._blocked_by),
            block_started_ns=self._block_started_ns, blocked_total_ns=total,
            block_count=self._block_count, credit_from=dict(self._credit_from),
            credit_to=dict(self._credit_to), deferred_grants=sum(self._deferred.values()),
            state=self.state(now_ns))
