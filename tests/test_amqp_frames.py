"""The per-message fast paths are byte-identical to pamqp, and partial input is never an error."""

from __future__ import annotations

import datetime

import pytest
from pamqp import body as pbody, commands, frame, header

from pipeline.amqp import frames
from pipeline.amqp.errors import FrameError

PROPS = [
    commands.Basic.Properties(),
    commands.Basic.Properties(delivery_mode=2),
    commands.Basic.Properties(content_type="application/json", content_encoding="gzip",
                              headers={"x": 1, "y": "z", "nested": {"a": [1, 2]}}, delivery_mode=1,
                              priority=3, correlation_id="c", reply_to="r", expiration="60000",
                              message_id="m", timestamp=datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc),
                              message_type="t", user_id="guest", app_id="app"),
]


def pamqp_content(channel, props, body, frame_max):
    out = frame.marshal(header.ContentHeader(0, len(body), props), channel)
    step = frame_max - 8
    for i in range(0, len(body), step):
        out += frame.marshal(pbody.ContentBody(body[i:i + step]), channel)
    return out


@pytest.mark.parametrize("props", PROPS)
@pytest.mark.parametrize("body", [b"", b"hello", bytes(range(256)) * 40])
def test_publish_and_deliver_match_pamqp(props, body):
    raw = frames.properties_raw(props)
    fm = 4096
    fast = frames.encode_publish(5, "amq.direct", "clé", raw, body, fm, mandatory=True)
    ref = frame.marshal(commands.Basic.Publish(exchange="amq.direct", routing_key="clé", mandatory=True), 5)
    assert fast == ref + pamqp_content(5, props, body, fm)
    fast = frames.encode_deliver(2, "ctag", 99, True, "", "q", raw, body, fm)
    ref = frame.marshal(commands.Basic.Deliver(consumer_tag="ctag", delivery_tag=99, redelivered=True,
                                               exchange="", routing_key="q"), 2)
    assert fast == ref + pamqp_content(2, props, body, fm)
    assert frames.delivery_mode_of(raw) == props.delivery_mode


def test_ack_and_decoders_round_trip():
    data = frames.encode_basic_ack(3, 12345, True)
    assert data == frame.marshal(commands.Basic.Ack(12345, True), 3)
    ftype, ch, ps, pe = frames.next_frame(data)
    assert (ftype, ch) == (1, 3)
    assert frames.decode_basic_ack(data, ps, pe) == (12345, True)
    pub = frames.encode_publish(1, "ex", "rk", b"\x00\x00", b"", 131072, mandatory=True)
    _, _, ps, pe = frames.next_frame(pub)
    assert frames.decode_publish(pub, ps, pe) == ("ex", "rk", True)
    dlv = frames.encode_deliver(1, "c", 7, False, "ex", "rk", b"\x00\x00", b"", 131072)
    _, _, ps, pe = frames.next_frame(dlv)
    assert frames.decode_deliver(dlv, ps, pe) == ("c", 7, False, "ex", "rk")


def test_truncation_at_every_offset_is_incomplete_never_an_error():
    data = frames.encode_publish(1, "", "q", frames.properties_raw(delivery_mode=2), b"x" * 300, 131072)
    for cut in range(len(data)):
        pos = 0
        while True:
            found = frames.next_frame(data[:cut], pos)
            if found is None:
                break
            pos = found[3] + 1
        assert pos <= cut


def test_bad_frame_end_and_oversized_frames_are_frame_errors():
    good = frames.encode_basic_ack(1, 1)
    with pytest.raises(FrameError, match="frame end") as exc:
        frames.next_frame(good[:-1] + b"\x00")
    assert exc.value.reply_code == 501
    big = frames.encode_publish(1, "", "q", b"\x00\x00", b"x" * 10000, 131072)
    with pytest.raises(FrameError, match="frame_too_large"):
        pos = 0
        while True:
            found = frames.next_frame(big, pos, frame_max=4096)
            pos = found[3] + 1


def test_unknown_methods_are_not_implemented():
    payload = b"\x00\x3c\x00\xff"
    with pytest.raises(Exception) as exc:
        frames.decode_method(payload, 0, len(payload))
    assert exc.value.reply_code == 540
