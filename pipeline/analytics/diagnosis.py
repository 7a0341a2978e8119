"""Bottleneck diagnosis, after RabbitMQ's "Finding bottlenecks with RabbitMQ 3.3".

A stage goes into flow control when anything it publishes to is a bottleneck
or is in flow control itself, so walking the publish path from the client
inwards, the first stage that is *not* in flow sits just behind the
bottleneck::

    reader (connection) ──▶ channel ──▶ queue ──▶ message store
       in flow?              in flow?     in flow?
       no  ─────────────────────────────────────────▶ none
       yes        no  ──────────────────────────────▶ channel
       yes        yes         no  ──────────────────▶ queue
       yes        yes         yes ──────────────────▶ message_store

Evidence is the share of time a stage spent in ``flow`` (from the
supervisor's state rows, one per change), over the steady window: from one second after the load
generator started (start-up, spawning and the first credit round-trip are
skipped) to its last per-second report (the drain that follows is not
publishing). A memory or disk alarm shows as ``blocked``/``blocking``, not
``flow``, so an alarm is not mistaken for a bottleneck; when publishers spent
a meaningful share of the window blocked by one, the rule says so.

Which processes count, per kind:

* reader  the publishing connections (readers whose ``publishes`` > 0);
* channel the channels those readers send to (their ``reader->channel`` links);
* queue   the queues those channels route to (their ``channel->queue`` links);
* store   the message store.

Without links in the telemetry every process of the kind counts. Per kind
the evidence is the largest fraction among its processes: the rules speak
of "some channels" and "some queues".

Thresholds, from measured runs (2 cores, 5 s and 60 s runs): a publishing
connection held by a slow consumer or a slow store spends 0.5-0.7 of the
window in flow and the stages behind it 0.95-1.0; stages that are not
throttled read 0.0, and a single brief block, which keeps ``flow`` for the
1 s window after it started, costs a few hundredths over a run of several
seconds. A connection or stage therefore counts as in flow when its
fraction reaches ``CONNECTION_FLOW_MIN`` / ``STAGE_FLOW_MIN`` (both 0.10):
well above the one-blip level, well below any sustained throttling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

CONNECTION_FLOW_MIN = 0.10     # fraction of the steady window in flow
STAGE_FLOW_MIN = 0.10
STEADY_SKIP_NS = 1_000_000_000  # the first second after the load starts

KINDS = ("reader", "channel", "queue", "store")
BOTTLENECKS = ("channel", "queue", "message_store", "none")


@dataclass(frozen=True)
class Diagnosis:
    """Which stage holds the publishers back, and why the rules say so."""

    bottleneck: str                      # one of BOTTLENECKS
    evidence: dict                       # kind -> fraction of the window in flow
    rule: str                            # the rule that fired, in words
    processes: dict = field(default_factory=dict)   # kind -> {process name: fraction}
    window_s: tuple = (0.0, 0.0)         # steady window, seconds on the report's time axis

    def to_json(self) -> dict:
        return {"bottleneck": self.bottleneck,
                "evidence": dict(self.evidence),
                "rule": self.rule,
                "thresholds": {"connection_flow_min": CONNECTION_FLOW_MIN,
                               "stage_flow_min": STAGE_FLOW_MIN},
                "window_s": list(self.window_s),
                "processes": {k: dict(v) for k, v in self.processes.items()}}


def apply_rules(evidence: dict) -> tuple[str, str]:
    """RabbitMQ's rules on per-kind flow fractions: (bottleneck, rule in words)."""
    r, c, q = (float(evidence.get(k) or 0.0) for k in ("reader", "channel", "queue"))
    if r < CONNECTION_FLOW_MIN:
        return "none", (f"publishing connections are not meaningfully in flow "
                        f"(reader {r:.2f} < {CONNECTION_FLOW_MIN:.2f}): no stage of the pipeline holds them back")
    if c < STAGE_FLOW_MIN:
        return "channel", (f"the publishing connection is in flow (reader {r:.2f}) but none of its channels "
                           f"are (channel {c:.2f} < {STAGE_FLOW_MIN:.2f}): the channel is the bottleneck")
    if q < STAGE_FLOW_MIN:
        return "queue", (f"the publishing connection (reader {r:.2f}) and its channels (channel {c:.2f}) are in "
                         f"flow but none of the target queues are (queue {q:.2f} < {STAGE_FLOW_MIN:.2f}): "
                         f"the queue is the bottleneck")
    return "message_store", (f"the publishing connection (reader {r:.2f}), its channels (channel {c:.2f}) and "
                             f"target queues (queue {q:.2f}) are all in flow: the message store is the bottleneck")


def flow_fractions(states: DataFrame, start_ns: int | None,
                   end_ns: int | None) -> dict[str, tuple[str, float, float, float]]:
    """Per process over [start_ns, end_ns]: name -> (kind, share of the time in flow, seconds seen,
    share of the time blocked or blocking by an alarm).

    Each state row holds from its time to the same process's next row (the supervisor writes a row
    on every change and one when the process ends; older runs sampled every 100 ms, which reads the
    same way), so a process in flow since before the window counts from the window's start."""
    lo = F.lit(start_ns if start_ns is not None else -(2 ** 62))
    hi = F.lit(end_ns if end_ns is not None else 2 ** 62)
    by_process = Window.partitionBy("name").orderBy("at_ns")
    spans = (states.where(F.col("name").isNotNull() & F.col("at_ns").isNotNull())
             .withColumn("next_ns", F.coalesce(F.lead("at_ns").over(by_process), F.col("at_ns")))
             .withColumn("ns", F.greatest(F.lit(0), F.least("next_ns", hi) - F.greatest("at_ns", lo))))
    rows = (spans.groupBy("name")
            .agg(F.first("kind", ignorenulls=True).alias("kind"),
                 F.sum("ns").alias("ns"),
                 F.sum(F.when(F.col("state") == "flow", F.col("ns")).otherwise(0)).alias("in_flow"),
                 F.sum(F.when(F.col("state").isin("blocked", "blocking"), F.col("ns")).otherwise(0))
                 .alias("alarmed"))
            .collect())
    return {row["name"]: (row["kind"] or "", row["in_flow"] / row["ns"], row["ns"] / 1e9,
                          row["alarmed"] / row["ns"])
            for row in rows if row["ns"]}


def members(kinds: dict[str, str], links: list[dict], publishes: dict[str, int]) -> dict[str, list[str]]:
    """The processes each rule looks at: publishing readers, their channels, their queues, the store.

    ``kinds`` maps process name to kind, ``links`` are rows with ``sender`` and
    ``receiver``, ``publishes`` maps reader name to messages it published.
    """
    by_kind: dict[str, list[str]] = {k: sorted(n for n, kind in kinds.items() if kind == k) for k in KINDS}
    if publishes and any(v is not None for v in publishes.values()):
        readers = sorted(n for n, v in publishes.items() if (v or 0) > 0)
    else:
        readers = by_kind["reader"]

    def downstream(senders: list[str], kind: str) -> list[str]:
        found = sorted({l["receiver"] for l in links
                        if l["sender"] in senders and kinds.get(l["receiver"]) == kind})
        return found or by_kind[kind]

    channels = downstream(readers, "channel")
    queues = downstream(channels, "queue")
    return {"reader": readers, "channel": channels, "queue": queues, "store": by_kind["store"]}


def diagnose(fractions: dict[str, tuple], chosen: dict[str, list[str]],
             window_s: tuple = (0.0, 0.0)) -> Diagnosis:
    """The diagnosis from per-process fractions and the processes each kind counts."""
    evidence: dict[str, float] = {}
    processes: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        per = {n: round(fractions[n][1], 4) for n in chosen.get(kind, []) if n in fractions}
        processes[kind] = per
        evidence[kind] = max(per.values()) if per else 0.0
    if not chosen.get("reader"):
        return Diagnosis("none", evidence, "no connection published during the run: nothing to diagnose",
                         processes, window_s)
    bottleneck, rule = apply_rules(evidence)
    alarmed = max((fractions[n][3] for n in chosen["reader"] if n in fractions and len(fractions[n]) > 3),
                  default=0.0)
    if bottleneck == "none" and alarmed >= CONNECTION_FLOW_MIN:
        rule += (f"; the publishers were held by a resource alarm instead (blocked or blocking in "
                 f"{alarmed:.2f} of the window), which is not flow control")
    return Diagnosis(bottleneck, evidence, rule, processes, window_s)


__all__ = ["BOTTLENECKS", "CONNECTION_FLOW_MIN", "Diagnosis", "KINDS", "STAGE_FLOW_MIN",
           "STEADY_SKIP_NS", "apply_rules", "diagnose", "flow_fractions", "members"]
