"""The max-rate search and steps within a run: the pure controllers, then each once against a real broker."""

from __future__ import annotations

import json
import subprocess

import pytest

from pipeline.loadgen.config import InvalidLoadConfig, LoadConfig
from pipeline.loadgen.maxrate import BACKLOG_LIMIT, PERIOD_S, RateSearch
from pipeline.loadgen.steps import parse_step, step_configs

from conftest import ROOT, creditflow_cmd


class Pipe:
    """A broker that passes at most ``capacity`` msg/s; publishers send what they are asked for."""

    def __init__(self, capacity: float):
        self.capacity = capacity
        self.published = self.received = 0

    def period(self, rate: float) -> tuple[int, int]:
        self.published += round(rate * PERIOD_S)
        self.received = min(self.published, self.received + round(self.capacity * PERIOD_S))
        return self.published, self.received


def test_the_search_rises_while_backlogs_stay_small_and_settles_under_capacity():
    pipe, search = Pipe(25_000), RateSearch(10_000)
    t = 0.0
    for _ in range(30):
        t += PERIOD_S
        search.observe(t, *pipe.period(search.rate))
    assert search.periods[0].sustained and search.periods[0].rate == 10_000
    assert search.periods[1].rate == 20_000                      # doubled after a held period
    assert any(not p.sustained for p in search.periods)          # it went over and came back
    assert 20_000 <= search.found <= 25_000 + BACKLOG_LIMIT / PERIOD_S
    assert all(p.receive_backlog <= BACKLOG_LIMIT for p in search.periods if p.sustained)


def test_a_period_is_judged_only_once_it_is_over():
    search = RateSearch(1000)
    assert search.observe(1.0, 1000, 1000) is None
    assert search.observe(2.0, 2000, 2000) == 2000.0
    assert search.found == 1000.0


def test_publishers_that_cannot_keep_up_bring_the_rate_down_to_what_they_sent():
    search = RateSearch(50_000)
    assert search.observe(2.0, 30_000, 30_000) == 15_000.0        # 15,000 msg/s went out of 50,000 asked
    assert search.found is None and search.periods[0].publish_backlog == 70_000


def test_fan_out_copies_count_once_per_message():
    search = RateSearch(1000, copies=3)
    search.observe(2.0, 2000, 6000)
    assert search.periods[0].receive_backlog == 0 and search.periods[0].sustained


def test_steps_set_one_dimension_each():
    plan = parse_step("publishers=1,2,4", 5)
    assert [c.producers for c in step_configs(LoadConfig(), plan)] == [1, 2, 4]
    assert {c.duration_s for c in step_configs(LoadConfig(), plan)} == {5}
    assert [c.confirm for c in step_configs(LoadConfig(), parse_step("inflight=10,100", 1))] == [10, 100]
    with pytest.raises(InvalidLoadConfig, match="one of rate, size"):
        parse_step("threads=1", 1)
    with pytest.raises(InvalidLoadConfig, match="must be at least 1"):
        step_configs(LoadConfig(), parse_step("inflight=0", 1))


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_stepped_run_and_a_max_rate_search_against_a_real_broker(tmp_path):
    done = subprocess.run(creditflow_cmd("run", "-y", "1", "-c", "100", "-r", "300", "--step", "publishers=1,2",
                                         "--step-seconds", "2", "--plain", "--run-dir", str(tmp_path / "steps")),
                          capture_output=True, text=True, cwd=ROOT, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    s = json.loads((tmp_path / "steps" / "summary.json").read_text())
    assert [(r["publishers"], r["published"], r["lost"]) for r in s["steps"]] == [(1, 600, 0), (2, 1200, 0)]
    assert s["published"] == s["delivered"] == 1800
    assert "publishers  published" in done.stdout

    done = subprocess.run(creditflow_cmd("run", "-x", "1", "-y", "1", "-z", "8", "-r", "2000", "--max-rate",
                                         "--plain", "--run-dir", str(tmp_path / "max")),
                          capture_output=True, text=True, cwd=ROOT, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads((tmp_path / "max" / "summary.json").read_text())["max_rate"]
    assert len(found["periods"]) >= 3 and found["periods"][0]["rate"] == 2000
    assert found["found"] == max(p["rate"] for p in found["periods"] if p["sustained"])
    assert f"max sustainable rate: {found['found']:,.0f} msg/s" in done.stdout
