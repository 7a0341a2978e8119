"""Control messages between the supervisor and a stage (not the hot path).

A unix SOCK_SEQPACKET socketpair: one message is one JSON object in UTF-8 of
at most ``MAX_CONTROL_BYTES``, optionally carrying file descriptors
(SCM_RIGHTS), which is how a running stage receives a new peer's inbox and
doorbell.
"""

from __future__ import annotations

import array
import json
import select
import socket

from ipc.errors import CorruptRecord, PeerGone, WouldBlock

MAX_CONTROL_BYTES = 65536
MAX_FDS = 8


def socketpair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.set_inheritable(True)
    b.set_inheritable(True)
    return a, b


def send_msg(sock: socket.socket, msg: dict, fds=()) -> None:
    data = json.dumps(msg, separators=(",", ":"), default=str).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise CorruptRecord(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.sendall(data)
    except BlockingIOError:
        select.select([], [sock], [])
        send_msg(sock, msg, fds)
    except (BrokenPipeError, ConnectionResetError):
        raise PeerGone("the other end of the control socket is gone") from None


def _decode(data: bytes) -> dict:
    try:
        msg = json.loads(data)
    except ValueError as exc:
        raise CorruptRecord(f"control message is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise CorruptRecord("control message is not a JSON object")
    return msg


def recv_msg_nowait(sock: socket.socket) -> tuple[dict, list[int]]:
    try:
        # socket.recv_fds ignores its flags in Python 3.11, so use recvmsg directly
        data, ancdata, _flags, _addr = sock.recvmsg(MAX_CONTROL_BYTES, socket.CMSG_SPACE(MAX_FDS * 4),
                                                    socket.MSG_DONTWAIT)
    except BlockingIOError:
        raise WouldBlock("no control message waiting") from None
    except ConnectionResetError:
        raise PeerGone("the other end of the control socket is gone") from None
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data and not fds:
        raise PeerGone("the other end of the control socket closed it")
    return _decode(data), list(fds)


def recv_msg(sock: socket.socket, timeout_s: float | None = None) -> tuple[dict, list[int]]:
    ready, _, _ = select.select([sock], [], [], timeout_s)
    if not ready:
        raise WouldBlock(f"no control message within {timeout_s} s")
    return recv_msg_nowait(sock)
