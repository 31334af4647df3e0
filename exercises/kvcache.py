"""Exercise `kvcache`: write new K/V rows into a cache at the rows their positions name.

Implement ``write_rows`` below. It replaces kvcache.py:write_rows, through which every
write of a ``StaticCache`` (position p lives in row p) and of a ``SlidingWindowCache``
(position p lives in row p mod its capacity) goes: one call for K and one for V, per
layer, per forward pass.

Run it:  make exercise E=kvcache    (or: .venv/bin/python -m pytest tests --exercise kvcache)

Passing means the kvcache lesson's own tests pass with your function inside the caches:
each row lands where its position says, and the static and ring-buffer caches decode
token for token what the naive decoder (no cache at all) decodes, after a crop and in
forked branches too.
"""

from __future__ import annotations

import torch


def write_rows(store: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """store (B, H, C, r): one layer's K (or V) cache, C rows of r numbers per (batch, head);
    rows (T,) long: the row each new token goes to; new (B, H, T, r): the new tokens' rows.

    Write new[:, :, i] into row rows[i] of store, for every batch entry and head, in place
    (the cache keeps using this very tensor), and return store. Keep rows a tensor: no
    .tolist() and no Python loop over it (a compiled decode step calls this every step and
    must not wait for the host)."""
    raise NotImplementedError(
        """write_rows: picture the loop "for each i, row rows[i] of store (dim 2) becomes
new[:, :, i]". Then say the whole loop at once: a write into dim 2 of store at every index of
rows, taking new's dim 2 in the same order. It must change store itself (the cache keeps that
very tensor), not a copy of it; then return it.""")
