"""The routing table: RabbitMQ 3.10's exchanges, bindings and route(), with no process or socket.

Each rule is a story of its own. Every reply text below, and the topic and
headers tables, were read off a real RabbitMQ 3.10.8 node (pika, one probe per
channel). Then hypothesis: topic routing against a slow reference matcher;
random graphs of exchange-to-exchange bindings and alternate exchanges, with
cycles, against a reference walk; and a state machine that binds, unbinds,
deletes and removes queues while a copy kept by ``apply(take_changes())``
must stay equal to the owner and route as the bindings say.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import json
import re

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pipeline.amqp.errors import ChannelLevelError, ConnectionLevelError
from pipeline.broker.routing import (PREDECLARED, ROUTE_CACHE_MAX, RouteResult, RoutingTable, field_key,
                                     from_json_value, to_json_value)


def table(*queues: str, durable: bool = False) -> RoutingTable:
    t = RoutingTable()
    for q in queues:
        t.add_queue(q, durable=durable)
    return t


def refused(code: int, text: str, hard: bool = False):
    """pytest.raises for a refusal with exactly this reply code and text."""
    return pytest.raises(ConnectionLevelError if hard else ChannelLevelError,
                         match="^" + re.escape(f"{code} {text}") + "$")


def queues(t: RoutingTable, exchange, key=b"", headers=None) -> list[str]:
    return [q.decode() for q in t.route(exchange, key, headers).queues]


# -- the default exchange and the predeclared ones -------------------------------------------------
def test_the_default_exchange_routes_to_the_queue_named_by_the_key_whether_or_not_it_exists():
    t = table("q")
    assert t.route(b"", b"q") == RouteResult((b"q",), False)
    assert t.route(b"", b"no-such-queue").queues == (b"no-such-queue",)
    assert not t.needs_headers(b"")


def test_the_default_exchange_cannot_be_declared_bound_unbound_or_deleted():
    t = table("q")
    text = "ACCESS_REFUSED - operation not permitted on the default exchange"
    with refused(403, text):
        t.declare_exchange("", "direct")
    with refused(403, text):
        t.declare_exchange("", "direct", passive=True)
    with refused(403, text):
        t.bind_queue("", "q", "k")
    with refused(403, text):
        t.unbind_queue("", "q", "k")
    t.declare_exchange("x", "direct")
    with refused(403, text):
        t.bind_exchange("x", "", "k")          # as a destination
    with refused(403, text):
        t.bind_exchange("", "x", "k")          # as a source
    with refused(403, text):
        t.delete_exchange("")


def test_every_vhost_has_the_amq_exchanges_and_amq_match_is_a_headers_exchange():
    t = table()
    kinds = {x.name: (x.type, x.durable, x.auto_delete, x.internal) for x in t.exchanges()}
    assert kinds == {b"amq.direct": ("direct", True, False, False), b"amq.fanout": ("fanout", True, False, False),
                     b"amq.topic": ("topic", True, False, False), b"amq.headers": ("headers", True, False, False),
                     b"amq.match": ("headers", True, False, False),
                     b"amq.rabbitmq.trace": ("topic", True, False, True)}
    assert set(kinds) == set(PREDECLARED)
    assert t.declare_exchange("amq.direct", "direct", durable=True) is False      # equivalent: fine
    assert t.declare_exchange("amq.match", "headers", durable=True) is False
    with refused(406, "PRECONDITION_FAILED - inequivalent arg 'durable' for exchange 'amq.direct' in vhost '/': "
                      "received 'false' but current is 'true'"):
        t.declare_exchange("amq.direct", "direct")


def test_amq_names_are_reserved_and_system_exchanges_cannot_be_deleted():
    t = table()
    with refused(403, "ACCESS_REFUSED - exchange name 'amq.foo' contains reserved prefix 'amq.*'"):
        t.declare_exchange("amq.foo", "direct")
    with refused(403, "ACCESS_REFUSED - exchange name 'amq.default' contains reserved prefix 'amq.*'"):
        t.declare_exchange("amq.default", "direct")
    with refused(403, "ACCESS_REFUSED - deletion of system exchange 'amq.direct' in vhost '/' not allowed"):
        t.delete_exchange("amq.direct")
    with refused(403, "ACCESS_REFUSED - deletion of system exchange 'amq.nothere' in vhost '/' not allowed"):
        t.delete_exchange("amq.nothere")                 # even one that does not exist
    with refused(404, "NOT_FOUND - no exchange 'amq.default' in vhost '/'"):
        t.route(b"amq.default", b"q")                      # not an alias of the default exchange


# -- declare -------------------------------------------------------------------------------------------
def test_declare_makes_an_exchange_once_and_checks_every_later_declare_for_equivalence():
    t = table()
    assert t.declare_exchange("x", "direct") is True
    assert t.declare_exchange("x", "direct") is False
    pre = "PRECONDITION_FAILED - inequivalent arg"
    where = "for exchange 'x' in vhost '/'"
    with refused(406, f"{pre} 'type' {where}: received 'fanout' but current is 'direct'"):
        t.declare_exchange("x", "fanout")
    with refused(406, f"{pre} 'durable' {where}: received 'true' but current is 'false'"):
        t.declare_exchange("x", "direct", durable=True)
    with refused(406, f"{pre} 'auto_delete' {where}: received 'true' but current is 'false'"):
        t.declare_exchange("x", "direct", auto_delete=True)
    with refused(406, f"{pre} 'internal' {where}: received 'true' but current is 'false'"):
        t.declare_exchange("x", "direct", internal=True)
    with refused(406, f"{pre} 'alternate-exchange' {where}: received the value 'ae' of type 'longstr' "
                      f"but current is none"):
        t.declare_exchange("x", "direct", arguments={"alternate-exchange": "ae"})


def test_of_the_arguments_only_alternate_exchange_is_compared():
    t = table()
    t.declare_exchange("y", "direct", arguments={"alternate-exchange": "a"})
    where = "PRECONDITION_FAILED - inequivalent arg 'alternate-exchange' for exchange 'y' in vhost '/'"
    with refused(406, f"{where}: received 'b' but current is 'a'"):
        t.declare_exchange("y", "direct", arguments={"alternate-exchange": "b"})
    with refused(406, f"{where}: received none but current is the value 'a' of type 'longstr'"):
        t.declare_exchange("y", "direct")
    with refused(406, f"{where}: received '5' but current is 'a'"):
        t.declare_exchange("y", "direct", arguments={"alternate-exchange": 5})
    assert t.declare_exchange("y", "direct", arguments={"alternate-exchange": "a", "foo": 1}) is False


def test_an_alternate_exchange_must_be_a_string():
    t = table()
    with refused(406, "PRECONDITION_FAILED - invalid type 'signedint' for arg 'alternate-exchange' in "
                      "exchange 'z' in vhost '/'"):
        t.declare_exchange("z", "direct", arguments={"alternate-exchange": 5})
    assert t.lookup("z") is None


def test_an_unknown_exchange_type_closes_the_connection():
    t = table()
    with refused(503, "COMMAND_INVALID - unknown exchange type 'nonsense'", hard=True) as err:
        t.declare_exchange("u", "nonsense")
    assert err.value.hard and (err.value.class_id, err.value.method_id) == (40, 10)
    with refused(503, "COMMAND_INVALID - unknown exchange type 'nonsense'", hard=True):
        t.declare_exchange("amq.direct", "nonsense")     # the type is checked before anything else


def test_a_passive_declare_only_asks_whether_the_exchange_exists():
    t = table()
    with refused(404, "NOT_FOUND - no exchange 'nope' in vhost '/'") as err:
        t.declare_exchange("nope", "direct", passive=True)
    assert not err.value.hard
    t.declare_exchange("x", "direct")
    assert t.declare_exchange("x", "fanout", passive=True) is False       # type not compared
    assert t.declare_exchange("x", "zzz", passive=True) is False          # nor checked


def test_carriage_returns_and_line_feeds_are_dropped_from_names_in_methods_but_not_in_publishes():
    t = table("q")
    assert t.declare_exchange("cr\r\nlf", "direct") is True
    assert t.declare_exchange("crlf", "direct", passive=True) is False
    assert t.declare_exchange("cr\nlf", "direct", passive=True) is False
    t.bind_queue("c\rr\nlf", "q\n", "k")
    assert queues(t, b"crlf", b"k") == ["q"]
    with refused(404, "NOT_FOUND - no exchange 'cr\nlf' in vhost '/'"):
        t.route(b"cr\nlf", b"k")


def test_names_are_bytes_inside_and_any_bytes_show_in_texts():
    t = table()
    t.declare_exchange("café", "fanout")
    assert t.lookup(b"caf\xc3\xa9").name == "café".encode()
    with refused(404, "NOT_FOUND - no exchange 'a\ufffdb' in vhost '/'"):
        t.route(b"a\xffb", b"")
    t.add_queue(b"q\xff", durable=False)
    t.bind_queue("café", b"q\xff")
    assert t.route("café", "").queues == (b"q\xff",)


def test_a_refused_method_changes_nothing():
    t = table("q")
    t.declare_exchange("x", "direct")
    t.bind_queue("x", "q", "k")
    before = t.snapshot()
    for attempt in (lambda: t.declare_exchange("x", "fanout"), lambda: t.declare_exchange("amq.x", "direct"),
                    lambda: t.bind_queue("x", "nope", "k"), lambda: t.bind_queue("nope", "q", "k"),
                    lambda: t.delete_exchange("x", if_unused=True),
                    lambda: t.bind_queue("amq.headers", "q", "", {"x-match": "some"})):
        with pytest.raises((ChannelLevelError, ConnectionLevelError)):
            attempt()
    assert t.snapshot() == before


# -- delete ------------------------------------------------------------------------------------------
def test_deleting_a_missing_exchange_is_no_error():
    assert table().delete_exchange("nope") == ()


def test_delete_if_unused_refuses_an_exchange_that_is_a_source_of_bindings():
    t = table("q")
    t.declare_exchange("x", "direct")
    t.bind_queue("x", "q", "k")
    with refused(406, "PRECONDITION_FAILED - exchange 'x' in vhost '/' in use"):
        t.delete_exchange("x", if_unused=True)
    t.declare_exchange("dest", "fanout")
    t.bind_exchange("x", "dest", "k")                   # dest is only a destination: not "in use"
    assert t.delete_exchange("dest", if_unused=True) == (b"dest",)
    assert t.delete_exchange("x") == (b"x",)
    assert t.bindings() == []


def test_deleting_an_exchange_removes_its_bindings_both_ways():
    t = table("q")
    for x in ("a", "b", "c"):
        t.declare_exchange(x, "fanout")
    t.bind_exchange("b", "a")
    t.bind_exchange("c", "b")
    t.bind_queue("b", "q")
    t.delete_exchange("b")
    assert t.bindings() == []
    assert queues(t, b"a") == [] and queues(t, b"c") == []


# -- bindings --------------------------------------------------------------------------------------------
def test_binding_needs_both_ends_and_names_the_exchange_first():
    t = table("q")
    t.declare_exchange("x", "direct")
    with refused(404, "NOT_FOUND - no exchange 'nope' in vhost '/'") as err:
        t.bind_queue("nope", "q", "k")
    assert (err.value.class_id, err.value.method_id) == (50, 20)
    with refused(404, "NOT_FOUND - no queue 'nope' in vhost '/'"):
        t.bind_queue("x", "nope", "k")
    with refused(404, "NOT_FOUND - no exchange 'nope2' in vhost '/'"):
        t.bind_queue("nope2", "nope", "k")
    with refused(404, "NOT_FOUND - no exchange 'nope' in vhost '/'") as err:
        t.bind_exchange("x", "nope", "k")
    assert (err.value.class_id, err.value.method_id) == (40, 30)
    with refused(404, "NOT_FOUND - no exchange 'nope' in vhost '/'"):
        t.bind_exchange("nope", "x", "k")


def test_unbinding_what_is_not_bound_or_does_not_exist_is_no_error():
    t = table("q")
    t.declare_exchange("x", "direct")
    t.bind_queue("x", "q", "k")
    assert t.unbind_queue("x", "q", "other") == ()
    assert t.unbind_queue("nope", "q", "k") == ()
    assert t.unbind_queue("x", "nope", "k") == ()
    assert t.unbind_exchange("nope", "nope2", "k") == ()
    assert queues(t, b"x", b"k") == ["q"]


def test_a_binding_is_its_exchange_destination_key_and_arguments():
    t = table("q")
    t.declare_exchange("x", "direct")
    assert t.bind_queue("x", "q", "k") is True
    assert t.bind_queue("x", "q", "k") is False
    assert t.bind_queue("x", "q", "k", {"a": 1}) is True          # other arguments: another binding
    assert t.bind_queue("x", "q", "k", {"a": 1}) is False
    assert len(t.bindings()) == 2
    assert queues(t, b"x", b"k") == ["q"]                          # still one copy
    t.unbind_queue("x", "q", "k")
    assert queues(t, b"x", b"k") == ["q"]
    t.unbind_queue("x", "q", "k", {"a": 2})                        # not that binding
    assert queues(t, b"x", b"k") == ["q"]
    t.unbind_queue("x", "q", "k", {"a": 1})
    assert queues(t, b"x", b"k") == []


def test_removing_a_queue_removes_its_bindings():
    t = table("q", "r")
    t.declare_exchange("x", "fanout")
    t.bind_queue("x", "q")
    t.bind_queue("x", "r")
    assert t.remove_queue("q") == ()
    assert queues(t, b"x") == ["r"] and not t.has_queue("q")
    with refused(404, "NOT_FOUND - no queue 'q' in vhost '/'"):
        t.bind_queue("x", "q")


# -- exchange types ----------------------------------------------------------------------------------
def test_direct_matches_the_key_exactly_and_fanout_ignores_it():
    t = table("q1", "q2", "q3")
    t.declare_exchange("d", "direct")
    t.bind_queue("d", "q1", "k")
    t.bind_queue("d", "q2", "k")
    t.bind_queue("d", "q3", "K")
    t.bind_queue("d", "q3", "")
    assert queues(t, b"d", b"k") == ["q1", "q2"]
    assert queues(t, b"d", b"") == ["q3"]
    t.declare_exchange("f", "fanout")
    t.bind_queue("f", "q1", "whatever")
    t.bind_queue("f", "q2")
    assert queues(t, b"f", b"anything") == ["q1", "q2"]


TOPIC_PATTERNS = ["", "#", "*", "a", "a.*", "a.#", "#.a", "*.*", "a..b", "a.*.b", "a.#.b", ".", "*.", "#.#",
                  "a.#.#.b", "#.*", "*.#", "a.b.", "#.."]
# what a RabbitMQ 3.10.8 node delivered for each key, one queue bound per pattern
RABBITMQ_TOPIC = {
    "": ["", "#", "#.#"],
    "a": ["#", "#.#", "#.*", "#.a", "*", "*.#", "a", "a.#"],
    "a.b": ["#", "#.#", "#.*", "*.#", "*.*", "a.#", "a.#.#.b", "a.#.b", "a.*"],
    "a..b": ["#", "#.#", "#.*", "*.#", "a.#", "a.#.#.b", "a.#.b", "a.*.b", "a..b"],
    ".": ["#", "#.#", "#.*", "#..", "*.", "*.#", "*.*", "."],
    "..": ["#", "#.#", "#.*", "#..", "*.#"],
    "a.b.": ["#", "#.#", "#.*", "*.#", "a.#", "a.b."],
    "a.x.b": ["#", "#.#", "#.*", "*.#", "a.#", "a.#.#.b", "a.#.b", "a.*.b"],
    "a.x.y.b": ["#", "#.#", "#.*", "*.#", "a.#", "a.#.#.b", "a.#.b"],
    "b.a": ["#", "#.#", "#.*", "#.a", "*.#", "*.*"],
    "a.b.c": ["#", "#.#", "#.*", "*.#", "a.#"],
    "x": ["#", "#.#", "#.*", "*", "*.#"],
}


def test_topic_words_are_split_on_dots_with_empty_words_as_rabbitmq_splits_them():
    t = table(*TOPIC_PATTERNS)
    t.declare_exchange("t", "topic")
    for p in TOPIC_PATTERNS:
        t.bind_queue("t", p, p)            # each queue is named by its pattern
    for key, expected in RABBITMQ_TOPIC.items():
        assert sorted(queues(t, b"t", key.encode())) == sorted(expected), key


def test_topic_keys_with_many_words_against_many_hashes_take_no_exponential_time():
    t = table("q")
    t.declare_exchange("t", "topic")
    t.bind_queue("t", "q", ".".join(["#"] * 30) + ".z")
    assert queues(t, b"t", b".".join([b"w"] * 200)) == []
    assert queues(t, b"t", b".".join([b"w"] * 200) + b".z") == ["q"]


# a binding per line, and what a RabbitMQ 3.10.8 node delivered for each message's headers
HEADER_BINDINGS = {
    "all_a1": {"a": 1}, "any_a1_b2": {"x-match": "any", "a": 1, "b": 2},
    "all_a1_b2": {"x-match": "all", "a": 1, "b": 2},
    "a_float": {"a": 1.0}, "a_str1": {"a": "1"}, "a_bytes": {"a": b"1"}, "a_bin": {"a": bytearray(b"1")},
    "a_true": {"a": True}, "a_void": {"a": None}, "any_void_b": {"x-match": "any", "b": None},
    "x_only": {"x-foo": "bar"}, "allwx_xfoo": {"x-match": "all-with-x", "x-foo": "bar"},
    "anywx_xfoo_a": {"x-match": "any-with-x", "x-foo": "bar", "a": 2}, "any_xfoo": {"x-match": "any", "x-foo": "bar"},
    "empty": {}, "any_empty": {"x-match": "any"}, "a_dec": {"a": decimal.Decimal("1.0")},
    "a_dec1": {"a": decimal.Decimal("1")}, "a_ts": {"a": datetime.datetime(1970, 1, 1, 0, 0, 1, tzinfo=datetime.UTC)},
    "a_tbl": {"a": {"k": 1}}, "a_arr": {"a": [1, "x"]},
}
ALWAYS = ["empty", "x_only"]
ONE = ["a_float", "a_ts", "a_void", "all_a1", "any_a1_b2"] + ALWAYS
STRING_1 = ["a_bin", "a_bytes", "a_str1", "a_void"] + ALWAYS
RABBITMQ_HEADERS = [
    (None, ALWAYS), ({}, ALWAYS), ({"a": 1}, ONE), ({"a": 1.0}, ONE),
    ({"a": datetime.datetime(1970, 1, 1, 0, 0, 1, tzinfo=datetime.UTC)}, ONE),
    ({"a": "1"}, STRING_1), ({"a": b"1"}, STRING_1), ({"a": bytearray(b"1")}, STRING_1),
    ({"a": True}, ["a_true", "a_void"] + ALWAYS),
    ({"a": 2, "b": 2}, ["a_void", "any_a1_b2", "anywx_xfoo_a", "any_void_b"] + ALWAYS),
    ({"a": 1, "b": 2}, ["all_a1_b2", "any_void_b"] + ONE),
    ({"x-foo": "bar"}, ["allwx_xfoo", "anywx_xfoo_a"] + ALWAYS),
    ({"a": None}, ["a_void"] + ALWAYS),
    ({"a": decimal.Decimal("1.0")}, ["a_dec", "a_void"] + ALWAYS),
    ({"a": decimal.Decimal("1")}, ["a_dec1", "a_void"] + ALWAYS),
    ({"a": {"k": 1}}, ["a_tbl", "a_void"] + ALWAYS),
    ({"a": {"k": 1.0}}, ["a_void"] + ALWAYS),               # inside a table the type counts
    ({"a": [1, "x"]}, ["a_arr", "a_void"] + ALWAYS),
    ({"a": 1, "x-foo": "bar"}, ["allwx_xfoo", "anywx_xfoo_a"] + ONE),
    ({"a": 2, "x-foo": "nope"}, ["a_void", "anywx_xfoo_a"] + ALWAYS),
    ({"a": 0}, ["a_void"] + ALWAYS),
]


@pytest.mark.parametrize("headers,expected", RABBITMQ_HEADERS, ids=[repr(h) for h, _ in RABBITMQ_HEADERS])
def test_headers_routing_compares_values_as_rabbitmq_does(headers, expected):
    t = table(*HEADER_BINDINGS)
    t.declare_exchange("h", "headers")
    for name, args in HEADER_BINDINGS.items():
        t.bind_queue("h", name, "", args)
    assert t.needs_headers(b"h")
    assert sorted(queues(t, b"h", b"ignored", headers)) == sorted(expected)


def test_x_match_must_be_one_of_four_strings():
    t = table("q")
    with refused(406, 'PRECONDITION_FAILED - Invalid x-match field value <<"foo">>; expected all, any, '
                      'all-with-x, or any-with-x'):
        t.bind_queue("amq.headers", "q", "", {"x-match": "foo"})
    with refused(406, "PRECONDITION_FAILED - Invalid x-match field type signedint (value 1); expected longstr"):
        t.bind_queue("amq.headers", "q", "", {"x-match": 1})
    for mode in ("all", "any", "all-with-x", "any-with-x"):
        assert t.bind_queue("amq.headers", "q", "", {"x-match": mode})
    t.declare_exchange("d", "direct")
    assert t.bind_queue("d", "q", "", {"x-match": "foo"})            # only headers exchanges look


def test_field_values_compare_by_value_at_the_top_and_by_type_inside():
    assert field_key(1) == field_key(1.0) == field_key(datetime.datetime(1970, 1, 1, 0, 0, 1, tzinfo=datetime.UTC))
    assert field_key("é") == field_key("é".encode()) == field_key(bytearray("é".encode()))
    assert field_key(True) != field_key(1)
    assert field_key(None) != field_key(b"")
    assert field_key(decimal.Decimal("1.0")) != field_key(decimal.Decimal("1"))
    assert field_key({"k": 1}) != field_key({"k": 1.0})
    assert field_key({"k": "s"}) != field_key({"k": bytearray(b"s")})     # longstr vs byte array inside
    assert field_key({"a": 1, "b": 2}) != field_key({"b": 2, "a": 1})    # tables keep their order
    assert field_key({}) == field_key([])                                # both [] to Erlang


# -- where a publish may not go ------------------------------------------------------------------------
def test_publishing_to_a_missing_or_internal_exchange_is_refused():
    t = table("q")
    with refused(404, "NOT_FOUND - no exchange 'nope' in vhost '/'") as err:
        t.route(b"nope", b"k")
    assert (err.value.class_id, err.value.method_id) == (60, 40)
    t.declare_exchange("i", "fanout", internal=True)
    t.bind_queue("i", "q")
    with refused(403, "ACCESS_REFUSED - cannot publish to internal exchange 'i' in vhost '/'"):
        t.route(b"i", b"k")
    with refused(403, "ACCESS_REFUSED - cannot publish to internal exchange 'amq.rabbitmq.trace' in vhost '/'"):
        t.route(b"amq.rabbitmq.trace", b"k")


# -- exchange-to-exchange bindings and alternate exchanges (each case as seen on RabbitMQ) -------------
def test_exchange_to_exchange_cycles_end_and_a_queue_reached_twice_gets_one_copy():
    t = table("q1", "q2")
    t.declare_exchange("e1", "fanout")
    t.declare_exchange("e2", "fanout")
    t.declare_exchange("e3", "direct")
    t.bind_exchange("e1", "e2")
    t.bind_exchange("e2", "e1")
    t.bind_exchange("e1", "e3")
    t.bind_queue("e1", "q1")
    t.bind_queue("e2", "q1")
    t.bind_queue("e3", "q2", "k")
    assert t.route(b"e1", b"k") == RouteResult((b"q1", b"q2"), False)
    assert queues(t, b"e1", b"z") == ["q1"]


def test_an_unroutable_message_goes_to_the_alternate_exchange_through_cycles_of_them():
    t = table("qa")
    t.declare_exchange("ae2", "direct", arguments={"alternate-exchange": "ae1"})
    t.declare_exchange("ae1", "direct", arguments={"alternate-exchange": "ae2"})
    t.bind_queue("ae2", "qa", "only")
    assert t.route(b"ae1", b"only") == RouteResult((b"qa",), True)
    assert t.route(b"ae1", b"other") == RouteResult((), True)
    assert t.route(b"ae2", b"only") == RouteResult((b"qa",), False)


def test_the_alternate_exchange_is_looked_up_when_needed_and_may_not_exist():
    t = table("q")
    t.declare_exchange("e4", "direct", arguments={"alternate-exchange": "later"})
    assert t.route(b"e4", b"x") == RouteResult((), False)
    t.declare_exchange("later", "fanout")
    t.bind_queue("later", "q")
    assert t.route(b"e4", b"x") == RouteResult((b"q",), True)
    t.delete_exchange("later")
    assert t.route(b"e4", b"x") == RouteResult((), False)


def test_the_alternate_exchange_is_used_only_when_the_exchanges_own_bindings_match_nothing():
    t = table("qa")
    t.declare_exchange("ae", "fanout")
    t.bind_queue("ae", "qa")
    t.declare_exchange("e5", "direct", arguments={"alternate-exchange": "ae"})
    t.declare_exchange("e6", "direct")
    t.bind_exchange("e5", "e6", "k")              # e5 -> e6, which routes nowhere
    assert t.route(b"e5", b"k") == RouteResult((), False)
    assert t.route(b"e5", b"only") == RouteResult((b"qa",), True)
    t.declare_exchange("e7", "fanout")
    t.declare_exchange("e8", "direct", arguments={"alternate-exchange": "ae"})
    t.bind_exchange("e7", "e8")
    assert t.route(b"e7", b"x") == RouteResult((b"qa",), True)     # a destination's AE counts too


def test_an_internal_exchange_can_be_an_alternate_or_a_destination():
    t = table("q3")
    t.declare_exchange("int", "fanout", internal=True)
    t.bind_queue("int", "q3")
    t.declare_exchange("e9", "direct", arguments={"alternate-exchange": "int"})
    assert t.route(b"e9", b"zz") == RouteResult((b"q3",), True)


def test_needs_headers_when_a_headers_exchange_may_be_reached():
    t = table("q")
    t.declare_exchange("d", "direct")
    t.declare_exchange("h", "headers")
    t.declare_exchange("via_ae", "direct", arguments={"alternate-exchange": "h"})
    assert not t.needs_headers(b"d") and t.needs_headers(b"h") and t.needs_headers(b"via_ae")
    assert not t.needs_headers(b"missing")
    t.bind_exchange("d", "h", "k")
    assert t.needs_headers(b"d")
    t.unbind_exchange("d", "h", "k")
    assert not t.needs_headers(b"d")


def test_routes_are_cached_until_the_table_changes():
    t = table("q1", "q2")
    t.declare_exchange("t", "topic")
    t.bind_queue("t", "q1", "a.*")
    assert queues(t, b"t", b"a.b") == ["q1"]
    assert queues(t, b"t", b"a.b") == ["q1"]
    assert t.statistics().cache_hits == 1
    t.bind_queue("t", "q2", "#")
    assert queues(t, b"t", b"a.b") == ["q1", "q2"]
    t.remove_queue("q1")
    assert queues(t, b"t", b"a.b") == ["q2"]
    for i in range(ROUTE_CACHE_MAX + 10):               # the cache stays bounded
        t.route(b"t", b"k%d" % i)
    assert len(t._cache) <= ROUTE_CACHE_MAX


# -- auto-delete -----------------------------------------------------------------------------------------
def test_an_auto_delete_exchange_goes_when_its_last_binding_as_a_source_goes():
    t = table("q1", "q2", "q3")
    t.declare_exchange("ad", "fanout", auto_delete=True)
    assert t.lookup("ad") is not None                    # never bound: it stays
    t.bind_queue("ad", "q1")
    t.bind_queue("ad", "q2")
    assert t.unbind_queue("ad", "q1") == ()
    assert t.unbind_queue("ad", "q2") == (b"ad",)
    assert t.lookup("ad") is None
    t.declare_exchange("ad", "fanout", auto_delete=True)
    t.bind_queue("ad", "q3")
    assert t.remove_queue("q3") == (b"ad",)


def test_auto_delete_follows_exchange_to_exchange_bindings():
    t = table()
    t.declare_exchange("src", "fanout", auto_delete=True)
    t.declare_exchange("ad2", "fanout")
    t.bind_exchange("src", "ad2")
    assert t.delete_exchange("ad2") == (b"ad2", b"src")
    t.declare_exchange("top", "fanout", auto_delete=True)
    t.declare_exchange("mid", "fanout", auto_delete=True)
    t.declare_exchange("leaf", "fanout")
    t.bind_exchange("top", "mid")
    t.bind_exchange("mid", "leaf")
    assert t.delete_exchange("leaf") == (b"leaf", b"mid", b"top")
    t.declare_exchange("ad3", "fanout", auto_delete=True)   # only ever a destination: it stays
    t.declare_exchange("s3", "fanout")
    t.bind_exchange("s3", "ad3")
    assert t.unbind_exchange("s3", "ad3") == ()
    assert t.lookup("ad3") is not None


# -- copies and the durable part -------------------------------------------------------------------------
def busy_table(**kw) -> RoutingTable:
    t = RoutingTable(**kw)
    t.add_queue("dq", durable=True)
    t.add_queue("tq", durable=False)
    t.add_queue(b"odd\xff", durable=False)         # any bytes in a snapshot; definitions hold UTF-8 names
    t.add_queue("café", durable=True)
    t.declare_exchange("dx", "topic", durable=True,
                       arguments={"alternate-exchange": "ae", "n": decimal.Decimal("2.50")})
    t.declare_exchange("ae", "fanout", durable=True, internal=True)
    t.declare_exchange("tx", "headers", auto_delete=True)
    t.bind_queue("dx", "dq", "a.#")
    t.bind_queue("dx", "tq", "a.*")
    t.bind_queue("dx", b"odd\xff", b"k\xfe")
    t.bind_queue("dx", "café", "ké")
    t.bind_exchange("ae", "dx", "")
    t.bind_exchange("dx", "tx", "b.*")
    t.bind_queue("tx", "dq", "", {"x-match": "any", "when": datetime.datetime(2024, 1, 2, tzinfo=datetime.UTC),
                                  "blob": bytearray(b"\x00\x01"), "raw": b"\xff", "nest": {"l": [1, None, True]}})
    t.bind_queue("amq.direct", "dq", "k")
    t.bind_queue("ae", "tq")
    return t


def test_a_snapshot_survives_json_and_makes_an_equal_table():
    t = busy_table()
    data = json.loads(json.dumps(t.snapshot()))
    copy = RoutingTable.from_snapshot(data)
    assert copy.snapshot() == t.snapshot()
    for exchange, key, headers in ((b"dx", b"a.b", None), (b"dx", b"b.c", {"raw": b"\xff"}), (b"dx", b"zz", None),
                                   (b"dx", b"k\xfe", None), (b"amq.direct", b"k", None)):
        assert copy.route(exchange, key, headers) == t.route(exchange, key, headers)
    assert sorted(map(repr, copy.bindings())) == sorted(map(repr, t.bindings()))


def test_field_values_round_trip_through_json():
    values = [None, True, 7, -2**40, 1.5, "s", b"\xff\x00", bytearray(b"ab"), decimal.Decimal("1.50"),
              datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC), {"t": {"a": [1, "x"]}}, []]
    for v in values:
        back = from_json_value(json.loads(json.dumps(to_json_value(v))))
        assert type(back) is type(v) and back == v and field_key(back) == field_key(v)


def test_a_copy_follows_the_owner_through_its_changes():
    owner = busy_table(log_changes=True)
    copy = RoutingTable.from_snapshot(owner.snapshot())
    owner.take_changes()
    owner.declare_exchange("new", "direct", auto_delete=True)
    owner.bind_queue("new", "tq", "k")
    owner.unbind_queue("dx", "tq", "a.*")
    owner.remove_queue("tq")                        # takes "new" with it (auto-delete)
    owner.delete_exchange("ae")
    owner.add_queue("late", durable=False)
    changes = json.loads(json.dumps(owner.take_changes()))
    copy.apply(changes)
    assert copy.snapshot() == owner.snapshot()
    assert copy.lookup("new") is None and not copy.has_queue("tq")
    copy.apply(changes)                             # replaying again changes nothing
    assert copy.snapshot() == owner.snapshot()
    with pytest.raises(ValueError, match="does not log"):
        copy.take_changes()


def test_the_durable_part_is_durable_exchanges_and_their_bindings_to_durable_things():
    t = busy_table()
    d = json.loads(json.dumps(t.durable()))
    assert d["queues"] == ["café", "dq"]
    assert set(d["exchanges"]) == {"dx", "ae", "amq.direct"}
    assert d["exchanges"]["dx"]["bindings"] == [["dq", "a.#"], ["café", "ké"]]
    assert d["exchanges"]["ae"] == {"type": "fanout", "bindings": [], "exchange_bindings": [["dx", ""]],
                                    "internal": True}
    fresh = RoutingTable()
    assert fresh.load_durable(d) == []
    assert fresh.durable() == t.durable()
    assert fresh.route(b"dx", b"a.b") == RouteResult((b"dq",), False)
    assert fresh.route(b"dx", b"nothing") == RouteResult((), True)        # via ae -> dx: already seen


def test_definitions_of_the_earlier_format_load_and_bad_entries_are_skipped_with_a_reason():
    t = RoutingTable()
    problems = t.load_durable({"queues": ["q", 5, "x" * 300],
                               "exchanges": {"old": {"type": "direct", "bindings": [["q", "k"], ["gone", "k"], "junk"]},
                                             "bad": {"type": "nonsense"}, "amq.fanout": {"type": "fanout",
                                                                                          "bindings": [["q", ""]]}}})
    assert len(problems) == 5, problems
    assert any("skipped exchange 'bad'" in p for p in problems)
    assert any("['gone', 'k']" in p for p in problems)
    assert t.route(b"old", b"k").queues == (b"q",)
    assert t.route(b"amq.fanout", b"").queues == (b"q",)


def test_statistics():
    t = busy_table()
    t.route(b"dx", b"zz")
    s = t.statistics()
    assert (s.queues, s.bindings, s.routes, s.alternate_routes) == (4, 9, 1, 1)
    assert s.exchanges == len(PREDECLARED) + 3


# -- properties ------------------------------------------------------------------------------------------
def reference_topic(pattern: bytes, key: bytes) -> bool:
    """RabbitMQ's topic rule written the slow, obvious way."""
    p = pattern.split(b".") if pattern else []
    k = key.split(b".") if key else []

    @functools.lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if i == len(p):
            return j == len(k)
        if p[i] == b"#":
            return match(i + 1, j) or (j < len(k) and match(i, j + 1))
        return j < len(k) and (p[i] in (b"*", k[j])) and match(i + 1, j + 1)

    return match(0, 0)


WORDS = st.sampled_from([b"", b"a", b"b", b"*", b"#"])
KEY_WORDS = st.sampled_from([b"", b"a", b"b", b"c", b"*", b"#"])


def dotted(words):
    return st.lists(words, max_size=5).map(lambda ws: b".".join(ws))


@settings(max_examples=150, deadline=None)
@given(patterns=st.lists(dotted(WORDS), min_size=1, max_size=12), keys=st.lists(dotted(KEY_WORDS), min_size=1,
                                                                                   max_size=8),
       drop=st.sets(st.integers(0, 11)))
def test_topic_routing_agrees_with_the_reference_matcher(patterns, keys, drop):
    t = RoutingTable()
    t.declare_exchange("t", "topic")
    for i, p in enumerate(patterns):
        t.add_queue(f"q{i}", durable=False)
        t.bind_queue("t", f"q{i}", p)
    for i in drop:                                  # the trie must prune right, too
        if i < len(patterns):
            t.unbind_queue("t", f"q{i}", patterns[i])
    live = {i: p for i, p in enumerate(patterns) if i not in drop}
    for key in keys:
        expected = sorted(f"q{i}".encode() for i, p in live.items() if reference_topic(p, key))
        assert list(t.route(b"t", key).queues) == expected, (key, live)


def reference_route(t: RoutingTable, exchange: bytes, key: bytes) -> tuple[set, bool]:
    """RabbitMQ's route1, from the public listings: breadth first, each exchange once."""
    kinds = {x.name: x for x in t.exchanges()}
    by_source: dict = {}
    for b in t.bindings():
        by_source.setdefault(b.source, []).append(b)
    found, seen, todo, alternate = set(), {exchange}, [exchange], False
    while todo:
        x = kinds[todo.pop(0)]
        hits = [b for b in by_source.get(x.name, [])
                if x.type == "fanout" or (x.type == "direct" and b.routing_key == key)
                or (x.type == "topic" and reference_topic(b.routing_key, key))]
        nexts = [(b.to_exchange, b.destination) for b in hits]
        ae = x.arguments.get("alternate-exchange")
        if not hits and ae is not None and ae.encode() in kinds:
            nexts, alternate = [(True, ae.encode())], True
        for is_exchange, name in nexts:
            if not is_exchange:
                found.add(name)
            elif name not in seen:
                seen.add(name)
                if name in kinds:
                    todo.append(name)
    return found, alternate


NAMES = [f"x{i}" for i in range(5)]


@settings(max_examples=150, deadline=None)
@given(kinds=st.lists(st.sampled_from(["direct", "fanout", "topic"]), min_size=5, max_size=5),
       alternates=st.lists(st.one_of(st.none(), st.sampled_from(NAMES + ["missing"])), min_size=5, max_size=5),
       e2e=st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(NAMES), st.sampled_from(["a", "b", "#"])),
                    max_size=12),
       to_queues=st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 3), st.sampled_from(["a", "b", "*"])),
                          max_size=10),
       publishes=st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from([b"a", b"b", b"c"])), min_size=1,
                          max_size=5))
def test_graphs_of_exchange_bindings_and_alternates_end_and_deliver_one_copy_per_queue(
        kinds, alternates, e2e, to_queues, publishes):
    t = table("q0", "q1", "q2", "q3")
    for name, kind, ae in zip(NAMES, kinds, alternates):
        t.declare_exchange(name, kind, arguments={"alternate-exchange": ae} if ae else None)
    for src, dst, key in e2e:
        t.bind_exchange(src, dst, key)
    for src, q, key in to_queues:
        t.bind_queue(src, f"q{q}", key)
    for exchange, key in publishes:
        result = t.route(exchange.encode(), key)
        assert len(set(result.queues)) == len(result.queues) and list(result.queues) == sorted(result.queues)
        assert (set(result.queues), result.alternate) == reference_route(t, exchange.encode(), key)


class TableMachine(RuleBasedStateMachine):
    """The owner changes the table in every way; a copy follows by changes; both route as the bindings say."""

    def __init__(self):
        super().__init__()
        self.owner = RoutingTable(log_changes=True)
        self.copy = RoutingTable.from_snapshot(self.owner.snapshot())
        self.had_bindings: set = set()

    @rule(q=st.integers(0, 3), durable=st.booleans())
    def add_queue(self, q, durable):
        self.owner.add_queue(f"q{q}", durable=durable)

    @rule(q=st.integers(0, 3))
    def remove_queue(self, q):
        self.owner.remove_queue(f"q{q}")

    @rule(x=st.sampled_from(NAMES), kind=st.sampled_from(["direct", "fanout", "topic"]), auto=st.booleans(),
          ae=st.one_of(st.none(), st.sampled_from(NAMES)))
    def declare(self, x, kind, auto, ae):
        if self.owner.lookup(x) is None:
            self.had_bindings.discard(x.encode())
            self.owner.declare_exchange(x, kind, auto_delete=auto, arguments={"alternate-exchange": ae} if ae else None)

    @rule(x=st.sampled_from(NAMES), if_unused=st.booleans())
    def delete(self, x, if_unused):
        try:
            self.owner.delete_exchange(x, if_unused=if_unused)
        except ChannelLevelError as err:
            assert "in use" in err.reply_text

    @rule(src=st.sampled_from(NAMES), dst=st.sampled_from(NAMES), key=st.sampled_from(["a", "#", "*.b"]),
          to_queue=st.booleans(), q=st.integers(0, 3), unbind=st.booleans())
    def bind(self, src, dst, key, to_queue, q, unbind):
        dest = f"q{q}" if to_queue else dst
        op = {(True, False): self.owner.bind_queue, (True, True): self.owner.unbind_queue,
              (False, False): self.owner.bind_exchange, (False, True): self.owner.unbind_exchange}[to_queue, unbind]
        try:
            op(src, dest, key)
        except ChannelLevelError as err:
            assert err.reply_code == 404

    @invariant()
    def copy_equals_owner_and_routes_agree_with_the_bindings(self):
        self.copy.apply(self.owner.take_changes())
        assert self.copy.snapshot() == self.owner.snapshot()
        for x in self.owner.exchanges():
            if x.internal:
                continue
            for key in (b"a", b"a.b", b"c"):
                got = self.owner.route(x.name, key)
                assert (set(got.queues), got.alternate) == reference_route(self.owner, x.name, key)
                assert self.copy.route(x.name, key) == got

    @invariant()
    def no_binding_dangles_and_no_auto_delete_exchange_outlives_its_last_binding(self):
        names = {x.name for x in self.owner.exchanges()}
        sources = set()
        for b in self.owner.bindings():
            sources.add(b.source)
            assert b.destination in names if b.to_exchange else self.owner.has_queue(b.destination)
        self.had_bindings &= names
        for x in self.owner.exchanges():
            if x.auto_delete:
                assert x.name in sources or x.name not in self.had_bindings, x.name
        self.had_bindings |= sources


TableMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestTableMachine = TableMachine.TestCase
