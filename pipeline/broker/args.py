"""Queue arguments and declarations, checked and compared as RabbitMQ 3.10 does for classic queues (pure).

A ``queue.declare`` carries ``x-`` arguments; ``parse_queue_args`` turns them
into a :class:`QueueArgs` or refuses them with RabbitMQ's 406, and
``check_redeclare`` says whether declaring an existing queue again is
equivalent (405 for the exclusive flag, 406 for durable, auto_delete or an
argument). ``parse_expiration`` reads a message's ``expiration`` property
and ``consumer_priority`` a consumer's ``x-priority``. Every reply text below
was read off a real RabbitMQ 3.10.8 node.

RabbitMQ's messages name the AMQP field type a value arrived as
(``signedint``, ``longstr``, ...). A decoded table keeps only the Python
value, so a value may be given as :class:`Typed` to say its type; a plain
value is named as pika would send it (an ``int`` that fits 32 bits is a
``signedint``, a larger one a ``long``; ``str`` a ``longstr``).

The checks run in RabbitMQ's order, the first failure wins: a
non-string ``x-dead-letter-exchange``; ``x-queue-type``; then each known
argument in the order of RabbitMQ's table (``x-expires``,
``x-message-ttl``, ``x-dead-letter-exchange``, ``x-dead-letter-routing-key``,
``x-max-length``, ``x-max-length-bytes``, ``x-max-priority``,
``x-overflow``, ``x-queue-mode``, ``x-queue-version``,
``x-single-active-consumer``); then, in the client's order, an argument
that belongs to another queue type. Unknown ``x-`` names are accepted and
ignored, as RabbitMQ does. One departure, refused with 406 rather than
built half-way: ``x-queue-type`` other than ``classic`` (RabbitMQ would make
a quorum queue or a stream).
"""

from __future__ import annotations

import datetime
import decimal
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from pipeline.amqp.errors import INTERNAL_ERROR, PRECONDITION_FAILED, RESOURCE_LOCKED

MAX_EXPIRY_MS = 315_360_000_000       # rabbit_misc:check_expiry: ten years
MAX_PRIORITY = 255
OVERFLOW_MODES = ("drop-head", "reject-publish", "reject-publish-dlx")
QUEUE_MODES = ("default", "lazy")
QUEUE_VERSIONS = (1, 2)
VHOST = "/"

INTEGER_TYPES = frozenset({"byte", "short", "signedint", "long", "unsignedbyte", "unsignedshort", "unsignedint"})
_TYPE_CLASS = {**{t: "int" for t in INTEGER_TYPES}, "decimal": "int", "float": "float", "double": "float"}
# arguments other queue types take and a classic queue refuses (RabbitMQ 3.10's capabilities)
OTHER_TYPES_ARGS = frozenset({"x-dead-letter-strategy", "x-max-in-memory-length", "x-max-in-memory-bytes",
                              "x-quorum-initial-group-size", "x-delivery-limit", "x-queue-leader-locator",
                              "x-max-age", "x-stream-max-segment-size-bytes", "x-initial-cluster-size"})
# the arguments compared on redeclare, in RabbitMQ's order
EQUIVALENCE_KEYS = ("x-expires", "x-message-ttl", "x-dead-letter-exchange", "x-dead-letter-routing-key",
                    "x-max-length", "x-max-length-bytes", "x-max-priority", "x-overflow", "x-queue-mode",
                    "x-queue-version", "x-single-active-consumer", "x-queue-type", "x-queue-master-locator")


class QueueError(Exception):
    """Raised when a request to a queue breaks one of RabbitMQ's rules (root of the queue's errors).

    ``reply_code`` and ``reply_text`` are what the client is told; the
    channel is closed with them (all the codes used here are soft errors).
    """

    reply_code = INTERNAL_ERROR

    def __init__(self, reply_text: str):
        super().__init__(f"{self.reply_code} {reply_text}")
        self.reply_text = reply_text


class PreconditionFailed(QueueError):
    """Raised when a request contradicts the queue's state or definition: 406 PRECONDITION_FAILED."""

    reply_code = PRECONDITION_FAILED


class InvalidArgument(PreconditionFailed):
    """Raised when a queue or consumer argument has the wrong type or value: 406 "invalid arg ..."."""


class InequivalentArgument(PreconditionFailed):
    """Raised when an existing queue is declared again with other flags or arguments: 406 "inequivalent arg"."""


class InvalidExpiration(PreconditionFailed):
    """Raised when a message's ``expiration`` property is not a whole number of ms: 406 "invalid expiration"."""


class ResourceLocked(QueueError):
    """Raised when a declare does not match the queue's exclusive owner: 405 RESOURCE_LOCKED."""

    reply_code = RESOURCE_LOCKED


@dataclass(frozen=True)
class Typed:
    """A table value with the AMQP field type it arrived as, named as RabbitMQ names it (``signedint``)."""

    type: str
    value: Any


def field_type(value) -> str:
    """RabbitMQ's name for the type of ``value`` (a :class:`Typed` says it; a plain value as pika sends it)."""
    if isinstance(value, Typed):
        return value.type
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "signedint" if -2**31 <= value < 2**31 else "long"
    if isinstance(value, (str, bytes)):
        return "longstr"
    if isinstance(value, bytearray):
        return "binary"
    if isinstance(value, float):
        return "double"
    if isinstance(value, decimal.Decimal):
        return "decimal"
    if isinstance(value, datetime.datetime):
        return "timestamp"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, list):
        return "array"
    if value is None:
        return "void"
    return type(value).__name__


def _plain(value):
    return value.value if isinstance(value, Typed) else value


def resource(queue: str) -> str:
    """``queue 'q' in vhost '/'``: how RabbitMQ names a queue in its reply texts."""
    return f"queue '{queue}' in vhost '{VHOST}'"


def erlang_term(value) -> str:
    """``value`` as Erlang's ``~p`` prints the term RabbitMQ holds for it (enough for reply texts)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (bytes, bytearray)):
        return "<<" + ",".join(str(b) for b in value) + ">>" if value else "<<>>"
    if isinstance(value, str):
        return '<<"' + value.replace("\\", "\\\\").replace('"', '\\"') + '">>'
    if isinstance(value, tuple):
        return "{" + ",".join(erlang_term(v) for v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(erlang_term(v) for v in value) + "]"
    return str(value)


def _show(value) -> str:
    """A value inside quotes in an equivalence text: binaries as text (``~s``), others as ``~p``."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return value.decode("latin-1")
    return erlang_term(value)


def _quoted(text: str) -> str:
    """An Erlang string as ``~p`` prints it: in double quotes."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- declare ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QueueArgs:
    """What a classic queue's arguments mean; ``None`` where the argument was not given."""

    message_ttl_ms: int | None = None          # x-message-ttl
    expires_ms: int | None = None              # x-expires: unused this long, the queue goes
    max_length: int | None = None              # x-max-length: ready messages
    max_length_bytes: int | None = None        # x-max-length-bytes: bodies of ready messages
    overflow: str = "drop-head"                # x-overflow
    dead_letter_exchange: str | None = None    # x-dead-letter-exchange ("" is the default exchange)
    dead_letter_routing_key: str | None = None  # x-dead-letter-routing-key
    max_priority: int | None = None            # x-max-priority: a priority queue with levels 0..max
    queue_mode: str = "default"                # x-queue-mode: default | lazy
    queue_version: int | None = None           # x-queue-version: 1 | 2
    single_active_consumer: bool = False       # x-single-active-consumer: one consumer gets it all


def _int_error(value) -> str | None:
    kind = field_type(value)
    if kind not in INTEGER_TYPES:
        return _quoted(f"expected integer, got {kind}")
    return None


def _non_neg_int(value) -> str | None:
    bad = _int_error(value)
    if bad is None and _plain(value) < 0:
        return f"{{value_negative,{_plain(value)}}}"
    return bad


def _expiry(value) -> str | None:
    n = _plain(value)
    if n < 0:
        return f"{{value_negative,{n}}}"
    if n > MAX_EXPIRY_MS:
        return f"{{value_too_large,{n}}}"
    return None


def _check_expires(value, args) -> str | None:
    bad = _int_error(value)
    if bad is None and _plain(value) == 0:
        return "{value_zero,0}"
    return bad or _expiry(value)


def _check_ttl(value, args) -> str | None:
    return _int_error(value) or _expiry(value)


def _check_string(value, args) -> str | None:
    kind = field_type(value)
    return None if kind == "longstr" else f"{{unacceptable_type,{kind}}}"


def _check_dlx_routing_key(value, args) -> str | None:
    bad = _check_string(value, args)
    if bad is None and "x-dead-letter-exchange" not in args:
        return "routing_key_but_no_dlx_defined"
    return bad


def _check_max_priority(value, args) -> str | None:
    bad = _non_neg_int(value)
    if bad is None and _plain(value) > MAX_PRIORITY:
        return f"{{max_value_exceeded,{_plain(value)}}}"
    return bad


def _check_choice(choices, what):
    def check(value, args) -> str | None:
        bad = _check_string(value, args)
        if bad is None and _text(value) not in choices:
            return "invalid_overflow" if what is None else _quoted(f"unsupported {what} '{_text(value)}'")
        return bad
    return check


def _check_queue_version(value, args) -> str | None:
    bad = _non_neg_int(value)
    if bad is None and _plain(value) not in QUEUE_VERSIONS:
        return _quoted(f"unsupported queue version '{_plain(value)}'")
    return bad


def _check_bool(value, args) -> str | None:
    kind = field_type(value)
    return None if kind == "bool" else f"{{unacceptable_type,{kind}}}"


def _text(value) -> str:
    v = _plain(value)
    return v.decode("utf-8", "surrogateescape") if isinstance(v, (bytes, bytearray)) else v


_CHECKS = (
    ("x-expires", _check_expires),
    ("x-message-ttl", _check_ttl),
    ("x-dead-letter-exchange", _check_string),
    ("x-dead-letter-routing-key", _check_dlx_routing_key),
    ("x-max-length", lambda v, a: _non_neg_int(v)),
    ("x-max-length-bytes", lambda v, a: _non_neg_int(v)),
    ("x-max-priority", _check_max_priority),
    ("x-overflow", _check_choice(OVERFLOW_MODES, None)),
    ("x-queue-mode", _check_choice(QUEUE_MODES, "queue mode")),
    ("x-queue-version", _check_queue_version),
    ("x-single-active-consumer", _check_bool),
)


def _invalid(key: str, queue: str, error: str) -> InvalidArgument:
    return InvalidArgument(f"PRECONDITION_FAILED - invalid arg '{key}' for {resource(queue)}: {error}")


def parse_queue_args(queue: str, arguments: Mapping | None) -> QueueArgs:
    """The meaning of a new queue's ``arguments``; raises ``InvalidArgument`` (406) as RabbitMQ would."""
    args = dict(arguments or {})
    if "x-dead-letter-exchange" in args:
        kind = field_type(args["x-dead-letter-exchange"])
        if kind != "longstr":
            raise InvalidArgument(f"PRECONDITION_FAILED - invalid type '{kind}' for arg 'x-dead-letter-exchange' "
                                  f"in {resource(queue)}")
    if "x-queue-type" in args:
        value = args["x-queue-type"]
        bad = _check_string(value, args)
        if bad is None and _text(value) != "classic":
            bad = _quoted(f"unsupported queue type '{_text(value)}'")
        if bad:
            raise _invalid("x-queue-type", queue, bad)
    for key, check in _CHECKS:
        if key in args:
            bad = check(args[key], args)
            if bad:
                raise _invalid(key, queue, bad)
    for key in args:
        if key in OTHER_TYPES_ARGS:
            raise InvalidArgument(f"PRECONDITION_FAILED - invalid arg '{key}' for {resource(queue)} "
                                  f"of queue type rabbit_classic_queue")
    def get(key):
        return _plain(args[key]) if key in args else None

    return QueueArgs(
        message_ttl_ms=get("x-message-ttl"), expires_ms=get("x-expires"), max_length=get("x-max-length"),
        max_length_bytes=get("x-max-length-bytes"), overflow=_text(args.get("x-overflow", "drop-head")),
        dead_letter_exchange=_text(args["x-dead-letter-exchange"]) if "x-dead-letter-exchange" in args else None,
        dead_letter_routing_key=(_text(args["x-dead-letter-routing-key"])
                                 if "x-dead-letter-routing-key" in args else None),
        max_priority=get("x-max-priority"), queue_mode=_text(args.get("x-queue-mode", "default")),
        queue_version=get("x-queue-version"), single_active_consumer=bool(get("x-single-active-consumer")))


# -- redeclare ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class QueueSpec:
    """A queue as declared: its flags and arguments as they came (values plain or :class:`Typed`).

    ``owner`` is the exclusive owner (the connection, any hashable key) or
    None. RabbitMQ stores ``durable and not exclusive`` as the durable flag;
    the caller passes what RabbitMQ would store.
    """

    name: str
    durable: bool = False
    auto_delete: bool = False
    owner: Any = None
    arguments: Mapping = field(default_factory=dict)


def _field_value(value) -> str:
    return f"'{_show(value)}'"


def _typed_value(value) -> str:
    return f"the value '{_show(_plain(value))}' of type '{field_type(value)}'"


def _inequivalent(queue: str, key: str, received: str, current: str) -> InequivalentArgument:
    return InequivalentArgument(f"PRECONDITION_FAILED - inequivalent arg '{key}' for {resource(queue)}: "
                                f"received {received} but current is {current}")


def check_redeclare(current: QueueSpec, requested: QueueSpec) -> None:
    """Raise unless declaring ``current`` again as ``requested`` is equivalent, in RabbitMQ's order of checks."""
    name = current.name
    if current.owner != requested.owner:
        raise ResourceLocked(f"RESOURCE_LOCKED - cannot obtain exclusive access to locked {resource(name)}. "
                             f"It could be originally declared on another connection or the exclusive property "
                             f"value does not match that of the original declaration.")
    for key in ("durable", "auto_delete"):
        was, now = getattr(current, key), getattr(requested, key)
        if was != now:
            raise _inequivalent(name, key, _field_value(now), _field_value(was))
    old, new = current.arguments or {}, requested.arguments or {}
    for key in EQUIVALENCE_KEYS:
        had, has = key in old, key in new
        if not had and not has:
            continue
        if had and has:
            o, n = old[key], new[key]
            if _TYPE_CLASS.get(field_type(o), field_type(o)) == _TYPE_CLASS.get(field_type(n), field_type(n)) \
                    and _plain(o) == _plain(n):
                continue
            raise _inequivalent(name, key, _field_value(_plain(n)), _field_value(_plain(o)))
        if key == "x-queue-type" and _text(old.get(key, new.get(key))) == "classic":
            continue                    # no type and 'classic' are the same
        raise _inequivalent(name, key, _typed_value(new[key]) if has else "none",
                            _typed_value(old[key]) if had else "none")


# -- messages and consumers -----------------------------------------------------------------------
def _erlang_string(text: str) -> str:
    """A leftover of a number as ``~p`` prints an Erlang string: quoted if printable, else a list of codes."""
    raw = text.encode("utf-8", "surrogateescape")
    if all(32 <= b < 127 or 160 <= b for b in raw):
        return _quoted(raw.decode("latin-1"))
    return "[" + ",".join(str(b) for b in raw) + "]"


def parse_expiration(expiration: str | bytes | None) -> int | None:
    """A message's ``expiration`` property as milliseconds (None when absent); raises ``InvalidExpiration``."""
    if expiration is None:
        return None
    text = expiration.decode("utf-8", "surrogateescape") if isinstance(expiration, (bytes, bytearray)) \
        else expiration
    i = 1 if text[:1] in ("+", "-") else 0
    j = i
    while j < len(text) and "0" <= text[j] <= "9":
        j += 1
    if j == i:
        error = "no_integer"
    elif j < len(text):
        error = f"{{leftover_string,{_erlang_string(text[j:])}}}"
    else:
        n = int(text[:j])
        error = _expiry(n)
        if error is None:
            return n
    raise InvalidExpiration(f"PRECONDITION_FAILED - invalid expiration '{text}': {error}")


CLASSIC_CONSUMER_REFUSES = frozenset({"x-stream-offset"})


def consumer_priority(queue: str, arguments: Mapping | None) -> int:
    """A consumer's ``x-priority`` (0 when absent); raises ``InvalidArgument`` as RabbitMQ's basic.consume does."""
    args = arguments or {}
    if "x-priority" in args:
        bad = _int_error(args["x-priority"])
        if bad:
            raise _invalid("x-priority", queue, bad)
    if "x-cancel-on-ha-failover" in args:
        bad = _check_bool(args["x-cancel-on-ha-failover"], args)
        if bad:
            raise _invalid("x-cancel-on-ha-failover", queue, bad)
    for key in args:
        if key in CLASSIC_CONSUMER_REFUSES:
            raise InvalidArgument(f"PRECONDITION_FAILED - invalid arg '{key}' for {resource(queue)} "
                                  f"of queue type rabbit_classic_queue")
    return _plain(args.get("x-priority", 0))
