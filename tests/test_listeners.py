"""Listeners: IPv4 and IPv6 side by side, AMQP over TLS, and options checked before anything starts."""

from __future__ import annotations

import socket
import ssl
import subprocess

import pika
import pytest
import trustme

from conftest import creditflow_cmd

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]


@pytest.fixture
def ca():
    return trustme.CA()


def test_the_loopback_broker_answers_on_ipv6_too(broker):
    if not socket.has_ipv6:
        pytest.fail("this machine has no IPv6; the listener cannot be checked")
    with pika.BlockingConnection(pika.ConnectionParameters("::1", broker.port)) as conn:
        ch = conn.channel()
        ch.queue_declare("v6")
        ch.basic_publish("", "v6", b"over ipv6")
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        assert conn.channel().basic_get("v6", auto_ack=True)[2] == b"over ipv6"
    assert f"started TCP listener on [::1]:{broker.port}" in broker.output()


def test_amqp_over_tls_carries_messages_both_ways(start_broker, tmp_path, ca):
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        tls_port = s.getsockname()[1]
    broker = start_broker("--tls-port", str(tls_port), "--cert", str(tmp_path / "server.pem"),
                          "--key", str(tmp_path / "server.pem"))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    params = pika.ConnectionParameters("localhost", tls_port, ssl_options=pika.SSLOptions(context, "localhost"))
    with pika.BlockingConnection(params) as conn:
        ch = conn.channel()
        ch.queue_declare("tls")
        ch.confirm_delivery()
        for i in range(300):
            ch.basic_publish("", "tls", str(i).encode() * 2000)
        bodies = []
        for method, _props, body in ch.consume("tls", auto_ack=True, inactivity_timeout=2):
            if method is None:
                break
            bodies.append(body)
    assert bodies == [str(i).encode() * 2000 for i in range(300)]
    # a client that does not speak TLS on that port is dropped; the broker goes on
    with socket.create_connection(("127.0.0.1", tls_port)) as raw:
        raw.sendall(b"AMQP\x00\x00\x09\x01")
        raw.settimeout(5)
        try:
            answer = raw.recv(100)
        except ConnectionResetError:
            answer = b""
        assert answer == b"", "no AMQP spoken to a client that skipped the TLS handshake"
    with pika.BlockingConnection(params) as conn:
        conn.channel().queue_declare("tls", passive=True)
    assert broker.proc.poll() is None


@pytest.mark.parametrize("args, reason", [
    (["--tls-port", "0"], "--tls-port needs --cert and --key"),
    (["--tls-port", "0", "--cert", "/nonexistent.pem", "--key", "/nonexistent.pem"], "cannot use --cert"),
    (["--cert", "x.pem"], "--cert and --key go with --tls-port"),
])
def test_bad_tls_options_exit_2_with_one_line(tmp_path, args, reason):
    proc = subprocess.run(creditflow_cmd("serve", "--port", "0", "--data-dir", str(tmp_path / "d"), *args),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert reason in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists(), "nothing started"
