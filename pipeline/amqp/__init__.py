"""AMQP 0-9-1 for creditflow.

``frames``      the codec: pure functions, pamqp to encode, ``fields`` to decode, byte-identical
                hand-written fast paths for the per-message frames
``fields``      field tables, arrays and method arguments: decoded in one pass, no recursion,
                nesting bounded
``connection``  the server side of one connection, sans-IO: bytes in, one event
                at a time out, replies queued as bytes
``errors``      reply codes, and the errors that carry them to the peer
"""
