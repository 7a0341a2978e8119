"""Edge-triggered alarms and RabbitMQ's log wording (pure).

A :class:`Watermark` turns a stream of "alarmed now?" readings into edges:
one ``set`` when the condition starts to hold, one ``clear`` when it stops;
repeats produce nothing. Memory is alarmed when used > limit, disk when
free < limit (both strict, as RabbitMQ). The disk poll interval adapts to
the headroom, assuming the disk can fill at 250 MB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

DISK_FAST_RATE_BYTES_PER_MS = 250_000
DISK_MIN_INTERVAL_MS = 100
DISK_MAX_INTERVAL_MS = 10_000
BANNER = "*" * 58


@dataclass(frozen=True)
class AlarmEdge:
    source: str
    edge: str            # 'set' | 'clear'


class Watermark:
    def __init__(self, source: str):
        self.source = source
        self.alarmed = False

    def update(self, alarmed_now: bool) -> AlarmEdge | None:
        if alarmed_now == self.alarmed:
            return None
        self.alarmed = alarmed_now
        return AlarmEdge(self.source, "set" if alarmed_now else "clear")


def memory_alarmed(used_bytes: int, limit_bytes: int) -> bool:
    return used_bytes > limit_bytes


def disk_alarmed(free_bytes: int, limit_bytes: int) -> bool:
    return free_bytes < limit_bytes


def disk_interval_ms(free_bytes: int | None, limit_bytes: int, alarmed: bool, *,
                     min_ms: int = DISK_MIN_INTERVAL_MS, max_ms: int = DISK_MAX_INTERVAL_MS) -> int:
    if alarmed or free_bytes is None:
        return max_ms
    ms = 2 * (free_bytes - limit_bytes) / DISK_FAST_RATE_BYTES_PER_MS
    return int(min(max(ms, min_ms), max_ms))


def alarm_set_lines(source: str, node: str) -> list[str]:
    return [f"{source} resource limit alarm set on node {node}.", "", BANNER,
            "*** Publishers will be blocked until this alarm clears ***", BANNER]


def alarm_cleared_line(source: str, node: str) -> str:
    return f"{source} resource limit alarm cleared on node {node}"


def memory_watermark_line(edge: str, used: int, allowed: int) -> str:
    return f"vm_memory_high_watermark {edge}. Memory used:{used} allowed:{allowed}"


def disk_line(edge: str, free: int, limit: int) -> str:
    word = "insufficient" if edge == "set" else "sufficient"
    return f"Free disk space is {word}. Free bytes: {free}. Limit: {limit}"
