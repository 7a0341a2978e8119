"""The data of the supervisor's events, as one frozen dataclass: the events table's schema, defined once.

An event is a line of ``events.jsonl``::

    {"at_ns": T, "event": KIND, "name": WHO, "data": {...}}

``data`` is a JSON object whose keys are fields of :class:`EventData`: every
key any event carries is one, and each field's comment names the events that
set it. The Arrow struct of the events table's ``data`` column is derived from
the class (:mod:`pipeline.telemetry.parquet`, as the stats columns are from
:mod:`pipeline.telemetry.schema`), and the report's Spark schema from that.

The Recorder writes an event's data as :func:`data_row` gives it: an alarm's
is the watchdog's control message as it came, less the ``type`` its kind
already says. A key no field names is written too; compaction drops it and
names it (``dropped_fields``, as ``data.KEY``), as it does a statistic no
class defines. The tests keep that list empty for every event the broker
emits, taking the keys from the calls themselves.

Stdlib only: the supervisor imports this module (through the Recorder);
pyarrow stays out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

ENVELOPE_KEY = "type"    # a control message's tag: the watchdog's alarm arrives as its message, "type": "alarm"


@dataclass(frozen=True)
class EventData:
    """What an event says beyond its kind, its process and its time; a field an event does not set is None."""

    duration_ns: int | None = None   # fsync: how long the store's fsync took
    source: str | None = None        # alarm_set, alarm_clear: 'memory' | 'disk'
    state: str | None = None         # alarm_set, alarm_clear: 'set' | 'clear'
    used: int | None = None          # alarm_set, alarm_clear (memory), paging: memory in use, bytes
    free: int | None = None          # alarm_set, alarm_clear (disk): disk space free, bytes
    limit: int | None = None         # alarm_set, alarm_clear, paging: bytes; fd_alarm_set, fd_alarm_cleared: fds
    at_ns: int | None = None         # alarm_set, alarm_clear: when the watchdog took the reading
    kind: str | None = None          # spawn, stage_died, stage_given_up: the process's kind
    pid: int | None = None           # spawn, host_ended, stage_died; stage_restarted: the new process's
    host: str | None = None          # spawn: the host process a pooled stage runs in
    peer: str | None = None          # connection: the client's address, 'ip:port'
    messages: int | None = None      # queue_deleted: the messages the queue held
    on: bool | None = None           # paging: True when queues start paging to disk, False when they stop
    how: str | None = None           # host_ended, stage_died: 'exit code N' | 'signal N'
    action: str | None = None        # stage_died: what the supervisor does about it (restart, queue_down, ...)
    stages: int | None = None        # host_ended: the stages it ran
    was: int | None = None           # stage_restarted: the pid of the process that died


def data_row(data: dict) -> dict:
    """An event's ``data`` as it is written: without a control message's ``type`` (the event's kind says it)."""
    if ENVELOPE_KEY not in data:
        return data
    return {k: v for k, v in data.items() if k != ENVELOPE_KEY}


__all__ = ["ENVELOPE_KEY", "EventData", "data_row"]
