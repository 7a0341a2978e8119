"""The consumer bias in a running broker, with real processes, sockets and clients.

A consumer's reader that cannot keep up (its host stopped, as a process starved of CPU is) makes the
queue take publishes only as deliveries pay for them, so the publishers wait on credit and the backlog
stays put; a consumer whose client does not read its socket is the client's doing, and there the queue
takes every publish, as RabbitMQ's does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from pamqp import commands, frame

from conftest import ROOT, kill_group, raw_amqp_connection

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

QUEUE = "bias-q"

PUBLISHER = r"""
import sys, pika
conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", int(sys.argv[1])))
ch = conn.channel()
if sys.argv[2] == "confirm":
    ch.confirm_delivery()
body = b"x" * 1024
for _ in range(int(sys.argv[3])):
    ch.basic_publish("", sys.argv[4], body)
print("published", flush=True)
conn.close()
"""


def consume(port: int, no_ack: bool = True):
    """A consumer on ``QUEUE`` over a raw socket (declared first): nothing reads it unless the caller does."""
    sock = raw_amqp_connection(port)
    sock.sendall(frame.marshal(commands.Channel.Open(), 1)
                 + frame.marshal(commands.Queue.Declare(queue=QUEUE), 1)
                 + frame.marshal(commands.Basic.Consume(queue=QUEUE, no_ack=no_ack), 1))
    return sock


def drain(sock, stop: threading.Event) -> threading.Thread:
    """Read and drop whatever arrives on ``sock`` until ``stop``."""
    def run():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                if not sock.recv(1 << 20):
                    return
            except TimeoutError:
                continue
            except OSError:
                return
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def publisher(port: int, count: int, confirm: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PUBLISHER, str(port), "confirm" if confirm else "plain",
                             str(count), QUEUE], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def readers(broker) -> dict[str, dict]:
    return {n: p for n, p in broker.status()["processes"].items() if n.startswith("reader-") and p.get("alive")}


def queue_stats(broker) -> dict:
    return broker.status()["processes"][f"queue-{QUEUE}"]


def test_a_consumer_reader_that_falls_behind_holds_publishers_back_and_the_backlog_stays_put(start_broker):
    broker = start_broker("--pool", "2")
    sock = consume(broker.port)
    stop = threading.Event()
    drain(sock, stop)
    consumer = broker.wait_for(lambda s: s["processes"][f"queue-{QUEUE}"]["consumers"] == 1,
                               what="the consumer") and next(iter(readers(broker).values()))
    pub = publisher(broker.port, 10_000_000, confirm=False)
    stopped = False
    try:
        broker.wait_for(lambda s: s["processes"][f"queue-{QUEUE}"]["delivered"] > 20_000, timeout_s=30,
                        what="deliveries under way")
        hosts = {p["pid"] for p in readers(broker).values()}
        assert len(hosts) == 2, "the publisher's connection should be in the other reader host"
        os.kill(consumer["pid"], signal.SIGSTOP)     # the consumer's reader falls behind, its client does not
        stopped = True
        before = queue_stats(broker)
        depths = []
        for _ in range(20):
            time.sleep(0.1)
            depths.append(queue_stats(broker)["messages"])
        during = queue_stats(broker)
        taken = during["enqueued"] - before["enqueued"]
        os.kill(consumer["pid"], signal.SIGCONT)
        stopped = False
        # Taken meanwhile: what was ready when the ring filled, then nothing (no delivery pays for more).
        assert max(depths) < 5_000, depths
        assert taken < 5_000, taken
        assert during["consumer_bias"] and during["consumer_bias_engaged"] >= 1, during
        after = queue_stats(broker)
        broker.wait_for(lambda s: s["processes"][f"queue-{QUEUE}"]["enqueued"] > after["enqueued"] + 20_000,
                        timeout_s=30, what="publishes taken again once the consumer's reader catches up")
    finally:
        if stopped:
            os.kill(consumer["pid"], signal.SIGCONT)
        stop.set()
        kill_group(pub)
        sock.close()


def test_a_consumer_whose_client_reads_nothing_leaves_publishers_alone(start_broker):
    broker = start_broker()
    sock = consume(broker.port)                      # never read: its socket backs up
    pub = publisher(broker.port, 30_000, confirm=True)
    try:
        out, _ = pub.communicate(timeout=60)         # every publish confirmed: the queue took them all
        assert pub.returncode == 0 and "published" in out, out
        st = broker.wait_for(lambda s: s["processes"][f"queue-{QUEUE}"]["enqueued"] == 30_000,
                             what="the statistics to show every publish")["processes"][f"queue-{QUEUE}"]
        assert st["messages"] > 20_000, st          # waiting in the queue, not in the consumer's socket
        assert not st["consumer_bias"], st
    finally:
        kill_group(pub)
        sock.close()
