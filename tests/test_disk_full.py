"""A full disk under a running broker: nothing crashes, no confirm is sent for what is not on disk,
and everything is written, confirmed and delivered whole once space comes back.

The message store's directory is a real 4 MiB tmpfs that a filler file (another
process's data) nearly fills; messages of 64 KiB go through the store.
"""

from __future__ import annotations

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
        with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
            ch = conn.channel()
            got = []
            for method, _, payload in ch.consume("big", inactivity_timeout=5):
                if method is None:
                    break
                got.append(payload)
                ch.basic_ack(method.delivery_tag)
                if len(got) == COUNT:
                    break
            ch.cancel()
        assert got == [body(i) for i in range(COUNT)]
        print(f"\n  disk full: {withheld_at} of {COUNT} confirmed before it filled, none while it was full "
              f"(one publish waited for its confirm), all {COUNT} confirmed and delivered whole after "
              f"space came back; 0 nacked, 0 lost")
    finally:
        broker.stop()
