"""The queue: one process per AMQP queue.

It acks a publish's credit on receipt (before enqueueing), then runs
``deliver_or_enqueue``: straight to a consumer with prefetch room, else onto
its backlog. Deliveries go to the consumer's reader over a ring that carries
no credit; they are bounded by prefetch and by that ring's space. Persistent
messages of ``QUEUE_INDEX_EMBED_MSGS_BELOW`` bytes or more in a durable queue
are also written to the message store, spending store credit
(``msg_store_credit_disc_bound``); while the store holds the queue blocked it
keeps accepting deliveries but defers its grants to channels.

Confirms go back to the publishing channel: at once for transient messages or
any message to a non-durable queue, after the store reports the message on
disk for those it wrote.
"""

from __future__ import annotations

import collections
import hashlib
import os
import struct
import time

from pamqp import commands

from pipeline import wire
from pipeline.amqp import frames
from pipeline.journal import QueueJournal, read_store_bodies
from pipeline.channel import busy_wait_ns
from pipeline.stage import Stage, read_batch_for

QUEUE_INDEX_EMBED_MSGS_BELOW = 4096
SYNC_INTERVAL_MS = 200
PAGE_BATCH_MESSAGES = 2048        # messages and pending acks paged out per round
PAGE_ROUND_INTERVAL_NS = 50_000_000


class Paged:
    """A message record that was paged out: where it lies in the queue's page file."""

    __slots__ = ("offset", "length")

    def __init__(self, offset: int, length: int):
        self.offset, self.length = offset, length


class PageFile:
    """Records paged out of RAM, appended and read back by position; emptied when nothing is paged."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1
        self.end = 0
        self.count = 0

    def write(self, record) -> Paged:
        if self.fd < 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(self.fd, record, self.end)
        ref = Paged(self.end, len(record))
        self.end += len(record)
        self.count += 1
        return ref

    def read(self, ref: Paged) -> bytes:
        return os.pread(self.fd, ref.length, ref.offset)

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            os.ftruncate(self.fd, 0)
            self.end = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
DELIVERY_HEAD_BYTES = 32           # a DELIVER record's head and the ring's length word, give or take
MSG_ID_INCARNATION_SHIFT = 40      # each restart of a queue numbers its messages from incarnation << 40
DELIVERY_WINDOW = 1000            # deliveries in flight to one consumer's reader, whatever the prefetch
TRIM_MIN_PEAK_MESSAGES = 1000        # a backlog smaller than this is not worth a trim
TRIM_AFTER_FALL_FRACTION = 1 / 16    # trim each time the backlog has fallen by this much since the last trim,
TRIM_MIN_INTERVAL_NS = 100_000_000   # but not more often: a trim costs ~0.1 ms per MiB it returns

class Consumer:
    __slots__ = ("ctag", "ctag_bytes", "channel", "reader", "via", "link", "no_ack", "prefetch", "unacked")

    def __init__(self, ctag: str, channel: int, reader: str, link, no_ack: bool, prefetch: int, via: str = ""):
        self.ctag = ctag
        self.ctag_bytes = ctag.encode()
        self.channel = channel
        self.reader = reader
        self.via = via             # the channel process it consumes through (its acks come from there)
        self.link = link
        self.no_ack = no_ack
        self.prefetch = prefetch
        self.unacked = 0


class Queue(Stage):
    kind = "queue"

    def __init__(self, name, ctl_sock, inbox_fd, doorbell_fd, credit_spec, *, queue: str, durable: bool,
                 exclusive: bool = False, auto_delete: bool = False, store_spec=None, delay_us: int = 0,
                 frame_max: int = 131072, run_id: str = "", journal_dir: str | None = None,
                 store_dir: str | None = None, page_path: str | None = None, incarnation: int = 0):
        super().__init__(name, ctl_sock, inbox_fd, doorbell_fd, credit_spec)
        self.queue = queue
        self.queue_bytes = queue.encode()
        self.durable = durable
        self.exclusive = exclusive
        self.auto_delete = auto_delete
        self.store_spec = store_spec
        self.delay_ns = delay_us * 1000
        self.read_batch = read_batch_for(self.delay_ns)
        self.frame_max = frame_max
        self.run_id = run_id
        self.id_prefixes: dict[str, bytes] = {}     # publishing channel -> 8-byte prefix of store ids
        self.next_id = 1
        self.messages: collections.deque = collections.deque()   # (msg_id, record, redelivered)
        self.unacked: dict[int, tuple] = {}                       # msg_id -> (record, consumer or (reader, channel), on_store)
        self.consumers: list[Consumer] = []
        self.rr = 0
        self.window_full = False
        self.reader_links: dict[str, object] = {}
        self.peer_out: dict[str, object] = {}                     # peer name -> out link
        self.store_out = None
        self.store_in = None
        self.confirms: dict[object, list[int]] = {}
        self.peak_messages = 0
        self.paging = False
        self.pages = PageFile(page_path) if page_path else None
        self.paged_messages = 0
        self.paged_acks = 0
        self.paged_out = 0
        self.paged_in = 0
        self.last_page_round_ns = 0
        self.page_sizes = (0, 0)
        self.waiting: dict[int, list] = {}        # msg_id -> [out link, seq, journal synced?, store on disk?]
        self.by_store_id: dict[bytes, int] = {}
        self.unwritten: dict[bytes, bytes] = {}   # store id -> WRITE record the store has not reported on disk
        self.store_lost = False                   # the store died: re-send ``unwritten`` to its successor
        self.store_resent = 0
        self.journal = QueueJournal(journal_dir) if durable and journal_dir else None
        self.journal_first_unsynced_ns: int | None = None
        self.journal_acks: list[int] = []
        self.journal_fsyncs = 0
        self.recovered = 0
        self.enqueued = 0
        self.delivered = 0
        self.acked = 0
        self.stored = 0
        if self.journal is not None:
            self.recover(store_dir)
        # message ids of a restarted queue never repeat its earlier life's: a late ack meant for
        # one of those deliveries then matches nothing here
        self.next_id = max(self.next_id, (incarnation << MSG_ID_INCARNATION_SHIFT) + 1)

    # -- wiring -----------------------------------------------------------------------
    def on_link_attached(self, link) -> None:
        if link.link_id in self.out_links:
            self.peer_out[link.peer] = link
            if link.peer.startswith("reader"):
                self.reader_links[link.peer] = link
            elif link.peer == "store":
                self.store_out = link
                if self.store_spec:
                    self.credit.set_peer_spec(link.link_id, self.store_spec)
                if self.store_lost:
                    self.resend_unwritten()
        elif link.peer == "store":
            self.store_in = link

    def on_control(self, msg: dict, fds) -> None:
        if msg.get("type") == "page" and self.pages is not None:
            self.paging = bool(msg["on"])

    def on_peer_down(self, link_id: int, reason: str) -> None:
        if self.store_in is not None and self.store_in.link_id == link_id:
            self.store_in = None
        for peer, link in list(self.peer_out.items()):
            if link.link_id == link_id:
                del self.peer_out[peer]
                if self.reader_links.pop(peer, None) is not None:
                    self.drop_consumers(lambda c, r=peer: c.reader == r, reader=peer)
                elif peer == "store":
                    self.store_out = None
                    self.store_lost = True
                elif reason == "crashed":     # a channel died: what its consumers and gets held goes back
                    self.drop_consumers(lambda c, v=peer: c.via == v, requeue=False)
                    self.requeue_where(lambda who, v=peer: who[2] == v)

    def resend_unwritten(self) -> None:
        """A new store took over: write again what the dead one never reported on disk, in order."""
        self.store_lost = False
        now = time.monotonic_ns()
        for record in self.unwritten.values():
            self.store_out.put_message(record)
            self.credit.send(self.store_out.link_id, now)
        self.store_resent += len(self.unwritten)

    # -- records --------------------------------------------------------------------
    def on_record(self, link, record) -> None:
        kind = record[0]
        if kind == wire.Kind.PUBLISH:
            self.on_publish(link, record)
        elif kind == wire.Kind.ACK:
            self.on_ack(link, record)
        elif kind == wire.Kind.CONTROL:
            self.on_op(link, wire.decode_control(record))
        elif kind == wire.Kind.ON_DISK:
            self.on_disk(wire.decode_ids(record))

    def on_publish(self, link, record) -> None:
        self.send_grants(self.credit.ack(link.link_id))
        if self.delay_ns:
            busy_wait_ns(self.delay_ns)
        flags, seq = wire.publish_head(record)
        msg_id = self.next_id
        self.next_id += 1
        self.enqueued += 1
        on_store = None
        if (flags & wire.PUB_PERSISTENT and self.durable and self.store_out is not None
                and wire.content_body_len(record) >= QUEUE_INDEX_EMBED_MSGS_BELOW):
            on_store = self.store_id(link.peer, seq)
            write = wire.encode_write(on_store, memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:])
            self.unwritten[on_store] = write
            self.store_out.put_message(write)
            self.credit.send(self.store_out.link_id, time.monotonic_ns())
            self.stored += 1
        persistent = self.journal is not None and flags & wire.PUB_PERSISTENT
        if persistent:
            self.journal_publish(msg_id, flags, on_store, record)
        if flags & wire.PUB_CONFIRM:
            out = self.peer_out.get(link.peer)
            if out is None:
                pass
            elif persistent:           # after the journal's fsync, and the store's for a body it holds
                self.waiting[msg_id] = [out, seq, False, on_store is None]
                if on_store is not None:
                    self.by_store_id[on_store] = msg_id
            else:
                self.confirms.setdefault(out, []).append(seq)
        self.messages.append((msg_id, record, False, on_store))

    def journal_publish(self, msg_id: int, flags: int, on_store, record) -> None:
        # a message kept in the shared store is found there by its id; the journal holds the rest whole
        content = b"" if on_store else memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:]
        self.journal.publish(msg_id, flags & ~wire.PUB_CONFIRM, on_store, content)
        if self.journal_first_unsynced_ns is None:
            self.journal_first_unsynced_ns = time.monotonic_ns()

    def recover(self, store_dir: str | None) -> None:
        """Rebuild the backlog from the journal (and the store's files for the bodies kept there)."""
        entries = self.journal.recover()
        bodies = read_store_bodies(store_dir or "", {sid for _, _, sid, _ in entries if sid is not None})
        for msg_id, flags, store_id, content in entries:
            if store_id is not None:
                content = bodies.get(store_id)   # the store keeps the publish's whole content
                if content is None:
                    continue        # never reached the store's disk, so it was never confirmed
            record = wire.encode_publish_record(flags, 0, content)
            self.messages.append((msg_id, record, True, store_id))
            self.next_id = max(self.next_id, msg_id + 1)
        self.recovered = len(self.messages)
        self.enqueued = self.recovered

    def page_in(self, record, queued: bool):
        """The record itself, read back from the page file if it was paged out."""
        if type(record) is not Paged:
            return record
        self.paged_in += 1
        if queued:
            self.paged_messages -= 1
        else:
            self.paged_acks -= 1
        data = self.pages.read(record)
        self.pages.release()
        return data

    def page_out(self, now_ns: int) -> None:
        """One round: page out up to PAGE_BATCH_MESSAGES records, the faster-growing kind first."""
        if now_ns - self.last_page_round_ns < PAGE_ROUND_INTERVAL_NS:
            return
        self.last_page_round_ns = now_ns
        ram_msgs = len(self.messages) - self.paged_messages
        ram_acks = len(self.unacked) - self.paged_acks
        grew_msgs, grew_acks = ram_msgs - self.page_sizes[0], ram_acks - self.page_sizes[1]
        quota = PAGE_BATCH_MESSAGES
        order = (self.page_acks, self.page_messages) if grew_acks > grew_msgs else (self.page_messages,
                                                                                    self.page_acks)
        for step in order:
            quota -= step(quota)
        self.page_sizes = (len(self.messages) - self.paged_messages, len(self.unacked) - self.paged_acks)
        if quota < PAGE_BATCH_MESSAGES:
            self.trim(now_ns)
            self.dirty = True           # paged counts changed: the next statistics push says so

    def page_messages(self, quota: int) -> int:
        messages = self.messages
        n = len(messages)
        picked = []
        for back, entry in enumerate(reversed(messages)):   # the newest are delivered last: page them first
            if len(picked) >= quota or self.paged_messages + len(picked) >= n:
                break
            if type(entry[1]) is not Paged:
                picked.append(n - 1 - back)
        for i in picked:
            msg_id, record, redelivered, on_store = messages[i]
            messages[i] = (msg_id, self.pages.write(record), redelivered, on_store)
        self.paged_messages += len(picked)
        self.paged_out += len(picked)
        return len(picked)

    def page_acks(self, quota: int) -> int:
        picked = [msg_id for msg_id, (record, _, _) in self.unacked.items() if type(record) is not Paged][:quota]
        for msg_id in picked:
            record, owner, on_store = self.unacked[msg_id]
            self.unacked[msg_id] = (self.pages.write(record), owner, on_store)
        self.paged_acks += len(picked)
        self.paged_out += len(picked)
        return len(picked)

    def store_id(self, channel: str, seq: int) -> bytes:
        """The same 16 bytes in every queue a publish reaches, so the store writes its body once."""
        prefix = self.id_prefixes.get(channel)
        if prefix is None:
            prefix = self.id_prefixes[channel] = hashlib.blake2b(f"{self.run_id}/{channel}".encode(),
                                                                 digest_size=8).digest()
        return prefix + struct.pack("<Q", seq)

    def on_disk(self, ids) -> None:
        unwritten = self.unwritten
        for store_id in ids:
            unwritten.pop(store_id, None)
            msg_id = self.by_store_id.pop(store_id, None)
            entry = self.waiting.get(msg_id) if msg_id is not None else None
            if entry is not None:
                entry[3] = True
                self.confirm_if_ready(msg_id, entry)

    def confirm_if_ready(self, msg_id: int, entry: list) -> None:
        if entry[2] and entry[3]:
            del self.waiting[msg_id]
            self.confirms.setdefault(entry[0], []).append(entry[1])

    def sync_journal(self) -> None:
        self.journal.sync()
        self.journal_fsyncs += 1
        self.journal_first_unsynced_ns = None
        for msg_id, entry in list(self.waiting.items()):
            if not entry[2]:
                entry[2] = True
                self.confirm_if_ready(msg_id, entry)

    def forget(self, msg_id: int, record, on_store) -> list:
        """A message is gone for good (acked, or delivered without ack): returns its store id to remove."""
        self.acked += 1
        if self.journal is not None and record[1] & wire.PUB_PERSISTENT:
            self.journal_acks.append(msg_id)
        if on_store is None:
            return []
        self.unwritten.pop(on_store, None)      # a store that took over need not write it at all
        return [on_store]

    def on_ack(self, link, record) -> None:
        flags, _, ids = wire.decode_ack(record)
        requeue = []
        removed = []
        via = link.peer
        unacked = self.unacked
        for msg_id in ids:
            entry = unacked.get(msg_id)
            if entry is None:
                continue
            rec, owner, on_store = entry
            if isinstance(owner, Consumer):
                if owner.via != via:
                    continue            # not delivered through this channel: a stale ack
                owner.unacked -= 1
            elif owner[2] != via:
                continue
            del unacked[msg_id]
            rec = self.page_in(rec, False)
            if flags & wire.ACK_REQUEUE:
                requeue.append((msg_id, rec, True, on_store))
            else:
                removed += self.forget(msg_id, rec, on_store)
        if requeue:
            self.messages.extendleft(reversed(requeue))
        if removed and self.store_out is not None:
            self.store_out.put(wire.encode_ids(wire.Kind.REMOVE, removed))

    # -- delivery -------------------------------------------------------------------------
    def after_io(self, now_ns: int) -> None:
        if self.messages and self.consumers:
            self.deliver_ready()
        if self.journal is not None:
            self.journal_policy(now_ns)
        if self.paging:
            self.page_out(now_ns)
        for link, seqs in self.confirms.items():
            link.put(wire.encode_confirm(seqs))
        self.confirms.clear()
        self.give_back_memory(now_ns)

    def journal_policy(self, now_ns: int) -> None:
        """Group commit: fsync every SYNC_INTERVAL_MS while writes are pending, sooner when drained with
        confirms waiting (as the store does)."""
        if self.journal_acks:
            self.journal.ack(self.journal_acks)
            self.journal_acks = []
            if self.journal_first_unsynced_ns is None:
                self.journal_first_unsynced_ns = now_ns
        if self.journal_first_unsynced_ns is None:
            return
        due = now_ns - self.journal_first_unsynced_ns >= SYNC_INTERVAL_MS * 1_000_000
        drained = self.waiting and all(link.ring.statistics().used_bytes == 0 for link in self.in_links.values())
        if due or drained:
            self.sync_journal()

    def timeout_s_journal(self, now_ns: int) -> float | None:
        if self.journal_first_unsynced_ns is None:
            return None
        return max(0.0, (self.journal_first_unsynced_ns + SYNC_INTERVAL_MS * 1_000_000 - now_ns) / 1e9)

    def shutdown(self) -> None:
        if self.pages is not None:
            self.pages.close()
        if self.journal is not None:
            if self.journal_acks:
                self.journal.ack(self.journal_acks)
            self.journal.close()
        super().shutdown()

    def give_back_memory(self, now_ns: int) -> None:
        """As a backlog drains, hand the heap pages its messages held back to the OS, step by step.

        Message bodies above 512 bytes live in glibc's main heap (each below the
        mmap threshold, so none has a mapping of its own). The backlog drains
        oldest first, from the bottom of the heap, while newer messages still
        sit above it, so the heap's top never comes free and ``free`` returns
        nothing: the pages stay mapped until ``malloc_trim`` hands back every
        whole free page inside the heap. The memory alarm measures what the OS
        sees, so the queue trims each time its backlog has fallen by
        ``TRIM_AFTER_FALL_FRACTION`` since the last trim (``peak_messages`` is
        the backlog at the last trim, or its peak since), at most every
        ``TRIM_MIN_INTERVAL_NS``: memory follows the backlog down instead of
        waiting for it to empty.
        """
        backlog = len(self.messages) + len(self.unacked)
        if backlog > self.peak_messages:
            self.peak_messages = backlog
            return
        if (self.peak_messages >= TRIM_MIN_PEAK_MESSAGES
                and backlog <= self.peak_messages * (1 - TRIM_AFTER_FALL_FRACTION)
                and now_ns - self.last_trim_ns >= TRIM_MIN_INTERVAL_NS):
            self.trim(now_ns)
            self.peak_messages = backlog

    def deliver_ready(self) -> None:
        """Round-robin over consumers with prefetch room and room in their reader's window: at most
        DELIVERY_WINDOW deliveries in flight, and only what the ring has space for (a delivery never
        waits in this process's memory, so big bodies are not held twice)."""
        messages = self.messages
        room = {}
        space = {}
        for c in self.consumers:
            if c.link.link_id not in room:
                stats = c.link.ring.statistics()
                room[c.link.link_id] = 0 if c.link.overflow else DELIVERY_WINDOW - stats.in_flight
                space[c.link.link_id] = c.link.ring.free_bytes() - DELIVERY_HEAD_BYTES * 2
        consumers = self.consumers
        n = len(consumers)
        idle = 0
        while messages and idle < n:
            c = consumers[self.rr % n]
            self.rr += 1
            if room[c.link.link_id] <= 0 or (c.prefetch and c.unacked >= c.prefetch):
                idle += 1
                continue
            head = messages[0][1]
            need = (head.length if type(head) is Paged else len(head)) + DELIVERY_HEAD_BYTES + len(c.ctag_bytes)
            if need > space[c.link.link_id] and room[c.link.link_id] < DELIVERY_WINDOW:
                room[c.link.link_id] = 0          # the ring is full for now; a SPACE token brings us back
                idle += 1
                continue
            idle = 0
            room[c.link.link_id] -= 1
            space[c.link.link_id] -= need
            msg_id, record, redelivered, on_store = messages.popleft()
            record = self.page_in(record, True)
            flags = (wire.DLV_REDELIVERED if redelivered else 0) | (wire.DLV_NO_ACK if c.no_ack else 0)
            c.link.put(wire.encode_deliver(flags, c.channel, msg_id, c.ctag_bytes,
                                           memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:]))
            self.delivered += 1
            if c.no_ack:
                gone = self.forget(msg_id, record, on_store)
                if gone and self.store_out is not None:
                    self.store_out.put(wire.encode_ids(wire.Kind.REMOVE, gone))
            else:
                c.unacked += 1
                self.unacked[msg_id] = (record, c, on_store)
        self.window_full = False
        for c in self.consumers:
            full = room[c.link.link_id] <= 0 and bool(messages)
            if full:
                self.window_full = True
            if full or c.link.ring.writer_waiting:
                c.link.ring.writer_waiting = full   # the reader answers a waiting writer with a SPACE token

    def timeout_s(self, now_ns: int) -> float | None:
        # SPACE tokens wake us when a reader drains a full window; this only covers the race
        # where it drained everything before we raised the flag
        journal = self.timeout_s_journal(now_ns) if self.journal is not None else None
        if self.paging and len(self.messages) + len(self.unacked) > self.paged_messages + self.paged_acks:
            journal = PAGE_ROUND_INTERVAL_NS / 1e9 if journal is None else min(journal, PAGE_ROUND_INTERVAL_NS / 1e9)
        if self.window_full and self.messages:
            return 0.01 if journal is None else min(0.01, journal)
        return journal

    # -- operations from channels ---------------------------------------------------------
    def on_op(self, link, op: dict) -> None:
        kind = op.get("op")
        out = self.peer_out.get(link.peer)
        if kind == "declare":
            if not op.get("passive") and bool(op["durable"]) != self.durable:
                self.reply(out, {"op": "error", "code": 406, "class_id": 50, "method_id": 10,
                                 "text": f"PRECONDITION_FAILED - inequivalent arg 'durable' for queue "
                                         f"'{self.queue}' in vhost '/': received "
                                         f"'{str(bool(op['durable'])).lower()}' but current is "
                                         f"'{str(self.durable).lower()}'"})
                return
            self.reply(out, {"op": "declare_ok", "queue": self.queue, "nowait": op.get("nowait", False),
                             "message_count": len(self.messages), "consumer_count": len(self.consumers)})
        elif kind == "consume":
            reader_link = self.reader_links.get(op["reader"])
            if reader_link is None:
                self.reply(out, {"op": "error", "code": 541, "text": "INTERNAL_ERROR - no delivery link"})
                return
            c = Consumer(op["ctag"], op["channel"], op["reader"], reader_link, op["no_ack"], op["prefetch"],
                         via=link.peer)
            if not op.get("nowait"):
                reader_link.put(wire.encode_frames(frames.encode_method(
                    c.channel, commands.Basic.ConsumeOk(consumer_tag=c.ctag))))
            self.consumers.append(c)
            self.done(out, reader_link)
        elif kind == "cancel":
            self.drop_consumers(lambda c: c.ctag == op["ctag"] and c.reader == op["reader"]
                                and c.channel == op["channel"], requeue=False)
            reader_link = self.reader_links.get(op["reader"])
            if reader_link is not None and not op.get("nowait"):
                reader_link.put(wire.encode_frames(frames.encode_method(
                    op["channel"], commands.Basic.CancelOk(consumer_tag=op["ctag"]))))
            self.done(out, reader_link)
        elif kind == "get":
            self.done(out, self.basic_get(op, link.peer))
        elif kind == "channel_closed":
            reader, channel = op["reader"], op["channel"]
            self.drop_consumers(lambda c: c.reader == reader and c.channel == channel,
                                reader=reader, channel=channel)
        elif kind == "recover":
            self.requeue_owned(op["reader"], op["channel"])

    def done(self, out, reader_link) -> None:
        """Tell the channel its operation is answered, after the answer the reader sends is committed:
        the reader handles what a queue committed before what the channel then sends, so the client
        sees the answers in the order it asked."""
        if reader_link is not None:
            reader_link.flush()
        self.reply(out, {"op": "done"})

    def basic_get(self, op: dict, via: str):
        """Answer basic.get on the reader's link; returns that link (None if the reader is gone)."""
        reader_link = self.reader_links.get(op["reader"])
        if reader_link is None:
            return None
        channel = op["channel"]
        if not self.messages:
            reader_link.put(wire.encode_frames(frames.encode_method(channel, commands.Basic.GetEmpty())))
            return reader_link
        msg_id, record, redelivered, on_store = self.messages.popleft()
        record = self.page_in(record, True)
        flags = (wire.DLV_REDELIVERED if redelivered else 0) | (wire.DLV_NO_ACK if op["no_ack"] else 0)
        reader_link.put(wire.encode_get_ok(flags, channel, msg_id, len(self.messages),
                                           memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:]))
        self.delivered += 1
        if op["no_ack"]:
            gone = self.forget(msg_id, record, on_store)
            if gone and self.store_out is not None:
                self.store_out.put(wire.encode_ids(wire.Kind.REMOVE, gone))
        else:
            self.unacked[msg_id] = (record, (op["reader"], channel, via), on_store)
        return reader_link

    def drop_consumers(self, match, *, requeue: bool = True, reader: str | None = None,
                       channel: int | None = None) -> None:
        self.consumers = [c for c in self.consumers if not match(c)]
        if requeue and reader is not None:
            self.requeue_owned(reader, channel)

    def requeue_owned(self, reader: str, channel: int | None) -> None:
        """Put back, in order and marked redelivered, what a reader's channel held unacked."""
        self.requeue_where(lambda who: who[0] == reader and (channel is None or who[1] == channel))

    def requeue_where(self, match) -> None:
        """Put back, in order and marked redelivered, the unacked messages whose (reader, channel number,
        channel process) ``match``."""
        back = []
        for msg_id, (rec, owner, on_store) in list(self.unacked.items()):
            who = (owner.reader, owner.channel, owner.via) if isinstance(owner, Consumer) else owner
            if match(who):
                del self.unacked[msg_id]
                if isinstance(owner, Consumer):
                    owner.unacked -= 1
                back.append((msg_id, self.page_in(rec, False), True, on_store))
        if back:
            back.sort(key=lambda m: m[0])
            self.messages.extendleft(reversed(back))

    def reply(self, out, msg: dict) -> None:
        if out is not None:
            out.put(wire.encode_control(msg))

    def extra_stats(self, now_ns: int) -> dict:
        return {"queue": self.queue, "durable": self.durable, "messages": len(self.messages),
                "unacked": len(self.unacked), "consumers": len(self.consumers), "enqueued": self.enqueued,
                "delivered": self.delivered, "acked": self.acked, "stored": self.stored,
                "awaiting_confirm": len(self.waiting), "recovered": self.recovered, "paging": self.paging,
                "paged_messages": self.paged_messages, "paged_acks": self.paged_acks, "paged_out": self.paged_out,
                "paged_in": self.paged_in, "store_resent": self.store_resent,
                "journal_fsyncs": self.journal_fsyncs}
