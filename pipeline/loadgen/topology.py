"""Where a load run's publishes go: exchange, bindings, routing keys, and the queues each reaches.

PerfTest's flags (``-e``, ``-t``, ``-k``, ``--queue-pattern``) map onto one
``Topology``; the publisher declares and binds from it, and the accounting
asks it which queues a producer's publishes reach, so that "expected" counts
one copy per queue a publish is routed to, not one per queue in the run.

===========  =============================================  =======================================
exchange     each queue is bound with                       producer ``i`` publishes with key
===========  =============================================  =======================================
default      (no binding: the queue's name routes)          ``-k``, else queue ``i mod n``
fanout       ""                                             ``-k`` or "" (every queue gets a copy)
direct       ``-k`` if given, else the queue's name          ``-k``, else queue ``i mod n``
topic        ``-k`` if given, else the queue's name          ``-k``, else queue ``i mod n``
headers      x-match=all, ``creditflow-route`` = ``-k`` or   header ``creditflow-route`` = ``-k``,
             the queue's name                               else queue ``i mod n``
===========  =============================================  =======================================

So with ``-k`` every queue gets every publish (a fan-out through any
exchange type); without it producers are spread over the queues round-robin
(PerfTest's queue sequences). Consumers are spread the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT, DIRECT, FANOUT, TOPIC, HEADERS = "", "direct", "fanout", "topic", "headers"
EXCHANGE_TYPES = (DIRECT, FANOUT, TOPIC, HEADERS)
ROUTE_HEADER = "creditflow-route"


@dataclass(frozen=True)
class Binding:
    queue: str
    routing_key: str
    arguments: dict


@dataclass(frozen=True)
class Route:
    """How one producer publishes: exchange, routing key, headers (None: none)."""
    exchange: str
    routing_key: str
    headers: dict | None


@dataclass(frozen=True)
class Topology:
    exchange: str                 # "" is the default exchange
    exchange_type: str            # DEFAULT for the default exchange
    queues: tuple[str, ...]
    routing_key: str | None = None

    def bindings(self) -> list[Binding]:
        if self.exchange_type == DEFAULT:
            return []
        if self.exchange_type == HEADERS:
            return [Binding(q, "", {"x-match": "all", ROUTE_HEADER: self.routing_key or q}) for q in self.queues]
        key = "" if self.exchange_type == FANOUT else None
        return [Binding(q, key if key is not None else (self.routing_key or q), {}) for q in self.queues]

    def route(self, producer: int) -> Route:
        own = self.routing_key if self.routing_key is not None else self.queues[producer % len(self.queues)]
        if self.exchange_type == FANOUT:
            return Route(self.exchange, self.routing_key or "", None)
        if self.exchange_type == HEADERS:
            return Route(self.exchange, "", {ROUTE_HEADER: own})
        return Route(self.exchange, own, None)

    def reaches(self, producer: int) -> tuple[str, ...]:
        """The queues a publish of producer ``producer`` is routed to."""
        if self.exchange_type == FANOUT:
            return self.queues
        if self.exchange_type == DEFAULT:
            key = self.route(producer).routing_key
            return (key,) if key in self.queues else ()
        if self.routing_key is not None:       # every queue is bound with the key it is published with
            return self.queues
        return (self.queues[producer % len(self.queues)],)

