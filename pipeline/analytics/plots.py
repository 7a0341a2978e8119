"""The report's figures, drawn on the driver from a :class:`RunAnalysis`.

Each function writes one PNG and returns a :class:`Figure` saying whether it
had data. A figure without data is still written, with a sentence saying what
is missing, so a page never shows a blank frame. Matplotlib runs on the Agg
backend: no display is needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from pipeline.analytics.analysis import RunAnalysis  # noqa: E402

DPI = 100
WIDE_IN = (10, 3.6)
STATE_COLOURS = {"running": "#4caf50", "flow": "#ffb300", "blocking": "#fdd835", "blocked": "#e53935",
                 "closing": "#9e9e9e"}
OTHER_STATE_COLOUR = "#607d8b"
ALARM_COLOURS = {"memory": "#e53935", "disk": "#8e24aa"}
MIB = 1024 * 1024


@dataclass(frozen=True)
class Figure:
    """One written PNG: its file name (relative to the report), title, and whether it has data."""

    file: str
    title: str
    has_data: bool
    note: str = ""


def _no_data(ax, sentence: str) -> None:
    ax.text(0.5, 0.5, sentence, ha="center", va="center", fontsize=12, color="#555555",
            transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig, out_dir: str, file: str) -> None:
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, file), dpi=DPI)
    plt.close(fig)


def _phase_lines(ax, run: RunAnalysis) -> None:
    at: dict[float, list[str]] = {}
    for name, t in (run.summary.get("phases") or {}).items():
        if isinstance(t, (int, float)):
            at.setdefault(round(t, 1), []).append(str(name))
    for t, names in sorted(at.items()):
        ax.axvline(t, color="#777777", lw=0.8, ls=":")
        ax.text(t, 0.02, " " + " / ".join(names), rotation=90, va="bottom", ha="right", fontsize=7,
                color="#555555", transform=ax.get_xaxis_transform())


def _alarm_shading(ax, run: RunAnalysis, source: str) -> bool:
    shaded = False
    for src, start, end in run.alarm_spans:
        if src == source:
            ax.axvspan(start, end, color=ALARM_COLOURS.get(source, "#e53935"), alpha=0.15,
                       label=None if shaded else f"{source} alarm")
            shaded = True
    return shaded


def rates(run: RunAnalysis, out_dir: str) -> Figure:
    title = "Publish, confirm and deliver rates"
    fig, ax = plt.subplots(figsize=WIDE_IN)
    rows = [r for r in run.seconds if r["t"] is not None]
    if not rows:
        _no_data(ax, "No per-second load reports (seconds.jsonl) in this run")
    else:
        t = [r["t"] for r in rows]
        for key, label, colour in (("sent", "published", "#1e88e5"), ("confirmed", "confirmed", "#43a047"),
                                   ("received", "delivered", "#fb8c00")):
            values = [r[key] for r in rows]
            if any(v for v in values if v is not None):
                ax.plot(t, [v or 0 for v in values], marker=".", label=label, color=colour)
        _phase_lines(ax, run)
        ax.set_xlabel("time since the load started (s)")
        ax.set_ylabel("msg/s")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    ax.set_title(title)
    _save(fig, out_dir, "rates.png")
    return Figure("rates.png", title, bool(rows))


def latency(run: RunAnalysis, out_dir: str) -> Figure:
    title = "Latency percentiles per second"
    groups = [g for g in ("consumer", "confirm")
              if any(r.get(f"{g}_p50") is not None for r in run.seconds)]
    fig, axes = plt.subplots(max(1, len(groups)), 1, figsize=(10, 3.2 * max(1, len(groups))), squeeze=False)
    if not groups:
        _no_data(axes[0][0], "No latency samples: nothing was delivered or confirmed")
        axes[0][0].set_title(title)
    for ax, group in zip((a[0] for a in axes), groups):
        rows = [r for r in run.seconds if r.get(f"{group}_p50") is not None]
        t = [r["t"] for r in rows]
        for p, colour in (("p50", "#1e88e5"), ("p75", "#43a047"), ("p95", "#fb8c00"), ("p99", "#e53935"),
                          ("max", "#6d4c41")):
            ax.plot(t, [max(r[f"{group}_{p}"] or 0, 1) / 1000 for r in rows], marker=".", label=p, color=colour)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{group} latency (from the intended send time)")
        ax.legend(loc="upper left", fontsize=8, ncol=5)
        ax.grid(alpha=0.3, which="both")
        _phase_lines(ax, run)
    (axes[-1][0]).set_xlabel("time since the load started (s)")
    _save(fig, out_dir, "latency.png")
    return Figure("latency.png", title, bool(groups))


def flow_timeline(run: RunAnalysis, out_dir: str) -> Figure:
    title = "Process states over time"
    names = sorted({s[0] for s in run.segments}, key=_process_order)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.38 * max(len(names), 3)))
    if not names:
        _no_data(ax, "No state samples (telemetry/states.jsonl) in this run")
    else:
        rows = {name: i for i, name in enumerate(names)}
        for name, _kind, state, start, end in run.segments:
            ax.broken_barh([(start, max(end - start, 0.01))], (rows[name] - 0.4, 0.8),
                           color=STATE_COLOURS.get(state, OTHER_STATE_COLOUR))
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        lo, hi = run.diagnosis.window_s if run.diagnosis else (None, None)
        if lo is not None and hi and hi > lo:
            ax.axvline(lo, color="black", lw=0.8, ls="--")
            ax.axvline(hi, color="black", lw=0.8, ls="--")
        seen = sorted({s[2] for s in run.segments})
        handles = [plt.Rectangle((0, 0), 1, 1, color=STATE_COLOURS.get(s, OTHER_STATE_COLOUR)) for s in seen]
        ax.legend(handles, seen, loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(names) > 4 else -0.3),
                  ncol=len(seen), fontsize=8, frameon=False)
        ax.set_xlabel("time since the load started (s); dashed: the diagnosis window")
        ax.grid(alpha=0.3, axis="x")
    ax.set_title(title)
    _save(fig, out_dir, "flow_timeline.png")
    return Figure("flow_timeline.png", title, bool(names))


def memory(run: RunAnalysis, out_dir: str) -> Figure:
    title = "Memory used against the high watermark"
    points = [w for w in run.watchdog if w.get("memory_used") is not None]
    points += [{"t": e["t"], "memory_used": e["used"], "memory_limit": e["limit"]}
               for e in run.alarm_events if e["source"] == "memory" and e.get("used") is not None]
    points.sort(key=lambda w: w["t"])
    fig, ax = plt.subplots(figsize=WIDE_IN)
    if not points:
        _no_data(ax, "No memory readings: the watchdog reported nothing in this run")
    else:
        t = [w["t"] for w in points]
        ax.plot(t, [w["memory_used"] / MIB for w in points], marker=".", color="#1e88e5", label="used")
        limit = [(w["t"], w["memory_limit"] / MIB) for w in points if w.get("memory_limit")]
        if limit:
            ax.step([x for x, _ in limit], [y for _, y in limit], where="post", color="#e53935", ls="--",
                    label="watermark")
            used_max = max(w["memory_used"] for w in points) / MIB
            if max(y for _, y in limit) > 20 * used_max:   # a default watermark dwarfs the broker
                ax.set_yscale("log")
        _alarm_shading(ax, run, "memory")
        _phase_lines(ax, run)
        ax.set_xlabel("time since the load started (s)")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    ax.set_title(title)
    _save(fig, out_dir, "memory.png")
    return Figure("memory.png", title, bool(points))


def disk(run: RunAnalysis, out_dir: str) -> Figure:
    title = "Disk free against the free-disk limit"
    points = [w for w in run.watchdog if w.get("disk_free") is not None]
    fig, ax = plt.subplots(figsize=WIDE_IN)
    if not points:
        _no_data(ax, "No disk readings: the watchdog reported nothing in this run")
    else:
        t = [w["t"] for w in points]
        ax.plot(t, [w["disk_free"] / MIB for w in points], marker=".", color="#1e88e5", label="free")
        ax.plot(t, [(w["disk_limit"] or 0) / MIB for w in points], color="#8e24aa", ls="--",
                label="disk_free_limit")
        _alarm_shading(ax, run, "disk")
        ax.set_yscale("log")
        ax.set_xlabel("time since the load started (s)")
        ax.set_ylabel("MiB (log)")
        ax.legend(loc="lower left", fontsize=8)
        ax.grid(alpha=0.3, which="both")
    ax.set_title(title)
    _save(fig, out_dir, "disk.png")
    return Figure("disk.png", title, bool(points))


def fsync(run: RunAnalysis, out_dir: str) -> Figure:
    title = "Message store fsync latency"
    fig, ax = plt.subplots(figsize=WIDE_IN)
    if not run.fsyncs:
        _no_data(ax, "No fsyncs in this run: nothing persistent reached the message store")
    else:
        ax.plot([t for t, _ in run.fsyncs], [ms for _, ms in run.fsyncs], marker="o", ms=3, lw=0.8,
                color="#6d4c41")
        ax.set_xlabel("time since the load started (s)")
        ax.set_ylabel("fsync duration (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax.set_title(title)
    _save(fig, out_dir, "fsync.png")
    return Figure("fsync.png", title, bool(run.fsyncs))


def run_figures(run: RunAnalysis, out_dir: str) -> list[Figure]:
    """Every figure of a one-run report, written into ``out_dir``."""
    return [f(run, out_dir) for f in (rates, latency, flow_timeline, memory, disk, fsync)]


def _process_order(name: str) -> tuple:
    order = ("reader", "channel", "queue", "store", "watchdog")
    for i, prefix in enumerate(order):
        if name.startswith(prefix):
            return (i, name)
    return (len(order), name)


# -- comparison ---------------------------------------------------------------------------------

def compare_rates(runs: list[RunAnalysis], out_dir: str) -> Figure:
    title = "Publish and deliver rates, run by run"
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True)
    has = False
    for run in runs:
        rows = [r for r in run.seconds if r["t"] is not None]
        if rows:
            has = True
            axes[0].plot([r["t"] for r in rows], [r["sent"] or 0 for r in rows], marker=".", label=run.label)
            axes[1].plot([r["t"] for r in rows], [r["received"] or 0 for r in rows], marker=".", label=run.label)
    for ax, what in zip(axes, ("published", "delivered")):
        ax.set_title(f"{what} msg/s")
        ax.set_xlabel("time since the load started (s)")
        ax.grid(alpha=0.3)
        if has:
            ax.legend(fontsize=8)
    if not has:
        _no_data(axes[0], "No per-second load reports in these runs")
    _save(fig, out_dir, "compare_rates.png")
    return Figure("compare_rates.png", title, has)


def compare_latency(runs: list[RunAnalysis], out_dir: str) -> Figure:
    title = "Consumer latency percentiles, run by run"
    fig, ax = plt.subplots(figsize=(10, 3.6))
    keys = ("p50", "p75", "p95", "p99", "max")
    has = False
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        lat = (run.summary.get("latency_us") or {}).get("consumer") or {}
        values = [lat.get(k) for k in keys]
        if any(v for v in values if v):
            has = True
            ax.bar([j + i * width for j in range(len(keys))], [max(v or 0, 1) / 1000 for v in values],
                   width=width, label=run.label)
    if has:
        ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))])
        ax.set_xticklabels(keys)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y", which="both")
    else:
        _no_data(ax, "No consumer latency in these runs")
    ax.set_title(title)
    _save(fig, out_dir, "compare_latency.png")
    return Figure("compare_latency.png", title, has)


def compare_flow(runs: list[RunAnalysis], out_dir: str) -> Figure:
    title = "Share of the steady window in flow, per stage kind"
    kinds = ("reader", "channel", "queue", "store")
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        evidence = run.diagnosis.evidence if run.diagnosis else {}
        ax.bar([j + i * width for j in range(len(kinds))], [evidence.get(k, 0.0) for k in kinds], width=width,
               label=f"{run.label}: {run.diagnosis.bottleneck if run.diagnosis else '?'}")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(kinds))])
    ax.set_xticklabels(kinds)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction of time in flow")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title)
    _save(fig, out_dir, "compare_flow.png")
    return Figure("compare_flow.png", title, bool(runs))


def comparison_figures(runs: list[RunAnalysis], out_dir: str) -> list[Figure]:
    """Every figure of a comparison page, written into ``out_dir``."""
    return [compare_rates(runs, out_dir), compare_latency(runs, out_dir), compare_flow(runs, out_dir)]
