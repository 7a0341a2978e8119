"""``creditflow sweep GRID.toml``: every grid point as a Spark task, then one table and a comparison.

The driver turns the grid into points (:mod:`pipeline.sweep`), makes one
partition per point and runs :func:`pipeline.sweep.run_point` on each: the
task starts ``creditflow run`` on its executor's machine. The results come
back to the driver, which reports on each point's run directory with the same
Spark session, then writes into OUT_DIR:

* ``sweep.parquet`` and ``sweep.csv``  one row per point: the grid values, then
  the comparison table's columns (rates, latency, flow per stage kind,
  alarms, bottleneck), then the exit code, executor host and task seconds;
* ``index.html``, ``tables/runs.csv`` and plots  the points side by side;
* ``points/NAME/``  each point's run directory, with its own ``report/``.

A run must have the machine to itself to mean anything, so the local default
is ``local[1]``: one point at a time (``--parallel N`` allows N). On a cluster,
give each executor as many ``spark.task.cpus`` as it has cores, so that it
too runs one point at a time, and put OUT_DIR on a file system every node and
the driver share: executors write the run directories, the driver reads them.
"""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from pyspark.sql import functions as F

from pipeline.analytics.analysis import analyse
from pipeline.analytics.load import load_run
from pipeline.analytics.report import write_comparison, write_run_report
from pipeline.analytics.session import describe, spark_session, under_spark_submit
from pipeline.analytics.tables import RUN_COLUMNS, run_row
from pipeline.sweep import Point, run_point

RESULT_COLUMNS = ("exit_code", "host", "task_seconds", "run_dir")
STRESS_COLUMNS = ("verdict", "key_figure")      # a point that ran a ``creditflow stress`` scenario


def run_tasks(spark, points: list[Point], out_dir: str) -> list[dict]:
    """Each point as one Spark task; the tasks' results in point order.

    ``range(n)`` in n partitions gives every point a partition, hence a task, of
    its own; the UDF is non-deterministic so Spark never runs a point twice to
    plan a query. Only the DataFrame API is used (no RDDs), so a Spark Connect
    session can run the sweep as well as a classic one.
    """
    tasks = {i: p.to_task() for i, p in enumerate(points)}
    run = F.udf(lambda i: json.dumps(run_point(tasks[i], out_dir)), "string", useArrow=False).asNondeterministic()
    rows = spark.range(0, len(tasks), 1, len(tasks)).select(run("id").alias("result")).collect()
    return sorted((json.loads(row["result"]) for row in rows), key=lambda r: r["index"])


def table_rows(points: list[Point], results: list[dict], analysed: dict) -> list[dict]:
    """One row per point: grid values, comparison columns (blank for a point that failed), outcome."""
    rows = []
    for point, result in zip(points, results):
        run = analysed.get(point.index)
        row = {**{k: str(v) for k, v in point.values.items()}}
        row.update(run_row(run) if run is not None else {"run": point.name})
        row.update({k: result.get(k) for k in RESULT_COLUMNS + STRESS_COLUMNS})
        rows.append(row)
    return rows


def write_table(rows: list[dict], columns: list[str], out_dir: str) -> tuple[str, str]:
    """``sweep.parquet`` and ``sweep.csv``; numbers stay numbers, grid values are strings."""
    arrays = {}
    for column in columns:
        values = [row.get(column) for row in rows]
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, bool) for v in present):
            arrays[column] = pa.array(values, pa.bool_())
        elif present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            arrays[column] = pa.array(values, pa.int64())
        elif present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
            arrays[column] = pa.array([None if v is None else float(v) for v in values], pa.float64())
        else:
            arrays[column] = pa.array([None if v is None else str(v) for v in values], pa.string())
    table = pa.table(arrays)
    parquet_path, csv_path = os.path.join(out_dir, "sweep.parquet"), os.path.join(out_dir, "sweep.csv")
    pq.write_table(table, parquet_path)
    pacsv.write_csv(table, csv_path)
    return parquet_path, csv_path


def run_sweep(points: list[Point], out_dir: str, master: str | None = None, parallel: int = 1,
              log=print, remote: str | None = None) -> dict:
    """Run every point, report on each, write the table and the comparison; returns what was written."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()
    if master is None and not under_spark_submit():
        master = f"local[{parallel}]"
    with spark_session(master, remote) as spark:
        log(f"sweep: {len(points)} point{'s' if len(points) != 1 else ''} on {describe(spark)}, into {out_dir}")
        results = run_tasks(spark, points, out_dir)
        tasks_done = time.monotonic()
        analysed = {}
        for point, result in zip(points, results):
            if result.get("verdict"):
                log(f"sweep: point {point.name}: {result['verdict']}, {result['key_figure']}")
            if result["exit_code"] == 0 or result.get("verdict") == "FAIL":     # a failed verdict ran to its end
                analysed[point.index] = analyse(load_run(spark, result["run_dir"]))
            else:
                log(f"sweep: point {point.name} failed (exit {result['exit_code']}):\n{result['output_tail']}")
    runs = [analysed[p.index] for p in points if p.index in analysed]
    for run in runs:
        write_run_report(run)
    index = write_comparison(runs, out_dir) if runs else None
    stress = [c for c in STRESS_COLUMNS if any(r.get("verdict") for r in results)]
    columns = list(points[0].values) + stress + list(RUN_COLUMNS) + list(RESULT_COLUMNS)
    rows = table_rows(points, results, analysed)
    parquet_path, csv_path = write_table(rows, columns, out_dir)
    return {"points": len(points), "failed": sum(1 for r in results if r["exit_code"] != 0),
            "rows": rows, "index": index, "parquet": parquet_path, "csv": csv_path,
            "tasks_seconds": round(tasks_done - started, 1), "seconds": round(time.monotonic() - started, 1)}


__all__ = ["run_sweep", "run_tasks", "table_rows", "write_table"]
