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
    """Scheduler method: this step's decode batch. Every running sequence that has a token to
    feed gets the KV slot that token's K/V will be written to; the batch is the sequences,
    oldest first, still running at the end. A sequence still prefilling (``seq.prefilling``: its
    prompt comes in chunks) has no token to feed yet and sits this step out.

    What a sequence feeds is its last output token (``seq.output[-1]``). Its slot comes from
    the block allocator ``self.alloc`` (paged.py): ``append_slot(table, token)`` returns
    ``(slot, copy)``, and a copy that is not None is a copy-on-write the storage owes before
    the step writes (``self.copies`` collects them); it raises if the sequence needs a new
    block (``needs_block(table)``) and none is left (``num_free``).

    Running out must not fail the step. Blocks come back, in this order of preference: from
    idle conversations parked between turns (``self.parked``, an OrderedDict session -> block
    table, oldest first; ``self.alloc.free(table)`` returns a table's blocks), the oldest first;
    and only when none is parked, from the newest running sequence, preempted
    (``self.preempt(seq)``: it leaves ``self.running`` and will recompute later), even if it is
    the very sequence that needs the block. Free no more than needed."""
    raise NotImplementedError(
        """schedule_decode: visit the running sequences from the oldest. Before giving one its
slot, ask whether that can fail; if so, make room by the rule of preference, then ask again
about the same sequence (room may still be short, or it may be gone). Preempting changes
the list you are walking: a plain for loop over it would skip or repeat.""")
