"""aio-pika against the broker: asyncio applications, its RPC pattern and direct reply-to.

aio-pika's RPC pattern is a small tour of RabbitMQ on its own: a server-named
auto-delete result queue with an exclusive consumer, a headers exchange as the
method queues' dead-letter exchange, mandatory publishes, and per-message TTL
that turns an unanswered call into a TimeoutError through dead-lettering. Reply
texts as RabbitMQ 3.10.8 sends them (aiormq raises one exception class per
reply code, with the text as its argument); the same tests run against
RabbitMQ itself (see ``tests/amqp_targets.py``).
"""

from __future__ import annotations

import asyncio
import ssl

import aio_pika
import pytest
from aio_pika.patterns import RPC
from aiormq.exceptions import ChannelNotFoundEntity, DeliveryError, PublishError

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def get(queue, timeout_s: float = 3.0):
    """The next message of ``queue`` by basic.get (acked), waiting up to ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        message = await queue.get(no_ack=True, fail=False)
        if message is not None:
            return message
        if loop.time() > deadline:
            raise AssertionError(f"no message in {queue.name} after {timeout_s} s")
        await asyncio.sleep(0.02)


async def ignore(_message) -> None:
    pass


def test_the_rpc_pattern_calls_answers_raises_and_times_out(amqp):
    idle = amqp.name("rpc-idle")

    async def scenario():
        server = await aio_pika.connect(amqp.url)
        client = await aio_pika.connect(amqp.url)
        async with server, client:
            served = await RPC.create(await server.channel())
            async def multiply(*, x, y):
                return x * y

            async def refuse(*, reason):
                raise ValueError(reason)
            await served.register("multiply", multiply, auto_delete=True)
            await served.register("refuse", refuse, auto_delete=True)
            caller = await RPC.create(await client.channel())
            # a method queue with nobody serving it: a call with an expiration dead-letters back
            channel = await client.channel()
            await channel.declare_queue(idle, auto_delete=True,
                                        arguments={"x-dead-letter-exchange": RPC.DLX_NAME})
            results = [await caller.call("multiply", kwargs={"x": 6, "y": 7})]
            results += await asyncio.gather(*(caller.call("multiply", kwargs={"x": i, "y": i}) for i in range(5)))
            with pytest.raises(ValueError, match="^no$"):
                await caller.call("refuse", kwargs={"reason": "no"})
            with pytest.raises(asyncio.TimeoutError):
                await caller.call(idle, expiration=0.2)
            with pytest.raises(aio_pika.exceptions.MessageProcessError, match="returned"):
                await caller.call("nobody-serves-this")             # mandatory: basic.return
            return results

    assert run(scenario()) == [42, 0, 1, 4, 9, 16]


def test_direct_reply_to_carries_answers_without_a_reply_queue(amqp):
    service = amqp.name("lookup")

    async def scenario():
        server = await aio_pika.connect(amqp.url)
        client = await aio_pika.connect(amqp.url)
        async with server, client:
            server_channel = await server.channel()
            requests = await server_channel.declare_queue(service, auto_delete=True)
            reply_to_seen = []

            async def answer(message: aio_pika.abc.AbstractIncomingMessage):
                async with message.process():
                    reply_to_seen.append(message.reply_to)
                    await server_channel.default_exchange.publish(
                        aio_pika.Message(message.body.upper(), correlation_id=message.correlation_id),
                        routing_key=message.reply_to)
            await requests.consume(answer)

            channel = await client.channel()
            replies = await channel.get_queue("amq.rabbitmq.reply-to")
            answers: asyncio.Queue = asyncio.Queue()

            async def on_reply(message):
                answers.put_nowait((message.correlation_id, message.body))
            await replies.consume(on_reply, no_ack=True)
            for i, word in enumerate([b"alpha", b"beta"]):
                await channel.default_exchange.publish(
                    aio_pika.Message(word, correlation_id=str(i), reply_to="amq.rabbitmq.reply-to"),
                    routing_key=service)
            got = [await answers.get(), await answers.get()]
            return got, reply_to_seen

    got, reply_to_seen = run(scenario())
    assert got == [("0", b"ALPHA"), ("1", b"BETA")]
    # the server sees a per-channel pseudo-queue name, one and the same for both requests
    assert reply_to_seen[0].startswith("amq.rabbitmq.reply-to.") and reply_to_seen[0] == reply_to_seen[1]


def test_exchange_to_exchange_bindings_and_an_alternate_exchange_route_end_to_end(amqp):
    names = {k: amqp.name(k) for k in ("front", "billing", "unrouted", "billing-q", "unrouted-q")}

    async def scenario():
        async with await aio_pika.connect(amqp.url) as conn:
            ch = await conn.channel()
            unrouted = await ch.declare_exchange(names["unrouted"], aio_pika.ExchangeType.FANOUT)
            front = await ch.declare_exchange(names["front"], aio_pika.ExchangeType.TOPIC,
                                              arguments={"alternate-exchange": names["unrouted"]})
            billing = await ch.declare_exchange(names["billing"], aio_pika.ExchangeType.DIRECT)
            await billing.bind(front, "billing.*")
            billing_q = await ch.declare_queue(names["billing-q"])
            await billing_q.bind(billing, "billing.invoice")
            unrouted_q = await ch.declare_queue(names["unrouted-q"])
            await unrouted_q.bind(unrouted)
            for key in ("billing.invoice", "billing.refund", "shipping.label"):
                await front.publish(aio_pika.Message(key.encode()), routing_key=key)
            first = [(await get(billing_q)).body, (await get(unrouted_q)).body]
            # billing.refund reached billing, which had no binding for it: dropped there, not sent on
            await billing.unbind(front, "billing.*")
            await front.publish(aio_pika.Message(b"after unbind"), routing_key="billing.invoice")
            second = (await get(unrouted_q)).body
            left = [(await ch.declare_queue(n, passive=True)).declaration_result.message_count
                    for n in (names["billing-q"], names["unrouted-q"])]
            return first, second, left

    assert run(scenario()) == ([b"billing.invoice", b"shipping.label"], b"after unbind", [0, 0])


def test_a_nacked_publish_raises_delivery_error(amqp):
    q = amqp.name("bounded")

    async def scenario():
        async with await aio_pika.connect(amqp.url) as conn:
            ch = await conn.channel(on_return_raises=True)     # publisher confirms are on by default
            await ch.declare_queue(q, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
            await ch.default_exchange.publish(aio_pika.Message(b"fits"), routing_key=q)
            with pytest.raises(DeliveryError) as exc:
                await ch.default_exchange.publish(aio_pika.Message(b"does not"), routing_key=q)
            nack = type(exc.value.frame).__name__
            with pytest.raises(PublishError):                  # mandatory and unroutable: basic.return
                await ch.default_exchange.publish(aio_pika.Message(b"x"), routing_key=amqp.name("none"),
                                                  mandatory=True)
            return nack

    assert run(scenario()) == "Nack"


def test_a_queue_unused_for_its_x_expires_is_deleted(amqp):
    q, kept = amqp.name("expiring"), amqp.name("kept-alive")

    async def scenario():
        async with await aio_pika.connect(amqp.url) as conn:
            ch = await conn.channel()
            await ch.declare_queue(q, arguments={"x-expires": 300})
            alive = await ch.declare_queue(kept, arguments={"x-expires": 300})
            await alive.consume(ignore)                         # a consumer keeps it in use
            await asyncio.sleep(1.0)
            await ch.declare_queue(kept, passive=True)
            with pytest.raises(ChannelNotFoundEntity) as exc:
                await ch.declare_queue(q, passive=True)
            return exc.value.args[0]

    assert run(scenario()) == f"NOT_FOUND - no queue '{q}' in vhost '/'"


def test_amqps_carries_messages(amqp_tls):
    q = amqp_tls.name("secure")
    context = ssl.create_default_context(cafile=amqp_tls.ca_file)

    async def scenario():
        conn = await aio_pika.connect(host="localhost", port=amqp_tls.tls_port, login="guest", password="guest",
                                      ssl=True, ssl_context=context)
        async with conn:
            ch = await conn.channel()
            queue = await ch.declare_queue(q, auto_delete=True)
            for i in range(50):
                await ch.default_exchange.publish(aio_pika.Message(b"%d" % i * 1000), routing_key=q)
            return [(await get(queue)).body for _ in range(50)]

    assert run(scenario()) == [b"%d" % i * 1000 for i in range(50)]


def test_publishes_in_flight_to_a_queue_being_deleted_are_confirmed_and_the_channel_stays_open(amqp):
    """As RabbitMQ's channel confirms what it had sent to a queue that then ended normally: a deleted
    queue's in-flight publishes go nowhere, are acked, and nothing is closed."""
    q = amqp.name("deleted-under-publishers")
    total = 20_000

    async def scenario():
        publisher = await aio_pika.connect(amqp.url)
        admin = await aio_pika.connect(amqp.url)
        async with publisher, admin:
            ch = await publisher.channel()                      # publisher confirms are on by default
            await ch.declare_queue(q)
            confirmed = 0

            async def publish():
                nonlocal confirmed
                await ch.default_exchange.publish(aio_pika.Message(b"x" * 100), routing_key=q)
                confirmed += 1

            publishes = [asyncio.ensure_future(publish()) for _ in range(total)]
            while confirmed < total // 10:
                await asyncio.sleep(0.001)
            deleted = await (await admin.channel()).queue_delete(q)
            results = await asyncio.gather(*publishes, return_exceptions=True)
            refused = [r for r in results if isinstance(r, BaseException)]
            check = await publisher.channel()
            with pytest.raises(ChannelNotFoundEntity):
                await check.declare_queue(q, passive=True)
            return deleted.message_count, refused, ch.is_closed, publisher.is_closed

    count, refused, channel_closed, connection_closed = run(scenario(), timeout_s=40)
    assert 0 < count < total
    assert refused == []
    assert (channel_closed, connection_closed) == (False, False)
