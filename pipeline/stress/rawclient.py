"""A blocking AMQP client for the scenarios the load generator does not cover.

``StressClient`` is the load generator's ``AmqpClient`` (handshake, frames,
``connection.blocked`` bookkeeping) with the few blocking calls the raw
scenarios need: publish one message, wait for its confirm, open and close
further channels, receive one whole delivery, delete a queue. Every call
waits at most the client's socket timeout (``SETUP_TIMEOUT_S``).
"""

from __future__ import annotations

from pamqp import commands

from pipeline.amqp import frames
from pipeline.loadgen.client import CHANNEL, AmqpClient

BASIC_DELIVER = (60, 60)


class StressClient(AmqpClient):
    """One AMQP connection with channel 1 open, driven one blocking call at a time."""

    def publish(self, queue: str, body: bytes, channel: int = CHANNEL, persistent: bool = False) -> None:
        """basic.publish to ``queue`` through the default exchange."""
        props = frames.properties_raw(delivery_mode=2 if persistent else 1)
        self.send_all(frames.encode_publish(channel, "", queue, props, body, self.frame_max))

    def wait_confirm(self, upto: int = 1, channel: int = CHANNEL) -> None:
        """Wait until publishes 1 to ``upto`` on ``channel`` are confirmed (an ack with ``multiple`` covers
        all before it). ServerClosed if the broker closes the channel instead; a nack is no answer here,
        so the wait ends with ConnectionLost at the socket timeout."""
        while True:
            ack = self._call(channel, None, "Basic.Ack")
            if ack.delivery_tag >= upto:
                return

    def open_channel(self, channel: int) -> None:
        self._call(channel, commands.Channel.Open(), "Channel.OpenOk")

    def close_channel(self, channel: int) -> None:
        self._call(channel, commands.Channel.Close(reply_code=200, reply_text="Goodbye", class_id=0, method_id=0),
                   "Channel.CloseOk")

    def confirm_select_on(self, channel: int) -> None:
        self._call(channel, commands.Confirm.Select(), "Confirm.SelectOk")

    def queue_delete(self, queue: str) -> int:
        """Delete ``queue``; how many messages it held."""
        return self._call(CHANNEL, commands.Queue.Delete(queue=queue), "Queue.DeleteOk").message_count

    def next_delivery(self) -> bytes:
        """The body of the next basic.deliver, read whole (method, header, body frames)."""
        while True:
            ftype, _, ps, pe = self._read_frame()
            if ftype == frames.FrameType.METHOD and frames.method_id(self.buffer, ps) == BASIC_DELIVER:
                self.discard(pe + 1)
                break
            self.handle_frame(ftype, _, ps, pe)
            self.discard(pe + 1)
        _, _, ps, pe = self._read_frame()
        size, _ = frames.decode_content_header(self.buffer, ps, pe)
        self.discard(pe + 1)
        body = bytearray()
        while len(body) < size:
            _, _, ps, pe = self._read_frame()
            body += self.buffer[ps:pe]
            self.discard(pe + 1)
        return bytes(body)
