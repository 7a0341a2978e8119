"""Prometheus /metrics: families built from one status (pure), then a real broker scraped while a slow
queue holds its channel in flow, parsed with prometheus_client's own parser."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.management.metrics import families
from test_management_api import status, wait_until

RABBITMQ_NAMES = (
    "rabbitmq_identity_info", "rabbitmq_alarms_memory_used_watermark", "rabbitmq_alarms_free_disk_space_watermark",
    "rabbitmq_resident_memory_limit_bytes", "rabbitmq_process_resident_memory_bytes",
    "rabbitmq_disk_space_available_bytes", "rabbitmq_global_messages_received_total",
    "rabbitmq_global_messages_confirmed_total", "rabbitmq_global_messages_delivered_total",
    "rabbitmq_global_messages_acknowledged_total", "rabbitmq_queue_messages", "rabbitmq_queue_messages_ready",
    "rabbitmq_queue_messages_unacked", "rabbitmq_connections", "rabbitmq_channels", "rabbitmq_queues",
    "rabbitmq_consumers")


def samples(text: str) -> dict[str, list]:
    """Sample name -> [(labels, value)], from the text format as Prometheus reads it."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def render(st: dict) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    from pipeline.management.metrics import StatusCollector
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: st))
    return generate_latest(registry).decode()


def test_families_carry_rabbitmqs_names_and_creditflows_states():
    st = status(publish=10, alarms={"memory": {"state": "set"}},
                fsync_histogram={"buckets": [[0.001, 2], [0.01, 3], ["+Inf", 3]], "count": 3, "sum_s": 0.012})
    got = samples(render(st))
    for name in RABBITMQ_NAMES:
        assert name in got, name
    assert got["rabbitmq_alarms_memory_used_watermark"] == [({}, 1.0)]
    assert got["rabbitmq_global_messages_received_total"] == [({"protocol": "amqp091"}, 10.0)]
    assert ({"vhost": "/", "queue": "q1"}, 10.0) in got["rabbitmq_queue_messages"]
    state = {(lb["name"], lb["state"]): v for lb, v in got["creditflow_process_state"]}
    assert state[("channel-1.1", "flow")] == 1 and state[("channel-1.1", "running")] == 0
    assert state[("reader-1", "flow")] == 1 and ("queue-q1", "blocked") not in state     # blocked: readers only
    assert ({"kind": "channel", "name": "channel-1.1"}, 1.5) in got["creditflow_blocked_seconds_total"]
    assert ({"kind": "channel", "name": "channel-1.1"}, 2.0) in got["creditflow_flow_seconds_total"]
    assert ({"sender": "reader-1", "receiver": "channel-1.1"}, 4.0) in got["creditflow_link_in_flight"]
    assert ({"sender": "reader-1", "receiver": "channel-1.1"}, 396.0) in got["creditflow_link_credit"]
    assert ({"le": "0.01"}, 3.0) in got["creditflow_store_fsync_seconds_bucket"]
    assert got["creditflow_store_fsync_seconds_count"] == [({}, 3.0)]


def test_each_family_is_built_from_one_status():
    calls = []

    def sample():
        calls.append(1)
        return status()
    from prometheus_client import CollectorRegistry, generate_latest
    from pipeline.management.metrics import StatusCollector
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(sample))
    generate_latest(registry)
    assert len(calls) == 1
    assert len({f.name for f in families(status())}) == len(families(status()))


@pytest.mark.processes
def test_metrics_show_a_channel_in_flow_behind_a_slow_queue(start_broker):
    import pika
    broker = start_broker("--queue-delay-us", "3000", "--fsync-interval-ms", "20")
    port = broker.info["management_port"]

    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            assert answer.headers["Content-Type"].startswith("text/plain")
            return samples(answer.read().decode())

    stop = threading.Event()

    def publish():
        conn = pika.BlockingConnection(pika.ConnectionParameters(port=broker.port))
        ch = conn.channel()
        ch.queue_declare("slow-q", durable=True)
        props = pika.BasicProperties(delivery_mode=2)
        while not stop.is_set():
            for _ in range(200):
                ch.basic_publish("", "slow-q", b"x" * 5000, props)      # over 4096: the store writes it
            conn.process_data_events(0)
        conn.close()
    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    try:
        def flowing():
            # A state change is pushed within 10 ms, the counters with the next regular statistics
            # push: wait for both rather than read the counters in the same scrape as the first flow.
            got = scrape()
            in_flow = any(lb["state"] == "flow" and v == 1 and lb["kind"] in ("reader", "channel")
                          for lb, v in got.get("creditflow_process_state", []))
            received = got.get("rabbitmq_global_messages_received_total", [({}, 0)])[0][1]
            return got if in_flow and received > 0 else None
        got = wait_until(flowing, timeout_s=20, what="a reader or channel in flow and messages received in /metrics")
    finally:
        stop.set()
        publisher.join(30)
    for name in RABBITMQ_NAMES:
        assert name in got, name
    assert got["rabbitmq_connections"] == [({}, 1.0)] and got["rabbitmq_queues"] == [({}, 1.0)]
    assert got["rabbitmq_global_messages_received_total"][0][1] > 0
    assert any(lb["receiver"] == "queue-slow-q" for lb, _ in got["creditflow_link_in_flight"])
    flow = {lb["name"]: v for lb, v in got["creditflow_flow_seconds_total"]}
    assert set(flow) >= {"store"} and any(name.startswith("channel-") for name in flow)
    later = wait_until(lambda: (g := scrape()).get("creditflow_store_fsync_seconds_count", [({}, 0)])[0][1] > 0
                       and g, what="an fsync in the histogram")
    assert later["creditflow_store_fsync_seconds_bucket"][-1][0] == {"le": "+Inf"}
