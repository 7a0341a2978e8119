"""The message store's fsync times as a cumulative histogram (what ``/metrics`` exports).

The store reports each fsync's duration in its statistics (``fsync_events``:
``(at_ns, duration_ns)`` pairs, each reported once); the supervisor feeds them
here as they arrive and puts ``snapshot()`` in its ``status``. Counts only
grow, across store restarts too, as a Prometheus histogram's must.
"""

from __future__ import annotations

import bisect

# upper bounds in seconds: a page-cache fsync takes tens of µs, a loaded disk tens of ms
FSYNC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LatencyHistogram:
    def __init__(self, bounds_s: tuple[float, ...] = FSYNC_BUCKETS_S) -> None:
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)      # the last: above every bound (+Inf)
        self.sum_s = 0.0

    def add(self, duration_ns: int) -> None:
        seconds = max(0, duration_ns) / 1e9
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
        self.sum_s += seconds

    def snapshot(self) -> dict:
        """``buckets``: [[upper bound in seconds or "+Inf", cumulative count], ...], ``count``, ``sum_s``."""
        buckets, total = [], 0
        for bound, n in zip((*self.bounds_s, "+Inf"), self.counts):
            total += n
            buckets.append([bound, total])
        return {"buckets": buckets, "count": total, "sum_s": self.sum_s}
