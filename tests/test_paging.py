"""Paging: past paging_ratio x the watermark, queues move message bodies to disk and read them back in order."""

from __future__ import annotations

import time

import pika
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def test_a_paging_queue_moves_bodies_to_disk_and_delivers_them_in_order(start_broker):
    # a tiny paging ratio: paging starts at the first memory reading
    broker = start_broker("--paging-ratio", "0.000001")
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    ch = conn.channel()
    ch.queue_declare("pg")
    for i in range(6000):
        ch.basic_publish("", "pg", b"%06d" % i + b"p" * 994)
    status = broker.wait_for(lambda s: s["processes"]["queue-pg"].get("paged_messages", 0) >= 5000,
                             timeout_s=40, what="most of the backlog paged out")
    q = status["processes"]["queue-pg"]
    assert q["paging"] is True and q["paged_out"] >= 5000
    pages = list((broker.data_dir / "paged").iterdir())
    assert pages and pages[0].stat().st_size >= 5000 * 1000
    got = []
    ch.basic_qos(prefetch_count=50)
    for method, _, body in ch.consume("pg", inactivity_timeout=5):
        if method is None:
            break
        got.append(body)
        ch.basic_ack(method.delivery_tag, multiple=False)
        if len(got) == 6000:
            break
    ch.cancel()
    assert [int(b[:6]) for b in got] == list(range(6000)), "read back in order"
    assert all(b[6:] == b"p" * 994 for b in got)
    status = broker.wait_for(lambda s: s["processes"]["queue-pg"]["paged_messages"] == 0, timeout_s=30,
                             what="nothing left paged")
    time.sleep(0.2)
    assert pages[0].stat().st_size == 0, "the page file is emptied once nothing is paged"
    conn.close()
