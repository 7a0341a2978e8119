"""Each broker process's state over time, as RabbitMQ shows it, kept on change only.

A reader's state is its connection's (``running``, ``flow``, ``blocking``,
``blocked``). Any other stage is ``flow`` while it is credit-blocked and for
one second after its last block began (RabbitMQ's rule: a process shows
``flow`` if it was blocked within the last second), ``running`` otherwise.

A state changes only when a stage pushes statistics (``observe``) or when a
``flow`` held by the one-second rule runs out (``tick``, which looks only at
the processes with such a deadline): an idle broker with thousands of
connections has nothing to tick. Each change comes back as a :class:`Change`
for the telemetry's ``states`` rows, and the time spent in each state is
accumulated exactly, in nanoseconds, from one change to the next.

A stage pushes a block or an unblock at once only when it changes what the
supervisor shows (``push_due_ns``): a channel that blocks many times a second
shows ``flow`` throughout, and tells the supervisor of its newer blocks once
before the hold of the last one it told of would run out.

Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

FLOW_HOLD_NS = 1_000_000_000       # a block shows as `flow` for this long after it began
STATES = ("running", "flow", "blocking", "blocked")
PUSH_AHEAD_NS = FLOW_HOLD_NS // 10  # a stage tells of a newer block this long before the supervisor's hold ends
NEVER = float("inf")


@dataclass(frozen=True)
class Change:
    """A process entered ``state`` at ``at_ns`` (also written when it ends, to close its last span)."""
    at_ns: int
    name: str
    kind: str | None
    state: str


@dataclass
class _Process:
    kind: str | None
    state: str
    since_ns: int
    first_ns: int
    spent_ns: dict[str, int] = field(default_factory=dict)
    ended: bool = False


def state_at(stats: dict, now_ns: int) -> str:
    """A process's state now, from its last statistics push (``conn_state``: the state it shows itself,
    as a reader shows its connection's, or as RabbitMQ's management API shows any of its processes)."""
    if stats.get("conn_state"):
        return stats["conn_state"]
    return "flow" if _flow_until(stats) > now_ns else "running"


def _flow_deadline(stats: dict, now_ns: int) -> int | None:
    """When the state will change by time alone (a held `flow` running out), if it will."""
    if stats.get("conn_state"):
        return None
    end = _flow_until(stats)
    return int(end) if now_ns < end < NEVER else None


def flow_until(blocked: bool, block_started_ns: int | None) -> float:
    """Until when a stage with these block facts shows `flow` (``NEVER`` while blocked; in the past
    if it never blocked)."""
    if blocked:
        return NEVER
    return -NEVER if block_started_ns is None else block_started_ns + FLOW_HOLD_NS


def _flow_until(stats: dict) -> float:
    return flow_until(bool(stats.get("blocked")), stats.get("block_started_ns"))


def push_due_ns(told: tuple[bool, int | None], now: tuple[bool, int | None], now_ns: int) -> float | None:
    """When a stage must push its statistics so that the state the supervisor shows from ``told`` (the
    ``(blocked, block_started_ns)`` of its last push) is the one ``now`` (its facts at ``now_ns``) gives:
    ``now_ns`` if they differ already, the moment ``PUSH_AHEAD_NS`` before they would come to differ
    by time alone, None if they never will until the facts change again."""
    if told == now:
        return None
    told_end, true_end = flow_until(*told), flow_until(*now)
    if (told_end > now_ns) != (true_end > now_ns):
        return now_ns
    if told_end <= now_ns or told_end == true_end:      # both running, or both flow until the same end
        return None
    return max(now_ns, min(told_end, true_end) - PUSH_AHEAD_NS)


class StateClock:
    """Every process's current state, the time it spent in each, and the changes to record."""

    def __init__(self) -> None:
        self.procs: dict[str, _Process] = {}
        self.stats: dict[str, dict] = {}
        self.deadlines: list[tuple[int, str, int]] = []  # (ns, name, block start): a held `flow` may end

    def observe(self, name: str, stats: dict, now_ns: int) -> Change | None:
        """A statistics push from ``name``; the change it makes, if any."""
        self.stats[name] = stats
        deadline = _flow_deadline(stats, now_ns)
        if deadline is not None:
            heapq.heappush(self.deadlines, (deadline, name, stats["block_started_ns"]))
        return self._enter(name, stats.get("kind"), state_at(stats, now_ns), now_ns)

    def tick(self, now_ns: int) -> list[Change]:
        """The changes time alone made by ``now_ns``: each held `flow` that ran out."""
        changes = []
        while self.deadlines and self.deadlines[0][0] <= now_ns:
            at_ns, name, started = heapq.heappop(self.deadlines)
            stats = self.stats.get(name)
            if stats is None or stats.get("block_started_ns") != started:
                continue                     # gone, or a later push (and its own deadline) says more
            change = self._enter(name, stats.get("kind"), state_at(stats, at_ns), at_ns)
            if change is not None:
                changes.append(change)
        return changes

    def end(self, name: str, now_ns: int) -> Change | None:
        """``name`` ended: close its last span (the row repeats its state at its end) and stop ticking it."""
        self.stats.pop(name, None)
        p = self.procs.get(name)
        if p is None or p.ended:
            return None
        self._spend(p, now_ns)
        p.ended = True
        return Change(now_ns, name, p.kind, p.state)

    def forget(self, name: str) -> None:
        self.procs.pop(name, None)
        self.stats.pop(name, None)

    def state(self, name: str) -> str | None:
        p = self.procs.get(name)
        return p.state if p is not None else None

    def seconds(self, name: str, now_ns: int) -> dict[str, float]:
        """Seconds ``name`` spent in each state up to ``now_ns`` (or to its end), ``total`` among them."""
        p = self.procs.get(name)
        if p is None:
            return {}
        spent = dict(p.spent_ns)
        if not p.ended and now_ns > p.since_ns:
            spent[p.state] = spent.get(p.state, 0) + now_ns - p.since_ns
        out = {state: ns / 1e9 for state, ns in spent.items()}
        out["total"] = sum(spent.values()) / 1e9
        return out

    def _enter(self, name: str, kind: str | None, state: str, now_ns: int) -> Change | None:
        p = self.procs.get(name)
        if p is None:
            self.procs[name] = _Process(kind, state, now_ns, now_ns)
            return Change(now_ns, name, kind, state)
        if p.ended:                         # a new incarnation under the same name
            p.ended, p.state, p.since_ns = False, state, now_ns
            return Change(now_ns, name, kind, state)
        if state == p.state:
            return None
        self._spend(p, now_ns)
        p.state = state
        return Change(now_ns, name, kind, state)

    @staticmethod
    def _spend(p: _Process, now_ns: int) -> None:
        if now_ns > p.since_ns:
            p.spent_ns[p.state] = p.spent_ns.get(p.state, 0) + now_ns - p.since_ns
            p.since_ns = now_ns
