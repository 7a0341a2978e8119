"""The broker the real-client acceptance tests talk to: ``creditflow serve``, or RabbitMQ itself.

By default the client tests of one module share a ``creditflow serve`` started for
them (a fresh one after a test that failed, and one of its own, with a TLS listener,
for the AMQPS test). ``CREDITFLOW_TEST_RABBITMQ`` points the same tests at RabbitMQ
instead, so that every assertion in them is proven against the broker creditflow
imitates:

* ``CREDITFLOW_TEST_RABBITMQ=start`` starts a private RabbitMQ node for the test
  session (Debian's ``rabbitmq-server``, under ``/usr/lib/rabbitmq``) on free
  loopback ports, listening on 127.0.0.1 and ::1 and with a TLS listener whose
  certificate a ``trustme`` CA signed, and stops it when the session ends;
* ``CREDITFLOW_TEST_RABBITMQ=HOST:PORT`` uses a node that is already running
  (guest/guest, vhost ``/``); the IPv6 and TLS tests then skip unless
  ``CREDITFLOW_TEST_RABBITMQ_IPV6=1`` and ``CREDITFLOW_TEST_RABBITMQ_TLS=PORT:CA_FILE``
  say where those listeners are.

A broker outlives a test, so every test names its queues and exchanges with
``target.name(...)``, which is unique to the test; on RabbitMQ they are deleted when
the test ends.

    CREDITFLOW_TEST_RABBITMQ=start .venv/bin/python -m pytest tests/test_client_*.py
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RABBITMQ_SBIN = Path("/usr/lib/rabbitmq/bin")
ENV_TARGET = "CREDITFLOW_TEST_RABBITMQ"


def _scripts_module(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_beside = _scripts_module("_beside_rabbitmq")
free_ports = _beside.free_ports      # n different ports, picked together


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


@dataclass
class Target:
    """Where a test's clients connect, and what that broker has to offer."""

    kind: str                        # "creditflow" or "rabbitmq"
    port: int
    host: str = "127.0.0.1"
    ipv6: bool = True                # listens on [::1]:port too
    tls_port: int | None = None
    ca_file: str | None = None
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    names: list[str] = field(default_factory=list)

    def name(self, base: str) -> str:
        """A queue or exchange name no other test uses."""
        full = f"{base}-{self.tag}"
        self.names.append(full)
        return full

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.host}:{self.port}/%2F"

    def pika_params(self, **kw):
        import pika
        return pika.ConnectionParameters(self.host, self.port, **kw)

    def cleanup(self) -> None:
        """Delete what the test declared on RabbitMQ (a creditflow broker goes with its module)."""
        if self.kind != "rabbitmq" or not self.names:
            return
        import pika
        try:
            with pika.BlockingConnection(self.pika_params()) as conn:
                for name in self.names:
                    for delete in ("queue_delete", "exchange_delete"):
                        ch = conn.channel()
                        try:
                            getattr(ch, delete)(name)
                            ch.close()
                        except pika.exceptions.AMQPError:
                            pass
        except pika.exceptions.AMQPError:
            pass


class RabbitMQNode:
    """A private RabbitMQ node on loopback: AMQP on 127.0.0.1 and ::1, AMQPS on 127.0.0.1."""

    def __init__(self):
        import trustme
        self.base = Path(tempfile.mkdtemp(prefix="creditflow-rabbitmq-"))
        self.port, self.tls_port, dist_port = free_ports(3)
        self.nodename = f"cftest{self.port}@localhost"
        ca = trustme.CA()
        cert = ca.issue_cert("localhost", "127.0.0.1")
        ca.cert_pem.write_to_path(str(self.base / "ca.pem"))
        cert.cert_chain_pems[0].write_to_path(str(self.base / "cert.pem"))
        cert.private_key_pem.write_to_path(str(self.base / "key.pem"))
        self.ca_file = str(self.base / "ca.pem")
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "rabbitmq.conf").write_text("\n".join([
            f"listeners.tcp.1 = 127.0.0.1:{self.port}",
            f"listeners.tcp.2 = ::1:{self.port}",
            f"listeners.ssl.1 = 127.0.0.1:{self.tls_port}",
            f"ssl_options.cacertfile = {self.base / 'ca.pem'}",
            f"ssl_options.certfile = {self.base / 'cert.pem'}",
            f"ssl_options.keyfile = {self.base / 'key.pem'}",
            "ssl_options.verify = verify_none",
            "ssl_options.fail_if_no_peer_cert = false",
            "",
        ]))
        self.env = _beside.private_epmd(dict(
            os.environ, HOME=str(self.base), RABBITMQ_NODENAME=self.nodename, RABBITMQ_DIST_PORT=str(dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base / "mnesia"), RABBITMQ_LOG_BASE=str(self.base / "log"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base / "enabled_plugins"),
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq")))
        self.proc = subprocess.Popen([str(RABBITMQ_SBIN / "rabbitmq-server")], env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"RabbitMQ exited with {self.proc.returncode}; logs in {self.base}/log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"AMQP\x00\x00\x09\x01")
                    if s.recv(8):
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("RabbitMQ did not start within 120 s")

    def target(self) -> Target:
        return Target("rabbitmq", self.port, tls_port=self.tls_port, ca_file=self.ca_file)

    def stop(self) -> None:
        try:
            subprocess.run([str(RABBITMQ_SBIN / "rabbitmqctl"), "-n", self.nodename, "stop"], env=self.env,
                           capture_output=True, timeout=60, check=False)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _beside.stop_epmd(self.env)
        shutil.rmtree(self.base, ignore_errors=True)


def rabbitmq_target_from_env(value: str) -> Target:
    """The Target an already running node named by ``HOST:PORT`` (and the optional variables) gives."""
    host, _, port = value.rpartition(":")
    target = Target("rabbitmq", int(port), host=host.strip("[]") or "127.0.0.1",
                    ipv6=os.environ.get(f"{ENV_TARGET}_IPV6") == "1")
    tls = os.environ.get(f"{ENV_TARGET}_TLS")
    if tls:
        tls_port, _, ca_file = tls.partition(":")
        target.tls_port, target.ca_file = int(tls_port), ca_file
    return target


# -- fixtures (conftest.py imports them) -------------------------------------------------------------

@pytest.fixture(scope="session")
def rabbitmq_target():
    """The RabbitMQ that CREDITFLOW_TEST_RABBITMQ names (None: test creditflow)."""
    value = os.environ.get(ENV_TARGET, "").strip()
    if not value:
        yield None
    elif value == "start":
        node = RabbitMQNode()
        try:
            yield node.target()
        finally:
            node.stop()
    else:
        yield rabbitmq_target_from_env(value)


class SharedBroker:
    """One ``creditflow serve`` for a test module's client tests, replaced after a test that failed.

    The tests name everything with ``Target.name``, as on a shared RabbitMQ node, so they do not
    see each other's queues; a broker that died, or saw a test fail, is not handed to the next.
    """

    def __init__(self, base: Path):
        self.base = base
        self.broker = None
        self.started = 0

    def get(self):
        from conftest import Broker
        if self.broker is not None and self.broker.proc.poll() is not None:
            self.discard()
        if self.broker is None:
            self.started += 1
            self.broker = Broker(self.base / f"broker-{self.started}")
        return self.broker

    def discard(self) -> None:
        if self.broker is not None:
            self.broker.stop()
            self.broker = None


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory):
    shared = SharedBroker(tmp_path_factory.mktemp("clients"))
    yield shared
    shared.discard()


def _from_node(node: Target) -> Target:
    return Target("rabbitmq", node.port, host=node.host, ipv6=node.ipv6, tls_port=node.tls_port,
                  ca_file=node.ca_file)


@pytest.fixture
def amqp(request, rabbitmq_target, shared_broker):
    """The broker a client test talks to: ``creditflow serve`` (one per module), or the RabbitMQ named above."""
    failed_before = request.session.testsfailed
    target = _from_node(rabbitmq_target) if rabbitmq_target else Target("creditflow", shared_broker.get().port)
    yield target
    target.cleanup()
    if request.session.testsfailed != failed_before:
        shared_broker.discard()


@pytest.fixture
def amqp_tls(rabbitmq_target, start_broker, tmp_path):
    """A broker with a TLS listener too (``tls_port``, and ``ca_file`` to trust): a fresh
    ``creditflow serve --tls-port``, or the RabbitMQ named above."""
    if rabbitmq_target is not None:
        if rabbitmq_target.tls_port is None:
            pytest.skip(f"{ENV_TARGET}_TLS does not name the RabbitMQ node's TLS listener")
        target = _from_node(rabbitmq_target)
        yield target
        target.cleanup()
        return
    import trustme
    ca = trustme.CA()
    pem, ca_pem = tmp_path / "server.pem", tmp_path / "ca.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    tls_port = free_port()
    broker = start_broker("--tls-port", str(tls_port), "--cert", str(pem), "--key", str(pem))
    yield Target("creditflow", broker.port, tls_port=tls_port, ca_file=str(ca_pem))
