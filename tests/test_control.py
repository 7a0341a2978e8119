"""Control messages between the supervisor and a stage: JSON objects, boundaries kept, fds passed."""

from __future__ import annotations

import array
import os
import socket
import time
from pathlib import Path

import pytest

from ipc import control, tokens
from ipc.doorbell import Doorbell
from ipc.errors import ClosedByUs, CorruptRecord, PeerGone, WouldBlock
from ipc.tokens import Kind, Token, TokenReader
from conftest import fork


@pytest.fixture
def pair():
    """A control socketpair (supervisor end, stage end), closed at teardown."""
    supervisor, stage = control.socketpair()
    yield supervisor, stage
    supervisor.close()
    stage.close()


@pytest.fixture
def fds():
    """Descriptors to close at teardown (those a test did not close itself)."""
    opened: list[int] = []
    yield opened
    for fd in opened:
        try:
            os.close(fd)
        except OSError:
            pass


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_message_and_a_pipe_fd_arrive_together(pair, fds):
    supervisor, stage = pair
    r, w = os.pipe()
    fds += [r, w]
    control.send_msg(supervisor, {"type": "attach", "link": 3, "role": "out"}, [w])
    msg, got = control.recv_msg(stage, timeout_s=5)
    fds += got
    assert msg == {"type": "attach", "link": 3, "role": "out"}
    assert len(got) == 1 and got[0] != w
    assert not os.get_inheritable(got[0])
    os.close(w)                                   # the received copy alone keeps the pipe open
    os.write(got[0], b"hi")
    assert os.read(r, 2) == b"hi"


@pytest.mark.processes
@pytest.mark.timeout(30)
def test_a_running_stage_is_handed_a_new_peers_inbox_and_doorbell(pair, fds, children):
    supervisor, stage = pair

    def running_stage() -> int:
        msg, (inbox_fd, bell_fd) = control.recv_msg(stage, timeout_s=10)
        tokens.TokenWriter(inbox_fd).send(Kind.BUMP, msg["link"], 200)
        Doorbell(bell_fd).ring()
        control.send_msg(stage, {"type": "attached", "link": msg["link"]})
        return 0

    pid = fork(running_stage)
    children.append(pid)
    # the peer's endpoints are made after the stage was forked: it can only get them by message
    inbox_r, inbox_w = os.pipe()
    bell = Doorbell()
    fds += [inbox_r, inbox_w]
    control.send_msg(supervisor, {"type": "attach", "link": 12}, [inbox_w, bell.fileno()])
    assert control.recv_msg(supervisor, timeout_s=10) == ({"type": "attached", "link": 12}, [])
    assert TokenReader(inbox_r).read_nowait() == [Token(Kind.BUMP, 12, 200)]
    assert bell.drain_nowait() == 1
    bell.close()
    _, status = os.waitpid(pid, 0)
    children.remove(pid)
    assert os.waitstatus_to_exitcode(status) == 0


def test_each_send_is_one_message(pair):
    supervisor, stage = pair
    for i in range(3):
        control.send_msg(supervisor, {"seq": i})
    assert [control.recv_msg_nowait(stage)[0] for _ in range(3)] == [{"seq": 0}, {"seq": 1}, {"seq": 2}]
    with pytest.raises(WouldBlock, match="no control message"):
        control.recv_msg_nowait(stage)


def test_messages_up_to_the_limit_pass_and_larger_ones_are_refused(pair):
    supervisor, stage = pair
    overhead = len('{"pad":""}')
    big = {"pad": "x" * (control.MAX_CONTROL_BYTES - overhead)}
    control.send_msg(supervisor, big)
    assert control.recv_msg(stage, timeout_s=5) == (big, [])
    with pytest.raises(control.MessageTooLarge, match="exceeds 65536"):
        control.send_msg(supervisor, {"pad": "x" * control.MAX_CONTROL_BYTES})
    with pytest.raises(ValueError, match="fds"):
        control.send_msg(supervisor, {}, [0] * (control.MAX_FDS + 1))


def test_values_json_cannot_encode_travel_as_text(pair):
    supervisor, stage = pair
    control.send_msg(supervisor, {"dir": Path("/tmp/run"), "nested": {"ok": [1, 2.5, None, True]}})
    assert control.recv_msg(stage, timeout_s=5)[0] == {"dir": "/tmp/run", "nested": {"ok": [1, 2.5, None, True]}}


def test_waiting_gives_up_after_the_timeout(pair):
    _, stage = pair
    started = time.monotonic()
    with pytest.raises(WouldBlock, match="within 0.1 s"):
        control.recv_msg(stage, timeout_s=0.1)
    assert time.monotonic() - started >= 0.1


def test_bytes_that_are_not_a_json_object_are_corrupt(pair):
    supervisor, stage = pair
    supervisor.send(b"{not json")
    with pytest.raises(CorruptRecord, match="not JSON"):
        control.recv_msg_nowait(stage)
    supervisor.send(b"\xff\xfe")
    with pytest.raises(CorruptRecord, match="not JSON"):
        control.recv_msg_nowait(stage)
    supervisor.send(b"[1, 2]")
    with pytest.raises(CorruptRecord, match="not an object"):
        control.recv_msg_nowait(stage)


def test_fds_riding_on_a_corrupt_message_are_closed_not_leaked(pair, fds):
    supervisor, stage = pair
    r, w = os.pipe()
    fds += [r, w]
    before = open_fd_count()
    supervisor.sendmsg([b"garbage"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w]))])
    with pytest.raises(CorruptRecord):
        control.recv_msg_nowait(stage)
    assert open_fd_count() == before


def test_the_other_end_closing_is_peer_gone_and_our_own_close_is_closed_by_us(pair):
    supervisor, stage = pair
    control.send_msg(supervisor, {"type": "last words"})
    supervisor.close()
    assert control.recv_msg_nowait(stage) == ({"type": "last words"}, [])
    with pytest.raises(PeerGone, match="closed"):
        control.recv_msg(stage, timeout_s=5)
    with pytest.raises(PeerGone, match="gone"):
        control.send_msg(stage, {"type": "anyone?"})
    stage.close()
    with pytest.raises(ClosedByUs):
        control.send_msg(stage, {})
    with pytest.raises(ClosedByUs):
        control.recv_msg_nowait(stage)
