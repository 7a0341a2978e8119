"""Per-second output: a rich live view on a terminal, plain lines otherwise.

Plain mode prints PerfTest's line and, under it, every broker process's state.
The live view keeps the latest line and a table of processes on screen and
prints log lines (alarms, deaths) above it, so a scroll-back still tells the
story.
"""

from __future__ import annotations

import sys

STATE_STYLE = {"running": "green", "flow": "yellow", "blocking": "yellow", "blocked": "red",
               "closing": "dim"}


class View:
    def __init__(self, plain: bool = False, stream=None):
        self.stream = stream or sys.stdout
        self.plain = plain or not self.stream.isatty()
        self.live = None

    def __enter__(self):
        if not self.plain:
            from rich.console import Console
            from rich.live import Live
            self.console = Console(file=self.stream)
            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None

    def log(self, line: str) -> None:
        if self.live is not None:
            self.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def second(self, line: str, states: str | None, status: dict) -> None:
        """PerfTest's line, then the broker's processes (``states``: None when the broker is not ours)."""
        if self.live is None:
            print(line, file=self.stream, flush=states is None)
            if states is not None:
                print(states, file=self.stream, flush=True)
            return
        from rich.table import Table
        from rich.text import Text
        self.console.print(line, markup=False, highlight=False)
        table = Table(title=None, expand=False, show_edge=False)
        for col in ("process", "state", "pid", "detail"):
            table.add_column(col)
        for name, p in sorted(status.get("processes", {}).items()):
            if not p.get("alive"):
                continue
            state = p.get("state", "")
            detail = ""
            if p.get("kind") == "queue":
                detail = f"{p.get('messages', 0)} ready, {p.get('unacked', 0)} unacked"
            elif p.get("kind") == "store":
                detail = f"{p.get('writes', 0)} writes, {p.get('fsyncs', 0)} fsyncs"
            table.add_row(name, Text(state, style=STATE_STYLE.get(state, "")), str(p.get("pid")), detail)
        alarms = [s for s, a in status.get("alarms", {}).items() if a.get("state") == "set"]
        if alarms:
            table.caption = "ALARM: " + ", ".join(alarms)
        self.live.update(table)
