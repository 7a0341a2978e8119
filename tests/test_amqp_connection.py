"""The sans-IO server connection, driven by pamqp-encoded client frames and by a real pika client."""

from __future__ import annotations

import dataclasses
import re
import socket
import struct
import threading
import time

import pika
import pytest
from pamqp import body as pbody, commands, frame, header, heartbeat

from pipeline.amqp import frames
from pipeline.amqp.connection import (ChannelClose, ChannelCloseOk, ChannelError, ChannelOpen, Closed,
                                      CloseRequested, ConnectionStatistics, HeartbeatTimeout, Method, Opened,
                                      ProtocolError, Publish, ServerConnection)
from pipeline.amqp.errors import UsageError

S = 1_000_000_000
GUEST = "\0guest\0guest"
PERSISTENT = frames.properties_raw(delivery_mode=2)


def m(channel: int, method) -> bytes:
    return frame.marshal(method, channel)


def replies(conn: ServerConnection) -> list:
    """What the connection queued for the client: (channel, pamqp method) or (channel, frame type)."""
    data = conn.data_to_send()
    out, pos = [], 0
    if data.startswith(b"AMQP"):
        out.append("protocol header")
        pos = 8
    while (found := frames.next_frame(data, pos)) is not None:
        ftype, ch, ps, pe = found
        pos = pe + 1
        out.append((ch, frames.decode_method(data, ps, pe)) if ftype == 1 else (ch, ftype))
    assert pos == len(data)
    return out


def names(conn: ServerConnection) -> list[str]:
    return [r if isinstance(r, str) else (r[1].name if not isinstance(r[1], int) else f"frame {r[1]}")
            for r in replies(conn)]


def events(conn: ServerConnection, now_ns: int = 0) -> list:
    out = []
    while (ev := conn.next_event(now_ns)) is not None:
        out.append(ev)
    return out


def start(capabilities=None, **kwargs) -> ServerConnection:
    """A connection that has had the header and start-ok."""
    conn = ServerConnection(**kwargs)
    conn.receive_data(frames.PROTOCOL_HEADER)
    assert conn.next_event(0) is None and conn.state == "starting"
    conn.data_to_send()
    props = {"product": "test", "capabilities": capabilities if capabilities is not None else
             {"authentication_failure_close": True}}
    conn.receive_data(m(0, commands.Connection.StartOk(client_properties=props, mechanism="PLAIN", response=GUEST)))
    assert conn.next_event(0) is None and conn.state == "tuning"
    conn.data_to_send()
    return conn


def opened(capabilities=None, heartbeat_s=0, channels=(1,), **kwargs) -> ServerConnection:
    """An open connection with ``channels`` open."""
    conn = start(capabilities, **kwargs)
    conn.receive_data(m(0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=heartbeat_s))
                      + m(0, commands.Connection.Open(virtual_host="/")))
    assert isinstance(conn.next_event(0), Opened)
    for ch in channels:
        conn.receive_data(m(ch, commands.Channel.Open()))
        assert conn.next_event(0) == ChannelOpen(ch)
        conn.open_channel_ok(ch)
    conn.data_to_send()
    return conn


def summary(ev):
    """An event as plain data (pamqp method objects do not compare equal)."""
    if isinstance(ev, Method):
        return ("Method", ev.channel, ev.class_id, ev.method_id, ev.payload)
    return ev


def closed_with(conn: ServerConnection, code: int) -> commands.Connection.Close:
    """The ProtocolError and the connection.close queued last agree on ``code``; returns the close."""
    ev = conn.next_event(0)
    assert isinstance(ev, ProtocolError) and ev.reply_code == code, ev
    out = replies(conn)
    assert out and out[-1][0] == 0 and out[-1][1].name == "Connection.Close", out
    assert all(r[1].name in ("Connection.Tune",) for r in out[:-1]), out
    close = out[-1][1]
    assert (close.reply_code, close.reply_text) == (code, ev.reply_text)
    assert conn.state == "closing"
    return close


# -- the handshake -----------------------------------------------------------------------------------------

def test_handshake_start_tune_open():
    conn = ServerConnection(node_name="rabbit@here", heartbeat_s=30, frame_max=65536, channel_max=100)
    assert conn.state == "awaiting_header"
    conn.receive_data(frames.PROTOCOL_HEADER[:5])
    assert conn.next_event(0) is None and conn.state == "awaiting_header"
    conn.receive_data(frames.PROTOCOL_HEADER[5:])
    assert conn.next_event(0) is None
    (ch, start_), = replies(conn)
    assert ch == 0 and start_.name == "Connection.Start"
    assert (start_.version_major, start_.version_minor) == (0, 9)
    assert start_.mechanisms == "PLAIN AMQPLAIN" and start_.locales == "en_US"
    server = start_.server_properties
    assert server["product"] == "creditflow" and server["cluster_name"] == "rabbit@here"
    assert server["capabilities"] == {name: True for name in (
        "publisher_confirms", "exchange_exchange_bindings", "basic.nack", "consumer_cancel_notify",
        "connection.blocked", "authentication_failure_close", "per_consumer_qos")}

    client_props = {"product": "test client", "capabilities": {"connection.blocked": True}}
    conn.receive_data(m(0, commands.Connection.StartOk(client_properties=client_props, mechanism="PLAIN",
                                                       response=GUEST)))
    assert conn.next_event(0) is None and conn.state == "tuning"
    assert conn.user == "guest" and conn.capabilities == {"connection.blocked": True}
    (_, tune), = replies(conn)
    assert (tune.channel_max, tune.frame_max, tune.heartbeat) == (100, 65536, 30)

    conn.receive_data(m(0, commands.Connection.TuneOk(channel_max=50, frame_max=8192, heartbeat=10)))
    assert conn.next_event(0) is None and conn.state == "opening"
    assert (conn.channel_max, conn.frame_max, conn.heartbeat_s) == (50, 8192, 10)
    conn.receive_data(m(0, commands.Connection.Open(virtual_host="/")))
    assert conn.next_event(0) == Opened("/", "guest", client_props)
    assert conn.state == "open" and conn.vhost == "/"
    assert names(conn) == ["Connection.OpenOk"]


def test_amqplain_login():
    conn = ServerConnection()
    conn.receive_data(frames.PROTOCOL_HEADER)
    conn.next_event(0)
    conn.data_to_send()
    table = "\x05LOGINS\x00\x00\x00\x05guest\x08PASSWORDS\x00\x00\x00\x05guest"
    conn.receive_data(m(0, commands.Connection.StartOk(client_properties={}, mechanism="AMQPLAIN", response=table)))
    assert conn.next_event(0) is None and conn.state == "tuning" and conn.user == "guest"


@pytest.mark.parametrize("client, server, expected", [
    ((0, 0, 0), (2047, 131072, 60), (2047, 131072, 0)),          # 0 from the client: the server's limit
    ((10, 4096, 5), (2047, 131072, 60), (10, 4096, 5)),          # the client may lower
    ((0, 0, 0), (0, 0, 0), (65535, 0, 0)),                       # no limit anywhere
])
def test_tune_ok_negotiation(client, server, expected):
    conn = start(channel_max=server[0], frame_max=server[1], heartbeat_s=server[2])
    conn.receive_data(m(0, commands.Connection.TuneOk(channel_max=client[0], frame_max=client[1],
                                                      heartbeat=client[2])))
    assert conn.next_event(0) is None
    assert (conn.channel_max, conn.frame_max, conn.heartbeat_s) == expected


@pytest.mark.parametrize("tune_ok, match", [
    (dict(channel_max=3000, frame_max=131072), "negotiated channel_max = 3000 is higher than the maximum allowed "
                                               r"value \(2047\)"),
    (dict(channel_max=10, frame_max=200000), "negotiated frame_max = 200000 is higher"),
    (dict(channel_max=10, frame_max=1000), r"negotiated frame_max = 1000 is lower than the minimum allowed value "
                                           r"\(4096\)"),
])
def test_tune_ok_over_the_servers_limits_is_not_allowed(tune_ok, match):
    conn = start()
    conn.receive_data(m(0, commands.Connection.TuneOk(heartbeat=0, **tune_ok)))
    close = closed_with(conn, 530)
    assert (close.class_id, close.method_id) == (10, 30)
    assert close.reply_text.startswith("NOT_ALLOWED - ")
    assert re.search(match, close.reply_text)


# -- channels and publishes ------------------------------------------------------------------------------

def test_channel_open_and_close_answered_by_the_reader():
    conn = opened(channels=())
    conn.receive_data(m(1, commands.Channel.Open()))
    assert conn.next_event(0) == ChannelOpen(1)
    assert names(conn) == [], "open-ok waits for the channel's process"
    conn.open_channel_ok(1)
    assert [(ch, m_.name) for ch, m_ in replies(conn)] == [(1, "Channel.OpenOk")]
    assert conn.open_channels == frozenset({1}) and conn.channel_state(1) == "open"

    conn.receive_data(m(1, commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)))
    assert conn.next_event(0) == ChannelClose(1, 200, "bye")
    assert conn.channel_state(1) == "client_closing" and names(conn) == []
    conn.receive_data(m(1, commands.Basic.Qos(prefetch_count=1)))
    assert conn.next_event(0) is None, "frames on a closing channel are dropped"
    conn.close_channel_ok(1)
    assert names(conn) == ["Channel.CloseOk"] and conn.open_channels == frozenset()

    conn.receive_data(m(1, commands.Channel.Open()))
    assert conn.next_event(0) == ChannelOpen(1), "the number is free again"


def test_publishes_come_out_one_event_per_call():
    conn = opened()
    conn.receive_data(b"".join(frames.encode_publish(1, "", "q", PERSISTENT, b"m%d" % i, 131072)
                               for i in range(10)))
    left = conn.buffered_bytes()
    for i in range(10):
        ev = conn.next_event(0)
        assert ev == Publish(1, b"", b"q", False, PERSISTENT, b"m%d" % i, 2)
        assert conn.buffered_bytes() < left, "one message consumed"
        left = conn.buffered_bytes()
        if i < 9:
            assert left > 0, "the rest stays unparsed"
    assert conn.next_event(0) is None and conn.buffered_bytes() == 0
    stats = conn.statistics()
    assert isinstance(stats, ConnectionStatistics) and stats.publishes == 10 and stats.frames_in == 30 + 4


def test_publish_fields_and_multi_frame_bodies_arriving_byte_by_byte():
    conn = ServerConnection(frame_max=4096)
    conn.receive_data(frames.PROTOCOL_HEADER)
    conn.next_event(0)
    conn.receive_data(m(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN", response=GUEST))
                      + m(0, commands.Connection.TuneOk(channel_max=10, frame_max=4096))
                      + m(0, commands.Connection.Open()) + m(7, commands.Channel.Open()))
    assert [type(e) for e in events(conn)] == [Opened, ChannelOpen]
    conn.open_channel_ok(7)
    props = frames.properties_raw(content_type="text/plain", headers={"k": "v"}, delivery_mode=1)
    body = bytes(range(256)) * 40
    data = frames.encode_publish(7, "amq.topic", "a.b.ünï", props, body, 4096, mandatory=True)
    got = []
    for i in range(len(data)):
        conn.receive_data(data[i:i + 1])
        got += events(conn)
    assert got == [Publish(7, b"amq.topic", "a.b.ünï".encode(), True, props, body, 1)]
    assert got[0].exchange == "amq.topic" and got[0].routing_key == "a.b.ünï"
    assert got[0].exchange_b == b"amq.topic"


@pytest.mark.timeout(20)
def test_a_huge_frame_arriving_in_small_reads_is_joined_once():
    conn = start(frame_max=0, max_message_bytes=64 * 1024 * 1024)
    conn.receive_data(m(0, commands.Connection.TuneOk(frame_max=0)) + m(0, commands.Connection.Open())
                      + m(1, commands.Channel.Open()))
    assert [type(e) for e in events(conn)] == [Opened, ChannelOpen] and conn.frame_max == 0, "no frame limit"
    body = bytes(range(256)) * (64 * 1024)                      # 16 MiB in one body frame
    data = frames.encode_publish(1, "", "q", b"\x00\x00", body, 0)
    started = time.perf_counter()
    got = []
    for i in range(0, len(data), 8192):
        conn.receive_data(data[i:i + 8192])
        got += events(conn)
    assert [len(e.body) for e in got] == [len(body)] and got[0].body == body
    assert time.perf_counter() - started < 5, "quadratic copying"


def test_content_may_interleave_across_channels():
    conn = opened(channels=(1, 2))
    one = frames.encode_publish(1, "", "first", b"\x00\x00", b"1", 131072)
    method_len = frames.next_frame(one)[3] + 1
    conn.receive_data(one[:method_len] + frames.encode_publish(2, "", "second", b"\x00\x00", b"2", 131072)
                      + one[method_len:])
    assert [(e.channel, e.body) for e in events(conn)] == [(2, b"2"), (1, b"1")]


def test_every_other_channel_method_is_forwarded_with_its_raw_payload():
    conn = opened()
    declare = commands.Queue.Declare(queue="q", durable=True, arguments={"x-max-length": 5})
    conn.receive_data(m(1, declare) + frames.encode_basic_ack(1, 42, True) + m(1, commands.Confirm.Select()))
    first, ack, select = events(conn)
    assert isinstance(first, Method) and (first.channel, first.class_id, first.method_id) == (1, 50, 10)
    assert first.method.durable and first.method.arguments == {"x-max-length": 5}
    again = frames.decode_method(first.payload, 0, len(first.payload))
    assert again.queue == "q" and again.arguments == {"x-max-length": 5}
    assert (ack.class_id, ack.method_id) == frames.BASIC_ACK
    assert (ack.method.delivery_tag, ack.method.multiple) == (42, True)
    assert select.method.name == "Confirm.Select"
    assert conn.statistics().methods == 3


STREAM_PARTS = [
    frames.encode_publish(1, "", "a", PERSISTENT, b"x" * 100, 4096),
    m(1, commands.Basic.Qos(prefetch_count=3)),
    frames.encode_publish(1, "ex", "b", b"\x00\x00", b"", 4096),
    frames.encode_heartbeat(),
    frames.encode_publish(2, "", "c", frames.properties_raw(headers={"h": 1}, delivery_mode=2), b"y" * 9000, 4096),
    frames.encode_basic_ack(2, 9),
]
STREAM = b"".join(STREAM_PARTS)


def test_the_same_events_however_the_bytes_are_split():
    whole = opened(channels=(1, 2))
    whole.receive_data(STREAM)
    first = events(whole)
    assert [type(e).__name__ for e in first] == ["Publish", "Method", "Publish", "Publish", "Method"]
    expected = [summary(e) for e in first]
    for cut in range(1, len(STREAM)):
        conn = opened(channels=(1, 2))
        conn.receive_data(STREAM[:cut])
        got = events(conn)
        conn.receive_data(STREAM[cut:])
        got += events(conn)
        assert [summary(e) for e in got] == expected, f"split at {cut}"


# -- bad input, and the reply code for it ---------------------------------------------------------------------

def test_a_wrong_protocol_header_gets_ours_and_nothing_else():
    conn = ServerConnection()
    conn.receive_data(b"GET / HTTP/1.1\r\n\r\n")
    ev = conn.next_event(0)
    assert isinstance(ev, ProtocolError) and "protocol header" in ev.reply_text
    assert conn.data_to_send() == b"AMQP\x00\x00\x09\x01"
    assert conn.state == "closed" and conn.next_event(0) is None


def test_a_bad_frame_end_is_501_and_nothing_after_it_is_parsed():
    conn = opened()
    conn.receive_data(frames.encode_basic_ack(1, 1)[:-1] + b"\x00" + m(0, commands.Connection.CloseOk()))
    close = closed_with(conn, 501)
    assert "invalid_frame_end_marker" in close.reply_text
    assert conn.next_event(0) is None and conn.state == "closing", "out of sync: even close-ok is not read"
    conn.receive_data(b"")
    assert isinstance(conn.next_event(0), Closed) and conn.state == "closed"


def test_an_oversized_frame_is_501_before_its_payload_arrives():
    conn = opened()
    conn.receive_data(struct.pack(">BHI", 3, 1, 131073))
    close = closed_with(conn, 501)
    assert "frame_too_large,131073,131064" in close.reply_text


def test_frames_up_to_frame_max_are_tolerated_as_rabbitmq_does():
    # RabbitMQ lets a payload reach frame_max itself (8 bytes over the limit), a common client off-by-8
    filler = frames.properties_raw(headers={"k": ""})
    props = frames.properties_raw(headers={"k": "v" * (131072 - 12 - len(filler))})
    conn = opened()
    conn.receive_data(frames.encode_publish(1, "", "q", props, b"", 131072))
    ev = conn.next_event(0)
    assert isinstance(ev, Publish) and len(ev.props_raw) + 12 == 131072
    conn.receive_data(struct.pack(">BHI", 3, 1, 131073))
    closed_with(conn, 501)


def before_open(frames_bytes: bytes) -> ServerConnection:
    conn = ServerConnection()
    conn.receive_data(frames.PROTOCOL_HEADER)
    conn.next_event(0)
    conn.data_to_send()
    conn.receive_data(frames_bytes)
    return conn


def start_ok(mechanism="PLAIN", response=GUEST, capabilities=None) -> bytes:
    props = {"capabilities": capabilities if capabilities is not None else {"authentication_failure_close": True}}
    return m(0, commands.Connection.StartOk(client_properties=props, mechanism=mechanism, response=response))


HANDSHAKE_CASES = {
    "bad frame end while starting": (frames.encode_heartbeat()[:-1] + b"\x00", 501, (0, 0)),
    "wrong password": (start_ok(response="\0guest\0nope"), 403, (10, 11)),
    "unknown user": (start_ok(response="\0bob\0guest"), 403, (10, 11)),
    "malformed PLAIN response": (start_ok(response="guest"), 502, (10, 11)),
    "unknown mechanism": (start_ok(mechanism="EXTERNAL"), 503, (10, 11)),
    "open before tune-ok": (start_ok() + m(0, commands.Connection.Open()), 504, (10, 40)),
    "unknown vhost": (start_ok() + m(0, commands.Connection.TuneOk(frame_max=131072))
                      + m(0, commands.Connection.Open(virtual_host="other")), 530, (10, 40)),
    "channel frame before open": (start_ok() + m(1, commands.Channel.Open()), 505, (0, 0)),
}


@pytest.mark.parametrize("data, code, ids", HANDSHAKE_CASES.values(), ids=HANDSHAKE_CASES.keys())
def test_bad_handshakes_get_the_right_reply_code(data, code, ids):
    conn = before_open(data)
    close = closed_with(conn, code)
    assert (close.class_id, close.method_id) == ids


def test_a_refused_login_only_gets_a_close_frame_with_the_capability():
    conn = before_open(start_ok(response="\0guest\0nope"))
    close = closed_with(conn, 403)
    assert close.reply_text == ("ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. "
                                "For details see the broker logfile.")
    silent = before_open(start_ok(response="\0guest\0nope", capabilities={}))
    ev = silent.next_event(0)
    assert isinstance(ev, ProtocolError) and ev.reply_code == 403
    assert silent.data_to_send() == b"" and silent.state == "closed"


def test_an_over_the_limit_connection_is_refused_in_place_of_open_ok():
    conn = start(refuse_open="NOT_ALLOWED - connection refused: node connection limit (1) is reached")
    conn.receive_data(m(0, commands.Connection.TuneOk(frame_max=131072)) + m(0, commands.Connection.Open()))
    close = closed_with(conn, 530)
    assert "connection limit (1)" in close.reply_text and (close.class_id, close.method_id) == (10, 40)


OPEN_CASES = {
    "method on an unopened channel": (m(3, commands.Basic.Qos(prefetch_count=1)), 504, (60, 10),
                                      "CHANNEL_ERROR - expected 'channel.open'"),
    "content header on an unopened channel": (frames.encode_content(3, b"\x00\x00", b"x", 4096), 505, (0, 0),
                                              "expected method frame"),
    "second channel.open": (m(1, commands.Channel.Open()), 504, (20, 10), "second 'channel.open' seen"),
    "channel over channel_max": (m(2048, commands.Channel.Open()), 530, (20, 10), "channel_max (2047)"),
    "unknown method": (struct.pack(">BHIHH", 1, 1, 4, 60, 255) + b"\xce", 540, (60, 255), "unknown method"),
    "unknown frame type": (struct.pack(">BHI", 9, 0, 0) + b"\xce", 501, (0, 0), "unknown_frame"),
    "truncated method arguments": (struct.pack(">BHIHH", 1, 1, 6, 50, 10) + b"\x00\x00\xce", 501, (50, 10),
                                   "cannot decode queue.declare"),
    "method inside content": (m(1, commands.Basic.Publish(routing_key="q")) + m(1, commands.Basic.Qos()), 505,
                              (60, 40), "expected content header for class 60, got non content header frame"),
    "body before header": (m(1, commands.Basic.Publish(routing_key="q"))
                           + frame.marshal(pbody.ContentBody(b"x"), 1), 505, (60, 40), "expected content header"),
    "header without a publish": (frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1), 505,
                                 (0, 0), "expected method frame, got non method frame instead"),
    "header after header": (m(1, commands.Basic.Publish(routing_key="q"))
                            + 2 * frame.marshal(header.ContentHeader(0, 2, commands.Basic.Properties()), 1), 505,
                            (60, 40), "expected content body, got non content body frame instead"),
    "body longer than declared": (m(1, commands.Basic.Publish(routing_key="q"))
                                  + frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1)
                                  + frame.marshal(pbody.ContentBody(b"xy"), 1), 501, (60, 40),
                                  "content body frame exceeds remaining content size"),
    "malformed properties": (m(1, commands.Basic.Publish(routing_key="q"))
                             + struct.pack(">BHIHHQH", 2, 1, 14, 60, 0, 0, 0x8000) + b"\xce", 501, (60, 40),
                             "cannot decode content properties"),
    "heartbeat on a channel": (struct.pack(">BHI", 8, 1, 0) + b"\xce", 505, (0, 0), "type 8"),
    "connection method while running": (m(0, commands.Connection.TuneOk()), 504, (10, 31),
                                        "unexpected method in connection state running"),
    "server-only method": (m(1, commands.Basic.Deliver(consumer_tag="c", delivery_tag=1, routing_key="q")), 503,
                           (60, 60), "COMMAND_INVALID - unimplemented method"),
    "immediate publish": (m(1, commands.Basic.Publish(routing_key="q", immediate=True)), 540, (60, 40),
                          "immediate=true"),
}


@pytest.mark.parametrize("data, code, ids, text", OPEN_CASES.values(), ids=OPEN_CASES.keys())
def test_bad_input_on_an_open_connection_gets_the_right_reply_code(data, code, ids, text):
    conn = opened()
    conn.receive_data(data)
    close = closed_with(conn, code)
    assert (close.class_id, close.method_id) == ids
    assert text in close.reply_text


def test_a_message_over_the_size_limit_closes_only_its_channel():
    conn = opened(channels=(1, 2), max_message_bytes=100)
    conn.receive_data(frames.encode_publish(1, "", "q", b"\x00\x00", b"x" * 101, 131072)
                      + frames.encode_publish(1, "", "q", b"\x00\x00", b"dropped", 131072)
                      + frames.encode_publish(2, "", "q", b"\x00\x00", b"y" * 100, 131072))
    ev = conn.next_event(0)
    assert ev == ChannelError(1, 406, "PRECONDITION_FAILED - message size 101 is larger than configured max "
                                      "size 100")
    (ch, close), = replies(conn)
    assert ch == 1 and close.name == "Channel.Close" and close.reply_code == 406
    assert (close.class_id, close.method_id) == (60, 40)
    assert conn.next_event(0).body == b"y" * 100, "channel 1 is dropped, channel 2 carries on"
    assert conn.state == "open" and conn.channel_state(1) == "server_closing"
    conn.receive_data(m(1, commands.Channel.CloseOk()))
    assert conn.next_event(0) == ChannelCloseOk(1) and conn.open_channels == frozenset({2})


def test_server_closes_a_channel_and_waits_for_close_ok():
    conn = opened()
    conn.close_channel(1, 404, "NOT_FOUND - no queue 'x' in vhost '/'", 50, 10)
    (ch, close), = replies(conn)
    assert (ch, close.reply_code, close.class_id, close.method_id) == (1, 404, 50, 10)
    conn.receive_data(frames.encode_publish(1, "", "x", b"\x00\x00", b"late", 131072)
                      + m(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0)))
    assert conn.next_event(0) is None, "everything on the closing channel is dropped"
    assert names(conn) == ["Channel.CloseOk"], "but a crossing channel.close is answered"
    conn.receive_data(m(1, commands.Channel.CloseOk()))
    assert conn.next_event(0) == ChannelCloseOk(1)


def test_after_connection_close_only_close_ok_counts():
    conn = opened()
    conn.close(320, "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'")
    assert names(conn) == ["Connection.Close"] and conn.state == "closing"
    conn.send_raw(frames.encode_basic_ack(1, 1))
    conn.send_deliver(1, "c", 1, False, "", "q", b"\x00\x00", b"x")
    assert conn.data_to_send() == b"", "nothing may follow connection.close"
    conn.receive_data(frames.encode_publish(1, "", "q", b"\x00\x00", b"x", 131072)
                      + m(1, commands.Queue.Declare(queue="q")) + m(0, commands.Connection.CloseOk()))
    assert conn.next_event(0) == Closed("close handshake finished") and conn.state == "closed"


def test_client_close_is_answered_at_once():
    conn = opened()
    conn.receive_data(m(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)))
    assert conn.next_event(0) == CloseRequested(200, "bye")
    assert names(conn) == ["Connection.CloseOk"] and conn.state == "closed"


def test_peer_eof_is_closed():
    conn = opened()
    conn.receive_data(frames.encode_publish(1, "", "q", b"\x00\x00", b"x", 131072)[:10])
    conn.receive_data(b"")
    ev = conn.next_event(0)
    assert ev == Closed("peer closed the connection in the middle of a frame") and conn.state == "closed"
    assert conn.next_event(0) is None


def test_an_illegal_transition_raises_and_changes_nothing():
    conn = ServerConnection()
    with pytest.raises(UsageError, match="cannot 'open' in state 'awaiting_header'"):
        conn._advance("open")
    assert conn.state == "awaiting_header"


# -- heartbeats ------------------------------------------------------------------------------------------------

def test_heartbeats_go_out_after_half_an_interval_of_quiet():
    conn = opened(heartbeat_s=10)
    assert conn.tick(4 * S) is None and conn.data_to_send() == b""
    assert conn.tick(5 * S) is None and conn.data_to_send() == frames.encode_heartbeat()
    conn.note_sent(8 * S)
    assert conn.tick(12 * S) is None and conn.data_to_send() == b"", "our own traffic counts"
    assert conn.tick(13 * S) is None and conn.data_to_send() == frames.encode_heartbeat()
    assert conn.statistics().heartbeats_sent == 2


def test_a_silent_client_times_out_after_two_intervals():
    conn = opened(heartbeat_s=10)
    assert conn.tick(20 * S) is None
    conn.receive_data(frame.marshal(heartbeat.Heartbeat(), 0))
    assert conn.tick(21 * S) is None, "any bytes from the client count"
    assert conn.tick(41 * S) is None
    assert conn.tick(41 * S + 1) == HeartbeatTimeout() and conn.state == "closed"


def test_a_paused_monitor_never_times_out_and_resumes_from_now():
    conn = opened(heartbeat_s=10)
    conn.pause_heartbeat_monitor()
    assert conn.tick(1000 * S) is None
    conn.resume_heartbeat_monitor(1000 * S)
    assert conn.tick(1020 * S) is None
    assert isinstance(conn.tick(1021 * S), HeartbeatTimeout)


def test_no_heartbeats_when_the_client_asks_for_none():
    conn = opened(heartbeat_s=0)
    assert conn.tick(10_000 * S) is None and conn.data_to_send() == b""


# -- connection.blocked ------------------------------------------------------------------------------------------

def test_blocked_and_unblocked_only_with_the_capability():
    without = opened(capabilities={})
    assert without.send_blocked("low on memory") is False and without.send_unblocked() is False
    assert without.data_to_send() == b""
    with_cap = opened(capabilities={"connection.blocked": True})
    assert with_cap.send_blocked("low on memory & disk") is True
    assert with_cap.send_unblocked() is True
    blocked, unblocked = replies(with_cap)
    assert blocked[1].name == "Connection.Blocked" and blocked[1].reason == "low on memory & disk"
    assert unblocked[1].name == "Connection.Unblocked"


def test_statistics_are_a_frozen_snapshot():
    conn = opened()
    conn.receive_data(frames.encode_publish(1, "", "q", PERSISTENT, b"x", 131072))
    conn.next_event(0)
    conn.send_deliver(1, "ctag", 1, False, "", "q", PERSISTENT, b"x")
    out = conn.data_to_send()
    stats = conn.statistics()
    assert stats.state == "open" and stats.open_channels == 1 and stats.unparsed_bytes == 0
    assert stats.frames_out >= 3 and stats.bytes_out >= len(out) and stats.publishes == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.publishes = 0


# -- a real client --------------------------------------------------------------------------------------------

class OneConnectionServer:
    """Accepts one socket and drives a ServerConnection with it on a thread, like a reader would."""

    def __init__(self, **kwargs):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.kwargs = kwargs
        self.events: list = []
        self.conn: ServerConnection | None = None
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    sock, _ = self.listener.accept()
                    break
                except socket.timeout:
                    continue
            else:
                return
            with sock:
                sock.settimeout(0.05)
                conn = self.conn = ServerConnection(**self.kwargs)
                while not self.stop.is_set() and conn.state != "closed":
                    try:
                        conn.receive_data(sock.recv(65536))
                    except socket.timeout:
                        pass
                    now = time.monotonic_ns()
                    while (ev := conn.next_event(now)) is not None:
                        self.events.append(ev)
                        if isinstance(ev, ChannelOpen):
                            conn.open_channel_ok(ev.channel)
                            conn.send_blocked("low on memory")
                        elif isinstance(ev, ChannelClose):
                            conn.close_channel_ok(ev.channel)
                    conn.tick(now)
                    sock.sendall(conn.data_to_send())
        except BaseException as exc:      # surfaced by the test
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def one_connection_server(request):
    server = OneConnectionServer()
    request.addfinalizer(server.close)
    return server


@pytest.mark.timeout(30)
def test_pika_connects_publishes_and_closes(one_connection_server):
    server = one_connection_server
    blocked = []
    params = pika.ConnectionParameters("127.0.0.1", server.port, connection_attempts=1, socket_timeout=5,
                                       blocked_connection_timeout=None)
    client = pika.BlockingConnection(params)
    try:
        client.add_on_connection_blocked_callback(lambda _conn, method: blocked.append(method.method.reason))
        channel = client.channel()
        channel.basic_publish("amq.direct", "route ☃", b"hello", pika.BasicProperties(delivery_mode=2,
                                                                                      content_type="text/plain"))
        channel.close()
        client.process_data_events(0.2)
    finally:
        client.close()
    server.thread.join(5)
    assert server.error is None
    kinds = [type(e).__name__ for e in server.events]
    assert kinds == ["Opened", "ChannelOpen", "Publish", "ChannelClose", "CloseRequested"]
    opened_ev, publish = server.events[0], server.events[2]
    assert opened_ev.user == "guest" and opened_ev.client_properties["product"] == "Pika Python Client Library"
    assert (publish.exchange, publish.routing_key, publish.body, publish.delivery_mode) == (
        "amq.direct", "route ☃", b"hello", 2)
    assert blocked == ["low on memory"]
    assert server.conn.state == "closed" and server.conn.heartbeat_s == 60


# -- speed ---------------------------------------------------------------------------------------------------

def test_parsing_and_delivery_encoding_speed(capsys):
    """10,000 pre-encoded 100-byte publishes parsed, and 10,000 deliveries encoded; best of three."""
    one = frames.encode_publish(1, "", "perf-test", PERSISTENT, b"x" * 100, 131072)
    data = one * 10_000
    parse_best = deliver_best = 0.0
    for _ in range(3):
        conn = opened()
        conn.receive_data(data)
        started = time.perf_counter()
        n = 0
        while conn.next_event(0) is not None:
            n += 1
        parse_best = max(parse_best, n / (time.perf_counter() - started))
        assert n == 10_000
        started = time.perf_counter()
        for tag in range(1, 10_001):
            frames.encode_deliver(1, "amq.ctag-1", tag, False, "", "perf-test", PERSISTENT, b"x" * 100, 131072)
        deliver_best = max(deliver_best, 10_000 / (time.perf_counter() - started))
    with capsys.disabled():
        print(f"\n  parse {parse_best:,.0f} publishes/s; encode_deliver {deliver_best:,.0f}/s")
    # far below what a laptop does: a guard against gross regressions, not a benchmark
    assert parse_best > 50_000 and deliver_best > 50_000
