"""When a producer's messages are intended to go out: fixed or stepped rates, a count limit, no bursts.

A ``SendSchedule`` hands out intended send times (ns of ``time.monotonic_ns``);
latency is measured from them, so a publisher that falls behind shows it.

- unlimited (no rate): a message is intended when it is composed;
- a rate, or ``--variable-rate`` steps ``((rate, seconds), ...)`` taken in
  turn and repeated: message ``n`` of a step is intended at
  ``anchor + n / rate``; a rate of 0 sends nothing for the step's seconds;
- ``limit`` (``-C``): no more than this many messages sent in all;
- ``start_ns`` may lie after the run's start (a random start delay): nothing
  is due before it, unlimited or not.

No burst after a stall. When the publisher could not send for a while (a
blocked connection, TCP back-pressure, a descheduled process), the messages
intended more than ``STALL_TOLERANCE_NS`` ago are not all sent at once to
catch up: the first of them goes out with its intended time (so its latency
shows the whole stall), the others are *skipped* (counted in ``skipped``,
never sent), and the schedule starts again from now at the step's rate.
The skipped sends still count in the latency figures (``take_omitted``):
each is recorded with the time it had waited when sending resumed, the
least it would have shown had it been sent then (no coordinated omission).
Pure: times in, times out.
"""

from __future__ import annotations

import math

NS_PER_S = 1_000_000_000
STALL_TOLERANCE_NS = 100_000_000     # behind by more than this is a stall, not scheduling jitter
OMITTED_BUCKETS = 256                # a stall's skipped sends are recorded in at most this many groups


class SendSchedule:
    def __init__(self, start_ns: int, rate: float | None = None, steps: tuple = (), limit: int = 0):
        self.steps = tuple(steps) if steps else ((rate, math.inf),)
        self.limit = limit
        self.step = 0
        self.first_start_ns = start_ns
        self.step_start_ns = start_ns
        self.anchor_ns = start_ns              # message ``in_step`` of this step is intended at anchor + in_step / rate
        self.in_step = 0
        self.taken = 0
        self.skipped = 0
        self.last_at: int | None = None          # the last intended time handed out
        self.omitted: list[tuple[int, int]] = []

    def set_rate(self, now_ns: int, rate: float) -> None:
        """From ``now_ns`` on, one fixed ``rate`` (the max-rate search's next period)."""
        self.steps = ((rate, math.inf),)
        self.step = 0
        self.step_start_ns = self.anchor_ns = now_ns
        self.in_step = 0

    @property
    def unlimited(self) -> bool:
        return len(self.steps) == 1 and self.steps[0][0] is None

    def exhausted(self) -> bool:
        return bool(self.limit) and self.taken >= self.limit

    def _step_end_ns(self) -> float:
        return self.step_start_ns + self.steps[self.step][1] * NS_PER_S

    def _next_step(self) -> None:
        """On to the next step; the part of an interval the last send still owed carries over, so
        that ``rate x seconds`` that is not whole does not round up in every step."""
        end = int(self._step_end_ns())
        old_rate = self.steps[self.step][0] or 0
        owed = 0.0
        if old_rate and self.in_step and self.last_at is not None:
            owed = min(1.0, max(0.0, 1 - (end - self.last_at) * old_rate / NS_PER_S))
        self.step = (self.step + 1) % len(self.steps)
        new_rate = self.steps[self.step][0] or 0
        self.step_start_ns = end
        self.anchor_ns = end + (round(owed * NS_PER_S / new_rate) if new_rate else 0)
        self.in_step = 0

    def _intended(self) -> int | None:
        """The next message's intended time, moving on past steps it does not fit in; None: unlimited."""
        for _ in range(len(self.steps) * 2 + 1):
            rate = self.steps[self.step][0]
            if rate is None:
                return None
            if rate > 0:
                at = self.anchor_ns + round(self.in_step * NS_PER_S / rate)
                if at < self._step_end_ns():
                    return at
            self._next_step()
        return int(self.step_start_ns)        # every step is a pause shorter than a turn of this loop

    def next_due_ns(self) -> int | None:
        """When the next message is due; None when publishing is unlimited (once started) or the limit
        is reached."""
        if self.exhausted():
            return None
        if self.unlimited:
            return self.first_start_ns if not self.taken else None
        return self._intended()

    def due(self, now_ns: int, room: int) -> list[int]:
        """Intended times of the messages to send now (at most ``room``); they count as taken."""
        out: list[int] = []
        if now_ns < self.first_start_ns:
            return out                           # a random start delay not over yet
        while len(out) < room and not self.exhausted():
            at = self._intended()
            if at is None:
                n = room - len(out) if not self.limit else min(room - len(out), self.limit - self.taken)
                self.taken += n
                return out + [now_ns] * n
            if at > now_ns:
                break
            out.append(at)
            self.taken += 1
            self.in_step += 1
            self.last_at = at
            if now_ns - at > STALL_TOLERANCE_NS:
                self._skip_until(now_ns)
        return out

    def _skip_until(self, now_ns: int) -> None:
        """A stall: skip every send intended before ``now_ns`` and start again from it."""
        while self._step_end_ns() <= now_ns:
            rate = self.steps[self.step][0] or 0
            left = max(0, math.ceil((self._step_end_ns() - self.anchor_ns) * rate / NS_PER_S) - self.in_step)
            self._skipped(now_ns, rate, left)
            self._next_step()
        rate = self.steps[self.step][0] or 0
        if rate:
            before_now = math.ceil((now_ns - self.anchor_ns) * rate / NS_PER_S) - self.in_step
            self._skipped(now_ns, rate, max(0, before_now))
        self.anchor_ns = now_ns
        self.in_step = 0

    def _skipped(self, now_ns: int, rate: float, n: int) -> None:
        """``n`` sends of this step, from message ``in_step`` on, are skipped at ``now_ns``: count them,
        and keep how long each had waited (in at most ``OMITTED_BUCKETS`` groups)."""
        if n <= 0:
            return
        self.skipped += n                        # not sent, so not counted against -C
        self.last_at = None
        first = self.anchor_ns + self.in_step * NS_PER_S / rate
        per = max(1, math.ceil(n / OMITTED_BUCKETS))
        for k in range(0, n, per):
            count = min(per, n - k)
            intended = first + (k + (count - 1) / 2) * NS_PER_S / rate
            self.omitted.append((max(0, int(now_ns - intended) // 1000), count))

    def take_omitted(self) -> list[tuple[int, int]]:
        """(µs waited, sends) of the skipped sends since the last call: each had waited that long
        when the publisher could send again, the least latency it would have had."""
        out, self.omitted = self.omitted, []
        return out


class Steps:
    """``((value, seconds), ...)`` taken in turn from ``start_ns`` and repeated: the value in force at a time."""

    def __init__(self, steps: tuple, start_ns: int):
        self.steps = tuple(steps)
        self.start_ns = start_ns
        self.cycle_ns = sum(seconds for _, seconds in self.steps) * NS_PER_S

    def value_at(self, at_ns: int):
        if len(self.steps) == 1 or not math.isfinite(self.cycle_ns):
            return self.steps[0][0]
        into = max(0, at_ns - self.start_ns) % self.cycle_ns
        for value, seconds in self.steps:
            if into < seconds * NS_PER_S:
                return value
            into -= seconds * NS_PER_S
        return self.steps[-1][0]

