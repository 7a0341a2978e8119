"""The long scenarios: 1,000 connections (aio-pika, from client processes) and 1,000 queues (pika).

``connections-1000`` forks ``CLIENT_PROCESSES`` workers, each an asyncio loop holding its share of
publisher/consumer connection pairs; the scenario process talks to them over a pipe: ``open`` (how many
connections and channels opened, with the errors), then ``go``, then the counts of the hold, then
``close`` (each worker deletes its queues and closes its connections). Live stages are counted before
the connections open, at the peak and after they close. ``queues-1000`` runs on one pika connection.
Both also run over ``--uri``, where stages are not observable.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time

from pipeline.stress import StressError
from pipeline.stress.scenarios import Broker, Place, live_stages, steady_stages, wait_stages

CONNECTIONS = 1000              # connections-1000: publishers and consumers, half each
CLIENT_PROCESSES = 2
OPENING_AT_ONCE = 20            # handshakes in flight per worker
HOLD_S = 20.0
RATE_PER_PUBLISHER = 1.0        # msg/s, with confirms
DRAIN_S = 30.0                  # how long consumers may take to receive every confirmed message
OPEN_TIMEOUT_S = 180.0          # the workers' answers, each step
STAGES_SETTLE_S = 60.0          # closing 1,000 connections ends their stages within this long
QUEUES = 1000


def _url(address) -> str:
    from urllib.parse import quote
    return (f"amqp://{quote(address.user, safe='')}:{quote(address.password, safe='')}@{address.host}:"
            f"{address.port}/{quote(address.vhost, safe='')}")


# -- connections-1000: one client process -----------------------------------------------------------
async def _worker_main(url: str, pairs: list[int], prefix: str, link) -> None:
    import aio_pika
    loop = asyncio.get_running_loop()
    recv = lambda: loop.run_in_executor(None, link.recv)         # noqa: E731
    gate = asyncio.Semaphore(OPENING_AT_ONCE)
    errors: list[str] = []

    async def open_one():
        async with gate:
            try:
                conn = await aio_pika.connect(url, timeout=60)
                return conn, await conn.channel(publisher_confirms=True)
            except Exception as exc:          # noqa: BLE001 - counted and reported
                errors.append(f"open: {type(exc).__name__}: {exc}")
                return None

    opened = await asyncio.gather(*(open_one() for _ in range(2 * len(pairs))))
    publishers, consumers = opened[0::2], opened[1::2]
    got: dict[int, set] = {p: set() for p in pairs}
    queues, tags = {}, {}
    duplicates = 0
    for p, pair in zip(pairs, consumers):
        if pair is None:
            continue
        try:
            await pair[1].set_qos(prefetch_count=100)
            queues[p] = await pair[1].declare_queue(f"{prefix}-{p}")

            def on_message(message, p=p):
                nonlocal duplicates
                seq = int(message.body)
                duplicates += seq in got[p]
                got[p].add(seq)
                return message.ack()
            tags[p] = await queues[p].consume(on_message)
        except Exception as exc:              # noqa: BLE001
            errors.append(f"consume: {type(exc).__name__}: {exc}")
    link.send(("open", sum(o is not None for o in opened), sum(o is not None for o in opened), errors[:5],
               len(errors)))
    go_at, hold_s = await recv()
    counts = {"published": 0, "confirmed": 0, "nacked": 0}
    confirmed: dict[int, set] = {p: set() for p in pairs}

    async def publish(p: int, chan) -> None:
        seq, next_at, until = 0, go_at + (p % 100) / 100 / RATE_PER_PUBLISHER, go_at + hold_s
        while (now := time.time()) < until:
            if next_at > now:
                await asyncio.sleep(next_at - now)
            next_at += 1 / RATE_PER_PUBLISHER
            seq += 1
            counts["published"] += 1
            try:
                await chan.default_exchange.publish(aio_pika.Message(str(seq).encode()), routing_key=f"{prefix}-{p}")
                counts["confirmed"] += 1
                confirmed[p].add(seq)
            except aio_pika.exceptions.DeliveryError:
                counts["nacked"] += 1
            except Exception as exc:          # noqa: BLE001
                errors.append(f"publish: {type(exc).__name__}: {exc}")
                return
    await asyncio.gather(*(publish(p, pair[1]) for p, pair in zip(pairs, publishers) if pair is not None))
    drain_until = time.monotonic() + DRAIN_S
    while time.monotonic() < drain_until and any(confirmed[p] - got[p] for p in pairs):
        await asyncio.sleep(0.2)
    counts.update(delivered=sum(len(got[p]) for p in pairs), lost=sum(len(confirmed[p] - got[p]) for p in pairs),
                  duplicates=duplicates)
    link.send(("counts", counts, errors[:5], len(errors)))
    await recv()                              # close
    for p, queue in queues.items():
        try:
            await queue.cancel(tags[p])       # before the delete, so that the broker has no consumer to cancel
            await queue.delete(if_unused=False, if_empty=False)
        except Exception:                     # noqa: BLE001 - a queue left behind shows in the stages
            pass
    for pair in opened:
        if pair is not None:
            try:
                await pair[0].close()
            except Exception:                 # noqa: BLE001
                pass
    link.send(("closed",))


def _worker(url: str, pairs: list[int], prefix: str, link) -> None:
    asyncio.run(_worker_main(url, pairs, prefix, link))


def _answer(link, proc, what: str):
    if not link.poll(OPEN_TIMEOUT_S):
        raise StressError(f"a client process gave no {what} within {OPEN_TIMEOUT_S:.0f} s "
                          f"({'alive' if proc.is_alive() else f'exit {proc.exitcode}'})")
    try:
        return link.recv()
    except EOFError:
        raise StressError(f"a client process exited (code {proc.exitcode}) before its {what}") from None


def run_connections_1000(place: Place) -> dict:
    pairs = list(range(CONNECTIONS // 2))
    ctx = multiprocessing.get_context("fork")
    workers = []
    with Broker(place, connection_max=CONNECTIONS + 10) as broker:
        try:
            before = steady_stages(broker) if broker.ctl else None
            started = time.monotonic()
            for share in (pairs[i::CLIENT_PROCESSES] for i in range(CLIENT_PROCESSES)):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(_url(broker.address), share,
                                                         place.queue("connections-1000"), theirs), daemon=True)
                proc.start()
                theirs.close()
                workers.append((proc, mine))
            opened = [_answer(link, proc, "open") for proc, link in workers]
            open_s = time.monotonic() - started
            peak = live_stages(broker.status()) if broker.ctl else None
            go_at = time.time() + 0.5
            for _, link in workers:
                link.send((go_at, HOLD_S))
            held = [_answer(link, proc, "counts") for proc, link in workers]
            for _, link in workers:
                link.send("close")
            for proc, link in workers:
                _answer(link, proc, "close")
                proc.join(30)
            after = wait_stages(broker, before, STAGES_SETTLE_S)[0] if broker.ctl else None
            up = _broker_up(broker)
        finally:
            for proc, link in workers:
                if proc.is_alive():
                    proc.kill()
                proc.join()
                link.close()
    totals = {k: sum(h[1][k] for h in held) for k in held[0][1]}
    errors = [e for o in opened for e in o[3]] + [e for h in held for e in h[2]]
    return {"wanted": CONNECTIONS, "connections_open": sum(o[1] for o in opened),
            "channels_open": sum(o[2] for o in opened), "open_seconds": open_s, "hold_s": HOLD_S, **totals,
            "errors": errors, "error_count": sum(o[4] for o in opened) + sum(h[3] for h in held),
            "stages_before": before, "stages_peak": peak, "stages_after": after, "broker_up": up,
            "broker_exit_code": broker.exit_code}


def _broker_up(broker: Broker) -> bool:
    from pipeline.loadgen.client import ClientError
    try:
        broker.client("creditflow-stress probe").close()
        return True
    except (ClientError, OSError):
        return False


# -- queues-1000 ------------------------------------------------------------------------------------
def run_queues_1000(place: Place) -> dict:
    import pika
    prefix = place.queue("queues-1000")
    names = [f"{prefix}-{i}" for i in range(QUEUES)]
    counts = {"declared": 0, "bound": 0, "confirmed": 0, "delivered": 0, "left_over": 0}
    errors: list[str] = []
    with Broker(place) as broker:
        before = steady_stages(broker) if broker.ctl else None
        a = broker.address
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            a.host, a.port, a.vhost, pika.PlainCredentials(a.user, a.password), blocked_connection_timeout=60))
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.exchange_declare(prefix, "direct", durable=False)
            started = time.monotonic()
            for i, q in enumerate(names):
                ch.queue_declare(q, durable=False)
                counts["declared"] += 1
                ch.queue_bind(q, prefix, routing_key=str(i))
                counts["bound"] += 1
            declare_s = time.monotonic() - started
            peak = live_stages(broker.status()) if broker.ctl else None
            for i in range(QUEUES):
                try:
                    ch.basic_publish(prefix, str(i), str(i).encode(), mandatory=True)
                    counts["confirmed"] += 1
                except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
                    errors.append(f"publish {i}: {type(exc).__name__}")
            for i, q in enumerate(names):
                method, _, body = ch.basic_get(q, auto_ack=True)
                counts["delivered"] += method is not None and body == str(i).encode()
                counts["left_over"] += method.message_count if method is not None else 0
            for q in names:
                counts["left_over"] += ch.queue_delete(q).method.message_count
            ch.exchange_delete(prefix)
        except pika.exceptions.AMQPError as exc:
            raise StressError(f"pika: {type(exc).__name__}: {exc}") from None
        finally:
            if conn.is_open:
                conn.close()
        after = wait_stages(broker, before)[0] if broker.ctl else None
        up = _broker_up(broker)
    return {"wanted": QUEUES, **counts, "declare_seconds": declare_s, "errors": errors[:5],
            "stages_before": before, "stages_peak": peak, "stages_after": after, "broker_up": up,
            "broker_exit_code": broker.exit_code}
