"""Alarm scenarios: the disk alarm reached by the run's own writes, a flapping memory watermark, and a
kombu publisher caught by the memory alarm.

Each needs a broker of its own (``ctl`` moves its limits), so over ``--uri`` they are skipped. The
alarm edges are counted from broker.log (the lines RabbitMQ logs), the publishers' view from the
connection.blocked / connection.unblocked frames they received, with their reasons.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

from pipeline.loadgen.config import LoadConfig
from pipeline.stress import ScenarioUnavailable, StressError
from pipeline.stress.scenarios import MIB, WATCHDOG, Broker, Place, counts, run_load, wait_alarm

DISK_FILL_MARGIN_BYTES = 32 * MIB      # disk-alarm: the limit is set this far under the free space
DISK_FILL_TIMEOUT_S = 8.0              # ... and the run's writes must cross it within this long
ALARM_HOLD_S = 2.0                     # disk-alarm: how long the alarm is held once it is seen
FLAP_CYCLES = 4                        # alarm-flapping: set/clear cycles caused
KOMBU_MESSAGES = 5
KOMBU_ALARM_HOLD_S = 3.0               # kombu-publisher-alarm: the alarm is held this long after the call
KOMBU_JOIN_TIMEOUT_S = 15.0            # ... and the call must return within this long after it clears


def alarm_edges(run_dir: str, source: str) -> tuple[int, int]:
    """How many times broker.log says the ``source`` ("memory", "disk") alarm was set, and cleared."""
    try:
        with open(os.path.join(run_dir, "broker.log"), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return 0, 0
    return (len(re.findall(rf"{source} resource limit alarm set on node", text)),
            len(re.findall(rf"{source} resource limit alarm cleared on node", text)))


def publisher_events(result) -> tuple[list[str], list[str]]:
    """The load's connection.blocked/unblocked events in order (one publisher), and the blocked reasons."""
    events = [e for evs in result.blocked_events.values() for e in evs]
    return [e[1] for e in events], [e[2] for e in events if e[1] == "blocked"]


def _ok(answer: dict, what: str) -> None:
    if not answer.get("ok"):
        raise StressError(f"ctl {what} was refused: {answer.get('error')}")


# -- disk-alarm -------------------------------------------------------------------------------------
def run_disk_alarm(place: Place) -> dict:
    marks: dict = {}

    def each_second(rep, status, ctl):
        now = time.monotonic()
        if "limit" not in marks and rep.time_s >= 1:
            free = shutil.disk_usage(place.run_dir).free
            limit = free - DISK_FILL_MARGIN_BYTES
            _ok(ctl.request("set_disk_free_limit", value=str(limit)), "set-disk-free-limit")
            marks["limit"] = (now, free, limit)
        elif "limit" in marks and "alarm" not in marks:
            if status["alarms"].get("disk", {}).get("state") == "set":
                free = status["processes"].get("watchdog", {}).get("disk_free")
                marks["alarm"] = (now, rep.delivered, free)
            elif now - marks["limit"][0] > DISK_FILL_TIMEOUT_S:
                _ok(ctl.request("set_disk_free_limit", value=WATCHDOG["disk_limit"]), "set-disk-free-limit")
                marks["gave_up"] = now
                return True
        elif "alarm" in marks and "restored" not in marks and now - marks["alarm"][0] >= ALARM_HOLD_S:
            _ok(ctl.request("set_disk_free_limit", value=WATCHDOG["disk_limit"]), "set-disk-free-limit")
            marks["restored"] = (time.monotonic(), rep.delivered)

    load = LoadConfig(producers=1, consumers=1, rate=4000, size=8192, persistent=True, consumer_latency_us=500,
                      prefetch=100, duration_s=9, drain_s=30, queue=place.queue("disk-alarm"))
    summary, result = run_load(place, load, on_second=each_second)
    if "gave_up" in marks:
        raise StressError(f"the run's writes did not cross a disk free limit {DISK_FILL_MARGIN_BYTES // MIB} MiB "
                          f"under the free space within {DISK_FILL_TIMEOUT_S:.0f} s")
    if "restored" not in marks:
        raise StressError("the run ended before the disk free limit was restored")
    events, reasons = publisher_events(result)
    (t_limit, free, limit), (t_alarm, d0, free_at_alarm), (t_restored, d1) = \
        marks["limit"], marks["alarm"], marks["restored"]
    sets, clears = alarm_edges(place.run_dir, "disk")
    return {**counts(summary), "free_at_limit": free, "limit_bytes": limit, "free_at_alarm": free_at_alarm or 0,
            "fill_seconds": t_alarm - t_limit, "alarm_seconds": t_restored - t_alarm,
            "received_during_alarm": d1 - d0, "disk_sets": sets, "disk_clears": clears,
            "memory_sets": alarm_edges(place.run_dir, "memory")[0], "events": events, "reasons": reasons}


# -- alarm-flapping ---------------------------------------------------------------------------------
def run_alarm_flapping(place: Place) -> dict:
    marks: dict = {"moves": []}

    def each_second(rep, status, ctl):
        if rep.time_s < 1 or len(marks["moves"]) == 2 * FLAP_CYCLES:
            return
        if not marks["moves"]:
            used = status["processes"]["watchdog"].get("memory_used")
            if not used:
                raise StressError("the watchdog reported no memory use")
            marks.update(used=used, low=max(used // 2 // MIB, 1) * MIB, high=(3 * used // MIB + 1) * MIB)
        value = marks["low"] if len(marks["moves"]) % 2 == 0 else marks["high"]
        _ok(ctl.request("set_watermark", value=f"{value // MIB}MiB"), "set-watermark")
        marks["moves"].append(value)

    load = LoadConfig(producers=1, consumers=1, rate=1000, prefetch=100, duration_s=2 * FLAP_CYCLES + 2,
                      drain_s=15, queue=place.queue("alarm-flapping"))
    summary, result = run_load(place, load, on_second=each_second)
    if len(marks["moves"]) != 2 * FLAP_CYCLES:
        raise StressError(f"the run ended after {len(marks['moves'])} of {2 * FLAP_CYCLES} watermark moves")
    events, reasons = publisher_events(result)
    sets, clears = alarm_edges(place.run_dir, "memory")
    return {**counts(summary), "cycles": FLAP_CYCLES, "memory_used": marks["used"], "low_bytes": marks["low"],
            "high_bytes": marks["high"], "memory_sets": sets, "memory_clears": clears, "events": events,
            "reasons": reasons}


# -- kombu-publisher-alarm --------------------------------------------------------------------------
def run_kombu_publisher_alarm(place: Place) -> dict:
    try:
        import kombu
    except ImportError as exc:
        raise ScenarioUnavailable(f"kombu is not installed ({exc})") from None
    from kombu import Connection, Producer, Queue

    q = place.queue("kombu-publisher-alarm")
    with Broker(place) as broker:
        url = f"amqp://guest:guest@{broker.address.host}:{broker.address.port}//"
        seen = {"blocked": [], "unblocked": 0, "calls": [], "errors": []}
        with Connection(url, transport_options={"confirm_publish": True}) as conn:
            conn.connect()
            conn.connection.on_blocked = lambda reason: seen["blocked"].append(reason)
            conn.connection.on_unblocked = lambda: seen.__setitem__("unblocked", seen["unblocked"] + 1)
            Queue(q, durable=False)(conn.default_channel).declare()
            producer = Producer(conn.default_channel, serializer="json")
            _ok(broker.ctl.request("set_watermark", value="0"), "set-watermark")
            wait_alarm(broker)

            def publish_all():
                try:
                    for n in range(KOMBU_MESSAGES):
                        began = time.monotonic()
                        producer.publish({"n": n}, routing_key=q)         # no timeout: as Celery calls it
                        seen["calls"].append((began - called, time.monotonic() - called))
                except Exception as exc:        # noqa: BLE001 - reported in the verdict
                    seen["errors"].append(f"{type(exc).__name__}: {exc}")

            called = time.monotonic()
            publisher = threading.Thread(target=publish_all, name="kombu publisher", daemon=True)
            publisher.start()
            time.sleep(KOMBU_ALARM_HOLD_S)
            calls_at_clear = len(seen["calls"])
            _ok(broker.ctl.request("set_watermark", value=WATCHDOG["memory_limit"]), "set-watermark")
            cleared = time.monotonic() - called
            publisher.join(KOMBU_JOIN_TIMEOUT_S)       # a thread still hanging ends with the connection
        check = broker.client("creditflow-stress kombu check")
        try:
            in_queue = check.queue_declare(q, durable=False)
        finally:
            check.close()
    return {"kombu": kombu.__version__, "messages": KOMBU_MESSAGES, "calls": [list(c) for c in seen["calls"]],
            "returned_before_clear": calls_at_clear, "cleared_at": cleared, "in_queue": in_queue,
            "blocked_reasons": seen["blocked"], "unblocked": seen["unblocked"], "errors": seen["errors"],
            "join_timeout_s": KOMBU_JOIN_TIMEOUT_S, "broker_exit_code": broker.exit_code}
