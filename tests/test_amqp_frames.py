"""The frame codec: fast paths byte-identical to pamqp, decoders that read pamqp's frames, and
partial input that is never an error."""

from __future__ import annotations

import datetime
import struct
import time

import pytest
from hypothesis import given, settings, strategies as st
from pamqp import body as pbody, commands, frame, header, heartbeat

from pipeline.amqp import fields, frames
from pipeline.amqp.errors import (AmqpError, ConnectionLevelError, FrameError, clip_reply_text, erlang_binary)

UTC = datetime.timezone.utc

PROPS = {
    "none": commands.Basic.Properties(),
    "persistent": commands.Basic.Properties(delivery_mode=2),
    "transient+type": commands.Basic.Properties(content_type="text/plain", delivery_mode=1),
    "every property": commands.Basic.Properties(
        content_type="application/json", content_encoding="gzip",
        headers={"x": 1, "y": "z", "big": 2 ** 40, "neg": -5, "flag": True, "nested": {"a": [1, "b"]},
                 "clé": "valeur ☃"},
        delivery_mode=2, priority=3, correlation_id="c-1", reply_to="amq.rabbitmq.reply-to",
        expiration="60000", message_id="m-1", timestamp=datetime.datetime(2026, 1, 1, tzinfo=UTC),
        message_type="t", user_id="guest", app_id="creditflow"),
    "headers before delivery mode": commands.Basic.Properties(headers={"k" * 50: "v" * 300}, delivery_mode=2),
    "no delivery mode": commands.Basic.Properties(content_type="a", priority=9, app_id="x"),
}

FRAME_MAX = 4096
BODIES = {
    "empty": b"",
    "small": b"hello",
    "exactly one frame": b"a" * (FRAME_MAX - 8),
    "one byte over a frame": b"b" * (FRAME_MAX - 7),
    "many frames": bytes(range(256)) * 50,
}


def pamqp_content(channel, props, body, frame_max):
    out = frame.marshal(header.ContentHeader(0, len(body), props), channel)
    step = frame_max - 8
    for i in range(0, len(body), step):
        out += frame.marshal(pbody.ContentBody(body[i:i + step]), channel)
    return out


def split_frames(data) -> list[tuple[int, int, bytes]]:
    out, pos = [], 0
    while (found := frames.next_frame(data, pos)) is not None:
        ftype, ch, ps, pe = found
        out.append((ftype, ch, bytes(data[ps:pe])))
        pos = pe + 1
    assert pos == len(data), "whole frames only"
    return out


# -- the fast paths against pamqp ----------------------------------------------------------------------

@pytest.mark.parametrize("props", PROPS.values(), ids=PROPS.keys())
@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_publish_is_byte_identical_to_pamqp(props, body):
    raw = frames.properties_raw(props)
    for mandatory in (False, True):
        fast = frames.encode_publish(5, "amq.direct", "clé.☃", raw, body, FRAME_MAX, mandatory=mandatory)
        ref = frame.marshal(commands.Basic.Publish(exchange="amq.direct", routing_key="clé.☃",
                                                   mandatory=mandatory), 5)
        assert fast == ref + pamqp_content(5, props, body, FRAME_MAX)


@pytest.mark.parametrize("props", PROPS.values(), ids=PROPS.keys())
@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_deliver_and_content_are_byte_identical_to_pamqp(props, body):
    raw = frames.properties_raw(props)
    for redelivered in (False, True):
        fast = frames.encode_deliver(2, "amq.ctag-Ü", 2 ** 62 + 7, redelivered, "", "q", raw, body, FRAME_MAX)
        ref = frame.marshal(commands.Basic.Deliver(consumer_tag="amq.ctag-Ü", delivery_tag=2 ** 62 + 7,
                                                   redelivered=redelivered, exchange="", routing_key="q"), 2)
        assert fast == ref + pamqp_content(2, props, body, FRAME_MAX)
        names = b"".join(bytes((len(n),)) + n for n in ("amq.direct".encode(), "clé.☃".encode()))
        for frame_max in (FRAME_MAX, 4096, 0):          # from a record's names, the frame count with it
            fast, count = frames.encode_deliver_names(2, "amq.ctag-Ü".encode(), 9, redelivered, memoryview(names),
                                                      memoryview(raw), memoryview(body), frame_max)
            assert fast == frames.encode_deliver(2, "amq.ctag-Ü", 9, redelivered, "amq.direct", "clé.☃", raw,
                                                 body, frame_max)
            assert count == frames.count_frames(fast)
    assert frames.encode_content(9, raw, body, FRAME_MAX) == pamqp_content(9, props, body, FRAME_MAX)


@given(channel=st.integers(1, 65535), ctag=st.binary(min_size=0, max_size=255),
       exchange=st.binary(max_size=255), routing_key=st.binary(max_size=255), props=st.binary(max_size=300),
       body=st.binary(min_size=1, max_size=3000), tag=st.integers(1, 2 ** 64 - 1), redelivered=st.booleans())
@settings(max_examples=300, deadline=None)
def test_a_delivery_from_its_template_is_byte_identical_to_the_frames_encoded_whole(
        channel, ctag, exchange, routing_key, props, body, tag, redelivered):
    """What a reader sends for a queue's DELIVER record: from the record's own bytes, through a template
    kept per consumer, the same frames as encoding the delivery whole (and as pamqp, above)."""
    from pipeline.broker import wire

    content = wire.encode_publish(0, 1, exchange, routing_key, props, body)[wire.PUBLISH_CONTENT_OFFSET:]
    record = wire.encode_deliver(wire.DLV_REDELIVERED if redelivered else 0, channel, 77, ctag, content)
    flags, ch, msg_id, names_at, props_at, body_at = wire.deliver_offsets(record)
    assert (flags, ch, msg_id) == (wire.DLV_REDELIVERED if redelivered else 0, channel, 77)
    assert bytes(record[props_at:body_at]) == props and bytes(record[body_at:]) == body
    templates = frames.DeliverTemplates()
    for _ in range(2):                      # the template made, then the template kept
        got = templates.encode(channel, bytes(record[wire.DELIVER_CTAG_AT:names_at]), tag, redelivered,
                               memoryview(record)[names_at:props_at - 4], memoryview(record)[props_at:body_at],
                               memoryview(record)[body_at:])
        whole = frames.encode_deliver(channel, ctag, tag, redelivered, exchange, routing_key, props, body, 0)
        assert got == whole
        assert frames.count_frames(got) == 3


@pytest.mark.parametrize("multiple", [False, True])
def test_basic_ack_is_byte_identical_to_pamqp(multiple):
    assert frames.encode_basic_ack(3, 12345, multiple) == frame.marshal(commands.Basic.Ack(12345, multiple), 3)


def test_heartbeat_and_generic_methods_are_pamqps():
    assert frames.encode_heartbeat() == frame.marshal(heartbeat.Heartbeat(), 0)
    qos = commands.Basic.Qos(prefetch_count=10)
    assert frames.encode_method(4, qos) == frame.marshal(qos, 4)


def test_a_body_is_never_split_when_frame_max_is_unlimited():
    data = frames.encode_content(1, b"\x00\x00", b"z" * 300_000, 0)
    kinds = [f[0] for f in split_frames(data)]
    assert kinds == [frames.FrameType.HEADER, frames.FrameType.BODY]


@settings(max_examples=150, deadline=None)
@given(exchange=st.text(alphabet="abcXYZ019-_.:@#,/+ ", max_size=60), routing_key=st.text(max_size=60), body=st.binary(max_size=9000),
       frame_max=st.sampled_from([4096, 5000, 131072]), mandatory=st.booleans(),
       mode=st.sampled_from([None, 1, 2]), ctype=st.one_of(st.none(), st.text(max_size=20)))
def test_any_publish_matches_pamqp_and_decodes_back(exchange, routing_key, body, frame_max, mandatory, mode, ctype):
    props = commands.Basic.Properties(content_type=ctype, delivery_mode=mode)
    raw = frames.properties_raw(props)
    data = frames.encode_publish(1, exchange, routing_key, raw, body, frame_max, mandatory)
    assert data == (frame.marshal(commands.Basic.Publish(exchange=exchange, routing_key=routing_key,
                                                         mandatory=mandatory), 1)
                    + pamqp_content(1, props, body, frame_max))
    method, head, *bodies = split_frames(data)
    assert frames.decode_publish(method[2], 0, len(method[2])) == (exchange, routing_key, mandatory)
    assert frames.decode_content_header(head[2], 0, len(head[2])) == (len(body), raw)
    assert b"".join(b[2] for b in bodies) == body
    assert all(len(b[2]) <= frame_max - 8 for b in bodies)
    assert frames.delivery_mode_of(raw) == frames.check_properties(raw) == mode


# -- decoding what pamqp made ---------------------------------------------------------------------------

def payload(data: bytes) -> bytes:
    (only,) = split_frames(data)
    return only[2]


def test_decoders_read_pamqp_frames():
    p = payload(frame.marshal(commands.Basic.Publish(exchange="ex", routing_key="rk ☃", mandatory=True), 1))
    assert frames.decode_publish(p, 0, len(p)) == ("ex", "rk ☃", True)
    assert frames.decode_publish_raw(p, 0, len(p)) == (b"ex", "rk ☃".encode(), 1)
    p = payload(frame.marshal(commands.Basic.Deliver(consumer_tag="ctag", delivery_tag=7, redelivered=True,
                                                     exchange="ex", routing_key="rk"), 1))
    assert frames.decode_deliver(p, 0, len(p)) == ("ctag", 7, True, "ex", "rk")
    p = payload(frame.marshal(commands.Basic.Ack(99, True), 1))
    assert frames.decode_basic_ack(p, 0, len(p)) == (99, True)
    props = PROPS["every property"]
    p = payload(frame.marshal(header.ContentHeader(0, 123456, props), 1))
    size, raw = frames.decode_content_header(p, 0, len(p))
    assert size == 123456 and raw == frames.properties_raw(props)
    assert frames.check_properties(raw) == 2


def test_decoders_work_in_place_inside_a_larger_buffer():
    data = bytearray(b"junk" + frames.encode_publish(3, "e", "r", b"\x00\x00", b"", 4096, True) + b"more")
    ftype, ch, ps, pe = frames.next_frame(data, 4)
    assert (ftype, ch) == (1, 3)
    assert frames.method_id(data, ps) == frames.BASIC_PUBLISH
    assert frames.decode_publish(data, ps, pe) == ("e", "r", True)


METHODS = [
    commands.Queue.Declare(queue="orders", durable=True, arguments={"x-max-length": 10, "x-queue-type": "classic"}),
    commands.Exchange.Declare(exchange="logs", exchange_type="topic", durable=True),
    commands.Queue.Bind(queue="orders", exchange="logs", routing_key="*.error"),
    commands.Basic.Consume(queue="orders", consumer_tag="c1", no_ack=False, exclusive=True),
    commands.Basic.Qos(prefetch_count=100, global_=True),
    commands.Basic.Nack(delivery_tag=5, multiple=True, requeue=False),
    commands.Basic.Reject(delivery_tag=6, requeue=True),
    commands.Basic.Ack(delivery_tag=7, multiple=False),
    commands.Basic.Get(queue="orders", no_ack=True),
    commands.Confirm.Select(),
    commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0),
    commands.Connection.StartOk(client_properties={"capabilities": {"connection.blocked": True}},
                                mechanism="PLAIN", response="\0guest\0guest", locale="en_US"),
    commands.Connection.TuneOk(channel_max=10, frame_max=4096, heartbeat=5),
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_decode_method_round_trips_pamqp(method):
    p = payload(frames.encode_method(1, method))
    decoded = frames.decode_method(p, 0, len(p))
    assert type(decoded) is type(method)
    assert {k: getattr(decoded, k) for k in method.__slots__} == {k: getattr(method, k) for k in method.__slots__}


def test_method_names_read_like_rabbitmq_logs():
    assert frames.method_name(frames.BASIC_PUBLISH) == "basic.publish"
    assert frames.method_name(frames.CONNECTION_TUNE_OK) == "connection.tune-ok"
    assert frames.method_name((60, 99)) == "unknown 60/99"


# -- malformed input ---------------------------------------------------------------------------------------

def test_unknown_methods_are_not_implemented():
    p = b"\x00\x3c\x00\xff"
    with pytest.raises(ConnectionLevelError, match="NOT_IMPLEMENTED - unknown method 60/255") as exc:
        frames.decode_method(p, 0, len(p))
    assert (exc.value.reply_code, exc.value.class_id, exc.value.method_id) == (540, 60, 255)


@pytest.mark.parametrize("mangle, text", [
    ("truncate", "FRAME_ERROR - cannot decode <<0,0,6,111,114,100,101,114,115,2,0>>"),
    ("extend", "FRAME_ERROR - cannot decode <<0,0,6,111,114,100,101,114,115,2,0,0,0,0,0>>"),
    ("bad utf-8", "FRAME_ERROR - Malformed UTF-8 in shortstr"),
])
def test_undecodable_arguments_are_frame_errors_with_rabbitmqs_text(mangle, text):
    p = payload(frames.encode_method(1, commands.Queue.Declare(queue="orders", durable=True)))
    if mangle == "truncate":
        p = p[:-3]
    elif mangle == "extend":
        p = p + b"\x00"
    else:
        p = p[:7] + b"\xff\xfe" + p[9:]     # inside the queue name
    with pytest.raises(FrameError) as exc:
        frames.decode_method(p, 0, len(p))
    assert exc.value.reply_text == text
    assert (exc.value.reply_code, exc.value.class_id, exc.value.method_id) == (501, 50, 10)


def test_content_bearing_methods_take_any_bytes_in_their_names_as_rabbitmq_does():
    p = struct.pack(">HHH", 60, 40, 0) + b"\x01\xff\x01q\x00"
    publish = frames.decode_method(p, 0, len(p))
    assert publish.exchange == "\udcff" and publish.exchange.encode("utf-8", "surrogateescape") == b"\xff"


def test_a_method_frame_too_short_for_its_ids_is_an_unknown_frame():
    with pytest.raises(FrameError, match="unknown_frame"):
        frames.decode_method(b"\x00\x3c", 0, 2)


@pytest.mark.parametrize("cut", [1, 3, 8])
def test_truncated_per_message_methods_are_frame_errors(cut):
    p = payload(frame.marshal(commands.Basic.Publish(exchange="ex", routing_key="rk"), 1))
    with pytest.raises(FrameError, match="cannot decode <<") as exc:
        frames.decode_publish(p, 0, len(p) - cut)
    assert (exc.value.class_id, exc.value.method_id) == frames.BASIC_PUBLISH
    p = payload(frame.marshal(commands.Basic.Deliver(consumer_tag="c", delivery_tag=1, exchange="e",
                                                     routing_key="r"), 1))
    with pytest.raises(FrameError, match="cannot decode <<"):
        frames.decode_deliver(p, 0, len(p) - cut)
    p = payload(frames.encode_basic_ack(1, 5))
    with pytest.raises(FrameError, match="cannot decode <<"):
        frames.decode_basic_ack(p, 0, len(p) - cut)


def test_property_lists_must_be_exactly_as_long_as_their_flags_say():
    raw = frames.properties_raw(PROPS["every property"])
    for cut in range(1, len(raw) - 2):
        with pytest.raises(FrameError, match="cannot decode content properties"):
            frames.check_properties(raw[:-cut])
    with pytest.raises(FrameError):
        frames.check_properties(raw + b"\x00")
    assert frames.check_properties(b"\x00\x00") is None
    assert frames.check_properties(b"\x10\x00\x02") == 2


def test_a_headers_table_is_walked_but_its_names_are_not_checked():
    def props(table: bytes) -> bytes:
        return b"\x30\x00" + struct.pack(">I", len(table)) + table + b"\x02"
    assert frames.check_properties(props(b"\x01\xffI\x00\x00\x00\x01")) == 2, "any bytes in a name, as RabbitMQ"
    for bad in (b"\x01aZ", b"\x01aI\x00\x00", b"\x05ab", b"\x01aS\x00\x00\x00\x09abc"):
        with pytest.raises(FrameError, match="cannot decode") as exc:
            frames.check_properties(props(bad))
        assert (exc.value.class_id, exc.value.method_id) == frames.BASIC_PUBLISH
    deep = b"\x01aI\x00\x00\x00\x01"
    for _ in range(fields.FIELD_NESTING_MAX):
        deep = b"\x01aF" + struct.pack(">I", len(deep)) + deep
    with pytest.raises(FrameError, match="nested deeper than 64 levels") as exc:
        frames.check_properties(props(deep))
    assert (exc.value.class_id, exc.value.method_id) == frames.BASIC_PUBLISH


# -- finding frames in a byte stream -----------------------------------------------------------------------

STREAM = (frames.encode_publish(1, "", "q", frames.properties_raw(PROPS["every property"]), b"x" * 9000, 4096)
          + frames.encode_heartbeat() + frames.encode_basic_ack(1, 3)
          + frames.encode_publish(2, "", "q", b"\x00\x00", b"", 4096))


def test_truncation_at_every_offset_is_incomplete_never_an_error():
    whole = split_frames(STREAM)
    for cut in range(len(STREAM)):
        prefix = STREAM[:cut]
        seen, pos = [], 0
        while (found := frames.next_frame(prefix, pos, 4096)) is not None:
            ftype, ch, ps, pe = found
            seen.append((ftype, ch, prefix[ps:pe]))
            pos = pe + 1
        assert seen == whole[:len(seen)], "whole frames only, in order"
        assert pos <= cut
        assert cut - pos < 4096, "a complete frame was left unparsed"


def test_counting_frames_stops_at_a_partial_one():
    assert frames.count_frames(STREAM) == len(split_frames(STREAM))
    assert frames.count_frames(STREAM[:-1]) == len(split_frames(STREAM)) - 1
    assert frames.count_frames(b"") == 0


def test_a_bad_frame_end_is_a_frame_error():
    good = frames.encode_basic_ack(1, 1)
    with pytest.raises(FrameError, match=r"FRAME_ERROR - type 1, all octets = <<0,60,0,80,.*invalid_frame_end_marker,0"):
        frames.next_frame(good[:-1] + b"\x00")
    assert frames.next_frame(good[:-1]) is None, "the end octet has not arrived yet"


def test_an_oversized_frame_is_refused_as_soon_as_its_header_arrives():
    big = struct.pack(">BHI", 3, 1, 5000)
    with pytest.raises(FrameError, match=r"frame_too_large,5000,4088") as exc:
        frames.next_frame(big, 0, frame_max=4096)
    assert exc.value.reply_code == 501
    assert frames.next_frame(big, 0, frame_max=0) is None, "0 is no limit"
    assert frames.next_frame(struct.pack(">BHI", 3, 1, 4096), 0, 4096, slack_bytes=8) is None
    with pytest.raises(FrameError):
        frames.next_frame(struct.pack(">BHI", 3, 1, 4097), 0, 4096, slack_bytes=8)


# -- field tables ------------------------------------------------------------------------------------------------

def table_bytes(entries: bytes) -> bytes:
    return struct.pack(">I", len(entries)) + entries


def nested(depth: int, kind: bytes = b"F") -> bytes:
    """Entries of a table holding ``depth`` levels in all: {"a": {"a": ... 1}} or {"a": [[...]]}."""
    if kind == b"F":
        inner = b"\x01aI\x00\x00\x00\x01"
        for _ in range(depth - 1):
            inner = b"\x01aF" + table_bytes(inner)
        return inner
    inner = b""
    for _ in range(depth - 2):
        inner = b"A" + table_bytes(inner)
    return b"\x01aA" + table_bytes(inner)


@pytest.mark.parametrize("kind", [b"F", b"A"])
def test_nesting_is_refused_past_the_limit_however_deep_without_recursion(kind):
    ok = nested(fields.FIELD_NESTING_MAX, kind)
    value, depth = fields.decode_table(ok, 0, len(ok)), 0
    while isinstance(value, (dict, list)) and value:
        value, depth = (value["a"] if isinstance(value, dict) else value[0]), depth + 1
    assert depth == fields.FIELD_NESTING_MAX - (kind == b"A")
    for depth in (fields.FIELD_NESTING_MAX + 1, 20_000):
        deep = nested(depth, kind)
        with pytest.raises(FrameError, match=f"FRAME_ERROR - field table nested deeper than "
                                             f"{fields.FIELD_NESTING_MAX} levels"):
            fields.decode_table(deep, 0, len(deep))
        with pytest.raises(FrameError, match="nested deeper"):
            fields.check_table(deep, 0, len(deep))


def test_a_wide_table_decodes_in_linear_time():
    entries = b"".join(b"\x04k%03dt\x01" % (i % 1000) for i in range(20_000))
    entries += b"\x01zS" + struct.pack(">I", 50_000) + b"x" * 50_000
    started = time.perf_counter()
    table = fields.decode_table(entries, 0, len(entries))
    assert len(table) == 1001 and table["z"] == "x" * 50_000
    assert time.perf_counter() - started < 2, "pamqp's decoder copies the rest of the buffer for every entry"


TABLE_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 63 - 1), st.text(max_size=20),
              st.floats(width=32, allow_nan=False), st.datetimes(min_value=datetime.datetime(1970, 1, 1),
                                                       max_value=datetime.datetime(2100, 1, 1)).map(
                  lambda d: d.replace(microsecond=0, tzinfo=UTC))),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(table=st.dictionaries(st.text(max_size=10), TABLE_VALUES, max_size=6))
def test_tables_pamqp_encodes_decode_to_what_pamqp_decodes(table):
    from pamqp import decode as pamqp_decode, encode as pamqp_encode
    data = pamqp_encode.field_table(table)
    assert fields.decode_table(data, 4, len(data)) == pamqp_decode.field_table(data)[1]


@settings(max_examples=500, deadline=None, derandomize=True)
@given(data=st.binary(max_size=200), cut=st.integers(0, 200))
def test_no_bytes_make_a_decoder_raise_anything_but_a_frame_error(data, cut):
    for decode in (fields.decode_table, fields.check_table):
        try:
            decode(data, min(cut, len(data)), len(data))
        except FrameError:
            pass
    for class_id, method_id in ((10, 11), (50, 10), (40, 10), (60, 20), (20, 40), (10, 40), (60, 40)):
        p = struct.pack(">HH", class_id, method_id) + data
        try:
            frames.decode_method(p, 0, len(p))
        except AmqpError:
            pass
    try:
        frames.check_properties(data)
    except FrameError:
        pass


def test_every_truncation_of_a_real_start_ok_is_a_frame_error():
    p = payload(frames.encode_method(0, commands.Connection.StartOk(
        client_properties={"product": "x", "capabilities": {"a": True, "b": [1, 2, {"c": None}]}},
        mechanism="PLAIN", response="\0guest\0guest", locale="en_US")))
    for cut in range(4, len(p)):
        with pytest.raises(FrameError, match="cannot decode <<") as exc:
            frames.decode_method(p, 0, cut)
        assert (exc.value.class_id, exc.value.method_id) == (10, 11)


def test_binaries_in_reply_texts_read_as_erlang_prints_them():
    assert erlang_binary(b"xx") == '<<"xx">>'
    assert erlang_binary(b'a"b\\\n') == '<<"a\\"b\\\\\\n">>'
    assert erlang_binary(b"\x00\x32") == "<<0,50>>"
    assert erlang_binary(b"") == "<<>>"
    assert erlang_binary(b"xx", text=False) == "<<120,120>>"
    assert frames.octets(b"x" * 20, 0, 20) == 'first 16 octets = <<"xxxxxxxxxxxxxxxx">>'


def test_a_long_reply_text_is_cut_as_rabbitmq_cuts_it():
    p = struct.pack(">HHH", 50, 10, 0) + b"\xc8" + b"a" * 150         # a queue name cut short
    with pytest.raises(FrameError) as exc:
        frames.decode_method(p, 0, len(p))
    # what RabbitMQ 3.10 sent for these very bytes
    assert clip_reply_text(exc.value.reply_text) == "FRAME_ERROR - cannot decode <<0,0,200," + "97," * 71 + "9..."
    assert clip_reply_text("é" * 200).endswith("...") and len(clip_reply_text("é" * 200).encode()) <= 255

