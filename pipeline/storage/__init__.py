"""On-disk layer of the durable message store.

- ``record``: the record format (size, id, body, commit marker) and its
  scanner; pure, no I/O.
- ``segments``: the shared store's numbered ``N.rdq`` files: buffered
  appends, the timed fsync policy, roll-over, refcounts, compaction and
  recovery, and ``read_bodies`` for a queue recovering before the store runs.
  The store process drives it.
- ``journal``: a durable queue's ``N.jnl`` files: its persistent messages
  and their acks, group-committed by the queue, recovered in order.
- ``errors``: what can go wrong, and who caused it.

The fsync policy's constants (RabbitMQ's defaults)::

    SYNC_INTERVAL_MS = 200                      group commit at least this often while writes are pending
    FILE_SIZE_LIMIT_BYTES = 16 * 1024 * 1024    a segment file rolls over once it reaches this
    LARGE_MESSAGE_BYTES = 4_000_000             a message this big gets a file of its own
"""

from pipeline.storage.errors import CorruptSegment, StorageError, StoreClosed, TornRecord, UnknownMessage
from pipeline.storage.record import ScanRecord, ScanResult, decode_record, encode_record, scan
from pipeline.storage.segments import (FILE_SIZE_LIMIT_BYTES, LARGE_MESSAGE_BYTES, SYNC_INTERVAL_MS, Location,
                                       SegmentStatistics, SegmentStore, SyncResult)

__all__ = [
    "CorruptSegment", "StorageError", "StoreClosed", "TornRecord", "UnknownMessage",
    "ScanRecord", "ScanResult", "decode_record", "encode_record", "scan",
    "FILE_SIZE_LIMIT_BYTES", "LARGE_MESSAGE_BYTES", "SYNC_INTERVAL_MS", "Location", "SegmentStatistics",
    "SegmentStore", "SyncResult",
]
