"""Supervision with real processes: whatever one client does, or whichever stage dies, the broker goes on.

Each death is handled where RabbitMQ handles it: a reader takes only its
connection (its consumers' unacked messages go back), a channel has its
connection closed with 541, a queue, the store and the watchdog are
restarted. Checked as a client sees it: frames on the wire, reply codes,
messages counted, and what ``ctl status`` and the log say.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pika
import pytest
from pamqp import body as amqp_body, commands, frame, header

from conftest import creditflow_cmd, raw_amqp_connection

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def connect(broker, **kw) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port, **kw))


def frames_until(sock: socket.socket, done, timeout_s: float = 10.0) -> list:
    """Read frames until ``done(frames so far)``; the pamqp objects of method frames, in order."""
    got, buf = [], b""
    deadline = time.monotonic() + timeout_s
    while not done(got):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; frames so far: {[type(f).__name__ for f in got]}"
        sock.settimeout(left)
        data = sock.recv(65536)
        if not data:
            break
        buf += data
        while True:
            try:
                used, _, value = frame.unmarshal(buf)
            except Exception:
                break
            buf = buf[used:]
            got.append(value)
    return got


def names(frames_seen) -> list[str]:
    return [f.name for f in frames_seen if hasattr(f, "name")]


def telemetry_events(broker, timeout_s: float = 5.0) -> set[str]:
    """The kinds of event in the broker's telemetry (written out once a second)."""
    path = broker.data_dir / "telemetry" / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {json.loads(line)["event"] for line in path.read_text().splitlines() if line.strip()}
        if "stage_restarted" in seen or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def deaths(broker) -> list[dict]:
    return broker.status()["deaths"]


def test_clients_that_open_publish_and_close_at_once_never_stop_the_broker(broker):
    keeper = connect(broker)
    kept = keeper.channel()
    kept.queue_declare("kept")
    for i in range(60):
        c = connect(broker)
        ch = c.channel()
        ch.queue_declare(f"q{i % 3}")
        ch.basic_publish("", f"q{i % 3}", b"x")
        ch.close()
        c.close()
    for i in range(60):      # and the rudest: publish on a fresh channel, then vanish without a close
        s = raw_amqp_connection(broker.port)
        s.sendall(frame.marshal(commands.Channel.Open(), 1)
                  + frame.marshal(commands.Queue.Declare(queue=f"q{i % 3}"), 1)
                  + frame.marshal(commands.Basic.Publish(exchange="", routing_key=f"q{i % 3}"), 1)
                  + frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1)
                  + frame.marshal(amqp_body.ContentBody(b"y"), 1))
        s.close()
    kept.basic_publish("", "kept", b"still here")
    assert kept.basic_get("kept", auto_ack=True)[2] == b"still here"
    # a publish before channel.close is handled before the close, as RabbitMQ's channel handles its
    # mailbox in order: each of the first sixty is in its queue (the rude ones may or may not be)
    held = [kept.queue_declare(f"q{i}", passive=True).method.message_count for i in range(3)]
    assert all(n >= 20 for n in held), held
    assert broker.proc.poll() is None
    assert deaths(broker) == []
    assert "supervisor failed" not in broker.output()
    keeper.close()


def test_a_killed_reader_takes_only_its_connection_and_its_unacked_messages_go_back(broker):
    other = connect(broker)
    och = other.channel()
    och.queue_declare("work")
    for i in range(20):
        och.basic_publish("", "work", str(i).encode())
    victim = connect(broker)
    vch = victim.channel()
    vch.basic_qos(prefetch_count=10)
    held = []
    vch.basic_consume("work", lambda ch, m, p, body: held.append(body))
    while len(held) < 10:
        victim.process_data_events(0.1)
    broker.kill("reader-2")
    broker.wait_for(lambda s: any(d["name"] == "reader-2" for d in s["deaths"]), what="the reader's death")
    got = []
    while True:
        m = och.basic_get("work", auto_ack=True)
        if m[0] is None:
            break
        got.append((m[2], m[0].redelivered))
    assert sorted(int(b) for b, _ in got) == list(range(20)), "nothing lost, nothing twice"
    assert {b for b, redelivered in got if redelivered} == set(held)
    assert [b for b, _ in got[:10]] == held, "requeued messages come back first, in their order"
    death = [d for d in deaths(broker) if d["name"] == "reader-2"][0]
    assert (death["how"], death["action"]) == ("killed", "close_connection")
    assert "closing AMQP connection reader-2" in broker.output()
    other.close()


def bystander_and_victim(broker):
    """Two connections, each with a channel that declared a queue: the first's reader is reader-1 and its
    channel channel-1.1, the second's reader-2 and channel-2.1. Returns the bystander, its channel and the
    victim."""
    bystander = connect(broker)
    bch = bystander.channel()
    bch.queue_declare("b")
    victim = connect(broker)
    victim.channel().queue_declare("v")
    return bystander, bch, victim


@pytest.mark.parametrize("how", ["kill", "crash"])
def test_a_dead_reader_s_client_sees_its_connection_go_and_the_others_carry_on(broker, how):
    """Killed, or raising in its host as a bug would (``ctl crash``): either way its socket closes, as a
    dead process's does, so the client hears at once. (A crashed reader's socket once stayed open: the
    broker had closed the connection, and its client waited on it forever.)"""
    bystander, bch, victim = bystander_and_victim(broker)
    broker.kill("reader-2", how)
    began = time.monotonic()
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        for _ in range(100):
            victim.process_data_events(0.05)
    assert time.monotonic() - began < 4
    bch.basic_publish("", "b", b"fine")
    assert bch.basic_get("b", auto_ack=True)[2] == b"fine"
    death = broker.wait_for(lambda s: [d for d in s["deaths"] if d["name"] == "reader-2"],
                            what="the reader's death")["deaths"][0]
    assert (death["how"], death["action"]) == ({"kill": "killed", "crash": "exit code 70"}[how], "close_connection")
    if how == "crash":
        assert "StageCrash: ctl crash reader-2" in broker.output()
    bystander.close()


def test_ctl_crash_refuses_a_stage_nothing_would_catch_and_one_that_is_not_there(broker):
    for name, error in (("store", "store runs in a process of its own: kill ends it"), ("nosuch", "no stage 'nosuch'")):
        done = subprocess.run(creditflow_cmd("ctl", "--data-dir", str(broker.data_dir), "crash", name),
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and json.loads(done.stdout) == {"ok": False, "error": error}
    assert broker.status()["processes"]["store"]["alive"]


@pytest.mark.parametrize("how", ["kill", "crash"])
def test_a_killed_channel_closes_its_connection_with_541_and_the_others_carry_on(broker, how):
    bystander, bch, victim = bystander_and_victim(broker)
    broker.kill("channel-2.1", how)
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        for _ in range(100):
            victim.process_data_events(0.05)
    assert closed.value.reply_code == 541
    assert closed.value.reply_text.startswith("INTERNAL_ERROR")
    bch.basic_publish("", "b", b"fine")
    assert bch.basic_get("b", auto_ack=True)[2] == b"fine"
    assert [d["action"] for d in deaths(broker)] == ["internal_error"]
    bystander.close()


@pytest.mark.parametrize("how", ["kill", "crash"])
def test_a_killed_durable_queue_restarts_with_its_messages_and_cancels_its_consumers(broker, how):
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("dq", durable=True)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", "dq", f"m{i}".encode(), properties=pika.BasicProperties(delivery_mode=2))
    watcher = connect(broker)
    wch = watcher.channel()
    cancelled = []
    wch.basic_qos(prefetch_count=1)
    wch.basic_consume("dq", lambda *a: None)
    wch.add_on_cancel_callback(lambda method: cancelled.append(method.method.consumer_tag))
    watcher.process_data_events(0.3)
    old = broker.kill("queue-dq", how)
    while not cancelled:
        watcher.process_data_events(0.1)       # pika announces consumer_cancel_notify: basic.cancel
    status = broker.wait_for(lambda s: s["processes"]["queue-dq"]["restarts"] > old["restarts"]
                             and s["processes"]["queue-dq"].get("recovered") == 50, what="the restarted queue")
    assert status["processes"]["queue-dq"]["alive"]
    ch.basic_publish("", "dq", b"after", properties=pika.BasicProperties(delivery_mode=2))   # same channel, same route
    bodies = []
    while True:
        m = ch.basic_get("dq", auto_ack=True)
        if m[0] is None:
            break
        bodies.append(m[2])
    assert bodies == [f"m{i}".encode() for i in range(50)] + [b"after"]
    death = [d for d in deaths(broker) if d["name"] == "queue-dq"][0]
    assert death["action"] == "restart" and death["restarted_pid"] is not None
    assert death["how"] == {"kill": "killed", "crash": "exit code 70"}[how]
    log = broker.output()
    assert "Restarting crashed queue 'dq' in vhost '/'." in log
    assert {"stage_died", "stage_restarted"} <= telemetry_events(broker)
    conn.close()
    watcher.close()


def test_publishes_a_crashed_queue_had_not_confirmed_are_nacked_never_acked(broker):
    s = raw_amqp_connection(broker.port)
    s.sendall(frame.marshal(commands.Channel.Open(), 1) + frame.marshal(commands.Confirm.Select(), 1)
              + frame.marshal(commands.Queue.Declare(queue="stuck", durable=True), 1))
    frames_until(s, lambda got: "Queue.DeclareOk" in names(got))
    queue = broker.process("queue-stuck")
    os.kill(queue["pid"], signal.SIGSTOP)
    props = commands.Basic.Properties(delivery_mode=2)
    for _ in range(5):
        s.sendall(frame.marshal(commands.Basic.Publish(exchange="", routing_key="stuck"), 1)
                  + frame.marshal(header.ContentHeader(0, 4, props), 1) + frame.marshal(amqp_body.ContentBody(b"body"), 1))
    time.sleep(0.5)
    os.kill(queue["pid"], signal.SIGKILL)
    def nacked(got) -> set[int]:
        tags: set[int] = set()
        for f in got:
            if f.name == "Basic.Nack":
                tags |= set(range(1, f.delivery_tag + 1)) if f.multiple else {f.delivery_tag}
        return tags

    got = frames_until(s, lambda got: nacked(got) >= {1, 2, 3, 4, 5})
    assert nacked(got) == {1, 2, 3, 4, 5}
    assert not [f for f in got if f.name == "Basic.Ack"]
    s.close()


def test_a_consumer_that_did_not_ask_for_cancel_notify_has_its_channel_closed_when_its_queue_dies(broker):
    s = raw_amqp_connection(broker.port)        # announces no capabilities
    s.sendall(frame.marshal(commands.Channel.Open(), 1) + frame.marshal(commands.Queue.Declare(queue="cq"), 1)
              + frame.marshal(commands.Basic.Consume(queue="cq", consumer_tag="c1"), 1))
    frames_until(s, lambda got: "Basic.ConsumeOk" in names(got))
    broker.kill("queue-cq")
    got = frames_until(s, lambda got: "Channel.Close" in names(got))
    close = [f for f in got if f.name == "Channel.Close"][0]
    assert close.reply_code == 404 and "crashed" in close.reply_text and "c1" in close.reply_text
    s.close()


def test_a_killed_store_restarts_and_no_confirmed_message_is_lost(broker):
    body = b"x" * 8192                           # over the embed limit: the store holds these
    confirmed: list[int] = []
    stop = threading.Event()
    errors = []

    def publish():
        try:
            c = connect(broker)
            ch = c.channel()
            ch.queue_declare("big", durable=True)
            ch.confirm_delivery()
            i = 0
            while not stop.is_set():
                try:
                    ch.basic_publish("", "big", str(i).encode() + b":" + body,
                                     properties=pika.BasicProperties(delivery_mode=2))
                    confirmed.append(i)
                except pika.exceptions.NackError:
                    pass
                i += 1
            c.close()
        except Exception as exc:   # noqa: BLE001 - reported by the test below
            errors.append(exc)

    t = threading.Thread(target=publish)
    t.start()
    deadline = time.monotonic() + 20
    while len(confirmed) < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    store = broker.process("store")
    os.kill(store["pid"], signal.SIGKILL)
    broker.wait_for(lambda s: s["processes"]["store"]["pid"] != store["pid"], what="the restarted store")
    at_kill = len(confirmed)
    while len(confirmed) < at_kill + 200 and time.monotonic() < deadline + 20:
        time.sleep(0.05)
    stop.set()
    t.join(30)
    assert not errors, errors
    assert len(confirmed) >= at_kill + 200, "publishing went on after the store came back"
    c = connect(broker)
    ch = c.channel()
    seen = set()
    while True:
        m = ch.basic_get("big", auto_ack=True)
        if m[0] is None:
            break
        assert m[2].endswith(body)
        seen.add(int(m[2].split(b":", 1)[0]))
    missing = set(confirmed) - seen
    assert not missing, f"{len(missing)} confirmed messages lost"
    assert [d["action"] for d in deaths(broker)] == ["restart"]
    c.close()


def test_a_killed_watchdog_restarts_and_re_evaluates_the_alarm(broker):
    from pipeline.ctlclient import CtlClient
    with CtlClient(str(broker.data_dir)) as ctl:
        assert ctl.request("set_watermark", value="0")["memory_alarm"] is True
        old = broker.process("watchdog")
        os.kill(old["pid"], signal.SIGKILL)
        broker.wait_for(lambda s: s["processes"]["watchdog"]["pid"] != old["pid"], what="the restarted watchdog")
        time.sleep(0.5)
        assert ctl.request("alarms")["alarms"]["memory"]["state"] == "set", "limit 0 still holds"
        assert ctl.request("set_watermark", value="0.9")["memory_alarm"] is False
        assert ctl.request("alarms")["alarms"]["memory"]["state"] == "clear"
        assert [d["name"] for d in ctl.request("status")["deaths"]] == ["watchdog"]
    shown = subprocess.run(creditflow_cmd("ctl", "--data-dir", str(broker.data_dir), "status"), capture_output=True,
                           text=True, timeout=30).stdout
    row = shown.split("deaths:")[1]
    assert "watchdog" in row and "signal 9" in row and "restarted as pid" in row


def test_a_thousand_pipelined_declares_are_answered_in_order_and_ctl_still_answers(broker):
    s = raw_amqp_connection(broker.port)
    s.sendall(frame.marshal(commands.Channel.Open(), 1))
    frames_until(s, lambda got: "Channel.OpenOk" in names(got))
    s.sendall(b"".join(frame.marshal(commands.Queue.Declare(queue=f"p{i % 10}"), 1) for i in range(1000)))
    got = frames_until(s, lambda got: names(got).count("Queue.DeclareOk") >= 1000, timeout_s=60)
    assert [f.queue for f in got if f.name == "Queue.DeclareOk"] == [f"p{i % 10}" for i in range(1000)]
    assert len(broker.status()["processes"]) > 0
    s.close()


def test_the_ctl_socket_refuses_bad_requests_and_a_client_that_never_reads_does_not_stall_the_broker(broker):
    path = json.loads((broker.data_dir / "broker.json").read_text())["ctl"]
    bad = socket.socket(socket.AF_UNIX)
    bad.connect(path)
    bad.settimeout(5)
    bad.sendall(b"[]\nnot json\n{\"nocmd\": 1}\n")
    answers = b""
    while answers.count(b"\n") < 3:
        answers += bad.recv(65536)
    replies = [json.loads(line) for line in answers.splitlines()]
    assert [r["ok"] for r in replies] == [False, False, False]
    assert "not an object" in replies[0]["error"]
    hog = socket.socket(socket.AF_UNIX)
    hog.connect(path)
    hog.setblocking(False)
    sent = 0
    try:
        while sent < 20_000:                      # asks for status over and over, never reads a reply
            hog.send(b'{"cmd":"status"}\n')
            sent += 1
    except BlockingIOError:
        pass
    conn = connect(broker)                        # the broker still serves clients and other ctl users
    conn.channel().queue_declare("alive")
    assert broker.status()["ok"] is True
    conn.close()
    hog.close()
    bad.close()


def test_a_close_right_behind_pipelined_methods_is_answered_after_them(broker):
    """RabbitMQ's reader lets its channels finish before it answers connection.close."""
    for _ in range(5):
        s = raw_amqp_connection(broker.port)
        s.sendall(frame.marshal(commands.Channel.Open(), 1))
        frames_until(s, lambda got: "Channel.OpenOk" in names(got))
        s.sendall(frame.marshal(commands.Queue.Declare(queue="behind"), 1)
                  + frame.marshal(commands.Basic.Qos(prefetch_count=5), 1)
                  + frame.marshal(commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0))
        got = names(frames_until(s, lambda got: "Connection.CloseOk" in names(got)))
        assert got == ["Queue.DeclareOk", "Basic.QosOk", "Connection.CloseOk"], got
        s.close()


def test_a_no_ack_consumer_that_stops_reading_holds_back_only_what_its_buffers_hold(broker):
    """Back-pressure from a client's socket reaches the queue: its reader stops taking deliveries once
    its own output buffer is full, so the backlog stays in the queue instead of moving into the reader."""
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("stalled")
    body = b"x" * 4000
    for _ in range(20_000):
        ch.basic_publish("", "stalled", body)
    conn.close()
    s = raw_amqp_connection(broker.port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    s.sendall(frame.marshal(commands.Channel.Open(), 1)
              + frame.marshal(commands.Basic.Consume(queue="stalled", no_ack=True), 1))
    time.sleep(3)                      # and never read again
    left = broker.process("queue-stalled")["messages"]
    assert left >= 16_000, f"only {left} of 20,000 still in the queue: the reader kept pulling"
    s.close()


def count_deliveries(sock: socket.socket, want: int, quiet_s: float = 5.0) -> int:
    """basic.deliver frames read until ``want`` have come or nothing has come for ``quiet_s``; the client
    sends nothing meanwhile (no acks, no heartbeats)."""
    buf, pos, got = bytearray(), 0, 0
    sock.settimeout(quiet_s)
    while got < want:
        try:
            data = sock.recv(1 << 20)
        except socket.timeout:
            break
        if not data:
            break
        buf += data
        while len(buf) - pos >= 7:
            ftype, size = buf[pos], int.from_bytes(buf[pos + 3:pos + 7], "big")
            if len(buf) - pos < size + 8:
                break
            if ftype == 1 and buf[pos + 7:pos + 11] == b"\x00\x3c\x00\x3c":
                got += 1
            pos += size + 8
        del buf[:pos]
        pos = 0
    return got


def test_a_no_ack_consumer_that_stops_reading_and_reads_again_gets_every_message_without_sending_a_byte(broker):
    """Once its socket takes its output again, the reader goes back to the deliveries waiting in its ring by
    itself: a no-ack consumer sends nothing that would wake it (here, no heartbeats either)."""
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("paused")
    for _ in range(1500):              # 96 MB: more than the sockets, the reader's output, its ring and the arena hold
        ch.basic_publish("", "paused", b"y" * 65536)
    conn.close()
    s = raw_amqp_connection(broker.port)
    s.sendall(frame.marshal(commands.Channel.Open(), 1)
              + frame.marshal(commands.Basic.Consume(queue="paused", no_ack=True), 1))
    time.sleep(1.5)                    # the reader's output fills and it stops taking deliveries
    got = count_deliveries(s, 1500)
    s.close()
    assert got == 1500, f"{got} of 1,500 delivered, then the consumer heard nothing more"


def test_a_reader_whose_socket_is_backed_up_waits_without_spinning_while_confirms_come_in(broker):
    """A connection that consumes and publishes with confirms, and stops reading its socket: the confirms
    wait behind the deliveries the socket cannot take, and the reader sleeps until it can."""
    import psutil
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("held")
    for _ in range(600):                   # 40 MB: more than the sockets, the reader's output and its ring hold
        ch.basic_publish("", "held", b"z" * 65536)
    conn.close()
    s = raw_amqp_connection(broker.port)
    s.sendall(frame.marshal(commands.Channel.Open(), 1) + frame.marshal(commands.Confirm.Select(), 1)
              + frame.marshal(commands.Basic.Consume(queue="held", no_ack=True), 1))
    time.sleep(1.5)                        # never read: the reader's output fills
    # unroutable and mandatory: the channel answers each with basic.return and a confirm, on its ring
    publish = (frame.marshal(commands.Basic.Publish(exchange="", routing_key="nowhere", mandatory=True), 1)
               + frame.marshal(header.ContentHeader(body_size=2), 1) + frame.marshal(amqp_body.ContentBody(b"hi"), 1))
    s.sendall(publish * 20)
    def publishing_reader(st):
        return [p for n, p in st["processes"].items()
                if n.startswith("reader-") and p.get("alive") and p["publishes"] == 20]
    reader = publishing_reader(broker.wait_for(publishing_reader, what="the publishes read"))
    time.sleep(0.5)                        # the channel's answers reach the reader
    host = psutil.Process(reader[0]["pid"])
    before = host.cpu_times()
    time.sleep(2)
    after = host.cpu_times()
    busy = (after.user + after.system) - (before.user + before.system)
    s.close()
    assert busy < 0.5, f"the reader's process used {busy:.2f} s of CPU in 2 s while its client read nothing"


def test_connections_share_reader_and_channel_processes_and_a_killed_host_takes_only_its_own(start_broker):
    broker = start_broker("--pool", "2")
    conns = [connect(broker) for _ in range(6)]
    chans = [c.channel() for c in conns]
    chans[0].queue_declare("shared")
    status = broker.wait_for(lambda s: sum(1 for n, p in s["processes"].items()
                                           if n.startswith("channel-") and p["alive"]) == 6, what="six channels")
    hosts = status["hosts"]
    assert sorted(h["kind"] for h in hosts.values()) == ["channel", "channel", "queue", "reader", "reader"]
    assert sorted(h["stages"] for n, h in hosts.items() if h["kind"] == "reader") == [3, 3]
    readers = {n: p for n, p in status["processes"].items() if n.startswith("reader-")}
    assert len({p["pid"] for p in readers.values()}) == 2, "six connections, two reader processes"
    victim_host = readers["reader-1"]["host"]
    victim_pid = hosts[victim_host]["pid"]
    gone = sorted(n for n, p in readers.items() if p["host"] == victim_host)
    os.kill(victim_pid, signal.SIGKILL)
    status = broker.wait_for(lambda s: {d["name"] for d in s["deaths"]} >= set(gone), what="its readers' deaths")
    assert all(d["how"] == "signal 9" and d["action"] == "close_connection"
               for d in status["deaths"] if d["name"] in gone)
    survivors = [(c, ch) for c, ch, n in zip(conns, chans, sorted(readers, key=lambda n: int(n.split("-")[1])))
                 if n not in gone]
    assert len(survivors) == 3
    for c, ch in survivors:                      # confirmed: the queue has each before the gets below
        ch.confirm_delivery()                    # (unconfirmed, a loaded suite run got there first, once)
        ch.basic_publish("", "shared", b"on")
    late = connect(broker)                       # a new host is started for new connections
    lch = late.channel()
    got = [lch.basic_get("shared", auto_ack=True)[2] for _ in range(3)]
    assert got == [b"on"] * 3
    assert broker.proc.poll() is None
    assert "reader-pool-1 (pid" in broker.output() or "reader-pool-2 (pid" in broker.output()
    for c, _ in survivors:
        c.close()
    late.close()


@pytest.mark.processes
def test_a_queue_whose_host_was_killed_restarts_in_a_new_host_with_its_messages(start_broker):
    """With one queue host, killing it must not restart its queue into the dead process."""
    broker = start_broker("--pool", "1")
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("hq", durable=True)
    for i in range(5):
        ch.basic_publish("", "hq", f"m{i}".encode(), properties=pika.BasicProperties(delivery_mode=2))
    status = broker.wait_for(lambda s: "queue-hq" in s["processes"], what="the queue")
    old_host = status["processes"]["queue-hq"]["host"]
    os.kill(status["hosts"][old_host]["pid"], signal.SIGKILL)
    status = broker.wait_for(lambda s: s["processes"]["queue-hq"]["restarts"] >= 1
                             and s["processes"]["queue-hq"]["alive"]
                             and s["processes"]["queue-hq"].get("recovered") == 5, what="the restarted queue")
    new_host = status["processes"]["queue-hq"]["host"]
    assert status["hosts"][new_host]["pid"] != status["hosts"].get(old_host, {}).get("pid")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", "hq", b"after", properties=pika.BasicProperties(delivery_mode=2))
    got = []
    while len(got) < 6:
        m = ch.basic_get("hq", auto_ack=True)
        assert m[0] is not None, f"only {got}"
        got.append(m[2])
    assert got == [f"m{i}".encode() for i in range(5)] + [b"after"]
    assert broker.proc.poll() is None
    conn.close()


def test_a_publish_from_a_channel_that_ended_before_its_queue_attached_the_ring_is_not_lost(start_broker):
    """A channel links to a queue, publishes and closes while the queue's host has not yet read the
    supervisor's attach (stopped here; a loaded machine's turn does the same). The channel's end
    unlinks the ring's name; the queue still maps the ring it was handed and takes the message."""
    broker = start_broker("--pool", "1")
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("late")
    status = broker.wait_for(lambda s: s["processes"].get("queue-late", {}).get("alive"), what="the queue")
    host_pid = status["hosts"][status["processes"]["queue-late"]["host"]]["pid"]
    os.kill(host_pid, signal.SIGSTOP)
    try:
        other = conn.channel()                 # a new channel process: it has no link to the queue yet
        other.basic_publish("", "late", b"published, then the channel closed")
        other.close()
        broker.wait_for(lambda s: not any(n.startswith("channel-") and n.endswith(f".{other.channel_number}")
                                          and p["alive"] for n, p in s["processes"].items()),
                        what="the publishing channel's end")
    finally:
        os.kill(host_pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while (held := ch.queue_declare("late", passive=True).method.message_count) < 1 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held == 1
    assert ch.basic_get("late", auto_ack=True)[2] == b"published, then the channel closed"
    assert broker.status()["processes"]["queue-late"]["restarts"] == 0
    conn.close()


@pytest.mark.processes
def test_a_data_directory_too_deep_for_a_unix_socket_address_still_serves_ctl(start_broker):
    """sun_path holds 108 bytes; the control socket under a deeper data directory is reached anyway."""
    broker = start_broker(name="d" * 110)
    assert len(str(broker.data_dir / "ctl.sock")) > 108
    # the store shows once it has reported its statistics: on a loaded machine, after the first status
    broker.wait_for(lambda s: s["processes"].get("store", {}).get("state") == "running", what="the store")
