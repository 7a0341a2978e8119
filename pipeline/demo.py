"""``creditflow demo``: a memory alarm reproduced on a laptop, phase by phase.

A publisher outpaces a slow consumer, so the queue's backlog grows real
memory, along a line: memory in use = footprint + backlog x cost of one
queued message. The demo fits that line to its per-second readings. Once the
backlog costs twice the headroom (``--headroom-mb``) and a little more, it
lowers the watermark to footprint + headroom, as ``rabbitmqctl
set_vm_memory_high_watermark`` would on a loaded broker: memory is over it at
once, the alarm is set, the publishing connection is blocked and sending
drops to zero while the consumer keeps draining. Queues give memory back as
their backlog shrinks, so memory comes down the same line and the alarm
clears, by RabbitMQ's rule (used > limit, no hysteresis), once more than
half the backlog is gone (a little later than the line says: memory comes
back one trim after the messages that held it).

At the lowered watermark the alarm would not stay clear: this publisher is
faster than its consumer and, once unblocked, sends everything it was held
back from, which would set the alarm again within a fraction of a second
(the watchdog reads memory every 100 ms). So the demo, like an operator
ending the exercise, restores the default watermark the moment the alarm
clears: a thread of its own watches the alarm every ``WATCH_INTERVAL_S``
on a control connection of its own. Publishing resumes and the alarm stays
clear.

The demo prints the per-second lines and the broker's alarm log lines, ends
with an account of what happened when (seconds since the load started) and
writes the run directory. It exits 0 only if every phase was seen, in order,
the memory alarm was set once and cleared once, and every message published
was delivered.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

from pipeline.ctlclient import BrokerNotRunning, CtlClient
from pipeline.runner import default_run_dir, execute, states_line
from pipeline.broker.supervisor import BrokerConfig

EXIT_PHASE_MISSED = 5
MIB = 1024 * 1024
KIB = 1024
DEFAULT_WATERMARK = "0.6"
PAGING_RATIO_NEVER = 1000.0        # x the watermark: memory never gets there
LOWER_MARGIN_BYTES = 16 * MIB     # lower once the backlog costs 2 x headroom + this: it clears below half
FIT_MIN_SAMPLES = 3
FIT_MIN_SPREAD_MESSAGES = 2000    # the line is fitted over at least this many messages of backlog
WATCH_INTERVAL_S = 0.01           # the watcher's look at the alarm (a control request to the supervisor)
WATCH_STATUS_INTERVAL_S = 0.1     # ... and at the queue's backlog, while the alarm holds
DRAINED_FRACTION = 0.05           # "drained": at most this share of the peak left
RESUMED_SECONDS = 2               # seconds of resumed publishing before the demo ends
DRAIN_S = 300                     # then the consumer may take this long to empty the queue
PHASES = ("backlog growing", "watermark lowered", "alarm set", "connection blocked", "publishing stopped",
          ("backlog halved", "backlog drained"), "alarm cleared", "watermark restored", "publishing resumed")
_ALARM_SET_LINE = re.compile(r"memory resource limit alarm set on node")
_ALARM_CLEARED_LINE = re.compile(r"memory resource limit alarm cleared on node")


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

    def when(self, slot) -> float | None:
        """When the phase in ``slot`` (a name, or a tuple of names any of which counts) was seen."""
        for name in (slot,) if isinstance(slot, str) else slot:
            if name in self.at:
                return self.at[name]
        return None

    def missing(self) -> list[str]:
        return ["/".join((s,) if isinstance(s, str) else s) for s in PHASES if self.when(s) is None]

    def out_of_order(self) -> list[str]:
        """Pairs of consecutive phases seen the wrong way round."""
        seen = [(s if isinstance(s, str) else next(n for n in s if n in self.at), self.when(s))
                for s in PHASES if self.when(s) is not None]
        return [f"{a} ({ta:.2f} s) after {b} ({tb:.2f} s)" for (b, tb), (a, ta) in zip(seen, seen[1:]) if ta < tb]

    def account(self) -> list[str]:
        lines = []
        for p in sorted(self.at, key=self.at.get):
            lines.append(f"  t={self.at[p]:6.1f} s  {p}{': ' + self.notes[p] if self.notes[p] else ''}")
        if self.missing():
            lines.append("  not seen: " + ", ".join(self.missing()))
        return lines


class MemoryLine:
    """Least-squares line of memory in use against messages held: footprint (intercept) and bytes per message."""

    def __init__(self):
        self.points: list[tuple[int, int]] = []

    def add(self, messages: int, used: int) -> None:
        self.points.append((messages, used))

    def fit(self) -> tuple[float, float] | None:
        """``(footprint_bytes, bytes_per_message)``, or None until the readings span enough backlog."""
        if len(self.points) < FIT_MIN_SAMPLES:
            return None
        xs = [x for x, _ in self.points]
        if max(xs) - min(xs) < FIT_MIN_SPREAD_MESSAGES:
            return None
        n = len(self.points)
        mx = sum(xs) / n
        my = sum(y for _, y in self.points) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in self.points) / sxx
        if slope <= 0:
            return None
        return my - slope * mx, slope


class AlarmWatcher(threading.Thread):
    """Watches the memory alarm on a control connection of its own; once armed, restores the watermark
    the moment the alarm clears. While armed it also samples the queue's backlog, so the account can say
    what the backlog was while publishers were blocked, between the demo's once-a-second looks."""

    def __init__(self, run_dir: str, queue: str, restore_to: str):
        super().__init__(name="demo-alarm-watcher", daemon=True)
        self.run_dir = run_dir
        self.queue = queue
        self.restore_to = restore_to
        self.stopping = threading.Event()
        self.armed = threading.Event()
        self.lock = threading.Lock()
        self.edges: list[dict] = []               # memory alarm edges as the supervisor holds them
        self.backlog: list[tuple[int, int]] = []  # (queue's statistics at_ns, messages held), while armed
        self.restored: dict | None = None         # {"at_ns", "limit", "after_clear_ns"} once restored
        self.error: str | None = None

    def run(self) -> None:
        try:
            with CtlClient(self.run_dir) as ctl:
                last = None
                next_status = 0.0
                while not self.stopping.wait(WATCH_INTERVAL_S):
                    edge = ctl.request("alarms").get("alarms", {}).get("memory")
                    if edge and (edge.get("state"), edge.get("at_ns")) != last:
                        last = (edge.get("state"), edge.get("at_ns"))
                        with self.lock:
                            self.edges.append(dict(edge))
                        if edge.get("state") == "clear" and self.armed.is_set() and self.restored is None:
                            self.restore(ctl, edge)
                    if self.armed.is_set() and self.restored is None and time.monotonic() >= next_status:
                        next_status = time.monotonic() + WATCH_STATUS_INTERVAL_S
                        self.sample_backlog(ctl.request("status"))
        except (BrokerNotRunning, OSError, ValueError) as exc:
            if self.restored is None and not self.stopping.is_set():   # (the broker stopping ends it too)
                self.error = f"the alarm watcher stopped before the alarm cleared: {exc}"

    def restore(self, ctl: CtlClient, cleared: dict) -> None:
        reply = ctl.request("set_watermark", value=self.restore_to)
        now = time.monotonic_ns()
        self.restored = {"at_ns": now, "limit": reply.get("memory_limit"), "ok": bool(reply.get("ok")),
                         "after_clear_ns": now - (cleared.get("at_ns") or now)}
        self.sample_backlog(ctl.request("status"))

    def sample_backlog(self, status: dict) -> None:
        q = status.get("processes", {}).get(f"queue-{self.queue}")
        if q and q.get("at_ns"):
            with self.lock:
                self.backlog.append((q["at_ns"], (q.get("messages") or 0) + (q.get("unacked") or 0)))

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)


def count_alarm_edges(log_path: str) -> tuple[int, int]:
    """How many times broker.log says the memory alarm was set, and cleared."""
    try:
        with open(log_path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return 0, 0
    return len(_ALARM_SET_LINE.findall(text)), len(_ALARM_CLEARED_LINE.findall(text))


class LivePictures:
    """Pictures of the live page (``pipeline.management.snapshot``) into RUN_DIR/report/: one once the
    alarm is set, one once it cleared, each taken in a thread of its own so that no second waits."""

    def __init__(self, run_dir: str):
        self.report_dir = os.path.join(run_dir, "report")
        self.threads: dict[str, threading.Thread] = {}
        self.results: dict[str, str | None] = {}

    def take(self, port: int | None, alarm_set: bool, alarm_cleared: bool) -> None:
        for name, due in (("live-alarm-set.png", alarm_set and not alarm_cleared), ("live-alarm-cleared.png",
                                                                                    alarm_cleared)):
            if due and port and name not in self.threads:
                path = os.path.join(self.report_dir, name)
                thread = threading.Thread(target=self._shoot, args=(f"http://127.0.0.1:{port}/", path, name),
                                          daemon=True)
                self.threads[name] = thread
                thread.start()

    def _shoot(self, url: str, path: str, name: str) -> None:
        from pipeline.management.snapshot import screenshot
        self.results[name] = screenshot(url, path)

    def finish(self) -> list[str]:
        """Wait for the pictures; a line for each (where it is, or why there is none)."""
        lines = []
        for name, thread in self.threads.items():
            thread.join(60)
            why = self.results.get(name, "still being taken")
            lines.append(f"live page: {os.path.join(self.report_dir, name)}" if why is None
                         else f"live page: no picture {name} ({why})")
        return lines


def run_demo(args) -> int:
    from pipeline.loadgen.config import LoadConfig
    from pipeline.loadgen.report import format_line
    from pipeline.view import View

    run_dir = os.path.abspath(args.run_dir or default_run_dir() + "-demo")
    queue = "demo"
    headroom = args.headroom_mb * MIB
    # Paging would move the backlog to disk and take memory down without the consumer (RabbitMQ 3.x does
    # the same); the demo is about the alarm and memory that follows the backlog, so queues never page on
    # memory pressure, as on RabbitMQ 3.12 and later.
    cfg = BrokerConfig(data_dir=run_dir, port=0, paging_ratio=PAGING_RATIO_NEVER, watchdog={
        "memory_limit": DEFAULT_WATERMARK, "disk_limit": "50MB", "strategy": args.memory_strategy,
        "memory_interval_ms": 100}, management_port=0)
    print(f"creditflow demo: a publisher at {args.rate} msg/s of {args.size} B against a consumer that spends "
          f"{args.consumer_latency} µs per message; once the backlog costs twice {args.headroom_mb} MiB the "
          f"watermark is lowered to the broker's footprint + {args.headroom_mb} MiB")
    phases = Phases()
    line = MemoryLine()
    watcher = AlarmWatcher(run_dir, queue, DEFAULT_WATERMARK)
    state = {"start_ns": None, "lowered": None, "peak": 0, "prev_msgs": 0, "mem": [], "resumed_seconds": 0}
    view = View(plain=args.plain)
    pictures = LivePictures(run_dir)

    def t_of(ns: int) -> float:
        return (ns - state["start_ns"]) / 1e9

    def on_second(rep, status, ctl) -> bool:
        if not watcher.is_alive() and watcher.ident is None:
            watcher.start()           # the broker answers by now
        now = time.monotonic_ns()
        start = now - int(rep.time_s * 1e9)
        state["start_ns"] = start if state["start_ns"] is None else min(state["start_ns"], start)
        t = t_of(now)
        wd = status["processes"].get("watchdog", {})
        used, limit = wd.get("memory_used") or 0, wd.get("memory_limit") or 0
        edge = status["alarms"].get("memory", {})
        alarm = edge.get("state") == "set"
        q = status["processes"].get(f"queue-{queue}", {})
        msgs = (q.get("messages") or 0) + (q.get("unacked") or 0)
        state["mem"].append((round(t, 3), used, limit, alarm, msgs))
        state["peak"] = max(state["peak"], msgs)
        if msgs > max(1000, state["prev_msgs"]) and not alarm:
            phases.see("backlog growing", t, f"{msgs} messages in the queue")
        state["prev_msgs"] = msgs
        if state["lowered"] is None:
            lower_when_due(t, used, msgs, ctl)
        elif alarm:
            see_alarm_set(edge)
            if any(p.get("state") == "blocked" for n, p in status["processes"].items() if n.startswith("reader")):
                phases.see("connection blocked", t, "the publishing reader stopped reading its socket; the "
                                                    "publisher keeps writing until TCP's buffers are full")
            if rep.sent_rate == 0 and rep.received_rate > 0:
                phases.see("publishing stopped", t, f"sent 0 msg/s, received {rep.received_rate:.0f} msg/s")
        see_watcher_phases()
        if "alarm cleared" in phases.at and rep.sent_rate > 0:
            if phases.see("publishing resumed", t, f"sent {rep.sent_rate:.0f} msg/s, received "
                                                   f"{rep.received_rate:.0f} msg/s (the publisher catches up "
                                                   f"on what it was held back from)"):
                state["resumed_seconds"] = 0
            state["resumed_seconds"] += 1
        view.second(format_line(rep), states_line(status) + f"  | memory {used / MIB:.0f} MiB / watermark "
                    f"{limit / MIB:.0f} MiB{' ALARM' if alarm else ''}, queue {msgs}", status)
        pictures.take(status.get("management_port"), "alarm set" in phases.at, "alarm cleared" in phases.at)
        done = not phases.missing() and state["resumed_seconds"] >= RESUMED_SECONDS
        if done and watcher.restored is None:   # the watcher never restored it: a re-set alarm would strand
            ctl.request("set_watermark", value=DEFAULT_WATERMARK)   # the last publishes in TCP's buffers
        return done

    def lower_when_due(t: float, used: int, msgs: int, ctl) -> None:
        if t < 1 or not used:
            return
        line.add(msgs, used)
        fitted = line.fit()
        if fitted is None:
            return
        footprint, per_msg = fitted
        if used - footprint < 2 * headroom + LOWER_MARGIN_BYTES:
            return
        target = int(footprint + headroom)
        watcher.armed.set()
        reply = ctl.request("set_watermark", value=str(target))
        if not reply.get("ok"):
            print(f"creditflow demo: the broker refused the watermark: {reply.get('error')}", file=sys.stderr)
            return
        state["lowered"] = {"at_s": t, "target": target, "footprint": footprint, "per_message": per_msg,
                            "used": used, "messages": msgs}
        phases.see("watermark lowered", t, f"{target / MIB:.0f} MiB = footprint {footprint / MIB:.0f} MiB + "
                                           f"{args.headroom_mb} MiB; memory in use {used / MIB:.0f} MiB with "
                                           f"{msgs} messages held, {per_msg / KIB:.1f} KiB each")
        see_alarm_set(ctl.request("alarms").get("alarms", {}).get("memory", {}))

    def see_alarm_set(edge: dict) -> None:
        if edge.get("state") == "set" and edge.get("at_ns"):
            phases.see("alarm set", t_of(edge["at_ns"]), f"{edge.get('used', 0) / MIB:.1f} MiB used > "
                                                         f"{edge.get('limit', 0) / MIB:.1f} MiB allowed")

    def see_watcher_phases() -> None:
        with watcher.lock:
            edges = list(watcher.edges)
            backlog = list(watcher.backlog)
        for e in edges:
            if e.get("state") == "set":
                see_alarm_set(e)
        cleared = next((e for e in edges if e.get("state") == "clear" and "alarm set" in phases.at
                        and e.get("at_ns", 0) >= state["start_ns"] + phases.at["alarm set"] * 1e9), None)
        limit_ns = cleared["at_ns"] if cleared else None
        for at_ns, held in backlog:       # what the backlog was while publishers were blocked
            if limit_ns is not None and at_ns > limit_ns:
                break
            state["peak"] = max(state["peak"], held)
            if "publishing stopped" not in phases.at:
                continue
            peak = state["peak"]
            if held <= peak * DRAINED_FRACTION:
                phases.see("backlog drained", t_of(at_ns), f"{held} messages left of a peak of {peak}")
            elif held * 2 <= peak and "backlog drained" not in phases.at:
                phases.see("backlog halved", t_of(at_ns), f"{held} messages left of a peak of {peak} "
                                                          f"({100 * held / peak:.0f} %)")
        if cleared is None:
            return
        before = [held for at_ns, held in backlog if at_ns <= limit_ns]
        left = f", {before[-1]} messages left" if before else ""
        phases.see("alarm cleared", t_of(cleared["at_ns"]), f"{cleared.get('used', 0) / MIB:.1f} MiB used <= "
                                                            f"{cleared.get('limit', 0) / MIB:.1f} MiB allowed{left}")
        restored = watcher.restored
        if restored is not None and restored["ok"]:
            phases.see("watermark restored", t_of(restored["at_ns"]),
                       f"{DEFAULT_WATERMARK} of RAM ({(restored['limit'] or 0) / MIB:.0f} MiB), "
                       f"{restored['after_clear_ns'] / 1e6:.0f} ms after the alarm cleared")

    load = LoadConfig(producers=1, consumers=1, rate=args.rate, size=args.size, prefetch=args.prefetch,
                      consumer_latency_us=args.consumer_latency, duration_s=args.max_seconds, queue=queue,
                      drain_s=DRAIN_S)
    try:
        with view:
            summary, result = execute(cfg, load, on_second=on_second, on_log=view.log, on_drain=view.log,
                                      extra={"demo": vars(args)})
    finally:
        if watcher.ident is not None:
            watcher.stop()
    if state["start_ns"] is not None:
        see_watcher_phases()
    sets, clears = count_alarm_edges(os.path.join(run_dir, "broker.log"))
    summary["phases"] = phases.at
    summary["phase_notes"] = phases.notes
    summary["memory_timeline"] = state["mem"]
    summary["memory_line"] = state["lowered"]
    summary["memory_alarm_edges"] = {"set": sets, "cleared": clears}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print()
    print("What happened:")
    for text in phases.account():
        print(text)
    print(f"memory alarm: set {sets} time{'s' * (sets != 1)}, cleared {clears} time{'s' * (clears != 1)}")
    print(f"published {result.published}, delivered {result.delivered}, undelivered {result.undelivered}, "
          f"lost {result.lost}")
    report_code = run_report_if_available(run_dir)
    for line in pictures.finish():
        print(line)
    print(f"run directory: {run_dir}")
    problems = []
    if phases.missing():
        problems.append("not every phase was seen (" + ", ".join(phases.missing()) + ")")
    problems += [f"phases out of order: {p}" for p in phases.out_of_order()]
    if (sets, clears) != (1, 1):
        problems.append(f"the memory alarm was set {sets} and cleared {clears} times, not once each")
    if result.lost or result.undelivered:
        problems.append(f"{result.lost} messages were lost and {result.undelivered} not delivered")
    if watcher.error:
        problems.append(watcher.error)
    for p in problems:
        print(f"creditflow demo: {p}", file=sys.stderr)
    return EXIT_PHASE_MISSED if problems or report_code else 0


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
