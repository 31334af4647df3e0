"""Exercise `engine`: one step of continuous batching's scheduler.

Implement ``schedule_decode`` below. It replaces engine.py:Scheduler.schedule_decode,
which Engine.step calls after admitting new requests: it decides which running sequences
decode in this step's batched forward pass and gives each the KV slot for the token it
feeds, preempting when the pool runs out of blocks.

Run it:  make exercise E=engine    (or: .venv/bin/python -m pytest tests --exercise engine)

Passing means the engine lesson's own tests pass with your scheduler step: when blocks
run out, an idle parked conversation gives its blocks back first, else the newest
sequence (and only it) is preempted; preempted requests still produce exactly the tokens
they produce alone; and a scheduler driven without a model (a fake KV storage) hands
every sequence exactly its own tokens.
"""

from __future__ import annotations

from engine import Sequence


def schedule_decode(self) -> list[Sequence]:
    """Scheduler method. Give every running sequence (``self.running``, oldest first) the
    slot for the token it feeds next, its last output token ``seq.output[-1]``, with
    ``self.alloc.append_slot(seq.table, token)``, which returns (slot, copy); a copy that
    is not None is a copy-on-write the storage owes: append it to ``self.copies``.

    A sequence still prefilling (``seq.prefilling``: its prompt comes in chunks) has no
    token to feed yet: skip it, and leave it out of the batch.

    Before a sequence's append, if it needs a new block (``self.alloc.needs_block(table)``)
    and none is free (``self.alloc.num_free == 0``), make room, then look at the same
    sequence again: free the oldest parked conversation first
    (``self.alloc.free(self.parked.popitem(last=False)[1])``), and only if none is parked,
    preempt the newest running sequence (``self.preempt(self.running[-1])``; it may be this
    very one). Return the batch: a new list of the sequences still running."""
    raise NotImplementedError(
        """schedule_decode: walk self.running from the oldest with an index, not a for loop:
preempting removes the newest from the list while you walk it. At each sequence, first
ask whether its append could fail (needs a block, none free); if so make room and look at
the same index again, else append its slot, keep any copy, and move on.""")
