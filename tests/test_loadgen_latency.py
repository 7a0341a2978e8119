"""HDR latency: cheap recording loses nothing at the histogram's resolution; histograms travel as text."""

from __future__ import annotations

import re

from hypothesis import given, strategies as st

from pipeline.loadgen import latency


@given(st.integers(min_value=latency.LOWEST_US, max_value=latency.HIGHEST_US))
def test_rounding_matches_the_histograms_own_buckets(value):
    hist = latency.new_histogram()
    assert latency.clamp_us(value) == hist.get_lowest_equivalent_value(value)


def test_out_of_range_values_are_clipped():
    assert latency.clamp_us(0) == latency.clamp_us(-5) == 1
    assert latency.clamp_us(10**12) == latency.new_histogram().get_lowest_equivalent_value(latency.HIGHEST_US)


def test_recorder_gives_the_same_percentiles_as_recording_directly():
    values = [1, 7, 250, 999, 1000, 2047, 2048, 5001, 123_456, 987_654, 3_000_000] * 13 + list(range(1, 3000, 7))
    direct = latency.new_histogram()
    rec = latency.LatencyRecorder()
    for v in values:
        direct.record_value(v)
        rec.record_us(v)
    taken = rec.take()
    assert latency.percentiles(taken) == latency.percentiles(direct)
    assert taken.get_total_count() == len(values) == rec.recorded
    assert len(rec.counts) == 0
    assert rec.take().get_total_count() == 0           # a take empties the recorder


def test_percentiles_of_known_values():
    rec = latency.LatencyRecorder()
    for v in range(1, 1001):
        rec.record_us(v)
    p = latency.percentiles(rec.take())
    assert p == {"count": 1000, "min": 1, "p50": 500, "p75": 750, "p95": 950, "p99": 990, "max": 1000}


def test_an_empty_histogram_reports_zeros():
    assert latency.percentiles(latency.new_histogram()) == {
        "count": 0, "min": 0, "p50": 0, "p75": 0, "p95": 0, "p99": 0, "max": 0}


def test_encoded_histograms_are_base64_text_and_round_trip():
    rec = latency.LatencyRecorder()
    for v in (5, 50, 500, 5000, 50_000):
        rec.record_us(v, count=3)
    hist = rec.take()
    text = latency.encode(hist)
    assert isinstance(text, str) and re.fullmatch(r"[A-Za-z0-9+/=]+", text)
    assert latency.percentiles(latency.decode(text)) == latency.percentiles(hist)


def test_merge_of_encoded_parts_equals_one_histogram_of_everything():
    parts, whole = [], latency.new_histogram()
    for base in (10, 1000, 100_000):
        rec = latency.LatencyRecorder()
        for v in range(base, base * 3, max(1, base // 10)):
            rec.record_us(v)
            whole.record_value(v)
        parts.append(latency.encode(rec.take()))
    merged = latency.merge(parts + ["", latency.encode(latency.new_histogram())])
    assert latency.percentiles(merged) == latency.percentiles(whole)
    assert latency.percentiles(merged)["min"] == 10     # an empty part does not drag the minimum to 0
