"""Control messages between the supervisor and a stage (not the hot path).

Theory of operation
-------------------
The supervisor makes one unix ``SOCK_SEQPACKET`` socketpair per stage before
forking it. SEQPACKET keeps message boundaries (one ``sendmsg`` is one
``recvmsg``) and reports the peer's exit as EOF, so a stage that dies is
noticed. A message is one JSON object, UTF-8, at most ``MAX_CONTROL_BYTES``,
and may carry up to ``MAX_FDS`` file descriptors (SCM_RIGHTS): that is how a
running stage receives a new peer's inbox pipe and doorbell. No pickle
crosses the boundary.

The receiver owns the descriptors it gets: they arrive close-on-exec, and
when a message turns out corrupt, the ones it carried are closed before
``CorruptRecord`` is raised, so nothing leaks.

``send_msg`` waits while the socket's buffer is full. A process that must
never wait on a peer (the supervisor, which every stage talks to) keeps an
``Outbox`` per peer instead: messages queue in order, ``flush_nowait`` sends
what the socket takes, and the fds a queued message carries are duplicates
the outbox owns, so a peer closing its own copies meanwhile changes nothing.
"""

from __future__ import annotations

import array
import collections
import json
import math
import os
import select
import socket
import time
from collections.abc import Sequence

from ipc.errors import ClosedByUs, CorruptRecord, IpcError, PeerGone, WouldBlock

MAX_CONTROL_BYTES = 65536
MAX_FDS = 8
_FD_SPACE_BYTES = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
# socket's MSG_* are IntFlag members: or-ing two makes a new member (0.3 µs), once per message otherwise
_SEND_FLAGS = int(socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
_RECV_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
_CUT_SHORT = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)


class MessageTooLarge(IpcError, ValueError):
    """Raised when a control message encodes to more than MAX_CONTROL_BYTES or carries more than MAX_FDS fds."""


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected SOCK_SEQPACKET pair (close-on-exec; a forked stage inherits its end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _wait(sock: socket.socket, events: int, timeout_s: float | None) -> bool:
    poller = select.poll()          # poll, not select: descriptors may be numbered past 1024
    poller.register(sock.fileno(), events)
    return bool(poller.poll(None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))))


def encode_msg(msg: dict, fds: Sequence[int] = ()) -> bytes:
    """The bytes of one message. Values JSON cannot encode are sent as their ``str()``.
    Raises ``MessageTooLarge``."""
    if not isinstance(msg, dict):
        raise TypeError(f"a control message is a dict, not {type(msg).__name__}")
    data = json.dumps(msg, separators=(",", ":"), default=str).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise MessageTooLarge(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    if len(fds) > MAX_FDS:
        raise MessageTooLarge(f"control message carries {len(fds)} fds, more than {MAX_FDS}")
    return data


def _send_nowait(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    if sock.fileno() < 0:
        raise ClosedByUs("control socket used after close()")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        sock.sendmsg([data], ancillary, _SEND_FLAGS)
    except BlockingIOError:
        raise WouldBlock("the control socket's buffer is full") from None
    except (BrokenPipeError, ConnectionResetError):
        raise PeerGone("the other end of the control socket is gone") from None


def send_msg(sock: socket.socket, msg: dict, fds: Sequence[int] = ()) -> None:
    """Send one message (and ``fds``), waiting while the socket's buffer is full.

    Raises ``MessageTooLarge``, ``PeerGone`` if the other end has closed,
    ``ClosedByUs`` if this end has.
    """
    data = encode_msg(msg, fds)
    while True:
        try:
            _send_nowait(sock, data, fds)
            return
        except WouldBlock:
            _wait(sock, select.POLLOUT, None)


class Outbox:
    """Messages to one peer, sent in order without ever waiting on it.

    ``put`` encodes at once (so a bad message raises in the caller) and
    duplicates the fds; ``flush_nowait`` sends what the socket takes and
    returns True once nothing is left. After the peer is gone every queued
    message is dropped (and its fds closed): there is nobody to tell.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.queue: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.gone = False
        self.sent = 0

    def put(self, msg: dict, fds: Sequence[int] = ()) -> None:
        data = encode_msg(msg, fds)
        if self.gone:
            return
        dups: list[int] = []
        try:
            for fd in fds:
                dups.append(os.dup(fd))
        except OSError:                 # out of descriptors: none of this message's are kept
            _close_all(dups)
            raise
        self.queue.append((data, dups))
        self.flush_nowait()

    def flush_nowait(self) -> bool:
        queue = self.queue
        while queue:
            data, fds = queue[0]
            try:
                _send_nowait(self.sock, data, fds)
            except WouldBlock:
                return False
            except (PeerGone, ClosedByUs, OSError):
                self.drop()
                return True
            queue.popleft()
            _close_all(fds)
            self.sent += 1
        return True

    def drop(self) -> None:
        """The peer is gone: close the fds of every queued message and forget them."""
        self.gone = True
        while self.queue:
            _close_all(self.queue.popleft()[1])

    def __len__(self) -> int:
        return len(self.queue)


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def recv_msg_nowait(sock: socket.socket) -> tuple[dict, list[int]]:
    """The next message and the fds it carried (now owned by the caller).

    Raises ``WouldBlock`` if none is waiting, ``PeerGone`` on EOF, and
    ``CorruptRecord`` if it is not a JSON object or was cut short.
    """
    if sock.fileno() < 0:
        raise ClosedByUs("control socket used after close()")
    try:
        # recvmsg, not socket.recv_fds: the latter drops its flags argument in Python 3.11
        data, ancdata, flags, _ = sock.recvmsg(MAX_CONTROL_BYTES, _FD_SPACE_BYTES, _RECV_FLAGS)
    except BlockingIOError:
        raise WouldBlock("no control message waiting") from None
    except ConnectionResetError:
        raise PeerGone("the other end of the control socket is gone") from None
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    fds = fds.tolist()
    if not data and not fds:
        raise PeerGone("the other end of the control socket closed it")
    try:
        if flags & _CUT_SHORT:
            raise CorruptRecord(f"control message longer than {MAX_CONTROL_BYTES} bytes or "
                                f"{MAX_FDS} fds was cut short")
        try:
            msg = json.loads(data)
        except ValueError as exc:         # bad UTF-8 or bad JSON
            raise CorruptRecord(f"control message is not JSON: {exc}") from None
        if not isinstance(msg, dict):
            raise CorruptRecord(f"control message is a JSON {type(msg).__name__}, not an object")
    except CorruptRecord:
        _close_all(fds)
        raise
    return msg, fds


def recv_msg(sock: socket.socket, timeout_s: float | None = None) -> tuple[dict, list[int]]:
    """Wait up to ``timeout_s`` (forever if None) for the next message; ``WouldBlock`` on timeout."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            return recv_msg_nowait(sock)
        except WouldBlock:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WouldBlock(f"no control message within {timeout_s} s") from None
            _wait(sock, select.POLLIN, left)


UNIX_PATH_MAX_BYTES = 107          # sun_path holds 108 bytes with its NUL


def unix_socket_call(sock: socket.socket, call: str, path: str) -> None:
    """``sock.bind(path)`` or ``sock.connect(path)`` (``call``) even when ``path`` is longer than a
    Unix socket address may be (a deep data directory): the directory is then reached through
    ``/proc/self/fd/N``, a path of a few bytes naming the same place."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX_BYTES:
        getattr(sock, call)(path)
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        getattr(sock, call)(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)
