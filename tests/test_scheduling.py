"""The pipeline's processes run under SCHED_BATCH unless ``--scheduling normal``; the watchdog never does.

Checked as a user of ``ps -o cls`` would: the policy of each live process the broker's status names.
"""

from __future__ import annotations

import os
import subprocess

import pika
import pytest

from conftest import creditflow_cmd

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def policies(broker) -> dict[str, int]:
    """Each process by kind (hosts by the kind of stage they run) -> its scheduling policy."""
    status = broker.status()
    pids = {f"{h['kind']} host": h["pid"] for h in status["hosts"].values()}
    for name, p in status["processes"].items():
        if p.get("alive") and p.get("kind") in ("store", "watchdog"):
            pids[p["kind"]] = p["pid"]
    return {what: os.sched_getscheduler(pid) for what, pid in pids.items()}


def open_a_queue_and_publish(broker) -> None:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    ch = conn.channel()
    ch.queue_declare("sched-q")
    ch.basic_publish("", "sched-q", b"x")
    broker.wait_for(lambda s: s["processes"]["queue-sched-q"]["messages"] == 1, what="the message queued")
    conn.close()


def test_readers_channels_queues_and_the_store_run_as_batch_the_watchdog_does_not(broker):
    open_a_queue_and_publish(broker)
    got = policies(broker)
    assert {k for k in got if k.endswith("host")} == {"reader host", "channel host", "queue host"}
    for what in ("reader host", "channel host", "queue host", "store"):
        assert got[what] == os.SCHED_BATCH, got
    assert got["watchdog"] == os.SCHED_OTHER, got


def test_scheduling_normal_leaves_every_process_under_the_default_policy(start_broker):
    broker = start_broker("--scheduling", "normal")
    open_a_queue_and_publish(broker)
    got = policies(broker)
    assert len(got) == 5 and set(got.values()) == {os.SCHED_OTHER}, got


def test_an_unknown_policy_exits_2_before_anything_starts(tmp_path):
    out = subprocess.run(creditflow_cmd("serve", "--port", "0", "--data-dir", str(tmp_path / "d"),
                                        "--scheduling", "fifo"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--scheduling" in out.stderr and "fifo" in out.stderr
    assert not (tmp_path / "d").exists()
