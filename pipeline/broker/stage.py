"""The loop every broker stage runs: wait, read, feed the core, write what it returns.

A stage process owns three endpoints, all created by the supervisor:

* a **doorbell** (eventfd) that any sender rings after committing records to
  one of this stage's inbound rings;
* an **inbox** pipe for tokens (credit bumps, ring space, peer_down, alarms);
* a **control** socket to the supervisor (JSON, with fds for new links).

Links are one-way: an :class:`OutLink` writes records into a ring and rings
the peer's doorbell; the matching :class:`InLink` reads them and answers with
tokens on the sender's inbox. Credit is counted per link id on both ends, so
``CreditFlow`` keys are link ids. A stage sleeps in ``select`` until one of
its endpoints has something; it pushes ``statistics`` to the supervisor at
most every ``STATS_INTERVAL_MS`` while busy, at once on a block or unblock
that changes the state the supervisor shows (``process_states.push_due_ns``;
at most every ``STATE_PUSH_MIN_MS``), and once more when it goes idle.
``statistics`` returns the stage's frozen dataclass of
:mod:`pipeline.telemetry.schema` (``StageStats`` and a subclass per kind);
the message is its ``to_dict()``, cut to the busiest links when it would
not fit a control message (``busiest_links``).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import select
import selectors
import time

from ipc import control, peers, shm, tokens
from ipc.credit import CreditFlow, CreditSpec
from ipc.doorbell import Doorbell
from ipc.errors import PeerGone, WouldBlock
from ipc.tokens import Kind as TokenKind
from pipeline.broker import collector, process_states
from pipeline.telemetry.schema import LinkStats, StageStats

STATS_INTERVAL_MS = 100
# A block/unblock that changes the state shown is pushed at once, but not more often than this. A reader
# whose credit runs out and comes back many times a second (1 -> 1 unpaced) so wakes the supervisor up to
# 100 times a second, about 3% of the CPU per message (100 ms: 14.7 us per message in all against 15.2,
# creditflow bench, 3 interleaved runs each); kept at 10 ms because each push is a point of the states
# timeline, and a reader's flow (shown only while it is credit-blocked, as RabbitMQ's) would be timed to
# 100 ms. Other stages show flow for a second after a block began, so their blocks within it change
# nothing shown and are not pushed at once (process_states.push_due_ns).
STATE_PUSH_MIN_MS = 10
IDLE_CHECK_S = 0.05             # safety net for a doorbell skipped in a race (see OutLink.flush)
TRIM_AFTER_RECORDS = 256       # an idle stage that handled this many records since its last trim trims: few,
                               # as between trims its heap keeps up to HEAP_TRIM_THRESHOLD_BYTES (keep_heap_mapped)
TRIM_INTERVAL_NS = 1_000_000_000
# every this many bytes a stage writes to disk, the watchdog measures free disk at once: the disk alarm
# then blocks publishers before the disk fills however fast it is written (its poll assumes 250 MB/s)
DISK_NUDGE_BYTES = 1024 * 1024


STATS_LINKS_KEPT = 100          # a snapshot too big for a control message keeps this many links


def busiest_links(stats: StageStats, keep: int) -> StageStats:
    """``stats`` with only the ``keep`` links that have the most in flight (then the most ever in
    flight); ``links_omitted`` says how many were left out."""
    links = stats.links
    kept = sorted(links.items(), key=lambda kv: (-kv[1].in_flight, -kv[1].max_in_flight, kv[0]))[:keep]
    return dataclasses.replace(stats, links=dict(kept), links_omitted=len(links) - len(kept))


def _load_libc(name: str):
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


malloc_trim = _load_libc("malloc_trim")
_mallopt = _load_libc("mallopt")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_TRIM_THRESHOLD_BYTES = 32 * 1024 * 1024
HEAP_MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def give_back_heap() -> bool:
    """Return freed glibc heap pages to the OS (message bodies over 512 bytes live there)."""
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def keep_heap_mapped() -> bool:
    """Stop glibc from handing the heap's top back to the OS on every ``free``.

    By default glibc trims the heap whenever 128 KiB (or twice its last big
    mapping) lie free at its top, and a stage that copies 64 KiB records in
    and out of its rings frees that much many times a second: every trim is
    paid for by page faults on the next allocation (over 100,000 a second in
    a consuming reader once bodies went inline). Here the heap keeps up to
    HEAP_TRIM_THRESHOLD_BYTES free at its top and only allocations of
    HEAP_MMAP_THRESHOLD_BYTES or more get mappings of their own. Memory
    still goes back when it matters: stages and queues call ``malloc_trim``
    themselves when idle and as a backlog drains (``give_back_heap``)."""
    if _mallopt is None:
        return False
    return bool(_mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD_BYTES)
                and _mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD_BYTES))


OVERFLOW_RETRY_MS = 5
HAND_ON_LIMIT_NS = 30_000_000_000   # an exiting stage waits this long for receivers to take its overflow
READ_BATCH_RECORDS = 256
FRAGMENT = 12                      # wire.Kind.FRAGMENT: a piece of a record too big for one ring slot
FRAGMENT_HEAD_BYTES = 2            # kind, last
FRAGMENT_MAX_BYTES = 1024 * 1024
_FRAGMENT_MORE, _FRAGMENT_LAST = bytes((FRAGMENT, 0)), bytes((FRAGMENT, 1))
TURN_NS = 1_000_000          # a stage with a per-record delay still hands on its output every ~1 ms
TURN_BUDGET_NS = 5_000_000   # at most this long reading in-links before the rest of a turn runs
STOP_DRAIN_NS = 1_000_000_000


def read_batch_for(delay_ns: int) -> int:
    """Records a stage handles per batch when each costs ``delay_ns`` (the delay knobs)."""
    if delay_ns <= 0:
        return READ_BATCH_RECORDS
    return max(1, min(READ_BATCH_RECORDS, TURN_NS // delay_ns))


def close_end(link) -> None:
    """Unmap one end of a link (an OutLink or an InLink) and give back its peer's endpoints, once:
    other links to the same peer may still use them."""
    try:
        link.segment.close()
    except OSError:
        pass
    if link.endpoints is not None:
        peers.ENDPOINTS.give_back(link.endpoints)
        link.endpoints = None


class OutLink:
    """Sending end of one ring. Records that do not fit wait in ``overflow``
    (this process's memory, like a growing Erlang mailbox) until the receiver
    frees space."""

    __slots__ = ("link_id", "peer", "peer_holder", "segment", "ring", "doorbell", "inbox", "endpoints", "flow",
                 "overflow", "staged", "records", "messages", "fragment_bytes")

    def __init__(self, link_id: int, peer: str, ring_name: str, ring_fd: int, peer_inbox_fd: int,
                 peer_doorbell_fd: int, flow: bool):
        self.link_id = link_id
        self.peer = peer
        self.peer_holder = 0
        self.segment, self.ring = shm.attach_ring(ring_name, ring_fd)
        self.endpoints, self.inbox, self.doorbell = peers.ENDPOINTS.take(peer_inbox_fd, peer_doorbell_fd)
        self.flow = flow
        self.overflow: collections.deque = collections.deque()
        self.staged = 0
        self.records = 0       # every record put on this link
        self.messages = 0      # the credit-bearing ones (publishes, store writes)
        self.fragment_bytes = min(FRAGMENT_MAX_BYTES, self.ring.max_record_bytes - FRAGMENT_HEAD_BYTES)

    def put_message(self, record) -> None:
        """Put a record that costs credit (the caller spends it with ``CreditFlow.send``)."""
        self.messages += 1
        self.put(record)

    def put(self, record) -> None:
        self.records += 1
        if len(record) > self.fragment_bytes:
            self.put_fragments(record)
            return
        if not self.overflow:
            try:
                self.ring.write_nowait(record)
                self.staged += 1
                return
            except WouldBlock:
                self.ring.writer_waiting = True
        self.overflow.append(record)

    def put_fragments(self, record) -> None:
        """A record too big for one ring slot goes as FRAGMENT records the receiving link joins."""
        view = memoryview(record)
        step = self.fragment_bytes
        for start in range(0, len(view), step):
            last = start + step >= len(view)
            piece = _FRAGMENT_LAST + view[start:start + step].tobytes() if last else \
                _FRAGMENT_MORE + view[start:start + step].tobytes()
            if not self.overflow:
                try:
                    self.ring.write_nowait(piece)
                    self.staged += 1
                    continue
                except WouldBlock:
                    self.ring.writer_waiting = True
            self.overflow.append(piece)

    def flush(self) -> None:
        overflow = self.overflow
        if overflow:
            ring = self.ring
            try:
                while overflow:
                    ring.write_nowait(overflow[0])
                    overflow.popleft()
                    self.staged += 1
            except WouldBlock:
                pass
            if not overflow:
                ring.writer_waiting = False
        if self.staged:
            ring = self.ring
            before = ring.records_committed()
            ring.commit()
            self.staged = 0
            # Ring only if the receiver had read everything before this commit: then it may be
            # asleep. Otherwise it has records of ours still to read and will poll this ring again.
            if ring.records_released() >= before:
                try:
                    self.doorbell.ring()
                except OSError:
                    pass

    def close(self) -> None:
        close_end(self)


class InLink:
    """Receiving end of one ring; answers the sender on its inbox pipe."""

    __slots__ = ("link_id", "peer", "peer_holder", "segment", "ring", "inbox", "endpoints", "flow", "received",
                 "pieces", "more")

    def __init__(self, link_id: int, peer: str, ring_name: str, ring_fd: int, peer_inbox_fd: int, flow: bool):
        self.link_id = link_id
        self.peer = peer
        self.peer_holder = 0
        self.segment, self.ring = shm.attach_ring(ring_name, ring_fd)
        self.endpoints, self.inbox, _ = peers.ENDPOINTS.take(peer_inbox_fd)
        self.flow = flow
        self.received = 0
        self.pieces: list = []     # the fragments of a record still arriving
        self.more = False          # the last read took a full batch: there may be more

    def read(self, max_records: int = READ_BATCH_RECORDS) -> list:
        records = self.ring.read_batch(max_records)
        self.more = len(records) == max_records
        if records:
            self.received += len(records)
            if self.ring.writer_waiting:
                self.token(TokenKind.SPACE, 0)
            for r in records:
                if r[0] == FRAGMENT:
                    return self.join(records)
        return records

    def join(self, records: list) -> list:
        """Whole records, with fragments joined (the last, unfinished one kept for the next read)."""
        out = []
        pieces = self.pieces
        for r in records:
            if r[0] != FRAGMENT:
                out.append(r)
                continue
            pieces.append(memoryview(r)[FRAGMENT_HEAD_BYTES:])
            if r[1]:
                out.append(b"".join(pieces))
                pieces.clear()
        return out

    def token(self, kind, value: int) -> None:
        try:
            self.inbox.send(kind, self.link_id, value)
        except PeerGone:
            pass

    def close(self) -> None:
        close_end(self)


def own_selector(stage) -> selectors.BaseSelector:
    return selectors.DefaultSelector()


class Stage:
    """Base class of reader, channel, queue and store processes.

    A stage runs either as a process of its own (``run``) or as one of many in a
    shared process (``pipeline.broker.host``), which sets ``selector_for`` to hand each
    stage its view of the one selector and drives ``wait_timeout``, ``on_endpoint``
    and ``turn`` itself. Nothing a stage does may wait: a hosted stage that
    waited would hold up every other stage of its process."""

    kind = "stage"
    selector_for = staticmethod(own_selector)
    hosted = False

    def __init__(self, name: str, ctl_sock, inbox_fd: int, doorbell_fd: int,
                 credit_spec: CreditSpec):
        self.name = name
        self.ctl = ctl_sock
        self.inbox = tokens.TokenReader(inbox_fd)
        self.doorbell = Doorbell(doorbell_fd)
        self.credit = CreditFlow(credit_spec)
        # credit-bearing records received and not yet acked to the credit core: a stage counts them
        # as it handles them and acks them once a batch (settle_owed), not once a record
        self.owed = 0
        self.owed_from: int | None = None       # the in-link they came on
        self.batch_ns = 0                       # the clock at the batch being handled (0: outside poll_links)
        self.credit.before_block = self.settle_owed
        self.out_links: dict[int, OutLink] = {}
        self.in_links: dict[int, InLink] = {}
        self.selector = Stage.selector_for(self)
        self.selector.register(self.doorbell.fileno(), selectors.EVENT_READ, "doorbell")
        self.selector.register(self.inbox.fileno(), selectors.EVENT_READ, "inbox")
        self.selector.register(self.ctl.fileno(), selectors.EVENT_READ, "ctl")
        self.running = True
        self.stopping_since_ns: int | None = None
        self.exit_code = 0
        self.dirty = True
        self.last_stats_ns = 0
        self.told = (False, None)    # block_facts() at the last push: what the supervisor shows comes from them
        self.facts = self.told       # block_facts() at the last turn
        self.state_due_ns = None     # when a push is owed to keep the supervisor's state true (None: none)
        self.started_ns = time.monotonic_ns()
        self.handled_since_trim = 0
        self.last_trim_ns = 0
        self.read_batch = READ_BATCH_RECORDS
        self.stats_interval_ns = STATS_INTERVAL_MS * 1_000_000
        self.backlog = False         # the last turn left records unread: do not sleep
        # turns that found nothing on any in-link since records last came. A doorbell can only be
        # skipped while this stage is finishing a read (OutLink.flush); once one quiet turn has polled
        # every ring after that, each later commit finds it all released and rings: an idle stage
        # then sleeps until something happens instead of polling every IDLE_CHECK_S
        self.quiet_turns = 0
        self.disk_written = 0        # bytes written to disk since the watchdog was last nudged
        self.trims = 0
        self.holder = 0              # this stage's id in body arenas (pipeline.broker.bodies); 0: none

    # -- hooks for subclasses ------------------------------------------------
    def on_record(self, link: InLink, record) -> None:
        raise NotImplementedError

    def on_control(self, msg: dict, fds: list[int]) -> None:
        pass

    def on_link_attached(self, link) -> None:
        pass

    def on_peer_down(self, link_id: int, reason: str) -> None:
        """The link ``link_id`` is gone (already removed from the link tables)."""

    def on_ready(self, tag) -> None:
        """An extra fd registered by the subclass is ready (``tag``: what it was registered with)."""

    def after_io(self, now_ns: int) -> None:
        """Called once per loop turn after inbound records were handled."""

    def timeout_s(self, now_ns: int) -> float | None:
        """Subclass deadline (seconds from now) or None."""
        return None

    # -- plumbing --------------------------------------------------------------
    def owe(self, link_id: int) -> None:
        """Count one credit-bearing record from ``link_id``; settle_owed acks the count to the core."""
        if link_id == self.owed_from:
            self.owed += 1
            return
        if self.owed:
            self.settle_owed()
        self.owed_from = link_id
        self.owed = 1

    def settle_owed(self) -> None:
        """Ack what was counted to the credit core, and send the grants that fall due. Called after
        each batch, before tokens are read (a bump may unblock), and by the core just before a send
        blocks: so every grant is made or deferred exactly as acking each record would."""
        n = self.owed
        if n:
            self.owed = 0
            self.send_grants(self.credit.ack(self.owed_from, n))

    def send_grants(self, grants) -> None:
        for grant in grants:
            link = self.in_links.get(grant.to)
            if link is not None:
                link.token(TokenKind.BUMP, grant.amount)

    def attach(self, msg: dict, fds: list[int]) -> None:
        """A link the supervisor made: ``fds`` are the ring's descriptor, then the peer's inbox (and, to
        the sender, its doorbell). The ring comes as a descriptor, so what a peer wrote and then ended
        is read here even if its name was unlinked before this attach arrived. A failure (out of
        memory) raises: this stage cannot go on without the link, and is handled as a death, never
        left to drop what it was sent."""
        spec = msg.get("spec")
        if msg["role"] == "out":
            link = OutLink(msg["link"], msg["peer"], msg["ring"], *fds[:3], msg["flow"])
            self.out_links[link.link_id] = link
        else:
            link = InLink(msg["link"], msg["peer"], msg["ring"], *fds[:2], msg["flow"])
            self.in_links[link.link_id] = link
        link.peer_holder = msg.get("peer_holder", 0)       # its id in body arenas (pipeline.broker.bodies)
        if spec:
            self.credit.set_peer_spec(link.link_id, CreditSpec(*spec))
        self.on_link_attached(link)

    def detach(self, link_id: int, now_ns: int, reason: str = "closed") -> None:
        """The process at the other end of ``link_id`` is gone: ``reason`` is "closed" (it ended as it
        should) or "crashed" (it died, or was killed)."""
        self.settle_owed()      # before peer_down forgets the link's count
        gone = self.in_links.get(link_id) or self.out_links.get(link_id)
        if gone is not None:
            # what the peer sent before it went away is still ours to handle, on every ring from it: a
            # queue told that its ring to a channel is down must first take the acks on the channel's
            # ring to it, or the channel's close would put back messages the client had acked
            for inbound in [link for link in self.in_links.values() if link.peer == gone.peer]:
                self.drain(inbound)
        self.send_grants(self.credit.peer_down(link_id, now_ns))
        for links in (self.out_links, self.in_links):
            link = links.pop(link_id, None)
            if link is not None:
                link.close()
        self.on_peer_down(link_id, reason)
        self.dirty = True

    def drain(self, inbound: InLink) -> None:
        """Handle every record waiting on ``inbound``."""
        while (records := inbound.read()) or inbound.more:
            for record in records:
                self.on_record(inbound, record)
            self.settle_owed()

    def handle_tokens(self, now_ns: int) -> None:
        self.settle_owed()      # a bump read now may unblock: what came before it is acked first
        try:
            toks = self.inbox.read_nowait()
        except WouldBlock:
            return
        except PeerGone:
            self.running = False
            return
        for tok in toks:
            self.on_token(tok, now_ns)
        self.dirty = True

    def on_token(self, tok, now_ns: int) -> None:
        if tok.kind == TokenKind.BUMP:
            self.send_grants(self.credit.handle_bump(tok.link, tok.value, now_ns))
        elif tok.kind == TokenKind.SPACE:
            pass  # the flush at the end of this turn retries the overflow
        elif tok.kind == TokenKind.PEER_DOWN:
            self.detach(tok.link, now_ns)
        elif tok.kind == TokenKind.STOP:
            self.running = False

    def handle_control(self) -> None:
        while True:
            try:
                msg, fds = control.recv_msg_nowait(self.ctl)
            except WouldBlock:
                return
            except PeerGone:
                self.running = False
                self.exit_code = 0
                return
            kind = msg.get("type")
            if kind == "attach":
                self.attach(msg, fds)
            elif kind == "detach":
                self.detach(msg["link"], time.monotonic_ns(), msg.get("reason", "closed"))
            elif kind == "stop":
                self.on_stop()
            else:
                self.on_control(msg, fds)

    def on_stop(self) -> None:
        """Stop once every inbound ring is empty (what was sent to us is still handled)."""
        self.stopping_since_ns = time.monotonic_ns()

    def poll_links(self, now_ns: int) -> int:
        """Handle what the in-links hold. Between full batches the out-links are committed and
        credit bumps read, as Erlang processes interleave: a slow stage's receivers see its
        output and grant credit back while it works through a backlog, so only the stage that
        is really behind runs out of credit."""
        self.batch_ns = now_ns
        try:
            return self.read_in_links(now_ns)
        finally:
            self.batch_ns = 0

    def read_in_links(self, now_ns: int) -> int:
        """``poll_links``'s loop; ``batch_ns`` is the clock at the batch in hand, read once a batch (what
        a record's handling takes for "now" instead of reading the clock itself)."""
        handled = 0
        batch = self.read_batch
        for link in list(self.in_links.values()):
            while link.link_id in self.in_links and self.wants_records(link) and self.can_read_more():
                records = link.read(batch)
                if not records:
                    if link.more:
                        continue           # a batch of fragments, none of its record finished yet
                    break
                handled += len(records)
                for record in records:
                    self.on_record(link, record)
                self.settle_owed()
                self.between_batches(now_ns)
                if not link.more or not self.can_read_more():
                    break
                if batch < READ_BATCH_RECORDS:
                    self.flush_links()     # a slow stage: show the receivers what it has done
                self.batch_ns = now = time.monotonic_ns()
                self.handle_tokens(now)
                if now - now_ns >= TURN_BUDGET_NS:
                    # A sender that never lets up must not starve the rest of the turn (a queue's
                    # deliveries, the other links): finish the turn and come straight back.
                    self.backlog = True
                    break
        return handled

    def can_read_more(self) -> bool:
        return True

    def deliveries_waiting(self) -> bool:
        """Whether deliveries wait in this stage's rings for it (a host gives such stages extra turns)."""
        return False

    def between_batches(self, now_ns: int) -> None:
        """After each batch read from an in-link: work that must not wait for the end of the turn
        (a queue's deliveries, as a gen_server interleaves them with its mailbox)."""

    def wants_records(self, link) -> bool:
        """Whether to read ``link`` now (a channel waiting on an answer leaves its reader's ring alone)."""
        return True

    def block_facts(self):
        """What the state the supervisor shows for this stage is computed from."""
        credit = self.credit
        return credit.blocked, credit.block_started_ns

    def state_push_due(self, told, facts, now_ns: int):
        """When a push is owed so that the supervisor, told ``told``, shows the state ``facts`` give."""
        return process_states.push_due_ns(told, facts, now_ns)

    def flush_links(self) -> None:
        for link in self.out_links.values():
            if link.staged or link.overflow:
                link.flush()

    def statistics(self, now_ns: int) -> StageStats:
        """This stage's snapshot: a subclass returns its kind's class, built on ``stage_fields``."""
        return StageStats(**self.stage_fields(now_ns))

    def stage_fields(self, now_ns: int) -> dict:
        """The fields of :class:`StageStats` every stage has, as keyword arguments."""
        cs = self.credit.statistics(now_ns)
        links = {}
        for link in self.out_links.values():
            rs = link.ring.statistics()
            links[f"{self.name}->{link.peer}"] = LinkStats(
                sent=link.messages, records=link.records, in_flight=rs.in_flight + len(link.overflow),
                max_in_flight=rs.max_in_flight, overflow=len(link.overflow),
                credit=self.credit.credit_towards(link.link_id) if link.flow else None)
        return dict(name=self.name, kind=self.kind, pid=os.getpid(), at_ns=now_ns, state=cs.state,
                    blocked=cs.blocked, block_started_ns=cs.block_started_ns,
                    blocked_total_ns=cs.blocked_total_ns, block_count=cs.block_count,
                    deferred_grants=cs.deferred_grants, trims=self.trims,
                    blocked_by=tuple(self._peer_of(key) for key in cs.blocked_by), links=links)

    def _peer_of(self, link_id) -> str:
        link = self.out_links.get(link_id) or self.in_links.get(link_id)
        return link.peer if link is not None else str(link_id)

    def push_stats(self, now_ns: int) -> None:
        stats = self.statistics(now_ns)
        try:
            try:
                control.send_msg(self.ctl, {"type": "stats", **stats.to_dict()})
            except control.MessageTooLarge:      # links to hundreds of queues: keep the busiest
                control.send_msg(self.ctl, {"type": "stats", **busiest_links(stats, STATS_LINKS_KEPT).to_dict()})
        except (OSError, PeerGone):
            self.running = False
        self.last_stats_ns = now_ns
        self.told = self.facts = self.block_facts()
        self.state_due_ns = None

    def run(self) -> int:
        """A process of its own: sleep in select until an endpoint is ready, then take a turn."""
        select = self.selector.select
        collect = collector.install()
        while self.running:
            now = time.monotonic_ns()
            collect(now)
            for key, _ in select(self.wait_timeout(now)):
                self.on_endpoint(key.data)
            self.turn()
        self.shutdown()
        return self.exit_code

    def wait_timeout(self, now: int) -> float | None:
        """How long this stage may sleep before its next turn (None: until an endpoint is ready)."""
        timeout = self.timeout_s(now)
        if self.dirty:
            due = (self.last_stats_ns + self.stats_interval_ns - now) / 1e9
            timeout = max(0.0, due) if timeout is None else min(timeout, max(0.0, due))
        if self.state_due_ns is not None:
            due = (max(self.state_due_ns, self.last_stats_ns + STATE_PUSH_MIN_MS * 1_000_000) - now) / 1e9
            timeout = max(0.0, due) if timeout is None else min(timeout, max(0.0, due))
        if self.stopping_since_ns is not None:
            timeout = 0.0 if timeout is None else min(timeout, 0.01)
        if self.in_links and self.quiet_turns < 1:
            timeout = IDLE_CHECK_S if timeout is None else min(timeout, IDLE_CHECK_S)
        elif self.handled_since_trim >= TRIM_AFTER_RECORDS:     # a trim is owed: wake for it
            due = max(IDLE_CHECK_S, (self.last_trim_ns + TRIM_INTERVAL_NS - now) / 1e9)
            timeout = due if timeout is None else min(timeout, due)
        if self.backlog:
            timeout = 0.0
        if any(link.overflow for link in self.out_links.values()):
            retry = OVERFLOW_RETRY_MS / 1000
            timeout = retry if timeout is None else min(timeout, retry)
        return timeout

    def on_endpoint(self, tag) -> None:
        """One of this stage's endpoints is ready (``tag`` is what it was registered with)."""
        if tag == "doorbell":
            try:
                self.doorbell.drain_nowait()
            except WouldBlock:
                pass
        elif tag == "inbox":
            self.handle_tokens(time.monotonic_ns())
        elif tag == "ctl":
            self.handle_control()
        else:
            self.on_ready(tag)

    def turn(self) -> None:
        """Read the in-links, let the subclass act, hand on the output, push statistics when due."""
        now = time.monotonic_ns()
        self.backlog = False
        handled = self.poll_links(now)
        self.settle_owed()      # records replayed outside a batch (a channel's, once its queue is linked)
        self.after_io(now)
        self.flush_links()
        if handled:
            self.dirty = True
            self.handled_since_trim += handled
            self.quiet_turns = 0
        else:
            self.quiet_turns += 1
            if self.handled_since_trim >= TRIM_AFTER_RECORDS and now - self.last_trim_ns >= TRIM_INTERVAL_NS:
                self.trim(now)
        facts = self.block_facts()
        if facts != self.facts:
            self.facts = facts
            self.state_due_ns = self.state_push_due(self.told, facts, now)
        due = self.state_due_ns     # a push owed to the state shown waits STATE_PUSH_MIN_MS at most, whatever the interval
        if due is not None and now >= due and now - self.last_stats_ns >= STATE_PUSH_MIN_MS * 1_000_000:
            self.push_stats(now)
            self.dirty = False
        elif self.dirty and now - self.last_stats_ns >= self.stats_interval_ns:
            self.push_stats(now)
            self.dirty = False
        if self.stopping_since_ns is not None and (
                not handled or now - self.stopping_since_ns > STOP_DRAIN_NS):
            self.running = False

    def trim(self, now_ns: int) -> None:
        """Idle after heavy traffic: give freed memory back so the memory alarm sees it go."""
        if give_back_heap():
            self.trims += 1
        self.handled_since_trim = 0
        self.last_trim_ns = now_ns

    def hand_on_overflow(self) -> None:
        """Before exiting, pass on what waits in out-link overflow: records this stage has accepted
        (with credit off a reader or channel can hold many thousands) are not dropped because its
        connection or channel closed. Gives up on a receiver that frees no space for
        ``HAND_ON_LIMIT_NS`` (and says how many records that lost); a receiver that dies is
        detached by its peer_down token."""
        deadline = time.monotonic_ns() + (0 if self.hosted else HAND_ON_LIMIT_NS)   # a host has waited already
        while True:
            self.flush_links()
            waiting = self.overflowing()
            if not waiting:
                return
            now = time.monotonic_ns()
            if now >= deadline:
                self.log_lines([f"{self.name}: exiting with {waiting} records its receivers never took"])
                return
            select.select([self.inbox.fileno()], [], [], OVERFLOW_RETRY_MS / 1000)   # a SPACE token, or retry
            self.handle_tokens(time.monotonic_ns())

    def overflowing(self) -> int:
        """Records still waiting in out-link overflow for their receivers to free ring space."""
        return sum(len(link.overflow) for link in self.out_links.values())

    def wrote_to_disk(self, nbytes: int) -> None:
        self.disk_written += nbytes
        if self.disk_written >= DISK_NUDGE_BYTES:
            self.disk_written = 0
            try:
                control.send_msg(self.ctl, {"type": "disk_written"})
            except OSError:
                pass

    def log_lines(self, lines: list[str]) -> None:
        try:
            control.send_msg(self.ctl, {"type": "log", "level": "warning", "lines": lines})
        except OSError:
            pass

    def shutdown(self) -> None:
        self.hand_on_overflow()
        try:
            self.push_stats(time.monotonic_ns())
        except Exception:
            pass
        for link in list(self.out_links.values()) + list(self.in_links.values()):
            link.close()
