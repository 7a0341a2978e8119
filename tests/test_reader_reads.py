"""How much a reader takes off its socket, with a real broker and a client streaming big messages.

A turn reads while each read fills its buffer (several buffers, so the channel gets big messages in
batches), but parses each read before the next: a connection blocked by credit holds one buffer of
unparsed input at most, not a turn's worth.
"""

from __future__ import annotations

import socket
import threading

import pytest
from pamqp import commands, frame
from pamqp.header import ContentHeader
from pamqp.body import ContentBody

from conftest import raw_amqp_connection
from pipeline.broker.reader import RECV_BYTES, RECVS_PER_TURN

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

FRAME_MAX = 131072


def test_a_blocked_publisher_leaves_at_most_one_read_unparsed(start_broker):
    assert RECVS_PER_TURN > 1, "a turn reads several buffers"
    broker = start_broker("--queue-delay-us", "3000")     # a slow queue: the channel, then the reader, wait on credit
    sock = raw_amqp_connection(broker.port)
    sock.sendall(frame.marshal(commands.Channel.Open(), 1) + frame.marshal(commands.Queue.Declare(queue="big"), 1))
    body = b"b" * 65536
    one = (frame.marshal(commands.Basic.Publish(exchange="", routing_key="big"), 1)
           + frame.marshal(ContentHeader(0, len(body), commands.Basic.Properties()), 1)
           + frame.marshal(ContentBody(body), 1))
    batch = one * 64                                       # 4 MiB a write, far more than credit lets in
    stop = threading.Event()

    def publish():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                sock.sendall(batch)
            except (TimeoutError, socket.timeout):
                continue                                   # the broker stopped reading: blocked, as wanted
            except OSError:
                return
    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        def reader(status):
            return next(p for n, p in status["processes"].items() if n.startswith("reader-") and p.get("alive"))
        broker.wait_for(lambda s: reader(s)["state"] == "flow" and reader(s)["publishes"] > 100, timeout_s=30,
                        what="the publishing reader in flow")
        seen = []
        for _ in range(40):
            st = reader(broker.status())
            seen.append(st["unparsed_bytes"])
        assert max(seen) > 0, "a blocked reader keeps what it read and could not parse yet"
        # a read's worth, plus the end of a frame the read before it left incomplete
        assert max(seen) <= RECV_BYTES + FRAME_MAX, seen
    finally:
        stop.set()
        thread.join(5)
        sock.close()
