"""Who may connect and for how long, and who may read what the broker writes.

RabbitMQ's rules, each against a real ``creditflow serve``: ``handshake_timeout``
drops a client that has not reached connection.open in time; users come from
``--user``; ``guest`` logs in only over loopback (``loopback_users``); a refused
login is answered only after a delay; the data directory and every file in it
are the broker owner's alone.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import pika
import pytest
from pika.adapters.utils.connection_workflow import AMQPConnectorException

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def closed_after(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the broker closed ``sock`` (EOF or reset), None if it stayed open ``limit_s``."""
    start = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - start < limit_s:
        try:
            data = sock.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
        if not data:
            return time.monotonic() - start
    return None


def test_a_client_that_does_not_reach_connection_open_in_time_is_dropped(start_broker):
    broker = start_broker("--handshake-timeout", "1")
    silent = socket.create_connection(("127.0.0.1", broker.port))
    header_only = socket.create_connection(("127.0.0.1", broker.port))
    header_only.sendall(b"AMQP\x00\x00\x09\x01")
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as good:
        for sock in (silent, header_only):
            waited = closed_after(sock, 10)
            assert waited is not None, "a silent socket was kept open past the handshake timeout"
            sock.close()
        broker.wait_for(lambda s: len([n for n, p in s["processes"].items()
                                       if n.startswith("reader") and p["alive"]]) == 1,
                        what="only the good connection's reader left")
        time.sleep(1.5)
        good.channel().queue_declare("still-here")        # an open connection is not timed


def test_users_from_the_command_line_log_in_and_a_wrong_password_is_refused_late(start_broker):
    broker = start_broker("--user", "alice:s3cret", "--user", "bob:")
    for user, password in (("alice", "s3cret"), ("bob", ""), ("guest", "guest")):
        with pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", broker.port, credentials=pika.PlainCredentials(user, password))) as conn:
            conn.channel().queue_declare(f"{user}-q")
    start = time.monotonic()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError,
                       match="ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN"):
        pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", broker.port, credentials=pika.PlainCredentials("alice", "guess"), socket_timeout=10))
    assert time.monotonic() - start >= 2.5, "a refused login is answered only after RabbitMQ's 3 s delay"
    assert "PLAIN login refused: user 'alice' - invalid credentials" in broker.output()


def non_loopback_address() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))          # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_guest_logs_in_only_over_loopback_as_in_rabbitmq(start_broker):
    """The rule itself is tested without a network in test_amqp_connection.py; this is it end to end."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address but loopback to connect from")
    broker = start_broker("--host", "0.0.0.0", "--no-ipv6", "--user", "admin:pw")
    with pytest.raises(pika.exceptions.ProbableAuthenticationError, match="ACCESS_REFUSED"):
        pika.BlockingConnection(pika.ConnectionParameters(address, broker.port, socket_timeout=10))
    assert "PLAIN login refused: user 'guest' can only connect via localhost" in broker.output()
    with pika.BlockingConnection(pika.ConnectionParameters(
            address, broker.port, credentials=pika.PlainCredentials("admin", "pw"))) as conn:
        conn.channel().queue_declare("remote-admin")
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        conn.channel().queue_declare("local-guest")
    relaxed = start_broker("--host", "0.0.0.0", "--no-ipv6", "--loopback-users", "none", name="relaxed")
    with pika.BlockingConnection(pika.ConnectionParameters(address, relaxed.port)) as conn:
        conn.channel().queue_declare("remote-guest")


def test_the_data_directory_and_its_files_are_the_owners_alone(start_broker):
    broker = start_broker()
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("secrets", durable=True)
        for i in range(20):
            ch.basic_publish("", "secrets", b"card 4111 1111 1111 %04d" % i,
                             pika.BasicProperties(delivery_mode=2))
    root = broker.data_dir
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    dirs = [os.path.join(d, s) for d, ss, _ in os.walk(root) for s in ss]
    assert any("definitions" in f for f in files) and len(files) >= 3
    assert {f: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files
            if stat.S_IMODE(os.stat(f).st_mode) & 0o077 and not stat.S_ISSOCK(os.stat(f).st_mode)} == {}
    assert [d for d in dirs if stat.S_IMODE(os.stat(d).st_mode) & 0o077] == []
    pid = broker.proc.pid
    modes = {}
    for n in os.listdir("/dev/shm"):
        if n.startswith((f"creditflow-{pid}x", f"sem.creditflow-{pid}x")):
            try:
                modes[n] = stat.S_IMODE(os.stat(f"/dev/shm/{n}").st_mode)
            except FileNotFoundError:       # the closed connection's rings go as this lists them
                pass
    assert modes and all(mode & 0o077 == 0 for mode in modes.values()), modes


def test_the_descriptor_alarm_sets_below_one_connections_room_and_clears_at_two_once_settled():
    from pipeline.broker.supervisor import FD_SHARE_FOR_CONNECTIONS, FDS_PER_CONNECTION, fd_alarm
    limit = 1000
    share = int(limit * FD_SHARE_FOR_CONNECTIONS)
    assert not fd_alarm(share - FDS_PER_CONNECTION, limit, was_set=False)
    assert fd_alarm(share - FDS_PER_CONNECTION + 1, limit, was_set=False)
    assert fd_alarm(share - 2 * FDS_PER_CONNECTION + 1, limit, was_set=True)     # room for one: still set
    assert not fd_alarm(share - 2 * FDS_PER_CONNECTION, limit, was_set=True)
    # a count taken while the newest connections may still be opening their channels clears nothing
    assert fd_alarm(0, limit, was_set=True, settled=False)
    assert not fd_alarm(0, limit, was_set=False, settled=False)


def test_out_of_descriptors_new_connections_wait_and_the_broker_goes_on(start_broker):
    """RabbitMQ's file_descriptor_limit alarm: past the share connections may take, the listener stops
    accepting (clients wait in the backlog); open connections carry on; closing some lets new ones in.
    What counts is the supervisor or the fullest host process, whichever holds more."""
    broker = start_broker(nofile=256)
    conns = []
    refused = 0
    for i in range(40):
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", broker.port, connection_attempts=1, socket_timeout=2, stack_timeout=2))
        except (pika.exceptions.AMQPConnectionError, AMQPConnectorException):      # no answer in 2 s
            refused += 1
            if refused == 2:
                break
            continue
        ch = conn.channel()
        ch.queue_declare(f"q{i % 4}")
        conns.append((conn, ch))
    assert refused == 2 and len(conns) >= 5, (len(conns), refused)
    status = broker.status()
    assert status["fd"]["alarm"] is True and status["fd"]["limit"] == 256
    assert "*** New connections will not be accepted until this alarm clears ***" in broker.output()
    for _, ch in conns:                                  # every open connection still works
        ch.basic_publish("", "q0", b"still going")
    for conn, _ in conns[:len(conns) // 2]:    # the queue all of them published to holds a link to each
        conn.close()
    broker.wait_for(lambda s: not s["fd"]["alarm"], what="the alarm to clear")
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        # unconfirmed publishes: one whose channel waited for a link to q0 while descriptors were short
        # may land after the alarm cleared; late, never lost (a channel that closed before q0's host had
        # attached its ring once lost its publish: test_supervision has that case on its own)
        ch = conn.channel()
        deadline = time.monotonic() + 10
        while (held := ch.queue_declare("q0", passive=True).method.message_count) < len(conns) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held == len(conns), [line for line in broker.output().splitlines() if "[error]" in line][-12:]
    # the links the publishes made fit in the queues' host: none of them crashed (and lost what it held)
    assert {name: p["restarts"] for name, p in broker.status()["processes"].items()
            if name.startswith("queue-")} == {f"queue-q{i}": 0 for i in range(4)}
    for conn, _ in conns[len(conns) // 2:]:
        conn.close()
    log = broker.output()
    assert log.count("file descriptor limit alarm set.") == 1 and log.count("alarm cleared") == 1, log


def test_connections_publishing_to_many_queues_fit_in_a_low_descriptor_limit(start_broker):
    """A host holds each peer's inbox pipe and doorbell once, however many of its stages link to that
    peer: six connections each publishing to the same six queues (one host for them all) need 36 pairs
    of rings, not 36 sets of endpoints besides. With its own copy of its peer's pipe and doorbell per
    link, the queues' host ran out at 256 and its queues crashed, losing what they held."""
    broker = start_broker("--pool", "1", nofile=256)
    names = [f"q{i}" for i in range(6)]
    conns = [pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) for _ in range(6)]
    for conn in conns:
        ch = conn.channel()
        for name in names:
            ch.queue_declare(name)
            ch.basic_publish("", name, b"one")
    check = conns[0].channel()
    assert [check.queue_declare(name, passive=True).method.message_count for name in names] == [6] * 6
    status = broker.status()
    assert {name: p["restarts"] for name, p in status["processes"].items() if name.startswith("queue-")} == \
        {f"queue-{name}": 0 for name in names}
    assert status["fd"]["alarm"] is False
    for conn in conns:
        conn.close()


def ctl(broker, *args: str):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "ctl", "--data-dir", str(broker.data_dir), *args],
                          capture_output=True, text=True, timeout=30)


def test_vhost_limits_refuse_connections_and_queues_with_rabbitmqs_replies(start_broker):
    """rabbitmqctl set_vhost_limits, checked against RabbitMQ 3.10.8: the same codes and texts."""
    broker = start_broker("--user", "alice:pw")
    assert ctl(broker, "set_vhost_limits", '{"max-connections": 2, "max-queues": 2}').returncode == 0
    params = pika.ConnectionParameters("127.0.0.1", broker.port)
    first = pika.BlockingConnection(params)
    second = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port,
                                                               credentials=pika.PlainCredentials("alice", "pw")))
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError,
                       match=r"530.*NOT_ALLOWED - access to vhost '/' refused for user 'guest': "
                             r"connection limit \(2\) is reached"):
        pika.BlockingConnection(params)
    ch = first.channel()
    ch.queue_declare("q0")
    ch.queue_declare("q1")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker,
                       match=r"406.*PRECONDITION_FAILED - cannot declare queue 'q2': queue limit in vhost '/' "
                             r"\(2\) is reached"):
        ch.queue_declare("q2")
    ch = first.channel()
    ch.queue_declare("q1")                          # one that exists may be declared again
    ch.queue_declare("q0", passive=True)
    ch.queue_delete("q1")
    ch.queue_declare("q2")                          # room again
    second.close()
    broker.wait_for(lambda st: sum(p["alive"] for n, p in st["processes"].items() if n.startswith("reader")) == 1,
                    what="the closed connection's reader gone")
    with pika.BlockingConnection(params) as third:  # and a connection's place is free again
        third.channel().queue_declare("q2", passive=True)
    assert json.loads(ctl(broker, "list_vhost_limits").stdout)["limits"] == {"max-connections": 2, "max-queues": 2}
    assert ctl(broker, "clear-vhost-limits").returncode == 0
    with pika.BlockingConnection(params) as more:
        more.channel().queue_declare("q3")
    first.close()


def test_vhost_limits_survive_a_restart_and_bad_limits_are_refused(start_broker):
    broker = start_broker()
    bad = ctl(broker, "set-vhost-limits", '{"max-bogus": 3}')
    assert bad.returncode == 2 and "Unrecognised terms ['max-bogus'] in limits" in bad.stdout
    assert ctl(broker, "set-vhost-limits", '{"max-connections": "ten"}').returncode == 2
    assert ctl(broker, "set-vhost-limits").returncode == 2
    assert ctl(broker, "set-vhost-limits", '{"max-connections": 0}').returncode == 0
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError, match=r"connection limit \(0\) is reached"):
        pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    broker.stop()
    again = start_broker(name="broker")             # the same data directory
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError, match=r"connection limit \(0\) is reached"):
        pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", again.port))
    assert ctl(again, "set-vhost-limits", '{"max-connections": -1}').returncode == 0
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", again.port)) as conn:
        conn.channel().queue_declare("fine")
