"""The queue: one process per AMQP queue, a shell over ``pipeline.broker.backlog``.

It acks a publish's credit on receipt (before enqueueing) and hands the
message to its :class:`~pipeline.broker.backlog.Backlog`, which runs
``deliver_or_enqueue`` and everything after it (consumers, prefetch, acks,
requeue order, TTL, max-length, dead-lettering) and returns what to do. This
shell does the I/O those actions need:

* deliveries go to the consumer's reader over a ring that carries no credit,
  bounded by the ring's space and ``DELIVERY_WINDOW`` (the ``room`` it gives
  the core), or ``LEND_IN_FLIGHT`` while the queue holds bodies by reference;
* persistent messages in a durable queue are journaled (``pipeline.storage.journal``);
  those of ``QUEUE_INDEX_EMBED_MSGS_BELOW`` bytes or more are also written to
  the message store under store credit (``msg_store_credit_disc_bound``);
  their publishers are confirmed once the journal's fsync (and the store's)
  covers them, others at once;
* dead-lettered copies are routed with this queue's copy of the routing
  table and sent to their queues as a publisher would, spending credit (a
  slow target blocks this queue, and so its publishers) and held while a
  resource alarm holds publishers: dead-lettering cannot bypass flow control;
* under memory pressure, records are paged out (``pipeline.broker.paging``);
* a body that came by reference (``pipeline.broker.bodies``) stays in its
  arena, held by this queue's word in the slot (:class:`Held`), and goes to a
  consumer's reader as a loan, no more than ``LEND_IN_FLIGHT`` of them in its
  ring: one further waits in the queue rather than going by copy to a reader
  that is behind; it is copied out (and let go) for the journal, a page, a
  dead letter or basic.get, and once held over a second in an arena over half full.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import struct
import time

from pamqp import commands

from ipc import control
from pipeline.broker import wire
from pipeline.amqp import frames
from pipeline.broker import bodies, props
from pipeline.broker.args import QueueArgs, QueueError, parse_expiration
from pipeline.broker.backlog import (AskPermits, Backlog, DeadLetter, DeleteQueue, Deliver, Forget, GetEmpty, GetOk,
                                     Message, Nack, ReturnPermits, dead_letter_cycles, record_death)
from pipeline.broker.backlog import Confirm as ConfirmAction
from pipeline.broker.consumer_bias import ConsumerBias
from pipeline.broker.definitions import not_found_queue
from pipeline.broker.paging import PAGE_BATCH_MESSAGES, PAGE_ROUND_INTERVAL_NS, PageFile, Paged
from pipeline.broker.routing import RoutingTable
from pipeline.storage.journal import QueueJournal
from pipeline.storage.segments import read_bodies
from pipeline.broker.stage import Stage, read_batch_for
from pipeline.telemetry.schema import CONSUMER_DETAILS_KEPT, ConsumerDetail, QueueStats

QUEUE_INDEX_EMBED_MSGS_BELOW = 4096
SYNC_INTERVAL_MS = 200
JOURNAL_RETRY_NS = 1_000_000_000  # a full disk: try the held journal entries again this often
DELIVERY_HEAD_BYTES = 32           # a DELIVER record's head and the ring's length word, give or take
MSG_ID_INCARNATION_SHIFT = 40      # each restart of a queue numbers its messages from incarnation << 40
COPY_OUT_BATCH = 256               # bodies copied out of a pressed arena in one turn
COPY_OUT_SCAN = 4 * COPY_OUT_BATCH  # of the oldest held bodies looked at for it
COPY_OUT_AFTER_NS = 1_000_000_000  # only bodies held at least this long
LEND_IN_FLIGHT = 128               # deliveries in a reader's ring while this queue holds bodies by reference
DELIVERY_WINDOW = 1000             # deliveries in flight to one consumer's reader, whatever the prefetch
TRIM_MIN_PEAK_MESSAGES = 1000        # a backlog smaller than this is not worth a trim
TRIM_AFTER_FALL_FRACTION = 1 / 16    # trim each time the backlog has fallen by this much since the last trim,
TRIM_MIN_INTERVAL_NS = 100_000_000   # but not more often: a trim costs ~0.1 ms per MiB it returns
BASIC_CONSUME = (60, 20)
# what another connection may not do to an exclusive queue (RabbitMQ's check_exclusive_access)
LOCKED_OPS = {"consume": {"class_id": 60, "method_id": 20}, "get": {"class_id": 60, "method_id": 70},
              "purge": {"class_id": 50, "method_id": 30}, "delete": {"class_id": 50, "method_id": 40}}
# operations answered 404 once the queue is deleted, a declare only when passive (a queue.delete is answered
# as deleted, with nothing in it)
GONE_OPS = {"declare": dict(zip(("class_id", "method_id"), frames.QUEUE_DECLARE)),
            **{op: ids for op, ids in LOCKED_OPS.items() if op != "delete"}}


def busy_wait_ns(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def names_of(record) -> tuple[str, tuple[str]]:
    """A publish's exchange and routing keys as the text x-death records them."""
    exchange, routing_key = wire.content_route(record)
    return exchange.decode("utf-8", "surrogateescape"), (routing_key.decode("utf-8", "surrogateescape"),)


class Held:
    """A message payload whose body stays in an arena slot, held by this queue's ``entry`` there.

    ``content`` is the record's content with a reference that names the entry: what a DELIVER lent to a
    consumer's reader carries."""

    __slots__ = ("record", "arena", "at", "size", "entry", "content", "since_ns")

    def __init__(self, record, a: int, arena, at: int, size: int, entry: int, since_ns: int):
        self.record, self.arena, self.at, self.size = record, arena, at, size
        self.entry, self.since_ns = entry, since_ns
        view = memoryview(record)
        self.content = b"".join((view[wire.PUBLISH_CONTENT_OFFSET:len(record) - bodies.REF_BYTES],
                                 bodies.encode_ref(a, at, size, entry)))


class ConsumerInfo:
    """Where a consumer's deliveries go: its reader's link, its channel number and tag; and, for the
    statistics, what the consumer asked for (``detail``)."""

    __slots__ = ("link", "channel", "ctag_bytes", "detail")

    def __init__(self, link, channel: int, ctag: str, detail: ConsumerDetail | None = None):
        self.link, self.channel, self.ctag_bytes, self.detail = link, channel, ctag.encode(), detail


class Queue(Stage):
    kind = "queue"

    def __init__(self, name, ctl_sock, inbox_fd, doorbell_fd, credit_spec, *, queue: str, durable: bool,
                 owner: str | None = None, auto_delete: bool = False, args: QueueArgs | None = None,
                 store_spec=None, delay_us: int = 0, frame_max: int = 131072, run_id: str = "",
                 journal_dir: str | None = None, store_dir: str | None = None, page_path: str | None = None,
                 incarnation: int = 0, routing: dict | None = None):
        super().__init__(name, ctl_sock, inbox_fd, doorbell_fd, credit_spec)
        self.queue = queue
        self.queue_bytes = queue.encode("utf-8", "surrogateescape")
        self.durable = durable
        self.owner = owner                         # an exclusive queue's connection (its reader)
        self.args = args or QueueArgs()
        self.store_spec = store_spec
        self.delay_ns = delay_us * 1000
        self.read_batch = read_batch_for(self.delay_ns)
        self.frame_max = frame_max
        self.run_id = run_id
        self.id_prefixes: dict[str, bytes] = {}     # publishing channel -> 8-byte prefix of store ids
        self.consumers: dict[tuple, ConsumerInfo] = {}       # (channel process, tag) -> where deliveries go
        # the reader links consumers' deliveries go on, the only ones room is counted for: a queue has a
        # link to every reader that declared it or published to it, a hundred with a hundred publishers
        self.delivery_links: tuple = ()
        self.channel_links: dict[str, tuple] = {}               # channel process -> (reader link, channel number)
        self.channel_reader: dict[str, str] = {}            # channel process -> its reader
        self.reader_links: dict[str, object] = {}
        self.peer_out: dict[str, object] = {}                # peer name -> out link
        self.store_out = None
        self.store_in = None
        self.confirms: dict[str, list[int]] = {}             # channel process -> seqs to confirm
        self.nacks: dict[str, list[int]] = {}
        self.record_bytes = 256                              # recent delivery record size, for ring room
        self.batch_room: dict | None = None                  # room() as this batch of records found it
        self.peak_messages = 0
        self.drain_trim_owed = False     # a backlog worth a trim was here: trim once it is gone
        self.paging = False
        self.pages = PageFile(page_path) if page_path else None
        self.paged_out = 0
        self.paged_in = 0
        self.last_page_round_ns = 0
        self.page_sizes = (0, 0)
        self.unsafe: dict[int, list] = {}        # msg id -> [journal synced?, store on disk?]
        self.by_store_id: dict[bytes, int] = {}
        self.store_ids: dict[int, bytes] = {}    # msg id -> its store id (bodies the store keeps)
        self.unwritten: dict[bytes, bytes] = {}  # store id -> WRITE record the store has not reported on disk
        self.store_lost = False                  # the store died: re-send ``unwritten`` to its successor
        self.store_resent = 0
        self.journal = QueueJournal(journal_dir) if durable and journal_dir else None
        self.journal_first_unsynced_ns: int | None = None
        self.journal_full_since_ns: int | None = None   # a full disk holds journal entries back
        self.journal_retry_at_ns = 0
        self.journal_acks: list[int] = []
        self.journal_fsyncs = 0
        self.stored = 0
        self.removes: list[bytes] = []           # store ids to remove, sent once a turn
        self.routing = RoutingTable.from_snapshot(routing) if routing else None
        self.dl_links: dict[bytes, object] = {}  # target queue -> out link, for dead-lettered copies
        self.dl_pending: collections.deque = collections.deque()   # (record, target queues) not yet sent
        self.dl_asked: set[bytes] = set()
        self.dl_sent = 0
        self.dl_cycles = 0
        self.alarms: set[str] = set()
        installed = bodies.installed()
        self.arenas = installed.arenas if installed is not None else []
        self.holding: dict[Held, Message] = {}   # messages whose body this queue holds in an arena, oldest first
        self.copied_out = 0                      # bodies it copied out of an arena (journal, page, pressure)
        self.bodies_lent = self.bodies_sent_by_copy = 0     # deliveries of bodies it held by reference
        now = time.monotonic_ns()
        recovered = self.recover(store_dir) if self.journal is not None else []
        first_id = max([m.id + 1 for m in recovered] + [(incarnation << MSG_ID_INCARNATION_SHIFT) + 1])
        self.core = Backlog(queue, now, self.args, auto_delete=auto_delete, first_id=first_id)
        for msg in recovered:
            self.core.restore(msg)
        self.recovered = len(recovered)
        self.bias = ConsumerBias()
        self.bias_held = False                   # publishes left unread this turn for the bias
        self.publishing_links: set[int] = set()  # in-links that have carried publishes

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
        kind = msg.get("type")
        if kind == "page" and self.pages is not None:
            self.paging = bool(msg["on"])
        elif kind == "alarms":
            self.alarms = set(msg["set"])
        elif kind == "routing" and self.routing is not None:
            self.routing.apply(msg["changes"])
        elif kind == "delete":
            self.delete(msg)
        elif kind == "purge":           # ctl purge_queue, or the management API's DELETE .../contents
            count, actions = self.core.purge(time.monotonic_ns())
            self.do(actions)
            control.send_msg(self.ctl, {"type": "purge_answer", "req": msg.get("req"), "message_count": count})
        elif kind in ("queue_linked", "no_queue", "declare_refused"):
            self.on_dl_link(msg)
        self.dirty = True

    def on_peer_down(self, link_id: int, reason: str) -> None:
        if self.store_in is not None and self.store_in.link_id == link_id:
            self.store_in = None
        for name, link in list(self.dl_links.items()):
            if link.link_id == link_id:
                del self.dl_links[name]
        for peer, link in list(self.peer_out.items()):
            if link.link_id != link_id:
                continue
            del self.peer_out[peer]
            if self.reader_links.pop(peer, None) is not None:     # a connection is gone: its channels too
                for channel in [c for c, r in self.channel_reader.items() if r == peer]:
                    self.channel_closed(channel)
            elif peer == "store":
                self.store_out = None
                self.store_lost = True
            elif peer.startswith("channel"):
                self.channel_closed(peer)

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
        self.owe(link.link_id)
        if self.core.deleted:
            self.drop_late_publish(record)
            return
        self.publishing_links.add(link.link_id)
        if self.delay_ns:
            busy_wait_ns(self.delay_ns)
        flags, seq = wire.publish_head(record)
        persistent = flags & wire.PUB_PERSISTENT
        payload = record
        if flags & wire.PUB_BODY_REF:
            payload = self.hold(record)
            if persistent and self.journal is not None:
                payload = record = self.let_go(payload)     # journaled: from its own bytes
                flags &= ~wire.PUB_BODY_REF
        body_size, prop_flags = wire.content_sizes(record)
        if type(payload) is Held:
            body_size = payload.size
        priority = expiration = raw_expiration = None
        if prop_flags & props.PRIORITY_OR_EXPIRATION:
            priority, raw_expiration = props.priority_expiration(wire.content_props(record))
        if raw_expiration is not None:
            try:
                expiration = parse_expiration(raw_expiration)
            except QueueError:
                expiration = None              # not a whole number of ms: RabbitMQ's channel refuses it
        exchange, routing_keys = "", ()
        if self.args.dead_letter_exchange is not None:        # x-death names where the message came from
            exchange, routing_keys = names_of(record)
        # positional: a dozen keywords cost this hot path more than the rest of the construction
        msg = Message(payload, body_size, bool(persistent), priority, expiration,
                      link.peer if flags & wire.PUB_CONFIRM else None, seq, exchange, routing_keys)
        if type(payload) is Held:
            self.holding[payload] = msg
        keep = persistent and self.journal is not None
        if keep:
            self.keep(msg, self.core.next_id, link.peer, seq, record, flags)
        core = self.core
        room = None
        if core.wants_room():               # the consumers' room, read once a batch: deliveries only use it up
            room = self.batch_room
            if room is None:
                room = self.batch_room = self.room()
        self.do(core.publish(msg, self.batch_ns or time.monotonic_ns(), safe=not keep, room=room))

    def drop_late_publish(self, record) -> None:
        """A publish that was on its way when the queue was deleted goes nowhere, as one sent to a RabbitMQ
        queue process that has ended: its channel counts it confirmed once this process has ended as it
        should (``queue_gone``). A body by reference loses this queue's word in its slot."""
        bodies.let_go_unsent(record, self.holder)

    # -- bodies by reference ---------------------------------------------------------------
    def hold(self, record) -> Held:
        """A publish by reference as this queue's ``Held`` payload."""
        a, at, size, _ = bodies.decode_ref(record)
        arena = self.arenas[a]
        entry = arena.entry_of(at, self.holder) if self.holder else -1
        if entry < 0:           # its bytes may be another message's by now: never read them
            raise bodies.NotHolder(f"{self.name} got a body by reference at {at} with no word of its own")
        return Held(record, a, arena, at, size, entry, self.batch_ns or time.monotonic_ns())

    def let_go(self, payload) -> bytes:
        """The payload as a record carrying its own body; this queue's word in the slot is cleared."""
        record, _, _, _ = bodies.copy_out(payload.record if type(payload) is Held else payload, wire.PUB_BODY_REF)
        if type(payload) is Held:
            payload.arena.release(payload.at, payload.entry)
            self.holding.pop(payload, None)
            self.copied_out += 1
        return record

    def copy_out_held(self, now_ns: int) -> None:
        """An arena is over half full: copy out of it the bodies this queue has held there for over
        COPY_OUT_AFTER_NS, oldest first, at most COPY_OUT_BATCH a turn. A body held that long (unacked,
        or behind a slow consumer) keeps the allocator from reusing everything after it; one that
        came in the last second is left alone, so a deep backlog costs no copying: new bodies then go
        inline until the oldest are delivered."""
        due = now_ns - COPY_OUT_AFTER_NS
        pressed = []
        for held in itertools.islice(self.holding, COPY_OUT_SCAN):
            if held.since_ns > due:
                break
            if held.arena.pressure:
                pressed.append(held)
        for held in pressed[:COPY_OUT_BATCH]:
            msg = self.holding[held]
            msg.payload = self.let_go(held)

    def keep(self, msg: Message, msg_id: int, channel: str, seq: int, record, flags: int) -> None:
        """Journal a persistent message (its body to the store when big); its confirm waits for both."""
        on_store = None
        if self.store_out is not None and msg.size >= QUEUE_INDEX_EMBED_MSGS_BELOW:
            on_store = self.store_id(channel, seq)
            write = wire.encode_write(on_store, memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:])
            self.unwritten[on_store] = write
            self.store_out.put_message(write)
            self.credit.send(self.store_out.link_id, time.monotonic_ns())
            self.stored += 1
            self.store_ids[msg_id] = on_store
            self.by_store_id[on_store] = msg_id
        content = b"" if on_store else memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:]
        self.journal.publish(msg_id, flags & ~wire.PUB_CONFIRM, on_store, content)
        self.wrote_to_disk(len(content))
        if self.journal.full:
            self.journal_full()
        if self.journal_first_unsynced_ns is None:
            self.journal_first_unsynced_ns = time.monotonic_ns()
        if msg.publisher is not None:
            self.unsafe[msg_id] = [False, on_store is None]

    def recover(self, store_dir: str | None) -> list[Message]:
        """The backlog's messages from the journal (and the store's files for the bodies kept there)."""
        entries = self.journal.recover()
        bodies = read_bodies(store_dir or "", {sid for _, _, sid, _ in entries if sid is not None})
        out = []
        for msg_id, flags, store_id, content in entries:
            if store_id is not None:
                content = bodies.get(store_id)   # the store keeps the publish's whole content
                if content is None:
                    continue        # never reached the store's disk, so it was never confirmed
                self.store_ids[msg_id] = store_id
            record = wire.encode_publish_record(flags, 0, content)
            priority, _ = props.priority_expiration(wire.content_props(record))
            exchange, routing_keys = names_of(record)
            out.append(Message(record, wire.content_body_len(record), persistent=True, priority=priority,
                               exchange=exchange, routing_keys=routing_keys, redelivered=True, id=msg_id))
        return out

    def store_id(self, channel: str, seq: int) -> bytes:
        """The same 16 bytes in every queue a publish reaches, so the store writes its body once."""
        prefix = self.id_prefixes.get(channel)
        if prefix is None:
            prefix = self.id_prefixes[channel] = hashlib.blake2b(f"{self.run_id}/{channel}".encode(),
                                                                 digest_size=8).digest()
        return prefix + struct.pack("<Q", seq)

    def on_disk(self, ids) -> None:
        unwritten = self.unwritten
        safe = []
        for store_id in ids:
            unwritten.pop(store_id, None)
            msg_id = self.by_store_id.pop(store_id, None)
            entry = self.unsafe.get(msg_id) if msg_id is not None else None
            if entry is not None:
                entry[1] = True
                if entry[0]:
                    del self.unsafe[msg_id]
                    safe.append(msg_id)
        if safe:
            self.do(self.core.mark_safe(safe))

    def sync_journal(self) -> None:
        if not self.journal.sync():
            self.journal_full()
            return
        self.journal_synced()

    def journal_full(self) -> None:
        """The disk refused journal entries: stop reading (flow control holds the publishers), confirm
        nothing more, and retry every JOURNAL_RETRY_NS (as the message store does)."""
        if self.journal_full_since_ns is None:
            self.journal_full_since_ns = time.monotonic_ns()
            self.journal_retry_at_ns = self.journal_full_since_ns + JOURNAL_RETRY_NS
            self.log_lines([f"{self.name}: disk full: journal entries held in memory, confirms withheld, not "
                            f"reading until a retry (every {JOURNAL_RETRY_NS // 1_000_000} ms) succeeds"])

    def wants_records(self, link) -> bool:
        if self.journal_full_since_ns is not None:
            return False
        if link.link_id in self.publishing_links and not self.bias.may_take():
            self.bias_held = True
            return False
        return True

    def journal_synced(self) -> None:
        self.journal_fsyncs += 1
        self.journal_first_unsynced_ns = None
        safe = []
        for msg_id, entry in list(self.unsafe.items()):
            entry[0] = True
            if entry[1]:
                del self.unsafe[msg_id]
                safe.append(msg_id)
        if safe:
            self.do(self.core.mark_safe(safe))

    def on_ack(self, link, record) -> None:
        flags, _, ids = wire.decode_ack(record)
        now = time.monotonic_ns()
        if flags & wire.ACK_REJECT:
            self.do(self.core.reject(link.peer, ids, now, requeue=bool(flags & wire.ACK_REQUEUE)))
        else:
            self.do(self.core.ack(link.peer, ids))

    # -- what the core decided ----------------------------------------------------------
    def do(self, actions) -> None:
        for action in actions:
            t = type(action)
            if t is Deliver:
                self.deliver(action)
            elif t is ConfirmAction:
                self.confirms.setdefault(action.publisher, []).append(action.seq)
            elif t is Forget:
                self.ended(action.message)
            elif t is GetOk:
                self.get_ok(action)
            elif t is GetEmpty:
                link, channel = self.channel_links[action.channel]
                link.put(wire.encode_frames(frames.encode_method(channel, commands.Basic.GetEmpty())))
            elif t is Nack:
                self.nacks.setdefault(action.publisher, []).append(action.seq)
            elif t is DeadLetter:
                self.dead_letter(action)
                self.ended(action.message)
            elif t is DeleteQueue:
                control.send_msg(self.ctl, {"type": "delete_me", "queue": self.queue, "reason": action.reason})
            elif t is AskPermits or t is ReturnPermits:
                self.to_limiter(action)

    def to_limiter(self, action) -> None:
        """basic.qos global=true: the channel's limiter lives in its reader, which sees all its deliveries."""
        link, channel = self.channel_links[action.channel]
        if type(action) is AskPermits:
            link.put(wire.encode_control({"op": "want", "channel": channel, "count": action.want}))
        else:
            link.put(wire.encode_control({"op": "give_back", "channel": channel, "count": action.count}))

    def payload(self, msg: Message):
        record = msg.payload
        if type(record) is Held:                  # a copy: the slot stays held, by this queue alone
            return bodies.copy_out(record.record, wire.PUB_BODY_REF)[0]
        if type(record) is Paged:
            record = self.pages.read(record)
            self.paged_in += 1
            msg.payload = record
        return record

    def deliver(self, action: Deliver) -> None:
        msg = action.message
        c = self.consumers[action.consumer]
        flags = (wire.DLV_REDELIVERED if action.redelivered else 0) | (wire.DLV_NO_ACK if action.no_ack else 0)
        held = msg.payload
        # lent only while its arena has room and the reader keeps up: a loan that sits in a stalled
        # reader's ring or socket would keep the allocator from reusing everything after it
        if (type(held) is Held and c.link.ring.in_flight() < LEND_IN_FLIGHT
                and held.arena.lend(held.at, held.entry, c.link.peer_holder)):
            out = wire.encode_deliver(flags | wire.DLV_BODY_REF, c.channel, msg.id, c.ctag_bytes, held.content)
            self.bodies_lent += 1
        else:
            if type(held) is Held:
                self.bodies_sent_by_copy += 1
            record = self.payload(msg)
            out = wire.encode_deliver(flags, c.channel, msg.id, c.ctag_bytes,
                                      memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:])
        if len(out) > self.record_bytes:
            self.batch_room = None          # counted for smaller records: read the rings' room afresh
        self.record_bytes = len(out)
        c.link.put(out)
        if action.no_ack:
            self.ended(msg)

    def get_ok(self, action: GetOk) -> None:
        link, channel = self.channel_links[action.channel]
        msg = action.message
        record = self.payload(msg)
        flags = (wire.DLV_REDELIVERED if action.redelivered else 0) | (wire.DLV_NO_ACK if action.no_ack else 0)
        link.put(wire.encode_get_ok(flags, channel, msg.id, action.remaining,
                                    memoryview(record)[wire.PUBLISH_CONTENT_OFFSET:]))
        if action.no_ack:
            self.ended(msg)

    def ended(self, msg: Message) -> None:
        """A message is gone for good: drop its journal entry, its store body, its page, its arena word."""
        if type(msg.payload) is Held:
            msg.payload.arena.release(msg.payload.at, msg.payload.entry)
            del self.holding[msg.payload]
            msg.payload = None
        elif type(msg.payload) is Paged:
            self.pages.release()
            msg.payload = None
        if msg.persistent and self.journal is not None:
            self.journal_acks.append(msg.id)
            self.unsafe.pop(msg.id, None)
        store_id = self.store_ids.pop(msg.id, None)
        if store_id is not None:
            self.unwritten.pop(store_id, None)          # a store that took over need not write it at all
            self.by_store_id.pop(store_id, None)
            self.removes.append(store_id)         # one REMOVE record per turn (after_io)

    # -- dead-lettering ------------------------------------------------------------------
    def dead_letter(self, action: DeadLetter) -> None:
        """Publish a copy to the dead-letter exchange with RabbitMQ's x-death headers, as a publisher would."""
        if self.routing is None:
            return
        record = self.payload(action.message)
        _, _, props_raw, body = wire.content_views(record, wire.PUBLISH_CONTENT_OFFSET)
        values = props.read(props_raw)
        original_expiration = values.pop("expiration", None)
        headers = record_death(values.get("headers"), action.death(
            int(time.time()), original_expiration.decode() if original_expiration else None),
            drop_cc=action.routing_key is not None)
        values["headers"] = headers
        exchange = action.exchange.encode("utf-8", "surrogateescape")
        keys = [k if isinstance(k, bytes) else k.encode("utf-8", "surrogateescape") for k in action.routing_keys]
        targets: set = set()
        try:
            for key in keys:
                targets.update(self.routing.route(exchange, key, headers).queues)
        except Exception:          # noqa: BLE001 - a DLX that does not exist (any more) drops it, as RabbitMQ
            return
        names = [t.decode("utf-8", "surrogateescape") for t in targets]
        keep, cycles = dead_letter_cycles(action.reason, headers, names)
        self.dl_cycles += len(cycles)
        if not keep:
            return
        flags = record[1] & wire.PUB_PERSISTENT
        copy = wire.encode_publish(flags, 0, exchange, keys[0] if keys else b"", props.encode(values), bytes(body))
        self.dl_pending.append((copy, [k.encode("utf-8", "surrogateescape") for k in keep]))

    def send_dead_letters(self) -> None:
        """Send what waits, in order, once every target it needs is linked and no alarm holds publishers."""
        if self.alarms:
            return
        now = time.monotonic_ns()
        while self.dl_pending:
            record, targets = self.dl_pending[0]
            unlinked = [t for t in targets if t not in self.dl_links]
            if unlinked:
                for t in unlinked:
                    if t not in self.dl_asked:
                        self.dl_asked.add(t)
                        control.send_msg(self.ctl, {"type": "link_queue",
                                                    "queue": t.decode("utf-8", "surrogateescape")})
                return
            self.dl_pending.popleft()
            for t in targets:
                link = self.dl_links.get(t)
                if link is not None and link.link_id in self.out_links:
                    link.put_message(record)
                    self.credit.send(link.link_id, now)
            self.dl_sent += 1

    def on_dl_link(self, msg: dict) -> None:
        name = msg.get("queue", "").encode("utf-8", "surrogateescape")
        self.dl_asked.discard(name)
        link = self.out_links.get(msg.get("out"))
        if msg.get("type") == "queue_linked" and link is not None:
            self.dl_links[name] = link
        else:                                   # no such queue: copies for it are dropped
            for i, (record, targets) in enumerate(self.dl_pending):
                if name in targets:
                    self.dl_pending[i] = (record, [t for t in targets if t != name])

    # -- timing --------------------------------------------------------------------------
    def between_batches(self, now_ns: int) -> None:
        """Deliver between intake batches: with many publishers the in-links never run dry, and a
        queue that delivered only once a turn would take publishes far faster than it hands them on
        (RabbitMQ's queue process delivers as it takes each publish). Only with a consumer that has
        room. The room publishes were handed over against is read afresh only after such a pass:
        without one it has only shrunk by what they took, and a consumer that has read more since gets
        it with the next pass (with many publishers each link's batch is a few messages, and the room
        was read for each).

        What such a pass delivered goes out at once, not at the end of the turn: a turn through a
        hundred publishers' links lasts milliseconds, and a consumer's reader that saw its deliveries
        only then sat idle meanwhile, and so did a core (raw driver, 100 publishers, 100 B: the
        machine 13% idle, 93-97k msg/s; committed here, 4% idle, 110-113k). Without a backlog the
        turn's end commits them as before: committing after every batch then only woke the consumer's
        reader for smaller batches (one publisher: 6% fewer deliveries)."""
        if self.reader_links and self.core.ready:
            self.batch_room = None
            self.deliver_ready(now_ns)
            self.flush_links()

    def deliver_ready(self, now_ns: int) -> None:
        """Hand ready messages to consumers with room, then let the consumer bias weigh what is left."""
        room = self.room()
        core = self.core
        self.do(core.deliver(now_ns, room))
        ready = core.ready
        starved = False
        if ready:
            for link in self.delivery_links:
                if room.get(link.link_id, 1) <= 0 and not link.ring.congested:
                    starved = True
                    break
        bias = self.bias
        bias.assess(*core.flow_totals(), ready, starved)
        if self.bias_held and bias.may_take():
            self.bias_held = False
            self.backlog = True                 # publishes were left unread: come straight back for them

    def after_io(self, now_ns: int) -> None:
        self.batch_room = None
        core = self.core
        deadline = core.next_deadline_ns()
        if deadline is not None and now_ns >= deadline:
            self.do(core.expire(now_ns))
        self.deliver_ready(now_ns)
        if self.dl_pending:
            self.send_dead_letters()
        if self.journal is not None:
            self.journal_policy(now_ns)
        if self.paging:
            self.page_out(now_ns)
        if self.holding and any(a.pressure for a in self.arenas):
            self.copy_out_held(now_ns)
        if self.removes:
            if self.store_out is not None:
                self.store_out.put(wire.encode_ids(wire.Kind.REMOVE, self.removes))
            self.removes = []
        for peer, seqs in self.confirms.items():
            out = self.peer_out.get(peer)
            if out is not None:
                out.put(wire.encode_confirm(seqs))
        self.confirms.clear()
        for peer, seqs in self.nacks.items():
            out = self.peer_out.get(peer)
            if out is not None:
                out.put(wire.encode_control({"op": "nack", "seqs": seqs}))
        self.nacks.clear()
        self.give_back_memory(now_ns)

    def room(self) -> dict:
        """How many deliveries each consumer's reader link can take now: the ring's space and window."""
        room = {}
        size = self.record_bytes + DELIVERY_HEAD_BYTES
        # Bodies by reference go as loans, a few MiB of arena each hundred at 64 KiB: a reader that is
        # behind gets no more than LEND_IN_FLIGHT of them, and the rest wait here rather than going to
        # it by copy (a copy costs the queue three copies of the body and the reader one more; at
        # 64 KiB 1 -> 1 a tenth of the deliveries went so)
        window = LEND_IN_FLIGHT if self.holding else DELIVERY_WINDOW
        for link in self.delivery_links:
            if link.overflow:
                room[link.link_id] = 0
                continue
            ring = link.ring
            in_flight = ring.in_flight()
            by_space = ring.free_bytes() // size
            if not in_flight:
                by_space = max(1, by_space)        # into an empty ring even a message bigger than it goes
            room[link.link_id] = max(0, min(window - in_flight, by_space))
            if room[link.link_id] == 0:
                link.ring.writer_waiting = True     # its reader answers with a SPACE token once it reads
        return room

    def timeout_s(self, now_ns: int) -> float | None:
        waits = []
        if self.journal_full_since_ns is not None:
            waits.append((self.journal_retry_at_ns - now_ns) / 1e9)
        elif self.journal_first_unsynced_ns is not None:
            waits.append((self.journal_first_unsynced_ns + SYNC_INTERVAL_MS * 1_000_000 - now_ns) / 1e9)
        deadline = self.core.next_deadline_ns()
        if deadline is not None:
            waits.append((deadline - now_ns) / 1e9)
        if self.paging:
            waits.append(PAGE_ROUND_INTERVAL_NS / 1e9)
        if self.dl_pending and not self.alarms:
            waits.append(0.05)
        if self.reader_links and self.core.ready and self.core.consuming:
            waits.append(0.01)                  # covers a SPACE token lost in a race with a full ring
        return max(0.0, min(waits)) if waits else None

    def journal_policy(self, now_ns: int) -> None:
        """Group commit: fsync every SYNC_INTERVAL_MS while writes are pending, sooner when drained with
        confirms waiting (as the store does)."""
        if self.journal_acks:
            self.journal.ack(self.journal_acks)
            self.journal_acks = []
            if self.journal.full:
                self.journal_full()
            if self.journal_first_unsynced_ns is None:
                self.journal_first_unsynced_ns = now_ns
        if self.journal_full_since_ns is not None:
            if now_ns >= self.journal_retry_at_ns:
                if self.journal.retry():
                    self.log_lines([f"{self.name}: disk space is back: the held journal entries are on disk "
                                    f"after {(now_ns - self.journal_full_since_ns) / 1e9:.1f} s; reading again"])
                    self.journal_full_since_ns = None
                    self.journal_synced()
                    self.backlog = True
                else:
                    self.journal_retry_at_ns = now_ns + JOURNAL_RETRY_NS
            return
        if self.journal_first_unsynced_ns is None:
            return
        due = now_ns - self.journal_first_unsynced_ns >= SYNC_INTERVAL_MS * 1_000_000
        drained = self.unsafe and all(link.ring.statistics().used_bytes == 0 for link in self.in_links.values())
        if due or drained:
            self.sync_journal()

    # -- paging ---------------------------------------------------------------------------
    def page_out(self, now_ns: int) -> None:
        """One round: page out up to PAGE_BATCH_MESSAGES records, the faster-growing kind first."""
        if now_ns - self.last_page_round_ns < PAGE_ROUND_INTERVAL_NS:
            return
        self.last_page_round_ns = now_ns
        st = self.core.statistics()
        grew_msgs, grew_acks = st.messages_ready - self.page_sizes[0], st.messages_unacknowledged - self.page_sizes[1]
        kinds = [self.core.ready_newest_first, self.core.unacked_messages]
        if grew_acks > grew_msgs:
            kinds.reverse()
        quota = PAGE_BATCH_MESSAGES
        for source in kinds:
            for msg in source():
                if quota <= 0:
                    break
                if type(msg.payload) is Paged or msg.payload is None:
                    continue
                if type(msg.payload) is Held:
                    msg.payload = self.let_go(msg.payload)
                msg.payload = self.pages.write(msg.payload)
                quota -= 1
        self.page_sizes = (st.messages_ready, st.messages_unacknowledged)
        if quota < PAGE_BATCH_MESSAGES:
            self.paged_out += PAGE_BATCH_MESSAGES - quota
            self.trim(now_ns)
            self.dirty = True           # paged counts changed: the next statistics push says so

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
        waiting for it to empty. A backlog that has just emptied trims at once.
        """
        backlog = self.core.held
        if backlog > self.peak_messages:
            self.peak_messages = backlog
            self.drain_trim_owed |= backlog >= TRIM_MIN_PEAK_MESSAGES
            return
        if backlog == 0 and self.drain_trim_owed:
            self.trim(now_ns)
            self.drain_trim_owed = False
            self.peak_messages = 0
        elif (self.peak_messages >= TRIM_MIN_PEAK_MESSAGES
                and backlog <= self.peak_messages * (1 - TRIM_AFTER_FALL_FRACTION)
                and now_ns - self.last_trim_ns >= TRIM_MIN_INTERVAL_NS):
            self.trim(now_ns)
            self.peak_messages = backlog

    # -- operations from channels -----------------------------------------------------------
    def on_op(self, link, op: dict) -> None:
        self.batch_room = None              # a consumer may come or go
        kind = op.get("op")
        channel = link.peer
        out = self.peer_out.get(channel)
        now = time.monotonic_ns()
        core = self.core
        if core.deleted and kind in GONE_OPS and (kind != "declare" or op.get("passive")):
            refused = not_found_queue(self.queue)     # asked before the routing table said the queue is gone
            self.reply(out, {"op": "error", "code": refused.code, "text": refused.text, **GONE_OPS[kind]})
            return
        if self.owner is not None and op.get("reader", self.owner) != self.owner and kind in LOCKED_OPS:
            text = (f"RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{self.queue}' in vhost "
                    "'/'. It could be originally declared on another connection or the exclusive property value "
                    "does not match that of the original declaration.")
            if kind == "delete":
                control.send_msg(self.ctl, {"type": "delete_answer", "queue": self.queue, "req": None,
                                            "channel": channel, "ok": False, "code": 405, "text": text})
            else:
                self.reply(out, {"op": "error", "code": 405, **LOCKED_OPS[kind], "text": text})
            return
        if kind == "declare":
            core.touch(now)
            st = core.statistics()
            self.reply(out, {"op": "declare_ok", "queue": self.queue, "nowait": op.get("nowait", False),
                             "message_count": st.messages_ready, "consumer_count": st.consumers})
        elif kind == "consume":
            self.consume(channel, out, op, now)
        elif kind == "cancel":
            key = (channel, op["ctag"])
            actions = core.cancel(key, now)
            self.consumers.pop(key, None)
            self.consumers_changed()
            reader_link = self.reader_links.get(op["reader"])
            if reader_link is not None and not op.get("nowait"):
                reader_link.put(wire.encode_frames(frames.encode_reply(
                    op["channel"], commands.Basic.CancelOk, consumer_tag=op["ctag"])))
            self.done(out, reader_link)
            self.do(actions)
        elif kind == "get":
            reader_link = self.reader_links.get(op["reader"])
            if reader_link is None:
                self.reply(out, {"op": "error", "code": 541, "text": "INTERNAL_ERROR - no delivery link"})
                return
            self.channel_links[channel] = (reader_link, op["channel"])
            self.channel_reader[channel] = op["reader"]
            self.do(core.get(channel, now, no_ack=op["no_ack"]))
            self.done(out, reader_link)
        elif kind == "delete":
            self.delete({**op, "channel": channel})
        elif kind == "purge":
            count, actions = core.purge(now)
            self.do(actions)
            self.reply(out, {"op": "purge_ok", "message_count": count, "nowait": op.get("nowait", False)})
        elif kind == "qos_global":
            core.set_channel_prefetch(channel, op["count"])
        elif kind == "permits":
            core.grant(channel, op["count"])
        elif kind == "channel_closed":
            self.channel_closed(channel)
        elif kind == "recover":
            self.do(core.recover(channel, now))

    def consume(self, channel: str, out, op: dict, now: int) -> None:
        reader_link = self.reader_links.get(op["reader"])
        if reader_link is None:
            self.reply(out, {"op": "error", "code": 541, "text": "INTERNAL_ERROR - no delivery link"})
            return
        key = (channel, op["ctag"])
        if op.get("channel_prefetch"):
            self.core.set_channel_prefetch(channel, op["channel_prefetch"])
        try:
            self.core.consume(key, channel, now, no_ack=op["no_ack"], prefetch=op["prefetch"],
                                 priority=op.get("priority", 0), exclusive=bool(op.get("exclusive")),
                                 transport=reader_link.link_id)
        except QueueError as exc:
            self.reply(out, {"op": "error", "code": exc.reply_code, "text": exc.reply_text,
                             "class_id": BASIC_CONSUME[0], "method_id": BASIC_CONSUME[1]})
            return
        self.consumers[key] = ConsumerInfo(reader_link, op["channel"], op["ctag"], ConsumerDetail(
            consumer_tag=op["ctag"], channel=channel, channel_number=op["channel"], ack_required=not op["no_ack"],
            prefetch_count=int(op.get("prefetch") or 0), exclusive=bool(op.get("exclusive"))))
        self.consumers_changed()
        self.channel_reader[channel] = op["reader"]
        self.channel_links[channel] = (reader_link, op["channel"])
        if not op.get("nowait"):
            reader_link.put(wire.encode_frames(frames.encode_reply(
                op["channel"], commands.Basic.ConsumeOk, consumer_tag=op["ctag"])))
        self.done(out, reader_link)

    def consumers_changed(self) -> None:
        self.delivery_links = tuple({c.link.link_id: c.link for c in self.consumers.values()}.values())

    def channel_closed(self, channel: str) -> None:
        """A channel closed (or its process or connection went): its consumers go, its unacked come back."""
        for key in [k for k in self.consumers if k[0] == channel]:
            del self.consumers[key]
        self.consumers_changed()
        self.channel_links.pop(channel, None)
        self.channel_reader.pop(channel, None)
        self.do(self.core.channel_closed(channel, time.monotonic_ns()))

    def delete(self, msg: dict) -> None:
        """queue.delete, from a channel (over its ring) or the supervisor: check if-unused/if-empty,
        forget everything, and tell the supervisor, which answers the channel once the queue is gone."""
        answer = {"type": "delete_answer", "queue": self.queue, "req": msg.get("req"), "channel": msg.get("channel")}
        try:
            count, actions = self.core.delete(time.monotonic_ns(), if_unused=msg.get("if_unused", False),
                                              if_empty=msg.get("if_empty", False))
        except QueueError as exc:
            control.send_msg(self.ctl, {**answer, "ok": False, "code": exc.reply_code, "text": exc.reply_text})
            return
        self.do(actions)
        self.consumers.clear()
        self.consumers_changed()
        if self.journal is not None:
            self.journal_policy(time.monotonic_ns())
        control.send_msg(self.ctl, {**answer, "ok": True, "message_count": count})

    def done(self, out, reader_link) -> None:
        """Tell the channel its operation is answered, after the answer the reader sends is committed:
        the reader handles what a queue committed before what the channel then sends, so the client
        sees the answers in the order it asked."""
        if reader_link is not None:
            reader_link.flush()
        self.reply(out, {"op": "done"})

    def reply(self, out, msg: dict) -> None:
        if out is not None:
            out.put(wire.encode_control(msg))

    def shutdown(self) -> None:
        if self.pages is not None:
            self.pages.close()
        if self.journal is not None:
            if self.journal_acks:
                self.journal.ack(self.journal_acks)
            self.journal.close()
        super().shutdown()

    def consumer_details(self) -> tuple[tuple[ConsumerDetail, ...], int | None]:
        """The first ``CONSUMER_DETAILS_KEPT`` consumers, and how many were left out (None: none)."""
        kept = tuple(itertools.islice((c.detail for c in self.consumers.values() if c.detail is not None),
                                      CONSUMER_DETAILS_KEPT))
        if self.args.single_active_consumer:
            holder = self.core.single_active_consumer
            kept = tuple(d if (d.channel, d.consumer_tag) == holder else dataclasses.replace(d, active=False)
                         for d in kept)
        left = len(self.consumers) - len(kept)
        return kept, (left if left > 0 else None)

    def statistics(self, now_ns: int) -> QueueStats:
        st = self.core.statistics()
        details, omitted = self.consumer_details()
        return QueueStats(
            **self.stage_fields(now_ns), queue=self.queue, durable=self.durable, messages=st.messages_ready,
            journal_full=self.journal_full_since_ns is not None, unacked=st.messages_unacknowledged,
            message_bytes=st.message_bytes_ready, consumers=st.consumers, enqueued=st.published + st.restored,
            delivered=st.delivered, redelivered=st.redelivered, acked=st.acked, expired=st.expired,
            dead_lettered=st.dead_lettered, dropped=st.dropped, rejected=st.rejected, purged=st.purged,
            stored=self.stored, awaiting_confirm=st.unconfirmed, recovered=self.recovered, paging=self.paging,
            paged_messages=self.pages.count if self.pages else 0, paged_out=self.paged_out,
            paged_in=self.paged_in, store_resent=self.store_resent, journal_fsyncs=self.journal_fsyncs,
            dead_letters_sent=self.dl_sent, dead_letter_cycles=self.dl_cycles, consumer_bias=self.bias.active,
            consumer_bias_engaged=self.bias.engaged, bodies_lent=self.bodies_lent,
            bodies_sent_by_copy=self.bodies_sent_by_copy, consumer_details=details,
            consumer_details_omitted=omitted, single_active_consumer_tag=self.single_active_consumer_tag())

    def single_active_consumer_tag(self) -> str | None:
        holder = self.core.single_active_consumer          # (channel, consumer tag)
        return None if holder is None else holder[1]
