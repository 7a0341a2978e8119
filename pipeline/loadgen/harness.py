"""Run publishers and consumers as OS processes and merge their once-a-second reports.

Lifecycle (``run_load``)::

    fork consumers ─▶ each connects, declares, consumes, reports "ready"
    fork producers ─▶ each connects, declares, confirm.select, reports "ready"
    start instant chosen; "G"+start to every worker ─▶ seconds counted from it
    every second: each worker reports; the book merges second k into a
        SecondReport once every live worker has reported it (or 300 ms late)
    at -z: "S" to producers ─▶ each finishes its batch, waits for confirms,
        closes and waits for close-ok (the broker has read everything), reports
    drain: consumers run on until every copy arrived, or the broker's queues
        are empty and still (asked through ``broker``), or ``drain_s`` is over
        (see ``accounting``) ─▶ "E" to producers still closing (they report and
        drop the connection) ─▶ "S" to consumers ─▶ finals
    reap: every worker is waited for, killed if it lingers

A worker is forked with SIGINT/SIGTERM blocked until it has set itself up;
it ignores SIGINT (the harness coordinates shutdown) and asks the kernel for
SIGKILL when the harness dies (PR_SET_PDEATHSIG), so no worker outlives a
killed harness. The pipe records are described in ``report``; ``ReportBook``
is the pure part that turns records into per-second and final figures, and
``accounting`` says where each message ended up.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import time
from dataclasses import dataclass, field

from pipeline.amqp.errors import AmqpError
from pipeline.loadgen import LoadgenError, accounting, latency
from pipeline.loadgen.accounting import DrainEnd
from pipeline.loadgen.client import ClientError
from pipeline.loadgen.config import LoadConfig
from pipeline.loadgen.consumer import Consumer
from pipeline.loadgen.publisher import Publisher
from pipeline.loadgen.report import WorkerLink, decode_records, encode_end, encode_rate, encode_start, encode_stop

NS_PER_S = 1_000_000_000
READY_TIMEOUT_S = 30.0
START_WAIT_TIMEOUT_S = 120.0
SECOND_GRACE_NS = 300_000_000
FINAL_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.25
REAP_TIMEOUT_S = 5.0
PR_SET_PDEATHSIG = 1
EXIT_OK = 0
EXIT_WORKER_FAILED = 1


class WorkerFailed(LoadgenError):
    """Raised when a publisher or consumer process cannot connect or set itself up."""


@dataclass(frozen=True)
class SecondReport:
    time_s: float                 # seconds since the start instant at which the second's reports were taken
    sent_rate: float              # msg/s over the second, all producers
    confirmed_rate: float
    received_rate: float
    nacked: int                   # during the second
    returned: int                 # during the second
    consumer: dict                # latency percentiles, µs (latency.percentiles)
    confirm: dict | None          # None without confirms
    blocked: dict                 # publisher name -> blocked by connection.blocked during the second
    published: int                # cumulative
    delivered: int                # cumulative
    histograms: dict | None = None  # the second's latency as HdrHistogram base64 text, per kind
    confirmed_total: int = 0      # cumulative
    nacked_total: int = 0         # cumulative
    returned_total: int = 0       # cumulative


@dataclass(frozen=True)
class LoadResult:
    run_id: str
    published: int
    confirmed: int
    nacked: int
    returned: int
    delivered: int
    lost: int                     # copies the broker accepted and never delivered (see ``accounting``)
    stale: int                    # deliveries left over from earlier runs
    gaps: int
    duplicates: int
    publish_rate: float           # msg/s over the producing window
    deliver_rate: float           # msg/s over the producing window
    window_s: float
    latency_us: dict              # {"consumer": percentiles, "confirm": percentiles (with -c)}
    histograms: dict              # the same, as HdrHistogram base64 text
    seconds: tuple = ()
    blocked_events: dict = field(default_factory=dict)   # publisher -> ((time_s, "blocked"/"unblocked", reason), ...)
    errors: tuple = ()
    cpu_s: dict = field(default_factory=dict)   # worker -> CPU seconds the worker process used
    undelivered: int = 0          # copies still on their way when the drain ended
    dropped: int = 0              # copies the queues' limits (x-max-length, x-message-ttl) may have dropped
    skipped: int = 0              # sends the rate limiter skipped after stalls instead of bursting (``schedule``)
    foreign: int = 0              # deliveries from another tool (PerfTest, omq)
    rejected: int = 0             # publishes the broker refused
    rejections: dict = field(default_factory=dict)   # reason -> publishes
    drain: DrainEnd | None = None
    connections: dict = field(default_factory=dict)  # publisher -> how its connection ended (accounting.CLOSED, ...)
    blocked_s: dict = field(default_factory=dict)    # publisher -> seconds its connection was blocked (connection.blocked)
    reordered: int = 0            # deliveries that came after a later sequence of their producer
    order: dict = field(default_factory=dict)        # queue -> {"gaps", "duplicates", "reordered"}, where checked


# -- the pure part ---------------------------------------------------------------------------
class ReportBook:
    """Everything the workers reported, merged into seconds and a result (no I/O, no clock)."""

    def __init__(self, cfg: LoadConfig, start_ns: int, workers: list[str], run_id: str = ""):
        self.cfg = cfg
        self.start_ns = start_ns
        self.run_id = run_id
        self.workers = list(workers)
        self.latest: dict[str, dict] = {}            # worker -> latest record with stats
        self.used: dict[str, dict] = {}              # worker -> record the previous second was cut at
        self.fresh_hist: dict[str, list[tuple[str, str]]] = {w: [] for w in workers}   # (kind, histogram)
        self.fresh_events: dict[str, list] = {w: [] for w in workers}
        self.totals = {"consumer": latency.new_histogram(), "confirm": latency.new_histogram()}
        self.events: dict[str, list] = {}
        self.finals: set[str] = set()
        self.gone: set[str] = set()                   # ended: final record, or EOF
        self.errors: list[str] = []
        self.cpu_s: dict[str, float] = {}             # worker -> CPU seconds it has used
        self.window: dict[str, tuple[int, int]] | None = None   # worker -> (at_ns, record) at stop

    @staticmethod
    def role(worker: str) -> str:
        return worker.split("-", 1)[0]

    def add(self, record: dict) -> None:
        worker = record["worker"]
        event = record["event"]
        if event == "error":
            self.errors.append(f"{worker}: {record.get('error')}")
            self.gone.add(worker)
            return
        if "stats" not in record:
            return
        self.latest[worker] = record
        if "cpu_s" in record:
            self.cpu_s[worker] = record["cpu_s"]
        for kind, text in (record.get("hist") or {}).items():
            if text:
                self.fresh_hist[worker].append((kind, text))
                self.totals[kind] = latency.merge((self.totals[kind], text))
        for at_ns, what, reason in record.get("blocked_events") or ():
            self.fresh_events[worker].append(what)
            self.events.setdefault(worker, []).append(((at_ns - self.start_ns) / NS_PER_S, what, reason))
        if event == "final":
            self.finals.add(worker)
            self.gone.add(worker)
            if record.get("error"):
                self.errors.append(f"{worker}: {record['error']}")

    def ended(self, worker: str, why: str) -> None:
        """``worker``'s pipe closed; without a final report that is a death worth reporting."""
        if worker not in self.gone:
            self.errors.append(f"{worker}: {why}")
        self.gone.add(worker)

    def has_second(self, k: int) -> bool:
        """Every live worker has reported second ``k`` (or a later one)."""
        return all(w in self.gone or self.latest.get(w, {}).get("k", -1) >= k for w in self.workers)

    def _stat(self, worker: str, name: str, record: dict | None = None) -> int:
        record = record if record is not None else self.latest.get(worker)
        return (record or {}).get("stats", {}).get(name, 0)

    def _sum(self, role: str, name: str) -> int:
        return sum(self._stat(w, name) for w in self.workers if self.role(w) == role)

    def second(self, k: int) -> SecondReport:
        """Cut second ``k``: rates since the previous cut, latencies reported since then."""
        rates = {"sent": 0.0, "confirmed": 0.0, "received": 0.0}
        counts = {"nacked": 0, "returned": 0}
        ats = []
        blocked = {}
        hists = {"consumer": [], "confirm": []}
        for w in self.workers:
            rec = self.latest.get(w)
            if rec is None:
                continue
            prev = self.used.get(w)
            prev_at = prev["at_ns"] if prev else self.start_ns
            dt_s = max(rec["at_ns"] - prev_at, 1) / NS_PER_S
            fields = ("sent", "confirmed") if self.role(w) == "publisher" else ("received",)
            for name in fields:
                rates[name] += (self._stat(w, name) - self._stat(w, name, prev or {})) / dt_s
            if self.role(w) == "publisher":
                for name in counts:
                    counts[name] += self._stat(w, name) - self._stat(w, name, prev or {})
                blocked[w] = bool(rec["stats"].get("blocked")) or "blocked" in self.fresh_events[w]
            for kind, text in self.fresh_hist[w]:
                hists[kind].append(text)
            self.fresh_hist[w] = []
            self.fresh_events[w] = []
            if rec is not prev:
                ats.append(rec["at_ns"])
            self.used[w] = rec
        time_s = (sum(ats) / len(ats) - self.start_ns) / NS_PER_S if ats else float(k + 1)
        consumer = latency.merge(hists["consumer"])
        confirm = latency.merge(hists["confirm"]) if self.cfg.confirm else None
        encoded = {"consumer": latency.encode(consumer)}
        if confirm is not None:
            encoded["confirm"] = latency.encode(confirm)
        return SecondReport(
            time_s=time_s, sent_rate=rates["sent"], confirmed_rate=rates["confirmed"],
            received_rate=rates["received"], nacked=counts["nacked"], returned=counts["returned"],
            consumer=latency.percentiles(consumer),
            confirm=latency.percentiles(confirm) if confirm is not None else None,
            blocked=blocked, published=self._sum("publisher", "sent"), delivered=self._sum("consumer", "received"),
            histograms=encoded, confirmed_total=self._sum("publisher", "confirmed"),
            nacked_total=self._sum("publisher", "nacked"), returned_total=self._sum("publisher", "returned"))

    def mark_window(self) -> None:
        """The producing window ends now: remember each worker's latest report for the average rates."""
        self.window = {w: (rec["at_ns"], rec) for w, rec in self.latest.items()}

    @property
    def published(self) -> int:
        return self._sum("publisher", "sent")

    @property
    def delivered(self) -> int:
        """Copies of this run's publishes received (another tool's messages are not counted)."""
        return self._sum("consumer", "received") - self._sum("consumer", "foreign")

    def stats(self, role: str) -> dict[str, dict]:
        """Worker -> its latest statistics, for one role."""
        return {w: self.latest.get(w, {}).get("stats", {}) for w in self.workers if self.role(w) == role}

    def accounts(self, drain: DrainEnd | None = None) -> accounting.Accounts:
        return accounting.account(self.cfg, self.stats("publisher"), self.stats("consumer"), drain)

    def expected_deliveries(self) -> int:
        """Copies the consumers should get: each publish not rejected, once per consumed queue."""
        return self.accounts().expected

    def publishers_ended(self) -> bool:
        """Every publisher has sent its final report (or is gone)."""
        return all(w in self.gone for w in self.workers if self.role(w) == "publisher")

    def refused(self) -> bool:
        """The broker closed some publisher's channel or connection."""
        return any(s.get("connection") == accounting.REFUSED for s in self.stats("publisher").values())

    def _window_rate(self, role: str, name: str, fallback_s: float) -> float:
        rate = 0.0
        for w in self.workers:
            if self.role(w) != role:
                continue
            at_ns, rec = (self.window or {}).get(w, (0, None))
            if rec is not None and at_ns > self.start_ns:
                rate += self._stat(w, name, rec) / ((at_ns - self.start_ns) / NS_PER_S)
            elif self._stat(w, "last_ns") > self.start_ns:    # no report inside a short (-C) window
                rate += self._stat(w, name) / ((self._stat(w, "last_ns") - self.start_ns) / NS_PER_S)
            else:
                rate += self._stat(w, name) / fallback_s
        return rate

    def result(self, seconds: list[SecondReport], drain: DrainEnd | None = None) -> LoadResult:
        """The run's figures; ``drain`` (how the drain ended) decides what counts as lost."""
        cfg = self.cfg
        published, delivered = self.published, self.delivered
        if drain is None:
            drain = DrainEnd(accounting.DRAIN_IDLE, 0.0)
        accounts = self.accounts(drain)
        lat = {"consumer": latency.percentiles(self.totals["consumer"])}
        hists = {"consumer": latency.encode(self.totals["consumer"])}
        if cfg.confirm:
            lat["confirm"] = latency.percentiles(self.totals["confirm"])
            hists["confirm"] = latency.encode(self.totals["confirm"])
        windows = [at - self.start_ns for at, _ in (self.window or {}).values()]
        return LoadResult(
            run_id=self.run_id, published=published, confirmed=self._sum("publisher", "confirmed"),
            nacked=self._sum("publisher", "nacked"), returned=self._sum("publisher", "returned"),
            delivered=delivered, lost=accounts.lost, stale=self._sum("consumer", "stale"),
            gaps=self._sum("consumer", "gaps"), duplicates=self._sum("consumer", "duplicates"),
            publish_rate=self._window_rate("publisher", "sent", cfg.duration_s),
            deliver_rate=self._window_rate("consumer", "received", cfg.duration_s),
            window_s=max(windows) / NS_PER_S if windows else float(cfg.duration_s),
            latency_us=lat, histograms=hists, seconds=tuple(seconds),
            blocked_events={w: tuple(e) for w, e in self.events.items()}, errors=tuple(self.errors),
            cpu_s=dict(self.cpu_s), undelivered=accounts.undelivered, rejected=accounts.rejected,
            dropped=accounts.dropped, skipped=self._sum("publisher", "skipped"),
            foreign=self._sum("consumer", "foreign"),
            rejections=accounts.rejections, drain=drain,
            connections={w: st.get("connection", accounting.OPEN) for w, st in self.stats("publisher").items()},
            blocked_s={w: round(st.get("blocked_ns", 0) / NS_PER_S, 3) for w, st in self.stats("publisher").items()},
            reordered=self._sum("consumer", "reordered"), order=self.order_by_queue())

    def order_by_queue(self) -> dict:
        """Gaps, duplicates and late arrivals per queue, for queues with one consumer (only there does
        one process see each producer's whole sequence)."""
        out: dict[str, dict] = {}
        for w, st in self.stats("consumer").items():
            q = self.cfg.consumer_queue(int(w.rsplit("-", 1)[1]))
            if self.cfg.consumers_on(q) == 1:
                out[q] = {k: st.get(k, 0) for k in ("gaps", "duplicates", "reordered")}
        return out


# -- processes -------------------------------------------------------------------------------
@dataclass
class WorkerProcess:
    name: str
    pid: int
    report_fd: int
    control_fd: int
    buffer: bytes = b""
    open: bool = True
    ready: bool = False
    exit_code: int | None = None


def _worker_main(name: str, cfg: LoadConfig, index: int, link: WorkerLink) -> int:
    """Everything a worker process does; its exit code."""
    try:
        worker = Publisher(cfg, index) if name.startswith("publisher") else Consumer(cfg, index)
    except (ClientError, AmqpError, OSError) as exc:
        link.send("error", error=f"cannot start: {exc}")
        return EXIT_WORKER_FAILED
    link.send("ready")
    start_ns = None
    deadline = time.monotonic() + START_WAIT_TIMEOUT_S
    while start_ns is None and time.monotonic() < deadline:
        select.select([link.control_fd], [], [], 1.0)
        command, value = link.command_nowait()
        if command == "stop":
            worker.client.close()
            return EXIT_OK
        if command == "start":
            start_ns = value
    if start_ns is None:
        worker.client.abort()
        return EXIT_WORKER_FAILED
    try:
        worker.run(link, start_ns)
        worker.finish(link, start_ns)
    except (ClientError, AmqpError, OSError) as exc:
        worker.client.abort()
        if isinstance(worker, Publisher):
            worker.ended(exc)
        worker.report(link, "final", start_ns, time.monotonic_ns())
        link.send("error", error=str(exc))
        return EXIT_WORKER_FAILED
    return EXIT_OK


def _spawn(name: str, cfg: LoadConfig, index: int, others: list[WorkerProcess]) -> WorkerProcess:
    report_r, report_w = os.pipe()
    control_r, control_w = os.pipe()
    parent = os.getpid()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for fd in (report_r, report_w, control_r, control_w):
            os.close(fd)
        raise
    if pid == 0:                                     # the worker
        code = EXIT_WORKER_FAILED
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:               # the harness died before prctl took effect
                os._exit(code)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            for fd in [report_r, control_w] + [f for w in others for f in (w.report_fd, w.control_fd)]:
                os.close(fd)
            code = _worker_main(name, cfg, index, WorkerLink(name, report_w, control_r))
        except BaseException as exc:                 # nothing may escape into the harness's code
            try:
                os.write(report_w, f'{{"event":"error","worker":"{name}","error":"{type(exc).__name__}"}}\n'
                         .encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(report_w)
    os.close(control_r)
    return WorkerProcess(name, pid, report_r, control_w)


def _read_reports(workers: list[WorkerProcess], book: ReportBook | None, timeout_s: float,
                  early: list[dict] | None = None) -> None:
    """Wait up to ``timeout_s`` for reports and take in all that came; records before the book go to ``early``."""
    live = {w.report_fd: w for w in workers if w.open}
    if not live:
        time.sleep(max(0.0, timeout_s))
        return
    poller = select.poll()                           # not select(): a big run has over 1024 descriptors
    for fd in live:
        poller.register(fd, select.POLLIN)
    for fd, _ in poller.poll(max(0.0, timeout_s) * 1000):
        w = live[fd]
        data = os.read(fd, 65536)
        if not data:
            w.open = False
            if book is not None:
                book.ended(w.name, "died without a final report" + _exit_note(w))
            elif early is not None:
                early.append({"event": "error", "worker": w.name, "error": "died before it was ready" + _exit_note(w)})
            continue
        records, used = decode_records(w.buffer + data)
        w.buffer = (w.buffer + data)[used:]
        for record in records:
            if record["event"] == "ready":
                w.ready = True
            elif book is not None:
                book.add(record)
            elif early is not None:
                early.append(record)


def _exit_note(w: WorkerProcess) -> str:
    try:
        pid, status = os.waitpid(w.pid, os.WNOHANG)
    except ChildProcessError:
        return ""
    if pid:
        w.exit_code = os.waitstatus_to_exitcode(status)
        return f" (exit code {w.exit_code})"
    return ""


def _wait_ready(workers: list[WorkerProcess]) -> None:
    early: list[dict] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while any(w.open and not w.ready for w in workers) and not early:
        left = deadline - time.monotonic()
        if left <= 0:
            late = [w.name for w in workers if not w.ready]
            raise WorkerFailed(f"{', '.join(late)} not ready after {READY_TIMEOUT_S:.0f} s")
        _read_reports(workers, None, min(left, 0.5), early)
    errors = [f"{r['worker']}: {r.get('error')}" for r in early if r["event"] == "error"]
    if errors:
        raise WorkerFailed("; ".join(errors))


def _send(workers: list[WorkerProcess], data: bytes) -> None:
    for w in workers:
        try:
            os.write(w.control_fd, data)
        except OSError:
            pass                                     # it already ended; its report pipe says so


def _reap(workers: list[WorkerProcess]) -> None:
    for w in workers:
        for fd in (w.report_fd, w.control_fd):
            try:
                os.close(fd)
            except OSError:
                pass
    deadline = time.monotonic() + REAP_TIMEOUT_S
    for w in workers:
        if w.exit_code is not None:
            continue
        while True:
            try:
                pid, _ = os.waitpid(w.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                break
            if time.monotonic() >= deadline:
                os.kill(w.pid, signal.SIGKILL)
                os.waitpid(w.pid, 0)
                break
            time.sleep(0.01)


def _run_id() -> str:
    now = time.time()
    return f"test-{time.strftime('%H%M%S', time.localtime(now))}-{int(now * 1000) % 1000:03d}"


def run_load(cfg: LoadConfig, on_second=None, broker=None, on_drain=None, search=None) -> LoadResult:
    """Run ``cfg``'s load against the broker at ``cfg.host:cfg.port``.

    ``on_second(SecondReport)`` is called once a second of the producing
    window; if it returns a true value, publishing stops there (early).
    ``broker()``, if given, returns a ``BrokerView`` of the broker's queues:
    the drain asks it whether they are empty, and records their depths when
    it ends. ``on_drain(seconds, delivered, expected, view)`` is called about
    once a second of the drain (``view`` None without ``broker``). ``search``, if given (a
    ``maxrate.RateSearch``), sees each second's counts and sets the publishers' rate.

    Raises WorkerFailed if a worker cannot connect or set up; a worker that
    fails later is listed in ``LoadResult.errors`` and the run carries on.
    """
    workers: list[WorkerProcess] = []
    try:
        consumers = []
        for i in range(cfg.consumers):
            consumers.append(_spawn(f"consumer-{i}", cfg, i, workers))
            workers.append(consumers[-1])
        _wait_ready(consumers)
        producers = []
        for i in range(cfg.producers):
            producers.append(_spawn(f"publisher-{i}", cfg, i, workers))
            workers.append(producers[-1])
        _wait_ready(producers)
        start_ns = time.monotonic_ns()
        book = ReportBook(cfg, start_ns, [w.name for w in workers], _run_id())
        _send(workers, encode_start(start_ns))
        seconds = _produce(cfg, workers, book, start_ns, on_second, search, producers)
        _send(producers, encode_stop())
        drain = _drain(cfg, workers, book, broker, on_drain)
        _send(producers, encode_end())
        _until(lambda: all(not w.open or w.name in book.gone for w in producers), workers, book, FINAL_TIMEOUT_S)
        _send(consumers, encode_stop())
        _until(lambda: all(not w.open or w.name in book.gone for w in consumers), workers, book, FINAL_TIMEOUT_S)
        return book.result(seconds, drain)
    finally:
        _reap(workers)


def _produce(cfg: LoadConfig, workers, book: ReportBook, start_ns: int, on_second, search=None,
             producers=()) -> list[SecondReport]:
    """The producing window: cut and hand out each second (until ``on_second`` returns true)."""
    seconds: list[SecondReport] = []
    stop_ns = start_ns + int(cfg.duration_s * NS_PER_S)
    last_k = int(cfg.duration_s) - 1                 # the last whole second inside the window
    k = 0
    while True:
        now = time.monotonic_ns()
        boundary = start_ns + (k + 1) * NS_PER_S
        if k <= last_k and now >= boundary and (book.has_second(k) or now >= boundary + SECOND_GRACE_NS):
            seconds.append(book.second(k))
            k += 1
            if search is not None and producers:
                rate = search.observe(seconds[-1].time_s, seconds[-1].published, seconds[-1].delivered)
                if rate is not None:
                    _send(producers, encode_rate(rate / len(producers)))
            if on_second is not None and on_second(seconds[-1]):
                break                                # the caller has seen enough: stop early
            continue
        if now >= stop_ns and k > last_k:
            break
        if all(not w.open for w in workers):
            break
        if cfg.pmessages and cfg.producers and book.publishers_ended():
            break                                    # every producer sent its -C messages
        wake = min(stop_ns, boundary + (0 if now < boundary else SECOND_GRACE_NS))
        _read_reports(workers, book, min(1.0, max(0, wake - now) / NS_PER_S))
    book.mark_window()
    return seconds


def _until(done, workers, book: ReportBook, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline and any(w.open for w in workers):
        _read_reports(workers, book, min(0.2, max(0.0, deadline - time.monotonic())))


def _drain(cfg: LoadConfig, workers, book: ReportBook, broker, on_drain) -> DrainEnd:
    """After -z: read reports until the drain is over (see ``accounting``); how it ended."""
    started = time.monotonic()
    deadline = started + cfg.drain_s
    queues = accounting.consumed_queues(cfg)
    consumers = [w for w in workers if book.role(w.name) == "consumer"]
    still = None                   # the broker's view, unchanged since ``still_at``
    still_at = started
    heard, heard_at = book.delivered, started
    next_progress = started + 1.0

    def end(why: str) -> DrainEnd:
        last = broker() if broker is not None else None
        return DrainEnd(why, round(time.monotonic() - started, 3),
                        {q: last.queues[q] for q in cfg.queues if q in last.queues} if last is not None else None)

    while True:
        now = time.monotonic()
        if book.delivered != heard:
            heard, heard_at = book.delivered, now
        ended = book.publishers_ended()
        if ended and book.delivered >= book.expected_deliveries() and not book.refused():
            return end(accounting.DRAIN_DELIVERED)
        if consumers and not any(w.open and w.name not in book.gone for w in consumers):
            return end(accounting.DRAIN_CONSUMERS_GONE)
        if now >= deadline:
            return end(accounting.DRAIN_TIME)
        view = broker() if broker is not None and (ended or now >= next_progress) else None
        if ended and view is not None:
            if not view.empty(queues) or not view.same_as(still, queues) or heard_at > still_at:
                still, still_at = view, now
            elif now - still_at >= accounting.QUIET_S:
                return end(accounting.DRAIN_EMPTY)
        elif ended and now - heard_at >= accounting.IDLE_S:
            return end(accounting.DRAIN_IDLE)
        if now >= next_progress:
            next_progress += 1.0
            if on_drain is not None:
                on_drain(now - started, book.delivered, book.expected_deliveries(), view)
        _read_reports(workers, book, min(DRAIN_POLL_S, max(0.0, deadline - now)))
