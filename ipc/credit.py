"""Credit flow between processes: RabbitMQ's ``credit_flow``, sans-IO.

The publish chain and the two directions things move in::

    socket ─▶ reader ──msg──▶ channel ──msg──▶ queue ──msg──▶ message store
                     ◀─bump──         ◀─bump──       ◀─bump──

Every process keeps one :class:`CreditFlow`. As a *sender* it has credit
towards each receiver, starting at ``InitialCredit`` and spent one per
message; the send that takes it from 1 to 0 blocks the sender on that
receiver. Credit may go negative: only socket readers check ``blocked``
before reading more; every other process keeps forwarding whatever it is
given. As a *receiver* it counts down ``MoreCreditAfter`` messages per
sender and then grants that sender ``MoreCreditAfter`` more credit
(``bump_credit``). A grant is sent at once unless the granter is blocked
itself; then it is deferred, and every deferred grant goes out when the
granter's last blocker clears. That is how a slow store ends up holding the
reader: the queue, blocked by the store, withholds the channel's credit; the
channel, blocked by the queue, withholds the reader's.

This module has no pipe, ring, clock or process in it. ``send``, ``ack``,
``handle_bump``, ``unblock`` and ``peer_down`` return the grants the caller
must transmit; time is passed in as monotonic nanoseconds. Peers are any
hashable key (stages use link ids). ``n`` in ``send``/``ack`` stands for
that many single calls, so a stage can count a batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from ipc.errors import IpcError

STATE_CHANGE_INTERVAL_NS = 1_000_000_000
_NO_GRANTS: tuple = ()


class InvalidCreditSpec(IpcError, ValueError):
    """Raised when a credit spec is not two whole numbers 0 <= MoreCreditAfter <= InitialCredit."""


@dataclass(frozen=True)
class CreditSpec:
    """``{InitialCredit, MoreCreditAfter}``; ``{0,0}`` disables credit flow."""

    initial: int
    more_after: int

    def __post_init__(self) -> None:
        i, m = self.initial, self.more_after
        shown = f"{i!r},{m!r}"
        for value in (i, m):
            if type(value) is not int:
                raise InvalidCreditSpec(f"invalid credit spec '{shown}': values must be whole numbers")
        if i < 0 or m < 0:
            raise InvalidCreditSpec(f"invalid credit spec '{shown}': values must not be negative")
        if m > i:
            raise InvalidCreditSpec(f"invalid credit spec '{shown}': MoreCreditAfter ({m}) must not "
                                    f"exceed InitialCredit ({i})")

    @classmethod
    def parse(cls, text: str) -> "CreditSpec":
        """Accepts "400,200", "{400,200}" and spaces around the numbers."""
        body = str(text).strip()
        if body.startswith("{") and body.endswith("}"):
            body = body[1:-1]
        parts = [p.strip() for p in body.split(",")]
        if len(parts) != 2:
            raise InvalidCreditSpec(f"invalid credit spec '{text}': expected InitialCredit,MoreCreditAfter")
        try:
            initial, more = (int(p) for p in parts)
        except ValueError:
            raise InvalidCreditSpec(f"invalid credit spec '{text}': values must be whole numbers") from None
        return cls(initial, more)

    @property
    def disabled(self) -> bool:
        return self.initial == 0 and self.more_after == 0

    def __str__(self) -> str:
        return f"{self.initial},{self.more_after}"


DEFAULT_CREDIT = CreditSpec(400, 200)              # credit_flow_default_credit
MSG_STORE_CREDIT_DISC_BOUND = CreditSpec(4000, 800)  # msg_store_credit_disc_bound


@dataclass(frozen=True)
class Grant:
    """A ``bump_credit`` of ``amount`` that must be sent to ``to``."""

    to: Hashable
    amount: int


@dataclass(frozen=True)
class CreditStatistics:
    blocked: bool
    blocked_by: tuple
    block_started_ns: int | None
    blocked_total_ns: int
    block_count: int
    credit_from: dict
    credit_to: dict
    deferred_grants: int
    state: str


class CreditFlow:
    def __init__(self, spec: CreditSpec = DEFAULT_CREDIT) -> None:
        self.spec = spec
        self._peer_spec: dict = {}
        self._credit_from: dict = {}     # peer -> credit left as a sender
        self._credit_to: dict = {}       # peer -> acks left before the next grant
        self._blocked_by: list = []
        self._block_started_ns: int | None = None
        self._blocked_total_ns = 0
        self._block_count = 0
        self._deferred: dict = {}        # peer -> credit held back

    def set_peer_spec(self, peer, spec: CreditSpec) -> None:
        self._peer_spec[peer] = spec

    def _spec(self, peer) -> CreditSpec:
        return self._peer_spec.get(peer, self.spec)

    # -- sender side ------------------------------------------------------------------
    def send(self, to, now_ns: int, n: int = 1) -> None:
        c = self._credit_from.get(to)
        if c is None:
            c = self._spec(to).initial
        after = c - n
        self._credit_from[to] = after
        if c >= 1 and after <= 0:
            self._block(to, now_ns)

    def handle_bump(self, frm, amount: int, now_ns: int):
        c = self._credit_from.get(frm, 0)
        after = c + amount
        self._credit_from[frm] = after
        if c <= 0 < after:
            return self.unblock(frm, now_ns)
        return _NO_GRANTS

    def credit_towards(self, peer) -> int:
        c = self._credit_from.get(peer)
        return self._spec(peer).initial if c is None else c

    # -- receiver side ----------------------------------------------------------------
    def ack(self, frm, n: int = 1):
        more = self._spec(frm).more_after
        c = self._credit_to.get(frm)
        if c is None:
            c = more
        if c >= 1 and c - n <= 0 and more > 0:
            # the countdown hits 1 on ack number c, then every `more` acks after it
            grants = 1 + (n - c) // more
            self._credit_to[frm] = more - (n - c) % more
            return self._grant(frm, grants * more)
        self._credit_to[frm] = c - n
        return _NO_GRANTS

    def _grant(self, to, amount: int):
        if self._blocked_by:
            self._deferred[to] = self._deferred.get(to, 0) + amount
            return _NO_GRANTS
        return [Grant(to, amount)]

    # -- blocking -------------------------------------------------------------------------
    @property
    def blocked(self) -> bool:
        return bool(self._blocked_by)

    def _block(self, key, now_ns: int) -> None:
        if not self._blocked_by:
            self._block_started_ns = now_ns
            self._block_count += 1
        self._blocked_by.append(key)

    def block(self, key, now_ns: int) -> None:
        """An explicit blocker, like RabbitMQ's ``credit_flow:block/1``."""
        self._block(key, now_ns)

    def unblock(self, key, now_ns: int):
        blockers = self._blocked_by
        try:
            blockers.remove(key)
        except ValueError:
            pass
        else:
            if not blockers and self._block_started_ns is not None:
                self._blocked_total_ns += now_ns - self._block_started_ns
        if blockers or not self._deferred:
            return _NO_GRANTS
        deferred, self._deferred = self._deferred, {}
        return [Grant(to, amount) for to, amount in deferred.items()]

    def peer_down(self, peer, now_ns: int):
        grants = self.unblock(peer, now_ns)
        self._credit_from.pop(peer, None)
        self._credit_to.pop(peer, None)
        return grants

    def state(self, now_ns: int) -> str:
        if self._blocked_by:
            return "flow"
        started = self._block_started_ns
        if started is not None and now_ns - started < STATE_CHANGE_INTERVAL_NS:
            return "flow"
        return "running"

    def statistics(self, now_ns: int) -> CreditStatistics:
        total = self._blocked_total_ns
        if self._blocked_by and self._block_started_ns is not None:
            total += now_ns - self._block_started_ns
        return CreditStatistics(
            blocked=bool(self._blocked_by), blocked_by=tuple(self._blocked_by),
            block_started_ns=self._block_started_ns, blocked_total_ns=total, block_count=self._block_count,
            credit_from=dict(self._credit_from), credit_to=dict(self._credit_to),
            deferred_grants=sum(self._deferred.values()), state=self.state(now_ns))
