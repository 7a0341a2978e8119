"""``creditflow stress``: verdicts from measured figures (pure), then the command with real brokers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, _started, kill_group
from pipeline.stress import catalogue
from pipeline.stress.catalogue import FAIL, PASS, SKIP, judge

STRESS = [sys.executable, "-m", "pipeline.stress"]


# -- verdicts: pure ----------------------------------------------------------------------------------
SLOW_CONSUMER = {"published": 300_000, "confirmed": 0, "delivered": 9_000, "undelivered": 291_000, "lost": 0,
                 "errors": [], "backlog_peak": 229_092, "reader_flow": 0.62}


def test_a_slow_consumer_passes_on_backlog_flow_and_nothing_lost():
    v = judge("slow-consumer", SLOW_CONSUMER)
    assert v.outcome == PASS
    assert "backlog reached 229,092 messages" in v.measured and "in flow 62%" in v.measured
    assert v.key == "backlog 229,092, flow 62%"


@pytest.mark.parametrize("change, why", [
    ({"reader_flow": 0.0}, "no publishing connection was ever in flow"),
    ({"backlog_peak": 999}, "backlog peaked at 999"),
    ({"lost": 3}, "3 messages lost"),
])
def test_a_slow_consumer_fails_on_each_missing_expectation(change, why):
    v = judge("slow-consumer", {**SLOW_CONSUMER, **change})
    assert v.outcome == FAIL
    assert any(why in f for f in v.failures)


def test_a_figure_not_observable_over_uri_is_said_not_checked():
    v = judge("slow-consumer", {**SLOW_CONSUMER, "reader_flow": None})
    assert v.outcome == PASS
    assert "flow not observable" in v.measured


def test_fanout_fails_when_publishing_does_not_fall_to_the_slow_queues_rate():
    facts = {"published": 1, "delivered": 2, "lost": 0, "rate_before": 4000.0, "rate_after": 1200.0,
             "slow_queue_rate": 800.0, "reader_flow": 0.5}
    v = judge("fanout-slow-queue", facts)
    assert v.outcome == FAIL and "not within 25%" in v.failures[0]
    assert judge("fanout-slow-queue", {**facts, "rate_after": 810.0}).outcome == PASS
    assert judge("fanout-slow-queue", {**facts, "rate_after": 3900.0, "slow_queue_rate": 3900.0}).outcome == FAIL


def test_a_killed_stage_without_a_recorded_death_or_541_fails():
    facts = {"killed": "channel-2.1", "death_action": "internal_error", "survivor_published_after_kill": 3000,
             "errors": ["publisher-0: broker closed the connection: 541 INTERNAL_ERROR"], "broker_alive": True,
             "lost": 0}
    assert judge("stage-killed", facts).outcome == PASS
    v = judge("stage-killed", {**facts, "death_action": None, "errors": []})
    assert v.outcome == FAIL
    assert v.failures == ("no death of channel-2.1 recorded", "the run did not report the closed publisher (541)")


def test_slow_disk_needs_confirms_to_rise_above_the_fsync_delay():
    facts = {"published": 6000, "confirmed": 6000, "queued": 6000, "fsync_delay_ms": 300,
             "base_confirm_p50_us": 70_000, "slow_confirm_p50_us": 660_000, "reader_flow": 0.002,
             "channel_flow": 0.98,
             "base_publish_rate": 14000.0, "slow_publish_rate": 1600.0}
    ok = judge("slow-disk", facts)
    assert ok.outcome == PASS and "channel in flow 98% of its time (its connection 0.2%)" in ok.measured
    v = judge("slow-disk", {**facts, "slow_confirm_p50_us": 250_000})
    assert v.failures == ("confirm p50 250000 µs under the fsync delay of 300000 µs",)


def test_the_verdict_line_and_the_table():
    v = judge("consumer-stops-reading", {"prefetch": 50, "published": 5000, "unacked": 50, "ready": 4950})
    line = catalogue.verdict_line(v)
    assert line.startswith("PASS  consumer-stops-reading  — 5,000 published")
    assert line.endswith("; expected: " + catalogue.BY_NAME["consumer-stops-reading"].expectation)
    bad = judge("consumer-stops-reading", {"prefetch": 50, "published": 5000, "unacked": 5000, "ready": 0})
    assert "[5000 unacked, prefetch 50; 0 ready of 5000 published" in catalogue.verdict_line(bad)
    skipped = catalogue.skipped("alarm", "needs a broker of its own")
    rows = catalogue.table([v, bad, skipped])
    assert rows[0].split() == ["scenario", "verdict", "key", "figure", "seconds"]
    assert [r.split()[1] for r in rows[2:5]] == [PASS, FAIL, SKIP]
    assert rows[-1] == "1 passed, 1 failed, 1 skipped in 0 s"


def test_every_scenario_has_a_judge_and_a_runner():
    from pipeline.stress.scenarios import RUNNERS
    names = [s.name for s in catalogue.CATALOGUE]
    assert set(names) == set(catalogue.JUDGES) == set(RUNNERS)
    assert len(set(names)) == len(names)


# -- the command ------------------------------------------------------------------------------------
def stress(*args: str, timeout_s: float = 60) -> tuple[int, str, str]:
    proc = subprocess.Popen([*STRESS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=ROOT)
    _started.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        kill_group(proc)
    return proc.returncode, out, err


def test_list_describes_every_scenario():
    code, out, _ = stress("--list")
    assert code == 0
    for s in catalogue.CATALOGUE:
        assert s.name in out and f"expects: {s.expectation}" in out


@pytest.mark.parametrize("args, reason", [
    (("no-such-scenario",), "creditflow stress: no scenario named 'no-such-scenario'"),
    ((), "creditflow stress: name a scenario, or all"),
    (("alarm", "--long"), "creditflow stress: --long goes with all"),
    (("all", "--uri", "http://localhost/"), "creditflow stress: --uri 'http://localhost/' is not an AMQP URI"),
])
def test_a_bad_option_exits_2_with_one_line_before_anything_starts(tmp_path, args, reason):
    code, out, err = stress(*args, "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert err.startswith(reason) and err.count("\n") == 1
    assert out == "" and not (tmp_path / "run").exists()


def verdict_of(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["stress"]


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("name", ["huge-messages", "consumer-stops-reading", "channel-churn"])
def test_a_scenario_on_its_own_broker_passes_and_leaves_its_run_directory(tmp_path, name):
    run_dir = tmp_path / name
    code, out, err = stress(name, "--run-dir", str(run_dir))
    assert code == 0, out + err
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"PASS  {name}  — ")
    assert verdict_of(run_dir)["line"] == last
    assert (run_dir / "config.json").exists() and (run_dir / "broker.log").exists()
    assert verdict_of(run_dir)["facts"]["broker_exit_code"] == 0


@pytest.mark.processes
@pytest.mark.slow
def test_over_uri_a_scenario_runs_on_that_broker_and_one_needing_its_own_is_skipped(broker, tmp_path):
    uri = f"amqp://guest:guest@127.0.0.1:{broker.port}/%2f"
    code, out, _ = stress("consumer-stops-reading", "--uri", uri, "--run-dir", str(tmp_path / "r"))
    assert code == 0
    assert out.strip().splitlines()[-1].startswith("PASS  consumer-stops-reading  — 5,000 published to a consumer "
                                                  "with prefetch 50 that never reads: unacked not observable")
    assert "stress-consumer-stops-reading" not in broker.status()["queues"], "its queue is deleted afterwards"
    code, out, _ = stress("alarm", "--uri", uri, "--run-dir", str(tmp_path / "s"))
    assert code == 0
    assert out.strip().splitlines()[-1].startswith("SKIP  alarm  — needs a broker of its own")


def test_an_unreachable_uri_exits_6_before_any_scenario(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]              # bound, not listening: the connection is refused
        code, out, err = stress("huge-messages", "--uri", f"amqp://guest:guest@127.0.0.1:{port}/%2f",
                                "--run-dir", str(tmp_path / "r"))
    assert code == 6 and err.startswith("creditflow stress: cannot use amqp://guest@127.0.0.1:")
    assert out == "" and not (tmp_path / "r").exists()
