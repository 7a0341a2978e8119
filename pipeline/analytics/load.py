"""Reading a run directory into Spark DataFrames.

A run directory (``creditflow run`` / ``creditflow demo``) holds::

    summary.json            totals, latency percentiles, per-process summary, config
    seconds.jsonl           one load-generator report a second (time_s, rates, latency)
    telemetry/stats.jsonl   every statistics() snapshot a stage pushed
    telemetry/states.jsonl  the supervisor's 100 ms state samples
    telemetry/events.jsonl  spawn, connection, alarm_set/alarm_clear, stage_died, fsync

All timestamps are int64 nanoseconds of the machine-wide monotonic clock, so
the broker's files and the load generator's ``seconds.jsonl`` share one axis.

The telemetry files are read with explicit schemas naming only the fields the
report uses: a stage that adds fields costs nothing, one that drops a field
leaves a null column, and no job is spent inferring a schema from megabytes
of snapshots. ``seconds.jsonl``'s field names still move, so its schema
lists every known spelling of a field and :func:`pick` takes the first that
holds a value.

A missing file reads as an empty DataFrame of the same schema. With a
cluster master the run directory must be on a path every executor can read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (ArrayType, BooleanType, DoubleType, LongType, MapType, StringType,
                               StructField, StructType)

LINK_SCHEMA = StructType([
    StructField("sent", LongType()),
    StructField("records", LongType()),
    StructField("in_flight", LongType()),
    StructField("max_in_flight", LongType()),
    StructField("overflow", LongType()),
    StructField("credit", LongType()),
])

STATS_SCHEMA = StructType([
    StructField("name", StringType()),
    StructField("kind", StringType()),
    StructField("pid", LongType()),
    StructField("at_ns", LongType()),
    StructField("state", StringType()),
    StructField("blocked", BooleanType()),
    StructField("block_count", LongType()),
    StructField("blocked_total_ns", LongType()),
    StructField("links", MapType(StringType(), LINK_SCHEMA)),
    # reader
    StructField("publishes", LongType()),
    StructField("deliveries", LongType()),
    StructField("first_publish_ns", LongType()),
    StructField("last_publish_ns", LongType()),
    # queue
    StructField("messages", LongType()),
    # store
    StructField("fsyncs", LongType()),
    StructField("fsync_events", ArrayType(ArrayType(LongType()))),
    # watchdog
    StructField("memory_used", LongType()),
    StructField("memory_limit", LongType()),
    StructField("memory_alarm", BooleanType()),
    StructField("disk_free", LongType()),
    StructField("disk_limit", LongType()),
    StructField("disk_alarm", BooleanType()),
])

STATES_SCHEMA = StructType([
    StructField("at_ns", LongType()),
    StructField("name", StringType()),
    StructField("kind", StringType()),
    StructField("state", StringType()),
])

EVENTS_SCHEMA = StructType([
    StructField("at_ns", LongType()),
    StructField("event", StringType()),
    StructField("name", StringType()),
    StructField("data", StructType([
        StructField("duration_ns", LongType()),
        StructField("source", StringType()),
        StructField("state", StringType()),
        StructField("used", LongType()),
        StructField("free", LongType()),
        StructField("limit", LongType()),
        StructField("at_ns", LongType()),
        StructField("kind", StringType()),
        StructField("pid", LongType()),
    ])),
])


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


def _read_lines(spark: SparkSession, path: str, schema: StructType) -> DataFrame:
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return spark.createDataFrame([], schema)
    return spark.read.schema(schema).json(_url(path))


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
        stats=_read_lines(spark, os.path.join(telemetry, "stats.jsonl"), STATS_SCHEMA),
        states=_read_lines(spark, os.path.join(telemetry, "states.jsonl"), STATES_SCHEMA),
        events=_read_lines(spark, os.path.join(telemetry, "events.jsonl"), EVENTS_SCHEMA),
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
           "SECONDS_SCHEMA", "STATS_SCHEMA", "has_field", "load_run", "pick"]
