"""Steps within one run: one dimension takes a series of values, each for a step (RabbitTestTool's
``singleDimension``), against the same broker.

``--step publishers=1,2,4,8 --step-seconds 10`` runs four loads one after
the other, each publishing for 10 s and draining as a run does, so each
step's figures are its own. The dimensions are RabbitTestTool's that map
onto a run's options:

===========  ===========  =====================================
dimension    option       meaning
===========  ===========  =====================================
rate         -r           msg/s per publisher
size         -s           body bytes
inflight     -c           max unconfirmed per publisher
prefetch     -q           consumer prefetch
publishers   -x           publishing connections
consumers    -y           consuming connections
===========  ===========  =====================================

``combine`` adds the steps' results into one for the run's summary: counts
summed, latencies merged, the seconds laid end to end. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.loadgen import latency
from pipeline.loadgen.config import InvalidLoadConfig, LoadConfig

DIMENSIONS = {"rate": "rate", "size": "size", "inflight": "confirm", "prefetch": "prefetch",
              "publishers": "producers", "consumers": "consumers"}
COUNTS = ("published", "confirmed", "nacked", "returned", "delivered", "lost", "stale", "gaps", "duplicates",
          "undelivered", "rejected", "dropped", "skipped", "foreign", "reordered")


@dataclass(frozen=True)
class StepPlan:
    dimension: str
    values: tuple
    seconds: float


def parse_step(text: str, seconds: float) -> StepPlan:
    """``DIMENSION=V1,V2,...`` (``rate`` may be fractional, the others are whole numbers)."""
    name, sep, values = text.partition("=")
    name = name.strip().lower()
    if not sep or name not in DIMENSIONS:
        raise InvalidLoadConfig(f"--step must be DIMENSION=V1,V2,... with DIMENSION one of "
                                f"{', '.join(DIMENSIONS)}, got {text!r}")
    try:
        parsed = tuple((float if name == "rate" else int)(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise InvalidLoadConfig(f"--step {name}: values must be numbers, got {values!r}") from None
    if not parsed:
        raise InvalidLoadConfig(f"--step {name}: give at least one value")
    return StepPlan(name, parsed, seconds)


def step_configs(load: LoadConfig, plan: StepPlan) -> list[LoadConfig]:
    """The run's load with the dimension set to each value (each checked: InvalidLoadConfig)."""
    return [replace(load, **{DIMENSIONS[plan.dimension]: value}, duration_s=plan.seconds) for value in plan.values]


def step_row(plan: StepPlan, value, result) -> dict:
    """One step's line of the steps table."""
    consumer = result.latency_us.get("consumer", {})
    return {plan.dimension: value, "published": result.published, "delivered": result.delivered,
            "lost": result.lost, "publish_rate": round(result.publish_rate, 1),
            "deliver_rate": round(result.deliver_rate, 1), "latency_p50_us": consumer.get("p50", 0),
            "latency_p99_us": consumer.get("p99", 0),
            **({"confirm_p50_us": result.latency_us["confirm"].get("p50", 0)} if "confirm" in result.latency_us
               else {})}


def combine(results: list):
    """One result for several steps: counts summed, latencies merged, seconds end to end; the drain and
    the connections are the last step's."""
    last = results[-1]
    sums = {name: sum(getattr(r, name) for r in results) for name in COUNTS}
    window = sum(r.window_s for r in results)
    hists, lat = {}, {}
    for kind in {k for r in results for k in r.histograms}:
        merged = latency.merge(r.histograms[kind] for r in results if r.histograms.get(kind))
        hists[kind], lat[kind] = latency.encode(merged), latency.percentiles(merged)
    seconds, offset = [], 0.0
    for r in results:
        seconds.extend(replace(rep, time_s=rep.time_s + offset) for rep in r.seconds)
        offset += r.window_s
    rejections: dict[str, int] = {}
    for r in results:
        for reason, n in r.rejections.items():
            rejections[reason] = rejections.get(reason, 0) + n
    return replace(last, **sums, publish_rate=sums["published"] / window if window else 0.0,
                   deliver_rate=sums["delivered"] / window if window else 0.0, window_s=window,
                   latency_us=lat, histograms=hists, seconds=tuple(seconds), rejections=rejections,
                   errors=tuple(e for r in results for e in r.errors))
