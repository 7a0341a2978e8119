"""``creditflow run`` end to end: the run directory, losslessness, a slow store blocking the reader,
where every message went when a planted bottleneck outlasts the drain, and options refused before
anything starts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import ROOT, _started, creditflow_cmd, kill_group, run_creditflow

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def run(tmp_path, *args: str, timeout_s: float = 90) -> tuple[int, str, dict]:
    return run_creditflow(tmp_path / "run", *args, timeout_s=timeout_s)


def test_five_second_run_loses_nothing_and_writes_the_summary(tmp_path):
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-s", "100", "-z", "5")
    assert code == 0, out
    assert s["published"] > 1000, out
    assert s["delivered"] == s["published"] and s["lost"] == 0
    for field in ("confirmed", "nacked", "returned", "publish_rate", "deliver_rate", "latency_us",
                  "processes", "links", "alarms", "config"):
        assert field in s
    kinds = {p["kind"] for p in s["processes"].values()}
    assert {"reader", "channel", "queue", "store"} <= kinds
    assert all("flow_fraction" in p for p in s["processes"].values())
    assert any("reader" in name and "channel" in name for name in s["links"])
    cpu = s["broker_cpu"]                                 # each kind's CPU per message over the load's window
    assert 0 < cpu["messages"] <= s["delivered"]
    assert all(cpu["us_per_message"][k] > 0 for k in ("reader", "channel", "queue")), cpu
    assert s["latency_us"]["consumer"]["p99"] >= s["latency_us"]["consumer"]["p50"] > 0
    lines = [line for line in out.splitlines() if line.startswith("time ")]
    assert len(lines) >= 4, out
    assert "sent:" in lines[0] and "received:" in lines[0] and "consumer latency" in lines[0]
    # the whole run's latency histogram is kept, and every second's, in HdrHistogram's own encoding
    from pipeline.loadgen import latency
    whole = latency.decode(s["latency_histograms"]["consumer"])
    assert whole.get_total_count() == s["delivered"]
    assert latency.percentiles(whole) == s["latency_us"]["consumer"]
    seconds = [json.loads(line) for line in (tmp_path / "run" / "seconds.jsonl").read_text().splitlines()]
    per_second = [latency.decode(r["histograms"]["consumer"]).get_total_count() for r in seconds]
    assert len(per_second) >= 4 and 0 < sum(per_second) <= s["delivered"]


def test_slow_store_blocks_the_reader_and_in_flight_stays_within_credit(tmp_path):
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-s", "5000", "-f", "persistent", "-z", "4",
                       "--store-delay-us", "2000", "--credit", "20,10", "--store-credit", "40,20")
    assert code == 0, out
    procs = s["processes"]
    reader = [p for n, p in procs.items() if n.startswith("reader") and p["block_count"] > 0]
    assert reader, f"no reader was ever blocked: {procs}"
    assert 0 <= reader[0]["first_stop_after_first_publish_s"] < 1.0, "the reader stops reading within a second"
    assert any(p["kind"] == "queue" and p["block_count"] > 0 for p in procs.values())
    links = s["links"]
    rc = [v["max_in_flight"] for k, v in links.items() if k.startswith("reader") and "channel" in k]
    cq = [v["max_in_flight"] for k, v in links.items() if k.startswith("channel") and "queue" in k]
    qs = [v["max_in_flight"] for k, v in links.items() if k.startswith("queue") and k.endswith("store")]
    assert rc and max(rc) <= 20
    assert cq and max(cq) <= 20 + 20
    # queue -> store carries writes (at most 40 of credit + 20 in a bump on its way) and the removes
    # of acked messages, which credit does not cover (nor does RabbitMQ's): at most one per
    # message, so no more than the writes. The store reads one record at a time under a 2 ms
    # delay, so they sit in the ring until handled (measured 87-88).
    assert qs and max(qs) <= 2 * (40 + 20)
    assert s["lost"] == 0


@pytest.mark.parametrize("args, reason", [
    (("--credit", "100,200"), "100,200"),
    (("-x", "0", "-y", "0"), "a run needs at least one producer or consumer"),
    (("-q", "70000"), r"prefetch (-q) must be between 0 and 65535 (basic.qos prefetch_count is 16 bits), got 70000"),
    (("-s", "200000000"), "size (-s) must be between 0 and 134217728 bytes"),
    (("-s", "2000000", "--max-message-bytes", "1048576"),
     "messages of 2000000 bytes (-s) are over the broker's --max-message-bytes 1048576"),
    (("-s", "5000", "--max-message-bytes", "4096"), "--max-message-bytes 4096"),
    (("--drain-s", "-1"), "argument --drain-s: must be 0 or more seconds, got -1"),
    (("--drain-s", "soon"), "argument --drain-s: expected a number of seconds, got 'soon'"),
    (("-z", "0"), "argument -z/--time: must be at least 1"),
])
def test_a_bad_option_exits_2_with_one_line_before_anything_starts(tmp_path, args, reason):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(creditflow_cmd("run", "--run-dir", str(run_dir), "--plain", *args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=ROOT)
    _started.append(proc)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        pgid_gone = _group_gone(proc.pid)
        kill_group(proc)
    assert proc.returncode == 2, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("creditflow run: ") and reason in err, err
    assert out == ""
    assert not run_dir.exists(), "no broker was started, so no run directory"
    assert pgid_gone, "no process of the run outlived it"


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_planted_channel_bottleneck_leaves_messages_undelivered_not_lost(tmp_path):
    """Two publishers fill their sockets far faster than two 700 µs channels take messages: when the
    drain runs out, what is still in socket buffers and the broker is undelivered, and nothing is lost."""
    code, out, s = run(tmp_path, "-x", "2", "-y", "1", "-z", "2", "--channel-delay-us", "700", "-s", "64",
                       "--drain-s", "2")
    assert code == 0, out
    assert s["lost"] == 0 and s["rejected"] == 0 and s["rejections"] == {}
    assert s["undelivered"] > 0 and s["delivered"] > 0
    assert s["delivered"] + s["undelivered"] == s["published"]
    assert s["drain"]["end"] == "time" and 2 <= s["drain"]["seconds"] < 4
    assert set(s["drain"]["queues"]) == {"creditflow-perf"}
    assert set(s["drain"]["queues"]["creditflow-perf"]) == {"messages", "unacked"}
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"published {s['published']}, delivered {s['delivered']}, "
                           f"undelivered {s['undelivered']}, lost 0, rejected 0;"), out
    assert s["drain"]["publishers"] == {"publisher-0": "open", "publisher-1": "open"}   # sockets still full
    assert "drain: ended after" in out and "(time); creditflow-perf " in out
    assert "publisher-0, publisher-1 still sending (close not answered)" in out


def test_a_planted_queue_bottleneck_with_small_credit_leaves_messages_undelivered_not_lost(tmp_path):
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-s", "100", "-z", "2", "--credit", "20,10",
                       "--queue-delay-us", "2000", "--drain-s", "2")
    assert code == 0, out
    assert (s["lost"], s["rejected"]) == (0, 0)
    assert s["undelivered"] > 0 and s["delivered"] + s["undelivered"] == s["published"]
    assert s["drain"]["end"] == "time"


def test_the_drain_empties_a_backlog_left_at_the_end_of_the_window(tmp_path):
    """A consumer slower than the publisher leaves a backlog at -z; the drain waits for it."""
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-r", "3000", "-s", "100", "-z", "2", "-L", "500")
    assert code == 0, out
    # at most 3000 msg/s for 2 s (a publisher short of CPU sends fewer, as PerfTest's would)
    assert 5000 <= s["published"] <= 6000
    assert s["delivered"] == s["published"] and (s["undelivered"], s["lost"], s["rejected"]) == (0, 0, 0)
    assert s["drain"]["end"] == "delivered" and s["drain"]["seconds"] > 0.5      # 5000 take 2.5 s at 2000 msg/s
    assert s["drain"]["publishers"] == {"publisher-0": "closed"}


def test_without_consumers_nothing_is_expected_and_nothing_lost(tmp_path):
    code, out, s = run(tmp_path, "-x", "1", "-y", "0", "-r", "500", "-s", "100", "-z", "1")
    assert code == 0, out
    assert s["published"] == 500 and (s["delivered"], s["undelivered"], s["lost"]) == (0, 0, 0)
    assert "creditflow-perf" in s["drain"]["queues"]          # the depths are recorded all the same


def test_a_fractional_rate_sends_on_its_schedule(tmp_path):
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-r", "2.5", "-s", "100", "-z", "4")
    assert code == 0, out
    assert s["published"] == 10 and s["delivered"] == 10, out      # one every 0.4 s for 4 s
    assert s["config"]["load"]["rate"] == 2.5


def _rows(telemetry_dir, name: str) -> int:
    """Rows of one telemetry table, whichever form it was left in."""
    parquet, lines = telemetry_dir / f"{name}.parquet", telemetry_dir / f"{name}.jsonl"
    if parquet.exists():
        import pyarrow.parquet as pq
        return pq.read_metadata(parquet).num_rows
    return len(lines.read_text().splitlines()) if lines.exists() else 0


def test_telemetry_off_records_no_snapshots_and_loses_nothing(tmp_path):
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-s", "100", "-z", "3", "--telemetry", "off")
    assert code == 0, out
    assert s["delivered"] == s["published"] > 1000 and s["lost"] == 0
    tele = tmp_path / "run" / "telemetry"
    assert _rows(tele, "stats") == 0 and _rows(tele, "states") == 0
    assert _rows(tele, "events") > 0                      # spawns and the like are still written
    assert len([line for line in out.splitlines() if line.startswith("time ")]) >= 2
    assert {p["kind"] for p in s["processes"].values()} >= {"reader", "channel", "queue", "store"}


def test_telemetry_on_records_snapshots_of_every_stage(tmp_path):
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-s", "100", "-z", "2")
    assert code == 0, out
    tele = tmp_path / "run" / "telemetry"
    # every stage pushes at most every 100 ms while busy: several per stage over two seconds
    assert _rows(tele, "stats") >= 4 * 5 and _rows(tele, "states") >= 4 * 15


def test_closing_with_credit_off_hands_on_every_accepted_message(tmp_path):
    """With credit off a slow queue leaves thousands of publishes waiting in the channel's overflow
    (its process memory) when the publisher closes: the channel must pass them all on before it
    exits, as RabbitMQ's channel works through its mailbox."""
    code, out, s = run(tmp_path, "-x", "1", "-y", "1", "-s", "1000", "-r", "10000", "-z", "3",
                       "--credit", "0,0", "--queue-delay-us", "200")
    assert code == 0, out
    assert s["published"] > 20000
    # the 4 MiB ring (about 4,030 records of 1,000 B with their heads) stayed full: the rest waited in overflow
    assert max(v["max_in_flight"] for k, v in s["links"].items() if k.startswith("channel") and "queue" in k) >= 4000
    assert s["delivered"] == s["published"] and s["lost"] == 0
