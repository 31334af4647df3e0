"""
The KV cache: remember K and V of past tokens instead of recomputing them.

In a decoder, token t attends to the keys and values of tokens 0..t. Those
depend only on earlier tokens, so once computed they never change. A decoder
without a cache re-runs the whole prefix every step (step t costs O(t) token
forwards and O(t²) attention scores); with a cache, step t runs one token and
reads t cached rows: O(t) attention work and one pass over the weights.

The price is memory. Per token and layer the cache holds K and V:

    bytes = 2 · n_kv_heads · d_head · dtype_size
    Llama-2-7B (32 KV heads, d_head 128, fp16): 16 KiB per layer, 512 KiB per token
    SmolLM2-135M (3 KV heads, d_head 64, fp32): 1.5 KiB per layer, 45 KiB per token

Layout: per layer one tensor (batch, n_kv_heads, capacity, d_head) for K and one
for V, so a query head reads its K/V as a contiguous (capacity, d_head) matrix.

Interface (shared by every cache in the project): a cache has ``layers``; each
layer's ``update(k, v, positions)`` stores the new rows and returns views of
all K and V so far; ``length`` counts cached tokens; ``crop(n)`` rolls back to
the first n tokens (a new chat turn that diverges, speculative rollback);
``nbytes`` is what the cache really holds.
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_size: int) -> int:
    return n_layers * 2 * n_kv_heads * head_dim * dtype_size


class DynamicLayer:
    """One layer's K/V, grown in chunks so a step is a copy into spare room, not a
    ``torch.cat`` of the whole history (which would make decoding O(N²) in copies)."""

    def __init__(self, batch, n_kv_heads, head_dim, dtype, device, chunk=256):
        self.shape = (batch, n_kv_heads, 0, head_dim)
        self.dtype, self.device, self.chunk = dtype, device, chunk
        self.k = self.v = None
        self.length = 0

    def _reserve(self, needed: int):
        capacity = 0 if self.k is None else self.k.shape[2]
        if needed <= capacity:
            return
        new_cap = max(needed, 2 * capacity, self.chunk)  # doubling: amortised O(1) copies per token
        b, h, _, d = self.shape
        k = torch.empty(b, h, new_cap, d, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        if self.length:
            k[:, :, :self.length] = self.k[:, :, :self.length]
            v[:, :, :self.length] = self.v[:, :, :self.length]
        self.k, self.v = k, v

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """k, v: (batch, n_kv_heads, T, d_head) for the T new tokens, which sit at
        positions length..length+T-1 (a contiguous cache appends)."""
        t = k.shape[2]
        self._reserve(self.length + t)
        self.k[:, :, self.length:self.length + t] = k
        self.v[:, :, self.length:self.length + t] = v
        self.length += t
        return self.k[:, :, :self.length], self.v[:, :, :self.length]

    def crop(self, n: int):
        self.length = min(self.length, n)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class DynamicCache:
    """A growing contiguous cache for every layer of one model."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        self.layers = [DynamicLayer(batch, n_kv_heads, head_dim, dtype, device) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, n: int):
        for layer in self.layers:
            layer.crop(n)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
