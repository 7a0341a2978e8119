"""The state clock: each process's state as RabbitMQ shows it, recorded on change only, timed exactly."""

from pipeline.broker.process_states import FLOW_HOLD_NS, PUSH_AHEAD_NS, Change, StateClock, push_due_ns, state_at

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


def test_a_block_is_pushed_at_once_only_when_it_changes_the_state_shown():
    never = (False, None)
    assert push_due_ns(never, never, 5 * S) is None
    assert push_due_ns(never, (True, 5 * S), 5 * S) == 5 * S                       # running -> flow: now
    assert push_due_ns((True, 5 * S), (False, 5 * S), 5 * S + S // 10) == 6 * S - PUSH_AHEAD_NS   # still flow
    assert push_due_ns((True, 5 * S), (False, 5 * S), 7 * S) == 7 * S              # a long block ended: now
    assert push_due_ns((True, 5 * S), (True, 5 * S + S // 2), 6 * S) is None       # blocked all along, as told


def test_newer_blocks_are_told_once_before_the_hold_of_the_last_one_told_runs_out():
    told = (False, 5 * S)                  # the supervisor shows flow until 6 s, then running by time alone
    for facts in ((True, 5 * S + S // 4), (False, 5 * S + S // 4), (False, 5 * S + S // 2)):
        assert push_due_ns(told, facts, 5 * S + S // 2) == 6 * S - PUSH_AHEAD_NS
    assert push_due_ns(told, (True, 7 * S), 7 * S) == 7 * S          # its hold ran out: a new block is news
    assert push_due_ns(told, (False, 5 * S), 9 * S) is None


def test_what_is_pushed_keeps_the_clock_s_states_those_the_stage_would_show():
    """A channel blocking every 50 ms for 3 s, pushing only when push_due_ns says: the supervisor's clock,
    fed only those pushes, holds flow from the first block to one second after the last."""
    clock, told, pushes, last_block = StateClock(), (False, None), 0, None
    clock.observe("channel-1.1", {"kind": "channel"}, 0)
    for t in range(S, 6 * S, S // 100):                        # a turn every 10 ms
        blocking = t < 4 * S and (t // (S // 100)) % 5 == 0
        if blocking:
            last_block = t
        facts = (blocking, last_block)
        clock.tick(t)
        due = push_due_ns(told, facts, t)
        if due is not None and t >= due:
            pushes += 1
            told = facts
            clock.observe("channel-1.1", {"kind": "channel", "blocked": facts[0], "block_started_ns": facts[1]}, t)
        assert clock.state("channel-1.1") == ("flow" if last_block is not None and
                                              (blocking or t < last_block + FLOW_HOLD_NS) else "running"), t
    assert pushes == 2          # the first block, and the last unblock before its hold runs out: not 120
