"""Exercise `flash`: one step of online softmax, the heart of flash attention.

Implement ``tile_step`` below. It replaces flash.py:tile_step, which flash.attention calls
for every (query tile, key tile) pair it visits: the running max, the running sum and the
accumulator of each query row go in, updated by one more tile of keys and values. The
lesson's section 1 (``tiled_softmax_dot``) does the same on one query with Python lists:
read it first.

Run it:  make exercise E=flash    (or: .venv/bin/python -m pytest tests --exercise flash)

Passing means the flash lesson's own tests pass with your step inside flash.attention:
tiled attention equals the naive softmax(QKᵀ/√d)V to 1e-5 (fp32) over many lengths,
tile shapes, GQA groups, causal masks, windows and explicit masks, including rows that
see no key at all (out 0, lse -inf), and partial results merge exactly.
"""

from __future__ import annotations


def tile_step(q, k, v, m, s, acc, scale: float, allowed=None):
    """One K/V tile against one Q tile, for every batch entry, KV head and query head of its group.

    q (B, H_kv, G, tq, d): G query heads share each KV head (GQA); k, v (B, H_kv, tk, d);
    m, s (B, H_kv, G, tq, 1) fp32: each query row's largest score so far (-inf before any
    visible key) and its sum of exp(score - m); acc (B, H_kv, G, tq, d) fp32: its
    sum of exp(score - m) · v; scale: the factor on q·k (1/√d).
    allowed: None (every pair visible) or a bool mask that broadcasts to the scores
    (B, H_kv, G, tq, tk): shape (tq, tk), or (B, 1, 1, tq, tk); False = not visible.

    Returns the updated (m, s, acc), fp32 whatever q's dtype: scores q·kᵀ·scale in fp32,
    probabilities cast to v's dtype for the product with v. A row that has seen no visible
    key keeps m = -inf, s = 0, acc = 0 and must never become NaN."""
    raise NotImplementedError(
        """tile_step: score the tile, then bring the running values up to date.
The new max is the larger of the old one and this tile's row max; everything summed so far was
relative to exp(old max), so multiply s and acc by exp(old max - new max) before adding this tile's
exp(score - new max) terms. Watch rows whose new max is still -inf: -inf - -inf is NaN.""")
