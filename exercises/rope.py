"""Exercise `rope`: rotary position embeddings, the one place a token's position enters the model.

Implement ``rope_cos_sin`` and ``apply_rope`` below. They replace model.py:rope_cos_sin and
model.py:apply_rope: every forward pass (Llama.step) turns its positions into cosines and sines
once, and every layer's Attention rotates its queries and keys with them before q·k. A rotation
by an angle proportional to the position makes q·k depend on how far apart two tokens are, not
where they sit: that is why a cache may keep a key as it was rotated when it was written.

Run it:  make exercise E=rope    (or: .venv/bin/python -m pytest tests --exercise rope)

Passing means the model lesson's own tests pass with your RoPE: the logits equal transformers'
LlamaForCausalLM within 1e-4 on six checkpoints (multi-head, grouped and multi-query attention,
llama3 and linear frequency scaling), a prompt prefilled in two chunks then decoded one token at
a time gets at every position the logits of one full pass, and the engine's batch of 32
sequences, each at its own positions, decodes the tokens each decodes alone.
"""

from __future__ import annotations

import torch


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype):
    """inv_freq (d/2,): the frequency θ_i of each pair of dimensions (model.rope_frequencies);
    positions: the tokens' positions, long, either (T,) or (B, T) (a batch of sequences, each
    row its own positions). Position p turns pair i by the angle p·θ_i, computed in inv_freq's
    dtype. The pairs are laid out as Hugging Face's checkpoints expect: dimension j and
    dimension j + d/2 form pair j (j < d/2), so both carry pair j's angle.

    Returns (cos, sin) of every dimension's angle, cast to ``dtype``: shape (T, d) for (T,)
    positions, (B, 1, T, d) for (B, T) ones, so that they broadcast against the queries and
    keys (B, heads, T, d)."""
    raise NotImplementedError(
        """rope_cos_sin: every (position, pair) needs position × frequency: one broadcast
product, no loop. Then widen it from d/2 pairs to d dimensions (which two dimensions share
each angle?), and for a batch of sequences leave room for the heads axis.""")


def apply_rope(x, cos, sin):
    """x (..., T, d): queries or keys of one pass, a row per head and position; cos, sin:
    rope_cos_sin's, broadcasting against x. Rotate every pair (x_j, x_{j+d/2}) by its angle:
    in the plane of the pair, the point (a, b) turned by angle t lands on
    (a·cos t − b·sin t, b·cos t + a·sin t). Return a new tensor of x's shape and dtype (x
    itself unchanged)."""
    raise NotImplementedError(
        """apply_rope: write the rotation for dimension j (first half) and for j + d/2 (second
half) side by side: each new value is the old one times cos, plus its partner times sin, with a
sign. Build the tensor of signed partners for all d dimensions at once from x's two halves.""")
