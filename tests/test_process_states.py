"""The state clock: each process's state as RabbitMQ shows it, recorded on change only, timed exactly."""

from pipeline.broker.process_states import FLOW_HOLD_NS, Change, StateClock, state_at

S = 1_000_000_000


def test_a_reader_shows_its_connection_state():
    assert state_at({"kind": "reader", "conn_state": "blocked"}, 0) == "blocked"
    assert state_at({"kind": "channel", "blocked": True}, 0) == "flow"


def test_a_block_shows_as_flow_for_one_second_after_it_began():
    stats = {"kind": "queue", "blocked": False, "block_started_ns": 10 * S}
    assert state_at(stats, 10 * S + FLOW_HOLD_NS - 1) == "flow"
    assert state_at(stats, 10 * S + FLOW_HOLD_NS) == "running"


def test_only_changes_are_recorded():
    clock = StateClock()
    assert clock.observe("channel-1.1", {"kind": "channel"}, 0) == Change(0, "channel-1.1", "channel", "running")
    for t in range(1, 100):                          # idle pushes change nothing: nothing to record
        assert clock.observe("channel-1.1", {"kind": "channel"}, t * S) is None
    assert clock.tick(200 * S) == []
    assert not clock.deadlines


def test_a_held_flow_ends_by_time_alone_at_its_deadline():
    clock = StateClock()
    clock.observe("queue-q", {"kind": "queue"}, 0)
    assert clock.observe("queue-q", {"kind": "queue", "blocked": True}, 5 * S).state == "flow"
    assert clock.observe("queue-q", {"kind": "queue", "blocked": False, "block_started_ns": 5 * S},
                         5 * S + S // 10) is None           # unblocked, but flow is held for the second
    assert clock.tick(5 * S + S // 2) == []
    assert clock.tick(7 * S) == [Change(6 * S, "queue-q", "queue", "running")]   # timed at the deadline
    assert clock.seconds("queue-q", 8 * S) == {"running": 7.0, "flow": 1.0, "total": 8.0}


def test_time_in_each_state_is_summed_from_change_to_change_and_stops_at_the_end():
    clock = StateClock()
    clock.observe("reader-1", {"kind": "reader", "conn_state": "running"}, 0)
    clock.observe("reader-1", {"kind": "reader", "conn_state": "blocking"}, 2 * S)
    clock.observe("reader-1", {"kind": "reader", "conn_state": "blocked"}, 3 * S)
    clock.observe("reader-1", {"kind": "reader", "conn_state": "running"}, 7 * S)
    assert clock.end("reader-1", 10 * S) == Change(10 * S, "reader-1", "reader", "running")
    assert clock.end("reader-1", 11 * S) is None
    assert clock.seconds("reader-1", 60 * S) == {"running": 5.0, "blocking": 1.0, "blocked": 4.0, "total": 10.0}


def test_a_restarted_stage_starts_a_new_span_under_its_old_name():
    clock = StateClock()
    clock.observe("queue-q", {"kind": "queue"}, 0)
    clock.end("queue-q", 2 * S)
    assert clock.observe("queue-q", {"kind": "queue"}, 5 * S) == Change(5 * S, "queue-q", "queue", "running")
    assert clock.seconds("queue-q", 6 * S)["total"] == 3.0          # the 3 s it was down are not counted
