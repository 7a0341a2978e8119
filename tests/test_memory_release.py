"""As consumers drain a backlog, the broker's measured memory (default ``rss`` strategy) falls with it.

Bodies of 100 B live in CPython's small-object arenas, 4 KiB and 64 KiB ones
in glibc's heap; in each case the memory must go back to the operating
system while the backlog drains, not only once it is empty: half-way down,
memory must already be clearly below its peak, or an alarm raised by a
backlog would hold (and then flap) long after the consumers had done their
part. Once the backlog is gone, most of what it cost must be back.
"""

from __future__ import annotations

import select
import time

import psutil
import pytest

from pipeline.amqp import frames
from ipc.errors import WouldBlock
from pipeline.loadgen.client import AmqpClient

# alone: when the stages trim memory back depends on their idle turns, which a second test's load delays
pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(180)]
MIB = 1024 * 1024
QUEUE = "backlog"
CHECK_EVERY_BYTES = 1 * MIB      # while draining, look at what the queue holds after about this much was read
READ_BYTES_PER_S = 40 * MIB      # a consumer paced so that it stops close to where it means to
IN_FLIGHT_BYTES = 2 * MIB        # the consumer's prefetch holds about this much (at most 200 messages)


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


def memory_once_still(broker, seconds: float = 2.5, limit_s: float = 10.0) -> int:
    """Memory once it has stopped falling (two readings 0.5 s apart within 1 MiB), at most ``limit_s``
    after ``seconds``: on a loaded machine the stages' idle trims can come a few seconds late."""
    time.sleep(seconds)
    deadline = time.monotonic() + limit_s
    last = memory_used(broker)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = memory_used(broker)
        if last - now < MIB:
            return min(last, now)
        last = now
    return last


def pss_by_process(broker) -> str:
    """Each broker process's proportional set size in MiB, for a failure message."""
    root = psutil.Process(broker.proc.pid)
    parts = []
    for proc in [root] + root.children(recursive=True):
        try:
            parts.append(f"{proc.pid}:{proc.memory_full_info().pss / MIB:.1f}")
        except psutil.Error:
            pass
    return " ".join(parts)


def held_by_queue(broker) -> int:
    """Messages the queue holds: its backlog and its deliveries not yet acknowledged."""
    q = broker.status()["processes"][f"queue-{QUEUE}"]
    return q["messages"] + q["unacked"]


class AckingConsumer:
    """Reads deliveries at most ``READ_BYTES_PER_S`` and acknowledges each read's worth with one multiple
    ack, with a prefetch of about ``IN_FLIGHT_BYTES``: when it stops reading, the queue stops delivering."""

    def __init__(self, client: AmqpClient, size: int):
        self.client = client
        self.delivered = 0          # delivery tags run 1, 2, ... on the channel
        self.acked = 0
        self.read = 0
        self.started = time.monotonic()
        client.basic_qos(max(10, min(200, IN_FLIGHT_BYTES // size)))
        client.basic_consume(QUEUE, no_ack=False)
        client.set_nonblocking()

    def step(self) -> None:
        ahead = self.read / READ_BYTES_PER_S - (time.monotonic() - self.started)
        if ahead > 0:
            time.sleep(ahead)
        if select.select([self.client], [], [], 0 if self.client.buffer else 0.5)[0]:
            try:
                self.read += self.client.receive_nowait()
            except WouldBlock:
                pass
        buf, pos = self.client.buffer, 0       # (the first deliveries may have come with basic.consume-ok)
        while (found := frames.next_frame(buf, pos)) is not None:
            ftype, _, ps, pe = found
            if ftype == 1 and frames.method_id(buf, ps) == frames.BASIC_DELIVER:
                self.delivered += 1
            pos = pe + 1
        self.client.discard(pos)
        if self.delivered > self.acked:
            self.acked = self.delivered
            self.client.send_all(frames.encode_basic_ack(1, self.acked, True))

    def drain(self, broker, down_to: int, timeout_s: float = 60) -> int:
        """Consume until the queue holds at most ``down_to`` messages; then stop, and return what it holds."""
        deadline = time.monotonic() + timeout_s
        read_at_check = self.read
        held = held_by_queue(broker)
        while held > down_to and time.monotonic() < deadline:
            before = self.read
            self.step()
            if self.read - read_at_check >= CHECK_EVERY_BYTES or self.read == before:
                read_at_check = self.read
                held = held_by_queue(broker)
        assert held <= down_to, f"the queue still holds {held} messages after {timeout_s} s of draining"
        time.sleep(0.3)             # the last acks arrive and the queue's statistics follow them
        return held_by_queue(broker)


# 100 B bodies sit in CPython's small-object arenas, which go back (munmap) only when wholly empty:
# measured 30-40 % of the backlog's cost returned half-way down and 60-75 % once drained. Larger bodies
# sit in glibc's heap, which the queue's malloc_trim returns as it drains: 45 % half-way (the rest is what
# the messages still held need, pages of the ring buffers touched once and for good, and what was freed
# since the last trim) and 85 %+ once drained.
# half_slack: what memory may hold half-way down beyond the share of the messages left, as a fraction of
# what the backlog cost; may_keep: what it may hold once the backlog is gone.
@pytest.mark.parametrize("size, count, half_slack, may_keep",
                         [(100, 300_000, 0.3, 0.5), (4000, 20_000, 0.25, 0.35), (65536, 1500, 0.3, 0.35)])
def test_memory_falls_as_the_backlog_drains(broker, size, count, half_slack, may_keep):
    pub = AmqpClient("127.0.0.1", broker.port, heartbeat_s=0)
    pub.queue_declare(QUEUE, durable=False)
    con = AmqpClient("127.0.0.1", broker.port, heartbeat_s=0)   # its processes exist before the baseline
    base = settled_memory(broker)
    base_pss = pss_by_process(broker)
    msg = frames.encode_publish(1, "", QUEUE, frames.properties_raw(), b"b" * size, pub.frame_max)
    batch = 500
    for i in range(0, count, batch):
        pub.send_all(msg * min(batch, count - i))
    broker.wait_for(lambda s: s["processes"].get(f"queue-{QUEUE}", {}).get("messages") == count, timeout_s=60,
                    what=f"{count} messages in the queue")
    full = settled_memory(broker)
    grown = full - base
    assert grown > 20 * MIB, f"the backlog should cost real memory, grew only {grown / MIB:.1f} MiB"

    consumer = AckingConsumer(con, size)
    left = consumer.drain(broker, count // 2)
    half = settled_memory(broker) - base
    allowed = grown * (left / count + half_slack)
    assert half < allowed, (f"{size} B bodies: memory grew {grown / MIB:.1f} MiB with {count} messages; with "
                            f"{left} left it still holds {half / MIB:.1f} MiB (allowed {allowed / MIB:.1f} MiB)")
    assert half < grown * 0.8, (f"{size} B bodies: half-way down the backlog memory should be clearly below its "
                                f"peak ({grown / MIB:.1f} MiB), it holds {half / MIB:.1f} MiB")

    assert consumer.drain(broker, 0) == 0
    kept = memory_once_still(broker) - base
    assert kept < grown * may_keep, (f"{size} B bodies: memory grew {grown / MIB:.1f} MiB with the backlog and "
                                     f"{kept / MIB:.1f} MiB are still held after it drained (PSS by pid: "
                                     f"{pss_by_process(broker)}; at the baseline {base_pss})")
    print(f"{size} B x {count}: grew {grown / MIB:.1f} MiB; {left} left: {half / MIB:.1f} MiB; "
          f"drained: {kept / MIB:.1f} MiB")
    pub.close()
    con.abort()
