"""Pipe tokens, the eventfd doorbell, control messages with fds, and shm ownership."""

from __future__ import annotations

import os
import select
import subprocess

import pytest

from ipc import control, shm, tokens
from ipc.doorbell import Doorbell
from ipc.errors import CorruptRecord, PeerGone, WouldBlock
from ipc.tokens import Kind, Token


def test_tokens_round_trip_and_partial_tails_wait():
    data = tokens.encode(Kind.BUMP, 7, 200) + tokens.encode(Kind.ALARM_SET, 0, 1)
    toks, used = tokens.decode(data + b"\x01\x00")
    assert toks == [Token(Kind.BUMP, 7, 200), Token(Kind.ALARM_SET, 0, 1)]
    assert used == 2 * tokens.TOKEN_BYTES


def test_token_pipe_eof_at_a_boundary_is_peer_gone_inside_is_corrupt():
    r, w = os.pipe()
    reader = tokens.TokenReader(r)
    with pytest.raises(WouldBlock):
        reader.read_nowait()
    tokens.TokenWriter(w).send(Kind.BUMP, 1, 5)
    assert reader.read_nowait() == [Token(Kind.BUMP, 1, 5)]
    os.close(w)
    with pytest.raises(PeerGone):
        reader.read_nowait()
    os.close(r)

    r, w = os.pipe()
    reader = tokens.TokenReader(r)
    os.write(w, tokens.encode(Kind.BUMP, 1, 5)[:9])
    os.close(w)
    with pytest.raises(CorruptRecord, match="inside a token"):
        reader.read_nowait()
        reader.read_nowait()
    os.close(r)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_tokens_from_several_writers_never_interleave():
    r, w = os.pipe()
    pids = []
    for k in range(4):
        pid = os.fork()
        if pid == 0:
            writer = tokens.TokenWriter(w)
            for i in range(5000):
                writer.send(Kind.BUMP, k, i)
            os._exit(0)
        pids.append(pid)
    os.close(w)
    reader = tokens.TokenReader(r)
    seen = {k: [] for k in range(4)}
    while True:
        select.select([r], [], [])
        try:
            for t in reader.read_nowait():
                seen[t.link].append(t.value)
        except PeerGone:
            break
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(r)
    assert all(seen[k] == list(range(5000)) for k in range(4))


def test_doorbell_counts_and_wakes_select():
    bell = Doorbell()
    with pytest.raises(WouldBlock):
        bell.drain_nowait()
    bell.ring()
    bell.ring()
    assert select.select([bell], [], [], 1)[0] == [bell]
    assert bell.drain_nowait() == 2
    assert select.select([bell], [], [], 0)[0] == []
    bell.close()


def test_control_messages_carry_fds():
    a, b = control.socketpair()
    r, w = os.pipe()
    control.send_msg(a, {"type": "attach", "link": 3}, [w])
    msg, fds = control.recv_msg(b, timeout_s=5)
    assert msg == {"type": "attach", "link": 3} and len(fds) == 1
    os.write(fds[0], b"hi")
    assert os.read(r, 2) == b"hi"
    for fd in (r, w, *fds):
        os.close(fd)
    with pytest.raises(WouldBlock):
        control.recv_msg_nowait(b)
    a.close()
    with pytest.raises(PeerGone):
        control.recv_msg_nowait(b)
    b.close()


def test_shm_owner_creates_attaches_and_unlinks_everything():
    owner = shm.SegmentOwner(shm.new_run_id())
    seg = owner.create("x", 4096)
    seg.buf[:5] = b"hello"
    other = shm.attach(seg.name)
    assert bytes(other.buf[:5]) == b"hello"
    other.close()
    assert shm.leftover_names(run_id=owner.run_id)
    seg.close()
    assert owner.unlink_all() == [seg.name]
    assert owner.unlink_all() == []
    assert not shm.leftover_names(run_id=owner.run_id)


def test_cleanup_removes_only_segments_of_dead_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = shm.SegmentOwner(f"{dead.pid}xdead")
    live = shm.SegmentOwner(shm.new_run_id())
    stale.create("old", 4096).close()
    live.create("new", 4096).close()
    try:
        removed = shm.cleanup_stale()
        assert f"creditflow-{dead.pid}xdead-old" in removed
        assert shm.leftover_names(run_id=live.run_id)
    finally:
        stale.unlink_all()
        live.unlink_all()
