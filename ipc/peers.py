"""A peer's inbox pipe and doorbell, held once per process however many links share them.

Every link brings the descriptors of its peer's endpoints: an out-link the
receiver's inbox pipe (tokens travel on inbox pipes) and doorbell, an in-link
the sender's inbox pipe. A queue host with four queues linked to the same
channel and to its connection's reader was given twenty descriptors for what
four (two pipes, two doorbells) can do. Under a limit of 256 it ran out of
them and a queue crashed: the supervisor's file descriptor alarm stops new
connections, not the links open ones make.

``PeerEndpoints.take`` keeps the first pair it is given for a pipe and closes
the duplicates; ``give_back`` closes them once no link uses them. A pipe is
known by its inode, which stays its own while a descriptor of it is open here:
a peer that ends and a new one given its name have different pipes.
"""

from __future__ import annotations

import os

from ipc.doorbell import Doorbell
from ipc.tokens import TokenWriter


class PeerEndpoints:
    def __init__(self):
        self._held: dict[tuple[int, int], list] = {}     # pipe -> [writer, doorbell or None, links]

    def take(self, inbox_fd: int, doorbell_fd: int | None = None) -> tuple[tuple[int, int], TokenWriter,
                                                                             Doorbell | None]:
        """The writer (and doorbell) for the peer whose inbox pipe ``inbox_fd`` writes to, and the key
        to give them back with. Owns the descriptors given: duplicates of held ones are closed."""
        st = os.fstat(inbox_fd)
        key = (st.st_dev, st.st_ino)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [TokenWriter(inbox_fd), None, 0]
        else:
            os.close(inbox_fd)
        if doorbell_fd is not None:
            if held[1] is None:
                held[1] = Doorbell(doorbell_fd)
            else:
                os.close(doorbell_fd)
        held[2] += 1
        return key, held[0], held[1]

    def give_back(self, key: tuple[int, int]) -> None:
        """One link less uses the peer's endpoints: the last one closes them."""
        held = self._held.get(key)
        if held is None:
            return
        held[2] -= 1
        if held[2] > 0:
            return
        del self._held[key]
        writer, doorbell, _ = held
        try:
            os.close(writer.fd)
        except OSError:
            pass
        writer.fd = -1
        if doorbell is not None:
            doorbell.close()

    def __len__(self) -> int:
        return len(self._held)


ENDPOINTS = PeerEndpoints()         # this process's
