"""One classic queue's messages and consumers, sans-IO: RabbitMQ 3.10's ``deliver_or_enqueue`` and what follows.

The queue process is a shell around one :class:`Backlog`. It feeds the core
what happened (a publish, a consume, an ack, a channel that closed, the time)
and does what the core returns: a list of actions, in order. The core never
touches a ring, a file or a clock; time comes in as monotonic nanoseconds::

    publish ──▶ [refused?] ──▶ [a consumer with room?] ──yes──▶ Deliver
                  │ Nack                  │ no
                  ▼                       ▼
               Forget /             ready (per priority: requeued heap + fresh deque)
               DeadLetter             │ head expired / over max-length ──▶ DeadLetter / Forget
                                      ▼
                           deliver(room) / get ──▶ unacked (per channel) ──ack──▶ Forget
                                      ▲                    │ requeue, recover, channel
                                      └────────────────────┘ closed: back by id

*Ready messages* are kept in id order within each priority level, as
rabbit_variable_queue keeps them by sequence id: a message put back (reject
or nack with requeue, ``basic.recover``, its channel closing) goes ahead of
every later one, whatever order or how often it comes back. Every removal
from ready takes the *head* (the oldest message of the highest non-empty
priority), so each put-back message is older than every message that was
never delivered: a level is a heap of put-back messages, all older than a
deque of fresh ones. Publishing appends, delivering pops; only a put-back
pays for the heap.

*Delivery* goes to consumers in RabbitMQ's order: the highest ``x-priority``
first, round-robin within a priority. A consumer that cannot take a message
leaves the rotation and rejoins at the back when the reason goes: its own
prefetch (``basic.qos`` per consumer, acks only), its channel's limit
(``basic.qos global=true``, counted across all the channel's queues by the
reader's ``limiter.ChannelLimit``: the queue delivers only while it holds a
permit, spends one per delivery needing an ack, asks for more with
``AskPermits`` and hands back what it cannot use with ``ReturnPermits``; as
RabbitMQ's limiter, it holds no-ack consumers too), or no room on
its transport. Room is the shell's knowledge: ``deliver`` and ``publish``
take a dict ``transport -> deliveries it can take now`` and spend it
(``None``: unlimited). A message is checked at the head before each delivery
and never delivered once expired, except straight at its publish (TTL 0 to
a waiting consumer, as RabbitMQ delivers it).

*Endings.* Every message taken in ends exactly once, with one of: a
``Deliver``/``GetOk`` with ``no_ack``, a ``Forget`` (ack, expiry or
max-length without a DLX, reject without requeue, purge, delete, refusal),
or a ``DeadLetter`` (a copy goes to the DLX; the original is gone). On any
of them the shell drops what it keeps for the message (journal entry, store
body). A publisher is confirmed once: at publish if the shell says the
message is ``safe`` (transient, or a non-durable queue), else when the shell
reports it safe (``mark_safe``, after fsync) or when the queue is done with
it, whichever comes first, as RabbitMQ confirms a message dropped before it
reached the disk. A publish refused by ``reject-publish*`` is nacked.

A message's life (one table, every transition)::

    state     event                                          next      action
    --------  ---------------------------------------------  --------  ----------------------------------
    new       publish over a reject-publish(-dlx) limit      gone      Nack, Forget(rejected) | DeadLetter(maxlen)
    new       publish, ready empty, a consumer can take it   unacked   Deliver   (no_ack: gone, acked)
    new       publish, x-message-ttl 0, no DLX               gone      Forget(expired)
    new       publish                                        ready     -
    ready     deliver / get                                  unacked   Deliver / GetOk (no_ack: gone, acked)
    ready     head expired (any call, or expire)             gone      DeadLetter(expired) | Forget(expired)
    ready     head over max-length, drop-head                gone      DeadLetter(maxlen) | Forget(dropped)
    ready     purge                                          gone      Forget(purged)
    unacked   ack                                            gone      Forget(acked)
    unacked   reject/nack requeue, recover, channel closed   ready     -  (by id; delivered again as redelivered)
    unacked   reject/nack without requeue                    gone      DeadLetter(rejected) | Forget(rejected)
    any       delete                                         gone      Forget(deleted)

A consumer's (``BLOCKED_BY``: the reason it is out of the rotation)::

    state      event                                  next
    ---------  -------------------------------------  ----------------------------------
    active     cannot take: transport full            room     (rejoins at the next deliver/publish)
    active     cannot take: own prefetch reached      prefetch (rejoins when one of its own is settled)
    active     cannot take: no permit from its channel channel (rejoins when the limiter grants some)
    any        cancel, channel closed                 cancelled

The queue's lifecycle facts: ``auto_delete`` asks for deletion
(``DeleteQueue``) when the last consumer goes, once it has had one;
``x-expires`` when no consumer, ``basic.get`` or declare (``touch``) was
seen for that long (``next_deadline_ns`` covers it, ``expire`` reports it).
Dead-lettering names the DLX and routing keys; ``record_death`` writes the
``x-death`` headers and ``dead_letter_cycles`` drops RabbitMQ's automatic
cycles, both exactly as RabbitMQ 3.10 does. Behaviour was checked against a
real 3.10.8 node: requeue order, consumer priorities, the channel-wide
prefetch, priorities under max-length, TTL 0 with and without consumers,
reject-publish with a waiting consumer, ``x-death`` shapes, cycles and every
reply text.

With ``x-single-active-consumer`` the first consumer to come is the only
one delivered to; the others wait (``WAITING``) and, when it goes, the
waiting one with the highest ``x-priority`` takes over, the first to come
among equals, as RabbitMQ 3.10's classic queue picks from its consumers'
priority queue (checked against 3.10.8). What the one that went holds
unacked stays with its channel, as after any cancel. An exclusive consume
on such a queue is refused, the first one too, as 3.10.8 refuses it.

Not modelled: AMQP 1.0 credit.
"""

from __future__ import annotations

import datetime
import heapq
from collections import deque
from dataclasses import dataclass
from collections.abc import Hashable, Iterable
from typing import Any

from pipeline.amqp.errors import ACCESS_REFUSED, INTERNAL_ERROR
from pipeline.broker.args import PreconditionFailed, QueueArgs, QueueError, resource

NS_PER_MS = 1_000_000
NO_ACTIONS: tuple = ()            # the shared "nothing to do" result (callers iterate, never mutate)

# how a message ended (Forget.outcome) and why it was dead-lettered (DeadLetter.reason)
ACKED, EXPIRED, DROPPED, REJECTED, PURGED, DELETED = "acked", "expired", "dropped", "rejected", "purged", "deleted"
DEAD_LETTERED = "dead_lettered"
OUTCOMES = (ACKED, EXPIRED, DEAD_LETTERED, DROPPED, REJECTED, PURGED, DELETED)
MAXLEN = "maxlen"
_WITHOUT_DLX = {EXPIRED: EXPIRED, MAXLEN: DROPPED, REJECTED: REJECTED}
# why a consumer is out of the rotation (None: in it)
ROOM, PREFETCH, CHANNEL, CANCELLED = "room", "prefetch", "channel", "cancelled"
WAITING = "waiting"                   # x-single-active-consumer: not the queue's active consumer
AUTO_DELETE, EXPIRES = "auto_delete", "expires"          # DeleteQueue.reason


class AccessRefused(QueueError):
    """Raised when a consume meets an exclusive consumer, or asks for exclusivity on a used queue: 403."""

    reply_code = ACCESS_REFUSED


class QueueInUse(PreconditionFailed):
    """Raised when ``queue.delete if-unused`` finds consumers: 406 "... in use"."""


class QueueNotEmpty(PreconditionFailed):
    """Raised when ``queue.delete if-empty`` finds ready messages: 406 "... not empty"."""


class ShellMisuse(QueueError):
    """Raised when the shell asks what the core's state forbids (a bug in the shell, not the client): 541."""

    reply_code = INTERNAL_ERROR


class Message:
    """One message: made by the shell, numbered and kept by the core, handed back in actions.

    ``payload`` is the shell's own record (never looked into); ``size`` the
    body's bytes (what ``x-max-length-bytes`` counts); ``publisher``/``seq``
    whom to confirm to (None: nobody); ``exchange`` and ``routing_keys``
    (the publish's key, then its CC keys) go back out in dead-lettering.
    The core sets ``id``, ``expires_ns`` (absolute, None: never),
    ``level`` (its priority level), ``redelivered`` (it was delivered before)
    and ``unconfirmed`` (its confirm waits).
    """

    __slots__ = ("payload", "size", "persistent", "priority", "expiration_ms", "publisher", "seq", "exchange",
                 "routing_keys", "id", "expires_ns", "level", "redelivered", "unconfirmed")

    def __init__(self, payload: Any, size: int, persistent: bool = False, priority: int | None = None,
                 expiration_ms: int | None = None, publisher: Hashable = None, seq: int = 0, exchange: str = "",
                 routing_keys: tuple = (), redelivered: bool = False, id: int | None = None,
                 expires_ns: int | None = None):
        self.payload, self.size, self.persistent, self.priority = payload, size, persistent, priority
        self.expiration_ms, self.publisher, self.seq = expiration_ms, publisher, seq
        self.exchange, self.routing_keys = exchange, routing_keys
        self.id, self.expires_ns, self.level = id, expires_ns, 0
        self.redelivered, self.unconfirmed = redelivered, False

    def __repr__(self) -> str:
        return f"Message(id={self.id}, size={self.size}, level={self.level}, expires_ns={self.expires_ns})"


# -- actions: what the shell must do, in order ---------------------------------------------------
# The per-message actions (Deliver, Confirm, Forget, and their kin GetOk, Nack) are not frozen: one is
# built for every message, and a frozen dataclass costs three times as much to build (0.50 against
# 0.15 µs). Nothing changes an action once made.
@dataclass(slots=True)
class Deliver:
    """Send ``message`` to ``consumer`` (the key given to ``consume``); ``no_ack``: it ends here."""
    consumer: Hashable
    message: Message
    redelivered: bool
    no_ack: bool


@dataclass(slots=True)
class GetOk:
    """Answer ``basic.get`` on ``channel`` with ``message``; ``remaining`` ready messages are left."""
    channel: Hashable
    message: Message
    redelivered: bool
    no_ack: bool
    remaining: int


@dataclass(frozen=True, slots=True)
class GetEmpty:
    """Answer ``basic.get`` on ``channel`` with ``get-empty``."""
    channel: Hashable


@dataclass(slots=True)
class Confirm:
    """Confirm publish ``seq`` to ``publisher`` (``basic.ack``)."""
    publisher: Hashable
    seq: int


@dataclass(slots=True)
class Nack:
    """Refuse publish ``seq`` to ``publisher`` (``basic.nack``): the queue would not take it."""
    publisher: Hashable
    seq: int


@dataclass(slots=True)
class Forget:
    """``message`` is gone (``outcome`` says how): drop what the shell keeps for it."""
    message: Message
    outcome: str


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Publish a copy of ``message`` to ``exchange`` (the DLX), then forget the original.

    Route it with ``routing_keys`` (the queue's x-dead-letter-routing-key, or
    the message's own keys); build its headers with
    ``record_death(headers, action.death(now_s, expiration), drop_cc=...)``
    and clear its ``expiration``.
    """
    message: Message
    reason: str                 # expired | maxlen | rejected
    exchange: str
    routing_key: str | None     # x-dead-letter-routing-key (then the CC header goes), or None
    queue: str
    at_ns: int

    @property
    def routing_keys(self) -> tuple:
        return (self.routing_key,) if self.routing_key is not None else tuple(self.message.routing_keys)

    def death(self, time_s: int, original_expiration: str | None = None) -> Death:
        """The ``x-death`` entry this dead-lettering adds, at wall-clock ``time_s``."""
        return Death(self.queue, self.reason, self.message.exchange, tuple(self.message.routing_keys), time_s,
                     original_expiration)


@dataclass(frozen=True, slots=True)
class AskPermits:
    """``channel``'s consumers wait for its global limit: ask its limiter for up to ``want`` permits."""
    channel: Hashable
    want: int


@dataclass(frozen=True, slots=True)
class ReturnPermits:
    """Permits ``channel``'s limiter granted that this queue cannot use now: give them back."""
    channel: Hashable
    count: int


@dataclass(frozen=True, slots=True)
class DeleteQueue:
    """The queue should go now (``auto_delete``: its last consumer left; ``expires``: unused too long)."""
    reason: str


@dataclass(frozen=True)
class BacklogStatistics:
    """A snapshot of one :class:`Backlog`. Every message taken in is ready, unacked, or in one outcome:
    ``published + restored == ready + unacked + acked + expired + dead_lettered + dropped + rejected +
    purged + deleted``."""

    queue: str
    messages_ready: int
    messages_unacknowledged: int
    message_bytes_ready: int
    message_bytes_unacknowledged: int
    consumers: int
    unconfirmed: int            # taken in, confirm waiting for mark_safe
    published: int              # publishes taken in, refused ones included
    restored: int               # messages put back by restore (a restarted queue)
    delivered: int              # deliveries and get-oks, redeliveries included
    redelivered: int            # ... of which carried the redelivered flag
    requeued: int               # put back by reject/nack, recover or a closed channel
    acked: int                  # ended: acked, or delivered with no-ack
    expired: int                # ended: expired, no DLX
    dead_lettered: int          # ended: handed to the DLX (expired, maxlen, rejected)
    dropped: int                # ended: dropped from the head over max-length, no DLX
    rejected: int               # ended: rejected without requeue, or refused by reject-publish; no DLX
    purged: int
    deleted: int                # ended: held when the queue was deleted


class _Consumer:
    __slots__ = ("key", "channel", "transport", "no_ack", "prefetch", "priority", "unacked", "blocked")

    def __init__(self, key, channel, transport, no_ack, prefetch, priority):
        self.key, self.channel, self.transport = key, channel, transport
        self.no_ack, self.prefetch, self.priority = no_ack, prefetch, priority
        self.unacked = 0
        self.blocked: str | None = None


class _Channel:
    __slots__ = ("key", "limited", "permits", "asked", "unacked", "held", "consumers", "waiting")

    def __init__(self, key):
        self.key = key
        self.limited = False           # basic.qos global=true with a count: deliveries need permits
        self.permits = 0               # granted by the channel's limiter, not yet used
        self.asked = False             # an AskPermits is out, not yet answered
        self.unacked = 0               # deliveries to its consumers with ack, not yet settled
        self.held: dict = {}           # message id -> (Message, _Consumer or None for basic.get)
        self.consumers = 0
        self.waiting: list = []        # its consumers blocked by its limit, in order

    def full(self) -> bool:
        return self.limited and self.permits <= 0


class _Level:
    __slots__ = ("requeued", "fresh")

    def __init__(self):
        self.requeued: list = []       # heap of (id, Message): put back, all older than every fresh one
        self.fresh: deque = deque()    # never delivered, in id order


class Backlog:
    """One classic queue: ready messages, consumers, unacked deliveries, limits and dead-lettering."""

    def __init__(self, name: str, now_ns: int, args: QueueArgs | None = None, *, auto_delete: bool = False,
                 first_id: int = 1):
        args = args or QueueArgs()
        self.name = name
        self.args = args
        self.auto_delete = auto_delete
        self._ttl_ms = args.message_ttl_ms
        self._dlx = args.dead_letter_exchange
        self._dlx_key = args.dead_letter_routing_key
        self._max_len, self._max_bytes = args.max_length, args.max_length_bytes
        limited = self._max_len is not None or self._max_bytes is not None
        self._drop_head = limited and args.overflow == "drop-head"
        self._refuse_over = limited and args.overflow != "drop-head"
        self._max_level = args.max_priority or 0
        self._levels = [_Level() for _ in range(self._max_level + 1)]
        self._nonempty = 0             # bit p set: level p has ready messages
        self._ready = 0
        self._ready_bytes = 0
        self._unacked = 0
        self._unacked_bytes = 0
        self._next_id = first_id
        self._last_restored = None
        self._unconfirmed: dict[int, Message] = {}
        self._consumers: dict = {}     # key -> _Consumer
        self._active: dict[int, deque] = {}    # consumer priority -> rotation
        self._priorities: list[int] = []       # priorities with a non-empty rotation, highest first
        self._room_blocked: list = []
        self._channels: dict = {}
        self._limited: list = []       # channels under basic.qos global=true
        self._exclusive = None         # key of the exclusive consumer
        self._single = args.single_active_consumer
        self._holder: _Consumer | None = None  # x-single-active-consumer: the one consumer delivered to
        self._sac_waiting: list = []           # the others, in the order they came
        self._had_consumers = False
        self._expires_ns = None if args.expires_ms is None else args.expires_ms * NS_PER_MS
        self._last_used_ns = now_ns
        self._expires_reported = False
        self._gone = False
        self._published = self._restored = self._delivered = self._redelivered = self._requeued = 0
        self._ended = dict.fromkeys(OUTCOMES, 0)        # outcome -> messages that ended so

    # -- publishing --------------------------------------------------------------------------
    def publish(self, message: Message, now_ns: int, *, safe: bool = True, room: dict | None = None):
        """``deliver_or_enqueue``: take ``message`` in. ``safe``: confirm it now (else at ``mark_safe``)."""
        if self._gone:
            raise ShellMisuse(f"INTERNAL_ERROR - {resource(self.name)} was deleted")
        msg = message
        msg.id = self._next_id
        self._next_id += 1
        self._published += 1
        ttl = self._ttl_ms
        exp = msg.expiration_ms
        if exp is not None and (ttl is None or exp < ttl):
            ttl = exp
        msg.expires_ns = None if ttl is None else now_ns + ttl * NS_PER_MS
        if self._max_level:
            p = msg.priority or 0
            msg.level = min(p, self._max_level)
        if self._refuse_over and ((self._max_len is not None and self._ready >= self._max_len) or
                                  (self._max_bytes is not None and self._ready_bytes + msg.size > self._max_bytes)):
            return self._refuse(msg, now_ns)
        actions = NO_ACTIONS
        if msg.publisher is not None:
            if safe:
                actions = [Confirm(msg.publisher, msg.seq)]
            else:
                msg.unconfirmed = True
                self._unconfirmed[msg.id] = msg
        if not self._ready and self._consumers:
            if self._room_blocked:
                self._unblock_room()
            c = self._pick(room)
            if c is not None:
                if actions is NO_ACTIONS:
                    actions = []
                self._hand_over(c, msg, room, actions)
                return actions
        if self._ttl_ms == 0 and self._dlx is None:     # RabbitMQ: no point queueing it
            if actions is NO_ACTIONS:
                actions = []
            self._end(msg, EXPIRED, actions)
            return actions
        self._levels[msg.level].fresh.append(msg)
        self._nonempty |= 1 << msg.level
        self._ready += 1
        self._ready_bytes += msg.size
        # RabbitMQ looks at the head again only if it changed: a drop, or this message alone in the queue
        if self._drop_head:
            if actions is NO_ACTIONS:
                actions = []
            if self._drop_over_limit(now_ns, actions) or self._ready == 1:
                self._expire_heads(now_ns, actions)
        elif self._ready == 1 and msg.expires_ns is not None and now_ns >= msg.expires_ns:
            if actions is NO_ACTIONS:
                actions = []
            self._expire_heads(now_ns, actions)
        return actions

    def _refuse(self, msg: Message, now_ns: int) -> list:
        actions: list = []
        if msg.publisher is not None:
            actions.append(Nack(msg.publisher, msg.seq))
        if self.args.overflow == "reject-publish-dlx" and self._dlx is not None:
            self._ended[DEAD_LETTERED] += 1
            actions.append(DeadLetter(msg, MAXLEN, self._dlx, self._dlx_key, self.name, now_ns))
        else:
            self._ended[REJECTED] += 1
            actions.append(Forget(msg, REJECTED))
        return actions

    def restore(self, message: Message) -> None:
        """Put back a ready message a restarted queue recovered, ids ascending and below ``first_id``."""
        msg = message
        if msg.id is None or msg.id >= self._next_id or (self._last_restored is not None
                                                          and msg.id <= self._last_restored):
            raise ShellMisuse(f"INTERNAL_ERROR - restored message id {msg.id} is not ascending below "
                              f"{self._next_id}")
        self._last_restored = msg.id
        if self._max_level:
            msg.level = min(msg.priority or 0, self._max_level)
        self._levels[msg.level].fresh.append(msg)
        self._nonempty |= 1 << msg.level
        self._ready += 1
        self._ready_bytes += msg.size
        self._restored += 1

    def mark_safe(self, ids: Iterable[int]) -> list:
        """The shell made these messages safe (fsynced): the confirms now due."""
        confirms = []
        pending = self._unconfirmed
        for i in ids:
            msg = pending.pop(i, None)
            if msg is not None:
                msg.unconfirmed = False
                confirms.append(Confirm(msg.publisher, msg.seq))
        return confirms

    # -- ready messages ----------------------------------------------------------------------
    def _head(self) -> Message:
        level = self._levels[self._nonempty.bit_length() - 1]
        return level.requeued[0][1] if level.requeued else level.fresh[0]

    def _pop_head(self) -> Message:
        top = self._nonempty.bit_length() - 1
        level = self._levels[top]
        msg = heapq.heappop(level.requeued)[1] if level.requeued else level.fresh.popleft()
        if not level.fresh and not level.requeued:
            self._nonempty &= ~(1 << top)
        self._ready -= 1
        self._ready_bytes -= msg.size
        return msg

    def _put_back(self, msgs: list, now_ns: int, actions: list) -> None:
        """Requeue: each goes back by id among its level's put-back messages, ahead of every fresh one."""
        for msg in msgs:
            heapq.heappush(self._levels[msg.level].requeued, (msg.id, msg))
            self._nonempty |= 1 << msg.level
            self._ready += 1
            self._ready_bytes += msg.size
        self._requeued += len(msgs)
        if self._drop_head:
            self._drop_over_limit(now_ns, actions)
        self._expire_heads(now_ns, actions)

    def _drop_over_limit(self, now_ns: int, actions: list) -> bool:
        dropped = False
        max_len, max_bytes = self._max_len, self._max_bytes
        while self._ready and ((max_len is not None and self._ready > max_len)
                               or (max_bytes is not None and self._ready_bytes > max_bytes)):
            self._dead_letter(self._pop_head(), MAXLEN, now_ns, actions)
            dropped = True
        return dropped

    def _expire_heads(self, now_ns: int, actions: list) -> None:
        while self._ready:
            due = self._head().expires_ns
            if due is None or now_ns < due:
                return
            self._dead_letter(self._pop_head(), EXPIRED, now_ns, actions)

    def _end(self, msg: Message, outcome: str, actions: list) -> None:
        self._ended[outcome] += 1
        actions.append(Forget(msg, outcome))
        if msg.unconfirmed:
            self._confirm(msg, actions)

    def _dead_letter(self, msg: Message, reason: str, now_ns: int, actions: list) -> None:
        if self._dlx is None:
            self._end(msg, _WITHOUT_DLX[reason], actions)
            return
        self._ended[DEAD_LETTERED] += 1
        actions.append(DeadLetter(msg, reason, self._dlx, self._dlx_key, self.name, now_ns))
        if msg.unconfirmed:
            self._confirm(msg, actions)

    def _confirm(self, msg: Message, actions: list) -> None:
        msg.unconfirmed = False
        del self._unconfirmed[msg.id]
        actions.append(Confirm(msg.publisher, msg.seq))

    # -- consumers ---------------------------------------------------------------------------
    def consume(self, key: Hashable, channel: Hashable, now_ns: int, *, no_ack: bool = False, prefetch: int = 0,
                priority: int = 0, exclusive: bool = False, transport: Hashable = None) -> None:
        """Add consumer ``key`` on ``channel``; its deliveries go over ``transport`` (default: the channel).

        ``prefetch`` is its own limit (0: none); ``priority`` its ``x-priority``
        (see ``args.consumer_priority``). Raises ``AccessRefused`` (403).
        """
        if key in self._consumers:
            raise ShellMisuse(f"INTERNAL_ERROR - consumer {key!r} is already on {resource(self.name)}")
        # with a single active consumer RabbitMQ 3.10 refuses every exclusive consume, the first one too
        if self._exclusive is not None or (exclusive and (self._consumers or self._single)):
            raise AccessRefused(f"ACCESS_REFUSED - {resource(self.name)} in exclusive use")
        ch = self._channel(channel)
        c = _Consumer(key, ch, channel if transport is None else transport, no_ack, prefetch, priority)
        self._consumers[key] = c
        ch.consumers += 1
        if exclusive:
            self._exclusive = key
        self._had_consumers = True
        if self._single:
            if self._holder is not None:
                c.blocked = WAITING
                self._sac_waiting.append(c)
                return
            self._holder = c
        self._activate(c)

    def cancel(self, key: Hashable, now_ns: int):
        """Remove consumer ``key``; what it holds unacked stays with its channel."""
        c = self._consumers.pop(key, None)
        if c is None:
            return NO_ACTIONS
        self._remove(c)
        return self._after_consumers_left(now_ns)

    def _after_consumers_left(self, now_ns: int):
        if self._consumers:
            return NO_ACTIONS
        self._last_used_ns = now_ns                  # RabbitMQ restarts the x-expires timer
        if self.auto_delete and self._had_consumers:
            return [DeleteQueue(AUTO_DELETE)]
        return NO_ACTIONS

    def _remove(self, c: _Consumer) -> None:
        if c.blocked is None:
            rotation = self._active[c.priority]
            rotation.remove(c)
            if not rotation:
                del self._active[c.priority]
                self._priorities.remove(c.priority)
        elif c.blocked is ROOM:
            self._room_blocked.remove(c)
        elif c.blocked is CHANNEL:
            c.channel.waiting.remove(c)
        elif c.blocked is WAITING:
            self._sac_waiting.remove(c)
        c.blocked = CANCELLED
        c.channel.consumers -= 1
        if self._exclusive == c.key:
            self._exclusive = None
        if c is self._holder:
            self._holder = None
            if self._sac_waiting:
                # RabbitMQ 3.10 takes the next from its consumers' priority queue: the highest x-priority,
                # the first to come among equals (checked against 3.10.8)
                best = max(self._sac_waiting, key=_priority_of)
                self._sac_waiting.remove(best)
                self._holder = best
                self._activate(best)

    @property
    def single_active_consumer(self) -> Hashable | None:
        """The key of the consumer a queue with x-single-active-consumer delivers to (None: it has none, or
        the queue has no single active consumer)."""
        return self._holder.key if self._holder is not None else None

    def _activate(self, c: _Consumer) -> None:
        c.blocked = None
        rotation = self._active.get(c.priority)
        if rotation is None:
            rotation = self._active[c.priority] = deque()
            prios = self._priorities
            i = 0
            while i < len(prios) and prios[i] > c.priority:
                i += 1
            prios.insert(i, c.priority)
        rotation.append(c)

    def _unblock_room(self) -> None:
        blocked, self._room_blocked = self._room_blocked, []
        for c in blocked:
            self._activate(c)

    def _pick(self, room: dict | None):
        """The next consumer in RabbitMQ's order that can take a message now; those that cannot step out."""
        prios = self._priorities
        while prios:
            p = prios[0]
            rotation = self._active[p]
            while rotation:
                c = rotation.popleft()
                if room is not None and room.get(c.transport, 0) <= 0:
                    c.blocked = ROOM
                    self._room_blocked.append(c)
                elif c.channel.limited and c.channel.permits <= 0:
                    c.blocked = CHANNEL
                    c.channel.waiting.append(c)
                elif c.prefetch and not c.no_ack and c.unacked >= c.prefetch:
                    c.blocked = PREFETCH
                else:
                    rotation.append(c)
                    return c
            del self._active[p]
            prios.pop(0)
        return None

    def _hand_over(self, c: _Consumer, msg: Message, room: dict | None, actions: list) -> None:
        redelivered = msg.redelivered
        msg.redelivered = True
        if room is not None:
            room[c.transport] -= 1
        self._delivered += 1
        if redelivered:
            self._redelivered += 1
        if c.no_ack:
            self._ended[ACKED] += 1
            actions.append(Deliver(c.key, msg, redelivered, True))
            if msg.unconfirmed:
                self._confirm(msg, actions)
            return
        c.unacked += 1
        ch = c.channel
        ch.unacked += 1
        if ch.limited:
            ch.permits -= 1
        ch.held[msg.id] = (msg, c)
        self._unacked += 1
        self._unacked_bytes += msg.size
        actions.append(Deliver(c.key, msg, redelivered, False))

    def deliver(self, now_ns: int, room: dict | None = None):
        """Hand ready messages to consumers while one can take them; expired heads go first."""
        if not self._ready or not self._consumers:
            return self._settle_permits([]) if self._limited else NO_ACTIONS
        if self._room_blocked:
            self._unblock_room()
        actions: list = []
        while self._ready:
            due = self._head().expires_ns
            if due is not None and now_ns >= due:
                self._dead_letter(self._pop_head(), EXPIRED, now_ns, actions)
                continue
            c = self._pick(room)
            if c is None:
                break
            self._hand_over(c, self._pop_head(), room, actions)
        if self._limited:
            self._settle_permits(actions)
        return actions

    def _settle_permits(self, actions: list) -> list:
        """After a delivery round: permits left over go back to their limiter (a queue never sits on
        what another queue of the channel could deliver with); consumers held only by their channel's
        limit ask for as many as there are ready messages."""
        for ch in self._limited:
            if ch.permits > 0:
                actions.append(ReturnPermits(ch.key, ch.permits))
                ch.permits = 0
            if ch.waiting and not ch.asked and self._ready:
                ch.asked = True
                actions.append(AskPermits(ch.key, self._ready))
        return actions

    # -- channels: basic.qos, basic.get, acks ------------------------------------------------------
    def _channel(self, key) -> _Channel:
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = _Channel(key)
        return ch

    def set_channel_prefetch(self, channel: Hashable, count: int) -> None:
        """``basic.qos global=true`` (``count`` 0: none). Under a limit, deliveries to the channel's
        consumers wait for permits from its limiter (``grant``); lifting it drops them."""
        ch = self._channel(channel)
        if count and not ch.limited:
            ch.limited = True
            self._limited.append(ch)
        elif not count and ch.limited:
            ch.limited, ch.permits, ch.asked = False, 0, False
            self._limited.remove(ch)
        self._wake_channel(ch)

    def grant(self, channel: Hashable, count: int) -> None:
        """The channel's limiter answered an ``AskPermits``: ``count`` more deliveries may go."""
        ch = self._channels.get(channel)
        if ch is None or not ch.limited:
            return
        ch.permits += count
        ch.asked = False
        self._wake_channel(ch)

    def _wake_channel(self, ch: _Channel) -> None:
        if ch.waiting and not ch.full():
            waiting, ch.waiting = ch.waiting, []
            for c in waiting:
                self._activate(c)

    def get(self, channel: Hashable, now_ns: int, *, no_ack: bool = False) -> list:
        """``basic.get``: exactly one ``GetOk`` (the head) or ``GetEmpty`` among the actions.

        Expired heads go first; after the fetch the new head is checked too,
        as RabbitMQ does, and ``remaining`` counts what is left after that.
        """
        if self._gone:
            raise ShellMisuse(f"INTERNAL_ERROR - {resource(self.name)} was deleted")
        self._last_used_ns = now_ns
        actions: list = []
        self._expire_heads(now_ns, actions)
        if not self._ready:
            actions.append(GetEmpty(channel))
            return actions
        msg = self._pop_head()
        redelivered = msg.redelivered
        msg.redelivered = True
        self._delivered += 1
        if redelivered:
            self._redelivered += 1
        if no_ack:
            self._ended[ACKED] += 1
            if msg.unconfirmed:
                self._confirm(msg, actions)
        else:
            self._channel(channel).held[msg.id] = (msg, None)
            self._unacked += 1
            self._unacked_bytes += msg.size
        answer = len(actions)
        actions.append(None)
        self._expire_heads(now_ns, actions)
        actions[answer] = GetOk(channel, msg, redelivered, no_ack, self._ready)
        return actions

    def _take(self, ch: _Channel, ids: Iterable[int]) -> list:
        """Remove ``ids`` from what ``ch`` holds (unknown ones ignored); settle the counts."""
        taken = []
        held = ch.held
        for i in ids:
            entry = held.pop(i, None)
            if entry is None:
                continue
            msg, c = entry
            taken.append(msg)
            self._unacked -= 1
            self._unacked_bytes -= msg.size
            if c is not None:
                c.unacked -= 1
                ch.unacked -= 1
                if c.blocked is PREFETCH and c.unacked < c.prefetch:
                    self._activate(c)
        if ch.waiting:
            self._wake_channel(ch)
        return taken

    def ack(self, channel: Hashable, ids: Iterable[int]):
        """``basic.ack`` of message ``ids`` held by ``channel`` (multiple resolved by the shell)."""
        ch = self._channels.get(channel)
        if ch is None:
            return NO_ACTIONS
        actions: list = []
        ended = self._ended
        for msg in self._take(ch, ids):
            ended[ACKED] += 1
            actions.append(Forget(msg, ACKED))
            if msg.unconfirmed:
                self._confirm(msg, actions)
        return actions

    def reject(self, channel: Hashable, ids: Iterable[int], now_ns: int, *, requeue: bool):
        """``basic.reject``/``basic.nack``: back to ready in original order, or dead-letter/forget (rejected)."""
        ch = self._channels.get(channel)
        if ch is None:
            return NO_ACTIONS
        taken = self._take(ch, ids)
        if not taken:
            return NO_ACTIONS
        actions: list = []
        if requeue:
            taken.sort(key=_by_id)
            self._put_back(taken, now_ns, actions)
        else:
            for msg in taken:
                self._dead_letter(msg, REJECTED, now_ns, actions)
        return actions

    def recover(self, channel: Hashable, now_ns: int):
        """``basic.recover requeue=true``: everything ``channel`` holds goes back."""
        ch = self._channels.get(channel)
        if ch is None or not ch.held:
            return NO_ACTIONS
        return self.reject(channel, list(ch.held), now_ns, requeue=True)

    def channel_closed(self, channel: Hashable, now_ns: int):
        """``channel`` closed or its connection went: its consumers go, what it held goes back in order."""
        ch = self._channels.pop(channel, None)
        if ch is None:
            return NO_ACTIONS
        if ch.limited:
            self._limited.remove(ch)
        had = ch.consumers
        for c in [c for c in self._consumers.values() if c.channel is ch]:
            del self._consumers[c.key]
            self._remove(c)
        back = sorted((msg for msg, _ in ch.held.values()), key=_by_id)
        actions: list = []
        if back:
            self._unacked -= len(back)
            self._unacked_bytes -= sum(m.size for m in back)
            self._put_back(back, now_ns, actions)
        if had:
            actions.extend(self._after_consumers_left(now_ns))
        elif not self._consumers:
            self._last_used_ns = now_ns              # any channel RabbitMQ knew restarts x-expires
        return actions

    # -- time, lifecycle -----------------------------------------------------------------------
    def touch(self, now_ns: int) -> None:
        """A declare (or passive declare) of this queue: restarts the x-expires clock."""
        self._last_used_ns = now_ns

    def next_deadline_ns(self) -> int | None:
        """When ``expire`` has something to do next: the head's expiry, or x-expires; None: never."""
        due = self._head().expires_ns if self._ready else None
        if self._expires_ns is not None and not self._consumers and not self._expires_reported:
            unused = self._last_used_ns + self._expires_ns
            due = unused if due is None or unused < due else due
        return due

    def expire(self, now_ns: int) -> list:
        """Dead-letter or forget expired heads; report ``DeleteQueue(expires)`` once x-expires has run out."""
        actions: list = []
        self._expire_heads(now_ns, actions)
        if (self._expires_ns is not None and not self._consumers and not self._expires_reported
                and now_ns >= self._last_used_ns + self._expires_ns):
            self._expires_reported = True
            actions.append(DeleteQueue(EXPIRES))
        return actions

    def purge(self, now_ns: int) -> tuple[int, list]:
        """``queue.purge``: forget every ready message (unacked ones stay); returns (count, actions)."""
        count = self._ready
        actions: list = []
        while self._ready:
            self._end(self._pop_head(), PURGED, actions)
        return count, actions

    def delete(self, now_ns: int, *, if_unused: bool = False, if_empty: bool = False) -> tuple[int, list]:
        """``queue.delete``: forget everything; returns (ready count, actions). Raises 406 as RabbitMQ."""
        if if_empty and self._ready:
            raise QueueNotEmpty(f"PRECONDITION_FAILED - {resource(self.name)} not empty")
        if if_unused and self._consumers:
            raise QueueInUse(f"PRECONDITION_FAILED - {resource(self.name)} in use")
        count = self._ready
        actions: list = []
        while self._ready:
            self._end(self._pop_head(), DELETED, actions)
        for ch in self._channels.values():
            for msg, _ in sorted(ch.held.values(), key=lambda e: e[0].id):
                self._unacked -= 1
                self._unacked_bytes -= msg.size
                self._end(msg, DELETED, actions)
            ch.held.clear()
        for c in list(self._consumers.values()):
            self._remove(c)
        self._consumers.clear()
        self._channels.clear()
        self._gone = True
        self._expires_reported = True       # gone already: x-expires has nothing left to ask for
        return count, actions

    @property
    def deleted(self) -> bool:
        """Whether ``delete`` has run: what still comes (it was on its way) is the shell's to drop or refuse."""
        return self._gone

    def is_unused(self) -> bool:
        """No consumers (RabbitMQ's test for if-unused, exclusive consume and x-expires)."""
        return not self._consumers

    def holds(self, channel: Hashable, msg_id: int) -> bool:
        """Whether ``channel`` holds message ``msg_id`` unacked (for the channel's own bookkeeping)."""
        ch = self._channels.get(channel)
        return ch is not None and msg_id in ch.held

    @property
    def next_id(self) -> int:
        """The id the next publish will get (the shell journals a persistent message under it first)."""
        return self._next_id

    def ready_newest_first(self):
        """Ready messages, the last to be delivered first (the shell pages their payloads out)."""
        for level in self._levels:
            yield from reversed(level.fresh)
            yield from (msg for _, msg in sorted(level.requeued, reverse=True))

    def unacked_messages(self):
        """Messages delivered and not yet settled."""
        for ch in self._channels.values():
            for msg, _ in ch.held.values():
                yield msg

    @property
    def ready(self) -> int:
        """Messages ready (``statistics().messages_ready``, for a shell that asks per batch)."""
        return self._ready

    @property
    def held(self) -> int:
        """Messages ready or delivered and not yet settled: what the queue keeps in memory (per turn, where
        ``statistics()``, a dataclass of every count, costs 3.4 us)."""
        return self._ready + self._unacked

    @property
    def consuming(self) -> bool:
        """Whether anyone consumes from the queue."""
        return bool(self._consumers)

    def flow_totals(self) -> tuple[int, int]:
        """Messages taken in (published) and handed to consumers, since the queue began."""
        return self._published, self._delivered

    def wants_room(self) -> bool:
        """Whether ``publish`` would look at ``room``: only a message that may go straight to a consumer
        (nothing ready ahead of it, someone consuming). A shell that finds room costly asks first."""
        return not self._ready and bool(self._consumers)

    def statistics(self) -> BacklogStatistics:
        return BacklogStatistics(
            queue=self.name, messages_ready=self._ready, messages_unacknowledged=self._unacked,
            message_bytes_ready=self._ready_bytes, message_bytes_unacknowledged=self._unacked_bytes,
            consumers=len(self._consumers), unconfirmed=len(self._unconfirmed), published=self._published,
            restored=self._restored, delivered=self._delivered, redelivered=self._redelivered,
            requeued=self._requeued, **self._ended)


def _priority_of(c: _Consumer) -> int:
    return c.priority


def _by_id(msg: Message) -> int:
    return msg.id


# -- dead-lettering: x-death headers and cycles ---------------------------------------------------------
@dataclass(frozen=True)
class Death:
    """One dead-lettering, as the ``x-death`` header records it."""

    queue: str
    reason: str                          # expired | maxlen | rejected
    exchange: str                        # the exchange the message was published to
    routing_keys: tuple                  # its routing key, then its CC keys
    time_s: int                          # wall clock, seconds
    original_expiration: str | None = None   # its expiration property, if it had one


def record_death(headers: dict | None, death: Death, *, drop_cc: bool = False) -> dict:
    """The dead-lettered copy's headers: ``headers`` with ``x-death`` updated exactly as RabbitMQ 3.10 does.

    The first death also sets ``x-first-death-reason/-queue/-exchange``. A
    later one increments ``count`` of the entry with the same queue and
    reason, keeping that entry's other fields, and moves it to the front;
    otherwise a new entry goes first. Existing entries are first grouped by
    (queue, reason) as RabbitMQ does, which reverses their order. An
    ``x-death`` that is not an array is replaced. ``drop_cc`` (the queue has
    a dead-letter routing key) removes the ``CC`` header. Keys come out
    sorted, as RabbitMQ writes the table; ``time`` is a UTC datetime (AMQP
    timestamp); ``count`` is an int that RabbitMQ sends as a ``long``.
    """
    info = {"reason": death.reason, "queue": death.queue,
            "time": datetime.datetime.fromtimestamp(death.time_s, datetime.UTC),
            "exchange": death.exchange, "routing-keys": list(death.routing_keys)}
    if death.original_expiration is not None:
        info["original-expiration"] = death.original_expiration
    out = dict(headers or {})
    if "x-death" not in out:
        out["x-first-death-reason"] = death.reason
        out["x-first-death-queue"] = death.queue
        out["x-first-death-exchange"] = death.exchange
        out["x-death"] = [{"count": 1, **info}]
    elif isinstance(out["x-death"], list):
        grouped = _group_deaths(out["x-death"])
        same = [d for d in grouped if _is_death(d, death.queue, death.reason)]
        others = [d for d in grouped if not _is_death(d, death.queue, death.reason)]
        if same:
            entry = dict(same[0])
            entry["count"] = entry["count"] + 1 if isinstance(entry.get("count"), int) else 1
        else:
            entry = {"count": 1, **info}
        out["x-death"] = [dict(sorted(entry.items()))] + others
    else:
        out["x-death"] = [{"count": 1, **info}]
    if drop_cc:
        out.pop("CC", None)
    return dict(sorted(out.items()))


def _is_death(entry, queue: str, reason: str) -> bool:
    return isinstance(entry, dict) and entry.get("queue") == queue and entry.get("reason") == reason


def _group_deaths(deaths: list) -> list:
    """RabbitMQ's group_by_queue_and_reason: one entry per (queue, reason), the first seen, in reverse."""
    if len(deaths) <= 1:
        return list(deaths)
    seen: set = set()
    grouped: list = []
    for entry in deaths:
        if not isinstance(entry, dict):
            continue
        key = (entry.get("queue"), entry.get("reason"))
        if key in seen:
            continue
        seen.add(key)
        matches = [d for d in deaths if _is_death(d, *key)]
        first = dict(matches[0])
        if "count" not in first:
            first = {"count": len(matches), **first}
        grouped.insert(0, first)
    return grouped


def dead_letter_cycles(reason: str, headers: dict | None, queues: Iterable) -> tuple[list, list]:
    """Split the queues a dead-lettered copy routes to into (deliver to, drop as a cycle), as RabbitMQ 3.10.

    ``headers`` are the copy's, after ``record_death``. A queue is a cycle
    when it already appears in ``x-death`` and no entry up to and including
    its first one has reason ``rejected`` (a fully automatic loop). A copy
    dead-lettered for ``rejected`` is never dropped.
    """
    queues = list(queues)
    deaths = (headers or {}).get("x-death")
    if reason == REJECTED or not isinstance(deaths, list):
        return queues, []
    keep, cycles = [], []
    for q in queues:
        (cycles if _is_cycle(q, deaths) else keep).append(q)
    return keep, cycles


def _is_cycle(queue: str, deaths: list) -> bool:
    for i, entry in enumerate(deaths):
        if isinstance(entry, dict) and entry.get("queue") == queue:
            return all(isinstance(d, dict) and d.get("reason") != REJECTED for d in deaths[:i + 1])
    return False
