"""LoadConfig keeps PerfTest's defaults and refuses bad options with a reason the CLI can print."""

from __future__ import annotations

import pytest

from pipeline.loadgen.config import BODY_HEADER_BYTES, InvalidLoadConfig, LoadConfig


def test_defaults_are_perftests():
    cfg = LoadConfig()
    assert (cfg.producers, cfg.consumers, cfg.rate, cfg.size, cfg.prefetch) == (1, 1, None, 12, 0)
    assert (cfg.persistent, cfg.autoack, cfg.confirm, cfg.consumer_latency_us) == (False, False, None, 0)
    assert cfg.drain_s == 30.0 and LoadConfig(drain_s=0).drain_s == 0
    assert cfg.queue == "creditflow-perf" and cfg.queues == ("creditflow-perf",)
    assert cfg.durable is True and not cfg.fanout


def test_a_small_size_still_carries_the_body_header():
    assert LoadConfig(size=12).body_bytes == BODY_HEADER_BYTES == 20
    assert LoadConfig(size=0).body_bytes == 20
    assert LoadConfig(size=1000).body_bytes == 1000


def test_fan_out_spreads_consumers_and_counts_copies():
    cfg = LoadConfig(consumers=3, queues=["a", "b"])
    assert cfg.queues == ("a", "b") and cfg.fanout
    assert [cfg.consumer_queue(i) for i in range(3)] == ["a", "b", "a"]
    assert cfg.consumers_on("a") == 2 and cfg.consumers_on("b") == 1
    assert cfg.copies_consumed == 2
    assert LoadConfig(consumers=1, queues=("a", "b")).copies_consumed == 1


def test_the_config_is_frozen():
    with pytest.raises(AttributeError):
        LoadConfig().size = 100


@pytest.mark.parametrize("kwargs, message", [
    ({"producers": -1}, r"producers \(-x\) must be at least 0, got -1"),
    ({"producers": 0, "consumers": 0}, "at least one producer or consumer"),
    ({"consumers": 1.5}, r"consumers \(-y\) must be an integer"),
    ({"rate": 0}, r"rate \(-r\) must be a positive number"),
    ({"rate": -5}, r"rate \(-r\) must be a positive number"),
    ({"size": -1}, r"size \(-s\) must be between 0 and"),
    ({"confirm": 0}, r"max unconfirmed \(-c\) must be at least 1, got 0"),
    ({"prefetch": 70000}, r"prefetch \(-q\) must be between 0 and 65535 \(basic.qos prefetch_count is 16 bits\)"),
    ({"consumer_latency_us": -3}, r"consumer latency \(-L\)"),
    ({"duration_s": 0}, r"duration \(-z\) must be a positive number of seconds"),
    ({"drain_s": -1}, r"drain time \(--drain-s\) must be 0 or more seconds, got -1"),
    ({"drain_s": float("nan")}, r"drain time \(--drain-s\) must be 0 or more seconds"),
    ({"size": 200_000_000}, r"size \(-s\) must be between 0 and 134217728 bytes"),
    ({"queue": ""}, r"queue \(-u\) must be a name of 1 to 255 bytes"),
    ({"queue": "q" * 256}, r"queue \(-u\) must be a name of 1 to 255 bytes"),
    ({"queues": "ab"}, "queues must be a list of names"),
    ({"queues": ("a", "a")}, "queues must be distinct"),
    ({"port": 0}, "port must be between 1 and 65535"),
    ({"frame_max": 1000}, "frame_max must be between 4096"),
    ({"heartbeat_s": -1}, "heartbeat_s must be between 0 and 65535"),
    ({"batch": 0}, "batch must be between 1 and 4096"),
    ({"persistent": "yes"}, "persistent must be true or false"),
])
def test_bad_values_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(InvalidLoadConfig, match=message):
        LoadConfig(**kwargs)


def test_the_refusal_is_a_value_error():
    with pytest.raises(ValueError):
        LoadConfig(rate=-1)
