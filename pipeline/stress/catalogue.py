"""The stress catalogue: what each scenario does, what RabbitMQ 3.x would do, and the verdict.

A scenario is data (``Scenario``); running one (``pipeline.stress.scenarios``)
yields ``facts``, a flat dict of figures measured in that run, and a judge
here turns the facts into a ``Verdict``. Judges are pure: no process, no
clock, no file, so every verdict rule is tested with facts written by hand.

A figure a run could not observe (a broker's process states over ``--uri``)
is None in the facts; the judge says so in the verdict instead of checking it.

Verdict line::

    PASS  slow-consumer  — backlog peaked at 1,234 messages, ...; expected: backlog grows, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
BACKLOG_MIN_MESSAGES = 1000        # slow-consumer: "the backlog grew" means at least this many held
CONFIRM_RISE_FACTOR = 2.0          # slow-disk: the slow disk's median confirm latency, x the baseline's
RATE_FALL_FACTOR = 0.7             # fanout-slow-queue: publishing falls below this share of the rate before
RATE_MATCH_TOLERANCE = 0.25        # ... and to within this share of the slow queue's own rate
BLOCKED_WRITE_BOUND_BYTES = 64 * 1024 * 1024   # publisher-ignores-blocked: socket buffers, not the broker
MEMORY_GROWTH_BOUND_BYTES = 64 * 1024 * 1024   # ... nor the broker's memory
DISK_REASON = "low on disk"        # connection.blocked's reason for the disk alarm alone (RabbitMQ's text)
MEMORY_REASON = "low on memory"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    expectation: str                # what RabbitMQ 3.x does, which the verdict checks
    own_broker: bool = False        # needs broker options or ctl: SKIP with --uri
    long: bool = False              # left out of ``stress all`` unless --long


@dataclass(frozen=True)
class Verdict:
    name: str
    outcome: str                    # PASS, FAIL or SKIP
    measured: str
    expected: str
    key: str = ""                   # the figure the table shows
    failures: tuple = ()            # why it failed, one phrase each
    seconds: float = 0.0
    run_dir: str | None = None
    facts: dict = field(default_factory=dict)


CATALOGUE = (
    Scenario("slow-consumer",
             "Two publishers send as fast as they can into one queue whose only consumer spends 300 µs on "
             "each message (-L 300, prefetch 50). The queue cannot hand messages on as fast as they come, so "
             "its backlog grows; the queue process is busy taking them in, credit runs out along the chain "
             "and the publishing connections go into flow.",
             "backlog grows past 1,000 messages, a publishing connection is in flow (broker status), lost 0"),
    Scenario("many-publishers-one-queue",
             "Twenty publisher connections, each at 100 msg/s with confirms (at most 20 unconfirmed), into "
             "one queue read by two consumers.",
             "every publish confirmed and delivered once, lost 0, no connection refused"),
    Scenario("slow-disk",
             "A publisher sends persistent 8 KiB messages (over queue_index_embed_msgs_below, so they go to the "
             "message store) with confirms (at most 1,000 unconfirmed) into a durable queue with no consumer, "
             "twice: on a plain broker, then on one whose every fsync takes 300 ms longer (--fsync-delay-ms "
             "300), as on a slow disk. With no consumer to acknowledge them first, confirms wait for the fsync.",
             "median confirm latency at least 2x the plain broker's and above the fsync delay; the publishing "
             "channel in flow; every publish confirmed and in the queue", own_broker=True),
    Scenario("alarm",
             "A publisher at 3,000 msg/s and a consumer at 500 µs a message, so a backlog builds. After 2 s the "
             "memory watermark is set to 0 (ctl set-watermark 0), which sets the memory alarm; 2 s later it "
             "goes back to 0.6.",
             "the publisher gets connection.blocked then connection.unblocked, the consumer keeps receiving "
             "during the alarm, the alarm clears, every message delivered, lost 0", own_broker=True),
    Scenario("fanout-slow-queue",
             "A publisher at 4,000 msg/s of persistent 8 KiB messages into a fanout exchange with two transient "
             "queues, each with a consumer. After 3 s a durable queue is bound to the exchange too. Only a "
             "durable queue writes persistent messages to the store, and the store takes 1 ms for each write "
             "(--store-delay-us 1000), so only that queue is slow.",
             "the publish rate falls below 0.7x its rate before and to within 25% of the slow queue's own "
             "intake: one slow queue holds back the whole connection; lost 0", own_broker=True),
    Scenario("huge-messages",
             "Messages of 1 byte, one frame exactly, one frame plus a byte, 1 MiB and 4 MiB (the broker's "
             "--max-message-bytes) with random bodies, then one of 4 MiB + 1 byte, on a raw AMQP connection.",
             "every message up to the limit arrives with the same bytes (SHA-256); the one over it is refused "
             "with 406 PRECONDITION_FAILED"),
    Scenario("connection-churn",
             "150 times: open a connection, publish one message, close it.",
             "the broker stays up, its live stages come back to the count before the churn, all 150 messages "
             "are in the queue"),
    Scenario("channel-churn",
             "On one connection, 150 times: open a channel, publish one message, close the channel.",
             "the broker stays up, its live stages come back to the count before the churn, all 150 messages "
             "are in the queue"),
    Scenario("stage-killed",
             "Two publishers at 1,000 msg/s with confirms and a consumer; after 2 s the channel process of "
             "the busiest publishing connection is killed (ctl kill).",
             "the broker closes that connection with 541 INTERNAL_ERROR and records the death, the other "
             "publisher goes on publishing, the run reports the closed publisher, lost 0", own_broker=True),
    Scenario("consumer-stops-reading",
             "A consumer with prefetch 50 that never reads its socket, then 5,000 messages of 1 KiB published "
             "to its queue.",
             "exactly 50 messages go out unacknowledged, the other 4,950 stay ready in the queue"),
    Scenario("publisher-ignores-blocked",
             "The memory alarm is forced (watermark 0); a raw client publishes 4 KiB messages for 4 s "
             "without ever reading, so it never sees connection.blocked.",
             "the reader stops reading the socket (state blocked): the client's writes stall once TCP's "
             "buffers are full (at most 64 MiB written, nothing in the last second), the broker's memory "
             "grows by at most 64 MiB", own_broker=True),
    Scenario("disk-alarm",
             "A publisher at 4,000 msg/s of persistent 8 KiB messages into a durable queue whose consumer "
             "takes 500 µs a message, so a backlog is written to the message store. After 1 s the disk free "
             "limit is set 32 MiB under the free space the file system has then (ctl set-disk-free-limit): "
             "the run's own writes cross it and set the disk alarm. 2 s after the alarm the limit goes back "
             "to 50 MB.",
             "the disk alarm is set once and cleared once, the publisher gets connection.blocked with the "
             "reason 'low on disk' and then connection.unblocked, the consumer keeps receiving during the "
             "alarm, every message delivered, lost 0", own_broker=True),
    Scenario("alarm-flapping",
             "A publisher at 1,000 msg/s and a consumer that keeps up. The broker's memory use is read, then "
             "the memory watermark is moved under it and back over it (ctl set-watermark, absolute sizes: "
             "half the use, then three times it) once a second, 4 times.",
             "the memory alarm is set 4 times and cleared 4 times (as many transitions as were caused), the "
             "publisher is blocked 4 times, each connection.blocked followed by its connection.unblocked, "
             "every message delivered, lost 0", own_broker=True),
    Scenario("kombu-publisher-alarm",
             "kombu (py-amqp, confirm_publish, as Celery's broker_transport_options set it) publishes 5 "
             "messages with Producer.publish and no timeout while the memory alarm is set (watermark 0); the "
             "alarm is held 3 s, then the watermark goes back to 0.6 (celery issues #2689, #10386).",
             "at most one publish returns during the alarm (the one that turns the connection from blocking "
             "to blocked, as RabbitMQ lets it through); the next call hangs until the alarm clears and "
             "returns only after it, kombu sees connection.blocked and connection.unblocked once, all 5 "
             "calls return and all 5 messages are in the queue",
             own_broker=True),
    Scenario("connections-1000",
             "1,000 aio-pika connections from 2 client processes, each with a channel: 500 publish with "
             "confirms at 1 msg/s each to a queue of their own, 500 consume from those queues; held 20 s, "
             "then every queue deleted and every connection closed.",
             "all 1,000 connections and channels open, every publish confirmed and delivered once, the broker "
             "stays up, its live stages come back to the count before", long=True),
    Scenario("queues-1000",
             "On one connection: 1,000 queues declared, each bound to a direct exchange with a key of its "
             "own, one message published to each key with confirms, then one basic.get from each queue; "
             "then the queues and the exchange are deleted.",
             "all 1,000 queues declared and bound, every message confirmed and delivered to its own queue "
             "(none left over), the broker stays up, its live stages come back to the count before",
             long=True),
)

BY_NAME = {s.name: s for s in CATALOGUE}


def _n(value) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.1f}%" if 0 < fraction < 0.01 else f"{100 * fraction:.0f}%"


def _lost(f: dict, problems: list) -> str:
    if f.get("lost"):
        problems.append(f"{f['lost']} messages lost")
    return f"lost {_n(f.get('lost', 0))}"


def _errors(f: dict, problems: list) -> None:
    for e in f.get("errors") or ():
        problems.append(f"error: {e}")


def judge_slow_consumer(f: dict, problems: list) -> tuple[str, str]:
    peak = f["backlog_peak"]
    if peak < BACKLOG_MIN_MESSAGES:
        problems.append(f"backlog peaked at {peak}, under {BACKLOG_MIN_MESSAGES}")
    flow = f.get("reader_flow")
    if flow is None:
        flow_text = "flow not observable (no broker status over --uri)"
    else:
        flow_text = f"publishing connections in flow {_pct(flow)} of their time"
        if flow <= 0:
            problems.append("no publishing connection was ever in flow")
    measured = (f"backlog reached {_n(peak)} messages ({_n(f['delivered'])} of {_n(f['published'])} delivered "
                f"in the run), {flow_text}, {_lost(f, problems)}")
    return measured, f"backlog {_n(peak)}, " + ("flow ?" if flow is None else f"flow {_pct(flow)}")


def judge_many_publishers(f: dict, problems: list) -> tuple[str, str]:
    _errors(f, problems)
    if f["confirmed"] != f["published"]:
        problems.append(f"{f['published'] - f['confirmed']} publishes not confirmed")
    if f["delivered"] != f["published"]:
        problems.append(f"{f['published'] - f['delivered']} publishes not delivered")
    measured = (f"{f['publishers']} publishers: {_n(f['published'])} published, {_n(f['confirmed'])} confirmed, "
                f"{_n(f['delivered'])} delivered, {_lost(f, problems)}")
    return measured, f"{_n(f['delivered'])}/{_n(f['published'])} delivered"


def judge_slow_disk(f: dict, problems: list) -> tuple[str, str]:
    base, slow, delay_us = f["base_confirm_p50_us"], f["slow_confirm_p50_us"], f["fsync_delay_ms"] * 1000
    if base is None or slow is None:
        problems.append("no confirm latency measured")
    else:
        if slow < CONFIRM_RISE_FACTOR * base:
            problems.append(f"confirm p50 rose only from {base} to {slow} µs")
        if slow < delay_us:
            problems.append(f"confirm p50 {slow} µs under the fsync delay of {delay_us} µs")
    if not f["channel_flow"] > 0:
        problems.append("the publishing channel was never in flow")
    if f["confirmed"] != f["published"]:
        problems.append(f"{f['published'] - f['confirmed']} of {f['published']} publishes not confirmed")
    if f["queued"] != f["published"]:
        problems.append(f"the queue holds {f['queued']} of {f['published']} messages published")
    ms = lambda us: "?" if us is None else f"{us / 1000:.1f} ms"       # noqa: E731
    measured = (f"confirm p50 {ms(slow)} with {f['fsync_delay_ms']} ms fsync delay vs {ms(base)} without, "
                f"publish {f['slow_publish_rate']:,.0f} vs {f['base_publish_rate']:,.0f} msg/s, publishing "
                f"channel in flow {_pct(f['channel_flow'])} of its time (its connection {_pct(f['reader_flow'])}); "
                f"{_n(f['confirmed'])} of "
                f"{_n(f['published'])} confirmed and {_n(f['queued'])} in the queue")
    return measured, f"confirm p50 {ms(base)} -> {ms(slow)}"


def judge_alarm(f: dict, problems: list) -> tuple[str, str]:
    if not f["alarm_sets"] or not f["alarm_clears"]:
        problems.append(f"memory alarm set {f['alarm_sets']} times, cleared {f['alarm_clears']} times")
    if not f["blocked"] or not f["unblocked"]:
        problems.append(f"publisher saw connection.blocked {f['blocked']} times, unblocked {f['unblocked']} times")
    if not f["received_during_alarm"] > 0:
        problems.append("the consumer received nothing during the alarm")
    if f["undelivered"]:
        problems.append(f"{f['undelivered']} not delivered")
    measured = (f"alarm set {f['alarm_sets']}x and cleared {f['alarm_clears']}x, publisher blocked {f['blocked']}x / "
                f"unblocked {f['unblocked']}x; in the {f['alarm_seconds']:.1f} s from watermark 0 to its "
                f"restore the publisher wrote {_n(f['sent_during_alarm'])} into its socket and the consumer received {_n(f['received_during_alarm'])}, "
                f"{_n(f['delivered'])} of {_n(f['published'])} delivered, {_lost(f, problems)}")
    return measured, f"received {_n(f['received_during_alarm'])} while blocked"


def judge_fanout_slow_queue(f: dict, problems: list) -> tuple[str, str]:
    before, after, slow = f["rate_before"], f["rate_after"], f["slow_queue_rate"]
    if not after < RATE_FALL_FACTOR * before:
        problems.append(f"publish rate {after:.0f} msg/s after the bind is not below {RATE_FALL_FACTOR} x "
                        f"{before:.0f}")
    if not slow or abs(after / slow - 1) > RATE_MATCH_TOLERANCE:
        problems.append(f"publish rate {after:.0f} msg/s is not within {_pct(RATE_MATCH_TOLERANCE)} of the slow "
                        f"queue's {slow:.0f} msg/s")
    measured = (f"publish {before:,.0f} msg/s before the slow queue was bound, {after:,.0f} msg/s after; the slow "
                f"queue took {slow:,.0f} msg/s; publishing connection in flow {_pct(f['reader_flow'])} of its "
                f"time, {_lost(f, problems)}")
    return measured, f"{before:,.0f} -> {after:,.0f} msg/s"


def judge_huge_messages(f: dict, problems: list) -> tuple[str, str]:
    if f["intact"] != f["sent"]:
        problems.append(f"{f['sent'] - f['intact']} of {f['sent']} messages did not arrive intact")
    over = f.get("over_max_refused")
    if over is None:
        over_text = "the over-limit message not tried (the broker's limit is unknown over --uri)"
    else:
        over_text = f"the one of {_n(f['max_bytes'] + 1)} B " + ("refused: " + over if over else "was not refused")
        if not over or not over.startswith("406"):
            problems.append("the message over the limit was not refused with 406")
    measured = f"{f['intact']} of {f['sent']} messages up to {_n(f['max_bytes'])} B arrived intact, {over_text}"
    return measured, f"{f['intact']}/{f['sent']} intact, largest {f['max_bytes'] // (1024 * 1024)} MiB"


def judge_churn(f: dict, problems: list) -> tuple[str, str]:
    if not f["broker_up"]:
        problems.append("the broker stopped answering")
    if f["messages_in_queue"] != f["published"]:
        problems.append(f"{f['messages_in_queue']} messages in the queue, {f['published']} published")
    before, after = f.get("stages_before"), f.get("stages_after")
    if before is None:
        stages = "live stages not observable (no broker status over --uri)"
    else:
        stages = f"live stages {before} before, {after} after (peak {f['stages_peak']})"
        if after != before:
            problems.append(f"live stages {after} after the churn, {before} before")
    measured = (f"{f['cycles']} {f['what']} opened, published and closed; {stages}; {f['messages_in_queue']} of "
                f"{f['published']} messages in the queue; broker " + ("up" if f["broker_up"] else "down"))
    return measured, f"{f['cycles']} cycles, stages {before}->{after}" if before is not None else f"{f['cycles']} cycles"


def judge_stage_killed(f: dict, problems: list) -> tuple[str, str]:
    if f["death_action"] is None:
        problems.append(f"no death of {f['killed']} recorded")
    elif f["death_action"] != "internal_error":
        problems.append(f"{f['killed']}'s death handled as {f['death_action']}, not internal_error (541)")
    if not f["survivor_published_after_kill"] > 0:
        problems.append("no other publisher published after the kill")
    if not any("541" in e for e in f["errors"]):
        problems.append("the run did not report the closed publisher (541)")
    if not f["broker_alive"]:
        problems.append("the broker stopped")
    measured = (f"killed {f['killed']}: death recorded ({f['death_action']}), run reported "
                f"{'; '.join(f['errors']) or 'no error'}; other publishers published {_n(f['survivor_published_after_kill'])} "
                f"after the kill; broker {'up' if f['broker_alive'] else 'down'}, {_lost(f, problems)}")
    return measured, f"{f['killed']} killed, {_n(f['survivor_published_after_kill'])} published after"


def judge_consumer_stops_reading(f: dict, problems: list) -> tuple[str, str]:
    unacked, ready = f.get("unacked"), f["ready"]
    if unacked is not None and unacked != f["prefetch"]:
        problems.append(f"{unacked} unacked, prefetch {f['prefetch']}")
    if ready != f["published"] - f["prefetch"]:
        problems.append(f"{ready} ready of {f['published']} published with prefetch {f['prefetch']}")
    unacked_text = "unacked not observable over --uri" if unacked is None else f"{_n(unacked)} unacked"
    measured = (f"{_n(f['published'])} published to a consumer with prefetch {f['prefetch']} that never reads: "
                f"{unacked_text}, {_n(ready)} ready")
    return measured, f"unacked {unacked}, ready {_n(ready)}"


def judge_publisher_ignores_blocked(f: dict, problems: list) -> tuple[str, str]:
    if f["reader_state"] != "blocked":
        problems.append(f"the publishing reader is {f['reader_state']}, not blocked")
    if f["bytes_written"] > BLOCKED_WRITE_BOUND_BYTES:
        problems.append(f"{f['bytes_written']} bytes written, over {BLOCKED_WRITE_BOUND_BYTES}")
    if f["bytes_last_second"]:
        problems.append(f"{f['bytes_last_second']} bytes still written in the last second")
    growth = f["memory_after"] - f["memory_before"]
    if growth > MEMORY_GROWTH_BOUND_BYTES:
        problems.append(f"broker memory grew by {growth} bytes")
    mib = lambda b: f"{b / (1024 * 1024):.1f} MiB"         # noqa: E731
    measured = (f"in {f['seconds']:.0f} s the client wrote {mib(f['bytes_written'])}, {_n(f['bytes_last_second'])} B "
                f"in the last second; reader {f['reader_state']}, {_n(f['queue_messages'])} message(s) reached "
                f"the queue; broker memory {mib(f['memory_before'])} -> {mib(f['memory_after'])}")
    return measured, f"{mib(f['bytes_written'])} written, then stalled" if not f["bytes_last_second"] else \
        f"{mib(f['bytes_written'])} written"


def _delivery(f: dict, problems: list) -> str:
    _errors(f, problems)
    if f.get("undelivered"):
        problems.append(f"{f['undelivered']} not delivered")
    return f"{_n(f['delivered'])} of {_n(f['published'])} delivered, {_lost(f, problems)}"


def _paired(events: list) -> bool:
    """Each connection.blocked followed by its connection.unblocked, and nothing left blocked."""
    return len(events) % 2 == 0 and all(e == ("blocked" if i % 2 == 0 else "unblocked") for i, e in enumerate(events))


def judge_disk_alarm(f: dict, problems: list) -> tuple[str, str]:
    if f["disk_sets"] != 1 or f["disk_clears"] != 1:
        problems.append(f"disk alarm set {f['disk_sets']} times, cleared {f['disk_clears']} times")
    if f["memory_sets"]:
        problems.append(f"the memory alarm went off too ({f['memory_sets']} times)")
    if "blocked" not in f["events"] or not _paired(f["events"]):
        problems.append(f"publisher events {f['events']}, not blocked then unblocked")
    wrong = sorted({r for r in f["reasons"] if r != DISK_REASON})
    if wrong:
        problems.append(f"connection.blocked reason {', '.join(map(repr, wrong))}, not {DISK_REASON!r}")
    if not f["received_during_alarm"] > 0:
        problems.append("the consumer received nothing during the alarm")
    mib = lambda b: f"{b / (1024 * 1024):,.0f} MiB"         # noqa: E731
    measured = (f"limit set to {mib(f['limit_bytes'])} with {mib(f['free_at_limit'])} free; the run's writes "
                f"crossed it {f['fill_seconds']:.1f} s later (free then {mib(f['free_at_alarm'])}); disk alarm set "
                f"{f['disk_sets']}x, cleared {f['disk_clears']}x; publisher {', '.join(f['events']) or 'never blocked'} "
                f"(reason {', '.join(sorted(set(f['reasons']))) or 'none'}); in the {f['alarm_seconds']:.1f} s of "
                f"the alarm the consumer received {_n(f['received_during_alarm'])}; {_delivery(f, problems)}")
    return measured, f"received {_n(f['received_during_alarm'])} while blocked"


def judge_alarm_flapping(f: dict, problems: list) -> tuple[str, str]:
    cycles = f["cycles"]
    if f["memory_sets"] != cycles or f["memory_clears"] != cycles:
        problems.append(f"memory alarm set {f['memory_sets']} and cleared {f['memory_clears']} times for "
                        f"{cycles} caused")
    if f["events"].count("blocked") != cycles or not _paired(f["events"]):
        problems.append(f"publisher events {' '.join(f['events']) or 'none'}, not {cycles} blocked/unblocked pairs")
    wrong = sorted({r for r in f["reasons"] if r != MEMORY_REASON})
    if wrong:
        problems.append(f"connection.blocked reason {', '.join(map(repr, wrong))}, not {MEMORY_REASON!r}")
    mib = lambda b: f"{b / (1024 * 1024):,.0f} MiB"         # noqa: E731
    measured = (f"broker using {mib(f['memory_used'])}; watermark moved to {mib(f['low_bytes'])} and "
                f"{mib(f['high_bytes'])} {cycles} times: memory alarm set {f['memory_sets']}x, cleared "
                f"{f['memory_clears']}x; publisher blocked {f['events'].count('blocked')}x, unblocked "
                f"{f['events'].count('unblocked')}x" + (" in pairs" if _paired(f["events"]) else " (not in pairs)")
                + f"; {_delivery(f, problems)}")
    return measured, (f"{cycles} cycles: alarm {f['memory_sets']}/{f['memory_clears']}, "
                      f"blocked {f['events'].count('blocked')}/{f['events'].count('unblocked')}")


def judge_kombu_publisher_alarm(f: dict, problems: list) -> tuple[str, str]:
    """RabbitMQ lets through the publish that turns a blocking connection blocked; the next one hangs."""
    calls, cleared = f["calls"], f["cleared_at"]
    spanning = [(b, e) for b, e in calls if b < cleared <= e]
    if not spanning:
        problems.append("no publish call was still waiting when the alarm cleared")
    if f["returned_before_clear"] > 1:
        problems.append(f"{f['returned_before_clear']} publish calls returned during the alarm (at most the one "
                        f"that turns the connection blocked may)")
    if len(calls) != f["messages"]:
        problems.append(f"{len(calls)} of {f['messages']} publish calls returned "
                        f"(within {f['join_timeout_s']:.0f} s of the clear)")
    if f["in_queue"] != f["messages"]:
        problems.append(f"{f['in_queue']} of {f['messages']} messages in the queue")
    if len(f["blocked_reasons"]) != 1 or f["unblocked"] != 1:
        problems.append(f"kombu's connection saw connection.blocked {len(f['blocked_reasons'])}x, "
                        f"unblocked {f['unblocked']}x")
    _errors(f, problems)
    held = f"{spanning[0][1] - spanning[0][0]:.2f} s" if spanning else "?"
    after = f", returning {spanning[0][1] - cleared:.3f} s after the clear" if spanning else ""
    measured = (f"kombu {f['kombu']} Producer.publish (no timeout, confirm_publish) during a memory alarm of "
                f"{cleared:.2f} s: {f['returned_before_clear']} call(s) returned during the alarm, the next was "
                f"held {held}{after}; kombu saw connection.blocked {len(f['blocked_reasons'])}x (py-amqp reports "
                f"{', '.join(map(repr, sorted(set(f['blocked_reasons'])))) or 'nothing'}, not the broker's reason), "
                f"unblocked {f['unblocked']}x; {len(calls)} of {f['messages']} calls returned, {f['in_queue']} "
                f"in the queue")
    return measured, f"publish held {held} of {cleared:.1f} s alarm"


def _stages(f: dict, problems: list) -> str:
    before, after = f.get("stages_before"), f.get("stages_after")
    if not f["broker_up"]:
        problems.append("the broker stopped answering")
    if before is None:
        return "live stages not observable (no broker status over --uri)"
    if after != before:
        problems.append(f"live stages {after} after closing, {before} before")
    return f"live stages {_n(before)} before, {_n(f['stages_peak'])} at the peak, {_n(after)} after"


def judge_connections_1000(f: dict, problems: list) -> tuple[str, str]:
    _errors(f, problems)
    for what in ("connections", "channels"):
        if f[f"{what}_open"] != f["wanted"]:
            problems.append(f"{f[f'{what}_open']} of {f['wanted']} {what} opened")
    if f["confirmed"] != f["published"] or f["nacked"]:
        problems.append(f"{f['confirmed']} of {f['published']} publishes confirmed, {f['nacked']} nacked")
    if f["duplicates"]:
        problems.append(f"{f['duplicates']} deliveries were duplicates")
    if not f["published"]:
        problems.append("nothing was published")
    measured = (f"{_n(f['connections_open'])} of {_n(f['wanted'])} connections with a channel open in "
                f"{f['open_seconds']:.1f} s; held {f['hold_s']:.0f} s: {_n(f['published'])} published, "
                f"{_n(f['confirmed'])} confirmed, {_n(f['delivered'])} delivered, {f['duplicates']} duplicates, "
                f"{_lost(f, problems)}; {_stages(f, problems)}; broker " + ("up" if f["broker_up"] else "down"))
    return measured, (f"{_n(f['connections_open'])} open, {_n(f['delivered'])}/{_n(f['published'])} delivered, "
                      f"stages {f.get('stages_before')}->{f.get('stages_after')}")


def judge_queues_1000(f: dict, problems: list) -> tuple[str, str]:
    _errors(f, problems)
    for what in ("declared", "bound", "confirmed", "delivered"):
        if f[what] != f["wanted"]:
            problems.append(f"{f[what]} of {f['wanted']} queues {what}")
    if f["left_over"]:
        problems.append(f"{f['left_over']} messages left in the queues after one basic.get each")
    measured = (f"{_n(f['declared'])} of {_n(f['wanted'])} queues declared and {_n(f['bound'])} bound in "
                f"{f['declare_seconds']:.1f} s, {_n(f['confirmed'])} messages confirmed, {_n(f['delivered'])} "
                f"fetched from their own queue, {f['left_over']} left over; {_stages(f, problems)}; broker "
                + ("up" if f["broker_up"] else "down"))
    return measured, (f"{_n(f['delivered'])}/{_n(f['wanted'])} delivered, "
                      f"stages {f.get('stages_before')}->{f.get('stages_after')}")


JUDGES = {
    "slow-consumer": judge_slow_consumer,
    "many-publishers-one-queue": judge_many_publishers,
    "slow-disk": judge_slow_disk,
    "alarm": judge_alarm,
    "fanout-slow-queue": judge_fanout_slow_queue,
    "huge-messages": judge_huge_messages,
    "connection-churn": judge_churn,
    "channel-churn": judge_churn,
    "stage-killed": judge_stage_killed,
    "consumer-stops-reading": judge_consumer_stops_reading,
    "publisher-ignores-blocked": judge_publisher_ignores_blocked,
    "disk-alarm": judge_disk_alarm,
    "alarm-flapping": judge_alarm_flapping,
    "kombu-publisher-alarm": judge_kombu_publisher_alarm,
    "connections-1000": judge_connections_1000,
    "queues-1000": judge_queues_1000,
}


def judge(name: str, facts: dict) -> Verdict:
    """The verdict on scenario ``name`` from the figures its run measured."""
    scenario = BY_NAME[name]
    problems: list[str] = []
    measured, key = JUDGES[name](facts, problems)
    return Verdict(name, FAIL if problems else PASS, measured, scenario.expectation, key, tuple(problems),
                   facts=dict(facts))


def skipped(name: str, why: str) -> Verdict:
    return Verdict(name, SKIP, why, BY_NAME[name].expectation, "skipped")


def failed(name: str, why: str) -> Verdict:
    """A scenario whose run broke before it measured what its judge needs."""
    return Verdict(name, FAIL, why, BY_NAME[name].expectation, "run failed", (why,))


def verdict_line(v: Verdict) -> str:
    """``PASS  name  — measured; expected: ...`` (FAIL adds why)."""
    why = f" [{'; '.join(v.failures)}]" if v.outcome == FAIL and v.failures and v.failures[0] != v.measured else ""
    return f"{v.outcome}  {v.name}  — {v.measured}{why}; expected: {v.expected}"


def table(verdicts) -> list[str]:
    """One line per verdict (name, verdict, key figure, seconds), then the count."""
    rows = [("scenario", "verdict", "key figure", "seconds")]
    rows += [(v.name, v.outcome, v.key, f"{v.seconds:.1f}") for v in verdicts]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts = {o: sum(1 for v in verdicts if v.outcome == o) for o in (PASS, FAIL, SKIP)}
    total = sum(v.seconds for v in verdicts)
    lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in {total:.0f} s")
    return lines


def describe(scenario: Scenario) -> list[str]:
    """``--list``'s entry for one scenario."""
    tags = [t for t, on in (("own broker", scenario.own_broker), ("long", scenario.long)) if on]
    return [f"{scenario.name}" + (f"  ({', '.join(tags)})" if tags else ""),
            f"    {scenario.description}",
            f"    expects: {scenario.expectation}"]
