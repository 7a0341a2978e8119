"""The supervisor: starts, wires, watches and stops every broker process.

It is the only owner of shared memory: it creates each ring (named
``creditflow-<run id>-...``) and unlinks it when its link is torn down or the
broker stops; at start it removes what a killed earlier run left behind.

For every stage it creates three endpoints before forking it (an inbox pipe,
an eventfd doorbell, a control socketpair); links between running stages are
made later by sending each end an ``attach`` message carrying the peer's
inbox and doorbell fds (SCM_RIGHTS). Stages ask for links (a channel for a
queue, a reader for a channel); the supervisor answers once both ends have
them.

A stage that dies is noticed (SIGCHLD), reported, its neighbours get
``peer_down`` for each link they shared with it, and, unless it was a reader
or channel that ended normally, the broker shuts down with
``EXIT_STAGE_DIED``. Shutdown is ordered: readers first, then channels,
queues, and the store last after its final fsync.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
import urllib.parse
from dataclasses import dataclass, field

from ipc import control, shm, tokens
from ipc.credit import DEFAULT_CREDIT, MSG_STORE_CREDIT_DISC_BOUND, CreditSpec
from ipc.doorbell import Doorbell
from ipc.errors import PeerGone, WouldBlock
from ipc.tokens import Kind as TokenKind
from pipeline import telemetry

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_STAGE_DIED = 3
EXIT_PORT_IN_USE = 4
EXIT_STAGE_CRASHED = 70

RING_BYTES = 4 * 1024 * 1024
EXCHANGE_TYPES = ("direct", "fanout", "topic")
PREDECLARED_EXCHANGES = {"amq.direct": "direct", "amq.fanout": "fanout", "amq.topic": "topic"}
STOP_GRACE_S = 3.0
SAMPLE_INTERVAL_MS = 100
UNTRACED_STATS_INTERVAL_MS = 1000   # --telemetry off: what status and the live view still need
PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


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
    max_message_bytes: int = 1024 * 1024
    ring_bytes: int = RING_BYTES
    fsync_interval_ms: int = 200
    fsync_delay_ms: int = 0
    confirm_after: str = "fsync"
    store_file_bytes: int = 16 * 1024 * 1024
    paging_ratio: float = 0.5
    telemetry: bool = True          # off: no snapshot or state-sample files, stages report once a second
    watchdog: dict = field(default_factory=dict)


@dataclass
class Proc:
    name: str
    kind: str
    pid: int
    ctl: socket.socket
    inbox_w: int
    doorbell: Doorbell
    links: set = field(default_factory=set)
    owner: str | None = None        # for channels: their reader
    stopping: bool = False


@dataclass
class LinkRec:
    link_id: int
    sender: str
    receiver: str
    segment: object
    flow: bool


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
        os.makedirs(cfg.data_dir, exist_ok=True)
        removed = shm.cleanup_stale()
        self.run_id = shm.new_run_id()
        self.owner = shm.SegmentOwner(self.run_id)
        self.procs: dict[str, Proc] = {}
        self.by_pid: dict[int, Proc] = {}
        self.links: dict[int, LinkRec] = {}
        self.next_link = 1
        self.next_conn = 1
        self.queues: dict[str, dict] = {}
        self.exchanges: dict[str, dict] = {name: {"type": kind, "durable": True, "bindings": []}
                                           for name, kind in PREDECLARED_EXCHANGES.items()}
        self.stats: dict[str, dict] = {}
        self.samples: dict[str, dict] = {}
        self.selector = selectors.DefaultSelector()
        self.running = True
        self.exit_code = EXIT_OK
        self.deaths: list[dict] = []
        self.alarms: dict[str, dict] = {}
        self.paging = False
        self.telemetry = telemetry.Recorder(cfg.data_dir)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((cfg.host, cfg.port))
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.ctl_path = os.path.join(cfg.data_dir, "ctl.sock")
        if os.path.exists(self.ctl_path):
            os.unlink(self.ctl_path)
        self.ctl_server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ctl_server.bind(self.ctl_path)
        self.ctl_server.listen(16)
        self.ctl_server.setblocking(False)
        self.ctl_clients: dict[int, tuple[socket.socket, bytearray]] = {}
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, ("listen", None))
        self.selector.register(self.ctl_server, selectors.EVENT_READ, ("ctl_server", None))
        self.selector.register(self.wake_r, selectors.EVENT_READ, ("signal", None))
        self.log("info", [f"Starting creditflow broker (run {self.run_id}) on {cfg.host}:{self.port}, "
                          f"data dir {cfg.data_dir}"])
        if removed:
            self.log("warning", [f"removed {len(removed)} shared-memory entries left by a killed run"])

    # -- logging -------------------------------------------------------------------
    def log(self, level: str, lines: list[str]) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        for line in lines:
            text = f"{stamp} [{level}] {line}" if line else ""
            print(text, file=self.out, flush=True)
            self.telemetry.log(level, line)

    # -- spawning ------------------------------------------------------------------
    def spawn(self, name: str, kind: str, factory, extra_keep: tuple[int, ...] = (), owner=None) -> Proc:
        inbox_r, inbox_w = os.pipe()
        doorbell = Doorbell()
        parent_ctl, child_ctl = control.socketpair()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT})
        try:
            pid = os.fork()
            if pid == 0:
                code = EXIT_STAGE_CRASHED
                try:
                    import faulthandler
                    faulthandler.register(signal.SIGUSR1, all_threads=False)
                    _child_setup(f"cf-{name}", {inbox_r, doorbell.fileno(), child_ctl.fileno(), *extra_keep})
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
                    stage = factory(child_ctl, inbox_r, doorbell.fileno())
                    if not self.cfg.telemetry and hasattr(stage, "stats_interval_ns"):
                        stage.stats_interval_ns = UNTRACED_STATS_INTERVAL_MS * 1_000_000
                    code = stage.run()
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.close(inbox_r)
        child_ctl.close()
        for fd in extra_keep:
            os.close(fd)
        proc = Proc(name, kind, pid, parent_ctl, inbox_w, doorbell, owner=owner)
        self.procs[name] = proc
        self.by_pid[pid] = proc
        self.selector.register(parent_ctl, selectors.EVENT_READ, ("proc", name))
        self.telemetry.event("spawn", name, {"pid": pid, "kind": kind})
        return proc

    def make_link(self, sender: str, receiver: str, flow: bool, spec: CreditSpec | None = None) -> int:
        link_id = self.next_link
        self.next_link += 1
        seg, _ring = shm.create_ring(self.owner, f"l{link_id}", self.cfg.ring_bytes)
        rec = LinkRec(link_id, sender, receiver, seg, flow)
        self.links[link_id] = rec
        s, r = self.procs[sender], self.procs[receiver]
        spec_list = [spec.initial, spec.more_after] if spec is not None else None
        base = {"type": "attach", "link": link_id, "ring": seg.name, "flow": flow, "spec": spec_list}
        control.send_msg(s.ctl, {**base, "role": "out", "peer": receiver}, [r.inbox_w, r.doorbell.fileno()])
        control.send_msg(r.ctl, {**base, "role": "in", "peer": sender}, [s.inbox_w])
        s.links.add(link_id)
        r.links.add(link_id)
        return link_id

    def link_between(self, sender: str, receiver: str) -> int | None:
        for rec in self.links.values():
            if rec.sender == sender and rec.receiver == receiver:
                return rec.link_id
        return None

    # -- the stages ------------------------------------------------------------------
    def start_store(self) -> None:
        from pipeline.store import Store
        cfg = self.cfg
        store_dir = os.path.join(cfg.data_dir, "msg_store")

        def factory(ctl, inbox, bell):
            return Store("store", ctl, inbox, bell, cfg.credit, data_dir=store_dir,
                         store_spec=cfg.store_credit, delay_us=cfg.store_delay_us,
                         fsync_interval_ms=cfg.fsync_interval_ms, fsync_delay_ms=cfg.fsync_delay_ms,
                         confirm_after=cfg.confirm_after, queues_dir=os.path.join(cfg.data_dir, "queues"),
                         file_size_limit_bytes=cfg.store_file_bytes)
        self.spawn("store", "store", factory)

    def start_watchdog(self) -> None:
        if not self.cfg.watchdog:
            return
        from alarms.watchdog import watchdog_main
        wcfg = dict(self.cfg.watchdog)
        sup = os.getpid()
        data_dir = self.cfg.data_dir
        node = self.cfg.node

        class _Watchdog:
            def __init__(self, ctl):
                self.ctl = ctl

            def run(self):
                return watchdog_main(self.ctl, data_dir=data_dir, node=node, supervisor_pid=sup, **wcfg)

        self.spawn("watchdog", "watchdog", lambda ctl, inbox, bell: _Watchdog(ctl))

    def accept(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return
            n = self.next_conn
            self.next_conn += 1
            name = f"reader-{n}"
            cfg = self.cfg
            readers = sum(1 for p in self.procs.values() if p.kind == "reader")
            refuse = None
            if readers >= cfg.connection_max:
                refuse = (f"NOT_ALLOWED - access to vhost '/' refused for user 'guest': connection limit "
                          f"({cfg.connection_max}) is reached")
            alarms = [src for src, a in self.alarms.items() if a.get("state") == "set"]
            fd = sock.detach()

            def factory(ctl, inbox, bell, fd=fd, name=name, refuse=refuse, alarms=alarms):
                from pipeline.reader import Reader
                return Reader(name, ctl, inbox, bell, cfg.credit, socket.socket(fileno=fd),
                              node_name=cfg.node, heartbeat_s=cfg.heartbeat_s, frame_max=cfg.frame_max,
                              channel_max=cfg.channel_max, max_message_bytes=cfg.max_message_bytes,
                              refuse=refuse, alarms=alarms)
            self.spawn(name, "reader", factory, extra_keep=(fd,))
            self.telemetry.event("connection", name, {"peer": f"{addr[0]}:{addr[1]}"})

    def open_channel(self, reader: Proc, number: int) -> None:
        cfg = self.cfg
        name = f"channel-{reader.name.split('-', 1)[1]}.{number}"
        if name in self.procs:  # the same number reopened while its old process is still stopping
            name = f"{name}-{self.next_link}"

        def factory(ctl, inbox, bell):
            from pipeline.channel import Channel
            return Channel(name, ctl, inbox, bell, cfg.credit, number=number, reader=reader.name,
                           frame_max=cfg.frame_max, delay_us=cfg.channel_delay_us)
        chan = self.spawn(name, "channel", factory, owner=reader.name)
        self.tell(chan, {"type": "exchanges", "table": self.exchanges})
        out = self.make_link(reader.name, name, flow=not cfg.credit.disabled)
        inp = self.make_link(name, reader.name, flow=False)
        control.send_msg(reader.ctl, {"type": "channel_ready", "channel": number, "out": out, "in": inp})

    def ensure_queue(self, name: str, durable: bool, exclusive: bool, auto_delete: bool) -> str:
        pname = f"queue-{name}"
        if name in self.queues:
            return pname
        cfg = self.cfg

        journal_dir = os.path.join(cfg.data_dir, "queues", urllib.parse.quote(name, safe=""))
        store_dir = os.path.join(cfg.data_dir, "msg_store")

        def factory(ctl, inbox, bell):
            from pipeline.queue import Queue
            return Queue(pname, ctl, inbox, bell, cfg.credit, queue=name, durable=durable,
                         exclusive=exclusive, auto_delete=auto_delete, store_spec=cfg.store_credit,
                         delay_us=cfg.queue_delay_us, frame_max=cfg.frame_max, run_id=self.run_id,
                         journal_dir=journal_dir, store_dir=store_dir,
                         page_path=os.path.join(cfg.data_dir, "paged", urllib.parse.quote(name, safe="") + ".pages"))
        queue_proc = self.spawn(pname, "queue", factory)
        if self.paging:
            self.tell(queue_proc, {"type": "page", "on": True})
        self.queues[name] = {"proc": pname, "durable": durable}
        if durable:
            self.save_definitions()
        self.make_link(pname, "store", flow=not cfg.store_credit.disabled, spec=cfg.store_credit)
        self.make_link("store", pname, flow=False)
        for proc in self.procs.values():
            if proc.kind == "channel":
                self.tell(proc, {"type": "queue_created", "queue": name})
        return pname

    def link_channel_queue(self, channel: Proc, queue: str) -> None:
        info = self.queues.get(queue)
        if info is None or info["proc"] not in self.procs:
            self.tell(channel, {"type": "no_queue", "queue": queue})
            return
        qname = info["proc"]
        out = self.link_between(channel.name, qname)
        inp = self.link_between(qname, channel.name)
        if out is None:
            out = self.make_link(channel.name, qname, flow=not self.cfg.credit.disabled)
            inp = self.make_link(qname, channel.name, flow=False)
        reader = self.procs.get(channel.owner)
        if reader is not None and self.link_between(qname, reader.name) is None:
            link = self.make_link(qname, reader.name, flow=False)
            self.tell(reader, {"type": "queue_link", "link": link, "queue": queue})
        self.tell(channel, {"type": "queue_linked", "queue": queue, "out": out, "in": inp})

    def tell(self, proc: Proc, msg: dict) -> None:
        try:
            control.send_msg(proc.ctl, msg)
        except (OSError, PeerGone):
            pass

    def token(self, proc: Proc, kind, link: int, value: int) -> None:
        try:
            os.write(proc.inbox_w, tokens.encode(kind, link, value))
        except OSError:
            pass

    # -- messages from stages -----------------------------------------------------------
    def on_proc_msg(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None:
            return
        while True:
            try:
                msg, fds = control.recv_msg_nowait(proc.ctl)
            except WouldBlock:
                return
            except (PeerGone, OSError):
                self.selector.unregister(proc.ctl)
                return
            for fd in fds:
                os.close(fd)
            self.handle(proc, msg)

    def handle(self, proc: Proc, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "stats":
            self.stats[proc.name] = msg
            if self.cfg.telemetry:
                self.telemetry.stats(msg)
            if proc.kind == "watchdog":
                self.check_paging(msg)
        elif kind == "log":
            self.log(msg.get("level", "info"), msg.get("lines", []))
        elif kind == "open_channel":
            self.open_channel(proc, msg["channel"])
        elif kind == "close_channel":
            pass  # the channel process exits by itself; reaping tears its links down
        elif kind == "link_queue":
            self.link_channel_queue(proc, msg["queue"])
        elif kind == "declare_queue":
            queue = msg["queue"]
            if queue not in self.queues and not msg.get("passive"):
                self.ensure_queue(queue, bool(msg.get("durable")), bool(msg.get("exclusive")),
                                  bool(msg.get("auto_delete")))
            self.link_channel_queue(proc, queue)
        elif kind in ("declare_exchange", "bind", "unbind"):
            self.tell(proc, {"type": "reply", **self.exchange_op(kind, msg)})
        elif kind == "alarm":
            self.on_alarm(msg)

        elif kind == "reply":
            self.pending_reply(msg)

    # -- exchanges and bindings (global, so kept here; every channel gets a copy) -----------------
    def exchange_op(self, kind: str, msg: dict) -> dict:
        name = msg["exchange"]
        if kind == "declare_exchange":
            if name == "" or name == "amq.default":
                return {"ok": True}
            ex = self.exchanges.get(name)
            if ex is None:
                if msg.get("passive"):
                    return {"ok": False, "code": 404, "text": f"NOT_FOUND - no exchange '{name}' in vhost '/'"}
                if msg["kind"] not in EXCHANGE_TYPES:
                    return {"ok": False, "code": 503, "text": f"COMMAND_INVALID - unknown exchange type "
                                                              f"'{msg['kind']}'"}
                if name.startswith("amq."):
                    return {"ok": False, "code": 403, "text": f"ACCESS_REFUSED - exchange name '{name}' contains "
                                                              "reserved prefix 'amq.*'"}
                self.exchanges[name] = {"type": msg["kind"], "durable": bool(msg.get("durable")), "bindings": []}
                self.broadcast_exchange(name)
                if msg.get("durable"):
                    self.save_definitions()
            elif not msg.get("passive") and ex["type"] != msg["kind"]:
                return {"ok": False, "code": 406, "text": f"PRECONDITION_FAILED - inequivalent arg 'type' for "
                                                          f"exchange '{name}' in vhost '/': received "
                                                          f"'{msg['kind']}' but current is '{ex['type']}'"}
            return {"ok": True}
        queue, key = msg["queue"], msg.get("routing_key", "")
        if name == "":
            return {"ok": False, "code": 403, "text": "ACCESS_REFUSED - operation not permitted on the default "
                                                     "exchange"}
        ex = self.exchanges.get(name)
        if ex is None:
            return {"ok": False, "code": 404, "text": f"NOT_FOUND - no exchange '{name}' in vhost '/'"}
        if queue not in self.queues:
            return {"ok": False, "code": 404, "text": f"NOT_FOUND - no queue '{queue}' in vhost '/'"}
        binding = [queue, key]
        if kind == "bind" and binding not in ex["bindings"]:
            ex["bindings"].append(binding)
        elif kind == "unbind" and binding in ex["bindings"]:
            ex["bindings"].remove(binding)
        self.broadcast_exchange(name)
        if ex.get("durable"):
            self.save_definitions()
        return {"ok": True}

    def save_definitions(self) -> None:
        """Durable queues, exchanges and their bindings, so a restart on this data dir brings them back."""
        durable_queues = {q for q, info in self.queues.items() if info["durable"]}
        exchanges = {name: {"type": ex["type"], "bindings": [b for b in ex["bindings"] if b[0] in durable_queues]}
                     for name, ex in self.exchanges.items() if ex.get("durable")}
        path = os.path.join(self.cfg.data_dir, "definitions.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"queues": sorted(durable_queues), "exchanges": exchanges}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def load_definitions(self) -> None:
        path = os.path.join(self.cfg.data_dir, "definitions.json")
        try:
            with open(path) as f:
                defs = json.load(f)
        except FileNotFoundError:
            return
        for name in defs.get("queues", []):
            self.ensure_queue(name, durable=True, exclusive=False, auto_delete=False)
        for name, ex in defs.get("exchanges", {}).items():
            mine = self.exchanges.setdefault(name, {"type": ex["type"], "durable": True, "bindings": []})
            for b in ex["bindings"]:
                if b not in mine["bindings"]:
                    mine["bindings"].append(b)
        self.log("info", [f"recovered {len(defs.get('queues', []))} durable queues and "
                          f"{len(defs.get('exchanges', {}))} durable exchanges from {path}"])

    def broadcast_exchange(self, name: str) -> None:
        for p in self.procs.values():
            if p.kind == "channel":
                self.tell(p, {"type": "exchanges", "table": {name: self.exchanges[name]}})

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
        value = 1 if source == "memory" else 2
        for p in self.procs.values():
            if p.kind == "reader":
                self.token(p, kind, 0, value)

    def pending_reply(self, msg: dict) -> None:
        waiting = getattr(self, "_ctl_waiting", None)
        if waiting:
            client = waiting.pop(0)
            self.ctl_send(client, msg)

    # -- the ctl socket (creditflow ctl) ------------------------------------------------------
    def on_ctl_accept(self) -> None:
        try:
            sock, _ = self.ctl_server.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        self.ctl_clients[sock.fileno()] = (sock, bytearray())
        self.selector.register(sock, selectors.EVENT_READ, ("ctl_client", sock.fileno()))

    def on_ctl_client(self, fd: int) -> None:
        sock, buf = self.ctl_clients[fd]
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(sock)
            sock.close()
            del self.ctl_clients[fd]
            return
        buf += data
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            try:
                req = json.loads(line)
            except ValueError:
                self.ctl_send(sock, {"ok": False, "error": "request is not JSON"})
                continue
            self.ctl_request(sock, req)

    def ctl_send(self, sock, msg: dict) -> None:
        try:
            sock.setblocking(True)
            sock.sendall(json.dumps(msg, default=str).encode() + b"\n")
            sock.setblocking(False)
        except OSError:
            pass

    def ctl_request(self, sock, req: dict) -> None:
        cmd = req.get("cmd")
        if cmd == "status":
            self.ctl_send(sock, {"ok": True, **self.status()})
        elif cmd == "alarms":
            self.ctl_send(sock, {"ok": True, "alarms": self.alarms})
        elif cmd in ("set_watermark", "set_disk_free_limit"):
            wd = self.procs.get("watchdog")
            if wd is None:
                self.ctl_send(sock, {"ok": False, "error": "no watchdog is running in this broker"})
                return
            self._ctl_waiting = getattr(self, "_ctl_waiting", []) + [sock]
            self.tell(wd, {"type": cmd, "value": req.get("value")})
        elif cmd == "stop":
            self.ctl_send(sock, {"ok": True})
            self.running = False
        else:
            self.ctl_send(sock, {"ok": False, "error": f"unknown command {cmd!r}"})

    def status(self) -> dict:
        now = time.monotonic_ns()
        processes = {}
        for name, st in self.stats.items():
            proc = self.procs.get(name)
            processes[name] = {
                **{k: v for k, v in st.items() if k not in ("type", "fsync_events", "state")},
                "kind": st.get("kind"), "pid": st.get("pid"), "alive": proc is not None,
                "state": state_at(st, now), "samples": self.samples.get(name, {}),
            }
        links = {}
        for st in self.stats.values():
            links.update(st.get("links", {}))
        return {"run_id": self.run_id, "pid": os.getpid(), "port": self.port, "node": self.cfg.node,
                "now_ns": now, "processes": processes, "links": links, "alarms": self.alarms,
                "deaths": self.deaths, "queues": self.queues}

    def sample(self) -> None:
        """Every SAMPLE_INTERVAL_MS: count each process's reported state (for flow_fraction)."""
        now = time.monotonic_ns()
        for name, st in self.stats.items():
            if name not in self.procs:
                continue
            s = self.samples.setdefault(name, {"samples": 0, "flow": 0, "blocked": 0, "blocking": 0})
            state = state_at(st, now)
            s["samples"] += 1
            if state in s:
                s[state] += 1
            if self.cfg.telemetry:
                self.telemetry.state(now, name, st.get("kind"), state)

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
            code = os.waitstatus_to_exitcode(status)
            self.ended(proc, code)

    def ended(self, proc: Proc, code: int) -> None:
        self.procs.pop(proc.name, None)
        try:
            self.selector.unregister(proc.ctl)
        except (KeyError, ValueError):
            pass
        proc.ctl.close()
        normal = code == 0 and (proc.kind in ("reader", "channel") or proc.stopping or not self.running)
        if not normal:
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            self.deaths.append({"name": proc.name, "kind": proc.kind, "pid": proc.pid, "how": how,
                                "at_ns": time.monotonic_ns()})
            self.log("error", [f"stage {proc.name} (pid {proc.pid}) died with {how}; "
                               "notifying its peers and shutting down"])
            self.telemetry.event("stage_died", proc.name, {"how": how})
        if proc.kind == "reader":
            for p in list(self.procs.values()):
                if p.kind == "channel" and p.owner == proc.name:
                    p.stopping = True
                    self.tell(p, {"type": "stop"})
        for link_id in list(proc.links):
            self.drop_link(link_id, gone=proc.name)
        os.close(proc.inbox_w)
        proc.doorbell.close()
        if not normal and self.running:
            self.exit_code = EXIT_STAGE_DIED
            self.running = False

    def drop_link(self, link_id: int, gone: str) -> None:
        rec = self.links.pop(link_id, None)
        if rec is None:
            return
        other = rec.receiver if rec.sender == gone else rec.sender
        peer = self.procs.get(other)
        if peer is not None:
            peer.links.discard(link_id)
            self.token(peer, TokenKind.PEER_DOWN, link_id, 0)
        try:
            rec.segment.close()
        except OSError:
            pass
        self.owner.unlink(rec.segment.name)

    # -- main loop ----------------------------------------------------------------------------
    def serve(self) -> int:
        signal.set_wakeup_fd(self.wake_w.fileno())
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        try:
            self.start_store()
            self.start_watchdog()
            self.load_definitions()
            self.write_broker_file()
            next_sample = time.monotonic()
            while self.running:
                timeout = max(0.0, next_sample - time.monotonic())
                for key, _ in self.selector.select(timeout):
                    what, arg = key.data
                    if what == "listen":
                        self.accept()
                    elif what == "proc":
                        self.on_proc_msg(arg)
                    elif what == "ctl_server":
                        self.on_ctl_accept()
                    elif what == "ctl_client":
                        if arg in self.ctl_clients:
                            self.on_ctl_client(arg)
                    elif what == "signal":
                        self.on_signals()
                if time.monotonic() >= next_sample:
                    next_sample += SAMPLE_INTERVAL_MS / 1000
                    if next_sample < time.monotonic():
                        next_sample = time.monotonic() + SAMPLE_INTERVAL_MS / 1000
                    self.sample()
                    self.telemetry.flush_if_due()
        except BaseException as exc:
            self.log("error", [f"supervisor failed: {exc!r}"])
            traceback.print_exc()
            self.exit_code = EXIT_STAGE_CRASHED
        finally:
            self.stop_all()
        return self.exit_code

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
            json.dump({"pid": os.getpid(), "port": self.port, "host": self.cfg.host, "run_id": self.run_id,
                       "ctl": self.ctl_path, "node": self.cfg.node}, f)
        os.replace(tmp, path)

    def stop_all(self) -> None:
        """Readers first, then channels, queues, watchdog, and the store last (after its final fsync)."""
        try:
            self.listener.close()
        except OSError:
            pass
        for kind in ("reader", "channel", "queue", "watchdog", "store"):
            group = [p for p in self.procs.values() if p.kind == kind]
            for p in group:
                p.stopping = True
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.tell(p, {"type": "stop"})
            deadline = time.monotonic() + STOP_GRACE_S
            while any(p.name in self.procs for p in group) and time.monotonic() < deadline:
                self.drain_stats()
                self.reap()
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
        for rec in list(self.links.values()):
            try:
                rec.segment.close()
            except OSError:
                pass
        self.owner.unlink_all()
        self.telemetry.close(self.status())
        for path in (self.ctl_path, os.path.join(self.cfg.data_dir, "broker.json")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.log("info", ["creditflow broker stopped"])

    def drain_stats(self) -> None:
        for key, _ in self.selector.select(0):
            what, arg = key.data
            if what == "proc":
                self.on_proc_msg(arg)


def state_at(st: dict, now_ns: int) -> str:
    """A process's reported state now: a reader's connection state; RabbitMQ's 1 s flow rule otherwise."""
    if st.get("kind") == "reader" and st.get("conn_state"):
        return st["conn_state"]
    if st.get("blocked"):
        return "flow"
    started = st.get("block_started_ns")
    if started is not None and now_ns - started < 1_000_000_000:
        return "flow"
    return "running"


def run_broker(cfg: BrokerConfig, out=None) -> int:
    try:
        sup = Supervisor(cfg, out=out)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"creditflow: port {cfg.port} is already in use", file=sys.stderr)
            return EXIT_PORT_IN_USE
        raise
    return sup.serve()
