"""RabbitMQ's management API answers turned into the telemetry a report reads (the pure part of
``creditflow run --management-uri``). The answers below have the shape RabbitMQ 3.10.8 gives
for the columns the sampler asks for."""

from pipeline.loadgen.management import Observer

S = 1_000_000_000
CONN = "127.0.0.1:58634 -> 127.0.0.1:5712"


def answers(conn_state="running", chan_state="running", queue_state="running", published=0, mem_alarm=False):
    connections = [{"name": CONN, "state": conn_state}]
    channels = [{"name": f"{CONN} (1)", "state": chan_state, "connection_details": {"name": CONN},
                 "message_stats": {"publish": published}}]
    queues = [{"name": "q", "vhost": "/", "state": queue_state, "messages_ready": 0,
               "messages_unacknowledged": 0}]
    nodes = [{"name": "rabbit@host", "mem_used": 100, "mem_limit": 1000, "mem_alarm": mem_alarm,
              "disk_free": 10**9, "disk_free_limit": 5 * 10**7, "disk_free_alarm": False}]
    return connections, channels, queues, nodes


def test_states_are_written_on_change_with_rabbitmqs_names_and_our_kinds():
    o = Observer()
    first = o.observe(1 * S, *answers())
    assert {(r["name"], r["kind"], r["state"]) for r in first.states} == {
        (CONN, "reader", "running"), (f"{CONN} (1)", "channel", "running"), ("q", "queue", "running")}
    assert o.observe(2 * S, *answers()).states == []                        # nothing changed
    flow = o.observe(3 * S, *answers(conn_state="flow", chan_state="flow")).states
    assert {(r["name"], r["state"]) for r in flow} == {(CONN, "flow"), (f"{CONN} (1)", "flow")}
    assert o.clock.seconds(CONN, 4 * S) == {"running": 2.0, "flow": 1.0, "total": 3.0}


def test_a_connection_that_closed_ends_its_span_and_the_end_of_the_run_closes_the_rest():
    o = Observer()
    o.observe(1 * S, *answers())
    _, _, queues, nodes = answers()
    gone = o.observe(2 * S, [], [], queues, nodes).states
    assert {(r["name"], r["at_ns"]) for r in gone} == {(CONN, 2 * S), (f"{CONN} (1)", 2 * S)}
    assert [(r["name"], r["at_ns"]) for r in o.finish(3 * S).states] == [("q", 3 * S)]


def test_publishing_connections_and_the_nodes_alarms_are_reported_as_the_watchdog_would():
    o = Observer()
    o.observe(1 * S, *answers())
    rows = o.observe(2 * S, *answers(published=500, mem_alarm=True))
    readers = [r for r in rows.stats if r["kind"] == "reader"]
    assert readers == [{"at_ns": 2 * S, "name": CONN, "kind": "reader", "publishes": 500,
                        "first_publish_ns": 2 * S, "last_publish_ns": 2 * S}]
    watchdog = next(r for r in rows.stats if r["kind"] == "watchdog")
    assert watchdog["memory_used"] == 100 and watchdog["memory_limit"] == 1000 and watchdog["memory_alarm"]
    assert [(e["event"], e["data"]["source"]) for e in rows.events] == [("alarm_set", "memory")]
    cleared = o.observe(3 * S, *answers(published=500))
    assert [(e["event"], e["data"]["source"]) for e in cleared.events] == [("alarm_clear", "memory")]
    assert not [r for r in cleared.stats if r["kind"] == "reader"]          # no new publishes: no row
