"""RabbitMQ's own view of a run, from its management API (``creditflow run --management-uri``).

Every second the sampler reads ``/api/connections``, ``/api/channels``,
``/api/queues`` and ``/api/nodes`` (only the columns it needs) and writes what
they say into the run directory's ``telemetry/``, in the shape a broker of
creditflow's own leaves there, so ``creditflow report`` draws the flow
timeline, the memory plot and the bottleneck diagnosis for a real RabbitMQ:

* ``states``  each connection (kind ``reader``), channel and queue's ``state``
  (running, flow, blocking, blocked, idle), a row per change (``StateClock``);
* ``stats``   a row per publishing connection with its ``publishes`` (what its
  channels' ``message_stats.publish`` add up to), and a ``watchdog`` row with
  the node's memory and disk against their limits and alarms;
* ``events``  ``alarm_set`` / ``alarm_clear`` when the node's memory or disk
  alarm changes, as the watchdog reports them.

``Observer`` is the pure part (API answers and the time in, telemetry rows
out); ``ManagementSampler`` fetches with the standard library.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from pipeline.broker.process_states import StateClock
from pipeline.loadgen.config import InvalidLoadConfig

REQUEST_TIMEOUT_S = 2.0
COLUMNS = {
    "connections": "name,state",
    "channels": "name,state,connection_details,message_stats.publish",
    "queues": "name,vhost,state,messages_ready,messages_unacknowledged",
    "nodes": "name,mem_used,mem_limit,mem_alarm,disk_free,disk_free_limit,disk_free_alarm",
}


class ManagementUnreachable(Exception):
    """Raised when the management API does not answer, or refuses the credentials."""


@dataclass
class Rows:
    """Telemetry rows of one sample, by table."""
    states: list[dict] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)


class Observer:
    """The API's answers of one instant, turned into state changes, snapshots and alarm edges."""

    def __init__(self) -> None:
        self.clock = StateClock()
        self.alarms: dict[str, bool] = {"memory": False, "disk": False}
        self.publishes: dict[str, int] = {}
        self.first_publish_ns: dict[str, int] = {}
        self.last_publish_ns: dict[str, int] = {}
        self.seen: set[str] = set()

    def observe(self, now_ns: int, connections: list, channels: list, queues: list, nodes: list) -> Rows:
        rows = Rows()
        present = set()
        named = [(c.get("name"), "reader", c.get("state")) for c in connections]
        named += [(c.get("name"), "channel", c.get("state")) for c in channels]
        named += [(q.get("name") if q.get("vhost", "/") == "/" else f"{q.get('vhost')}/{q.get('name')}", "queue",
                   q.get("state")) for q in queues]
        for name, kind, state in named:
            if not name or not state:
                continue
            present.add(name)
            change = self.clock.observe(name, {"kind": kind, "conn_state": state}, now_ns)
            if change is not None:
                rows.states.append(dataclasses.asdict(change))
        for name in self.seen - present:                  # closed since the last sample: its span ends
            change = self.clock.end(name, now_ns)
            if change is not None:
                rows.states.append(dataclasses.asdict(change))
            self.clock.forget(name)
        self.seen = present
        rows.stats += self._publishers(now_ns, channels)
        rows.stats += self._node(now_ns, nodes, rows)
        return rows

    def finish(self, now_ns: int) -> Rows:
        """The run is over: every span still open ends now (a state that never changed has one)."""
        rows = Rows()
        for name in sorted(self.seen):
            change = self.clock.end(name, now_ns)
            if change is not None:
                rows.states.append(dataclasses.asdict(change))
        self.seen = set()
        return rows

    def _publishers(self, now_ns: int, channels: list) -> list[dict]:
        per_connection: dict[str, int] = {}
        for ch in channels:
            conn = (ch.get("connection_details") or {}).get("name")
            publish = (ch.get("message_stats") or {}).get("publish") or 0
            if conn:
                per_connection[conn] = per_connection.get(conn, 0) + int(publish)
        rows = []
        for conn, published in per_connection.items():
            if published > self.publishes.get(conn, 0):
                self.first_publish_ns.setdefault(conn, now_ns)
                self.last_publish_ns[conn] = now_ns
                self.publishes[conn] = published
                rows.append({"at_ns": now_ns, "name": conn, "kind": "reader", "publishes": published,
                             "first_publish_ns": self.first_publish_ns[conn],
                             "last_publish_ns": self.last_publish_ns[conn]})
        return rows

    def _node(self, now_ns: int, nodes: list, rows: Rows) -> list[dict]:
        if not nodes:
            return []
        node = nodes[0]
        now = {"memory": bool(node.get("mem_alarm")), "disk": bool(node.get("disk_free_alarm"))}
        for source, on in now.items():
            if on != self.alarms[source]:
                used = node.get("mem_used") if source == "memory" else None
                free = node.get("disk_free") if source == "disk" else None
                limit = node.get("mem_limit") if source == "memory" else node.get("disk_free_limit")
                rows.events.append({"at_ns": now_ns, "event": "alarm_set" if on else "alarm_clear",
                                    "name": str(node.get("name")), "data": {"source": source, "used": used,
                                                                            "free": free, "limit": limit}})
        self.alarms = now
        return [{"at_ns": now_ns, "name": str(node.get("name")), "kind": "watchdog",
                 "memory_used": node.get("mem_used"), "memory_limit": node.get("mem_limit"),
                 "memory_alarm": now["memory"], "disk_free": node.get("disk_free"),
                 "disk_limit": node.get("disk_free_limit"), "disk_alarm": now["disk"]}]


class ManagementSampler:
    """Reads the management API at ``base`` (http://user:pass@host:15672) with basic auth."""

    def __init__(self, uri: str):
        parts = urlsplit(uri)
        try:
            port = f":{parts.port}" if parts.port else ""
        except ValueError as exc:
            raise InvalidLoadConfig(f"--management-uri {uri!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidLoadConfig(f"--management-uri {uri!r} is not http(s)://user:pass@host:port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self.base = f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}"
        user = unquote(parts.username) if parts.username is not None else "guest"
        password = unquote(parts.password) if parts.password is not None else "guest"
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.observer = Observer()
        self.queues: list | None = None           # the last /api/queues answer (for the drain's depths)

    def get(self, path: str):
        request = urllib.request.Request(f"{self.base}{path}", headers={"Authorization": self.auth})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise ManagementUnreachable(f"{self.base}{path}: HTTP {exc.code} {exc.reason}") from None
        except (OSError, ValueError) as exc:
            raise ManagementUnreachable(f"{self.base}{path}: {exc}") from None

    def depths(self) -> dict[str, tuple[int, int]] | None:
        """queue -> (ready, unacked) as last sampled; None before the first sample."""
        if self.queues is None:
            return None
        return {q["name"]: (int(q.get("messages_ready") or 0), int(q.get("messages_unacknowledged") or 0))
                for q in self.queues if q.get("name")}

    def check(self) -> str:
        """The node's name; raises ManagementUnreachable when the API cannot be used."""
        nodes = self.get("/api/nodes?columns=name")
        return str(nodes[0]["name"]) if nodes else "?"

    def sample(self, now_ns: int) -> Rows:
        answers = {what: self.get(f"/api/{what}?columns={cols}") for what, cols in COLUMNS.items()}
        self.queues = answers["queues"]
        return self.observer.observe(now_ns, answers["connections"], answers["channels"], answers["queues"],
                                     answers["nodes"])
