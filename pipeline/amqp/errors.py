"""AMQP errors: each carries the reply code and text the peer will see.

A *connection* error (hard) closes the whole connection with
``connection.close``; a *channel* error (soft) closes one channel with
``channel.close``. Only the connection that sent the bad input is affected.
"""

from __future__ import annotations

CONNECTION_FORCED = 320
ACCESS_REFUSED = 403
NOT_FOUND = 404
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
    """Raised when bytes do not form a valid frame (bad frame end, oversized, unknown type)."""


class ConnectionLevelError(AmqpError):
    """Raised when a client's method or frame sequence requires closing its connection."""


class ChannelLevelError(AmqpError):
    """Raised when a client's method requires closing one channel; the connection stays open."""

    hard = False
