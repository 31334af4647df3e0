"""Exercise `evict` (extend): a prefix-cache eviction policy that keeps the prefixes many
requests share.

The paged lesson keeps freed full blocks in its prefix cache until the pool runs dry, then
evicts the least recently freed one (paged.py:BlockAllocator.victim, the policy's one line).
LRU knows nothing about what a block is worth. A block near the start of a prompt (a system
prompt, the first turns of a chat) is reused by every request that begins the same way; a block
deep in one conversation is reused only if that very conversation goes on. So under a flood of
one-off requests, LRU throws away the shared system prompt as readily as anything else.

Add the policy the lesson lacks: implement ``victim`` below, which goes in at
paged.py:BlockAllocator.victim: evict the deepest block first.

Run it:  make exercise E=evict    (or: .venv/bin/python -m pytest tests --exercise evict)

Passing means the paged lesson's own tests still pass with your policy (prefix hits, hash
collisions, out-of-blocks, a randomized run of 1,000 requests and a property-based search keep
every invariant), and tests/lessons/test_extend.py's judge it: blocks go deepest first, the
least recently freed first among equals; a block no lookup can reach any more goes before all
others; and a system prompt survives a flood of longer requests that evicts LRU's copy of it.
(The solution: exercises/solutions/evict.py; read it after.)
"""

from __future__ import annotations


def victim(self) -> int:
    """BlockAllocator method, called when a block is needed, the free list is empty and
    ``self.evictable`` (an OrderedDict of block ids, least recently freed first) is not: the id
    of the evictable block to evict. Do not change anything: the allocator takes it.

    The policy. A full block's depth is how many blocks its prefix spans: 1 for a sequence's
    first block, its parent's depth + 1 otherwise. Its parent is the block before it in the
    sequence: block.parent holds that block's prefix id (0: none), and ``self.cached`` (hash ->
    list of blocks; owned ones included) holds every block a lookup can find, each with its own
    ``prefix_id``. Evict the deepest evictable block; among equally deep ones, the least
    recently freed. A block whose chain of parents breaks (a parent no longer cached) can never
    be found again, since a lookup walks a prompt from its first block: evict it before any
    other (the least recently freed of such first). Speed is no concern: the pool is small."""
    raise NotImplementedError(
        """victim: give every evictable block a depth by walking its parents back to a first
block, and keep the best candidate: deepest wins, and walking the LRU from its oldest end lets
the first of equals stay. Walking needs a way from a prefix id to its cached block: build it
once per call. A walk that cannot find a parent has found a block nobody can reach.""")
