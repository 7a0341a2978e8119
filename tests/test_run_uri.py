"""``creditflow run --uri``: the load generator against a broker it did not start.

The broker here is a ``creditflow serve`` started by the test (with a user of
its own); ``scripts/`` and the README show the same against RabbitMQ.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_creditflow
from pipeline.loadgen.config import InvalidLoadConfig
from pipeline.loadgen.uri import BrokerAddress, parse_amqp_uri


@pytest.mark.parametrize("uri, expected", [
    ("amqp://", BrokerAddress("localhost", 5672, "guest", "guest", "/")),
    ("amqp://alice:s3cret@broker:5673/", BrokerAddress("broker", 5673, "alice", "s3cret", "/")),
    ("amqp://alice:s3cret@broker/prod", BrokerAddress("broker", 5672, "alice", "s3cret", "prod")),
    ("amqp://host/%2f", BrokerAddress("host", 5672, "guest", "guest", "/")),
    ("amqp://a%40b:p%3Aw@[::1]:5680/v%2Fx", BrokerAddress("::1", 5680, "a@b", "p:w", "v/x")),
])
def test_uris_are_read_as_rabbitmqs_clients_read_them(uri, expected):
    assert parse_amqp_uri(uri) == expected


@pytest.mark.parametrize("uri, why", [
    ("amqps://host", "amqps"), ("http://host", "not an AMQP URI"), ("amqp://host:99999", "not an AMQP URI"),
    ("amqp://host/a/b", "%2f"), ("amqp://host/?heartbeat=5", "query"),
])
def test_uris_it_cannot_follow_are_refused(uri, why):
    with pytest.raises(InvalidLoadConfig, match=why):
        parse_amqp_uri(uri)


def test_the_uri_printed_leaves_the_password_out():
    assert BrokerAddress("::1", 5680, "alice", "s3cret", "/").uri() == "amqp://alice@[::1]:5680/%2f"


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_run_drives_a_broker_it_did_not_start(start_broker, tmp_path):
    broker = start_broker("--user", "alice:Kx7-secret")
    run_dir = tmp_path / "run"
    code, out, s = run_creditflow(run_dir, f"--uri=amqp://alice:Kx7-secret@127.0.0.1:{broker.port}/%2f",
                                  "-x", "2", "-y", "1", "-r", "300", "-z", "3", "-c", "50")
    assert code == 0, out
    assert s["published"] >= 1200 and s["delivered"] == s["published"] == s["confirmed"], out
    assert s["lost"] == 0 and s["undelivered"] == 0
    assert len([line for line in out.splitlines() if line.startswith("time ")]) >= 2, out
    assert not any(line.startswith("  reader") for line in out.splitlines())     # no process states to show
    config = json.loads((run_dir / "config.json").read_text())
    assert config["broker"] == {"uri": f"amqp://alice@127.0.0.1:{broker.port}/%2f"}
    assert "Kx7-secret" not in (run_dir / "config.json").read_text() + (run_dir / "summary.json").read_text()
    assert not (run_dir / "telemetry").exists() and not (run_dir / "msg_store").exists()
    queues = broker.status()["queues"]
    assert "creditflow-perf" in queues              # declared on the broker the URI named


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_broker_that_refuses_the_login_or_broker_options_stop_the_run_before_it_starts(start_broker, tmp_path):
    broker = start_broker()
    code, out, _ = run_creditflow(tmp_path / "bad", "--uri", f"amqp://guest:wrong@127.0.0.1:{broker.port}/")
    assert code == 6 and "ACCESS_REFUSED" in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "bad").exists()
    code, out, _ = run_creditflow(tmp_path / "opts", "--uri", f"amqp://127.0.0.1:{broker.port}/",
                                  "--queue-delay-us", "100", "--credit", "10,5")
    assert code == 2 and out.strip() == ("creditflow run: --credit, --queue-delay-us only apply to a broker "
                                         "creditflow starts; with --uri the broker is the one the URI names"), out
    assert not (tmp_path / "opts").exists()


RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


@pytest.fixture
def rabbitmq_with_management():
    """A private RabbitMQ node with its management API (scripts/bench_vs_rabbitmq's), where one is installed."""
    import os

    from amqp_targets import free_ports
    from conftest import script_module
    if not os.path.exists(RABBITMQ_SERVER):
        pytest.skip("RabbitMQ is not installed here (Debian's rabbitmq-server)")
    port, management_port, dist_port = free_ports(3)
    node = script_module("_beside_rabbitmq").bench_module().RabbitMQ(port, management_port=management_port,
                                                                     dist_port=dist_port)
    try:
        yield node
    finally:
        node.stop()


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_against_rabbitmq_samples_its_management_api_into_telemetry(rabbitmq_with_management, tmp_path):
    import time
    import urllib.request
    node = rabbitmq_with_management
    api = f"http://guest:guest@127.0.0.1:{node.management_port}"
    deadline = time.monotonic() + 60
    while True:                                      # the management listener comes up after AMQP's
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{node.management_port}/api/overview",
                                             headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="})
            urllib.request.urlopen(request, timeout=1).read()
            break
        except OSError:
            assert time.monotonic() < deadline, "RabbitMQ's management API did not come up"
            time.sleep(0.5)
    run_dir = tmp_path / "run"
    code, out, s = run_creditflow(run_dir, "--uri", f"amqp://guest:guest@127.0.0.1:{node.port}/",
                                  "--management-uri", api, "-x", "1", "-y", "1", "-r", "2000", "-z", "9")
    assert code == 0, out
    assert s["delivered"] == s["published"] > 0 and s["lost"] == 0, out
    assert any(line.startswith("  RabbitMQ: connections") for line in out.splitlines()), out
    import pyarrow.parquet as pq
    states = pq.read_table(run_dir / "telemetry" / "states.parquet").to_pylist()
    kinds = {r["kind"] for r in states}
    assert {"reader", "channel", "queue"} <= kinds, states
    assert any(r["kind"] == "queue" and r["name"] == "creditflow-perf" for r in states)
    stats = pq.read_table(run_dir / "telemetry" / "stats.parquet").to_pylist()
    assert any(r["kind"] == "watchdog" and r["memory_limit"] for r in stats)
    assert "guest:guest" not in (run_dir / "config.json").read_text()
