"""``creditflow stress``: verdicts from measured figures (pure), then the command with real brokers."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import run_group
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
    return run_group([*STRESS, *args], timeout_s)


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
# alarm-flapping and disk-alarm (10-14 s each) are left to `creditflow stress all`: their verdict rules are
# tested above, and the alarms themselves in test_alarms_broker.py and test_disk_full.py
@pytest.mark.parametrize("name", ["huge-messages", "consumer-stops-reading", "channel-churn",
                                  "kombu-publisher-alarm"])
def test_a_scenario_on_its_own_broker_passes_and_leaves_its_run_directory(tmp_path, name):
    run_dir = tmp_path / name
    code, out, err = stress(name, "--run-dir", str(run_dir))
    assert code == 0, out + err
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"PASS  {name}  — ")
    assert verdict_of(run_dir)["line"] == last
    assert (run_dir / "config.json").exists() and (run_dir / "broker.log").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stress"]["facts"].get("broker_exit_code", summary.get("broker_exit_code")) == 0


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


# -- the alarm scenarios and the long ones: verdicts, pure ---------------------------------------------
DISK = {"published": 22_000, "confirmed": 0, "delivered": 22_000, "undelivered": 0, "lost": 0, "errors": [],
        "free_at_limit": 80 * 2**30, "limit_bytes": 80 * 2**30 - 32 * 2**20, "free_at_alarm": 80 * 2**30 - 33 * 2**20,
        "fill_seconds": 2.0, "alarm_seconds": 3.0, "received_during_alarm": 4930, "disk_sets": 1, "disk_clears": 1,
        "memory_sets": 0, "events": ["blocked", "unblocked"], "reasons": ["low on disk"]}


def test_the_disk_alarm_passes_on_one_alarm_a_disk_reason_and_a_consumer_that_kept_receiving():
    v = judge("disk-alarm", DISK)
    assert v.outcome == PASS, v.failures
    assert "crossed it 2.0 s later" in v.measured and "reason low on disk" in v.measured
    assert v.key == "received 4,930 while blocked"


@pytest.mark.parametrize("change, why", [
    ({"reasons": ["low on memory"]}, "reason 'low on memory', not 'low on disk'"),
    ({"events": ["blocked"]}, "not blocked then unblocked"),
    ({"events": []}, "not blocked then unblocked"),
    ({"disk_sets": 2, "disk_clears": 2}, "disk alarm set 2 times"),
    ({"memory_sets": 1}, "the memory alarm went off too"),
    ({"received_during_alarm": 0}, "the consumer received nothing during the alarm"),
    ({"undelivered": 5, "lost": 5}, "5 messages lost"),
])
def test_the_disk_alarm_fails_on_each_missing_expectation(change, why):
    v = judge("disk-alarm", {**DISK, **change})
    assert v.outcome == FAIL and any(why in f for f in v.failures), v.failures


FLAP = {"published": 10_000, "confirmed": 0, "delivered": 10_000, "undelivered": 0, "lost": 0, "errors": [],
        "cycles": 4, "memory_used": 56 * 2**20, "low_bytes": 28 * 2**20, "high_bytes": 168 * 2**20,
        "memory_sets": 4, "memory_clears": 4, "events": ["blocked", "unblocked"] * 4, "reasons": ["low on memory"] * 4}


def test_a_flapping_watermark_passes_when_every_transition_caused_is_seen_once_in_pairs():
    v = judge("alarm-flapping", FLAP)
    assert v.outcome == PASS, v.failures
    assert v.key == "4 cycles: alarm 4/4, blocked 4/4"


@pytest.mark.parametrize("change, why", [
    ({"memory_sets": 5, "memory_clears": 5}, "memory alarm set 5 and cleared 5 times for 4 caused"),
    ({"events": ["blocked", "unblocked"] * 3}, "not 4 blocked/unblocked pairs"),
    ({"events": ["blocked", "blocked", "unblocked", "unblocked"] * 2}, "not 4 blocked/unblocked pairs"),
    ({"events": ["blocked", "unblocked"] * 3 + ["unblocked", "blocked"]}, "not 4 blocked/unblocked pairs"),
])
def test_a_flapping_watermark_fails_on_a_missed_extra_or_unpaired_transition(change, why):
    v = judge("alarm-flapping", {**FLAP, **change})
    assert v.outcome == FAIL and any(why in f for f in v.failures), v.failures


KOMBU = {"kombu": "5.7.0", "messages": 5, "calls": [[0.0, 0.004], [0.004, 3.01], [3.01, 3.011], [3.011, 3.012],
                                                    [3.012, 3.013]],
         "returned_before_clear": 1, "cleared_at": 3.009, "in_queue": 5, "blocked_reasons": ["x"], "unblocked": 1,
         "errors": [], "join_timeout_s": 15.0}


def test_a_kombu_publish_held_across_the_whole_alarm_passes():
    v = judge("kombu-publisher-alarm", KOMBU)
    assert v.outcome == PASS, v.failures
    assert "the next was held 3.01 s, returning 0.001 s after the clear" in v.measured


@pytest.mark.parametrize("change, why", [
    ({"calls": [[0.0, 0.004], [0.004, 0.005], [0.005, 0.006], [0.006, 0.007], [0.007, 0.008]],
      "returned_before_clear": 5}, "no publish call was still waiting"),
    ({"calls": [[0.0, 0.004], [0.004, 3.01]], "in_queue": 2}, "2 of 5 publish calls returned"),
    ({"in_queue": 4}, "4 of 5 messages in the queue"),
    ({"unblocked": 0}, "unblocked 0x"),
])
def test_a_kombu_publish_that_did_not_hang_or_lost_messages_fails(change, why):
    v = judge("kombu-publisher-alarm", {**KOMBU, **change})
    assert v.outcome == FAIL and any(why in f for f in v.failures), v.failures


CONNS = {"wanted": 1000, "connections_open": 1000, "channels_open": 1000, "open_seconds": 20.0, "hold_s": 20.0,
         "published": 10_000, "confirmed": 10_000, "nacked": 0, "delivered": 10_000, "lost": 0, "duplicates": 0,
         "errors": [], "error_count": 0, "stages_before": 2, "stages_peak": 2002, "stages_after": 2,
         "broker_up": True}


def test_a_thousand_connections_pass_only_all_open_all_delivered_and_stages_back():
    assert judge("connections-1000", CONNS).outcome == PASS
    assert judge("connections-1000", {**CONNS, "stages_before": None, "stages_after": None}).outcome == PASS
    for change, why in [({"connections_open": 998, "channels_open": 998}, "998 of 1000 connections opened"),
                        ({"confirmed": 9_990}, "9990 of 10000 publishes confirmed"),
                        ({"lost": 3, "delivered": 9_997}, "3 messages lost"),
                        ({"stages_after": 40}, "live stages 40 after closing, 2 before"),
                        ({"broker_up": False}, "the broker stopped answering"),
                        ({"published": 0, "confirmed": 0, "delivered": 0}, "nothing was published")]:
        v = judge("connections-1000", {**CONNS, **change})
        assert v.outcome == FAIL and any(why in f for f in v.failures), (change, v.failures)


def test_a_thousand_queues_pass_only_when_each_got_its_own_message():
    facts = {"wanted": 1000, "declared": 1000, "bound": 1000, "confirmed": 1000, "delivered": 1000, "left_over": 0,
             "declare_seconds": 8.7, "errors": [], "stages_before": 2, "stages_peak": 1004, "stages_after": 2,
             "broker_up": True}
    assert judge("queues-1000", facts).outcome == PASS
    v = judge("queues-1000", {**facts, "delivered": 999, "left_over": 1})
    assert v.failures == ("999 of 1000 queues delivered", "1 messages left in the queues after one basic.get each")


def test_the_long_scenarios_run_only_with_all_and_long():
    from argparse import Namespace
    from pipeline.stress.command import chosen
    plain = chosen(Namespace(scenario="all", long=False))
    assert "connections-1000" not in plain and "queues-1000" not in plain and "disk-alarm" in plain
    assert chosen(Namespace(scenario="all", long=True))[-2:] == ["connections-1000", "queues-1000"]


# -- a stress scenario as a sweep axis -----------------------------------------------------------------
def test_a_stress_axis_makes_one_point_per_scenario_and_takes_no_other_option():
    from pipeline.sweep import GridError, points_of
    points = points_of({"grid": {"stress": ["slow-consumer", "queues-1000"]}})
    assert [(p.values, p.args, p.name) for p in points] == [
        ({"stress": "slow-consumer"}, ("stress", "slow-consumer"), "p01-stress=slow-consumer"),
        ({"stress": "queues-1000"}, ("stress", "queues-1000"), "p02-stress=queues-1000")]
    assert points[1].seconds == 4 * points[0].seconds
    with pytest.raises(GridError, match="a stress scenario sets its own load; size cannot go with it"):
        points_of({"run": {"size": 100}, "grid": {"stress": ["alarm"]}})
    with pytest.raises(GridError, match="no stress scenario named 'nope'"):
        points_of({"grid": {"stress": ["alarm", "nope"]}})


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_sweep_point_runs_its_scenario_and_returns_the_verdict_and_key_figure():
    import shutil
    import tempfile
    from pipeline.sweep import points_of, run_point
    [point] = points_of({"grid": {"stress": ["consumer-stops-reading"]}})
    out = tempfile.mkdtemp(prefix="cf-sw-")      # short: the broker's control socket path lives under it
    try:
        result = run_point(point.to_task(), out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert result["exit_code"] == 0, result["output_tail"]
    assert (result["verdict"], result["key_figure"]) == (PASS, "unacked 50, ready 4,950")
    assert result["summary"]["stress"]["facts"]["broker_exit_code"] == 0


