"""Fixed-size tokens on pipes: credit grants and control between stages.

Theory of operation
-------------------
Each stage has one inbox pipe that every peer (and the supervisor) writes
tokens into, and only the stage reads. Records travel on rings; what travels
here is small and rare by comparison: a credit grant (RabbitMQ's
``bump_credit``), "I freed space in our ring", "your peer is gone", alarm
set/clear, stop. A token is 16 bytes sent with one ``write``. POSIX makes a
pipe write of at most PIPE_BUF (4096 bytes on Linux) atomic: all of it lands
together or, while the pipe is full, none of it yet. So tokens from several
writer processes never interleave, and since the reader reads multiples of
16 bytes, it never sees part of a token from a well-behaved writer. A
partial tail can only come from a foreign writer; EOF inside a token is
therefore corruption (``CorruptRecord``), EOF at a boundary means every
writer has gone (``PeerGone``).

Byte layout (little-endian)::

    offset 0  u8   kind        a Kind value; 0 and unknown values are corrupt
    offset 1  u8   reserved    0
    offset 2  u16  reserved    0
    offset 4  u32  link id     the link (ring) the token is about; 0 = none
    offset 8  i64  value       credit amount, alarm source, ...

``decode`` is pure: it takes whole tokens from a buffer and says how many
bytes it consumed, leaving a partial tail for the next read.
"""

from __future__ import annotations

import errno
import os
import select
import struct
from dataclasses import dataclass
from enum import IntEnum

from ipc.errors import ClosedByUs, CorruptRecord, PeerGone, WouldBlock

TOKEN_BYTES = 16
READ_BYTES = TOKEN_BYTES * 256          # one read takes at most 256 tokens
_TOKEN = struct.Struct("<BBHIq")
assert _TOKEN.size == TOKEN_BYTES


class Kind(IntEnum):
    """What a token means. Values are on the wire: add new kinds, never renumber."""

    BUMP = 1          # value = credit granted to the sender on `link` (bump_credit)
    SPACE = 2         # the receiver freed space in the ring of `link`
    PEER_DOWN = 3     # the process at the other end of `link` is gone
    ALARM_SET = 4     # value = alarm source (ALARM_MEMORY, ALARM_DISK)
    ALARM_CLEAR = 5   # value = alarm source
    STOP = 6          # finish what was sent to you, then exit


ALARM_MEMORY = 1
ALARM_DISK = 2
_KINDS = {int(k): k for k in Kind}


@dataclass(frozen=True, slots=True)
class Token:
    kind: Kind
    link: int
    value: int


@dataclass(frozen=True)
class TokenWriterStatistics:
    tokens_sent: int


@dataclass(frozen=True)
class TokenReaderStatistics:
    tokens_read: int
    partial_bytes: int       # bytes of a token still waiting for the rest


def encode(kind, link: int, value: int) -> bytes:
    """The 16 bytes of one token. Raises ``ValueError`` if a field is out of range."""
    try:
        return _TOKEN.pack(kind, 0, 0, link, value)
    except struct.error as exc:
        raise ValueError(f"token ({kind!r}, link {link}, value {value}) out of range: {exc}") from None


def decode(buf, offset: int = 0) -> tuple[list[Token], int]:
    """Decode the whole tokens in ``buf[offset:]``; return them and the bytes consumed.

    A partial token at the end is left unconsumed. Raises ``CorruptRecord`` on
    an unknown kind.
    """
    whole = (len(buf) - offset) // TOKEN_BYTES * TOKEN_BYTES
    if whole <= 0:
        return [], 0
    out = []
    for kind, _, _, link, value in _TOKEN.iter_unpack(memoryview(buf)[offset:offset + whole]):
        k = _KINDS.get(kind)
        if k is None:
            raise CorruptRecord(f"unknown token kind {kind}")
        out.append(Token(k, link, value))
    return out, whole


def _wait_writable(fd: int) -> None:
    poller = select.poll()          # poll, not select: descriptors may be numbered past 1024
    poller.register(fd, select.POLLOUT)
    poller.poll()


class TokenWriter:
    """Writes tokens into a peer's inbox pipe. ``send`` blocks while the pipe is full:
    that is back-pressure, and a full inbox means the peer has stopped reading."""

    def __init__(self, fd: int):
        self.fd = fd
        self._sent = 0

    def send(self, kind, link: int, value: int) -> None:
        """Write one token with one ``write``. Raises ``PeerGone`` when no reader is left."""
        data = encode(kind, link, value)
        while True:
            if self.fd < 0:
                raise ClosedByUs("token writer used after close()")
            try:
                os.write(self.fd, data)      # <= PIPE_BUF: all or nothing; EINTR is retried by Python
                self._sent += 1
                return
            except BlockingIOError:          # the pipe was made non-blocking elsewhere
                _wait_writable(self.fd)
            except BrokenPipeError:
                raise PeerGone(f"the reader of token pipe fd {self.fd} is gone") from None
            except OSError as exc:
                if exc.errno == errno.EBADF:
                    raise ClosedByUs(f"token pipe fd {self.fd} is closed") from None
                raise

    def close(self) -> None:
        """Close the write end (idempotent)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def statistics(self) -> TokenWriterStatistics:
        return TokenWriterStatistics(tokens_sent=self._sent)


class TokenReader:
    """Reads a stage's inbox pipe (the fd is made non-blocking)."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self._tail = b""
        self._read = 0

    def fileno(self) -> int:
        return self.fd

    def read_nowait(self) -> list[Token]:
        """The tokens waiting now (``[]`` if only part of one has arrived).

        Raises ``WouldBlock`` when nothing is waiting, ``PeerGone`` when every
        writer has closed the pipe at a token boundary, ``CorruptRecord`` when
        they closed it inside a token.
        """
        if self.fd < 0:
            raise ClosedByUs("token reader used after close()")
        try:
            data = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            raise WouldBlock("no token waiting") from None
        if not data:
            if self._tail:
                raise CorruptRecord(f"token pipe closed inside a token ({len(self._tail)} of "
                                    f"{TOKEN_BYTES} bytes)")
            raise PeerGone("every writer of the token pipe has closed it")
        if self._tail:
            data = self._tail + data
        tokens, used = decode(data)
        self._tail = data[used:]
        self._read += len(tokens)
        return tokens

    def close(self) -> None:
        """Close the read end (idempotent)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def statistics(self) -> TokenReaderStatistics:
        return TokenReaderStatistics(tokens_read=self._read, partial_bytes=len(self._tail))
