"""The maximum sustainable publish rate, searched for as OpenMessaging Benchmark does.

Every ``PERIOD_S`` seconds of a run (``creditflow run --max-rate``) the
``RateSearch`` looks at the period's two backlogs and sets the publishers'
total rate for the next one (OMB's ``RateController``):

- **receive backlog**, published but not yet received (over the whole run):
  above ``BACKLOG_LIMIT`` the consumers (or the broker) cannot keep up;
- **publish backlog**, intended in the period but not sent: above
  ``BACKLOG_LIMIT`` the publishers (or the broker's credit flow and TCP
  back-pressure holding them) cannot keep up.

Either one: the ramp factor halves and the rate falls to what went
through in the period (for a receive backlog, less what it takes to work
the excess off within a period, but to no less than half). Neither: the ramp factor doubles (at most 1) and the rate
rises by it. The answer is the highest rate the publishers were asked for
in a period that ended with both backlogs within the limit and with what
was intended sent and received: sustained, not only reached. Pure: counts in,
rates out.
"""

from __future__ import annotations

from dataclasses import dataclass

PERIOD_S = 2
BACKLOG_LIMIT = 1000
INITIAL_RATE = 10_000
MIN_RAMP = 0.01
MAX_RAMP = 1.0
MIN_RATE = 1.0


@dataclass(frozen=True)
class Period:
    rate: float                   # msg/s asked for, all publishers
    sent_rate: float
    received_rate: float          # messages (not copies) a second
    receive_backlog: int
    publish_backlog: int
    sustained: bool


class RateSearch:
    def __init__(self, initial_rate: float = INITIAL_RATE, copies: int = 1):
        self.rate = float(initial_rate)
        self.ramp = MAX_RAMP
        self.copies = max(1, copies)
        self.period_s = PERIOD_S
        self.periods: list[Period] = []
        self._published = 0
        self._received = 0
        self._elapsed_s = 0.0

    def observe(self, elapsed_s: float, published: int, delivered: int) -> float | None:
        """Cumulative counts at ``elapsed_s`` into the run; the new total rate when a period ended."""
        period_s = elapsed_s - self._elapsed_s
        if period_s < PERIOD_S - 0.05:
            return None
        received = delivered // self.copies
        sent, got = published - self._published, received - self._received
        expected = self.rate * period_s
        receive_backlog = max(0, published - received)
        publish_backlog = max(0, round(expected - sent))
        self._published, self._received, self._elapsed_s = published, received, elapsed_s
        if receive_backlog > BACKLOG_LIMIT:
            sustained = False
            self.ramp = max(MIN_RAMP, self.ramp / 2)
            excess = receive_backlog - BACKLOG_LIMIT
            next_rate = max(got / 2, got - excess) / period_s
        elif publish_backlog > BACKLOG_LIMIT:
            sustained = False
            self.ramp = max(MIN_RAMP, self.ramp / 2)
            next_rate = sent / period_s
        else:
            sustained = True
            self.ramp = min(MAX_RAMP, self.ramp * 2)
            next_rate = self.rate * (1 + self.ramp)
        self.periods.append(Period(self.rate, sent / period_s, got / period_s, receive_backlog, publish_backlog,
                                   sustained))
        self.rate = max(MIN_RATE, next_rate)
        return self.rate

    @property
    def found(self) -> float | None:
        """The highest rate sustained for a whole period (None before any was)."""
        held = [p.rate for p in self.periods if p.sustained]
        return max(held) if held else None
