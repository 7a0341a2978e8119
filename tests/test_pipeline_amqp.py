"""An unmodified pika client against the broker, and bad input that closes one connection only."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import pika
import pytest

from conftest import raw_amqp_connection

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def connect(broker, **kw) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port, **kw))


def test_pika_publishes_with_confirms_and_consumes_everything(broker):
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("work", durable=True)
    ch.confirm_delivery()
    for i in range(200):
        ch.basic_publish("", "work", f"m{i}".encode(),
                         pika.BasicProperties(delivery_mode=2, content_type="text/plain"))
    got = []
    for method, props, body in ch.consume("work", inactivity_timeout=5):
        if method is None:
            break
        got.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(got) == 200:
            break
    ch.cancel()
    assert got == [f"m{i}".encode() for i in range(200)]
    assert props.content_type == "text/plain" and props.delivery_mode == 2
    conn.close()
    status = broker.wait_for(lambda s: s["processes"]["queue-work"].get("acked") == 200, what="acks")
    assert status["processes"]["queue-work"]["messages"] == 0


def test_basic_get_and_redeclare_report_counts(broker):
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("g")
    for i in range(3):
        ch.basic_publish("", "g", b"%d" % i)
    deadline = time.monotonic() + 5
    while ch.queue_declare("g", passive=True).method.message_count < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ch.queue_declare("g", passive=True).method.message_count == 3
    method, _, body = ch.basic_get("g", auto_ack=True)
    assert body == b"0" and method.message_count == 2
    conn.close()


def test_a_queue_deleted_with_publishes_on_their_way_to_it_ends_as_deleted_not_as_crashed(start_broker):
    """What was on its way to a deleted queue goes nowhere, as to a RabbitMQ queue process that has
    ended: the queue's process is not reported crashed, and the publishing channel goes on."""
    broker = start_broker("--queue-delay-us", "200")        # the queue takes 5,000 msg/s: its inbox fills
    pub = connect(broker)
    ch = pub.channel()
    ch.queue_declare("doomed")
    for _ in range(5000):
        ch.basic_publish("", "doomed", b"x" * 100)
    pub.process_data_events(0)
    broker.wait_for(lambda s: s["processes"]["queue-doomed"]["messages"] > 0, what="publishes in the queue")
    deleted = connect(broker).channel().queue_delete("doomed").method.message_count
    assert 0 < deleted < 5000
    broker.wait_for(lambda s: not s["processes"].get("queue-doomed", {}).get("alive"), what="the queue's end")
    ch.queue_declare("after")
    ch.basic_publish("", "after", b"still open")
    pub.process_data_events(0.2)
    method, _, body = ch.basic_get("after", auto_ack=True)
    assert body == b"still open"
    log = broker.output()
    assert "crashed" not in log and "exit code" not in log, log[-3000:]


def test_a_basic_get_that_reaches_a_queue_after_its_deletion_is_answered_404(start_broker):
    broker = start_broker("--queue-delay-us", "200")
    late = connect(broker)
    ch = late.channel()
    ch.queue_declare("doomed")
    for _ in range(5000):                   # the get goes behind these, in the same order, to the queue
        ch.basic_publish("", "doomed", b"x" * 100)
    answer = {}

    def get():
        try:
            answer["get"] = ch.basic_get("doomed", auto_ack=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            answer["closed"] = (exc.reply_code, exc.reply_text)

    getter = threading.Thread(target=get)
    getter.start()
    broker.wait_for(lambda s: s["processes"]["queue-doomed"]["messages"] > 0, what="publishes in the queue")
    connect(broker).channel().queue_delete("doomed")
    getter.join(30)
    assert answer == {"closed": (404, "NOT_FOUND - no queue 'doomed' in vhost '/'")}
    assert "crashed" not in broker.output()


def test_two_channels_deleting_the_same_queue_at_once_both_get_delete_ok(broker):
    """As RabbitMQ 3.10 answers a queue.delete of a queue that is already gone: delete-ok, 0 messages.
    The second delete used to get no answer at all when it reached the queue after the first."""
    conns = [connect(broker), connect(broker)]
    channels = [c.channel() for c in conns]
    for ch in channels:
        ch.queue_declare("twice")               # both channels have their links to the queue
    for _ in range(50_000):                     # the first delete takes a while: the second is on its way by then
        channels[0].basic_publish("", "twice", b"x")
    broker.wait_for(lambda s: s["processes"]["queue-twice"]["messages"] == 50_000, what="the backlog")
    counts: list = []
    start = threading.Barrier(2)

    def delete(ch):
        start.wait()
        counts.append(ch.queue_delete("twice").method.message_count)

    threads = [threading.Thread(target=delete, args=(ch,), daemon=True) for ch in channels]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(counts) == [0, 50_000]


def test_passive_declare_of_a_missing_queue_closes_the_channel_with_404(broker):
    conn = connect(broker)
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as exc:
        ch.queue_declare("nope", passive=True)
    assert exc.value.reply_code == 404
    assert conn.is_open, "a channel error must leave the connection open"
    conn.channel().queue_declare("fine")
    conn.close()


def test_durable_mismatch_is_precondition_failed(broker):
    conn = connect(broker)
    conn.channel().queue_declare("d", durable=True)
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as exc:
        ch.queue_declare("d", durable=False)
    assert exc.value.reply_code == 406
    conn.close()


def read_close(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        pass
    return data


def test_wrong_protocol_header_gets_ours_and_only_that_connection_closes(broker):
    good = connect(broker)
    good_ch = good.channel()
    good_ch.queue_declare("still-here")
    with socket.create_connection(("127.0.0.1", broker.port)) as bad:
        bad.sendall(b"HTTP/1.1 GET /\r\n\r\n")
        assert read_close(bad).startswith(b"AMQP\x00\x00\x09\x01")
    good_ch.basic_publish("", "still-here", b"ok")
    method, _, body = None, None, None
    deadline = time.monotonic() + 5
    while method is None and time.monotonic() < deadline:
        method, _, body = good_ch.basic_get("still-here", auto_ack=True)
    assert body == b"ok"
    good.close()


def test_garbage_frame_closes_with_frame_error(broker):
    # before tune-ok the client is not trusted: RabbitMQ closes the socket without a word, so does the broker
    with socket.create_connection(("127.0.0.1", broker.port)) as s:
        s.sendall(b"AMQP\x00\x00\x09\x01")
        s.settimeout(5)
        start = s.recv(65536)
        assert start[0] == 1  # a method frame: connection.start
        # a method frame whose frame-end octet is wrong
        s.sendall(struct.pack(">BHI", 1, 0, 4) + b"\x00\x0a\x00\x0b" + b"\x00")
        assert read_close(s) == b""
    # after it, the client is told: connection.close (class 10, method 50) with 501 FRAME_ERROR
    with raw_amqp_connection(broker.port) as s:
        s.sendall(struct.pack(">BHI", 1, 1, 4) + b"\x00\x3c\x00\x0a" + b"\x00")
        data = read_close(s)
    assert data[7:11] == b"\x00\x0a\x00\x32"
    assert struct.unpack(">H", data[11:13])[0] == 501


def test_a_connection_over_the_limit_is_refused_with_530(start_broker):
    broker = start_broker("--connection-max", "1")
    first = connect(broker)
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as exc:
        connect(broker)
    assert "530" in str(exc.value) or "connection limit" in str(exc.value)
    first.channel().queue_declare("still-fine")
    first.close()


def test_a_channel_over_channel_max_is_refused_with_530(start_broker):
    from pamqp import commands, frame
    broker = start_broker("--channel-max", "2")
    with raw_amqp_connection(broker.port) as s:
        s.sendall(frame.marshal(commands.Channel.Open(), 5))
        data = read_close(s)
    assert data[7:11] == b"\x00\x0a\x00\x32" and struct.unpack(">H", data[11:13])[0] == 530


@pytest.mark.parametrize("method, ids", [("Ack", (60, 80)), ("Reject", (60, 90)), ("Nack", (60, 120))])
def test_an_unknown_delivery_tag_closes_the_channel_naming_the_method_that_carried_it(broker, method, ids):
    """channel.close 406 with the class and method of the ack, reject or nack, as RabbitMQ 3.10 sends."""
    from pamqp import commands, frame
    with raw_amqp_connection(broker.port) as s:
        s.sendall(frame.marshal(commands.Channel.Open(), 1))
        s.recv(65536)                                                   # channel.open-ok
        s.sendall(frame.marshal(getattr(commands.Basic, method)(delivery_tag=5), 1))
        s.settimeout(5)
        _, channel, close = frame.unmarshal(s.recv(65536))
    assert (channel, type(close).__name__) == (1, "Close")
    assert (close.reply_code, close.reply_text, (close.class_id, close.method_id)) == \
        (406, "PRECONDITION_FAILED - unknown delivery tag 5", ids)


def test_the_406_for_a_message_too_big_waits_until_its_channel_has_handed_back_what_it_held(start_broker):
    """As RabbitMQ's channel tells its queues before it sends the close: with the channel's process stopped,
    the client hears nothing of the 406 its reader found; once the process runs, the close comes, and the
    messages the channel held unacked are ready for the next channel."""
    broker = start_broker("--max-message-bytes", "1000")
    conn = connect(broker)
    try:
        ch = conn.channel()
        ch.queue_declare("held")
        for body in (b"a", b"b"):
            ch.basic_publish("", "held", body)
        for _ in range(2):
            deadline = time.monotonic() + 3
            while ch.basic_get("held")[0] is None:
                assert time.monotonic() < deadline
        channel = broker.process("channel")
        os.kill(channel["pid"], signal.SIGSTOP)
        try:
            ch.basic_publish("", "held", b"x" * 2000)
            conn.process_data_events(time_limit=1)
            assert ch.is_open, "the close reached the client before the channel's process had run"
        finally:
            os.kill(channel["pid"], signal.SIGCONT)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as exc:
            ch.basic_get("held")
        assert exc.value.reply_code == 406
        assert conn.channel().queue_declare("held", passive=True).method.message_count == 2
    finally:
        conn.close()


def test_a_message_over_the_size_limit_closes_its_channel_after_its_unacked_messages_went_back(start_broker):
    """The 406 for a message over --max-message-bytes comes from the connection's parser, not the
    channel process, which is told at once: the messages the channel held unacked are ready again for
    the next channel, every round."""
    broker = start_broker("--max-message-bytes", "1000")
    conn = connect(broker)
    try:
        for round_ in range(30):
            q = f"oversized-{round_}"
            ch = conn.channel()
            ch.queue_declare(q)
            for body in (b"a", b"b"):
                ch.basic_publish("", q, body)
            for _ in range(2):
                deadline = time.monotonic() + 3
                while ch.basic_get(q)[0] is None:
                    assert time.monotonic() < deadline
            ch.basic_publish("", q, b"x" * 2000)
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as exc:
                ch.basic_get(q)
            assert exc.value.reply_code == 406
            after = conn.channel()
            assert (round_, after.queue_declare(q, passive=True).method.message_count) == (round_, 2)
            after.queue_delete(q)
            after.close()
    finally:
        conn.close()
