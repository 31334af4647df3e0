"""Exercise `prefix`: the chain of block hashes that names a prefix in the prefix cache.

Implement ``block_hashes`` below. It replaces paged.py:block_hashes, which the allocator
calls to look up a new request's leading full blocks in the prefix cache (the blocks it
registers as they fill up are named with the same chain, one link at a time).

Run it:  make exercise E=prefix    (or: .venv/bin/python -m pytest tests --exercise prefix)

Passing means the paged lesson's prefix-cache tests pass with your chain: a shared system
prompt is found block for block, a prompt that differs early shares nothing, a prompt that
ends on a block border still computes its last block, decoded blocks become findable, and
with every hash forced to collide (the test replaces paged.block_hash) no request ever
receives another prefix's blocks.
"""

from __future__ import annotations


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chain hash of every full block of ``token_ids``, in order. Block i is
    token_ids[i·block_size : (i+1)·block_size], as a tuple; its hash is
    paged.block_hash(hash of block i-1, that tuple), with 0 in place of the hash before
    block 0. A partial last block gets no hash, so the list has len(token_ids) // block_size
    entries. ``import paged`` and call paged.block_hash: a test replaces it there, which a
    function bound by ``from paged import block_hash`` would never see."""
    raise NotImplementedError(
        """block_hashes: one hash per full block, each built from the one before it.
Walk the full blocks in order, carrying the previous hash (0 at the start): hash it together
with this block's tokens (as a tuple), keep the result, and make it the one to carry on.
Why chain at all? Two equal blocks after different prefixes must get different names.""")
