"""A host spreads its stages' statistics pushes (together near HOST_STATS_PER_S a second), and gives a stage with
deliveries waiting a turn after each other stage's (consumer bias)."""

from __future__ import annotations

import socket
import types

import pytest

from pipeline.broker.host import HOST_STATS_PER_S, MAX_STATS_INTERVAL_NS, Host
from pipeline.broker.stage import STATS_INTERVAL_MS

MS = 1_000_000


@pytest.fixture
def host():
    ours, theirs = socket.socketpair()
    h = Host("reader-pool-1", ours, cfg=None)
    yield h
    h.selector.close()
    ours.close()
    theirs.close()


def with_stages(host: Host, count: int) -> list:
    stages = [types.SimpleNamespace(stats_interval_ns=None) for _ in range(count)]
    host.stages = {f"s{i}": s for i, s in enumerate(stages)}
    host.space_stats()
    return stages


@pytest.mark.parametrize("count, every_ms", [(1, STATS_INTERVAL_MS), (5, 100), (10, 200), (25, 500), (50, 1000),
                                             (400, 1000)])
def test_each_stage_pushes_less_often_as_a_host_holds_more(host, count, every_ms):
    stages = with_stages(host, count)
    assert {s.stats_interval_ns for s in stages} == {every_ms * MS}
    assert count * 1000 / every_ms <= max(HOST_STATS_PER_S, count * 1_000_000_000 / MAX_STATS_INTERVAL_NS)


def test_a_longer_interval_asked_for_is_kept_and_fewer_stages_shorten_it_again(host):
    host.stats_interval_ns = 1000 * MS                   # --telemetry off
    assert {s.stats_interval_ns for s in with_stages(host, 5)} == {1000 * MS}
    host.stats_interval_ns = None
    assert {s.stats_interval_ns for s in with_stages(host, 30)} == {600 * MS}
    assert {s.stats_interval_ns for s in with_stages(host, 3)} == {STATS_INTERVAL_MS * MS}


class Recorder(Host):
    """A host whose turns are only written down."""

    def __init__(self, ctl):
        super().__init__("reader-pool-1", ctl, cfg=None)
        self.turns: list[str] = []

    def take_turn(self, stage) -> None:
        self.turns.append(stage.name)
        stage.waiting = max(0, stage.waiting - 1)


def stage(name: str, waiting: int = 0):
    """A stand-in stage with ``waiting`` turns' worth of deliveries in its rings."""
    s = types.SimpleNamespace(name=name, waiting=waiting)
    s.deliveries_waiting = lambda: s.waiting > 0
    return s


def test_a_consumer_with_deliveries_waiting_has_a_turn_after_each_publishers_turn():
    ours, theirs = socket.socketpair()
    host = Recorder(ours)
    try:
        pubs = [stage(f"reader-{i}") for i in range(1, 4)]
        consumer = stage("reader-9", waiting=3)
        idle = stage("reader-8")                  # a consumer whose rings are empty gets no extra turns
        round_ = [*pubs, consumer, idle]
        host.stages = {s.name: s for s in round_}
        host.take_turns(round_)
        assert host.turns == ["reader-1", "reader-9", "reader-2", "reader-9", "reader-3", "reader-9",
                              "reader-9", "reader-8"]
        host.turns.clear()
        del host.stages["reader-2"]               # a stage dropped in the round gets no turn
        consumer.waiting = 3
        host.take_turns(round_)
        assert host.turns == ["reader-1", "reader-9", "reader-3", "reader-9", "reader-9", "reader-8"]
    finally:
        host.selector.close()
        ours.close()
        theirs.close()
