"""Reading a run directory into Spark DataFrames.

A run directory (``creditflow run`` / ``creditflow demo``) holds::

    summary.json              totals, latency percentiles, per-process summary, config
    seconds.jsonl             one load-generator report a second (time_s, rates, latency)
    telemetry/stats.parquet   every statistics() snapshot a stage pushed
    telemetry/states.parquet  each process's state, a row per change
    telemetry/events.parquet  spawn, connection, alarm_set/alarm_clear, stage_died, fsync, ...

All timestamps are int64 nanoseconds of the machine-wide monotonic clock, so
the broker's files and the load generator's ``seconds.jsonl`` share one axis.

The broker writes its telemetry as ``NAME.jsonl`` while it runs and compacts
each into ``NAME.parquet`` when it stops (:mod:`pipeline.telemetry.parquet`).
The Spark schemas here are derived from its Arrow schemas, which are derived
from the statistics classes of :mod:`pipeline.telemetry.schema`: every field a
stage reports is a column, under the name ``ctl status`` shows, and an
event's ``data`` is a struct of the fields of ``EventData``
(:mod:`pipeline.telemetry.events`). A broker that was SIGKILLed never
compacted, so ``NAME.jsonl`` is read too: the table is the Parquet file's rows
followed by the JSONL's (both exist only when a later broker on the same data
directory was killed), and an empty DataFrame of the schema when neither file
exists. Either way the DataFrame has exactly the schema's columns, and a
JSONL line that is no JSON object (a torn last line) is dropped, as
compaction drops it. A NamedTuple field (a reader's ``notices``) is a JSON
array in the JSONL and a struct in the DataFrame.

Runs recorded before the schemas were derived kept only the report's columns
and put every other statistic, as JSON text, in an ``extra`` column of
``stats.parquet``; ``events.parquet`` kept there the keys of ``data`` beyond
its first nine fields, as ``{"data": {...}}``. They are still read: the
columns such a file lacks, and the struct fields it has no value in, are
taken from its ``extra`` (:func:`_read_parquet`), so an old run's report is
what it was, and its other statistics are columns as in a new run.

``seconds.jsonl`` is the load generator's ``SecondReport``
(:mod:`pipeline.loadgen.harness`) with the ``at_ns`` the run adds; its schema
names the fields the report reads, under their one spelling.

With a cluster master the run directory must be on a path every executor can
read.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, from_arrow_type
from pyspark.sql.types import ArrayType, DoubleType, LongType, StringType, StructField, StructType

from pipeline.telemetry import parquet as tables

# The telemetry tables are defined once, by the statistics and event data classes; the Arrow schemas are derived
# from them, and these from the Arrow schemas.
LINK_SCHEMA: StructType = from_arrow_type(tables.LINK_TYPE)
STATS_SCHEMA: StructType = from_arrow_schema(tables.STATS_SCHEMA)
STATES_SCHEMA: StructType = from_arrow_schema(tables.STATES_SCHEMA)
EVENTS_SCHEMA: StructType = from_arrow_schema(tables.EVENTS_SCHEMA)
TELEMETRY_SCHEMAS = {"stats": STATS_SCHEMA, "states": STATES_SCHEMA, "events": EVENTS_SCHEMA}
# Columns whose structs (NamedTuples) travel in JSON as arrays: read as arrays of text, then made structs.
ARRAY_STRUCTS = {name: frozenset(fns) for name, fns in tables.SHAPERS.items()}
_CORRUPT = "_corrupt_record"


_PERCENTILES_SCHEMA = StructType([StructField(p, DoubleType())
                                  for p in ("count", "min", "p50", "p75", "p95", "p99", "max")])

# The fields of the load generator's SecondReport the report reads, and the at_ns a run adds to each line.
SECONDS_SCHEMA = StructType(
    [StructField(n, DoubleType()) for n in ("time_s", "sent_rate", "confirmed_rate", "received_rate")]
    + [StructField("at_ns", LongType()),
       StructField("consumer", _PERCENTILES_SCHEMA), StructField("confirm", _PERCENTILES_SCHEMA)])


class NotARunDirectory(ValueError):
    """Raised when a path given to the report holds no run (no summary.json and no telemetry)."""


@dataclass(frozen=True)
class RunFrames:
    """One run directory, as DataFrames plus its (small) summary and config."""

    run_dir: str
    label: str
    summary: dict
    stats: DataFrame
    states: DataFrame
    events: DataFrame
    seconds: DataFrame | None     # None when the run has no seconds.jsonl (a broker alone)


def _url(path: str) -> str:
    return "file://" + os.path.abspath(path)


def _as_text_arrays(schema: StructType, names: frozenset[str]) -> StructType:
    """``schema`` with the columns ``names`` (arrays of structs) as arrays of arrays of text, the form in
    which JSON carries a NamedTuple (Spark's JSON reader takes any value as text)."""
    return StructType([StructField(f.name, ArrayType(ArrayType(StringType()))) if f.name in names else f
                       for f in schema.fields])


def _structs_of_arrays(column: Column, array_type: ArrayType) -> Column:
    """An array of arrays of text (NamedTuples from JSON) as ``array_type``, an array of structs."""
    fields = array_type.elementType.fields
    return F.transform(column, lambda x: F.struct(*[x[i].cast(f.dataType).alias(f.name)
                                                    for i, f in enumerate(fields)])).cast(array_type)


def _select(df: DataFrame, schema: StructType, arrays: frozenset[str]) -> DataFrame:
    return df.select(*[_structs_of_arrays(F.col(f.name), f.dataType).alias(f.name) if f.name in arrays
                       else F.col(f.name) for f in schema.fields])


def _read_jsonl(spark: SparkSession, path: str, schema: StructType,
                arrays: frozenset[str] = frozenset()) -> DataFrame:
    """JSON lines read with ``schema``, lines that are no JSON object dropped (as compaction skips them).

    Spark reads such a line (a torn last line) as a row of nulls with the line in the corrupt-record
    column; a line with one value of the wrong type also lands there but keeps its other values.
    ``arrays``: the columns whose structs JSON carries as arrays.
    """
    json_schema = _as_text_arrays(schema, arrays)
    with_corrupt = StructType(json_schema.fields + [StructField(_CORRUPT, StringType())])
    df = (spark.read.schema(with_corrupt).option("mode", "PERMISSIVE")
          .option("columnNameOfCorruptRecord", _CORRUPT).json(_url(path)))
    nothing_parsed = functools.reduce(lambda a, b: a & b, [F.col(n).isNull() for n in schema.fieldNames()])
    return _select(df.where(~(F.col(_CORRUPT).isNotNull() & nothing_parsed)), schema, arrays)


def _read_parquet(spark: SparkSession, path: str, schema: StructType, arrays: frozenset[str]) -> DataFrame:
    """A Parquet table of ``schema``. A file of before the derived schemas has an ``extra`` column of JSON
    text: the columns the file lacks are taken from there, and a struct column's fields (an event's
    ``data``) from the object of its name there, where the file has no value."""
    in_file = set(pq.read_schema(path).names)
    if tables.EXTRA not in in_file:
        return spark.read.schema(schema).parquet(_url(path)).select(*schema.fieldNames())
    structs = {f.name for f in schema.fields if f.name in in_file and isinstance(f.dataType, StructType)}
    from_extra = StructType([f for f in schema.fields if f.name not in in_file or f.name in structs])
    df = spark.read.schema(StructType(schema.fields + [StructField(tables.EXTRA, StringType())])).parquet(_url(path))
    parsed = F.from_json(F.col(tables.EXTRA), _as_text_arrays(from_extra, arrays))
    columns = []
    for f in schema.fields:
        if f.name in structs:
            filled = F.struct(*[F.coalesce(F.col(f.name).getField(sub.name), parsed.getField(f.name).getField(sub.name))
                                .alias(sub.name) for sub in f.dataType.fields])
            columns.append(F.when(F.col(f.name).isNull() & parsed.getField(f.name).isNull(), F.lit(None))
                           .otherwise(filled).cast(f.dataType).alias(f.name))
        elif f.name in in_file:
            columns.append(F.col(f.name))
        elif f.name in arrays:
            columns.append(_structs_of_arrays(parsed.getField(f.name), f.dataType).alias(f.name))
        else:
            columns.append(parsed.getField(f.name).alias(f.name))
    return df.select(*columns)


def _read_telemetry(spark: SparkSession, telemetry_dir: str, name: str) -> DataFrame:
    """``NAME.parquet`` and/or ``NAME.jsonl`` of ``telemetry_dir`` as one DataFrame of NAME's schema."""
    schema = TELEMETRY_SCHEMAS[name]
    arrays = ARRAY_STRUCTS.get(name, frozenset())
    parts = []
    parquet = os.path.join(telemetry_dir, f"{name}.parquet")
    if os.path.isfile(parquet):
        parts.append(_read_parquet(spark, parquet, schema, arrays))
    jsonl = os.path.join(telemetry_dir, f"{name}.jsonl")
    if os.path.exists(jsonl) and os.path.getsize(jsonl) > 0:
        parts.append(_read_jsonl(spark, jsonl, schema, arrays))
    if not parts:
        return spark.createDataFrame([], schema)
    return parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_run(spark: SparkSession, run_dir: str) -> RunFrames:
    """DataFrames over ``run_dir``'s telemetry; raises NotARunDirectory if it has none."""
    telemetry = os.path.join(run_dir, "telemetry")
    summary_path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(summary_path) and not os.path.isdir(telemetry):
        raise NotARunDirectory(f"{run_dir} is not a run directory (no summary.json, no telemetry/)")
    summary = _read_json(summary_path)
    if not summary.get("config"):
        summary = dict(summary, config=_read_json(os.path.join(run_dir, "config.json")))
    seconds_path = os.path.join(run_dir, "seconds.jsonl")
    seconds = None
    if os.path.exists(seconds_path) and os.path.getsize(seconds_path) > 0:
        seconds = spark.read.schema(SECONDS_SCHEMA).json(_url(seconds_path))
    return RunFrames(
        run_dir=os.path.abspath(run_dir),
        label=os.path.basename(os.path.normpath(os.path.abspath(run_dir))),
        summary=summary,
        stats=_read_telemetry(spark, telemetry, "stats"),
        states=_read_telemetry(spark, telemetry, "states"),
        events=_read_telemetry(spark, telemetry, "events"),
        seconds=seconds,
    )


__all__ = ["ARRAY_STRUCTS", "EVENTS_SCHEMA", "LINK_SCHEMA", "NotARunDirectory", "RunFrames", "STATES_SCHEMA",
           "SECONDS_SCHEMA", "STATS_SCHEMA", "TELEMETRY_SCHEMAS", "load_run"]
