"""The load generator's AMQP client against a scripted broker on a loopback socket (no processes)."""

from __future__ import annotations

import socket
import threading

import pytest
from pamqp import commands

from ipc.errors import WouldBlock
from pipeline.amqp import frames
from pipeline.loadgen.client import (AmqpClient, ConnectionLost, ConsumerCancelled, HeartbeatClock, ServerClosed,
                                     negotiate)

S = 1_000_000_000


# -- pure parts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("client, server, agreed", [(60, 30, 30), (10, 60, 10), (0, 60, 60), (60, 0, 60), (0, 0, 0)])
def test_negotiation_takes_the_smaller_unless_one_side_says_no_limit(client, server, agreed):
    assert negotiate(client, server) == agreed


def test_heartbeat_clock_sends_at_half_the_interval_and_gives_up_after_two():
    hb = HeartbeatClock(10, now_ns=0)
    assert not hb.send_due(4 * S) and hb.send_due(5 * S)
    hb.sent(5 * S)
    assert not hb.send_due(9 * S)
    assert hb.next_deadline_ns() == 10 * S
    assert not hb.peer_silent(19 * S) and hb.peer_silent(20 * S)
    hb.received(19 * S)
    assert not hb.peer_silent(20 * S)


def test_heartbeats_off():
    hb = HeartbeatClock(0, now_ns=0)
    assert not hb.send_due(10**15) and not hb.peer_silent(10**15) and hb.next_deadline_ns() is None


# -- a scripted broker ---------------------------------------------------------------------------
class ScriptedBroker:
    """Accepts one connection and plays the broker's side of the handshake, then ``script(self)``."""

    def __init__(self, script, heartbeat_s: int = 30):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.script = script
        self.heartbeat_s = heartbeat_s
        self.received: list = []          # pamqp methods the client sent, in order
        self.error: BaseException | None = None
        self.conn: socket.socket | None = None
        self.buf = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.conn, _ = self.listener.accept()
            self.conn.settimeout(5)
            header = self._recv_exact(8)
            assert header == frames.PROTOCOL_HEADER, header
            self.send(0, commands.Connection.Start(server_properties={"product": "scripted"},
                                                   mechanisms="PLAIN AMQPLAIN", locales="en_US"))
            self.expect("Connection.StartOk")
            self.send(0, commands.Connection.Tune(channel_max=2047, frame_max=65536, heartbeat=self.heartbeat_s))
            self.expect("Connection.TuneOk")
            self.expect("Connection.Open")
            self.send(0, commands.Connection.OpenOk())
            self.expect("Channel.Open")
            self.send(1, commands.Channel.OpenOk())
            self.script(self)
        except BaseException as exc:       # reported by close()
            self.error = exc

    def _recv_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.conn.recv(65536)
            if not data:
                raise EOFError("client closed")
            self.buf += data
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def next_method(self):
        while True:
            found = frames.next_frame(self.buf, 0)
            if found is not None:
                ftype, channel, ps, pe = found
                method = frames.decode_method(self.buf, ps, pe) if ftype == 1 else None
                del self.buf[:pe + 1]
                if method is not None:
                    self.received.append(method)
                    return channel, method
                continue
            data = self.conn.recv(65536)
            if not data:
                raise EOFError("client closed")
            self.buf += data

    def expect(self, name: str):
        channel, method = self.next_method()
        assert method.name == name, (name, method.name)
        return method

    def send(self, channel: int, method) -> None:
        self.conn.sendall(frames.encode_method(channel, method))

    def send_raw(self, data: bytes) -> None:
        self.conn.sendall(data)

    def close(self) -> None:
        self.thread.join(5)
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()
        if self.error is not None:
            raise self.error


@pytest.fixture
def scripted():
    brokers = []

    def start(script, **kwargs) -> ScriptedBroker:
        brokers.append(ScriptedBroker(script, **kwargs))
        return brokers[-1]

    yield start
    for b in brokers:
        b.close()


def test_handshake_announces_capabilities_and_negotiates(scripted):
    def script(b):
        b.expect("Queue.Declare")
        b.send(1, commands.Queue.DeclareOk("q", 3, 0))
        b.expect("Basic.Qos")
        b.send(1, commands.Basic.QosOk())
        b.expect("Basic.Consume")
        b.send(1, commands.Basic.ConsumeOk("amq.ctag-1"))
        b.expect("Confirm.Select")
        b.send(1, commands.Confirm.SelectOk())
        b.expect("Connection.Close")
        b.send(0, commands.Connection.CloseOk())

    broker = scripted(script)
    client = AmqpClient("127.0.0.1", broker.port, name="creditflow-perf publisher-0", frame_max=131072,
                        heartbeat_s=60)
    assert (client.frame_max, client.heartbeat_s) == (65536, 30)
    assert client.queue_declare("q", durable=True) == 3
    client.basic_qos(10)
    assert client.basic_consume("q") == "amq.ctag-1"
    client.confirm_select()
    assert client.close() is True
    broker.close()
    start_ok, tune_ok = broker.received[0], broker.received[1]
    caps = start_ok.client_properties["capabilities"]
    assert caps["connection.blocked"] is True and caps["publisher_confirms"] is True
    assert start_ok.client_properties["connection_name"] == "creditflow-perf publisher-0"
    assert (start_ok.mechanism, start_ok.response) == ("PLAIN", "\0guest\0guest")
    assert (tune_ok.frame_max, tune_ok.heartbeat) == (65536, 30)
    declare = broker.received[4]
    assert (declare.queue, declare.durable, declare.auto_delete, declare.exclusive) == ("q", True, False, False)
    assert broker.received[5].prefetch_count == 10 and broker.received[6].no_ack is False


def test_blocked_and_unblocked_are_recorded_with_their_times(scripted):
    ready = threading.Event()

    def script(b):
        b.send(0, commands.Connection.Blocked("low on memory"))
        b.send(0, commands.Connection.Unblocked())
        ready.set()
        b.expect("Connection.Close")
        b.send(0, commands.Connection.CloseOk())

    broker = scripted(script)
    clock = iter(range(0, 10**12, S))
    client = AmqpClient("127.0.0.1", broker.port, clock=lambda: next(clock))
    client.set_nonblocking()
    ready.wait(5)
    handled = []
    while len(handled) < 2:
        try:
            client.receive_nowait()
        except WouldBlock:
            continue
        pos = 0
        while (found := frames.next_frame(client.buffer, pos)) is not None:
            client.handle_frame(*found)
            handled.append(found)
            pos = found[3] + 1
        client.discard(pos)
    events = client.take_blocked_events()
    assert [(what, reason) for _, what, reason in events] == [("blocked", "low on memory"), ("unblocked", "")]
    assert events[1][0] > events[0][0]
    stats = client.statistics()
    assert (stats.blocked, stats.blocked_count, stats.blocked_ns) == (False, 1, events[1][0] - events[0][0])
    assert client.take_blocked_events() == []
    client.close()


def test_connection_close_from_the_broker_raises_with_code_and_text_and_is_answered(scripted):
    def script(b):
        b.expect("Queue.Declare")
        b.send(0, commands.Connection.Close(320, "CONNECTION_FORCED - broker forced connection closure", 0, 0))
        b.expect("Connection.CloseOk")

    broker = scripted(script)
    client = AmqpClient("127.0.0.1", broker.port)
    with pytest.raises(ServerClosed, match="320 CONNECTION_FORCED - broker forced connection closure") as info:
        client.queue_declare("q")
    assert info.value.reply_code == 320 and info.value.what == "connection"
    broker.close()                                      # the scripted broker saw the close-ok
    client.abort()


def test_channel_close_names_the_failed_method(scripted):
    def script(b):
        b.expect("Queue.Declare")
        b.send(1, commands.Channel.Close(406, "PRECONDITION_FAILED - inequivalent arg 'durable'", 50, 10))
        b.expect("Channel.CloseOk")

    broker = scripted(script)
    client = AmqpClient("127.0.0.1", broker.port)
    with pytest.raises(ServerClosed, match=r"channel 1: 406 PRECONDITION_FAILED .* \(after method 50/10\)"):
        client.queue_declare("q", durable=True)
    broker.close()
    client.abort()


def test_a_cancelled_consumer_is_an_error(scripted):
    def script(b):
        b.send(1, commands.Basic.Cancel("amq.ctag-1"))

    broker = scripted(script)
    client = AmqpClient("127.0.0.1", broker.port)
    broker.close()
    with pytest.raises(ConsumerCancelled, match="amq.ctag-1"):
        while True:
            found = frames.next_frame(client.buffer, 0)
            if found is not None:
                client.handle_frame(*found)
                client.discard(found[3] + 1)
            else:
                client.receive_nowait()
    client.abort()


def test_a_vanished_broker_is_connection_lost(scripted):
    broker = scripted(lambda b: None)
    client = AmqpClient("127.0.0.1", broker.port)
    broker.close()                                      # closes its socket without connection.close
    client.set_nonblocking()
    with pytest.raises(ConnectionLost, match="without connection.close"):
        while True:
            try:
                client.receive_nowait()
            except WouldBlock:
                pass
    client.abort()


def test_nothing_listening_is_connection_lost():
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    with pytest.raises(ConnectionLost, match=f"cannot connect to 127.0.0.1:{free}"):
        AmqpClient("127.0.0.1", free)


def test_a_heartbeat_goes_out_when_idle_and_silence_is_detected(scripted):
    got = threading.Event()

    def script(b):
        assert b._recv_exact(8) == frames.encode_heartbeat()
        got.set()

    broker = scripted(script, heartbeat_s=2)
    now = [0]
    client = AmqpClient("127.0.0.1", broker.port, heartbeat_s=60, clock=lambda: now[0])
    assert client.heartbeat_s == 2
    client.set_nonblocking()
    now[0] = 1 * S
    client.tick(now[0])
    assert client.statistics().heartbeats_sent == 1
    assert got.wait(5)
    broker.close()
    now[0] = 5 * S
    with pytest.raises(ConnectionLost, match="missed heartbeats"):
        client.tick(now[0])
    client.abort()
