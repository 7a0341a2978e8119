"""What a load run does, in RabbitMQ PerfTest's terms (-x -y -r -s -f -c -q -a -z -L -u)."""

from __future__ import annotations

from dataclasses import dataclass, field

BODY_HEADER_BYTES = 20       # u64 intended send time ns | u64 sequence | u32 producer id


class InvalidLoadConfig(ValueError):
    """Raised when load options are out of range; the CLI prints the reason and exits 2."""


@dataclass(frozen=True)
class LoadConfig:
    producers: int = 1
    consumers: int = 1
    rate: int | None = None              # msg/s per producer; None = as fast as possible
    size: int = 12                       # body bytes (at least BODY_HEADER_BYTES are used)
    persistent: bool = False
    confirm: int | None = None           # max unconfirmed per producer; None = no confirms
    prefetch: int = 0                    # 0 = unlimited
    autoack: bool = False
    duration_s: float = 10.0
    consumer_latency_us: int = 0
    queue: str = "creditflow-perf"
    queues: tuple[str, ...] = field(default=())
    durable: bool | None = None          # default: durable when persistent
    host: str = "127.0.0.1"
    port: int = 5672
    frame_max: int = 131072
    batch: int = 64                      # publishes per socket write when unthrottled
    drain_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.producers < 0 or self.consumers < 0:
            raise InvalidLoadConfig("producers and consumers must not be negative")
        if self.rate is not None and self.rate <= 0:
            raise InvalidLoadConfig(f"rate must be positive, got {self.rate}")
        if self.size < 0:
            raise InvalidLoadConfig(f"size must not be negative, got {self.size}")
        if self.confirm is not None and self.confirm <= 0:
            raise InvalidLoadConfig(f"max unconfirmed must be positive, got {self.confirm}")
        if self.duration_s <= 0:
            raise InvalidLoadConfig(f"duration must be positive, got {self.duration_s}")
        if not self.queue or len(self.queue.encode()) > 255:
            raise InvalidLoadConfig("queue name must be 1 to 255 bytes")

    @property
    def body_bytes(self) -> int:
        return max(self.size, BODY_HEADER_BYTES)

    @property
    def target_queues(self) -> tuple[str, ...]:
        return self.queues or (self.queue,)

    @property
    def queue_durable(self) -> bool:
        return self.persistent if self.durable is None else self.durable
