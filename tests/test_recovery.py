"""Crash recovery: every confirmed persistent message survives a SIGKILL of the whole broker."""

from __future__ import annotations

import os
import signal
import threading
import time

import pika
import pytest

from ipc import shm

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]


def body_for(i: int) -> bytes:
    size = 100 if i % 2 else 6000          # embedded in the queue's journal / kept in the shared store
    head = b"%08d:" % i
    return head + bytes((i + j) % 251 for j in range(size - len(head)))


def test_every_confirmed_message_survives_sigkill_of_the_broker(start_broker):
    broker = start_broker("--heartbeat", "0", name="data")
    confirmed: list[int] = []
    stop = threading.Event()
    errors: list[Exception] = []

    def publish():
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port, heartbeat=0))
            ch = conn.channel()
            ch.queue_declare("dur", durable=True)
            ch.exchange_declare("direct-dur", "direct", durable=True)
            ch.queue_bind("dur", "direct-dur", "k")
            ch.confirm_delivery()
            i = 0
            while not stop.is_set():
                ch.basic_publish("", "dur", body_for(i), pika.BasicProperties(delivery_mode=2))
                confirmed.append(i)          # basic_publish returned: the broker confirmed it
                i += 1
        except Exception as exc:             # the broker is killed under us: expected
            errors.append(exc)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while len(confirmed) < 300 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(broker.proc.pid, signal.SIGKILL)           # supervisor and every stage, no clean-up
    broker.proc.wait(10)
    stop.set()
    t.join(10)
    assert len(confirmed) >= 300, f"too few confirms before the kill: {len(confirmed)} ({errors})"
    run_id = broker.info["run_id"]
    (broker.data_dir / "broker.json").unlink()

    again = start_broker("--heartbeat", "0", name="data")
    assert not shm.leftover_names(run_id=run_id), "the restart cleaned the killed run's shared memory"
    status = again.process("queue-dur")
    assert status["recovered"] >= len(confirmed)
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", again.port))
    ch = conn.channel()
    got = []
    while True:
        method, _, body = ch.basic_get("dur", auto_ack=True)
        if method is None:
            break
        got.append(body)
    numbers = [int(b[:8]) for b in got]
    for n, b in zip(numbers, got):
        assert b == body_for(n), f"message {n} came back corrupt"
    assert numbers == sorted(numbers), "recovered in publish order"
    missing = set(confirmed) - set(numbers)
    assert not missing, f"{len(missing)} confirmed messages lost, e.g. {sorted(missing)[:5]}"
    ch.basic_publish("direct-dur", "k", b"binding survived")
    time.sleep(0.3)
    assert ch.basic_get("dur", auto_ack=True)[2] == b"binding survived"
    conn.close()
