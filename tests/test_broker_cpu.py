"""pipeline.broker_cpu's arithmetic: which kind each process is, and CPU per message between two readings."""

from __future__ import annotations

from pipeline.broker_cpu import Reading, kinds_by_pid, per_message


def test_processes_hosts_and_the_supervisor_get_their_kinds():
    status = {"pid": 1, "processes": {"reader-1": {"kind": "reader", "pid": 10, "alive": True},
                                      "queue-q": {"kind": "queue", "pid": 20, "alive": True},
                                      "channel-1.1": {"kind": "channel", "pid": 30, "alive": False}},
              "hosts": {"host-channel-0": {"pid": 31, "kind": "channel", "stages": 1}}}
    assert kinds_by_pid(status) == {10: "reader", 20: "queue", 31: "channel", 1: "supervisor"}


def test_cpu_between_the_readings_is_divided_by_the_messages_delivered_between_them():
    first = Reading(1_000, {10: ("reader", 1.0), 11: ("reader", 0.5), 20: ("queue", 2.0)})
    last = Reading(11_000, {10: ("reader", 1.1), 11: ("reader", 0.55), 20: ("queue", 2.2),
                            30: ("channel", 0.03)})       # started between the readings: counted from zero
    got = per_message(first, last)
    assert got["messages"] == 10_000
    assert got["us_per_message"] == {"channel": 3.0, "queue": 20.0, "reader": 15.0}
    assert got["total_us_per_message"] == 38.0


def test_a_pid_reused_by_another_kind_counts_from_zero_and_no_delivery_gives_no_figure():
    first = Reading(0, {10: ("reader", 5.0)})
    last = Reading(1_000, {10: ("queue", 0.01)})
    assert per_message(first, last)["us_per_message"] == {"queue": 10.0}
    assert per_message(Reading(5, {}), Reading(5, {})) is None
