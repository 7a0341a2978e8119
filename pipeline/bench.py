"""``creditflow bench``: the measuring stick.

Each scenario runs a fresh broker and PerfTest-style load ``runs`` times and
reports the median with min and max (the machine is shared and noisy; one
run says little). Micro-benchmarks time the pieces every message goes
through: the ring, the credit core, the frame codec. The alarm reaction is
timed from ``ctl set-watermark 0`` to the moment the publishing reader stops
reading, and from the clear to the first publish it reads again.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

from ipc.credit import CreditFlow, CreditSpec
from ipc.ring import HEADER_BYTES, Ring

SCENARIOS = [
    # name, load options, broker options
    ("transient 100 B 1->1", {"size": 100}, {}),
    ("transient 4 KiB 1->1", {"size": 4096}, {}),
    ("transient 64 KiB 1->1", {"size": 65536}, {}),
    ("persistent 100 B, confirms (-c 1000)", {"size": 100, "persistent": True, "confirm": 1000}, {}),
    ("fan-out 1 -> 4 queues, 100 B", {"size": 100, "consumers": 4,
                                      "queues": ("fanout-1", "fanout-2", "fanout-3", "fanout-4")}, {}),
    ("10 publishers -> 1 queue, 100 B", {"size": 100, "producers": 10}, {}),
    ("credit off {0,0}, 100 B 1->1", {"size": 100}, {"credit": CreditSpec(0, 0)}),
]
NOT_SUPPORTED: list[tuple[str, str]] = []
TRACING_LOAD = {"size": 100}      # the tracing overhead is measured on the fastest scenario


def _median(values):
    return statistics.median(values) if values else 0.0


def run_scenario(name: str, load_opts: dict, broker_opts: dict, runs: int, seconds: int, workdir: str) -> dict:
    from pipeline.loadgen.config import LoadConfig
    from pipeline.runner import execute
    from pipeline.broker.supervisor import BrokerConfig

    rows = []
    by_kind: list[dict] = []
    for i in range(runs):
        run_dir = os.path.join(workdir, f"{name.split()[0]}-{len(os.listdir(workdir))}")
        cfg = replace(BrokerConfig(data_dir=run_dir, port=0, watchdog={"memory_limit": "0.6"}), **broker_opts)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary, _ = execute(cfg, lambda port: LoadConfig(duration_s=seconds, port=port, **load_opts))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        lat = summary["latency_us"]
        rows.append({"deliver_rate": summary["deliver_rate"], "publish_rate": summary["publish_rate"],
                     "consumer_p50_us": lat["consumer"].get("p50", 0), "consumer_p99_us": lat["consumer"].get("p99", 0),
                     "confirm_p50_us": lat.get("confirm", {}).get("p50"), "confirm_p99_us": lat.get("confirm", {}).get("p99"),
                     "lost": summary["lost"],
                     # broker and load generator together (every process is reaped by the end of the run)
                     "cpu_us_per_msg": 1e6 * cpu_s / summary["delivered"] if summary["delivered"] else None,
                     "load_us_per_msg": summary["load_cpu"]["us_per_message"]})
        by_kind.append((summary.get("broker_cpu") or {}).get("us_per_message") or {})
    out = {"scenario": name, "runs": runs, "seconds": seconds}
    for key in rows[0]:
        vals = [r[key] for r in rows if r[key] is not None]
        if vals:
            out[key] = {"median": _median(vals), "min": min(vals), "max": max(vals)}
    out["cpu_us_per_msg_by_kind"] = {kind: _median([k[kind] for k in by_kind if kind in k])
                                     for kind in sorted({kind for k in by_kind for kind in k})}
    return out


CPU_KINDS_SHOWN = ("reader", "channel", "queue", "store", "supervisor", "watchdog")


def cpu_line(r: dict) -> str:
    """Where one scenario's CPU went, per message delivered (medians over its runs): each kind of broker
    process over the load's steady window, and the load generator over the whole run."""
    kinds = r.get("cpu_us_per_msg_by_kind") or {}
    if not kinds:
        return "CPU per message: not measured"
    shown = [(k, kinds[k]) for k in CPU_KINDS_SHOWN if k in kinds]
    other = sum(v for k, v in kinds.items() if k not in CPU_KINDS_SHOWN)
    if other:
        shown.append(("other", other))
    load = (r.get("load_us_per_msg") or {}).get("median")
    if load is not None:
        shown.append(("load", load))
    return ("CPU µs/msg: " + ", ".join(f"{k} {v:.1f}" for k, v in shown)
            + f" = {sum(v for _, v in shown):.1f}")


def measure_tracing_overhead(runs: int, seconds: int, workdir: str) -> dict:
    """Transient 100 B with telemetry on and off, runs alternating so drift in the machine's
    load hits both alike. Two measures: the deliver rate (overhead = 1 - median on / median off),
    which a shared machine makes noisy, and the CPU time every process of the run spent per
    message delivered (overhead = median on / median off - 1), which contention disturbs less."""
    rates: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(runs):
        for mode in ("on", "off"):
            r = run_scenario(f"tracing-{mode}", TRACING_LOAD, {"telemetry": mode == "on"}, 1, seconds, workdir)
            rates[mode].append(r["deliver_rate"]["median"])
            cpu[mode].append(r["cpu_us_per_msg"]["median"])
    on, off = _median(rates["on"]), _median(rates["off"])
    cpu_on, cpu_off = _median(cpu["on"]), _median(cpu["off"])
    return {"deliver_rate_on": rates["on"], "deliver_rate_off": rates["off"],
            "median_on": on, "median_off": off, "overhead": 1 - on / off if off else None,
            "cpu_us_per_msg_on": cpu["on"], "cpu_us_per_msg_off": cpu["off"],
            "cpu_median_on": cpu_on, "cpu_median_off": cpu_off,
            "cpu_overhead": cpu_on / cpu_off - 1 if cpu_off else None}


# -- micro-benchmarks ---------------------------------------------------------------------------

def micro_ring(batch: int, seconds: float = 1.0) -> float:
    ring = Ring(bytearray(HEADER_BYTES + (1 << 22)), create=True)
    rec = b"x" * 100
    records = [rec] * batch
    n = 0
    end = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < end:
        for _ in range(100):
            ring.write_batch(records)
            n += len(ring.read_batch())
    return n / (time.perf_counter() - start)


def micro_credit(seconds: float = 1.0) -> float:
    sender, receiver = CreditFlow(CreditSpec(400, 200)), CreditFlow(CreditSpec(400, 200))
    n = 0
    end = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < end:
        for _ in range(1000):
            sender.send("r", 0)
            for g in receiver.ack("s"):
                sender.handle_bump("r", g.amount, 0)
        n += 1000
    return n / (time.perf_counter() - start)


def micro_codec(count: int = 20000) -> float:
    from pamqp import commands, frame
    from pipeline.amqp import frames
    from pipeline.amqp.connection import ServerConnection
    conn = ServerConnection()
    conn.receive_data(frames.PROTOCOL_HEADER)
    conn.next_event(0)
    conn.receive_data(frame.marshal(commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                                                response="\0guest\0guest"), 0))
    conn.receive_data(frame.marshal(commands.Connection.TuneOk(frame_max=131072), 0)
                      + frame.marshal(commands.Connection.Open(), 0) + frame.marshal(commands.Channel.Open(), 1))
    while conn.next_event(0) is not None:
        pass
    pub = frames.encode_publish(1, "", "q", frames.properties_raw(delivery_mode=1), b"x" * 100, 131072)
    conn.receive_data(pub * count)
    start = time.perf_counter()
    n = 0
    while conn.next_event(0) is not None:
        n += 1
    return n / (time.perf_counter() - start)


# -- alarm reaction -----------------------------------------------------------------------------

def measure_alarm_reaction(tries: int = 20, rate: int = 5000) -> dict:
    """p50/p99 ms from set-watermark 0 to the reader's stop, and from the clear to its next publish."""
    from pamqp import commands, frame
    from pipeline.amqp import frames
    from pipeline.ctlclient import CtlClient, wait_for_broker
    import psutil

    data_dir = tempfile.mkdtemp(prefix="creditflow-reaction-")
    exe = os.path.join(os.path.dirname(sys.executable), "creditflow")
    broker = subprocess.Popen([exe, "serve", "--port", "0", "--data-dir", data_dir], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT, start_new_session=True)
    stop = threading.Event()
    try:
        info = wait_for_broker(data_dir)
        s = socket.create_connection(("127.0.0.1", info["port"]))
        s.sendall(frames.PROTOCOL_HEADER)
        s.recv(65536)
        s.sendall(frame.marshal(commands.Connection.StartOk(
            client_properties={"capabilities": {"connection.blocked": True}}, mechanism="PLAIN",
            response="\0guest\0guest"), 0))
        s.recv(65536)
        s.sendall(frame.marshal(commands.Connection.TuneOk(channel_max=0, frame_max=131072, heartbeat=0), 0)
                  + frame.marshal(commands.Connection.Open(), 0) + frame.marshal(commands.Channel.Open(), 1)
                  + frame.marshal(commands.Queue.Declare(queue="reaction"), 1))
        time.sleep(0.5)
        s.recv(65536)
        msg = frames.encode_publish(1, "", "reaction", frames.properties_raw(), b"x" * 20, 131072)

        def publish():
            nxt = time.monotonic()
            while not stop.is_set():
                s.sendall(msg)
                nxt += 1.0 / rate
                delay = nxt - time.monotonic()
                if delay > 0:
                    time.sleep(delay)

        threading.Thread(target=publish, daemon=True).start()
        ctl = CtlClient(data_dir)
        wd = psutil.Process(ctl.request("status")["processes"]["watchdog"]["pid"])
        cpu0, wall0 = sum(wd.cpu_times()[:2]), time.monotonic()

        def reader():
            procs = ctl.request("status")["processes"]
            return [p for n, p in procs.items() if n.startswith("reader") and p.get("alive")][0]

        def wait(pred):
            end = time.monotonic() + 10
            while time.monotonic() < end:
                r = reader()
                if pred(r):
                    return r
                time.sleep(0.005)
            raise RuntimeError("the reader did not react within 10 s")

        stop_ms, resume_ms = [], []
        time.sleep(1)
        for _ in range(tries):
            t0 = time.monotonic_ns()
            ctl.request("set_watermark", value="0")
            stop_ms.append((wait(lambda r: r["stopped_reading_ns"] > t0)["stopped_reading_ns"] - t0) / 1e6)
            time.sleep(0.2)
            t1 = time.monotonic_ns()
            ctl.request("set_watermark", value="0.6")
            r = wait(lambda r: r["first_publish_after_resume_ns"] > t1)
            resume_ms.append((r["first_publish_after_resume_ns"] - t1) / 1e6)
            time.sleep(0.2)
        cpu = (sum(wd.cpu_times()[:2]) - cpu0) / (time.monotonic() - wall0)
        ctl.close()
        s.close()
    finally:
        stop.set()
        broker.send_signal(signal.SIGTERM)
        try:
            broker.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(broker.pid, signal.SIGKILL)
    q = statistics.quantiles
    return {"tries": tries, "stop_p50_ms": statistics.median(stop_ms), "stop_p99_ms": q(stop_ms, n=100)[98],
            "resume_p50_ms": statistics.median(resume_ms), "resume_p99_ms": q(resume_ms, n=100)[98],
            "watchdog_cpu_percent": cpu * 100}


# -- the command ------------------------------------------------------------------------------------

def _fmt(stat, unit="", scale=1.0) -> str:
    if not stat:
        return "-"
    return f"{stat['median'] / scale:,.0f}{unit} ({stat['min'] / scale:,.0f}-{stat['max'] / scale:,.0f})"


def run_bench(args) -> int:
    from pipeline import machine

    def wanted(name: str) -> bool:
        return not args.only or args.only in name

    results = {"scenarios": [], "micro": {}, "not_supported": NOT_SUPPORTED, "machine": machine.describe()}
    print(machine.line(results["machine"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="creditflow-bench-") as workdir:
        for name, load_opts, broker_opts in SCENARIOS:
            if not wanted(name):
                continue
            r = run_scenario(name, load_opts, broker_opts, args.runs, args.seconds, workdir)
            results["scenarios"].append(r)
            print(f"{name:<40} deliver {_fmt(r.get('deliver_rate'), ' msg/s')}, consumer p50/p99 "
                  f"{_fmt(r.get('consumer_p50_us'), ' ms', 1000)}/{_fmt(r.get('consumer_p99_us'), ' ms', 1000)}"
                  + (f", confirm p50/p99 {_fmt(r.get('confirm_p50_us'), ' ms', 1000)}/"
                     f"{_fmt(r.get('confirm_p99_us'), ' ms', 1000)}" if r.get("confirm_p50_us") else ""),
                  flush=True)
            print(f"{'':<40} {cpu_line(r)}", flush=True)
    by_name = {r["scenario"]: r for r in results["scenarios"]}
    on, off = by_name.get(SCENARIOS[0][0]), by_name.get(SCENARIOS[-1][0])
    if on and off:
        ratio = on["deliver_rate"]["median"] / off["deliver_rate"]["median"]
        results["credit_on_off_ratio"] = ratio
        print(f"{'credit on / credit off (deliver rate)':<40} {ratio:.2f}")
    if wanted("tracing") or "tracing" in args.only:
        with tempfile.TemporaryDirectory(prefix="creditflow-bench-") as workdir:
            t = results["tracing"] = measure_tracing_overhead(args.runs, args.seconds, workdir)
        print(f"{'telemetry on / off, 100 B (deliver)':<40} {t['median_on']:,.0f} / {t['median_off']:,.0f} msg/s: "
              f"overhead {100 * t['overhead']:.1f}% (runs on {', '.join(f'{v:,.0f}' for v in t['deliver_rate_on'])}; "
              f"off {', '.join(f'{v:,.0f}' for v in t['deliver_rate_off'])})", flush=True)
        print(f"{'telemetry on / off, CPU per message':<40} {t['cpu_median_on']:.2f} / {t['cpu_median_off']:.2f} µs: "
              f"overhead {100 * t['cpu_overhead']:.1f}%", flush=True)
    for name, name_batch in (("ring, batches of 64", 64), ("ring, one at a time", 1)):
        if wanted(name):
            results["micro"][name] = micro_ring(name_batch)
            print(f"{name:<40} {results['micro'][name]:,.0f} records/s (write + read)")
    if wanted("credit core send+ack"):
        results["micro"]["credit core send+ack"] = micro_credit()
        print(f"{'credit core send+ack':<40} {results['micro']['credit core send+ack']:,.0f} messages/s")
    if wanted("frame codec, publishes parsed"):
        results["micro"]["frame codec, publishes parsed"] = micro_codec()
        print(f"{'frame codec, publishes parsed':<40} {results['micro']['frame codec, publishes parsed']:,.0f} /s")
    if wanted("alarm") or "alarm" in args.only:
        results["alarm_reaction"] = measure_alarm_reaction(args.tries)
        a = results["alarm_reaction"]
        print(f"{'alarm: set-watermark 0 -> reader stops':<40} p50 {a['stop_p50_ms']:.1f} ms, p99 {a['stop_p99_ms']:.1f} ms")
        print(f"{'alarm: clear -> next publish read':<40} p50 {a['resume_p50_ms']:.1f} ms, "
              f"p99 {a['resume_p99_ms']:.1f} ms")
        print(f"{'watchdog CPU':<40} {a['watchdog_cpu_percent']:.1f}% of one core")
    for name, why in NOT_SUPPORTED:
        print(f"{name:<40} not measured: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
