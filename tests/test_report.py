"""The Spark report, told as stories about run directories whose contents we know.

Each synthetic run is a broker seen for six seconds of load plus two of drain:
a consumer connection (reader-1 -> channel-1.1) and a publishing one
(reader-2 -> channel-2.1 -> queue-q -> store), sampled every 100 ms by the
supervisor. The test decides how much of the steady window each stage spends
in ``flow`` and checks that the report names the bottleneck RabbitMQ's rules
name. To prove that only the steady window counts, every stage reads ``flow``
during the first second and during the drain; to prove that only publishing
connections count, the consumer's reader and channel are in flow throughout.

One more story runs a real three-second ``creditflow run`` and reports on it.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

pyspark = pytest.importorskip("pyspark")

from conftest import creditflow_cmd, kill_group  # noqa: E402

from pipeline.analytics import diagnosis as rules  # noqa: E402
from pipeline.analytics.report import build_report  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
ORIGIN_NS = 5_000_000_000_000
SAMPLE_NS = 100_000_000
LOAD_S = 6
DRAIN_S = 2
PROCESSES = {"reader-1": "reader", "channel-1.1": "channel", "reader-2": "reader", "channel-2.1": "channel",
             "queue-q": "queue", "store": "store", "watchdog": "watchdog"}
BLUE = (0x1E, 0x88, 0xE5)          # plots.py: published / used line
FLOW_AMBER = (0xFF, 0xB3, 0x00)    # plots.py: STATE_COLOURS["flow"]
RUNNING_GREEN = (0x4C, 0xAF, 0x50)
FSYNC_BROWN = (0x6D, 0x4C, 0x41)


# -- writing a run directory ------------------------------------------------------------------------------

def _state_at(i: int, fraction: float, steady: bool, otherwise: str = "running") -> str:
    if not steady:
        return "flow"
    return "flow" if (i % 10) < round(fraction * 10) else otherwise


def write_run(path: Path, reader: float, channel: float, queue: float, *, alarm=False, fsyncs=True,
              publisher_otherwise: str = "running") -> dict:
    """A run directory in which reader-2, channel-2.1 and queue-q spend the given shares of 1..6 s in flow.

    Returns the state samples written, {process: [state, ...]}, for the table checks.
    """
    tele = path / "telemetry"
    tele.mkdir(parents=True)
    fractions = {"reader-1": 1.0, "channel-1.1": 1.0, "reader-2": reader, "channel-2.1": channel,
                 "queue-q": queue, "store": 0.0, "watchdog": 0.0}
    written: dict[str, list[str]] = {name: [] for name in PROCESSES}
    with open(tele / "states.jsonl", "w") as f:
        for i in range((LOAD_S + DRAIN_S) * 10 + 1):
            at = ORIGIN_NS + i * SAMPLE_NS
            steady = 10 <= i <= LOAD_S * 10
            for name, kind in PROCESSES.items():
                state = _state_at(i, fractions[name], steady,
                                  publisher_otherwise if name == "reader-2" else "running")
                if kind == "reader" and i > LOAD_S * 10:
                    state = "closing"
                if kind in ("store", "watchdog"):
                    state = "running"
                written[name].append(state)
                f.write(json.dumps({"at_ns": at, "name": name, "kind": kind, "state": state}) + "\n")

    def link(sent, max_in_flight):
        return {"sent": sent, "records": sent, "in_flight": 0, "max_in_flight": max_in_flight, "overflow": 0,
                "credit": 100}

    stats = []
    for second in range(LOAD_S + 1):
        at = ORIGIN_NS + second * 1_000_000_000
        n = second * 1000
        stats += [
            {"name": "reader-1", "kind": "reader", "at_ns": at, "state": "flow", "publishes": 0, "deliveries": n,
             "links": {"reader-1->channel-1.1": link(0, 1)}},
            {"name": "reader-2", "kind": "reader", "at_ns": at, "state": "running", "publishes": n,
             "first_publish_ns": ORIGIN_NS + 50_000_000, "last_publish_ns": at,
             "links": {"reader-2->channel-2.1": link(n, 350 + 10 * second)}},
            {"name": "channel-1.1", "kind": "channel", "at_ns": at, "state": "flow",
             "links": {"channel-1.1->reader-1": link(0, 1)}},
            {"name": "channel-2.1", "kind": "channel", "at_ns": at, "state": "running",
             "links": {"channel-2.1->queue-q": link(n, 800)}},
            {"name": "queue-q", "kind": "queue", "at_ns": at, "state": "running", "messages": 10,
             "links": {"queue-q->store": link(n, 40), "queue-q->reader-1": link(n, 1000)}},
            {"name": "store", "kind": "store", "at_ns": at, "state": "running", "links": {}, "writes": n},
            {"name": "watchdog", "kind": "watchdog", "at_ns": at, "memory_used": (100 + 10 * second) << 20,
             "memory_limit": 150 << 20, "memory_alarm": alarm and 2 <= second < 4,
             "disk_free": 50_000 << 20, "disk_limit": 50_000_000, "disk_alarm": False},
        ]
    with open(tele / "stats.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in stats)

    events = [{"at_ns": ORIGIN_NS - 50_000_000, "event": "spawn", "name": n, "data": {"pid": 1, "kind": k}}
              for n, k in PROCESSES.items()]
    if alarm:
        for event, t in (("alarm_set", 2.0), ("alarm_clear", 3.5)):
            at = ORIGIN_NS + int(t * 1e9)
            events.append({"at_ns": at, "event": event, "name": "memory",
                           "data": {"source": "memory", "state": event[6:], "at_ns": at,
                                    "used": 160 << 20, "limit": 150 << 20}})
    if fsyncs:
        events += [{"at_ns": ORIGIN_NS + k * 200_000_000, "event": "fsync", "name": "store",
                    "data": {"duration_ns": 1_000_000 + 100_000 * (k % 7)}} for k in range(1, 30)]
    with open(tele / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in sorted(events, key=lambda e: e["at_ns"]))

    with open(path / "seconds.jsonl", "w") as f:
        for second in range(1, LOAD_S + 1):
            f.write(json.dumps({
                "time_s": float(second), "sent_rate": 1000.0, "confirmed_rate": 0.0, "received_rate": 900.0,
                "nacked": 0, "returned": 0,
                "consumer": {"count": 900, "min": 100, "p50": 1000 * second, "p75": 1500 * second,
                             "p95": 2000 * second, "p99": 3000 * second, "max": 4000 * second},
                "confirm": None, "blocked": {"publisher-0": False}, "published": 1000 * second,
                "delivered": 900 * second, "at_ns": ORIGIN_NS + second * 1_000_000_000,
                "states": {}}) + "\n")
    summary = {"published": 6000, "confirmed": 0, "nacked": 0, "returned": 0, "delivered": 6000, "lost": 0,
               "publish_rate": 1000.0, "deliver_rate": 900.0,
               "latency_us": {"consumer": {"count": 6000, "min": 100, "p50": 3000, "p75": 4000, "p95": 9000,
                                           "p99": 15000, "max": 24000}},
               "processes": {}, "links": {}, "alarms": [], "deaths": [], "config": {"argv": ["run", "-z", "6"]}}
    (path / "summary.json").write_text(json.dumps(summary))
    return written


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def colour_pixels(png: Path, rgb: tuple, tolerance: int = 12) -> int:
    """How many pixels of ``png`` are within ``tolerance`` of ``rgb``."""
    import numpy as np
    from matplotlib import image

    pixels = (image.imread(str(png))[:, :, :3] * 255).astype(int)
    return int((np.abs(pixels - np.array(rgb)).max(axis=2) <= tolerance).sum())


# -- the rules, without Spark -----------------------------------------------------------------------------

def test_rules_walk_from_the_connection_inwards():
    assert rules.apply_rules({"reader": 0.6, "channel": 0.0, "queue": 0.0})[0] == "channel"
    assert rules.apply_rules({"reader": 0.6, "channel": 0.9, "queue": 0.0})[0] == "queue"
    assert rules.apply_rules({"reader": 0.6, "channel": 0.9, "queue": 0.9})[0] == "message_store"
    assert rules.apply_rules({"reader": 0.0, "channel": 0.9, "queue": 0.9})[0] == "none"


def test_thresholds_are_inclusive_and_a_blip_is_not_flow():
    at = rules.CONNECTION_FLOW_MIN
    assert rules.apply_rules({"reader": at, "channel": rules.STAGE_FLOW_MIN, "queue": 0.0})[0] == "queue"
    assert rules.apply_rules({"reader": at - 0.001, "channel": 1.0, "queue": 1.0})[0] == "none"
    # one 1 s flow window over a 60 s run is 0.017: not flow
    assert rules.apply_rules({"reader": 0.6, "channel": 1 / 60, "queue": 0.0})[0] == "channel"


def test_members_follow_the_links_of_publishing_readers_only():
    kinds = PROCESSES
    links = [{"sender": "reader-1", "receiver": "channel-1.1"}, {"sender": "reader-2", "receiver": "channel-2.1"},
             {"sender": "channel-2.1", "receiver": "queue-q"}, {"sender": "channel-1.1", "receiver": "reader-1"}]
    chosen = rules.members(kinds, links, {"reader-1": 0, "reader-2": 10})
    assert chosen == {"reader": ["reader-2"], "channel": ["channel-2.1"], "queue": ["queue-q"], "store": ["store"]}


# -- the diagnosis on synthetic runs ----------------------------------------------------------------------

@pytest.mark.parametrize("flows, expected, rule_words", [
    ((0.6, 0.0, 0.0), "channel", "none of its channels"),
    ((0.6, 1.0, 0.0), "queue", "none of the target queues"),
    ((0.6, 1.0, 1.0), "message_store", "all in flow"),
    ((0.0, 1.0, 1.0), "none", "not meaningfully in flow"),
], ids=["channel", "queue", "message_store", "none"])
def test_diagnosis_follows_rabbitmqs_rules(spark, tmp_path, flows, expected, rule_words):
    run = tmp_path / f"run-{expected}"
    write_run(run, *flows)

    index = build_report([str(run)])

    assert index == str(run / "report" / "index.html")
    diagnosis = json.loads((run / "report" / "diagnosis.json").read_text())
    assert diagnosis["bottleneck"] == expected
    assert rule_words in diagnosis["rule"]
    # The steady window (1..6 s) alone counts: the flow of the first second and of the drain is left out,
    # and the consumer's reader and channel, in flow all along, are not looked at.
    for kind, fraction in zip(("reader", "channel", "queue"), flows):
        assert diagnosis["evidence"][kind] == pytest.approx(fraction, abs=0.03), kind
    assert diagnosis["evidence"]["store"] == 0.0
    assert diagnosis["processes"]["reader"] == {"reader-2": pytest.approx(flows[0], abs=0.03)}
    assert list(diagnosis["processes"]["channel"]) == ["channel-2.1"]
    assert diagnosis["window_s"] == [1.0, 6.0]
    assert f"Bottleneck: <b>{expected}</b>" in Path(index).read_text()


def test_an_alarm_is_not_flow_control(spark, tmp_path):
    run = tmp_path / "alarmed"
    write_run(run, 0.0, 1.0, 1.0, alarm=True, publisher_otherwise="blocked")

    build_report([str(run)])

    diagnosis = json.loads((run / "report" / "diagnosis.json").read_text())
    assert diagnosis["bottleneck"] == "none"
    assert diagnosis["evidence"]["reader"] == 0.0
    assert "held by a resource alarm instead (blocked or blocking in 1.00 of the window)" in diagnosis["rule"]


# -- the files of a one-run report ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def alarm_run(spark, tmp_path_factory):
    """A message-store-bound run with a memory alarm from 2.0 to 3.5 s, reported once for several tests."""
    run = tmp_path_factory.mktemp("alarm") / "run"
    written = write_run(run, 0.6, 1.0, 1.0, alarm=True)
    return run, written, Path(build_report([str(run)]))


def test_report_page_shows_every_plot_and_table(alarm_run):
    run, _written, index = alarm_run
    page = index.read_text()
    for png in ("rates.png", "latency.png", "flow_timeline.png", "memory.png", "disk.png", "fsync.png"):
        assert f'src="{png}"' in page
        data = (run / "report" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert "(no data in this run)" not in page
    for table in ("process_states.csv", "links.csv", "summary.csv", "alarms.csv", "seconds.csv"):
        assert f'href="tables/{table}"' in page
    assert "http://" not in page and "https://" not in page and "<script" not in page


def test_plots_draw_the_data(alarm_run):
    run, _written, _index = alarm_run
    report = run / "report"
    assert colour_pixels(report / "rates.png", BLUE) > 200                 # the published line
    assert colour_pixels(report / "flow_timeline.png", FLOW_AMBER) > 2000    # flow bars ...
    assert colour_pixels(report / "flow_timeline.png", RUNNING_GREEN) > 2000  # ... and running bars
    assert colour_pixels(report / "memory.png", BLUE) > 200
    assert colour_pixels(report / "fsync.png", FSYNC_BROWN) > 200


def test_state_table_times_every_span(alarm_run):
    """Each row holds until the process's next one; its last row closes its last span."""
    run, written, _index = alarm_run
    rows = read_csv(run / "report" / "tables" / "process_states.csv")
    got = {(r["name"], r["state"]): float(r["seconds"]) for r in rows}
    expected = {}
    for name, states in written.items():
        for state in set(states):
            expected[(name, state)] = pytest.approx(states[:-1].count(state) * SAMPLE_NS / 1e9, abs=0.002)
    assert got == expected
    closing = next(r for r in rows if r["name"] == "reader-2" and r["state"] == "closing")
    assert float(closing["seconds"]) == pytest.approx((DRAIN_S * 10 - 1) * 0.1, abs=0.01)
    for name in PROCESSES:   # fractions of a process add up to one
        assert sum(float(r["fraction"]) for r in rows if r["name"] == name) == pytest.approx(1.0, abs=0.001)


def test_flow_is_timed_from_state_changes_alone(spark):
    """Rows written only on change: a process in flow since before the window counts from its start."""
    s = 1_000_000_000
    rows = [(0, "reader-1", "reader", "flow"), (10 * s, "reader-1", "reader", "running"),
            (12 * s, "reader-1", "reader", "running"),                               # its end
            (0, "queue-q", "queue", "running"), (7 * s, "queue-q", "queue", "blocked"),
            (9 * s, "queue-q", "queue", "running"), (12 * s, "queue-q", "queue", "running")]
    states = spark.createDataFrame(rows, "at_ns long, name string, kind string, state string")
    got = rules.flow_fractions(states, 5 * s, 11 * s)
    assert got["reader-1"] == ("reader", pytest.approx(5 / 6), pytest.approx(6.0), 0.0)
    assert got["queue-q"] == ("queue", 0.0, pytest.approx(6.0), pytest.approx(2 / 6))
    whole = rules.flow_fractions(states, None, None)
    assert whole["reader-1"][1] == pytest.approx(10 / 12)


def test_link_and_summary_tables(alarm_run):
    run, _written, _index = alarm_run
    tables = run / "report" / "tables"
    links = {r["link"]: r for r in read_csv(tables / "links.csv")}
    assert set(links) == {"reader-1->channel-1.1", "reader-2->channel-2.1", "channel-1.1->reader-1",
                          "channel-2.1->queue-q", "queue-q->store", "queue-q->reader-1"}
    assert links["reader-2->channel-2.1"]["max_in_flight"] == str(350 + 10 * LOAD_S)   # the largest snapshot
    assert links["reader-2->channel-2.1"]["sent"] == str(1000 * LOAD_S)
    assert links["queue-q->store"]["receiver"] == "store"
    summary = {r["metric"]: r["value"] for r in read_csv(tables / "summary.csv")}
    assert summary["published"] == "6000" and summary["lost"] == "0"
    assert summary["alarms"] == "1" and float(summary["alarm_seconds"]) == pytest.approx(1.5)
    assert summary["events_fsync"] == "29"
    alarms = read_csv(tables / "alarms.csv")
    assert [(a["source"], float(a["set_s"]), float(a["clear_s"])) for a in alarms] == [("memory", 2.0, 3.5)]
    assert len(read_csv(tables / "seconds.csv")) == LOAD_S


def test_a_plot_without_data_says_so(spark, tmp_path):
    run = tmp_path / "quiet"
    write_run(run, 0.0, 0.0, 0.0, fsyncs=False)
    page = Path(build_report([str(run)])).read_text()
    assert "Message store fsync latency (no data in this run)" in page
    assert "Publish, confirm and deliver rates (no data" not in page
    fsync_png = run / "report" / "fsync.png"
    assert fsync_png.stat().st_size > 5000 and colour_pixels(fsync_png, FSYNC_BROWN) == 0


def test_not_a_run_directory_is_refused(spark, tmp_path):
    from pipeline.analytics.load import NotARunDirectory

    with pytest.raises(NotARunDirectory, match="is not a run directory"):
        build_report([str(tmp_path)])


# -- comparison ------------------------------------------------------------------------------------------

def test_two_runs_side_by_side(spark, tmp_path):
    a, b = tmp_path / "slow-channel", tmp_path / "slow-store"
    write_run(a, 0.6, 0.0, 0.0)
    write_run(b, 0.6, 1.0, 1.0, alarm=True)
    out = tmp_path / "compare"

    index = Path(build_report([str(a), str(b)], out_dir=str(out)))

    assert index == out / "index.html"
    page = index.read_text()
    assert "slow-channel" in page and "slow-store" in page
    assert 'href="../slow-channel/report/index.html"' in page
    rows = {r["run"]: r for r in read_csv(out / "tables" / "runs.csv")}
    assert rows["slow-channel"]["bottleneck"] == "channel" and rows["slow-store"]["bottleneck"] == "message_store"
    assert rows["slow-channel"]["alarms"] == "none" and rows["slow-store"]["alarms"] == "memory"
    assert float(rows["slow-store"]["flow_queue"]) == pytest.approx(1.0, abs=0.03)
    assert rows["slow-channel"]["consumer_p99_us"] == "15000"
    for png in ("compare_rates.png", "compare_latency.png", "compare_flow.png"):
        assert f'src="{png}"' in page and (out / png).stat().st_size > 5000
    assert colour_pixels(out / "compare_flow.png", (0x1F, 0x77, 0xB4)) > 500   # matplotlib's first bar colour
    assert (a / "report" / "diagnosis.json").exists() and (b / "report" / "diagnosis.json").exists()


# -- a real run ------------------------------------------------------------------------------------------

def _shm_of(run_dir: Path, pid: int) -> list[str]:
    """/dev/shm entries of the broker that ran in ``run_dir`` (its run id names them) or of ``pid``."""
    prefixes = [f"creditflow-{pid}x"]
    try:
        prefixes.append(f"creditflow-{json.loads((run_dir / 'telemetry' / 'final.json').read_text())['run_id']}")
    except (OSError, ValueError, KeyError):
        pass
    try:
        return [n for n in os.listdir("/dev/shm") if n.removeprefix("sem.").startswith(tuple(prefixes))]
    except FileNotFoundError:
        return []


@pytest.fixture
def real_run(tmp_path):
    """A three-second ``creditflow run``, its process group killed however the test ends."""
    run_dir = tmp_path / "real"
    log = open(tmp_path / "run.out", "w")
    proc = subprocess.Popen(creditflow_cmd("run", "-x", "1", "-y", "1", "-s", "100", "-z", "3",
                                           "--run-dir", str(run_dir), "--plain"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    yield proc, run_dir, tmp_path / "run.out"
    kill_group(proc)
    log.close()
    leaked = _shm_of(run_dir, proc.pid)
    assert not leaked, f"the run left shared memory behind: {leaked}"


@pytest.mark.processes
def test_report_of_a_real_run(spark, real_run):
    proc, run_dir, out = real_run
    assert proc.wait(60) == 0, out.read_text()[-3000:]

    index = Path(build_report([str(run_dir)]))

    diagnosis = json.loads((run_dir / "report" / "diagnosis.json").read_text())
    assert diagnosis["bottleneck"] in rules.BOTTLENECKS
    assert set(diagnosis["evidence"]) == {"reader", "channel", "queue", "store"}
    assert all(0.0 <= v <= 1.0 for v in diagnosis["evidence"].values())
    assert len(diagnosis["processes"]["reader"]) == 1          # the one publishing connection
    assert colour_pixels(run_dir / "report" / "rates.png", BLUE) > 200
    assert colour_pixels(run_dir / "report" / "flow_timeline.png", RUNNING_GREEN) > 1000
    states = read_csv(run_dir / "report" / "tables" / "process_states.csv")
    assert {"reader", "channel", "queue", "store", "watchdog"} <= {r["kind"] for r in states}
    published = json.loads((run_dir / "summary.json").read_text())["published"]
    summary = {r["metric"]: r["value"] for r in read_csv(run_dir / "report" / "tables" / "summary.csv")}
    assert int(summary["published"]) == published > 0
    assert "Memory used against the high watermark (no data" not in index.read_text()
