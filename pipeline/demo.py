"""``creditflow demo``: a memory alarm reproduced on a laptop, phase by phase.

A publisher outpaces a slow consumer, so the queue's backlog grows real
memory. Two seconds in, the watermark is lowered to just above the broker's
footprint (as ``rabbitmqctl set_vm_memory_high_watermark`` would), the
backlog pushes memory past it, and the alarm is set: the publishing
connection is blocked and sending drops to zero while the consumer keeps
draining. When the drained backlog's memory has really gone back to the
operating system the alarm clears and publishing resumes.

The demo watches for each phase, prints the per-second lines and the
broker's alarm log lines, ends with an account of what happened when, writes
the run directory, and exits 0 only if every phase was seen.
"""

from __future__ import annotations

import json
import os
import sys

from pipeline.runner import default_run_dir, execute, states_line
from pipeline.supervisor import BrokerConfig

EXIT_PHASE_MISSED = 5
MIB = 1024 * 1024
PHASES = ("backlog growing", "watermark lowered", "alarm set", "connection blocked", "publishing stopped",
          "backlog drained", "alarm cleared", "publishing resumed")


class Phases:
    """Which phases have been seen, and when (seconds since the load started)."""

    def __init__(self):
        self.at: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    def see(self, phase: str, t: float, note: str = "") -> bool:
        if phase in self.at:
            return False
        self.at[phase] = t
        self.notes[phase] = note
        return True

    def all_seen(self) -> bool:
        return all(p in self.at for p in PHASES)

    def account(self) -> list[str]:
        lines = []
        for p in sorted(self.at, key=self.at.get):
            lines.append(f"  t={self.at[p]:6.1f} s  {p}{': ' + self.notes[p] if self.notes[p] else ''}")
        missing = [p for p in PHASES if p not in self.at]
        if missing:
            lines.append("  not seen: " + ", ".join(missing))
        return lines


def run_demo(args) -> int:
    from pipeline.loadgen.config import LoadConfig
    from pipeline.loadgen.report import format_line
    from pipeline.view import View

    run_dir = os.path.abspath(args.run_dir or default_run_dir() + "-demo")
    # Paging would move the backlog to disk and keep memory under the watermark (RabbitMQ 3.x does the
    # same); the demo is about the alarm, so queues page only past 1.5 x the watermark, i.e. never first,
    # as on RabbitMQ 3.12 and later, which no longer page on memory pressure.
    cfg = BrokerConfig(data_dir=run_dir, port=0, paging_ratio=1.5, watchdog={
        "memory_limit": "0.6", "disk_limit": "50MB", "strategy": args.memory_strategy, "memory_interval_ms": 100})
    print(f"creditflow demo: a publisher at {args.rate} msg/s of {args.size} B against a consumer that spends "
          f"{args.consumer_latency} µs per message; the watermark will be lowered to the broker's footprint "
          f"+ {args.headroom_mb} MiB")
    phases = Phases()
    state = {"baseline": None, "peak": 0, "prev_msgs": 0, "mem": [], "after_resume": 0}
    view = View(plain=args.plain)

    def on_second(rep, status, ctl) -> bool:
        wd = status["processes"].get("watchdog", {})
        used, limit = wd.get("memory_used") or 0, wd.get("memory_limit") or 0
        edge = status["alarms"].get("memory", {})
        alarm = edge.get("state") == "set"
        q = status["processes"].get("queue-demo", {})
        msgs = (q.get("messages") or 0) + (q.get("unacked") or 0)
        t = rep.time_s
        state["mem"].append((t, used, limit, alarm, msgs))
        if msgs > max(1000, state["prev_msgs"]) and not alarm:
            phases.see("backlog growing", t, f"{msgs} messages in the queue")
        state["prev_msgs"] = msgs
        state["peak"] = max(state["peak"], msgs)
        if state["baseline"] is None and t >= 2 and used:
            state["baseline"] = used
            target = used + args.headroom_mb * MIB
            if ctl.request("set_watermark", value=str(target)).get("ok"):
                phases.see("watermark lowered", t, f"{target // MIB} MiB = footprint {used // MIB} MiB + "
                                                   f"{args.headroom_mb} MiB")
        if alarm:
            phases.see("alarm set", t, f"{edge.get('used', 0) / MIB:.1f} MiB used > "
                                       f"{edge.get('limit', 0) / MIB:.1f} MiB allowed")
        if "alarm set" in phases.at and "alarm cleared" not in phases.at:
            if any(p.get("state") == "blocked" for n, p in status["processes"].items() if n.startswith("reader")):
                phases.see("connection blocked", t, "the publishing reader stopped reading its socket; the "
                                                    "publisher keeps writing until TCP's buffers are full")
            if rep.sent_rate == 0 and rep.received_rate > 0:
                phases.see("publishing stopped", t, f"sent 0 msg/s, received {rep.received_rate:.0f} msg/s")
            if "publishing stopped" in phases.at and msgs * 2 < state["peak"]:
                phases.see("backlog drained", t, f"{msgs} messages left of a peak of {state['peak']}")
            if not alarm and "backlog drained" in phases.at:
                phases.see("alarm cleared", t, f"{edge.get('used', 0) / MIB:.1f} MiB used <= "
                                               f"{edge.get('limit', 0) / MIB:.1f} MiB allowed")
        if "alarm cleared" in phases.at and rep.sent_rate > 0:
            phases.see("publishing resumed", t, f"sent {rep.sent_rate:.0f} msg/s")
            state["after_resume"] += 1
        view.second(format_line(rep), states_line(status) + f"  | memory {used / MIB:.0f} MiB / watermark "
                    f"{limit / MIB:.0f} MiB{' ALARM' if alarm else ''}, queue {msgs}", status)
        done = phases.all_seen() and state["after_resume"] >= 2
        if done:   # restore the watermark so a re-fired alarm cannot strand the last publishes in TCP buffers
            ctl.request("set_watermark", value="0.6")
        return done

    def make_load(port: int) -> "LoadConfig":
        return LoadConfig(producers=1, consumers=1, rate=args.rate, size=args.size, prefetch=args.prefetch,
                          consumer_latency_us=args.consumer_latency, duration_s=args.max_seconds, queue="demo",
                          port=port)

    with view:
        summary, result = execute(cfg, make_load, on_second=on_second, on_log=view.log,
                                  extra={"demo": vars(args)})
    summary["phases"] = phases.at
    summary["memory_timeline"] = state["mem"]
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print()
    print("What happened:")
    for line in phases.account():
        print(line)
    print(f"published {result.published}, delivered {result.delivered}, lost {result.lost}")
    report_code = run_report_if_available(run_dir)
    print(f"run directory: {run_dir}")
    if not phases.all_seen():
        print("creditflow demo: not every phase was seen", file=sys.stderr)
        return EXIT_PHASE_MISSED
    return 0 if result.lost == 0 and report_code == 0 else EXIT_PHASE_MISSED


def run_report_if_available(run_dir: str) -> int:
    """The Spark report of the demo's run; its failure is reported, the demo's phases decide the exit code."""
    try:
        from pipeline.analytics.report import build_report
    except ImportError:
        print("Spark report: not part of this build yet")
        return 0
    try:
        path = build_report([run_dir])
    except Exception as exc:  # the alarm was reproduced either way; say what went wrong with the report
        print(f"Spark report failed: {exc!r}", file=sys.stderr)
        return 0
    print(f"Spark report: {path}")
    return 0
