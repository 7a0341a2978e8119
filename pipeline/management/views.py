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
import json

VHOST = "/"
API_VERSION = "3.10.8"           # the RabbitMQ release whose API shapes these views follow
PRODUCT = "creditflow"
PRODUCT_VERSION = "0.1.0"
RATE_SPAN_S = 1.0                # rates span at least this much time, when the samples allow
RATE_WINDOW_S = 10.0             # samples older than this are dropped (one older than the span is kept)
HEALTH_REASON = {"cluster": "There are alarms in effect in the cluster",
                 "node": "There are alarms in effect on the node"}
ALARM_RESOURCES = {"memory": "memory", "disk": "disk"}


# -- counters: what each process's statistics add to message_stats ------------------------------------
def channel_counters(st: dict) -> dict[str, int]:
    """A channel's publishes, confirms, returns and drops. Confirms are messages: the channel's
    ``confirmed`` if it reports it, else its publishes less those still unconfirmed (exact when
    confirm.select came before the first publish and nothing was nacked)."""
    publish = int(st.get("routed") or 0) + int(st.get("unroutable") or 0)
    if "confirmed" in st:
        confirm = int(st["confirmed"] or 0)
    elif st.get("confirm_mode") == "confirm":
        confirm = max(0, publish - int(st.get("unconfirmed") or 0))
    else:
        confirm = 0
    returned = int(st.get("returned") or 0)
    return {"publish": publish, "confirm": confirm, "return_unroutable": returned,
            "drop_unroutable": max(0, int(st.get("unroutable") or 0) - returned)}


def queue_counters(st: dict) -> dict[str, int]:
    delivered = int(st.get("delivered") or 0)
    return {"publish": int(st.get("enqueued") or 0), "deliver_get": delivered, "deliver": delivered,
            "redeliver": int(st.get("redelivered") or 0), "ack": int(st.get("acked") or 0)}


def connection_counters(st: dict) -> dict[str, int]:
    return {"recv_oct": int(st.get("recv_oct") or 0), "send_oct": int(st.get("send_oct") or 0)}


COUNTERS = {"channel": channel_counters, "queue": queue_counters, "reader": connection_counters}


def counters(kind: str | None, st: dict) -> dict[str, int]:
    fn = COUNTERS.get(kind or "")
    return fn(st) if fn is not None else {}


def retire(retired: dict, kind: str | None, st: dict) -> None:
    """Add an ended process's last counters into ``retired`` ({kind: {counter: total}})."""
    got = counters(kind, st)
    if got:
        into = retired.setdefault(kind, {})
        for key, value in got.items():
            into[key] = into.get(key, 0) + value


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
    for proc, q in views.live("queue"):
        name = str(q.get("queue") or proc.removeprefix("queue-"))
        for key, value in queue_counters(q).items():
            out[("queue", name, key)] = value
        ready, unacked = int(q.get("messages") or 0), int(q.get("unacked") or 0)
        out[("queue", name, "messages_ready")] = ready
        out[("queue", name, "messages_unacknowledged")] = unacked
        out[("queue", name, "messages")] = ready + unacked
    for name, ch in views.live("channel"):
        for key, value in channel_counters(ch).items():
            out[("channel", name, key)] = value
    for name, r in views.live("reader"):
        for key, value in connection_counters(r).items():
            out[("reader", name, key)] = value
    for name, link in (status.get("links") or {}).items():
        out[("link", name, "sent")] = int(link.get("sent") or 0)
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
    """RabbitMQ-shaped objects from one ``status``; ``rates`` (a RateBook that has seen it) or none (0.0)."""

    def __init__(self, status: dict, rates: RateBook | None = None) -> None:
        self.status = status
        self.rates = rates
        self.node = str(status.get("node") or "creditflow@localhost")
        self.processes: dict = status.get("processes") or {}

    # helpers
    def live(self, kind: str):
        return [(name, p) for name, p in sorted(self.processes.items()) if p.get("kind") == kind and p.get("alive")]

    def rate(self, *key) -> float:
        return self.rates.rate(key) if self.rates is not None else 0.0

    def stats(self, prefix: tuple, values: dict) -> dict:
        """Each counter and its ``_details`` (``{"rate": per second}``); ``prefix`` names it in the RateBook."""
        out = {}
        for key, value in values.items():
            out[key] = value
            out[f"{key}_details"] = details(self.rate(*prefix, key))
        return out

    def process_extra(self, name: str, p: dict) -> dict:
        """What RabbitMQ has no field for: the process behind the object and its credit flow."""
        seconds = p.get("seconds") or {}
        return {"process": name, "pid": p.get("pid"), "host": p.get("host"), "process_state": p.get("state"),
                "blocked": bool(p.get("blocked")), "blocked_by": list(p.get("blocked_by") or []),
                "block_count": int(p.get("block_count") or 0),
                "blocked_seconds": (p.get("blocked_total_ns") or 0) / 1e9,
                "flow_seconds": float(seconds.get("flow", 0.0)), "state_seconds": seconds,
                "restarts": int(p.get("restarts") or 0)}

    def connection_name(self, reader: str) -> str:
        p = self.processes.get(reader) or {}
        return str(p.get("peer") or reader)

    def channel_owner(self, name: str, p: dict) -> str:
        if p.get("owner"):
            return str(p["owner"])
        return "reader-" + name[len("channel-"):].split(".", 1)[0]

    def totals(self) -> dict[str, int]:
        """Global message counters: live processes plus those the supervisor retired."""
        out: dict[str, int] = {}
        retired = self.status.get("retired") or {}
        for kind in ("channel", "queue"):
            for key, value in (retired.get(kind) or {}).items():
                out[f"{kind}.{key}"] = out.get(f"{kind}.{key}", 0) + int(value)
            for _, p in self.live(kind):
                for key, value in counters(kind, p).items():
                    out[f"{kind}.{key}"] = out.get(f"{kind}.{key}", 0) + value
        return {"publish": out.get("channel.publish", 0), "confirm": out.get("channel.confirm", 0),
                "return_unroutable": out.get("channel.return_unroutable", 0),
                "drop_unroutable": out.get("channel.drop_unroutable", 0),
                "deliver_get": out.get("queue.deliver_get", 0), "deliver": out.get("queue.deliver", 0),
                "redeliver": out.get("queue.redeliver", 0), "ack": out.get("queue.ack", 0),
                "get": 0, "get_no_ack": 0, "deliver_no_ack": 0}

    def queue_depths(self) -> dict[str, int]:
        ready = sum(int(p.get("messages") or 0) for _, p in self.live("queue"))
        unacked = sum(int(p.get("unacked") or 0) for _, p in self.live("queue"))
        return {"messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked}

    def alarms(self) -> list[str]:
        """RabbitMQ's resource names of the alarms in effect (``memory``, ``disk``)."""
        on = [ALARM_RESOURCES.get(src, src) for src, a in sorted((self.status.get("alarms") or {}).items())
              if a.get("state") == "set"]
        if (self.status.get("fd") or {}).get("alarm"):
            on.append("file_descriptor_limit")
        return on

    # /api/overview
    def overview(self) -> dict:
        totals = self.totals()
        depths = self.queue_depths()
        connections, channels, queues = self.live("reader"), self.live("channel"), self.queues()
        listeners = [{"node": self.node, "protocol": "amqp", "ip_address": self.status.get("host", "127.0.0.1"),
                      "port": self.status.get("port")}]
        if self.status.get("management_port"):
            listeners.append({"node": self.node, "protocol": "http", "ip_address": "127.0.0.1",
                              "port": self.status["management_port"]})
        routing = self.status.get("routing") or {}
        return {
            "management_version": API_VERSION, "rates_mode": "basic", "rabbitmq_version": API_VERSION,
            "product_name": PRODUCT, "product_version": PRODUCT_VERSION, "cluster_name": self.node,
            "node": self.node, "erlang_version": None, "disable_stats": False, "enable_queue_totals": True,
            "message_stats": self.stats(("overview",), totals),
            "queue_totals": {k: v for key, value in depths.items()
                             for k, v in ((key, value), (f"{key}_details", details(self.rate("overview", key))))},
            "object_totals": {"connections": len(connections), "channels": len(channels),
                              "queues": len(queues), "consumers": sum(q["consumers"] for q in queues),
                              "exchanges": int(routing.get("exchanges", 0)) + 1},     # + the default exchange
            "listeners": listeners, "exchange_types": [{"name": t, "enabled": True}
                                                        for t in ("direct", "fanout", "headers", "topic")],
        }

    # /api/nodes
    def nodes(self) -> list[dict]:
        wd = next((p for _, p in self.live("watchdog")), None) or self.processes.get("watchdog") or {}
        alarms = self.alarms()
        fd = self.status.get("fd") or {}
        proc = self.status.get("proc") or {}
        return [{
            "name": self.node, "type": "disc", "running": True, "os_pid": str(self.status.get("pid")),
            "uptime": self.status.get("uptime_ms"),
            "mem_used": wd.get("memory_used"), "mem_limit": wd.get("memory_limit"), "mem_alarm": "memory" in alarms,
            "mem_calculation_strategy": wd.get("strategy"),
            "disk_free": wd.get("disk_free"), "disk_free_limit": wd.get("disk_limit"),
            "disk_free_alarm": "disk" in alarms,
            "fd_used": fd.get("used"), "fd_total": fd.get("limit"),
            "sockets_used": len(self.live("reader")), "sockets_total": self.status.get("connection_max"),
            "proc_used": proc.get("used"), "proc_total": proc.get("limit"),
            "processors": self.status.get("processors"),
        }]

    # /api/connections
    def connection(self, name: str, p: dict) -> dict:
        shown = self.connection_name(name)
        peer_host, peer_port, host, port = parse_peer(str(p.get("peer") or ""))
        client = p.get("client_properties")
        if isinstance(client, dict):            # the reader's ClientProperties: the keys the client sent
            client = {k: v for k, v in client.items() if v is not None}
        else:
            client = {"connection_name": p["client_name"]} if p.get("client_name") else {}
        octets = connection_counters(p)
        return {
            "name": shown, "node": self.node, "vhost": p.get("vhost") or VHOST, "user": p.get("user"),
            "state": p.get("conn_state") or p.get("state"), "channels": int(p.get("channels") or 0),
            "type": "network", "protocol": "AMQP 0-9-1",
            "peer_host": peer_host, "peer_port": peer_port, "host": host, "port": port,
            "ssl": bool(p.get("tls")) if "tls" in p else port is not None and port == self.status.get("tls_port"),
            "client_properties": client, "user_provided_name": p.get("client_name") or None,
            **self.stats(("reader", name), octets),
            "creditflow": {**self.process_extra(name, p), "publishes": int(p.get("publishes") or 0),
                           "deliveries": int(p.get("deliveries") or 0),
                           "alarm_reasons": list(p.get("alarm_reasons") or [])},
        }

    def connections(self) -> list[dict]:
        return [self.connection(name, p) for name, p in self.live("reader")]

    # /api/channels
    def channel(self, name: str, p: dict) -> dict:
        owner = self.channel_owner(name, p)
        conn = self.connection_name(owner)
        peer_host, peer_port, _, _ = parse_peer(conn)
        number = int(p.get("number") or 0)
        mode = p.get("confirm_mode")
        return {
            "name": f"{conn} ({number})", "number": number, "node": self.node, "vhost": VHOST,
            "user": (self.processes.get(owner) or {}).get("user"),
            "state": p.get("state"), "confirm": mode == "confirm", "transactional": mode == "tx",
            "messages_unconfirmed": int(p.get("unconfirmed") or 0),
            "messages_unacknowledged": self.channel_unacked(owner, p),
            "prefetch_count": int(p.get("prefetch_count") or 0),
            "global_prefetch_count": int(p.get("global_prefetch_count") or 0),
            "consumer_count": int(p.get("consumer_count") or 0),
            "connection_details": {"name": conn, "peer_host": peer_host, "peer_port": peer_port},
            "message_stats": self.stats(("channel", name), channel_counters(p)),
            "creditflow": {**self.process_extra(name, p), "connection_process": owner},
        }

    def channel_unacked(self, owner: str, p: dict) -> int:
        """Deliveries on the channel not yet acked: its reader counts them (it assigns the delivery tags)."""
        if "unacked" in p:
            return int(p.get("unacked") or 0)
        by_channel = (self.processes.get(owner) or {}).get("channel_unacked") or {}
        return int(by_channel.get(str(int(p.get("number") or 0))) or 0)

    def channel_details(self, proc: str, number: int) -> dict:
        """RabbitMQ's ``channel_details`` of a consumer on channel ``number`` (process ``proc``)."""
        owner = self.channel_owner(proc, self.processes.get(proc) or {})
        conn = self.connection_name(owner)
        peer_host, peer_port, _, _ = parse_peer(conn)
        return {"name": f"{conn} ({number})", "number": number, "connection_name": conn,
                "peer_host": peer_host, "peer_port": peer_port,
                "user": (self.processes.get(owner) or {}).get("user")}

    def channels(self) -> list[dict]:
        return [self.channel(name, p) for name, p in self.live("channel")]

    # /api/queues
    def queue(self, name: str, definition: dict, detail: bool = False) -> dict:
        proc = definition.get("proc") or f"queue-{name}"
        p = self.processes.get(proc) or {}
        alive = bool(p.get("alive"))
        ready = int(p.get("messages") or 0) if alive else 0
        unacked = int(p.get("unacked") or 0) if alive else 0
        depths = {"messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked}
        state = "stopped" if definition.get("down") else (p.get("state") if alive else "down")
        out = {
            "name": name, "vhost": VHOST, "node": self.node, "type": "classic", "state": state,
            **{k: v for key, value in depths.items()
               for k, v in ((key, value), (f"{key}_details", details(self.rate("queue", name, key))))},
            "message_bytes": int(p.get("message_bytes") or 0),
            "message_bytes_ready": int(p.get("message_bytes") or 0),
            "memory": int(p.get("memory") or p.get("message_bytes") or 0),
            "messages_paged_out": int(p.get("paged_messages") or 0),
            "consumers": int(p.get("consumers") or 0) if alive else 0,
            "durable": bool(definition.get("durable")), "auto_delete": bool(definition.get("auto_delete")),
            "exclusive": bool(definition.get("exclusive")), "arguments": definition.get("arguments") or {},
            "policy": None, "operator_policy": None, "effective_policy_definition": {},
            "message_stats": self.stats(("queue", name), queue_counters(p)) if alive else {},
            "creditflow": {**self.process_extra(proc, p), "paging": bool(p.get("paging")),
                           "awaiting_confirm": int(p.get("awaiting_confirm") or 0)},
        }
        if detail:
            out["consumer_details"] = self.consumers_of(name, p)
        return out

    def queues(self) -> list[dict]:
        return [self.queue(name, d) for name, d in sorted((self.status.get("queues") or {}).items())]

    def find_queue(self, vhost: str, name: str) -> dict | None:
        definition = (self.status.get("queues") or {}).get(name)
        if vhost != VHOST or definition is None:
            return None
        return self.queue(name, definition, detail=True)

    # /api/consumers
    def consumers_of(self, queue: str, p: dict) -> list[dict]:
        """The queue's consumers as it reports them (``consumer_details``, at most
        ``schema.CONSUMER_DETAILS_KEPT``); those it left out, or all of them from a queue that reports
        only a count, are entries without tag or channel."""
        if not p.get("alive"):
            return []
        listed = p.get("consumer_details")
        listed = listed if isinstance(listed, list) else []
        out = [{"queue": {"name": queue, "vhost": VHOST}, "consumer_tag": c.get("consumer_tag"),
                "channel_details": self.channel_details(str(c.get("channel") or ""), int(c.get("channel_number") or 0)),
                "ack_required": c.get("ack_required"), "prefetch_count": c.get("prefetch_count"),
                "exclusive": c.get("exclusive"), "active": True, "activity_status": "up", "arguments": {}}
               for c in listed]
        unnamed = max(0, int(p.get("consumers") or 0) - len(out))
        return out + [{"queue": {"name": queue, "vhost": VHOST}, "consumer_tag": None, "channel_details": {},
                       "ack_required": None, "prefetch_count": None, "exclusive": None, "active": True,
                       "activity_status": "up", "arguments": {}} for _ in range(unnamed)]

    def consumers(self) -> list[dict]:
        out = []
        for name, d in sorted((self.status.get("queues") or {}).items()):
            out += self.consumers_of(name, self.processes.get(d.get("proc") or f"queue-{name}") or {})
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
        for name, p in self.live("channel"):
            shown[name] = f"{self.connection_name(self.channel_owner(name, p))} ({int(p.get('number') or 0)})"
        for qname, d in (self.status.get("queues") or {}).items():
            shown[d.get("proc") or f"queue-{qname}"] = qname
        return [{"name": name, "kind": p.get("kind"), "state": p.get("state"), "alive": bool(p.get("alive")),
                 "object": shown.get(name), **{k: v for k, v in self.process_extra(name, p).items()
                                                if k not in ("process", "process_state")}}
                for name, p in sorted(self.processes.items()) if p.get("alive")]

    def links_view(self) -> list[dict]:
        out = []
        for name, link in sorted((self.status.get("links") or {}).items()):
            sender, _, receiver = name.partition("->")
            sent = int(link.get("sent") or 0)
            out.append({"name": name, "sender": sender, "receiver": receiver, "credit": link.get("credit"),
                        "in_flight": int(link.get("in_flight") or 0),
                        "max_in_flight": int(link.get("max_in_flight") or 0), "overflow": int(link.get("overflow") or 0),
                        "records": int(link.get("records") or 0), "sent": sent,
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
             "arguments": {}, "properties_key": q} for q in sorted(queues)]
    for b in topology.get("bindings") or []:
        key = _text(b["routing_key"])
        rows.append({"source": _text(b["source"]), "vhost": VHOST, "destination": _text(b["destination"]),
                     "destination_type": "exchange" if b["to_exchange"] else "queue", "routing_key": key,
                     "arguments": b.get("arguments") or {}, "properties_key": key or "~"})
    return rows
