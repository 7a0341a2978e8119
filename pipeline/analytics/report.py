"""``creditflow report``: a run directory (or several) turned into an HTML report.

One run::

    RUN_DIR/report/index.html      the page (self-contained; PNGs beside it)
    RUN_DIR/report/*.png           rates, latency, flow timeline, memory, disk, fsync
    RUN_DIR/report/tables/*.csv    process states, links, summary, alarms, seconds
    RUN_DIR/report/diagnosis.json  {"bottleneck", "evidence", "rule", ...}

Several runs: each gets its own report as above, and a comparison page goes to
``out_dir`` (default ``./report-compare-<UTC time>/``) with the runs side by
side and ``tables/runs.csv``.

The pipeline: load (Spark DataFrames over the JSON lines,
:mod:`pipeline.analytics.load`) -> analyse (Spark aggregations collected into
small results, :mod:`pipeline.analytics.analysis`; the diagnosis rules in
:mod:`pipeline.analytics.diagnosis`) -> plot and tabulate on the driver ->
write HTML. The Spark session is ``local[*]`` unless ``master`` is given;
an already active session is reused.
"""

from __future__ import annotations

import json
import os
import time

from pipeline.analytics import html as pages
from pipeline.analytics import plots
from pipeline.analytics.analysis import RunAnalysis, analyse
from pipeline.analytics.load import load_run
from pipeline.analytics.session import spark_session
from pipeline.analytics.tables import RUN_COLUMNS, run_row, write_csv, write_run_tables


def write_run_report(run: RunAnalysis) -> str:
    """Write RUN_DIR/report/ for an analysed run; returns the index.html path."""
    report_dir = os.path.join(run.run_dir, "report")
    os.makedirs(report_dir, exist_ok=True)
    figures = plots.run_figures(run, report_dir)
    tables = write_run_tables(run, os.path.join(report_dir, "tables"))
    with open(os.path.join(report_dir, "diagnosis.json"), "w", encoding="utf-8") as f:
        json.dump(run.diagnosis.to_json(), f, indent=2)
        f.write("\n")
    index = os.path.join(report_dir, "index.html")
    with open(index, "w", encoding="utf-8") as f:
        f.write(pages.run_page(run, figures, tables, report_dir))
    return index


def write_comparison(runs: list[RunAnalysis], out_dir: str) -> str:
    """Write the side-by-side page for several analysed runs; returns its index.html path."""
    os.makedirs(os.path.join(out_dir, "tables"), exist_ok=True)
    figures = plots.comparison_figures(runs, out_dir)
    table_path = write_csv(os.path.join(out_dir, "tables", "runs.csv"), RUN_COLUMNS, [run_row(r) for r in runs])
    index = os.path.join(out_dir, "index.html")
    with open(index, "w", encoding="utf-8") as f:
        f.write(pages.comparison_page(runs, figures, out_dir, table_path))
    return index


def default_compare_dir() -> str:
    return os.path.abspath(f"report-compare-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")


def build_report(run_dirs: list[str], master: str | None = None, out_dir: str | None = None,
                 remote: str | None = None) -> str:
    """Report one run (or compare several); returns the path of the index.html written.

    One run: ``out_dir`` is ignored and the report goes to RUN_DIR/report/.
    Raises NotARunDirectory for a path with neither summary.json nor telemetry/.
    """
    if not run_dirs:
        raise ValueError("build_report needs at least one run directory")
    with spark_session(master, remote) as spark:
        analysed = [analyse(load_run(spark, d)) for d in run_dirs]
    indexes = [write_run_report(run) for run in analysed]
    if len(analysed) == 1:
        return indexes[0]
    return write_comparison(analysed, os.path.abspath(out_dir) if out_dir else default_compare_dir())
