"""The supervisor: starts, wires, watches, restarts and stops every broker process.

It is the only owner of shared memory: it creates each ring (named
``creditflow-<run id>-...``) and unlinks it when its link is torn down or the
broker stops; at start it removes what a killed earlier run left behind.

For every stage it creates three endpoints before forking it (an inbox pipe,
an eventfd doorbell, a control socketpair); links between running stages are
made later by sending each end an ``attach`` message carrying the ring's
descriptor and the peer's inbox and doorbell fds (SCM_RIGHTS;
``pipeline.broker.wiring``). Stages ask for links (a channel for a queue, a
reader for a channel); the supervisor answers once both ends have them.

It never waits on a stage: control messages go through one ``Outbox`` per
stage and tokens through non-blocking writes, so a stage that stops reading
(a channel pipelining a thousand declares, a stage that died a moment ago)
cannot stall the broker, and any one message it cannot handle is logged and
dropped, never raised out of the loop.

What a stage's end means is decided by ``pipeline.broker.lifecycle`` (a
table): a reader that dies takes only its connection; a channel that dies
has its connection closed with 541; the queues, the store and the watchdog
are restarted. Each death and restart is logged in RabbitMQ's words, kept
as a telemetry event and listed by ``ctl status``. Shutdown is ordered:
readers first, then channels, queues, and the store last after its final
fsync.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import ipaddress
import json
import os
import resource
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field

from ipc import control, shm, tokens
from ipc.credit import DEFAULT_CREDIT, MSG_STORE_CREDIT_DISC_BOUND, CreditSpec
from ipc.doorbell import Doorbell
from ipc.errors import CorruptRecord, PeerGone, WouldBlock
from ipc.tokens import Kind as TokenKind
from pipeline.broker import channel as _channel, queue as _queue, reader as _reader, store as _store  # noqa: F401
from pipeline import telemetry
from pipeline.broker import bodies as _bodies, lifecycle, names, wiring
from pipeline.broker.ctl_server import CtlServer
from pipeline.broker.args import QueueError
from pipeline.amqp.errors import AmqpError
from pipeline.broker.definitions import (DEFINITIONS_FILE, REPLY_TO_PREFIX, BadLimits, Definitions, QueueDef,
                                         arguments_from_json, arguments_to_json, connection_limit_text,
                                         not_found_queue, parse_limits, queue_stopped, refused)
from pipeline.broker.process_states import StateClock, state_at
from pipeline.broker.host import Host, build_stage
from pipeline.broker.stage import keep_heap_mapped
from pipeline.management import views as management_views
from pipeline.management.histogram import LatencyHistogram
from pipeline.management.writes import properties_key

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_STAGE_DIED = 3
EXIT_PORT_IN_USE = 4
EXIT_STAGE_CRASHED = 70

RING_BYTES = 4 * 1024 * 1024
STOP_GRACE_S = 3.0
IDLE_WAKE_S = 1.0                   # with nothing due, the loop still wakes this often (telemetry flush)
FD_RECHECK_S = 0.1                  # while the fd alarm is set, descriptors are recounted this often
UNTRACED_STATS_INTERVAL_MS = 1000   # --telemetry off: what status and the live view still need
ENDED_KEPT = 256                    # ended processes whose last statistics ctl status still shows
DEATHS_KEPT = 1000
TOKEN_RETRY_S = 0.01                # a full inbox pipe: try the tokens again this soon
ACCEPT_PAUSE_S = 0.5                # out of descriptors: stop accepting for this long
# what one more connection with a channel adds in the fullest process (measured: 6 to 8 with two hosts
# of each kind, 10.6 with one); more than that made every accept look bigger than it was
FDS_PER_CONNECTION = 12
# RabbitMQ lets sockets take 90% of the limit; here channels and queue links take descriptors too
FD_SHARE_FOR_CONNECTIONS = 0.8
FD_COUNT_INTERVAL_NS = 100_000_000  # descriptors are counted at most this often, estimated in between
FD_SETTLE_NS = 1_000_000_000        # a connection this new may not have opened its channel yet
SUPERVISOR = "creditflow_sup"
HOSTED_KINDS = ("reader", "channel", "queue")      # a host's Proc.number is its kind's index here
PIPELINE_KINDS = frozenset({"host", "store", *HOSTED_KINDS})   # batch scheduling, heap kept (not watchdog, management)
PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
MANAGEMENT_HOST = "127.0.0.1"       # the management listener is for this machine only


class ManagementPortInUse(OSError):
    """Raised when the management port (--management-port) is taken by another process."""


@dataclass
class BrokerConfig:
    data_dir: str
    host: str = "127.0.0.1"
    port: int = 5672
    node: str = "creditflow@localhost"
    credit: CreditSpec = DEFAULT_CREDIT
    store_credit: CreditSpec = MSG_STORE_CREDIT_DISC_BOUND
    channel_delay_us: int = 0
    queue_delay_us: int = 0
    store_delay_us: int = 0
    heartbeat_s: int = 60
    frame_max: int = 131072
    channel_max: int = 2047
    connection_max: int = 1000
    handshake_timeout_s: float = 10.0       # RabbitMQ's handshake_timeout: TCP connect to connection.open
    users: dict = field(default_factory=lambda: {"guest": "guest"})
    definitions: list = field(default_factory=list)    # ctl requests that import --definitions, in order
    loopback_users: tuple = ("guest",)      # RabbitMQ's loopback_users
    max_message_bytes: int = 128 * 1024 * 1024     # RabbitMQ 3.10's max_message_size
    ring_bytes: int = RING_BYTES
    fsync_interval_ms: int = 200
    fsync_delay_ms: int = 0
    confirm_after: str = "fsync"
    store_file_bytes: int = 16 * 1024 * 1024
    paging_ratio: float = 0.5
    telemetry: bool = True          # off: no snapshot or state-sample files, stages report once a second
    watchdog: dict = field(default_factory=dict)
    ipv6: bool = True               # also listen on the IPv6 twin of a loopback or wildcard host
    tls_port: int | None = None     # an AMQPS listener (RabbitMQ's 5671) with tls_cert / tls_key
    tls_cert: str | None = None
    tls_key: str | None = None
    # hosts per kind for readers, channels and queues (pipeline.broker.host); 0: a process of its own for each
    pool: int = field(default_factory=lambda: os.cpu_count() or 1)
    # hosts for readers; None (or 0): twice ``pool``, or ``pool`` where /dev/shm is too small for as
    # many body arenas. Connections are placed as they open, before anyone knows which will publish
    # and which consume: with one host per core, a publisher opened after a consumer and an idle
    # connection shared the consumer's host (and core), and 64 KiB 1 -> 1 ran 25% slower.
    reader_pool: int | None = None
    management_port: int | None = None     # the management API and /metrics on 127.0.0.1 (0: any free port)
    arena_mb: int = _bodies.ARENA_MB       # each reader host's arena for bodies by reference; 0: bodies by copy
    scheduling: str = "batch"       # the pipeline's processes under Linux's SCHED_BATCH ("batch") or "normal"


@dataclass(eq=False)                # one Proc per process incarnation: compared and hashed by identity
class Proc:
    name: str
    kind: str
    pid: int
    ctl: socket.socket
    outbox: control.Outbox
    inbox_w: int
    doorbell: Doorbell
    factory: object = None          # how to start it again (queues, store, watchdog)
    links: set = field(default_factory=set)
    owner: str | None = None        # for channels: their reader
    number: int = 0                 # for channels: the AMQP channel number
    peer: str = ""                  # for readers: the client's address
    state: str = "running"          # pipeline.broker.lifecycle.STATES
    tokens: bytearray = field(default_factory=bytearray)   # tokens its full inbox could not take yet
    deleted: bool = False           # for queues: deleted, so its files go when it has stopped
    host: str | None = None         # the host process it runs in (pid is that host's), None: its own
    stages: int = 0                 # for hosts: how many stages it runs now
    exit_code: int | None = None    # for hosted stages: how it ended, as its host reported
    exit_how: str | None = None
    reaped: bool = False            # its end is being handled
    holder: int = 0                 # for stages: its id in body arenas (pipeline.broker.bodies), 0: none
    arena: int | None = None        # for reader hosts: the arena it allocates bodies in


def plan_reader_hosts(cfg: BrokerConfig, fit_arenas) -> tuple[int, int, str | None]:
    """(reader hosts, each one's body arena in bytes, a line to log or None). Twice ``pool`` unless
    ``reader_pool`` says; 0 with ``pool`` 0 (a process of its own for each reader). Where /dev/shm
    cannot hold that many arenas at full size (a container's), one host per core, each with a
    bigger arena. ``fit_arenas(bytes wanted, count)`` is ``pipeline.broker.bodies.fit_arenas``."""
    if not cfg.pool:
        return 0, 0, None
    readers = cfg.reader_pool or 2 * cfg.pool
    arena_bytes, note = fit_arenas(cfg.arena_mb * 1024 * 1024, readers + 1)
    if note and not cfg.reader_pool and readers > cfg.pool:
        readers = cfg.pool
        arena_bytes, note = fit_arenas(cfg.arena_mb * 1024 * 1024, readers + 1)
        note = (note or f"body arenas of {cfg.arena_mb} MiB") + f": readers run in {readers} hosts, one per core"
    return readers, arena_bytes, note


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, or 127.x seen through an IPv4-mapped IPv6 address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def fd_alarm(used: int, limit: int, was_set: bool, settled: bool = True) -> bool:
    """RabbitMQ's ``file_descriptor_limit`` alarm: set when one more connection would not fit in the
    share of the descriptor limit connections may take; cleared once two would (no flapping), on a
    count ``settled``: taken when the newest connection has had time to open its channel. (A count
    just after a burst of accepts is short of what those connections will hold: clearing on it set
    and cleared the alarm three times in a second.)"""
    room = limit * FD_SHARE_FOR_CONNECTIONS - used
    if was_set and not settled:
        return True
    return room < FDS_PER_CONNECTION * (2 if was_set else 1)


def raise_fd_limit() -> int:
    """Take the hard descriptor limit as the soft one (as RabbitMQ's packaging raises it): each
    connection holds a dozen descriptors here. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def fds_in_use(pid: int | None = None) -> int:
    """Descriptors open in this process (or in ``pid``)."""
    if pid is None:
        try:
            return len(os.listdir("/proc/self/fd")) - 1        # less the one listdir itself holds
        except OSError:
            return 0
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _child_setup(title: str, keep: set[int]) -> None:
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]))
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the supervisor alone stops stages
        signal.signal(sig, signal.SIG_IGN)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


class Supervisor:
    def __init__(self, cfg: BrokerConfig, *, out=None):
        self.cfg = cfg
        self.out = out or sys.stdout
        # message bodies are the users' data: only the broker's owner reads the data directory, its
        # segments, journals, pages and definitions (every process started from here inherits the umask)
        os.umask(0o077)
        os.makedirs(cfg.data_dir, mode=0o700, exist_ok=True)
        os.chmod(cfg.data_dir, 0o700)
        removed = shm.cleanup_stale()
        self.run_id = shm.new_run_id()
        self.owner = shm.SegmentOwner(self.run_id)
        # made before any fork, so every stage process maps them (pipeline.broker.bodies)
        self.bodies = None
        readers, arena_bytes, arena_note = plan_reader_hosts(cfg, _bodies.fit_arenas)
        self.reader_host_count = readers
        if arena_bytes:
            self.bodies = _bodies.Bodies.create(self.owner, readers + 1, arena_bytes)
        _bodies.install(self.bodies)
        self.next_holder = 1
        self.batch_refused = False      # the machine refused SCHED_BATCH once (and it was logged)
        self.procs: dict[str, Proc] = {}
        self.by_pid: dict[int, Proc] = {}
        self.links = wiring.Links(self.owner, self.cfg.ring_bytes)
        self.next_conn = 1
        self.defs = Definitions()
        self.stats: dict[str, dict] = {}
        self.clock = StateClock()                         # each process's state, on change only
        self.tokens_waiting: set[Proc] = set()            # stages whose inbox pipe was full
        self.selector = selectors.DefaultSelector()
        self.running = True
        self.exit_code = EXIT_OK
        self.deaths: list[dict] = []
        self.deletions: dict[int, tuple] = {}            # request -> (queue, who to answer or None)
        self.purges: dict[int, tuple] = {}               # request -> (queue, ctl client to answer)
        self.next_request = 0
        self.after_deletion: dict[str, list] = {}        # queue -> declares that wait until it is gone
        self.ended_names: collections.deque = collections.deque()
        self.restarts = lifecycle.RestartBook()
        self.incarnations: dict[str, int] = {}
        self.alarms: dict[str, dict] = {}
        self.watchdog_limits: dict = {}
        self.ctl_waiting: list = []           # ctl clients waiting for the watchdog's answer, in order
        self.replies_after_tokens: list = []  # answers held until every reader has its alarm tokens
        self.paging = False
        self.accept_paused_until = 0.0
        self.fd_limit = raise_fd_limit()
        self.fd_alarm = False
        self.fds_used = 0
        self.fds_counted_ns = 0
        self.accepted_ns = 0                 # when the newest connection was accepted
        self.accepting = True
        self.telemetry = telemetry.Recorder(cfg.data_dir)
        self.tls = None
        if cfg.tls_port is not None:
            import ssl
            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        self.listeners: list[tuple[socket.socket, bool]] = []     # (listening socket, TLS?)
        self.port = self.listen(cfg.host, cfg.port, tls=False)
        self.tls_port = self.listen(cfg.host, cfg.tls_port, tls=True) if cfg.tls_port is not None else None
        self.management_sock: socket.socket | None = None
        self.management_port: int | None = None
        if cfg.management_port is not None:
            self.management_sock, self.management_port = self.listen_management(cfg.management_port)
        self.started_ns = time.monotonic_ns()
        self.fsync_histogram = LatencyHistogram()
        self.retired: dict[str, dict] = {}                # counters of processes that ended, by kind
        self.retired_names: set[str] = set()      # processes whose counters went into ``retired``
        self.ctl_path = os.path.join(cfg.data_dir, "ctl.sock")
        self.ctl = CtlServer(self.ctl_path, self.selector, self.ctl_request)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.selector.register(self.wake_r, selectors.EVENT_READ, ("signal", None))
        self.log("info", [f"Starting creditflow broker (run {self.run_id}), data dir {cfg.data_dir}"])
        for sock, tls in self.listeners:
            host, port = sock.getsockname()[:2]
            self.log("info", [f"started {'TLS (SSL) ' if tls else ''}TCP listener on "
                              f"{'[' + host + ']' if ':' in host else host}:{port}"])
        if arena_note:
            self.log("warning", [arena_note])
        if removed:
            self.log("warning", [f"removed {len(removed)} shared-memory entries left by a killed run"])

    # -- logging -------------------------------------------------------------------
    def log(self, level: str, lines: list[str]) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        for line in lines:
            text = f"{stamp} [{level}] {line}" if line else ""
            try:
                print(text, file=self.out, flush=True)
            except (OSError, ValueError):
                pass
            self.telemetry.log(level, line)

    # -- spawning ------------------------------------------------------------------
    def endpoints(self, name: str):
        """A new stage's inbox pipe (read, write), doorbell and control socketpair (ours, its); None (and a
        log line) when the machine refuses a descriptor."""
        made: list = []
        try:
            made += os.pipe()
            made.append(Doorbell())
            made += control.socketpair()
        except OSError as exc:
            self.log("error", [f"cannot start {name}: {exc}"])
            _close_endpoints(made)
            return None
        return tuple(made)

    def spawn(self, name: str, kind: str, factory, extra_keep: tuple[int, ...] = (), **info) -> Proc | None:
        """Fork a stage; None (and a log line) if the machine refuses a process or a descriptor."""
        made = self.endpoints(name)
        if made is None:
            return None
        inbox_r, inbox_w, doorbell, parent_ctl, child_ctl = made
        endpoints = list(made)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT})
        try:
            pid = os.fork()
            if pid == 0:
                code = EXIT_STAGE_CRASHED
                try:
                    import faulthandler
                    faulthandler.register(signal.SIGUSR1, all_threads=False)
                    _child_setup(f"cf-{name}", {inbox_r, doorbell.fileno(), child_ctl.fileno(), *extra_keep})
                    if kind in PIPELINE_KINDS:
                        keep_heap_mapped()
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
                    stage = factory(child_ctl, inbox_r, doorbell.fileno())
                    if not self.cfg.telemetry and hasattr(stage, "stats_interval_ns"):
                        stage.stats_interval_ns = UNTRACED_STATS_INTERVAL_MS * 1_000_000
                    code = stage.run()
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
        except OSError as exc:
            self.log("error", [f"cannot start {name}: fork failed: {exc}"])
            _close_endpoints(endpoints)
            return None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.close(inbox_r)
        child_ctl.close()
        os.set_blocking(inbox_w, False)
        if kind in PIPELINE_KINDS and self.cfg.scheduling == "batch":
            self.schedule_as_batch(pid)
        proc = Proc(name, kind, pid, parent_ctl, control.Outbox(parent_ctl), inbox_w, doorbell, factory=factory,
                    **info)
        self.procs[name] = proc
        self.by_pid[pid] = proc
        self.selector.register(parent_ctl, selectors.EVENT_READ, ("proc", name))
        self.telemetry.event("spawn", name, {"pid": pid, "kind": kind})
        return proc

    def schedule_as_batch(self, pid: int) -> None:
        """Put a pipeline process under SCHED_BATCH. Stages wake each other with a doorbell per batch;
        under the default policy a woken stage often preempts the one that rang, so a turn that rings
        three peers is cut short three times. A batch process runs its turn out and the woken one takes
        the next free slice; an idle core still runs it at once, so latency at a rate the cores keep up
        with does not change. Linux lets any process choose it for its own children."""
        try:
            os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:
            pass                        # it has ended already: reaped as any other
        except OSError as exc:
            if not self.batch_refused:
                self.batch_refused = True
                self.log("warning", [f"the pipeline's processes keep the default scheduling policy: {exc}"])

    def start_stage(self, name: str, kind: str, spec: dict, extra_fds: tuple[int, ...] = (), **info) -> Proc | None:
        """A reader, channel or queue: in the host of its kind that runs the fewest (``cfg.pool``), or
        with ``pool`` 0 in a process of its own. ``spec`` is JSON (``pipeline.broker.host.build_stage``)."""
        holder = 0
        if self.bodies is not None and self.next_holder < _bodies.LIVENESS_IDS:
            holder = self.next_holder
            self.next_holder += 1
        spec = {**spec, "holder": holder}
        info["holder"] = holder
        if not self.cfg.pool:
            def factory(ctl, inbox, bell):
                return build_stage(kind, name, spec, self.cfg, ctl, inbox, bell, list(extra_fds), self.tls)
            return self.spawn(name, kind, factory, extra_keep=extra_fds, **info)
        host = self.host_for(kind)
        if host is None:
            return None
        made = self.endpoints(name)
        if made is None:
            return None
        inbox_r, inbox_w, doorbell, parent_ctl, child_ctl = made
        try:
            host.outbox.put({"type": "host", "name": name, "kind": kind, "spec": spec},
                            [inbox_r, doorbell.fileno(), child_ctl.fileno(), *extra_fds])
        except OSError as exc:
            self.log("error", [f"cannot start {name}: {exc}"])
            _close_endpoints(made)
            return None
        self.want_write(host)
        os.close(inbox_r)           # the outbox holds duplicates until the host has them
        child_ctl.close()
        os.set_blocking(inbox_w, False)
        proc = Proc(name, kind, host.pid, parent_ctl, control.Outbox(parent_ctl), inbox_w, doorbell, host=host.name,
                    **info)
        host.stages += 1
        self.procs[name] = proc
        self.selector.register(parent_ctl, selectors.EVENT_READ, ("proc", name))
        self.telemetry.event("spawn", name, {"pid": host.pid, "kind": kind, "host": host.name})
        return proc

    def host_for(self, kind: str) -> Proc | None:
        """The running host of ``kind`` with the fewest stages; a new one while the pool is not full."""
        hosts = [p for p in self.procs.values() if p.kind == "host" and p.number == HOSTED_KINDS.index(kind)
                 and p.state == "running"]
        size = self.reader_host_count if kind == "reader" else self.cfg.pool
        if len(hosts) < size:
            taken = {p.name for p in self.procs.values() if p.kind == "host"}    # a dying one's name too
            name = next(f"{kind}-pool-{i}" for i in range(1, size + 2) if f"{kind}-pool-{i}" not in taken)
            host = self.start_host(name, kind)
            if host is not None:
                return host
        return min(hosts, key=lambda p: p.stages, default=None)

    def start_host(self, name: str, kind: str) -> Proc | None:
        cfg = self.cfg
        interval = None if cfg.telemetry else UNTRACED_STATS_INTERVAL_MS * 1_000_000

        arena = None
        if kind == "reader" and self.bodies is not None:     # one allocator per arena, ever at once
            taken = {p.arena for p in self.procs.values() if p.kind == "host"}
            arena = next((i for i in range(len(self.bodies.arenas)) if i not in taken), None)

        def factory(ctl, inbox, bell):
            _bodies.claim(arena)
            return Host(name, ctl, cfg, stats_interval_ns=interval, tls_context=self.tls)
        host = self.spawn(name, "host", factory, number=HOSTED_KINDS.index(kind), arena=arena)
        if host is not None:
            self.log("info", [f"started {name} (pid {host.pid}) to run {kind}s"])
        return host

    def make_link(self, sender: str, receiver: str, flow: bool, spec: CreditSpec | None = None) -> int | None:
        """A ring from ``sender`` to ``receiver``; None when either is not running (it ended, or is
        ending), or when the ring or its attaches could not be made (logged)."""
        s, r = self.procs.get(sender), self.procs.get(receiver)
        if s is None or r is None or s.state != "running" or r.state != "running":
            return None
        try:
            rec, ring_fd = self.links.create(sender, receiver, flow)
        except OSError as exc:
            self.log("error", [f"cannot make a ring from {sender} to {receiver}: {exc}"])
            return None
        s.links.add(rec.link_id)
        r.links.add(rec.link_id)
        to_sender, to_receiver = wiring.attach_messages(rec, spec, s.holder, r.holder)
        try:
            told = (self.tell(s, to_sender, [ring_fd, r.inbox_w, r.doorbell.fileno()])
                    and self.tell(r, to_receiver, [ring_fd, s.inbox_w]))
        finally:
            os.close(ring_fd)
        if not told:        # out of descriptors: a link one end never hears of would lose what it carries
            r.links.discard(rec.link_id)
            self.drop_link(rec.link_id, receiver, "closed")
            return None
        return rec.link_id

    def link_between(self, sender: str, receiver: str) -> int | None:
        return self.links.between(sender, receiver)

    def tell(self, proc: Proc, msg: dict, fds=()) -> bool:
        """Queue ``msg`` for ``proc``; False (and logged) when there are no descriptors to duplicate."""
        try:
            proc.outbox.put(msg, fds)
        except OSError as exc:          # out of descriptors for the duplicates
            self.log("error", [f"cannot send {msg.get('type')} to {proc.name}: {exc}"])
            return False
        self.want_write(proc)
        return True

    def want_write(self, proc: Proc) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if len(proc.outbox) else 0)
        try:
            if self.selector.get_key(proc.ctl).events != events:
                self.selector.modify(proc.ctl, events, ("proc", proc.name))
        except (KeyError, ValueError):
            pass

    def token(self, proc: Proc, kind, link: int, value: int) -> None:
        proc.tokens += tokens.encode(kind, link, value)
        self.flush_tokens(proc)

    def flush_tokens(self, proc: Proc) -> None:
        """Write what its inbox pipe takes; the rest waits in ``tokens_waiting`` for the next loop."""
        while proc.tokens:
            try:
                n = os.write(proc.inbox_w, proc.tokens[:4096 - 4096 % tokens.TOKEN_BYTES])
            except BlockingIOError:
                self.tokens_waiting.add(proc)
                return
            except OSError:                 # its reader is gone: nobody to tell
                proc.tokens.clear()
                break
            del proc.tokens[:n]
        self.tokens_waiting.discard(proc)

    def flush_waiting_tokens(self) -> None:
        for p in list(self.tokens_waiting):
            self.flush_tokens(p)

    # -- the stages ------------------------------------------------------------------
    def start_store(self) -> Proc | None:
        from pipeline.broker.store import Store
        cfg = self.cfg
        store_dir = os.path.join(cfg.data_dir, "msg_store")

        def factory(ctl, inbox, bell):
            return Store("store", ctl, inbox, bell, cfg.credit, data_dir=store_dir,
                         store_spec=cfg.store_credit, delay_us=cfg.store_delay_us,
                         fsync_interval_ms=cfg.fsync_interval_ms, fsync_delay_ms=cfg.fsync_delay_ms,
                         confirm_after=cfg.confirm_after, queues_dir=os.path.join(cfg.data_dir, "queues"),
                         file_size_limit_bytes=cfg.store_file_bytes)
        return self.spawn("store", "store", factory)

    def start_watchdog(self) -> Proc | None:
        if not self.cfg.watchdog:
            return None
        from alarms.watchdog import watchdog_main
        wcfg = {**self.cfg.watchdog, **self.watchdog_limits}
        alarmed = frozenset(src for src, a in self.alarms.items() if a.get("state") == "set")
        sup = os.getpid()
        data_dir = self.cfg.data_dir
        node = self.cfg.node

        class _Watchdog:
            def __init__(self, ctl):
                self.ctl = ctl

            def run(self):
                return watchdog_main(self.ctl, data_dir=data_dir, node=node, supervisor_pid=sup, alarmed=alarmed,
                                     **wcfg)

        return self.spawn("watchdog", "watchdog", lambda ctl, inbox, bell: _Watchdog(ctl))

    def listen(self, host: str, port: int, *, tls: bool) -> int:
        """Listen on ``host:port`` (port 0: any free port), and on its IPv6 twin (``::1`` for
        127.0.0.1, ``::`` for 0.0.0.0) on the same port when the machine has IPv6; returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = self._bind(family, host, port)
        port = sock.getsockname()[1]
        self.listeners.append((sock, tls))
        twin = {"127.0.0.1": "::1", "0.0.0.0": "::", "localhost": "::1"}.get(host)
        if self.cfg.ipv6 and twin and socket.has_ipv6:
            try:
                self.listeners.append((self._bind(socket.AF_INET6, twin, port), tls))
            except OSError as exc:
                self.log("warning", [f"no IPv6 listener on [{twin}]:{port}: {exc}"])
        return port

    def _bind(self, family, host: str, port: int) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.selector.register(sock, selectors.EVENT_READ, ("listen", len(self.listeners)))
        return sock

    def listen_management(self, port: int) -> tuple[socket.socket, int]:
        """The management API's listening socket, bound here so its port is known (and refused) at start
        and a restarted management process serves on the same one."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((MANAGEMENT_HOST, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise ManagementPortInUse(exc.errno, f"management port {port} is already in use") from None
            raise
        sock.listen(128)
        return sock, sock.getsockname()[1]

    def start_management(self) -> Proc | None:
        if self.management_sock is None:
            return None
        from pipeline.management.server import ManagementProcess
        fd = self.management_sock.fileno()
        ctl_path, users = self.ctl_path, dict(self.cfg.users)
        return self.spawn("management", "management",
                          lambda ctl, inbox, bell: ManagementProcess(ctl, fd, ctl_path, users), extra_keep=(fd,))

    def accept(self, index: int) -> None:
        listener, tls = self.listeners[index]
        while True:
            if self.check_fds():
                return
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.pause_accepting(f"cannot accept a connection: {exc}")
                return               # ECONNABORTED and the like: that client gave up
            self.fds_used += FDS_PER_CONNECTION        # until the next count: each accept's share
            self.accepted_ns = time.monotonic_ns()
            self.start_reader(sock, addr, tls)

    def check_fds(self) -> bool:
        """Set or clear the file descriptor alarm; True while it is set (no connection is accepted:
        clients wait in the listen backlog, as RabbitMQ's do, until connections close)."""
        if self.fd_limit == resource.RLIM_INFINITY:
            return False
        was = self.fd_alarm
        now = time.monotonic_ns()
        # listing /proc/*/fd costs per entry: counted when due, and before the alarm is set on an
        # estimate (between counts each accept's share is a guess)
        if now - self.fds_counted_ns >= FD_COUNT_INTERVAL_NS or (not was and fd_alarm(self.fds_used,
                                                                                      self.fd_limit, False)):
            self.fds_used, self.fds_counted_ns = self.fds_fullest(), now
        self.fd_alarm = fd_alarm(self.fds_used, self.fd_limit, was,
                                 settled=self.fds_counted_ns - self.accepted_ns >= FD_SETTLE_NS)
        if self.fd_alarm and not was:
            self.log("warning", ["file descriptor limit alarm set.", "",
                                 "********************************************************************",
                                 "*** New connections will not be accepted until this alarm clears ***",
                                 "********************************************************************"])
            self.telemetry.event("fd_alarm_set", "supervisor", {"limit": self.fd_limit})
        elif was and not self.fd_alarm:
            self.log("warning", ["file descriptor limit alarm cleared"])
            self.telemetry.event("fd_alarm_cleared", "supervisor", {"limit": self.fd_limit})
        self.set_accepting()
        return self.fd_alarm

    def fds_fullest(self) -> int:
        """Descriptors in use in the supervisor or the fullest host: every one of them has the same limit."""
        return max([fds_in_use(), *(fds_in_use(p.pid) for p in self.procs.values() if p.kind == "host")])

    def pause_accepting(self, why: str) -> None:
        self.log("warning", [f"{why}; not accepting for {ACCEPT_PAUSE_S} s"])
        self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
        self.set_accepting()

    def resume_accepting(self) -> None:
        if self.accept_paused_until and time.monotonic() >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self.set_accepting()

    def set_accepting(self) -> None:
        on = self.running and not self.accept_paused_until and not self.fd_alarm
        if on == self.accepting:
            return
        self.accepting = on
        for i, (listener, _) in enumerate(self.listeners):
            try:
                if on:
                    self.selector.register(listener, selectors.EVENT_READ, ("listen", i))
                else:
                    self.selector.unregister(listener)
            except (KeyError, ValueError, OSError):
                pass

    def start_reader(self, sock: socket.socket, addr, tls: bool = False) -> None:
        n = self.next_conn
        self.next_conn += 1
        name = f"reader-{n}"
        cfg = self.cfg
        readers = sum(1 for p in self.procs.values() if p.kind == "reader")
        refuse = None
        vhost_most = self.defs.limit("max-connections")
        if vhost_most is not None and readers >= vhost_most:
            refuse = connection_limit_text(vhost_most)
        elif readers >= cfg.connection_max:
            refuse = connection_limit_text(cfg.connection_max)
        alarms = [src for src, a in self.alarms.items() if a.get("state") == "set"]
        here = sock.getsockname()
        fd = sock.detach()
        peer = f"{addr[0]}:{addr[1]} -> {here[0]}:{here[1]}"

        connection = {"node_name": cfg.node, "heartbeat_s": cfg.heartbeat_s, "frame_max": cfg.frame_max,
                      "channel_max": cfg.channel_max, "max_message_bytes": cfg.max_message_bytes,
                      "refuse_open": refuse, "handshake_timeout_s": cfg.handshake_timeout_s, "users": cfg.users,
                      "loopback_users": list(cfg.loopback_users), "peer_is_loopback": is_loopback(addr[0])}
        spec = {"connection": connection, "alarms": alarms, "tls": tls}
        proc = self.start_stage(name, "reader", spec, extra_fds=(fd,), peer=peer)
        os.close(fd)                 # the reader has its own copy now (or, if none started, the client is dropped)
        if proc is not None:
            self.telemetry.event("connection", name, {"peer": f"{addr[0]}:{addr[1]}"})

    def open_channel(self, reader: Proc, number: int, cancel_notify: bool) -> None:
        cfg = self.cfg
        name = f"channel-{reader.name.split('-', 1)[1]}.{number}"
        if name in self.procs:  # the same number reopened while its old process is still stopping
            name = f"{name}-{self.links.next_id}"

        spec = {"number": number, "reader": reader.name, "cancel_notify": cancel_notify}
        chan = self.start_stage(name, "channel", spec, owner=reader.name, number=number)
        if chan is None:
            self.tell(reader, {"type": "channel_refused", "channel": number, "code": 541,
                               "text": "INTERNAL_ERROR - cannot start a channel process"})
            return
        self.tell(chan, {"type": "routing", "snapshot": self.defs.routing.snapshot()})
        out = self.make_link(reader.name, name, flow=not cfg.credit.disabled)
        inp = self.make_link(name, reader.name, flow=False) if out is not None else None
        if out is not None and inp is not None:
            self.tell(reader, {"type": "channel_ready", "channel": number, "out": out, "in": inp})
            return
        # no ring (/dev/shm full) or an end already stopping: the reader, waiting for this channel before
        # it parses anything more, must hear that it will not come
        self.stop_proc(chan)
        if reader.state == "running":
            self.tell(reader, {"type": "channel_refused", "channel": number, "code": 541,
                               "text": "INTERNAL_ERROR - cannot connect a channel process"})

    def queue_spec(self, qdef: QueueDef) -> dict:
        cfg = self.cfg
        name = qdef.name
        fname = names.file_name(name)
        journal_dir = os.path.join(cfg.data_dir, "queues", fname)
        legacy = names.legacy_file_name(name)
        if legacy and legacy != fname and os.path.isdir(os.path.join(cfg.data_dir, "queues", legacy)) \
                and not os.path.exists(journal_dir):
            os.replace(os.path.join(cfg.data_dir, "queues", legacy), journal_dir)
        pname = f"queue-{name}"
        incarnation = self.incarnations[pname] = self.incarnations.get(pname, -1) + 1
        snapshot = self.defs.routing.snapshot() if qdef.args.dead_letter_exchange is not None else None
        return {"queue": name, "durable": qdef.durable, "owner": qdef.owner, "auto_delete": qdef.auto_delete,
                "arguments": arguments_to_json(qdef.arguments), "run_id": self.run_id,
                "store_credit": [cfg.store_credit.initial, cfg.store_credit.more_after],
                "journal_dir": journal_dir, "store_dir": os.path.join(cfg.data_dir, "msg_store"),
                "page_path": os.path.join(cfg.data_dir, "paged", fname + ".pages"),
                "incarnation": incarnation, "routing": snapshot}

    def start_queue(self, qdef: QueueDef) -> Proc | None:
        proc = self.start_stage(f"queue-{qdef.name}", "queue", self.queue_spec(qdef))
        if proc is None:
            return None
        if self.paging:
            self.tell(proc, {"type": "page", "on": True})
        alarms = [src for src, a in self.alarms.items() if a.get("state") == "set"]
        if alarms:
            self.tell(proc, {"type": "alarms", "set": alarms})
        self.link_queue_store(proc)
        return proc

    def link_queue_store(self, queue: Proc) -> None:
        # The store's link back to the queue first: each control socket brings attaches in order, so the
        # store can answer (on_disk) whatever it reads from the queue, and the queue, which re-sends what
        # a crashed store had not written as soon as its link to the store is attached, hears the answer.
        # The other way round a write read before the link back was attached went unconfirmed for good.
        if self.make_link("store", queue.name, flow=False) is not None:
            self.make_link(queue.name, "store", flow=not self.cfg.store_credit.disabled, spec=self.cfg.store_credit)

    def link_channel_queue(self, channel: Proc, queue: str) -> None:
        if channel.state != "running":
            return                  # the channel is ending: there is nobody to answer
        qdef = self.defs.queues.get(queue)
        qname = f"queue-{queue}"
        if qdef is None or qdef.down or qname not in self.procs:
            refused = queue_stopped(queue) if qdef is not None else not_found_queue(queue)
            self.tell(channel, {"type": "no_queue", "queue": queue, "code": refused.code, "text": refused.text})
            return
        # The queue's links back (to the channel, to its connection's reader) are made before the
        # channel's link to the queue: the queue reads what the channel sends only once it has attached
        # that link, and its control socket brings attaches in order, so by then it can answer. (Its
        # attaches and the channel's queue_linked travel on different sockets: nothing orders them.)
        out = self.link_between(channel.name, qname)
        inp = self.link_between(qname, channel.name)
        if inp is None:
            inp = self.make_link(qname, channel.name, flow=False)
        reader = self.procs.get(channel.owner)
        if reader is not None and self.link_between(qname, reader.name) is None:
            link = self.make_link(qname, reader.name, flow=False)
            if link is not None:
                self.tell(reader, {"type": "queue_link", "link": link, "queue": queue})
        if out is None and inp is not None:
            out = self.make_link(channel.name, qname, flow=not self.cfg.credit.disabled)
        if out is None or inp is None:      # the queue is ending: nothing can be linked to it now
            refused = queue_stopped(queue)
            self.tell(channel, {"type": "no_queue", "queue": queue, "code": refused.code, "text": refused.text})
            return
        self.tell(channel, {"type": "queue_linked", "queue": queue, "out": out, "in": inp})

    # -- messages from stages -----------------------------------------------------------
    def on_proc_ready(self, name: str, events: int) -> None:
        proc = self.procs.get(name)
        if proc is None:
            return
        if events & selectors.EVENT_WRITE:
            proc.outbox.flush_nowait()
            self.want_write(proc)
        if events & selectors.EVENT_READ:
            self.on_proc_msg(proc)

    def on_proc_msg(self, proc: Proc, limit: int = 256) -> None:
        """Handle up to ``limit`` of its messages (then the loop goes on; select comes back here)."""
        for _ in range(limit):
            try:
                msg, fds = control.recv_msg_nowait(proc.ctl)
            except WouldBlock:
                return
            except CorruptRecord as exc:
                self.log("error", [f"dropped a corrupt control message from {proc.name}: {exc}"])
                continue
            except (PeerGone, OSError):
                try:
                    self.selector.unregister(proc.ctl)   # it is ending: SIGCHLD, or its host, says how
                except (KeyError, ValueError):
                    pass
                return
            for fd in fds:
                os.close(fd)
            try:
                self.handle(proc, msg)
            except Exception:   # one bad message must not take the broker down
                self.log("error", [f"error handling {msg.get('type')!r} from {proc.name}:",
                                   *traceback.format_exc().rstrip().splitlines()])

    def handle(self, proc: Proc, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "stats":
            self.stats[proc.name] = msg
            self.retired_names.discard(proc.name)     # a restarted process counts afresh
            now = time.monotonic_ns()
            for change in self.clock.tick(now):          # what time alone changed comes first
                self.record_state(change)
            self.record_state(self.clock.observe(proc.name, msg, now))
            if self.cfg.telemetry:
                self.telemetry.stats(msg, stages=len(self.procs))
            if proc.kind == "watchdog":
                self.check_paging(msg)
            elif proc.kind == "store":
                for _, duration_ns in msg.get("fsync_events", ()):
                    self.fsync_histogram.add(int(duration_ns))
        elif kind == "log":
            self.log(msg.get("level", "info"), msg.get("lines", []))
        elif kind == "exited" and proc.kind == "host":     # one of its stages ended
            stage = self.procs.get(msg.get("name"))
            if stage is not None and stage.host == proc.name and not stage.reaped:
                stage.exit_code, stage.exit_how = int(msg.get("code", EXIT_STAGE_CRASHED)), msg.get("how")
                self.ended(stage, stage.exit_code)
        elif kind == "disk_written":           # a stage wrote DISK_NUDGE_BYTES: measure free disk now
            wd = self.procs.get("watchdog")
            if wd is not None and wd.state == "running":
                self.tell(wd, {"type": "disk_written"})
        elif kind == "open_channel":
            if proc.kind == "reader" and proc.state == "running":
                self.open_channel(proc, int(msg["channel"]), bool(msg.get("cancel_notify")))
        elif kind == "connection_closed":     # its exclusive queues go with it
            if proc.kind == "reader":
                self.delete_exclusive_queues(proc)
        elif kind == "close_channel":
            pass  # the channel process exits by itself; reaping tears its links down
        elif kind == "link_queue":
            self.link_channel_queue(proc, msg["queue"])
        elif kind == "declare_queue":
            self.declare_queue(proc, msg)
        elif kind == "exchange":
            self.tell(proc, {"type": "reply", **self.exchange_op({**msg, "owner": proc.owner})})
        elif kind == "delete_queue":
            self.delete_queue(proc, msg)
        elif kind == "delete_answer":
            self.on_delete_answer(msg)
        elif kind == "purge_answer":
            self.on_purge_answer(msg)
        elif kind == "delete_me":           # auto-delete or x-expires: the queue asks to go
            self.log("info", [f"queue '{msg['queue']}' in vhost '/' is deleted ({msg.get('reason')})"])
            self.delete_queue(None, {"queue": msg["queue"]})
        elif kind == "alarm":
            self.on_alarm(msg)
        elif kind == "reply":
            self.watchdog_reply(msg)

    def declare_queue(self, channel: Proc, msg: dict) -> None:
        name = msg["queue"]
        qdef = self.defs.queues.get(name)
        if (qdef.deleting if qdef is not None else f"queue-{name}" in self.procs):
            # answered once it is gone: the queue being deleted, or the process of one deleted a moment
            # ago (a new queue of the same name must not start beside it, under its name)
            self.after_deletion.setdefault(name, []).append((channel, msg))
            return
        try:
            qdef, made = self.defs.declare_queue(
                name, durable=bool(msg.get("durable")), exclusive=bool(msg.get("exclusive")),
                auto_delete=bool(msg.get("auto_delete")), arguments=arguments_from_json(msg.get("arguments")),
                owner=channel.owner, passive=bool(msg.get("passive")),
                reserved=msg.get("generated") is True or (name.startswith(REPLY_TO_PREFIX)
                                                          and msg.get("reply_to") is True))
        except (AmqpError, QueueError) as exc:
            self.tell(channel, {"type": "declare_refused", "queue": name, **vars(refused(exc))})
            return
        if made:
            if self.start_queue(qdef) is None:
                self.defs.remove_queue(name)
                self.defs.routing.take_changes()
                self.tell(channel, {"type": "declare_refused", "queue": name, "code": 541, "hard": True,
                                    "text": f"INTERNAL_ERROR - cannot start a process for queue '{name}'"})
                return
            self.broadcast_routing()
            if qdef.durable:
                self.save_definitions()
        self.link_channel_queue(channel, name)

    def exchange_op(self, msg: dict) -> dict:
        """exchange.declare/delete/bind/unbind and queue.bind/unbind, on the routing table."""
        op = msg["op"]
        r = self.defs.routing
        args = arguments_from_json(msg.get("arguments"))
        try:
            if op == "declare":
                r.declare_exchange(msg["exchange"], msg["kind"], passive=bool(msg.get("passive")),
                                   durable=bool(msg.get("durable")), auto_delete=bool(msg.get("auto_delete")),
                                   internal=bool(msg.get("internal")), arguments=args)
            elif op == "delete":
                r.delete_exchange(msg["exchange"], if_unused=bool(msg.get("if_unused")))
            elif op in ("bind", "unbind"):
                self.check_owner(msg["queue"], msg.get("owner"), (50, 20) if op == "bind" else (50, 50))
                if op == "bind":
                    r.bind_queue(msg["exchange"], msg["queue"], msg.get("routing_key", ""), args)
                else:
                    r.unbind_queue(msg["exchange"], msg["queue"], msg.get("routing_key", ""), args)
            elif op == "bind_exchange":
                r.bind_exchange(msg["source"], msg["destination"], msg.get("routing_key", ""), args)
            elif op == "unbind_exchange":
                r.unbind_exchange(msg["source"], msg["destination"], msg.get("routing_key", ""), args)
            else:
                return {"ok": False, "code": 540, "hard": True, "text": f"NOT_IMPLEMENTED - {op}"}
        except (AmqpError, QueueError) as exc:
            return {"ok": False, **vars(refused(exc))}
        if self.broadcast_routing():
            self.save_definitions()
        return {"ok": True}

    def check_owner(self, queue: str, owner: str | None, method: tuple[int, int]) -> None:
        """An exclusive queue takes bindings only from its own connection (405, as RabbitMQ)."""
        qdef = self.defs.queues.get(queue)
        if qdef is not None and qdef.owner is not None and qdef.owner != owner:
            from pipeline.amqp.errors import ChannelLevelError
            raise ChannelLevelError(405, f"RESOURCE_LOCKED - cannot obtain exclusive access to locked queue "
                                         f"'{queue}' in vhost '/'. It could be originally declared on another "
                                         "connection or the exclusive property value does not match that of "
                                         "the original declaration.", *method)

    def broadcast_routing(self) -> bool:
        """Send the routing table's changes to every channel and to every queue that dead-letters (the
        only queues that route, and so the only ones started with a copy); True if there were any."""
        changes = self.defs.routing.take_changes()
        if not changes:
            return False
        for p in self.procs.values():
            if p.state != "running":
                continue
            if p.kind == "queue":
                qdef = self.defs.queues.get(p.name[len("queue-"):])
                if qdef is None or qdef.args.dead_letter_exchange is None:
                    continue
            elif p.kind != "channel":
                continue
            self.tell(p, {"type": "routing", "changes": changes})
        return True

    # -- deleting queues ---------------------------------------------------------------------------
    def delete_queue(self, requester: Proc | None, msg: dict) -> None:
        """queue.delete from a channel (or the queue's own wish, or its owner's end): the queue process
        checks if-unused/if-empty and answers; ``queue_deleted`` finishes the job."""
        name = msg["queue"]
        qdef = self.defs.queues.get(name)
        reply_to = requester.name if requester is not None else None
        if qdef is None:
            if reply_to:
                self.tell(requester, {"type": "reply", "ok": True, "message_count": 0})
            return
        if requester is not None and requester.kind == "channel" and qdef.owner not in (None, requester.owner):
            try:
                self.check_owner(name, requester.owner, (50, 40))
            except AmqpError as exc:
                self.tell(requester, {"type": "reply", "ok": False, **vars(refused(exc))})
                return
        proc = self.procs.get(f"queue-{name}")
        if proc is None or proc.state != "running":
            self.queue_deleted(name, 0)
            if reply_to:
                self.tell(requester, {"type": "reply", "ok": True, "message_count": 0})
            return
        self.ask_queue_to_delete(proc, qdef, reply_to, msg)

    def ask_queue_to_delete(self, proc: Proc, qdef: QueueDef, reply_to, msg: dict) -> None:
        """The queue process checks if-unused/if-empty and answers (``delete_answer``); ``reply_to``: a
        channel's name or a ctl client, answered then (``answer_deletion``)."""
        qdef.deleting = True
        self.next_request += 1
        self.deletions[self.next_request] = (qdef.name, reply_to)
        self.tell(proc, {"type": "delete", "req": self.next_request, "if_unused": bool(msg.get("if_unused")),
                         "if_empty": bool(msg.get("if_empty"))})

    def on_delete_answer(self, msg: dict) -> None:
        if msg.get("req") is not None:
            name, reply_to = self.deletions.pop(msg["req"], (None, None))
        else:                                   # a channel's queue.delete, sent over the queue's ring
            name, reply_to = msg.get("queue"), msg.get("channel")
            qdef = self.defs.queues.get(name)
            if qdef is None or qdef.deleting:   # another deletion went first: this one is answered as is
                self.answer_deletion(reply_to, {k: v for k, v in msg.items()
                                                if k in ("ok", "message_count", "code", "text")})
                return
            if msg.get("ok"):
                qdef.deleting = True
        if name is None or name not in self.defs.queues:
            return
        if not msg.get("ok"):
            self.defs.queues[name].deleting = False
            self.replay_declares(name)
            self.answer_deletion(reply_to, {k: v for k, v in msg.items() if k not in ("type", "req")})
            return
        self.queue_deleted(name, msg.get("message_count", 0))
        self.answer_deletion(reply_to, {"ok": True, "message_count": msg.get("message_count", 0)})

    def answer_deletion(self, reply_to, reply: dict) -> None:
        """To a channel (by name, if it is still there) its ``reply``; to a ctl client ctl's shape of it."""
        if isinstance(reply_to, str):
            requester = self.procs.get(reply_to)
            if requester is not None:
                self.tell(requester, {"type": "reply", **reply})
        elif reply_to is not None:
            self.ctl.reply(reply_to, reply if reply.get("ok") else
                           {"ok": False, "code": reply.get("code"), "error": reply.get("text")})

    def queue_deleted(self, name: str, messages: int) -> None:
        """The queue is gone: out of the definitions and the routing table (every copy told), its
        process stopped (its channels and consumers hear it by their links), its files removed."""
        qdef = self.defs.queues.get(name)
        self.defs.remove_queue(name)
        self.broadcast_routing()
        if qdef is not None and qdef.durable:
            self.save_definitions()
        proc = self.procs.get(f"queue-{name}")
        if proc is not None:
            proc.deleted = True
            self.stop_proc(proc)
        else:
            self.remove_queue_files(name)
        self.log("info", [f"Deleted queue '{name}' in vhost '/' ({messages} messages)"])
        self.telemetry.event("queue_deleted", f"queue-{name}", {"messages": messages})
        self.replay_declares(name)

    def replay_declares(self, name: str) -> None:
        for chan, msg in self.after_deletion.pop(name, []):
            if chan is None:                    # the management API's, answered on its ctl connection
                if msg["client"].open:          # not for a client that gave up waiting
                    reply = self.ctl_declare_queue(msg["client"], msg["req"])
                    if reply is not None:
                        self.ctl.reply(msg["client"], reply)
                continue
            # only to the channel that asked, still open: not to a later channel of the same name, and no
            # queue for a connection that has closed meanwhile (its exclusive queues are gone already)
            if self.procs.get(chan.name) is chan and chan.state == "running":
                self.declare_queue(chan, msg)

    def remove_queue_files(self, name: str) -> None:
        import shutil
        fname = names.file_name(name)
        shutil.rmtree(os.path.join(self.cfg.data_dir, "queues", fname), ignore_errors=True)
        try:
            os.unlink(os.path.join(self.cfg.data_dir, "paged", fname + ".pages"))
        except FileNotFoundError:
            pass

    def save_definitions(self) -> None:
        try:
            self.defs.save(self.cfg.data_dir)
        except OSError as exc:
            self.log("error", [f"could not save durable definitions: {exc}"])

    def load_definitions(self) -> None:
        path = os.path.join(self.cfg.data_dir, DEFINITIONS_FILE)
        found = os.path.exists(path)
        queues, problems = self.defs.load(self.cfg.data_dir)
        if problems:
            self.log("warning", problems)
        for name in queues:
            if self.start_queue(self.defs.queues[name]) is None:
                self.defs.queues[name].down = True
        if found:
            durable_exchanges = sum(1 for ex in self.defs.routing.exchanges() if ex.durable)
            self.log("info", [f"recovered {len(queues)} durable queues and {durable_exchanges} durable exchanges "
                              f"from {path}"])

    def import_definitions(self) -> None:
        """``--definitions FILE`` (RabbitMQ's load_definitions), checked whole by the CLI, made here as an
        import over HTTP makes it: what is there already is kept, as are refusals of a binding to nothing."""
        from pipeline.management.writes import skipped_on_import
        if not self.cfg.definitions:
            return
        given, new = collections.Counter(), collections.Counter()
        for cmd, args in self.cfg.definitions:
            reply = self.ctl_request(None, {"cmd": cmd, **args})
            if reply is not None and not reply.get("ok") and not skipped_on_import(cmd, reply):
                raise RuntimeError(f"cannot import the definitions: {reply.get('error')}")
            kind = "exchanges" if args.get("op") == "declare" else "bindings" if cmd == "exchange" else cmd
            given[kind] += 1
            new[kind] += bool(reply and reply.get("created"))
        self.log("info", [f"imported definitions: {given['declare_queue']} queues ({new['declare_queue']} new), "
                          f"{given['exchanges']} exchanges ({new['exchanges']} new), {given['bindings']} bindings"
                          + (", the vhost's limits" if given["set_vhost_limits"] else "")])

    # -- paging -------------------------------------------------------------------------
    def check_paging(self, st: dict) -> None:
        """Queues page to disk while memory used > paging_ratio x the watermark (the watchdog's readings)."""
        used, limit = st.get("memory_used"), st.get("memory_limit")
        if used is None or limit is None:
            return
        on = used > limit * self.cfg.paging_ratio
        if on == self.paging:
            return
        self.paging = on
        self.log("info", [f"memory used {used} {'passed' if on else 'is back under'} {self.cfg.paging_ratio} x the "
                          f"watermark ({int(limit * self.cfg.paging_ratio)}): queues "
                          f"{'start' if on else 'stop'} paging to disk"])
        self.telemetry.event("paging", "supervisor", {"on": on, "used": used, "limit": limit})
        for p in self.procs.values():
            if p.kind == "queue":
                self.tell(p, {"type": "page", "on": on})

    # -- alarms -------------------------------------------------------------------------
    def on_alarm(self, msg: dict) -> None:
        source = msg["source"]
        state = msg["state"]
        prev = self.alarms.get(source, {}).get("state")
        if prev == state:
            return
        self.alarms[source] = {**msg, "at_ns": msg.get("at_ns", time.monotonic_ns())}
        self.telemetry.event("alarm_" + state, source, msg)
        kind = TokenKind.ALARM_SET if state == "set" else TokenKind.ALARM_CLEAR
        value = tokens.ALARM_MEMORY if source == "memory" else tokens.ALARM_DISK
        alarms = [src for src, a in self.alarms.items() if a.get("state") == "set"]
        for p in self.procs.values():
            if p.kind == "reader":
                self.token(p, kind, 0, value)
            elif p.kind == "queue":          # dead-lettering is held while an alarm holds publishers
                self.tell(p, {"type": "alarms", "set": alarms})

    def watchdog_reply(self, msg: dict) -> None:
        """The watchdog's answer to a ctl request; it goes out once every reader holds its alarm tokens."""
        if not self.ctl_waiting:
            return
        client, value_key, value = self.ctl_waiting.pop(0)
        if msg.get("ok"):
            self.watchdog_limits[value_key] = value        # a restarted watchdog keeps what ctl set
        self.replies_after_tokens.append((client, {k: v for k, v in msg.items() if k != "type"}))
        self.send_held_replies()

    def send_held_replies(self) -> None:
        if not self.replies_after_tokens or any(p.tokens for p in self.tokens_waiting if p.kind == "reader"):
            return
        for client, reply in self.replies_after_tokens:
            self.ctl.reply(client, reply)
        self.replies_after_tokens.clear()

    # -- the ctl socket (creditflow ctl) ------------------------------------------------------
    def ctl_request(self, client, req: dict) -> dict | None:
        cmd = req["cmd"]
        if cmd == "status":
            return {"ok": True, **self.status()}
        if cmd == "alarms":
            return {"ok": True, "alarms": self.alarms}
        if cmd == "topology":           # the management API's exchanges and bindings
            routing = self.defs.routing
            return {"ok": True, "exchanges": [_text_fields(dataclasses.asdict(x)) for x in routing.exchanges()],
                    "bindings": [{**_text_fields(dataclasses.asdict(b)), "properties_key": binding_key(b)}
                                 for b in routing.bindings()]}
        if cmd in ("set_watermark", "set_disk_free_limit"):
            wd = self.procs.get("watchdog")
            if wd is None or wd.state != "running":
                return {"ok": False, "error": "no watchdog is running in this broker"}
            if not isinstance(req.get("value"), (str, int, float)) or isinstance(req.get("value"), bool):
                return {"ok": False, "error": f"{cmd} needs a value"}
            key = "memory_limit" if cmd == "set_watermark" else "disk_limit"
            self.ctl_waiting.append((client, key, req["value"]))
            self.tell(wd, {"type": cmd, "value": req["value"]})
            return None
        if cmd == "set_vhost_limits":          # "merge": true keeps the limits not named (the HTTP API's PUT)
            try:
                limits = parse_limits(req.get("value") if req.get("value") is not None else "")
            except BadLimits as exc:
                return {"ok": False, "error": str(exc)}
            self.defs.limits = {**self.defs.limits, **limits} if req.get("merge") else limits
            self.save_definitions()
            self.log("info", [f"Setting vhost limits to {json.dumps(self.defs.limits)} for vhost '/'"])
            return {"ok": True, "limits": self.defs.limits}
        if cmd == "clear_vhost_limits":        # "name": that one only (the HTTP API's DELETE)
            name = req.get("name")
            self.defs.limits = {k: v for k, v in self.defs.limits.items() if name is not None and k != name}
            self.save_definitions()
            self.log("info", [f"Clearing vhost '/' limit {name}" if name is not None else "Clearing vhost '/' limits"])
            return {"ok": True, "limits": self.defs.limits}
        if cmd == "close_connection":
            return self.close_connection(req.get("name"), req.get("reason"))
        if cmd in ("delete_queue", "purge_queue"):
            return self.ctl_queue_op(client, cmd, req)
        if cmd == "declare_queue":
            return self.ctl_declare_queue(client, req)
        if cmd == "exchange":
            return self.ctl_exchange_op(req)
        if cmd == "list_vhost_limits":
            return {"ok": True, "limits": self.defs.limits}
        if cmd == "stop":
            self.running = False
            return {"ok": True}
        if cmd in ("kill", "crash"):
            return self.kill_stage(req.get("name"), cmd)
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def kill_stage(self, name, how: str = "kill") -> dict:
        """``kill``: crash one stage at once, as a SIGKILL would (Erlang's ``exit(Pid, kill)`` for one in
        a host); ``crash``: make one in a host raise, as a bug in it would (``exit(Pid, Reason)``): its
        host drops it alone and it dies as its kind dies (exit code 70). A stage in a process of its own
        has nothing to catch it: ``kill`` ends it."""
        proc = self.procs.get(name) if isinstance(name, str) else None
        if proc is None or proc.kind == "host":
            return {"ok": False, "error": f"no stage {name!r}"}
        host = self.procs.get(proc.host) if proc.host is not None else None
        if host is not None:
            self.tell(host, {"type": how, "name": name})
        elif how == "kill":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            return {"ok": False, "error": f"{name} runs in a process of its own: kill ends it"}
        return {"ok": True, "pid": proc.pid, "host": proc.host}

    # -- what the management API (and ctl) change: connections and queues ---------------------------
    def close_connection(self, name, reason) -> dict:
        """rabbitmqctl close_connection: the connection (its name, ``A:P -> B:Q``, or its reader's)
        is sent connection.close 320 ``CONNECTION_FORCED - <reason>`` by its reader."""
        if not isinstance(name, str) or not isinstance(reason, str):
            return {"ok": False, "error": "close_connection needs a connection name and a reason"}
        reader = next((p for p in self.procs.values() if p.kind == "reader" and name in (p.name, p.peer)), None)
        if reader is None:
            return {"ok": False, "code": 404, "error": f"no connection {name!r}"}
        self.log("info", [f"Closing connection {reader.name} ({reader.peer}) because {json.dumps(reason)}"])
        self.tell(reader, {"type": "force_close", "text": f"CONNECTION_FORCED - {reason}"})
        return {"ok": True, "process": reader.name}

    def ctl_queue_op(self, client, cmd: str, req: dict) -> dict | None:
        """delete_queue (``if_empty``, ``if_unused``) or purge_queue, answered once the queue process
        has done it. ``exclusive_check``: refuse an exclusive queue (405) as a connection other than
        its owner is refused (the HTTP API's; rabbitmqctl's are not)."""
        name = req.get("queue")
        if not isinstance(name, str):
            return {"ok": False, "error": f"{cmd} needs a queue name"}
        qdef = self.defs.queues.get(name)
        if qdef is None or qdef.deleting:
            return {"ok": False, "code": 404, "error": not_found_queue(name).text}
        if req.get("exclusive_check"):
            try:
                self.check_owner(name, None, (50, 40) if cmd == "delete_queue" else (50, 30))
            except AmqpError as exc:
                return {"ok": False, "code": exc.reply_code, "error": exc.reply_text}
        proc = self.procs.get(f"queue-{name}")
        running = proc is not None and proc.state == "running"
        if cmd == "delete_queue":
            if not running:
                self.queue_deleted(name, 0)
                return {"ok": True, "message_count": 0}
            self.ask_queue_to_delete(proc, qdef, client, req)
            return None
        if not running:
            return {"ok": False, "code": 404, "error": queue_stopped(name).text}
        self.next_request += 1
        self.purges[self.next_request] = (name, client)
        self.tell(proc, {"type": "purge", "req": self.next_request})
        return None

    @staticmethod
    def bad_request(req: dict, texts: tuple, tables: tuple = ("arguments",)) -> dict | None:
        """A refusal when a ctl request's ``texts`` are not strings or its ``tables`` not objects."""
        for name in texts:
            if not isinstance(req.get(name), str):
                return {"ok": False, "error": f"{req.get('cmd')} needs {name} as a string"}
        for name in tables:
            if not isinstance(req.get(name) or {}, dict):
                return {"ok": False, "error": f"{req.get('cmd')} needs {name} as an object"}
        return None

    def ctl_declare_queue(self, client, req: dict) -> dict | None:
        """queue.declare as the management API makes it (``PUT /api/queues``): owned by no connection,
        never exclusive; ``created`` says whether it was made now. One being deleted is declared (and
        answered) once it is gone, as a channel's declare is."""
        refused = self.bad_request(req, ("queue",))
        if refused is not None:
            return refused
        name = req["queue"]
        qdef = self.defs.queues.get(name)
        if qdef.deleting if qdef is not None else f"queue-{name}" in self.procs:
            self.after_deletion.setdefault(name, []).append((None, {"client": client, "req": req}))
            return None
        try:
            qdef, made = self.defs.declare_queue(
                name, durable=bool(req.get("durable")), exclusive=False, auto_delete=bool(req.get("auto_delete")),
                arguments=arguments_from_json(req.get("arguments")), owner=None, passive=False)
        except (AmqpError, QueueError) as exc:
            return {"ok": False, "code": exc.reply_code, "error": exc.reply_text}
        except (TypeError, ValueError, ArithmeticError) as exc:        # arguments that are no field values
            return {"ok": False, "error": f"declare_queue: bad arguments: {exc}"}
        if made:
            if self.start_queue(qdef) is None:
                self.defs.remove_queue(name)
                self.defs.routing.take_changes()
                return {"ok": False, "code": 541, "error": f"INTERNAL_ERROR - cannot start a process for queue '{name}'"}
            self.broadcast_routing()
            if qdef.durable:
                self.save_definitions()
        return {"ok": True, "created": made}

    def ctl_exchange_op(self, req: dict) -> dict:
        """exchange.declare/delete and the bindings, as the management API makes them (no connection's):
        a declare says whether it made the exchange (``created``), a delete of none is 404."""
        op, name = req.get("op"), req.get("exchange")
        if op not in EXCHANGE_OP_TEXTS:
            return {"ok": False, "error": f"exchange: unknown op {op!r}"}
        refused = self.bad_request(req, EXCHANGE_OP_TEXTS[op])
        if refused is not None:
            return refused
        before = self.defs.routing.lookup(name) if op in ("declare", "delete") else None
        if op == "delete" and before is None:
            return {"ok": False, "code": 404, "error": f"NOT_FOUND - no exchange '{name}' in vhost '/'"}
        if op == "unbind_key":                  # DELETE /api/bindings/...: the binding its properties key names
            found = self.binding_by_key(req.get("source"), req.get("destination"), req.get("to_exchange") is True,
                                        req.get("properties_key"))
            if found is None:
                source, destination = req.get("source"), req.get("destination")
                if (source == "" and req.get("to_exchange") is not True and destination in self.defs.queues
                        and req.get("properties_key") == properties_key(destination, None)):
                    # a queue's binding to the default exchange, which nobody may remove (as RabbitMQ)
                    return {"ok": False, "code": 403, "error": "ACCESS_REFUSED - operation not permitted on the "
                                                               "default exchange"}
                return {"ok": False, "code": 404, "error": "NOT_FOUND - no such binding"}
            source, destination = _text_fields(found.source), _text_fields(found.destination)
            req = {"op": "unbind_exchange" if found.to_exchange else "unbind", "source": source,
                   "exchange": source, "destination": destination, "queue": destination,
                   "routing_key": found.routing_key, "arguments": arguments_to_json(found.arguments)}
        try:
            reply = self.exchange_op({**req, "owner": None})
        except (TypeError, ValueError, ArithmeticError) as exc:        # arguments that are no field values
            return {"ok": False, "error": f"exchange {op}: bad arguments: {exc}"}
        if not reply["ok"]:
            return {"ok": False, "code": reply["code"], "error": reply["text"]}
        return {**reply, "created": op == "declare" and before is None}

    def binding_by_key(self, source, destination, to_exchange: bool, key):
        """The binding from ``source`` to ``destination`` whose management API properties key is ``key``."""
        for b in self.defs.routing.bindings():
            if (b.to_exchange == to_exchange and _text_fields(b.source) == source
                    and _text_fields(b.destination) == destination and binding_key(b) == key):
                return b
        return None

    def on_purge_answer(self, msg: dict) -> None:
        _, client = self.purges.pop(msg.get("req"), (None, None))
        if client is not None:
            self.ctl.reply(client, {"ok": True, "message_count": msg.get("message_count", 0)})

    def fail_pending_purges(self, queue: str) -> None:
        """The queue process ended before it answered a purge: the ctl client hears so."""
        for req, (name, client) in list(self.purges.items()):
            if name == queue:
                del self.purges[req]
                self.ctl.reply(client, {"ok": False, "code": 404, "error": queue_stopped(name).text})

    def status(self) -> dict:
        now = time.monotonic_ns()
        processes = {}
        for name, st in self.stats.items():
            proc = self.procs.get(name)
            processes[name] = {
                **{k: v for k, v in st.items() if k not in ("type", "fsync_events", "state")},
                "kind": st.get("kind"), "pid": proc.pid if proc is not None else st.get("pid"),
                "host": proc.host if proc is not None else None,
                "alive": proc is not None, "state": state_at(st, now), "seconds": self.clock.seconds(name, now),
                "restarts": self.incarnations.get(name, 0),
            }
            if proc is not None and proc.peer:
                processes[name]["peer"] = proc.peer          # a reader's "client -> listener" addresses
            if proc is not None and proc.owner:
                processes[name]["owner"] = proc.owner        # a channel's reader
        links = {}
        for st in self.stats.values():
            links.update(st.get("links", {}))
        queues = {name: {"proc": f"queue-{name}", "durable": q.durable, "down": q.down, "exclusive": q.exclusive,
                         "auto_delete": q.auto_delete, "arguments": {k: _json_value(v) for k, v in q.arguments.items()}}
                  for name, q in self.defs.queues.items()}
        hosts = {p.name: {"pid": p.pid, "kind": HOSTED_KINDS[p.number], "stages": p.stages}
                 for p in self.procs.values() if p.kind == "host"}
        return {"run_id": self.run_id, "pid": os.getpid(), "port": self.port, "node": self.cfg.node,
                "now_ns": now, "processes": processes, "hosts": hosts, "links": links, "alarms": self.alarms,
                "deaths": self.deaths, "queues": queues,
                "fd": {"used": self.fds_fullest(), "limit": self.fd_limit, "alarm": self.fd_alarm},
                "host": self.cfg.host, "tls_port": self.tls_port, "management_port": self.management_port,
                "uptime_ms": (now - self.started_ns) // 1_000_000, "connection_max": self.cfg.connection_max,
                "processors": os.cpu_count(),
                "proc": {"used": 1 + len({p.pid for p in self.procs.values()}), "limit": _nproc_limit()},
                "routing": dataclasses.asdict(self.defs.routing.statistics()),
                "retired": self.retired, "fsync_histogram": self.fsync_histogram.snapshot(),
                "arenas": self.arena_status()}

    def arena_status(self) -> list[dict]:
        """Each body arena's header, and the slots live holders still hold (a read-only walk)."""
        out = []
        for arena in self.bodies.arenas if self.bodies is not None else ():
            slots, body = arena.held_slots()
            out.append({**dataclasses.asdict(arena.statistics()), "held_slots": slots, "held_body_bytes": body})
        return out

    def record_state(self, change) -> None:
        if change is not None and self.cfg.telemetry:
            self.telemetry.state(change.at_ns, change.name, change.kind, change.state)

    def tick(self) -> float:
        """Record the states time alone changed; seconds until something is next due."""
        now = time.monotonic_ns()
        for change in self.clock.tick(now):
            self.record_state(change)
        self.telemetry.flush_if_due()
        if self.fd_alarm:
            self.check_fds()
        wait = IDLE_WAKE_S
        if self.clock.deadlines:
            wait = min(wait, max(0.0, (self.clock.deadlines[0][0] - now) / 1e9))
        if self.fd_alarm:
            wait = min(wait, FD_RECHECK_S)
        return wait

    # -- children that end -------------------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            proc = self.by_pid.pop(pid, None)
            if proc is None:
                continue
            try:
                self.ended(proc, os.waitstatus_to_exitcode(status))
            except Exception:
                self.log("error", [f"error handling the end of {proc.name}:",
                                   *traceback.format_exc().rstrip().splitlines()])

    def ended(self, proc: Proc, code: int) -> None:
        proc.reaped = True
        if proc.kind == "host":
            was_running = proc.state == "running"
            proc.state = "gone"         # a queue restarted (or declared) while its stages are handled goes elsewhere
            hosted = [p for p in self.procs.values() if p.host == proc.name]
            if hosted and was_running:
                self.log("error", [f"{proc.name} (pid {proc.pid}) ended ({lifecycle.how_it_ended(code)}) with "
                                   f"{len(hosted)} stages in it"])
            for p in hosted:             # each is a death of its own, handled as its kind's
                p.exit_code = code
                self.ended(p, code)
            self.telemetry.event("host_ended", proc.name, {"how": lifecycle.how_it_ended(code), "pid": proc.pid,
                                                           "stages": len(hosted)})
            self.close_proc(proc)
            return
        elif proc.host is not None:
            host = self.procs.get(proc.host)
            if host is not None:
                host.stages -= 1
        now = time.monotonic_ns()
        verdict = lifecycle.on_exit(proc.kind, proc.state, code, broker_running=self.running, book=self.restarts,
                                    name=proc.name, now_ns=now)
        if proc.exit_how:
            verdict = dataclasses.replace(verdict, how=proc.exit_how)
        proc.state = verdict.state
        self.close_proc(proc)
        if proc.kind == "queue":
            self.fail_pending_purges(proc.name[len("queue-"):])
        if not verdict.crashed and code != 0:
            self.log("warning", [f"{proc.name} (pid {proc.pid}) exited with {verdict.how} while it was "
                                 "ending"])
        if verdict.crashed:
            self.deaths.append({"name": proc.name, "kind": proc.kind, "pid": proc.pid, "how": verdict.how,
                                "action": verdict.action, "at_ns": now})
            self.log("error", [f"Supervisor {SUPERVISOR} had child {proc.name} (pid {proc.pid}) exit with reason "
                               f"{verdict.how} in context child_terminated"])
            self.telemetry.event("stage_died", proc.name, {"how": verdict.how, "action": verdict.action,
                                                           "kind": proc.kind, "pid": proc.pid})
        reason = "crashed" if verdict.crashed else "closed"
        for link_id in list(proc.links):
            self.drop_link(link_id, gone=proc.name, reason=reason)
        getattr(self, f"after_{verdict.action}")(proc, verdict)
        self.forget_ended(proc.name)
        if proc.kind == "queue" and proc.name not in self.procs:
            self.replay_declares(proc.name[len("queue-"):])     # declares that waited for it to go

    def close_proc(self, proc: Proc) -> None:
        """Take what it said last (a log line, final statistics), then close its endpoints here."""
        if proc.holder and self.bodies is not None:
            self.bodies.liveness.mark_dead(proc.holder)      # whatever it still held in arenas comes free
        self.on_proc_msg(proc, limit=100_000)
        self.record_state(self.clock.end(proc.name, time.monotonic_ns()))
        st = self.stats.get(proc.name)
        if st is not None and proc.name not in self.retired_names:    # global counters keep what it counted
            management_views.retire(self.retired, proc.kind, st)
            self.retired_names.add(proc.name)
        self.telemetry.stage_ended(proc.name)
        if self.procs.get(proc.name) is proc:
            del self.procs[proc.name]
        try:
            self.selector.unregister(proc.ctl)
        except (KeyError, ValueError):
            pass
        proc.outbox.drop()
        self.tokens_waiting.discard(proc)
        proc.ctl.close()
        os.close(proc.inbox_w)
        proc.doorbell.close()

    def forget_ended(self, name: str) -> None:
        """Keep the statistics of the last ENDED_KEPT processes that ended (a run's summary reads its
        publishers' readers after they closed), not of every connection a long-lived broker served."""
        if name in self.procs:
            return
        self.ended_names.append(name)
        while len(self.ended_names) > ENDED_KEPT:
            old = self.ended_names.popleft()
            if old not in self.procs:
                self.stats.pop(old, None)
                self.clock.forget(old)
        del self.deaths[:-DEATHS_KEPT]

    def after_forget(self, proc: Proc, verdict) -> None:
        if proc.kind == "reader":
            self.stop_channels_of(proc)
            self.delete_exclusive_queues(proc)
        elif proc.kind == "queue" and proc.deleted:
            self.remove_queue_files(proc.name[len("queue-"):])

    def delete_exclusive_queues(self, reader: Proc) -> None:
        """An exclusive queue goes with its connection (RabbitMQ deletes it when its owner closes)."""
        for name in [n for n, q in self.defs.queues.items() if q.owner == reader.name and not q.deleting]:
            self.delete_queue(None, {"queue": name})

    def finish_pending_deletion(self, queue: str) -> None:
        for req, (name, reply_to) in list(self.deletions.items()):
            if name == queue:
                self.on_delete_answer({"req": req, "ok": True, "message_count": 0})

    def after_close_connection(self, proc: Proc, verdict) -> None:
        channels = self.stop_channels_of(proc)
        self.delete_exclusive_queues(proc)
        self.log("error", [f"closing AMQP connection {proc.name} ({proc.peer}): its reader process died; "
                           f"{channels} channel(s) closed, their consumers' unacked messages requeued"])

    def after_internal_error(self, proc: Proc, verdict) -> None:
        reader = self.procs.get(proc.owner or "")
        self.log("error", [f"Channel error on connection {proc.owner} ({reader.peer if reader else '?'}), "
                           f"channel {proc.number}: its process died ({verdict.how}); closing the connection "
                           "with 541 INTERNAL_ERROR"])
        if reader is not None:
            self.tell(reader, {"type": "channel_crashed", "channel": proc.number,
                               "text": f"INTERNAL_ERROR - channel {proc.number} process died ({verdict.how})"})

    def after_restart(self, proc: Proc, verdict) -> None:
        if proc.kind == "queue":
            queue = proc.name[len("queue-"):]
            qdef = self.defs.queues.get(queue)
            self.log("warning", [f"Restarting crashed queue '{queue}' in vhost '/'."])
            new = self.start_queue(qdef) if qdef is not None and not qdef.deleting else None
            if qdef is not None and qdef.deleting:      # it died while being deleted: finish that
                self.finish_pending_deletion(queue)
                return
        elif proc.kind == "store":
            self.log("warning", ["Restarting crashed message store msg_store_persistent for vhost '/': "
                                 "it recovers its segments and the queues re-send what it had not written"])
            new = self.start_store()
            if new is not None:
                for q in [p for p in self.procs.values() if p.kind == "queue"]:
                    self.link_queue_store(q)
        elif proc.kind == "management":
            self.log("warning", ["Restarting crashed management listener (HTTP API and /metrics) on port "
                                 f"{self.management_port}"])
            new = self.start_management()
        else:
            self.log("warning", ["Restarting crashed memory and disk monitor; alarms are re-evaluated from a "
                                 "fresh reading"])
            for client, _, _ in self.ctl_waiting:
                self.ctl.reply(client, {"ok": False, "error": "the watchdog restarted before it answered"})
            self.ctl_waiting.clear()
            new = self.start_watchdog()
        if new is None:
            self.after_give_up(proc, verdict)
            return
        self.log("info", [f"{proc.name} restarted as pid {new.pid}"])
        self.deaths[-1]["restarted_pid"] = new.pid
        self.telemetry.event("stage_restarted", proc.name, {"pid": new.pid, "was": proc.pid})

    def after_queue_down(self, proc: Proc, verdict) -> None:
        self.after_give_up(proc, verdict)

    def after_stop_broker(self, proc: Proc, verdict) -> None:
        self.after_give_up(proc, verdict)

    def after_no_watchdog(self, proc: Proc, verdict) -> None:
        self.after_give_up(proc, verdict)

    def after_no_management(self, proc: Proc, verdict) -> None:
        self.after_give_up(proc, verdict)

    def after_give_up(self, proc: Proc, verdict) -> None:
        limit = f"{lifecycle.MAX_RESTARTS} restarts in {lifecycle.RESTART_PERIOD_S} s"
        if proc.kind == "queue":
            queue = proc.name[len("queue-"):]
            qdef = self.defs.queues.get(queue)
            if qdef is not None and qdef.deleting:      # it died while being deleted: finish that
                self.finish_pending_deletion(queue)
            elif qdef is not None:
                qdef.down = True
            what = f"queue '{queue}' in vhost '/' stays down; clients get 404"
        elif proc.kind == "management":
            what = "the broker runs on without its management API and /metrics"
        elif proc.kind == "watchdog":
            what = "the broker runs on without memory and disk alarms"
            for client, _, _ in self.ctl_waiting:
                self.ctl.reply(client, {"ok": False, "error": "the watchdog is down"})
            self.ctl_waiting.clear()
        else:
            what = "the broker cannot run without its message store and stops"
            self.exit_code = EXIT_STAGE_DIED
            self.running = False
        self.log("error", [f"Supervisor {SUPERVISOR}: child {proc.name} reached its restart intensity "
                           f"({limit}) or could not start; {what}"])
        self.telemetry.event("stage_given_up", proc.name, {"kind": proc.kind})

    def stop_channels_of(self, reader: Proc) -> int:
        channels = [p for p in self.procs.values() if p.kind == "channel" and p.owner == reader.name]
        for p in channels:
            self.stop_proc(p)
        return len(channels)

    def stop_proc(self, p: Proc) -> None:
        if p.state == "running":
            p.state = lifecycle.step(p.state, "stop")
            self.tell(p, {"type": "stop"})

    def drop_link(self, link_id: int, gone: str, reason: str) -> None:
        rec = self.links.remove(link_id)
        if rec is None:
            return
        other = rec.receiver if rec.sender == gone else rec.sender
        peer = self.procs.get(other)
        if peer is not None:
            peer.links.discard(link_id)
            self.tell(peer, {"type": "detach", "link": link_id, "reason": reason})

    # -- main loop ----------------------------------------------------------------------------
    def serve(self) -> int:
        signal.set_wakeup_fd(self.wake_w.fileno())
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        try:
            if self.start_store() is None:
                raise RuntimeError("cannot start the message store")
            self.start_watchdog()
            self.load_definitions()
            self.import_definitions()
            self.write_broker_file()
            if self.start_management() is not None:
                self.log("info", [f"Management plugin: HTTP (non-TLS) listener started on port {self.management_port}",
                                  f"Prometheus metrics: HTTP (non-TLS) listener started on port "
                                  f"{self.management_port} (/metrics)"])
            next_tick = time.monotonic()
            while self.running:
                timeout = max(0.0, next_tick - time.monotonic())
                if self.tokens_waiting:
                    timeout = min(timeout, TOKEN_RETRY_S)
                if self.accept_paused_until:
                    timeout = min(timeout, max(0.0, self.accept_paused_until - time.monotonic()))
                if self.fd_alarm:
                    timeout = min(timeout, FD_RECHECK_S)
                for key, events in self.selector.select(timeout):
                    self.dispatch(key.data, events)
                self.flush_waiting_tokens()
                self.send_held_replies()
                self.resume_accepting()
                if time.monotonic() >= next_tick or self.clock.deadlines or self.fd_alarm:
                    next_tick = time.monotonic() + self.tick()
        except BaseException as exc:
            self.log("error", [f"supervisor failed: {exc!r}", *traceback.format_exc().rstrip().splitlines()])
            self.exit_code = EXIT_STAGE_CRASHED
        finally:
            self.stop_all()
        return self.exit_code

    def dispatch(self, data, events: int) -> None:
        what, arg = data
        try:
            if what == "listen":
                self.accept(arg)
            elif what == "proc":
                self.on_proc_ready(arg, events)
            elif what == "ctl_server":
                self.ctl.on_accept()
            elif what == "ctl_client":
                self.ctl.on_ready(arg, events)
            elif what == "signal":
                self.on_signals()
        except Exception:       # whatever one event does wrong, the broker goes on
            self.log("error", [f"error handling {what}:", *traceback.format_exc().rstrip().splitlines()])

    def on_signals(self) -> None:
        try:
            data = self.wake_r.recv(4096)
        except BlockingIOError:
            data = b""
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                if self.running:
                    self.log("info", [f"received {signal.Signals(signum).name}, stopping"])
                self.running = False
        self.reap()

    def write_broker_file(self) -> None:
        path = os.path.join(self.cfg.data_dir, "broker.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "port": self.port, "tls_port": self.tls_port, "host": self.cfg.host,
                       "run_id": self.run_id, "ctl": self.ctl_path, "node": self.cfg.node,
                       "management_port": self.management_port}, f)
        os.replace(tmp, path)

    def stop_all(self) -> None:
        """Readers first, then channels, queues, watchdog, and the store last (after its final fsync)."""
        self.running = False
        for listener, _ in self.listeners:
            try:
                listener.close()
            except OSError:
                pass
        for kind in ("management", "reader", "channel", "queue", "host", "watchdog", "store"):
            group = [p for p in self.procs.values() if p.kind == kind]
            for p in group:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.stop_proc(p)
            deadline = time.monotonic() + STOP_GRACE_S
            while any(p.name in self.procs for p in group) and time.monotonic() < deadline:
                self.pump_while_stopping()
                time.sleep(0.01)
            for p in group:
                if p.name in self.procs:
                    self.log("warning", [f"stage {p.name} did not stop in {STOP_GRACE_S} s; killing it"])
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + STOP_GRACE_S
            while any(p.name in self.procs for p in group) and time.monotonic() < deadline:
                self.reap()
                time.sleep(0.01)
        self.owner.unlink_all()
        if self.management_sock is not None:
            self.management_sock.close()
        self.telemetry.close(self.status(), process_ends=True)
        self.ctl.close()
        try:
            os.unlink(os.path.join(self.cfg.data_dir, "broker.json"))
        except FileNotFoundError:
            pass
        self.log("info", ["creditflow broker stopped"])

    def pump_while_stopping(self) -> None:
        """While stopping: take stages' statistics, pass on what they still send, reap those that ended."""
        for key, events in self.selector.select(0):
            what, arg = key.data
            if what == "proc":
                try:
                    self.on_proc_ready(arg, events)
                except Exception:
                    pass
        self.flush_waiting_tokens()
        self.reap()


def _json_value(value):
    """An AMQP table value as JSON shows it (numbers stay numbers); anything else as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


EXCHANGE_OP_TEXTS = {                  # the ctl "exchange" ops the management API sends, and their names
    "declare": ("exchange", "kind"), "delete": ("exchange",),
    "bind": ("exchange", "queue", "routing_key"), "bind_exchange": ("source", "destination", "routing_key"),
    "unbind_key": ("source", "destination", "properties_key")}


def binding_key(b) -> str:
    """A binding's properties key in the management API (its arguments typed, as definitions keep them)."""
    return properties_key(_text_fields(b.routing_key), arguments_to_json(b.arguments))


def _text_fields(value):
    """Names, keys and arguments held as bytes (AMQP shortstrs), as text for JSON."""
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_text_fields(k): _text_fields(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_text_fields(v) for v in value]
    return value


def _nproc_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    return None if soft == resource.RLIM_INFINITY else soft


def _close_endpoints(endpoints) -> None:
    for e in endpoints:
        try:
            e.close() if hasattr(e, "close") else os.close(e)
        except OSError:
            pass


def run_broker(cfg: BrokerConfig, out=None) -> int:
    try:
        sup = Supervisor(cfg, out=out)
    except ManagementPortInUse as exc:
        print(f"creditflow: {exc.strerror}", file=sys.stderr)
        return EXIT_PORT_IN_USE
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"creditflow: port {cfg.port} is already in use", file=sys.stderr)
            return EXIT_PORT_IN_USE
        raise
    return sup.serve()
