"""Run publishers and consumers as processes and merge their once-a-second reports.

Consumers start first, then publishers; all of them time their reports from
one shared start instant. Each worker writes one JSON line per second on its
own pipe (counts and HdrHistogram-encoded latencies; no pickle). At the end
the publishers are told to stop (a byte on their stop pipe), the consumers
drain until they have everything that was published or stop making
progress, and the harness returns the totals.

Every worker dies with the harness (PR_SET_PDEATHSIG) and is reaped in a
``finally`` block, whatever happens.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import time
import traceback
from dataclasses import dataclass, field

from pipeline.loadgen import latency
from pipeline.loadgen.config import LoadConfig

START_DELAY_NS = 300_000_000
NO_PROGRESS_S = 3.0


@dataclass
class SecondReport:
    time_s: float
    sent_rate: float
    confirmed_rate: float
    received_rate: float
    nacked: int
    returned: int
    consumer: dict
    confirm: dict | None
    blocked: bool
    published: int
    delivered: int


@dataclass
class LoadResult:
    published: int
    confirmed: int
    nacked: int
    returned: int
    delivered: int
    lost: int
    publish_rate: float
    deliver_rate: float
    latency_us: dict
    seconds: list = field(default_factory=list)
    blocked_events: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    gaps: int = 0
    duplicates: int = 0


@dataclass
class Worker:
    role: str
    index: int
    pid: int
    report_fd: int
    stop_fd: int
    buf: bytes = b""
    latest: dict = field(default_factory=dict)
    reports: dict = field(default_factory=dict)   # second -> report
    final: bool = False


def _fork_worker(target, args) -> tuple[int, int, int]:
    report_r, report_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.close(report_r)
            os.close(stop_w)
            code = target(*args(report_w, stop_r))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(stop_r)
    return pid, report_r, stop_w


def run_load(cfg: LoadConfig, on_second=None) -> LoadResult:
    from pipeline.loadgen.consumer import consumer_main
    from pipeline.loadgen.publisher import publisher_main

    start_ns = time.monotonic_ns() + START_DELAY_NS
    workers: list[Worker] = []
    try:
        queues = cfg.target_queues
        for i in range(cfg.consumers):
            q = queues[i % len(queues)]
            pid, rfd, sfd = _fork_worker(consumer_main, lambda rw, sr, i=i, q=q: (cfg, i, rw, sr, start_ns, q))
            workers.append(Worker("consumer", i, pid, rfd, sfd))
        for i in range(cfg.producers):
            pid, rfd, sfd = _fork_worker(publisher_main, lambda rw, sr, i=i: (cfg, i, rw, sr, start_ns))
            workers.append(Worker("publisher", i, pid, rfd, sfd))
        return _collect(cfg, workers, start_ns, on_second)
    finally:
        for w in workers:
            for fd in (w.report_fd, w.stop_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        for w in workers:
            while time.monotonic() < deadline:
                done, _ = os.waitpid(w.pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.01)
            else:
                try:
                    os.kill(w.pid, signal.SIGKILL)
                    os.waitpid(w.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass


def _read(workers: list[Worker], timeout_s: float) -> None:
    live = {w.report_fd: w for w in workers if not w.final}
    if not live:
        time.sleep(max(0.0, timeout_s))
        return
    ready, _, _ = select.select(list(live), [], [], max(0.0, timeout_s))
    for fd in ready:
        w = live[fd]
        data = os.read(fd, 65536)
        if not data:
            w.final = True
            continue
        w.buf += data
        while b"\n" in w.buf:
            line, _, w.buf = w.buf.partition(b"\n")
            msg = json.loads(line)
            w.latest = {**w.latest, **msg}
            if "second" in msg:
                w.reports[msg["second"]] = msg
            if msg.get("final"):
                w.final = True


def _total(workers, role: str, key: str) -> int:
    return sum(w.latest.get(key, 0) for w in workers if w.role == role)


def _second(workers, k: int, prev: dict, elapsed_s: float) -> SecondReport:
    reports = [w.reports.get(k) or w.latest for w in workers]
    pubs = [r for w, r in zip(workers, reports) if w.role == "publisher"]
    cons = [r for w, r in zip(workers, reports) if w.role == "consumer"]
    sent = sum(r.get("sent", 0) for r in pubs)
    confirmed = sum(r.get("confirmed", 0) for r in pubs)
    received = sum(r.get("received", 0) for r in cons)
    dt = max(1e-9, elapsed_s - prev.get("elapsed", 0.0))
    rep = SecondReport(
        time_s=elapsed_s,
        sent_rate=(sent - prev.get("sent", 0)) / dt,
        confirmed_rate=(confirmed - prev.get("confirmed", 0)) / dt,
        received_rate=(received - prev.get("received", 0)) / dt,
        nacked=sum(r.get("nacked", 0) for r in pubs), returned=sum(r.get("returned", 0) for r in pubs),
        consumer=latency.summary(latency.merge(r.get("consumer_hist", "") for r in cons
                                               if w_is_fresh(r, k))),
        confirm=latency.summary(latency.merge(r.get("confirm_hist", "") for r in pubs if w_is_fresh(r, k)))
        if any(r.get("confirm_hist") for r in pubs) else None,
        blocked=any(r.get("blocked") for r in pubs), published=sent, delivered=received)
    prev.update(sent=sent, confirmed=confirmed, received=received, elapsed=elapsed_s)
    return rep


def w_is_fresh(report: dict, k: int) -> bool:
    return report.get("second") == k


def _collect(cfg: LoadConfig, workers: list[Worker], start_ns: int, on_second) -> LoadResult:
    hist_consumer = latency.new_histogram()
    hist_confirm = latency.new_histogram()
    seconds: list[SecondReport] = []
    prev: dict = {}
    stop_ns = start_ns + int(cfg.duration_s * 1e9)
    k = 0
    stopped_publishers = False
    produced_at_stop = None
    last_progress = (time.monotonic(), -1)
    drain_deadline = None
    while True:
        now = time.monotonic_ns()
        boundary = start_ns + (k + 1) * 1_000_000_000
        live = [w for w in workers if not w.final]
        have_all = all(k in w.reports or w.final for w in workers)
        if now >= boundary and (have_all or now >= boundary + 400_000_000):
            rep = _second(workers, k, prev, (k + 1) * 1.0)
            for w in workers:
                r = w.reports.get(k)
                if r:
                    if r.get("consumer_hist"):
                        hist_consumer.add(latency.decode(r["consumer_hist"]))
                    if r.get("confirm_hist"):
                        hist_confirm.add(latency.decode(r["confirm_hist"]))
            if not stopped_publishers:
                seconds.append(rep)
                if on_second is not None and on_second(rep) is True:
                    stop_ns = min(stop_ns, time.monotonic_ns())   # the caller has seen enough
            k += 1
            continue
        if not stopped_publishers and now >= stop_ns:
            for w in workers:
                if w.role == "publisher":
                    os.write(w.stop_fd, b"x")
            stopped_publishers = True
            produced_at_stop = (_total(workers, "publisher", "sent"), _total(workers, "consumer", "received"),
                                (now - start_ns) / 1e9)
        if stopped_publishers:
            pubs_done = all(w.final for w in workers if w.role == "publisher")
            if pubs_done:
                published = _total(workers, "publisher", "sent")
                received = _total(workers, "consumer", "received")
                if received != last_progress[1]:
                    last_progress = (time.monotonic(), received)
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + cfg.drain_timeout_s
                stalled = time.monotonic() - last_progress[0] > NO_PROGRESS_S
                if received >= published or stalled or time.monotonic() > drain_deadline or not cfg.consumers:
                    for w in workers:
                        if w.role == "consumer" and not w.final:
                            os.write(w.stop_fd, b"x")
                    end = time.monotonic() + 5
                    while any(not w.final for w in workers) and time.monotonic() < end:
                        _read(workers, 0.1)
                    break
        if not live:
            break
        wait_ns = min(boundary, stop_ns if not stopped_publishers else boundary) - now
        _read(workers, min(0.1 if stopped_publishers else 1.0, max(0.0, wait_ns / 1e9)))
    for w in workers:
        for r in (w.latest,):
            if r.get("second") not in w.reports and r.get("consumer_hist"):
                hist_consumer.add(latency.decode(r["consumer_hist"]))
            if r.get("second") not in w.reports and r.get("confirm_hist"):
                hist_confirm.add(latency.decode(r["confirm_hist"]))
    published = _total(workers, "publisher", "sent")
    delivered = _total(workers, "consumer", "received")
    nacked = _total(workers, "publisher", "nacked")
    pub_at_stop, rec_at_stop, window_s = produced_at_stop or (published, delivered, cfg.duration_s)
    events = []
    for w in workers:
        for r in w.reports.values():
            for at_ns, what in r.get("blocked_events", []):
                events.append({"at_s": (at_ns - start_ns) / 1e9, "worker": f"{w.role}-{w.index}", "event": what})
    errors = [f"{w.role}-{w.index}: {w.latest['error']}" for w in workers if w.latest.get("error")]
    lat = {"consumer": latency.summary(hist_consumer)}
    if cfg.confirm:
        lat["confirm"] = latency.summary(hist_confirm)
    return LoadResult(
        published=published, confirmed=_total(workers, "publisher", "confirmed"), nacked=nacked,
        returned=_total(workers, "publisher", "returned"), delivered=delivered,
        lost=max(0, published - nacked - delivered) if cfg.consumers else 0,
        publish_rate=pub_at_stop / window_s if window_s else 0.0,
        deliver_rate=rec_at_stop / window_s if window_s else 0.0,
        latency_us=lat, seconds=seconds, blocked_events=sorted(events, key=lambda e: e["at_s"]),
        errors=errors, gaps=_total(workers, "consumer", "gaps"),
        duplicates=_total(workers, "consumer", "duplicates"))
