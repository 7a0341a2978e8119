"""The broker's one vhost: its queues, its routing table, its limits, and the durable part on disk.

The supervisor owns one :class:`Definitions`. Queues are declared here with
RabbitMQ's checks, in its order (``rabbit_channel``'s queue.declare): a
reserved ``amq.`` name (403), the exclusive owner (405), equivalence of the
flags and arguments (406, ``pipeline.broker.args``), a passive declare of a
missing queue (404), the arguments of a new one (406). Exchanges and
bindings are the :class:`~pipeline.broker.routing.RoutingTable`'s; every
channel and every queue that dead-letters routes with a copy of it, kept
current with ``routing.take_changes()``.

The vhost's limits are RabbitMQ's ``set_vhost_limits``: ``max-connections``
(530 at ``connection.open`` once that many connections are open) and
``max-queues`` (406 for the queue.declare that would make one more; a queue
that exists may still be redeclared). A negative value is no limit, 0 allows
none.

Durable queues (with their arguments), durable exchanges and their bindings,
and the vhost's limits are kept in ``DATA_DIR/definitions.json`` (written to a temporary file,
fsynced, renamed) so a restart on the same data directory brings them back.
Reading it never keeps the broker from starting: a file that does not parse
is moved aside as ``definitions.json.bad-<time>`` and an entry that is not
valid is skipped; both are reported as lines for the log.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from pipeline.amqp.errors import ACCESS_REFUSED, NOT_FOUND, ChannelLevelError
from pipeline.broker.args import QueueArgs, QueueSpec, check_redeclare, parse_queue_args
from pipeline.broker.names import BadName, check
from pipeline.broker.routing import RoutingTable, from_json_value, to_json_value

DEFINITIONS_FILE = "definitions.json"
REPLY_TO_PREFIX = "amq.rabbitmq.reply-to."      # a channel's direct reply-to queue: not counted as a queue
QUEUE_DECLARE = (50, 10)


@dataclass(frozen=True)
class Refused:
    """A request the broker refuses: the channel (or, if ``hard``, the connection) is closed."""
    code: int
    text: str
    hard: bool = False


@dataclass
class QueueDef:
    name: str
    durable: bool
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict = field(default_factory=dict)
    args: QueueArgs = field(default_factory=QueueArgs)
    owner: str | None = None        # the reader of the connection an exclusive queue belongs to
    down: bool = False              # its process crashed too often and was given up
    deleting: bool = False          # asked to go; declares wait until it has

    def spec(self) -> QueueSpec:
        return QueueSpec(self.name, durable=self.durable, auto_delete=self.auto_delete, owner=self.owner,
                         arguments=self.arguments)


def resource(name: str) -> str:
    return f"queue '{name}' in vhost '/'"


def not_found_queue(name: str) -> Refused:
    return Refused(404, f"NOT_FOUND - no {resource(name)}")


def queue_stopped(name: str) -> Refused:
    return Refused(404, f"NOT_FOUND - {resource(name)} process is stopped by supervisor")


def refused(exc: Exception) -> Refused:
    """The Refused for what a core raised: an ``AmqpError`` (routing; ``hard`` says which kind) or a
    ``QueueError`` (queue arguments; always a channel error)."""
    return Refused(exc.reply_code, exc.reply_text, bool(getattr(exc, "hard", False)))


VHOST_LIMITS = ("max-connections", "max-queues")


class BadLimits(ValueError):
    """Raised when vhost limits are not a JSON object of known limits with integer values."""


def parse_limits(text_or_dict) -> dict[str, int]:
    """``{"max-connections": 10, "max-queues": 5}`` (JSON text or a dict) checked as rabbitmqctl checks it."""
    data = text_or_dict
    if isinstance(text_or_dict, str):
        try:
            data = json.loads(text_or_dict)
        except ValueError as exc:
            raise BadLimits(f"limits are not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadLimits("limits must be a JSON object, e.g. '{\"max-connections\": 100}'")
    unknown = sorted(k for k in data if k not in VHOST_LIMITS)
    if unknown:
        raise BadLimits(f"Unrecognised terms {unknown} in limits (known: {', '.join(VHOST_LIMITS)})")
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadLimits(f"{key} must be an integer, got {value!r}")
    return dict(data)


def connection_limit_text(limit: int) -> str:
    """The 530 text once ``max-connections`` is reached (``{user}``: who logged in)."""
    return f"NOT_ALLOWED - access to vhost '/' refused for user '{{user}}': connection limit ({limit}) is reached"


def arguments_from_json(data) -> dict:
    return {str(k): from_json_value(v) for k, v in (data or {}).items()}


def arguments_to_json(arguments) -> dict:
    return {str(k): to_json_value(v) for k, v in (arguments or {}).items()}


class Definitions:
    def __init__(self) -> None:
        self.routing = RoutingTable(log_changes=True)
        self.queues: dict[str, QueueDef] = {}
        self.limits: dict[str, int] = {}

    def limit(self, name: str) -> int | None:
        """The vhost's ``name`` limit, None when there is none (unset or negative)."""
        value = self.limits.get(name)
        return value if value is not None and value >= 0 else None

    # -- queues ----------------------------------------------------------------------------------
    def declare_queue(self, name: str, *, durable: bool, exclusive: bool, auto_delete: bool, arguments: dict,
                      owner: str, passive: bool, reserved: bool = False) -> tuple[QueueDef | None, bool]:
        """(the queue, made now?) for a queue.declare from the connection whose reader is ``owner``;
        ``reserved``: the broker's own (a direct reply-to queue), which may be named ``amq.``.
        Raises what the client is told (``QueueError`` from args, ``ChannelLevelError``)."""
        q = self.queues.get(name)
        if passive:
            if q is None:
                raise ChannelLevelError(NOT_FOUND, f"NOT_FOUND - no {resource(name)}", *QUEUE_DECLARE)
            if q.owner is not None and q.owner != owner:
                check_redeclare(q.spec(), QueueSpec(name, q.durable, q.auto_delete, owner, q.arguments))
            return q, False
        if name.startswith("amq.") and not reserved:
            raise ChannelLevelError(ACCESS_REFUSED, f"ACCESS_REFUSED - queue name '{name}' contains reserved "
                                                    "prefix 'amq.*'", *QUEUE_DECLARE)
        durable = durable and not exclusive          # as RabbitMQ stores it
        wanted = QueueSpec(name, durable=durable, auto_delete=auto_delete, owner=owner if exclusive else None,
                           arguments=arguments)
        if q is not None:
            check_redeclare(q.spec(), wanted)
            return q, False
        try:
            check(name)
        except BadName as exc:
            raise ChannelLevelError(406, f"PRECONDITION_FAILED - {exc}", *QUEUE_DECLARE) from None
        args = parse_queue_args(name, arguments)
        most = self.limit("max-queues")
        if most is not None and not name.startswith(REPLY_TO_PREFIX) and sum(
                not r.name.startswith(REPLY_TO_PREFIX) for r in self.queues.values()) >= most:
            raise ChannelLevelError(406, f"PRECONDITION_FAILED - cannot declare queue '{name}': queue limit in "
                                         f"vhost '/' ({most}) is reached", *QUEUE_DECLARE)
        q = QueueDef(name, durable, exclusive, auto_delete, dict(arguments), args, owner if exclusive else None)
        self.queues[name] = q
        self.routing.add_queue(name, durable=durable)
        return q, True

    def remove_queue(self, name: str) -> None:
        """The queue is gone: its bindings go, and exchanges that auto-delete with them."""
        self.queues.pop(name, None)
        self.routing.remove_queue(name)

    # -- the durable part on disk ---------------------------------------------------------------------
    def durable(self) -> dict:
        data = self.routing.durable()
        props = {}
        for name in data["queues"]:
            q = self.queues.get(name)
            if q is not None and (q.arguments or q.auto_delete):
                props[name] = {"arguments": arguments_to_json(q.arguments), "auto_delete": q.auto_delete}
        if props:
            data["queue_props"] = props
        if self.limits:
            data["vhost_limits"] = dict(self.limits)
        return data

    def save(self, data_dir: str) -> None:
        path = os.path.join(data_dir, DEFINITIONS_FILE)
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self.durable(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def load(self, data_dir: str) -> tuple[list[str], list[str]]:
        """Read the durable definitions; returns (the durable queues to start, log lines about what was wrong)."""
        path = os.path.join(data_dir, DEFINITIONS_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                defs = json.load(f)
            if not isinstance(defs, dict):
                raise ValueError(f"a JSON {type(defs).__name__}, not an object")
        except FileNotFoundError:
            return [], []
        except (OSError, ValueError) as exc:
            aside = f"{path}.bad-{time.strftime('%Y%m%d-%H%M%S')}"
            try:
                os.replace(path, aside)
            except OSError:
                aside = "(could not be moved aside)"
            return [], [f"definitions file {path} could not be read ({exc}); moved to {aside}, starting "
                        "with no durable definitions"]
        problems: list[str] = []
        try:
            self.limits = parse_limits(defs.get("vhost_limits") or {})
        except BadLimits as exc:
            problems.append(f"skipped the vhost limits: {exc}")
        props = defs.get("queue_props") if isinstance(defs.get("queue_props"), dict) else {}
        queues = []
        for name in defs.get("queues") or [] if isinstance(defs.get("queues") or [], list) else []:
            if not isinstance(name, str):
                problems.append(f"skipped queue entry {name!r}: not a name")
                continue
            prop = props.get(name) if isinstance(props.get(name), dict) else {}
            try:
                check(name)
                arguments = arguments_from_json(prop.get("arguments"))
                args = parse_queue_args(name, arguments)
            except Exception as exc:       # noqa: BLE001 - any bad entry is skipped, never fatal
                problems.append(f"skipped queue {name!r}: {exc}")
                continue
            self.queues[name] = QueueDef(name, True, False, bool(prop.get("auto_delete")), arguments, args)
            queues.append(name)
        if not isinstance(defs.get("queues", []), list):
            problems.append(f"skipped the queues: {type(defs.get('queues')).__name__}, not a list")
        routing = {"queues": queues, "exchanges": defs.get("exchanges") or {}}
        problems += self.routing.load_durable(routing)
        self.routing.take_changes()              # a fresh start: channels get the snapshot
        return queues, problems
