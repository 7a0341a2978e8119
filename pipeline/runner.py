"""``creditflow run``: a broker, PerfTest-style load against it, and the run directory.

The broker runs as a child process (the supervisor and its stages); the load
generator's publishers and consumers are separate processes that speak AMQP
to it over loopback. Every second the runner prints PerfTest's line plus the
state of every broker process (a rich live view on a terminal, plain lines
otherwise), and at the end writes ``RUN_DIR/summary.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

from pipeline.ctlclient import CtlClient, wait_for_broker
from pipeline.supervisor import BrokerConfig, run_broker

EXIT_LOST = 5
STATE_ORDER = ("reader", "channel", "queue", "store")


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def start_broker(cfg: BrokerConfig) -> int:
    """Fork the supervisor; it dies with us (PR_SET_PDEATHSIG) if we are killed."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            code = run_broker(cfg, out=open(os.devnull, "w"))
        finally:
            os._exit(code)
    return pid


def stop_broker(pid: int, data_dir: str, timeout_s: float = 20.0) -> int:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def states_line(status: dict) -> str:
    procs = status.get("processes", {})
    parts = []
    for kind in STATE_ORDER:
        for name in sorted(procs):
            p = procs[name]
            if p.get("kind") == kind and p.get("alive"):
                parts.append(f"{name} {p.get('state')}")
    alarms = [s for s, a in status.get("alarms", {}).items() if a.get("state") == "set"]
    if alarms:
        parts.append("ALARM " + "+".join(alarms))
    return "  " + ", ".join(parts)


class LogTail:
    """New lines of the broker log at warning level or above (alarms, deaths)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        out = []
        keep = False
        for line in data.splitlines():
            if "[warning]" in line or "[error]" in line:
                keep = True
            elif "] " in line[:40]:
                keep = False
            if keep:
                out.append(line)
        return out


class SecondsLog:
    """``RUN_DIR/seconds.jsonl``: the load generator's per-second report, one JSON object a line."""

    def __init__(self, run_dir: str):
        self.f = open(os.path.join(run_dir, "seconds.jsonl"), "w", encoding="utf-8")

    def write(self, rep, status: dict) -> None:
        row = {k: v for k, v in vars(rep).items()}
        row["at_ns"] = time.monotonic_ns()
        row["states"] = {n: p.get("state") for n, p in status.get("processes", {}).items() if p.get("alive")}
        self.f.write(json.dumps(row, default=str) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def summarize(result, status: dict, config: dict, wall_s: float) -> dict:
    processes = {}
    for name, p in status.get("processes", {}).items():
        samples = p.get("samples") or {}
        n = samples.get("samples", 0)
        processes[name] = {
            "kind": p.get("kind"), "pid": p.get("pid"),
            "flow_fraction": round(samples.get("flow", 0) / n, 4) if n else 0.0,
            "blocked_fraction": round(samples.get("blocked", 0) / n, 4) if n else 0.0,
            "blocked_seconds": round((p.get("blocked_total_ns") or 0) / 1e9, 3),
            "block_count": p.get("block_count", 0),
            "final_state": p.get("state"),
        }
        if p.get("kind") == "reader" and p.get("publishes"):
            first, stop = p.get("first_publish_ns") or 0, p.get("first_stop_ns") or 0
            processes[name]["first_stop_after_first_publish_s"] = round((stop - first) / 1e9, 4) if stop else None
    links = {name: {"max_in_flight": v.get("max_in_flight", 0), "sent": v.get("sent", 0)}
             for name, v in status.get("links", {}).items()}
    alarms = [{"source": src, **{k: v for k, v in a.items() if k not in ("type",)}}
              for src, a in status.get("alarms", {}).items()]
    return {
        "published": result.published, "confirmed": result.confirmed, "nacked": result.nacked,
        "returned": result.returned, "delivered": result.delivered, "lost": result.lost,
        "publish_rate": round(result.publish_rate, 1), "deliver_rate": round(result.deliver_rate, 1),
        "latency_us": result.latency_us, "latency_histograms": result.histograms, "processes": processes, "links": links, "alarms": alarms,
        "deaths": status.get("deaths", []), "wall_seconds": round(wall_s, 3), "config": config,
    }


def load_config(args, port: int):
    from pipeline.loadgen.config import LoadConfig
    return LoadConfig(producers=args.producers, consumers=args.consumers, rate=args.rate, size=args.size,
                      persistent="persistent" in args.flag, confirm=args.confirm, prefetch=args.qos,
                      autoack=args.autoack, duration_s=args.time, consumer_latency_us=args.consumer_latency,
                      queue=args.queue, host="127.0.0.1", port=port)


def execute(cfg: BrokerConfig, make_load, *, on_second=None, on_log=None, extra: dict | None = None):
    """Start a broker on ``cfg.data_dir``, run load against it, stop it, and leave the run directory.

    ``make_load(port)`` builds the LoadConfig once the broker listens.
    ``on_second(rep, status, ctl)`` is called every second (return True to stop
    early); ``on_log(line)`` gets the broker's warning and error lines as they
    appear. Writes config.json, seconds.jsonl and summary.json; returns
    ``(summary, result)``.
    """
    from pipeline.loadgen.harness import run_load

    run_dir = cfg.data_dir
    os.makedirs(run_dir, exist_ok=True)
    started = time.monotonic()
    pid = start_broker(cfg)
    try:
        info = wait_for_broker(run_dir, pid=pid)
        load = make_load(info["port"])
        config = {"broker": {k: (str(v) if hasattr(v, "__dataclass_fields__") else v)
                             for k, v in vars(cfg).items()},
                  "load": dict(vars(load)), "argv": sys.argv[1:], **(extra or {})}
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        tail = LogTail(os.path.join(run_dir, "broker.log"))
        seconds = SecondsLog(run_dir)
        with CtlClient(run_dir) as ctl:
            def each_second(rep):
                status = ctl.request("status")
                seconds.write(rep, status)
                for line in tail.new_lines():
                    if on_log is not None:
                        on_log(line)
                return on_second(rep, status, ctl) if on_second is not None else None

            result = run_load(load, on_second=each_second)
            final = ctl.request("status")
        seconds.close()
        for line in tail.new_lines():
            if on_log is not None:
                on_log(line)
    finally:
        code = stop_broker(pid, run_dir)
    summary = summarize(result, final, config, time.monotonic() - started)
    summary["broker_exit_code"] = code
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary, result


def run_harness(args) -> int:
    from pipeline.cli import broker_config
    from pipeline.loadgen.report import format_line
    from pipeline.view import View

    run_dir = os.path.abspath(args.run_dir or default_run_dir())
    cfg = broker_config(args, run_dir, args.port)
    view = View(plain=args.plain)
    with view:
        summary, _ = execute(cfg, lambda port: load_config(args, port),
                             on_second=lambda rep, status, ctl: view.second(format_line(rep), states_line(status),
                                                                            status),
                             on_log=view.log)
    print(f"published {summary['published']}, delivered {summary['delivered']}, lost {summary['lost']}; "
          f"publish {summary['publish_rate']:.0f} msg/s, deliver {summary['deliver_rate']:.0f} msg/s")
    print(f"run directory: {run_dir}")
    return EXIT_LOST if summary["lost"] else 0
