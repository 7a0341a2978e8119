"""Edge-triggered alarms, the disk poll interval and RabbitMQ's log wording (pure).

Theory of operation
-------------------
A monitor reads a level (memory used, disk free) and compares it with its
limit; the comparison is a plain predicate, strict as RabbitMQ's:

    memory alarmed  <=>  used > limit        (used == limit is fine)
    disk alarmed    <=>  free < limit        (free == limit is fine)

A :class:`Watermark` turns the stream of "alarmed now?" answers into edges,
following the table ``_EDGES``: ``clear -> set`` returns a ``set`` edge,
``set -> clear`` a ``clear`` edge, and a repeat returns ``None`` — so a
repeated set or clear produces no second event, log line or notification.
Only edges travel to the supervisor and on to the readers.

The disk is polled more often the closer it is to its limit, assuming it
can fill at ``DISK_FAST_RATE_BYTES_PER_MS`` (250 MB/s)::

    interval_ms = clamp(2 * (free - limit) / 250_000, 100, 10_000)

and at the maximum while alarmed or while free space cannot be read.

The ``*_line`` / ``*_lines`` functions give the exact text RabbitMQ logs, so
a log written by creditflow can be read with the same eyes (and greps).
"""

from __future__ import annotations

from dataclasses import dataclass

from alarms.errors import UnknownSource

DISK_FAST_RATE_BYTES_PER_MS = 250_000
DISK_MIN_INTERVAL_MS = 100
DISK_MAX_INTERVAL_MS = 10_000
BANNER = "*" * 58
SOURCES = ("memory", "disk")

# (alarmed before, alarmed now) -> edge; a missing pair is a repeat, which is no edge
_EDGES = {(False, True): "set", (True, False): "clear"}


@dataclass(frozen=True)
class AlarmEdge:
    """A change of one alarm: ``edge`` is 'set' or 'clear'."""

    source: str
    edge: str


@dataclass(frozen=True)
class WatermarkStatistics:
    source: str
    alarmed: bool
    sets: int
    clears: int


class Watermark:
    """One alarm source; reports a change of its condition, never a repeat."""

    def __init__(self, source: str, alarmed: bool = False):
        """``alarmed``: the state it starts from (a restarted monitor takes over a set alarm)."""
        if source not in SOURCES:
            raise UnknownSource(f"unknown alarm source {source!r} (use one of {', '.join(SOURCES)})")
        self.source = source
        self.alarmed = bool(alarmed)
        self.sets = 0
        self.clears = 0

    def update(self, alarmed_now: bool) -> AlarmEdge | None:
        """Feed the condition as it holds now; an :class:`AlarmEdge` only when it changed."""
        edge = _EDGES.get((self.alarmed, bool(alarmed_now)))
        if edge is None:
            return None
        self.alarmed = edge == "set"
        if self.alarmed:
            self.sets += 1
        else:
            self.clears += 1
        return AlarmEdge(self.source, edge)

    def statistics(self) -> WatermarkStatistics:
        return WatermarkStatistics(self.source, self.alarmed, self.sets, self.clears)


def memory_alarmed(used_bytes: int, limit_bytes: int) -> bool:
    """True when the memory in use is above the watermark (strictly)."""
    return used_bytes > limit_bytes


def disk_alarmed(free_bytes: int, limit_bytes: int) -> bool:
    """True when free disk space is below the limit (strictly)."""
    return free_bytes < limit_bytes


def disk_interval_ms(free_bytes: int | None, limit_bytes: int, alarmed: bool, *,
                     min_ms: int = DISK_MIN_INTERVAL_MS, max_ms: int = DISK_MAX_INTERVAL_MS) -> int:
    """Milliseconds until the next disk reading; ``free_bytes`` None means the last reading failed."""
    if alarmed or free_bytes is None:
        return max_ms
    ms = 2 * (free_bytes - limit_bytes) / DISK_FAST_RATE_BYTES_PER_MS
    return int(min(max(ms, min_ms), max_ms))


def alarm_set_lines(source: str, node: str) -> list[str]:
    """What RabbitMQ logs (warning) when an alarm is set: the line, a blank line and the banner."""
    return [f"{source} resource limit alarm set on node {node}.", "", BANNER,
            "*** Publishers will be blocked until this alarm clears ***", BANNER]


def alarm_cleared_line(source: str, node: str) -> str:
    """What RabbitMQ logs (warning) when an alarm of this node clears."""
    return f"{source} resource limit alarm cleared on node {node}"


def alarm_cleared_across_cluster_line(source: str) -> str:
    """What RabbitMQ logs next when no node has that alarm any more (always, for one node)."""
    return f"{source} resource limit alarm cleared across the cluster"


def memory_watermark_line(edge: str, used: int, allowed: int) -> str:
    """The memory monitor's line (info) on an edge: 'set' or 'clear'."""
    return f"vm_memory_high_watermark {edge}. Memory used:{used} allowed:{allowed}"


def disk_line(edge: str, free: int, limit: int) -> str:
    """The disk monitor's line (info) on an edge: 'set' or 'clear'."""
    word = "insufficient" if edge == "set" else "sufficient"
    return f"Free disk space is {word}. Free bytes: {free}. Limit: {limit}"
