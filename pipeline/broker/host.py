"""A stage host: one OS process that runs many reader, channel or queue stages.

RabbitMQ gives every connection, channel and queue an Erlang process of its
own, at a few hundred KB each. Here stages are Python objects, so one OS
process per connection costs megabytes; instead the supervisor keeps a pool
of hosts per kind (``BrokerConfig.pool``, by default one per core) and places
each new reader, channel or queue in the host of its kind with the fewest.

Nothing about credit changes: every hosted stage keeps its own endpoints (inbox
pipe, doorbell, control socket), its own links and its own ``CreditFlow``, so
credit, ``flow`` and ``connection.blocked`` stay per connection and per
channel. The host only multiplexes: one selector over every endpoint, a turn
for each stage that has something to do, a timer heap for the ones that asked
to wake later. A stage that raises is dropped and reported as crashed (exit
code 70) while the others go on; ``kill`` drops one at once, as Erlang's
``exit(Pid, kill)`` would; killing the host's OS process ends all it hosts, and
the supervisor handles each of them as a death.

Messages from the supervisor on the host's own control socket::

    host  {name, kind, spec} + fds [inbox, doorbell, control(, socket)]
    kill  {name}
    stop  end once no stage is left

and to it: ``exited {name, code, how}`` once a stage has ended and its
endpoints are closed (its statistics went before, on its own socket).

Consumer bias: a stage with deliveries waiting in its rings (a consuming
connection's reader) gets a turn after every other stage's in the same round,
as RabbitMQ's queue process favours its consumers over new publishes while
they fall behind. Round-robin alone gave a consumer sharing a host with fifty
busy publishers one turn in fifty-one: its ring filled, and the queue's
backlog grew while the client sat idle.

A host's stages together push at most ``HOST_STATS_PER_S`` statistics
snapshots a second: five stages each every 100 ms, fifty each every second
(``stats_interval_ns``). With a hundred connections, pushing each one's every
100 ms cost the supervisor a tenth of a core and the hosts a syscall and a
wakeup per push, and 100 pushes a second a host still cost the broker a
tenth of its CPU a message; a state change (flow, blocked) still goes within
10 ms, and RabbitMQ itself emits statistics every 5 s.
"""

from __future__ import annotations

import heapq
import os
import selectors
import socket
import sys
import time
import traceback

from ipc import control
from ipc.credit import CreditSpec
from ipc.errors import CorruptRecord, PeerGone, WouldBlock
from pipeline.broker import bodies, collector
from pipeline.broker.stage import HAND_ON_LIMIT_NS, OVERFLOW_RETRY_MS, STATS_INTERVAL_MS, Stage

EXIT_STAGE_CRASHED = 70
ARENA_RECLAIM_S = 0.1              # how often an idle reader host frees its arena's let-go slots
KILLED = -9
HOST_STATS_PER_S = 50              # statistics snapshots a host's stages push a second, all together
MAX_STATS_INTERVAL_NS = 1_000_000_000


class StageCrash(Exception):
    """What ``ctl crash`` raises in a stage's place."""


class StageView:
    """One stage's view of its host's selector: what it registers comes back tagged with the stage."""

    def __init__(self, selector: selectors.BaseSelector, stage):
        self.selector = selector
        self.stage = stage
        self.fds: set[int] = set()

    def register(self, fileobj, events, data=None):
        key = self.selector.register(fileobj, events, (self.stage, data))
        self.fds.add(key.fd)
        return key

    def modify(self, fileobj, events, data=None):
        return self.selector.modify(fileobj, events, (self.stage, data))

    def unregister(self, fileobj):
        key = self.selector.unregister(fileobj)
        self.fds.discard(key.fd)
        return key

    def close(self) -> None:
        for fd in list(self.fds):
            try:
                self.selector.unregister(fd)
            except (KeyError, ValueError):
                pass
        self.fds.clear()


def build_stage(kind: str, name: str, spec: dict, cfg, ctl, inbox: int, bell: int, extra: list[int],
                tls_context=None):
    """The stage ``kind`` named ``name`` from its JSON ``spec`` and the broker's configuration."""
    stage = _build(kind, name, spec, cfg, ctl, inbox, bell, extra, tls_context)
    stage.holder = spec.get("holder", 0)
    return stage


def _build(kind: str, name: str, spec: dict, cfg, ctl, inbox: int, bell: int, extra: list[int], tls_context):
    if kind == "reader":
        from pipeline.broker.reader import Reader
        conn = socket.socket(fileno=extra[0])
        if spec.get("tls"):
            conn = tls_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        connection = {**spec["connection"], "loopback_users": frozenset(spec["connection"]["loopback_users"])}
        return Reader(name, ctl, inbox, bell, cfg.credit, conn, connection=connection, alarms=spec["alarms"])
    if kind == "channel":
        from pipeline.broker.channel import Channel
        return Channel(name, ctl, inbox, bell, cfg.credit, number=spec["number"], reader=spec["reader"],
                       frame_max=cfg.frame_max, delay_us=cfg.channel_delay_us, cancel_notify=spec["cancel_notify"])
    if kind == "queue":
        from pipeline.broker.args import parse_queue_args
        from pipeline.broker.definitions import arguments_from_json
        from pipeline.broker.queue import Queue
        args = parse_queue_args(spec["queue"], arguments_from_json(spec["arguments"]))
        return Queue(name, ctl, inbox, bell, cfg.credit, queue=spec["queue"], durable=spec["durable"],
                     owner=spec["owner"], auto_delete=spec["auto_delete"], args=args,
                     store_spec=CreditSpec(*spec["store_credit"]), delay_us=cfg.queue_delay_us,
                     frame_max=cfg.frame_max, run_id=spec["run_id"], journal_dir=spec["journal_dir"],
                     store_dir=spec["store_dir"], page_path=spec["page_path"], incarnation=spec["incarnation"],
                     routing=spec["routing"])
    raise ValueError(f"no stage kind {kind!r}")


class Host:
    def __init__(self, name: str, ctl, cfg, *, stats_interval_ns: int | None = None, tls_context=None):
        self.name = name
        self.ctl = ctl
        self.cfg = cfg
        self.tls_context = tls_context
        self.stats_interval_ns = stats_interval_ns
        self.selector = selectors.DefaultSelector()
        self.selector.register(ctl.fileno(), selectors.EVENT_READ, (None, "host"))
        self.stages: dict[str, Stage] = {}
        self.ready: set[Stage] = set()
        self.timers: list = []             # (deadline ns, sequence, stage)
        self.deadlines: dict[str, int] = {}
        self.seq = 0
        self.hand_on_until: dict[str, int] = {}    # stopped stages still handing on their overflow
        self.stopping = False
        installed = bodies.installed()
        self.arena = installed.allocator() if installed is not None else None   # a reader host's own
        Stage.selector_for = self.view_for

    def view_for(self, stage) -> StageView:
        return StageView(self.selector, stage)

    # -- the supervisor's requests --------------------------------------------------------------
    def on_host_control(self) -> None:
        while True:
            try:
                msg, fds = control.recv_msg_nowait(self.ctl)
            except WouldBlock:
                return
            except CorruptRecord:
                continue
            except PeerGone:
                self.stopping = True
                for stage in list(self.stages.values()):
                    self.drop(stage, KILLED, "killed")
                return
            kind = msg.get("type")
            if kind == "host":
                self.add(msg, fds)
            elif kind == "kill":
                stage = self.stages.get(msg.get("name"))
                if stage is not None:
                    self.drop(stage, KILLED, "killed")
            elif kind == "crash":               # ctl crash: as a bug raising in its turn would
                stage = self.stages.get(msg.get("name"))
                if stage is not None:
                    try:
                        raise StageCrash(f"ctl crash {stage.name}")
                    except StageCrash:
                        self.crashed(stage)
            elif kind == "stop":
                self.stopping = True
            else:
                for fd in fds:
                    os.close(fd)

    def add(self, msg: dict, fds: list[int]) -> None:
        name = msg["name"]
        inbox, bell, ctl_fd, *extra = fds
        ctl = socket.socket(fileno=ctl_fd)
        try:
            stage = build_stage(msg["kind"], name, msg["spec"], self.cfg, ctl, inbox, bell, extra,
                                tls_context=self.tls_context)
        except Exception:
            traceback.print_exc()
            try:
                control.send_msg(self.ctl, {"type": "exited", "name": name, "code": EXIT_STAGE_CRASHED})
            except (OSError, PeerGone):
                pass
            for fd in (inbox, bell, *extra):
                try:
                    os.close(fd)
                except OSError:
                    pass
            ctl.close()
            return
        stage.hosted = True
        self.stages[name] = stage
        self.space_stats()
        self.ready.add(stage)

    def space_stats(self) -> None:
        """Spread the stages' statistics pushes so that together they stay near HOST_STATS_PER_S."""
        base = self.stats_interval_ns or STATS_INTERVAL_MS * 1_000_000
        spread = len(self.stages) * 1_000_000_000 // HOST_STATS_PER_S
        interval = max(base, min(spread, MAX_STATS_INTERVAL_NS))
        for stage in self.stages.values():
            stage.stats_interval_ns = interval

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        select = self.selector.select
        arena = self.arena
        collect = collector.install()
        while not (self.stopping and not self.stages):
            now = time.monotonic_ns()
            collect(now)
            if self.ready:
                timeout = 0.0
            elif self.timers:
                timeout = max(0.0, (self.timers[0][0] - now) / 1e9)
            else:
                timeout = None
            if arena is not None and (arena.in_use or arena.returning):
                # the allocator frees what holders let go of, and gives long-free pages back, also
                # while its own connections are idle or gone
                arena.reclaim(now)
                if (arena.in_use or arena.returning) and (timeout is None or timeout > ARENA_RECLAIM_S):
                    timeout = ARENA_RECLAIM_S
            for key, _ in select(timeout):
                stage, tag = key.data
                if stage is None:
                    self.on_host_control()
                    continue
                if self.stages.get(stage.name) is not stage:
                    continue
                try:
                    stage.on_endpoint(tag)
                except Exception:
                    self.crashed(stage)
                    continue
                self.ready.add(stage)
            now = time.monotonic_ns()
            timers = self.timers
            while timers and timers[0][0] <= now:
                deadline, _, stage = heapq.heappop(timers)
                if self.deadlines.get(stage.name) == deadline:
                    del self.deadlines[stage.name]
                    self.ready.add(stage)
            ready, self.ready = self.ready, set()
            self.take_turns(ready)
        return 0

    def take_turns(self, ready) -> None:
        """One round: a turn for each ready stage, and with consumer bias (a stage with deliveries waiting
        has another turn after each other stage's), so a consumer sharing this host with busy publishers
        is not starved."""
        consumers = [stage for stage in ready if stage.deliveries_waiting()]
        for stage in ready:
            if self.stages.get(stage.name) is not stage:
                continue
            self.take_turn(stage)
            if consumers and stage not in consumers:
                for other in consumers:
                    if self.stages.get(other.name) is other and other.deliveries_waiting():
                        self.take_turn(other)

    def take_turn(self, stage: Stage) -> None:
        now = time.monotonic_ns()
        try:
            if stage.running:
                stage.turn()
            else:
                stage.flush_links()
        except Exception:
            self.crashed(stage)
            return
        if not stage.running:
            self.ending(stage, now)
            return
        try:
            timeout = stage.wait_timeout(time.monotonic_ns())
        except Exception:
            self.crashed(stage)
            return
        if timeout is not None:
            self.wake(stage, time.monotonic_ns() + int(timeout * 1e9))

    def wake(self, stage: Stage, at_ns: int) -> None:
        if at_ns <= time.monotonic_ns():
            self.ready.add(stage)
            return
        current = self.deadlines.get(stage.name)
        if current is not None and current <= at_ns:
            return
        self.deadlines[stage.name] = at_ns
        self.seq += 1
        heapq.heappush(self.timers, (at_ns, self.seq, stage))

    def ending(self, stage: Stage, now: int) -> None:
        """A stage that stopped running hands on its overflow (its inbox still brings SPACE tokens),
        then shuts down, as a process of its own would before exiting."""
        until = self.hand_on_until.setdefault(stage.name, now + HAND_ON_LIMIT_NS)
        if stage.overflowing() and now < until:
            self.wake(stage, now + OVERFLOW_RETRY_MS * 1_000_000)
            return
        code, how = stage.exit_code, None
        try:
            stage.shutdown()
        except Exception:
            traceback.print_exc()
            code = EXIT_STAGE_CRASHED
        self.drop(stage, code, how)

    def crashed(self, stage: Stage) -> None:
        print(f"stage {stage.name} crashed in {self.name} (pid {os.getpid()}):", file=sys.stderr)
        traceback.print_exc()
        self.drop(stage, EXIT_STAGE_CRASHED, None)

    def drop(self, stage: Stage, code: int, how: str | None) -> None:
        """Forget ``stage``: tell the supervisor how it ended, close every endpoint it had."""
        self.stages.pop(stage.name, None)
        self.space_stats()
        self.deadlines.pop(stage.name, None)
        self.hand_on_until.pop(stage.name, None)
        self.ready.discard(stage)
        stage.selector.close()
        for link in stage.out_links.values():   # what its receivers never got holds nothing in arenas
            for record in link.overflow:
                bodies.let_go_unsent(record, link.peer_holder)
            link.overflow.clear()
        if code in (KILLED, EXIT_STAGE_CRASHED):   # no goodbye: its links and socket just close, as a
            # process's do when it dies (a crashed reader's client once waited on an open socket forever)
            for link in list(stage.out_links.values()) + list(stage.in_links.values()):
                link.close()
            sock = getattr(stage, "sock", None)
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        # on the host's own socket: a stage's socket closed with the supervisor's last messages unread
        # reports only ECONNRESET at the other end, whatever was sent on it before
        try:
            control.send_msg(self.ctl, {"type": "exited", "name": stage.name, "code": code, "how": how})
        except (OSError, PeerGone):
            pass
        for closer in (stage.ctl.close, stage.doorbell.close, lambda: os.close(stage.inbox.fd)):
            try:
                closer()
            except OSError:
                pass

