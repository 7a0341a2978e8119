"""Reading a run directory into Spark DataFrames.

A run directory (``creditflow run`` / ``creditflow demo``) holds::

    summary.json              totals, latency percentiles, per-process summary, config
    seconds.jsonl             one load-generator report a second (time_s, rates, latency)
    telemetry/stats.parquet   every statistics() snapshot a stage pushed
    telemetry/states.parquet  each process's state, a row per change
    telemetry/events.parquet  spawn, connection, alarm_set/alarm_clear, stage_died, fsync

All timestamps are int64 nanoseconds of the machine-wide monotonic clock, so
the broker's files and the load generator's ``seconds.jsonl`` share one axis.

The broker writes its telemetry as ``NAME.jsonl`` while it runs and compacts
each into ``NAME.parquet`` when it stops (:mod:`pipeline.telemetry_parquet`,
whose Arrow schemas are the one definition of these tables; the Spark schemas
here are derived from them). A broker that was SIGKILLed never compacted, so
``NAME.jsonl`` is read too: the table is the Parquet file's rows followed by
the JSONL's (both exist only when a later broker on the same data directory
was killed), and an empty DataFrame of the schema when neither file exists.
Either way the DataFrame has exactly the schema's columns, and a JSONL line
that is no JSON object (a torn last line) is dropped, as compaction drops it.

The telemetry schemas name only the fields the report uses: a stage that adds
fields costs nothing, one that drops a field leaves a null column, and no job
is spent inferring a schema from megabytes of snapshots. ``seconds.jsonl``'s
field names still move, so its schema lists every known spelling of a field
and :func:`pick` takes the first that holds a value.

With a cluster master the run directory must be on a path every executor can
read.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, from_arrow_type
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

from pipeline import telemetry_parquet as tables

# The telemetry tables are defined once, in Arrow, next to the compaction that writes them.
LINK_SCHEMA: StructType = from_arrow_type(tables.LINK_TYPE)


def _report_columns(schema):
    """The table's columns the report reads: all but ``extra`` (a JSON line keeps it inline)."""
    return schema.remove(schema.get_field_index(tables.EXTRA)) if tables.EXTRA in schema.names else schema


STATS_SCHEMA: StructType = from_arrow_schema(_report_columns(tables.STATS_SCHEMA))
STATES_SCHEMA: StructType = from_arrow_schema(_report_columns(tables.STATES_SCHEMA))
EVENTS_SCHEMA: StructType = from_arrow_schema(_report_columns(tables.EVENTS_SCHEMA))
TELEMETRY_SCHEMAS = {"stats": STATS_SCHEMA, "states": STATES_SCHEMA, "events": EVENTS_SCHEMA}
_CORRUPT = "_corrupt_record"


_PERCENTILES_SCHEMA = StructType([StructField(p, DoubleType())
                                  for p in ("count", "min", "p50", "p75", "p95", "p99", "max")])

# The load generator's SecondReport, with the older and alternative spellings of
# the fields the report reads (a missing spelling is a null column; see SECONDS_SPELLINGS).
SECONDS_SCHEMA = StructType(
    [StructField(n, DoubleType()) for n in ("time_s", "time", "t_s", "sent_rate", "publish_rate", "sent",
                                            "confirmed_rate", "confirm_rate", "confirmed", "received_rate",
                                            "deliver_rate", "received")]
    + [StructField("at_ns", LongType()),
       StructField("consumer", _PERCENTILES_SCHEMA), StructField("confirm", _PERCENTILES_SCHEMA),
       StructField("latency_us", StructType([StructField("consumer", _PERCENTILES_SCHEMA),
                                             StructField("confirm", _PERCENTILES_SCHEMA)]))])


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


def _read_jsonl(spark: SparkSession, path: str, schema: StructType) -> DataFrame:
    """JSON lines read with ``schema``, lines that are no JSON object dropped (as compaction skips them).

    Spark reads such a line (a torn last line) as a row of nulls with the line in the corrupt-record
    column; a line with one value of the wrong type also lands there but keeps its other values.
    """
    with_corrupt = StructType(schema.fields + [StructField(_CORRUPT, StringType())])
    df = (spark.read.schema(with_corrupt).option("mode", "PERMISSIVE")
          .option("columnNameOfCorruptRecord", _CORRUPT).json(_url(path)))
    nothing_parsed = functools.reduce(lambda a, b: a & b, [F.col(n).isNull() for n in schema.fieldNames()])
    return df.where(~(F.col(_CORRUPT).isNotNull() & nothing_parsed)).select(*schema.fieldNames())


def _read_telemetry(spark: SparkSession, telemetry_dir: str, name: str) -> DataFrame:
    """``NAME.parquet`` and/or ``NAME.jsonl`` of ``telemetry_dir`` as one DataFrame of NAME's schema."""
    schema = TELEMETRY_SCHEMAS[name]
    parts = []
    parquet = os.path.join(telemetry_dir, f"{name}.parquet")
    if os.path.isfile(parquet):
        parts.append(spark.read.schema(schema).parquet(_url(parquet)).select(*schema.fieldNames()))
    jsonl = os.path.join(telemetry_dir, f"{name}.jsonl")
    if os.path.exists(jsonl) and os.path.getsize(jsonl) > 0:
        parts.append(_read_jsonl(spark, jsonl, schema))
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


def pick(df: DataFrame, *spellings: str, cast: str = "double") -> Column:
    """The first non-null of ``spellings`` that ``df``'s schema has, cast; a null column if none."""
    present = [F.col(name).cast(cast) for name in spellings if has_field(df, name)]
    if not present:
        return F.lit(None).cast(cast)
    return present[0] if len(present) == 1 else F.coalesce(*present)


def has_field(df: DataFrame, dotted: str) -> bool:
    """Whether ``df`` has the (possibly nested, dot-separated) field ``dotted``."""
    schema = df.schema
    for part in dotted.split("."):
        if not isinstance(schema, StructType) or part not in schema.fieldNames():
            return False
        schema = schema[part].dataType
    return True


__all__ = ["EVENTS_SCHEMA", "LINK_SCHEMA", "NotARunDirectory", "RunFrames", "STATES_SCHEMA",
           "SECONDS_SCHEMA", "STATS_SCHEMA", "TELEMETRY_SCHEMAS", "has_field", "load_run", "pick"]
