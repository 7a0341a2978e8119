"""scripts/raw_driver.py, the load driver written apart from the load generator, against a real broker."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
import time

import pytest

from conftest import ROOT, script_module

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def raw_driver():
    return script_module("raw_driver")


def test_it_publishes_and_counts_what_the_consumer_received_in_the_window(broker):
    driver = raw_driver()
    plain = driver.run(broker.port, size=100, seconds=1.5, queue="raw-plain")
    assert plain["deliver_rate"] > 100 and plain["publish_rate"] >= plain["deliver_rate"] * 0.9
    confirmed = driver.run(broker.port, size=4096, seconds=1.5, persistent=True, confirm=200, queue="raw-confirmed")
    assert confirmed["deliver_rate"] > 50
    # with credit flow the publisher never runs far ahead of the queue: what the broker holds outside the queue
    # stays within credit's windows (a starved consumer may leave a real backlog in the queue, starred rightly)
    assert not confirmed["overrun"] or confirmed["held_at_stop"] - confirmed["depth_end"] < 2_000, confirmed
    assert broker.wait_for(lambda s: "raw-plain" not in s["queues"] and "raw-confirmed" not in s["queues"],
                           what="the runs' queues gone with their consumers")   # auto-delete: no leftover backlog


def test_a_confirm_window_smaller_than_a_batch_still_publishes(broker):
    """--confirm 10: batches shrink to the window (they once waited for acks of publishes never sent)."""
    run = raw_driver().run(broker.port, size=100, seconds=1.0, confirm=10, queue="raw-small-window")
    assert run["publish_rate"] > 50 and run["deliver_rate"] > 50


@pytest.mark.parametrize("args", [["--confirm", "-1"], ["--publishers", "0"], ["--seconds", "0"], ["--size", "x"],
                                  ["--rate", "-5"]])
def test_it_refuses_bad_options_before_it_starts_anything(args):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "raw_driver.py"), "--port", "1", *args],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"raw_driver.py: error: argument {args[0]}")


def test_the_depth_sampler_reports_what_the_queue_holds_ready(broker):
    """The sampler asks the broker (a passive queue.declare), so its figure is the broker's own count."""
    import multiprocessing
    import time

    import pika
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    ch = conn.channel()
    ch.queue_declare("raw-depth")
    for _ in range(300):
        ch.basic_publish("", "raw-depth", b"x" * 100)
    broker.wait_for(lambda s: s["processes"]["queue-raw-depth"]["messages"] == 300, what="300 ready")
    counts = multiprocessing.get_context("fork").Queue()
    now = time.time()
    raw_driver().depth_sampler(broker.port, "raw-depth", now, now + 0.6, counts)
    ch.queue_purge("raw-depth")
    conn.close()
    got = dict(counts.get(timeout=5) for _ in range(2))
    assert got == {"depth_max": 300, "depth_end": 300}, got


def test_a_broker_that_goes_away_mid_run_ends_the_run_with_the_reason_at_once(broker):
    """The publishers' sockets are reset: each still reports (its count and what the broker took), so the
    run ends with the reason instead of waiting a minute for a report that never comes."""
    import threading
    import time

    threading.Timer(3.0, broker.stop).start()        # 1 s into the publishing window
    began = time.monotonic()
    with pytest.raises(SystemExit, match="closed a publisher"):
        raw_driver().run(broker.port, size=100, seconds=4, queue="raw-gone")
    assert time.monotonic() - began < 20


def test_a_backlog_that_grows_is_told_from_what_credit_holds_in_flight(start_broker):
    """A queue slowed to 20,000 msg/s behind an unpaced publisher: with credit the broker holds a level
    amount (each hop's credit, the reader's unparsed input) and the run is not starred; without credit
    what it holds grows through the run, wherever it keeps it, and the run is starred."""
    def told(run):                           # a failure shows every figure (pytest cuts a long dict short)
        return " ".join(f"{k}={v:.0f}" for k, v in run.items())

    driver = raw_driver()
    # 5 s: what credit holds level moves between a few hundred and ~2,300 publishes (the reader's unparsed
    # input comes in chunks), and the second half's threshold is a tenth of what the window delivered
    level = driver.run(start_broker("--queue-delay-us", "50").port, seconds=5, queue="raw-level")
    assert not level["overrun"] and level["held_at_stop"] < 20_000, told(level)
    grew = driver.run(start_broker("--queue-delay-us", "50", "--credit", "0,0", name="no-credit").port, seconds=3,
                      queue="raw-grew")
    # 41,000 msg/s published against 10,700 delivered grows it by ~45,000 over the second half on a quiet
    # machine; a suite's other worker made that 17,884 once: growth past the ~2,300 that credit on holds
    # level at most (above), however busy the machine
    assert grew["overrun"] and grew["held_at_stop"] > grew["held_mid"] + 2_300, told(grew)


def cpu_per_message():
    loader = importlib.machinery.SourceFileLoader("cpu_per_message", str(ROOT / "scripts" / "cpu_per_message"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_a_run_reads_the_broker_s_and_the_driver_s_cpu_inside_the_publishing_window(broker):
    """scripts/cpu_per_message's run (``_beside_rabbitmq.raw_run_with_cpu``, which scripts/bench_vs_rabbitmq
    uses too): a paced load the consumer keeps up with, and the CPU of the broker's processes (the
    supervisor and everything under it) and of the driver's own, per message delivered in the window."""
    assert len(script_module("_beside_rabbitmq").tree(broker.proc.pid)) >= 3   # the supervisor, store, watchdog
    row = cpu_per_message().one_run(broker.port, broker.proc.pid, size=100, rate=2000, seconds=4)
    # the consumer got the load (whether a paced run kept up to 95% of its rate is the bench's verdict, and a
    # driver short of CPU on a busy machine may fall behind its own schedule)
    assert row["delivered"] >= 1000, row
    assert 1 < row["us_per_msg"] < 100_000, row
    assert 0.1 < row["driver_us_per_msg"] < 100_000, row   # its publisher, consumer and depth sampler were read


def test_bench_vs_rabbitmq_refuses_a_raw_run_too_short_to_read_cpu_before_it_starts_anything():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vs_rabbitmq"), "--driver", "raw",
                           "--seconds", "2"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "bench_vs_rabbitmq" in proc.stderr


@pytest.mark.parametrize("args", [["--sizes", "100,4096", "--rates", "1000"], ["--rates", "fast"],
                                  ["--seconds", "2"], ["--publishers", "0"]])
def test_cpu_per_message_refuses_bad_options_before_it_starts_anything(args):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "cpu_per_message"), *args], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "cpu_per_message" in proc.stderr


def test_a_publisher_the_broker_closes_ends_the_run_with_the_reason_not_a_rate(start_broker):
    """A publisher that never reads would go on counting what the broker discards after closing its
    channel (here 406: bodies over --max-message-bytes), and print a publish rate nobody received."""
    broker = start_broker("--max-message-bytes", "1000")
    with pytest.raises(SystemExit, match=r"closed a publisher: 406 PRECONDITION_FAILED"):
        raw_driver().run(broker.port, size=4096, seconds=1.5, queue="raw-too-big")


def test_consumer_stall_stops_the_consumer_and_reports_both_rates_and_the_arena():
    """scripts/consumer_stall: a fresh broker, 64 KiB unpaced, the raw consumer stopped for 0.3 s."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "consumer_stall"), "--seconds", "6", "--at", "1",
                           "--stall", "0.3", "--runs", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("run 1: delivered ") and ", written to the sockets " in line, line
    assert "bodies by reference" in line, line      # 64 KiB bodies went into the publishing reader's arena


@pytest.mark.parametrize("args", [["--at", "5", "--seconds", "6"], ["--stall", "0"], ["--runs", "two"]])
def test_consumer_stall_refuses_bad_options_before_it_starts_anything(args):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "consumer_stall"), *args], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "consumer_stall" in proc.stderr


def test_the_sustained_search_runs_credit_off_beside_credit_on_and_passes_a_rate_both_deliver(tmp_path):
    """``bench_vs_rabbitmq --sustained`` on a creditflow-only row (credit off): a broker with the row's
    options and one with creditflow's own (credit on) are searched side by side; at 2,000 msg/s both keep up."""
    from ipc.credit import CreditSpec

    beside = script_module("_beside_rabbitmq")
    bench = beside.bench_module()
    bench.SEARCH_STEPS = 1
    bench.KEEPS_UP = 0.5        # the wiring is under test here: a driver short of CPU may lag its schedule
    off, on = beside.free_ports(2)
    found = bench.sustained_search({"size": 100}, 3, str(tmp_path),
                                   [("creditflow", off, {"credit": CreditSpec(0, 0)}, 2000.0),
                                    ("credit on", on, {}, 2000.0)])
    for who in ("creditflow", "credit on"):
        (tried,) = found[who]["tried"]
        assert tried["rate"] == 2000 and tried["passed"], found
        assert found[who]["sustained"] == 2000
    assert bench.credit_on_rate([{"scenario": "transient 100 B 1->1", "creditflow": {"deliver_rate": {"median": 5.0}}}],
                                {"size": 100}, bench.SCENARIOS) == 5.0


def test_more_publishers_are_told_as_a_share_of_the_fewest_publishers_rate_unpaced_and_sustained():
    """``bench_vs_rabbitmq --publishers 100,1 --sustained``: the 100 publishers' delivered rate against one
    publisher's, each broker's own, whatever order the counts came in; none where a figure is a starved
    consumer's."""
    bench = script_module("_beside_rabbitmq").bench_module()

    def row(n, ours, theirs, their_overruns=0, sustained=None):
        r = {"scenario": f"{n} publishers -> 1 queue, 100 B", "publishers": n,
             "creditflow": {"deliver_rate": {"median": ours}, "runs": 3, "overrun_runs": 0},
             "rabbitmq": {"deliver_rate": {"median": theirs}, "runs": 3, "overrun_runs": their_overruns}}
        if sustained:
            r["sustained"] = {"creditflow": {"sustained": sustained[0]}, "RabbitMQ": {"sustained": sustained[1]}}
        return r

    rows = bench.against_fewest([row(100, 47004, 15900, 3, (56405, 27475)), row(1, 53433, 45525, 0, (53433, 39834))])
    assert rows == [("100 publishers, unpaced", "88%", "-"), ("100 publishers, sustained", "106%", "69%")]
    assert bench.against_fewest([row(1, 53433, 45525), row(10, 60000, 40000)]) == [
        ("10 publishers, unpaced", "112%", "88%")]
    assert bench.against_fewest([row(1, 53433, 45525)]) == []


def test_a_dual_stack_listener_s_end_of_a_connection_to_127_0_0_1_is_in_the_dump():
    """A broker listening on [::] (RabbitMQ's default) holds IPv6 ends of the driver's IPv4 connections."""
    import socket

    srv = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    c = socket.create_connection(("127.0.0.1", srv.getsockname()[1]))
    a, _ = srv.accept()
    try:
        c.sendall(b"x" * 700)
        time.sleep(0.05)
        assert a.recv(200) == b"x" * 200
        assert raw_driver().broker_ends(srv.getsockname()[1]) == {c.getsockname()[1]: (200, 0)}
    finally:
        c.close()
        a.close()
        srv.close()


def test_what_the_broker_holds_is_publishes_read_less_deliveries_written(monkeypatch):
    """``held_now`` over what a dump gives: set-up bytes are not messages, a publisher not yet connected
    has sent nothing, and until the consumer has measured a delivery nothing counts as written."""
    import ctypes

    rd = raw_driver()
    board = (ctypes.c_int64 * (2 * rd.BOARD_SLOTS))(40001, 150, 300, 0, 0, 0)   # one publisher, one not yet
    seen = (ctypes.c_int64 * rd.SEEN_SLOTS)(40009, 500, 0)
    ends = {40001: (300 + 150 * 1000, 0), 40009: (0, 500 + 180 * 400)}
    monkeypatch.setattr(rd, "broker_ends", lambda port: ends)
    assert rd.held_now(board, 2, seen, 5672) == 1000           # the consumer's delivery size not known yet
    seen[2] = 180
    assert rd.held_now(board, 2, seen, 5672) == 600
    ends[40009] = (0, 500 + 180 * 1200)                        # more written than read: never below 0
    assert rd.held_now(board, 2, seen, 5672) == 0


def test_bodies_bigger_than_one_read_still_tell_what_the_broker_holds(broker):
    """300 KB bodies: no read holds two deliveries, and the consumer still learns a delivery's size (once
    it did not, so everything the broker had read counted as held, and every such run was starred). What
    the broker holds at the stop is what its queue holds, give or take what credit keeps in flight; on busy
    cores the consumer may fall behind at this size, and then the queue's depth says so too."""
    run = raw_driver().run(broker.port, size=300_000, seconds=2, queue="raw-big")
    assert run["deliver_rate"] > 10
    assert run["held_at_stop"] <= run["depth_end"] + 500, run


def test_a_kernel_that_gives_no_socket_counts_is_told_before_anything_starts(monkeypatch):
    import multiprocessing

    rd = raw_driver()

    def refused(port):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(rd, "broker_ends", refused)
    with pytest.raises(SystemExit, match=r"sock_diag.*not permitted"):
        rd.run(1, seconds=1)
    assert multiprocessing.active_children() == []


def test_one_dump_gives_what_the_broker_s_end_of_each_connection_read_and_wrote():
    """The readings of what the broker holds ask the kernel once for every connection: bytes the broker's
    end has read (not those still waiting unread) and written (those the client has not read too)."""
    import socket

    rd = raw_driver()
    srv = socket.create_server(("127.0.0.1", 0))
    pairs = []
    try:
        for n in (1000, 2000, 3000):
            c = socket.create_connection(srv.getsockname())
            a, _ = srv.accept()
            pairs.append((c, a))
            c.sendall(b"x" * n)
            time.sleep(0.05)
            assert len(a.recv(n // 4)) == n // 4     # the rest waits unread
            a.sendall(b"y" * (n // 10))              # never read by the client
        ends = rd.broker_ends(srv.getsockname()[1])
        assert ends == {
            c.getsockname()[1]: (n // 4, n // 10) for (c, _), n in zip(pairs, (1000, 2000, 3000))}
    finally:
        for c, a in pairs:
            c.close()
            a.close()
        srv.close()
