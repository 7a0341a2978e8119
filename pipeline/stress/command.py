"""``creditflow stress``: the command line of the stress catalogue.

    creditflow stress --list
    creditflow stress NAME [--uri amqp://USER:PASS@HOST:PORT/VHOST] [--run-dir DIR] [--report]
    creditflow stress all [--long] [--uri ...] [--run-dir DIR] [--report]

Each scenario ends in one verdict line; ``all`` ends in a table. Exit codes:
0 nothing failed (skipped scenarios included), 1 a scenario failed, 2 a bad
option (one line on stderr, before anything starts), 6 the ``--uri`` broker
cannot be reached.
"""

from __future__ import annotations

import os
import sys
import time

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_BROKER = 6


def add_stress_parser(sub) -> None:
    """Add ``stress`` to an argparse subparsers object (``creditflow``'s)."""
    p = sub.add_parser("stress", help="named stress scenarios, each ending in a PASS/FAIL verdict")
    p.add_argument("scenario", nargs="?", metavar="NAME|all", help="a scenario of --list, or all of them")
    p.add_argument("--list", action="store_true", help="describe every scenario and what it expects")
    p.add_argument("--uri", default=None, metavar="amqp://USER:PASS@HOST:PORT/VHOST",
                   help="run against this broker instead of starting one (scenarios that need broker options "
                        "are skipped)")
    p.add_argument("--run-dir", default=None,
                   help="where to write the run (one scenario: this directory; all: one directory per "
                        "scenario in it; default runs/stress-<time>)")
    p.add_argument("--long", action="store_true", help="with all: the long scenarios too")
    p.add_argument("--report", action="store_true", help="run the Spark report on each run directory")


class _Usage(Exception):
    """Raised when ``stress``'s options are wrong (the CLI's one-line reason, exit 2)."""


def _usage_error(message: str) -> Exception:
    """The CLI's UsageError when it is importable (so ``creditflow``'s main prints it), else our own."""
    try:
        from pipeline.cli import UsageError
        return UsageError(message)
    except ImportError:       # pragma: no cover - the CLI is part of the package
        return _Usage(message)


def cmd_stress(args) -> int:
    from pipeline.stress import catalogue
    if args.list:
        if args.scenario:
            raise _usage_error("creditflow stress: --list takes no scenario")
        for s in catalogue.CATALOGUE:
            print("\n".join(catalogue.describe(s)))
        return EXIT_OK
    names = chosen(args)
    address = None
    if args.uri:
        from pipeline.loadgen.config import InvalidLoadConfig
        from pipeline.loadgen.uri import parse_amqp_uri
        try:
            address = parse_amqp_uri(args.uri)
        except InvalidLoadConfig as exc:
            raise _usage_error(f"creditflow stress: {exc}") from None
    if args.report:
        import importlib.util
        if importlib.util.find_spec("pyspark") is None:
            raise _usage_error("creditflow stress: --report needs pyspark, which is not installed")
    if address is not None:
        reason = unreachable(address)
        if reason:
            print(f"creditflow stress: {reason}", file=sys.stderr)
            return EXIT_NO_BROKER
    return run(names, args, address)


def chosen(args) -> list[str]:
    from pipeline.stress import catalogue
    if not args.scenario:
        raise _usage_error("creditflow stress: name a scenario, or all (--list shows them)")
    if args.scenario == "all":
        return [s.name for s in catalogue.CATALOGUE if args.long or not s.long]
    if args.scenario not in catalogue.BY_NAME:
        raise _usage_error(f"creditflow stress: no scenario named {args.scenario!r} "
                           f"(one of {', '.join(catalogue.BY_NAME)}, or all)")
    if args.long:
        raise _usage_error("creditflow stress: --long goes with all")
    return [args.scenario]


def unreachable(address) -> str | None:
    """Why the --uri broker cannot be used (None when a connection and login work)."""
    from pipeline.amqp.errors import AmqpError
    from pipeline.loadgen.client import AmqpClient, ClientError
    try:
        AmqpClient(address.host, address.port, name="creditflow-stress probe", user=address.user,
                   password=address.password, vhost=address.vhost).close()
    except (ClientError, AmqpError, OSError) as exc:
        return f"cannot use {address.uri()}: {exc}"
    return None


def run(names: list[str], args, address) -> int:
    from pipeline.stress import catalogue
    from pipeline.stress.scenarios import run_scenario
    base = os.path.abspath(args.run_dir or os.path.join("runs", "stress-" + time.strftime("%Y%m%d-%H%M%S")))
    single = len(names) == 1 and args.scenario != "all"
    verdicts = []
    for name in names:
        run_dir = base if single and args.run_dir else os.path.join(base, name)
        print(f"== {name}: {catalogue.BY_NAME[name].expectation}", flush=True)
        verdict = run_scenario(name, run_dir, address)
        verdicts.append(verdict)
        if verdict.run_dir:
            print(f"run directory: {verdict.run_dir}")
            if args.report:
                report(verdict.run_dir)
        print(catalogue.verdict_line(verdict), flush=True)
    if not single:
        print()
        for line in catalogue.table(verdicts):
            print(line)
    return EXIT_FAILED if any(v.outcome == catalogue.FAIL for v in verdicts) else EXIT_OK


def report(run_dir: str) -> None:
    """The Spark report of one run directory; a failure is said, the verdict stands either way."""
    try:
        from pipeline.analytics.report import build_report
        print(f"Spark report: {build_report([run_dir])}")
    except Exception as exc:       # the scenario's verdict does not depend on the report
        print(f"Spark report of {run_dir} failed: {exc!r}", file=sys.stderr)


def main(argv=None) -> int:
    """``python -m pipeline.stress``: the ``stress`` command on its own, as ``creditflow stress`` runs it."""
    from pipeline.cli import Parser, UsageError
    parser = Parser(prog="creditflow")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_stress_parser(sub)
    try:
        return cmd_stress(parser.parse_args(["stress", *(sys.argv[1:] if argv is None else argv)]))
    except (UsageError, _Usage) as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
