"""The ctl socket (``DATA_DIR/ctl.sock``): what ``creditflow ctl`` talks to, served without ever waiting.

One request per line, a JSON object with a string ``cmd``; one JSON object
per line back. The supervisor's loop owns the socket, so nothing a ctl
client does may stall it: every client socket is non-blocking, replies
queue in the client's own buffer and go out as it reads them, a client that
lets more than ``MAX_UNSENT_BYTES`` pile up or sends a line over
``MAX_LINE_BYTES`` is disconnected, and a request that is not a JSON object
with a ``cmd`` string is answered ``{"ok": false, "error": ...}``.

A request may be answered later (``set-watermark`` waits for the
watchdog): ``on_request`` returns None, and the supervisor calls ``reply``
with the same client when it knows the answer; a client that left by then
is simply gone.
"""

from __future__ import annotations

import json
import os
import selectors
import socket

from ipc import control

MAX_LINE_BYTES = 64 * 1024
MAX_UNSENT_BYTES = 16 * 1024 * 1024
MAX_CLIENTS = 64
RECV_BYTES = 65536


class CtlClient:
    __slots__ = ("sock", "inbuf", "outbuf", "open")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.open = True


class CtlServer:
    def __init__(self, path: str, selector: selectors.BaseSelector, on_request):
        """``on_request(client, request) -> reply dict or None`` (None: answered later with ``reply``)."""
        if os.path.exists(path):
            os.unlink(path)
        self.path = path
        self.selector = selector
        self.on_request = on_request
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        control.unix_socket_call(self.server, "bind", path)
        os.chmod(path, 0o600)
        self.server.listen(16)
        self.server.setblocking(False)
        self.clients: dict[int, CtlClient] = {}
        selector.register(self.server, selectors.EVENT_READ, ("ctl_server", None))

    def on_accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:            # out of descriptors: the client's connect simply fails
                return
            if len(self.clients) >= MAX_CLIENTS:
                sock.close()
                continue
            sock.setblocking(False)
            client = CtlClient(sock)
            self.clients[sock.fileno()] = client
            self.selector.register(sock, selectors.EVENT_READ, ("ctl_client", sock.fileno()))

    def on_ready(self, fd: int, events: int) -> None:
        client = self.clients.get(fd)
        if client is None:
            return
        if events & selectors.EVENT_WRITE:
            self._send(client)
        if client.open and events & selectors.EVENT_READ:
            self._receive(client)

    def _receive(self, client: CtlClient) -> None:
        try:
            data = client.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.drop(client)
            return
        client.inbuf += data
        while client.open:
            end = client.inbuf.find(b"\n")
            if end < 0:
                if len(client.inbuf) > MAX_LINE_BYTES:
                    self.reply(client, {"ok": False, "error": f"request longer than {MAX_LINE_BYTES} bytes"})
                    self.drop(client, after_send=True)
                return
            line = bytes(client.inbuf[:end])
            del client.inbuf[:end + 1]
            request, error = parse_request(line)
            answer = {"ok": False, "error": error} if error else self.on_request(client, request)
            if answer is not None:
                self.reply(client, answer)

    def reply(self, client: CtlClient, msg: dict) -> None:
        if not client.open:
            return
        client.outbuf += json.dumps(msg, default=str).encode() + b"\n"
        if len(client.outbuf) > MAX_UNSENT_BYTES:
            self.drop(client)          # it does not read its replies: it may not stall the broker
            return
        self._send(client)

    def _send(self, client: CtlClient) -> None:
        if client.outbuf:
            try:
                sent = client.sock.send(client.outbuf)
                del client.outbuf[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self.drop(client)
                return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbuf else 0)
        try:
            self.selector.modify(client.sock, want, ("ctl_client", client.sock.fileno()))
        except (KeyError, ValueError):
            pass

    def drop(self, client: CtlClient, after_send: bool = False) -> None:
        if after_send and client.outbuf:
            try:
                client.sock.send(client.outbuf)
            except OSError:
                pass
        client.open = False
        self.clients.pop(client.sock.fileno(), None)
        try:
            self.selector.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        client.sock.close()

    def close(self) -> None:
        for client in list(self.clients.values()):
            self.drop(client, after_send=True)
        try:
            self.selector.unregister(self.server)
        except (KeyError, ValueError):
            pass
        self.server.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def parse_request(line: bytes) -> tuple[dict | None, str | None]:
    """(request, None), or (None, why it is not one)."""
    try:
        request = json.loads(line)
    except ValueError:
        return None, "request is not JSON"
    if not isinstance(request, dict):
        return None, f"request is a JSON {type(request).__name__}, not an object"
    if not isinstance(request.get("cmd"), str):
        return None, "request has no \"cmd\" string"
    return request, None
