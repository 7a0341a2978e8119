"""Exchanges, queues and bindings: the broker's one table of them, and the durable part on disk (pure but for the file).

The supervisor owns the table; every channel gets a copy of the exchanges
(``exchange_table``) so it can route without asking. A request that breaks a
rule returns ``Refused`` with RabbitMQ's reply code and text; nothing changes.

Durable queues, exchanges and their bindings are kept in
``DATA_DIR/definitions.json`` (written to a temporary file, fsynced, renamed)
so a restart on the same data directory brings them back. Reading it never
keeps the broker from starting: a file that does not parse is moved aside as
``definitions.json.bad-<time>`` and an entry that is not valid (a name
RabbitMQ would not accept, an unknown exchange type, a malformed binding) is
skipped; both are reported as lines for the log.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from pipeline.broker.names import BadName, check

EXCHANGE_TYPES = ("direct", "fanout", "topic")
PREDECLARED_EXCHANGES = {"amq.direct": "direct", "amq.fanout": "fanout", "amq.topic": "topic"}
DEFINITIONS_FILE = "definitions.json"


@dataclass(frozen=True)
class Refused:
    """A request the broker refuses: the channel is closed with ``code`` and ``text``."""
    code: int
    text: str


@dataclass
class QueueDef:
    name: str
    durable: bool
    exclusive: bool = False
    auto_delete: bool = False
    down: bool = False              # its process crashed too often and was given up


@dataclass
class ExchangeDef:
    name: str
    type: str
    durable: bool
    bindings: list[tuple[str, str]] = field(default_factory=list)     # (queue, routing key)


def not_found_exchange(name: str) -> Refused:
    return Refused(404, f"NOT_FOUND - no exchange '{name}' in vhost '/'")


def not_found_queue(name: str) -> Refused:
    return Refused(404, f"NOT_FOUND - no queue '{name}' in vhost '/'")


def queue_stopped(name: str) -> Refused:
    return Refused(404, f"NOT_FOUND - queue '{name}' in vhost '/' process is stopped by supervisor")


class Definitions:
    def __init__(self) -> None:
        self.queues: dict[str, QueueDef] = {}
        self.exchanges: dict[str, ExchangeDef] = {
            name: ExchangeDef(name, kind, True) for name, kind in PREDECLARED_EXCHANGES.items()}

    # -- exchanges and bindings ------------------------------------------------------------
    def declare_exchange(self, name: str, kind: str, *, durable: bool, passive: bool) -> Refused | bool:
        """Declare (or check) an exchange; True when a new one was made."""
        if name in ("", "amq.default"):
            return False
        ex = self.exchanges.get(name)
        if ex is None:
            if passive:
                return not_found_exchange(name)
            if kind not in EXCHANGE_TYPES:
                return Refused(503, f"COMMAND_INVALID - unknown exchange type '{kind}'")
            if name.startswith("amq."):
                return Refused(403, f"ACCESS_REFUSED - exchange name '{name}' contains reserved prefix 'amq.*'")
            try:
                check(name)
            except BadName as exc:
                return Refused(406, f"PRECONDITION_FAILED - {exc}")
            self.exchanges[name] = ExchangeDef(name, kind, durable)
            return True
        if not passive and ex.type != kind:
            return Refused(406, f"PRECONDITION_FAILED - inequivalent arg 'type' for exchange '{name}' in vhost "
                                f"'/': received '{kind}' but current is '{ex.type}'")
        return False

    def bind(self, exchange: str, queue: str, key: str, *, unbind: bool = False) -> Refused | ExchangeDef:
        """Add (or remove) a binding; the exchange it changed."""
        if exchange == "":
            return Refused(403, "ACCESS_REFUSED - operation not permitted on the default exchange")
        ex = self.exchanges.get(exchange)
        if ex is None:
            return not_found_exchange(exchange)
        if queue not in self.queues:
            return not_found_queue(queue)
        binding = (queue, key)
        if not unbind and binding not in ex.bindings:
            ex.bindings.append(binding)
        elif unbind and binding in ex.bindings:
            ex.bindings.remove(binding)
        return ex

    def exchange_table(self, names=None) -> dict:
        """What channels route with: name -> {type, bindings}, for ``names`` (all when None)."""
        return {name: {"type": ex.type, "bindings": [list(b) for b in ex.bindings]}
                for name, ex in self.exchanges.items() if names is None or name in names}

    # -- queues ------------------------------------------------------------------------------
    def add_queue(self, name: str, *, durable: bool, exclusive: bool = False,
                  auto_delete: bool = False) -> Refused | QueueDef:
        try:
            check(name)
        except BadName as exc:
            return Refused(406, f"PRECONDITION_FAILED - {exc}")
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = QueueDef(name, durable, exclusive, auto_delete)
        return q

    # -- the durable part on disk -----------------------------------------------------------------
    def durable(self) -> dict:
        durable_queues = sorted(name for name, q in self.queues.items() if q.durable)
        kept = set(durable_queues)
        exchanges = {name: {"type": ex.type, "bindings": [list(b) for b in ex.bindings if b[0] in kept]}
                     for name, ex in self.exchanges.items() if ex.durable}
        return {"queues": durable_queues, "exchanges": exchanges}

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
        problems: list[str] = []
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
        queues = []
        for name in _list(defs.get("queues"), "queues", problems):
            if not isinstance(name, str):
                problems.append(f"skipped queue entry {name!r}: not a name")
                continue
            made = self.add_queue(name, durable=True)
            if isinstance(made, Refused):
                problems.append(f"skipped queue {name!r}: {made.text}")
                continue
            queues.append(name)
        exchanges = defs.get("exchanges")
        if not isinstance(exchanges, dict):
            if exchanges is not None:
                problems.append(f"skipped the exchanges: {type(exchanges).__name__}, not an object")
            exchanges = {}
        for name, ex in exchanges.items():
            if not isinstance(ex, dict) or ex.get("type") not in EXCHANGE_TYPES:
                problems.append(f"skipped exchange {name!r}: no valid type")
                continue
            mine = self.exchanges.get(name)
            if mine is None:
                try:
                    check(name)
                except BadName as exc:
                    problems.append(f"skipped exchange {name!r}: {exc}")
                    continue
                mine = self.exchanges[name] = ExchangeDef(name, ex["type"], True)
            for b in _list(ex.get("bindings"), f"bindings of exchange {name!r}", problems):
                if (not isinstance(b, list) or len(b) != 2 or not all(isinstance(x, str) for x in b)
                        or b[0] not in self.queues):
                    problems.append(f"skipped binding {b!r} of exchange {name!r}")
                    continue
                if tuple(b) not in mine.bindings:
                    mine.bindings.append(tuple(b))
        return queues, problems


def _list(value, what: str, problems: list[str]) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        problems.append(f"skipped the {what}: {type(value).__name__}, not a list")
        return []
    return value
