"""The links between stage processes: one shared-memory ring each, from a sender to a receiver.

The supervisor alone makes and ends links (it alone creates and unlinks segments, ``ipc.shm``).
Each end hears of a link in an ``attach`` on its control socket that carries a descriptor of the
ring, not only its name: a receiver that attaches after its sender wrote, ended and had the name
unlinked (a channel that published and closed before its queue's host read the attach) still maps
the ring and reads what it holds. A link whose attach could not be sent to both ends is undone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc import shm


@dataclass
class LinkRec:
    link_id: int
    sender: str
    receiver: str
    ring: str          # the segment's name, unlinked when the link ends
    flow: bool


class Links:
    """Every live link by id and by its two ends, and the numbering of new ones."""

    def __init__(self, owner: shm.SegmentOwner, ring_bytes: int):
        self.owner = owner
        self.ring_bytes = ring_bytes
        self.by_id: dict[int, LinkRec] = {}
        self.by_ends: dict[tuple[str, str], int] = {}
        self.next_id = 1

    def between(self, sender: str, receiver: str) -> int | None:
        return self.by_ends.get((sender, receiver))

    def create(self, sender: str, receiver: str, flow: bool) -> tuple[LinkRec, int]:
        """A new link's record and a descriptor of its ring for the attaches (the caller closes it).
        Raises OSError (no memory in /dev/shm, no descriptors) with nothing left behind."""
        link_id = self.next_id
        self.next_id += 1
        seg, _ring = shm.create_ring(self.owner, f"l{link_id}", self.ring_bytes)
        seg.close()        # only its two ends map it; the name is kept, to unlink it
        try:
            fd = shm.descriptor(seg.name)
        except OSError:
            self.owner.unlink(seg.name)
            raise
        rec = LinkRec(link_id, sender, receiver, seg.name, flow)
        self.by_id[link_id] = rec
        self.by_ends.setdefault((sender, receiver), link_id)
        return rec, fd

    def remove(self, link_id: int) -> LinkRec | None:
        """Forget the link and unlink its ring's name (its ends' mappings stay until they close them)."""
        rec = self.by_id.pop(link_id, None)
        if rec is None:
            return None
        ends = (rec.sender, rec.receiver)
        if self.by_ends.get(ends) == link_id:
            del self.by_ends[ends]
            other = next((r.link_id for r in self.by_id.values() if (r.sender, r.receiver) == ends), None)
            if other is not None:
                self.by_ends[ends] = other
        self.owner.unlink(rec.ring)
        return rec


def attach_messages(rec: LinkRec, spec, sender_holder: int, receiver_holder: int) -> tuple[dict, dict]:
    """The sender's and the receiver's ``attach``. The sender's goes with the ring's descriptor, the
    receiver's inbox and doorbell; the receiver's with the ring's descriptor and the sender's inbox.
    ``spec``: the receiver's credit (a CreditSpec) when it is not the default; holders: each stage's
    id in the body arenas."""
    base = {"type": "attach", "link": rec.link_id, "ring": rec.ring, "flow": rec.flow,
            "spec": [spec.initial, spec.more_after] if spec is not None else None}
    return ({**base, "role": "out", "peer": rec.receiver, "peer_holder": receiver_holder},
            {**base, "role": "in", "peer": rec.sender, "peer_holder": sender_holder})
