"""The sans-IO server connection driven by pamqp-encoded client frames."""

from __future__ import annotations

from pamqp import commands, frame

from pipeline.amqp import frames
from pipeline.amqp.connection import (ChannelClose, ChannelOpen, CloseRequested, HeartbeatTimeout, Method,
                                      Opened, ProtocolError, Publish, ServerConnection)

S = 1_000_000_000


def m(channel, method) -> bytes:
    return frame.marshal(method, channel)


def replies(conn) -> list:
    data = conn.data_to_send()
    out, pos = [], 0
    if data.startswith(b"AMQP"):
        return ["header"]
    while (found := frames.next_frame(data, pos)) is not None:
        ftype, ch, ps, pe = found
        pos = pe + 1
        if ftype == 1:
            out.append((ch, frames.decode_method(data, ps, pe)))
        else:
            out.append((ch, ftype))
    return out


def open_conn(capabilities=None, heartbeat=0) -> ServerConnection:
    conn = ServerConnection(now_ns=0)
    conn.receive_data(frames.PROTOCOL_HEADER)
    assert conn.next_event(0) is None
    start = replies(conn)[0][1]
    assert start.name == "Connection.Start" and "PLAIN" in start.mechanisms
    props = {"capabilities": capabilities or {}}
    conn.receive_data(m(0, commands.Connection.StartOk(client_properties=props, mechanism="PLAIN",
                                                       response="\0guest\0guest")))
    assert conn.next_event(0) is None
    assert replies(conn)[0][1].name == "Connection.Tune"
    conn.receive_data(m(0, commands.Connection.TuneOk(channel_max=10, frame_max=131072, heartbeat=heartbeat)))
    conn.receive_data(m(0, commands.Connection.Open(virtual_host="/")))
    event = conn.next_event(0)
    assert isinstance(event, Opened) and event.user == "guest"
    assert replies(conn)[0][1].name == "Connection.OpenOk"
    return conn


def test_handshake_channel_and_publish_one_event_per_call():
    conn = open_conn()
    conn.receive_data(m(1, commands.Channel.Open()))
    assert conn.next_event(0) == ChannelOpen(1)
    conn.open_channel_ok(1)
    props = frames.properties_raw(delivery_mode=2)
    conn.receive_data(b"".join(frames.encode_publish(1, "", "q", props, b"m%d" % i, 131072) for i in range(10)))
    got = []
    while (ev := conn.next_event(0)) is not None:
        assert isinstance(ev, Publish)
        got.append(ev.body)
        if len(got) == 3:
            assert conn.buffered_bytes() > 0, "one event per call: the rest stays unparsed"
    assert got == [b"m%d" % i for i in range(10)]
    assert ev is None
    conn.receive_data(m(1, commands.Queue.Declare(queue="q", durable=True)))
    ev = conn.next_event(0)
    assert isinstance(ev, Method) and ev.method.durable and (ev.class_id, ev.method_id) == (50, 10)
    assert frames.decode_method(ev.payload, 0, len(ev.payload)).queue == "q"


def test_bad_protocol_header_gets_ours():
    conn = ServerConnection()
    conn.receive_data(b"GET / HTTP/1.1\r\n")
    assert isinstance(conn.next_event(0), ProtocolError)
    assert conn.data_to_send() == frames.PROTOCOL_HEADER


def test_wrong_password_is_access_refused():
    conn = ServerConnection()
    conn.receive_data(frames.PROTOCOL_HEADER)
    conn.next_event(0)
    conn.data_to_send()
    conn.receive_data(m(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                                       response="\0guest\0nope")))
    ev = conn.next_event(0)
    assert isinstance(ev, ProtocolError) and ev.reply_code == 403


def test_frame_on_an_unopened_channel_is_channel_error():
    conn = open_conn()
    conn.receive_data(m(3, commands.Basic.Qos(prefetch_count=1)))
    ev = conn.next_event(0)
    assert isinstance(ev, ProtocolError) and ev.reply_code == 504
    assert replies(conn)[0][1].reply_code == 504


def test_content_out_of_order_is_unexpected_frame():
    conn = open_conn()
    conn.receive_data(m(1, commands.Channel.Open()))
    conn.next_event(0)
    conn.receive_data(m(1, commands.Basic.Publish(routing_key="q")) + m(1, commands.Basic.Qos()))
    ev = conn.next_event(0)
    assert isinstance(ev, ProtocolError) and ev.reply_code == 505


def test_oversized_message_closes_only_its_channel():
    conn = ServerConnection(max_message_bytes=100)
    for data in (frames.PROTOCOL_HEADER,):
        conn.receive_data(data)
    conn.next_event(0)
    conn.receive_data(m(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                                       response="\0guest\0guest")))
    conn.receive_data(m(0, commands.Connection.TuneOk(frame_max=131072)) + m(0, commands.Connection.Open()))
    conn.next_event(0)
    conn.data_to_send()
    conn.receive_data(m(1, commands.Channel.Open()))
    conn.next_event(0)
    conn.receive_data(frames.encode_publish(1, "", "q", b"\x00\x00", b"x" * 200, 131072))
    assert conn.next_event(0) is None
    out = replies(conn)
    assert out[0][1].name == "Channel.Close" and out[0][1].reply_code == 406
    assert conn.state == "open"


def test_blocked_frames_only_with_the_capability():
    without = open_conn()
    assert without.send_blocked("low on memory") is False
    with_cap = open_conn({"connection.blocked": True})
    assert with_cap.send_blocked("low on memory") is True
    assert replies(with_cap)[0][1].reason == "low on memory"


def test_client_close_is_answered():
    conn = open_conn()
    conn.receive_data(m(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)))
    assert isinstance(conn.next_event(0), CloseRequested)
    assert replies(conn)[0][1].name == "Connection.CloseOk"


def test_channel_close_waits_for_the_reader():
    conn = open_conn()
    conn.receive_data(m(1, commands.Channel.Open()))
    conn.next_event(0)
    conn.receive_data(m(1, commands.Channel.Close(reply_code=200, reply_text="ok", class_id=0, method_id=0)))
    assert conn.next_event(0) == ChannelClose(1, 200, "ok")
    conn.data_to_send()
    conn.close_channel_ok(1)
    assert replies(conn)[0][1].name == "Channel.CloseOk"


def test_heartbeats_are_sent_and_a_silent_client_times_out_unless_paused():
    conn = open_conn(heartbeat=2)
    conn.data_to_send()
    assert conn.tick(1 * S) is None
    assert conn.data_to_send() == frames.encode_heartbeat()
    conn.pause_heartbeat_monitor()
    assert conn.tick(10 * S) is None
    conn.resume_heartbeat_monitor(10 * S)
    assert conn.tick(13 * S) is None
    assert isinstance(conn.tick(15 * S), HeartbeatTimeout)
