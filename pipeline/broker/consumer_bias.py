"""Consumer bias: a queue that cannot hand messages on as fast as they come takes publishes no faster
than it delivers them, until its backlog is gone.

RabbitMQ's queue process (since 3.3) watches how fast it delivers against how fast it accepts. While it
works flat out and delivers less than 1.1 times what it accepts, it lets what helps it shrink (a
consumer's channel ready for more, an ack) overtake publishes in its mailbox; a queue short of CPU then
tends to get smaller instead of growing for ever, and publishers wait on credit meanwhile.

Here a queue's deliveries end in its consumers' readers, other processes: the pipeline cannot keep up
when a consumer's ring is full while messages are ready and that reader is not held up by its client
(a reader whose socket does not take its output is the client's doing, and then the queue takes every
publish, as RabbitMQ's does for a consumer blocked by network congestion). While that lasts, each
publish taken spends an allowance that deliveries earn, ``RATIO`` deliveries for one publish, so the
backlog shrinks by at least a tenth of what is delivered and the publishers' credit waits on the
deliveries. The allowance is a debt counter: a batch read in one go may take it below zero, and the
deliveries that follow pay it back.
"""

from __future__ import annotations

RATIO = 1.1                 # deliveries per publish taken while biased (RabbitMQ's CONSUMER_BIAS_RATIO)
MAX_ALLOWANCE = 256         # publishes that deliveries may bank ahead while biased (one read batch)


class ConsumerBias:
    """Whether a queue may take more publishes now, from its totals of publishes taken and deliveries."""

    __slots__ = ("active", "allowance", "_taken", "_delivered", "engaged")

    def __init__(self) -> None:
        self.active = False
        self.allowance = 0.0
        self._taken = 0
        self._delivered = 0
        self.engaged = 0            # times the bias has come on (for statistics)

    def assess(self, taken: int, delivered: int, ready: int, starved: bool) -> None:
        """After a delivery round: ``taken`` and ``delivered`` are the queue's running totals, ``ready``
        what waits for a consumer, ``starved`` whether a consumer that is not held up by its client had
        no room left for what is ready."""
        new_taken, self._taken = taken - self._taken, taken
        new_delivered, self._delivered = delivered - self._delivered, delivered
        if self.active:
            self.allowance = min(MAX_ALLOWANCE, self.allowance + new_delivered / RATIO - new_taken)
        on = ready > 0 and starved
        if on and not self.active:
            self.allowance = 0.0
            self.engaged += 1
        self.active = on

    def may_take(self) -> bool:
        """Whether to read another batch of publishes now."""
        return not self.active or self.allowance > 0
