"""A doorbell: the eventfd a sender rings after committing records to a ring.

Theory of operation
-------------------
Every stage owns one doorbell for all its inbound rings and sleeps in
``select``/``poll`` on it (with its inbox pipe and control socket), so an
idle stage uses no CPU. A sender rings the receiver's doorbell after
``Ring.commit``; the eventfd counter adds up the rings until the receiver
drains it, so many rings cost the receiver one wake-up.

No lost wake-up. The receiver's loop is: drain the doorbell, read every
inbound ring until empty, sleep on the doorbell. The sender's is: store the
records and ``write_pos`` (commit), then ring. Suppose the receiver's ring
reads missed a commit. The sender rang after that commit, so:

* if the ring came after the receiver's drain, the counter is non-zero when
  the receiver goes to sleep and ``poll`` returns at once;
* if it came before the drain, then commit -> ring -> drain -> read ring is
  a chain of happens-before: both eventfd calls are system calls that take
  the eventfd's lock (a full barrier), and each side's ring-header access
  is ordered with its own system call, so the receiver's read after the
  drain sees the new ``write_pos``, a contradiction.

Either way the receiver handles the records. Draining before reading is
what matters: a receiver that reads first and drains after could swallow the
ring of a commit it never saw.

Descriptors. The eventfd is made non-blocking and close-on-exec. Close-on-
exec does not stop inheritance by ``fork`` (a forked stage keeps every fd
its supervisor had, and picks the ones it needs), nor passing it over a unix
socket (SCM_RIGHTS); it only keeps the fd out of programs started with
``exec``, which must never hold a stage's doorbell.
"""

from __future__ import annotations

import math
import os
import select
from dataclasses import dataclass

from ipc.errors import ClosedByUs, WouldBlock


@dataclass(frozen=True)
class DoorbellStatistics:
    rings: int       # times this object rang
    drains: int      # drains that found the bell rung
    wakeups: int     # rings those drains collected (any sender's)


class Doorbell:
    """An eventfd used as a doorbell; wraps ``fd`` if given (taking ownership), else creates one."""

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            os.set_blocking(fd, False)
        self.fd = fd
        self._rings = self._drains = self._wakeups = 0

    def ring(self) -> None:
        """Add one to the counter, waking whoever sleeps on the doorbell."""
        if self.fd < 0:
            raise ClosedByUs("doorbell rung after close()")
        try:
            os.eventfd_write(self.fd, 1)
        except BlockingIOError:
            pass  # the counter is at its maximum: the bell is rung already
        self._rings += 1

    def drain_nowait(self) -> int:
        """Reset the counter and return how many rings it held; ``WouldBlock`` if none."""
        if self.fd < 0:
            raise ClosedByUs("doorbell drained after close()")
        try:
            count = os.eventfd_read(self.fd)
        except BlockingIOError:
            raise WouldBlock("doorbell has not rung") from None
        self._drains += 1
        self._wakeups += count
        return count

    def wait_rung(self, timeout_s: float | None = None) -> int:
        """Sleep until the bell is rung (or ``timeout_s`` passes), then drain it.

        Returns the rings collected; raises ``WouldBlock`` on timeout.
        """
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        poller.poll(None if timeout_s is None else max(0, math.ceil(timeout_s * 1000)))
        return self.drain_nowait()

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        """Close the eventfd (idempotent)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def statistics(self) -> DoorbellStatistics:
        return DoorbellStatistics(rings=self._rings, drains=self._drains, wakeups=self._wakeups)
