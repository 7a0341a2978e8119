"""``creditflow run``: a broker, PerfTest-style load against it, and the run directory.

The broker runs as a child process (the supervisor and its stages); the load
generator's publishers and consumers are separate processes that speak AMQP
to it over loopback. Every second the runner prints PerfTest's line plus the
state of every broker process (a rich live view on a terminal, plain lines
otherwise); after -z, a line a second while the consumers drain the queues
(the drain asks the broker for its queues' depths, ``broker_view``); at the
end it writes ``RUN_DIR/summary.json`` and prints where every message went
(delivered, undelivered, lost, rejected: ``loadgen.accounting``).

The load is checked before any process starts: a bad option is a
``InvalidLoadConfig`` raised by ``execute`` with nothing started.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import sys
import time
from dataclasses import replace

from pipeline.broker_cpu import CpuWindow
from pipeline.ctlclient import BrokerNotRunning, CtlClient, wait_for_broker
from pipeline.loadgen.accounting import BrokerView, QueueDepth
from pipeline.loadgen.config import InvalidLoadConfig, LoadConfig
from pipeline.broker.supervisor import BrokerConfig, run_broker

ALREADY_REAPED = -1             # stop_broker: the broker had exited and been waited for before
EXIT_LOAD_FAILED = 1             # a publisher or consumer could not connect or set up
EXIT_LOST = 5
EXIT_NO_BROKER = 6               # --uri names a broker that cannot be reached (the CLI's code for it too)
EXIT_PORT_IN_USE = 4            # --metrics-port cannot be bound (serve's code for its ports)
PLACEHOLDER_PORT = 5672          # a LoadConfig is checked with it before the broker has a port
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
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:            # reaped already: it died early and said why (wait_for_broker)
            return ALREADY_REAPED
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


def broker_view(status: dict) -> BrokerView:
    """The queues' depths and counters in a ``ctl status`` answer."""
    queues = {}
    for p in status.get("processes", {}).values():
        if p.get("kind") == "queue" and p.get("alive") and p.get("queue") is not None:
            queues[p["queue"]] = QueueDepth(messages=p.get("messages", 0), unacked=p.get("unacked", 0),
                                            enqueued=p.get("enqueued", 0), delivered=p.get("delivered", 0))
    return BrokerView(queues)


def drain_summary(result) -> dict:
    """``summary.json``'s ``drain``: why and when it ended, each queue's depth then (None if unknown),
    and how each publisher's connection ended."""
    drain = result.drain
    return {"end": drain.why, "seconds": drain.seconds,
            "queues": None if drain.queues is None else
            {q: {"messages": d.messages, "unacked": d.unacked} for q, d in drain.queues.items()},
            "publishers": dict(result.connections)}


def connection_times(result, status: dict) -> dict:
    """Per load connection: seconds blocked by alarms (connection.blocked, as the client saw it) and
    seconds in ``flow`` (credit flow, as the broker's reader for it recorded; None when the broker
    is not creditflow's own). Readers are matched by the connection name the client gave."""
    readers = {p.get("client_name"): p for p in status.get("processes", {}).values()
               if p.get("kind") == "reader" and p.get("client_name")}
    out = {}
    for worker in sorted(set(result.blocked_s) | set(result.connections)):
        reader = readers.get(f"creditflow-perf {worker}")
        seconds = (reader or {}).get("seconds") or {}
        out[worker] = {"blocked_s": result.blocked_s.get(worker, 0.0),
                       "flow_s": round(seconds.get("flow", 0.0), 3) if reader else None,
                       "running_s": round(seconds.get("running", 0.0), 3) if reader else None}
    return out


def max_rate_summary(search) -> dict:
    """The max-rate search's answer and every period it judged (``loadgen.maxrate``)."""
    return {"found": None if search.found is None else round(search.found, 1),
            "period_s": search.period_s,
            "periods": [{"rate": round(p.rate, 1), "sent_rate": round(p.sent_rate, 1),
                         "received_rate": round(p.received_rate, 1), "receive_backlog": p.receive_backlog,
                         "publish_backlog": p.publish_backlog, "sustained": p.sustained} for p in search.periods]}


def links_over_run(seen: dict, status: dict) -> dict:
    """``seen`` with the links of one ``ctl status`` merged in: each link's most ever in flight and
    messages sent over the run. A stage reports only the links it has open, so a link closed before the
    last status (a publisher's, once it hung up) keeps what an earlier one showed."""
    for name, now in status.get("links", {}).items():
        was = seen.get(name, {})
        seen[name] = {"max_in_flight": max(was.get("max_in_flight", 0), now.get("max_in_flight", 0)),
                      "sent": max(was.get("sent", 0), now.get("sent", 0))}
    return seen


def summarize(result, status: dict, config: dict, wall_s: float, search=None, steps=None,
              links: dict | None = None) -> dict:
    """The run's summary.json from the load's ``result`` and the broker's last ``status`` (``links``:
    the links over the whole run, ``links_over_run``; else those ``status`` shows)."""
    processes = {}
    for name, p in status.get("processes", {}).items():
        seconds = p.get("seconds") or {}
        total = seconds.get("total", 0.0)
        processes[name] = {
            "kind": p.get("kind"), "pid": p.get("pid"),
            "flow_fraction": round(seconds.get("flow", 0.0) / total, 4) if total else 0.0,
            "blocked_fraction": round(seconds.get("blocked", 0.0) / total, 4) if total else 0.0,
            "state_seconds": {k: round(v, 3) for k, v in seconds.items()},
            "blocked_seconds": round((p.get("blocked_total_ns") or 0) / 1e9, 3),
            "block_count": p.get("block_count", 0),
            "final_state": p.get("state"),
        }
        if p.get("kind") == "reader" and p.get("publishes"):
            first, stop = p.get("first_publish_ns") or 0, p.get("first_stop_ns") or 0
            processes[name]["first_stop_after_first_publish_s"] = round((stop - first) / 1e9, 4) if stop else None
    links = links if links is not None else links_over_run({}, status)
    alarms = [{"source": src, **{k: v for k, v in a.items() if k not in ("type",)}}
              for src, a in status.get("alarms", {}).items()]
    return {
        "published": result.published, "confirmed": result.confirmed, "nacked": result.nacked,
        "returned": result.returned, "delivered": result.delivered, "undelivered": result.undelivered,
        "lost": result.lost, "dropped": result.dropped, "rejected": result.rejected, "rejections": result.rejections,
        "skipped": result.skipped, "foreign": result.foreign, "gaps": result.gaps, "duplicates": result.duplicates,
        "reordered": result.reordered, "order": result.order,
        "connections": connection_times(result, status),
        "load_cpu": {"seconds": {w: round(v, 3) for w, v in sorted(result.cpu_s.items())},
                     "us_per_message": round(sum(result.cpu_s.values()) / result.published * 1e6, 2)
                     if result.published else None},
        "drain": drain_summary(result), "errors": list(result.errors),
        "publish_rate": round(result.publish_rate, 1), "deliver_rate": round(result.deliver_rate, 1),
        "latency_us": result.latency_us, "latency_histograms": result.histograms, "processes": processes, "links": links, "alarms": alarms,
        "deaths": status.get("deaths", []), "wall_seconds": round(wall_s, 3), "config": config,
        **({"max_rate": max_rate_summary(search)} if search is not None else {}),
        **({"steps": steps} if steps is not None else {}),
    }


def load_config(args) -> LoadConfig:
    """``creditflow run``'s options as a LoadConfig (raises InvalidLoadConfig). Without ``--uri`` the
    port is the broker's, known only once it has started; with it, the URI says where to go."""
    from pipeline.loadgen.uri import parse_amqp_uri
    where = {"host": "127.0.0.1", "port": PLACEHOLDER_PORT}
    if getattr(args, "uri", None):
        address = parse_amqp_uri(args.uri)
        where = {"host": address.host, "port": address.port, "user": address.user, "password": address.password,
                 "vhost": address.vhost}
    queues, exchange_type = (), getattr(args, "type", None)
    pattern = getattr(args, "queue_pattern", None)
    if pattern is not None:
        if args.queue_pattern_to is None:
            raise InvalidLoadConfig("--queue-pattern needs --queue-pattern-to (and --queue-pattern-from, default 1)")
        if args.queue_pattern_to < args.queue_pattern_from:
            raise InvalidLoadConfig(f"--queue-pattern-to {args.queue_pattern_to} is below --queue-pattern-from "
                                    f"{args.queue_pattern_from}")
        try:
            queues = tuple(pattern % i for i in range(args.queue_pattern_from, args.queue_pattern_to + 1))
        except (TypeError, ValueError):
            raise InvalidLoadConfig(f"--queue-pattern needs one %d, got {pattern!r}") from None
        if pattern % args.queue_pattern_from == pattern % (args.queue_pattern_from + 1):
            raise InvalidLoadConfig(f"--queue-pattern needs one %d, got {pattern!r}")
        if exchange_type is None and args.exchange is None:
            exchange_type = "direct"           # PerfTest: producers and consumers spread over the queues
    elif getattr(args, "queue_pattern_to", None) is not None:
        raise InvalidLoadConfig("--queue-pattern-to goes with --queue-pattern")
    shape = {}
    if hasattr(args, "pmessages"):
        shape = dict(exchange=args.exchange, exchange_type=exchange_type, routing_key=args.routing_key,
                     queue_args=args.queue_args, auto_delete=args.auto_delete, multi_ack_every=args.multi_ack_every,
                     pmessages=args.pmessages, cmessages=args.cmessages, variable_rate=tuple(args.variable_rate),
                     variable_size=tuple(args.variable_size), variable_latency=tuple(args.variable_latency),
                     start_delay_s=args.producer_random_start_delay, consumer_rate=args.consumer_rate)
    return LoadConfig(producers=args.producers, consumers=args.consumers, rate=args.rate, size=args.size,
                      persistent="persistent" in args.flag, mandatory="mandatory" in args.flag,
                      confirm=args.confirm, prefetch=args.qos, autoack=args.autoack, duration_s=args.time,
                      consumer_latency_us=args.consumer_latency, queue=args.queue, drain_s=args.drain_s,
                      queues=queues, **shape, **where)


class BrokerUnreachable(Exception):
    """Raised when the broker a ``--uri`` names cannot be connected to (or refuses the login) at the start."""


def management_line(clock) -> str:
    """``  RabbitMQ: connections 2 running, 1 flow; channels ...; queues ...`` from the sampled states."""
    counts: dict[str, dict[str, int]] = {}
    for name, p in clock.procs.items():
        if not p.ended:
            by_state = counts.setdefault(p.kind, {})
            by_state[p.state] = by_state.get(p.state, 0) + 1
    parts = [f"{label} " + ", ".join(f"{n} {state}" for state, n in sorted(counts[kind].items()))
             for kind, label in (("reader", "connections"), ("channel", "channels"), ("queue", "queues"))
             if kind in counts]
    return "  RabbitMQ: " + "; ".join(parts) if parts else "  RabbitMQ: nothing open"


def redact(arg: str) -> str:
    """``arg`` with the password of any URI in it left out (``--uri=amqp://u:p@h/`` -> ``--uri=amqp://u@h/``)."""
    return re.sub(r"((?:amqps?|https?)://[^:@/\s]*):[^/\s]*@", r"\1@", arg)


def shown_config(load: LoadConfig) -> dict:
    """The load's options for config.json and summary.json: everything but the password."""
    return {k: v for k, v in vars(load).items() if k != "password"}


def run_planned(load: LoadConfig, plan, on_step=None, **kwargs):
    """``run_load`` once, or once per step of ``plan`` (``loadgen.steps``) against the same broker;
    ``(result, step rows or None)``, the steps' results combined into one."""
    from pipeline.loadgen.harness import run_load
    from pipeline.loadgen.steps import combine, step_configs, step_row
    if plan is None:
        return run_load(load, **kwargs), None
    results, rows = [], []
    for value, step_load in zip(plan.values, step_configs(load, plan)):
        results.append(run_load(step_load, **kwargs))
        rows.append(step_row(plan, value, results[-1]))
        if on_step is not None:
            on_step(rows[-1])
    return combine(results), rows


def execute_remote(load: LoadConfig, run_dir: str, *, management_uri: str | None = None, on_second=None,
                   on_drain=None, extra: dict | None = None, search=None, plan=None, on_step=None):
    """Run ``load`` against the broker it names (``--uri``): nothing is started but the load's own
    processes. The run directory holds config.json, seconds.jsonl and summary.json, as with a broker
    of our own; with ``management_uri`` (a RabbitMQ's management API) its connections', channels' and
    queues' states and its alarms are sampled each second into ``telemetry/`` too, for the report.
    ``on_second(rep, states, None)`` gets those states counted by kind (a line), or None.
    Raises ``BrokerUnreachable`` before anything starts if a first connection (or the management
    API) cannot be used."""
    from pipeline.amqp.errors import AmqpError
    from pipeline.loadgen.client import AmqpClient, ClientError
    from pipeline.loadgen.harness import run_load
    from pipeline.loadgen.management import ManagementSampler, ManagementUnreachable, Rows
    from pipeline.loadgen.uri import BrokerAddress
    address = BrokerAddress(load.host, load.port, load.user, "", load.vhost).uri()
    try:
        AmqpClient(load.host, load.port, name="creditflow-perf probe", user=load.user, password=load.password,
                   vhost=load.vhost).close()
    except (ClientError, AmqpError, OSError) as exc:      # AmqpError: what answered does not speak AMQP 0-9-1
        raise BrokerUnreachable(f"cannot use {address}: {exc}") from None
    sampler = recorder = None
    if management_uri:
        sampler = ManagementSampler(management_uri)
        try:
            sampler.check()
        except ManagementUnreachable as exc:
            raise BrokerUnreachable(f"cannot use the management API: {exc}") from None
    os.makedirs(run_dir, exist_ok=True)
    if sampler is not None:
        from pipeline import telemetry
        recorder = telemetry.Recorder(run_dir)
    started = time.monotonic()
    argv = [redact(a) for a in sys.argv[1:]]
    config = {"broker": {"uri": address}, "load": shown_config(load), "argv": argv, **(extra or {})}
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, default=str)
    seconds = SecondsLog(run_dir)

    def sample(last: bool = False) -> str | None:
        if sampler is None:
            return None
        line = None
        try:
            rows = sampler.sample(time.monotonic_ns())
        except ManagementUnreachable as exc:
            rows, line = Rows(), f"  management API: {exc}"
        if last:                           # every span still open ends, whether or not that fetch worked
            rows.states += sampler.observer.finish(time.monotonic_ns()).states
        for row in rows.states:
            recorder.state(row["at_ns"], row["name"], row["kind"], row["state"])
        for row in rows.stats:
            recorder.stats(row)
        for row in rows.events:
            recorder.event(row["event"], row["name"], row["data"], at_ns=row["at_ns"])
        recorder.flush_if_due()
        return line or management_line(sampler.observer.clock)

    def each_second(rep):
        seconds.write(rep, {})
        line = sample()
        return on_second(rep, line, None) if on_second is not None else None

    def each_drain_second(elapsed_s, delivered, expected, _depths):
        """The drain ends on what the consumers received, never on the management API's depths:
        RabbitMQ's statistics lag (collect_statistics_interval, 5 s by default), so a queue they show
        empty may not be. They are shown, as RabbitMQ last reported them."""
        sample()
        depths = sampler.depths() if sampler is not None else None
        shown = None if depths is None else BrokerView({q: QueueDepth(messages=r, unacked=u)
                                                        for q, (r, u) in depths.items() if q in load.queues})
        if on_drain is not None:
            on_drain(drain_line(elapsed_s, delivered, expected, shown))

    try:
        result, steps = run_planned(load, plan, on_step, on_second=each_second, broker=None,
                                    on_drain=each_drain_second, search=search)
        sample(last=True)
    finally:
        seconds.close()
        if recorder is not None:
            recorder.close({"management": sampler.base})
    summary = summarize(result, {}, config, time.monotonic() - started, search, steps)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary, result


def execute(cfg: BrokerConfig, load, *, on_second=None, on_log=None, on_drain=None, extra: dict | None = None,
            search=None, plan=None, on_step=None):
    """Start a broker on ``cfg.data_dir``, run load against it, stop it, and leave the run directory.

    ``load`` is the LoadConfig (its port becomes the broker's), or ``make_load(port)`` building
    it; either is checked before anything starts (InvalidLoadConfig). ``on_second(rep, status,
    ctl)`` is called every second (return True to stop early); ``on_drain(line)`` gets a line a
    second of the drain; ``on_log(line)`` gets the broker's warning and error lines as they
    appear. Writes config.json, seconds.jsonl and summary.json; returns ``(summary, result)``.
    """
    from pipeline.loadgen.harness import run_load

    make_load = load if callable(load) else (lambda port: replace(load, port=port))
    make_load(PLACEHOLDER_PORT)
    run_dir = cfg.data_dir
    os.makedirs(run_dir, exist_ok=True)
    started = time.monotonic()
    pid = start_broker(cfg)
    try:
        info = wait_for_broker(run_dir, pid=pid)
        load = make_load(info["port"])
        config = {"broker": {k: (str(v) if hasattr(v, "__dataclass_fields__") else v)
                             for k, v in vars(cfg).items()},
                  "load": shown_config(load), "argv": sys.argv[1:], **(extra or {})}
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        tail = LogTail(os.path.join(run_dir, "broker.log"))
        seconds = SecondsLog(run_dir)
        cpu = CpuWindow()
        links: dict = {}
        with CtlClient(run_dir) as ctl:
            def each_second(rep):
                status = ctl.request("status")
                links_over_run(links, status)
                seconds.write(rep, status)
                cpu.observe(status, rep.delivered)
                for line in tail.new_lines():
                    if on_log is not None:
                        on_log(line)
                return on_second(rep, status, ctl) if on_second is not None else None

            def view():
                try:
                    return broker_view(ctl.request("status"))
                except (BrokerNotRunning, OSError, ValueError):
                    return None

            def each_drain_second(elapsed_s, delivered, expected, depths):
                if on_drain is not None:
                    on_drain(drain_line(elapsed_s, delivered, expected, depths))

            result, steps = run_planned(load, plan, on_step, on_second=each_second, broker=view,
                                        on_drain=each_drain_second, search=search)
            final = ctl.request("status")
            links_over_run(links, final)
        seconds.close()
        for line in tail.new_lines():
            if on_log is not None:
                on_log(line)
    finally:
        code = stop_broker(pid, run_dir)
    summary = summarize(result, final, config, time.monotonic() - started, search, steps, links)
    summary["broker_cpu"] = cpu.summary()
    summary["broker_exit_code"] = code
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary, result


def depths_text(queues: dict | None) -> str:
    """``q 12 ready, 3 unacked, ...`` from queue -> {"messages", "unacked"}."""
    if queues is None:
        return "queue depths unknown"
    return ", ".join(f"{q} {d['messages']} ready, {d['unacked']} unacked" for q, d in sorted(queues.items())) \
        or "no queue reported"


def drain_line(elapsed_s: float, delivered: int, expected: int, view: BrokerView | None) -> str:
    queues = None if view is None else {q: {"messages": d.messages, "unacked": d.unacked}
                                        for q, d in view.queues.items()}
    return f"draining {elapsed_s:.0f} s: delivered {delivered} of {expected}; {depths_text(queues)}"


def outcome_lines(summary: dict) -> list[str]:
    """What ``creditflow run`` prints at the end; the last line counts every message."""
    lines = []
    drain = summary["drain"]
    if drain["seconds"] or drain["end"] != "delivered":
        open_ = sorted(name for name, how in drain["publishers"].items() if how == "open")
        lines.append(f"drain: ended after {drain['seconds']:.1f} s ({drain['end']}); {depths_text(drain['queues'])}"
                     + (f"; {', '.join(open_)} still sending (close not answered)" if open_ else ""))
    for reason, n in sorted(summary["rejections"].items()):
        lines.append(f"rejected {n}: {reason}")
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    if summary.get("skipped"):
        lines.append(f"skipped {summary['skipped']} sends: publishers stalled (blocked, flow, CPU) and the rate "
                     "limiter did not burst to catch up; their latency is in the consumer figures")
    times = [c for c in summary.get("connections", {}).values() if c.get("flow_s") is not None]
    if times and any(c["flow_s"] or c["blocked_s"] for c in times):
        lines.append(f"publishing connections: {sum(c['flow_s'] for c in times):.1f} s in flow, "
                     f"{sum(c['blocked_s'] for c in summary['connections'].values()):.1f} s blocked by alarms "
                     f"(summed over {len(times)}; per connection in summary.json)")
    disorder = {q: o for q, o in summary.get("order", {}).items() if any(o.values())}
    for q, o in sorted(disorder.items()):
        lines.append(f"order in {q}: {o['gaps']} missing, {o['duplicates']} duplicates, {o['reordered']} late")
    if summary.get("foreign"):
        lines.append(f"received {summary['foreign']} messages from another tool (PerfTest/omq layout): "
                     "latency measured, order not checked")
    lines.append(f"published {summary['published']}, delivered {summary['delivered']}, "
                 f"undelivered {summary['undelivered']}, lost {summary['lost']}, "
                 + (f"dropped {summary['dropped']} (by the queues' length limit or TTL), "
                    if summary.get("dropped") else "")
                 + f"rejected {summary['rejected']}; "
                 f"publish {summary['publish_rate']:.0f} msg/s, deliver {summary['deliver_rate']:.0f} msg/s")
    return lines


def steps_table(rows: list[dict]) -> list[str]:
    """The steps of a ``--step`` run, a line each, aligned."""
    if not rows:
        return []
    keys = list(rows[0])
    cells = [keys] + [[f"{r.get(k, ''):,}" if isinstance(r.get(k), (int, float)) else str(r.get(k, ''))
                       for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]


def max_rate_line(found: dict, producers: int) -> str:
    periods = found["periods"]
    if found["found"] is None:
        return (f"max sustainable rate: not found ({len(periods)} periods of {found['period_s']} s, none held; "
                "run longer with -z, or start lower with -r)")
    held = sum(p["sustained"] for p in periods)
    return (f"max sustainable rate: {found['found']:,.0f} msg/s ({producers} publisher(s) together; the highest "
            f"rate held for a whole {found['period_s']} s period with both backlogs under 1,000; {held} of "
            f"{len(periods)} periods held)")


def write_outputs(args, summary: dict, result) -> None:
    """``-o``: PerfTest's CSV, a row a second; ``--json``: the JSON summary (``loadgen.outputs``)."""
    from pipeline.loadgen.outputs import json_summary, perftest_csv
    if getattr(args, "output_file", None):
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(perftest_csv(result.run_id, result.seconds))
    if getattr(args, "json", None):
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_summary(summary, result.window_s), f, indent=2)
            f.write("\n")


def run_harness(args, load: LoadConfig | None = None) -> int:
    """``creditflow run``: ``load`` already checked by the CLI (built from ``args`` if None)."""
    from pipeline.cli import broker_config
    from pipeline.loadgen.harness import WorkerFailed
    from pipeline.loadgen.report import format_line
    from pipeline.view import View

    load = load if load is not None else load_config(args)
    run_dir = os.path.abspath(args.run_dir or default_run_dir())
    view = View(plain=args.plain)

    plan = None
    if getattr(args, "step", None):
        from pipeline.loadgen.steps import parse_step
        plan = parse_step(args.step, args.step_seconds or load.duration_s)

    def each_step(row):
        view.log("step done: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    search = None
    if getattr(args, "max_rate", False):
        from pipeline.loadgen.maxrate import RateSearch
        search = RateSearch(load.rate * load.producers, load.copies_consumed)

    load_metrics = extra = None
    if getattr(args, "metrics_port", None) is not None:
        from pipeline.loadgen.metrics import MetricsServer
        try:
            load_metrics = MetricsServer(args.metrics_port)
        except OSError as exc:
            print(f"creditflow run: --metrics-port {args.metrics_port}: {exc}", file=sys.stderr)
            return EXIT_PORT_IN_USE
        extra = {"metrics_port": load_metrics.port}
        print(f"load metrics (PerfTest's perftest_* names): http://127.0.0.1:{load_metrics.port}/metrics", flush=True)

    def each_second(rep, status, ctl):
        if load_metrics is not None:
            load_metrics.update(rep)
        return view.second(format_line(rep), states_line(status), status)
    try:
        if getattr(args, "uri", None):
            def each_remote_second(rep, line, _ctl):
                if load_metrics is not None:
                    load_metrics.update(rep)
                return view.second(format_line(rep), line, {})
            try:
                with view:
                    summary, result = execute_remote(load, run_dir, management_uri=args.management_uri,
                                                     on_second=each_remote_second, on_drain=view.log,
                                                     search=search, plan=plan, on_step=each_step, extra=extra)
            except BrokerUnreachable as exc:
                print(f"creditflow run: {exc}", file=sys.stderr)
                return EXIT_NO_BROKER
        else:
            cfg = broker_config(args, run_dir, args.port)
            with view:
                summary, result = execute(cfg, load, on_second=each_second, on_drain=view.log, on_log=view.log,
                                          search=search, plan=plan, on_step=each_step, extra=extra)
    except WorkerFailed as exc:          # e.g. a declare the broker refused (406 inequivalent arg)
        print(f"creditflow run: the load could not start: {exc}", file=sys.stderr)
        return EXIT_LOAD_FAILED
    finally:
        if load_metrics is not None:
            load_metrics.stop()
    print(f"run directory: {run_dir}")
    write_outputs(args, summary, result)
    for line in outcome_lines(summary):
        print(line)
    if search is not None:
        print(max_rate_line(summary["max_rate"], load.producers))
    if plan is not None:
        for line in steps_table(summary["steps"]):
            print(line)
    return EXIT_LOST if summary["lost"] else 0
