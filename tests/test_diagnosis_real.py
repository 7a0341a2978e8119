"""The bottleneck diagnosis on real runs with a planted bottleneck.

Each case is a five-second ``creditflow run`` of one publisher and one
consumer in which one stage is made slow with its delay knob (a busy wait per
message), reported on with the session's Spark. RabbitMQ's rules must name
that stage: a slow channel leaves its connection in flow but not itself; a
slow queue holds the channel too; a slow store, writing persistent 4 KiB
messages (too big to embed in the queue's journal), holds the queue as well.
A publisher held to a rate the pipeline easily keeps up with is in flow
nowhere.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_creditflow

pytest.importorskip("pyspark")

from pipeline.analytics.report import build_report  # noqa: E402

# alone: a planted bottleneck is told by which stages wait on which; a second test's load on the two cores
# slows the stages next to the planted one too, and blurs what the diagnosis reads
pytestmark = [pytest.mark.processes, pytest.mark.spark, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(180)]

LOAD = ("-x", "1", "-y", "1", "-z", "5")


@pytest.mark.parametrize("planted, args, expected", [
    ("channel", ("-s", "100", "--channel-delay-us", "100"), "channel"),
    ("queue", ("-s", "100", "--queue-delay-us", "100"), "queue"),
    ("store", ("-s", "4096", "-f", "persistent", "--store-delay-us", "300"), "message_store"),
    ("nothing", ("-s", "100", "-r", "2000"), "none"),
])
def test_the_planted_bottleneck_is_found(request, tmp_path, planted, args, expected):
    run_dir = tmp_path / planted
    code, out, summary = run_creditflow(run_dir, *LOAD, *args, timeout_s=120)
    assert code == 0, out[-3000:]
    assert summary["lost"] == 0 and summary["delivered"] > 0

    # the session's Spark only now: a JVM starting (and compiling) during the run would take CPU from
    # the stages beside the planted one, and a queue slowed that way holds the channel in flow too
    request.getfixturevalue("spark")
    build_report([str(run_dir)])

    diagnosis = json.loads((run_dir / "report" / "diagnosis.json").read_text())
    assert diagnosis["bottleneck"] == expected, diagnosis
    evidence = diagnosis["evidence"]
    if expected == "none":
        assert evidence["reader"] < 0.10, diagnosis
        return
    # The stage just in front of the bottleneck spends most of the steady window in flow,
    # and the bottleneck itself almost none of it.
    in_front = {"channel": "reader", "queue": "channel", "message_store": "queue"}[expected]
    behind = {"channel": "channel", "queue": "queue", "message_store": "store"}[expected]
    assert evidence[in_front] >= 0.5, diagnosis
    assert evidence[behind] < 0.10, diagnosis
