"""PerfTest-shaped load: publisher and consumer processes speaking AMQP 0-9-1 over TCP.

Theory of operation::

    harness ──fork──▶ consumer-0..y-1   (connect, declare, qos, consume; report "ready")
            ──fork──▶ publisher-0..x-1  (connect, declare, confirm.select; report "ready")
            ──"G" + start instant──▶ every worker; all time their reports from it
    publisher ──pre-encoded basic.publish frames──▶ broker ──basic.deliver──▶ consumer
    publisher ◀──basic.ack/nack, basic.return, connection.blocked── broker
    every worker ──one JSON line a second (counts, HDR histogram)──▶ harness
    harness ──"S"──▶ publishers at -z; consumers once they have drained

Each publisher and consumer is its own OS process with its own connection,
so the load generator's own CPU time is spread the way a real client fleet's
is. Latency is measured from the *intended* send time written into every
message body (``time.monotonic_ns`` is one clock for the whole machine), so
time a publisher spends blocked by the broker shows in the figures instead of
being hidden (no coordinated omission).

Modules: ``config`` (what a run does), ``client`` (a minimal AMQP client),
``publisher`` and ``consumer`` (the worker processes and their sans-IO
cores), ``latency`` (HDR histograms), ``harness`` (processes and per-second
merging), ``report`` (PerfTest's lines).
"""


class LoadgenError(Exception):
    """Raised for any failure of the load generator (root of its errors)."""
