"""Where every published message ended up: delivered, undelivered, lost or rejected.

A run ends in two steps. At -z publishers stop, wait for their confirms and
close their connections (close-ok comes once the broker has read every
publish, see ``publisher``); consumers go on receiving. This drain ends at
the first of (``DRAIN_*``):

==============  ==============================================================
delivered       every publisher has ended and every expected copy arrived
broker empty    every publisher has ended, every consumed queue reports no
                ready and no unacked message, and nothing moved (no delivery,
                no queue counter changed) for ``QUIET_S``
idle            no broker to ask (``run_load`` without ``broker``): every
                publisher has ended and nothing arrived for ``IDLE_S``
time            ``drain_s`` ran out
consumers gone  no consumer process is left
==============  ==============================================================

Then, per publisher ``p`` and consumed queue ``q`` that ``p``'s publishes
are routed to (one with a consumer; a publish is expected once in each,
``C[p]`` times in all, see ``topology``), where ``H[p,q]`` is
the highest sequence of ``p`` a consumer of ``q`` received and ``taken[p]``
the highest known to have reached the broker (confirmed or nacked through
it, or received by any consumer):

``rejected``
    publishes the broker refused: nacked, returned as unroutable, and, when
    the broker closed ``p``'s channel or connection with a reply code (406
    for an over-size message, ...), every publish after ``taken[p]``: the
    broker discards what follows the frame it refused. Counted in publishes,
    by reason (``rejections``).
``expected``
    ``(sent - rejected) * C[p]`` summed over publishers, in copies.
``outstanding``
    ``expected - delivered`` (not below 0).
``undelivered``
    the part of ``outstanding`` that may still have been on its way when the
    drain ended: at most what the consumed queues held then (ready +
    unacked) plus, per ``p`` and ``q``, the publishes after ``H[p,q]`` (in
    socket buffers, the reader, a channel or the queue; the broker keeps a
    connection's publishes in order). None when the drain ended with the
    broker empty and every publisher's connection closed or refused: then
    nothing can still be on its way.
``lost``
    ``outstanding - undelivered``: accepted by the broker and gone. A defect,
    unless the queues' arguments drop messages by design (``x-max-length``
    with drop-head, ``x-message-ttl``): then the same count is ``dropped``
    and ``lost`` is 0 (the load side cannot tell one from the other).

So ``delivered + undelivered + lost + dropped == sum((sent - rejected) * C[p])`` when no
copy arrived twice. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.loadgen.config import LoadConfig

QUIET_S = 1.5                 # over a stage's slowest statistics interval (1 s with telemetry off)
IDLE_S = 5.0

DRAIN_DELIVERED = "delivered"
DRAIN_EMPTY = "broker empty"
DRAIN_IDLE = "idle"
DRAIN_TIME = "time"
DRAIN_CONSUMERS_GONE = "consumers gone"

CLOSED, REFUSED, FAILED, OPEN = "closed", "refused", "failed", "open"
NACKED = "nacked"
RETURNED = "returned unroutable"


@dataclass(frozen=True)
class QueueDepth:
    """One queue as the broker reports it: its depth, and counters that show it still moves."""
    messages: int                 # ready for delivery
    unacked: int                  # delivered, not yet acknowledged
    enqueued: int = 0
    delivered: int = 0

    @property
    def held(self) -> int:
        return self.messages + self.unacked


@dataclass(frozen=True)
class BrokerView:
    """What the broker says its queues hold (``creditflow ctl status``), by queue name."""
    queues: dict = field(default_factory=dict)

    def held(self, names) -> int:
        return sum(self.queues[n].held for n in names if n in self.queues)

    def empty(self, names) -> bool:
        """Every named queue is known and holds nothing."""
        return all(n in self.queues and self.queues[n].held == 0 for n in names)

    def same_as(self, other: "BrokerView | None", names) -> bool:
        """Nothing moved between ``other`` and this view in the named queues."""
        return other is not None and all(self.queues.get(n) == other.queues.get(n) for n in names)


@dataclass(frozen=True)
class DrainEnd:
    """How the drain after -z ended."""
    why: str                      # a DRAIN_* reason
    seconds: float
    queues: dict | None = None    # consumed queue -> QueueDepth at that moment; None without a broker view


@dataclass(frozen=True)
class Accounts:
    expected: int                 # copies the consumers should get
    delivered: int
    undelivered: int
    lost: int
    rejected: int                 # publishes
    rejections: dict              # reason -> publishes
    dropped: int = 0              # copies the queues may have dropped by design (``cfg.queues_may_drop``)


def consumed_queues(cfg: LoadConfig) -> list[str]:
    return [q for q in cfg.queues if cfg.consumers_on(q)]


def account(cfg: LoadConfig, publishers: dict, consumers: dict, drain: DrainEnd | None) -> Accounts:
    """Classify every publish. ``publishers`` and ``consumers`` map worker names (``publisher-0``,
    ``consumer-1``) to their latest statistics; ``drain`` is None while the drain goes on (then
    only ``expected`` and ``rejected`` mean anything)."""
    queues = consumed_queues(cfg) if cfg.producers else []
    highest: dict[str, dict[str, int]] = {q: {} for q in queues}      # queue -> producer id -> sequence
    delivered = 0
    for name, stats in consumers.items():
        delivered += stats.get("received", 0) - stats.get("foreign", 0)      # another tool's are not ours
        q = cfg.consumer_queue(int(name.rsplit("-", 1)[1]))
        top = highest.setdefault(q, {})
        for producer, seq in (stats.get("highest") or {}).items():
            top[str(producer)] = max(top.get(str(producer), 0), seq)
    expected = rejected = tails = 0
    rejections: dict[str, int] = {}
    proven = True                                  # every publisher's connection closed or was refused
    for name, stats in publishers.items():
        pid = name.rsplit("-", 1)[1]
        sent = stats.get("sent", 0)
        nacked, returned = stats.get("nacked", 0), stats.get("returned", 0)
        reached = [q for q in cfg.producer_queues(int(pid)) if q in highest]
        heard = [highest[q].get(pid, 0) for q in reached]
        taken = min(sent, max([stats.get("settled_through", 0), *heard]))
        connection = stats.get("connection", OPEN)
        proven = proven and connection in (CLOSED, REFUSED)
        limit = sent
        if connection == REFUSED:
            limit = taken
            if sent > taken:
                reason = stats.get("refusal") or "closed by the broker"
                rejections[reason] = rejections.get(reason, 0) + sent - taken
        for reason, n in ((NACKED, nacked), (RETURNED, returned)):
            if n:
                rejections[reason] = rejections.get(reason, 0) + n
        rejected += nacked + returned + sent - limit
        expected += max(0, limit - nacked - returned) * len(reached)
        tails += sum(max(0, limit - h) for h in heard)
    outstanding = max(0, expected - delivered)
    if drain is None:
        undelivered = lost = 0
    elif drain.why == DRAIN_EMPTY and proven:
        undelivered, lost = 0, outstanding
    else:
        held = sum(d.held for q, d in (drain.queues or {}).items() if q in queues)
        undelivered = min(outstanding, held + tails)
        lost = outstanding - undelivered
    dropped = 0
    if lost and cfg.queues_may_drop:
        dropped, lost = lost, 0
    return Accounts(expected=expected, delivered=delivered, undelivered=undelivered, lost=lost,
                    rejected=rejected, rejections=rejections, dropped=dropped)
