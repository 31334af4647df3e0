"""Exercise `tp`: which part of every layer a rank keeps in tensor parallelism.

Implement ``plan`` below. It replaces tp.py:plan, the shard rule: the runner and the launcher
ask it what rank ``rank`` of ``world`` holds, and tp.shard then slices each weight by the Part it
returns (query and key/value heads for attention, intermediate units for the MLP). A rank
computes attention only for the heads it holds, so a query head must live on the rank that
holds the key/value head it reads.

Run it:  make exercise E=tp    (or: .venv/bin/python -m pytest tests --exercise tp)

Passing means the tp lesson's own test of the split passes with your rule: a layer of
SmolLM2's shape (9 query heads in 3 GQA groups, 1,536 MLP units) splits over 2 ranks into
exactly the ranges the lesson uses (whole groups, contiguous, the larger share first), and a
world larger than the number of KV heads is refused in one line that says what to do.
(The ranks themselves run in processes of their own, which the swap does not reach: the
launched tests of tp.py check the lesson's plan, not yours.)
"""

from __future__ import annotations

import model
from tp import Part


def plan(cfg: model.LlamaConfig, rank: int, world: int) -> Part:
    """Rank ``rank`` of ``world``'s Part: its KV heads, the query heads that read them, and its
    MLP units, each a ``range``. cfg.n_heads query heads share cfg.n_kv_heads KV heads in
    groups of n_heads // n_kv_heads consecutive query heads (query head h reads KV head
    h // group). The KV heads and the cfg.intermediate_size units are each split in ``world``
    contiguous runs, rank 0 first, as evenly as possible: of n items, every rank gets
    n // world and the first n % world ranks one more (tp.even computes such a share).

    Refuse, with ValueError, a rank outside 0 <= rank < world or world < 1 (message: "rank
    {rank} of {world}: need 0 <= rank < world size"), and more ranks than KV heads (message:
    "{world} ranks but the model has {n_kv_heads} KV heads: each rank needs a whole KV head and
    its query heads; use --tp {n_kv_heads} or fewer")."""
    raise NotImplementedError(
        """plan: split what cannot be cut first. A query head is useless without the KV head its
group reads, so give each rank whole groups: share out the KV heads, then derive its query
heads from them. The MLP's units are independent of each other: share them out the same way.""")
