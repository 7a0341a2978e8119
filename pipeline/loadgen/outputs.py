"""A run's figures in other tools' formats: PerfTest's CSV (``-o``) and a JSON summary (``--json``).

The CSV is PerfTest's (``CsvMetricsFormatter``): the same header, one row a
second, rates in msg/s (returned and nacked too, counted over the second)
and latencies in µs, so a spreadsheet or script made for PerfTest's output
reads creditflow's. The JSON summary opens with lavinmqperf's throughput
fields (``elapsed_seconds``, ``avg_pub_rate``, ``avg_consume_rate``,
``latency_*_ms``, ``latency_count``) and goes on with what only creditflow
counts: where every message ended up, sends the rate limiter skipped, gaps
and duplicates, and per connection the seconds blocked by alarms and in
flow. Pure: figures in, text out.
"""

from __future__ import annotations

import csv
import io

CSV_HEADER = ("id", "time (s)", "published (msg/s)", "returned (msg/s)", "confirmed (msg/s)", "nacked (msg/s)",
              "received (msg/s)", "min consumer latency (µs)", "median consumer latency (µs)",
              "75th p. consumer latency (µs)", "95th p. consumer latency (µs)", "99th p. consumer latency (µs)",
              "min confirm latency (µs)", "median confirm latency (µs)", "75th p. confirm latency (µs)",
              "95th p. confirm latency (µs)", "99th p. confirm latency (µs)")
LATENCY_KEYS = ("min", "p50", "p75", "p95", "p99")


def perftest_csv(run_id: str, seconds) -> str:
    """PerfTest's CSV of ``seconds`` (``harness.SecondReport``s)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    previous = 0.0
    for rep in seconds:
        span = max(rep.time_s - previous, 1e-9)
        previous = rep.time_s
        confirm = rep.confirm or {}
        writer.writerow([run_id, f"{rep.time_s:.3f}", round(rep.sent_rate), round(rep.returned / span),
                         round(rep.confirmed_rate), round(rep.nacked / span), round(rep.received_rate),
                         *(rep.consumer.get(k, 0) for k in LATENCY_KEYS),
                         *(confirm.get(k, 0) for k in LATENCY_KEYS)])
    return out.getvalue()


def json_summary(summary: dict, window_s: float) -> dict:
    """lavinmqperf's fields, then creditflow's, from a run's ``summary.json`` and its producing window."""
    consumer = summary["latency_us"].get("consumer", {})
    out = {"elapsed_seconds": round(window_s, 3), "avg_pub_rate": round(summary["publish_rate"]),
           "avg_consume_rate": round(summary["deliver_rate"])}
    if consumer.get("count"):
        for key, name in (("min", "min"), ("p50", "median"), ("p75", "p75"), ("p95", "p95"), ("p99", "p99")):
            out[f"latency_{name}_ms"] = round(consumer[key] / 1000, 3)
        out["latency_count"] = consumer["count"]
    for key in ("published", "confirmed", "nacked", "returned", "delivered", "undelivered", "lost", "dropped",
                "rejected", "skipped", "foreign", "gaps", "duplicates", "reordered", "order"):
        if key in summary:
            out[key] = summary[key]
    out["latency_us"] = summary["latency_us"]
    out["drain"] = {k: summary["drain"][k] for k in ("end", "seconds")}
    out["connections"] = summary.get("connections", {})
    out["errors"] = summary.get("errors", [])
    return out
