"""The management API's methods and write calls as RabbitMQ 3.10.8 answers them: pure, no I/O.

``allowed(parts)`` is the ``Allow`` list of a path (RabbitMQ answers any
other method 405 with it, before asking for a login, and ``OPTIONS`` 200
with it). The write calls, each turned into a ctl request by ``server``:

- ``DELETE /api/connections/NAME``: ctl ``close_connection`` (the ``X-Reason``
  header, if any, is the text after ``CONNECTION_FORCED - ``);
- ``PUT /api/vhost-limits/%2F/NAME`` with ``{"value": N}``: ctl
  ``set_vhost_limits`` of that one, merged with the others;
- ``DELETE /api/vhost-limits/%2F/NAME``: ctl ``clear_vhost_limits`` of that one;
- ``DELETE /api/queues/%2F/NAME`` (``?if-empty=true``, ``?if-unused=true``):
  ctl ``delete_queue``; ``DELETE /api/queues/%2F/NAME/contents``: ctl ``purge_queue``.

- ``PUT /api/queues/%2F/NAME`` with ``{"durable", "auto_delete", "arguments"}`` (all optional;
  ``exclusive`` is ignored, as RabbitMQ ignores it here): ctl ``declare_queue``;
- ``PUT /api/exchanges/%2F/NAME`` with ``{"type" (direct), "durable", "auto_delete", "internal",
  "arguments"}``: ctl ``exchange`` declare; ``DELETE`` (``?if-unused=true``): ctl ``exchange`` delete;
- ``POST /api/bindings/%2F/e/SOURCE/q/QUEUE`` (or ``/e/DESTINATION``) with ``{"routing_key",
  "arguments"}``: ctl ``exchange`` bind, answered 201 with a ``Location`` of the binding's
  *properties key* (``properties_key``); ``DELETE`` of ``.../PROPERTIES_KEY`` unbinds it.

A declare answers 201 when it made the queue or exchange, 204 when one equal to it was there; a
binding 201 either way. Booleans may come as JSON booleans or the strings ``"true"``/``"false"``
(anything else is 400 ``["not_boolean", value]``); an empty body is ``{}``; a body that is not a
JSON object is 400 ``not_json``. Names under ``amq.`` (and the default exchange, ``amq.default``)
are refused 401 ``not_authorised``, as RabbitMQ refuses them. A binding's properties key is its
routing key, URL-quoted, then ``~`` and a hash of its arguments when it has any: RabbitMQ's hash is
Erlang's ``phash2`` of the arguments as terms, so the six characters after ``~`` differ from
RabbitMQ's for the same arguments (a client that takes them from the ``Location`` or from
``GET /api/bindings`` finds the same binding either way).

Each other call answers 204 with no body once the broker took it. A refusal from the
broker is an AMQP reply code and text: 404 is RabbitMQ's ``Object Not
Found``, any other is 400 ``bad_request`` with the text after its ``NAME -``
prefix, as RabbitMQ's management plugin reports the error of the
queue.delete or queue.purge it made (exclusive queues included: the API is
never their owning connection). A vhost other than ``/`` is 404; RabbitMQ
answers a DELETE of a missing vhost's limit 500 (its handler crashes), here
it is 404 ``vhost_not_found`` as for PUT.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from urllib.parse import quote, quote_plus

from pipeline.broker.definitions import VHOST_LIMITS

VHOST = "/"
NOT_FOUND = {"error": "Object Not Found", "reason": "Not Found"}
VHOST_NOT_FOUND = {"error": "not_found", "reason": "vhost_not_found"}
ACCESS_REFUSED = {"error": "not_authorised", "reason": "Access refused."}
DEFAULT_EXCHANGE = "amq.default"     # how the API names the exchange named ""
MAX_ARGUMENT_DEPTH = 32              # tables and arrays in a declare's arguments, one inside another
FORCED_REASON = "Closed via management plugin"      # RabbitMQ's text when no X-Reason header came
READ = ("HEAD", "GET", "OPTIONS")
ANY = "*"                        # any one path segment
ALLOW: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (     # (path, its methods); any other path: READ
    (("api", "connections", ANY), ("HEAD", "GET", "DELETE", "OPTIONS")),
    (("api", "queues", ANY, ANY), ("HEAD", "GET", "PUT", "DELETE", "OPTIONS")),
    (("api", "exchanges", ANY, ANY), ("HEAD", "GET", "PUT", "DELETE", "OPTIONS")),
    (("api", "bindings", ANY, "e", ANY, "q", ANY), ("HEAD", "GET", "POST", "OPTIONS")),
    (("api", "bindings", ANY, "e", ANY, "e", ANY), ("HEAD", "GET", "POST", "OPTIONS")),
    (("api", "bindings", ANY, "e", ANY, "q", ANY, ANY), ("HEAD", "GET", "DELETE", "OPTIONS")),
    (("api", "bindings", ANY, "e", ANY, "e", ANY, ANY), ("HEAD", "GET", "DELETE", "OPTIONS")),
    (("api", "queues", ANY, ANY, "contents"), ("DELETE", "OPTIONS")),
    (("api", "definitions"), ("HEAD", "GET", "POST", "OPTIONS")),
    (("api", "definitions", ANY), ("HEAD", "GET", "POST", "OPTIONS")),
    (("api", "vhost-limits"), ("GET", "OPTIONS")),
    (("api", "vhost-limits", ANY), ("GET", "OPTIONS")),
    (("api", "vhost-limits", ANY, ANY), ("PUT", "DELETE", "OPTIONS")),
)


def allowed(parts: list[str]) -> tuple[str, ...]:
    """The methods a path answers (``parts``: the path's unquoted segments, without the leading "")."""
    for pattern, methods in ALLOW:
        if len(pattern) == len(parts) and all(p in (ANY, part) for p, part in zip(pattern, parts)):
            return methods
    return READ


# -- vhost limits ---------------------------------------------------------------------------------------------
def vhost_limits_view(limits: dict) -> list[dict]:
    """``GET /api/vhost-limits`` and ``/api/vhost-limits/%2F``: the one vhost's, or none."""
    return [{"vhost": VHOST, "value": dict(limits)}] if limits else []


class BadRequest(ValueError):
    """Raised when a request's body is not what the call takes (400 ``bad_request`` with this reason: a
    text, or a JSON list where RabbitMQ gives one)."""

    def __init__(self, reason) -> None:
        super().__init__(reason)
        self.reason = reason


class UnsupportedMediaType(ValueError):
    """Raised when a body comes without ``Content-Type: application/json`` (415, as RabbitMQ)."""


def check_json(content_type: str | None) -> None:
    """A PUT's body must say it is JSON (any parameters, any case), or it is refused 415."""
    if (content_type or "").split(";", 1)[0].strip().lower() != "application/json":
        raise UnsupportedMediaType(content_type or "")


def limit_value(name: str, body: bytes) -> int:
    """The N of a ``PUT /api/vhost-limits/%2F/NAME`` body ``{"value": N}``, checked in RabbitMQ's order
    and refused with its reasons."""
    try:
        data = json.loads(body) if body.strip() else None
    except ValueError:
        raise BadRequest("not_json") from None
    if data is not None and not isinstance(data, dict):
        raise BadRequest("not_json")
    if not data or "value" not in data:
        raise BadRequest("[{key_missing,value}]")
    value = data["value"]
    if name not in VHOST_LIMITS:
        raise BadRequest(f"Validation failed\n\nUnrecognised terms [{{{erlang_term(name)},{erlang_term(value)}}}] "
                         "in limits\n")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"Validation failed\n\n{name} should be a number, actually was {erlang_term(value)}\n")
    return value


def erlang_term(value) -> str:
    """A decoded JSON value as RabbitMQ prints it in a validation error (Erlang's ``~p``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:                     # 1e+20 -> 1.0e20
            mantissa, _, exponent = text.partition("e")
            text = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exponent)}"
        return text
    if isinstance(value, str):
        return '<<"' + value.replace("\\", "\\\\").replace('"', '\\"') + '">>'
    if isinstance(value, list):
        return "[" + ",".join(erlang_term(v) for v in value) + "]"
    if isinstance(value, dict):
        return "#{" + ",".join(f"{erlang_term(k)} => {erlang_term(v)}" for k, v in value.items()) + "}"
    return str(value)


# -- the broker's answers ---------------------------------------------------------------------------------------
def refusal(reply: dict, missing: dict | None = NOT_FOUND) -> tuple[int, dict]:
    """(HTTP status, body) for a ctl reply that refused a write (``code``: an AMQP reply code). A 404 is
    ``missing``, or (None) ``not_found`` with the broker's reason, as a binding to nothing is answered;
    403 ACCESS_REFUSED is 401 ``not_authorised``."""
    text = str(reply.get("error") or "")
    name, sep, rest = text.partition(" - ")
    reason = rest if sep and name.isupper() else text
    if reply.get("code") == 404:
        return 404, missing if missing is not None else {"error": "not_found", "reason": reason}
    if reply.get("code") == 403:
        return 401, ACCESS_REFUSED
    return 400, {"error": "bad_request", "reason": reason}


def flag(query: dict, name: str) -> bool:
    """``?if-empty=true``: only the exact text ``true`` turns a flag on, and the first of repeated
    ones counts, as RabbitMQ reads it."""
    return query.get(name, [""])[0] == "true"


# -- declaring: queues, exchanges, bindings -----------------------------------------------------------------------
def body_object(body: bytes) -> dict:
    """A declare's body: ``{}`` when empty, else a JSON object (400 ``not_json`` otherwise)."""
    if not body.strip():
        return {}
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise BadRequest("not_json") from None
    if not isinstance(data, dict):
        raise BadRequest("not_json")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")        # NaN and Infinity, which Python's decoder would take


def boolean(data: dict, name: str) -> bool:
    """A flag of a declare's body: false when absent; true, false, "true" or "false" as RabbitMQ takes them."""
    value = data.get(name, False)
    if value in ("true", "false"):
        return value == "true"
    if not isinstance(value, bool):
        raise BadRequest(["not_boolean", value])
    return value


def arguments(data: dict) -> dict:
    """A declare's ``arguments`` as the broker keeps them (an empty list, as RabbitMQ takes it, is none);
    a table inside is tagged as the broker's definitions tag one."""
    value = data.get("arguments") or {}
    if not isinstance(value, dict):
        raise BadRequest("not_json")
    return {str(k): _field(v, 1) for k, v in value.items()}


def _field(value, depth: int):
    if depth > MAX_ARGUMENT_DEPTH:
        raise BadRequest(f"arguments nested deeper than {MAX_ARGUMENT_DEPTH} levels")
    if isinstance(value, dict):
        return {"F": [[str(k), _field(v, depth + 1)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_field(v, depth + 1) for v in value]
    return value


def queue_fields(data: dict) -> dict:
    """A queue's ctl ``declare_queue`` fields from a PUT's body or an imported document's queue."""
    return {"durable": boolean(data, "durable"), "auto_delete": boolean(data, "auto_delete"),
            "arguments": arguments(data)}


def exchange_fields(data: dict) -> dict:
    """An exchange's ctl ``exchange`` declare fields (type direct if none), from a PUT or an import."""
    kind = data.get("type", "direct")
    return {"kind": kind if isinstance(kind, str) else json.dumps(kind), "durable": boolean(data, "durable"),
            "auto_delete": boolean(data, "auto_delete"), "internal": boolean(data, "internal"),
            "arguments": arguments(data)}


def binding_fields(data: dict) -> dict:
    """A binding's routing key (one that is not text is its JSON) and arguments, from a POST or an import."""
    key = data.get("routing_key", "")
    return {"routing_key": key if isinstance(key, str) else json.dumps(key), "arguments": arguments(data)}


def queue_declare(body: bytes) -> dict:
    """The ctl ``declare_queue`` request's fields for ``PUT /api/queues/%2F/NAME``."""
    return queue_fields(body_object(body))


def exchange_declare(body: bytes) -> dict:
    """The ctl ``exchange`` declare's fields for ``PUT /api/exchanges/%2F/NAME``."""
    return exchange_fields(body_object(body))


def binding(body: bytes) -> tuple[dict, str]:
    """The ctl ``exchange`` bind's fields for ``POST /api/bindings/...``, and the properties key of the
    binding it makes."""
    fields = binding_fields(body_object(body))
    return fields, properties_key(fields["routing_key"], fields["arguments"])


def exchange_name(name: str) -> str:
    """An exchange as the API names it: ``amq.default`` is the default exchange, ``""``."""
    return "" if name == DEFAULT_EXCHANGE else name


def properties_key(routing_key: str, args: dict | None) -> str:
    """What names one binding between a source and a destination in the API's paths; ``args`` as the
    broker's definitions write them (``routing.to_json_value``: typed, so "1.5" and a decimal 1.5 differ)."""
    key = quote_plus(routing_key, safe="").replace("~", "%7E")       # a literal ~ only ahead of the hash
    if not args:
        return key or "~"
    canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), default=str).encode()
    return key + "~" + base64.urlsafe_b64encode(hashlib.sha1(canonical).digest()[:4]).decode().rstrip("=")


def binding_location(destination: str, key: str) -> str:
    """The ``Location`` of a binding just made: relative, as RabbitMQ's (``DESTINATION/PROPERTIES_KEY``)."""
    return quote_plus(destination, safe="") + "/" + quote(key, safe="~")


# -- definitions: export and import ------------------------------------------------------------------------------
HASHING_ALGORITHM = "rabbit_password_hashing_sha256"
DEFINITION_LISTS = ("users", "vhosts", "permissions", "topic_permissions", "parameters", "global_parameters",
                    "policies", "queues", "exchanges", "bindings")


def password_hash(password: str, salt: bytes) -> str:
    """RabbitMQ's stored form of a password: base64 of a 4-byte salt and SHA-256 of salt and password."""
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def definitions_body(body: bytes) -> dict:
    """An import's document (400 ``failed_to_parse_json`` unless a JSON object whose lists are lists)."""
    try:
        data = json.loads(body, parse_constant=_no_constant) if body.strip() else {}
    except (ValueError, RecursionError):
        raise BadRequest("failed_to_parse_json") from None
    if not isinstance(data, dict) or any(not isinstance(data.get(k, []), list) for k in DEFINITION_LISTS):
        raise BadRequest("failed_to_parse_json")
    if any(not isinstance(item, dict) for k in DEFINITION_LISTS for item in data.get(k, [])):
        raise BadRequest("failed_to_parse_json")
    return data


def definitions_plan(data: dict, users: dict[str, str], path_vhost: str | None) -> list[tuple[str, dict]]:
    """The ctl requests that import ``data`` (``definitions_body``), in RabbitMQ's order: the vhost's
    limits, queues, exchanges, bindings. ``path_vhost``: the vhost of ``/api/definitions/VHOST`` (items
    then need none of their own). What creditflow cannot honour is refused before anything is made:
    another vhost, a user it does not have (or with another password), a policy, a runtime parameter
    other than vhost limits. Permissions are taken as they are: every user may do everything here. A
    vhost's own import leaves users and vhosts alone, as RabbitMQ's does."""
    def vhost_of(item: dict) -> None:
        name = path_vhost if path_vhost is not None else item.get("vhost", "undefined")
        if name != VHOST:
            raise BadRequest(["no_such_vhost", name if isinstance(name, str) else json.dumps(name)])

    if path_vhost is None:          # a vhost's own import (``/api/definitions/VHOST``) leaves these alone
        for item in data.get("vhosts", []):
            if item.get("name") != VHOST:
                raise BadRequest(f"creditflow serves the vhost '/' only, not {json.dumps(item.get('name'))}")
        for item in data.get("users", []):
            _check_user(item, users)
    if data.get("policies"):
        raise BadRequest("creditflow has no policies: give queues their arguments instead")
    plan: list[tuple[str, dict]] = []
    for item in data.get("parameters", []):
        vhost_of(item)
        if item.get("component") != "vhost-limits" or not isinstance(item.get("value"), dict):
            raise BadRequest(f"creditflow has no runtime parameters but vhost limits, not component "
                             f"{json.dumps(item.get('component'))}")
        plan.append(("set_vhost_limits", {"value": item["value"]}))
    for item in data.get("queues", []):
        vhost_of(item)
        plan.append(("declare_queue", {"queue": _name(item, "name"), **queue_fields(item)}))
    for item in data.get("exchanges", []):
        vhost_of(item)
        plan.append(("exchange", {"op": "declare", "exchange": _name(item, "name"), **exchange_fields(item)}))
    for item in data.get("bindings", []):
        vhost_of(item)
        if item.get("destination_type", "queue") not in ("queue", "exchange"):
            raise BadRequest(f"destination_type {json.dumps(item.get('destination_type'))} is neither queue nor "
                             "exchange")
        fields = binding_fields(item)
        source = _name(item, "source")
        if item.get("destination_type") == "exchange":
            plan.append(("exchange", {"op": "bind_exchange", "source": source,
                                      "destination": _name(item, "destination"), **fields}))
        else:
            plan.append(("exchange", {"op": "bind", "exchange": source, "queue": _name(item, "destination"),
                                      **fields}))
    return plan


def _check_user(item: dict, users: dict[str, str]) -> None:
    """A user in an import must be one of this broker's, with the same password (its hash checked)."""
    name, stored = item.get("name"), item.get("password_hash")
    where = "(its users come from `creditflow serve --user NAME:PASSWORD`)"
    if not isinstance(name, str) or name not in users:
        raise BadRequest(f"user {json.dumps(name)} is not one of this broker's {where}")
    if not isinstance(stored, str) or not stored:
        raise BadRequest(f"user {json.dumps(name)} comes without a password_hash {where}")
    try:
        salt = base64.b64decode(stored, validate=True)[:4]
    except ValueError:
        raise BadRequest(["not_base64", stored]) from None
    if item.get("hashing_algorithm", HASHING_ALGORITHM) != HASHING_ALGORITHM or \
            not hmac.compare_digest(password_hash(users[name], salt), stored):
        raise BadRequest(f"user {json.dumps(name)} has another password here {where}")


def _name(item: dict, field: str) -> str:
    name = item.get(field)
    if not isinstance(name, str):
        raise BadRequest(f"{field} {json.dumps(name)} is not a name")
    return name


def skipped_on_import(cmd: str, reply: dict) -> bool:
    """What an import passes over, as RabbitMQ's does: a queue or exchange that is there already (even
    unlike the one given: it is kept), an ``amq.`` name, a binding whose ends are missing."""
    code = reply.get("code")
    if cmd in ("declare_queue", "exchange") and code == 403:
        return True
    text = str(reply.get("error") or "")
    return (code == 406 and "inequivalent arg" in text) or (code == 404 and cmd == "exchange")


def check_definitions(plan: list[tuple[str, dict]]) -> None:
    """Refuse (400, the broker's own reason) a plan any of whose queues, exchanges or limits the broker would
    refuse whatever it holds: bad queue arguments, an unknown exchange type, limits that are no limits. What
    remains to refuse depends on what is there (equal or not), and an import passes over that."""
    from pipeline.broker.args import QueueError, parse_queue_args
    from pipeline.broker.definitions import BadLimits, arguments_from_json, parse_limits
    from pipeline.broker.routing import EXCHANGE_TYPES
    for cmd, args in plan:
        try:
            if cmd == "set_vhost_limits":
                parse_limits(args["value"])
            elif cmd == "declare_queue" and not args["queue"].startswith("amq."):
                parse_queue_args(args["queue"], arguments_from_json(args["arguments"]))
            elif cmd == "exchange" and args["op"] == "declare" and not args["exchange"].startswith("amq.") \
                    and args["kind"] not in EXCHANGE_TYPES:
                raise BadRequest(f"unknown exchange type '{args['kind']}'")
        except QueueError as exc:
            name, sep, rest = exc.reply_text.partition(" - ")
            raise BadRequest(rest if sep and name.isupper() else exc.reply_text) from None
        except BadLimits as exc:
            raise BadRequest(str(exc)) from None
