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

The schemas are derived, never written out: the stats table's columns are
the fields of the statistics classes of :mod:`pipeline.telemetry.schema`, and
the events table's ``data`` struct is :class:`~pipeline.telemetry.events.EventData`
(:func:`arrow_type`: int -> int64, float -> float64, bool, str -> string,
``X | None`` -> nullable X, tuples and lists -> list, ``dict[str, X]`` -> map,
a dataclass or NamedTuple -> struct). Every statistic a stage sends is a
column and every key of an event's data a field of ``data``; a field no class
defines is dropped and named in the result (``dropped_fields``; a key of a
struct column's object as ``column.key``), which the tests keep empty for
every stage and every event.

Conversion rules, the same as the Spark JSON reader's with an explicit schema:

* a line that is not a JSON object (a torn last line after a crash, a line
  glued to one) is skipped and counted (``skipped_lines``);
* a NamedTuple (a reader's ``notices``) arrives as a JSON array and becomes a
  struct; missing fields are null;
* a value of the wrong type (a string where int64 is due) becomes null and is
  counted (``nulled_values``). Only a chunk that fails conversion as a whole
  is converted row by row, so clean telemetry pays nothing for this.

Files written before the schemas were derived kept what their schema did not
name as JSON text in an ``extra`` column: a stats file the statistics beyond
the report's columns, an events file the keys of ``data`` beyond its first
nine fields (as ``{"data": {...}}``). They are converted when a later broker
appends to them: ``extra``'s fields fill the columns, and the struct fields,
that now hold them (:func:`conform`). The report reads such files the same
way (``pipeline.analytics.load``).

All timestamps and durations (``*_ns``) are int64 nanoseconds of the
machine-wide monotonic clock, as in the JSON lines.

This module imports pyarrow, so only code that runs after the broker's stages
(``Recorder.close``) or outside the broker (analytics, tests) imports it.
Cost, measured on the 2-core machine for a 60 s run of 100 B messages (7.0 MB
of stats.jsonl, 10.7k snapshots): 0.84 s, part of it pyarrow importing pandas
(when installed) on its first Python conversion, which the supervisor, ending
right after, keeps out (:func:`pandas_kept_out`). The Parquet files come to
about 9% of the JSONL's size (7.3 MB -> 634 kB).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import sys
import time
import types
import typing
from typing import BinaryIO, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage.segments import fsync_directory
from pipeline.telemetry import schema as stats_schema
from pipeline.telemetry.events import EventData
from pipeline.telemetry.schema import LinkStats

CHUNK_LINES = 20_000
EXTRA = "extra"      # files of before the derived schemas: what their columns did not hold, as JSON text
COMPRESSION = "zstd"
TMP_PREFIX = "."
TMP_SUFFIX = ".tmp"

_SCALARS = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}


def _is_namedtuple(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")


def _optional_of(tp):
    """``X`` for ``X | None`` (``Optional[X]``), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def _item_of(tp):
    """``X`` for ``tuple[X, ...]`` and ``list[X]``, else None."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and len(args) == 1:
        return args[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def arrow_type(tp) -> pa.DataType:
    """The Arrow type of a statistics field's Python type (see the module's docstring)."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    inner = _optional_of(tp)
    if inner is not None:
        return arrow_type(inner)
    item = _item_of(tp)
    if item is not None:
        return pa.list_(arrow_type(item))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict and len(args) == 2:
        return pa.map_(arrow_type(args[0]), arrow_type(args[1]))
    if dataclasses.is_dataclass(tp) or _is_namedtuple(tp):
        return pa.struct([(name, arrow_type(t)) for name, t in stats_schema.type_hints(tp).items()])
    raise TypeError(f"no Arrow type for {tp!r}")


def _shaper(tp) -> Callable | None:
    """How a JSON value of type ``tp`` becomes what Arrow takes: a NamedTuple's array becomes a dict."""
    inner = _optional_of(tp)
    if inner is not None:
        return _shaper(inner)
    if _is_namedtuple(tp):
        names = tp._fields
        return lambda v: dict(zip(names, v)) if isinstance(v, (list, tuple)) else v
    item = _item_of(tp)
    if item is not None:
        each = _shaper(item)
        if each is not None:
            return lambda v: [each(x) for x in v] if isinstance(v, (list, tuple)) else v
    return None


def shapers(columns) -> dict[str, Callable]:
    return {name: fn for name, tp in columns if (fn := _shaper(tp)) is not None}


LINK_TYPE = arrow_type(LinkStats)

STATS_SCHEMA = pa.schema([(name, arrow_type(tp)) for name, tp in stats_schema.stats_columns()])

STATES_SCHEMA = pa.schema([
    ("at_ns", pa.int64()),
    ("name", pa.string()),
    ("kind", pa.string()),
    ("state", pa.string()),
])

EVENT_DATA_TYPE = arrow_type(EventData)

EVENTS_SCHEMA = pa.schema([
    ("at_ns", pa.int64()),
    ("event", pa.string()),
    ("name", pa.string()),
    ("data", EVENT_DATA_TYPE),
])

TABLES: dict[str, pa.Schema] = {"stats": STATS_SCHEMA, "states": STATES_SCHEMA, "events": EVENTS_SCHEMA}
SHAPERS: dict[str, dict[str, Callable]] = {"stats": shapers(stats_schema.stats_columns())}

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


def shape(rows: list[dict], fns: dict[str, Callable]) -> list[dict]:
    """``rows`` with each value ``fns`` names made into what Arrow takes (a NamedTuple's array as a dict)."""
    if not fns:
        return rows
    out = []
    for row in rows:
        todo = [name for name in fns if row.get(name) is not None]
        if todo:
            row = dict(row)
            for name in todo:
                row[name] = fns[name](row[name])
        out.append(row)
    return out


def unnamed_fields(rows: list[dict], schema: pa.Schema) -> set[str]:
    """Keys of ``rows`` that ``schema`` has no column for, and keys of a struct column's object that its
    struct has no field for (as ``column.key``); a stats message's ``type`` is no field."""
    names = set(schema.names) | {"type"}
    structs = {f.name: {sub.name for sub in f.type} for f in schema if pa.types.is_struct(f.type)}
    unnamed: set[str] = set()
    for row in rows:
        unnamed |= row.keys() - names
        for column, known in structs.items():
            value = row.get(column)
            if isinstance(value, dict):
                unnamed |= {f"{column}.{k}" for k in value.keys() - known}
    return unnamed


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


def conform(table: pa.Table, schema: pa.Schema, fns: dict[str, Callable] | None = None) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: missing ones null, others cast (for files of older schemas).

    A file of before the derived schemas has an ``extra`` column of JSON text: the fields it holds fill
    the columns, and the fields of struct columns (an event's ``{"data": {...}}``), that now hold them
    (a value of the wrong type becomes null)."""
    if EXTRA in table.column_names and EXTRA not in schema.names:
        rows = []
        for row in table.to_pylist():
            extra = row.pop(EXTRA, None)
            try:
                more = json.loads(extra) if extra else {}
            except ValueError:
                more = {}
            if isinstance(more, dict):
                _fill(row, more)
            rows.append(row)
        return to_table(shape(rows, fns or {}), schema)[0]
    columns = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            columns.append(pa.chunked_array([_cast(chunk, field.type) for chunk in column.chunks], field.type))
        else:
            columns.append(pa.nulls(table.num_rows, type=field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _cast(array: pa.Array, to: pa.DataType) -> pa.Array:
    """``array`` as type ``to``; a struct field by field, by name, a field it lacks null (an older file's
    struct has fewer fields, and pyarrow before 19 casts only a struct of the same fields)."""
    if array.type == to or not (pa.types.is_struct(to) and pa.types.is_struct(array.type)):
        return array.cast(to)
    have = dict(zip((f.name for f in array.type), array.flatten()))
    children = [_cast(have[f.name], f.type) if f.name in have else pa.nulls(len(array), f.type) for f in to]
    return pa.StructArray.from_arrays(children, fields=list(to), mask=array.is_null())


def _fill(row: dict, more: dict) -> None:
    """Set each of ``row``'s fields that is None to ``more``'s value; an object fills an object field by field."""
    for k, v in more.items():
        have = row.get(k)
        if have is None:
            row[k] = v
        elif isinstance(have, dict) and isinstance(v, dict):
            _fill(have, v)


def shapers_for(schema: pa.Schema) -> dict[str, Callable]:
    """The value shapers of the table whose schema is ``schema`` (none for a schema of no table)."""
    for name, table_schema in TABLES.items():
        if table_schema is schema or table_schema.equals(schema):
            return SHAPERS.get(name, {})
    return {}


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
    ``dropped_fields`` (names no column or struct field holds: :func:`unnamed_fields`), ``jsonl_bytes`` and
    ``parquet_bytes``. Raises (and leaves the JSONL and any old Parquet file untouched) if anything fails
    before the new Parquet file is in place.
    """
    directory, base = os.path.split(parquet_path)
    tmp_path = os.path.join(directory, TMP_PREFIX + base + TMP_SUFFIX)
    jsonl_bytes = os.path.getsize(jsonl_path)
    rows = jsonl_rows = skipped = nulled = 0
    dropped: set[str] = set()
    fns = shapers_for(schema)
    try:
        with open(tmp_path, "wb") as sink:
            writer = pq.ParquetWriter(sink, schema, compression=COMPRESSION)
            try:
                if os.path.lexists(parquet_path):
                    for batch in pq.ParquetFile(parquet_path).iter_batches(batch_size=chunk_lines):
                        writer.write_table(conform(pa.Table.from_batches([batch]), schema, fns))
                        rows += batch.num_rows
                with open(jsonl_path, "rb") as source:
                    for lines in _line_chunks(source, chunk_lines):
                        parsed, bad = parse_lines(lines)
                        skipped += bad
                        if not parsed:
                            continue
                        dropped |= unnamed_fields(parsed, schema)
                        table, n_null = to_table(shape(parsed, fns), schema)
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
            "nulled_values": nulled, "dropped_fields": sorted(dropped), "jsonl_bytes": jsonl_bytes,
            "parquet_bytes": os.path.getsize(parquet_path)}


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


class _PandasMissing:
    """An import finder that finds pandas missing (:func:`pandas_kept_out`)."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@contextlib.contextmanager
def pandas_kept_out() -> Iterator[None]:
    """For a process that ends once it has compacted (the supervisor): pandas cannot be imported meanwhile.

    pyarrow imports pandas on its first conversion of Python values (to take pandas objects as well),
    which was half of a broker's stop (0.3 of 0.6 s); compaction converts plain values only. pyarrow
    then holds pandas missing for the rest of the process, so a process that goes on must not ask
    for this. A process that has imported pandas already is left as it is.
    """
    if "pandas" in sys.modules:
        yield
        return
    finder = _PandasMissing()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


__all__ = ["CHUNK_LINES", "COMPRESSION", "EXTRA", "CompactionFailed", "EVENTS_SCHEMA", "EVENT_DATA_TYPE",
           "LINK_TYPE", "SHAPERS", "STATES_SCHEMA", "STATS_SCHEMA", "TABLES", "arrow_type", "compact",
           "compact_file", "conform", "pandas_kept_out", "parse_lines", "shape", "shapers", "to_table",
           "unnamed_fields"]
