"""A full disk under a running broker: nothing crashes, no confirm is sent for what is not on disk,
and everything is written, confirmed and delivered whole once space comes back.

The message store's directory (messages of 64 KiB go through the store), or the
queues' journals (small messages are embedded there), is a real tmpfs that a
filler file (another process's data) nearly fills.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pika
import pytest

from conftest import Broker, fill

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

BODY = 64 * 1024
COUNT = 40


def body(i: int) -> bytes:
    return (b"%06d" % i) * (BODY // 6) + b"x" * (BODY % 6)


def consume_all(broker, queue: str, count: int) -> list[bytes]:
    """Up to ``count`` bodies from ``queue``, acked, in the order delivered."""
    got: list[bytes] = []
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        ch = conn.channel()
        for method, _, payload in ch.consume(queue, inactivity_timeout=5):
            if method is None:
                break
            got.append(payload)
            ch.basic_ack(method.delivery_tag)
            if len(got) == count:
                break
        ch.cancel()
    return got


def test_a_full_disk_withholds_confirms_and_loses_nothing(tmp_path, small_tmpfs):
    data_dir = tmp_path / "broker"
    store_fs = small_tmpfs("4m", at=data_dir / "msg_store")
    filler = fill(store_fs, 512 * 1024)
    broker = Broker(data_dir)
    try:
        confirmed: list[int] = []
        errors: list[BaseException] = []

        def publish() -> None:
            try:
                with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
                    ch = conn.channel()
                    ch.confirm_delivery()
                    ch.queue_declare("big", durable=True)
                    for i in range(COUNT):
                        ch.basic_publish("", "big", body(i), pika.BasicProperties(delivery_mode=2))
                        confirmed.append(i)          # confirm_delivery: basic_publish returns on the ack
            except BaseException as exc:         # surfaced below
                errors.append(exc)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        status = broker.wait_for(lambda s: s["processes"]["store"].get("disk_full"), timeout_s=30,
                                 what="the store to find the disk full")
        time.sleep(1.5)
        withheld_at = len(confirmed)
        assert 0 < withheld_at < COUNT and publisher.is_alive(), "confirms go on only while the disk takes writes"
        status = broker.status()
        assert status["deaths"] == [] and status["processes"]["store"]["alive"]
        assert len(confirmed) == withheld_at, "a confirm was sent for a write the disk refused"
        with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as other:
            other.channel().queue_declare("big", durable=True, passive=True)      # the broker still answers
        assert "disk full" in broker.output()

        filler.unlink()                                  # the other process frees its space
        publisher.join(60)
        assert not errors and len(confirmed) == COUNT
        assert "disk space is back" in broker.output()
        assert broker.status()["deaths"] == []
        assert consume_all(broker, "big", COUNT) == [body(i) for i in range(COUNT)]
        print(f"\n  disk full: {withheld_at} of {COUNT} confirmed before it filled, none while it was full "
              f"(one publish waited for its confirm), all {COUNT} confirmed and delivered whole after "
              f"space came back; 0 nacked, 0 lost")
    finally:
        broker.stop()


def test_a_full_disk_under_the_queue_journals_withholds_confirms_and_loses_nothing(tmp_path, small_tmpfs):
    data_dir = tmp_path / "broker"
    journals = small_tmpfs("2m", at=data_dir / "queues")
    broker = Broker(data_dir)
    try:
        with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
            conn.channel().queue_declare("small", durable=True)
        filler = fill(journals, 64 * 1024)
        confirmed: list[int] = []
        errors: list[BaseException] = []
        count, size = 300, 1000

        def publish() -> None:
            try:
                with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
                    ch = conn.channel()
                    ch.confirm_delivery()
                    for i in range(count):
                        ch.basic_publish("", "small", b"%06d" % i * (size // 6),
                                         pika.BasicProperties(delivery_mode=2))
                        confirmed.append(i)
            except BaseException as exc:         # surfaced below
                errors.append(exc)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        broker.wait_for(lambda s: s["processes"]["queue-small"].get("journal_full"), timeout_s=30,
                        what="the queue to find its journal's disk full")
        time.sleep(1.5)
        withheld_at = len(confirmed)
        assert 0 < withheld_at < count and publisher.is_alive()
        time.sleep(1.0)
        assert len(confirmed) == withheld_at, "a confirm was sent for an entry the disk refused"
        status = broker.status()
        assert status["deaths"] == [] and status["processes"]["queue-small"]["alive"]

        filler.unlink()
        publisher.join(60)
        assert not errors and len(confirmed) == count
        assert "journal entries are on disk" in broker.output()
        broker.stop()                                   # a restart reads the journal back: all of it is there
        broker = Broker(data_dir)
        assert consume_all(broker, "small", count) == [b"%06d" % i * (size // 6) for i in range(count)]
        print(f"\n  journal disk full: {withheld_at} of {count} confirmed before it filled, none while it was "
              f"full, all {count} confirmed after space came back and read back whole after a restart; "
              f"0 nacked, 0 lost")
    finally:
        broker.stop()


def test_the_disk_alarm_blocks_publishers_before_the_disk_fills(tmp_path, small_tmpfs):
    """The whole data directory on a 128 MiB tmpfs, RabbitMQ's default 50 MB free-disk limit, a publisher
    writing 16 KB persistent messages as fast as it can: the disk alarm blocks it while space is left,
    and what was already inside the broker when it did still fits: no write meets a full disk. (What is
    inside is bounded by credit, counted in messages as RabbitMQ counts it: 400 per hop.)"""
    data_dir = tmp_path / "broker"
    small_tmpfs("128m", at=data_dir)
    broker = Broker(data_dir, ("--disk-free-limit", "50MB"))
    stop = threading.Event()

    def publish() -> None:
        try:
            with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port, heartbeat=0)) as conn:
                ch = conn.channel()
                ch.queue_declare("fill", durable=True)
                while not stop.is_set():
                    ch.basic_publish("", "fill", b"d" * 16_000, pika.BasicProperties(delivery_mode=2))
        except Exception:                        # the broker stops under a blocked publisher at the end
            pass

    threading.Thread(target=publish, daemon=True).start()
    try:
        broker.wait_for(lambda s: any(src.startswith("disk") and a.get("state") == "set"
                                      for src, a in s["alarms"].items()), timeout_s=60, what="the disk alarm")
        time.sleep(1.0)
        before = broker.process("queue-fill")["enqueued"]
        time.sleep(2.0)
        after = broker.process("queue-fill")["enqueued"]
        assert after <= before + 1, "publishers go on during the disk alarm"
        st = os.statvfs(data_dir)
        free_now = st.f_bavail * st.f_frsize
        found = re.search(r"Free disk space is insufficient\. Free bytes: (\d+)\. Limit: (\d+)", broker.output())
        assert found, broker.output()[-2000:]
        at_alarm, limit = int(found.group(1)), int(found.group(2))
        assert limit == 50_000_000 and 0 < free_now and at_alarm > 0
        assert "disk full" not in broker.output(), "a write met the full disk before the alarm blocked it"
        assert at_alarm >= limit - 5_000_000, "the alarm came late"
        print(f"\n  disk alarm: set with {at_alarm / 1e6:.1f} MB free (limit {limit / 1e6:.0f} MB); "
              f"{free_now / 1e6:.1f} MB free once publishing stopped; no write met a full disk")
    finally:
        stop.set()
        broker.stop()
