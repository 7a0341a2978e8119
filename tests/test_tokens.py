"""A stage's inbox: fixed-size tokens on a pipe, and the eventfd doorbell beside it."""

from __future__ import annotations

import os
import select
import struct
import time

import pytest
from hypothesis import given, strategies as st

from ipc import tokens
from ipc.doorbell import Doorbell, DoorbellStatistics
from ipc.errors import ClosedByUs, CorruptRecord, PeerGone, WouldBlock
from ipc.tokens import TOKEN_BYTES, Kind, Token, TokenReader, TokenWriter
from conftest import fork


@pytest.fixture
def pipe():
    """A pipe (read fd, write fd); whichever end the test did not close is closed at teardown."""
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def reap(pids: list[int]) -> list[int]:
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    pids.clear()
    return codes


# -- the codec --------------------------------------------------------------------------

def test_a_token_is_sixteen_bytes_laid_out_as_documented():
    data = tokens.encode(Kind.BUMP, 7, 200)
    assert len(data) == TOKEN_BYTES == 16
    assert data == bytes([1, 0, 0, 0, 7, 0, 0, 0, 200, 0, 0, 0, 0, 0, 0, 0])
    assert tokens.encode(Kind.ALARM_SET, 0x01020304, -1) == (b"\x04\x00\x00\x00" + b"\x04\x03\x02\x01"
                                                             + b"\xff" * 8)
    assert [int(k) for k in Kind] == [1, 2, 3, 4, 5, 6], "kinds are on the wire: never renumbered"


def test_out_of_range_fields_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        tokens.encode(Kind.BUMP, 1 << 32, 0)
    with pytest.raises(ValueError, match="out of range"):
        tokens.encode(Kind.BUMP, 1, 1 << 63)


_tokens = st.lists(st.builds(Token, st.sampled_from(Kind), st.integers(0, 2**32 - 1),
                             st.integers(-2**63, 2**63 - 1)), max_size=40)


@given(toks=_tokens)
def test_decode_returns_what_encode_wrote(toks):
    data = b"".join(tokens.encode(t.kind, t.link, t.value) for t in toks)
    assert tokens.decode(data) == (toks, len(data))
    assert tokens.decode(b"pad" + data, offset=3) == (toks, len(data))


@given(toks=_tokens, cuts=st.lists(st.integers(0, 40 * TOKEN_BYTES), max_size=10))
def test_decode_never_consumes_part_of_a_token_however_the_stream_is_cut(toks, cuts):
    data = b"".join(tokens.encode(t.kind, t.link, t.value) for t in toks)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    pending, out = b"", []
    for start, end in zip(bounds, bounds[1:]):
        pending += data[start:end]
        got, used = tokens.decode(pending)
        assert used % TOKEN_BYTES == 0 and len(pending) - used < TOKEN_BYTES
        out += got
        pending = pending[used:]
    assert out == toks and pending == b""


def test_a_partial_tail_is_left_for_later():
    data = tokens.encode(Kind.BUMP, 7, 200) + tokens.encode(Kind.SPACE, 3, 0)
    assert tokens.decode(data + data[:9]) == ([Token(Kind.BUMP, 7, 200), Token(Kind.SPACE, 3, 0)], 32)
    assert tokens.decode(data[:15]) == ([], 0)


def test_an_unknown_kind_is_corrupt():
    with pytest.raises(CorruptRecord, match="unknown token kind 99"):
        tokens.decode(struct.pack("<BBHIq", 99, 0, 0, 1, 1))
    with pytest.raises(CorruptRecord, match="unknown token kind 0"):
        tokens.decode(bytes(TOKEN_BYTES))


# -- on a pipe --------------------------------------------------------------------------------

def test_tokens_sent_on_a_pipe_are_read_back(pipe):
    r, w = pipe
    reader, writer = TokenReader(r), TokenWriter(w)
    with pytest.raises(WouldBlock):
        reader.read_nowait()
    writer.send(Kind.BUMP, 1, 200)
    writer.send(Kind.ALARM_SET, 0, tokens.ALARM_MEMORY)
    assert reader.read_nowait() == [Token(Kind.BUMP, 1, 200), Token(Kind.ALARM_SET, 0, 1)]
    assert reader.fileno() == r
    assert writer.statistics().tokens_sent == 2 and reader.statistics().tokens_read == 2


def test_a_token_split_across_writes_is_reassembled(pipe):
    r, w = pipe
    reader = TokenReader(r)
    data = tokens.encode(Kind.PEER_DOWN, 9, 0)
    os.write(w, data[:5])
    assert reader.read_nowait() == []
    assert reader.statistics().partial_bytes == 5
    os.write(w, data[5:] + tokens.encode(Kind.STOP, 0, 0))
    assert reader.read_nowait() == [Token(Kind.PEER_DOWN, 9, 0), Token(Kind.STOP, 0, 0)]
    assert reader.statistics().partial_bytes == 0


def test_eof_at_a_token_boundary_means_the_writers_are_gone(pipe):
    r, w = pipe
    reader = TokenReader(r)
    TokenWriter(w).send(Kind.BUMP, 1, 5)
    os.close(w)
    assert reader.read_nowait() == [Token(Kind.BUMP, 1, 5)]
    with pytest.raises(PeerGone, match="closed"):
        reader.read_nowait()


def test_eof_inside_a_token_is_corrupt(pipe):
    r, w = pipe
    reader = TokenReader(r)
    os.write(w, tokens.encode(Kind.BUMP, 1, 5)[:9])
    os.close(w)
    assert reader.read_nowait() == []
    with pytest.raises(CorruptRecord, match="inside a token"):
        reader.read_nowait()


def test_sending_to_a_pipe_nobody_reads_is_peer_gone(pipe):
    r, w = pipe
    os.close(r)
    with pytest.raises(PeerGone, match="gone"):
        TokenWriter(w).send(Kind.BUMP, 1, 1)


def test_an_end_used_after_we_closed_it_says_so(pipe):
    r, w = pipe
    writer, reader = TokenWriter(w), TokenReader(r)
    writer.close()
    writer.close()
    reader.close()
    with pytest.raises(ClosedByUs):
        writer.send(Kind.BUMP, 1, 1)
    with pytest.raises(ClosedByUs):
        reader.read_nowait()


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_tokens_from_several_writer_processes_never_interleave(pipe, children):
    r, w = pipe
    writers, per_writer = 4, 20_000             # 1.25 MB through a 64 KiB pipe: writers block often

    def write(k: int) -> int:
        writer = TokenWriter(w)
        for i in range(per_writer):
            writer.send(Kind.BUMP, k, i)
        return 0

    for k in range(writers):
        children.append(fork(lambda k=k: write(k)))
    os.close(w)
    reader = TokenReader(r)
    seen: dict[int, list[int]] = {k: [] for k in range(writers)}
    poller = select.poll()
    poller.register(r, select.POLLIN)
    while True:
        poller.poll(10_000)
        try:
            for token in reader.read_nowait():
                assert token.kind == Kind.BUMP
                seen[token.link].append(token.value)
        except WouldBlock:
            continue
        except PeerGone:
            break
    assert reap(children) == [0] * writers
    assert all(seen[k] == list(range(per_writer)) for k in range(writers))


# -- the doorbell ------------------------------------------------------------------------------

@pytest.fixture
def bell():
    doorbell = Doorbell()
    yield doorbell
    doorbell.close()


def test_the_doorbell_counts_rings_until_drained(bell):
    with pytest.raises(WouldBlock, match="not rung"):
        bell.drain_nowait()
    for _ in range(3):
        bell.ring()
    assert bell.drain_nowait() == 3
    with pytest.raises(WouldBlock):
        bell.drain_nowait()
    assert bell.statistics() == DoorbellStatistics(rings=3, drains=1, wakeups=3)


def test_a_ring_wakes_a_sleeping_select_and_a_drain_puts_it_back_to_sleep(bell):
    assert select.select([bell], [], [], 0)[0] == []
    bell.ring()
    assert select.select([bell], [], [], 5)[0] == [bell]
    bell.drain_nowait()
    assert select.select([bell], [], [], 0)[0] == []
    with pytest.raises(WouldBlock):
        bell.wait_rung(0.01)


def test_a_doorbell_wraps_a_received_fd_and_closing_twice_is_harmless(bell):
    twin = Doorbell(os.dup(bell.fileno()))
    twin.ring()
    assert bell.drain_nowait() == 1
    twin.close()
    twin.close()
    with pytest.raises(ClosedByUs):
        twin.ring()
    assert os.get_inheritable(bell.fileno()) is False


@pytest.mark.processes
@pytest.mark.timeout(30)
def test_a_forked_sender_wakes_a_receiver_sleeping_on_the_doorbell(bell, children):
    def sender() -> int:
        time.sleep(0.2)
        bell.ring()                      # the eventfd is inherited by fork despite close-on-exec
        return 0

    started = time.monotonic()
    children.append(fork(sender))
    assert bell.wait_rung(10) == 1
    assert 0.15 < time.monotonic() - started < 10
    assert reap(children) == [0]
