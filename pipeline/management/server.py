"""The management HTTP listener: a process of its own, as RabbitMQ's management plugin is a separate app.

The supervisor binds the listening socket (127.0.0.1:``--management-port``)
and forks this process with it; a process that dies is restarted on the same
socket. Requests are served by ``http.server.ThreadingHTTPServer``, a thread
each; every answer is built by ``pipeline.management.views`` (or ``metrics``)
from the broker's ``status``, which this process asks the supervisor for over
the ctl socket, as ``creditflow ctl status`` does. The supervisor answers that
socket without ever waiting on it, so a slow or stalled HTTP client holds up
only its own thread here. One status serves every request for
``STATUS_MAX_AGE_S``; rates come from successive statuses (``RateBook``).

Paths: ``/api/overview``, ``/api/nodes``, ``/api/connections``, ``/api/channels``,
``/api/queues[/VHOST[/NAME]]``, ``/api/consumers``, ``/api/health/checks/alarms``,
``/api/health/checks/local-alarms``, ``/api/whoami``, ``/api/vhosts``,
``/api/exchanges[/VHOST[/NAME]]``, ``/api/bindings[/VHOST[/e/SOURCE/q|e/DESTINATION[/PROPERTIES_KEY]]]``,
``/api/vhost-limits[/VHOST]``,
``/api/creditflow/processes``, ``/api/creditflow/links`` (HTTP basic auth with
the broker's users; ``?columns=a,b.c`` as RabbitMQ's), and ``/metrics``
(``/metrics/per-object`` alike; no auth, as RabbitMQ's prometheus plugin).
The write calls (PUT, POST and DELETE, same auth; ``pipeline.management.writes``)
are ctl requests too, each on a ctl connection of its own, so a queue that
takes a moment to answer its deletion holds up no reader of the status.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import selectors
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from ipc import control
from ipc.errors import CorruptRecord, PeerGone
from pipeline.ctlclient import BrokerNotRunning, CtlClient
from pipeline.management import writes
from pipeline.management.views import (VHOST, RateBook, Views, bindings_view, definitions_view, exchanges_view,
                                       parameters_view, permissions_view, select_columns, users_view, whoami)

STATUS_MAX_AGE_S = 0.25          # requests within this long of a status share it
CTL_TIMEOUT_S = 10.0
CLIENT_TIMEOUT_S = 30.0          # an HTTP client silent this long loses its connection
MAX_BODY_BYTES = 64 * 1024       # a PUT's body (``{"value": N}``); a longer one is refused 413
MAX_DEFINITIONS_BYTES = 20 * 1024 * 1024  # an imported definitions document: the limit later RabbitMQ releases
                                          # put on them (for CVE-2023-46118; 3.10.8 has none)
REALM = 'Basic realm="RabbitMQ Management"'
NOT_FOUND = {"error": "Object Not Found", "reason": "Not Found"}
LIVE_PAGE = (Path(__file__).with_name("live.html")).read_bytes()   # the live page at ``/`` (it logs in itself)
JSON = "application/json"


class BrokerUnavailable(Exception):
    """Raised when the supervisor does not answer the status request (it is stopping, or gone)."""


class StatusSource:
    """The broker's status, asked over the ctl socket at most every ``max_age_s``; one at a time.
    ``command`` sends any other ctl request (the writes, the vhost's limits)."""

    def __init__(self, ctl_path: str, max_age_s: float = STATUS_MAX_AGE_S) -> None:
        self.ctl_path = ctl_path
        self.max_age_s = max_age_s
        self.lock = threading.Lock()
        self.client: CtlClient | None = None
        self.status: dict | None = None
        self.taken = 0.0
        self.rates = RateBook()

    def get(self) -> dict:
        with self.lock:
            now = time.monotonic()
            if self.status is None or now - self.taken >= self.max_age_s:
                self.status = self._ask()
                self.taken = time.monotonic()
                self.rates.observe(self.status.get("now_ns", 0) / 1e9, self.status)
            return self.status

    def topology(self) -> dict:
        """Exchanges and bindings, asked afresh (only ``/api/exchanges`` and ``/api/bindings`` need them)."""
        with self.lock:
            return self._ask("topology")

    def command(self, cmd: str, **args) -> dict:
        """One ctl request on a connection of its own (a write: never sent twice); its reply, ok or not."""
        try:
            with CtlClient(path=self.ctl_path, timeout_s=CTL_TIMEOUT_S) as client:
                return client.request(cmd, **args)
        except (OSError, ValueError, BrokerNotRunning) as exc:
            raise BrokerUnavailable(str(exc)) from None

    def _ask(self, cmd: str = "status") -> dict:
        for attempt in (1, 2):        # a second try on a fresh connection (the supervisor dropped ours)
            try:
                if self.client is None:
                    self.client = CtlClient(path=self.ctl_path, timeout_s=CTL_TIMEOUT_S)
                reply = self.client.request(cmd)
                if reply.get("ok"):
                    return reply
                raise BrokerUnavailable(str(reply.get("error")))
            except (OSError, ValueError, BrokerNotRunning) as exc:
                if self.client is not None:
                    self.client.close()
                    self.client = None
                if attempt == 2:
                    raise BrokerUnavailable(str(exc)) from None
        raise AssertionError("unreachable")


class App:
    """Routing and auth: (method, path, query, headers, body) in, (code, headers, body) out."""

    def __init__(self, source: StatusSource, users: dict[str, str]) -> None:
        self.source = source
        self.users = users

    def login(self, header: str | None) -> str | None:
        if not header or not header.startswith("Basic "):
            return None
        try:
            user, sep, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        known = self.users.get(user)
        if not sep or known is None or not hmac.compare_digest(known.encode(), password.encode()):
            return None
        return user

    def handle(self, method: str, path: str, query: str, headers, body: bytes = b"") -> tuple[int, dict, bytes]:
        """``headers``: the request's (``.get`` by name, any case); ``body``: what came with a PUT."""
        parts = [unquote(p) for p in path.split("/")[1:]]
        if parts and parts[-1] == "" and len(parts) > 1:
            parts = parts[:-1]
        allow = writes.allowed(parts)
        if method == "OPTIONS" or method not in allow:        # before any login, as RabbitMQ answers
            return 200 if method == "OPTIONS" else 405, {"Allow": ", ".join(allow)}, b""
        try:
            if parts in ([""], ["index.html"]):
                return 200, {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-cache"}, LIVE_PAGE
            if parts[:1] == ["metrics"] and parts[1:] in ([], ["per-object"]):
                return self.metrics()
            if parts[:1] != ["api"]:
                return 404, {"Content-Type": JSON}, _json(NOT_FOUND)
            authorization = headers.get("Authorization")
            user = self.login(authorization)
            if user is None:
                answer = {"WWW-Authenticate": REALM}
                if authorization is None:
                    return 401, answer, b""
                return 401, {**answer, "Content-Type": JSON}, _json({"error": "not_authorized",
                                                                   "reason": "Login failed"})
            extra: dict = {}
            if method in ("PUT", "DELETE", "POST"):
                code, body, extra = self.write(method, parts[1:], parse_qs(query), headers, body)
            else:
                code, body = self.api(parts[1:], user)
        except BrokerUnavailable as exc:
            return 503, {"Content-Type": JSON}, _json({"error": "broker_unavailable", "reason": str(exc)})
        except writes.UnsupportedMediaType:
            return 415, {}, b""
        except Exception:                       # a fault of ours: the client hears 500, the log says where
            traceback.print_exc()
            return 500, {"Content-Type": JSON}, _json({"error": "internal_server_error",
                                                       "reason": "the management API failed on this request"})
        if code in (201, 204) and body is None:
            return code, extra, b""
        if code == 200:
            columns = parse_qs(query).get("columns")
            if columns:
                body = select_columns(body, [c for c in ",".join(columns).split(",") if c])
        return code, {"Content-Type": JSON, "Cache-Control": "no-cache"}, _json(body)

    def write(self, method: str, parts: list[str], query: dict, headers, body: bytes) -> tuple[int, object, dict]:
        """PUT, POST and DELETE (``writes.allowed`` let only those through that a path takes): (status, body,
        headers to add)."""
        try:
            if parts[0] == "definitions":
                return self.import_definitions(parts, headers, body)
            if parts[0] == "exchanges" or parts[0] == "bindings" or (parts[0] == "queues" and method == "PUT"):
                return self.declare(method, parts, query, body)
        except writes.BadRequest as exc:
            return 400, {"error": "bad_request", "reason": exc.reason}, {}
        return (*self.change(method, parts, query, headers, body), {})

    def import_definitions(self, parts: list[str], headers, body: bytes) -> tuple[int, object, dict]:
        """``POST /api/definitions[/VHOST]``: merged in, as RabbitMQ merges them (what is there stays, even
        where the file differs); checked whole first, then made in order, stopping at the first refusal."""
        writes.check_json(headers.get("Content-Type"))
        if len(parts) == 2 and parts[1] != VHOST:
            return 404, writes.VHOST_NOT_FOUND, {}
        plan = writes.definitions_plan(writes.definitions_body(body), self.users, parts[1] if len(parts) == 2 else None)
        writes.check_definitions(plan)
        for cmd, args in plan:
            reply = self.source.command(cmd, **args)
            if not reply.get("ok") and not writes.skipped_on_import(cmd, reply):
                code, answer = writes.refusal(reply, missing=None)
                return (400 if code == 401 else code), answer, {}
        return 204, None, {}

    def declare(self, method: str, parts: list[str], query: dict, body: bytes) -> tuple[int, object, dict]:
        """Queues, exchanges and bindings made and removed over HTTP (``writes``)."""
        if parts[1] != VHOST:
            return (404, writes.VHOST_NOT_FOUND if method != "DELETE" else NOT_FOUND, {})
        if parts[0] == "queues":
            reply = self.source.command("declare_queue", queue=parts[2], **writes.queue_declare(body))
        elif parts[0] == "exchanges":
            name = writes.exchange_name(parts[2])
            if method == "PUT":
                reply = self.source.command("exchange", op="declare", exchange=name, **writes.exchange_declare(body))
            else:
                reply = self.source.command("exchange", op="delete", exchange=name,
                                            if_unused=writes.flag(query, "if-unused"))
        else:
            source, to_exchange = writes.exchange_name(parts[3]), parts[4] == "e"
            destination = writes.exchange_name(parts[5]) if to_exchange else parts[5]
            if method == "DELETE":
                reply = self.source.command("exchange", op="unbind_key", source=source, destination=destination,
                                            to_exchange=to_exchange, properties_key=parts[6])
            else:
                fields, key = writes.binding(body)
                names = ({"source": source, "destination": destination} if to_exchange
                         else {"exchange": source, "queue": destination})
                reply = self.source.command("exchange", op="bind_exchange" if to_exchange else "bind",
                                            **names, **fields)
                if reply.get("ok"):
                    return 201, None, {"Location": writes.binding_location(parts[5], key)}
        if not reply.get("ok"):
            code, answer = writes.refusal(reply, missing=NOT_FOUND if method == "DELETE" else None)
            return code, answer, {}
        return (201 if reply.get("created") else 204), None, {}

    def change(self, method: str, parts: list[str], query: dict, headers, body: bytes) -> tuple[int, object]:
        """Connections closed, vhost limits set, queues deleted and purged."""
        if parts[0] == "connections":
            reason = headers.get("X-Reason")
            if reason is not None:          # http.server read the header as latin-1: undo that
                reason = reason.encode("latin-1", "replace").decode("utf-8", "replace")
            reply = self.source.command("close_connection", name=parts[1], reason=reason or writes.FORCED_REASON)
        elif parts[0] == "vhost-limits":
            if method == "PUT":
                writes.check_json(headers.get("Content-Type"))
            if parts[1] != VHOST:
                return 404, writes.VHOST_NOT_FOUND
            try:
                if method == "PUT":
                    value = writes.limit_value(parts[2], body)
                    reply = self.source.command("set_vhost_limits", value={parts[2]: value}, merge=True)
                else:
                    reply = self.source.command("clear_vhost_limits", name=parts[2])
            except writes.BadRequest as exc:
                return 400, {"error": "bad_request", "reason": str(exc)}
        elif parts[1] != VHOST:
            return 404, NOT_FOUND
        elif len(parts) == 4:
            reply = self.source.command("purge_queue", queue=parts[2], exclusive_check=True)
        else:
            reply = self.source.command("delete_queue", queue=parts[2], if_empty=writes.flag(query, "if-empty"),
                                        if_unused=writes.flag(query, "if-unused"), exclusive_check=True)
        return (204, None) if reply.get("ok") else writes.refusal(reply)

    def api(self, parts: list[str], user: str) -> tuple[int, object]:
        if parts == ["whoami"]:
            return 200, whoami(user)
        if parts[:1] == ["vhost-limits"] and len(parts) <= 2:
            if len(parts) == 2 and parts[1] != VHOST:
                return 404, NOT_FOUND
            return 200, writes.vhost_limits_view(self.source.command("list_vhost_limits").get("limits") or {})
        if parts[:1] in (["users"], ["permissions"], ["topic-permissions"], ["policies"], ["operator-policies"],
                         ["parameters"], ["global-parameters"]) \
                or parts[:1] == ["vhosts"] and len(parts) == 3 and parts[2] in ("permissions", "topic-permissions"):
            return self.access(parts)
        views = Views(self.source.get(), self.source.rates)
        if parts == ["overview"]:
            return 200, views.overview()
        if parts[:1] == ["vhosts"] and len(parts) == 3 and parts[2] in ("connections", "channels"):
            if parts[1] != VHOST:
                return 404, NOT_FOUND
            return 200, views.connections() if parts[2] == "connections" else views.channels()
        if parts[:1] == ["connections"] and len(parts) == 3 and parts[2] == "channels":
            if parts[1] not in [c["name"] for c in views.connections()]:
                return 404, NOT_FOUND
            return 200, [c for c in views.channels() if c["connection_details"]["name"] == parts[1]]
        if parts[:1] == ["vhosts"] and len(parts) <= 2:
            if len(parts) == 2 and parts[1] != VHOST:
                return 404, NOT_FOUND
            return 200, views.vhost() if len(parts) == 2 else [views.vhost()]
        if parts == ["cluster-name"]:
            return 200, {"name": views.node}
        if parts == ["health", "checks", "virtual-hosts"]:
            return 200, {"status": "ok"}
        if parts[:3] == ["health", "checks", "port-listener"] and len(parts) == 4:
            return views.port_listener(parts[3])
        if parts[:3] == ["health", "checks", "protocol-listener"] and len(parts) == 4:
            return views.protocol_listener(parts[3])
        if (parts[:1] == ["queues"] and len(parts) == 4 and parts[3] == "bindings"
                or parts[:1] == ["exchanges"] and len(parts) == 5 and parts[3] == "bindings"
                and parts[4] in ("source", "destination")):
            if parts[1] != VHOST:
                return 404, NOT_FOUND
            if parts[0] == "queues":           # a missing queue lists its implicit binding, as RabbitMQ's does
                return 200, [r for r in bindings_view(self.source.topology(), [parts[2]])
                             if r["destination_type"] == "queue" and r["destination"] == parts[2]]
            rows = bindings_view(self.source.topology(), [q["name"] for q in views.queues()])
            name = writes.exchange_name(parts[2])
            if parts[4] == "source":
                return 200, [r for r in rows if r["source"] == name]
            return 200, [r for r in rows if r["destination_type"] == "exchange" and r["destination"] == name]
        if parts[:1] == ["nodes"] and len(parts) <= 2:
            nodes = views.nodes()
            if len(parts) == 2:
                return _one([n for n in nodes if n["name"] == parts[1]])
            return 200, nodes
        if parts[:1] in (["connections"], ["channels"]) and len(parts) <= 2:
            rows = views.connections() if parts[0] == "connections" else views.channels()
            if len(parts) == 2:
                return _one([r for r in rows if r["name"] == parts[1]])
            return 200, rows
        if parts[:1] == ["queues"] and len(parts) <= 3:
            if len(parts) == 3:
                found = views.find_queue(parts[1], parts[2])
                return (200, found) if found is not None else (404, NOT_FOUND)
            return 200, [q for q in views.queues() if len(parts) == 1 or q["vhost"] == parts[1]]
        if parts[:1] == ["consumers"] and len(parts) <= 2:
            return 200, [c for c in views.consumers() if len(parts) == 1 or c["queue"]["vhost"] == parts[1]]
        if parts in (["health", "checks", "alarms"], ["health", "checks", "local-alarms"]):
            return views.health_alarms("cluster" if parts[2] == "alarms" else "node")
        if parts[:1] == ["definitions"] and len(parts) <= 2:
            if len(parts) == 2 and parts[1] != VHOST:
                return 400, {"error": "bad_request", "reason": "vhost_not_found"}
            return 200, definitions_view(views.queues(), self.source.topology(),
                                         self.source.command("list_vhost_limits").get("limits") or {}, self.users,
                                         vhost_only=len(parts) == 2)
        if parts[:1] == ["exchanges"] and len(parts) <= 3:
            rows = [r for r in exchanges_view(self.source.topology()) if len(parts) == 1 or r["vhost"] == parts[1]]
            if len(parts) == 3:
                found = [r for r in rows if r["name"] == writes.exchange_name(parts[2])]
                # one exchange comes with its message rates by where they came from and went (RabbitMQ's
                # "incoming" and "outgoing"): none are kept per exchange here, as in RabbitMQ's basic mode
                return (200, {**found[0], "incoming": [], "outgoing": []}) if found else (404, NOT_FOUND)
            return 200, rows
        if parts[:1] == ["bindings"] and (len(parts) <= 2 or len(parts) in (6, 7) and parts[2] == "e"):
            rows = [r for r in bindings_view(self.source.topology(), [q["name"] for q in views.queues()])
                    if len(parts) == 1 or r["vhost"] == parts[1]]
            if len(parts) <= 2:
                return 200, rows
            if parts[1] != VHOST:
                return 404, NOT_FOUND
            kind = "exchange" if parts[4] == "e" else "queue" if parts[4] == "q" else None
            rows = [r for r in rows if r["source"] == writes.exchange_name(parts[3]) and r["destination_type"] == kind
                    and r["destination"] == (writes.exchange_name(parts[5]) if kind == "exchange" else parts[5])]
            if len(parts) == 7:
                return _one([r for r in rows if r["properties_key"] == parts[6]])
            return 200, rows
        if parts == ["creditflow", "processes"]:
            return 200, views.processes_view()
        if parts == ["creditflow", "links"]:
            return 200, views.links_view()
        return 404, NOT_FOUND

    def access(self, parts: list[str]) -> tuple[int, object]:
        """Users, permissions, policies and parameters, read only: the broker's users (each may do
        everything), no policies, the vhost's limits as its one parameter."""
        users, permissions = users_view(self.users), permissions_view(self.users)
        kind, rest = parts[0], parts[1:]
        if kind == "users":
            if rest == ["without-permissions"]:
                return 200, []
            if len(rest) == 2 and rest[1] in ("permissions", "topic-permissions"):
                if rest[0] not in self.users:
                    return 404, NOT_FOUND
                return 200, [p for p in permissions if p["user"] == rest[0]] if rest[1] == "permissions" else []
            if len(rest) <= 1:
                return (200, users) if not rest else _one([u for u in users if u["name"] == rest[0]])
        elif kind == "vhosts":                                      # /api/vhosts/VHOST/permissions
            if rest[0] != VHOST:
                return 404, NOT_FOUND
            if rest[1] == "permissions":
                return 200, [{"vhost": VHOST, **{k: v for k, v in p.items() if k != "vhost"}} for p in permissions]
            if rest[1] == "topic-permissions":
                return 200, []
        elif kind == "permissions" and len(rest) in (0, 2):
            if rest:
                return _one([p for p in permissions if p["vhost"] == rest[0] and p["user"] == rest[1]])
            return 200, permissions
        elif kind in ("topic-permissions", "global-parameters") and not rest:
            return 200, []
        elif kind in ("policies", "operator-policies") and len(rest) <= 1:
            return (200, []) if not rest or rest[0] == VHOST else (404, NOT_FOUND)
        elif kind == "parameters" and len(rest) <= 3:
            if len(rest) >= 2 and rest[1] != VHOST:
                return 404, NOT_FOUND
            rows = [r for r in parameters_view(self.source.command("list_vhost_limits").get("limits") or {})
                    if not rest or r["component"] == rest[0]]
            return _one([r for r in rows if r["name"] == rest[2]]) if len(rest) == 3 else (200, rows)
        return 404, NOT_FOUND

    def metrics(self) -> tuple[int, dict, bytes]:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from pipeline.management.metrics import StatusCollector
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(self.source.get))
        return 200, {"Content-Type": CONTENT_TYPE_LATEST}, generate_latest(registry)


def _one(rows: list) -> tuple[int, object]:
    """The one row a path names, or 404 as RabbitMQ answers for none."""
    return (200, rows[0]) if rows else (404, NOT_FOUND)


def _json(body) -> bytes:
    return json.dumps(body, separators=(",", ":"), default=str).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "creditflow-management"
    timeout = CLIENT_TIMEOUT_S

    def do_GET(self) -> None:
        self.answer()

    do_HEAD = do_PUT = do_DELETE = do_POST = do_PATCH = do_OPTIONS = do_GET

    def answer(self) -> None:
        url = urlsplit(self.path)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        most = MAX_DEFINITIONS_BYTES if url.path.startswith("/api/definitions") else MAX_BODY_BYTES
        if not 0 <= length <= most:
            self.send_error(400 if length < 0 else 413)
            return
        body = self.rfile.read(length) if length else b""
        code, headers, body = self.server.app.handle(self.command, url.path, url.query, self.headers, body)
        self.send_response(code)
        for name, value in headers.items():
            self.send_header(name, value)
        if code != 204:                     # a 204 has no body, nor a length for one
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and code != 204:
            self.wfile.write(body)

    def log_message(self, format, *args) -> None:      # noqa: A002  (the broker's log is for the broker)
        pass


class Server(ThreadingHTTPServer):
    """The HTTP server. A client that hangs up mid-request (a reset, a broken pipe, a timeout) is the
    client's business: RabbitMQ's listener logs nothing for it, where socketserver prints a traceback
    to the broker's log. Any other error in a request is still printed."""

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class ManagementProcess:
    """What the supervisor forks: serves on ``listen_fd`` until told to stop (or the supervisor is gone)."""

    def __init__(self, ctl: socket.socket, listen_fd: int, ctl_path: str, users: dict[str, str]) -> None:
        self.ctl = ctl
        self.listen_fd = listen_fd
        self.ctl_path = ctl_path
        self.users = dict(users)

    def run(self) -> int:
        server = Server(("127.0.0.1", 0), Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = socket.socket(fileno=self.listen_fd)
        server.server_address = server.socket.getsockname()[:2]
        server.daemon_threads = True
        server.app = App(StatusSource(self.ctl_path), self.users)
        server.socket.setblocking(False)        # a connection gone before its accept is no wait
        with selectors.DefaultSelector() as selector:
            selector.register(server, selectors.EVENT_READ, "http")
            selector.register(self.ctl, selectors.EVENT_READ, "ctl")
            serving = True
            while serving:
                for key, _ in selector.select():
                    if key.data == "http":
                        server.handle_request()     # accepted and handed to a thread of its own
                    elif self.told_to_stop():
                        serving = False
        server.socket.close()
        return 0

    def told_to_stop(self) -> bool:
        """A ``stop`` from the supervisor, or its end of the control socket closing, ends serving at once
        (a polling ``serve_forever`` took up to half a second of every broker's stop)."""
        try:
            msg, fds = control.recv_msg(self.ctl)
        except CorruptRecord:
            return False
        except (PeerGone, OSError):
            return True
        for fd in fds:
            os.close(fd)
        return msg.get("type") == "stop"
