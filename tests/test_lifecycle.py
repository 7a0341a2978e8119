"""Supervision as tables: what a stage's end means, decided with no process and no clock."""

from __future__ import annotations

import pytest

from pipeline.broker import lifecycle
from pipeline.broker.lifecycle import IllegalTransition, RestartBook, on_exit, step

S = 1_000_000_000


def decide(kind: str, code: int, state: str = "running", *, running: bool = True, book: RestartBook | None = None,
           name: str = "x", now_ns: int = 0):
    return on_exit(kind, state, code, broker_running=running, book=book or RestartBook(), name=name, now_ns=now_ns)


def test_every_edge_of_the_table_and_nothing_else():
    assert step("running", "stop") == "stopping"
    assert step("running", "exit", "gone") == "gone"
    assert step("running", "exit", "restarting") == "restarting"
    assert step("restarting", "spawned") == "running"
    assert step("stopping", "exit") == "gone"
    with pytest.raises(IllegalTransition, match="no transition from 'gone' on 'stop'"):
        step("gone", "stop")
    with pytest.raises(IllegalTransition, match="to 'restarting'"):
        step("stopping", "exit", "restarting")


@pytest.mark.parametrize("kind, action", [
    ("reader", "close_connection"), ("channel", "internal_error"), ("queue", "restart"), ("store", "restart"),
    ("watchdog", "restart")])
def test_a_stage_killed_under_a_running_broker_is_handled_as_rabbitmq_does(kind, action):
    verdict = decide(kind, -9)
    assert verdict.action == action
    assert verdict.crashed
    assert verdict.how == "signal 9"


@pytest.mark.parametrize("kind", ["reader", "channel"])
def test_a_connection_or_channel_that_finishes_is_no_death(kind):
    verdict = decide(kind, 0)
    assert (verdict.action, verdict.crashed, verdict.state) == ("forget", False, "gone")


@pytest.mark.parametrize("kind", ["queue", "store", "watchdog"])
def test_a_queue_store_or_watchdog_leaving_unasked_even_with_exit_0_is_restarted(kind):
    assert decide(kind, 0).action == "restart"
    assert decide(kind, 70).how == "exit code 70"


@pytest.mark.parametrize("kind", ["reader", "channel", "queue", "store", "watchdog"])
def test_nothing_is_restarted_or_reported_while_stopping(kind):
    assert decide(kind, -9, "stopping").action == "forget"
    assert not decide(kind, -9, "stopping").crashed
    assert decide(kind, -9, running=False).action == "forget"


def test_restart_intensity_gives_up_as_otp_does_and_the_window_slides():
    book = RestartBook(max_restarts=3, period_ns=10 * S)
    actions = [decide("queue", -9, book=book, name="queue-q", now_ns=i * S).action for i in range(4)]
    assert actions == ["restart", "restart", "restart", "queue_down"]
    # another queue has a book of its own
    assert decide("queue", -9, book=book, name="queue-other", now_ns=3 * S).action == "restart"
    # once the earliest restarts are older than the period, restarting is allowed again
    assert decide("queue", -9, book=book, name="queue-q", now_ns=11 * S).action == "restart"


@pytest.mark.parametrize("kind, give_up", [("queue", "queue_down"), ("store", "stop_broker"),
                                           ("watchdog", "no_watchdog")])
def test_what_giving_up_means_for_each_kind(kind, give_up):
    book = RestartBook(max_restarts=0)
    assert decide(kind, 1, book=book).action == give_up
    assert lifecycle.ON_GIVE_UP[kind] == give_up

