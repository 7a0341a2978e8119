"""After consumers drain a backlog, the broker's measured memory (default ``rss`` strategy) falls back.

Bodies of 100 B live in CPython's small-object arenas, 4 KiB and 64 KiB ones
in glibc's heap; in each case the memory must go back to the operating
system, or an alarm raised by a backlog would never clear.
"""

from __future__ import annotations

import select
import time

import pytest

from pipeline.amqp import frames
from ipc.errors import WouldBlock
from pipeline.loadgen.client import AmqpClient

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(120)]
MIB = 1024 * 1024


def memory_used(broker) -> int:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        wd = broker.status()["processes"].get("watchdog", {})
        if wd.get("memory_used"):
            return wd["memory_used"]
        time.sleep(0.1)
    raise AssertionError("the watchdog reported no memory reading")


def settled_memory(broker, seconds: float = 1.5) -> int:
    time.sleep(seconds)
    return memory_used(broker)


# 100 B bodies sit in CPython's small-object arenas, which go back only when wholly empty; measured
# 60-75 % returned. Larger bodies sit in glibc's heap, which malloc_trim returns (85 %+).
@pytest.mark.parametrize("size, count, may_keep", [(100, 300_000, 0.5), (4000, 20_000, 0.35), (65536, 1500, 0.35)])
def test_memory_falls_after_the_backlog_drains(broker, size, count, may_keep):
    pub = AmqpClient("127.0.0.1", broker.port, heartbeat_s=0)
    pub.queue_declare("backlog", durable=False)
    con = AmqpClient("127.0.0.1", broker.port, heartbeat_s=0)   # its processes exist before the baseline
    base = settled_memory(broker)
    msg = frames.encode_publish(1, "", "backlog", frames.properties_raw(), b"b" * size, pub.frame_max)
    batch = 500
    for i in range(0, count, batch):
        pub.send_all(msg * min(batch, count - i))
    broker.wait_for(lambda s: s["processes"].get("queue-backlog", {}).get("messages") == count, timeout_s=60,
                    what=f"{count} messages in the queue")
    full = settled_memory(broker)
    grown = full - base
    assert grown > 20 * MIB, f"the backlog should cost real memory, grew only {grown / MIB:.1f} MiB"

    con.basic_consume("backlog", no_ack=True)
    con.set_nonblocking()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not select.select([con], [], [], 1)[0]:
            if broker.status()["processes"]["queue-backlog"]["messages"] == 0:
                break
            continue
        try:
            con.receive_nowait()
        except WouldBlock:
            continue
        con.discard(len(con.buffer))
    assert broker.status()["processes"]["queue-backlog"]["messages"] == 0
    after = settled_memory(broker, 2.5)
    kept = after - base
    assert kept < grown * may_keep, (f"{size} B bodies: memory grew {grown / MIB:.1f} MiB with the backlog and "
                                 f"{kept / MIB:.1f} MiB are still held after it drained")
    pub.close()
    con.abort()
