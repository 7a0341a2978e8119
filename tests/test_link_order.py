"""The order in which the supervisor links a channel to a queue.

A queue answers a channel (declare-ok, confirms) on its link back to the
channel and delivers on its link to the channel's reader. Its attaches come on
its control socket, in order, while the channel hears ``queue_linked`` on
another socket: nothing orders the two. So the channel's link *to* the queue
must be made last; a queue that can read what the channel sends then already
has its links back. (Made first, one declare in a few hundred went unanswered
with 1,000 connections open: the queue read the declare before it had the link
to answer on.)
"""

from types import SimpleNamespace

from pipeline.broker.definitions import Definitions
from pipeline.broker.supervisor import Supervisor


class Recorder(SimpleNamespace):
    """Just what ``link_channel_queue`` uses of the supervisor, recording the links it makes."""

    def link_between(self, sender, receiver):
        return self.existing.get((sender, receiver))

    def make_link(self, sender, receiver, flow, spec=None):
        self.made.append((sender, receiver))
        return len(self.made)

    def tell(self, proc, msg, fds=()):
        self.told.append((proc.name, msg["type"]))


def linker(existing=()):
    defs = Definitions()
    defs.declare_queue("q", durable=False, exclusive=False, auto_delete=False, arguments={}, owner="reader-1",
                       passive=False)
    procs = {name: SimpleNamespace(name=name, state="running") for name in ("queue-q", "reader-1")}
    channel = SimpleNamespace(name="channel-1.1", state="running", owner="reader-1")
    rec = Recorder(defs=defs, procs=procs, made=[], told=[], existing=dict(existing),
                   cfg=SimpleNamespace(credit=SimpleNamespace(disabled=False)))
    return rec, channel


def test_the_channels_link_to_the_queue_is_made_after_the_queues_links_back():
    rec, channel = linker()
    Supervisor.link_channel_queue(rec, channel, "q")
    assert rec.made == [("queue-q", "channel-1.1"), ("queue-q", "reader-1"), ("channel-1.1", "queue-q")]
    assert rec.told[-1] == ("channel-1.1", "queue_linked")


def test_links_that_exist_are_not_made_again():
    rec, channel = linker({("queue-q", "reader-1"): 7})
    Supervisor.link_channel_queue(rec, channel, "q")
    assert rec.made == [("queue-q", "channel-1.1"), ("channel-1.1", "queue-q")]
