"""The broker processes' garbage-collection policy: freeze what a full collection left, thaw now and then."""

import subprocess
import sys
import textwrap

from pipeline.broker.collector import FULL, Collector

S = 1_000_000_000


def test_a_full_collection_is_followed_by_a_freeze_and_younger_ones_are_not():
    c = Collector(0, thaw_every_ns=60 * S)
    c.collected(0)
    c.collected(1)
    assert c.step(1 * S) is None
    c.collected(FULL)
    assert c.step(2 * S) == "freeze"
    assert c.step(3 * S) is None          # once per full collection


def test_a_thaw_comes_every_interval():
    c = Collector(0, thaw_every_ns=60 * S)
    assert c.step(59 * S) is None
    assert c.step(60 * S) == "thaw"
    assert c.step(61 * S) is None
    assert c.step(125 * S) == "thaw"
    assert c.step(180 * S) is None        # the next is 60 s after the last one done
    assert c.step(185 * S) == "thaw"


def test_a_freeze_waiting_goes_before_a_thaw_due():
    c = Collector(0, thaw_every_ns=60 * S)
    c.collected(FULL)
    assert c.step(60 * S) == "freeze"
    assert c.step(60 * S) == "thaw"


def test_with_the_real_collector_objects_stay_alive_and_a_frozen_cycle_is_collected_once_thawed():
    # in a process of its own: freezing changes the whole interpreter's collector
    script = textwrap.dedent("""
        import gc, time, weakref
        from pipeline.broker import collector

        class Message:                                  # tracked by the collector, as a queue's are
            __slots__ = ("payload",)
            def __init__(self, payload):
                self.payload = payload

        step = collector.install(thaw_every_ns=10**12)
        backlog = [Message(i) for i in range(50_000)]
        gc.collect()                                    # a full collection: a freeze is owed
        step(time.monotonic_ns())
        frozen = gc.get_freeze_count()
        assert frozen >= 50_000, frozen
        assert [m.payload for m in backlog[:3]] == [0, 1, 2]
        backlog.clear()                                 # freed by reference counting, frozen or not
        assert gc.get_freeze_count() < frozen - 40_000, gc.get_freeze_count()

        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a                         # a cycle, alive through a
        gc.collect()
        step(time.monotonic_ns())                       # frozen with it
        dead = weakref.ref(a)
        del a, b
        gc.collect()
        assert dead() is not None, "a frozen cycle is not collected"
        step(time.monotonic_ns())                       # the freeze owed by that collection
        step(time.monotonic_ns() + 10**12)              # then the thaw, due
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert dead() is None, "once thawed, the cycle is collected"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_messages_held_for_a_moment_are_not_walked_by_the_young_collector():
    # 20,000 messages alive at once, as a queue holds them from publish to ack: at Python's default
    # (a young collection every 700 allocations) that is over 25 collections, each walking them
    script = textwrap.dedent("""
        import gc, sys
        from pipeline.broker import collector

        mode = sys.argv[1]
        if mode == "installed":
            collector.install()
        runs = []
        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "stop" else None)

        class Message:
            __slots__ = ("payload",)
            def __init__(self, payload):
                self.payload = payload

        held = [Message(i) for i in range(20_000)]
        del held
        print(len(runs))
    """)
    counts = {}
    for mode in ("installed", "default"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        counts[mode] = int(out.stdout)
    assert counts["default"] >= 25
    assert counts["installed"] == 0
