"""``creditflow sweep``: a grid of ``creditflow run`` scenarios, without Spark.

A grid file is TOML. ``[run]`` holds the options every point shares and
``[grid]`` the options that vary, each a non-empty list; every combination of
the ``[grid]`` lists is one point. Keys are ``creditflow run``'s long option
names (``size``, ``credit``, ``consumer-latency``, ``time``...); ``true``
turns a flag on, ``false`` leaves it off::

    [run]
    producers = 1
    consumers = 1
    time = 5

    [grid]
    credit = ["400,200", "0,0"]
    size = [100, 4096]
    consumer-latency = [0, 200]

A ``stress`` key names scenarios of ``creditflow stress`` instead (``[grid]
stress = ["slow-consumer", "alarm"]``): each such point runs ``creditflow
stress NAME`` and its row carries the verdict and the key figure. A stress
point takes no other option, since a scenario sets its own load.

This module turns a grid file into :class:`Point`\\ s (every point's options
are checked with the ``run`` command's own parser before anything starts) and
runs one point: :func:`run_point`, the function each Spark task executes, runs
``creditflow run`` as a child process on the executor's machine and returns a
plain dict of what it measured. The Spark side is
:mod:`pipeline.analytics.sweep`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass

SET_BY_SWEEP = ("run-dir", "port", "plain")     # each point gets its own; a grid may not set them
POINT_GRACE_S = 120                             # start-up, drain and shutdown on top of the run's time
STRESS_KEY = "stress"                           # a grid key naming ``creditflow stress`` scenarios
STRESS_SECONDS = 60                             # a scenario's time limit before the grace (a long one: x4)
OUTPUT_TAIL_LINES = 20


class GridError(ValueError):
    """A grid file that cannot be swept; the message is one line."""


@dataclass(frozen=True)
class Point:
    """One combination of the grid."""

    index: int
    values: dict            # grid key -> value, in the grid's key order
    args: tuple             # ``creditflow run`` arguments (shared options, then this point's)
    name: str               # directory name: index and values
    seconds: int            # the run's load time (for the task's time limit)

    def to_task(self) -> dict:
        return {"index": self.index, "values": dict(self.values), "args": list(self.args), "name": self.name,
                "seconds": self.seconds}


def _option_args(key: str, value) -> list[str]:
    flag = f"--{key}" if len(key) > 1 else f"-{key}"
    if isinstance(value, bool):
        return [flag] if value else []
    if isinstance(value, (int, float, str)):
        return [flag, str(value)]
    raise GridError(f"{key}: {value!r} is not a number, string or true/false")


def _dir_name(index: int, values: dict) -> str:
    words = [f"{k}={v}" for k, v in values.items()]
    return re.sub(r"[^A-Za-z0-9=,.+_-]", "_", "-".join([f"p{index:02d}", *words]))[:120]


def load_grid(path: str) -> list[Point]:
    """The points of the grid file at ``path``; GridError says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise GridError(f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"{path}: not valid TOML ({exc})") from None
    return points_of(doc, path)


def points_of(doc: dict, origin: str = "grid") -> list[Point]:
    """The points of a parsed grid document (see the module docstring)."""
    unknown = set(doc) - {"run", "grid"}
    if unknown:
        raise GridError(f"{origin}: unknown table(s) {', '.join(sorted(unknown))}; expected [run] and [grid]")
    shared, grid = doc.get("run", {}), doc.get("grid")
    if not isinstance(shared, dict) or not isinstance(grid, dict) or not grid:
        raise GridError(f"{origin}: needs a [grid] table with at least one option to vary")
    for key in (*shared, *grid):
        if key.lstrip("-") in SET_BY_SWEEP:
            raise GridError(f"{origin}: {key} is set by the sweep for each point")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise GridError(f"{origin}: grid.{key} must be a non-empty list")
    if STRESS_KEY in shared or STRESS_KEY in grid:
        return _stress_points(shared, grid, origin)
    shared_args = [a for k, v in shared.items() for a in _option_args(k.lstrip("-"), v)]
    keys = list(grid)
    points = []
    for index, combo in enumerate(itertools.product(*(grid[k] for k in keys)), start=1):
        values = dict(zip(keys, combo))
        args = tuple(shared_args + [a for k, v in values.items() for a in _option_args(k.lstrip("-"), v)])
        seconds = _check_run_args(args, origin, values)
        points.append(Point(index, values, args, _dir_name(index, values), seconds))
    return points


def _stress_points(shared: dict, grid: dict, origin: str) -> list[Point]:
    """One point per scenario named by ``stress`` (in [run] or [grid]); it takes no other option."""
    from pipeline.stress.catalogue import BY_NAME
    others = sorted(k for k in (*shared, *grid) if k != STRESS_KEY)
    if others:
        raise GridError(f"{origin}: a stress scenario sets its own load; {', '.join(others)} cannot go with it")
    names = grid.get(STRESS_KEY, [shared.get(STRESS_KEY)])
    points = []
    for index, name in enumerate(names, start=1):
        if name not in BY_NAME:
            raise GridError(f"{origin}: no stress scenario named {name!r} (creditflow stress --list shows them)")
        values = {STRESS_KEY: name}
        seconds = STRESS_SECONDS * (4 if BY_NAME[name].long else 1)
        points.append(Point(index, values, ("stress", name), _dir_name(index, values), seconds))
    return points


def _check_run_args(args: tuple, origin: str, values: dict) -> int:
    """Parse a point's arguments with ``creditflow run``'s parser; returns its load seconds."""
    from pipeline.cli import UsageError, build_parser
    try:
        parsed = build_parser().parse_args(["run", *args])
    except UsageError as exc:
        where = ", ".join(f"{k}={v}" for k, v in values.items())
        reason = str(exc).splitlines()[0].removeprefix("creditflow run: ")
        raise GridError(f"{origin}: point {where}: {reason}") from None
    return parsed.time


# -- one point, on an executor ----------------------------------------------------------------------

def creditflow_command(*args: str) -> list[str]:
    """``creditflow`` of the interpreter running this code (the project's venv on every node)."""
    exe = os.path.join(os.path.dirname(sys.executable), "creditflow")
    if os.path.exists(exe):
        return [exe, *args]
    return [sys.executable, "-c", "import sys; from pipeline.cli import main; sys.exit(main())", *args]


def run_point(task: dict, out_dir: str) -> dict:
    """Run one point with ``creditflow run`` into OUT_DIR/points/NAME; what it measured, as a dict.

    The run is a process group of its own and is killed whole if it outlives its
    time limit, so a task never leaves a broker behind on the executor.
    """
    run_dir = os.path.join(out_dir, "points", task["name"])
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    started = time.monotonic()
    stress = STRESS_KEY in task["values"]
    command = (*task["args"], "--run-dir", run_dir) if stress else ("run", "--run-dir", run_dir, "--plain",
                                                                     *task["args"])
    proc = subprocess.Popen(creditflow_command(*command),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=task["seconds"] + POINT_GRACE_S)
    except subprocess.TimeoutExpired:
        out = f"the run did not finish within {task['seconds'] + POINT_GRACE_S} s and was killed"
    finally:
        _kill_group(proc)
    summary = {}
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        pass
    verdict = summary.get("stress") or {}
    return {"index": task["index"], "name": task["name"], "values": task["values"], "run_dir": run_dir,
            "exit_code": proc.returncode, "host": socket.gethostname(),
            "verdict": verdict.get("outcome"), "key_figure": verdict.get("key"),
            "task_seconds": round(time.monotonic() - started, 3), "summary": summary,
            "output_tail": "\n".join(out.splitlines()[-OUTPUT_TAIL_LINES:]) if proc.returncode else ""}


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


__all__ = ["GridError", "Point", "creditflow_command", "load_grid", "points_of", "run_point"]
