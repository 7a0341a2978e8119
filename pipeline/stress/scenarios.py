"""Running the stress scenarios: real brokers, real load, figures measured for the judges.

A scenario runs either against a broker it starts itself in its run
directory (``BrokerConfig``, started and stopped by ``pipeline.runner``), or
against the broker a ``--uri`` names, where it only connects. Load scenarios
go through ``runner.execute`` / ``execute_remote``, so their run directory is
``creditflow run``'s (config.json, seconds.jsonl, summary.json, the broker's
telemetry); raw-client scenarios start the broker with ``runner.start_broker``
and write config.json and summary.json themselves. Every summary.json gets a
``stress`` entry: the facts the verdict was judged on, and the verdict.

Each ``run_<scenario>(place)`` returns the facts ``catalogue.judge`` needs.
Queues are named ``stress-<scenario>...``; on a broker given by ``--uri``
they are deleted at the end, so nothing is left behind there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import socket
import time
from dataclasses import asdict, replace

from pipeline import runner
from pipeline.ctlclient import CtlClient, wait_for_broker
from pipeline.loadgen.client import ClientError, ServerClosed
from pipeline.loadgen.config import LoadConfig
from pipeline.stress import ScenarioUnavailable, StressError, catalogue
from pipeline.stress.rawclient import StressClient
from pipeline.broker.supervisor import BrokerConfig

WATCHDOG = {"memory_limit": "0.6", "disk_limit": "50MB", "strategy": "rss", "memory_interval_ms": 100}
MIB = 1024 * 1024
SETTLE_S = 5.0                  # churn: how long the broker may take to end the stages of closed connections
STEADY_S = 0.5                  # ... and the count before it: unchanged this long
HUGE_MAX_BYTES = 4 * MIB        # huge-messages: the broker's --max-message-bytes
CHURN_CYCLES = 150
FSYNC_DELAY_MS = 300
STORE_DELAY_US = 1000
SETTLE_AFTER_BIND_S = 3.0       # fanout-slow-queue: rates are compared from this long after the bind


class Place:
    """Where a scenario runs: its run directory and, with ``--uri``, the broker's address (else None)."""

    def __init__(self, run_dir: str, address=None):
        self.run_dir = run_dir
        self.address = address

    def queue(self, scenario: str, suffix: str = "") -> str:
        return f"stress-{scenario}{suffix}"


# -- helpers: load runs ----------------------------------------------------------------------------
def _aimed(load: LoadConfig, address) -> LoadConfig:
    return replace(load, host=address.host, port=address.port, user=address.user, password=address.password,
                   vhost=address.vhost)


def run_load(place: Place, load: LoadConfig, *, run_dir: str | None = None, on_second=None, **broker):
    """``(summary, result)`` of ``load`` on a broker of our own (with ``broker``'s options) or the one
    ``place`` names. ``on_second(rep, status, ctl)``; status and ctl are None over --uri."""
    run_dir = run_dir or place.run_dir
    if place.address is None:
        cfg = BrokerConfig(data_dir=run_dir, port=0, watchdog=dict(WATCHDOG), **broker)
        return runner.execute(cfg, load, on_second=on_second)
    each = (lambda rep, _line, _ctl: on_second(rep, None, None)) if on_second else None
    try:
        return runner.execute_remote(_aimed(load, place.address), run_dir, on_second=each)
    finally:
        delete_queues(place.address, load.queues)


def delete_queues(address, queues) -> None:
    """Delete what a scenario declared on a broker it did not start."""
    try:
        client = connect(address, "creditflow-stress cleanup")
    except (ClientError, OSError):
        return
    try:
        for q in queues:
            client.queue_delete(q)
    finally:
        client.close()


def connect(address, name: str, port: int | None = None) -> StressClient:
    return StressClient(address.host, port or address.port, name=name, user=address.user,
                        password=address.password, vhost=address.vhost)


def max_flow(summary: dict, kind: str = "reader") -> float:
    """The largest share of its time a process of ``kind`` spent in flow (of readers, those that took
    publishes: ``runner.summarize`` times their first stop only for them)."""
    shares = [p["flow_fraction"] for p in summary.get("processes", {}).values()
              if p.get("kind") == kind and (kind != "reader" or "first_stop_after_first_publish_s" in p)]
    return max(shares, default=0.0)


def queue_depth(status: dict | None, queue: str) -> int | None:
    p = (status or {}).get("processes", {}).get(f"queue-{queue}")
    if not p or not p.get("alive"):
        return None
    return (p.get("messages") or 0) + (p.get("unacked") or 0)


def counts(summary: dict) -> dict:
    return {k: summary[k] for k in ("published", "confirmed", "delivered", "undelivered", "lost")} | \
        {"errors": list(summary.get("errors", []))}


# -- helpers: raw-client scenarios -----------------------------------------------------------------
class Broker:
    """A broker of our own for a raw-client scenario (or the --uri one): its port, its ctl if ours."""

    def __init__(self, place: Place, **options):
        self.place = place
        self.options = options
        self.pid = None
        self.ctl = None
        self.exit_code = None

    def __enter__(self):
        if self.place.address is not None:
            self.address = self.place.address
            return self
        from pipeline.loadgen.uri import BrokerAddress
        os.makedirs(self.place.run_dir, exist_ok=True)
        cfg = BrokerConfig(data_dir=self.place.run_dir, port=0, watchdog=dict(WATCHDOG), **self.options)
        self.pid = runner.start_broker(cfg)
        try:
            info = wait_for_broker(self.place.run_dir, pid=self.pid)
            self.address = BrokerAddress("127.0.0.1", info["port"])
            self.ctl = CtlClient(self.place.run_dir)
        except BaseException:
            self.exit_code = runner.stop_broker(self.pid, self.place.run_dir)
            raise
        return self

    def status(self) -> dict | None:
        return self.ctl.request("status") if self.ctl is not None else None

    def client(self, name: str) -> StressClient:
        return connect(self.address, name)

    def __exit__(self, *exc):
        if self.ctl is not None:
            self.ctl.close()
        if self.pid is not None:
            self.exit_code = runner.stop_broker(self.pid, self.place.run_dir)


def write_json(run_dir: str, name: str, data: dict) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, name), "w") as f:
        json.dump(data, f, indent=2, default=str)


def live_stages(status: dict) -> int:
    return sum(1 for p in status.get("processes", {}).values() if p.get("alive"))


def steady_stages(broker: Broker, timeout_s: float = SETTLE_S) -> int:
    """Live stages once their count has held for ``STEADY_S``: the broker lists a stage once it has
    reported, so a count taken straight after a declare could miss the new queue (on a loaded machine)
    and a churn would then seem to leave one stage behind."""
    deadline = time.monotonic() + timeout_s
    n, since = live_stages(broker.status()), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = live_stages(broker.status())
        if now != n:
            n, since = now, time.monotonic()
        elif time.monotonic() - since >= STEADY_S:
            break
    return n


def wait_stages(broker: Broker, target: int, timeout_s: float = SETTLE_S) -> tuple[int, dict]:
    """Live stages once they are back to ``target`` (or when ``timeout_s`` is up), with that status."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = broker.status()
        n = live_stages(status)
        if n <= target or time.monotonic() > deadline:
            return n, status
        time.sleep(0.05)


# -- the scenarios ---------------------------------------------------------------------------------
def run_slow_consumer(place: Place) -> dict:
    q = place.queue("slow-consumer")
    peak = {"depth": 0}

    def each_second(rep, status, _ctl):
        depth = queue_depth(status, q)
        peak["depth"] = max(peak["depth"], depth if depth is not None else rep.published - rep.delivered)

    load = LoadConfig(producers=2, consumers=1, consumer_latency_us=300, prefetch=50, duration_s=4, drain_s=3,
                      queue=q)
    summary, _ = run_load(place, load, on_second=each_second)
    return {**counts(summary), "backlog_peak": peak["depth"],
            "reader_flow": max_flow(summary) if place.address is None else None}


def run_many_publishers(place: Place) -> dict:
    load = LoadConfig(producers=20, consumers=2, rate=100, confirm=20, duration_s=4, drain_s=15,
                      queue=place.queue("many-publishers"))
    summary, _ = run_load(place, load)
    return {**counts(summary), "publishers": load.producers}


def run_slow_disk(place: Place) -> dict:
    """No consumer: RabbitMQ confirms a persistent message once it is fsynced or once a consumer has
    acknowledged it, whichever comes first, so a consumer would hide the disk."""
    q = place.queue("slow-disk")
    load = LoadConfig(producers=1, consumers=0, size=8192, persistent=True, confirm=1000, duration_s=4, drain_s=3,
                      queue=q)
    base, _ = run_load(place, load, run_dir=os.path.join(place.run_dir, "baseline"))
    slow, _ = run_load(place, load, fsync_delay_ms=FSYNC_DELAY_MS)
    p50 = lambda s: (s.get("latency_us", {}).get("confirm") or {}).get("p50")     # noqa: E731
    held = ((slow["drain"].get("queues") or {}).get(q) or {}).get("messages")
    return {**counts(slow), "fsync_delay_ms": FSYNC_DELAY_MS, "base_confirm_p50_us": p50(base),
            "slow_confirm_p50_us": p50(slow), "reader_flow": max_flow(slow), "channel_flow": max_flow(slow, "channel"),
            "base_reader_flow": max_flow(base),
            "base_publish_rate": base["publish_rate"], "slow_publish_rate": slow["publish_rate"],
            "queued": held}


def run_alarm(place: Place) -> dict:
    marks = {}

    def each_second(rep, status, ctl):
        if "lowered" not in marks and rep.time_s >= 2:
            ctl.request("set_watermark", value="0")
            marks["lowered"] = (time.monotonic(), rep.published, rep.delivered)
        elif "lowered" in marks and "restored" not in marks and time.monotonic() - marks["lowered"][0] >= 2:
            ctl.request("set_watermark", value=WATCHDOG["memory_limit"])
            marks["restored"] = (time.monotonic(), rep.published, rep.delivered)

    load = LoadConfig(producers=1, consumers=1, rate=3000, consumer_latency_us=500, prefetch=100, duration_s=6,
                      drain_s=20, queue=place.queue("alarm"))
    summary, result = run_load(place, load, on_second=each_second)
    if "restored" not in marks:
        raise StressError("the run ended before the watermark was restored")
    from pipeline.demo import count_alarm_edges
    sets, clears = count_alarm_edges(os.path.join(place.run_dir, "broker.log"))
    events = [e for evs in result.blocked_events.values() for e in evs]
    (t0, p0, d0), (t1, p1, d1) = marks["lowered"], marks["restored"]
    return {**counts(summary), "alarm_sets": sets, "alarm_clears": clears,
            "blocked": sum(1 for e in events if e[1] == "blocked"),
            "unblocked": sum(1 for e in events if e[1] == "unblocked"),
            "alarm_seconds": t1 - t0, "sent_during_alarm": p1 - p0, "received_during_alarm": d1 - d0}


def run_fanout_slow_queue(place: Place) -> dict:
    fast = (place.queue("fanout", "-a"), place.queue("fanout", "-b"))
    slow = place.queue("fanout", "-slow")
    exchange = "creditflow-perf-fanout"
    seen = {"rates": [], "bound_at": None, "intake": []}

    def each_second(rep, status, _ctl):
        if seen["bound_at"] is None and rep.time_s >= 3:
            client = connect(place.address or _local(status), "creditflow-stress binder")
            try:
                client.queue_declare(slow, durable=True)
                client.queue_bind(slow, exchange)
            finally:
                client.close()
            seen["bound_at"] = rep.time_s
        else:
            seen["rates"].append((rep.time_s, rep.sent_rate, seen["bound_at"] is not None))
        p = status["processes"].get(f"queue-{slow}") if status else None
        if p and p.get("alive"):
            seen["intake"].append((rep.time_s, p["at_ns"], p.get("enqueued", 0)))

    load = LoadConfig(producers=1, consumers=2, rate=4000, size=8192, persistent=True, durable=False, queues=fast,
                      duration_s=9, drain_s=10, queue=fast[0])
    summary, _ = run_load(place, load, on_second=each_second, store_delay_us=STORE_DELAY_US)
    before = [r for t, r, bound in seen["rates"] if not bound]
    # the first seconds after the bind carry the burst the credit along the chain lets through
    settled = seen["bound_at"] + SETTLE_AFTER_BIND_S if seen["bound_at"] is not None else float("inf")
    after = [r for t, r, bound in seen["rates"] if bound and t >= settled]
    intake = [(at_ns, n) for t, at_ns, n in seen["intake"] if t >= settled - 1]
    if not before or not after or len(intake) < 2:
        raise StressError(f"too few seconds measured (before {len(before)}, after {len(after)}, "
                          f"slow queue {len(intake)})")
    (n0, e0), (n1, e1) = intake[0], intake[-1]
    return {**counts(summary), "rate_before": sum(before) / len(before), "rate_after": sum(after) / len(after),
            "slow_queue_rate": (e1 - e0) / ((n1 - n0) / 1e9) if n1 > n0 else 0.0,
            "reader_flow": max_flow(summary)}


def _local(status):
    from pipeline.loadgen.uri import BrokerAddress
    return BrokerAddress("127.0.0.1", status["port"])


def run_huge_messages(place: Place) -> dict:
    q = place.queue("huge-messages")
    sizes = (1, 131072 - 8, 131072 - 8 + 1, MIB, HUGE_MAX_BYTES)
    with Broker(place, max_message_bytes=HUGE_MAX_BYTES) as broker:
        publisher = broker.client("creditflow-stress huge publisher")
        consumer = broker.client("creditflow-stress huge consumer")
        try:
            publisher.queue_declare(q, durable=False)
            publisher.confirm_select()
            rng = random.Random(1)
            digests = []
            for tag, size in enumerate(sizes, 1):
                body = rng.randbytes(size)
                digests.append(hashlib.sha256(body).hexdigest())
                publisher.publish(q, body)
                publisher.wait_confirm(upto=tag)
            consumer.basic_consume(q, no_ack=True)
            got = [hashlib.sha256(consumer.next_delivery()).hexdigest() for _ in sizes]
            refused = None
            if place.address is None:
                publisher.publish(q, bytes(HUGE_MAX_BYTES + 1))
                try:
                    publisher.wait_confirm(upto=len(sizes) + 1)
                    refused = ""
                except ServerClosed as exc:
                    refused = f"{exc.reply_code} {exc.reply_text}"
        finally:
            publisher.abort()
            consumer.close()
            if place.address is not None:
                delete_queues(place.address, [q])
    return {"sent": len(sizes), "intact": sum(1 for a, b in zip(digests, got) if a == b),
            "max_bytes": HUGE_MAX_BYTES, "sizes": list(sizes), "over_max_refused": refused,
            "broker_exit_code": broker.exit_code}


def _churn(place: Place, what: str, cycle) -> dict:
    """Live stages are counted with the set-up connection open, before the churn and once every churned
    connection (for channel churn, the one connection whose channels churned) has closed again."""
    q = place.queue(f"{what}-churn")
    with Broker(place) as broker:
        setup = broker.client("creditflow-stress churn setup")
        try:
            setup.queue_declare(q, durable=False)
            before = steady_stages(broker) if broker.ctl else None
            peak = before
            keeper = broker.client("creditflow-stress churn") if what == "channel" else None
            for i in range(CHURN_CYCLES):
                cycle(broker, keeper, q, i)
                if broker.ctl is not None and i % 10 == 0:
                    peak = max(peak, live_stages(broker.status()))
            if keeper is not None:
                keeper.close()
            after = wait_stages(broker, before)[0] if broker.ctl else None
            in_queue = setup.queue_declare(q, durable=False)
            try:
                broker.client("creditflow-stress probe").close()
                up = True
            except (ClientError, OSError):
                up = False
        finally:
            setup.close()
            if place.address is not None:
                delete_queues(place.address, [q])
    return {"what": f"{what}s", "cycles": CHURN_CYCLES, "published": CHURN_CYCLES, "messages_in_queue": in_queue,
            "stages_before": before, "stages_after": after, "stages_peak": peak, "broker_up": up,
            "broker_exit_code": broker.exit_code}


def _connection_cycle(broker: Broker, _keeper, q: str, i: int) -> None:
    client = broker.client(f"creditflow-stress churn {i}")
    try:
        client.confirm_select()
        client.publish(q, b"churn %d" % i)
        client.wait_confirm()
    finally:
        client.close()


def _channel_cycle(_broker: Broker, keeper: StressClient, q: str, i: int) -> None:
    keeper.open_channel(2)
    keeper.confirm_select_on(2)
    keeper.publish(q, b"churn %d" % i, channel=2)
    keeper.wait_confirm(channel=2)
    keeper.close_channel(2)


def run_connection_churn(place: Place) -> dict:
    return _churn(place, "connection", _connection_cycle)


def run_channel_churn(place: Place) -> dict:
    return _churn(place, "channel", _channel_cycle)


def run_stage_killed(place: Place) -> dict:
    seen = {"killed": None, "survivors_at_kill": None, "survivors_last": 0}

    def publishes(status, but: str | None):
        return sum(p.get("publishes") or 0 for n, p in status["processes"].items()
                   if p.get("kind") == "reader" and n != but)

    def each_second(rep, status, ctl):
        if seen["killed"] is None and rep.time_s >= 2:
            readers = {n: p.get("publishes") or 0 for n, p in status["processes"].items()
                       if p.get("kind") == "reader" and p.get("alive")}
            victim = max(readers, key=readers.get)
            seen["reader"] = victim
            seen["killed"] = "channel-" + victim.split("-", 1)[1] + ".1"
            if not ctl.request("kill", name=seen["killed"]).get("ok"):
                raise StressError(f"ctl kill {seen['killed']} was refused")
            seen["survivors_at_kill"] = publishes(status, victim)
        elif seen["killed"] is not None:
            seen["survivors_last"] = max(seen["survivors_last"], publishes(status, seen["reader"]))

    load = LoadConfig(producers=2, consumers=1, rate=1000, confirm=100, prefetch=100, duration_s=5, drain_s=15,
                      queue=place.queue("stage-killed"))
    summary, _ = run_load(place, load, on_second=each_second)
    if seen["killed"] is None:
        raise StressError("the run ended before a stage was killed")
    death = next((d for d in summary.get("deaths", []) if d.get("name") == seen["killed"]), None)
    return {**counts(summary), "killed": seen["killed"], "death_action": death and death.get("action"),
            "survivor_published_after_kill": seen["survivors_last"] - seen["survivors_at_kill"],
            "broker_alive": bool(summary.get("processes")) and summary.get("broker_exit_code") == 0}


def run_consumer_stops_reading(place: Place) -> dict:
    q, prefetch, published = place.queue("consumer-stops-reading"), 50, 5000
    with Broker(place) as broker:
        consumer = broker.client("creditflow-stress silent consumer")
        publisher = broker.client("creditflow-stress publisher")
        try:
            consumer.queue_declare(q, durable=False)
            consumer.basic_qos(prefetch)
            consumer.basic_consume(q)
            publisher.confirm_select()
            body = bytes(1024)
            for _ in range(published):
                publisher.publish(q, body)
            publisher.wait_confirm(upto=published)
            time.sleep(0.5)                   # deliveries take what prefetch allows, then stop
            status = broker.status()
            p = (status or {}).get("processes", {}).get(f"queue-{q}", {})
            unacked = p.get("unacked") if status else None
            ready = publisher.queue_declare(q, durable=False)
        finally:
            publisher.close()
            consumer.abort()
            if place.address is not None:
                delete_queues(place.address, [q])
    return {"prefetch": prefetch, "published": published, "unacked": unacked, "ready": ready,
            "broker_exit_code": broker.exit_code}


def run_publisher_ignores_blocked(place: Place) -> dict:
    q, seconds = place.queue("publisher-ignores-blocked"), 4.0
    with Broker(place) as broker:
        client = broker.client("creditflow-stress deaf publisher")
        client.queue_declare(q, durable=False)
        memory = lambda: broker.status()["processes"]["watchdog"].get("memory_used") or 0   # noqa: E731
        memory_before = memory()
        broker.ctl.request("set_watermark", value="0")
        wait_alarm(broker)
        frame = frames_for(client, q, 4096)
        client.set_nonblocking()
        written, last_second, end = 0, 0, time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            _, writable, _ = select.select([], [client.fileno()], [], min(0.05, end - now))
            if not writable:
                continue
            try:
                n = client.send_nowait(frame)
            except Exception as exc:             # the broker may close a connection it cannot read: say so
                raise StressError(f"writing failed: {exc}") from None
            written += n
            if end - time.monotonic() < 1.0:
                last_second += n
        status = broker.status()
        reader = next((p for p in status["processes"].values()
                       if p.get("kind") == "reader" and p.get("alive") and p.get("publishes")), {})
        facts = {"seconds": seconds, "bytes_written": written, "bytes_last_second": last_second,
                 "reader_state": reader.get("state"), "queue_messages": queue_depth(status, q) or 0,
                 "memory_before": memory_before, "memory_after": memory()}
        broker.ctl.request("set_watermark", value=WATCHDOG["memory_limit"])
        client.abort()
    return {**facts, "broker_exit_code": broker.exit_code}


def frames_for(client: StressClient, queue: str, size: int) -> bytes:
    from pipeline.amqp import frames
    return frames.encode_publish(1, "", queue, frames.properties_raw(delivery_mode=1), bytes(size),
                                 client.frame_max) * 16


def wait_alarm(broker: Broker, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while broker.ctl.request("alarms").get("alarms", {}).get("memory", {}).get("state") != "set":
        if time.monotonic() > deadline:
            raise StressError("the memory alarm did not go off with watermark 0")
        time.sleep(0.05)


from pipeline.stress import alarmed, many      # noqa: E402 - they build on the helpers above

RUNNERS = {
    "slow-consumer": run_slow_consumer,
    "many-publishers-one-queue": run_many_publishers,
    "slow-disk": run_slow_disk,
    "alarm": run_alarm,
    "fanout-slow-queue": run_fanout_slow_queue,
    "huge-messages": run_huge_messages,
    "connection-churn": run_connection_churn,
    "channel-churn": run_channel_churn,
    "stage-killed": run_stage_killed,
    "consumer-stops-reading": run_consumer_stops_reading,
    "publisher-ignores-blocked": run_publisher_ignores_blocked,
    "disk-alarm": alarmed.run_disk_alarm,
    "alarm-flapping": alarmed.run_alarm_flapping,
    "kombu-publisher-alarm": alarmed.run_kombu_publisher_alarm,
    "connections-1000": many.run_connections_1000,
    "queues-1000": many.run_queues_1000,
}


def run_scenario(name: str, run_dir: str, address=None) -> catalogue.Verdict:
    """Run scenario ``name`` into ``run_dir`` and judge it; summary.json gets the facts and the verdict."""
    scenario = catalogue.BY_NAME[name]
    started = time.monotonic()
    if address is not None and scenario.own_broker:
        verdict = catalogue.skipped(name, "needs a broker of its own (broker options or ctl), not the --uri one")
        return replace(verdict, seconds=time.monotonic() - started)
    os.makedirs(run_dir, exist_ok=True)
    if not os.path.exists(os.path.join(run_dir, "config.json")):     # a load run writes its own over it
        write_json(run_dir, "config.json", {"stress": name, "broker": {"uri": address.uri()} if address else "own"})
    try:
        facts = RUNNERS[name](Place(run_dir, address))
        verdict = catalogue.judge(name, facts)
    except ScenarioUnavailable as exc:
        verdict = catalogue.skipped(name, str(exc))
    except (StressError, ClientError, OSError, socket.timeout) as exc:
        verdict = catalogue.failed(name, f"{type(exc).__name__}: {exc}")
    verdict = replace(verdict, seconds=time.monotonic() - started, run_dir=run_dir)
    record(verdict)
    return verdict


def record(verdict: catalogue.Verdict) -> None:
    """Add the facts and the verdict to the run directory's summary.json (writing one if there is none)."""
    path = os.path.join(verdict.run_dir, "summary.json")
    try:
        with open(path) as f:
            summary = json.load(f)
    except (FileNotFoundError, ValueError):
        summary = {}
    summary["stress"] = {**asdict(verdict), "line": catalogue.verdict_line(verdict)}
    write_json(verdict.run_dir, "summary.json", summary)
