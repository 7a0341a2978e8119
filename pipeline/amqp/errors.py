"""AMQP errors: each carries the reply code and text the peer will see.

A *connection* error (hard) closes the whole connection with
``connection.close``; a *channel* error (soft) closes one channel with
``channel.close`` and the connection carries on. Either way only the
connection that sent the bad input is affected. ``class_id``/``method_id``
name the method that failed (0/0 when no method was involved, e.g. a bad
frame). Reply texts follow RabbitMQ: ``"NAME - explanation"``.

Which code RabbitMQ (``rabbit_reader``, ``rabbit_command_assembler``,
``rabbit_channel``) uses for what::

    wrong protocol header        none: it writes a protocol header of its own and closes
                                 (here always AMQP 0-9-1's)
    bad frame-end octet          501 FRAME_ERROR, then stops reading (out of sync)
    frame over frame_max         501 FRAME_ERROR, then stops reading (out of sync)
    unknown frame type           501 FRAME_ERROR (unknown_frame)
    method args undecodable      501 FRAME_ERROR ("cannot decode")
    content frames out of order  505 UNEXPECTED_FRAME
    body frame over body size    501 FRAME_ERROR
    heartbeat on a channel       505 UNEXPECTED_FRAME
    method on an unopened chan.  504 CHANNEL_ERROR "expected 'channel.open'"
    content on an unopened chan. 505 UNEXPECTED_FRAME "expected method frame"
    second channel.open          504 CHANNEL_ERROR
    wrong method in conn. state  504 CHANNEL_ERROR "unexpected method in connection state"
    server-only method sent      503 COMMAND_INVALID "unimplemented method"
    channel over channel_max     530 NOT_ALLOWED
    tune-ok over server limits   530 NOT_ALLOWED
    unknown vhost                530 NOT_ALLOWED
    bad credentials              403 ACCESS_REFUSED (only to clients with the
                                 authentication_failure_close capability;
                                 others are just disconnected)
    malformed PLAIN response     502 SYNTAX_ERROR
    message over max size        406 PRECONDITION_FAILED, channel-level
    publish with immediate=true  540 NOT_IMPLEMENTED

Two departures, both so the client learns why it is being closed: for an
unknown class or method id RabbitMQ's reader exits without a reply, where this
project answers 540 NOT_IMPLEMENTED; and before tune-ok RabbitMQ drops most
offenders silently after a pause, where this project sends connection.close
in every state (a refused login still follows the capability, as above).
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


def reply_text(reply_code: int, explanation: str) -> str:
    """``"NOT_FOUND - no queue 'q'"``: a reply text with the code's name in front, as RabbitMQ writes it."""
    return f"{REPLY_NAMES.get(reply_code, str(reply_code))} - {explanation}"


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
