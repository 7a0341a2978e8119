"""Python's cyclic garbage collector in the broker's processes: what survived a full collection is frozen.

A queue with a deep backlog holds a Python object or two per message, and the
collector's full collections walk every one of them. Python starts one each
time the objects that lived through the younger collections grow by a quarter
of those that lived through the last full one, so a backlog growing to 707,000
messages brought 21 full collections over 14 s, each over the whole backlog:
3.1 s of the queue process's time (about a quarter of it), which the queue
then did not spend delivering.

Here, once a full collection has finished, everything it left is frozen
(``gc.freeze``): the next full collections walk only what came after, so each
object is walked about once in a full collection instead of once per
collection. A frozen object is still freed as soon as nothing refers to it (a
delivered message is); what freezing puts off is collecting *cycles* among
frozen objects (a closed connection's stage and its selector keys). So every
``THAW_EVERY_NS`` everything is thawed, and the next full collection walks it
all once, finds those cycles, and freezes what is left.

The young generation is collected every ``YOUNG_THRESHOLD`` net allocations
rather than Python's 700. A message a queue holds (its ``Message``, its
``Held``) lives a few milliseconds, from publish to ack; at 700 it was walked
by several young collections and promoted on the way. With 100 publishers to
one queue that took 58 ms a second of the queue process's time (15 in
generation 0, 19 in 1, 24 in 2), against 17 with one publisher; at 50,000,
under 5. What waits longer is cyclic garbage, at most that many objects.

:class:`Collector` decides, with time passed in; :func:`install` hooks it to
the ``gc`` module and returns the function a process's loop calls each round.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

THAW_EVERY_NS = 60 * 1_000_000_000
YOUNG_THRESHOLD = 50_000            # net allocations of tracked objects between young collections
FULL = 2                            # the generation a full collection collects


class Collector:
    """When to freeze and when to thaw; :meth:`step` says which, at most one a call."""

    def __init__(self, now_ns: int, thaw_every_ns: int = THAW_EVERY_NS):
        self.thaw_every_ns = thaw_every_ns
        self.next_thaw_ns = now_ns + thaw_every_ns
        self.full_done = False

    def collected(self, generation: int) -> None:
        """A collection of ``generation`` has just finished."""
        if generation == FULL:
            self.full_done = True

    def step(self, now_ns: int) -> str | None:
        """``"freeze"``, ``"thaw"`` or None (a thaw with nothing frozen costs nothing)."""
        if self.full_done:
            self.full_done = False
            return "freeze"
        if now_ns >= self.next_thaw_ns:
            self.next_thaw_ns = now_ns + self.thaw_every_ns
            return "thaw"
        return None


def install(thaw_every_ns: int = THAW_EVERY_NS) -> Callable[[int], None]:
    """Hook a :class:`Collector` to ``gc``; call what this returns once a loop round with the clock."""
    collector = Collector(time.monotonic_ns(), thaw_every_ns)
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])

    def on_gc(phase: str, info: dict) -> None:
        if phase == "stop":
            collector.collected(info["generation"])

    gc.callbacks.append(on_gc)

    def step(now_ns: int) -> None:
        if not collector.full_done and now_ns < collector.next_thaw_ns:
            return                  # the common case, without a call
        action = collector.step(now_ns)     # (gc.get_freeze_count walks the frozen list: not asked)
        if action == "freeze":
            gc.freeze()
        elif action == "thaw":
            gc.unfreeze()

    return step
