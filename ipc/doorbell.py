"""A doorbell: an eventfd a sender rings after committing records to a ring.

The receiver sleeps in ``select`` on it. There is no lost wake-up: the
receiver drains the eventfd *before* it looks at its rings, and the sender
rings it *after* publishing the ring's write position. Both are system calls
that take the eventfd's lock, so either the receiver's look sees the new
records, or the ring comes after the drain and wakes it again.

The fd is created without CLOEXEC: the supervisor hands it to forked stages
and passes it to peers over SCM_RIGHTS.
"""

from __future__ import annotations

import os

from ipc.errors import WouldBlock


class Doorbell:
    def __init__(self, fd: int | None = None):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK) if fd is None else fd
        os.set_blocking(self.fd, False)

    def ring(self) -> None:
        os.eventfd_write(self.fd, 1)

    def drain_nowait(self) -> int:
        try:
            return os.eventfd_read(self.fd)
        except BlockingIOError:
            raise WouldBlock("doorbell has not rung") from None

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
