"""A channel that blocks hundreds of times a second: what it tells the supervisor, and what that shows.

One unpaced publisher (``scripts/raw_driver.py``) runs its channel out of
credit towards the queue and back hundreds of times a second. RabbitMQ shows
such a process as ``flow`` from its first block until a second after its last
one began, so its later blocks change nothing shown: the channel pushes its
statistics at its first block (and, had its blocks stopped, once before its
flow ran out), and otherwise only at its regular interval, not at every block
and unblock. The run's ``states`` timeline, which the supervisor writes from
those pushes alone, still holds the channel in ``flow`` from its first block
to its end; its ``stats`` rows are its pushes (every one is written with so
few stages).
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from conftest import script_module
from pipeline.broker.stage import STATS_INTERVAL_MS          # a busy stage's regular pushes are this far apart

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def test_a_channel_blocking_hundreds_of_times_a_second_shows_flow_throughout_from_few_pushes(start_broker):
    broker = start_broker("--management-port", "off")
    script_module("raw_driver").run(broker.port, size=100, seconds=2.0, queue="flapping")
    broker.stop()

    telemetry = broker.data_dir / "telemetry"
    stats = pq.read_table(telemetry / "stats.parquet").to_pylist()
    publishing = max({r["name"] for r in stats if r["name"].startswith("channel-")},
                     key=lambda name: max(r["block_count"] or 0 for r in stats if r["name"] == name))
    rows = sorted((r for r in stats if r["name"] == publishing), key=lambda r: r["at_ns"])
    blocks = rows[-1]["block_count"]
    between = [b for a, b in zip(rows, rows[1:]) if b["at_ns"] - a["at_ns"] < STATS_INTERVAL_MS * 1_000_000]
    states = [r["state"] for r in pq.read_table(telemetry / "states.parquet").to_pylist() if r["name"] == publishing]

    assert blocks >= 100, f"the channel blocked only {blocks} times: nothing here tells pushes from blocks"
    assert states == ["running", "flow", "flow"], states     # one span of flow to its end, not one per block
    # between regular pushes only its first block and its last push as it ended, not one a block
    assert len(between) <= 2, [(r["at_ns"], r["blocked"], r["block_count"]) for r in between]
