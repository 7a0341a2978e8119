"""SPEC §2's acceptance scenario, with real processes, a real socket and pika.

With credit {2,1}, the queue process stopped (SIGSTOP) and 100 publishes on
one channel, exactly 4 messages get past the channel towards the queue, the
connection reads ``flow`` and the reader parses no further publish; after
SIGCONT all 100 arrive and the connection reads ``running`` again. With
credit flow off ({0,0}) all 100 pass at once.
"""

from __future__ import annotations

import os
import signal
import time

import pika
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def connect(broker) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port, heartbeat=0))


def link(status: dict, sender: str, receiver: str) -> dict:
    """The link from the (only) ``sender*`` process to ``receiver``; empty until its sender reported it."""
    found = [v for k, v in status["links"].items() if k.startswith(sender) and receiver in k.split("->")[1]]
    assert len(found) <= 1, f"more than one link {sender}->{receiver} in {list(status['links'])}"
    return found[0] if found else {"sent": 0, "in_flight": 0}


def publish_100_with_queue_stopped(broker):
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("q", durable=False)
    queue = broker.process("queue-q")
    os.kill(queue["pid"], signal.SIGSTOP)
    body = b"x" * 10
    for _ in range(100):
        ch.basic_publish("", "q", body)
    conn.process_data_events(0)
    return conn, queue["pid"]


def test_credit_2_1_lets_exactly_four_past_a_stopped_queue(start_broker):
    broker = start_broker("--credit", "2,1")
    conn, qpid = publish_100_with_queue_stopped(broker)
    try:
        broker.wait_for(lambda s: link(s, "channel", "queue-q")["sent"] >= 4,
                        what="four publishes past the channel")
        time.sleep(0.5)  # long enough for any fifth publish to show up
        status = broker.status()
        reader = [p for n, p in status["processes"].items() if n.startswith("reader") and p["alive"]][0]
        channel = [p for n, p in status["processes"].items() if n.startswith("channel") and p["alive"]][0]
        assert reader["state"] == "flow"
        assert reader["publishes"] == 4, "the reader must not parse past its credit"
        assert link(status, "channel", "queue-q")["sent"] == 4
        assert link(status, "channel", "queue-q")["in_flight"] == 4
        assert channel["blocked"] is True
    finally:
        os.kill(qpid, signal.SIGCONT)
    status = broker.wait_for(lambda s: s["processes"]["queue-q"].get("enqueued") == 100,
                             what="all 100 publishes to reach the queue")
    status = broker.wait_for(
        lambda s: all(p["state"] == "running" for n, p in s["processes"].items()
                      if n.startswith(("reader", "channel")) and p["alive"]),
        timeout_s=5, what="the connection and channel to read running again")
    assert status["processes"]["queue-q"]["messages"] == 100
    conn.close()


def test_credit_disabled_lets_all_100_reach_the_stopped_queue(start_broker):
    broker = start_broker("--credit", "0,0")
    conn, qpid = publish_100_with_queue_stopped(broker)
    try:
        broker.wait_for(lambda s: link(s, "channel", "queue-q")["sent"] >= 100,
                        what="all 100 publishes to pass the channel")
        time.sleep(0.3)
        status = broker.status()
        reader = [p for n, p in status["processes"].items() if n.startswith("reader") and p["alive"]][0]
        assert reader["publishes"] == 100
        assert reader["state"] == "running"
        assert link(status, "channel", "queue-q")["in_flight"] == 100
    finally:
        os.kill(qpid, signal.SIGCONT)
    broker.wait_for(lambda s: s["processes"]["queue-q"].get("enqueued") == 100, what="enqueue after resume")
    conn.close()
