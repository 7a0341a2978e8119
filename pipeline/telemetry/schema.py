"""The statistics of every broker stage, as frozen dataclasses: THE schema, defined once.

Each stage's ``statistics(now_ns)`` returns one of these; everything else is
derived from them, and no other module lists a field again::

    Snapshot            name, kind, pid, at_ns: who reported, and when
    ├─ StageStats       a credit-flow stage: its state, credit blocks, out-links (LinkStats)
    │  ├─ ReaderStats   a connection
    │  ├─ ChannelStats
    │  ├─ QueueStats
    │  └─ StoreStats    (segments: pipeline.storage.segments.SegmentStatistics)
    └─ WatchdogStats    the watchdog's own statistics (alarms.watchdog and alarms.probes define
                        them, since alarms may not import pipeline; composed here)

* the control message a stage pushes is ``{"type": "stats", **stats.to_dict()}``
  (JSON; the supervisor keeps it as is, so ``ctl status`` shows exactly these keys);
* a telemetry row is that message without ``type`` and the fields marked
  ``column=False`` (:func:`row_of`);
* the Arrow schema of ``stats.parquet`` is the union of the classes' fields
  (:func:`stats_columns`, typed by :mod:`pipeline.telemetry.parquet`), and the
  report's Spark schema is derived from that.

Field metadata: ``column=False`` travels in the message but is no column (the
store's ``fsync_events`` become events of their own); ``optional=True`` is
left out of the message while None (``links_omitted``, set only when a
snapshot had to be cut to fit a control message). A ``typing.NamedTuple``
inside a field (``NoticeSent``) travels as a JSON array, as ``ctl status`` has
always shown it, and is a struct in Parquet; a dataclass inside a field
(``ClientProperties``, ``ConsumerDetail``, ``SegmentStatistics``) travels as a
JSON object and is a struct too. A client's table of arbitrary shape is kept
to a fixed one (``ClientProperties.of``) and a queue lists at most
``CONSUMER_DETAILS_KEPT`` consumers, so a snapshot still fits a control
message (64 KiB).

Stdlib only: broker processes import this module; pyarrow stays out of them.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import NamedTuple

from alarms.probes import BrokerMemoryStatistics
from alarms.watchdog import WatchdogStatistics
from pipeline.storage.segments import SegmentStatistics

NOT_A_COLUMN = {"column": False}
OPTIONAL = {"optional": True}


@dataclass(frozen=True)
class LinkStats:
    """One out-link, shown under ``"sender->receiver"``."""

    sent: int                    # credit-bearing records (publishes, store writes)
    records: int                 # every record put on the link
    in_flight: int               # in the ring and in overflow, not yet read by the receiver
    max_in_flight: int
    overflow: int                # records waiting in the sender's memory for ring space
    credit: int | None           # credit left towards the receiver; None on a link without flow control

    def to_dict(self) -> dict:
        return {"sent": self.sent, "records": self.records, "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight, "overflow": self.overflow, "credit": self.credit}


CLIENT_TEXT_MAX = 200           # characters kept of a client property's text
CLIENT_CAPABILITIES_MAX = 32     # capabilities kept of a client's table
CONSUMER_DETAILS_KEPT = 100      # consumers a queue lists in its snapshot; the rest are counted


@dataclass(frozen=True)
class ClientProperties:
    """What a connection's client said about itself in connection.start-ok, as RabbitMQ's API shows it:
    the usual keys only, text cut to ``CLIENT_TEXT_MAX``, capabilities as booleans (a fixed shape, so
    it is a struct column and its message stays small whatever the client sent)."""

    product: str | None = None
    version: str | None = None
    platform: str | None = None
    information: str | None = None
    connection_name: str | None = None
    capabilities: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, table: dict) -> ClientProperties:
        """From the client's field table (whatever types its values have)."""
        def text(key):
            value = table.get(key)
            if value is None:
                return None
            if isinstance(value, (bytes, bytearray)):
                value = bytes(value).decode("utf-8", "replace")
            return str(value)[:CLIENT_TEXT_MAX]
        caps = table.get("capabilities")
        caps = {str(k)[:CLIENT_TEXT_MAX]: bool(v) for k, v in list(caps.items())[:CLIENT_CAPABILITIES_MAX]} \
            if isinstance(caps, dict) else {}
        return cls(product=text("product"), version=text("version"), platform=text("platform"),
                   information=text("information"), connection_name=text("connection_name"), capabilities=caps)


@dataclass(frozen=True)
class ConsumerDetail:
    """One consumer of a queue (RabbitMQ's ``consumer_details``); ``channel`` is its channel's process."""

    consumer_tag: str
    channel: str
    channel_number: int
    ack_required: bool
    prefetch_count: int
    exclusive: bool
    active: bool = True          # False: waiting behind a queue's single active consumer


class NoticeSent(NamedTuple):
    """A connection.blocked / connection.unblocked the reader sent (or would have)."""

    at_ns: int
    state: str                   # 'blocked' | 'unblocked'
    reason: str | None
    sent: bool                   # False: the client did not ask for these notices


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    name: str
    kind: str
    pid: int
    at_ns: int

    def to_dict(self) -> dict:
        """This snapshot as the JSON object its process sends (and ``ctl status`` shows)."""
        return message_of(self)


@dataclass(frozen=True, kw_only=True)
class StageStats(Snapshot):
    """What every credit-flow stage reports (``ipc.credit.CreditStatistics`` and its links)."""

    state: str                           # 'flow' or 'running'
    blocked: bool
    block_started_ns: int | None
    blocked_total_ns: int
    block_count: int
    deferred_grants: int
    trims: int                           # times it gave freed heap back to the OS
    blocked_by: tuple[str, ...]          # the peers a credit block waits on
    links: dict[str, LinkStats]
    links_omitted: int | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class ReaderStats(StageStats):
    conn_state: str                      # RabbitMQ's connection state: running, flow, blocking, blocked
    publishes: int
    deliveries: int
    first_publish_ns: int
    last_publish_ns: int
    stopped_reading_ns: int              # when it last stopped reading (credit or an alarm)
    first_stop_ns: int
    resumed_ns: int
    first_publish_after_resume_ns: int
    channels: int
    client_name: str
    alarm_reasons: tuple[str, ...]
    notices: tuple[NoticeSent, ...]      # the last 20
    unparsed_bytes: int
    user: str | None                     # who logged in; None before connection.start-ok
    recv_oct: int                        # bytes read from the socket, since it was accepted
    send_oct: int                        # bytes written to it
    client_properties: ClientProperties | None
    channel_unacked: dict[str, int]      # channel number -> deliveries not yet acked (channels with some)


@dataclass(frozen=True, kw_only=True)
class ChannelStats(StageStats):
    number: int
    routed: int
    unroutable: int
    returned: int
    unconfirmed: int
    confirms_sent: int                   # basic.ack frames
    nacks_sent: int
    confirm_mode: str                    # 'none', 'confirm' or 'tx'
    confirmed: int                       # publishes acked to the client (messages, not frames)
    prefetch_count: int                  # basic.qos for each new consumer
    global_prefetch_count: int           # basic.qos global=true
    consumer_count: int


@dataclass(frozen=True, kw_only=True)
class QueueStats(StageStats):
    queue: str
    durable: bool
    messages: int                        # ready
    journal_full: bool
    unacked: int
    message_bytes: int                   # of the ready ones
    consumers: int
    enqueued: int
    delivered: int
    redelivered: int
    acked: int
    expired: int
    dead_lettered: int
    dropped: int
    rejected: int
    purged: int
    stored: int
    awaiting_confirm: int
    recovered: int
    paging: bool
    paged_messages: int                  # records in the page file, ready or unacked
    paged_out: int
    paged_in: int
    store_resent: int
    journal_fsyncs: int
    dead_letters_sent: int
    dead_letter_cycles: int
    consumer_bias: bool                  # publishes taken only as deliveries pay for them, now
    consumer_bias_engaged: int           # times that has begun
    bodies_lent: int                     # deliveries whose body, held by reference, went as a loan
    bodies_sent_by_copy: int             # ... and by copy instead: its reader could take no loan then
    consumer_details: tuple[ConsumerDetail, ...]   # at most CONSUMER_DETAILS_KEPT
    consumer_details_omitted: int | None = field(default=None, metadata=OPTIONAL)
    single_active_consumer_tag: str | None = field(default=None, metadata=OPTIONAL)   # x-single-active-consumer


@dataclass(frozen=True, kw_only=True)
class StoreStats(StageStats):
    writes: int
    removes: int
    fsyncs: int
    adopted: int
    disk_full: bool
    disk_full_episodes: int
    held_writes: int
    fsync_ms_total: float
    segments: SegmentStatistics
    fsync_events: tuple[tuple[int, int], ...] = field(default=(), metadata=NOT_A_COLUMN)  # (at_ns, duration_ns)


@dataclass(frozen=True, kw_only=True)
class WatchdogStats(BrokerMemoryStatistics, WatchdogStatistics, Snapshot):
    """The watchdog's message: ``{"type": "stats", name, kind, pid, at_ns, **WatchdogStatistics,
    **BrokerMemoryStatistics}`` (alarms.watchdog builds it)."""


STATS_TYPES: dict[str, type[Snapshot]] = {
    "reader": ReaderStats, "channel": ChannelStats, "queue": QueueStats, "store": StoreStats,
    "watchdog": WatchdogStats,
}


class SchemaConflict(TypeError):
    """Raised when two statistics classes give one field name different types."""


@functools.cache
def type_hints(cls) -> dict[str, typing.Any]:
    """``cls``'s fields and their types, resolved (each in its own module)."""
    return typing.get_type_hints(cls)


def is_column(f: dataclasses.Field) -> bool:
    return f.metadata.get("column", True)


@functools.cache
def stats_columns() -> tuple[tuple[str, typing.Any], ...]:
    """Every column of the stats table, (name, type), in the order the classes first name them."""
    columns: dict[str, typing.Any] = {}
    for cls in STATS_TYPES.values():
        hints = type_hints(cls)
        for f in dataclasses.fields(cls):
            if not is_column(f):
                continue
            tp = hints[f.name]
            if columns.setdefault(f.name, tp) != tp:
                raise SchemaConflict(f"{cls.__name__}.{f.name} is {tp}, elsewhere {columns[f.name]}")
    return tuple(columns.items())


@functools.cache
def not_columns() -> frozenset[str]:
    """Fields that travel in a stage's message but are no column of the stats table."""
    return frozenset(f.name for cls in STATS_TYPES.values() for f in dataclasses.fields(cls) if not is_column(f))


def _plain(value):
    """``value`` as JSON-ready data: dataclasses as dicts, NamedTuples and tuples as lists."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, LinkStats):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _links_plain(links: dict) -> dict:
    return {k: v.to_dict() for k, v in links.items()}


def _converter(tp):
    """How a value of type ``tp`` becomes JSON-ready: None when it already is (a scalar)."""
    if tp in (str, int, float, bool) or tp == (int | None) or tp == (str | None) or tp == (float | None):
        return None
    if tp == dict[str, LinkStats]:
        return _links_plain
    return _plain


@functools.cache
def _fields(cls) -> tuple[tuple[str, bool, typing.Any], ...]:
    """(name, optional, converter) per field of ``cls``, in order."""
    hints = type_hints(cls)
    return tuple((f.name, bool(f.metadata.get("optional")), _converter(hints[f.name]))
                 for f in dataclasses.fields(cls))


def message_of(stats: Snapshot) -> dict:
    """``stats`` as a JSON-ready dict: one key per field, in field order, an optional field only when set."""
    out = {}
    for name, optional, convert in _fields(type(stats)):
        value = getattr(stats, name)
        if value is None:
            if optional:
                continue
        elif convert is not None:
            value = convert(value)
        out[name] = value
    return out


def row_of(msg: dict) -> dict:
    """A stats message as its telemetry row: without ``type`` and the fields that are no column."""
    skip = not_columns()
    return {k: v for k, v in msg.items() if k != "type" and k not in skip}


class SchemaMismatch(ValueError):
    """Raised when a stats message lacks a field its kind's class requires, or holds one of the wrong shape."""


def _scalar(tp):
    def convert(value):
        if not isinstance(value, tp) and not (tp is float and isinstance(value, int)):
            raise SchemaMismatch(f"{value!r} is no {tp.__name__}")
        return value
    return convert


def _reader(tp) -> typing.Callable:
    """How a JSON-ready value becomes a value of ``tp`` (the inverse of :func:`_plain`)."""
    if tp in (str, int, float, bool):
        return _scalar(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            read = _reader(inner[0])
            return lambda v: None if v is None else read(v)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            read = _reader(args[0])
            return lambda v: tuple(read(x) for x in v)
        reads = [_reader(a) for a in args]
        return lambda v: tuple(r(x) for r, x in zip(reads, v, strict=True))
    if origin is dict:
        read_key, read_value = _reader(args[0]), _reader(args[1])
        return lambda v: {read_key(k): read_value(x) for k, x in v.items()}
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):      # a NamedTuple
        hints = typing.get_type_hints(tp)
        reads = [_reader(hints[f]) for f in tp._fields]
        return lambda v: tp(*(r(x) for r, x in zip(reads, v, strict=True)))
    if dataclasses.is_dataclass(tp):
        return functools.partial(_build, tp)
    raise TypeError(f"no reader for {tp}")


@functools.cache
def _readers(cls) -> tuple[tuple[str, bool, typing.Callable], ...]:
    """(name, has a default, reader) per init field of ``cls``."""
    hints = type_hints(cls)
    return tuple((f.name, f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING,
                  _reader(hints[f.name])) for f in dataclasses.fields(cls) if f.init)


def _build(cls, msg: dict):
    values = {}
    for name, has_default, read in _readers(cls):
        if name in msg:
            try:
                values[name] = read(msg[name])
            except (SchemaMismatch, TypeError, ValueError, AttributeError) as exc:
                raise SchemaMismatch(f"{cls.__name__}.{name}: {exc}") from None
        elif not has_default:
            raise SchemaMismatch(f"{cls.__name__} lacks {name}")
    return cls(**values)


def stats_of(msg: dict) -> Snapshot:
    """A stats message (or the supervisor's copy of one, with its own keys beside) as its kind's class:
    what reads statistics reads attributes the classes define, never a spelling it guessed. Keys no field
    names are ignored; a missing field (without default) or a value of the wrong shape raises
    :class:`SchemaMismatch`, as does a kind without a class."""
    cls = STATS_TYPES.get(msg.get("kind"))
    if cls is None:
        raise SchemaMismatch(f"no statistics class for kind {msg.get('kind')!r}")
    return _build(cls, msg)


def unknown_fields(msg: dict) -> set[str]:
    """Keys of a stats message its kind's class does not define (empty for a kind without one)."""
    cls = STATS_TYPES.get(msg.get("kind"))
    if cls is None:
        return set()
    return set(msg) - {"type"} - {name for name, _, _ in _fields(cls)}


__all__ = ["CLIENT_CAPABILITIES_MAX", "CLIENT_TEXT_MAX", "CONSUMER_DETAILS_KEPT", "ChannelStats", "ClientProperties",
           "ConsumerDetail", "LinkStats", "NOT_A_COLUMN", "NoticeSent", "OPTIONAL", "QueueStats",
           "ReaderStats", "STATS_TYPES", "SchemaConflict", "SchemaMismatch", "Snapshot", "StageStats", "StoreStats", "WatchdogStats",
           "is_column", "message_of", "not_columns", "row_of", "stats_columns", "stats_of", "type_hints", "unknown_fields"]
