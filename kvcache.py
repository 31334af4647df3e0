"""
The KV cache: remember K and V of past tokens instead of recomputing them.

In a decoder, token t attends to the keys and values of tokens 0..t. Those depend only on earlier
tokens, so once computed they never change. A decoder without a cache re-runs the whole prefix every
step (step t pushes t positions through every layer); with a cache, step t runs one position and
reads t cached rows. Generating N tokens drops from N(N+1)/2 position-forwards to N.

The price is memory. Per token and layer the cache holds one K and one V row per KV head:

    bytes per token per layer = 2 · n_kv_heads · d_head · dtype_size

    model              KV heads  d_head  dtype  per layer  layers  per token   at 32K  at 128K
    Llama-2-7B               32     128  fp16      16 KiB      32    512 KiB   16 GiB   64 GiB
    Llama-3-70B (GQA)         8     128  fp16       4 KiB      80    320 KiB   10 GiB   40 GiB
    the same as MHA          64     128  fp16      32 KiB      80    2.5 MiB   80 GiB  320 GiB
    SmolLM2-135M              3      64  bf16       768 B      30   22.5 KiB  720 MiB  2.8 GiB

GQA's 8 KV heads, shared by 64 query heads, make the cache 64 / 8 = 8 times smaller than MHA's.

MLA (DeepSeek-V2/V3's multi-head latent attention) caches no per-head K or V. Per token and layer it
stores one latent vector c, from which every head's K and V are up-projections (folded into the
query and output matrices at inference, so c is read as it is), plus one RoPE key shared by all
heads (a rotation by position cannot be folded into a fixed matrix, so it is kept apart):

    bytes per token per layer = (d_latent + d_rope) · dtype_size

    DeepSeek-V3, bf16, 61 layers          per layer                         per token
    MLA: latent 512, RoPE key 64          (512 + 64) · 2        = 1,152 B    68.6 KiB
    MHA: 128 heads, K 192 wide, V 128     128 · (192 + 128) · 2 =  80 KiB   4.77 MiB  (71× more)

`python kvcache.py --config llama2-7b --seq 32768` prints these for any config;
`python bench.py kv-plot` draws what each kind of cache below holds against the context, in fp16
and int8 (the end of this file says why they differ).

The code goes from the smallest cache up. ``ListCache`` is the one everybody writes first: per
layer, a list of the K and V tensors each pass produced, joined when attention reads them, so step
t copies all t rows again (N tokens: N(N+1)/2 row copies, the quadratic moved from compute to
memory). ``TensorCache`` fixes that with one tensor per layer, allocated once and written in place:
reading is a view, no copy. The cache kinds below are that tensor plus one idea each:

* ``DynamicCache`` grows as tokens arrive, doubling its capacity (an amortised O(1) copy per token).
* ``StaticCache`` is TensorCache with the full interface: fixed shapes, so ``torch.compile``
  compiles the decode step once, and the memory known up front.
* ``SlidingWindowCache`` (Mistral-style ``sliding_window`` configs) is a ring buffer of the last W
  positions (plus a little slack so speculative decoding can roll back): memory O(W).
* ``OffloadedCache`` keeps the cache in host memory and brings one layer's K/V at a time to the
  device: capacity for the price of moving the whole cache every step.
* ``PagedKVCache`` is one pool of fixed-size blocks that many sequences share, each reading its rows
  through a block table (paged.py keeps the books; engine.py batches sequences on it).

The interface. A cache has ``layers``; per forward pass the model calls ``cache.begin(positions)``
once (host-side bookkeeping: grow, copy-on-write, advance ``length``) which returns the attention
mask over the keys that each layer's ``update(k, v, positions)`` will return. The two smallest
caches stop there; the kinds add ``crop(n)`` (roll back to the first n tokens: a chat turn that
diverges, rejected speculative tokens), ``fork()`` (a branch that shares the prefix until either
side writes) and ``nbytes`` (the memory the cache's tensors take once every row is written: on a
CPU a page of them is only backed by RAM from its first write, ``zeros`` below).

Any of them can store K and V quantized (``codec``, from quantize.py: int8 or fp8 with a scale per
token and head): rows of bytes instead of numbers, about half of bf16's, decoded one layer at a time
when attention reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
from pathlib import Path

import numpy as np
import torch

from model import Llama, attention_mask     # the one mask rule


class ListCache:
    """The first cache: per layer, the K and V tensors of every pass so far, in two lists.
    ``model(tokens, positions, cache)`` calls ``begin`` once, then each layer's ``update``."""
    limit = None        # it grows: only the model's context bounds it

    def __init__(self, n_layers: int, window: int | None = None):
        self.layers = [ListLayer() for _ in range(n_layers)]
        self.window, self.length = window, 0

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        """Once per pass, before any layer: the (T, L) mask of the held keys each new token reads
        (its own position and earlier ones, within the model's window if it has one)."""
        self.length += positions.shape[-1]
        return attention_mask(positions, torch.arange(self.length, device=positions.device),
                              self.window)


class ListLayer:
    def __init__(self):
        self.k: list[torch.Tensor] = []      # one (B, H_kv, T, d) tensor per pass
        self.v: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Keep this pass's k, v (B, H_kv, T, d); return every key and value held (B, H_kv, L, d).
        The join copies all L rows, every pass: this is what TensorCache removes."""
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)


def write_rows(store: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The write of a preallocated cache: store (B, H, C, r), rows (T,) long, new (B, H, T, r); row
    rows[i] of every (batch, head) gets new[:, :, i], in place, and store is returned.
    The rows stay a tensor (index_copy_): no host sync, and the same graph every step, which a
    compiled decode step needs."""
    return store.index_copy_(2, rows, new)


class TensorCache:
    """One K and one V tensor per layer, ``max_len`` rows, allocated once: position p is written in
    place into row p, and attention reads rows 0..length-1 as a view (no copy of the history).
    StaticCache below is this, plus the interface's crop, fork and quantized rows."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype=torch.float32, device="cpu", window: int | None = None):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.layers = [TensorLayer(self, i) for i in range(n_layers)]
        self.window, self.length, self.limit = window, 0, max_len

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        if self.length + positions.shape[-1] > self.limit:
            raise ValueError(f"cache is full: max_len {self.limit}")
        self.length += positions.shape[-1]
        return attention_mask(positions, torch.arange(self.length, device=positions.device),
                              self.window)


class TensorLayer:
    def __init__(self, cache: TensorCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        c, i = self.cache, self.index
        write_rows(c.k[i], positions, k)
        write_rows(c.v[i], positions, v)
        return c.k[i][:, :, :c.length], c.v[i][:, :, :c.length]


# ----------------------------------------------------------------------------
# The cache kinds: TensorCache's per-layer tensors behind one interface.

def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_size: float) -> float:
    return n_layers * 2 * n_kv_heads * head_dim * dtype_size


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share: what a cache of ``a`` can keep for ``b``."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class _Shared:
    """A reference count on storage: forks share it until one of them writes."""
    def __init__(self):
        self.refs = 1


def zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor for a cache, which takes memory as its rows are written. A cache is sized for
    its most tokens and holds far fewer most of the time. On a CPU a fresh private mapping reads
    as zeros by the OS's promise and each page of it is given RAM at its first write, so the
    resident memory follows the tokens written; torch.zeros would write every page up front."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not nbytes or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)


class KVCache:
    """What every contiguous cache has in common: TensorCache's tensors per layer, plus crop, fork,
    move and quantized rows; subclasses say how storage grows and which row a position takes."""
    # whether every call sees the same tensor shapes (a compiled step needs it)
    fixed_shape = False

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, dtype, device, capacity, window=None,
                 codec=None):
        self.spec = (batch, n_kv_heads, head_dim, dtype, torch.device(device))
        self.window = window   # a model with sliding-window attention masks beyond it in any cache
        self.codec = codec     # quantized storage (quantize.py): rows of bytes, decoded when read
        self.k = [self._alloc(capacity) for _ in range(n_layers)]
        self.v = [self._alloc(capacity) for _ in range(n_layers)]
        self.layers = [_Layer(self, i) for i in range(n_layers)]
        self.length = 0
        self._shared = _Shared()

    def _alloc(self, capacity):
        b, h, d, dtype, device = self.spec
        if self.codec is not None:
            return zeros((b, h, capacity, self.codec.row_bytes(d)), torch.uint8, device)
        return zeros((b, h, capacity, d), dtype, device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def limit(self) -> int | None:
        """The most tokens this cache can hold (None: no limit of its own)."""
        return None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def crop(self, n: int):
        self.length = min(self.length, n)

    def move(self, src: list[int], dst: int):
        """Copy the rows src (a list, in order) to rows dst, dst+1, ... in every layer,
        in their stored form (quantized or not): speculative decoding brings the
        accepted guesses of a token tree right behind the last accepted token."""
        idx = torch.tensor(src, device=self.k[0].device)
        for store in (self.k, self.v):
            for t in store:
                t[:, :, dst:dst + len(src)] = t[:, :, idx]

    def fork(self) -> "KVCache":
        """A branch with the same contents. No data is copied now: both point at
        the same storage, and whichever writes first takes a private copy."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.k, twin.v = list(self.k), list(self.v)
        twin.layers = [_Layer(twin, i) for i in range(len(self.layers))]
        self._shared.refs += 1
        return twin

    def _reallocate(self, capacity: int, rows: int):
        """Move to fresh storage of ``capacity`` rows, keeping the first ``rows``."""
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                store[i] = self._alloc(capacity)
                store[i][:, :, :rows] = old[:, :, :rows]

    def _own(self, rows: int):
        """Before writing: if the storage is shared, copy the first ``rows`` rows
        (the part that matters) into storage of our own."""
        if self._shared.refs > 1:
            self._shared.refs -= 1
            self._shared = _Shared()
            self._reallocate(self.capacity, rows)

    def begin(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Called once per forward pass with the new tokens' positions (T,). Returns the (T, L) mask
        for the keys that update() will return, or None when every returned key is visible (one new
        token, no window)."""
        raise NotImplementedError

    def _write(self, layer: int, k, v, positions):
        raise NotImplementedError


class _Layer:
    """One layer's view of its cache: ``update`` stores the new rows and returns all keys/values."""
    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """k, v: (batch, n_kv_heads, T, d_head) -> K, V: (batch, n_kv_heads, L, d_head).
        A quantized cache encodes the new rows and decodes this layer's rows for
        attention: one layer's K and V exist in full precision at a time, briefly."""
        codec = self.cache.codec
        if codec is None:
            return self.cache._write(self.index, k, v, positions)
        K, V = self.cache._write(self.index, codec.encode(k), codec.encode(v), positions)
        return codec.decode(K, k.dtype), codec.decode(V, v.dtype)


class DynamicCache(KVCache):
    """Contiguous, growing: positions 0..length-1 live in rows 0..length-1."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 window=None, chunk=256, codec=None):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, dtype, device, 0, window, codec)
        self.chunk = chunk

    def begin(self, positions):
        t = positions.shape[-1]
        self._own(self.length)
        if self.length + t > self.capacity:
            # Double (at least one chunk): N tokens cost O(N) copying in total, not O(N²).
            self._reallocate(max(self.length + t, 2 * self.capacity, self.chunk), self.length)
        self._start, self.length = self.length, self.length + t
        if t == 1 and self.window is None:
            return None
        return attention_mask(positions, torch.arange(self.length, device=positions.device),
                              self.window)

    def _write(self, layer, k, v, positions):
        end = self._start + k.shape[2]
        self.k[layer][:, :, self._start:end], self.v[layer][:, :, self._start:end] = k, v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class StaticCache(KVCache):
    """TensorCache with the interface: preallocated to ``max_len``, position p in row p, so a crop
    is free (stale rows sit past every future query). On a GPU attention reads all max_len rows:
    the same shapes every step, which a compiled step needs. On a CPU (``live``) it reads only the
    rows written so far: an unwritten row costs the same bandwidth as a written one."""

    fixed_shape = True

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype=torch.float32,
                 device="cpu", window=None, codec=None):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, dtype, device, max_len, window,
                         codec)
        self.slots, self.live = (torch.arange(max_len, device=device),
                                 torch.device(device).type == "cpu")

    @property
    def limit(self) -> int:
        return self.capacity

    def begin(self, positions):
        t = positions.shape[-1]
        if self.length + t > self.capacity:
            raise ValueError(f"static cache is full: {self.length} + {t} tokens "
                             f"> max_len {self.capacity}")
        self._own(self.length)
        self.length += t
        return attention_mask(positions, self.slots[:self.length] if self.live else self.slots,
                              self.window)

    def _write(self, layer, k, v, positions):
        return write_rows(self.k[layer], positions, k), write_rows(self.v[layer], positions, v)


class SlidingWindowCache(KVCache):
    """A ring buffer of ``window + slack`` rows: position p lives in row p mod C.

    A forward pass attends over [ring contents, new tokens] and then writes the
    new tokens into the ring, so a prefill longer than the window still sees
    every key it needs. The slack rows keep positions just outside the window,
    so ``crop`` can roll back up to ``slack`` tokens (speculative decoding)."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, window, dtype=torch.float32,
                 device="cpu", slack=64, codec=None):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, dtype, device, window + slack,
                         window, codec)
        self.slack = slack
        self.slot_pos = torch.full((window + slack,), -1, dtype=torch.long, device=device)

    def crop(self, n: int):
        if n < self.length - self.slack:
            raise ValueError(f"a sliding-window cache can roll back at most {self.slack} tokens "
                             f"(asked {self.length} -> {n})")
        self.slot_pos = self.slot_pos.masked_fill(self.slot_pos >= n, -1)
        super().crop(n)

    def fork(self):
        twin = super().fork()
        twin.slot_pos = self.slot_pos.clone()
        return twin

    def begin(self, positions):
        self._own(self.capacity)
        t = positions.shape[-1]
        mask = attention_mask(positions, torch.cat([self.slot_pos, positions]), self.window)
        # Only the last C new tokens survive in the ring; earlier ones are read this pass only.
        keep = positions[-self.capacity:]
        self._rows = keep % self.capacity
        self.slot_pos = self.slot_pos.index_copy(0, self._rows, keep)
        self.length += t
        return mask

    def _write(self, layer, k, v, positions):
        keys = torch.cat([self.k[layer], k], dim=2)
        values = torch.cat([self.v[layer], v], dim=2)
        n = self._rows.shape[0]
        write_rows(self.k[layer], self._rows, k[:, :, -n:])
        write_rows(self.v[layer], self._rows, v[:, :, -n:])
        return keys, values


# ----------------------------------------------------------------------------
# Offloading: a cache bigger than the device, paid for in transfers.

# PCIe 4.0 x16, host to GPU: the calculator's assumption, a round figure under the spec's 32 GB/s
PCIE_GBPS = 25


class OffloadedCache(DynamicCache):
    """The cache lives in a big, slow memory (the store); each layer's K/V visit the device only
    while it runs.

    On a GPU the store is pinned host memory (the copy engine reads it directly, so copies run on a
    side stream while the GPU computes) and the device holds two layers' K/V: the one computing and
    the next one arriving. Before layer i's attention, layer i+1's stored rows are already being
    copied (prefetch); the rows a pass writes go back to the store. The rest is DynamicCache's:
    rows, growth, crop, fork, move, the mask.

    Cost model. Device memory: 2/n_layers of the cache (SmolLM2's 30 layers: room for 15 times
    the context).
    Transfers: a pass copies every layer's stored rows in and its new rows out, so

        bytes moved per step (``step_moved``) = length after the step · bytes per token
                                                (the formula at the top)

    the whole cache, every step. Llama-3-70B at 32K in fp16 moves 32768 · 320 KiB = 10 GiB a
    step. PCIe 4 x16's spec is 32 GB/s, an H100's HBM's 3.35 TB/s: the copy takes
    3.35 TB/s ÷ 32 GB/s ≈ 100× as long as reading the cache where it lies. It buys capacity and
    costs time, unless compute as long hides the copy (a big batch, a long prefill; never batch-1
    decode). ``python kvcache.py --config llama3-70b`` prints the time.

    On a CPU the store is a plain CPU tensor and the working buffers share its RAM: each copy is a
    memcpy that reads and writes every byte, some GB/s like PCIe, so the slowdown measured
    (`python bench.py offload`) is that of moving the cache once per step, every byte counted (a
    memory-mapped file would only add page faults: the page cache serves it from the same RAM). The
    prefetch is a synchronous copy at the same point in the code: copy and attention share the cores
    and the memory bus, so a thread buys no overlap."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 window=None, chunk=256, codec=None):
        self.compute = device = torch.device(device)
        # the side stream
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        super().__init__(n_layers, batch, n_kv_heads, head_dim, dtype, "cpu", window, chunk, codec)
        # the device's working buffers, and their copies' events
        self.work, self.ready = [], [None, None]

    def _alloc(self, capacity):
        """Rows outermost ((C, B, H, r) seen as (B, H, C, r)): n rows are one block, one DMA copy;
        pinned on a GPU."""
        b, h, d, dtype, _ = self.spec
        r, dtype = (d, dtype) if self.codec is None else (self.codec.row_bytes(d), torch.uint8)
        return torch.zeros(capacity, b, h, r, dtype=dtype,
                           pin_memory=self.stream is not None).permute(1, 2, 0, 3)

    def begin(self, positions):
        mask, self.step_moved = super().begin(positions), 0
        # (K, V) of 2 layers, grown with the store
        if not self.work or self.work[0][0].shape[2] < self.capacity:
            self.work = [[torch.empty_like(self.k[0], device=self.compute) for _ in "kv"]
                         for _ in range(2)]
        # layer 0's, before anything computes
        self._copy(0, slice(0, self._start), to_store=False)
        return mask

    def _copy(self, layer: int, rows: slice, to_store: bool):
        """Stored rows -> the layer's working buffer, or (to_store) the buffer's rows -> the
        store."""
        side, work = self.stream is not None, self.work[layer % 2]
        if side:   # after the main stream's work so far: its last read (or its write) of the buffer
            self.stream.wait_stream(torch.cuda.current_stream(self.compute))
        with torch.cuda.stream(self.stream):     # a no-op for None: the copy runs here and now
            for store, buf in zip((self.k[layer], self.v[layer]), work):
                store, buf = store[:, :, rows], buf[:, :, rows]
                (store if to_store else buf).copy_(buf if to_store else store, non_blocking=side)
                self.step_moved += store.numel() * store.element_size()
            self.ready[layer % 2] = self.stream.record_event() if side else None

    def _write(self, layer, k, v, positions):
        if self.stream is not None:        # this layer's rows have arrived
            torch.cuda.current_stream(self.compute).wait_event(self.ready[layer % 2])
        if layer + 1 < len(self.layers):   # the next layer's travel while this one computes
            self._copy(layer + 1, slice(0, self._start), to_store=False)
        (K, V), end = self.work[layer % 2], self._start + k.shape[2]
        K[:, :, self._start:end], V[:, :, self._start:end] = k, v
        self._copy(layer, slice(self._start, end), to_store=True)
        if self.stream is not None and layer + 1 == len(self.layers):
            # the store is whole before the host reads it (crop, move, growth)
            self.stream.synchronize()
        return K[:, :, :end], V[:, :, :end]


CACHES = ("dynamic", "static", "sliding", "offloaded")   # new_cache's kinds: --cache


def new_cache(model: Llama, kind: str = "dynamic", max_len: int | None = None, batch: int = 1,
              codec=None) -> KVCache:
    """A cache for ``model``: dynamic (grows), static (preallocated to max_len, default the
    model's context), sliding (ring buffer; needs a sliding_window config) or offloaded (in host
    memory, one layer at a time on the device). ``codec``: quantized storage (quantize.kv_codec),
    None for the model's dtype."""
    # the blocks' dtype (an EAGLE head borrows its embedding)
    c, w = model.config, model.norm.weight
    shape = (c.n_layers, batch, c.n_kv_heads, c.head_dim)
    if kind in ("dynamic", "offloaded"):
        grows = DynamicCache if kind == "dynamic" else OffloadedCache
        return grows(*shape, dtype=w.dtype, device=w.device, window=c.sliding_window, codec=codec)
    if kind == "static":
        return StaticCache(*shape, max_len or c.max_seq_len, w.dtype, w.device, c.sliding_window,
                           codec)
    if kind == "sliding":
        if c.sliding_window is None:
            raise ValueError("--cache sliding needs a model whose config.json sets sliding_window")
        return SlidingWindowCache(*shape, c.sliding_window, w.dtype, w.device, codec=codec)
    raise ValueError(f"unknown cache kind '{kind}': use {', '.join(CACHES)}")


# ----------------------------------------------------------------------------
# Paged storage: the tensors behind paged.py's bookkeeping.
#
# One pool per layer for K and one for V, each [num_blocks, block_size, n_kv_heads, d_head],
# allocated once. A forward pass runs a batch of sequences, one per row, each with its own block
# table:
#
#   scatter  the new K/V rows go to their slots, table.slot(p) for each new position p, viewing
#            the pool as [num_blocks * block_size, ...];
#   gather   each row's keys are read through its table, block by block: pool[block_ids] is
#            [n_blocks, block_size, ...] = the sequence's tokens in order; rows are padded to the
#            longest table;
#   mask     key j is visible to a query at position p iff j <= p, so a shorter row's padding
#            (j beyond its length) and the unwritten tail of its last block are hidden; positions
#            say it all.
#
# The model does not change: the cache keeps the interface above (``begin(positions)`` returns the
# mask once per pass, each layer's ``update(k, v, positions)`` returns (B, n_kv, L, d) keys and
# values), and attend() takes a (B, 1, T, L) mask as it takes a (T, L) one.
#
# What the gather costs. It copies every row's K and V once per layer per step:
# B · L · 2 · n_kv · d · dtype bytes, L the longest table in tokens. For SmolLM2 in fp32 that
# is 1.5 KiB per token per layer: a decode step of 16 sequences of ~200 tokens copies
# 16 · 200 · 1.5 KiB ≈ 4.7 MiB per layer, 4.7 MiB · 30 ≈ 141 MiB over the layers, against
# 135M · 4 B ≈ 540 MB of weights the step reads anyway: about a quarter more bytes, a share that
# grows with the batch and the context.
# A decode step reads the blocks in place instead where the device has a reader (kernels.py:
# paged_decode, a Triton kernel that follows the block table per key, on a GPU; kernels.cpp's
# paged_attention on a CPU): the layer's ``attend`` then replaces update + the model's attention.
# Prefill and verification passes (T > 1) and quantized pools (a codec) keep the gather.


class PagedKVCache:
    """The K/V pool of every layer, and the batch of block tables a forward pass reads.

        cache = PagedKVCache(n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype)
        logits = model(tokens, positions, cache.bind(tables))   # tokens, positions (B, T)

    Row b of the batch is ``tables[b]`` (a paged.BlockTable), which already holds the
    row's T new tokens as its last T (``allocate_sequence`` / ``append_slot`` put them there), so
    positions[b] = num_tokens - T ... num_tokens - 1. Sequences are not owned
    here: forks, crops and frees are the allocator's; the pool only holds data.
    ``dtype`` is the storage type; a ``codec`` (quantize.py's int8/fp8 KV rows, each
    with its scale) stores rows of bytes instead, encoded on the way in and decoded
    after the gather, so a block carries its scales wherever it is copied. ``in_place``:
    a function that reads the pool where it lies for a one-token pass (kernels.paged_decode's
    arguments: q, one layer's K and V pools, block tables, positions, window); None: the gather."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype=None, device="cpu", window: int | None = None, codec=None,
                 in_place=None):
        self.block_size, self.window, self.codec = block_size, window, codec
        self.in_place, self.reading_in_place = in_place, False
        if codec is not None:
            dtype, head_dim = torch.uint8, codec.row_bytes(head_dim)
        # Per layer one K and one V tensor [slot, KV head, d_head], slot = block · block_size + its
        # slot in the block: separate tensors, written whole (no view), which a compiled step writes
        # in place (as a static cache's). Zeros, not empty: a masked key still meets a zero
        # probability in probs @ V, and 0 · NaN garbage is NaN.
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.k, self.v = ([zeros(shape, dtype or torch.float32, device) for _ in range(n_layers)]
                          for _ in range(2))
        self.layers = [_PagedLayer(self, i) for i in range(n_layers)]
        self.tables: list = []         # paged.BlockTable, one per batch row
        self.width: int | None = None  # a fixed table width for in-place passes (bind)
        self.fixed_shape = False       # this pass's shapes are a compiled step's (begin)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] // self.block_size

    @property
    def limit(self) -> int:
        """The most tokens one sequence can hold: the whole pool."""
        return self.num_blocks * self.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_block(self, src: int, dst: int):
        """Copy-on-write: block ``src``'s K and V, all layers, into block ``dst``."""
        for t in self.k + self.v:
            t = t.view(self.num_blocks, self.block_size, *t.shape[1:])
            t[dst] = t[src]

    def bind(self, tables: list, width: int | None = None) -> "PagedKVCache":
        """The sequences of the next forward pass, one per batch row. ``width``: a one-token pass
        read in place gives every table this many blocks, whatever the longest holds, so its
        shapes are those of a compiled step's (model.Llama.forward runs that one then)."""
        self.tables, self.width = list(tables), width
        return self

    def begin(self, positions) -> torch.Tensor:
        """positions (B, T), or (T,) for one sequence -> what every layer of the pass reads: the
        mask (B, 1, T, L), L = the longest table's blocks × block_size; for a one-token pass read
        in place, ``rows`` instead (the reader applies the same rule to each row's position).
        Builds the slot and block indices (host-side lists, one small copy to the device)."""
        if positions.dim() == 1:
            positions = positions[None]
        B, T = positions.shape
        if B != len(self.tables):
            raise ValueError(f"{B} batch rows but {len(self.tables)} block tables bound; "
                             f"call bind(tables)")
        dev, n = self.k[0].device, max(len(t.block_ids) for t in self.tables)
        self.reading_in_place = self.in_place is not None and T == 1
        self.fixed_shape = self.reading_in_place and self.width is not None
        if self.reading_in_place:
            return self.rows([t.slot(t.num_tokens - 1) for t in self.tables],
                             [t.num_tokens - 1 for t in self.tables],
                             [t.block_ids for t in self.tables], self.width or n)
        self._write = torch.tensor([t.slot(p) for t in self.tables
                                    for p in range(t.num_tokens - T, t.num_tokens)],
                                   device=dev)
        # Short tables are padded with block 0: its keys sit past the row's last position, so
        # masked.
        self._read = torch.tensor([t.block_ids + [0] * (n - len(t.block_ids)) for t in self.tables],
                                  device=dev)
        # key j of a row is its token at position j: the mask is the plain positional one
        return attention_mask(positions, torch.arange(n * self.block_size, device=dev),
                              self.window)[:, None]

    def rows(self, slots: list[int], positions: list[int], tables: list[list[int]],
             width: int) -> torch.Tensor:
        """A one-token pass read in place, as one tensor (B, 2 + width) int64: row b's new slot, its
        position, then its block table padded with block 0 to ``width`` (read only up to the
        position). One tensor the layers read, so a compiled step takes it as an input. Filled in
        a numpy array: torch.tensor converts a list element by element, and at a fixed width
        every row is hundreds of them, mostly padding (an order of magnitude slower)."""
        rows = np.zeros((len(slots), 2 + width), dtype=np.int64)
        for row, s, p, t in zip(rows, slots, positions, tables):
            row[:2 + len(t)] = (s, p, *t)
        return torch.from_numpy(rows).to(self.k[0].device)

    def blocks(self, pool: torch.Tensor) -> torch.Tensor:
        """A layer's K or V viewed as [block, slot in block, KV head, d_head]."""
        return pool.view(self.num_blocks, self.block_size, *pool.shape[1:])

    def _scatter(self, layer: int, k, v, slots):
        """This pass's new K/V rows into their slots of the layer's pool; returns its (K, V)."""
        B, H, T, d = k.shape
        pools = self.k[layer], self.v[layer]
        for pool, new in zip(pools, (k, v)):
            new = new.transpose(1, 2).reshape(B * T, H, d)
            new = new.to(pool.dtype) if self.codec is None else self.codec.encode(new)
            pool.index_copy_(0, slots, new)
        return pools

    def _update(self, layer: int, k, v):
        B, H = k.shape[:2]
        out = []
        for pool in self._scatter(layer, k, v, self._write):
            # Whole blocks in table order, head-major: contiguous (H, B, L, row), which
            # model.attend reads as is.
            kv = (self.blocks(pool).index_select(0, self._read.flatten())
                  .view(B, -1, H, pool.shape[-1]).permute(2, 0, 1, 3).contiguous())
            kv = kv.to(k.dtype) if self.codec is None else self.codec.decode(kv, k.dtype)
            out.append(kv.transpose(0, 1))                                  # (B, H, L, d) views
        return out


class _PagedLayer:
    def __init__(self, cache: PagedKVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k, v, positions):
        """k, v (B, n_kv, T, d) -> K, V (B, n_kv, L, d) through the bound block tables."""
        return self.cache._update(self.index, k, v)

    @property
    def in_place(self) -> bool:
        """Whether this pass's attention is ``attend`` (in place) rather than update + attention."""
        return self.cache.reading_in_place

    def attend(self, q, k, v, rows):
        """q (B, H, 1, d), this step's k, v (B, n_kv, 1, d), ``rows`` (begin's: each row's slot,
        position and table) -> attention output (B, H, 1, d), K/V read from the pool where they
        lie (the cache's ``in_place`` reader)."""
        c = self.cache
        K, V = c._scatter(self.index, k, v, rows[:, 0])
        return c.in_place(q, c.blocks(K), c.blocks(V), rows[:, 2:], rows[:, 1], c.window)


# ----------------------------------------------------------------------------
# The memory calculator: what a cache costs before you allocate it.

PRESETS = {  # name: (layers, KV heads, d_head)
    "llama2-7b": (32, 32, 128),
    "llama3-70b": (80, 8, 128),
    "llama3-70b-mha": (80, 64, 128),
    "tinyllama": (22, 4, 64),
    "smollm2-135m": (30, 3, 64),
}
# (layers, latent, RoPE key width)
MLA_PRESETS = {"deepseek-v2": (60, 512, 64), "deepseek-v3": (61, 512, 64)}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.2f} {unit}"
        n /= 1024


def shape_of(config: str) -> tuple[int, int, int]:
    if config in PRESETS:
        return PRESETS[config]
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"error: no preset or config.json '{config}'; "
                         f"presets: {', '.join(PRESETS)}")
    c = json.loads(path.read_text())
    heads = c["num_attention_heads"]
    return (c["num_hidden_layers"], c.get("num_key_value_heads") or heads,
            c.get("head_dim") or c["hidden_size"] // heads)


def calculator(config: str, seq: int, batch: int, dtype: str, gpu_gib: float | None) -> str:
    size = DTYPE_BYTES[dtype]
    if config in MLA_PRESETS:
        layers, latent, rope = MLA_PRESETS[config]
        per_layer = (latent + rope) * size      # the docstring's MLA formula
        lines = [f"{config}: {layers} layers, MLA: a {latent}-wide latent "
                 f"+ a {rope}-wide RoPE key, {dtype}",
                 f"  per token per layer: ({latent} + {rope}) · {size} "
                 f"= {per_layer:.0f} B/token/layer"]
    else:
        layers, kv_heads, d_head = shape_of(config)
        per_layer = kv_bytes_per_token(1, kv_heads, d_head, size)
        lines = [f"{config}: {layers} layers, {kv_heads} KV heads, d_head {d_head}, {dtype}",
                 f"  per token per layer: 2 · {kv_heads} · {d_head} · {size} "
                 f"= {per_layer:.0f} B/token/layer"]
    per_token, total = per_layer * layers, per_layer * layers * seq * batch
    lines += [f"  per token:           {human(per_token)}/token",
              f"  per sequence of {seq}: {human(per_token * seq)}",
              f"  batch of {batch}:      {human(total)}",
              f"  offloaded (OffloadedCache): all of it crosses the link every decode step, "
              f"{1e3 * total / (PCIE_GBPS * 1e9):.0f} ms at {PCIE_GBPS} GB/s (PCIe 4 x16)"]
    if gpu_gib:
        room, fits = gpu_gib * 2**30, int(gpu_gib * 2**30 // (per_token * seq))
        lines += [f"  on a {gpu_gib:g} GiB GPU: the cache alone takes {100 * total / room:.0f}% "
                  f"of memory; at most {fits} sequences of {seq} fit (before weights)",
                  f"  longest context there, batch {batch}: "
                  f"{int(room // (per_token * batch))} tokens; offloaded "
                  f"(2 layers on the GPU): {int(room // (2 * per_layer * batch))}"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# What each kind of cache holds as the context grows (`python bench.py kv-plot` draws it).
#
# The formula says what one token costs; what a cache holds also depends on how it allocates. With
# tokens arriving one at a time (a generation):
#   dynamic   one chunk of 256 rows, then doubling: past 256 tokens, up to twice the rows needed
#   static    max_len rows from the start, whatever the context
#   sliding   window + slack rows from the start, never more
#   paged     whole 16-token blocks: at most 15 rows unused per sequence
# An int8 row (quantize.py) is d_head values plus an fp16 scale: 66 B for d_head 64, 52% of fp16's
# 128 B.

KINDS = ("dynamic", "static", "sliding", "paged")


def row_bytes(head_dim: int, dtype: str) -> int:
    """One token's K (or V) for one KV head, as a cache stores it. int8 is quantize.py's KV row:
    d_head int8 values, then the fp16 scale of that token and head (the formula is written out here
    because the caches sit below quantize.py; a test holds the two equal). The calculator above
    counts int8 values only."""
    return head_dim + 2 if dtype == "int8" else head_dim * DTYPE_BYTES[dtype]


def rows_held(kind: str, contexts: list[int], max_len: int, window: int,
              block_size: int = 16) -> list[int]:
    """Rows per layer and KV head that a cache of ``kind`` holds once each of ``contexts`` tokens
    has arrived, one at a time. The contiguous kinds are asked directly: real caches of one layer,
    one head and d_head 1 on the meta device (no memory, no arithmetic), so the curves follow the
    classes' own rules."""
    tiny = dict(dtype=torch.float16, device="meta")
    if kind == "dynamic":
        cache, held = DynamicCache(1, 1, 1, 1, **tiny), {}
        for n in sorted(contexts):
            while cache.length < n:
                cache.begin(torch.tensor([cache.length]))
            held[n] = cache.capacity
        return [held[n] for n in contexts]
    if kind == "static":
        return [StaticCache(1, 1, 1, 1, max_len, **tiny).capacity] * len(contexts)
    if kind == "sliding":
        return [SlidingWindowCache(1, 1, 1, 1, window, **tiny).capacity] * len(contexts)
    if kind == "paged":
        # the blocks one sequence holds; the pool they come from is shared (paged.py)
        return [-(-n // block_size) * block_size for n in contexts]
    raise ValueError(f"unknown cache kind '{kind}': use {', '.join(KINDS)}")


def token_bytes(shape: tuple[int, int, int], dtype: str) -> int:
    """One token's K and V in every layer and KV head: the formula at the top, one row
    of row_bytes per head (for fp16, kv_bytes_per_token(layers, heads, d_head, 2))."""
    layers, kv_heads, d_head = shape
    return int(kv_bytes_per_token(layers, kv_heads, 1, row_bytes(d_head, dtype)))


def held_bytes(kind: str, contexts: list[int], shape: tuple[int, int, int], dtype: str,
               max_len: int, window: int, block_size: int = 16) -> list[int]:
    """The bytes a cache of ``kind`` holds at each context, batch 1: the rows it holds
    × token_bytes. Equals a real cache's ``nbytes`` (a test builds them)."""
    return [rows * token_bytes(shape, dtype)
            for rows in rows_held(kind, contexts, max_len, window, block_size)]


def _main():
    ap = argparse.ArgumentParser(description="KV cache memory calculator: "
                                 "bytes per token, per sequence, per batch")
    ap.add_argument("--config", default="smollm2-135m",
                    help=f"config.json path or preset: {', '.join([*PRESETS, *MLA_PRESETS])}")
    ap.add_argument("--seq", type=int, default=32768, help="tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="fp16", choices=list(DTYPE_BYTES))
    ap.add_argument("--gpu-gib", type=float, default=None)
    args = ap.parse_args()
    for name in ("seq", "batch", "gpu_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    print(calculator(args.config, args.seq, args.batch, args.dtype, args.gpu_gib))


if __name__ == "__main__":
    _main()
