"""The harness: reports merged into seconds and a result, and real worker processes against a tiny broker.

``EchoBroker`` is a few threads in the test process speaking just enough
AMQP for the load generator: it acknowledges declares, hands every publish
to the queue's consumer as a delivery, confirms, and can block a publisher
with ``connection.blocked`` for a while. Worker processes are forked from
the test; every test checks that none is left behind.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from pamqp import commands

from pipeline.amqp import frames
from pipeline.loadgen import latency
from pipeline.loadgen.accounting import DRAIN_DELIVERED, DRAIN_EMPTY, DRAIN_TIME, DrainEnd, QueueDepth
from pipeline.loadgen.config import LoadConfig
from pipeline.loadgen.harness import LoadResult, ReportBook, WorkerFailed, run_load

S = 1_000_000_000


def hist_text(*values: int) -> str:
    rec = latency.LatencyRecorder()
    for v in values:
        rec.record_us(v)
    return latency.encode(rec.take())


def pub(worker, k, at_ns, sent, confirmed=0, nacked=0, returned=0, blocked=False, hist="", events=(), event="second",
        settled=0, connection=None, refusal=""):
    connection = connection or ("closed" if event == "final" else "open")
    return {"event": event, "worker": worker, "k": k, "at_ns": at_ns, "cpu_s": 0.5,
            "stats": {"sent": sent, "confirmed": confirmed, "nacked": nacked, "returned": returned,
                      "unconfirmed": 0, "settled_through": settled, "blocked": blocked, "blocked_count": 0,
                      "blocked_ns": 0, "connection": connection, "refusal": refusal},
            "hist": {"confirm": hist} if hist else {}, "blocked_events": [list(e) for e in events]}


def con(worker, k, at_ns, received, hist="", stale=0, gaps=0, event="second", highest=None):
    return {"event": event, "worker": worker, "k": k, "at_ns": at_ns, "cpu_s": 0.25,
            "stats": {"received": received, "stale": stale, "gaps": gaps, "duplicates": 0, "acked_tag": received,
                      "highest": {str(p): seq for p, seq in (highest or {}).items()}},
            "hist": {"consumer": hist}}


# -- merging -------------------------------------------------------------------------------------
def book(**cfg) -> ReportBook:
    return ReportBook(LoadConfig(**cfg), start_ns=10 * S, workers=["consumer-0", "publisher-0", "publisher-1"])


def test_a_second_sums_rates_and_merges_latencies_once_every_worker_reported():
    b = book(producers=2, confirm=100)
    b.add(pub("publisher-0", 0, 11 * S, sent=1000, confirmed=900, hist=hist_text(100, 200)))
    b.add(con("consumer-0", 0, 11 * S, received=1800, hist=hist_text(50, 60, 70)))
    assert not b.has_second(0)
    b.add(pub("publisher-1", 0, 11 * S + S // 2, sent=1500, confirmed=1500, hist=hist_text(300),
              events=[(10 * S + 5, "blocked", "low on memory")]))
    assert b.has_second(0)
    rep = b.second(0)
    assert rep.sent_rate == pytest.approx(1000 + 1000)         # publisher-1 took 1.5 s for its 1500
    assert rep.confirmed_rate == pytest.approx(900 + 1000)
    assert rep.received_rate == pytest.approx(1800)
    assert rep.consumer["count"] == 3 and rep.consumer["max"] == 70
    assert rep.confirm["count"] == 3 and rep.confirm["max"] == 300
    assert rep.blocked == {"publisher-0": False, "publisher-1": True}   # blocked at some point that second
    assert (rep.published, rep.delivered) == (2500, 1800)
    assert rep.time_s == pytest.approx(1 + 1 / 6)

    b.add(pub("publisher-0", 1, 12 * S, sent=3000, confirmed=2900, nacked=4))
    b.add(pub("publisher-1", 1, 12 * S + S // 2, sent=2500, confirmed=2500))
    b.add(con("consumer-0", 1, 12 * S, received=4000))
    rep = b.second(1)
    assert rep.sent_rate == pytest.approx(2000 + 1000) and rep.nacked == 4
    assert rep.consumer["count"] == 0 and rep.blocked == {"publisher-0": False, "publisher-1": False}


def test_without_confirms_there_is_no_confirm_latency():
    b = book(producers=2)
    b.add(pub("publisher-0", 0, 11 * S, sent=10))
    assert b.second(0).confirm is None


def test_the_result_counts_rates_over_the_window_and_nacks_and_returns_as_rejected():
    b = book(producers=2, confirm=10)
    b.add(pub("publisher-0", 9, 20 * S, sent=1000, confirmed=990, nacked=10, settled=1000))
    b.add(pub("publisher-1", 9, 20 * S, sent=2000, confirmed=2000, returned=5, settled=2000))
    b.add(con("consumer-0", 9, 20 * S, received=2000))
    b.mark_window()
    b.add(pub("publisher-0", 10, 21 * S, sent=1000, confirmed=990, nacked=10, settled=1000, event="final"))
    b.add(pub("publisher-1", 10, 21 * S, sent=2000, confirmed=2000, returned=5, settled=2000, event="final"))
    b.add(con("consumer-0", 12, 23 * S, received=2985, stale=7, hist=hist_text(1000), event="final",
              highest={0: 1000, 1: 2000}))
    r = b.result([], DrainEnd(DRAIN_DELIVERED, 1.5, {}))
    assert (r.published, r.confirmed, r.nacked, r.returned, r.delivered) == (3000, 2990, 10, 5, 2985)
    assert (r.lost, r.undelivered, r.rejected) == (0, 0, 15)
    assert r.rejections == {"nacked": 10, "returned unroutable": 5}
    assert r.drain.why == "delivered"
    assert r.stale == 7
    assert r.publish_rate == pytest.approx(300.0)               # over the 10 s window, not the drain
    assert r.deliver_rate == pytest.approx(200.0)
    assert r.window_s == pytest.approx(10.0)
    assert r.latency_us["consumer"]["count"] == 1 and "confirm" in r.latency_us
    assert latency.decode(r.histograms["consumer"]).get_total_count() == 1
    assert r.cpu_s == {"publisher-0": 0.5, "publisher-1": 0.5, "consumer-0": 0.25}
    assert r.errors == ()


def drained(the_book: ReportBook, why: str, **held) -> LoadResult:
    """The result of a drain that ended for ``why`` with queues holding ``held`` (name -> (ready, unacked))."""
    queues = {q: QueueDepth(*depth) for q, depth in held.items()}
    return the_book.result([], DrainEnd(why, 30.0, queues if held else None))


def one_queue(publishers=1) -> ReportBook:
    return ReportBook(LoadConfig(producers=publishers, queue="q"), 0,
                      ["consumer-0"] + [f"publisher-{i}" for i in range(publishers)])


def test_a_bottleneck_still_draining_when_time_runs_out_is_undelivered_not_lost():
    b = one_queue()
    b.add(pub("publisher-0", 5, 6 * S, sent=112_384, event="final", connection="open"))   # close never answered
    b.add(con("consumer-0", 40, 41 * S, received=98_624, event="final", highest={0: 98_624}))
    r = drained(b, DRAIN_TIME, q=(0, 0))
    assert (r.delivered, r.undelivered, r.lost, r.rejected) == (98_624, 112_384 - 98_624, 0, 0)
    assert r.drain.queues == {"q": QueueDepth(0, 0)}
    assert r.connections == {"publisher-0": "open"}


def test_copies_still_in_the_queue_when_time_runs_out_are_undelivered():
    b = one_queue()
    b.add(pub("publisher-0", 5, 6 * S, sent=1000, event="final"))                        # closed: all read
    b.add(con("consumer-0", 9, 10 * S, received=700, event="final", highest={0: 1000}))  # two consumers' worth
    r = drained(b, DRAIN_TIME, q=(250, 50))
    assert (r.undelivered, r.lost) == (300, 0)


def test_a_gap_behind_the_last_delivery_with_nothing_queued_is_lost_even_when_time_ran_out():
    b = one_queue()
    b.add(pub("publisher-0", 5, 6 * S, sent=1000, event="final", connection="open"))
    b.add(con("consumer-0", 9, 10 * S, received=990, gaps=10, event="final", highest={0: 995}))
    r = drained(b, DRAIN_TIME, q=(0, 0))
    assert (r.undelivered, r.lost) == (5, 5)       # 996..1000 may still be on their way; 10 behind 995 are gone


def test_with_the_broker_empty_and_every_connection_closed_what_is_missing_is_lost():
    b = one_queue(publishers=2)
    b.add(pub("publisher-0", 5, 6 * S, sent=1000, event="final"))
    b.add(pub("publisher-1", 5, 6 * S, sent=1000, event="final"))
    b.add(con("consumer-0", 9, 10 * S, received=1990, event="final", highest={0: 990, 1: 1000}))
    assert (b.expected_deliveries(), b.publishers_ended(), b.refused()) == (2000, True, False)
    r = drained(b, DRAIN_EMPTY, q=(0, 0))
    assert (r.undelivered, r.lost) == (0, 10)
    # a publisher that died without its final report proves nothing: its tail may be in a socket
    b = one_queue(publishers=2)
    b.add(pub("publisher-0", 5, 6 * S, sent=1000, event="final"))
    b.add(pub("publisher-1", 4, 5 * S, sent=1000))
    b.ended("publisher-1", "died without a final report (exit code -9)")
    b.add(con("consumer-0", 9, 10 * S, received=1990, event="final", highest={0: 1000, 1: 990}))
    r = drained(b, DRAIN_EMPTY, q=(0, 0))
    assert (r.undelivered, r.lost) == (10, 0)


def test_publishes_after_the_broker_closed_the_channel_are_rejected_with_its_reason():
    b = one_queue(publishers=2)
    reason = "406 PRECONDITION_FAILED - message size 2000000 is larger than configured max size 1048576 (channel closed)"
    b.add(pub("publisher-0", 0, 1 * S, sent=64, event="final", connection="refused", refusal=reason))
    b.add(pub("publisher-1", 5, 6 * S, sent=1000, event="final", connection="refused",
              refusal="320 CONNECTION_FORCED - broker shutting down (connection closed)"))
    b.add(con("consumer-0", 9, 10 * S, received=600, event="final", highest={1: 600}))
    assert b.refused() and b.expected_deliveries() == 600
    r = drained(b, DRAIN_EMPTY, q=(0, 0))
    assert (r.delivered, r.undelivered, r.lost, r.rejected) == (600, 0, 0, 64 + 400)
    assert r.rejections == {reason: 64, "320 CONNECTION_FORCED - broker shutting down (connection closed)": 400}


def test_a_refused_publisher_with_confirms_keeps_what_was_confirmed():
    b = ReportBook(LoadConfig(queue="q", confirm=100), 0, ["consumer-0", "publisher-0"])
    b.add(pub("publisher-0", 5, 6 * S, sent=1000, confirmed=800, settled=800, event="final", connection="refused",
              refusal="541 INTERNAL_ERROR (connection closed)"))
    b.add(con("consumer-0", 9, 10 * S, received=790, event="final", highest={0: 790}))
    r = drained(b, DRAIN_TIME, q=(0, 0))
    assert (r.rejected, r.undelivered, r.lost) == (200, 10, 0)   # 791..800 were confirmed: may still come
    r = drained(b, DRAIN_EMPTY, q=(0, 0))
    assert (r.rejected, r.undelivered, r.lost) == (200, 0, 10)   # confirmed, the broker empty: gone


def test_fan_out_expects_one_copy_per_consumed_queue():
    b = ReportBook(LoadConfig(consumers=2, queues=["a", "b", "c"]), 0, ["publisher-0", "consumer-0", "consumer-1"])
    b.add(pub("publisher-0", 0, S, sent=100, event="final"))
    b.add(con("consumer-0", 0, S, received=100, highest={0: 100}))
    b.add(con("consumer-1", 0, S, received=90, highest={0: 90}))
    assert b.expected_deliveries() == 200                       # queue c has no consumer
    r = drained(b, DRAIN_TIME, a=(0, 0), b=(0, 0), c=(100, 0))  # c's copies are no one's to deliver
    assert (r.undelivered, r.lost) == (10, 0)
    assert drained(b, DRAIN_EMPTY, a=(0, 0), b=(0, 0), c=(100, 0)).lost == 10


def test_without_consumers_nothing_is_expected():
    b = ReportBook(LoadConfig(consumers=0, queue="q"), 0, ["publisher-0"])
    b.add(pub("publisher-0", 0, S, sent=100, event="final"))
    r = drained(b, DRAIN_DELIVERED, q=(100, 0))
    assert (b.expected_deliveries(), r.undelivered, r.lost, r.rejected) == (0, 0, 0, 0)


def test_a_worker_that_dies_is_reported_and_no_longer_awaited():
    b = book(producers=2)
    b.add(pub("publisher-0", 0, 11 * S, sent=10))
    b.add(con("consumer-0", 0, 11 * S, received=10))
    b.ended("publisher-1", "died without a final report (exit code -9)")
    assert b.has_second(0)
    b.add({"event": "error", "worker": "consumer-0", "error": "broker closed the connection: 320 CONNECTION_FORCED"})
    assert b.result([]).errors == ("publisher-1: died without a final report (exit code -9)",
                                   "consumer-0: broker closed the connection: 320 CONNECTION_FORCED")


def test_a_clean_end_is_not_an_error():
    b = book(producers=2)
    b.add(pub("publisher-0", 0, 11 * S, sent=10, event="final"))
    b.ended("publisher-0", "pipe closed")
    assert b.result([]).errors == ()


def test_a_link_closed_before_the_last_status_keeps_its_figures_in_the_summary():
    from pipeline.runner import links_over_run
    seen: dict = {}
    links_over_run(seen, {"links": {"reader-2->channel-2.1": {"max_in_flight": 20, "sent": 900, "in_flight": 3},
                                    "channel-2.1->reader-2": {"max_in_flight": 4, "sent": 10}}})
    links_over_run(seen, {"links": {"reader-2->channel-2.1": {"max_in_flight": 18, "sent": 1200}}})
    links_over_run(seen, {"links": {"channel-2.1->reader-2": {"max_in_flight": 6, "sent": 30}}})   # the publisher hung up
    assert seen == {"reader-2->channel-2.1": {"max_in_flight": 20, "sent": 1200},
                    "channel-2.1->reader-2": {"max_in_flight": 6, "sent": 30}}


# -- real worker processes against a tiny broker -------------------------------------------------
class EchoBroker:
    """Just enough AMQP: declares, consume, confirms; every publish goes to its queue's consumer."""

    def __init__(self, block_after: int | None = None, block_s: float = 0.0):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.block_after = block_after
        self.block_s = block_s
        self.lock = threading.Lock()
        self.consumers: dict[str, tuple] = {}          # queue -> (socket, send lock, consumer tag, [next tag])
        self.backlog: dict[str, list[tuple]] = {}
        self.conns: list[socket.socket] = []
        self.errors: list[BaseException] = []
        self.closed = False
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(0.05)
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.conns.append(conn)
            t = threading.Thread(target=self._serve_safely, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve_safely(self, conn) -> None:
        try:
            self._serve(conn)
        except (OSError, EOFError):
            pass
        except BaseException as exc:
            self.errors.append(exc)

    def _serve(self, conn) -> None:
        buf = bytearray()

        def send(channel, method):
            conn.sendall(frames.encode_method(channel, method))

        while len(buf) < 8:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        assert bytes(buf[:8]) == frames.PROTOCOL_HEADER
        del buf[:8]
        send(0, commands.Connection.Start(mechanisms="PLAIN", locales="en_US"))
        confirming, published, pending, blocked_once = False, 0, None, False
        while True:
            found = frames.next_frame(buf, 0)
            if found is None:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                continue
            ftype, channel, ps, pe = found
            if ftype == 1:
                method = frames.decode_method(buf, ps, pe)
                name = method.name
                if name == "Connection.StartOk":
                    send(0, commands.Connection.Tune(channel_max=16, frame_max=131072, heartbeat=0))
                elif name == "Connection.Open":
                    send(0, commands.Connection.OpenOk())
                elif name == "Channel.Open":
                    send(channel, commands.Channel.OpenOk())
                elif name == "Queue.Declare":
                    send(channel, commands.Queue.DeclareOk(method.queue, 0, 0))
                elif name == "Basic.Qos":
                    send(channel, commands.Basic.QosOk())
                elif name == "Confirm.Select":
                    confirming = True
                    send(channel, commands.Confirm.SelectOk())
                elif name == "Basic.Consume":
                    send(channel, commands.Basic.ConsumeOk("ctag-" + method.queue))
                    with self.lock:
                        self.consumers[method.queue] = (conn, threading.Lock(), "ctag-" + method.queue, [1])
                        waiting = self.backlog.pop(method.queue, [])
                    for message in waiting:
                        self._deliver(*message)
                elif name == "Basic.Publish":
                    pending = [method.routing_key, None, b""]
                elif name == "Connection.Close":
                    send(0, commands.Connection.CloseOk())
                    return
            elif ftype == 2 and pending is not None:
                size, props = frames.decode_content_header(buf, ps, pe)
                pending[1] = props
                pending.append(size)
            elif ftype == 3 and pending is not None:
                pending[2] += bytes(buf[ps:pe])
                if len(pending[2]) == pending[3]:
                    self._deliver(pending[0], pending[1], pending[2])
                    published += 1
                    pending = None
                    if confirming:
                        conn.sendall(frames.encode_basic_ack(1, published, False))
                    if self.block_after and published == self.block_after and not blocked_once:
                        blocked_once = True
                        send(0, commands.Connection.Blocked("low on memory"))
                        time.sleep(self.block_s)                   # reads nothing: TCP back-pressure
                        send(0, commands.Connection.Unblocked())
            del buf[:pe + 1]

    def _deliver(self, queue, props, body) -> None:
        with self.lock:
            consumer = self.consumers.get(queue)
            if consumer is None:
                self.backlog.setdefault(queue, []).append((queue, props, body))
                return
        conn, send_lock, ctag, tag = consumer
        with send_lock:
            conn.sendall(frames.encode_deliver(1, ctag, tag[0], False, "", queue, props, body, 131072))
            tag[0] += 1

    def close(self) -> None:
        self.closed = True
        self.threads[0].join(5)
        self.listener.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        for t in self.threads:
            t.join(5)
        assert not self.errors, self.errors


_ELDERS: set = set()     # children the test process already had (the session's Spark JVM)


def our_children() -> list:
    """Live children started since the echo broker fixture began."""
    import psutil
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and (p.pid, p.create_time()) not in _ELDERS:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def echo_broker():
    import psutil
    _ELDERS.clear()
    for p in psutil.Process().children(recursive=True):
        try:
            _ELDERS.add((p.pid, p.create_time()))
        except psutil.NoSuchProcess:
            pass
    brokers = []

    def start(**kwargs) -> EchoBroker:
        brokers.append(EchoBroker(**kwargs))
        return brokers[-1]

    yield start
    for b in brokers:
        b.close()
    assert our_children() == []


@pytest.mark.processes
def test_a_rated_run_delivers_everything_and_reports_each_second(echo_broker):
    broker = echo_broker()
    cfg = LoadConfig(rate=500, size=100, confirm=50, duration_s=2, port=broker.port, queue="lg-test")
    seen = []
    result = run_load(cfg, on_second=seen.append)
    assert list(result.seconds) == seen and len(seen) == 2
    assert [round(rep.time_s) for rep in seen] == [1, 2]
    assert 450 <= seen[0].sent_rate <= 550 and 450 <= seen[1].received_rate <= 550
    assert result.published + result.skipped == 1000        # intended at start + i / 500 s, inside 2 s
    assert result.delivered == result.confirmed == result.published, result
    assert (result.lost, result.gaps, result.duplicates, result.stale, result.errors) == (0, 0, 0, 0, ())
    assert result.latency_us["consumer"]["count"] == result.delivered
    assert result.latency_us["confirm"]["count"] == result.confirmed
    assert 450 <= result.publish_rate <= 550
    assert set(result.cpu_s) == {"publisher-0", "consumer-0"}


@pytest.mark.processes
def test_a_blocked_publisher_shows_in_events_flags_and_latency(echo_broker):
    broker = echo_broker(block_after=100, block_s=1.2)
    cfg = LoadConfig(rate=500, size=100, duration_s=3, port=broker.port, queue="lg-test")
    result = run_load(cfg)
    (t_block, what1, reason), (t_unblock, what2, _) = result.blocked_events["publisher-0"]
    assert (what1, reason, what2) == ("blocked", "low on memory", "unblocked")
    assert 1.1 <= t_unblock - t_block <= 2.0
    assert any(rep.blocked["publisher-0"] for rep in result.seconds)
    # messages due while the broker read nothing count their wait: no coordinated omission
    assert result.latency_us["consumer"]["max"] >= 1_000_000
    assert result.lost == 0 and result.delivered == result.published


@pytest.mark.processes
def test_on_second_can_end_the_run_early(echo_broker):
    broker = echo_broker()
    cfg = LoadConfig(rate=200, duration_s=60, port=broker.port, queue="lg-test")
    started = time.monotonic()
    result = run_load(cfg, on_second=lambda rep: True)
    assert time.monotonic() - started < 15
    assert len(result.seconds) == 1 and result.lost == 0 and 150 <= result.published <= 260


@pytest.mark.processes
def test_a_worker_killed_mid_run_is_reported_and_the_run_finishes(echo_broker):
    import psutil
    broker = echo_broker()
    cfg = LoadConfig(rate=200, duration_s=2, port=broker.port, queue="lg-test")

    def kill_publisher(rep):
        if rep.time_s < 1.5:
            newest = max(our_children(), key=lambda p: (p.create_time(), p.pid))
            newest.kill()                                      # publishers start after consumers
            psutil.wait_procs([newest], timeout=5)

    result = run_load(cfg, on_second=kill_publisher)
    assert len(result.errors) == 1
    assert result.errors[0].startswith("publisher-0: died without a final report")
    assert result.delivered >= 150


@pytest.mark.processes
def test_a_broker_that_is_not_there_fails_the_start_with_the_reason():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(WorkerFailed, match=f"consumer-0: cannot start: cannot connect to 127.0.0.1:{port}"):
        run_load(LoadConfig(port=port, duration_s=1))
    assert our_children() == []


@pytest.mark.processes
def test_publishes_the_broker_refuses_as_over_size_are_rejected_with_its_reply(start_broker):
    """A real broker closes the channel with 406 at the first message over --max-message-bytes:
    every publish is rejected with that reason, none is lost, and the drain sees the queue empty."""
    from pipeline.runner import broker_view
    broker = start_broker("--max-message-bytes", "1000")
    cfg = LoadConfig(size=2000, duration_s=1, drain_s=20, port=broker.port, queue="big")
    result = run_load(cfg, broker=lambda: broker_view(broker.status()))
    assert result.published > 0 and result.delivered == 0
    assert (result.rejected, result.lost, result.undelivered) == (result.published, 0, 0)
    [(reason, count)] = result.rejections.items()
    assert count == result.published
    assert reason.startswith("406 PRECONDITION_FAILED") and "larger than configured max size 1000" in reason
    assert reason.endswith("(channel closed)")
    assert result.drain.why == "broker empty" and result.drain.seconds < 10
    assert result.drain.queues == {"big": QueueDepth(0, 0, 0, 0)}
    assert any("406" in e for e in result.errors)
