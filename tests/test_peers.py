"""ipc.peers: one writer and doorbell per peer pipe in a process, closed with the last link using them."""

from __future__ import annotations

import os

import pytest

from ipc import tokens
from ipc.peers import PeerEndpoints


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        if _is_open(fd):
            os.close(fd)


def test_links_to_one_peer_share_its_pipe_and_doorbell_and_duplicates_are_closed(pipe):
    r, w = pipe
    held = PeerEndpoints()
    bell = os.eventfd(0)
    first_key, writer, no_bell = held.take(os.dup(w))                 # an in-link: the pipe alone
    dup_w, dup_bell = os.dup(w), os.dup(bell)
    second_key, same_writer, doorbell = held.take(dup_w, dup_bell)     # an out-link brings the doorbell
    third_w, third_bell = os.dup(w), os.dup(bell)
    _, third_writer, same_bell = held.take(third_w, third_bell)
    assert first_key == second_key and no_bell is None
    assert same_writer is writer is third_writer and same_bell is doorbell
    assert not _is_open(dup_w) and not _is_open(third_w) and not _is_open(third_bell)
    assert len(held) == 1
    writer.send(tokens.Kind.BUMP, 7, 3)                                # it writes to the peer's pipe
    doorbell.ring()
    assert tokens.decode(os.read(r, 64))[0] == [tokens.Token(tokens.Kind.BUMP, 7, 3)]
    assert os.eventfd_read(bell) == 1
    os.close(bell)
    held.give_back(first_key)
    held.give_back(first_key)
    assert _is_open(writer.fd) and len(held) == 1                      # one link still uses them
    kept_fd = writer.fd
    held.give_back(first_key)
    assert not _is_open(kept_fd) and writer.fd == -1 and len(held) == 0


def test_different_pipes_are_different_peers(pipe):
    _, w = pipe
    r2, w2 = os.pipe()
    try:
        held = PeerEndpoints()
        key_a, writer_a, _ = held.take(os.dup(w))
        key_b, writer_b, _ = held.take(os.dup(w2))
        assert key_a != key_b and writer_a is not writer_b and len(held) == 2
        held.give_back(key_a)
        assert writer_a.fd == -1 and _is_open(writer_b.fd)
        held.give_back(key_b)
        held.give_back(key_b)                                          # once too often: nothing left to close
        assert len(held) == 0
    finally:
        os.close(r2)
        os.close(w2)
