"""When a connection stops reading, and what it reports (RabbitMQ's reader throttle)."""

from __future__ import annotations

import pytest

from pipeline.broker.throttle import DISK, FLOW, MEMORY, IllegalTransition, Notice, Throttle


def test_flow_blocks_reading_on_the_publish_and_clears_with_credit():
    t = Throttle()
    t.set_reason(FLOW, True)
    assert t.reported_state() == "flow" and t.reading
    assert t.publish_received() == []
    assert not t.reading and t.reported_state() == "flow"
    assert t.set_reason(FLOW, False) == []
    assert t.reading and t.reported_state() == "running"


def test_an_alarm_blocks_only_a_publishing_connection_and_tells_it_once():
    t = Throttle()
    assert t.set_reason(MEMORY, True) == []
    assert t.reading and t.reported_state() == "blocking"
    assert t.publish_received() == [Notice(True, "low on memory")]
    assert not t.reading and t.reported_state() == "blocked"
    assert t.publish_received() == []
    assert t.set_reason(MEMORY, True) == []
    assert t.set_reason(MEMORY, False) == [Notice(False)]
    assert t.reading and t.reported_state() == "running"


def test_both_alarms_need_both_clears():
    t = Throttle()
    t.set_reason(DISK, True)
    t.set_reason(MEMORY, True)
    assert t.publish_received() == [Notice(True, "low on memory & disk")]
    assert t.set_reason(MEMORY, False) == []
    assert not t.reading
    assert t.set_reason(DISK, False) == [Notice(False)]
    assert t.reading


def test_unblocked_is_sent_even_while_still_in_flow():
    t = Throttle()
    t.set_reason(MEMORY, True)
    t.publish_received()
    t.set_reason(FLOW, True)
    assert t.set_reason(MEMORY, False) == [Notice(False)]
    assert not t.reading and t.reported_state() == "flow"


def test_closing_is_terminal_and_illegal_moves_raise():
    t = Throttle()
    t.close()
    assert t.reported_state() == "closing"
    with pytest.raises(IllegalTransition):
        t._go("block")
