"""Names as RabbitMQ takes them (any UTF-8 up to 255 bytes) and definitions that never stop a start."""

from __future__ import annotations

import json
import os

import pika
import pytest

from pipeline.broker import names
from pipeline.broker.definitions import Definitions

NAMES = ["café", "orders!", "q%1", ".", "..", "a/b", "with space", "x" * 255, "é" * 127, "ünï.cødé.#"]


def test_file_names_are_safe_distinct_and_short():
    seen = {}
    for name in NAMES + ["", "A", "a", "q_1", "q%251"]:
        f = names.file_name(name)
        assert f not in (".", "..") and "/" not in f and "\0" not in f and len(f.encode()) <= 64
        assert seen.setdefault(f, name) == name, f"{name!r} and {seen[f]!r} share {f}"


def test_only_what_rabbitmq_refuses_is_refused():
    for name in NAMES:
        assert names.check(name) == name
    with pytest.raises(names.BadName, match="longer than 255"):
        names.check("é" * 128)
    with pytest.raises(names.BadName, match="not valid UTF-8"):
        names.check(b"\xff".decode("utf-8", "surrogateescape"))


def test_a_definitions_file_that_does_not_parse_is_moved_aside(tmp_path):
    (tmp_path / "definitions.json").write_text("{not json")
    queues, problems = Definitions().load(str(tmp_path))
    assert queues == []
    assert "could not be read" in problems[0]
    assert [p.name for p in tmp_path.iterdir()][0].startswith("definitions.json.bad-")


def test_bad_entries_are_skipped_and_the_rest_kept(tmp_path):
    (tmp_path / "definitions.json").write_text(json.dumps({
        "queues": ["good", 7, "x" * 300, ".", "bad-args"],
        "queue_props": {"bad-args": {"arguments": {"x-max-length": -1}}},
        "exchanges": {"ex": {"type": "fanout", "bindings": [["good", ""], ["missing", ""], "junk"]},
                      "bad": {"type": "nonsense"}, "worse": "junk"}}))
    defs = Definitions()
    queues, problems = defs.load(str(tmp_path))
    assert queues == ["good", "."]
    assert [(b.destination, b.routing_key) for b in defs.routing.bindings() if b.source == b"ex"] == [(b"good", b"")]
    assert defs.routing.lookup("bad") is None and defs.routing.lookup("worse") is None
    assert len(problems) == 7, problems


def test_queue_declares_are_checked_as_rabbitmq_checks_them():
    defs = Definitions()
    declare = dict(durable=True, exclusive=False, auto_delete=False, arguments={}, owner="reader-1", passive=False)
    with pytest.raises(Exception, match="ACCESS_REFUSED - queue name 'amq.x' contains reserved prefix 'amq.\\*'"):
        defs.declare_queue("amq.x", **declare)
    with pytest.raises(Exception, match="NOT_FOUND - no queue 'nope' in vhost '/'"):
        defs.declare_queue("nope", **{**declare, "passive": True})
    q, made = defs.declare_queue("q", **{**declare, "arguments": {"x-max-length": 2}})
    assert made and q.args.max_length == 2
    assert defs.declare_queue("q", **{**declare, "arguments": {"x-max-length": 2}}) == (q, False)
    with pytest.raises(Exception, match="inequivalent arg 'x-max-length' for queue 'q'"):
        defs.declare_queue("q", **{**declare, "arguments": {"x-max-length": 3}})
    mine, _ = defs.declare_queue("mine", **{**declare, "exclusive": True})
    assert mine.owner == "reader-1" and not mine.durable
    with pytest.raises(Exception, match="RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'mine'"):
        defs.declare_queue("mine", **{**declare, "exclusive": True, "owner": "reader-2"})


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_odd_names_work_end_to_end_and_survive_a_restart(start_broker):
    broker = start_broker()
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare("ex!", "direct", durable=True)
        for name in NAMES:
            ch.queue_declare(name, durable=True)
            ch.queue_bind(name, "ex!", routing_key=name)
            ch.basic_publish("ex!", name, name.encode(), properties=pika.BasicProperties(delivery_mode=2))
        got = ch.basic_get(NAMES[0], auto_ack=True)
        assert got[2] == NAMES[0].encode() and got[0].exchange == "ex!"
        ch.basic_publish("", b"\xff\xfe".decode("latin-1"), b"nowhere")   # routes nowhere, breaks nothing
    broker.stop()
    again = start_broker(name="broker")          # the same data directory
    assert "recovered 10 durable queues" in again.output()
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", again.port)) as conn:
        ch = conn.channel()
        for name in NAMES[1:]:
            assert ch.basic_get(name, auto_ack=True)[2] == name.encode()
    queue_dirs = os.listdir(again.data_dir / "queues")
    assert len(queue_dirs) == len(NAMES) and all(d not in (".", "..") for d in queue_dirs)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_broken_definitions_file_does_not_keep_the_broker_from_starting(start_broker, tmp_path):
    data = tmp_path / "broker"
    data.mkdir()
    (data / "definitions.json").write_text('{"queues": ["ok", 1], "exchanges": []')
    broker = start_broker()
    assert "could not be read" in broker.output()
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        conn.channel().queue_declare("fine")
