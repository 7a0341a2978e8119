"""What a load run does, in RabbitMQ PerfTest's terms.

=====================  ===========  ==========================================
field                  PerfTest     meaning
=====================  ===========  ==========================================
producers              -x           publisher processes (one connection each)
consumers              -y           consumer processes (one connection each)
rate                   -r           msg/s per producer; None = as fast as possible
size                   -s           body bytes (at least ``BODY_HEADER_BYTES``)
persistent             -f persistent  delivery_mode 2
mandatory              -f mandatory   unroutable messages come back (basic.return)
confirm                -c           max unconfirmed per producer; None = no confirms
prefetch               -q           basic.qos prefetch_count; 0 = unlimited
autoack                -a           consume with no_ack
duration_s             -z           seconds of publishing
drain_s                --drain-s    after -z, seconds consumers may take to empty the queues
consumer_latency_us    -L           time a consumer spends on each message
queue                  -u           queue name
queues                 (fan-out)    several queues bound to one fanout exchange
=====================  ===========  ==========================================

Queues are declared durable and not auto-delete (``durable=False`` for a
transient queue). With one queue, publishers use the default exchange; with
several, they publish to a fanout exchange bound to all of them, and
consumers are spread over the queues round-robin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.loadgen import LoadgenError

BODY_HEADER_BYTES = 20            # u64 intended send ns | u64 sequence | u32 producer id
MAX_BODY_BYTES = 128 * 1024 * 1024
MIN_FRAME_MAX_BYTES = 4096
MAX_BATCH_MESSAGES = 4096
MAX_PREFETCH = 65535              # basic.qos prefetch_count is a u16
MAX_HEARTBEAT_S = 65535


class InvalidLoadConfig(LoadgenError, ValueError):
    """Raised when a load option is out of range; the CLI prints the reason and exits 2."""


def _int(name: str, value, low: int, high: int | None = None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLoadConfig(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise InvalidLoadConfig(f"{name} must be {bounds}{why}, got {value}")


def _name(what: str, value) -> None:
    if not isinstance(value, str) or not value or len(value.encode("utf-8")) > 255:
        raise InvalidLoadConfig(f"{what} must be a name of 1 to 255 bytes, got {value!r}")


def _seconds(value) -> bool:
    """A finite number (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class LoadConfig:
    producers: int = 1
    consumers: int = 1
    rate: float | None = None
    size: int = 12
    persistent: bool = False
    mandatory: bool = False
    confirm: int | None = None
    prefetch: int = 0
    autoack: bool = False
    duration_s: float = 10.0
    consumer_latency_us: int = 0
    queue: str = "creditflow-perf"
    queues: tuple[str, ...] = ()          # empty means (queue,)
    exchange: str = "creditflow-perf-fanout"
    durable: bool = True
    host: str = "127.0.0.1"
    port: int = 5672
    user: str = "guest"
    password: str = "guest"
    vhost: str = "/"
    frame_max: int = 131072
    heartbeat_s: int = 60
    batch: int = 64                       # publish frame-sets per socket write when unthrottled
    drain_s: float = 30.0                 # after -z: at most this long for the broker to hand everything on

    def __post_init__(self) -> None:
        _int("producers (-x)", self.producers, 0)
        _int("consumers (-y)", self.consumers, 0)
        if self.producers + self.consumers == 0:
            raise InvalidLoadConfig("a run needs at least one producer or consumer")
        if self.rate is not None:
            if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not self.rate > 0:
                raise InvalidLoadConfig(f"rate (-r) must be a positive number of msg/s, got {self.rate!r}")
        _int("size (-s)", self.size, 0, MAX_BODY_BYTES, " bytes (128 MiB, the largest body this load generator sends)")
        if self.confirm is not None:
            _int("max unconfirmed (-c)", self.confirm, 1)
        _int("prefetch (-q)", self.prefetch, 0, MAX_PREFETCH, " (basic.qos prefetch_count is 16 bits)")
        _int("consumer latency (-L)", self.consumer_latency_us, 0)
        for flag in ("persistent", "mandatory", "autoack", "durable"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidLoadConfig(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if not _seconds(self.duration_s) or not self.duration_s > 0:
            raise InvalidLoadConfig(f"duration (-z) must be a positive number of seconds, got {self.duration_s!r}")
        if not _seconds(self.drain_s) or not self.drain_s >= 0:
            raise InvalidLoadConfig(f"drain time (--drain-s) must be 0 or more seconds, got {self.drain_s!r}")
        _name("queue (-u)", self.queue)
        queues = (self.queue,) if not self.queues else self.queues
        if isinstance(queues, str):
            raise InvalidLoadConfig(f"queues must be a list of names, got the string {queues!r}")
        queues = tuple(queues)
        for q in queues:
            _name("queue", q)
        if len(set(queues)) != len(queues):
            raise InvalidLoadConfig(f"queues must be distinct, got {list(queues)}")
        object.__setattr__(self, "queues", queues)
        if len(queues) > 1:
            _name("exchange", self.exchange)
        if not isinstance(self.host, str) or not self.host:
            raise InvalidLoadConfig(f"host must be a host name or address, got {self.host!r}")
        _int("port", self.port, 1, 65535)
        for what in ("user", "password", "vhost"):
            if not isinstance(getattr(self, what), str):
                raise InvalidLoadConfig(f"{what} must be a string, got {getattr(self, what)!r}")
        _int("frame_max", self.frame_max, MIN_FRAME_MAX_BYTES, 2**32 - 1)
        _int("heartbeat_s", self.heartbeat_s, 0, MAX_HEARTBEAT_S)
        _int("batch", self.batch, 1, MAX_BATCH_MESSAGES)

    @property
    def body_bytes(self) -> int:
        """Body size actually sent: ``size``, raised to fit the body header."""
        return max(self.size, BODY_HEADER_BYTES)

    @property
    def fanout(self) -> bool:
        return len(self.queues) > 1

    def consumer_queue(self, index: int) -> str:
        """The queue consumer ``index`` reads (round-robin over ``queues``)."""
        return self.queues[index % len(self.queues)]

    def consumers_on(self, queue: str) -> int:
        return sum(1 for i in range(self.consumers) if self.consumer_queue(i) == queue)

    @property
    def copies_consumed(self) -> int:
        """Deliveries to expect per published message: one per queue that has a consumer."""
        return sum(1 for q in self.queues if self.consumers_on(q))
