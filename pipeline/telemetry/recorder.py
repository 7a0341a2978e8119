"""What a broker run leaves behind for analysis, written by the supervisor.

While the broker runs, files under ``DATA_DIR/telemetry/`` are JSON lines,
one object per line (timestamps are int64 nanoseconds of the system-wide
monotonic clock):

* ``stats.jsonl``  the ``statistics()`` snapshots stages pushed: every one (at
  most every 100 ms per busy stage, at once on a block or unblock that changes
  the state shown) while the broker runs up to ``STATS_ROWS_PER_S`` / 10
  stages; with more, each stage's at most every ``stages / STATS_ROWS_PER_S``
  seconds, and its last one when it ends, so a thousand busy connections do
  not write gigabytes (process states are kept apart, in ``states``, at every
  change);
* ``states.jsonl`` each process's state, a row per change (and one at its end);
* ``events.jsonl`` state changes: spawn, connection, alarm set/clear,
  stage deaths, fsyncs;
* ``final.json``   the supervisor's last status.

``DATA_DIR/broker.log`` holds the log lines. Writes are buffered and flushed
once a second so tracing stays off the hot path.

A snapshot's row is its message as :mod:`pipeline.telemetry.schema` defines
it (``row_of``: without ``type`` and the fields that are no column); an
event's ``data`` holds fields of :mod:`pipeline.telemetry.events`' ``EventData``
(``data_row``: without an alarm message's ``type``).

When the broker stops, :meth:`Recorder.close` compacts each ``NAME.jsonl``
into ``NAME.parquet`` (:mod:`pipeline.telemetry.parquet`: int64-ns columns,
zstd, the JSONL deleted only once the Parquet file is whole). pyarrow is
imported only then, after the stages have stopped, so it never adds to the
memory the broker's alarm measures. If compaction fails the JSONL stays and
the failure is logged; a broker that is SIGKILLed leaves JSONL too, and the
report reads either.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from pipeline.telemetry.events import data_row
from pipeline.telemetry.schema import row_of

FLUSH_INTERVAL_S = 1.0
STATS_ROWS_PER_S = 500          # snapshots written per second, at most, once stages are many


class Recorder:
    def __init__(self, data_dir: str):
        self.dir = os.path.join(data_dir, "telemetry")
        os.makedirs(self.dir, exist_ok=True)
        self.files = {name: open(os.path.join(self.dir, f"{name}.jsonl"), "a", encoding="utf-8")
                      for name in ("stats", "states", "events")}
        self.logfile = open(os.path.join(data_dir, "broker.log"), "a", encoding="utf-8")
        self.buffers: dict[str, list[str]] = {name: [] for name in self.files}
        self.last_flush = time.monotonic()
        self.written_ns: dict[str, int] = {}       # stage -> when its last snapshot was written
        self.held: dict[str, dict] = {}            # stage -> its newest snapshot not written yet

    def _put(self, name: str, obj: dict) -> None:
        self.buffers[name].append(json.dumps(obj, separators=(",", ":"), default=str))

    def stats(self, msg: dict, stages: int = 1, now_ns: int | None = None) -> None:
        """A stage's snapshot, written unless that stage's last one is more recent than the budget allows
        with ``stages`` stages running (then kept, and written by ``stage_ended`` or the next one due)."""
        for at_ns, duration_ns in msg.get("fsync_events", ()):
            self.event("fsync", msg.get("name", "store"), {"duration_ns": duration_ns}, at_ns=at_ns)
        name = msg.get("name", "")
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        gap_ns = stages * 1_000_000_000 // STATS_ROWS_PER_S
        if now_ns - self.written_ns.get(name, -gap_ns) < gap_ns:
            self.held[name] = msg
            return
        self.held.pop(name, None)
        self.written_ns[name] = now_ns
        self._put("stats", row_of(msg))

    def stage_ended(self, name: str) -> None:
        """``name`` is gone: its last snapshot is written if it was held, and it is forgotten."""
        msg = self.held.pop(name, None)
        if msg is not None:
            self._put("stats", row_of(msg))
        self.written_ns.pop(name, None)

    def state(self, now_ns: int, name: str, kind: str | None, state: str) -> None:
        self._put("states", {"at_ns": now_ns, "name": name, "kind": kind, "state": state})

    def event(self, kind: str, name: str, data: dict, at_ns: int | None = None) -> None:
        self._put("events", {"at_ns": at_ns or time.monotonic_ns(), "event": kind, "name": name,
                             "data": data_row(data)})

    def log(self, level: str, line: str) -> None:
        if self.logfile.closed:
            return
        self.logfile.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [{level}] {line}\n" if line else "\n")
        self.logfile.flush()  # log lines are few and someone may be tailing them

    def flush_if_due(self) -> None:
        if time.monotonic() - self.last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        for name, lines in self.buffers.items():
            if lines:
                self.files[name].write("\n".join(lines) + "\n")
                lines.clear()
            self.files[name].flush()
        self.logfile.flush()
        self.last_flush = time.monotonic()

    def close(self, final_status: dict, *, process_ends: bool = False) -> None:
        """Write what is buffered and the final status, then compact to Parquet (``process_ends``: this
        process ends next, so the compaction may keep pandas out: ``parquet.pandas_kept_out``)."""
        for name in list(self.held):
            self.stage_ended(name)
        self.flush()
        with open(os.path.join(self.dir, "final.json"), "w", encoding="utf-8") as f:
            json.dump(final_status, f, default=str)
        for f in self.files.values():
            f.close()
        self._compact(process_ends)
        self.logfile.close()

    def _compact(self, process_ends: bool) -> None:
        """Turn the closed JSONL files into Parquet; on any failure log it and keep the JSONL."""
        try:
            from pipeline.telemetry import parquet   # pyarrow: loaded only now, never while the broker runs
            with parquet.pandas_kept_out() if process_ends else contextlib.nullcontext():
                results = parquet.compact(self.dir)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the JSONL is still there
            self.log("warning", f"telemetry kept as JSON lines: {type(e).__name__}: {e}")
            return
        if results:
            self.log("info", "telemetry compacted to Parquet: " + ", ".join(
                f"{name} {r['rows']} rows, {r['jsonl_bytes']} -> {r['parquet_bytes']} B in {r['seconds']:.2f} s"
                + (f", {r['skipped_lines']} unreadable lines skipped" if r["skipped_lines"] else "")
                + (f", fields no schema class defines dropped: {', '.join(r['dropped_fields'])}"
                   if r.get("dropped_fields") else "")
                for name, r in results.items()))
