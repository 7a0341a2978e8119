"""The Spark side of the report: one run's telemetry reduced to small results.

Every aggregation runs in Spark; what comes back to the driver is already
small (one row per second, per state segment, per link, per alarm, per
fsync) and is held in :class:`RunAnalysis`, which the plots, tables and HTML
read without touching Spark again.

Time axis: seconds since the load generator started (``seconds.jsonl``'s
``at_ns - time_s``), the same clock the console lines and the demo's phases
use; a run without a load generator counts from the supervisor's first state
sample.

State durations: each state row holds until the same process's next row.
The supervisor writes a row when a process's state changes and one when the
process ends (older runs sampled every 100 ms; they read the same way), so a
process's last row closes its last span and stands for no time itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import Window
from pyspark.sql import functions as F

from pipeline.analytics.diagnosis import STEADY_SKIP_NS, Diagnosis, diagnose, flow_fractions, members
from pipeline.analytics.load import RunFrames

NS_PER_S = 1_000_000_000
PERCENTILES = ("min", "p50", "p75", "p95", "p99", "max")
STATES = ("running", "flow", "blocking", "blocked", "closing")


@dataclass
class RunAnalysis:
    """Everything the report draws and tabulates for one run."""

    label: str
    run_dir: str
    summary: dict
    origin_ns: int
    seconds: list[dict] = field(default_factory=list)      # t, sent, confirmed, received, consumer_*, confirm_*
    segments: list[tuple] = field(default_factory=list)    # (name, kind, state, start_s, end_s)
    state_time: list[dict] = field(default_factory=list)   # name, kind, state, seconds, fraction
    links: list[dict] = field(default_factory=list)        # link, sender, receiver, max_in_flight, sent, overflow
    watchdog: list[dict] = field(default_factory=list)     # t, memory_used, memory_limit, disk_free, disk_limit
    alarm_spans: list[tuple] = field(default_factory=list)  # (source, start_s, end_s)
    alarm_events: list[dict] = field(default_factory=list)  # t, source, state, used/free, limit
    fsyncs: list[tuple] = field(default_factory=list)      # (t, duration_ms)
    event_counts: dict = field(default_factory=dict)
    diagnosis: Diagnosis | None = None
    end_s: float = 0.0

    def t(self, at_ns: int) -> float:
        return (at_ns - self.origin_ns) / NS_PER_S


def _seconds(run: RunFrames) -> tuple[list[dict], int | None, int | None]:
    """Per-second rows, and the load's start and last-report instants (ns) if known."""
    df = run.seconds
    if df is None:
        return [], None, None
    cols = [F.col("time_s").alias("t"), F.col("at_ns"), F.col("sent_rate").alias("sent"),
            F.col("confirmed_rate").alias("confirmed"), F.col("received_rate").alias("received")]
    for group in ("consumer", "confirm"):
        for p in PERCENTILES:
            cols.append(F.col(f"{group}.{p}").alias(f"{group}_{p}"))
    rows = [r.asDict() for r in df.select(*cols).where(F.col("t").isNotNull()).orderBy("t").collect()]
    starts = [r["at_ns"] - int(r["t"] * NS_PER_S) for r in rows if r["at_ns"] is not None]
    ends = [r["at_ns"] for r in rows if r["at_ns"] is not None]
    return rows, (min(starts) if starts else None), (max(ends) if ends else None)


def analyse(run: RunFrames) -> RunAnalysis:
    """Run every aggregation of the report over one run's DataFrames.

    The snapshots and samples are parsed once and cached for the duration:
    each is queried several times.
    """
    run.stats.cache()
    run.states.cache()
    try:
        return _analyse(run)
    finally:
        run.stats.unpersist()
        run.states.unpersist()


def _analyse(run: RunFrames) -> RunAnalysis:
    seconds, load_start_ns, load_end_ns = _seconds(run)

    bounds = run.states.agg(F.min("at_ns").alias("lo"), F.max("at_ns").alias("hi")).first()
    first_sample_ns, last_sample_ns = bounds["lo"], bounds["hi"]
    origin_ns = load_start_ns if load_start_ns is not None else (first_sample_ns or 0)
    result = RunAnalysis(run.label, run.run_dir, run.summary, origin_ns)
    result.seconds = seconds

    # State segments and time in each state (window functions over each process's samples).
    by_process = Window.partitionBy("name").orderBy("at_ns")
    samples = (run.states.where(F.col("name").isNotNull() & F.col("at_ns").isNotNull())
               .withColumn("next_ns", F.coalesce(F.lead("at_ns").over(by_process), F.col("at_ns")))
               .withColumn("changed", F.when(F.lag("state").over(by_process).eqNullSafe(F.col("state")), 0)
                           .otherwise(1))
               .withColumn("segment", F.sum("changed").over(by_process.rowsBetween(Window.unboundedPreceding, 0))))
    samples = samples.cache()
    segments = (samples.groupBy("name", "segment")
                .agg(F.first("kind", ignorenulls=True).alias("kind"), F.first("state").alias("state"),
                     F.min("at_ns").alias("start_ns"), F.max("next_ns").alias("end_ns"))
                .orderBy("name", "start_ns").collect())
    result.segments = [(r["name"], r["kind"] or "", r["state"] or "unknown", result.t(r["start_ns"]),
                        result.t(r["end_ns"])) for r in segments]
    per_state = (samples.withColumn("duration_ns", F.col("next_ns") - F.col("at_ns"))
                 .groupBy("name", "state")
                 .agg(F.first("kind", ignorenulls=True).alias("kind"), F.sum("duration_ns").alias("duration_ns"))
                 .withColumn("total_ns", F.sum("duration_ns").over(Window.partitionBy("name")))
                 .withColumn("fraction", F.when(F.col("total_ns") > 0, F.col("duration_ns") / F.col("total_ns")))
                 .orderBy("name", "state").collect())
    result.state_time = [{"name": r["name"], "kind": r["kind"] or "", "state": r["state"] or "unknown",
                          "seconds": round(r["duration_ns"] / NS_PER_S, 3),
                          "fraction": round(r["fraction"] or 0.0, 4)} for r in per_state]
    samples.unpersist()

    # Links: the largest values any snapshot reported, per sender->receiver pair.
    links = (run.stats.where(F.col("links").isNotNull())
             .select(F.explode("links").alias("link", "v"))
             .groupBy("link")
             .agg(F.max("v.max_in_flight").alias("max_in_flight"), F.max("v.sent").alias("sent"),
                  F.max("v.overflow").alias("overflow"))
             .withColumn("sender", F.split("link", "->").getItem(0))
             .withColumn("receiver", F.split("link", "->").getItem(1))
             .orderBy("link").collect())
    result.links = [r.asDict() for r in links]

    # Readers: who published, and when publishing began and ended.
    readers = (run.stats.where(F.col("kind") == "reader").groupBy("name")
               .agg(F.max("publishes").alias("publishes"),
                    F.min(F.when(F.col("first_publish_ns") > 0, F.col("first_publish_ns"))).alias("first_ns"),
                    F.max("last_publish_ns").alias("last_ns"))
               .collect())
    publishes = {r["name"]: r["publishes"] for r in readers}

    # Watchdog readings and the alarm/fsync events.
    watch = (run.stats.where(F.col("kind") == "watchdog")
             .select("at_ns", "memory_used", "memory_limit", "memory_alarm", "disk_free", "disk_limit",
                     "disk_alarm").orderBy("at_ns").collect())
    result.watchdog = [dict(r.asDict(), t=result.t(r["at_ns"])) for r in watch if r["at_ns"] is not None]
    alarms = (run.events.where(F.col("event").isin("alarm_set", "alarm_clear"))
              .select(F.coalesce("data.at_ns", "at_ns").alias("at_ns"), "event",
                      F.coalesce("data.source", "name").alias("source"), "data.used", "data.free", "data.limit")
              .orderBy("at_ns").collect())
    result.alarm_events = [{"t": result.t(r["at_ns"]), "source": r["source"],
                            "state": "set" if r["event"] == "alarm_set" else "clear",
                            "used": r["used"], "free": r["free"], "limit": r["limit"]} for r in alarms]
    fsyncs = (run.events.where((F.col("event") == "fsync") & F.col("data.duration_ns").isNotNull())
              .select("at_ns", "data.duration_ns").orderBy("at_ns").collect())
    result.fsyncs = [(result.t(r["at_ns"]), r["duration_ns"] / 1e6) for r in fsyncs]
    result.event_counts = {r["event"]: r["count"] for r in
                           run.events.groupBy("event").count().orderBy("event").collect()}

    ends = [x for x in (last_sample_ns, load_end_ns) if x is not None]
    result.end_s = result.t(max(ends)) if ends else 0.0
    result.alarm_spans = _spans(result.alarm_events, result.end_s)

    # The steady window and the diagnosis.
    first_publish = [r["first_ns"] for r in readers if r["first_ns"]]
    begin_ns = load_start_ns if load_start_ns is not None else (min(first_publish) if first_publish
                                                                else first_sample_ns)
    end_ns = load_end_ns if load_end_ns is not None else (max((r["last_ns"] or 0) for r in readers)
                                                          if readers else last_sample_ns)
    start_ns = None if begin_ns is None else begin_ns + STEADY_SKIP_NS
    if start_ns is not None and end_ns is not None and end_ns <= start_ns:
        start_ns = begin_ns                      # shorter than the skipped second: use it all
    fractions = flow_fractions(run.states, start_ns, end_ns)
    if not fractions:
        fractions = flow_fractions(run.states, None, None)
    kinds = {r["name"]: r["kind"] for r in result.state_time}
    chosen = members(kinds, result.links, publishes)
    window = (round(result.t(start_ns), 3) if start_ns is not None else 0.0,
              round(result.t(end_ns), 3) if end_ns is not None else result.end_s)
    result.diagnosis = diagnose(fractions, chosen, window)
    return result


def _spans(events: list[dict], end_s: float) -> list[tuple]:
    """(source, start, end) for each set..clear; an alarm still set ends at the run's end."""
    open_at: dict[str, float] = {}
    spans = []
    for e in events:
        if e["state"] == "set" and e["source"] not in open_at:
            open_at[e["source"]] = e["t"]
        elif e["state"] == "clear" and e["source"] in open_at:
            spans.append((e["source"], open_at.pop(e["source"]), e["t"]))
    spans.extend((source, start, max(end_s, start)) for source, start in open_at.items())
    return sorted(spans, key=lambda s: s[1])


__all__ = ["PERCENTILES", "RunAnalysis", "SAMPLE_INTERVAL_NS", "STATES", "analyse"]
