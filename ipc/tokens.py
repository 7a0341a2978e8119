"""Fixed-size tokens on pipes: credit grants and control between stages.

Each stage has one inbox pipe; every peer writes tokens into it. A token is
16 bytes, written with a single ``write`` (well under PIPE_BUF), so tokens
from several writers never interleave.

Layout (little-endian)::

    offset 0  u8   kind
    offset 1  u8   reserved (0)
    offset 2  u16  reserved (0)
    offset 4  u32  link id       the ring the token is about (0 = none)
    offset 8  i64  value         credit amount, alarm source, ...
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from enum import IntEnum

from ipc.errors import CorruptRecord, PeerGone, WouldBlock

TOKEN_BYTES = 16
_TOKEN = struct.Struct("<BBHIq")
READ_BYTES = TOKEN_BYTES * 256


class Kind(IntEnum):
    BUMP = 1          # bump_credit: value = credit granted on `link`
    SPACE = 2         # the receiver freed space in the ring of `link`
    PEER_DOWN = 3     # the other end of `link` is gone
    ALARM_SET = 4     # value: 1 memory, 2 disk
    ALARM_CLEAR = 5
    STOP = 6


@dataclass(frozen=True, slots=True)
class Token:
    kind: Kind
    link: int
    value: int


def encode(kind, link: int, value: int) -> bytes:
    return _TOKEN.pack(int(kind), 0, 0, link, value)


def decode(buf, offset: int = 0) -> tuple[list[Token], int]:
    """Decode whole tokens from ``buf[offset:]``; return them and the bytes consumed."""
    end = offset + (len(buf) - offset) // TOKEN_BYTES * TOKEN_BYTES
    out = []
    for kind, _, _, link, value in _TOKEN.iter_unpack(memoryview(buf)[offset:end]):
        try:
            out.append(Token(Kind(kind), link, value))
        except ValueError:
            raise CorruptRecord(f"unknown token kind {kind}") from None
    return out, end - offset


class TokenWriter:
    def __init__(self, fd: int):
        self.fd = fd

    def send(self, kind, link: int, value: int) -> None:
        data = _TOKEN.pack(int(kind), 0, 0, link, value)
        while True:
            try:
                os.write(self.fd, data)
                return
            except InterruptedError:
                continue
            except BlockingIOError:
                import select
                select.select([], [self.fd], [])
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.EBADF):
                    raise PeerGone(f"token pipe fd {self.fd} is closed") from None
                raise


class TokenReader:
    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self._tail = b""

    def fileno(self) -> int:
        return self.fd

    def read_nowait(self) -> list[Token]:
        try:
            data = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            raise WouldBlock("no token waiting") from None
        if not data:
            if self._tail:
                raise CorruptRecord(f"token pipe closed inside a token ({len(self._tail)} bytes)")
            raise PeerGone("every writer of the token pipe has closed it")
        if self._tail:
            data = self._tail + data
        tokens, used = decode(data)
        self._tail = data[used:]
        return tokens
