"""Errors of the on-disk store layer: one root, and who caused each one.

A torn or corrupt record found while *scanning* is not an error: the scan
stops there and says so (``ScanResult.clean``), because that is what a crash
leaves behind. These errors are for a record that must be whole and is not
(a read through the index), and for callers that break the rules.
"""


class StorageError(Exception):
    """Raised for any failure inside the on-disk store layer (root of its errors)."""


class TornRecord(StorageError):
    """Raised when the data ends inside a record that was required to be whole."""


class CorruptSegment(StorageError):
    """Raised when the bytes where a record should be lack a sane size, the commit marker or the expected id."""


class UnknownMessage(StorageError, KeyError):
    """Raised when a message id is read or referenced that the segment store does not hold."""


class StoreClosed(StorageError):
    """Raised when a segment store this process already closed is used again."""


class DiskFull(StorageError):
    """Raised when the file system refused a write or fsync (ENOSPC, EDQUOT). Nothing is lost: what was
    not yet durable is held in memory and written again by ``SegmentStore.retry``."""
