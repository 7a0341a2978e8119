"""The management API subset: pure views of a status, then a real broker answering over HTTP, and
``creditflow ctl list_*`` printing the same views as rabbitmqctl does."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import time
import types
import typing
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, creditflow_cmd
from pipeline.management.views import (RateBook, UnknownColumn, Views, list_rows, retire, select_columns)
from pipeline.telemetry import schema

NODE = "creditflow@localhost"


SUPERVISOR_KEYS = ("alive", "seconds", "restarts", "host", "peer", "owner")     # what the supervisor adds


def zero(tp):
    """The plain (JSON) zero value of a statistics field's type."""
    hints_of = schema.type_hints
    if tp in (int, float, bool, str):
        return tp()
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return None
    if origin in (tuple, list):
        return []
    if origin is dict:
        return {}
    if dataclasses.is_dataclass(tp):
        return {f.name: zero(hints_of(tp)[f.name]) for f in dataclasses.fields(tp)}
    raise TypeError(tp)


def proc(name: str, kind: str, **fields) -> dict:
    """A process's entry in ``status["processes"]``: its kind's statistics message (every field zero but
    those given, which must be fields of its class) and the supervisor's keys beside it."""
    cls = schema.STATS_TYPES[kind]
    sup = {"alive": True, "seconds": {"running": 1.0, "total": 1.0}, "restarts": 0, "host": None,
           "state": "running"}                # the supervisor's state_at, over the stage's own
    sup.update({k: fields.pop(k) for k in (*SUPERVISOR_KEYS, "state") if k in fields})
    msg = {f.name: zero(schema.type_hints(cls)[f.name]) for f in dataclasses.fields(cls)
           if not f.metadata.get("optional")}
    msg.update({"name": name, "kind": kind, "pid": 10, **fields})
    assert not schema.unknown_fields(msg), schema.unknown_fields(msg)
    return {**msg, **sup}


def status(now_ns: int = 10**12, *, publish: int = 0, alarms=None, queue_state="running", **extra) -> dict:
    return {
        "node": NODE, "pid": 1, "port": 5672, "now_ns": now_ns, "alarms": alarms or {},
        "fd": {"used": 40, "limit": 1024, "alarm": False},
        "processes": {
            "reader-1": proc("reader-1", "reader", conn_state="flow", channels=1, client_name="app",
                             publishes=publish, peer="127.0.0.1:50712 -> 127.0.0.1:5672"),
            "channel-1.1": proc("channel-1.1", "channel", number=1, routed=publish, unconfirmed=2,
                                confirmed=max(0, publish - 2), confirm_mode="confirm", owner="reader-1",
                                state="flow", blocked=True, blocked_by=["queue-q1"], blocked_total_ns=1_500_000_000,
                                seconds={"running": 1.0, "flow": 2.0, "total": 3.0}),
            "queue-q1": proc("queue-q1", "queue", queue="q1", messages=7, unacked=3, consumers=2, enqueued=publish,
                             delivered=5, acked=2, message_bytes=700, state=queue_state),
            "watchdog": proc("watchdog", "watchdog", memory_used=100, memory_limit=1000, disk_free=5000,
                             disk_limit=50, strategy="rss"),
        },
        "links": {"reader-1->channel-1.1": {"sent": publish, "records": publish, "in_flight": 4, "max_in_flight": 9,
                                            "overflow": 0, "credit": 396},
                  "channel-1.1->reader-1": {"sent": 0, "records": 0, "in_flight": 0, "max_in_flight": 0,
                                            "overflow": 0, "credit": None}},
        "queues": {"q1": {"proc": "queue-q1", "durable": True, "down": False, "exclusive": False,
                          "auto_delete": False, "arguments": {"x-max-length": 1000}}},
        "routing": {"exchanges": 6}, **extra,
    }


# -- pure -----------------------------------------------------------------------------------------------------
def test_objects_carry_rabbitmqs_names_and_the_process_behind_them():
    v = Views(status(publish=10))
    conn, = v.connections()
    assert conn["name"] == "127.0.0.1:50712 -> 127.0.0.1:5672" and conn["state"] == "flow"
    assert (conn["peer_host"], conn["peer_port"], conn["port"]) == ("127.0.0.1", 50712, 5672)
    assert conn["client_properties"] == {"connection_name": "app"} and conn["creditflow"]["process"] == "reader-1"
    chan, = v.channels()
    assert chan["name"] == "127.0.0.1:50712 -> 127.0.0.1:5672 (1)" and chan["confirm"] is True
    assert chan["connection_details"]["name"] == conn["name"] and chan["messages_unconfirmed"] == 2
    assert chan["creditflow"]["blocked_by"] == ["queue-q1"] and chan["creditflow"]["flow_seconds"] == 2.0
    assert chan["message_stats"]["confirm"] == 8                  # as the channel counted them
    q, = v.queues()
    assert (q["messages"], q["messages_ready"], q["messages_unacknowledged"], q["consumers"]) == (10, 7, 3, 2)
    assert q["arguments"] == {"x-max-length": 1000} and q["message_stats"]["publish"] == 10
    assert len(v.consumers()) == 2
    o = v.overview()
    assert o["object_totals"] == {"connections": 1, "channels": 1, "queues": 1, "consumers": 2, "exchanges": 7}
    assert o["queue_totals"]["messages"] == 10 and o["message_stats"]["publish"] == 10
    node, = v.nodes()
    assert (node["mem_used"], node["mem_limit"], node["disk_free"], node["fd_total"]) == (100, 1000, 5000, 1024)
    link = next(lk for lk in v.links_view() if lk["sender"] == "reader-1")
    assert (link["receiver"], link["credit"], link["in_flight"]) == ("channel-1.1", 396, 4)


def test_health_checks_answer_as_rabbitmq_3_10_does():
    assert Views(status()).health_alarms("cluster") == (200, {"status": "ok"})
    alarmed = Views(status(alarms={"memory": {"state": "set"}, "disk": {"state": "clear"}}))
    assert alarmed.health_alarms("cluster") == (503, {
        "status": "failed", "reason": "There are alarms in effect in the cluster",
        "alarms": [{"node": NODE, "resource": "memory"}]})
    assert alarmed.health_alarms("node")[1]["reason"] == "There are alarms in effect on the node"
    assert alarmed.nodes()[0]["mem_alarm"] is True and alarmed.nodes()[0]["disk_free_alarm"] is False


def test_rates_come_from_successive_samples_at_least_a_second_apart():
    rates = RateBook()
    for i, t in enumerate((0.0, 0.5, 1.0, 1.5, 2.0)):
        s = status(int(t * 1e9), publish=1000 * i)
        rates.observe(t, s)
    v = Views(s, rates)
    assert v.overview()["message_stats"]["publish_details"]["rate"] == 2000.0     # 2000 more in 1.0 s
    assert v.queues()[0]["message_stats"]["publish_details"]["rate"] == 2000.0
    assert Views(s).overview()["message_stats"]["publish_details"]["rate"] == 0.0  # no samples: 0


def test_counters_of_ended_processes_are_kept_so_totals_never_fall():
    retired: dict = {}
    before = status(publish=10)
    retire(retired, "channel", before["processes"]["channel-1.1"])
    retire(retired, "queue", before["processes"]["queue-q1"])
    after = status(publish=0, retired=retired)
    for name in ("channel-1.1", "queue-q1"):
        after["processes"][name]["alive"] = False
    totals = Views(after).totals()
    assert (totals["publish"], totals["confirm"], totals["deliver_get"], totals["ack"]) == (10, 8, 5, 2)


def test_columns_select_nested_fields_and_list_rows_refuse_unknown_ones():
    q = Views(status(publish=3)).queues()
    assert select_columns(q, ["name", "message_stats.publish", "nope"]) == [
        {"name": "q1", "message_stats": {"publish": 3}}]
    rows = list_rows(Views(status()), "queues", ["name", "state", "messages", "durable", "arguments"])
    assert rows == [["name", "state", "messages", "durable", "arguments"],
                    ["q1", "running", 10, True, {"x-max-length": 1000}]]
    assert list_rows(Views(status()), "connections", [])[0] == ["user", "peer_host", "peer_port", "state"]
    with pytest.raises(UnknownColumn, match="Info key\\(s\\) bogus are not supported"):
        list_rows(Views(status()), "channels", ["name", "bogus"])


def test_what_the_stages_report_fills_connections_channels_and_consumers():
    st = status()
    st["processes"]["reader-1"].update(user="guest", recv_oct=1200, send_oct=3400, channel_unacked={"1": 4},
                                       client_properties={"product": "pika", "version": "1.3.2", "platform": None,
                                                          "information": None, "connection_name": "app",
                                                          "capabilities": {"basic.nack": True}})
    st["processes"]["channel-1.1"].update(prefetch_count=7, global_prefetch_count=0, consumer_count=1, confirmed=6)
    st["processes"]["queue-q1"].update(consumer_details=[
        {"consumer_tag": "ctag-a", "channel": "channel-1.1", "channel_number": 1, "ack_required": True,
         "prefetch_count": 7, "exclusive": False}])
    v = Views(st)

    conn, = v.connections()
    assert (conn["user"], conn["recv_oct"], conn["send_oct"]) == ("guest", 1200, 3400)
    assert conn["client_properties"] == {"product": "pika", "version": "1.3.2", "connection_name": "app",
                                         "capabilities": {"basic.nack": True}}       # what the client sent
    chan, = v.channels()
    assert (chan["user"], chan["prefetch_count"], chan["consumer_count"], chan["messages_unacknowledged"]) == (
        "guest", 7, 1, 4)                                     # unacked: the reader counts them per channel
    assert chan["message_stats"]["confirm"] == 6              # as the channel counted it
    named, unnamed = v.consumers()                            # the queue counts 2, lists 1
    assert named["consumer_tag"] == "ctag-a" and named["prefetch_count"] == 7 and named["ack_required"] is True
    assert named["channel_details"] == {"name": chan["name"], "number": 1, "connection_name": conn["name"],
                                        "peer_host": "127.0.0.1", "peer_port": 50712, "user": "guest"}
    assert unnamed["consumer_tag"] is None and unnamed["channel_details"] == {}


@pytest.mark.parametrize("listed_active, expected", [
    (True, [("ctag-a", True, "single_active"), (None, False, "waiting")]),
    (False, [("ctag-a", False, "waiting"), (None, True, "single_active")]),
])
def test_a_single_active_consumer_left_out_of_the_list_is_still_one_of_its_consumers(listed_active, expected):
    """A queue lists its first hundred consumers: with a single active consumer the rest wait, unless the
    active one is among those left out (then one of them is it)."""
    st = status()
    st["processes"]["queue-q1"].update(single_active_consumer_tag="ctag-a" if listed_active else "ctag-z",
                                       consumer_details=[
        {"consumer_tag": "ctag-a", "channel": "channel-1.1", "channel_number": 1, "ack_required": True,
         "prefetch_count": 7, "exclusive": False, "active": listed_active}])
    v = Views(st)
    assert [(c["consumer_tag"], c["active"], c["activity_status"]) for c in v.consumers()] == expected
    assert v.find_queue("/", "q1")["single_active_consumer_tag"] == ("ctag-a" if listed_active else "ctag-z")


# -- a real broker ---------------------------------------------------------------------------------------------
def get(port: int, path: str, auth=("guest", "guest")):
    """(status code, parsed JSON or raw bytes, headers)."""
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            body, code, got = answer.read(), answer.status, answer.headers
    except urllib.error.HTTPError as exc:
        body, code, got = exc.read(), exc.code, exc.headers
    try:
        return code, json.loads(body), got
    except ValueError:
        return code, body, got


def wait_until(fn, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def ctl(broker, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(creditflow_cmd("ctl", "--data-dir", str(broker.data_dir), *args), capture_output=True,
                          text=True, cwd=ROOT, timeout=30)


@pytest.mark.processes
def test_the_api_serves_a_live_broker_with_auth_health_checks_and_ctl_lists(start_broker):
    import pika
    broker = start_broker("--user", "alice:s3cret")
    port = broker.info["management_port"]
    assert port and port != broker.port

    code, body, headers = get(port, "/api/overview", auth=None)
    assert code == 401 and headers["WWW-Authenticate"] == 'Basic realm="RabbitMQ Management"'
    assert get(port, "/api/overview", auth=("guest", "wrong"))[:2] == (
        401, {"error": "not_authorized", "reason": "Login failed"})
    assert get(port, "/api/whoami", auth=("alice", "s3cret"))[1] == {"name": "alice", "tags": ["administrator"]}

    conn = pika.BlockingConnection(pika.ConnectionParameters(port=broker.port, client_properties={
        "connection_name": "api-test"}))
    try:
        pub = conn.channel()
        pub.confirm_delivery()
        pub.queue_declare("api-q", durable=True, arguments={"x-max-length": 1000})
        for _ in range(20):
            pub.basic_publish("", "api-q", b"x" * 100)
        sub = conn.channel()
        sub.basic_qos(prefetch_count=5)
        sub.basic_consume("api-q", lambda *a: None)
        conn.process_data_events(0.5)

        def queue_settled():
            code, q, _ = get(port, "/api/queues/%2F/api-q")
            return q if code == 200 and q["messages_unacknowledged"] == 5 and q["consumers"] == 1 else None
        q = wait_until(queue_settled, what="the queue's consumer and 5 unacked")
        assert (q["name"], q["vhost"], q["state"], q["messages"], q["messages_ready"]) == ("api-q", "/", "running",
                                                                                         20, 15)
        assert q["durable"] is True and q["auto_delete"] is False and q["arguments"] == {"x-max-length": 1000}
        assert q["message_stats"]["publish"] == 20 and q["message_stats"]["deliver_get"] == 5
        assert "rate" in q["message_stats"]["publish_details"] and "memory" in q
        assert get(port, "/api/queues/%2F/nope")[:2] == (404, {"error": "Object Not Found", "reason": "Not Found"})

        o = get(port, "/api/overview")[1]
        assert o["object_totals"]["connections"] == 1 and o["object_totals"]["queues"] == 1
        assert o["queue_totals"]["messages"] == 20 and o["message_stats"]["publish"] == 20
        assert o["node"] == o["cluster_name"] and o["rabbitmq_version"]
        node, = get(port, "/api/nodes")[1]
        for field in ("name", "mem_used", "mem_limit", "mem_alarm", "disk_free", "disk_free_limit",
                      "disk_free_alarm", "fd_used", "fd_total", "proc_used", "running"):
            assert node[field] is not None, field
        c, = get(port, "/api/connections")[1]
        assert c["state"] == "running" and c["channels"] == 2 and c["user_provided_name"] == "api-test"
        assert c["name"].endswith(f"-> 127.0.0.1:{broker.port}") and c["vhost"] == "/"
        chans = get(port, "/api/channels?columns=name,confirm,connection_details.name,creditflow.process")[1]
        assert sorted(ch["confirm"] for ch in chans) == [False, True]
        assert all(ch["connection_details"]["name"] == c["name"] and ch["name"].startswith(c["name"] + " (")
                   for ch in chans)
        assert all(set(ch) == {"name", "confirm", "connection_details", "creditflow"} for ch in chans)
        assert len(get(port, "/api/consumers")[1]) == 1
        procs = get(port, "/api/creditflow/processes")[1]
        assert {p["kind"] for p in procs} >= {"reader", "channel", "queue", "store"}
        assert any(lk["credit"] is not None for lk in get(port, "/api/creditflow/links")[1])

        listed = ctl(broker, "list_queues", "name", "state", "messages", "durable", "arguments")
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines() == ["Listing queues for vhost / ...", "name\tstate\tmessages\tdurable\t"
                                              "arguments", 'api-q\trunning\t20\ttrue\t{"x-max-length":1000}']
        listed = ctl(broker, "-q", "list-connections", "name", "state", "channels")
        assert listed.stdout.splitlines() == ["name\tstate\tchannels", f"{c['name']}\trunning\t2"]
        listed = ctl(broker, "list_queues", "-q", "name", "messages")     # rabbitmqctl takes -q among the columns
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines() == ["name\tmessages", "api-q\t20"]
        listed = ctl(broker, "list_channels", "name", "state", "confirm")
        assert sorted(listed.stdout.splitlines()[2:]) == [f"{c['name']} (1)\trunning\ttrue",
                                                          f"{c['name']} (2)\trunning\tfalse"]
        bad = ctl(broker, "list_channels", "name", "bogus")
        assert bad.returncode == 2 and "bogus" in bad.stderr
    finally:
        conn.close()

    for path in ("/api/health/checks/alarms", "/api/health/checks/local-alarms"):
        assert get(port, path)[:2] == (200, {"status": "ok"})
    assert ctl(broker, "set-watermark", "0").returncode == 0
    code, body, _ = wait_until(lambda: (r := get(port, "/api/health/checks/alarms"))[0] == 503 and r,
                               what="the alarm health check to fail")
    assert body == {"status": "failed", "reason": "There are alarms in effect in the cluster",
                    "alarms": [{"node": broker.info["node"], "resource": "memory"}]}
    assert get(port, "/api/health/checks/local-alarms")[1]["reason"] == "There are alarms in effect on the node"
    assert get(port, "/api/nodes")[1][0]["mem_alarm"] is True
    assert ctl(broker, "set-watermark", "0.6").returncode == 0
    wait_until(lambda: get(port, "/api/health/checks/alarms")[0] == 200, what="the alarm to clear")


@pytest.mark.processes
def test_a_pika_consumer_shows_its_prefetch_tag_bytes_and_client_properties(broker):
    import pika
    port = broker.info["management_port"]
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port,
                                                             client_properties={"connection_name": "pika-app"}))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("pika-q")
        for _ in range(20):
            ch.basic_publish("", "pika-q", b"x" * 100)
        ch.basic_qos(prefetch_count=7)
        tag = ch.basic_consume("pika-q", lambda *a: None)
        conn.process_data_events(0.5)

        def consuming():
            c = get(port, "/api/channels")[1]
            return c if len(c) == 1 and c[0]["consumer_count"] == 1 and c[0]["messages_unacknowledged"] == 7 \
                else None
        chan, = wait_until(consuming, what="the channel's consumer and its 7 unacked")
        assert (chan["prefetch_count"], chan["global_prefetch_count"], chan["user"]) == (7, 0, "guest")
        assert chan["confirm"] is True and chan["message_stats"]["confirm"] == 20
        consumer, = get(port, "/api/consumers")[1]
        assert (consumer["consumer_tag"], consumer["prefetch_count"], consumer["ack_required"]) == (tag, 7, True)
        assert consumer["exclusive"] is False and consumer["queue"]["name"] == "pika-q"
        assert consumer["channel_details"]["name"] == chan["name"] and consumer["channel_details"]["number"] == 1
        assert get(port, "/api/queues/%2F/pika-q")[1]["consumer_details"][0]["consumer_tag"] == tag

        first, = get(port, "/api/connections")[1]
        assert first["user"] == "guest" and first["user_provided_name"] == "pika-app"
        props = first["client_properties"]
        assert props["product"] == pika.connection.PRODUCT and props["connection_name"] == "pika-app"
        assert props["capabilities"]["publisher_confirms"] is True and "platform" in props
        assert first["recv_oct"] > 20 * 100 and first["send_oct"] > 7 * 100      # bodies both ways
        for _ in range(10):
            ch.basic_publish("", "pika-q", b"y" * 1000)
        conn.process_data_events(0.3)
        later = wait_until(lambda: (c := get(port, "/api/connections")[1]) and c[0]["recv_oct"] >= first["recv_oct"]
                           + 10 * 1000 and c[0], what="recv_oct to grow by what was published")
        assert later["send_oct"] > first["send_oct"]                             # the confirms
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "rabbitmq_connection_incoming_bytes_total" in metrics and "rabbitmq_channel_consumers 1.0" in metrics
    finally:
        conn.close()


def test_a_single_active_consumer_and_those_waiting_show_as_rabbitmq_3_10_shows_them(broker):
    """RabbitMQ 3.10.8: the queue's single_active_consumer_tag (null on other queues), each consumer
    active and single_active, or not and waiting; a plain queue's consumers up."""
    import pika
    port = broker.info["management_port"]
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    try:
        ch = conn.channel()
        ch.queue_declare("plain")
        ch.basic_consume("plain", lambda *a: None, consumer_tag="p1")
        ch.queue_declare("sacq", arguments={"x-single-active-consumer": True})
        for tag in ("s1", "s2"):
            ch.basic_consume("sacq", lambda *a: None, consumer_tag=tag)
        conn.process_data_events(0.3)

        def both_consuming():
            q = get(port, "/api/queues/%2F/sacq")[1]
            return q if q["consumers"] == 2 and len(q["consumer_details"]) == 2 else None
        q = wait_until(both_consuming, what="the two consumers of sacq")
        assert q["single_active_consumer_tag"] == "s1"
        assert sorted((c["consumer_tag"], c["active"], c["activity_status"]) for c in q["consumer_details"]) == [
            ("s1", True, "single_active"), ("s2", False, "waiting")]
        plain = get(port, "/api/queues/%2F/plain")[1]
        assert plain["single_active_consumer_tag"] is None
        assert [(c["consumer_tag"], c["active"], c["activity_status"]) for c in plain["consumer_details"]] == [
            ("p1", True, "up")]
        listed = {c["consumer_tag"]: c["activity_status"] for c in get(port, "/api/consumers")[1]}
        assert listed == {"p1": "up", "s1": "single_active", "s2": "waiting"}
        ch.basic_cancel("s1")
        wait_until(lambda: get(port, "/api/queues/%2F/sacq")[1]["single_active_consumer_tag"] == "s2",
                   what="s2 to take over")
    finally:
        conn.close()


@pytest.mark.processes
def test_a_dead_management_process_is_restarted_on_the_same_port(start_broker):
    broker = start_broker()
    port = broker.info["management_port"]
    assert get(port, "/api/whoami")[0] == 200
    from pipeline.ctlclient import CtlClient
    with CtlClient(str(broker.data_dir)) as client:
        assert client.request("kill", name="management")["ok"]
    status = broker.wait_for(lambda s: any(d["name"] == "management" and d.get("restarted_pid")
                                           for d in s["deaths"]), what="the management process's restart")
    death, = [d for d in status["deaths"] if d["name"] == "management"]
    assert death["action"] == "restart"
    wait_until(lambda: _answers(port), what="the restarted API to answer")
    assert "Restarting crashed management listener" in broker.output()


def _answers(port: int) -> bool:
    try:
        return get(port, "/api/whoami")[0] == 200
    except OSError:
        return False


@pytest.mark.processes
def test_management_port_off_and_in_use(start_broker, tmp_path):
    broker = start_broker("--management-port", "off")
    assert broker.info["management_port"] is None
    taken = broker.port                          # the AMQP port: certainly taken
    out = subprocess.run(creditflow_cmd("serve", "--port", "0", "--management-port", str(taken), "--data-dir",
                                        str(tmp_path / "other")), capture_output=True, text=True, cwd=ROOT,
                         timeout=30)
    assert out.returncode == 4 and f"management port {taken} is already in use" in out.stderr


@pytest.mark.processes
def test_a_client_that_resets_its_connection_mid_request_leaves_no_traceback_in_the_log(broker):
    """As RabbitMQ's listener: a client hanging up (an RST, as rabbitmqadmin's may) is not the broker's error."""
    import socket
    import struct
    port = broker.info["management_port"]
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /api/overview HTTP/1.1\r\nHost: x")        # no end of line: the server waits
            time.sleep(0.2)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
    time.sleep(0.5)
    with urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/api/overview",
            headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()}), timeout=10) as r:
        assert r.status == 200                  # still serving
    assert "Traceback" not in broker.output()


RABBITMQADMIN = "/usr/bin/rabbitmqadmin"


@pytest.mark.processes
@pytest.mark.skipif(not __import__("os").path.exists(RABBITMQADMIN),
                    reason="rabbitmqadmin is not installed (Debian's rabbitmq-server ships it)")
def test_rabbitmqadmin_reads_queues_exchanges_bindings_and_connections(start_broker):
    """RabbitMQ's own command-line client, unchanged, against the management port."""
    import pika
    broker = start_broker()
    port = broker.info["management_port"]
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    ch = conn.channel()
    ch.queue_declare("adm-q")
    ch.exchange_declare("adm-x", "topic")
    ch.queue_bind("adm-q", "adm-x", "orders.#")

    def admin(*args: str) -> list[list[str]]:
        done = subprocess.run([RABBITMQADMIN, "-P", str(port), "-f", "tsv", *args], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return [line.split("\t") for line in done.stdout.splitlines()]

    try:
        deadline = time.monotonic() + 10
        while ["adm-q", "0"] not in admin("list", "queues", "name", "messages") and time.monotonic() < deadline:
            time.sleep(0.3)
        assert ["adm-q", "0"] in admin("list", "queues", "name", "messages")
        assert ["adm-x", "topic"] in admin("list", "exchanges", "name", "type")
        assert ["adm-x", "adm-q", "orders.#"] in admin("list", "bindings", "source", "destination", "routing_key")
        assert ["", "adm-q", "adm-q"] in admin("list", "bindings", "source", "destination", "routing_key")
        assert any(row and row[0] == "running" for row in admin("list", "connections", "state"))
        overview = admin("show", "overview")
        assert overview[0][0] == "rabbitmq_version" and overview[1][0] == "3.10.8"
    finally:
        conn.close()
