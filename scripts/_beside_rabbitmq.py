"""What the scripts that run creditflow beside a private RabbitMQ node (or alone) share: a free port,
``scripts/bench_vs_rabbitmq`` (which starts the node and a creditflow broker) loaded as a module, a
broker's processes' CPU and memory, and a raw driver run that reads the CPU the broker and the driver
used inside its publishing window."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import psutil

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
SETTLE_S = 1.0              # left out at each end of the publishing window when CPU is read


def free_port() -> int:
    return free_ports(1)[0]


def private_epmd(env: dict) -> dict:
    """``env`` for a private RabbitMQ node with an epmd of its own on a free port (ERL_EPMD_PORT): the node
    starts it and :func:`stop_epmd` ends it, where the machine's shared epmd would outlive the node."""
    return dict(env, ERL_EPMD_PORT=str(free_port()))


def stop_epmd(env: dict) -> None:
    """End the epmd :func:`private_epmd` gave a node, once the node has stopped (epmd refuses to end while
    a node is registered with it)."""
    port = env.get("ERL_EPMD_PORT")
    epmd = shutil.which("epmd") or "/usr/lib/rabbitmq/bin/epmd"
    if port and os.path.exists(epmd):
        subprocess.run([epmd, "-port", port, "-kill"], env=env, capture_output=True, timeout=10, check=False)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` different ports free on ``host`` now (held open together while picked: one at a time, the
    kernel may hand out the same port twice)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
                 for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def bench_module():
    """``scripts/bench_vs_rabbitmq`` as a module: its ``RabbitMQ`` node, ``creditflow_serve``, ``stop_serve``."""
    loader = importlib.machinery.SourceFileLoader("bench_vs_rabbitmq", os.path.join(SCRIPTS, "bench_vs_rabbitmq"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def cpu_seconds(procs) -> float:
    """User + system seconds of ``procs`` (psutil processes; those gone are left out)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def tree(root_pid: int) -> list:
    """``root_pid`` and every process under it, alive now (a broker: creditflow's supervisor and its stages,
    RabbitMQ's node and its children)."""
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pss_bytes(procs) -> int:
    """Proportional set size of ``procs`` (shared pages counted once among them); those gone are left out."""
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return total


def raw_run_with_cpu(port: int, broker_pid: int, seconds: float, **opts) -> dict:
    """``raw_driver.run`` against the broker under ``broker_pid``, with the user + system time its processes
    and the driver's own used from SETTLE_S after publishing starts to SETTLE_S before it stops, per message
    delivered: ``broker_us_per_msg`` and ``driver_us_per_msg``. On two shared cores the rate is what is left
    to the broker after the driver, so a rate that falls is told apart from a broker that got dearer."""
    sys.path.insert(0, SCRIPTS)
    import raw_driver
    if seconds <= 2 * SETTLE_S:
        raise ValueError(f"a run that reads CPU lasts over {2 * SETTLE_S:g} s")
    result: dict = {}
    launched = time.time()
    run = threading.Thread(target=lambda: result.update(raw_driver.run(port, seconds=seconds, **opts)))
    run.start()
    # raw_driver starts publishing 2 s after it is called, its processes up by then
    time.sleep(max(0.0, launched + 2.0 + SETTLE_S - time.time()))
    broker = tree(broker_pid)
    driver = [psutil.Process(c.pid) for c in multiprocessing.active_children()]
    first = cpu_seconds(broker), cpu_seconds(driver)
    window = seconds - 2 * SETTLE_S
    time.sleep(window)
    used = cpu_seconds(broker) - first[0], cpu_seconds(driver) - first[1]
    run.join()
    if not result:
        raise SystemExit("raw driver: the run ended without a result")
    delivered = result["deliver_rate"] * window
    result["broker_us_per_msg"] = used[0] / delivered * 1e6 if delivered else float("inf")
    result["driver_us_per_msg"] = used[1] / delivered * 1e6 if delivered else float("inf")
    return result
