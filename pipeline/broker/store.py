"""The message store: one process per broker, last in the publish chain.

Queues send it WRITE records for persistent messages too big to embed in
their own index; each costs the queue one store credit
(``msg_store_credit_disc_bound``) and the store acks that credit when it
*dequeues* the write, so credit tracks the backlog in its inbox, not the
disk. Writes go to numbered segment files and become durable as a group: the
store fsyncs at least every ``SYNC_INTERVAL_MS`` while writes are pending,
sooner when its inbox has drained and confirms wait, and tells each queue
which of its messages are on disk (ON_DISK) so their publishers can be
confirmed.

A full disk (ENOSPC) does not stop it: the segment store holds what the disk
refused, the store stops reading its rings (so credit runs out and flow
control holds the queues, their channels and readers, as for a slow disk),
reports nothing more on disk, and retries every ``DISK_FULL_RETRY_NS`` until
the writes and their fsync succeed; then the withheld confirms go out.
"""

from __future__ import annotations

import time

from pipeline.broker import wire
from pipeline.broker.channel import busy_wait_ns
from pipeline.broker.stage import READ_BATCH_RECORDS, Stage, read_batch_for
from pipeline.storage.journal import held_store_ids
from pipeline.storage.errors import DiskFull
from pipeline.storage.segments import FILE_SIZE_LIMIT_BYTES, SYNC_INTERVAL_MS, SegmentStore
from pipeline.telemetry.schema import StoreStats

COLLECT_INTERVAL_NS = 1_000_000_000     # look for garbage at most once a second after removals
DISK_FULL_RETRY_NS = 1_000_000_000      # a full disk: try the held writes again this often


class Store(Stage):
    kind = "store"

    def __init__(self, name, ctl_sock, inbox_fd, doorbell_fd, credit_spec, *, data_dir: str,
                 store_spec=None, delay_us: int = 0, fsync_interval_ms: int = SYNC_INTERVAL_MS,
                 fsync_delay_ms: int = 0, confirm_after: str = "fsync", queues_dir: str | None = None,
                 file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES):
        super().__init__(name, ctl_sock, inbox_fd, doorbell_fd, credit_spec)
        self.segments = SegmentStore(data_dir, fsync_delay_ms=fsync_delay_ms,
                                     file_size_limit_bytes=file_size_limit_bytes)
        self.adopted = self.segments.adopt(held_store_ids(queues_dir)) if queues_dir else 0
        self.segments.collect()
        self.removed_since_collect = 0
        self.last_collect_ns = 0
        self.store_spec = store_spec
        self.delay_ns = delay_us * 1000
        self.read_batch = read_batch_for(self.delay_ns)
        self.sync_interval_ns = fsync_interval_ms * 1_000_000
        self.confirm_after = confirm_after
        self.unsynced: dict[int, list[bytes]] = {}      # in-link id -> ids written since the last fsync
        self.first_unsynced_ns: int | None = None
        self.writes = 0
        self.removes = 0
        self.fsyncs = 0
        self.fsync_ns_total = 0
        self.fsync_events: list = []
        self.drained = True
        self.out_by_peer: dict[str, object] = {}
        self.disk_full_since_ns: int | None = None
        self.retry_at_ns = 0
        self.disk_full_episodes = 0

    def on_link_attached(self, link) -> None:
        if link.link_id in self.in_links and self.store_spec:
            self.credit.set_peer_spec(link.link_id, self.store_spec)
        if link.link_id in self.out_links:
            self.out_by_peer[link.peer] = link

    def on_peer_down(self, link_id: int, reason: str) -> None:
        for peer, link in list(self.out_by_peer.items()):
            if link.link_id == link_id:
                del self.out_by_peer[peer]
        self.unsynced.pop(link_id, None)     # written for a queue that is gone; its successor re-sends

    def on_record(self, link, record) -> None:
        kind = record[0]
        if kind == wire.Kind.WRITE:
            self.owe(link.link_id)
            if self.delay_ns:
                busy_wait_ns(self.delay_ns)
            msg_id, body = wire.decode_write(record)
            self.wrote_to_disk(len(body))
            try:
                self.segments.append(msg_id, body)
            except DiskFull as exc:
                self.disk_full(exc)         # held: it is written when space comes back
            self.writes += 1
            self.unsynced.setdefault(link.link_id, []).append(msg_id)
            if self.first_unsynced_ns is None:
                self.first_unsynced_ns = time.monotonic_ns()
        elif kind == wire.Kind.REMOVE:
            for msg_id in wire.decode_ids(record):
                self.segments.decref(msg_id)
                self.removes += 1
                self.removed_since_collect += 1

    def poll_links(self, now_ns: int) -> int:
        handled = super().poll_links(now_ns)
        self.drained = all(link.ring.statistics().used_bytes == 0 for link in self.in_links.values())
        return handled

    def wants_records(self, link) -> bool:
        return self.disk_full_since_ns is None

    def disk_full(self, exc: Exception) -> None:
        if self.disk_full_since_ns is None:
            self.disk_full_since_ns = time.monotonic_ns()
            self.retry_at_ns = self.disk_full_since_ns + DISK_FULL_RETRY_NS
            self.disk_full_episodes += 1
            self.log_lines([f"{self.name}: disk full ({exc}): writes held in memory, confirms withheld, not "
                            f"reading until a retry (every {DISK_FULL_RETRY_NS // 1_000_000} ms) succeeds"])

    def retry(self, now_ns: int) -> None:
        try:
            result = self.segments.retry()
        except DiskFull:
            self.retry_at_ns = now_ns + DISK_FULL_RETRY_NS
            return
        self.log_lines([f"{self.name}: disk space is back: the held writes are on disk after "
                        f"{(now_ns - self.disk_full_since_ns) / 1e9:.1f} s; reading again"])
        self.disk_full_since_ns = None
        self.fsyncs += 1
        self.fsync_ns_total += result.duration_ns
        self.first_unsynced_ns = None
        self.report_on_disk()
        self.backlog = True

    def after_io(self, now_ns: int) -> None:
        if self.disk_full_since_ns is not None:
            if now_ns >= self.retry_at_ns:
                self.retry(now_ns)
            return
        if self.removed_since_collect and now_ns - self.last_collect_ns >= COLLECT_INTERVAL_NS:
            self.segments.collect()
            self.removed_since_collect = 0
            self.last_collect_ns = now_ns
        if self.first_unsynced_ns is None:
            return
        if self.confirm_after == "write":
            self.report_on_disk()
            self.flush_links()          # these confirms do not wait for the fsync below
        due = now_ns - self.first_unsynced_ns >= self.sync_interval_ns
        if due or self.drained:
            self.sync(now_ns)

    def sync(self, now_ns: int) -> None:
        try:
            result = self.segments.sync()
        except DiskFull as exc:
            self.disk_full(exc)
            return
        self.fsyncs += 1
        self.fsync_ns_total += result.duration_ns
        self.fsync_events.append((now_ns, result.duration_ns))
        self.first_unsynced_ns = None
        self.report_on_disk()

    def report_on_disk(self) -> None:
        for link_id, ids in self.unsynced.items():
            inp = self.in_links.get(link_id)
            out = self.out_by_peer.get(inp.peer) if inp is not None else None
            if out is not None and ids:
                out.put(wire.encode_ids(wire.Kind.ON_DISK, ids))
        self.unsynced = {}

    def timeout_s(self, now_ns: int) -> float | None:
        if self.disk_full_since_ns is not None:
            return max(0.0, (self.retry_at_ns - now_ns) / 1e9)
        if self.first_unsynced_ns is None:
            return 1.0 if self.removed_since_collect else None
        return max(0.0, (self.first_unsynced_ns + self.sync_interval_ns - now_ns) / 1e9)

    def shutdown(self) -> None:
        if self.disk_full_since_ns is not None:
            self.retry(time.monotonic_ns())
        if self.disk_full_since_ns is not None:
            self.log_lines([f"{self.name}: stopping with {self.segments.held()} writes the full disk refused; "
                            "their publishers were never confirmed"])
        elif self.first_unsynced_ns is not None:
            self.sync(time.monotonic_ns())
            self.flush_links()
        self.segments.collect()
        self.segments.close()
        super().shutdown()

    def statistics(self, now_ns: int) -> StoreStats:
        """The snapshot; the fsyncs since the last one travel with it (``fsync_events``) and are forgotten."""
        events, self.fsync_events = self.fsync_events, []
        return StoreStats(
            **self.stage_fields(now_ns), writes=self.writes, removes=self.removes, fsyncs=self.fsyncs,
            adopted=self.adopted, disk_full=self.disk_full_since_ns is not None,
            disk_full_episodes=self.disk_full_episodes, held_writes=self.segments.held(),
            fsync_ms_total=self.fsync_ns_total / 1e6, segments=self.segments.statistics(),
            fsync_events=tuple(events))


__all__ = ["Store", "READ_BATCH_RECORDS"]
