"""AMQP 0-9-1 for creditflow.

``frames``      the codec: pure functions, pamqp for everything, byte-identical
                hand-written fast paths for the per-message frames
``connection``  the server side of one connection, sans-IO: bytes in, one event
                at a time out, replies queued as bytes
``errors``      reply codes, and the errors that carry them to the peer
"""
