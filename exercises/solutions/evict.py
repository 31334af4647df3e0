"""Solution of exercise `evict`: deepest block first, unreachable blocks before all (read
exercises/evict.py for the contract)."""

from __future__ import annotations

import math


def victim(self) -> int:
    """BlockAllocator method: the evictable block to evict. Unreachable blocks first (a parent
    no longer cached), then the deepest, the least recently freed among equals."""
    by_prefix = {b.prefix_id: b for bucket in self.cached.values() for b in bucket}

    def depth(block) -> float:
        d = 1
        while block.parent:
            block = by_prefix.get(block.parent)
            if block is None:       # its prefix was evicted: no lookup reaches it again
                return math.inf
            d += 1
        return d

    # max keeps the first of equals, and evictable runs from the least recently freed
    return max(self.evictable, key=lambda bid: depth(self.blocks[bid]))
