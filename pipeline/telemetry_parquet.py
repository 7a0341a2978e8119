"""Telemetry as Parquet: the tables' Arrow schemas and the JSONL -> Parquet compaction.

While a broker runs, :class:`pipeline.telemetry.Recorder` appends JSON lines
(cheap, crash-tolerant, no pyarrow in the broker). When it closes, it calls
:func:`compact`, which turns each ``NAME.jsonl`` of ``DATA_DIR/telemetry/``
into ``NAME.parquet``::

    NAME.jsonl --(20k lines at a time)--> Arrow table of NAME's schema
               --> ParquetWriter(.NAME.parquet.tmp, zstd) --> fsync
               --> os.replace(.NAME.parquet.tmp, NAME.parquet) --> fsync dir
               --> unlink NAME.jsonl

The JSONL goes only after the Parquet file is whole and in place, so a crash
or an error at any step leaves the data in one file or the other (or, in the
instant between replace and unlink, in both). A broker that was SIGKILLed
never compacts: its run keeps the JSONL, which ``pipeline.analytics.load``
reads as before. If ``NAME.parquet`` already exists (the data dir of an
earlier broker), its rows are copied first, so the new file appends to it as
the JSONL would have.

Conversion rules, the same as the Spark JSON reader's with an explicit schema:

* a line that is not a JSON object (a torn last line after a crash, a line
  glued to one) is skipped and counted (``skipped_lines``);
* fields the schema does not name go, as JSON text, into the ``extra`` column
  (stats and events; for an event, the keys of ``data`` its struct does not
  name too), so every statistic a stage reported is kept; missing fields are
  null;
* a value of the wrong type (a string where int64 is due) becomes null and is
  counted (``nulled_values``). Only a chunk that fails conversion as a whole
  is converted row by row, so clean telemetry pays nothing for this.

All timestamps and durations (``*_ns``) are int64 nanoseconds of the
machine-wide monotonic clock, as in the JSON lines. The schemas below are the
one definition of the tables: ``pipeline.analytics.load`` derives its Spark
schemas from them. They name only what the report reads; a stage's other
statistics are kept in ``extra``.

This module imports pyarrow, so only code that runs after the broker's stages
(``Recorder.close``) or outside the broker (analytics, tests) imports it.
Cost, measured on the 2-core machine for a 60 s run of 100 B messages (7.0 MB
of stats.jsonl, 10.7k snapshots, with ``extra``): 0.84 s, part of it pyarrow
importing pandas (when installed) on its first Python conversion. The Parquet
files come to about 9% of the JSONL's size (7.3 MB -> 634 kB).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import BinaryIO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage.segments import fsync_directory

CHUNK_LINES = 20_000
EXTRA = "extra"      # every field a row had beyond its schema's columns, as JSON text
COMPRESSION = "zstd"
TMP_PREFIX = "."
TMP_SUFFIX = ".tmp"

LINK_TYPE = pa.struct([(name, pa.int64())
                       for name in ("sent", "records", "in_flight", "max_in_flight", "overflow", "credit")])

STATS_SCHEMA = pa.schema([
    ("name", pa.string()),
    ("kind", pa.string()),
    ("pid", pa.int64()),
    ("at_ns", pa.int64()),
    ("state", pa.string()),
    ("blocked", pa.bool_()),
    ("block_count", pa.int64()),
    ("blocked_total_ns", pa.int64()),
    ("links", pa.map_(pa.string(), LINK_TYPE)),      # "sender->receiver" -> link statistics
    # reader
    ("publishes", pa.int64()),
    ("deliveries", pa.int64()),
    ("first_publish_ns", pa.int64()),
    ("last_publish_ns", pa.int64()),
    # queue
    ("messages", pa.int64()),
    # store
    ("fsyncs", pa.int64()),
    ("fsync_events", pa.list_(pa.list_(pa.int64()))),  # [[at_ns, duration_ns], ...]
    # watchdog
    ("memory_used", pa.int64()),
    ("memory_limit", pa.int64()),
    ("memory_alarm", pa.bool_()),
    ("disk_free", pa.int64()),
    ("disk_limit", pa.int64()),
    ("disk_alarm", pa.bool_()),
    # state changes: which peers a credit block waits on, and the connection's state
    ("blocked_by", pa.list_(pa.string())),
    ("block_started_ns", pa.int64()),
    ("conn_state", pa.string()),
    (EXTRA, pa.string()),
])

STATES_SCHEMA = pa.schema([
    ("at_ns", pa.int64()),
    ("name", pa.string()),
    ("kind", pa.string()),
    ("state", pa.string()),
])

EVENT_DATA_TYPE = pa.struct([
    ("duration_ns", pa.int64()),
    ("source", pa.string()),
    ("state", pa.string()),
    ("used", pa.int64()),
    ("free", pa.int64()),
    ("limit", pa.int64()),
    ("at_ns", pa.int64()),
    ("kind", pa.string()),
    ("pid", pa.int64()),
])

EVENTS_SCHEMA = pa.schema([
    ("at_ns", pa.int64()),
    ("event", pa.string()),
    ("name", pa.string()),
    ("data", EVENT_DATA_TYPE),
    (EXTRA, pa.string()),
])

TABLES: dict[str, pa.Schema] = {"stats": STATS_SCHEMA, "states": STATES_SCHEMA, "events": EVENTS_SCHEMA}

# What pyarrow raises for a Python value that does not fit the Arrow type.
_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError,
                      TypeError, ValueError)


class CompactionFailed(Exception):
    """Raised when one or more JSONL files could not be compacted; each one's JSONL is left as it was."""

    def __init__(self, failures: dict[str, str], results: dict[str, dict]):
        self.failures = failures
        self.results = results
        super().__init__("telemetry not compacted: " + "; ".join(f"{n}: {why}" for n, why in failures.items()))


def parse_lines(lines: list[bytes]) -> tuple[list[dict], int]:
    """The JSON objects among ``lines`` and how many non-blank lines were not one (torn or foreign)."""
    rows: list[dict] = []
    skipped = 0
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:                 # JSONDecodeError, UnicodeDecodeError
            if line.strip():
                skipped += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            skipped += 1
    return rows, skipped


def with_extra(rows: list[dict], schema: pa.Schema) -> list[dict]:
    """``rows`` with what ``schema`` does not name folded into its ``extra`` column (if it has one)."""
    if EXTRA not in schema.names:
        return rows
    names = set(schema.names)
    structs = {f.name: {sub.name for sub in f.type} for f in schema if pa.types.is_struct(f.type)}
    out = []
    for row in rows:
        rest = {k: v for k, v in row.items() if k not in names and k != "type"}
        for name, known in structs.items():
            value = row.get(name)
            if isinstance(value, dict):
                more = {k: v for k, v in value.items() if k not in known}
                if more:
                    rest[name] = more
        if rest:
            row = dict(row)
            row[EXTRA] = json.dumps(rest, separators=(",", ":"), sort_keys=True, default=str)
        out.append(row)
    return out


def to_table(rows: list[dict], schema: pa.Schema) -> tuple[pa.Table, int]:
    """``rows`` as a table of ``schema`` (extra fields dropped, missing null) and how many values were nulled."""
    try:
        return pa.Table.from_pylist(rows, schema=schema), 0
    except _CONVERSION_ERRORS:
        pass
    nulled = 0
    clean: list[dict] = []
    for row in rows:
        try:
            pa.Table.from_pylist([row], schema=schema)
            clean.append(row)
            continue
        except _CONVERSION_ERRORS:
            pass
        fixed = {}
        for field in schema:
            value = row.get(field.name)
            try:
                pa.array([value], type=field.type)
            except _CONVERSION_ERRORS:
                value = None
                nulled += 1
            fixed[field.name] = value
        clean.append(fixed)
    return pa.Table.from_pylist(clean, schema=schema), nulled


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: missing ones null, others cast (for files of older schemas)."""
    columns = []
    for field in schema:
        if field.name in table.column_names:
            columns.append(table.column(field.name).cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, type=field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _line_chunks(f: BinaryIO, chunk_lines: int) -> Iterator[list[bytes]]:
    while True:
        chunk = list(itertools.islice(f, chunk_lines))
        if not chunk:
            return
        yield chunk


def compact_file(jsonl_path: str, parquet_path: str, schema: pa.Schema,
                 chunk_lines: int = CHUNK_LINES) -> dict:
    """Convert one JSONL file into ``parquet_path`` (appending to an existing one), then delete the JSONL.

    Returns ``rows`` (in the Parquet file), ``jsonl_rows``, ``skipped_lines``, ``nulled_values``,
    ``jsonl_bytes`` and ``parquet_bytes``. Raises (and leaves the JSONL and any old Parquet file
    untouched) if anything fails before the new Parquet file is in place.
    """
    directory, base = os.path.split(parquet_path)
    tmp_path = os.path.join(directory, TMP_PREFIX + base + TMP_SUFFIX)
    jsonl_bytes = os.path.getsize(jsonl_path)
    rows = jsonl_rows = skipped = nulled = 0
    try:
        with open(tmp_path, "wb") as sink:
            writer = pq.ParquetWriter(sink, schema, compression=COMPRESSION)
            try:
                if os.path.lexists(parquet_path):
                    for batch in pq.ParquetFile(parquet_path).iter_batches(batch_size=chunk_lines):
                        writer.write_table(conform(pa.Table.from_batches([batch]), schema))
                        rows += batch.num_rows
                with open(jsonl_path, "rb") as source:
                    for lines in _line_chunks(source, chunk_lines):
                        parsed, bad = parse_lines(lines)
                        skipped += bad
                        if not parsed:
                            continue
                        table, n_null = to_table(with_extra(parsed, schema), schema)
                        nulled += n_null
                        writer.write_table(table)
                        jsonl_rows += table.num_rows
            finally:
                writer.close()
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(tmp_path, parquet_path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except OSError:
            pass
        raise
    fsync_directory(directory or ".")
    os.unlink(jsonl_path)
    return {"rows": rows + jsonl_rows, "jsonl_rows": jsonl_rows, "skipped_lines": skipped,
            "nulled_values": nulled, "jsonl_bytes": jsonl_bytes, "parquet_bytes": os.path.getsize(parquet_path)}


def compact(telemetry_dir: str, chunk_lines: int = CHUNK_LINES) -> dict[str, dict]:
    """Turn every ``NAME.jsonl`` of ``telemetry_dir`` (stats, states, events) into ``NAME.parquet``.

    Returns, per table compacted, the counts of :func:`compact_file` plus ``seconds``; a table without
    a JSONL file is left alone and not listed. Every table is tried; if any failed, raises
    :class:`CompactionFailed` naming them (with the results of the others), their JSONL kept.
    """
    results: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for name, schema in TABLES.items():
        jsonl_path = os.path.join(telemetry_dir, f"{name}.jsonl")
        if not os.path.exists(jsonl_path):
            continue
        started = time.perf_counter()
        try:
            result = compact_file(jsonl_path, os.path.join(telemetry_dir, f"{name}.parquet"), schema, chunk_lines)
        except Exception as e:  # noqa: BLE001 - reported per table; the JSONL is intact
            failures[name] = f"{type(e).__name__}: {e}"
            continue
        results[name] = dict(result, seconds=time.perf_counter() - started)
    if failures:
        raise CompactionFailed(failures, results)
    return results


__all__ = ["CHUNK_LINES", "COMPRESSION", "EXTRA", "with_extra", "CompactionFailed", "EVENTS_SCHEMA", "EVENT_DATA_TYPE", "LINK_TYPE",
           "STATES_SCHEMA", "STATS_SCHEMA", "TABLES", "compact", "compact_file", "conform", "parse_lines",
           "to_table"]
