"""Exchanges, bindings and routing as RabbitMQ 3.10 does them: one table, sans-IO.

How a publish to exchange X with routing key K (and headers H) finds its queues::

    X ──its type's match──▶ queues                  direct   K == binding key
    │                 └───▶ exchanges ─▶ (again)    fanout   every binding
    │                                               topic    words of K against the pattern
    └─ X's own bindings matched nothing and X       headers  x-match over the binding's
       names an alternate-exchange ─▶ that AE                 arguments and H
                                       (again)

Every exchange reached routes with its own bindings; each is visited at most
once, so cycles of exchange-to-exchange bindings or of alternate exchanges
end; a queue reached by several paths gets one copy. An alternate exchange is
looked up by name when a message needs it and may not exist (then nothing
happens). The default exchange ``b""`` routes to the queue named by the key,
whether or not it exists (the caller drops missing queues, as RabbitMQ does).

The table has one owner (the supervisor), which applies the AMQP methods
(``declare_exchange``, ``delete_exchange``, ``bind_queue``, ...) with
RabbitMQ's checks: a refusal raises ``ChannelLevelError`` or
``ConnectionLevelError`` (``pipeline.amqp.errors``: reply code, text,
class and method ids, ``hard``) and changes nothing. Copies (channels, queues
that dead-letter) are built from ``snapshot()`` and kept current with the
owner's ``take_changes()`` passed to ``apply()``; ``durable()`` is the part
kept in ``definitions.json``.

Names and routing keys are ``bytes`` inside and in every result: the data
path carries them so, and a publish's may be any bytes. Methods also take
``str`` (encoded UTF-8, surrogateescape), snapshots and changes carry
``str`` (decoded the same way, so any bytes round-trip), reply texts show
bytes that are not UTF-8 as U+FFFD. Table keys (arguments, headers) are
``str``, values as ``pipeline.amqp.fields`` decodes them.

Header values compare as RabbitMQ compares AMQP field values: by value at the
top (``1 == 1.0 ==`` a short 1 ``==`` timestamp 1; a longstr equals a byte
array with the same bytes; ``True`` equals only ``True``; decimals as
(scale, digits), so 1.0 is not 1), by type and value inside tables and
arrays. A decoded value has lost its exact type, so inside tables and arrays
integers of different widths (and float vs double) compare equal here where
RabbitMQ tells them apart.

Not here: the CC and BCC headers (sender-selected distribution, which add
routing keys), direct reply-to (``amq.rabbitmq.reply-to``), policies (an
alternate exchange set by policy), exchange types from plugins, and
RabbitMQ's "invalid exchange type" for a type name that happens to be an
Erlang atom (always "unknown exchange type" here).
"""

from __future__ import annotations

import base64
import datetime
import decimal
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

from pipeline.amqp.errors import (ACCESS_REFUSED, COMMAND_INVALID, NOT_FOUND, PRECONDITION_FAILED,
                                  SOFT_ERROR_CODES, ChannelLevelError, ConnectionLevelError, clip_reply_text,
                                  erlang_binary, reply_text)
from pipeline.broker.names import BadName, check

DIRECT, FANOUT, TOPIC, HEADERS = "direct", "fanout", "topic", "headers"
EXCHANGE_TYPES = (DIRECT, FANOUT, TOPIC, HEADERS)
DEFAULT_EXCHANGE = b""
# (type, internal) of the exchanges every vhost has; all durable, none auto-delete
PREDECLARED = {b"amq.direct": (DIRECT, False), b"amq.fanout": (FANOUT, False), b"amq.topic": (TOPIC, False),
               b"amq.headers": (HEADERS, False), b"amq.match": (HEADERS, False),
               b"amq.rabbitmq.trace": (TOPIC, True)}
X_MATCH_MODES = ("all", "any", "all-with-x", "any-with-x")
ROUTE_CACHE_MAX = 4096          # (exchange, key) results kept; the cache is emptied when full or on any change
SNAPSHOT_FORMAT = 1

# class and method ids of the methods whose refusals are raised here
EXCHANGE_DECLARE, EXCHANGE_DELETE = (40, 10), (40, 20)
EXCHANGE_BIND, EXCHANGE_UNBIND = (40, 30), (40, 40)
QUEUE_BIND, QUEUE_UNBIND = (50, 20), (50, 50)
BASIC_PUBLISH = (60, 40)

DURABLE, AUTO_DELETE, INTERNAL = 1, 2, 4      # exchange flags in snapshots and changes
_Q, _E = "q", "e"                             # a binding's destination kind
_HASH, _STAR = b"#", b"*"


class RouteResult(NamedTuple):
    """Where a publish goes: queue names (sorted, each once), and ``alternate``: an exchange on the way
    matched nothing and passed the message to its alternate exchange, which exists."""

    queues: tuple
    alternate: bool


@dataclass(frozen=True)
class ExchangeInfo:
    name: bytes
    type: str
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: dict


@dataclass(frozen=True)
class Binding:
    source: bytes
    destination: bytes
    to_exchange: bool           # the destination is an exchange (exchange.bind), not a queue
    routing_key: bytes
    arguments: dict


@dataclass(frozen=True)
class RoutingStatistics:
    exchanges: int              # user and predeclared, not the default exchange
    queues: int
    bindings: int
    routes: int                 # route() calls
    cache_hits: int             # route() calls answered from the cache
    alternate_routes: int       # routes in which an alternate exchange took part


def _refuse(code: int, explanation: str, method: tuple[int, int]):
    cls = ChannelLevelError if code in SOFT_ERROR_CODES else ConnectionLevelError
    return cls(code, clip_reply_text(reply_text(code, explanation)), *method)


def _b(name) -> bytes:
    if type(name) is bytes:
        return name
    if isinstance(name, str):
        return name.encode("utf-8", "surrogateescape")
    return bytes(name)


def _s(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")


def _shown(name: bytes) -> str:
    return name.decode("utf-8", "replace")


def _rs(kind: str, name: bytes) -> str:
    return f"{kind} '{_shown(name)}' in vhost '/'"


def _strip_cr_lf(name: bytes) -> bytes:
    return name.replace(b"\r", b"").replace(b"\n", b"") if b"\r" in name or b"\n" in name else name


def _words(key: bytes) -> list:
    return key.split(b".") if key else []


# -- AMQP field values: comparison keys, RabbitMQ's type names, JSON --------------------------------
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_VOID = ("void",)
_PRESENT = object()             # a binding argument with a void value: the header need only be present


def _seconds(value: datetime.datetime) -> int:
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return int((value - _EPOCH).total_seconds())


def _decimal(value: decimal.Decimal):
    sign, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        return ("nan", str(value))
    unscaled = int("".join(map(str, digits)) or "0")
    return (-exponent, -unscaled if sign else unscaled)


def field_key(value):
    """What RabbitMQ's ``==`` on a decoded field value sees: equal keys for values it takes as equal."""
    t = type(value)
    if t is str:
        return value.encode("utf-8", "surrogateescape")
    if t is bytes or t is int or t is float:
        return value
    if t is bool:
        return ("bool", value)
    if t is bytearray:
        return bytes(value)
    if value is None:
        return _VOID
    if t is decimal.Decimal:
        return ("decimal", _decimal(value))
    if t is datetime.datetime:
        return _seconds(value)
    if t is dict:                 # tables and arrays are lists of typed entries in RabbitMQ
        return ("list", tuple((_b(k), *_typed_key(v)) for k, v in value.items()))
    if t is list:
        return ("list", tuple(_typed_key(v) for v in value))
    return ("other", repr(value))


def _typed_key(value) -> tuple:
    return (field_type(value), field_key(value))


def field_type(value) -> str:
    """RabbitMQ's name for the AMQP type of a decoded value, as pika would have sent it."""
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
    return "void"


_TYPE_CLASS = {"signedint": "int", "long": "int", "decimal": "int", "double": "float"}


def _erlang(value) -> str:
    """``value`` as Erlang's ``~p`` prints it, near enough for a reply text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "undefined"
    if isinstance(value, (str, bytes, bytearray)):
        return erlang_binary(_b(value) if isinstance(value, str) else bytes(value))
    if isinstance(value, datetime.datetime):
        return str(_seconds(value))
    if isinstance(value, decimal.Decimal):
        scale, unscaled = _decimal(value)
        return f"{{{scale},{unscaled}}}"
    return repr(value)


def _val(value) -> str:
    """RabbitMQ's ``val/1`` for a value in an equivalence text: a binary as it is, anything else as ``~p``."""
    if isinstance(value, (str, bytes)):
        return f"'{_shown(_b(value))}'"
    return f"'{_erlang(value)}'"


def _typed_val(value, present: bool) -> str:
    if not present:
        return "none"
    shown = _shown(_b(value)) if isinstance(value, (str, bytes)) else _erlang(value)
    return f"the value '{shown}' of type '{field_type(value)}'"


def to_json_value(value):
    """A decoded field value as JSON, tagged where JSON has no type of its own (see ``from_json_value``)."""
    t = type(value)
    if value is None or t in (bool, int, float, str):
        return value
    if t is bytes:
        return {"S64": base64.b64encode(value).decode("ascii")}
    if t is bytearray:
        return {"x64": base64.b64encode(bytes(value)).decode("ascii")}
    if t is decimal.Decimal:
        return {"D": str(value)}
    if t is datetime.datetime:
        return {"T": value.isoformat()}
    if t is dict:
        return {"F": [[k, to_json_value(v)] for k, v in value.items()]}
    if t is list:
        return [to_json_value(v) for v in value]
    raise TypeError(f"not an AMQP field value: {value!r}")


def from_json_value(value):
    if isinstance(value, list):
        return [from_json_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, data), = value.items()
    if tag == "S64":
        return base64.b64decode(data)
    if tag == "x64":
        return bytearray(base64.b64decode(data))
    if tag == "D":
        return decimal.Decimal(data)
    if tag == "T":
        return datetime.datetime.fromisoformat(data)
    if tag == "F":
        return {k: from_json_value(v) for k, v in data}
    raise ValueError(f"unknown field value tag {tag!r}")


def _table_json(table: Mapping | None):
    return {k: to_json_value(v) for k, v in table.items()} if table else None


def _table_from_json(data) -> dict:
    return {k: from_json_value(v) for k, v in data.items()} if data else {}


def _args_key(args: Mapping | None) -> tuple:
    """A binding's identity part from its arguments: RabbitMQ compares them sorted, by type and value."""
    if not args:
        return ()
    return tuple(sorted((k, _typed_key(v)) for k, v in args.items()))


# -- headers exchanges --------------------------------------------------------------------------------
def _x_match_error(args: Mapping | None) -> str | None:
    """RabbitMQ's objection to a binding's x-match (headers exchanges), or None."""
    if not args or "x-match" not in args:
        return None
    mode = args["x-match"]
    if isinstance(mode, (str, bytes)):
        if _b(mode) in (m.encode() for m in X_MATCH_MODES):
            return None
        return (f"Invalid x-match field value {erlang_binary(_b(mode))}; expected all, any, all-with-x, "
                f"or any-with-x")
    return f"Invalid x-match field type {field_type(mode)} (value {_erlang(mode)}); expected longstr"


def _headers_spec(args: Mapping | None) -> tuple:
    """(match all?, ((header, wanted key or _PRESENT), ...)) from a binding's arguments."""
    mode = (args or {}).get("x-match")
    mode = _b(mode).decode("utf-8", "replace") if isinstance(mode, (str, bytes)) else "all"
    with_x = mode in ("all-with-x", "any-with-x")
    pairs = tuple((k, _PRESENT if v is None else field_key(v)) for k, v in (args or {}).items()
                  if k != "x-match" and (with_x or not k.startswith("x-")))
    return (mode not in ("any", "any-with-x"), pairs)


def _headers_match(spec: tuple, headers: dict) -> bool:
    """``headers`` (field keys by name) against a binding's spec, as rabbit_exchange_type_headers matches."""
    match_all, pairs = spec
    if match_all:
        for k, want in pairs:
            if k not in headers or (want is not _PRESENT and headers[k] != want):
                return False
        return True
    for k, want in pairs:
        if k in headers and (want is _PRESENT or headers[k] == want):
            return True
    return False


# -- topic exchanges: a trie of binding-key words ------------------------------------------------------
class _Node:
    __slots__ = ("children", "dests", "loops")

    def __init__(self, loops: bool = False) -> None:
        self.children: dict = {}
        self.dests: dict = {}       # destination -> how many bindings end here with it
        self.loops = loops          # reached by '#': may take any word and stay


def _closure(nodes) -> dict:
    """``nodes`` and every node they reach through '#' edges (a '#' may take no word)."""
    out: dict = {}
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in out:
            continue
        out[node] = None
        h = node.children.get(_HASH)
        if h is not None:
            stack.append(h)
    return out


def _topic_match(root: _Node, words: list) -> dict:
    """The destinations of the bindings whose keys match ``words``; a set of states, so no key is exponential."""
    current = _closure((root,))
    for w in words:
        nxt = []
        for node in current:
            children = node.children
            if children:
                c = children.get(w)
                if c is not None:
                    nxt.append(c)
                c = children.get(_STAR)
                if c is not None:
                    nxt.append(c)
            if node.loops:
                nxt.append(node)
        if not nxt:
            return {}
        current = _closure(nxt)
    dests: dict = {}
    for node in current:
        if node.dests:
            dests.update(node.dests)
    return dests


def _count(index: dict, dest, delta: int) -> None:
    n = index.get(dest, 0) + delta
    if n:
        index[dest] = n
    else:
        del index[dest]


class _Exchange:
    __slots__ = ("name", "type", "durable", "auto_delete", "internal", "arguments", "alternate",
                 "bindings", "index")

    def __init__(self, name: bytes, kind: str, durable: bool, auto_delete: bool, internal: bool,
                 arguments: dict) -> None:
        self.name, self.type = name, kind
        self.durable, self.auto_delete, self.internal = durable, auto_delete, internal
        self.arguments = arguments
        ae = arguments.get("alternate-exchange")
        self.alternate = _b(ae) if isinstance(ae, (str, bytes)) else None
        self.bindings: dict = {}    # (kind, destination, key, args key) -> arguments as given
        self.index = _Node() if kind == TOPIC else {}

    @property
    def flags(self) -> int:
        return DURABLE * self.durable | AUTO_DELETE * self.auto_delete | INTERNAL * self.internal

    def add(self, bid: tuple, args: dict) -> None:
        self.bindings[bid] = args
        dest, key = (bid[0], bid[1]), bid[2]
        kind, index = self.type, self.index
        if kind == DIRECT:
            _count(index.setdefault(key, {}), dest, 1)
        elif kind == FANOUT:
            _count(index, dest, 1)
        elif kind == TOPIC:
            node = index
            for w in _words(key):
                child = node.children.get(w)
                if child is None:
                    child = node.children[w] = _Node(loops=w == _HASH)
                node = child
            _count(node.dests, dest, 1)
        else:
            index[bid] = (_headers_spec(args), dest)

    def remove(self, bid: tuple) -> None:
        del self.bindings[bid]
        dest, key = (bid[0], bid[1]), bid[2]
        kind, index = self.type, self.index
        if kind == DIRECT:
            _count(index[key], dest, -1)
            if not index[key]:
                del index[key]
        elif kind == FANOUT:
            _count(index, dest, -1)
        elif kind == TOPIC:
            path = [index]
            words = _words(key)
            for w in words:
                path.append(path[-1].children[w])
            _count(path[-1].dests, dest, -1)
            for i in range(len(words), 0, -1):          # prune nodes left with nothing
                node = path[i]
                if node.dests or node.children:
                    break
                del path[i - 1].children[words[i - 1]]
        else:
            del index[bid]

    def matches(self, routing_key: bytes, headers: dict | None):
        kind = self.type
        if kind == DIRECT:
            return self.index.get(routing_key, ())
        if kind == FANOUT:
            return self.index
        if kind == TOPIC:
            return _topic_match(self.index, _words(routing_key))
        return [dest for spec, dest in self.index.values() if _headers_match(spec, headers)]

    def info(self) -> ExchangeInfo:
        return ExchangeInfo(self.name, self.type, self.durable, self.auto_delete, self.internal,
                            dict(self.arguments))


class RoutingTable:
    """The exchanges, queues and bindings of the broker's one vhost, and ``route()`` over them."""

    def __init__(self, *, log_changes: bool = False) -> None:
        self._exchanges: dict[bytes, _Exchange] = {
            name: _Exchange(name, kind, True, False, internal, {}) for name, (kind, internal) in PREDECLARED.items()}
        self._queues: dict[bytes, bool] = {}                  # name -> durable
        self._bound_to: dict[tuple, set] = {}                 # (kind, name) -> {(source, binding id)}
        self._cache: dict = {}
        self._needs_headers: dict = {}
        self._changes: list | None = [] if log_changes else None
        self._routes = self._cache_hits = self._alternate_routes = 0

    # -- routing (the hot path) -------------------------------------------------------------------------
    def route(self, exchange, routing_key, headers: Mapping | None = None) -> RouteResult:
        """The queues a publish to ``exchange`` with ``routing_key`` goes to.

        ``headers`` (the message's, decoded) matter only where ``needs_headers(exchange)``; None
        is a message without headers. Raises 404 for no such exchange, 403 for an internal one.
        """
        self._routes += 1
        key = (exchange, routing_key)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache_hits += 1
            return hit
        if type(exchange) is not bytes or type(routing_key) is not bytes:     # str: fine, but never cached
            exchange, routing_key = _b(exchange), _b(routing_key)
            key = (exchange, routing_key)
        if not exchange:
            result = RouteResult((routing_key,), False)
            self._remember(key, result)
            return result
        x = self._exchanges.get(exchange)
        if x is None:
            raise _refuse(NOT_FOUND, f"no {_rs('exchange', exchange)}", BASIC_PUBLISH)
        if x.internal:
            raise _refuse(ACCESS_REFUSED, f"cannot publish to internal {_rs('exchange', exchange)}", BASIC_PUBLISH)
        result, cacheable = self._walk(x, routing_key, headers)
        if result.alternate:
            self._alternate_routes += 1
        if cacheable:
            self._remember(key, result)
        return result

    def _remember(self, key: tuple, result: RouteResult) -> None:
        if len(self._cache) >= ROUTE_CACHE_MAX:
            self._cache.clear()
        self._cache[key] = result

    def _walk(self, x: _Exchange, routing_key: bytes, headers) -> tuple[RouteResult, bool]:
        exchanges = self._exchanges
        queues: set = set()
        seen = {x.name}
        work = [x]
        alternate = False
        cacheable = True
        header_keys = None
        while work:
            x = work.pop()
            if x.type == HEADERS:
                cacheable = False
                if header_keys is None:
                    header_keys = {k: field_key(v) for k, v in headers.items()} if headers else {}
            dests = x.matches(routing_key, header_keys)
            if not dests:
                ae = x.alternate
                if ae is not None and ae in exchanges:
                    alternate = True
                    if ae not in seen:
                        seen.add(ae)
                        work.append(exchanges[ae])
                continue
            for kind, name in dests:
                if kind == _Q:
                    queues.add(name)
                elif name not in seen:
                    seen.add(name)
                    nx = exchanges.get(name)
                    if nx is not None:
                        work.append(nx)
        return RouteResult(tuple(sorted(queues)), alternate), cacheable

    def needs_headers(self, exchange) -> bool:
        """True if a publish to ``exchange`` may reach a headers exchange, so ``route`` needs the headers."""
        exchange = _b(exchange)
        known = self._needs_headers.get(exchange)
        if known is None:
            known = self._needs_headers[exchange] = self._reaches_headers(exchange)
        return known

    def _reaches_headers(self, exchange: bytes) -> bool:
        seen, work = {exchange}, [exchange]
        while work:
            x = self._exchanges.get(work.pop())
            if x is None:
                continue
            if x.type == HEADERS:
                return True
            nexts = [bid[1] for bid in x.bindings if bid[0] == _E]
            if x.alternate is not None:
                nexts.append(x.alternate)
            for name in nexts:
                if name not in seen:
                    seen.add(name)
                    work.append(name)
        return False

    # -- exchanges -------------------------------------------------------------------------------------
    def declare_exchange(self, name, kind: str, *, passive: bool = False, durable: bool = False,
                         auto_delete: bool = False, internal: bool = False,
                         arguments: Mapping | None = None) -> bool:
        """exchange.declare: True if a new exchange was made; refusals in RabbitMQ's order."""
        if not passive and kind not in EXCHANGE_TYPES:
            raise _refuse(COMMAND_INVALID, f"unknown exchange type '{kind}'", EXCHANGE_DECLARE)
        name = _strip_cr_lf(_b(name))
        if not name:
            raise _refuse(ACCESS_REFUSED, "operation not permitted on the default exchange", EXCHANGE_DECLARE)
        x = self._exchanges.get(name)
        if passive:
            if x is None:
                raise _refuse(NOT_FOUND, f"no {_rs('exchange', name)}", EXCHANGE_DECLARE)
            return False
        arguments = dict(arguments or {})
        if x is not None:
            self._check_equivalent(x, kind, durable, auto_delete, internal, arguments)
            return False
        if name.startswith(b"amq."):
            raise _refuse(ACCESS_REFUSED, f"exchange name '{_shown(name)}' contains reserved prefix 'amq.*'",
                          EXCHANGE_DECLARE)
        ae = arguments.get("alternate-exchange")
        if "alternate-exchange" in arguments and not isinstance(ae, (str, bytes)):
            raise _refuse(PRECONDITION_FAILED, f"invalid type '{field_type(ae)}' for arg 'alternate-exchange' "
                                               f"in {_rs('exchange', name)}", EXCHANGE_DECLARE)
        self._add_exchange(name, kind, durable, auto_delete, internal, arguments)
        return True

    def _check_equivalent(self, x: _Exchange, kind: str, durable: bool, auto_delete: bool, internal: bool,
                          arguments: dict) -> None:
        for field, current, received in (("type", x.type, kind), ("durable", x.durable, bool(durable)),
                                         ("auto_delete", x.auto_delete, bool(auto_delete)),
                                         ("internal", x.internal, bool(internal))):
            if current != received:
                raise self._inequivalent(x.name, field, _val(received), _val(current))
        key = "alternate-exchange"             # the one argument RabbitMQ compares for exchanges
        have, want = x.arguments.get(key), arguments.get(key)
        if key not in x.arguments and key not in arguments:
            return
        if key not in x.arguments or key not in arguments:
            raise self._inequivalent(x.name, key, _typed_val(want, key in arguments),
                                     _typed_val(have, key in x.arguments))
        same_class = (_TYPE_CLASS.get(field_type(have), field_type(have))
                      == _TYPE_CLASS.get(field_type(want), field_type(want)))
        if not (same_class and field_key(have) == field_key(want)):
            raise self._inequivalent(x.name, key, _val(want), _val(have))

    @staticmethod
    def _inequivalent(name: bytes, field: str, received: str, current: str):
        return _refuse(PRECONDITION_FAILED, f"inequivalent arg '{field}' for {_rs('exchange', name)}: "
                                            f"received {received} but current is {current}", EXCHANGE_DECLARE)

    def delete_exchange(self, name, *, if_unused: bool = False) -> tuple:
        """exchange.delete: the exchanges that went (this one, then any auto-deleted); () if it did not exist."""
        name = _strip_cr_lf(_b(name))
        if not name:
            raise _refuse(ACCESS_REFUSED, "operation not permitted on the default exchange", EXCHANGE_DELETE)
        if name.startswith(b"amq."):
            raise _refuse(ACCESS_REFUSED, f"deletion of system {_rs('exchange', name)} not allowed", EXCHANGE_DELETE)
        x = self._exchanges.get(name)
        if x is None:
            return ()
        if if_unused and x.bindings:
            raise _refuse(PRECONDITION_FAILED, f"{_rs('exchange', name)} in use", EXCHANGE_DELETE)
        return (name,) + self._auto_delete(self._delete_exchange(name))

    def lookup(self, name) -> ExchangeInfo | None:
        name = _b(name)
        if not name:
            return ExchangeInfo(DEFAULT_EXCHANGE, DIRECT, True, False, False, {})
        x = self._exchanges.get(name)
        return None if x is None else x.info()

    def exchanges(self) -> list[ExchangeInfo]:
        return [x.info() for x in self._exchanges.values()]

    # -- queues ------------------------------------------------------------------------------------------
    def add_queue(self, name, *, durable: bool) -> bool:
        """A queue now exists (declared or recovered); True if it was not known."""
        name = _b(name)
        if name in self._queues:
            return False
        self._add_queue(name, durable)
        return True

    def remove_queue(self, name) -> tuple:
        """A queue is gone: its bindings go with it; returns the exchanges auto-deleted as a result."""
        name = _b(name)
        if name not in self._queues:
            return ()
        return self._auto_delete(self._remove_queue(name))

    def has_queue(self, name) -> bool:
        return _b(name) in self._queues

    # -- bindings ----------------------------------------------------------------------------------------
    def bind_queue(self, exchange, queue, routing_key=b"", arguments: Mapping | None = None) -> bool:
        """queue.bind: True if the binding is new."""
        return self._bind(_b(exchange), _Q, _b(queue), _b(routing_key), arguments, QUEUE_BIND)

    def bind_exchange(self, source, destination, routing_key=b"", arguments: Mapping | None = None) -> bool:
        """exchange.bind: messages ``source`` routes here go on through ``destination``."""
        return self._bind(_b(source), _E, _b(destination), _b(routing_key), arguments, EXCHANGE_BIND)

    def unbind_queue(self, exchange, queue, routing_key=b"", arguments: Mapping | None = None) -> tuple:
        """queue.unbind: the exchanges auto-deleted as a result (unbinding what is not bound is no error)."""
        return self._unbind(_b(exchange), _Q, _b(queue), _b(routing_key), arguments, QUEUE_UNBIND)

    def unbind_exchange(self, source, destination, routing_key=b"", arguments: Mapping | None = None) -> tuple:
        return self._unbind(_b(source), _E, _b(destination), _b(routing_key), arguments, EXCHANGE_UNBIND)

    def _check_names(self, source: bytes, kind: str, dest: bytes, method) -> tuple[bytes, bytes]:
        source, dest = _strip_cr_lf(source), _strip_cr_lf(dest)
        if not source or (kind == _E and not dest):
            raise _refuse(ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        return source, dest

    def _bind(self, source: bytes, kind: str, dest: bytes, key: bytes, arguments, method) -> bool:
        source, dest = self._check_names(source, kind, dest, method)
        x = self._exchanges.get(source)
        if x is None:
            raise _refuse(NOT_FOUND, f"no {_rs('exchange', source)}", method)
        if kind == _Q and dest not in self._queues:
            raise _refuse(NOT_FOUND, f"no {_rs('queue', dest)}", method)
        if kind == _E and dest not in self._exchanges:
            raise _refuse(NOT_FOUND, f"no {_rs('exchange', dest)}", method)
        arguments = dict(arguments or {})
        if x.type == HEADERS:
            error = _x_match_error(arguments)
            if error is not None:
                raise _refuse(PRECONDITION_FAILED, error, method)
        bid = (kind, dest, key, _args_key(arguments))
        if bid in x.bindings:
            return False
        self._add_binding(x, bid, arguments)
        return True

    def _unbind(self, source: bytes, kind: str, dest: bytes, key: bytes, arguments, method) -> tuple:
        source, dest = self._check_names(source, kind, dest, method)
        x = self._exchanges.get(source)
        bid = (kind, dest, key, _args_key(arguments))
        if x is None or bid not in x.bindings:
            return ()
        self._remove_binding(x, bid)
        return self._auto_delete([source])

    def bindings(self) -> list[Binding]:
        return [Binding(x.name, bid[1], bid[0] == _E, bid[2], dict(args))
                for x in self._exchanges.values() for bid, args in x.bindings.items()]

    # -- the primitives every change is made of (each logged; apply() replays them) ----------------------
    def _log(self, change: list) -> None:
        if self._changes is not None:
            self._changes.append(change)

    def _changed(self) -> None:
        self._cache.clear()
        self._needs_headers.clear()

    def _add_exchange(self, name: bytes, kind: str, durable: bool, auto_delete: bool, internal: bool,
                      arguments: dict) -> _Exchange:
        x = self._exchanges[name] = _Exchange(name, kind, bool(durable), bool(auto_delete), bool(internal),
                                               arguments)
        self._log(["x+", _s(name), kind, x.flags, _table_json(arguments)])
        self._changed()
        return x

    def _add_binding(self, x: _Exchange, bid: tuple, arguments: dict) -> None:
        x.add(bid, arguments)
        self._bound_to.setdefault((bid[0], bid[1]), set()).add((x.name, bid))
        self._log(["b+", _s(x.name), bid[0], _s(bid[1]), _s(bid[2]), _table_json(arguments)])
        self._changed()

    def _remove_binding(self, x: _Exchange, bid: tuple) -> None:
        args = x.bindings[bid]
        x.remove(bid)
        dest = (bid[0], bid[1])
        bound = self._bound_to[dest]
        bound.discard((x.name, bid))
        if not bound:
            del self._bound_to[dest]
        self._log(["b-", _s(x.name), bid[0], _s(bid[1]), _s(bid[2]), _table_json(args)])
        self._changed()

    def _unbind_destination(self, dest: tuple) -> list[bytes]:
        """Remove every binding to ``dest``; the sources that lost one."""
        sources = []
        for source, bid in sorted(self._bound_to.get(dest, ()), key=repr):
            x = self._exchanges[source]
            self._remove_binding(x, bid)
            sources.append(source)
        return sources

    def _delete_exchange(self, name: bytes) -> list[bytes]:
        """Delete exchange ``name`` and its bindings either way; the sources that lost a binding to it."""
        x = self._exchanges[name]
        for bid in list(x.bindings):
            self._remove_binding(x, bid)
        sources = [s for s in self._unbind_destination((_E, name)) if s != name]
        del self._exchanges[name]
        self._log(["x-", _s(name)])
        self._changed()
        return sources

    def _add_queue(self, name: bytes, durable: bool) -> None:
        self._queues[name] = bool(durable)
        self._log(["q+", _s(name), int(bool(durable))])
        self._changed()

    def _remove_queue(self, name: bytes) -> list[bytes]:
        sources = self._unbind_destination((_Q, name))
        del self._queues[name]
        self._log(["q-", _s(name)])
        self._changed()
        return sources

    def _auto_delete(self, sources: Iterable[bytes]) -> tuple:
        """Delete every auto-delete exchange among ``sources`` left with no binding, and so on."""
        gone = []
        work = list(dict.fromkeys(sources))
        while work:
            name = work.pop(0)
            x = self._exchanges.get(name)
            if x is not None and x.auto_delete and not x.bindings:
                gone.append(name)
                work.extend(self._delete_exchange(name))
        return tuple(gone)

    # -- copies: snapshot, changes ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything, as JSON-able data: ``RoutingTable.from_snapshot`` makes an equal table of it."""
        exchanges = []
        for x in self._exchanges.values():
            bindings = []
            for (kind, dest, key, _), args in x.bindings.items():
                entry = [kind, _s(dest), _s(key)]
                if args:
                    entry.append(_table_json(args))
                bindings.append(entry)
            exchanges.append([_s(x.name), x.type, x.flags, _table_json(x.arguments), bindings])
        return {"format": SNAPSHOT_FORMAT, "queues": {_s(q): int(d) for q, d in self._queues.items()},
                "exchanges": exchanges}

    @classmethod
    def from_snapshot(cls, data: Mapping, *, log_changes: bool = False) -> "RoutingTable":
        if data.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"routing snapshot format {data.get('format')!r}, expected {SNAPSHOT_FORMAT}")
        table = cls()
        table._exchanges.clear()
        for name, durable in data["queues"].items():
            table._queues[_b(name)] = bool(durable)
        for name, kind, flags, args, _ in data["exchanges"]:
            table._add_exchange(_b(name), kind, flags & DURABLE, flags & AUTO_DELETE, flags & INTERNAL,
                                _table_from_json(args))
        for name, _, _, _, bindings in data["exchanges"]:
            x = table._exchanges[_b(name)]
            for kind, dest, key, *args in bindings:
                arguments = _table_from_json(args[0] if args else None)
                table._add_binding(x, (kind, _b(dest), _b(key), _args_key(arguments)), arguments)
        table._changes = [] if log_changes else None
        return table

    def take_changes(self) -> list:
        """The changes made since the last call (a table made with ``log_changes=True``), for ``apply``."""
        if self._changes is None:
            raise ValueError("this table does not log its changes (log_changes=False)")
        changes, self._changes = self._changes, []
        return changes

    def apply(self, changes: Iterable[list]) -> None:
        """Replay an owner's ``take_changes()`` on a copy: effects only, no checks and no cascades."""
        for change in changes:
            op = change[0]
            if op == "x+":
                _, name, kind, flags, args = change
                if _b(name) in self._exchanges:
                    continue
                self._add_exchange(_b(name), kind, flags & DURABLE, flags & AUTO_DELETE, flags & INTERNAL,
                                   _table_from_json(args))
            elif op == "x-":
                if _b(change[1]) in self._exchanges:
                    self._delete_exchange(_b(change[1]))
            elif op in ("b+", "b-"):
                _, source, kind, dest, key, args = change
                x = self._exchanges.get(_b(source))
                arguments = _table_from_json(args)
                bid = (kind, _b(dest), _b(key), _args_key(arguments))
                if x is None:
                    continue
                if op == "b+" and bid not in x.bindings:
                    self._add_binding(x, bid, arguments)
                elif op == "b-" and bid in x.bindings:
                    self._remove_binding(x, bid)
            elif op == "q+":
                if _b(change[1]) not in self._queues:
                    self._add_queue(_b(change[1]), change[2])
            elif op == "q-":
                if _b(change[1]) in self._queues:
                    self._remove_queue(_b(change[1]))
            else:
                raise ValueError(f"unknown routing change {change!r}")

    # -- the durable part: definitions.json ---------------------------------------------------------------
    def durable(self) -> dict:
        """Durable queues, durable exchanges, and their bindings to durable queues and durable exchanges.

        ``{"queues": [name...], "exchanges": {name: {"type", "bindings": [[queue, key(, args)]...],
        and when not empty or false: "auto_delete", "internal", "arguments",
        "exchange_bindings": [[exchange, key(, args)]...]}}}``; a predeclared exchange is listed only
        when it has durable bindings.
        """
        durable_queues = {q for q, d in self._queues.items() if d}
        durable_exchanges = {n for n, x in self._exchanges.items() if x.durable}
        out = {}
        for name, x in self._exchanges.items():
            if not x.durable:
                continue
            entry: dict = {"type": x.type, "bindings": []}
            for (kind, dest, key, _), args in x.bindings.items():
                if (dest in durable_queues) if kind == _Q else (dest in durable_exchanges):
                    row = [_s(dest), _s(key)] + ([_table_json(args)] if args else [])
                    entry.setdefault("bindings" if kind == _Q else "exchange_bindings", []).append(row)
            if name in PREDECLARED and not entry["bindings"] and "exchange_bindings" not in entry:
                continue
            if x.auto_delete:
                entry["auto_delete"] = True
            if x.internal:
                entry["internal"] = True
            if x.arguments:
                entry["arguments"] = _table_json(x.arguments)
            out[_s(name)] = entry
        return {"queues": sorted(_s(q) for q in durable_queues), "exchanges": out}

    def load_durable(self, data: Mapping) -> list[str]:
        """Add what ``durable()`` wrote; an entry that is not valid is skipped with a line saying why."""
        problems: list[str] = []
        queues = data.get("queues") or []
        for name in queues if isinstance(queues, list) else []:
            if not isinstance(name, str) or _bad_name(name):
                problems.append(f"skipped queue {name!r}: not a valid name")
                continue
            self.add_queue(name, durable=True)
        exchanges = data.get("exchanges") or {}
        if not isinstance(exchanges, dict):
            problems.append(f"skipped the exchanges: {type(exchanges).__name__}, not an object")
            exchanges = {}
        loaded = []
        for name, entry in exchanges.items():
            if _bad_name(name) or not isinstance(entry, dict) or entry.get("type") not in EXCHANGE_TYPES:
                problems.append(f"skipped exchange {name!r}: no valid name and type")
                continue
            try:
                args = _table_from_json(entry.get("arguments"))
            except (ValueError, TypeError, AttributeError) as exc:
                problems.append(f"skipped exchange {name!r}: bad arguments ({exc})")
                continue
            if _b(name) not in self._exchanges:
                self._add_exchange(_b(name), entry["type"], True, bool(entry.get("auto_delete")),
                                   bool(entry.get("internal")), args)
            loaded.append((name, entry))
        for name, entry in loaded:
            for field, kind in (("bindings", _Q), ("exchange_bindings", _E)):
                rows = entry.get(field) or []
                for row in rows if isinstance(rows, list) else [rows]:
                    if not self._load_binding(_b(name), kind, row):
                        problems.append(f"skipped binding {row!r} of exchange {name!r}")
        return problems

    def _load_binding(self, source: bytes, kind: str, row) -> bool:
        if (not isinstance(row, list) or len(row) not in (2, 3) or not all(isinstance(v, str) for v in row[:2])):
            return False
        dest, key = _b(row[0]), _b(row[1])
        if dest not in (self._queues if kind == _Q else self._exchanges):
            return False
        try:
            arguments = _table_from_json(row[2] if len(row) == 3 else None)
        except (ValueError, TypeError, AttributeError):
            return False
        x = self._exchanges[source]
        bid = (kind, dest, key, _args_key(arguments))
        if bid not in x.bindings:
            self._add_binding(x, bid, arguments)
        return True

    # -- reporting -----------------------------------------------------------------------------------------
    def statistics(self) -> RoutingStatistics:
        return RoutingStatistics(exchanges=len(self._exchanges), queues=len(self._queues),
                                 bindings=sum(len(x.bindings) for x in self._exchanges.values()),
                                 routes=self._routes, cache_hits=self._cache_hits,
                                 alternate_routes=self._alternate_routes)


def _bad_name(name: str) -> bool:
    try:
        check(name)
    except BadName:
        return True
    return not name
