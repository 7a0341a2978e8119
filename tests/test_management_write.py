"""The management API's write calls, as RabbitMQ 3.10.8 answers them: first the routing, checks and
refusals with a fake broker behind the API, then a real ``creditflow serve`` whose connections are
closed, limits set and queues deleted and purged over HTTP, by ``creditflow ctl`` and by RabbitMQ's
own ``rabbitmqadmin``. Every code, body and text asserted here was read from a RabbitMQ 3.10.8 node
given the same requests."""

from __future__ import annotations

import base64
import http.client
import json
import os
import subprocess
import time
from urllib.parse import quote

import pytest

from pipeline.management import writes
from pipeline.management.server import App
from test_management_api import ctl, wait_until

GUEST = "Basic " + base64.b64encode(b"guest:guest").decode()
NOT_FOUND = {"error": "Object Not Found", "reason": "Not Found"}
LOCKED = ("cannot obtain exclusive access to locked queue '{}' in vhost '/'. It could be originally declared "
          "on another connection or the exclusive property value does not match that of the original declaration.")


# -- pure: the API in front of a fake broker -------------------------------------------------------------------
class FakeBroker:
    """What ``App`` asks the supervisor (``command``), recorded; the answers are set per command."""

    def __init__(self, **replies) -> None:
        self.replies = {"list_vhost_limits": {"ok": True, "limits": {}}, **replies}
        self.asked: list[tuple[str, dict]] = []

    def command(self, cmd: str, **args) -> dict:
        self.asked.append((cmd, args))
        return self.replies.get(cmd, {"ok": True})


def handle(app: App, method: str, path: str, body: bytes = b"", **headers) -> tuple[int, dict, object]:
    headers = {"Authorization": GUEST, **{k.replace("_", "-"): v for k, v in headers.items()}}
    headers = {k: v for k, v in headers.items() if v is not None}
    url, _, query = path.partition("?")
    code, got, raw = app.handle(method, url, query, headers, body)
    return code, got, json.loads(raw) if raw else raw


def test_other_methods_are_405_with_the_paths_allow_list_before_any_login():
    app = App(FakeBroker(), {"guest": "guest"})
    for method, path, allow in (("POST", "/api/connections", "HEAD, GET, OPTIONS"),
                                ("PUT", "/api/connections/c", "HEAD, GET, DELETE, OPTIONS"),
                                ("PATCH", "/api/queues/%2F/q", "HEAD, GET, PUT, DELETE, OPTIONS"),
                                ("POST", "/api/exchanges/%2F/x", "HEAD, GET, PUT, DELETE, OPTIONS"),
                                ("PUT", "/api/bindings/%2F/e/x/q/q", "HEAD, GET, POST, OPTIONS"),
                                ("POST", "/api/bindings/%2F/e/x/e/y/k", "HEAD, GET, DELETE, OPTIONS"),
                                ("POST", "/api/bindings/%2F/e/x/z/q", "HEAD, GET, OPTIONS"),
                                ("GET", "/api/queues/%2F/q/contents", "DELETE, OPTIONS"),
                                ("HEAD", "/api/vhost-limits", "GET, OPTIONS"),
                                ("DELETE", "/api/vhost-limits/%2F", "GET, OPTIONS"),
                                ("POST", "/api/vhost-limits/%2F/max-queues", "PUT, DELETE, OPTIONS"),
                                ("DELETE", "/api/overview", "HEAD, GET, OPTIONS"),
                                ("PUT", "/metrics", "HEAD, GET, OPTIONS")):
        assert handle(app, method, path, Authorization=None) == (405, {"Allow": allow}, b""), (method, path)
    assert handle(app, "OPTIONS", "/api/connections/c", Authorization=None) == (
        200, {"Allow": "HEAD, GET, DELETE, OPTIONS"}, b"")
    code, headers, body = handle(app, "DELETE", "/api/connections/c", Authorization=None)
    assert (code, headers["WWW-Authenticate"], body) == (401, 'Basic realm="RabbitMQ Management"', b"")
    code, _, body = handle(app, "PUT", "/api/vhost-limits/%2F/max-queues", b'{"x": 1}',
                           Authorization="Basic " + base64.b64encode(b"guest:nope").decode())
    assert (code, body) == (401, {"error": "not_authorized", "reason": "Login failed"})


def test_deleting_a_connection_asks_the_broker_with_rabbitmqs_reason_or_x_reason():
    broker = FakeBroker()
    app = App(broker, {"guest": "guest"})
    assert handle(app, "DELETE", "/api/connections/127.0.0.1%3A5000%20-%3E%20127.0.0.1%3A5672") == (204, {}, b"")
    assert handle(app, "DELETE", "/api/connections/c", X_Reason="load test over")[0] == 204
    assert broker.asked == [("close_connection", {"name": "127.0.0.1:5000 -> 127.0.0.1:5672",
                                                  "reason": "Closed via management plugin"}),
                            ("close_connection", {"name": "c", "reason": "load test over"})]
    broker.replies["close_connection"] = {"ok": False, "code": 404, "error": "no connection 'c'"}
    assert handle(app, "DELETE", "/api/connections/c")[::2] == (404, NOT_FOUND)


def test_vhost_limits_bodies_are_checked_in_rabbitmqs_order_with_its_reasons():
    broker = FakeBroker(list_vhost_limits={"ok": True, "limits": {"max-connections": 3}})
    app = App(broker, {"guest": "guest"})
    json_type = {"Content_Type": "application/json"}
    put = "/api/vhost-limits/%2F/max-connections"
    assert handle(app, "GET", "/api/vhost-limits")[::2] == (200, [{"vhost": "/", "value": {"max-connections": 3}}])
    assert handle(app, "GET", "/api/vhost-limits/%2F?columns=value")[::2] == (200, [{"value": {"max-connections": 3}}])
    assert handle(app, "GET", "/api/vhost-limits/other")[::2] == (404, NOT_FOUND)
    assert handle(app, "PUT", put, b'{"value": 4}') == (415, {}, b"")           # no Content-Type
    assert handle(app, "PUT", put, b'{"value": 4}', Content_Type="text/plain") == (415, {}, b"")
    assert handle(app, "PUT", "/api/vhost-limits/other/max-queues", b"{}", **json_type)[::2] == (
        404, {"error": "not_found", "reason": "vhost_not_found"})
    bad = {b"": "[{key_missing,value}]", b"null": "[{key_missing,value}]", b'{"valu": 3}': "[{key_missing,value}]",
           b"[]": "not_json", b"5": "not_json", b'{"value": 3': "not_json",
           b'{"value": "5"}': 'Validation failed\n\nmax-connections should be a number, actually was <<"5">>\n',
           b'{"value": 1.5}': "Validation failed\n\nmax-connections should be a number, actually was 1.5\n",
           b'{"value": true}': "Validation failed\n\nmax-connections should be a number, actually was true\n"}
    for body, reason in bad.items():
        assert handle(app, "PUT", put, body, **json_type)[::2] == (400, {"error": "bad_request", "reason": reason})
    assert handle(app, "PUT", "/api/vhost-limits/%2F/max-channels", b'{"value": 3}', **json_type)[2]["reason"] == (
        'Validation failed\n\nUnrecognised terms [{<<"max-channels">>,3}] in limits\n')
    assert broker.asked == [("list_vhost_limits", {})] * 2                     # nothing bad reached the broker
    assert handle(app, "PUT", put, b'{"value": -1, "vhost": "/"}', Content_Type="application/json; charset=utf-8") \
        == (204, {}, b"")
    assert handle(app, "DELETE", "/api/vhost-limits/%2F/max-queues") == (204, {}, b"")
    assert broker.asked[2:] == [("set_vhost_limits", {"value": {"max-connections": -1}, "merge": True}),
                                ("clear_vhost_limits", {"name": "max-queues"})]


def test_queue_refusals_become_rabbitmqs_404_or_400_with_the_text_after_the_amqp_name():
    broker = FakeBroker()
    app = App(broker, {"guest": "guest"})
    assert handle(app, "DELETE", "/api/queues/%2F/q?if-empty=true&if-unused=TRUE&if-empty=false") == (204, {}, b"")
    assert handle(app, "DELETE", "/api/queues/%2F/q/contents") == (204, {}, b"")
    assert handle(app, "DELETE", "/api/queues/other/q")[::2] == (404, NOT_FOUND)
    assert broker.asked == [("delete_queue", {"queue": "q", "if_empty": True, "if_unused": False,
                                              "exclusive_check": True}),
                            ("purge_queue", {"queue": "q", "exclusive_check": True})]
    broker.replies["delete_queue"] = {"ok": False, "code": 406,
                                      "error": "PRECONDITION_FAILED - queue 'q' in vhost '/' not empty"}
    assert handle(app, "DELETE", "/api/queues/%2F/q")[::2] == (
        400, {"error": "bad_request", "reason": "queue 'q' in vhost '/' not empty"})
    broker.replies["purge_queue"] = {"ok": False, "code": 404, "error": "NOT_FOUND - no queue 'q' in vhost '/'"}
    assert handle(app, "DELETE", "/api/queues/%2F/q/contents")[::2] == (404, NOT_FOUND)


def test_declares_reach_the_broker_with_rabbitmqs_defaults_and_are_answered_201_or_204():
    broker = FakeBroker(declare_queue={"ok": True, "created": True}, exchange={"ok": True, "created": False})
    app = App(broker, {"guest": "guest"})
    assert handle(app, "PUT", "/api/queues/%2F/q", b"") == (201, {}, b"")      # no body, no Content-Type
    assert handle(app, "PUT", "/api/queues/%2F/q2", b'{"durable": "true", "auto_delete": false, "exclusive": true, '
                                                    b'"arguments": {"x-max-length": 10, "t": {"a": [1]}}}')[0] == 201
    assert handle(app, "PUT", "/api/queues/%2F/q3", b'{"arguments": []}')[0] == 201
    assert handle(app, "PUT", "/api/exchanges/%2F/x", b"{}") == (204, {}, b"")   # there already
    assert handle(app, "PUT", "/api/exchanges/%2F/t", b'{"type": "topic", "internal": "false", "durable": true, '
                                                       b'"arguments": {"alternate-exchange": "ae"}}')[0] == 204
    assert handle(app, "DELETE", "/api/exchanges/%2F/x?if-unused=true") == (204, {}, b"")
    assert broker.asked == [
        ("declare_queue", {"queue": "q", "durable": False, "auto_delete": False, "arguments": {}}),
        ("declare_queue", {"queue": "q2", "durable": True, "auto_delete": False,     # exclusive: ignored
                           "arguments": {"x-max-length": 10, "t": {"F": [["a", [1]]]}}}),
        ("declare_queue", {"queue": "q3", "durable": False, "auto_delete": False, "arguments": {}}),
        ("exchange", {"op": "declare", "exchange": "x", "kind": "direct", "durable": False, "auto_delete": False,
                      "internal": False, "arguments": {}}),
        ("exchange", {"op": "declare", "exchange": "t", "kind": "topic", "durable": True, "auto_delete": False,
                      "internal": False, "arguments": {"alternate-exchange": "ae"}}),
        ("exchange", {"op": "delete", "exchange": "x", "if_unused": True})]


def test_bad_declare_bodies_are_refused_as_rabbitmq_refuses_them_before_reaching_the_broker():
    broker = FakeBroker()
    app = App(broker, {"guest": "guest"})
    for path in ("/api/queues/%2F/q", "/api/exchanges/%2F/x"):
        for body, reason in ((b"nope", "not_json"), (b"[1]", "not_json"), (b'"x"', "not_json"),
                             (b'{"durable": "yes"}', ["not_boolean", "yes"]), (b'{"durable": 1}', ["not_boolean", 1]),
                             (b'{"auto_delete": null}', ["not_boolean", None])):
            assert handle(app, "PUT", path, body)[::2] == (400, {"error": "bad_request", "reason": reason}), (path, body)
        assert handle(app, "PUT", path.replace("%2F", "other"), b"{}")[::2] == (
            404, {"error": "not_found", "reason": "vhost_not_found"})
    assert handle(app, "POST", "/api/bindings/%2F/e/x/q/q", b"[]")[::2] == (
        400, {"error": "bad_request", "reason": "not_json"})
    assert handle(app, "POST", "/api/bindings/other/e/x/q/q", b"{}")[::2] == (
        404, {"error": "not_found", "reason": "vhost_not_found"})
    assert handle(app, "DELETE", "/api/exchanges/other/x")[::2] == (404, NOT_FOUND)
    assert broker.asked == []


def test_refused_declares_are_rabbitmqs_400_401_and_404():
    broker = FakeBroker()
    app = App(broker, {"guest": "guest"})
    broker.replies["declare_queue"] = {"ok": False, "code": 406, "error": (
        "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current "
        "is 'false'")}
    assert handle(app, "PUT", "/api/queues/%2F/q", b'{"durable": true}')[::2] == (400, {
        "error": "bad_request",
        "reason": "inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'"})
    broker.replies["declare_queue"] = {"ok": False, "code": 403, "error": "ACCESS_REFUSED - queue name 'amq.q' "
                                                                          "contains reserved prefix 'amq.*'"}
    assert handle(app, "PUT", "/api/queues/%2F/amq.q", b"{}")[::2] == (
        401, {"error": "not_authorised", "reason": "Access refused."})
    broker.replies["exchange"] = {"ok": False, "code": 404, "error": "NOT_FOUND - no exchange 'nope' in vhost '/'"}
    assert handle(app, "POST", "/api/bindings/%2F/e/nope/q/q", b"{}")[::2] == (
        404, {"error": "not_found", "reason": "no exchange 'nope' in vhost '/'"})
    assert handle(app, "DELETE", "/api/exchanges/%2F/nope")[::2] == (404, NOT_FOUND)
    assert handle(app, "DELETE", "/api/bindings/%2F/e/x/q/q/k")[::2] == (404, NOT_FOUND)


def test_a_binding_is_made_at_its_properties_key_and_deleted_by_it():
    broker = FakeBroker()
    app = App(broker, {"guest": "guest"})
    code, headers, _ = handle(app, "POST", "/api/bindings/%2F/e/x/q/q%20one", b'{"routing_key": "k 2/x"}')
    assert (code, headers) == (201, {"Location": "q+one/k%2B2%252Fx"})        # as RabbitMQ quotes both parts
    code, headers, _ = handle(app, "POST", "/api/bindings/%2F/e/amq.default/e/y", b'{"arguments": {"a": 1}}')
    key = writes.properties_key("", {"a": 1})
    assert (code, headers["Location"]) == (201, "y/" + key) and key.startswith("~") and len(key) == 7
    assert handle(app, "POST", "/api/bindings/%2F/e/x/q/q", b"")[1] == {"Location": "q/~"}
    assert handle(app, "DELETE", "/api/bindings/%2F/e/x/q/q/k%2B2%252Fx")[0] == 204
    assert broker.asked == [
        ("exchange", {"op": "bind", "exchange": "x", "queue": "q one", "routing_key": "k 2/x", "arguments": {}}),
        ("exchange", {"op": "bind_exchange", "source": "", "destination": "y", "routing_key": "",   # amq.default
                      "arguments": {"a": 1}}),
        ("exchange", {"op": "bind", "exchange": "x", "queue": "q", "routing_key": "", "arguments": {}}),
        ("exchange", {"op": "unbind_key", "source": "x", "destination": "q", "to_exchange": False,
                      "properties_key": "k+2%2Fx"})]
    assert writes.properties_key("k1", {}) == "k1" and writes.properties_key("", None) == "~"
    assert writes.properties_key("a#b~c!d(e)f'g-h_i", None) == "a%23b%7Ec%21d%28e%29f%27g-h_i"   # RabbitMQ's
    assert writes.properties_key("é+%", None) == "%C3%A9%2B%25"
    assert writes.properties_key("k", {"a": 1, "b": 2}) == writes.properties_key("k", {"b": 2, "a": 1})
    assert writes.properties_key("k", {"a": 1}) != writes.properties_key("k", {"a": 2})
    assert writes.properties_key("k", {"a": "1.5"}) != writes.properties_key("k", {"a": {"D": "1.5"}})  # typed


def test_bodies_that_are_not_json_or_nest_too_deep_are_refused_before_reaching_the_broker():
    broker = FakeBroker()
    app = App(broker, {"guest": "guest"})
    for body in (b'{"arguments": {"a": NaN}}', b'{"durable": Infinity}', b"[" * 5000 + b"]" * 5000,
                 b'{"a":' * 5000 + b"1" + b"}" * 5000):
        assert handle(app, "PUT", "/api/queues/%2F/q", body)[::2] == (400, {"error": "bad_request",
                                                                           "reason": "not_json"})
    deep = b'{"arguments": {"a": ' + b"[" * 40 + b"]" * 40 + b"}}"
    assert handle(app, "POST", "/api/bindings/%2F/e/x/q/q", deep)[::2] == (400, {
        "error": "bad_request", "reason": f"arguments nested deeper than {writes.MAX_ARGUMENT_DEPTH} levels"})
    assert broker.asked == []


RABBITMQ_GUEST_HASH = "P8gbr/h5KjCgA5Unu0gNEmgRYja3kRbg47L00+KK6cBqC9ky"    # guest's, from a RabbitMQ 3.10.8 export


def test_definitions_are_exported_as_rabbitmq_exports_them_with_its_password_hashes():
    from pipeline.management.views import definitions_view
    salt = base64.b64decode(RABBITMQ_GUEST_HASH)[:4]
    topology = {"exchanges": [{"name": "x", "type": "topic", "durable": True, "auto_delete": False,
                               "internal": False, "arguments": {}},
                              {"name": "amq.topic", "type": "topic", "durable": True, "auto_delete": False,
                               "internal": False, "arguments": {}}],
                "bindings": [{"source": "x", "destination": "q", "to_exchange": False, "routing_key": "a.#",
                              "arguments": {"k": 1}, "properties_key": "a.%23~x"},
                             {"source": "x", "destination": "mine", "to_exchange": False, "routing_key": "m",
                              "arguments": {}, "properties_key": "m"}]}
    queues = [{"name": "q", "durable": True, "auto_delete": False, "exclusive": False, "arguments": {"x-max-length": 5}},
              {"name": "mine", "durable": False, "auto_delete": False, "exclusive": True, "arguments": {}}]
    d = definitions_view(queues, topology, {"max-queues": 50}, {"guest": "guest"}, salt=lambda name: salt)
    assert d["users"] == [{"name": "guest", "password_hash": RABBITMQ_GUEST_HASH, "hashing_algorithm":
                           "rabbit_password_hashing_sha256", "tags": ["administrator"], "limits": {}}]
    assert d["permissions"] == [{"user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}]
    assert d["parameters"] == [{"value": {"max-queues": 50}, "vhost": "/", "component": "vhost-limits",
                                "name": "limits"}]
    assert d["queues"] == [{"name": "q", "vhost": "/", "durable": True, "auto_delete": False,
                            "arguments": {"x-max-length": 5}}]                  # not the exclusive one
    assert [x["name"] for x in d["exchanges"]] == ["x"]                         # not the default or amq.*
    assert d["bindings"] == [{"source": "x", "vhost": "/", "destination": "q", "destination_type": "queue",
                              "routing_key": "a.#", "arguments": {"k": 1}}]     # not the default exchange's,
    #                                                                         nor the exclusive queue's
    one = definitions_view(queues, topology, {}, {"guest": "guest"}, vhost_only=True)
    assert sorted(one) == ["bindings", "exchanges", "parameters", "policies", "queues", "rabbit_version"]
    assert one["queues"] == [{"name": "q", "durable": True, "auto_delete": False, "arguments": {"x-max-length": 5}}]


def test_an_import_is_checked_whole_then_made_in_rabbitmqs_order_passing_over_what_is_there():
    broker = FakeBroker()
    app = App(broker, {"guest": "guest"})
    json_type = {"Content_Type": "application/json"}
    doc = {"users": [{"name": "guest", "password_hash": RABBITMQ_GUEST_HASH,
                      "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["administrator"]}],
           "vhosts": [{"name": "/"}], "permissions": [{"user": "guest", "vhost": "/", "configure": ""}],
           "global_parameters": [{"name": "internal_cluster_id", "value": "x"}], "policies": [],
           "parameters": [{"value": {"max-queues": 9}, "vhost": "/", "component": "vhost-limits", "name": "limits"}],
           "bindings": [{"source": "x", "vhost": "/", "destination": "q", "destination_type": "queue",
                         "routing_key": "k", "arguments": {}},
                        {"source": "x", "vhost": "/", "destination": "y", "destination_type": "exchange",
                         "routing_key": "", "arguments": {}}],
           "exchanges": [{"name": "x", "vhost": "/", "type": "topic", "durable": True}],
           "queues": [{"name": "q", "vhost": "/", "durable": True, "arguments": {"x-max-length": 5}}]}
    assert handle(app, "POST", "/api/definitions", json.dumps(doc).encode(), **json_type) == (204, {}, b"")
    assert [(cmd, args.get("op")) for cmd, args in broker.asked] == [
        ("set_vhost_limits", None), ("declare_queue", None), ("exchange", "declare"), ("exchange", "bind"),
        ("exchange", "bind_exchange")]
    assert broker.asked[1] == ("declare_queue", {"queue": "q", "durable": True, "auto_delete": False,
                                                 "arguments": {"x-max-length": 5}})

    broker.asked.clear()
    for body, code, answer in (
            (b"nope", 400, "failed_to_parse_json"), (b"[]", 400, "failed_to_parse_json"),
            (b'{"queues": "x"}', 400, "failed_to_parse_json"),
            (b'{"queues": [{"name": "q", "durable": true}]}', 400, ["no_such_vhost", "undefined"]),
            (b'{"queues": [{"name": "q", "vhost": "other"}]}', 400, ["no_such_vhost", "other"]),
            (b'{"users": [{"name": "app", "password_hash": "x"}]}', 400,
             'user "app" is not one of this broker\'s (its users come from `creditflow serve --user NAME:PASSWORD`)'),
            (json.dumps({"users": [{"name": "guest", "password_hash": writes.password_hash("other", b"salt")}]}
                        ).encode(), 400,
             'user "guest" has another password here (its users come from `creditflow serve --user NAME:PASSWORD`)'),
            (b'{"policies": [{"name": "p", "pattern": ".*", "definition": {"max-length": 1}}]}', 400,
             "creditflow has no policies: give queues their arguments instead"),
            (b'{"parameters": [{"vhost": "/", "component": "shovel", "name": "s", "value": {}}]}', 400,
             'creditflow has no runtime parameters but vhost limits, not component "shovel"')):
        assert handle(app, "POST", "/api/definitions", body, **json_type)[::2] == (
            code, {"error": "bad_request", "reason": answer}), body
    assert broker.asked == []                                   # nothing made from a document refused whole
    whole = {"parameters": [{"value": {"max-queues": 9}, "vhost": "/", "component": "vhost-limits"}],
             "queues": [{"name": "q", "vhost": "/"}],
             "exchanges": [{"name": "e", "vhost": "/", "type": "nosuch"}]}
    for late, reason in (({"bindings": [{"source": "e", "vhost": "other", "destination": "q"}]},
                          ["no_such_vhost", "other"]),
                         ({"bindings": [{"source": "e", "vhost": "/", "destination": "q", "destination_type": "x"}]},
                          'destination_type "x" is neither queue nor exchange'),
                         ({}, "unknown exchange type 'nosuch'"),
                         ({"queues": [{"name": "q", "vhost": "/"}, {"name": "r", "vhost": "/",
                                                                    "arguments": {"x-max-priority": 300}}]},
                          "invalid arg 'x-max-priority' for queue 'r' in vhost '/': {max_value_exceeded,300}"),
                         ({"parameters": [{"value": {"max-queues": "x"}, "vhost": "/", "component": "vhost-limits"}]},
                          "max-queues must be an integer, got 'x'")):
        doc = {**whole, "exchanges": [{"name": "e", "vhost": "/", "type": "direct"}], **late}
        if not late:
            doc = whole
        code, _, answer = handle(app, "POST", "/api/definitions", json.dumps(doc).encode(), **json_type)
        assert (code, answer["reason"]) == (400, reason), late
    for user in ({"name": ["guest"], "password_hash": "x"}, {"name": "guest", "password_hash": 5},
                 {"name": "guest"}):
        assert handle(app, "POST", "/api/definitions", json.dumps({"users": [user]}).encode(), **json_type)[0] == 400
    assert broker.asked == []                                   # each refused whole, before anything was made
    assert handle(app, "POST", "/api/definitions/%2F", b'{"users": [{"name": "app"}], "vhosts": [{"name": "v"}]}',
                  **json_type)[0] == 204                        # a vhost's own import leaves users alone
    assert handle(app, "POST", "/api/definitions", b"{}") == (415, {}, b"")
    assert handle(app, "POST", "/api/definitions/other", b"{}", **json_type)[::2] == (
        404, {"error": "not_found", "reason": "vhost_not_found"})
    assert handle(app, "POST", "/api/definitions/%2F", b'{"queues": [{"name": "q"}]}', **json_type)[0] == 204

    broker.asked.clear()        # what is there is kept, amq. names and bindings to nothing passed over
    broker.replies.update(declare_queue={"ok": False, "code": 406, "error": "PRECONDITION_FAILED - inequivalent "
                                                                              "arg 'durable' for queue 'q'"},
                          exchange={"ok": False, "code": 404, "error": "NOT_FOUND - no exchange 'x' in vhost '/'"})
    several = {"queues": [{"name": "q", "vhost": "/"}, {"name": "r", "vhost": "/"}],
               "bindings": [{"source": "x", "vhost": "/", "destination": "q"}]}
    assert handle(app, "POST", "/api/definitions", json.dumps(several).encode(), **json_type)[0] == 204
    assert len(broker.asked) == 3
    broker.asked.clear()        # any other refusal stops the import there, as RabbitMQ's does
    broker.replies["declare_queue"] = {"ok": False, "code": 406, "error": "PRECONDITION_FAILED - invalid arg "
                                                                          "'x-max-length' for queue 'q'"}
    assert handle(app, "POST", "/api/definitions", json.dumps(several).encode(), **json_type)[::2] == (
        400, {"error": "bad_request", "reason": "invalid arg 'x-max-length' for queue 'q'"})
    assert len(broker.asked) == 1


def test_a_fault_behind_a_request_is_answered_500_not_a_dropped_connection(capsys):
    class Failing(FakeBroker):
        def command(self, cmd: str, **args) -> dict:
            raise RuntimeError("planted")
    app = App(Failing(), {"guest": "guest"})
    assert handle(app, "PUT", "/api/queues/%2F/q", b"{}")[::2] == (500, {
        "error": "internal_server_error", "reason": "the management API failed on this request"})
    assert "RuntimeError: planted" in capsys.readouterr().err


def test_users_permissions_policies_and_parameters_read_as_rabbitmq_shapes_them():
    broker = FakeBroker(list_vhost_limits={"ok": True, "limits": {"max-queues": 50}})
    app = App(broker, {"guest": "guest", "app": "s3cret"})
    users = handle(app, "GET", "/api/users")[2]
    assert [(u["name"], u["tags"], u["hashing_algorithm"]) for u in users] == [
        ("app", ["administrator"], "rabbit_password_hashing_sha256"), ("guest", ["administrator"],
                                                                       "rabbit_password_hashing_sha256")]
    salt = base64.b64decode(users[1]["password_hash"])[:4]
    assert users[1]["password_hash"] == writes.password_hash("guest", salt)            # RabbitMQ's scheme
    assert handle(app, "GET", "/api/users")[2] == users                                  # the same each time
    assert handle(app, "GET", "/api/users/app")[::2] == (200, users[0])
    assert handle(app, "GET", "/api/users/nobody")[::2] == (404, NOT_FOUND)
    every = {"vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}
    assert handle(app, "GET", "/api/permissions")[2] == [{"user": "app", **every}, {"user": "guest", **every}]
    assert handle(app, "GET", "/api/permissions/%2F/guest")[::2] == (200, {"user": "guest", **every})
    assert handle(app, "GET", "/api/permissions/%2F/nobody")[::2] == (404, NOT_FOUND)
    assert handle(app, "GET", "/api/users/guest/permissions")[2] == [{"user": "guest", **every}]
    assert handle(app, "GET", "/api/vhosts/%2F/permissions")[2][0] == {"vhost": "/", "user": "app", "configure": ".*",
                                                                      "write": ".*", "read": ".*"}
    for path in ("/api/policies", "/api/policies/%2F", "/api/operator-policies", "/api/topic-permissions",
                 "/api/global-parameters", "/api/users/without-permissions", "/api/users/guest/topic-permissions"):
        assert handle(app, "GET", path)[::2] == (200, []), path
    limits = [{"value": {"max-queues": 50}, "vhost": "/", "component": "vhost-limits", "name": "limits"}]
    assert handle(app, "GET", "/api/parameters")[2] == handle(app, "GET", "/api/parameters/vhost-limits")[2] == limits
    assert handle(app, "GET", "/api/parameters/shovel")[2] == []
    assert handle(app, "GET", "/api/parameters/vhost-limits/%2F/limits")[::2] == (200, limits[0])
    for path in ("/api/parameters/vhost-limits/%2F/other", "/api/parameters/vhost-limits/other",
                 "/api/policies/other", "/api/permissions/%2F", "/api/global-parameters/x",
                 "/api/topic-permissions/%2F"):
        assert handle(app, "GET", path)[::2] == (404, NOT_FOUND), path
    assert handle(app, "PUT", "/api/users/app", b"{}")[:2] == (405, {"Allow": "HEAD, GET, OPTIONS"})   # read only


def test_values_are_printed_as_erlang_prints_them():
    assert [writes.erlang_term(v) for v in (None, False, 7, 1.5, 1e20, 'a"b\\c é', [1, "a"], {"a": 1})] == [
        "null", "false", "7", "1.5", "1.0e20", '<<"a\\"b\\\\c é">>', '[1,<<"a">>]', '#{<<"a">> => 1}']
    with pytest.raises(writes.BadRequest, match=r"^not_json$"):
        writes.limit_value("max-queues", b"[1]")


# -- a real broker ---------------------------------------------------------------------------------------------
def call(port: int, method: str, path: str, body=None, headers=None, auth: str | None = GUEST):
    """(status, headers with lower-case names, parsed JSON or b"") of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    headers = dict(headers or {})
    if auth is not None:
        headers["Authorization"] = auth
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        raw = answer.read()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, json.loads(raw) if raw else raw
    finally:
        conn.close()


def closed_by_broker(conn) -> tuple[int, str]:
    """What the broker closed pika's connection with, (reply code, text)."""
    import pika
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            conn.process_data_events(0.1)
    return closed.value.reply_code, closed.value.reply_text


@pytest.mark.processes
def test_a_forced_close_reaches_the_pika_client_as_320_with_the_reason(start_broker):
    import pika
    broker = start_broker()
    port = broker.info["management_port"]
    conns = {tag: pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker.port, client_properties={"connection_name": tag})) for tag in ("api", "why", "ctl")}
    try:
        for conn in conns.values():
            conn.channel().queue_declare("", exclusive=True)
        name = wait_until(lambda: (named := {c["user_provided_name"]: c["name"]
                                             for c in call(port, "GET", "/api/connections")[2]}).keys() == conns.keys()
                          and named, what="the three connections listed by their names")

        code, headers, body = call(port, "DELETE", "/api/connections/" + quote(name["api"], safe=""))
        assert (code, body, "content-length" in headers, "content-type" in headers) == (204, b"", False, False)
        assert closed_by_broker(conns["api"]) == (320, "CONNECTION_FORCED - Closed via management plugin")
        assert call(port, "DELETE", "/api/connections/" + quote(name["why"], safe=""),
                    headers={"X-Reason": "load test over"})[0] == 204
        assert closed_by_broker(conns["why"]) == (320, "CONNECTION_FORCED - load test over")
        done = ctl(broker, "close_connection", name["ctl"], "maintenance")
        assert done.returncode == 0, done.stderr
        assert closed_by_broker(conns["ctl"]) == (320, "CONNECTION_FORCED - maintenance")

        wait_until(lambda: call(port, "GET", "/api/connections")[2] == [], what="the connections gone from the API")
        broker.wait_for(lambda st: not st["queues"], what="their exclusive queues deleted")
        assert call(port, "DELETE", "/api/connections/" + quote(name["api"], safe=""))[::2] == (404, NOT_FOUND)
        missing = ctl(broker, "close_connection", "nobody")
        assert missing.returncode == 2 and json.loads(missing.stdout)["code"] == 404
        assert f'({name["api"]}) because "Closed via management plugin"' in broker.output()
    finally:
        for conn in conns.values():
            if conn.is_open:
                conn.close()


@pytest.mark.processes
def test_vhost_limits_set_over_http_refuse_the_next_connection_and_queue(start_broker):
    import pika
    broker = start_broker()
    port = broker.info["management_port"]
    params = pika.ConnectionParameters("127.0.0.1", broker.port)
    assert call(port, "GET", "/api/vhost-limits")[::2] == (200, [])
    assert call(port, "PUT", "/api/vhost-limits/%2F/max-connections", {"value": 1})[::2] == (204, b"")
    assert call(port, "PUT", "/api/vhost-limits/%2F/max-queues", {"value": 1})[::2] == (204, b"")
    limits = [{"vhost": "/", "value": {"max-connections": 1, "max-queues": 1}}]
    assert call(port, "GET", "/api/vhost-limits")[::2] == call(port, "GET", "/api/vhost-limits/%2F")[::2] == (
        200, limits)
    assert json.loads(ctl(broker, "list_vhost_limits").stdout)["limits"] == limits[0]["value"]
    assert call(port, "PUT", "/api/vhost-limits/%2F/max-queues", {"value": "2"})[::2] == (400, {
        "error": "bad_request",
        "reason": 'Validation failed\n\nmax-queues should be a number, actually was <<"2">>\n'})
    conn = pika.BlockingConnection(params)
    try:
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError,
                           match=r"530.*connection limit \(1\) is reached"):
            pika.BlockingConnection(params)
        ch = conn.channel()
        ch.queue_declare("only")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker,
                           match=r"406.*cannot declare queue 'more': queue limit in vhost '/' \(1\) is reached"):
            ch.queue_declare("more")

        assert call(port, "DELETE", "/api/vhost-limits/%2F/max-connections")[::2] == (204, b"")
        assert call(port, "GET", "/api/vhost-limits")[2] == [{"vhost": "/", "value": {"max-queues": 1}}]
        with pika.BlockingConnection(params) as second:              # room now
            second.channel().queue_declare("only", passive=True)
        assert call(port, "DELETE", "/api/vhost-limits/%2F/max-queues")[::2] == (204, b"")
        conn.channel().queue_declare("more")
        assert call(port, "GET", "/api/vhost-limits")[::2] == (200, [])
    finally:
        conn.close()


@pytest.mark.processes
def test_queues_are_purged_and_deleted_over_http_as_rabbitmq_does(start_broker):
    import pika
    broker = start_broker()
    port = broker.info["management_port"]
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    cancelled = []
    try:
        ch = conn.channel()
        for name in ("full", "consumed", "mine"):
            ch.queue_declare(name, exclusive=name == "mine")
            for _ in range(3):
                ch.basic_publish("", name, b"x")
        listener = conn.channel()
        listener.add_on_cancel_callback(cancelled.append)
        listener.basic_consume("consumed", lambda *a: None)
        conn.process_data_events(0.2)

        assert call(port, "DELETE", "/api/queues/%2F/full?if-empty=true")[::2] == (400, {
            "error": "bad_request", "reason": "queue 'full' in vhost '/' not empty"})
        assert call(port, "DELETE", "/api/queues/%2F/consumed?if-unused=true")[::2] == (400, {
            "error": "bad_request", "reason": "queue 'consumed' in vhost '/' in use"})
        for path in ("/api/queues/%2F/mine", "/api/queues/%2F/mine/contents"):
            assert call(port, "DELETE", path)[::2] == (400, {"error": "bad_request", "reason": LOCKED.format("mine")})
        assert ch.queue_declare("mine", passive=True).method.message_count == 3     # untouched
        for path in ("/api/queues/%2F/nope", "/api/queues/%2F/nope/contents", "/api/queues/other/full"):
            assert call(port, "DELETE", path)[::2] == (404, NOT_FOUND)

        assert call(port, "DELETE", "/api/queues/%2F/full/contents")[::2] == (204, b"")
        assert ch.queue_declare("full", passive=True).method.message_count == 0
        assert call(port, "DELETE", "/api/queues/%2F/full?if-empty=true")[::2] == (204, b"")
        assert call(port, "DELETE", "/api/queues/%2F/consumed")[::2] == (204, b"")
        wait_until(lambda: conn.process_data_events(0.05) or cancelled, what="the consumer's basic.cancel")
        assert [q["name"] for q in call(port, "GET", "/api/queues")[2]] == ["mine"]

        ch.queue_declare("by-ctl")
        ch.basic_publish("", "by-ctl", b"x")
        assert json.loads(ctl(broker, "purge_queue", "by-ctl").stdout) == {"ok": True, "message_count": 1}
        # rabbitmqctl purge_queue purges an exclusive queue (the API, never its owner, may not)
        assert json.loads(ctl(broker, "purge_queue", "mine").stdout)["message_count"] == 3
        ch.basic_publish("", "by-ctl", b"x")
        conn.process_data_events(0.1)
        refused = ctl(broker, "delete_queue", "by-ctl", "--if-empty")
        assert refused.returncode == 2 and "not empty" in refused.stdout
        refused = ctl(broker, "delete_queue", "--if-empty", "by-ctl")    # the option before the name, too
        assert refused.returncode == 2 and "not empty" in refused.stdout
        assert ctl(broker, "delete-queue", "by-ctl").returncode == 0
        assert ctl(broker, "delete-queue", "by-ctl").returncode == 2
        assert sorted(broker.status()["queues"]) == ["mine"]
    finally:
        conn.close()


RABBITMQADMIN = "/usr/bin/rabbitmqadmin"


@pytest.mark.processes
@pytest.mark.skipif(not os.path.exists(RABBITMQADMIN),
                    reason="rabbitmqadmin is not installed (Debian's rabbitmq-server ships it)")
def test_rabbitmqadmin_declares_closes_connections_purges_deletes_and_sets_limits(start_broker):
    """RabbitMQ's own command-line client, unchanged, against the management port."""
    import pika
    broker = start_broker()
    port = broker.info["management_port"]

    def admin(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([RABBITMQADMIN, "-P", str(port), *args], capture_output=True, text=True, timeout=30)

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    try:
        ch = conn.channel()
        ch.queue_declare("adm-q")
        ch.basic_publish("", "adm-q", b"x")
        assert admin("purge", "queue", "name=adm-q").stdout.strip() == "queue purged"
        assert ch.queue_declare("adm-q", passive=True).method.message_count == 0
        assert admin("delete", "queue", "name=adm-q").stdout.strip() == "queue deleted"
        gone = admin("delete", "queue", "name=adm-q")
        assert gone.returncode == 1 and "Not found: /api/queues/%2F/adm-q" in gone.stderr

        assert admin("declare", "vhost_limit", "vhost=/", "name=max-queues", "value=5").returncode == 0
        assert json.loads(admin("-f", "raw_json", "list", "vhost_limits").stdout) == [
            {"vhost": "/", "value": {"max-queues": 5}}]
        assert admin("delete", "vhost_limit", "vhost=/", "name=max-queues").returncode == 0
        assert json.loads(admin("-f", "raw_json", "list", "vhost_limits").stdout) == []

        assert admin("declare", "queue", "name=adm.q", "durable=true").stdout.strip() == "queue declared"
        assert admin("declare", "queue", "name=adm.q", "durable=true").stdout.strip() == "queue declared"
        differs = admin("declare", "queue", "name=adm.q", "durable=false")
        assert differs.returncode == 1 and ("inequivalent arg 'durable' for queue 'adm.q' in vhost '/': received "
                                            "'false' but current is 'true'") in differs.stdout + differs.stderr
        assert admin("declare", "exchange", "name=adm.x", "type=fanout").stdout.strip() == "exchange declared"
        assert admin("declare", "binding", "source=adm.x", "destination=adm.q", "routing_key=rk"
                     ).stdout.strip() == "binding declared"
        ch.basic_publish("adm.x", "anything", b"fanned")
        assert ch.queue_declare("adm.q", durable=True, passive=True).method.message_count == 1
        listed = [line.split("\t") for line in admin("-f", "tsv", "list", "bindings", "source", "destination",
                                                      "properties_key").stdout.splitlines()]
        assert ["adm.x", "adm.q", "rk"] in listed
        assert admin("delete", "binding", "source=adm.x", "destination_type=queue", "destination=adm.q",
                     "properties_key=rk").stdout.strip() == "binding deleted"
        assert admin("delete", "exchange", "name=adm.x").stdout.strip() == "exchange deleted"
        gone = admin("delete", "exchange", "name=adm.x")
        assert gone.returncode == 1 and "Not found: /api/exchanges/%2F/adm.x" in gone.stderr
        assert admin("delete", "queue", "name=adm.q").stdout.strip() == "queue deleted"
        assert [line.split("\t")[0] for line in admin("-f", "tsv", "list", "users").stdout.splitlines()] == [
            "name", "guest"]
        assert admin("-f", "tsv", "list", "permissions").stdout.splitlines()[1].split("\t") == [
            "/", ".*", ".*", "guest", ".*"]
        assert admin("list", "policies").stdout.strip() == "No items"

        name = wait_until(lambda: call(port, "GET", "/api/connections")[2], what="the connection listed")[0]["name"]
        assert admin("close", "connection", f"name={name}").stdout.strip() == "connection closed"
        assert closed_by_broker(conn) == (320, "CONNECTION_FORCED - Closed via management plugin")
    finally:
        if conn.is_open:
            conn.close()


@pytest.mark.processes
def test_a_topology_declared_over_http_carries_messages_and_comes_down_again(start_broker):
    """Queues, exchanges and bindings made over HTTP route pika's publishes as AMQP-declared ones do; the
    bindings listed at their properties keys are deleted by them; the codes are RabbitMQ 3.10.8's."""
    import pika
    broker = start_broker()
    port = broker.info["management_port"]
    assert call(port, "PUT", "/api/queues/%2F/orders", {"durable": True, "arguments": {"x-max-length": 2}})[0] == 201
    assert call(port, "PUT", "/api/queues/%2F/orders", {"durable": True, "arguments": {"x-max-length": 2}})[0] == 204
    assert call(port, "PUT", "/api/queues/%2F/orders", {"durable": False})[::2] == (400, {
        "error": "bad_request",
        "reason": "inequivalent arg 'durable' for queue 'orders' in vhost '/': received 'false' but current is 'true'"})
    assert call(port, "PUT", "/api/queues/%2F/audit", {})[0] == 201
    assert call(port, "PUT", "/api/exchanges/%2F/shop", {"type": "topic", "durable": True})[0] == 201
    assert call(port, "PUT", "/api/exchanges/%2F/fan", {"type": "fanout"})[0] == 201
    assert call(port, "PUT", "/api/exchanges/%2F/fan", {"type": "direct"})[::2] == (400, {
        "error": "bad_request",
        "reason": "inequivalent arg 'type' for exchange 'fan' in vhost '/': received 'direct' but current is 'fanout'"})
    code, headers, _ = call(port, "POST", "/api/bindings/%2F/e/shop/q/orders", {"routing_key": "order.*"})
    assert (code, headers["location"]) == (201, "orders/order.%252A")     # as RabbitMQ quotes it
    assert call(port, "POST", "/api/bindings/%2F/e/shop/e/fan", {"routing_key": "#"})[0] == 201
    code, headers, _ = call(port, "POST", "/api/bindings/%2F/e/fan/q/audit", {"arguments": {"why": "all"}})
    assert code == 201
    audit_key = headers["location"].split("/", 1)[1]
    assert call(port, "POST", "/api/bindings/%2F/e/nope/q/audit", {})[::2] == (
        404, {"error": "not_found", "reason": "no exchange 'nope' in vhost '/'"})

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(3):
            ch.basic_publish("shop", "order.new", f"o{i}".encode())
        assert ch.queue_declare("orders", durable=True, arguments={"x-max-length": 2}, passive=True
                                ).method.message_count == 2          # the HTTP-given limit holds
        assert ch.queue_declare("audit", passive=True).method.message_count == 3   # through shop -> fan -> audit

        listed = call(port, "GET", "/api/bindings/%2F/e/fan/q/audit")[2]
        assert [(b["routing_key"], b["arguments"], b["properties_key"]) for b in listed] == [
            ("", {"why": "all"}, writes.properties_key("", {"why": "all"}))]
        assert call(port, "GET", "/api/bindings/%2F/e/fan/q/audit/" + quote(listed[0]["properties_key"], safe="~")
                    )[::2] == (200, listed[0])
        assert call(port, "DELETE", "/api/bindings/%2F/e/fan/q/audit/" + audit_key)[0] == 204
        assert call(port, "DELETE", "/api/bindings/%2F/e/fan/q/audit/" + audit_key)[::2] == (404, NOT_FOUND)
        ch.basic_publish("shop", "order.new", b"after")
        assert ch.queue_declare("audit", passive=True).method.message_count == 3   # no longer bound

        assert call(port, "DELETE", "/api/bindings/%2F/e/amq.default/q/audit/audit")[::2] == (
            401, {"error": "not_authorised", "reason": "Access refused."})      # the implicit one
        assert call(port, "DELETE", "/api/bindings/%2F/e/amq.default/q/audit/other")[::2] == (404, NOT_FOUND)
        assert call(port, "GET", "/api/bindings/%2F/e/amq.default/q/audit")[2] == [
            {"source": "", "vhost": "/", "destination": "audit", "destination_type": "queue", "routing_key": "audit",
             "arguments": {}, "properties_key": "audit"}]
        assert call(port, "GET", "/api/exchanges/%2F/shop")[2]["type"] == "topic"
        assert call(port, "DELETE", "/api/exchanges/%2F/shop")[0] == 204
        assert call(port, "DELETE", "/api/exchanges/%2F/shop")[::2] == (404, NOT_FOUND)
        assert call(port, "DELETE", "/api/exchanges/%2F/amq.topic")[::2] == (
            401, {"error": "not_authorised", "reason": "Access refused."})
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="404.*no exchange 'shop'"):
            ch.basic_publish("shop", "order.new", b"gone")
            conn.process_data_events(0.2)
    finally:
        if conn.is_open:
            conn.close()
    assert "orders" in json.loads((broker.data_dir / "definitions.json").read_text())["queues"]   # durable: kept


@pytest.mark.processes
def test_another_connections_exclusive_queue_keeps_its_bindings_and_odd_ctl_requests_get_answers(start_broker):
    import pika

    from pipeline.ctlclient import CtlClient
    broker = start_broker()
    port = broker.info["management_port"]
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port))
    try:
        ch = conn.channel()
        ch.exchange_declare("ex", "direct")
        ch.queue_declare("mine", exclusive=True)
        ch.queue_bind("mine", "ex", "k", arguments={"n": 1})
        key = call(port, "GET", "/api/bindings/%2F/e/ex/q/mine")[2][0]["properties_key"]
        assert call(port, "DELETE", "/api/bindings/%2F/e/ex/q/mine/" + quote(key, safe="~"))[::2] == (
            400, {"error": "bad_request", "reason": LOCKED.format("mine")})
        assert call(port, "POST", "/api/bindings/%2F/e/ex/q/mine", {"routing_key": "k2"})[::2] == (
            400, {"error": "bad_request", "reason": LOCKED.format("mine")})
        assert [b["routing_key"] for b in call(port, "GET", "/api/bindings/%2F/e/ex/q/mine")[2]] == ["k"]
        assert call(port, "PUT", "/api/queues/%2F/mine", {})[::2] == (
            400, {"error": "bad_request", "reason": LOCKED.format("mine")})
    finally:
        conn.close()
    with CtlClient(str(broker.data_dir)) as client:      # what no HTTP request sends: answered, not dropped
        for cmd, args in (("exchange", {}), ("exchange", {"op": "nope"}), ("exchange", {"op": "declare"}),
                          ("exchange", {"op": "declare", "exchange": 10 ** 10, "kind": "direct"}),
                          ("exchange", {"op": "bind", "exchange": "ex", "queue": "q", "routing_key": 5}),
                          ("exchange", {"op": "declare", "exchange": "t", "kind": "direct",
                                        "arguments": {"a": {"D": "not a number"}}}),
                          ("declare_queue", {"queue": ["q"]}), ("declare_queue", {"queue": "q", "arguments": [1]}),
                          ("declare_queue", {"queue": "q", "arguments": {"a": {"T": 5}}})):
            assert client.request(cmd, **args)["ok"] is False, (cmd, args)
        assert client.request("status")["ok"]


@pytest.mark.processes
def test_a_queue_declared_over_http_while_its_namesake_is_being_deleted_is_made_once_that_one_is_gone(start_broker):
    """The deletion waits for the queue's process (stopped here); the PUT that comes meanwhile is answered
    only after it, with a new queue (201), as a channel's queue.declare is."""
    import signal
    import threading
    broker = start_broker()
    port = broker.info["management_port"]
    assert call(port, "PUT", "/api/queues/%2F/slow", {})[0] == 201
    queue = broker.wait_for(lambda s: s["processes"].get("queue-slow", {}).get("alive"), what="the queue's process")
    pid = queue["processes"]["queue-slow"]["pid"]
    answers: dict = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        deleting = threading.Thread(target=lambda: answers.update(delete=call(port, "DELETE", "/api/queues/%2F/slow")))
        deleting.start()
        time.sleep(1.0)            # the DELETE reaches the supervisor, which asks the stopped process
        declaring = threading.Thread(target=lambda: answers.update(
            declare=call(port, "PUT", "/api/queues/%2F/slow", {"durable": True})))
        declaring.start()
        time.sleep(1.0)
        assert answers == {}, "answered while the queue's process was stopped"
    finally:
        os.kill(pid, signal.SIGCONT)
    deleting.join(15)
    declaring.join(15)
    assert answers["delete"][0] == 204 and answers["declare"][0] == 201
    assert call(port, "GET", "/api/queues/%2F/slow")[2]["durable"] is True


@pytest.mark.processes
@pytest.mark.skipif(not os.path.exists(RABBITMQADMIN),
                    reason="rabbitmqadmin is not installed (Debian's rabbitmq-server ships it)")
def test_definitions_exported_from_one_broker_and_imported_into_another_carry_its_messages(start_broker):
    """rabbitmqadmin export from one broker, import into a second: the second routes pika's publishes as
    the first did, keeps its limits, and its queues' arguments hold."""
    import pika
    first = start_broker(name="first")
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", first.port))
    ch = conn.channel()
    ch.exchange_declare("orders", "topic", durable=True)
    ch.exchange_declare("audit", "fanout")
    ch.queue_declare("paid", durable=True, arguments={"x-max-length": 2})
    ch.queue_declare("log")
    ch.queue_declare("mine", exclusive=True)
    ch.queue_bind("paid", "orders", "order.paid")
    ch.exchange_bind("audit", "orders", "#")
    ch.queue_bind("log", "audit", "", arguments={"why": "all"})
    ch.queue_bind("mine", "orders", "#")                # left out with its exclusive queue
    assert call(first.info["management_port"], "PUT", "/api/vhost-limits/%2F/max-queues", {"value": 10})[0] == 204
    exported = first.data_dir.parent / "definitions.json"
    done = subprocess.run([RABBITMQADMIN, "-P", str(first.info["management_port"]), "export", str(exported)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    conn.close()
    assert {q["name"] for q in json.loads(exported.read_text())["queues"]} == {"paid", "log"}    # no exclusive one
    assert "mine" not in {b["destination"] for b in json.loads(exported.read_text())["bindings"]}

    second = start_broker(name="second")
    done = subprocess.run([RABBITMQADMIN, "-P", str(second.info["management_port"]), "import", str(exported)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", second.port)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(3):
            ch.basic_publish("orders", "order.paid", f"m{i}".encode())
        assert ch.queue_declare("paid", durable=True, passive=True).method.message_count == 2   # x-max-length
        assert ch.queue_declare("log", passive=True).method.message_count == 3       # orders -> audit -> log
    assert call(second.info["management_port"], "GET", "/api/definitions/%2F/more")[::2] == (404, NOT_FOUND)
    assert call(second.info["management_port"], "GET", "/api/vhost-limits")[2] == [
        {"vhost": "/", "value": {"max-queues": 10}}]
    def bindings(rows: list) -> list:
        return sorted(rows, key=lambda b: json.dumps(b, sort_keys=True))
    assert bindings(json.loads(exported.read_text())["bindings"]) == bindings(
        call(second.info["management_port"], "GET", "/api/definitions")[2]["bindings"])


@pytest.mark.processes
def test_serve_imports_a_definitions_file_at_start_and_refuses_a_bad_one_before_anything_starts(start_broker,
                                                                                                 tmp_path):
    """RabbitMQ's load_definitions: ``serve --definitions FILE`` makes what the file names once the broker is
    up (and keeps what a restart recovered); a file it cannot honour exits 2 with one line, nothing made."""
    import pika

    from conftest import creditflow_cmd
    good = tmp_path / "defs.json"
    good.write_text(json.dumps({
        "vhosts": [{"name": "/"}], "policies": [],
        "parameters": [{"value": {"max-connections": 5}, "vhost": "/", "component": "vhost-limits", "name": "limits"}],
        "queues": [{"name": "jobs", "vhost": "/", "durable": True, "auto_delete": False,
                    "arguments": {"x-max-length": 2}},
                   {"name": "amq.skipped", "vhost": "/", "durable": True, "auto_delete": False, "arguments": {}}],
        "exchanges": [{"name": "work", "vhost": "/", "type": "direct", "durable": True, "auto_delete": False,
                       "internal": False, "arguments": {}}],
        "bindings": [{"source": "work", "vhost": "/", "destination": "jobs", "destination_type": "queue",
                      "routing_key": "job", "arguments": {}},
                     {"source": "missing", "vhost": "/", "destination": "jobs", "destination_type": "queue",
                      "routing_key": "job", "arguments": {}}]}))
    broker = start_broker("--definitions", str(good))
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(3):
            ch.basic_publish("work", "job", f"j{i}".encode())
        assert ch.queue_declare("jobs", durable=True, passive=True).method.message_count == 2
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="404"):
            conn.channel().queue_declare("amq.skipped", passive=True)
    assert call(broker.info["management_port"], "GET", "/api/vhost-limits")[2] == [
        {"vhost": "/", "value": {"max-connections": 5}}]
    assert "imported definitions: 2 queues (1 new), 1 exchanges (1 new), 2 bindings, the vhost's limits" \
        in broker.output()

    for doc, reason in (({"policies": [{"name": "p"}]}, "creditflow has no policies"),
                        ({"queues": [{"name": "q", "vhost": "/", "arguments": {"x-max-length": "x"}}]},
                         "invalid arg 'x-max-length' for queue 'q'"),
                        ({"users": [{"name": "app", "password_hash": "x"}]}, "user \"app\" is not one of")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        data = tmp_path / "bad-data"
        done = subprocess.run(creditflow_cmd("serve", "--port", "0", "--data-dir", str(data), "--definitions",
                                             str(bad)), capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and reason in done.stderr, done.stderr
        assert not data.exists() or not any(data.iterdir())


@pytest.mark.processes
def test_health_checks_vhosts_and_bindings_per_queue_and_exchange_answer_as_rabbitmq(start_broker):
    """Each code and body as a RabbitMQ 3.10.8 node answered the same requests."""
    broker = start_broker()
    port = broker.info["management_port"]
    assert call(port, "PUT", "/api/queues/%2F/q1", {})[0] == 201
    assert call(port, "PUT", "/api/exchanges/%2F/x1", {"type": "direct"})[0] == 201
    assert call(port, "POST", "/api/bindings/%2F/e/x1/q/q1", {"routing_key": "k"})[0] == 201
    node = call(port, "GET", "/api/overview")[2]["node"]
    vhost = {"name": "/", "description": "Default virtual host", "tags": [], "default_queue_type": "undefined",
             "metadata": {"description": "Default virtual host", "tags": []}, "tracing": False,
             "cluster_state": {node: "running"}}
    assert call(port, "GET", "/api/vhosts/%2F")[::2] == (200, vhost)
    assert call(port, "GET", "/api/vhosts")[::2] == (200, [vhost])
    assert call(port, "GET", "/api/vhosts/other")[::2] == (404, NOT_FOUND)
    assert call(port, "GET", "/api/cluster-name")[::2] == (200, {"name": node})
    assert call(port, "GET", "/api/health/checks/virtual-hosts")[::2] == (200, {"status": "ok"})
    assert call(port, "GET", f"/api/health/checks/port-listener/{broker.port}")[::2] == (
        200, {"status": "ok", "port": broker.port})
    assert call(port, "GET", "/api/health/checks/port-listener/1")[::2] == (503, {
        "status": "failed", "reason": "No active listener", "missing": 1, "ports": [broker.port, port]})
    assert call(port, "GET", "/api/health/checks/port-listener/x")[::2] == (
        400, {"error": "bad_request", "reason": "Invalid port"})
    for name in ("amqp", "AMQP", "amqp091", "amqp0_9_1"):
        assert call(port, "GET", f"/api/health/checks/protocol-listener/{name}")[::2] == (
            200, {"status": "ok", "protocol": "amqp"})
    assert call(port, "GET", "/api/health/checks/protocol-listener/MQTT")[::2] == (503, {
        "status": "failed", "reason": "No active listener", "missing": "mqtt", "protocols": ["amqp", "http"]})
    assert call(port, "GET", "/api/health/checks/protocol-listener/management")[0] == 200
    assert call(port, "GET", "/api/health/checks/port-listener/%C2%B2")[0] == 400
    implicit = {"source": "", "vhost": "/", "destination": "q1", "destination_type": "queue", "routing_key": "q1",
                "arguments": {}, "properties_key": "q1"}
    bound = {"source": "x1", "vhost": "/", "destination": "q1", "destination_type": "queue", "routing_key": "k",
             "arguments": {}, "properties_key": "k"}
    assert call(port, "GET", "/api/queues/%2F/q1/bindings")[::2] == (200, [implicit, bound])
    assert call(port, "GET", "/api/exchanges/%2F/x1/bindings/source")[::2] == (200, [bound])
    assert call(port, "GET", "/api/exchanges/%2F/x1/bindings/destination")[::2] == (200, [])
    assert call(port, "GET", "/api/exchanges/%2F/nope/bindings/source")[::2] == (200, [])



@pytest.mark.processes
def test_a_connections_channels_and_the_vhosts_connections_and_channels_are_listed(start_broker):
    import pika
    broker = start_broker()
    port = broker.info["management_port"]
    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", broker.port)) as conn:
        conn.channel()
        conn.channel()
        name = wait_until(lambda: call(port, "GET", "/api/connections")[2], what="the connection listed")[0]["name"]
        channels = wait_until(lambda: len(got := call(port, "GET", "/api/connections/" + quote(name, safe="")
                                                      + "/channels")[2]) == 2 and got, what="its two channels")
        assert sorted(c["name"] for c in channels) == [f"{name} (1)", f"{name} (2)"]
        assert [c["name"] for c in call(port, "GET", "/api/vhosts/%2F/connections")[2]] == [name]
        assert len(call(port, "GET", "/api/vhosts/%2F/channels")[2]) == 2
        assert call(port, "GET", "/api/vhosts/other/channels")[::2] == (404, NOT_FOUND)
        assert call(port, "GET", "/api/connections/nope/channels")[::2] == (404, NOT_FOUND)   # RabbitMQ: 500
