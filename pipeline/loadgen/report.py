"""PerfTest's per-second line."""

from __future__ import annotations


def _lat(s: dict | None) -> str:
    if not s:
        return "0/0/0/0/0/0"
    return "/".join(str(s.get(k, 0)) for k in ("min", "p50", "p75", "p95", "p99", "max"))


def format_line(rep) -> str:
    parts = [f"time {rep.time_s:.3f} s", f"sent: {rep.sent_rate:.0f} msg/s"]
    if rep.confirm is not None:
        parts.append(f"confirmed: {rep.confirmed_rate:.0f} msg/s")
    parts.append(f"received: {rep.received_rate:.0f} msg/s")
    parts.append(f"min/median/75th/95th/99th/max consumer latency: {_lat(rep.consumer)} µs")
    if rep.confirm is not None:
        parts.append(f"confirm latency: {_lat(rep.confirm)} µs")
    return ", ".join(parts)
