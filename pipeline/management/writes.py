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

Each answers 204 with no body once the broker took it. A refusal from the
broker is an AMQP reply code and text: 404 is RabbitMQ's ``Object Not
Found``, any other is 400 ``bad_request`` with the text after its ``NAME -``
prefix, as RabbitMQ's management plugin reports the error of the
queue.delete or queue.purge it made (exclusive queues included: the API is
never their owning connection). A vhost other than ``/`` is 404; RabbitMQ
answers a DELETE of a missing vhost's limit 500 (its handler crashes), here
it is 404 ``vhost_not_found`` as for PUT.
"""

from __future__ import annotations

import json

from pipeline.broker.definitions import VHOST_LIMITS

VHOST = "/"
NOT_FOUND = {"error": "Object Not Found", "reason": "Not Found"}
VHOST_NOT_FOUND = {"error": "not_found", "reason": "vhost_not_found"}
FORCED_REASON = "Closed via management plugin"      # RabbitMQ's text when no X-Reason header came
READ = ("HEAD", "GET", "OPTIONS")
ANY = "*"                        # any one path segment
ALLOW: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (     # (path, its methods); any other path: READ
    (("api", "connections", ANY), ("HEAD", "GET", "DELETE", "OPTIONS")),
    (("api", "queues", ANY, ANY), ("HEAD", "GET", "DELETE", "OPTIONS")),
    (("api", "queues", ANY, ANY, "contents"), ("DELETE", "OPTIONS")),
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
    """Raised when a request's body is not what the call takes (400 ``bad_request`` with this reason)."""


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
def refusal(reply: dict) -> tuple[int, dict]:
    """(HTTP status, body) for a ctl reply that refused a write (``code``: an AMQP reply code)."""
    if reply.get("code") == 404:
        return 404, NOT_FOUND
    text = str(reply.get("error") or "")
    name, sep, rest = text.partition(" - ")
    reason = rest if sep and name.isupper() else text
    return 400, {"error": "bad_request", "reason": reason}


def flag(query: dict, name: str) -> bool:
    """``?if-empty=true``: only the exact text ``true`` turns a flag on, and the first of repeated
    ones counts, as RabbitMQ reads it."""
    return query.get(name, [""])[0] == "true"
