"""One channel's ``basic.qos global=true``, sans-IO: RabbitMQ's ``rabbit_limiter`` as permits.

In RabbitMQ each queue asks the channel's limiter process ``can_send`` before
every delivery to one of the channel's consumers; the limiter counts the
channel's unacknowledged deliveries (its *volume*) against the prefetch count
and remembers the queues it turned away, to wake them when an ack brings the
volume under the limit. Here the queues are other processes a ring away, so
a call per delivery becomes a grant of *permits*: a queue with consumers on
the channel and ready messages asks for as many permits as it has messages
(``want``), spends one per delivery that needs an ack, and gives back what it
could not use. The reader, which sees every delivery and every ack of the
channel, keeps one :class:`ChannelLimit` per channel and never grants more
than ``limit - unacked - permits out``, so the channel's deliveries from all
its queues together stay within the limit, as RabbitMQ's do::

    queue ──want(n)──▶ limiter ──grant(k ≤ free)──▶ queue ──deliver (uses one)──▶ reader
       ▲                  │ nothing free: the queue waits, in order            │
       └──give back───────┘◀──────────────── ack / nack / reject ──────────────┘

Queues are served in the order they asked, each at most what it wanted.
Every method returns the grants to send: a list of ``(queue, count)``.
``unacked`` is always the caller's count of the channel's consumer deliveries
not yet settled (``basic.get`` ones do not count, as RabbitMQ's limiter).
"""

from __future__ import annotations

from typing import Hashable

Grants = list[tuple[Hashable, int]]


class ChannelLimit:
    """The permits a channel under ``basic.qos global=true`` has handed to its queues."""

    def __init__(self) -> None:
        self.limit = 0                               # 0: no channel-wide limit
        self.out: dict[Hashable, int] = {}           # queue -> permits granted, not yet used or given back
        self.waiting: dict[Hashable, int] = {}       # queue -> permits wanted, in the order asked

    @property
    def active(self) -> bool:
        return self.limit > 0

    def set_limit(self, count: int, unacked: int) -> Grants:
        """``basic.qos global=true prefetch_count=count``; 0 lifts the limit and forgets every permit
        (the queues hear ``count`` from the channel and stop asking)."""
        self.limit = count
        if not count:
            self.out.clear()
            self.waiting.clear()
            return []
        return self._serve(unacked)

    def want(self, queue: Hashable, count: int, unacked: int) -> Grants:
        if not self.limit:
            return []
        self.waiting.pop(queue, None)
        self.waiting[queue] = max(1, count)
        return self._serve(unacked)

    def used(self, queue: Hashable) -> None:
        """A delivery needing an ack came from ``queue``: one of its permits became an unacked delivery."""
        n = self.out.get(queue)
        if n:
            if n == 1:
                del self.out[queue]
            else:
                self.out[queue] = n - 1

    def give_back(self, queue: Hashable, count: int, unacked: int) -> Grants:
        n = self.out.pop(queue, 0) - count
        if n > 0:
            self.out[queue] = n
        return self._serve(unacked)

    def settled(self, unacked: int) -> Grants:
        """Deliveries were acked, nacked or rejected: serve the queues waiting, if any."""
        return self._serve(unacked) if self.waiting else []

    def forget(self, queue: Hashable, unacked: int) -> Grants:
        """``queue`` is gone (its link ended): its permits and its request with it."""
        self.out.pop(queue, None)
        self.waiting.pop(queue, None)
        return self._serve(unacked)

    def free(self, unacked: int) -> int:
        return self.limit - unacked - sum(self.out.values())

    def _serve(self, unacked: int) -> Grants:
        grants: Grants = []
        if not self.waiting:
            return grants
        free = self.free(unacked)
        while free > 0 and self.waiting:
            queue = next(iter(self.waiting))
            n = min(free, self.waiting.pop(queue))
            self.out[queue] = self.out.get(queue, 0) + n
            free -= n
            grants.append((queue, n))
        return grants
