"""Errors of the ipc package: one root, and who caused each one."""


class IpcError(Exception):
    """Raised for any failure inside the ipc package (root of its errors)."""


class WouldBlock(IpcError):
    """Raised when a ``_nowait`` call could only proceed by waiting."""


class PeerGone(IpcError):
    """Raised when the process at the other end of a pipe or ring went away."""


class ClosedByUs(IpcError):
    """Raised when an endpoint this process already closed is used again."""


class CorruptRecord(IpcError):
    """Raised when bytes on a pipe or ring end inside a record or do not parse."""
