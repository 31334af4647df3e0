"""Exercise `paged`: where a token's K/V lives, and giving a block back when nobody holds it.

Implement ``slot`` and ``release`` below. They replace paged.py:BlockTable.slot (the
address of token position p in the block pool; kvcache.PagedKVCache scatters and the
tests read through it) and paged.py:BlockAllocator.release (dropping one reference to a
block: ``free`` releases every block of a table, copy-on-write releases the shared block
it stops using).

Run it:  make exercise E=paged    (or: .venv/bin/python -m pytest tests --exercise paged)

Passing means the paged lesson's own tests pass with your two methods in the allocator:
every sequence reads back exactly its own tokens through its table, forks share and copy
on write correctly, the LRU of cached blocks evicts the least recently freed first, and a
randomized run of 1,000 requests plus a property-based search find every reference count,
free list and cache state consistent, with no block leaked.
"""

from __future__ import annotations


def slot(self, pos: int) -> int:
    """BlockTable method. self.block_ids[i] is the physical block holding the sequence's
    logical block i (tokens i·block_size .. (i+1)·block_size - 1); self.block_size tokens
    per block. Return the physical slot of token position ``pos``: the pool is read as one
    array of num_blocks · block_size slots, block b's slots being b·block_size onwards."""
    raise NotImplementedError(
        """slot: two questions. Which logical block holds position pos, and where inside it?
(integer division and remainder by self.block_size). Then: which physical block is that
logical block (the table says), and where do that block's slots start in the flat pool?""")


def release(self, block_id: int) -> None:
    """BlockAllocator method: drop one reference to block ``block_id`` (self.blocks[block_id],
    a paged.Block with a ref_count). While other tables still hold it, nothing else changes.
    When the count reaches 0, the block goes back: if the prefix cache can still find it
    (self.is_cached(block)), to the newest end of the LRU ``self.evictable`` (an
    OrderedDict used as an ordered set: key block_id, value None), where it stays reusable
    until evicted; otherwise it is wiped (block.forget()) and appended to ``self.free_ids``."""
    raise NotImplementedError(
        """release: a reference count says how many tables point at the block; this drops one.
Only the last reference out changes where the block lives: then decide between the two
places a block nobody holds can be (the LRU of cached blocks, or the free list), as the
docstring says. Every block must end up in exactly one state: owned, free or evictable.""")
