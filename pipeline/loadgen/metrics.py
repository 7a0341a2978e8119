"""The load generator's figures as Prometheus metrics (``creditflow run --metrics-port``).

PerfTest's names where they fit. PerfTest (``--metrics-prometheus``) registers
its figures with Micrometer under the prefix ``perftest_``, and Micrometer's
Prometheus registry exports them as:

====================================  =========  ==================================================
``perftest_published``                gauge      msg/s over the last interval (1 s): a rate, not a
``perftest_confirmed``                           count, as PerfTest's are
``perftest_nacked``
``perftest_returned``
``perftest_consumed``
``perftest_latency_seconds``          summary    consumer latency: quantiles 0.5, 0.75, 0.95, 0.99
                                                 of the last interval, ``_count`` and ``_sum`` since
                                                 the start
``perftest_latency_seconds_max``      gauge      the last interval's highest
``perftest_confirm_latency_seconds``  summary    the same for publisher confirms (with ``-c``)
``perftest_confirm_latency_seconds_max``
====================================  =========  ==================================================

PerfTest exports no running totals; these are creditflow's, counters since
the start: ``creditflow_perf_published_total``, ``..._confirmed_total``,
``..._nacked_total``, ``..._returned_total``, ``..._consumed_total``.

Each second the harness hands its ``SecondReport`` (``harness.run_load``'s
``on_second``) to :meth:`LoadMetrics.update`; a scrape answers with the
families of the newest second. :func:`families` is pure: the second and the
latency totals so far in, metric families out; :func:`add_latency` folds a
second's histograms into those totals.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pipeline.loadgen import latency

PREFIX = "perftest_"
OWN_PREFIX = "creditflow_perf_"
QUANTILES = (("0.5", "p50"), ("0.75", "p75"), ("0.95", "p95"), ("0.99", "p99"))   # Micrometer's, PerfTest's
US_PER_S = 1_000_000
RATES = (("published", "sent_rate", "published messages per second, over the last second"),
         ("confirmed", "confirmed_rate", "confirmed messages per second, over the last second"),
         ("nacked", "nacked", "nacked messages per second, over the last second"),
         ("returned", "returned", "returned messages per second, over the last second"),
         ("consumed", "received_rate", "consumed messages per second, over the last second"))
TOTALS = (("published", "published", "messages published since the start"),
          ("confirmed", "confirmed_total", "publishes confirmed since the start"),
          ("nacked", "nacked_total", "publishes nacked since the start"),
          ("returned", "returned_total", "publishes returned (mandatory, unroutable) since the start"),
          ("consumed", "delivered", "messages consumed since the start"))
LATENCIES = (("latency", "consumer", "message latency"), ("confirm_latency", "confirm", "confirm latency"))


class LatencyTotals(NamedTuple):
    """Latencies recorded since the start, per kind (``consumer``, ``confirm``): count and sum in µs."""

    count: dict
    sum_us: dict


NO_LATENCY = LatencyTotals({}, {})


def add_latency(totals: LatencyTotals, rep) -> LatencyTotals:
    """``totals`` with the second ``rep``'s latencies added (from its HdrHistograms)."""
    count, sum_us = dict(totals.count), dict(totals.sum_us)
    for kind, text in (rep.histograms or {}).items():
        hist = latency.decode(text)
        n = hist.get_total_count()
        if n:
            count[kind] = count.get(kind, 0) + n
            sum_us[kind] = sum_us.get(kind, 0.0) + hist.get_mean_value() * n
    return LatencyTotals(count, sum_us)


def families(rep, totals: LatencyTotals) -> list:
    """The metric families of one second (a ``harness.SecondReport``), with ``totals`` (including it)."""
    out = []
    for name, attr, help_text in RATES:
        out.append(GaugeMetricFamily(PREFIX + name, help_text, value=float(getattr(rep, attr))))
    for name, attr, help_text in TOTALS:
        out.append(CounterMetricFamily(OWN_PREFIX + name, help_text, value=float(getattr(rep, attr))))
    for name, kind, help_text in LATENCIES:
        shown = rep.consumer if kind == "consumer" else rep.confirm
        if shown is None:
            continue
        base = f"{PREFIX}{name}_seconds"
        summary = Metric(base, help_text, "summary")
        if shown.get("count"):
            for quantile, key in QUANTILES:
                summary.add_sample(base, {"quantile": quantile}, shown[key] / US_PER_S)
        summary.add_sample(base + "_count", {}, float(totals.count.get(kind, 0)))
        summary.add_sample(base + "_sum", {}, totals.sum_us.get(kind, 0.0) / US_PER_S)
        out.append(summary)
        out.append(GaugeMetricFamily(base + "_max", help_text + ", the last second's highest",
                                     value=shown.get("max", 0) / US_PER_S))
    return out


class LoadMetrics(Collector):
    """The newest second's families, for a prometheus_client registry; ``update`` once a second."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = NO_LATENCY
        self._families: list = []

    def update(self, rep) -> None:
        totals = add_latency(self._totals, rep)
        shown = families(rep, totals)
        with self._lock:
            self._totals, self._families = totals, shown

    def collect(self):
        with self._lock:
            return list(self._families)


class MetricsServer:
    """``/metrics`` on 127.0.0.1:``port`` (0: any free one; ``port`` is then the one bound) until ``stop``."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server
        self.metrics = LoadMetrics()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.metrics)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port

    def update(self, rep) -> None:
        self.metrics.update(rep)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


__all__ = ["LatencyTotals", "LoadMetrics", "MetricsServer", "NO_LATENCY", "add_latency", "families"]
