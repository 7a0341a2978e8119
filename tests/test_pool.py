"""Stage hosts with real processes: many connections, channels and queues to a few OS processes.

Readers, channels and queues run in ``--pool`` hosts per kind; each stage
keeps its own endpoints and credit. Checked as a user sees it: the processes
``ctl status`` lists, messages counted, and what a deleted queue leaves in
/dev/shm and on disk.
"""

from __future__ import annotations

import os

import pika
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]


def connect(broker) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))


def rings(run_id: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"creditflow-{run_id}-")}


def hosted(status: dict, kind: str) -> list[int]:
    return sorted(h["stages"] for h in status["hosts"].values() if h["kind"] == kind)


def test_many_queues_share_two_processes_and_deleted_queues_leave_no_ring_file_or_stage(start_broker):
    broker = start_broker("--pool", "2")
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    run_id = broker.status()["run_id"]
    before = rings(run_id)
    for i in range(100):
        ch.queue_declare(f"d{i}", durable=True)
        ch.basic_publish("", f"d{i}", f"m{i}".encode(), properties=pika.BasicProperties(delivery_mode=2))
    owner = connect(broker)
    och = owner.channel()
    for i in range(50):
        och.queue_declare(f"x{i}", exclusive=True)
    auto = connect(broker)
    ach = auto.channel()
    tags = []
    for i in range(50):
        ach.queue_declare(f"a{i}", auto_delete=True)
        tags.append(ach.basic_consume(f"a{i}", lambda *a: None))
    status = broker.wait_for(lambda s: sum(hosted(s, "queue")) == 200, what="200 queues in their hosts")
    assert len(hosted(status, "queue")) == 2, "200 queues, two queue processes"
    assert min(hosted(status, "queue")) >= 90, "placed in the host with the fewest"
    queue_pids = {p["pid"] for n, p in status["processes"].items() if n.startswith("queue-") and p["alive"]}
    assert len(queue_pids) == 2
    assert ch.basic_get("d42", auto_ack=True)[2] == b"m42"
    journals = os.listdir(broker.data_dir / "queues")
    assert len(journals) >= 100
    for i in range(100):
        ch.queue_delete(f"d{i}")
    owner.close()                       # its exclusive queues go with it
    for tag in tags:                    # an auto-delete queue goes with its last consumer
        ach.basic_cancel(tag)
    status = broker.wait_for(lambda s: sum(hosted(s, "queue")) == 0 and not s["queues"],
                             what="every queue gone")
    assert hosted(status, "queue") == [0, 0]
    new = rings(run_id) - before         # what is left: the open auto connection's reader<->channel rings
    assert len(new) <= 2, f"rings left after the queues went: {sorted(new)}"
    assert [j for j in os.listdir(broker.data_dir / "queues") if j.startswith(("d", "x", "a"))] == []
    conn.close()
    auto.close()


def test_by_default_a_consumer_an_idle_connection_and_a_publisher_each_get_a_reader_process(start_broker):
    # Connections are placed as they open, before anyone knows which will publish: with one reader
    # host per core, the publisher opened after an idle connection landed beside the consumer.
    broker = start_broker()
    conns = [connect(broker) for _ in range(3)]
    try:
        for conn in conns:
            conn.channel()

        def alive(status, kind):
            return [p for n, p in status["processes"].items() if n.startswith(f"{kind}-") and p.get("alive")]
        status = broker.wait_for(lambda s: len(alive(s, "reader")) == 3 and len(alive(s, "channel")) == 3,
                                 what="three readers and three channels reporting")
        assert len({p["pid"] for p in alive(status, "reader")}) == min(3, 2 * (os.cpu_count() or 1)), status["hosts"]
        # channels keep one host per core: three channels on a 2-core machine share
        assert len({p["pid"] for p in alive(status, "channel")}) == min(3, os.cpu_count() or 1), status["hosts"]
    finally:
        for conn in conns:
            conn.close()


def test_reader_hosts_are_twice_the_pool_unless_shm_cannot_hold_their_arenas():
    from pipeline.broker.bodies import MIB
    from pipeline.broker.supervisor import BrokerConfig, plan_reader_hosts

    def roomy(wanted, count):
        return wanted, None

    def holds(total_mib):       # a /dev/shm of which half may go to arenas, as fit_arenas reckons
        def fit(wanted, count):
            size = min(wanted, total_mib * MIB // 2 // count) & -MIB
            return (wanted, None) if size >= wanted else (size, f"{count} arenas of {size // MIB} MiB")
        return fit
    cfg = BrokerConfig(data_dir="/nonexistent", pool=2, arena_mb=64)
    assert plan_reader_hosts(cfg, roomy) == (4, 64 * MIB, None)
    # 5 arenas of 64 MiB do not fit in half of 512 MiB, 3 do: one reader host per core, and the log says so
    readers, size, note = plan_reader_hosts(cfg, holds(512))
    assert (readers, size) == (2, 64 * MIB) and note.endswith("readers run in 2 hosts, one per core")
    readers, size, note = plan_reader_hosts(cfg, holds(256))
    assert (readers, size) == (2, 42 * MIB) and note.startswith("3 arenas of 42 MiB")
    assert plan_reader_hosts(BrokerConfig(data_dir="/x", pool=2, reader_pool=3), holds(256))[0] == 3
    assert plan_reader_hosts(BrokerConfig(data_dir="/x", pool=0), roomy) == (0, 0, None)
