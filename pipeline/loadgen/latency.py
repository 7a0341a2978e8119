"""Latency in HDR histograms (µs, 1 µs .. 60 s, 3 significant digits).

Workers count latencies in a plain dict on the hot path (a dict update is
several times cheaper than recording into the histogram) and fold them into
an ``HdrHistogram`` once a second; histograms cross process boundaries in
HdrHistogram's own compressed base64 encoding.
"""

from __future__ import annotations

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 60_000_000
SIGNIFICANT_DIGITS = 3
PERCENTILES = (("min", None), ("p50", 50.0), ("p75", 75.0), ("p95", 95.0), ("p99", 99.0), ("max", None))


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)


def fold(hist: HdrHistogram, counts: dict[int, int]) -> None:
    for value, count in counts.items():
        hist.record_value(min(max(value, LOWEST_US), HIGHEST_US), count)
    counts.clear()


def encode(hist: HdrHistogram) -> str:
    return hist.encode().decode("ascii")


def decode(text: str) -> HdrHistogram:
    return HdrHistogram.decode(text.encode("ascii"))


def merge(texts) -> HdrHistogram:
    total = new_histogram()
    for text in texts:
        if text:
            total.add(decode(text))
    return total


def summary(hist: HdrHistogram) -> dict[str, int]:
    if hist.get_total_count() == 0:
        return {name: 0 for name, _ in PERCENTILES} | {"count": 0}
    out = {"count": hist.get_total_count()}
    for name, pct in PERCENTILES:
        if name == "min":
            out[name] = hist.get_min_value()
        elif name == "max":
            out[name] = hist.get_max_value()
        else:
            out[name] = hist.get_value_at_percentile(pct)
    return out
