"""The load side's Prometheus metrics: PerfTest's names built from one second's report, then a real
``creditflow run --metrics-port 0`` scraped while it runs."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from conftest import ROOT, creditflow_cmd, kill_group
from pipeline.loadgen import latency
from pipeline.loadgen.harness import SecondReport
from pipeline.loadgen.metrics import NO_LATENCY, LoadMetrics, add_latency, families


def histogram_text(*values_us: int) -> str:
    hist = latency.new_histogram()
    for v in values_us:
        hist.record_value(v)
    return latency.encode(hist)


def second(*, consumer_us=(1000, 2000, 3000), confirm_us=(500,), published=1000, delivered=990) -> SecondReport:
    consumer = latency.percentiles(latency.decode(histogram_text(*consumer_us)))
    hists = {"consumer": histogram_text(*consumer_us)}
    confirm = None
    if confirm_us is not None:
        hists["confirm"] = histogram_text(*confirm_us)
        confirm = latency.percentiles(latency.decode(hists["confirm"]))
    return SecondReport(time_s=1.0, sent_rate=1000.0, confirmed_rate=980.0, received_rate=990.0, nacked=2,
                        returned=1, consumer=consumer, confirm=confirm, blocked={}, published=published,
                        delivered=delivered, histograms=hists, confirmed_total=980, nacked_total=2,
                        returned_total=1)


def scrape_text(collector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def parsed(text: str) -> dict:
    """name -> (type, {(sample name, labels as a sorted tuple): value})."""
    return {f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(text)}


# -- pure ----------------------------------------------------------------------------------------------------
def test_a_second_becomes_perftests_gauges_summaries_and_running_totals():
    rep = second()
    got = parsed(scrape_text(_Fixed(families(rep, add_latency(NO_LATENCY, rep)))))

    assert got["perftest_published"] == ("gauge", {("perftest_published", ()): 1000.0})   # msg/s, as PerfTest's
    assert got["perftest_consumed"][1] == {("perftest_consumed", ()): 990.0}
    assert got["perftest_nacked"][1] == {("perftest_nacked", ()): 2.0}
    assert got["creditflow_perf_published"] == ("counter", {("creditflow_perf_published_total", ()): 1000.0})
    assert got["creditflow_perf_confirmed"][1] == {("creditflow_perf_confirmed_total", ()): 980.0}
    kind, samples = got["perftest_latency_seconds"]
    assert kind == "summary"
    assert samples[("perftest_latency_seconds", (("quantile", "0.5"),))] == pytest.approx(0.002, rel=0.01)
    assert {q for (name, labels) in samples for _, q in labels} == {"0.5", "0.75", "0.95", "0.99"}
    assert samples[("perftest_latency_seconds_count", ())] == 3
    assert samples[("perftest_latency_seconds_sum", ())] == pytest.approx(0.006, rel=0.01)
    assert got["perftest_latency_seconds_max"][1] == {("perftest_latency_seconds_max", ()): pytest.approx(0.003,
                                                                                                       rel=0.01)}
    assert got["perftest_confirm_latency_seconds"][1][("perftest_confirm_latency_seconds_count", ())] == 1


def test_latency_count_and_sum_run_on_while_quantiles_are_the_last_seconds():
    metrics = LoadMetrics()
    assert scrape_text(metrics) == ""                              # nothing before the first second
    metrics.update(second(consumer_us=(1000,) * 4))
    metrics.update(second(consumer_us=(9000,), confirm_us=None))   # a run without confirms: no confirm family

    got = parsed(scrape_text(metrics))
    samples = got["perftest_latency_seconds"][1]
    assert samples[("perftest_latency_seconds_count", ())] == 5
    assert samples[("perftest_latency_seconds_sum", ())] == pytest.approx(0.013, rel=0.01)
    assert samples[("perftest_latency_seconds", (("quantile", "0.99"),))] == pytest.approx(0.009, rel=0.01)
    assert "perftest_confirm_latency_seconds" not in got


class _Fixed:
    def __init__(self, fams):
        self.fams = fams

    def collect(self):
        return self.fams


# -- a real run ------------------------------------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_run_serves_its_metrics_while_it_runs(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(creditflow_cmd("run", "-x", "1", "-y", "1", "-r", "400", "-c", "50", "-z", "4",
                                           "--plain", "--metrics-port", "0", "--run-dir", str(run_dir)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        first = ""
        while not (found := re.search(r"load metrics .*http://127\.0\.0\.1:(\d+)/metrics", first)):
            line = proc.stdout.readline()
            assert line, first
            first += line
        port = int(found.group(1))
        time.sleep(2.5)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        out, _ = proc.communicate(timeout=90)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, first + out

    got = parsed(text)
    published = got["creditflow_perf_published"][1][("creditflow_perf_published_total", ())]
    assert 200 <= published <= 1600, text                          # one to three seconds in, at 400 msg/s
    assert got["perftest_published"][1][("perftest_published", ())] == pytest.approx(400, rel=0.2)
    assert got["perftest_latency_seconds"][0] == "summary"
    assert got["perftest_latency_seconds"][1][("perftest_latency_seconds_count", ())] > 0
    assert got["perftest_confirm_latency_seconds"][1][("perftest_confirm_latency_seconds", (("quantile", "0.5"),))] > 0
    assert json.loads((run_dir / "config.json").read_text())["metrics_port"] == port
    with pytest.raises(OSError):                                   # gone with the run
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
