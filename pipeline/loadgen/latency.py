"""Latency in HDR histograms: microseconds, 1 µs .. 60 s, 3 significant digits.

Recording straight into an ``HdrHistogram`` costs over a microsecond per
value in Python, a large share of what a consumer may spend per message. So
the hot path counts values in a plain dict (``LatencyRecorder.record_us``),
first rounding each value down to the histogram's own resolution — with 3
significant digits a value keeps its 11 highest bits — so the dict stays
small (a few thousand keys) and nothing is lost. Once a second the counts
are folded into a histogram (``take``).

Histograms cross process boundaries in HdrHistogram's own compressed base64
encoding (``encode`` / ``decode``), never pickled.
"""

from __future__ import annotations

from collections.abc import Iterable

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 60_000_000
SIGNIFICANT_DIGITS = 3
RESOLUTION_BITS = 11              # 2 * 10**3 sub-buckets round up to 2**11
PERCENTILES = (("min", None), ("p50", 50.0), ("p75", 75.0), ("p95", 95.0), ("p99", 99.0), ("max", None))


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)


def clamp_us(value_us: int) -> int:
    """``value_us`` clipped to the histogram's range and rounded down to its resolution."""
    if value_us < LOWEST_US:
        return LOWEST_US
    if value_us > HIGHEST_US:
        value_us = HIGHEST_US
    shift = value_us.bit_length() - RESOLUTION_BITS
    return value_us >> shift << shift if shift > 0 else value_us


class LatencyRecorder:
    """Counts latencies cheaply; ``take`` turns what was counted into a histogram."""

    __slots__ = ("counts", "recorded")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.recorded = 0

    def record_us(self, value_us: int, count: int = 1) -> None:
        key = clamp_us(value_us)
        self.counts[key] = self.counts.get(key, 0) + count

    def take(self) -> HdrHistogram:
        """A histogram of every value recorded since the last ``take``."""
        hist = new_histogram()
        for value, count in self.counts.items():
            hist.record_value(value, count)
            self.recorded += count
        self.counts.clear()
        return hist


def encode(hist: HdrHistogram) -> str:
    return hist.encode().decode("ascii")


def decode(text: str) -> HdrHistogram:
    return HdrHistogram.decode(text.encode("ascii"))


def merge(histograms: Iterable[HdrHistogram | str]) -> HdrHistogram:
    """One histogram holding every value of ``histograms`` (objects or encoded text; empty text skipped)."""
    total = new_histogram()
    for hist in histograms:
        if isinstance(hist, str):
            if not hist:
                continue
            hist = decode(hist)
        if hist.get_total_count():
            total.add(hist)
    return total


def percentiles(hist: HdrHistogram) -> dict[str, int]:
    """``count``, ``min``, ``p50``, ``p75``, ``p95``, ``p99``, ``max`` in µs; all 0 when empty."""
    count = hist.get_total_count()
    out = {"count": count}
    for name, pct in PERCENTILES:
        if not count:
            out[name] = 0
        elif name == "min":
            out[name] = hist.get_min_value()
        elif name == "max":
            out[name] = hist.get_max_value()
        else:
            out[name] = hist.get_value_at_percentile(pct)
    return out
