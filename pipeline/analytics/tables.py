"""The report's tables: rows built from a :class:`RunAnalysis`, written as CSV.

Files under ``report/tables/`` (comma-separated, a header line first)::

    process_states.csv  name, kind, state, seconds, fraction
                        (time each process spent in each state, from its state changes)
    links.csv           link, sender, receiver, max_in_flight, sent, overflow
                        (the largest values any snapshot reported)
    summary.csv         metric, value (counts and rates of the run)
    alarms.csv          source, set_s, clear_s, duration_s
    seconds.csv         t, sent, confirmed, received, consumer_* and confirm_* latency (µs)

A comparison writes ``runs.csv``: one row per run (:data:`RUN_COLUMNS`).
"""

from __future__ import annotations

import csv
import os

from pipeline.analytics.analysis import PERCENTILES, RunAnalysis

SUMMARY_COUNTS = ("published", "confirmed", "nacked", "returned", "delivered", "lost", "publish_rate",
                  "deliver_rate", "wall_seconds")
RUN_COLUMNS = ("run", "published", "delivered", "lost", "publish_rate", "deliver_rate",
               "consumer_p50_us", "consumer_p99_us", "consumer_max_us", "confirm_p50_us", "confirm_p99_us",
               "flow_reader", "flow_channel", "flow_queue", "flow_store", "alarms", "alarm_seconds",
               "bottleneck", "rule")


def write_csv(path: str, columns: tuple | list, rows: list[dict]) -> str:
    """Write ``rows`` (dicts) under ``columns`` to ``path``; returns the path."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    return path


def summary_rows(run: RunAnalysis) -> list[dict]:
    s = run.summary
    rows = [{"metric": k, "value": s[k]} for k in SUMMARY_COUNTS if k in s]
    for group in ("consumer", "confirm"):
        lat = (s.get("latency_us") or {}).get(group) or {}
        rows += [{"metric": f"{group}_latency_{p}_us", "value": lat[p]} for p in ("p50", "p99", "max") if p in lat]
    rows.append({"metric": "alarms", "value": len(run.alarm_spans)})
    rows.append({"metric": "alarm_seconds", "value": round(sum(e - b for _, b, e in run.alarm_spans), 3)})
    rows.append({"metric": "stage_deaths", "value": len(s.get("deaths") or [])})
    rows += [{"metric": f"events_{k}", "value": v} for k, v in sorted(run.event_counts.items())]
    return rows


def alarm_rows(run: RunAnalysis) -> list[dict]:
    return [{"source": src, "set_s": round(b, 3), "clear_s": round(e, 3), "duration_s": round(e - b, 3)}
            for src, b, e in run.alarm_spans]


def state_wide(run: RunAnalysis) -> tuple[list[str], list[dict]]:
    """Seconds in each state, one row per process (the page's view of process_states.csv)."""
    states = [s for s in ("running", "flow", "blocking", "blocked", "closing")
              if any(r["state"] == s for r in run.state_time)]
    states += sorted({r["state"] for r in run.state_time} - set(states))
    by_name: dict[str, dict] = {}
    for r in run.state_time:
        row = by_name.setdefault(r["name"], {"name": r["name"], "kind": r["kind"]})
        row[r["state"]] = r["seconds"]
    return ["name", "kind"] + states, list(by_name.values())


def write_run_tables(run: RunAnalysis, tables_dir: str) -> dict[str, str]:
    """Write every table of a one-run report; returns table name -> path."""
    os.makedirs(tables_dir, exist_ok=True)
    seconds_columns = ["t", "sent", "confirmed", "received"] + [f"{g}_{p}" for g in ("consumer", "confirm")
                                                               for p in PERCENTILES]
    return {
        "process_states": write_csv(os.path.join(tables_dir, "process_states.csv"),
                                    ("name", "kind", "state", "seconds", "fraction"), run.state_time),
        "links": write_csv(os.path.join(tables_dir, "links.csv"),
                           ("link", "sender", "receiver", "max_in_flight", "sent", "overflow"), run.links),
        "summary": write_csv(os.path.join(tables_dir, "summary.csv"), ("metric", "value"), summary_rows(run)),
        "alarms": write_csv(os.path.join(tables_dir, "alarms.csv"),
                            ("source", "set_s", "clear_s", "duration_s"), alarm_rows(run)),
        "seconds": write_csv(os.path.join(tables_dir, "seconds.csv"), seconds_columns, run.seconds),
    }


def run_row(run: RunAnalysis) -> dict:
    """One run as a row of the comparison table."""
    s = run.summary
    consumer = (s.get("latency_us") or {}).get("consumer") or {}
    confirm = (s.get("latency_us") or {}).get("confirm") or {}
    evidence = run.diagnosis.evidence if run.diagnosis else {}
    return {"run": run.label, "published": s.get("published"), "delivered": s.get("delivered"),
            "lost": s.get("lost"), "publish_rate": s.get("publish_rate"), "deliver_rate": s.get("deliver_rate"),
            "consumer_p50_us": consumer.get("p50"), "consumer_p99_us": consumer.get("p99"),
            "consumer_max_us": consumer.get("max"), "confirm_p50_us": confirm.get("p50"),
            "confirm_p99_us": confirm.get("p99"),
            **{f"flow_{k}": evidence.get(k) for k in ("reader", "channel", "queue", "store")},
            "alarms": ", ".join(sorted({src for src, _, _ in run.alarm_spans})) or "none",
            "alarm_seconds": round(sum(e - b for _, b, e in run.alarm_spans), 3),
            "bottleneck": run.diagnosis.bottleneck if run.diagnosis else None,
            "rule": run.diagnosis.rule if run.diagnosis else None}
