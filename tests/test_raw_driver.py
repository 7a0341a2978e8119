"""scripts/raw_driver.py, the load driver written apart from the load generator, against a real broker."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def raw_driver():
    spec = importlib.util.spec_from_file_location("raw_driver", ROOT / "scripts" / "raw_driver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_publishes_and_counts_what_the_consumer_received_in_the_window(broker):
    driver = raw_driver()
    plain = driver.run(broker.port, size=100, seconds=1.5, queue="raw-plain")
    assert plain["deliver_rate"] > 100 and plain["publish_rate"] >= plain["deliver_rate"] * 0.9
    confirmed = driver.run(broker.port, size=4096, seconds=1.5, persistent=True, confirm=200, queue="raw-confirmed")
    assert confirmed["deliver_rate"] > 50
    assert confirmed["overrun"] is False               # with credit flow the publisher never ran far ahead
    assert broker.wait_for(lambda s: "raw-plain" not in s["queues"] and "raw-confirmed" not in s["queues"],
                           what="the runs' queues gone with their consumers")   # auto-delete: no leftover backlog
