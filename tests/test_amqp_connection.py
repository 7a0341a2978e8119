"""The sans-IO server connection, driven by pamqp-encoded client frames and by a real pika client."""

from __future__ import annotations

import dataclasses
import decimal
import re
import socket
import struct
import threading
import time

import pika
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pamqp import body as pbody, commands, frame, header, heartbeat

from pipeline.amqp import frames
from pipeline.amqp.connection import (CLOSING_BUFFER_MAX_BYTES, BodyParts, ChannelClose, ChannelCloseOk,
                                      ChannelError, ChannelOpen, Closed, CloseRequested, ConnectionStatistics,
                                      HandshakeTimeout, HeartbeatTimeout, Method, Opened, ProtocolError, Publish,
                                      ServerConnection)
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
    assert server["capabilities"] == {name: True for name in (       # RabbitMQ 3.10's list
        "publisher_confirms", "exchange_exchange_bindings", "basic.nack", "consumer_cancel_notify",
        "connection.blocked", "consumer_priorities", "authentication_failure_close", "per_consumer_qos",
        "direct_reply_to")}

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


BIG_STREAM = b"".join([
    frames.encode_publish(1, "", "a", PERSISTENT, bytes(range(256)) * 256, 131072),       # 64 KiB, one frame
    frames.encode_publish(2, "", "b", b"\x00\x00", b"x" * 50, 131072),
    frames.encode_publish(1, "", "c", b"\x00\x00", bytes(range(251)) * 200, 20000),       # 50,200 B, 3 frames
    frames.encode_basic_ack(2, 9),
])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(1, len(BIG_STREAM) - 1), max_size=6))
def test_big_bodies_taken_as_they_arrive_are_the_same_however_the_bytes_are_split(cuts):
    whole = opened(channels=(1, 2))
    whole.receive_data(BIG_STREAM)
    expected = [summary(e) for e in events(whole)]
    assert [type(e).__name__ for e in expected] == ["Publish", "Publish", "Publish", "tuple"]
    assert [len(e.body) for e in expected[:3]] == [65536, 50, 50200]
    conn = opened(channels=(1, 2))
    got, at = [], 0
    for cut in sorted(set(cuts)) + [len(BIG_STREAM)]:
        conn.receive_data(BIG_STREAM[at:cut])
        got += [summary(e) for e in events(conn)]
        at = cut
    assert got == expected
    assert [bytes(e.body) for e in got[:3]] == [bytes(e.body) for e in expected[:3]]
    assert (conn.frames_in, conn.publishes) == (whole.frames_in, whole.publishes) == (17, 3)


def test_a_big_body_frame_in_pieces_is_handed_on_in_those_pieces():
    conn = opened()
    body = bytes(range(256)) * 256
    data = frames.encode_publish(1, "", "q", b"\x00\x00", body, 131072)
    cut = len(data) - 30000
    conn.receive_data(data[:cut])
    assert events(conn) == []
    conn.receive_data(data[cut:])
    publish, = events(conn)
    assert isinstance(publish.body, BodyParts) and len(publish.body) == len(body)
    assert [len(p) for p in publish.body.pieces] == [len(body) - 29999, 29999], "no joined copy"
    into = bytearray(len(body))
    publish.body.copy_into(memoryview(into))
    assert into == body and bytes(publish.body) == body


def test_a_bad_frame_end_after_a_big_body_taken_in_pieces_is_501():
    conn = opened()
    data = frames.encode_publish(1, "", "q", b"\x00\x00", b"z" * 40000, 131072)
    conn.receive_data(data[:20000])
    assert events(conn) == []
    conn.receive_data(data[20000:-1] + b"\x00" + frames.encode_basic_ack(1, 1))
    close = closed_with(conn, 501)
    assert "invalid_frame_end_marker" in close.reply_text and "type 3" in close.reply_text
    assert conn.next_event(0) is None and conn.state == "closing"


def test_a_big_body_whose_rest_was_collected_behind_a_bigger_frame_is_not_left_waiting():
    """Bytes collected while a bigger frame was awaited are parsed once a big body frame is being taken,
    with no further read: a publish whose last bytes are in must come out."""
    conn = opened(channels=(1, 2, 3))
    conn.close_channel(1, 406, "PRECONDITION_FAILED - test")
    replies(conn)
    dropped = frames.encode_publish(1, "", "q", b"\x00\x00", b"d" * 100000, 131072)    # dropped: channel closing
    conn.receive_data(dropped[:50000])
    assert events(conn) == []                   # now waiting for the whole 100,008-byte frame
    conn.receive_data(dropped[50000:] + frames.encode_basic_ack(3, 1))
    big = frames.encode_publish(2, "", "q", b"\x00\x00", bytes(range(250)) * 80, 131072)
    conn.receive_data(big[:300])
    assert summary(conn.next_event(0))[:4] == ("Method", 3, 60, 80)
    conn.receive_data(big[300:])
    publish, = events(conn)
    assert publish.channel == 2 and bytes(publish.body) == bytes(range(250)) * 80


def test_the_peer_closing_in_the_middle_of_a_big_body_frame_is_reported():
    conn = opened()
    conn.receive_data(frames.encode_publish(1, "", "q", b"\x00\x00", b"z" * 20000, 131072)[:500])
    assert events(conn) == []
    conn.receive_data(b"")
    ev = conn.next_event(0)
    assert isinstance(ev, Closed) and "in the middle of a frame" in ev.reason and conn.state == "closed"


def test_a_bad_frame_end_after_a_big_body_names_its_first_16_octets_however_it_arrived():
    data = frames.encode_publish(1, "", "q", b"\x00\x00", bytes(range(100)) * 400, 131072)
    body_at = len(data) - 40000 - 8
    texts = set()
    for cut in (body_at + 7, body_at + 12, body_at + 40):     # after the frame header: taken in pieces
        conn = opened()
        conn.receive_data(data[:cut])
        assert events(conn) == []
        conn.receive_data(data[cut:-1] + b"\x00")
        texts.add(closed_with(conn, 501).reply_text)
    text, = texts
    assert "first 16 octets" in text and "invalid_frame_end_marker" in text


def test_a_channel_closed_by_the_client_is_not_taken_mid_body():
    """Frames cannot interleave inside a frame: bytes that arrive mid-body are body, whatever they look like."""
    conn = opened(channels=(1, 2))
    body = m(1, commands.Channel.Close(200, "bye", 0, 0)) * 1000
    data = frames.encode_publish(1, "", "q", b"\x00\x00", body, 131072)
    conn.receive_data(data[:100])
    conn.receive_data(data[100:])
    publish, = events(conn)
    assert bytes(publish.body) == body and conn.channel_state(1) == "open"


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


def dropped_with(conn: ServerConnection, code: int) -> ProtocolError:
    """Before tune-ok a bad client is dropped: the ProtocolError names the code, nothing goes to the client."""
    ev = conn.next_event(0)
    assert isinstance(ev, ProtocolError) and ev.reply_code == code, ev
    assert [r[1].name for r in replies(conn)] in ([], ["Connection.Tune"]), "no connection.close"
    assert conn.state == "closed" and conn.next_event(0) is None
    return ev


def start_ok(mechanism="PLAIN", response=GUEST, capabilities=None) -> bytes:
    props = {"capabilities": capabilities if capabilities is not None else {"authentication_failure_close": True}}
    return m(0, commands.Connection.StartOk(client_properties=props, mechanism=mechanism, response=response))


def raw_frame(ftype: int, channel: int, payload: bytes, end: bytes = b"\xce") -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + end


def nested_table(depth: int) -> bytes:
    """A field table (with its size) holding a table holding a table ... ``depth`` levels in all."""
    table = struct.pack(">I", 7) + b"\x01aI\x00\x00\x00\x01"
    for _ in range(depth - 1):
        table = struct.pack(">I", len(table) + 3) + b"\x01aF" + table
    return table


def nested_array(depth: int) -> bytes:
    """A table {"a": [[[...]]]} whose array nests ``depth - 1`` levels (the table is the first)."""
    array = struct.pack(">I", 0)
    for _ in range(depth - 2):
        array = struct.pack(">I", len(array) + 1) + b"A" + array
    return struct.pack(">I", len(array) + 3) + b"\x01aA" + array


def start_ok_with(client_properties: bytes, mechanism: bytes = b"PLAIN", response: bytes = GUEST.encode()) -> bytes:
    return raw_frame(1, 0, struct.pack(">HH", 10, 11) + client_properties + bytes([len(mechanism)]) + mechanism
                     + struct.pack(">I", len(response)) + response + b"\x05en_US")


def queue_declare_with(name: bytes = b"q", arguments: bytes = b"\x00\x00\x00\x00", channel: int = 1) -> bytes:
    return raw_frame(1, channel, struct.pack(">HHH", 50, 10, 0) + bytes([len(name)]) + name + b"\x00" + arguments)


def publish_with(props_raw: bytes, body: bytes = b"x", channel: int = 1) -> bytes:
    return (m(channel, commands.Basic.Publish(routing_key="q"))
            + raw_frame(2, channel, struct.pack(">HHQ", 60, 0, len(body)) + props_raw)
            + raw_frame(3, channel, body))


# RabbitMQ 3.10 closes every one of these without a word (after a 3 s pause), so does the core (at once)
DROPPED_CASES = {
    "bad frame end while starting": (frames.encode_heartbeat()[:-1] + b"\x00", 501, "invalid_frame_end_marker"),
    "frame over 4096 bytes before tune-ok": (start_ok_with(struct.pack(">I", 5007) + b"\x01xS"
                                                           + struct.pack(">I", 5000) + b"x" * 5000), 501,
                                             "frame_too_large,5043,4088"),
    "frame size 2^32-1 before tune-ok": (struct.pack(">BHI", 1, 0, 0xFFFFFFFF), 501,
                                         "frame_too_large,4294967295,4088"),
    "client properties nested 580 deep": (start_ok_with(nested_table(580)), 501, "nested deeper than 64 levels"),
    "client properties: arrays nested 800 deep": (start_ok_with(nested_array(800)), 501,
                                                 "nested deeper than 64 levels"),
    "client properties: unknown field type": (start_ok_with(struct.pack(">I", 3) + b"\x01aZ"), 501,
                                              "cannot decode <<"),
    "non-UTF-8 mechanism": (start_ok_with(b"\x00\x00\x00\x00", mechanism=b"PL\xffIN"), 501,
                            "Malformed UTF-8 in shortstr"),
    "truncated start-ok": (raw_frame(1, 0, start_ok()[7:40]), 501, "cannot decode <<"),
    "start-ok with bytes left over": (raw_frame(1, 0, start_ok()[7:-1] + b"zz"), 501, "cannot decode <<"),
    "unknown method before tune-ok": (raw_frame(1, 0, struct.pack(">HH", 10, 99)), 540, "unknown method 10/99"),
    "content header before tune-ok": (raw_frame(2, 1, struct.pack(">HHQ", 60, 0, 1) + b"\x00\x00"), 505,
                                      "type 2"),
    "malformed PLAIN response": (start_ok(response="guest"), 502, "response <<\"guest\">> invalid"),
    "unknown mechanism": (start_ok(mechanism="EXTERNAL"), 503, "unknown authentication mechanism 'EXTERNAL'"),
    "tune-ok before start-ok": (m(0, commands.Connection.TuneOk()), 504, "connection state starting"),
    "open before tune-ok": (start_ok() + m(0, commands.Connection.Open()), 504, "connection state tuning"),
    "channel frame before tune-ok": (start_ok() + m(1, commands.Channel.Open()), 505, "type 1"),
}


@pytest.mark.parametrize("data, code, text", DROPPED_CASES.values(), ids=DROPPED_CASES.keys())
def test_a_bad_client_is_dropped_without_a_word_before_tune_ok(data, code, text):
    ev = dropped_with(before_open(data), code)
    assert text in ev.reply_text


def test_frames_up_to_4096_bytes_are_taken_before_tune_ok():
    value = 4096 - 36 - 7                  # the rest of the start-ok payload is 36 bytes, the entry's head 7
    data = start_ok_with(struct.pack(">I", value + 7) + b"\x01xS" + struct.pack(">I", value) + b"x" * value)
    assert len(data) == 4096 + 8, "a payload of frame_max itself, the 8 bytes RabbitMQ tolerates"
    conn = before_open(data)
    assert conn.next_event(0) is None and conn.state == "tuning" and len(conn.client_properties["x"]) == value
    dropped_with(before_open(start_ok_with(struct.pack(">I", value + 8) + b"\x01xS" + struct.pack(">I", value + 1)
                                           + b"x" * (value + 1))), 501)


def test_client_properties_nested_up_to_the_limit_are_taken():
    conn = before_open(start_ok_with(nested_table(64)))
    assert conn.next_event(0) is None and conn.state == "tuning"
    depth, table = 0, conn.client_properties
    while isinstance(table, dict):
        depth, table = depth + 1, table["a"]
    assert depth == 64 and table == 1


TOLD_CASES = {
    "wrong password": (start_ok(response="\0guest\0nope"), 403, (10, 11)),
    "unknown user": (start_ok(response="\0bob\0guest"), 403, (10, 11)),
    "unknown vhost": (start_ok() + m(0, commands.Connection.TuneOk(frame_max=131072))
                      + m(0, commands.Connection.Open(virtual_host="other")), 530, (10, 40)),
    "channel frame after tune-ok": (start_ok() + m(0, commands.Connection.TuneOk(frame_max=131072))
                                    + m(1, commands.Channel.Open()), 505, (0, 0)),
    "non-UTF-8 vhost": (start_ok() + m(0, commands.Connection.TuneOk(frame_max=131072))
                        + raw_frame(1, 0, b"\x00\x0a\x00\x28\x02\xff\xfe\x00\x00"), 501, (10, 40)),
}


@pytest.mark.parametrize("data, code, ids", TOLD_CASES.values(), ids=TOLD_CASES.keys())
def test_a_refused_login_or_anything_after_tune_ok_is_told_its_reply_code(data, code, ids):
    conn = before_open(data)
    close = closed_with(conn, code)
    assert (close.class_id, close.method_id) == ids


def test_a_refused_login_only_gets_a_close_frame_with_the_capability():
    conn = before_open(start_ok(response="\0guest\0nope"))
    close = closed_with(conn, 403)
    assert close.reply_text == ("ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. "
                                "For details see the broker logfile.")
    silent = before_open(start_ok(response="\0guest\0nope", capabilities={}))
    dropped_with(silent, 403)


def test_an_amqplain_response_nested_too_deep_is_a_refused_login():
    conn = before_open(start_ok_with(b"\x00\x00\x00\x00", mechanism=b"AMQPLAIN", response=nested_table(500)[4:]))
    ev = dropped_with(conn, 502)
    assert "AMQPLAIN auth info is missing LOGIN or PASSWORD field" in ev.reply_text


def test_an_over_the_limit_connection_is_refused_in_place_of_open_ok():
    conn = start(refuse_open="NOT_ALLOWED - connection refused: node connection limit (1) is reached")
    conn.receive_data(m(0, commands.Connection.TuneOk(frame_max=131072)) + m(0, commands.Connection.Open()))
    close = closed_with(conn, 530)
    assert "connection limit (1)" in close.reply_text and (close.class_id, close.method_id) == (10, 40)


# what RabbitMQ 3.10 answered each of these with, from a real node (see pipeline/amqp/errors.py)
OPEN_CASES = {
    "method on an unopened channel": (m(3, commands.Basic.Qos(prefetch_count=1)), 504, (60, 10),
                                      "CHANNEL_ERROR - expected 'channel.open'"),
    "content header on an unopened channel": (frames.encode_content(3, b"\x00\x00", b"x", 4096), 505, (0, 0),
                                              "expected method frame"),
    "body on an unopened channel": (raw_frame(3, 5, b"x"), 505, (0, 0),
                                    "UNEXPECTED_FRAME - expected method frame, got non method frame instead"),
    "second channel.open": (m(1, commands.Channel.Open()), 504, (20, 10), "second 'channel.open' seen"),
    "channel over channel_max": (m(2048, commands.Channel.Open()), 530, (20, 10), "channel_max (2047)"),
    "unknown method": (struct.pack(">BHIHH", 1, 1, 4, 60, 255) + b"\xce", 540, (60, 255), "unknown method"),
    "unknown class": (raw_frame(1, 1, struct.pack(">HH", 99, 10)), 540, (99, 10), "unknown method 99/10"),
    "unknown method on channel 0": (raw_frame(1, 0, struct.pack(">HH", 10, 99)), 540, (10, 99),
                                    "unknown method 10/99"),
    "unknown frame type": (struct.pack(">BHI", 9, 0, 0) + b"\xce", 501, (0, 0),
                           "FRAME_ERROR - type 9, all octets = <<>>: unknown_frame"),
    "method frame too short for its ids": (raw_frame(1, 1, b"\x00\x32"), 501, (0, 0),
                                           "FRAME_ERROR - type 1, all octets = <<0,50>>: unknown_frame"),
    "truncated method arguments": (struct.pack(">BHIHH", 1, 1, 6, 50, 10) + b"\x00\x00\xce", 501, (50, 10),
                                   "FRAME_ERROR - cannot decode <<0,0>>"),
    "method arguments with bytes over": (raw_frame(1, 1, queue_declare_with()[7:-1] + b"zz"), 501, (50, 10),
                                         "FRAME_ERROR - cannot decode <<0,0,1,113,0,0,0,0,0,122,122>>"),
    "truncated publish": (raw_frame(1, 1, struct.pack(">HHH", 60, 40, 0) + b"\x05ab"), 501, (60, 40),
                          "FRAME_ERROR - cannot decode <<0,0,5,97,98>>"),
    "frame over frame_max": (struct.pack(">BHI", 3, 1, 131073), 501, (0, 0),
                             "FRAME_ERROR - type 3, all octets = <<>>: {frame_too_large,131073,131064}"),
    "frame size 2^32-1": (struct.pack(">BHI", 1, 1, 0xFFFFFFFF), 501, (0, 0),
                          "{frame_too_large,4294967295,131064}"),
    "method inside content": (m(1, commands.Basic.Publish(routing_key="q")) + m(1, commands.Basic.Qos()), 505,
                              (60, 40), "expected content header for class 60, got non content header frame"),
    "body before header": (m(1, commands.Basic.Publish(routing_key="q"))
                           + frame.marshal(pbody.ContentBody(b"x"), 1), 505, (60, 40), "expected content header"),
    "header without a publish": (frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1), 505,
                                 (0, 0), "expected method frame, got non method frame instead"),
    "header after header": (m(1, commands.Basic.Publish(routing_key="q"))
                            + 2 * frame.marshal(header.ContentHeader(0, 2, commands.Basic.Properties()), 1), 505,
                            (60, 40), "expected content body, got non content body frame instead"),
    "header for class 50": (m(1, commands.Basic.Publish(routing_key="q"))
                            + raw_frame(2, 1, struct.pack(">HHQ", 50, 0, 1) + b"\x00\x00"), 505, (60, 40),
                            "expected content header for class 60, got one for class 50 instead"),
    "header too short": (m(1, commands.Basic.Publish(routing_key="q")) + raw_frame(2, 1, b"\x00\x3c\x00"), 501,
                         (0, 0), "FRAME_ERROR - type 2, all octets = <<0,60,0>>: unknown_frame"),
    "body longer than declared": (m(1, commands.Basic.Publish(routing_key="q"))
                                  + frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1)
                                  + frame.marshal(pbody.ContentBody(b"xy"), 1), 501, (60, 40),
                                  "content body frame exceeds remaining content size"),
    "heartbeat on a channel": (struct.pack(">BHI", 8, 1, 0) + b"\xce", 505, (0, 0), "type 8"),
    "heartbeat with a payload": (raw_frame(8, 0, b"xx"), 501, (0, 0),
                                 'FRAME_ERROR - type 8, all octets = <<"xx">>: unknown_frame'),
    "content header on channel 0": (raw_frame(2, 0, struct.pack(">HHQ", 60, 0, 1) + b"\x00\x00"), 505, (0, 0),
                                    "UNEXPECTED_FRAME - type 2, all octets = <<0,60,0,0,0,0,0,0,0,0,0,1,0,0>>"),
    "connection method while running": (m(0, commands.Connection.TuneOk()), 504, (10, 31),
                                        "unexpected method in connection state running"),
    "channel method on channel 0": (m(0, commands.Basic.Qos()), 504, (60, 10),
                                    "unexpected method in connection state running"),
    "server-only method": (m(1, commands.Basic.Deliver(consumer_tag="c", delivery_tag=1, routing_key="q")), 503,
                           (60, 60), "COMMAND_INVALID - unimplemented method"),
    "channel.close-ok for no close of ours": (m(1, commands.Channel.CloseOk()), 503, (20, 41),
                                              "COMMAND_INVALID - unimplemented method"),
    "channel.flow active=false": (m(1, commands.Channel.Flow(active=False)), 540, (20, 20),
                                  "NOT_IMPLEMENTED - active=false"),
    "immediate publish": (m(1, commands.Basic.Publish(routing_key="q", immediate=True)), 540, (60, 40),
                          "immediate=true"),
    "non-UTF-8 queue name": (queue_declare_with(b"q\xff\xfe"), 501, (50, 10),
                             "FRAME_ERROR - Malformed UTF-8 in shortstr"),
    "non-UTF-8 consumer tag": (raw_frame(1, 1, struct.pack(">HHH", 60, 20, 0) + b"\x01q\x02\xff\xfe\x00"
                                         + b"\x00\x00\x00\x00"), 501, (60, 20), "Malformed UTF-8 in shortstr"),
    "non-UTF-8 channel.close text": (raw_frame(1, 1, struct.pack(">HHH", 20, 40, 200) + b"\x02\xff\xfe"
                                               + struct.pack(">HH", 0, 0)), 501, (20, 40),
                                     "Malformed UTF-8 in shortstr"),
    "non-UTF-8 field name in arguments": (queue_declare_with(arguments=struct.pack(">I", 7) + b"\x01\xffI\x00\x00"
                                                                                              b"\x00\x01"),
                                          501, (50, 10), "Malformed UTF-8 in shortstr"),
    "arguments nested 10,000 deep": (queue_declare_with(arguments=nested_table(10_000)), 501, (50, 10),
                                     "FRAME_ERROR - field table nested deeper than 64 levels"),
    "arrays in arguments nested 10,000 deep": (queue_declare_with(arguments=nested_array(10_000)), 501, (50, 10),
                                               "nested deeper than 64 levels"),
    "unknown field type in arguments": (queue_declare_with(arguments=struct.pack(">I", 3) + b"\x01aU"), 501,
                                        (50, 10), "FRAME_ERROR - cannot decode <<0,0,1,113,0,0,0,0,3,1,97,85>>"),
    "arguments longer than the frame": (queue_declare_with(arguments=struct.pack(">I", 100) + b"\x01at\x01"), 501,
                                        (50, 10), "cannot decode"),
    "array entry cut short": (queue_declare_with(arguments=struct.pack(">I", 10) + b"\x01aA" + struct.pack(">I", 3)
                                                 + b"I\x00\x00"), 501, (50, 10), "cannot decode"),
    "message headers nested 10,000 deep": (publish_with(b"\x20\x00" + nested_table(10_000)), 501, (60, 40),
                                           "nested deeper than 64 levels"),
    "message headers with an unknown field type": (publish_with(b"\x20\x00" + struct.pack(">I", 3) + b"\x01aZ"),
                                                   501, (60, 40), "cannot decode"),
    "malformed properties": (m(1, commands.Basic.Publish(routing_key="q"))
                             + struct.pack(">BHIHHQH", 2, 1, 14, 60, 0, 0, 0x8000) + b"\xce", 501, (60, 40),
                             "cannot decode content properties"),
}


@pytest.mark.parametrize("data, code, ids, text", OPEN_CASES.values(), ids=OPEN_CASES.keys())
def test_bad_input_on_an_open_connection_gets_the_right_reply_code(data, code, ids, text):
    conn = opened()
    conn.receive_data(data)
    close = closed_with(conn, code)
    assert (close.class_id, close.method_id) == ids
    assert text in close.reply_text


EVERY_FIELD_TYPE = (
    b"\x01tt\x01" b"\x01bb\xff" b"\x01BB\xff" b"\x01ss\xff\xff" b"\x01uu\xff\xff" b"\x01II\xff\xff\xff\xff"
    b"\x01ii\xff\xff\xff\xff" b"\x01ll" + b"\xff" * 8 + b"\x01LL" + b"\xff" * 8 + b"\x01ff\x00\x00\x00\x00"
    b"\x01dd" + b"\x00" * 8 + b"\x01DD\x02\x00\x00\x01\x00" b"\x01SS\x00\x00\x00\x01s" b"\x01xx\x00\x00\x00\x01x"
    b"\x01TT" + b"\xff" * 8 + b"\x01VV" b"\x01FF\x00\x00\x00\x00" b"\x01AA\x00\x00\x00\x00")
ACCEPTED_CASES = {
    "arguments nested 64 deep": queue_declare_with(arguments=nested_table(64)),
    "non-UTF-8 long string in arguments": queue_declare_with(arguments=struct.pack(">I", 9) + b"\x01aS"
                                                             + struct.pack(">I", 2) + b"\xff\xfe"),
    "every field type RabbitMQ knows": queue_declare_with(arguments=struct.pack(">I", len(EVERY_FIELD_TYPE))
                                                          + EVERY_FIELD_TYPE),
    "a timestamp no datetime can hold": queue_declare_with(arguments=struct.pack(">I", 11) + b"\x01aT" + b"\xff" * 8),
}


@pytest.mark.parametrize("data", ACCEPTED_CASES.values(), ids=ACCEPTED_CASES.keys())
def test_odd_but_valid_arguments_are_forwarded_as_rabbitmq_takes_them(data):
    conn = opened()
    conn.receive_data(data)
    ev = conn.next_event(0)
    assert isinstance(ev, Method) and (ev.class_id, ev.method_id) == (50, 10) and conn.state == "open"


def test_every_field_type_decodes_to_what_rabbitmq_reads():
    conn = opened()
    conn.receive_data(ACCEPTED_CASES["every field type RabbitMQ knows"])
    args = conn.next_event(0).method.arguments
    assert args == {"t": True, "b": -1, "B": 255, "s": -1, "u": 65535, "I": -1, "i": 2 ** 32 - 1, "l": -1,
                    "L": 2 ** 64 - 1, "f": 0.0, "d": 0.0, "D": decimal.Decimal("2.56"), "S": "s",
                    "x": bytearray(b"x"), "T": 2 ** 64 - 1, "V": None, "F": {}, "A": []}


def test_non_utf8_names_in_a_publish_go_through_as_rabbitmq_lets_them():
    conn = opened()
    conn.receive_data(raw_frame(1, 1, struct.pack(">HHH", 60, 40, 0) + b"\x01\xff\x02\xfe\xfd\x00")
                      + frames.encode_content(1, b"\x00\x00", b"x", 131072))
    ev = conn.next_event(0)
    assert isinstance(ev, Publish) and (ev.exchange_b, ev.routing_key_b) == (b"\xff", b"\xfe\xfd")


def test_message_headers_with_non_utf8_names_are_forwarded_untouched():
    props = b"\x20\x00" + struct.pack(">I", 7) + b"\x01\xffI\x00\x00\x00\x01"
    conn = opened()
    conn.receive_data(publish_with(props))
    ev = conn.next_event(0)
    assert isinstance(ev, Publish) and ev.props_raw == props


def test_a_huge_declared_body_is_dropped_as_it_comes_and_other_channels_carry_on():
    # RabbitMQ 3.10 waits for the whole body before refusing it (406); here nothing of it is kept
    conn = opened(channels=(1, 2), max_message_bytes=100)
    conn.receive_data(m(1, commands.Basic.Publish(routing_key="q"))
                      + raw_frame(2, 1, struct.pack(">HHQ", 60, 0, 2 ** 64 - 1) + b"\x00\x00"))
    assert conn.next_event(0) is None
    chunk = raw_frame(3, 1, b"z" * 131_000)
    for _ in range(100):
        conn.receive_data(chunk)
        assert conn.next_event(0) is None
    conn.receive_data(frames.encode_publish(2, "", "q", b"\x00\x00", b"ok", 131072))
    assert conn.next_event(0).body == b"ok" and conn.state == "open"
    assert conn.buffered_bytes() == 0


def test_a_declared_body_over_512_mib_closes_its_channel_once_it_is_in():
    conn = opened(channels=(1, 2), max_message_bytes=100)
    size = 600 * 1024 * 1024
    conn.receive_data(m(1, commands.Basic.Publish(routing_key="q"))
                      + raw_frame(2, 1, struct.pack(">HHQ", 60, 0, size) + b"\x00\x00"))
    assert conn.next_event(0) is None
    piece = raw_frame(3, 1, b"z" * (131072 - 8))
    sent = 0
    while size - sent >= 131072 - 8:
        conn.receive_data(piece)
        assert conn.next_event(0) is None
        sent += 131072 - 8
    conn.receive_data(raw_frame(3, 1, b"z" * (size - sent)))
    assert conn.next_event(0) == ChannelError(1, 406, f"PRECONDITION_FAILED - message size {size} is larger than "
                                                      "configured max size 100")
    assert conn.state == "open" and conn.channel_state(1) == "server_closing"


def test_content_on_a_channel_the_client_is_closing_is_unexpected():
    conn = opened()
    conn.receive_data(m(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0))
                      + frames.encode_content(1, b"\x00\x00", b"x", 4096))
    assert conn.next_event(0) == ChannelClose(1, 200, "")
    close = closed_with(conn, 505)
    assert close.reply_text == "UNEXPECTED_FRAME - expected method frame, got non method frame instead"


def test_a_fault_inside_parsing_closes_only_this_connection_with_541(monkeypatch):
    conn = opened()

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(conn, "_channel_method", broken)
    conn.receive_data(m(1, commands.Basic.Qos(prefetch_count=1)))
    close = closed_with(conn, 541)
    assert close.reply_text == "INTERNAL_ERROR - RuntimeError while parsing: boom"
    conn.receive_data(m(0, commands.Connection.CloseOk()))
    assert conn.next_event(0) is None, "nothing more is parsed"


def test_input_after_our_close_is_not_kept_without_bound():
    conn = opened()
    conn.receive_data(raw_frame(9, 0, b""))
    closed_with(conn, 501)
    conn.receive_data(m(0, commands.Connection.CloseOk()))
    assert isinstance(conn.next_event(0), Closed), "a close-ok after our close is still read"
    conn = opened()
    conn.close(320, "CONNECTION_FORCED - test")
    for _ in range(100):
        conn.receive_data(b"\x03\x00\x01\x00\x01\xff\xf8" + b"z" * 65536)
    assert conn.buffered_bytes() <= CLOSING_BUFFER_MAX_BYTES
    conn.receive_data(b"")
    assert isinstance(conn.next_event(0), Closed) and conn.state == "closed"
    dropped = before_open(raw_frame(9, 0, b""))
    dropped_with(dropped, 501)
    dropped.receive_data(b"x" * 1_000_000)
    assert dropped.buffered_bytes() == 0


# -- whatever the bytes, an event and never an exception ---------------------------------------------------------

def _valid_session() -> list[bytes]:
    """What pika sends for declare, confirm, publish, consume and close, one frame to an element."""
    props = frames.properties_raw(content_type="text/plain", delivery_mode=2, headers={"h": [1, "x", {"n": None}]})
    parts = [m(1, commands.Queue.Declare(queue="q", arguments={"x-max-length": 10})),
             m(1, commands.Confirm.Select()), m(1, commands.Basic.Qos(prefetch_count=5))]
    parts += list(split_frames(frames.encode_publish(1, "", "q", props, b"x" * 5000, 4096)))
    parts += [m(1, commands.Basic.Consume(queue="q")), frames.encode_basic_ack(1, 1),
              m(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0)),
              m(0, commands.Connection.Close(reply_code=200, reply_text="", class_id=0, method_id=0))]
    return parts


def split_frames(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while (found := frames.next_frame(data, pos)) is not None:
        out.append(data[pos:found[3] + 1])
        pos = found[3] + 1
    return out


VALID = _valid_session()


@st.composite
def mutated_sessions(draw) -> bytes:
    parts = list(VALID)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(parts) - 1))
        part = bytearray(parts[i])
        how = draw(st.sampled_from(["flip", "cut", "insert", "drop", "swap", "channel", "size"]))
        if how == "flip" and part:
            part[draw(st.integers(0, len(part) - 1))] = draw(st.integers(0, 255))
        elif how == "cut":
            del part[draw(st.integers(0, len(part))):]
        elif how == "insert":
            part[draw(st.integers(0, len(part))):0] = draw(st.binary(min_size=1, max_size=40))
        elif how == "drop":
            part = bytearray()
        elif how == "swap":
            j = draw(st.integers(0, len(parts) - 1))
            parts[i], parts[j] = parts[j], parts[i]
            continue
        elif how == "channel" and len(part) > 3:
            part[1:3] = struct.pack(">H", draw(st.sampled_from([0, 1, 2, 9, 2047, 65535])))
        elif how == "size" and len(part) > 7:
            part[3:7] = struct.pack(">I", draw(st.sampled_from([0, 1, 4095, 4096, 4097, 131064, 2 ** 32 - 1])))
        parts[i] = bytes(part)
    return b"".join(parts)


def _drain(conn: ServerConnection) -> list:
    got = []
    for _ in range(200):
        ev = conn.next_event(0)
        if ev is None:
            break
        got.append(ev)
        if isinstance(ev, ChannelOpen):
            conn.open_channel_ok(ev.channel)
        elif isinstance(ev, ChannelClose):
            conn.close_channel_ok(ev.channel)
    return got


def _check_reply_stream(conn: ServerConnection) -> None:
    data = conn.data_to_send()
    pos = 0
    while (found := frames.next_frame(data, pos)) is not None:
        pos = found[3] + 1
    assert pos == len(data), "we only ever send whole frames"


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(mutated_sessions(), st.binary(max_size=300)), split=st.integers(1, 64),
       where=st.sampled_from(["header", "starting", "tuning", "open"]))
def test_no_input_makes_the_core_raise(data, split, where):
    if where == "header":
        conn = ServerConnection()
        data = frames.PROTOCOL_HEADER + data
    elif where == "starting":
        conn = before_open(b"")
    elif where == "tuning":
        conn = start()
    else:
        conn = opened(channels=(1,))
    got = []
    for i in range(0, len(data), split):
        conn.receive_data(data[i:i + split])
        got += _drain(conn)
    conn.receive_data(b"")
    got += _drain(conn)
    _check_reply_stream(conn)
    errors = [e for e in got if isinstance(e, ProtocolError)]
    assert len(errors) <= 1
    if errors:
        assert conn.state in ("closing", "closed")
        assert errors[0].reply_code != 541, errors[0]


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


def test_a_held_channel_close_goes_only_when_sent_and_its_frames_are_dropped_meanwhile():
    """``hold_channel_closes`` (the broker's readers): the 406 for a message too big waits until the channel's
    process has handed back what it held; the channel's frames are dropped meanwhile, the others go on."""
    conn = opened(channels=(1, 2), max_message_bytes=100, hold_channel_closes=True)
    conn.receive_data(frames.encode_publish(1, "", "q", b"\x00\x00", b"x" * 101, 131072)
                      + frames.encode_publish(1, "", "q", b"\x00\x00", b"dropped", 131072)
                      + frames.encode_publish(2, "", "q", b"\x00\x00", b"y" * 100, 131072))
    assert conn.next_event(0) == ChannelError(1, 406, "PRECONDITION_FAILED - message size 101 is larger than "
                                                      "configured max size 100")
    held = conn.held_close(1)
    assert (held.reply_code, held.class_id, held.method_id) == (406, 60, 40)
    assert conn.next_event(0).body == b"y" * 100 and replies(conn) == []
    assert conn.channel_state(1) == "server_closing"
    assert conn.send_held_close(1) and not conn.send_held_close(1)
    (ch, close), = replies(conn)
    assert ch == 1 and close.name == "Channel.Close" and close.reply_code == 406
    conn.receive_data(m(1, commands.Channel.CloseOk()))
    assert conn.next_event(0) == ChannelCloseOk(1) and conn.open_channels == frozenset({2})


def test_a_client_that_closes_a_channel_whose_close_is_held_gets_its_own_close_answered():
    conn = opened(max_message_bytes=100, hold_channel_closes=True)
    conn.receive_data(frames.encode_publish(1, "", "q", b"\x00\x00", b"x" * 101, 131072)
                      + m(1, commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)))
    assert isinstance(conn.next_event(0), ChannelError)
    assert conn.next_event(0) == ChannelClose(1, 200, "bye") and conn.channel_state(1) == "client_closing"
    assert conn.held_close(1) is None and not conn.send_held_close(1) and replies(conn) == []
    conn.close_channel_ok(1)
    (ch, ok), = replies(conn)
    assert (ch, ok.name) == (1, "Channel.CloseOk") and conn.open_channels == frozenset()


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


def test_client_close_is_answered_once_its_channels_have_finished():
    conn = opened()
    conn.receive_data(m(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
                      + m(1, commands.Channel.Open()))
    assert conn.next_event(0) == CloseRequested(200, "bye")
    assert names(conn) == [] and conn.state == "client_closing"
    assert conn.next_event(0) is None, "nothing after the client's close is parsed"
    conn.send_raw(frames.encode_method(1, commands.Queue.DeclareOk(queue="q", message_count=0, consumer_count=0)))
    conn.send_close_ok()
    assert names(conn) == ["Queue.DeclareOk", "Connection.CloseOk"] and conn.state == "closed"
    conn.send_raw(frames.encode_method(1, commands.Basic.QosOk()))
    assert names(conn) == [], "nothing goes out after close-ok"


def test_connection_update_secret_is_answered():
    conn = opened()
    conn.receive_data(m(0, commands.Connection.UpdateSecret(new_secret="guest", reason="rotation")))
    assert conn.next_event(0) is None
    assert names(conn) == ["Connection.UpdateSecretOk"] and conn.state == "open"


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
    assert conn.next_tick_ns() is None, "an idle connection without heartbeats needs no timer at all"


def test_the_next_tick_is_when_tick_has_something_to_do_and_not_before():
    waiting = start(handshake_timeout_s=10)
    assert waiting.next_tick_ns() == 10 * S, "the handshake deadline"
    conn = opened(heartbeat_s=10)
    due = conn.next_tick_ns()
    assert due == 5 * S
    assert conn.tick(due - 1) is None and conn.data_to_send() == b""
    assert conn.tick(due) is None and conn.data_to_send() == frames.encode_heartbeat()
    assert conn.next_tick_ns() == 10 * S, "the next heartbeat out"
    assert conn.tick(10 * S) is None and conn.data_to_send() == frames.encode_heartbeat()
    assert conn.next_tick_ns() == 15 * S
    conn.note_sent(14 * S)                  # other traffic out puts the next heartbeat off
    assert conn.next_tick_ns() == 19 * S
    conn.tick(19 * S)
    assert conn.next_tick_ns() == 20 * S + 1, "the silent client's deadline comes before the next heartbeat"
    assert isinstance(conn.tick(20 * S + 1), HeartbeatTimeout)


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
                conn = self.conn = ServerConnection(now_ns=time.monotonic_ns(), **self.kwargs)
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
                        elif isinstance(ev, CloseRequested):
                            conn.send_close_ok()       # this server has no channel processes to wait for
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


def test_guest_is_refused_from_a_remote_address_and_other_users_are_not():
    remote = ServerConnection(peer_is_loopback=False, users={"guest": "guest", "admin": "pw"})
    remote.receive_data(frames.PROTOCOL_HEADER + start_ok())
    ev = remote.next_event(0)
    assert isinstance(ev, ProtocolError) and ev.reply_code == 403
    assert remote.login_refused == "PLAIN login refused: user 'guest' can only connect via localhost"
    admin = ServerConnection(peer_is_loopback=False, users={"guest": "guest", "admin": "pw"})
    admin.receive_data(frames.PROTOCOL_HEADER + start_ok(response="\0admin\0pw"))
    assert admin.next_event(0) is None and admin.state == "tuning" and admin.login_refused is None
    anywhere = ServerConnection(peer_is_loopback=False, loopback_users=frozenset())
    anywhere.receive_data(frames.PROTOCOL_HEADER + start_ok())
    assert anywhere.next_event(0) is None and anywhere.state == "tuning"


def test_a_client_that_does_not_open_within_the_handshake_timeout_is_dropped():
    conn = ServerConnection(now_ns=0, handshake_timeout_s=10)
    conn.receive_data(frames.PROTOCOL_HEADER + start_ok())
    assert conn.next_event(1) is None and conn.tick(9_999_999_999) is None
    assert isinstance(conn.tick(10_000_000_000), HandshakeTimeout) and conn.state == "closed"
    done = opened()                                  # an open connection is never timed by it
    assert done.tick(3_600 * 1_000_000_000) is None and done.state == "open"
