"""``creditflow sweep``: grid files into points, and a real two-point sweep on the session's Spark."""

from __future__ import annotations

import csv
import json
import subprocess

import pytest

from conftest import ROOT, creditflow_cmd
from pipeline.sweep import GridError, load_grid, points_of

GRID = """
[run]
producers = 1
consumers = 1
time = 2
autoack = false

[grid]
credit = ["400,200", "0,0"]
size = [100, 4096]
"""


def test_every_combination_is_a_point_with_the_shared_options_first(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text(GRID)
    points = load_grid(str(path))
    assert [p.values for p in points] == [{"credit": "400,200", "size": 100}, {"credit": "400,200", "size": 4096},
                                          {"credit": "0,0", "size": 100}, {"credit": "0,0", "size": 4096}]
    assert points[0].args == ("--producers", "1", "--consumers", "1", "--time", "2",
                              "--credit", "400,200", "--size", "100")
    assert [p.index for p in points] == [1, 2, 3, 4]
    assert len({p.name for p in points}) == 4 and points[2].name == "p03-credit=0,0-size=100"
    assert all(p.seconds == 2 for p in points)


def test_a_true_flag_is_passed_and_single_letter_keys_are_short_options():
    points = points_of({"run": {"a": True, "z": 3}, "grid": {"L": [0, 500]}})
    assert points[1].args == ("-a", "-z", "3", "-L", "500")
    assert points[1].seconds == 3


@pytest.mark.parametrize("doc, words", [
    ({"run": {"time": 2}}, "needs a [grid]"),
    ({"grid": {"size": []}}, "grid.size must be a non-empty list"),
    ({"grid": {"size": 100}}, "grid.size must be a non-empty list"),
    ({"grid": {"size": [100]}, "extra": {}}, "unknown table(s) extra"),
    ({"run": {"run-dir": "x"}, "grid": {"size": [100]}}, "run-dir is set by the sweep"),
    ({"grid": {"port": [5672]}}, "port is set by the sweep"),
    ({"grid": {"credit": ["400,200", "100,200"]}}, "point credit=100,200"),
    ({"grid": {"no-such-option": [1]}}, "unrecognized arguments"),
    ({"grid": {"size": [{"a": 1}]}}, "is not a number, string or true/false"),
])
def test_a_bad_grid_is_refused_before_anything_runs(doc, words):
    with pytest.raises(GridError) as err:
        points_of(doc)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(60)
def test_the_cli_exits_2_with_one_line_for_a_bad_grid(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[grid]\nsize = [100, 'big']\n")
    for path in (bad, tmp_path / "missing.toml"):
        proc = subprocess.run(creditflow_cmd("sweep", str(path)), capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and str(path.name) in proc.stderr
    assert not (ROOT / "sweeps").exists() or not any((ROOT / "sweeps").glob("bad-*"))


@pytest.mark.processes
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_point_sweep_lands_in_one_table_and_a_comparison(spark, tmp_path):
    pytest.importorskip("pyspark")
    from pipeline.analytics.sweep import run_sweep
    import pyarrow.parquet as pq

    points = points_of({"run": {"producers": 1, "consumers": 1, "time": 2, "size": 100},
                        "grid": {"credit": ["400,200", "0,0"]}})
    out = tmp_path / "sweep"
    done = run_sweep(points, str(out), log=print)

    assert done["points"] == 2 and done["failed"] == 0
    table = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [row["credit"] for row in table] == ["400,200", "0,0"]
    for row in table:
        assert row["exit_code"] == 0 and row["lost"] == 0
        assert row["delivered"] == row["published"] > 1000
        assert row["deliver_rate"] > 0 and row["bottleneck"] in ("channel", "queue", "message_store", "none")
        diagnosis = json.loads((out / "points" / row["run"] / "report" / "diagnosis.json").read_text())
        assert diagnosis["bottleneck"] == row["bottleneck"]
    # with credit off nothing is ever in flow
    assert table[1]["flow_reader"] == 0 and table[1]["bottleneck"] == "none"
    with open(out / "sweep.csv", newline="") as f:
        assert [r["credit"] for r in csv.DictReader(f)] == ["400,200", "0,0"]
    page = (out / "index.html").read_text()
    assert "p01-credit=400,200" in page and "p02-credit=0,0" in page
    assert (out / "compare_rates.png").stat().st_size > 5000


@pytest.mark.timeout(60)
def test_master_and_remote_together_are_refused(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text("[grid]\nsize = [100]\n")
    proc = subprocess.run(creditflow_cmd("sweep", str(grid), "--master", "local[1]", "--remote", "sc://h:15002"),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--master or --remote, not both" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.processes
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sweep_runs_on_spark_connect(tmp_path):
    """``--remote local[2]`` starts a Spark Connect server of its own: the same client path as a
    remote ``sc://`` cluster, in a process of its own so it does not meet the session's Spark."""
    pytest.importorskip("pyspark.sql.connect")
    grid = tmp_path / "grid.toml"
    grid.write_text("[run]\ntime = 2\nsize = 100\n\n[grid]\nproducers = [1, 2]\n")
    out = tmp_path / "sweep"
    proc = subprocess.run(creditflow_cmd("sweep", str(grid), "--remote", "local[2]", "--out", str(out)),
                          capture_output=True, text=True, timeout=280, cwd=ROOT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 points in" in proc.stdout and "0 failed" in proc.stdout
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["producers"] for r in rows] == ["1", "2"]
    assert all(r["exit_code"] == "0" and int(r["delivered"]) == int(r["published"]) > 1000 for r in rows)
    assert (out / "index.html").exists()


@pytest.mark.processes
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spark_submit_runs_a_sweep_under_its_own_master(tmp_path):
    """The cluster recipe of the README, on a local master: spark-submit's --master is the one used."""
    import os
    import sys
    from pathlib import Path
    pyspark = pytest.importorskip("pyspark")
    home = Path(pyspark.__file__).parent
    grid = tmp_path / "grid.toml"
    grid.write_text("[run]\ntime = 2\n\n[grid]\nsize = [100]\n")
    out = tmp_path / "sweep"
    env = dict(os.environ, SPARK_HOME=str(home), PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    proc = subprocess.run([str(home / "bin" / "spark-submit"), "--master", "local[1]", "--conf", "spark.task.cpus=1",
                           str(ROOT / "scripts" / "spark_driver.py"), "sweep", str(grid), "--out", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "sweep: 1 point on local[1]" in proc.stdout and "0 failed" in proc.stdout
    with open(out / "sweep.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert row["size"] == "100" and row["exit_code"] == "0" and int(row["delivered"]) > 1000
