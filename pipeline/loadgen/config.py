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
queues                 --queue-pattern  the queues (``%d`` from --queue-pattern-from to -to)
exchange               -e           exchange; None: the default exchange for one queue,
                                    ``creditflow-perf-fanout`` for several
exchange_type          -t           direct, fanout, topic, headers (None: direct if
                                    ``exchange`` is named, else as above)
routing_key            -k           see ``topology``; None: each producer its queue
queue_args             --queue-args queue.declare arguments, ((name, value), ...)
auto_delete            --auto-delete  queues go when their last consumer does
multi_ack_every        -A           consumers ack every N messages (0: each read)
pmessages              -C           messages per producer, then it stops (0: -z decides)
cmessages              -D           messages per consumer, then it stops (0: no limit)
variable_rate          --variable-rate  ((rate, seconds), ...) repeated in turn
variable_size          --variable-size  ((bytes, seconds), ...) repeated in turn
variable_latency       --variable-latency  ((µs, seconds), ...) consumer latency, in turn
start_delay_s          --producer-random-start-delay  each producer waits up to this long
consumer_rate          --consumer-rate  msg/s per consumer; None = as fast as possible
=====================  ===========  ==========================================

Queues are declared durable and not auto-delete (``durable=False`` for a
transient queue). Where publishes go is ``topology``'s table: with one
queue and no exchange, the default exchange; with several and no exchange
type, a fanout exchange bound to all of them. Consumers are spread over the
queues round-robin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.loadgen import LoadgenError
from pipeline.loadgen.topology import DEFAULT, DIRECT, EXCHANGE_TYPES, FANOUT, Topology

BODY_HEADER_BYTES = 20            # PerfTest's 12 (seq, ns) + producer id + high sequence bits
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
    exchange: str | None = None
    exchange_type: str | None = None
    routing_key: str | None = None
    queue_args: tuple = ()                # ((name, value), ...) for queue.declare
    auto_delete: bool = False
    multi_ack_every: int = 0
    pmessages: int = 0
    cmessages: int = 0
    variable_rate: tuple = ()             # ((msg/s, seconds), ...)
    variable_size: tuple = ()             # ((bytes, seconds), ...)
    variable_latency: tuple = ()          # ((µs, seconds), ...)
    start_delay_s: float = 0.0
    consumer_rate: float | None = None
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
        if self.exchange is not None and self.exchange != "":
            _name("exchange (-e)", self.exchange)
        if self.exchange_type is not None and self.exchange_type not in EXCHANGE_TYPES:
            raise InvalidLoadConfig(f"exchange type (-t) must be one of {', '.join(EXCHANGE_TYPES)}, "
                                    f"got {self.exchange_type!r}")
        if self.exchange == "" and self.exchange_type not in (None, DIRECT):
            raise InvalidLoadConfig(f"the default exchange is a direct exchange; -t {self.exchange_type} needs "
                                    "a named exchange (-e)")
        if self.routing_key is not None and (not isinstance(self.routing_key, str)
                                             or len(self.routing_key.encode("utf-8")) > 255):
            raise InvalidLoadConfig(f"routing key (-k) must be at most 255 bytes, got {self.routing_key!r}")
        for pair in self.queue_args:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]):
                raise InvalidLoadConfig(f"queue arguments must be (name, value) pairs, got {pair!r}")
        _int("multi-ack-every (-A)", self.multi_ack_every, 0)
        if self.multi_ack_every and self.prefetch and self.multi_ack_every > self.prefetch:
            raise InvalidLoadConfig(f"--multi-ack-every {self.multi_ack_every} is above the prefetch (-q "
                                    f"{self.prefetch}): consumers would wait for messages the broker never sends")
        if self.multi_ack_every and self.autoack:
            raise InvalidLoadConfig("--multi-ack-every has nothing to acknowledge with -a (no-ack)")
        _int("messages per producer (-C)", self.pmessages, 0)
        _int("messages per consumer (-D)", self.cmessages, 0)
        for what, steps, low in (("--variable-rate", self.variable_rate, 0), ("--variable-size", self.variable_size, 0),
                                 ("--variable-latency", self.variable_latency, 0)):
            for step in steps:
                if not (isinstance(step, tuple) and len(step) == 2 and _seconds(step[0]) and step[0] >= low
                        and _seconds(step[1]) and step[1] > 0):
                    raise InvalidLoadConfig(f"{what} steps must be VALUE:SECONDS with SECONDS above 0, got {step!r}")
        for size, _ in self.variable_size:
            _int("--variable-size bytes", size, 0, MAX_BODY_BYTES)
        if self.variable_rate and not any(rate for rate, _ in self.variable_rate):
            raise InvalidLoadConfig("--variable-rate steps are all 0 msg/s: nothing would be published")
        if self.variable_rate and self.rate is not None:
            raise InvalidLoadConfig("-r and --variable-rate both set the rate: give one")
        if self.variable_latency and self.consumer_latency_us:
            raise InvalidLoadConfig("-L and --variable-latency both set the consumer latency: give one")
        if not _seconds(self.start_delay_s) or self.start_delay_s < 0:
            raise InvalidLoadConfig(f"--producer-random-start-delay must be 0 or more seconds, got {self.start_delay_s!r}")
        if self.consumer_rate is not None and (not _seconds(self.consumer_rate) or not self.consumer_rate > 0):
            raise InvalidLoadConfig(f"consumer rate (--consumer-rate) must be a positive number of msg/s, "
                                    f"got {self.consumer_rate!r}")
        for flag in ("auto_delete",):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidLoadConfig(f"{flag} must be true or false, got {getattr(self, flag)!r}")
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
    def topology(self) -> Topology:
        """Exchange, bindings and routes (see ``topology``), with the defaults resolved."""
        kind, name = self.exchange_type, self.exchange
        if name is None and kind is None and self.routing_key is not None:
            name, kind = "creditflow-perf-direct", DIRECT     # PerfTest: -k binds the queues with it
        elif name is None and kind is None:
            name, kind = ("", DEFAULT) if len(self.queues) == 1 else ("creditflow-perf-fanout", FANOUT)
        elif name is None:
            name = f"creditflow-perf-{kind}"
        elif name == "":
            kind = DEFAULT
        elif kind is None:
            kind = DIRECT
        return Topology(name, kind, self.queues, self.routing_key)

    @property
    def fanout(self) -> bool:
        return self.topology.exchange_type == FANOUT

    @property
    def max_body_bytes(self) -> int:
        """The largest body a producer sends (``size`` or the largest ``--variable-size`` step)."""
        return max([self.body_bytes] + [max(s, BODY_HEADER_BYTES) for s, _ in self.variable_size])

    @property
    def queues_may_drop(self) -> str:
        """Why the queues may drop accepted messages by design ("" when they may not): a length limit
        that drops the head (RabbitMQ's default overflow) or a message TTL."""
        args = dict(self.queue_args)
        overflow = args.get("x-overflow", "drop-head")
        if overflow in ("reject-publish", "reject-publish-dlx") and not self.confirm and (
                "x-max-length" in args or "x-max-length-bytes" in args):
            return f"x-overflow={overflow} without confirms (-c): the broker drops what it refuses"
        if overflow == "drop-head":
            for limit in ("x-max-length", "x-max-length-bytes"):
                if limit in args:
                    return f"{limit}={args[limit]} (drop-head)"
        if "x-message-ttl" in args:
            return f"x-message-ttl={args['x-message-ttl']}"
        return ""

    def producer_queues(self, index: int) -> tuple[str, ...]:
        """The queues producer ``index``'s publishes are routed to."""
        return self.topology.reaches(index)

    def consumer_queue(self, index: int) -> str:
        """The queue consumer ``index`` reads (round-robin over ``queues``)."""
        return self.queues[index % len(self.queues)]

    def consumers_on(self, queue: str) -> int:
        return sum(1 for i in range(self.consumers) if self.consumer_queue(i) == queue)

    @property
    def copies_consumed(self) -> int:
        """Deliveries to expect per message of producer 0: one per queue it reaches that has a consumer."""
        return sum(1 for q in self.producer_queues(0) if self.consumers_on(q))
