"""AMQP errors: each carries the reply code and text the peer will see.

A *connection* error (hard) closes the whole connection with
``connection.close``; a *channel* error (soft) closes one channel with
``channel.close`` and the connection carries on. Either way only the
connection that sent the bad input is affected. ``class_id``/``method_id``
name the method that failed (0/0 when no method was involved, e.g. a bad
frame). Reply texts follow RabbitMQ: ``"NAME - explanation"``, binaries in
them written as Erlang prints them (``<<"xx">>``, ``<<0,50>>``), anything
longer than a shortstr cut to 252 bytes and ``...``.

What RabbitMQ does with each kind of bad input was read off a real 3.10.8
node: each input below went on a connection of its own, and the reply was
taken off the socket. Where this project departs, the line says so.

Before tune-ok (connection states ``starting`` and ``tuning``) RabbitMQ does
not trust the client. Whatever it sends wrong -- a frame over 4096 bytes (a
payload of 4096 itself passes: RabbitMQ allows 8 bytes of slack), a declared
frame size of 2^32-1, a bad frame-end, an unknown frame type, a frame on a
channel, a content header, a start-ok cut short or with bytes left over, an
unknown field type, a non-UTF-8 mechanism, start-ok, tune-ok or open out of
order -- the socket is closed with nothing sent, after a 3 s pause; an
unknown class or method id closes it at once. Heartbeats are ignored. Two
errors only are told: a refused login (403, to clients announcing
``authentication_failure_close``) and a refused tune-ok (530). This project
does the same without the pause, which would hold a whole reader process
here (RabbitMQ pays for an Erlang process); the ``ProtocolError`` event
still carries the code and text for the log.

After tune-ok, the codes and texts RabbitMQ sent (``connection.close``
unless marked channel)::

    wrong protocol header               no close: its own protocol header, then the socket closes
    bad frame-end octet                 501 "type 1, all octets = <<...>>: {invalid_frame_end_marker,0}",
                                        then it stops reading (out of sync)
    frame over frame_max, up to 2^32-1  501 "type 3, all octets = <<>>: {frame_too_large,131073,131064}",
                                        stops reading; checked on the 7-byte header, before any payload
    unknown frame type                  501 "type 9, all octets = <<>>: unknown_frame"
    heartbeat with a payload            501 "type 8, all octets = <<"xx">>: unknown_frame"
    method frame under 4 bytes,
      content header under 12           501 "type 1, all octets = <<0,50>>: unknown_frame"
    method arguments cut short or
      with bytes left over              501 "cannot decode <<0,0,5,97,98>>" (with the method's ids); for
                                        connection.open alone RabbitMQ closes without a word, here 501
    non-UTF-8 shortstr in a method
      that carries no content           501 "Malformed UTF-8 in shortstr" (RabbitMQ gives channel
                                        methods ids 0/0; this project the method's)
    non-UTF-8 exchange or routing key
      in basic.publish                  taken unchecked (the channel answers 404 for no such exchange)
    header or body with no publish, on
      an unopened channel, or on one
      the client is closing             505 "expected method frame, got non method frame instead"
    body before header, a method
      inside content, header for class
      50 or of weight 1, header twice   505 "expected content header for class 60, got ..." (60/40)
    header or body on channel 0,
      heartbeat on a channel            505 "type 2, all octets = <<...>>"
    method on an unopened channel       504 "CHANNEL_ERROR - expected 'channel.open'"
    second channel.open                 504 "second 'channel.open' seen"
    connection method while running,
      channel method on channel 0       504 "unexpected method in connection state running"
    channel.close-ok for no close       503 "COMMAND_INVALID - unimplemented method"
    channel.flow active=false           540 "NOT_IMPLEMENTED - active=false"
    unknown delivery tag in basic.ack   406 channel, "unknown delivery tag 99"
    content interleaved on two channels taken: assembly is per channel
    declared body size 600 MiB, 2^63,
      2^64-1                            no reply: RabbitMQ waits for the body, then refuses it as over
                                        the size limit (406 channel, "message size N is larger than
                                        configured max size M"); here the body is dropped as it
                                        arrives and the same 406 follows once it is all in
    unknown class or method id          RabbitMQ resets the socket at once (its reader exits); here
                                        540 "NOT_IMPLEMENTED - unknown method 60/255"
    unknown field type in a table, an
      array entry cut short             RabbitMQ resets the socket at once; here 501 "cannot decode"
    table longer than its method        501 "cannot decode <<...>>"
    content properties that do not
      decode (with the body sent)       541 "INTERNAL_ERROR" (its channel process crashes); here 501
                                        "cannot decode content properties <<...>>"
    tables nested 5,000 deep (queue
      arguments, message headers; and
      580 deep in client_properties)    taken; here 501 "field table nested deeper than 64 levels",
                                        since a Python stack is not Erlang's (fields.FIELD_NESTING_MAX)
    non-UTF-8 field names in a table    taken; here 501 "Malformed UTF-8 in shortstr" where the table is
                                        decoded (method arguments); message headers go on untouched
    every field type (t b B s u I i l
      L f d D S x T V F A), timestamps
      past the year 9999                taken
    channel number over channel_max     RabbitMQ 3.10 takes it (it limits how many are open); here
                                        530 NOT_ALLOWED "channel number N is over the negotiated
                                        channel_max"

Not sent to the live node, from RabbitMQ's sources: a refused login (403),
a malformed PLAIN response (502 SYNTAX_ERROR), an unknown mechanism (503),
a tune-ok over the server's limits and an unknown vhost (530 NOT_ALLOWED), a
message over the configured size (406 channel), publish with immediate=true
(540). Should parsing fail on input nobody foresaw, the connection closes
with 541 INTERNAL_ERROR, as RabbitMQ closes one whose channel process
crashed, and no other connection notices.
"""

from __future__ import annotations

REPLY_SUCCESS = 200
CONTENT_TOO_LARGE = 311
NO_ROUTE = 312
NO_CONSUMERS = 313
CONNECTION_FORCED = 320
INVALID_PATH = 402
ACCESS_REFUSED = 403
NOT_FOUND = 404
RESOURCE_LOCKED = 405
PRECONDITION_FAILED = 406
FRAME_ERROR = 501
SYNTAX_ERROR = 502
COMMAND_INVALID = 503
CHANNEL_ERROR = 504
UNEXPECTED_FRAME = 505
RESOURCE_ERROR = 506
NOT_ALLOWED = 530
NOT_IMPLEMENTED = 540
INTERNAL_ERROR = 541

REPLY_NAMES = {
    REPLY_SUCCESS: "REPLY_SUCCESS", CONTENT_TOO_LARGE: "CONTENT_TOO_LARGE", NO_ROUTE: "NO_ROUTE",
    NO_CONSUMERS: "NO_CONSUMERS", CONNECTION_FORCED: "CONNECTION_FORCED", INVALID_PATH: "INVALID_PATH",
    ACCESS_REFUSED: "ACCESS_REFUSED", NOT_FOUND: "NOT_FOUND", RESOURCE_LOCKED: "RESOURCE_LOCKED",
    PRECONDITION_FAILED: "PRECONDITION_FAILED", FRAME_ERROR: "FRAME_ERROR", SYNTAX_ERROR: "SYNTAX_ERROR",
    COMMAND_INVALID: "COMMAND_INVALID", CHANNEL_ERROR: "CHANNEL_ERROR", UNEXPECTED_FRAME: "UNEXPECTED_FRAME",
    RESOURCE_ERROR: "RESOURCE_ERROR", NOT_ALLOWED: "NOT_ALLOWED", NOT_IMPLEMENTED: "NOT_IMPLEMENTED",
    INTERNAL_ERROR: "INTERNAL_ERROR",
}

# the codes the specification defines as soft (channel) exceptions; all others close the connection
SOFT_ERROR_CODES = frozenset({CONTENT_TOO_LARGE, NO_ROUTE, NO_CONSUMERS, ACCESS_REFUSED, NOT_FOUND,
                              RESOURCE_LOCKED, PRECONDITION_FAILED})


REPLY_TEXT_MAX_BYTES = 255         # a reply text is a shortstr
BINARY_SHOWN_BYTES = 128           # enough octets to fill any reply text


def reply_text(reply_code: int, explanation: str) -> str:
    """``"NOT_FOUND - no queue 'q'"``: a reply text with the code's name in front, as RabbitMQ writes it."""
    return f"{REPLY_NAMES.get(reply_code, str(reply_code))} - {explanation}"


def clip_reply_text(text: str) -> str:
    """``text`` cut to fit a shortstr as RabbitMQ cuts it: 252 bytes and ``...``, no character split."""
    raw = text.encode("utf-8")
    if len(raw) <= REPLY_TEXT_MAX_BYTES:
        return text
    return raw[:REPLY_TEXT_MAX_BYTES - 3].decode("utf-8", "ignore") + "..."


_ERLANG_ESCAPES = {ord('"'): '\\"', ord("\\"): "\\\\", 8: "\\b", 9: "\\t", 10: "\\n", 11: "\\v", 12: "\\f",
                   13: "\\r", 27: "\\e"}


def erlang_binary(data, text: bool = True) -> str:
    """The first ``BINARY_SHOWN_BYTES`` of ``data`` as Erlang prints a binary in a reply text.

    ``text=True`` is ``~p``: ``<<"abc">>`` when every octet is printable
    ASCII, else ``<<0,50>>``; ``text=False`` is ``~w``, always numbers.
    """
    raw = bytes(data[:BINARY_SHOWN_BYTES])
    if text and raw and all(32 <= b < 127 or b in _ERLANG_ESCAPES for b in raw):
        return '<<"' + "".join(_ERLANG_ESCAPES.get(b) or chr(b) for b in raw) + '">>'
    return "<<" + ",".join(map(str, raw)) + ">>"


class AmqpError(Exception):
    """Raised when AMQP input breaks the protocol (root of this package's errors)."""

    hard = True

    def __init__(self, reply_code: int, reply_text: str, class_id: int = 0, method_id: int = 0):
        super().__init__(f"{reply_code} {reply_text}")
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.class_id = class_id
        self.method_id = method_id


class FrameError(AmqpError):
    """Raised when bytes do not form a valid frame or method (bad frame end, oversized, undecodable)."""


class ConnectionLevelError(AmqpError):
    """Raised when the peer's method or frame sequence requires closing its whole connection."""


class ChannelLevelError(AmqpError):
    """Raised when the peer's method requires closing one channel; the connection stays open."""

    hard = False


class UsageError(AmqpError):
    """Raised when the local side asks a connection for something its state forbids (a bug, not the peer)."""

    def __init__(self, message: str):
        super().__init__(INTERNAL_ERROR, reply_text(INTERNAL_ERROR, message))
