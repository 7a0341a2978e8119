"""Supervision as tables: what happens to a stage process when it starts, is asked to stop, or ends.

The supervisor calls these pure functions with the time passed in and does
what they return; it never decides a death's consequences anywhere else.
RabbitMQ's supervision tree is the model:

==========  =====================================================================
kind        when it ends without being asked to (a crash, a kill, a bad exit)
==========  =====================================================================
reader      its connection is gone; its channels end; queues requeue what its
            consumers held unacked; credit it held is released (``peer_down``)
channel     its reader closes the connection with 541 INTERNAL_ERROR, as
            rabbit_reader does when a channel process crashes
queue       restarted: a durable queue recovers its persistent messages from
            its journal; consumers are cancelled; unconfirmed publishes nacked
store       restarted: it recovers its segments; queues re-send the writes it
            had not reported on disk
watchdog    restarted; alarms re-evaluated from its first fresh reading
management  restarted on the same listening socket; given up, the broker runs
            on without its HTTP API and /metrics
==========  =====================================================================

A reader or channel that exits 0 by itself has simply finished (its client
closed). Restarts are limited as OTP's supervisors limit them: more than
``MAX_RESTARTS`` of one process within ``RESTART_PERIOD_S`` and it is given
up: a queue stays down (clients get 404, "process is stopped by
supervisor"), a watchdog stays down (no alarms), and the store's loss stops
the broker, as losing its message store takes a RabbitMQ vhost down.

Process states (``TRANSITIONS`` is the whole table)::

    running --stop--> stopping --exit--> gone
    running --exit--> gone                 (finished, or crashed and not restarted)
    running --exit--> restarting --spawned--> running
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_RESTARTS = 5
RESTART_PERIOD_S = 10
NS_PER_S = 1_000_000_000

STATES = ("running", "stopping", "restarting", "gone")
TRANSITIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("running", "stop"): ("stopping",),
    ("running", "exit"): ("gone", "restarting"),
    ("stopping", "stop"): ("stopping",),
    ("stopping", "exit"): ("gone",),
    ("restarting", "spawned"): ("running",),
    ("restarting", "stop"): ("gone",),
}

# what a kind's unasked-for end means, and what to do when its restarts run out
ON_DEATH = {"reader": "close_connection", "channel": "internal_error", "queue": "restart",
            "store": "restart", "watchdog": "restart", "management": "restart"}
ON_GIVE_UP = {"queue": "queue_down", "store": "stop_broker", "watchdog": "no_watchdog",
              "management": "no_management"}
FINISHES_BY_ITSELF = ("reader", "channel")


class IllegalTransition(Exception):
    """Raised when a process is moved along an edge the lifecycle table does not have."""


def step(state: str, event: str, to: str | None = None) -> str:
    """The state after ``event``; ``to`` picks among several targets. Raises ``IllegalTransition``."""
    targets = TRANSITIONS.get((state, event))
    if targets is None or (to is not None and to not in targets):
        raise IllegalTransition(f"no transition from {state!r} on {event!r}" + (f" to {to!r}" if to else ""))
    return to if to is not None else targets[0]


@dataclass(frozen=True)
class Verdict:
    """What the supervisor must do about a process that ended."""
    action: str                   # forget | close_connection | internal_error | restart | queue_down |
                                  # stop_broker | no_watchdog | no_management
    crashed: bool                 # an unasked-for end: logged as an error, counted in ``deaths``
    how: str                      # "exit code N" / "signal N"
    state: str                    # the process's lifecycle state after this


@dataclass
class RestartBook:
    """Each process name's recent restarts, for OTP's restart intensity."""
    max_restarts: int = MAX_RESTARTS
    period_ns: int = RESTART_PERIOD_S * NS_PER_S
    restarts: dict[str, list[int]] = field(default_factory=dict)

    def allow(self, name: str, now_ns: int) -> bool:
        """Record a restart of ``name`` now, unless that would be one too many within the period."""
        recent = [t for t in self.restarts.get(name, []) if now_ns - t < self.period_ns]
        if len(recent) >= self.max_restarts:
            self.restarts[name] = recent
            return False
        recent.append(now_ns)
        self.restarts[name] = recent
        return True


def how_it_ended(exit_code: int) -> str:
    """``os.waitstatus_to_exitcode``'s value in words: negative means killed by that signal."""
    return f"signal {-exit_code}" if exit_code < 0 else f"exit code {exit_code}"


def on_exit(kind: str, state: str, exit_code: int, *, broker_running: bool, book: RestartBook, name: str,
            now_ns: int) -> Verdict:
    """Decide what a process's end means. ``state`` is its lifecycle state before it ended."""
    how = how_it_ended(exit_code)
    if state == "stopping" or not broker_running:
        return Verdict("forget", False, how, "gone")
    if exit_code == 0 and kind in FINISHES_BY_ITSELF:
        return Verdict("forget", False, how, step(state, "exit", "gone"))
    action = ON_DEATH.get(kind, "forget")
    if action == "restart":
        if book.allow(name, now_ns):
            return Verdict("restart", True, how, step(state, "exit", "restarting"))
        return Verdict(ON_GIVE_UP[kind], True, how, step(state, "exit", "gone"))
    return Verdict(action, True, how, step(state, "exit", "gone"))
