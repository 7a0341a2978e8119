"""The report pages: one self-contained HTML file each, PNGs beside it.

No script, no external stylesheet, no network: the page opens from a copied
directory or an e-mail attachment. Everything interpolated is escaped.
"""

from __future__ import annotations

import html
import os

from pipeline.analytics.analysis import RunAnalysis
from pipeline.analytics.plots import Figure
from pipeline.analytics.tables import RUN_COLUMNS, alarm_rows, run_row, state_wide, summary_rows

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
.verdict { font-size: 1.15em; padding: 0.6em 1em; background: #fff8e1; border-left: 4px solid #ffb300; }
.none { background: #e8f5e9; border-left-color: #4caf50; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; } .muted { color: #777; font-size: 0.85em; }
"""


def _e(value) -> str:
    if isinstance(value, float):
        value = f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, int) and not isinstance(value, bool):
        value = f"{value:,}"
    return html.escape("" if value is None else str(value))


def table(columns: list | tuple, rows: list[dict], left: tuple = ()) -> str:
    if not rows:
        return '<p class="muted">No rows.</p>'
    head = "".join(f'<th class="{"l" if c in left else ""}">{_e(c)}</th>' for c in columns)
    body = "".join("<tr>" + "".join(f'<td class="{"l" if c in left else ""}">{_e(r.get(c))}</td>' for c in columns)
                   + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(fig: Figure, prefix: str = "") -> str:
    caption = fig.title if fig.has_data else f"{fig.title} (no data in this run)"
    return (f'<figure><img src="{html.escape(prefix + fig.file)}" alt="{html.escape(fig.title)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def _diagnosis_block(run: RunAnalysis) -> str:
    d = run.diagnosis
    if d is None:
        return ""
    rows = [{"kind": k, "fraction in flow": v, "processes": ", ".join(f"{n} {f:.2f}" for n, f in
                                                                      sorted(d.processes.get(k, {}).items()))}
            for k, v in d.evidence.items()]
    css = "verdict none" if d.bottleneck == "none" else "verdict"
    return (f'<p class="{css}">Bottleneck: <b>{_e(d.bottleneck)}</b> — {_e(d.rule)}</p>'
            + table(["kind", "fraction in flow", "processes"], rows, left=("kind", "processes"))
            + f'<p class="muted">Steady window {d.window_s[0]:.1f}–{d.window_s[1]:.1f} s '
              f"(the first second after the load started is skipped).</p>")


def run_page(run: RunAnalysis, figures: list[Figure], tables: dict[str, str], report_dir: str) -> str:
    """The HTML of a one-run report."""
    config = (run.summary.get("config") or {})
    argv = config.get("argv") if isinstance(config, dict) else None
    state_cols, state_rows = state_wide(run)
    parts = [f"<h1>creditflow report: {_e(run.label)}</h1>",
             f'<p class="muted">{_e(run.run_dir)}' + (f" — creditflow {_e(' '.join(map(str, argv)))}" if argv
                                                      else "") + "</p>",
             "<h2>Diagnosis</h2>", _diagnosis_block(run),
             "<h2>Summary</h2>", table(["metric", "value"], summary_rows(run), left=("metric",)),
             "<h2>Rates and latency</h2>", _figure(figures[0]), _figure(figures[1]),
             "<h2>Flow control</h2>", _figure(figures[2]),
             "<h3>Time in each state (s)</h3>", table(state_cols, state_rows, left=("name", "kind")),
             "<h3>Links</h3>",
             table(["link", "max_in_flight", "sent", "overflow"], run.links, left=("link",)),
             "<h2>Resources and alarms</h2>", _figure(figures[3]), _figure(figures[4]),
             table(["source", "set_s", "clear_s", "duration_s"], alarm_rows(run), left=("source",)),
             "<h2>Message store</h2>", _figure(figures[5]),
             "<h2>Tables</h2><ul>" + "".join(
                 f'<li><a href="{html.escape(os.path.relpath(p, report_dir))}">{html.escape(os.path.basename(p))}'
                 f"</a></li>" for p in tables.values()) + '<li><a href="diagnosis.json">diagnosis.json</a></li></ul>']
    return _page(f"creditflow report: {run.label}", "\n".join(parts))


def comparison_page(runs: list[RunAnalysis], figures: list[Figure], out_dir: str, table_path: str) -> str:
    """The HTML of a page putting several runs side by side."""
    rows = [run_row(r) for r in runs]
    links = "".join(
        f'<li><a href="{html.escape(os.path.relpath(os.path.join(r.run_dir, "report", "index.html"), out_dir))}">'
        f"{_e(r.label)}</a> — {_e(r.run_dir)}</li>" for r in runs)
    verdicts = "".join(f'<p class="{"verdict none" if r.diagnosis.bottleneck == "none" else "verdict"}">'
                       f"<b>{_e(r.label)}</b>: {_e(r.diagnosis.bottleneck)} — {_e(r.diagnosis.rule)}</p>"
                       for r in runs if r.diagnosis)
    parts = [f"<h1>creditflow comparison of {len(runs)} runs</h1>", f"<ul>{links}</ul>",
             "<h2>Diagnosis</h2>", verdicts,
             "<h2>Side by side</h2>", table(list(RUN_COLUMNS[:-1]), rows, left=("run", "alarms", "bottleneck")),
             f'<p class="muted"><a href="{html.escape(os.path.relpath(table_path, out_dir))}">runs.csv</a></p>',
             "<h2>Rates</h2>", _figure(figures[0]),
             "<h2>Latency</h2>", _figure(figures[1]),
             "<h2>Flow per stage kind</h2>", _figure(figures[2])]
    return _page("creditflow comparison", "\n".join(parts))
