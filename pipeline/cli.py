"""``creditflow``: the command line.

Exit codes: 0 ok, 2 bad usage or configuration (one-line reason on stderr),
3 a broker stage died, 4 port in use, 5 a run lost messages or the demo
missed a phase, 6 no broker answered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ipc.credit import CreditSpec, InvalidCreditSpec
from pipeline.stress.command import add_stress_parser, cmd_stress

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_LOST = 5
EXIT_NO_BROKER = 6
EXIT_POINTS_FAILED = 1          # sweep: some points did not finish cleanly
MIB = 1024 * 1024


class UsageError(Exception):
    """Raised when options are wrong; the CLI prints the reason on one line and exits 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


class IntermixedParser(Parser):
    """Options anywhere among the positionals, as rabbitmqctl takes them (``list_queues -q name messages``,
    ``delete_queue --if-empty q``): argparse's intermixed parsing, also when reached as a subcommand."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inner:                         # the intermixed parse's own two passes
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def credit_arg(text: str) -> CreditSpec:
    try:
        return CreditSpec.parse(text)
    except InvalidCreditSpec as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def nonneg_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def rate_arg(text: str) -> float:
    """A positive, finite number of messages a second; fractions are rates too (-r 0.5: one every 2 s)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected msg/s, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of msg/s, got {text}")
    return value


def queue_args_arg(text: str) -> tuple:
    """PerfTest's --queue-args: ``name=value,name=value``; integers and true/false become numbers and booleans."""
    pairs = []
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE[,NAME=VALUE...], got {item!r}")
        value = value.strip()
        if value.lower() in ("true", "false"):
            parsed = value.lower() == "true"
        else:
            try:
                parsed = int(value)
            except ValueError:
                parsed = value
        pairs.append((name.strip(), parsed))
    return tuple(pairs)


def step_arg(kind: str):
    """PerfTest's VALUE:SECONDS steps (--variable-rate 100:10); ``kind`` is float or int."""
    def parse(text: str) -> tuple:
        value, sep, seconds = text.partition(":")
        try:
            step = (kind(value), float(seconds))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected VALUE:SECONDS, got {text!r}") from None
        if not sep or step[0] < 0 or not 0 < step[1] < float("inf"):
            raise argparse.ArgumentTypeError(f"expected VALUE:SECONDS with SECONDS above 0, got {text!r}")
        return step
    return parse


def bool_arg(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


DEFAULT_MAX_MESSAGE_BYTES = 128 * 1024 * 1024     # RabbitMQ 3.10's max_message_size
MAX_MESSAGE_BYTES_LIMIT = 512 * 1024 * 1024       # RabbitMQ refuses a larger setting


def max_message_arg(text: str) -> int:
    value = pos_int(text)
    if value > MAX_MESSAGE_BYTES_LIMIT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_MESSAGE_BYTES_LIMIT} (512 MiB), got {value}")
    return value


def arena_mb_arg(text: str) -> int:
    from pipeline.broker.bodies import MAX_ARENA_MB
    value = nonneg_int(text)
    if value > MAX_ARENA_MB:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_ARENA_MB}, got {value}")
    return value


def user_arg(text: str) -> tuple[str, str]:
    name, sep, password = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME:PASSWORD, got {text!r}")
    return name, password


def pos_int(text: str) -> int:
    value = nonneg_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def watermark_arg(text: str) -> str:
    from alarms.errors import InvalidLimit
    from alarms.limits import parse_memory_watermark
    try:
        parse_memory_watermark(text)
    except InvalidLimit as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def disk_limit_arg(text: str) -> str:
    from alarms.errors import InvalidLimit
    from alarms.limits import parse_disk_free_limit
    try:
        parse_disk_free_limit(text)
    except InvalidLimit as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def management_port_arg(text: str):
    """--management-port: a port (0: any free one) or ``off``."""
    if text.lower() == "off":
        return "off"
    value = nonneg_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def port_arg(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    value = nonneg_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


MANAGEMENT_PORT = 15672         # RabbitMQ's management plugin's


def management_port(args) -> int | None:
    """The port the management API listens on, None for none. serve: 15672, or any free port when the
    broker's own --port is 0; run: off unless asked for."""
    given = getattr(args, "management_port", None)
    if given == "off":
        return None
    if given is not None:
        return given
    if getattr(args, "command", None) == "serve":
        return 0 if args.port == 0 else MANAGEMENT_PORT
    return None


BROKER_DESTS: set[str] = set()      # the dests add_broker_options makes (for run --uri's check)


def add_broker_options(p: argparse.ArgumentParser) -> None:
    before = {a.dest for a in p._actions}
    _add_broker_options(p)
    BROKER_DESTS.update(a.dest for a in p._actions if a.dest not in before)


def _add_broker_options(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("resource alarms")
    a.add_argument("--memory-watermark", type=watermark_arg, default="0.6",
                   help="vm_memory_high_watermark: fraction of RAM (0.6) or absolute (512MiB); 0 forces the alarm")
    a.add_argument("--memory-strategy", choices=("rss", "system"), default="rss",
                   help="rss: the broker's processes, shared pages once (default); system: host memory in use")
    a.add_argument("--disk-free-limit", type=disk_limit_arg, default="50MB",
                   help="disk_free_limit: absolute (50MB) or mem_relative:F")
    a.add_argument("--memory-poll-ms", type=pos_int, default=100, help="memory poll interval (default 100 ms)")
    a.add_argument("--paging-ratio", type=float, default=0.5,
                   help="queues page message bodies to disk past this fraction of the watermark (default 0.5)")
    g = p.add_argument_group("broker")
    g.add_argument("--credit", type=credit_arg, default=None, metavar="I,M",
                   help="credit_flow_default_credit {InitialCredit,MoreCreditAfter} (default 400,200; 0,0 disables)")
    g.add_argument("--store-credit", type=credit_arg, default=None, metavar="I,M",
                   help="msg_store_credit_disc_bound (default 4000,800)")
    g.add_argument("--channel-delay-us", type=nonneg_int, default=0, help="busy delay per message in each channel")
    g.add_argument("--queue-delay-us", type=nonneg_int, default=0, help="busy delay per message in each queue")
    g.add_argument("--store-delay-us", type=nonneg_int, default=0, help="busy delay per write in the store")
    g.add_argument("--fsync-interval-ms", type=pos_int, default=200, help="group-commit interval (default 200)")
    g.add_argument("--fsync-delay-ms", type=nonneg_int, default=0, help="extra delay per fsync (a slow disk)")
    g.add_argument("--store-file-mb", type=pos_int, default=16,
                   help="msg_store_file_size_limit in MiB: segment files roll over at this size (default 16)")
    g.add_argument("--confirm-after", choices=("fsync", "write"), default="fsync",
                   help="confirm persistent messages after fsync (default) or after write")
    g.add_argument("--heartbeat", type=nonneg_int, default=60, help="heartbeat seconds offered to clients")
    g.add_argument("--frame-max", type=pos_int, default=131072)
    g.add_argument("--channel-max", type=pos_int, default=2047)
    g.add_argument("--connection-max", type=pos_int, default=1000)
    g.add_argument("--handshake-timeout", type=nonneg_seconds, default=10.0,
                   help="seconds a client has from its TCP connect to connection.open (RabbitMQ's "
                        "handshake_timeout, default 10; 0: none)")
    g.add_argument("--pool", type=nonneg_int, default=None, metavar="N",
                   help="processes that run readers, and as many for channels and for queues, each serving "
                        "many (default: one per core for channels and queues, two per core for readers); "
                        "0: a process of its own for every connection, channel and queue")
    g.add_argument("--telemetry", choices=("on", "off"), default="on",
                   help="on (default): statistics snapshots every 100 ms and state changes in "
                        "DATA_DIR/telemetry for the report; off: neither (log, events and summary stay)")
    g.add_argument("--management-port", type=management_port_arg, default=None, metavar="PORT|off",
                   help="RabbitMQ's management API subset and Prometheus /metrics on 127.0.0.1:PORT (HTTP basic "
                        "auth with the broker's users; 0: any free port; off: none). Default: serve 15672 (any "
                        "free port with --port 0), run off")
    g.add_argument("--arena-mb", type=arena_mb_arg, default=None, metavar="MIB",
                   help="each reader host's arena for message bodies by reference (default 256: a steady flow "
                        "keeps to its first 64, a backlog has the rest; 0: every body by copy); smaller when "
                        "/dev/shm has less than twice what they need free")
    g.add_argument("--scheduling", choices=("batch", "normal"), default="batch",
                   help="batch (default): readers, channels, queues and the store run under Linux's SCHED_BATCH, "
                        "so a stage that wakes another runs its turn out instead of being preempted; normal: "
                        "the default policy")
    g.add_argument("--max-message-bytes", type=max_message_arg, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="max_message_size: largest message accepted (default 128 MiB, RabbitMQ's; at most "
                        "512 MiB); one bigger than a ring slot crosses it in pieces")


def broker_config(args, data_dir: str, port: int):
    from pipeline.broker.supervisor import RING_BYTES, BrokerConfig
    from ipc.credit import DEFAULT_CREDIT, MSG_STORE_CREDIT_DISC_BOUND
    ring_bytes = RING_BYTES
    return BrokerConfig(
        data_dir=data_dir, port=port,
        credit=args.credit or DEFAULT_CREDIT, store_credit=args.store_credit or MSG_STORE_CREDIT_DISC_BOUND,
        channel_delay_us=args.channel_delay_us, queue_delay_us=args.queue_delay_us,
        store_delay_us=args.store_delay_us, heartbeat_s=args.heartbeat, frame_max=args.frame_max,
        channel_max=args.channel_max, connection_max=args.connection_max,
        handshake_timeout_s=args.handshake_timeout,
        max_message_bytes=args.max_message_bytes, ring_bytes=ring_bytes,
        fsync_interval_ms=args.fsync_interval_ms, fsync_delay_ms=args.fsync_delay_ms,
        confirm_after=args.confirm_after, store_file_bytes=args.store_file_mb * 1024 * 1024,
        watchdog={"memory_limit": args.memory_watermark, "disk_limit": args.disk_free_limit,
                  "strategy": args.memory_strategy, "memory_interval_ms": args.memory_poll_ms},
        paging_ratio=args.paging_ratio, telemetry=args.telemetry == "on", management_port=management_port(args),
        scheduling=args.scheduling,
        **({} if args.pool is None else {"pool": args.pool, "reader_pool": args.pool}),
        **({} if args.arena_mb is None else {"arena_mb": args.arena_mb}))


def build_parser() -> Parser:
    parser = Parser(prog="creditflow", description="RabbitMQ's flow control, reproduced with real processes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    serve = sub.add_parser("serve", help="run the broker alone for outside AMQP clients")
    serve.add_argument("--port", type=nonneg_int, default=5672)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1, and ::1 beside it; 0.0.0.0 and ::)")
    serve.add_argument("--no-ipv6", action="store_true", help="no IPv6 listener beside the IPv4 one")
    serve.add_argument("--tls-port", type=nonneg_int, default=None,
                       help="also listen for AMQP over TLS (amqps, RabbitMQ's 5671); needs --cert and --key")
    serve.add_argument("--cert", default=None, help="PEM certificate (chain) for --tls-port")
    serve.add_argument("--key", default=None, help="PEM private key for --tls-port")
    serve.add_argument("--data-dir", default="creditflow-data")
    serve.add_argument("--user", type=user_arg, action="append", default=[], metavar="NAME:PASSWORD",
                       help="a user who may log in (repeatable), beside guest/guest; NAME guest changes its password")
    serve.add_argument("--loopback-users", default="guest", metavar="NAMES",
                       help="RabbitMQ's loopback_users: comma-separated users who may log in only over "
                            "loopback (default guest; none: no such restriction)")
    serve.add_argument("--definitions", default=None, metavar="FILE",
                       help="RabbitMQ's load_definitions: import this definitions file (as GET /api/definitions "
                            "or rabbitmqctl export_definitions writes it) once the broker is up")
    add_broker_options(serve)

    run = sub.add_parser("run", help="broker + PerfTest-style load, per-second lines, summary.json")
    run.add_argument("-x", "--producers", type=nonneg_int, default=1)
    run.add_argument("-y", "--consumers", type=nonneg_int, default=1)
    run.add_argument("-r", "--rate", type=rate_arg, default=None,
                     help="msg/s per producer, fractions too (0.5: one every 2 s; default unlimited)")
    run.add_argument("-s", "--size", type=nonneg_int, default=12, help="message body bytes")
    run.add_argument("-f", "--flag", action="append", default=[], choices=("persistent", "mandatory"),
                     help="message flags: persistent, mandatory")
    run.add_argument("-c", "--confirm", type=pos_int, default=None, help="max unconfirmed publishes per producer")
    run.add_argument("-q", "--qos", type=nonneg_int, default=0, help="consumer prefetch (0 = unlimited)")
    run.add_argument("-a", "--autoack", action="store_true", help="consumers use no-ack")
    run.add_argument("-z", "--time", type=pos_int, default=10, help="seconds to publish")
    run.add_argument("--drain-s", type=nonneg_seconds, default=30.0, metavar="SECONDS",
                     help="after -z, at most this many seconds for consumers to empty the queues (default 30)")
    run.add_argument("-u", "--queue", default="creditflow-perf", help="queue name")
    run.add_argument("-L", "--consumer-latency", type=nonneg_int, default=0, help="µs each consumer spends per message")
    run.add_argument("--run-dir", default=None, help="where to write the run (default runs/<time>)")
    run.add_argument("--port", type=nonneg_int, default=0, help="broker port (default: any free port)")
    run.add_argument("--metrics-port", type=port_arg, default=None, metavar="PORT",
                     help="serve the load's figures for Prometheus on 127.0.0.1:PORT/metrics while it runs "
                          "(PerfTest's perftest_* names; 0: any free port, printed and in config.json)")
    run.add_argument("--uri", default=None, metavar="amqp://USER:PASS@HOST:PORT/VHOST",
                     help="drive this broker (a RabbitMQ, a creditflow serve) instead of starting one; "
                          "the broker options below then do not apply")
    run.add_argument("--management-uri", default=None, metavar="http://USER:PASS@HOST:15672",
                     help="with --uri: sample RabbitMQ's management API each second (connection, channel and "
                          "queue states, alarms) into the run's telemetry, for creditflow report")
    run.add_argument("--plain", action="store_true", help="plain lines even on a terminal")
    run.add_argument("-o", "--output-file", default=None, metavar="FILE",
                     help="PerfTest's CSV: a row a second (rates, latency percentiles in µs)")
    run.add_argument("--json", default=None, metavar="FILE",
                     help="JSON summary: lavinmqperf's fields, then where every message went and per-connection "
                          "seconds in flow and blocked")
    t = run.add_argument_group("topology (PerfTest's flags)")
    t.add_argument("-e", "--exchange", default=None,
                   help="exchange to publish to (default: the default exchange; with several queues a fanout)")
    t.add_argument("-t", "--type", default=None, choices=("direct", "fanout", "topic", "headers"),
                   help="exchange type (default direct; fanout for several queues without -e)")
    t.add_argument("-k", "--routing-key", default=None,
                   help="routing key, every queue bound with it (default: each producer its own queue's name)")
    t.add_argument("-qp", "--queue-pattern", default=None, metavar="PATTERN",
                   help="queues named by PATTERN with %%d from --queue-pattern-from to --queue-pattern-to; "
                        "producers and consumers spread over them")
    t.add_argument("-qpf", "--queue-pattern-from", type=nonneg_int, default=1, metavar="N")
    t.add_argument("-qpt", "--queue-pattern-to", type=nonneg_int, default=None, metavar="N")
    t.add_argument("-qa", "--queue-args", type=queue_args_arg, default=(), metavar="NAME=VALUE,...",
                   help="queue.declare arguments, e.g. x-max-length=1000,x-overflow=reject-publish")
    t.add_argument("-ad", "--auto-delete", type=bool_arg, nargs="?", const=True, default=False,
                   metavar="true|false", help="declare the queues auto-delete (default false)")
    t.add_argument("-A", "--multi-ack-every", type=nonneg_int, default=0, metavar="N",
                   help="consumers ack every N messages with one multiple ack (default: once per socket read)")
    shape = run.add_argument_group("traffic shape")
    shape.add_argument("-C", "--pmessages", type=nonneg_int, default=0,
                       help="messages each producer sends, then stops (default: until -z)")
    shape.add_argument("-D", "--cmessages", type=nonneg_int, default=0,
                       help="messages each consumer takes, then stops (default: no limit)")
    shape.add_argument("-vr", "--variable-rate", type=step_arg(float), action="append", default=[],
                       metavar="RATE:SECONDS", help="publish RATE msg/s for SECONDS; repeat for steps, in turn")
    shape.add_argument("-vs", "--variable-size", type=step_arg(int), action="append", default=[],
                       metavar="BYTES:SECONDS", help="bodies of BYTES for SECONDS; repeat for steps, in turn")
    shape.add_argument("-vl", "--variable-latency", type=step_arg(int), action="append", default=[],
                       metavar="MICROSECONDS:SECONDS", help="consumer latency steps, in turn (as -L)")
    shape.add_argument("-prsd", "--producer-random-start-delay", type=nonneg_seconds, default=0.0,
                       metavar="SECONDS", help="each producer starts after a random delay up to SECONDS")
    shape.add_argument("-R", "--consumer-rate", type=rate_arg, default=None,
                       help="msg/s each consumer takes at most (default unlimited)")
    shape.add_argument("--step", default=None, metavar="DIMENSION=V1,V2,...",
                       help="steps within one run (RabbitTestTool): rate, size, inflight, prefetch, publishers or "
                            "consumers takes each value in turn for --step-seconds, with its own figures")
    shape.add_argument("--step-seconds", type=nonneg_seconds, default=None, metavar="SECONDS",
                       help="each step's publishing time (default -z)")
    shape.add_argument("--max-rate", action="store_true",
                       help="search for the maximum sustainable rate (OpenMessaging Benchmark's way): from -r "
                            "(default 10000 msg/s in all) the rate rises every 2 s while backlogs stay under "
                            "1,000 and falls when they grow; for -z seconds, then the rate found")
    add_broker_options(run)

    demo = sub.add_parser("demo", help="reproduce a memory alarm: publishers blocked, consumer drains, alarm clears")
    demo.add_argument("--rate", type=pos_int, default=6000, help="publisher msg/s (default 6000)")
    demo.add_argument("--size", type=pos_int, default=4000, help="message bytes (default 4000)")
    demo.add_argument("--consumer-latency", type=nonneg_int, default=300, help="µs the consumer spends per message")
    demo.add_argument("--prefetch", type=pos_int, default=100)
    demo.add_argument("--headroom-mb", type=pos_int, default=64,
                      help="watermark = the broker's footprint + this many MiB (default 64)")
    demo.add_argument("--memory-strategy", choices=("rss", "system"), default="rss")
    demo.add_argument("--max-seconds", type=pos_int, default=100, help="give up after this long")
    demo.add_argument("--run-dir", default=None)
    demo.add_argument("--plain", action="store_true")

    report = sub.add_parser("report", help="Spark report of one run, or several runs side by side")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--master", default=None, help="Spark master URL (default local[*])")
    report.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                        help="run on a Spark Connect server instead (needs the [connect] extra)")
    report.add_argument("--out", default=None, help="where to write a comparison of several runs")

    sweep = sub.add_parser("sweep", help="a grid of runs, each a Spark task, in one table and a comparison")
    sweep.add_argument("grid", metavar="GRID.toml", help="[run] options every point shares, [grid] lists to combine")
    sweep.add_argument("--master", default=None, help="Spark master URL (default local[PARALLEL])")
    sweep.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                       help="run on a Spark Connect server instead (needs the [connect] extra)")
    sweep.add_argument("--parallel", type=pos_int, default=1,
                       help="points run at once with the local master (default 1: a run needs the machine)")
    sweep.add_argument("--out", default=None, help="where to write the sweep (default sweeps/<grid>-<time>)")

    bench = sub.add_parser("bench", help="scenarios (median of N runs), micro-benchmarks, alarm reaction")
    bench.add_argument("--runs", type=pos_int, default=3)
    bench.add_argument("--seconds", type=pos_int, default=10, help="seconds per scenario run (default 10)")
    bench.add_argument("--tries", type=pos_int, default=20, help="alarm reaction tries (default 20)")
    bench.add_argument("--only", default=None,
                       help="run only what has this in its name: scenarios, micro-benchmarks, 'tracing', 'alarm'")
    bench.add_argument("--json", default=None, metavar="FILE")

    sub._parser_class = IntermixedParser
    ctl = sub.add_parser("ctl", help="inspect or steer a running broker, like rabbitmqctl")
    sub._parser_class = Parser
    ctl.add_argument("--data-dir", required=True, help="the broker's data directory or run directory")
    ctl.add_argument("--json", action="store_true", help="print the raw JSON answer")
    ctl.add_argument("-q", "--quiet", action="store_true", help="list-*: no 'Listing ...' line (rabbitmqctl's -q)")
    ctl.add_argument("-e", "--if-empty", action="store_true", help="delete-queue: only if it has no ready message")
    ctl.add_argument("-u", "--if-unused", action="store_true", help="delete-queue: only if it has no consumer")
    ctl.add_argument("action", type=lambda s: s.replace("_", "-"),     # rabbitmqctl's set_vhost_limits works too
                     choices=("status", "alarms", "set-watermark", "set-disk-free-limit", "set-vhost-limits",
                              "list-vhost-limits", "clear-vhost-limits", "close-connection", "delete-queue",
                              "purge-queue", "kill", "crash", "stop", *LIST_ACTIONS),
                     help="kill NAME: crash one stage at once, as SIGKILL would (one in a shared process alone); "
                          "crash NAME: make one stage in a shared process raise, as a bug in it would; "
                          "set-vhost-limits JSON: '{\"max-connections\": 100, \"max-queues\": 50}' "
                          "(negative: no limit); close-connection NAME [REASON]: the client gets 320 "
                          "CONNECTION_FORCED - REASON (NAME as list-connections name shows it, or reader-N); "
                          "delete-queue NAME [-e] [-u], purge-queue NAME; "
                          "list-queues|list-connections|list-channels [COLUMN ...]: "
                          "rabbitmqctl's columns (list-queues name state messages), tab-separated with a header")
    ctl.add_argument("value", nargs="*", help="the action's value, or list-* columns")
    add_stress_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        handler = {"serve": cmd_serve, "run": cmd_run, "ctl": cmd_ctl, "demo": cmd_demo,
                   "report": cmd_report, "sweep": cmd_sweep, "bench": cmd_bench, "stress": cmd_stress}[args.command]
        return handler(args)
    except UsageError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def cmd_serve(args) -> int:
    from pipeline.broker.supervisor import run_broker
    cfg = broker_config(args, os.path.abspath(args.data_dir), args.port)
    cfg.host = args.host
    cfg.ipv6 = not args.no_ipv6
    if args.tls_port is not None:
        check_tls(args)
        cfg.tls_port, cfg.tls_cert, cfg.tls_key = args.tls_port, os.path.abspath(args.cert), os.path.abspath(args.key)
    elif args.cert or args.key:
        raise UsageError("creditflow serve: --cert and --key go with --tls-port")
    cfg.users = {"guest": "guest", **dict(args.user)}
    cfg.loopback_users = tuple(n for n in args.loopback_users.split(",") if n and args.loopback_users != "none")
    if args.definitions is not None:
        cfg.definitions = definitions_plan(args.definitions, cfg.users)
    return run_broker(cfg)


def definitions_plan(path: str, users: dict[str, str]) -> list:
    """What ``--definitions FILE`` will make, checked whole before anything starts (as an import over HTTP)."""
    from pipeline.management import writes
    try:
        with open(path, "rb") as f:
            body = f.read()
        plan = writes.definitions_plan(writes.definitions_body(body), users, None)
        writes.check_definitions(plan)
    except OSError as exc:
        raise UsageError(f"creditflow serve: --definitions {path}: {exc.strerror or exc}") from None
    except writes.BadRequest as exc:
        reason = exc.reason if isinstance(exc.reason, str) else json.dumps(exc.reason)
        raise UsageError(f"creditflow serve: --definitions {path}: {reason}") from None
    return plan


def check_tls(args) -> None:
    """--tls-port needs a certificate and key that load; say which and why before anything starts."""
    import ssl
    if not args.cert or not args.key:
        raise UsageError("creditflow serve: --tls-port needs --cert and --key")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.cert, args.key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"creditflow serve: cannot use --cert {args.cert} / --key {args.key}: {exc}") from None


LIST_ACTIONS = ("list-queues", "list-connections", "list-channels")
CTL_CLOSE_REASON = "Closed via creditflow ctl"      # close-connection's text when none is given


def cmd_ctl(args) -> int:
    from pipeline.ctlclient import BrokerNotRunning, CtlClient
    if args.action in LIST_ACTIONS:
        return cmd_ctl_list(args)
    most = 2 if args.action == "close-connection" else 1
    if len(args.value) > most:
        raise UsageError(f"creditflow ctl: {args.action} takes at most {most} value(s), got {len(args.value)}")
    reason = args.value[1] if len(args.value) > 1 else CTL_CLOSE_REASON
    args.value = args.value[0] if args.value else None
    if args.action in ("set-watermark", "set-disk-free-limit", "set-vhost-limits", "kill", "crash", "close-connection",
                       "delete-queue", "purge-queue") and args.value is None:
        raise UsageError(f"creditflow ctl: {args.action} needs a value")
    try:
        with CtlClient(args.data_dir) as client:
            cmd = args.action.replace("-", "_")
            if args.action in ("kill", "crash"):
                reply = client.request(cmd, name=args.value)
            elif args.action == "close-connection":
                reply = client.request(cmd, name=args.value, reason=reason)
            elif args.action == "delete-queue":
                reply = client.request(cmd, queue=args.value, if_empty=args.if_empty, if_unused=args.if_unused)
            elif args.action == "purge-queue":
                reply = client.request(cmd, queue=args.value)
            elif args.value is not None:
                reply = client.request(cmd, value=args.value)
            else:
                reply = client.request(cmd)
    except BrokerNotRunning as exc:
        print(f"creditflow ctl: {exc}", file=sys.stderr)
        return EXIT_NO_BROKER
    if args.json or args.action not in ("status", "alarms"):
        print(json.dumps(reply, indent=2, default=str))
    elif args.action == "status":
        print(format_status(reply))
    else:
        alarms = reply.get("alarms", {})
        active = [src for src, a in alarms.items() if a.get("state") == "set"]
        print("Node reported alarms: " + ", ".join(active) if active else "Node reported no alarms")
    return EXIT_OK if reply.get("ok") else EXIT_USAGE


def cmd_ctl_list(args) -> int:
    """rabbitmqctl's list_queues / list_connections / list_channels, from the management API's views."""
    from pipeline.ctlclient import BrokerNotRunning, CtlClient
    from pipeline.management.views import LIST_HEADINGS, UnknownColumn, Views, format_cell, list_rows
    what = args.action.split("-", 1)[1]
    try:
        with CtlClient(args.data_dir) as client:
            status = client.request("status")
    except BrokerNotRunning as exc:
        print(f"creditflow ctl: {exc}", file=sys.stderr)
        return EXIT_NO_BROKER
    try:
        rows = list_rows(Views(status), what, args.value)
    except UnknownColumn as exc:
        raise UsageError(f"creditflow ctl: {args.action}: {exc}") from None
    if args.json:
        print(json.dumps([dict(zip(rows[0], r)) for r in rows[1:]], indent=2, default=str))
        return EXIT_OK
    if not args.quiet:
        print(LIST_HEADINGS[what])
    for row in rows:
        print("\t".join(format_cell(v) for v in row))
    return EXIT_OK


def format_status(status: dict) -> str:
    lines = [f"broker {status.get('node')} pid {status.get('pid')} port {status.get('port')} "
             f"run {status.get('run_id')}"]
    if status.get("management_port"):
        lines.append(f"management API and /metrics: http://127.0.0.1:{status['management_port']}/")
    for name, p in sorted(status.get("processes", {}).items()):
        if not p.get("alive"):
            continue
        extra = ""
        if p.get("kind") == "queue":
            extra = f" messages={p.get('messages')} unacked={p.get('unacked')} consumers={p.get('consumers')}"
        lines.append(f"  {name:<24} {p.get('state'):<9} pid {p.get('pid')}{extra}")
    alarms = [s for s, a in status.get("alarms", {}).items() if a.get("state") == "set"]
    if status.get("fd", {}).get("alarm"):
        alarms.append("file_descriptor_limit")
    lines.append("alarms: " + (", ".join(alarms) if alarms else "none"))
    for i, a in enumerate(status.get("arenas", [])):
        lines.append(f"arena b{i}: {a['allocated']} bodies so far, {a['held_slots']} held "
                     f"({a['held_body_bytes'] / MIB:.1f} MiB), {a['used_bytes'] / MIB:.1f} of "
                     f"{a['capacity_bytes'] / MIB:.0f} MiB in use, {a['refused']} sent inline for want of room"
                     + (", pressed" if a["pressure"] else ""))
    deaths = status.get("deaths", [])
    if deaths:
        lines.append("deaths:")
        now = status.get("now_ns", 0)
        for d in deaths:
            then = f"{(now - d['at_ns']) / 1e9:.1f} s ago" if now else ""
            after = {"restart": f"restarted as pid {d.get('restarted_pid')}",
                     "close_connection": "its connection closed",
                     "internal_error": "its connection closed with 541",
                     "queue_down": "given up: the queue stays down",
                     "no_watchdog": "given up: no alarms",
                     "no_management": "given up: no management API",
                     "stop_broker": "given up: the broker stops"}.get(d.get("action"), d.get("action", ""))
            lines.append(f"  {d['name']:<24} pid {d['pid']} {d['how']}, {then}: {after}")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    from pipeline.bench import run_bench
    return run_bench(args)


def cmd_report(args) -> int:
    for d in args.run_dirs:
        if not os.path.exists(os.path.join(d, "summary.json")):
            raise UsageError(f"creditflow report: {d} is not a run directory (no summary.json)")
    try:
        from pipeline.analytics.report import build_report
    except ImportError:
        print("creditflow report: the Spark report is not part of this build yet", file=sys.stderr)
        return EXIT_USAGE
    check_spark_target(args, "report")
    print(build_report(list(args.run_dirs), master=args.master, out_dir=args.out, remote=args.remote))
    return EXIT_OK


def check_spark_target(args, command: str) -> None:
    """--master and --remote exclude each other; --remote needs Spark Connect's client libraries."""
    if args.master and args.remote:
        raise UsageError(f"creditflow {command}: give --master or --remote, not both")
    if args.remote:
        import importlib.util
        missing = [m for m in ("grpc", "pandas", "google.protobuf") if importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(f"creditflow {command}: --remote needs Spark Connect's client "
                             f"(pip install 'creditflow[connect]'); missing {', '.join(missing)}")


def cmd_sweep(args) -> int:
    from pipeline.sweep import GridError, load_grid
    try:
        points = load_grid(args.grid)
    except GridError as exc:
        raise UsageError(f"creditflow sweep: {exc}") from None
    check_spark_target(args, "sweep")
    stem = os.path.splitext(os.path.basename(args.grid))[0]
    out_dir = args.out or os.path.join("sweeps", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    from pipeline.analytics.sweep import run_sweep
    done = run_sweep(points, out_dir, master=args.master, parallel=args.parallel, remote=args.remote)
    keys = list(points[0].values)
    print(" | ".join([*keys, "deliver msg/s", "consumer p99 ms", "bottleneck", "exit"]))
    for row in done["rows"]:
        rate, p99 = row.get("deliver_rate"), row.get("consumer_p99_us")
        print(" | ".join([*(str(row.get(k)) for k in keys), f"{rate:,.0f}" if rate is not None else "-",
                          f"{p99 / 1000:,.1f}" if p99 is not None else "-", str(row.get("bottleneck") or "-"),
                          str(row.get("exit_code"))]))
    print(f"{done['points']} point{'s' if done['points'] != 1 else ''} in {done['seconds']} s ({done['tasks_seconds']} s running them); "
          f"{done['failed']} failed")
    print(f"table: {done['parquet']}, {done['csv']}")
    if done["index"]:
        print(done["index"])
    return EXIT_OK if not done["failed"] else EXIT_POINTS_FAILED


def cmd_demo(args) -> int:
    from pipeline.demo import run_demo
    return run_demo(args)


def broker_options_given(args) -> list[str]:
    """The broker options (and --port) given on the command line with a value other than the default."""
    defaults = build_parser().parse_args(["run"])
    return sorted(f"--{dest.replace('_', '-')}" for dest in BROKER_DESTS | {"port"}
                  if getattr(args, dest) != getattr(defaults, dest))


def cmd_run(args) -> int:
    from pipeline.loadgen.config import InvalidLoadConfig
    from pipeline.runner import load_config, run_harness
    try:
        load = load_config(args)
    except InvalidLoadConfig as exc:
        raise UsageError(f"creditflow run: {exc}") from None
    if args.step:
        from pipeline.loadgen.steps import parse_step, step_configs
        if args.max_rate:
            raise UsageError("creditflow run: --step and --max-rate both drive the run: give one")
        try:
            step_configs(load, parse_step(args.step, args.step_seconds or load.duration_s))
        except InvalidLoadConfig as exc:
            raise UsageError(f"creditflow run: {exc}") from None
    elif args.step_seconds is not None:
        raise UsageError("creditflow run: --step-seconds goes with --step")
    if args.max_rate:
        if args.variable_rate or args.pmessages:
            raise UsageError("creditflow run: --max-rate sets the rate itself: no --variable-rate or -C")
        if not load.producers or not load.consumers:
            raise UsageError("creditflow run: --max-rate needs publishers and consumers (-x, -y)")
        if load.rate is None:
            from dataclasses import replace
            from pipeline.loadgen.maxrate import INITIAL_RATE
            load = replace(load, rate=INITIAL_RATE / load.producers)
    for what, path in (("-o", args.output_file), ("--json", args.json)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(f"creditflow run: {what} {path}: no such directory")
    if args.management_uri and not args.uri:
        raise UsageError("creditflow run: --management-uri goes with --uri (a broker creditflow starts "
                         "has its own telemetry)")
    if args.management_uri:
        from pipeline.loadgen.management import ManagementSampler
        try:
            ManagementSampler(args.management_uri)
        except InvalidLoadConfig as exc:
            raise UsageError(f"creditflow run: {exc}") from None
    if args.uri:
        given = broker_options_given(args)
        if given:
            raise UsageError(f"creditflow run: {', '.join(given)} only apply to a broker creditflow starts; "
                             "with --uri the broker is the one the URI names")
    elif load.producers and load.max_body_bytes > args.max_message_bytes:
        raise UsageError(f"creditflow run: messages of {load.max_body_bytes} bytes (-s) are over the broker's "
                         f"--max-message-bytes {args.max_message_bytes}, which would refuse every one (406); "
                         f"raise --max-message-bytes or lower -s")
    return run_harness(args, load)


if __name__ == "__main__":
    sys.exit(main())
