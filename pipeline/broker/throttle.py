"""When a connection stops reading its socket, and what it reports (pure).

A reader may be held back for three reasons: ``flow`` (its credit towards a
channel ran out), ``memory`` and ``disk`` (resource alarms). Following
RabbitMQ's reader, only a connection that *publishes* is blocked: a reason
alone moves nothing; the first content frame read while a reason holds sets
``should_block`` and the connection goes ``blocked`` and stops reading. When
the last reason clears it goes back to ``running`` and reads again.

Reported states (``reported_state``)::

    internal   reasons             reported
    running    {}                  running
    running    alarm(s)            blocking     (will block on its next publish)
    running    {flow}              flow
    blocked    {flow}              flow
    blocked    alarm(s)[+flow]     blocked
    closing    any                 closing

``connection.blocked`` is due once, when the connection becomes blocked while
an alarm holds (flow is never told to the client); ``connection.unblocked``
once, when no alarm remains after ``connection.blocked`` was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOW = "flow"
MEMORY = "memory"
DISK = "disk"
ALARM_REASONS = (MEMORY, DISK)

RUNNING = "running"
BLOCKED = "blocked"
CLOSING = "closing"

# (internal state, event) -> next internal state; missing pairs are illegal.
_TRANSITIONS = {
    (RUNNING, "block"): BLOCKED,
    (BLOCKED, "unblock"): RUNNING,
    (RUNNING, "close"): CLOSING,
    (BLOCKED, "close"): CLOSING,
    (CLOSING, "close"): CLOSING,
}


class IllegalTransition(RuntimeError):
    """Raised when the throttle is asked for a transition its table does not have."""


@dataclass(frozen=True)
class Notice:
    """A frame the reader must send: ``connection.blocked`` (with reason) or ``connection.unblocked``."""

    blocked: bool
    reason: str = ""


def blocked_reason(reasons) -> str:
    """RabbitMQ's reason text: "low on memory", "low on disk", "low on memory & disk"."""
    return "low on " + " & ".join(r for r in ALARM_REASONS if r in reasons)


class Throttle:
    def __init__(self) -> None:
        self.state = RUNNING
        self.reasons: set[str] = set()
        self.should_block = False
        self.blocked_notice_sent = False

    def _go(self, event: str) -> None:
        nxt = _TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise IllegalTransition(f"no transition from {self.state!r} on {event!r}")
        self.state = nxt

    @property
    def reading(self) -> bool:
        """True while the reader may read and parse client bytes."""
        return self.state == RUNNING

    def set_reason(self, reason: str, on: bool) -> list[Notice]:
        if on:
            self.reasons.add(reason)
        else:
            self.reasons.discard(reason)
        return self._control()

    def publish_received(self) -> list[Notice]:
        """A content-bearing method was read (RabbitMQ's ``publish_received``)."""
        if self.reasons and self.state != CLOSING:
            self.should_block = True
        return self._control()

    def close(self) -> None:
        self._go("close")

    def _control(self) -> list[Notice]:
        notices: list[Notice] = []
        alarms = self.reasons.intersection(ALARM_REASONS)
        if self.state == BLOCKED and not (self.should_block and self.reasons):
            self._go("unblock")
            self.should_block = False
        elif self.state == RUNNING and self.should_block and self.reasons:
            self._go("block")
        if self.state == BLOCKED and alarms and not self.blocked_notice_sent:
            self.blocked_notice_sent = True
            notices.append(Notice(True, blocked_reason(alarms)))
        elif self.blocked_notice_sent and not alarms:
            self.blocked_notice_sent = False
            notices.append(Notice(False))
        return notices

    def reported_state(self) -> str:
        if self.state == CLOSING:
            return CLOSING
        alarms = self.reasons.intersection(ALARM_REASONS)
        if self.state == BLOCKED:
            return BLOCKED if alarms else FLOW
        if alarms:
            return "blocking"
        return FLOW if FLOW in self.reasons else RUNNING
