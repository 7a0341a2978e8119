"""Talking to a running broker through ``DATA_DIR/ctl.sock`` (what ``creditflow ctl`` uses).

One request per line, JSON both ways: ``{"cmd": "status"}`` ->
``{"ok": true, ...}``.
"""

from __future__ import annotations

import json
import os
import socket
import time

from ipc import control


class BrokerNotRunning(RuntimeError):
    """Raised when no broker answers on the data directory's control socket."""


def broker_info(data_dir: str) -> dict:
    path = os.path.join(data_dir, "broker.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise BrokerNotRunning(f"no broker is running on {data_dir} (no broker.json)") from None


def wait_for_broker(data_dir: str, timeout_s: float = 15.0, pid: int | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return broker_info(data_dir)
        except BrokerNotRunning:
            if pid is not None:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    raise BrokerNotRunning(f"the broker exited before it was ready ({data_dir})") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class CtlClient:
    def __init__(self, data_dir: str | None = None, timeout_s: float = 10.0, *, path: str | None = None):
        """The broker on ``data_dir`` (its broker.json names the socket), or the socket at ``path``."""
        if path is None:
            if data_dir is None:
                raise TypeError("CtlClient needs a data_dir or a path")
            path = broker_info(data_dir)["ctl"]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            control.unix_socket_call(self.sock, "connect", path)
        except OSError as exc:
            self.sock.close()
            raise BrokerNotRunning(f"broker on {data_dir or path} does not answer: {exc}") from None
        self.buf = b""

    def request(self, cmd: str, **args) -> dict:
        self.sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        while b"\n" not in self.buf:
            data = self.sock.recv(1 << 20)
            if not data:
                raise BrokerNotRunning("the broker closed the control connection")
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
