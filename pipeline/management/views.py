"""The broker's ``status`` as RabbitMQ 3.10's management API shows it: pure, time passed in.

``Views(status, rates)`` answers ``/api/overview``, ``/api/nodes``,
``/api/connections``, ``/api/channels``, ``/api/queues``, ``/api/consumers`` and
the health checks with RabbitMQ's paths' field names; ``creditflow ctl
list_queues`` and friends print the same rows as rabbitmqctl's columns.
What RabbitMQ has no field for (each process's credit-flow state, credit per
link) is under ``creditflow`` keys and ``/api/creditflow/*``.

Mapping (one AMQP object, one creditflow process):

==========  ===================  =============================================
object      process              name shown (RabbitMQ's)
==========  ===================  =============================================
connection  ``reader-N``         ``127.0.0.1:50712 -> 127.0.0.1:5672``
channel     ``channel-N.C``      ``127.0.0.1:50712 -> 127.0.0.1:5672 (C)``
queue       ``queue-NAME``       ``NAME`` in vhost ``/``
==========  ===================  =============================================

Counters (``message_stats``) add the live processes' figures to what the
supervisor kept of those that ended (``status["retired"]``, summed with
``counters``), so global totals never fall. Rates (``*_details.rate``, per
second) come from ``RateBook``: the change of a counter since the newest
sample at least ``RATE_SPAN_S`` older than the current one.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json

from pipeline.management.writes import HASHING_ALGORITHM, password_hash, properties_key
from pipeline.telemetry.schema import (ChannelStats, LinkStats, QueueStats, ReaderStats, SchemaMismatch, Snapshot,
                                       WatchdogStats, stats_of)

VHOST = "/"
PROTOCOL_ALIASES = {"amqp091": "amqp", "amqp0.9.1": "amqp", "amqp0-9-1": "amqp", "amqp0_9_1": "amqp",
                    "amqps": "amqp/ssl", "management": "http", "ui": "http", "http_api": "http", "http1": "http"}
# RabbitMQ's names for a protocol-listener health check, lowercased first (its AMQP 1.0 names are left out:
# creditflow speaks 0-9-1 only, so a check for 1.0 fails)
API_VERSION = "3.10.8"           # the RabbitMQ release whose API shapes these views follow
PRODUCT = "creditflow"
PRODUCT_VERSION = "0.1.0"
RATE_SPAN_S = 1.0                # rates span at least this much time, when the samples allow
RATE_WINDOW_S = 10.0             # samples older than this are dropped (one older than the span is kept)
HEALTH_REASON = {"cluster": "There are alarms in effect in the cluster",
                 "node": "There are alarms in effect on the node"}
ALARM_RESOURCES = {"memory": "memory", "disk": "disk"}


# -- counters: what each process's statistics add to message_stats ------------------------------------
def channel_counters(st: ChannelStats) -> dict[str, int]:
    """A channel's publishes, confirms (messages acked to the client), returns and drops."""
    return {"publish": st.routed + st.unroutable, "confirm": st.confirmed, "return_unroutable": st.returned,
            "drop_unroutable": max(0, st.unroutable - st.returned)}


def queue_counters(st: QueueStats) -> dict[str, int]:
    return {"publish": st.enqueued, "deliver_get": st.delivered, "deliver": st.delivered,
            "redeliver": st.redelivered, "ack": st.acked}


def connection_counters(st: ReaderStats) -> dict[str, int]:
    return {"recv_oct": st.recv_oct, "send_oct": st.send_oct}


COUNTERS = {"channel": channel_counters, "queue": queue_counters, "reader": connection_counters}


def counters(kind: str | None, st: Snapshot) -> dict[str, int]:
    fn = COUNTERS.get(kind or "")
    return fn(st) if fn is not None else {}


def retire(retired: dict, kind: str | None, msg: dict) -> None:
    """Add an ended process's last counters (its last stats message) into ``retired`` ({kind: {counter:
    total}}). A message that is no statistics of its kind adds nothing (it is the test suite's business
    that every stage's is)."""
    if kind not in COUNTERS:
        return
    try:
        got = counters(kind, stats_of(msg))
    except SchemaMismatch:
        return
    into = retired.setdefault(kind, {})
    for key, value in got.items():
        into[key] = into.get(key, 0) + value


def activity(active: bool, single_active: bool) -> str:
    """A consumer's ``activity_status`` as RabbitMQ 3.10 gives it: ``up``, or with a single active
    consumer ``single_active`` for that one and ``waiting`` for the others."""
    if not single_active:
        return "up"
    return "single_active" if active else "waiting"


# -- rates ------------------------------------------------------------------------------------------------
class RateBook:
    """Successive samples of every counter; ``rate(key)`` per second. ``observe`` once per new status."""

    def __init__(self, span_s: float = RATE_SPAN_S, window_s: float = RATE_WINDOW_S) -> None:
        self.span_s = span_s
        self.window_s = window_s
        self.samples: collections.deque = collections.deque()     # (t_s, {key: value})

    def observe(self, now_s: float, status: dict) -> None:
        if self.samples and now_s <= self.samples[-1][0]:
            return
        self.samples.append((now_s, sample_counters(status)))
        while len(self.samples) > 2 and now_s - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def rate(self, key: tuple) -> float:
        if len(self.samples) < 2:
            return 0.0
        now_s, current = self.samples[-1]
        base = self.samples[0]
        for sample in reversed(list(self.samples)[:-1]):
            if now_s - sample[0] >= self.span_s:
                base = sample
                break
        value = current.get(key)
        if value is None:
            return 0.0
        before = base[1].get(key, 0)
        dt = now_s - base[0]
        return round((value - before) / dt, 1) if dt > 0 else 0.0


def sample_counters(status: dict) -> dict[tuple, float]:
    """Every counter and depth a rate is shown for, from one status."""
    views = Views(status)
    out: dict[tuple, float] = {}
    for key, value in views.totals().items():
        out[("overview", key)] = value
    for _, q in views.live("queue"):
        for key, value in queue_counters(q).items():
            out[("queue", q.queue, key)] = value
        out[("queue", q.queue, "messages_ready")] = q.messages
        out[("queue", q.queue, "messages_unacknowledged")] = q.unacked
        out[("queue", q.queue, "messages")] = q.messages + q.unacked
    for name, ch in views.live("channel"):
        for key, value in channel_counters(ch).items():
            out[("channel", name, key)] = value
    for name, r in views.live("reader"):
        for key, value in connection_counters(r).items():
            out[("reader", name, key)] = value
    for name, link in views.links().items():
        out[("link", name, "sent")] = link.sent
    depth = views.queue_depths()
    for key, value in depth.items():
        out[("overview", key)] = value
    return out


def details(rate: float) -> dict:
    """RabbitMQ's ``*_details``: here only the rate (per second); no sample history."""
    return {"rate": rate}


def parse_peer(peer: str) -> tuple[str | None, int | None, str | None, int | None]:
    """``"a:p -> b:q"`` (IPv6 addresses unbracketed) -> (peer host, peer port, host, port)."""
    def split(text: str):
        host, _, port = text.strip().rpartition(":")
        try:
            return host or None, int(port)
        except ValueError:
            return None, None
    there, sep, here = peer.partition(" -> ")
    if not sep:
        return None, None, None, None
    return (*split(there), *split(here))


# -- the views ----------------------------------------------------------------------------------------------
class Views:
    """RabbitMQ-shaped objects from one ``status``; ``rates`` (a RateBook that has seen it) or none (0.0).

    A process's statistics are read as its kind's class (:func:`pipeline.telemetry.schema.stats_of`);
    what the supervisor adds beside them (``alive``, ``seconds``, ``restarts``, ``host``, ``peer``,
    ``owner``) is read from its entry in ``status["processes"]``."""

    def __init__(self, status: dict, rates: RateBook | None = None) -> None:
        self.status = status
        self.rates = rates
        self.node = str(status.get("node") or "creditflow@localhost")
        self.processes: dict = status.get("processes") or {}
        self._typed: dict[str, Snapshot] = {}

    # helpers
    def stats(self, name: str) -> Snapshot | None:
        """Process ``name``'s statistics as its class; None for a process the status does not list."""
        st = self._typed.get(name)
        if st is None and name in self.processes:
            st = self._typed[name] = stats_of(self.processes[name])
        return st

    def live(self, kind: str) -> list[tuple[str, Snapshot]]:
        return [(name, self.stats(name)) for name, p in sorted(self.processes.items())
                if p.get("kind") == kind and p.get("alive")]

    def links(self) -> dict[str, LinkStats]:
        return {name: LinkStats(**link) for name, link in sorted((self.status.get("links") or {}).items())}

    def rate(self, *key) -> float:
        return self.rates.rate(key) if self.rates is not None else 0.0

    def with_rates(self, prefix: tuple, values: dict) -> dict:
        """Each counter and its ``_details`` (``{"rate": per second}``); ``prefix`` names it in the RateBook."""
        out = {}
        for key, value in values.items():
            out[key] = value
            out[f"{key}_details"] = details(self.rate(*prefix, key))
        return out

    def process_extra(self, name: str) -> dict:
        """What RabbitMQ has no field for: the process behind the object and its credit flow."""
        p = self.processes.get(name) or {}
        st = self.stats(name)
        seconds = p.get("seconds") or {}
        blocked = getattr(st, "blocked", False)
        return {"process": name, "pid": st.pid if st else None, "host": p.get("host"),
                "process_state": getattr(st, "state", None), "blocked": blocked,
                "blocked_by": list(getattr(st, "blocked_by", ())), "block_count": getattr(st, "block_count", 0),
                "blocked_seconds": getattr(st, "blocked_total_ns", 0) / 1e9,
                "flow_seconds": float(seconds.get("flow", 0.0)), "state_seconds": seconds,
                "restarts": int(p.get("restarts") or 0)}

    def connection_name(self, reader: str) -> str:
        p = self.processes.get(reader) or {}
        return str(p.get("peer") or reader)

    def channel_owner(self, name: str) -> str:
        p = self.processes.get(name) or {}
        if p.get("owner"):
            return str(p["owner"])
        return "reader-" + name[len("channel-"):].split(".", 1)[0]

    def user_of(self, reader: str) -> str | None:
        st = self.stats(reader)
        return st.user if isinstance(st, ReaderStats) else None

    def totals(self) -> dict[str, int]:
        """Global message counters: live processes plus those the supervisor retired."""
        out: dict[str, int] = {}
        retired = self.status.get("retired") or {}
        for kind in ("channel", "queue"):
            for key, value in (retired.get(kind) or {}).items():
                out[f"{kind}.{key}"] = out.get(f"{kind}.{key}", 0) + int(value)
            for _, st in self.live(kind):
                for key, value in counters(kind, st).items():
                    out[f"{kind}.{key}"] = out.get(f"{kind}.{key}", 0) + value
        return {"publish": out.get("channel.publish", 0), "confirm": out.get("channel.confirm", 0),
                "return_unroutable": out.get("channel.return_unroutable", 0),
                "drop_unroutable": out.get("channel.drop_unroutable", 0),
                "deliver_get": out.get("queue.deliver_get", 0), "deliver": out.get("queue.deliver", 0),
                "redeliver": out.get("queue.redeliver", 0), "ack": out.get("queue.ack", 0),
                "get": 0, "get_no_ack": 0, "deliver_no_ack": 0}

    def connection_octets(self) -> dict[str, int]:
        """Bytes read and written over every connection: live readers plus those the supervisor retired."""
        retired = (self.status.get("retired") or {}).get("reader") or {}
        out = {key: int(retired.get(key) or 0) for key in ("recv_oct", "send_oct")}
        for _, st in self.live("reader"):
            for key, value in connection_counters(st).items():
                out[key] += value
        return out

    def queue_depths(self) -> dict[str, int]:
        queues = [st for _, st in self.live("queue")]
        ready = sum(q.messages for q in queues)
        unacked = sum(q.unacked for q in queues)
        return {"messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked}

    def alarms(self) -> list[str]:
        """RabbitMQ's resource names of the alarms in effect (``memory``, ``disk``)."""
        on = [ALARM_RESOURCES.get(src, src) for src, a in sorted((self.status.get("alarms") or {}).items())
              if a.get("state") == "set"]
        if (self.status.get("fd") or {}).get("alarm"):
            on.append("file_descriptor_limit")
        return on

    def listeners(self) -> list[dict]:
        """What the broker listens on: AMQP, AMQPS when ``--tls-port`` is given, and this API (with /metrics)."""
        host = self.status.get("host", "127.0.0.1")
        rows = [{"node": self.node, "protocol": "amqp", "ip_address": host, "port": self.status.get("port")}]
        if self.status.get("tls_port"):
            rows.append({"node": self.node, "protocol": "amqp/ssl", "ip_address": host,
                         "port": self.status["tls_port"]})
        if self.status.get("management_port"):
            rows.append({"node": self.node, "protocol": "http", "ip_address": "127.0.0.1",
                         "port": self.status["management_port"]})
        return rows

    def vhost(self) -> dict:
        """``/api/vhosts/%2F``: the one vhost, running on this node."""
        return {"name": VHOST, "description": "Default virtual host", "tags": [], "default_queue_type": "undefined",
                "metadata": {"description": "Default virtual host", "tags": []}, "tracing": False,
                "cluster_state": {self.node: "running"}}

    def port_listener(self, port: str) -> tuple[int, dict]:
        """``/api/health/checks/port-listener/PORT``: 200 while something of the broker's listens there."""
        try:
            number = int(port)
        except ValueError:
            return 400, {"error": "bad_request", "reason": "Invalid port"}
        ports = [row["port"] for row in self.listeners()]
        if number in ports:
            return 200, {"status": "ok", "port": number}
        return 503, {"status": "failed", "reason": "No active listener", "missing": number, "ports": ports}

    def protocol_listener(self, protocol: str) -> tuple[int, dict]:
        """``/api/health/checks/protocol-listener/PROTOCOL`` (amqp091, amqp-0-9-1 and amqps read as RabbitMQ
        reads them)."""
        name = PROTOCOL_ALIASES.get(protocol.lower(), protocol.lower())
        protocols = [row["protocol"] for row in self.listeners()]
        if name in protocols:
            return 200, {"status": "ok", "protocol": name}
        return 503, {"status": "failed", "reason": "No active listener", "missing": name, "protocols": protocols}

    # /api/overview
    def overview(self) -> dict:
        totals = self.totals()
        depths = self.queue_depths()
        connections, channels, queues = self.live("reader"), self.live("channel"), self.queues()
        listeners = self.listeners()
        routing = self.status.get("routing") or {}
        return {
            "management_version": API_VERSION, "rates_mode": "basic", "rabbitmq_version": API_VERSION,
            "product_name": PRODUCT, "product_version": PRODUCT_VERSION, "cluster_name": self.node,
            "node": self.node, "erlang_version": None, "disable_stats": False, "enable_queue_totals": True,
            "message_stats": self.with_rates(("overview",), totals),
            "queue_totals": {k: v for key, value in depths.items()
                             for k, v in ((key, value), (f"{key}_details", details(self.rate("overview", key))))},
            "object_totals": {"connections": len(connections), "channels": len(channels),
                              "queues": len(queues), "consumers": sum(q["consumers"] for q in queues),
                              "exchanges": int(routing.get("exchanges", 0)) + 1},     # + the default exchange
            "listeners": listeners, "exchange_types": [{"name": t, "enabled": True}
                                                        for t in ("direct", "fanout", "headers", "topic")],
        }

    # /api/nodes
    def watchdog(self) -> WatchdogStats | None:
        live = self.live("watchdog")
        if live:
            return live[0][1]
        st = self.stats("watchdog")
        return st if isinstance(st, WatchdogStats) else None

    def nodes(self) -> list[dict]:
        wd = self.watchdog()
        alarms = self.alarms()
        fd = self.status.get("fd") or {}
        proc = self.status.get("proc") or {}
        return [{
            "name": self.node, "type": "disc", "running": True, "os_pid": str(self.status.get("pid")),
            "uptime": self.status.get("uptime_ms"),
            "mem_used": wd.memory_used if wd else None, "mem_limit": wd.memory_limit if wd else None,
            "mem_alarm": "memory" in alarms, "mem_calculation_strategy": wd.strategy if wd else None,
            "disk_free": wd.disk_free if wd else None, "disk_free_limit": wd.disk_limit if wd else None,
            "disk_free_alarm": "disk" in alarms,
            "fd_used": fd.get("used"), "fd_total": fd.get("limit"),
            "sockets_used": len(self.live("reader")), "sockets_total": self.status.get("connection_max"),
            "proc_used": proc.get("used"), "proc_total": proc.get("limit"),
            "processors": self.status.get("processors"),
        }]

    # /api/connections
    def connection(self, name: str, st: ReaderStats) -> dict:
        shown = self.connection_name(name)
        peer_host, peer_port, host, port = parse_peer(str((self.processes.get(name) or {}).get("peer") or ""))
        if st.client_properties is not None:       # the keys the client sent
            client = {k: v for k, v in dataclasses.asdict(st.client_properties).items() if v is not None}
        else:
            client = {"connection_name": st.client_name} if st.client_name else {}
        return {
            "name": shown, "node": self.node, "vhost": VHOST, "user": st.user,
            "state": st.conn_state, "channels": st.channels, "type": "network", "protocol": "AMQP 0-9-1",
            "peer_host": peer_host, "peer_port": peer_port, "host": host, "port": port,
            "ssl": port is not None and port == self.status.get("tls_port"),
            "client_properties": client, "user_provided_name": st.client_name or None,
            **self.with_rates(("reader", name), connection_counters(st)),
            "creditflow": {**self.process_extra(name), "publishes": st.publishes, "deliveries": st.deliveries,
                           "alarm_reasons": list(st.alarm_reasons)},
        }

    def connections(self) -> list[dict]:
        return [self.connection(name, st) for name, st in self.live("reader")]

    # /api/channels
    def channel(self, name: str, st: ChannelStats) -> dict:
        owner = self.channel_owner(name)
        conn = self.connection_name(owner)
        peer_host, peer_port, _, _ = parse_peer(conn)
        return {
            "name": f"{conn} ({st.number})", "number": st.number, "node": self.node, "vhost": VHOST,
            "user": self.user_of(owner), "state": st.state,
            "confirm": st.confirm_mode == "confirm", "transactional": st.confirm_mode == "tx",
            "messages_unconfirmed": st.unconfirmed,
            "messages_unacknowledged": self.channel_unacked(owner, st.number),
            "prefetch_count": st.prefetch_count, "global_prefetch_count": st.global_prefetch_count,
            "consumer_count": st.consumer_count,
            "connection_details": {"name": conn, "peer_host": peer_host, "peer_port": peer_port},
            "message_stats": self.with_rates(("channel", name), channel_counters(st)),
            "creditflow": {**self.process_extra(name), "connection_process": owner},
        }

    def channel_unacked(self, owner: str, number: int) -> int:
        """Deliveries on the channel not yet acked: its reader counts them (it assigns the delivery tags)."""
        reader = self.stats(owner)
        return int(reader.channel_unacked.get(str(number), 0)) if isinstance(reader, ReaderStats) else 0

    def channel_details(self, proc: str, number: int) -> dict:
        """RabbitMQ's ``channel_details`` of a consumer on channel ``number`` (process ``proc``)."""
        owner = self.channel_owner(proc)
        conn = self.connection_name(owner)
        peer_host, peer_port, _, _ = parse_peer(conn)
        return {"name": f"{conn} ({number})", "number": number, "connection_name": conn,
                "peer_host": peer_host, "peer_port": peer_port, "user": self.user_of(owner)}

    def channels(self) -> list[dict]:
        return [self.channel(name, st) for name, st in self.live("channel")]

    # /api/queues
    def live_queue(self, proc: str) -> QueueStats | None:
        st = self.stats(proc)
        return st if isinstance(st, QueueStats) and self.processes[proc].get("alive") else None

    def queue(self, name: str, definition: dict, detail: bool = False) -> dict:
        proc = definition.get("proc") or f"queue-{name}"
        q = self.live_queue(proc)
        ready, unacked = (q.messages, q.unacked) if q else (0, 0)
        depths = {"messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked}
        state = "stopped" if definition.get("down") else (q.state if q else "down")
        out = {
            "name": name, "vhost": VHOST, "node": self.node, "type": "classic", "state": state,
            **{k: v for key, value in depths.items()
               for k, v in ((key, value), (f"{key}_details", details(self.rate("queue", name, key))))},
            "message_bytes": q.message_bytes if q else 0, "message_bytes_ready": q.message_bytes if q else 0,
            "memory": q.message_bytes if q else 0,        # the queue's bodies: its processes share a host
            "messages_paged_out": q.paged_messages if q else 0,
            "consumers": q.consumers if q else 0,
            "durable": bool(definition.get("durable")), "auto_delete": bool(definition.get("auto_delete")),
            "exclusive": bool(definition.get("exclusive")), "arguments": definition.get("arguments") or {},
            "policy": None, "operator_policy": None, "effective_policy_definition": {},
            "message_stats": self.with_rates(("queue", name), queue_counters(q)) if q else {},
            "creditflow": {**self.process_extra(proc), "paging": q.paging if q else False,
                           "awaiting_confirm": q.awaiting_confirm if q else 0},
        }
        out["single_active_consumer_tag"] = q.single_active_consumer_tag if q else None
        if detail:
            out["consumer_details"] = self.consumers_of(name, q)
        return out

    def queues(self) -> list[dict]:
        return [self.queue(name, d) for name, d in sorted((self.status.get("queues") or {}).items())]

    def find_queue(self, vhost: str, name: str) -> dict | None:
        definition = (self.status.get("queues") or {}).get(name)
        if vhost != VHOST or definition is None:
            return None
        return self.queue(name, definition, detail=True)

    # /api/consumers
    def consumers_of(self, queue: str, q: QueueStats | None) -> list[dict]:
        """The queue's consumers as it reports them (``consumer_details``, at most
        ``schema.CONSUMER_DETAILS_KEPT``); those it left out are entries without tag or channel."""
        if q is None:
            return []
        sac = q.single_active_consumer_tag is not None
        out = [{"queue": {"name": queue, "vhost": VHOST}, "consumer_tag": c.consumer_tag,
                "channel_details": self.channel_details(c.channel, c.channel_number),
                "ack_required": c.ack_required, "prefetch_count": c.prefetch_count,
                "exclusive": c.exclusive, "active": c.active, "activity_status": activity(c.active, sac),
                "arguments": {}}
               for c in q.consumer_details]
        unnamed = max(0, q.consumers - len(out))
        # with a single active consumer, the ones left out wait, unless it is among them (then one is it)
        holder_left_out = sac and not any(c.active for c in q.consumer_details)
        actives = [not sac or (holder_left_out and i == 0) for i in range(unnamed)]
        return out + [{"queue": {"name": queue, "vhost": VHOST}, "consumer_tag": None, "channel_details": {},
                       "ack_required": None, "prefetch_count": None, "exclusive": None, "active": active,
                       "activity_status": activity(active, sac), "arguments": {}} for active in actives]

    def consumers(self) -> list[dict]:
        out = []
        for name, d in sorted((self.status.get("queues") or {}).items()):
            out += self.consumers_of(name, self.live_queue(d.get("proc") or f"queue-{name}"))
        return out

    # /api/health/checks/alarms, /api/health/checks/local-alarms
    def health_alarms(self, scope: str = "cluster") -> tuple[int, dict]:
        """(HTTP status, body) as RabbitMQ 3.10 answers: 200 ok, or 503 with every alarm in effect."""
        on = self.alarms()
        if not on:
            return 200, {"status": "ok"}
        return 503, {"status": "failed", "reason": HEALTH_REASON[scope],
                     "alarms": [{"node": self.node, "resource": r} for r in on]}

    # /api/creditflow/processes, /api/creditflow/links
    def processes_view(self) -> list[dict]:
        shown = {}
        for name, _ in self.live("reader"):
            shown[name] = self.connection_name(name)
        for name, st in self.live("channel"):
            shown[name] = f"{self.connection_name(self.channel_owner(name))} ({st.number})"
        for qname, d in (self.status.get("queues") or {}).items():
            shown[d.get("proc") or f"queue-{qname}"] = qname
        return [{"name": name, "kind": p.get("kind"), "state": p.get("state"),     # the supervisor's state_at
                 "alive": True, "object": shown.get(name),
                 **{k: v for k, v in self.process_extra(name).items() if k not in ("process", "process_state")}}
                for name, p in sorted(self.processes.items()) if p.get("alive")]

    def links_view(self) -> list[dict]:
        out = []
        for name, link in self.links().items():
            sender, _, receiver = name.partition("->")
            out.append({"name": name, "sender": sender, "receiver": receiver, **link.to_dict(),
                        "sent_details": details(self.rate("link", name, "sent"))})
        return out


def whoami(user: str) -> dict:
    return {"name": user, "tags": ["administrator"]}


# -- columns: ?columns= and rabbitmqctl list_* ----------------------------------------------------------------
def pick(row: dict, column: str):
    """A dotted column (``message_stats.publish``) of one row; None where it has none."""
    value = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def select_columns(rows, columns: list[str]):
    """RabbitMQ's ``?columns=a,b.c``: only those (nested ones kept nested)."""
    def one(row: dict) -> dict:
        out: dict = {}
        for column in columns:
            parts = column.split(".")
            value = pick(row, column)
            if value is None and not _has(row, parts):
                continue
            into = out
            for part in parts[:-1]:
                into = into.setdefault(part, {})
            into[parts[-1]] = value
        return out
    return [one(r) for r in rows] if isinstance(rows, list) else one(rows)


def _has(row: dict, parts: list[str]) -> bool:
    value = row
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


# rabbitmqctl's list_* actions: their default columns, and the columns that are not API fields
LIST_DEFAULTS = {"queues": ["name", "messages"], "connections": ["user", "peer_host", "peer_port", "state"],
                 "channels": ["pid", "user", "consumer_count", "messages_unacknowledged"]}
LIST_HEADINGS = {"queues": "Listing queues for vhost / ...", "connections": "Listing connections ...",
                 "channels": "Listing channels ..."}
LIST_EXTRA = {"pid": "creditflow.pid", "process": "creditflow.process", "connection": "connection_details.name"}
LIST_COLUMNS = {
    "queues": ["name", "durable", "auto_delete", "arguments", "exclusive", "messages_ready",
               "messages_unacknowledged", "messages", "consumers", "memory", "message_bytes",
               "message_bytes_ready", "messages_paged_out", "state", "type", "policy", "pid", "process"],
    "connections": ["name", "state", "channels", "user", "vhost", "peer_host", "peer_port", "host", "port",
                    "protocol", "type", "ssl", "client_properties", "user_provided_name", "recv_oct", "send_oct",
                    "pid", "process"],
    "channels": ["name", "state", "number", "user", "vhost", "connection", "confirm", "transactional",
                 "consumer_count", "messages_unacknowledged", "messages_unconfirmed", "prefetch_count",
                 "global_prefetch_count", "pid", "process"],
}


class UnknownColumn(ValueError):
    """Raised when a list_* column is not one that object has (rabbitmqctl: 'Info key(s) ... are not supported')."""


def list_rows(views: Views, what: str, columns: list[str]) -> list[list]:
    """The rows of ``rabbitmqctl list_<what> COLUMN...`` (hyphens read as underscores)."""
    columns = [c.replace("-", "_") for c in columns] or LIST_DEFAULTS[what]
    bad = [c for c in columns if c not in LIST_COLUMNS[what]]
    if bad:
        raise UnknownColumn(f"Info key(s) {','.join(bad)} are not supported; {what} have: "
                            f"{' '.join(LIST_COLUMNS[what])}")
    rows = {"queues": views.queues, "connections": views.connections, "channels": views.channels}[what]()
    return [columns] + [[pick(r, LIST_EXTRA.get(c, c)) for c in columns] for r in rows]


def format_cell(value) -> str:
    """As rabbitmqctl prints: true/false, JSON for tables, an empty cell for none."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value).replace("\t", " ").replace("\n", " ")


# -- exchanges and bindings (``ctl topology``) ------------------------------------------------------------
def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def exchanges_view(topology: dict) -> list[dict]:
    """``/api/exchanges``: the default exchange (named "") first, as RabbitMQ lists it."""
    rows = [{"name": "", "vhost": VHOST, "type": "direct", "durable": True, "auto_delete": False,
             "internal": False, "arguments": {}, "user_who_performed_action": "rmq-internal"}]
    for x in sorted(topology.get("exchanges") or [], key=lambda x: _text(x["name"])):
        name = _text(x["name"])
        if not name:
            continue
        rows.append({"name": name, "vhost": VHOST, "type": x["type"], "durable": bool(x["durable"]),
                     "auto_delete": bool(x["auto_delete"]), "internal": bool(x["internal"]),
                     "arguments": x.get("arguments") or {},
                     "user_who_performed_action": "rmq-internal" if name.startswith("amq.") else "guest"})
    return rows


def bindings_view(topology: dict, queues) -> list[dict]:
    """``/api/bindings``: each queue's binding to the default exchange (implicit, as RabbitMQ lists it),
    then every exchange-to-queue and exchange-to-exchange binding."""
    rows = [{"source": "", "vhost": VHOST, "destination": q, "destination_type": "queue", "routing_key": q,
             "arguments": {}, "properties_key": properties_key(q, None)} for q in sorted(queues)]
    for b in topology.get("bindings") or []:
        key = _text(b["routing_key"])
        rows.append({"source": _text(b["source"]), "vhost": VHOST, "destination": _text(b["destination"]),
                     "destination_type": "exchange" if b["to_exchange"] else "queue", "routing_key": key,
                     "arguments": b.get("arguments") or {}, "properties_key": b["properties_key"]})
    return rows


# -- definitions (``GET /api/definitions``) --------------------------------------------------------------------
def user_salt(name: str) -> bytes:
    """The 4-byte salt of a user's exported hash: its name's, so the hash is the same at every request."""
    return hashlib.sha256(b"creditflow user " + name.encode()).digest()[:4]


def users_view(users: dict[str, str], salt=user_salt) -> list[dict]:
    """``/api/users``: every user an ``administrator`` (every user may do everything here), hashed as RabbitMQ
    hashes passwords."""
    return [{"name": name, "password_hash": password_hash(password, salt(name)), "hashing_algorithm":
             HASHING_ALGORITHM, "tags": ["administrator"], "limits": {}} for name, password in sorted(users.items())]


def permissions_view(users: dict[str, str]) -> list[dict]:
    """``/api/permissions``: every user may configure, write and read everything in the one vhost."""
    return [{"user": name, "vhost": VHOST, "configure": ".*", "write": ".*", "read": ".*"} for name in sorted(users)]


def parameters_view(limits: dict) -> list[dict]:
    """``/api/parameters``: the vhost's limits, the one runtime parameter creditflow has."""
    return [{"value": dict(limits), "vhost": VHOST, "component": "vhost-limits", "name": "limits"}] if limits else []


def definitions_view(queues: list[dict], topology: dict, limits: dict, users: dict[str, str],
                     vhost_only: bool = False, salt=user_salt) -> dict:
    """What RabbitMQ 3.10.8 exports: users (every one may do everything here: ``administrator``, all
    permissions), the one vhost, its limits as a ``vhost-limits`` parameter, every queue but the exclusive
    ones, the exchanges but the default and ``amq.`` ones, the bindings but the default exchange's.
    ``vhost_only`` (``/api/definitions/%2F``): the vhost's part, without vhost fields in its items."""
    parameters = parameters_view(limits)
    qs = [{"name": q["name"], "vhost": VHOST, "durable": q["durable"], "auto_delete": q["auto_delete"],
           "arguments": q["arguments"]} for q in queues if not q.get("exclusive")]
    xs = [{k: x[k] for k in ("name", "vhost", "type", "durable", "auto_delete", "internal", "arguments")}
          for x in exchanges_view(topology) if x["name"] and not x["name"].startswith("amq.")]
    exported = {q["name"] for q in qs}          # not the bindings of the queues left out (exclusive ones)
    bs = [{k: b[k] for k in ("source", "vhost", "destination", "destination_type", "routing_key", "arguments")}
          for b in bindings_view(topology, []) if b["source"]
          and (b["destination_type"] == "exchange" or b["destination"] in exported)]
    if vhost_only:
        strip = (lambda rows: [{k: v for k, v in r.items() if k != "vhost"} for r in rows])
        return {"rabbit_version": API_VERSION, "parameters": strip(parameters), "policies": [],
                "queues": strip(qs), "exchanges": strip(xs), "bindings": strip(bs)}
    return {"rabbit_version": API_VERSION, "rabbitmq_version": API_VERSION, "product_name": PRODUCT,
            "product_version": PRODUCT_VERSION,
            "users": users_view(users, salt), "vhosts": [{"name": VHOST}], "permissions": permissions_view(users),
            "topic_permissions": [], "parameters": parameters, "global_parameters": [], "policies": [],
            "queues": qs, "exchanges": xs, "bindings": bs}
