"""The supervisor's record of links (pipeline.broker.wiring): rings made, found by their ends, and
ended; a ring handed over as a descriptor outlives its name."""

from __future__ import annotations

import os

import pytest

from ipc import shm
from pipeline.broker import wiring
from ipc.credit import CreditSpec


@pytest.fixture
def links():
    owner = shm.SegmentOwner(shm.new_run_id())
    made = wiring.Links(owner, 4096)
    yield made
    owner.unlink_all()


def test_a_link_is_found_by_its_ends_until_it_is_removed(links):
    rec, fd = links.create("channel-1.1", "queue-q", flow=True)
    os.close(fd)
    back, fd = links.create("queue-q", "channel-1.1", flow=False)
    os.close(fd)
    assert (rec.link_id, back.link_id) == (1, 2) and links.next_id == 3
    assert links.between("channel-1.1", "queue-q") == 1 and links.between("queue-q", "channel-1.1") == 2
    assert links.between("channel-1.1", "queue-other") is None
    assert links.remove(1) == rec and links.remove(1) is None
    assert links.between("channel-1.1", "queue-q") is None and links.between("queue-q", "channel-1.1") == 2
    assert links.owner.names == [back.ring]


def test_two_links_between_the_same_ends_are_found_oldest_first_and_the_other_after(links):
    first, fd1 = links.create("store", "queue-q", flow=False)
    second, fd2 = links.create("store", "queue-q", flow=False)
    os.close(fd1), os.close(fd2)
    assert links.between("store", "queue-q") == first.link_id
    links.remove(first.link_id)
    assert links.between("store", "queue-q") == second.link_id


def test_a_ring_given_as_a_descriptor_is_mapped_after_its_name_is_unlinked(links):
    rec, fd = links.create("channel-1.1", "queue-q", flow=True)
    sender_fd = os.dup(fd)
    segment, ring = shm.attach_ring(rec.ring, sender_fd)
    ring.write_batch([b"published before the queue attached"])
    links.remove(rec.link_id)                  # the channel ended: its name goes
    with pytest.raises(shm.SegmentNotFound):
        shm.attach_ring(rec.ring)
    late, late_ring = shm.attach_ring(rec.ring, fd)
    assert late_ring.read_batch() == [b"published before the queue attached"]
    segment.close(), late.close()


def test_the_attaches_name_each_end_its_peer_and_carry_the_receivers_credit(links):
    rec, fd = links.create("queue-q", "store", flow=True)
    os.close(fd)
    out, inp = wiring.attach_messages(rec, CreditSpec(400, 200), sender_holder=3, receiver_holder=0)
    assert out == {"type": "attach", "link": rec.link_id, "ring": rec.ring, "flow": True, "spec": [400, 200],
                   "role": "out", "peer": "store", "peer_holder": 0}
    assert inp == {**out, "role": "in", "peer": "queue-q", "peer_holder": 3}
    assert wiring.attach_messages(rec, None, 0, 0)[0]["spec"] is None
