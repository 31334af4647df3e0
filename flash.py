"""
Flash attention: exact softmax attention without the N×N score matrix.

Attention for one query q over N keys is out = Σ_j softmax(s)_j · v_j with
s_j = q·k_j/√d. Written plainly, a sequence of N queries builds the N×N matrix
S = QKᵀ/√d, then P = softmax(S), then PV. Every entry of S is used once and
thrown away, yet it is the biggest object in the computation:

    scores of one head, N = 16384, fp32:   16384² · 4 B              = 1 GiB
    of 8 heads at once:                    8 · 1 GiB                 = 8 GiB
    the inputs Q, K, V (8 heads, d 64):    3 · 16384 · 8 · 64 · 4 B  = 96 MiB

The softmax is the only thing that needs a whole row of S at once (its max and
its sum). Both can be kept as running values: walk over the keys tile by tile,
keep per query row the largest score seen so far m, the sum s of exp(score − m)
and the unnormalised output acc = Σ exp(score − m)·v. When a tile raises the
max from m to m', everything accumulated so far was scaled by exp(−m) and must
now be scaled by exp(−m'): multiply s and acc by exp(m − m'). After the last
tile, out = acc / s, exactly the softmax (no approximation, only rounding).

The cost model:

* FLOPs are unchanged: QKᵀ and PV are still 2·N²·d multiply-adds each (half
  that with a causal mask, when tiles above the diagonal are skipped: the tile
  version skips them outright, a materialised S pays for them and masks).
* Memory: one score tile per step instead of S. With tiles of 256 queries ×
  256 keys, the 8-head working set is 8·256·256·4 B = 2 MiB (scores, then
  probabilities), whatever N is; what grows with N is only the output
  (16384 · 8 · 64 · 4 B = 32 MiB at N = 16384) and one (max, sum) pair per row,
  O(N·d). `python bench.py attention` measures the peak memory of both: the
  tiles' stays near the output's size, the naive version's grows as N² even run
  one head at a time, and its last column is the ratio of the two.
* Bandwidth: S never travels to memory and back. On a GPU that is the whole
  point (HBM is the bottleneck); on a CPU the 2 MiB working set stays in L2/L3.

The same running-(max, sum) algebra gives the other pieces built here:

* ``merge``: two partial attentions over disjoint key sets, each summarised by
  (out, lse) with lse = log Σ exp(score), combine exactly into the attention
  over the union. Flash-decoding and paged attention are built on it.
* ``decode`` (flash-decoding): one new token against a long cache has a single
  query row, so tiling the queries gives no parallelism; split the keys into
  chunks instead, attend to every chunk independently (in parallel), merge.

Compilation (``compiled=True``): the loop over tiles stays in Python and
each tile step (``tile_step``) is compiled once with torch.compile for its
static tile shapes; a ragged last tile is padded to full size and masked, and
every tile is copied contiguous, so any N reuses the same two graphs (with and
without a mask). What inductor fuses, per tile step, on a CPU (one C++ kernel
with vector intrinsics and OpenMP) and on CUDA (Triton): the scaling, the mask,
the row max, the running max, exp, the row sum, the rescaling of the running
sum, the casts; then the rescaling of the accumulator plus P·V in a second
kernel. What it does not fuse: the two matrix products (QKᵀ and PV stay calls
to the BLAS, MKL on a CPU and cuBLAS on CUDA), so each step writes the score
tile and reads it back, writes P and reads it back (from cache, at 2 MiB);
the loop over tiles (a Python call per tile, whose guards and dispatch cost
a small share of a 256×256×8-head tile's work); the tile copies and the final
acc / sum. PyTorch's own CPU kernel behind F.scaled_dot_product_attention
does the same arithmetic inside one parallel loop over (head, query block),
each thread with small buffers in its own cache: no Python per tile, and one
fork/join per call instead of four per tile. That is the gap that remains,
and it widens sharply when other processes share the cores: every fork/join
waits for its slowest thread.

Tile sizes: of the shapes tried (128 to 512 query rows by 256 to 1024 keys,
d 64 and 128, compiled, each timed against SDPA in the same process), 256×256
was the fastest or tied with it. Smaller tiles pay the per-call overhead more
often, larger ones fall out of L2. To try another shape, pass tile_q and
tile_k to `attention` and time it against SDPA as `python flash.py` does. The
decode chunk (256 keys) is the same size.

`python flash.py` shows the idea with numbers; `python bench.py attention`
measures time and peak memory of naive, tiled (eager and compiled) and SDPA
(`--device cuda`: and the same algorithm as a GPU kernel in Triton, kernels.py's
`triton_attention`).
"""

from __future__ import annotations

import argparse
import functools
import math

import torch

import model
from model import attention_mask

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------
# 1. The idea on one query, with Python lists.

def softmax_dot(q: list[float], K: list[list[float]], V: list[list[float]]) -> list[float]:
    """One-shot: every score first, then the softmax over all of them, then Σ p_j·v_j."""
    scale = 1 / math.sqrt(len(q))
    scores = [sum(a * b for a, b in zip(q, k)) * scale for k in K]
    # subtracting the max keeps exp() from overflowing
    m = max(scores)
    w = [math.exp(s - m) for s in scores]
    total = sum(w)
    return [sum(wj * v[i] for wj, v in zip(w, V)) / total for i in range(len(V[0]))]


def tiled_softmax_dot(q: list[float], K: list[list[float]], V: list[list[float]],
                      tile: int) -> list[float]:
    """The same result, looking at ``tile`` keys at a time and keeping only
    three running values: the max m, the sum s of exp(score − m), and
    acc = Σ exp(score − m)·v. Nothing of size len(K) is ever held."""
    scale = 1 / math.sqrt(len(q))
    m, s, acc = NEG_INF, 0.0, [0.0] * len(V[0])
    for start in range(0, len(K), tile):
        scores = [sum(a * b for a, b in zip(q, k)) * scale for k in K[start:start + tile]]
        m_new = max(m, max(scores))
        # s and acc were accumulated relative to exp(m); re-base them on exp(m_new).
        # The first tile has m = -inf: exp(-inf) = 0 and the empty sums stay empty.
        shrink = math.exp(m - m_new)
        w = [math.exp(x - m_new) for x in scores]
        s = s * shrink + sum(w)
        acc = [a * shrink + sum(wj * v[i] for wj, v in zip(w, V[start:start + tile]))
               for i, a in enumerate(acc)]
        m = m_new
    return [a / s for a in acc]


# ----------------------------------------------------------------------------
# 2. Merging partial results. A partial attention over a subset of the keys is
# summarised by its normalised output and lse = log Σ exp(score) over that
# subset (the log of its softmax denominator). The union's denominator is
# exp(lse_a) + exp(lse_b), so each part's output is weighted by its share.

def _safe(lse: torch.Tensor) -> torch.Tensor:
    """-inf (a row that saw no key at all) replaced by 0, so that -inf - -inf never makes NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(out_a, lse_a, out_b, lse_b):
    """(out (..., T, d), lse (..., T)) of two disjoint key sets -> those of their union.
    A part with no visible key (lse = -inf) weighs 0; if both are empty, out = 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - _safe(lse))[..., None]
    wb = torch.exp(lse_b - _safe(lse))[..., None]
    return wa * out_a.float() + wb * out_b.float(), lse


def merge_many(outs, lses, dim: int):
    """The n-way merge: outs (..., n, ..., T, d) and lses (..., n, ..., T) stacked along ``dim``
    (counted from the front) -> (out, lse) with that dimension reduced."""
    lse = torch.logsumexp(lses, dim=dim)
    w = torch.exp(lses - _safe(lse).unsqueeze(dim))
    return (w[..., None] * outs.float()).sum(dim), lse


# ----------------------------------------------------------------------------
# 3. The tensor version for prefill: Q tiles × K/V tiles.
#
# Layout. q is (B, H, T, d); k and v are (B, H_kv, L, d) with H = G·H_kv (GQA:
# G query heads share one K/V head). The G query heads of one KV head are
# stacked as the rows of one matrix, (B, H_kv, G·tq, d), so one matrix product
# against a K tile serves the whole group: no copy of K or V is made for GQA.
#
# Positions. Query row i sits at position q_start + i and key j at k_start + j
# (keys need not start at 0: a block of a paged cache, a chunk of a long
# context). causal: a query sees keys at positions <= its own; window: and only
# the last `window` of them. A tile entirely outside what its queries may see
# is skipped without being read, a tile entirely inside needs no mask, and only
# the tiles crossing the diagonal (or the window's edge) pay for a mask. An
# explicit (T, L) bool mask covers layouts that are not contiguous runs of
# positions (a ring buffer); it is AND-ed with the rest, and its tiles are
# classified (empty / full / mixed) the same way.

TILE_Q = 256     # query rows per tile (per head)
TILE_K = 256     # keys per tile


def tile_step(q, k, v, m, s, acc, scale: float, allowed=None):
    """One K/V tile against one Q tile, updating each row's running max m,
    sum s and accumulator acc (all fp32, whatever q's dtype).
    q (B, H_kv, G, tq, d); k, v (B, H_kv, tk, d); m, s (B, H_kv, G, tq, 1);
    acc (B, H_kv, G, tq, d); allowed: bool, (tq, tk) or (B, 1, 1, tq, tk) (a mask per
    sequence), or None when every pair is visible."""
    B, Hkv, G, tq, d = q.shape
    scores = ((q.reshape(B, Hkv, G * tq, d) @ k.transpose(-1, -2)).view(B, Hkv, G, tq, -1).float()
              * scale)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    # a row with nothing visible yet keeps m = -inf and adds zeros
    base = _safe(m_new)
    p = torch.exp(scores - base)
    shrink = torch.exp(m - base)        # re-base what was accumulated relative to the old max
    s = s * shrink + p.sum(-1, keepdim=True)
    pv = (p.to(v.dtype).view(B, Hkv, G * tq, -1) @ v).view(B, Hkv, G, tq, -1)
    return m_new, s, acc * shrink + pv.float()


@functools.cache
def _compiled_step():
    # Built on first use, so that importing this module (model.py does) never starts the compiler.
    # dynamic=False: tile shapes are fixed, so each (dtype, heads, group, d, tile) compiles once;
    # past dynamo's recompile limit (8 per function) further shapes fall back to eager.
    return torch.compile(tile_step, dynamic=False)


def _rows(x, start: int, size: int):
    """x[..., start:start+size, :] along dim -2 as a contiguous tile, zero-padded to exactly
    ``size`` rows. The copy is what a GPU kernel does when it loads a tile into shared memory;
    here it also gives every tile the same strides, which the compiled step is specialised on."""
    part = x[..., start:start + size, :]
    short = size - part.shape[-2]
    return torch.nn.functional.pad(part, (0, 0, 0, short)) if short else part.contiguous()


def as_4d(mask):
    """A (T, L) mask, or a per-sequence (B, 1, T, L) one (a paged cache's), as (B or 1, 1, T, L)."""
    return mask if mask.dim() == 4 else mask[None, None]


def _tile_plan(T, L, tq, tk, causal, q_start, k_start, window, mask):
    """For every Q tile, the K tiles to visit and whether each needs a mask:
    [(qa, [(ka, needs_mask), ...]), ...]. Pure host arithmetic, except for an
    explicit mask (already padded to whole tiles), whose tiles are reduced once
    (one host sync per call); a tile counts as empty or full only if it is so
    for every sequence of the batch."""
    n_q, n_k = -(-T // tq), -(-L // tk)
    if mask is not None:
        tiles = mask.view(-1, n_q, tq, n_k, tk)
        any_, all_ = tiles.any(4).any(2).any(0).tolist(), tiles.all(4).all(2).all(0).tolist()
    plan = []
    for i in range(n_q):
        qa = i * tq
        # positions of the tile's real rows
        q_lo, q_hi = q_start + qa, q_start + min(qa + tq, T) - 1
        visits = []
        for j in range(n_k):
            ka = j * tk
            k_lo, k_hi = k_start + ka, k_start + min(ka + tk, L) - 1
            if causal and k_lo > q_hi or window is not None and k_hi <= q_lo - window:
                # above the diagonal / older than the window
                continue
            if mask is not None and not any_[i][j]:
                continue
            full = (ka + tk <= L and (not causal or k_hi <= q_lo)
                    and (window is None or k_lo > q_hi - window) and (mask is None or all_[i][j]))
            visits.append((ka, not full))
        plan.append((qa, visits))
    return plan


def attention(q, k, v, causal: bool = True, q_start: int | None = None, k_start: int = 0,
              window: int | None = None, mask: torch.Tensor | None = None,
              scale: float | None = None, tile_q: int = TILE_Q, tile_k: int = TILE_K,
              compiled: bool = False):
    """Exact softmax(q·kᵀ·scale)·v, tile by tile. q (B, H, T, d); k, v (B, H_kv, L, d).

    Query i is at position q_start + i, key j at k_start + j. q_start defaults
    to k_start + L − T: the queries are the last T positions (a whole-sequence
    prefill has q_start = k_start). ``window``: only keys within the last
    ``window`` positions. ``mask``: an extra bool mask, True = visible, (T, L)
    or (B, 1, T, L) (one per sequence, as a paged cache gives).
    Returns out (B, H, T, d) in q's dtype and lse (B, H, T) fp32; a row that
    sees no key gets out = 0, lse = -inf.

    ``compiled``: run the tile steps compiled (static tile shapes; a problem
    smaller than one tile in either direction runs eagerly with the tile
    shrunk to fit, so short prompts never trigger a compile)."""
    B, H, T, d = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = d ** -0.5 if scale is None else scale
    q_start = k_start + L - T if q_start is None else q_start
    tq, tk = min(tile_q, T), min(tile_k, max(L, 1))
    step = _compiled_step() if compiled and (tq, tk) == (tile_q, tile_k) else tile_step
    q5 = q.view(B, Hkv, G, T, d) if q.is_contiguous() else q.reshape(B, Hkv, G, T, d)
    out = torch.empty(B, Hkv, G, T, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hkv, G, T, dtype=torch.float32, device=q.device)
    rows = torch.arange(tq, device=q.device)
    cols = torch.arange(tk, device=q.device)
    if mask is not None:   # padded with False to whole tiles: (B or 1, 1, T', L')
        mask4, n_q, n_k = as_4d(mask), -(-T // tq), -(-L // tk)
        mask = torch.zeros(mask4.shape[0], 1, n_q * tq, n_k * tk, dtype=torch.bool, device=q.device)
        mask[..., :T, :L] = mask4
    for qa, visits in _tile_plan(T, L, tq, tk, causal, q_start, k_start, window, mask):
        qt = _rows(q5, qa, tq)
        m = torch.full((B, Hkv, G, tq, 1), NEG_INF, device=q.device)
        s = torch.zeros(B, Hkv, G, tq, 1, device=q.device)
        acc = torch.zeros(B, Hkv, G, tq, d, device=q.device)
        for ka, needs_mask in visits:
            allowed = None
            if needs_mask:
                allowed = attention_mask(q_start + qa + rows, k_start + ka + cols, window, causal)
                # padding keys are never visible
                allowed = allowed & (ka + cols < L)
                if mask is not None:   # (B or 1, 1, 1, tq, tk): broadcast over heads and the group
                    allowed = allowed & mask[:, :, None, qa:qa + tq, ka:ka + tk].contiguous()
            m, s, acc = step(qt, _rows(k, ka, tk), _rows(v, ka, tk), m, s, acc, scale, allowed)
        n = min(tq, T - qa)
        out[..., qa:qa + n, :] = (acc / torch.where(s > 0, s, 1.0))[..., :n, :].to(q.dtype)
        lse[..., qa:qa + n] = (m + torch.log(s)).squeeze(-1)[..., :n]     # s = 0 gives -inf
    return out.view(B, H, T, d), lse.view(B, H, T)


def naive(q, k, v, causal: bool = True, q_start: int | None = None, k_start: int = 0,
          window: int | None = None, mask: torch.Tensor | None = None,
          scale: float | None = None):
    """The reference: the full (T, L) score matrix per head, same arguments and
    results as ``attention``. K and V are repeated per query head for GQA."""
    B, H, T, d = q.shape
    L = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    q_start = k_start + L - T if q_start is None else q_start
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    allowed = visible(torch.arange(T, device=q.device) + q_start,
                      torch.arange(L, device=q.device) + k_start, causal, window)
    if mask is not None:
        allowed = as_4d(mask) if allowed is None else allowed & as_4d(mask)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _safe(lse)[..., None])      # a row with no visible key: all zeros
    return (probs.to(v.dtype) @ v).to(q.dtype), lse


def visible(q_pos, k_pos, causal: bool, window: int | None):
    """(T, L) bool from positions (model.attention_mask), or None when everything is visible."""
    return attention_mask(q_pos, k_pos, window, causal) if causal or window is not None else None


# ----------------------------------------------------------------------------
# 4. Flash-decoding: a few query rows against a long cache. The keys are cut
# into chunks; each chunk yields a partial (out, lse), and merge_many combines
# them. All chunks are computed by one batched product here (on a GPU each
# chunk goes to its own thread block: that is where the parallelism comes
# from when there is a single query row). Plain tensor code, no host sync and
# no data-dependent branch, so it traces into a compiled decode step.

CHUNK = 256


def decode(q, k, v, mask: torch.Tensor | None = None, causal: bool = True,
           q_start: int | None = None, k_start: int = 0, window: int | None = None,
           scale: float | None = None, chunk: int = CHUNK):
    """Same arguments and results as ``attention``, for small T (one new token, a few draft
    tokens)."""
    B, H, T, d = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = d ** -0.5 if scale is None else scale
    q_start = k_start + L - T if q_start is None else q_start
    allowed = None
    if causal and T > 1 or window is not None:   # causal with one query at the end sees every key
        allowed = visible(torch.arange(T, device=q.device) + q_start,
                          torch.arange(L, device=q.device) + k_start, causal, window)
    if mask is not None:
        allowed = as_4d(mask) if allowed is None else allowed & as_4d(mask)
    if allowed is not None:
        allowed = as_4d(allowed)                    # (B or 1, 1, T, L)
    # the group's query rows stacked, as in the prefill
    qg = q.reshape(B, Hkv, 1, G * T, d)
    n = L // chunk
    outs, lses = [], []
    # Whole chunks as a view of the cache (no copy), then the ragged rest as one more chunk.
    for a, size, count in ((0, chunk, n), (n * chunk, L - n * chunk, 1)):
        if count == 0 or size == 0:
            continue
        # (B, Hkv, count, size, d)
        ks = k[:, :, a:a + size * count].unflatten(2, (count, size))
        vs = v[:, :, a:a + size * count].unflatten(2, (count, size))
        # (B, Hkv, count, G·T, size)
        scores = (qg @ ks.transpose(-1, -2)).float() * scale
        if allowed is not None:
            ok = allowed[..., a:a + size * count].unflatten(-1, (count, size)).transpose(-3, -2)
            scores = scores.view(B, Hkv, count, G, T, size).masked_fill(~ok[:, :, :, None], NEG_INF)
            scores = scores.view(B, Hkv, count, G * T, size)
        m = _safe(scores.amax(-1, keepdim=True))
        p = torch.exp(scores - m)
        s = p.sum(-1, keepdim=True)
        outs.append((p.to(v.dtype) @ vs).float() / torch.where(s > 0, s, 1.0))
        lses.append((m + torch.log(s)).squeeze(-1))
    out, lse = merge_many(torch.cat(outs, 2), torch.cat(lses, 2), dim=2)     # (B, Hkv, G·T, d)
    return out.view(B, H, T, d).to(q.dtype), lse.view(B, H, T)


# ----------------------------------------------------------------------------
# The model's attention, four ways. Each takes model.attend's arguments (q, k, v, mask,
# window: mask None = causal, the queries the last T positions) and is handed to a Llama as
# its ``attend``.

def attend_sdpa(q, k, v, mask, window=None):
    """model.attend (PyTorch's fused SDPA), but a sliding window's prefill in tiles: no T×L mask."""
    if window and q.shape[2] > 1:
        return attention(q, k, v, causal=mask is None, mask=mask, window=window, compiled=False)[0]
    return model.attend(q, k, v, mask, window)


def attend_flash(q, k, v, mask, window=None):
    """Q×K/V tiles with causal tile skipping for prefill (compiled once a prompt fills a 256×256
    tile: the first such prompt waits for the compile); flash-decoding for one token. A cache's
    mask is taken as it is, and its empty tiles are skipped too."""
    if q.shape[2] == 1:
        return decode(q, k, v, mask, causal=mask is None)[0]
    return attention(q, k, v, causal=mask is None, mask=mask, window=window, compiled=True)[0]


def attend_naive(q, k, v, mask, window=None):
    """The whole T×L score matrix: the reference the others must match."""
    return naive(q, k, v, causal=mask is None, mask=mask, window=window)[0]


ATTENTION = {"sdpa": attend_sdpa, "flash": attend_flash, "naive": attend_naive}


# ----------------------------------------------------------------------------
# The demo: what the idea buys, with numbers.

HEADS = 8


def demo(rounds: int = 5):
    import random
    import torch.nn.functional as F
    import results
    rnd = random.Random(0)
    q = [rnd.gauss(0, 1) for _ in range(16)]
    K = [[rnd.gauss(0, 1) for _ in range(16)] for _ in range(1000)]
    V = [[rnd.gauss(0, 1) for _ in range(16)] for _ in range(1000)]
    err = max(abs(a - b) for a, b in zip(tiled_softmax_dot(q, K, V, 64), softmax_dot(q, K, V)))
    print(f"one query, 1000 keys, tiles of 64, Python floats: tiled - one-shot = {err:.1e}")

    n, d = 4096, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, d, generator=g) for _ in range(3))
    with torch.inference_mode():
        # the first call of each is the warm-up (thread pools, allocation), then rounds in turns
        out, lse = attention(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seconds = results.alternate(
            {"tiled": lambda: attention(q, k, v),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)},
            rounds, warmup=0)
    ratios = [a / b for a, b in zip(seconds["tiled"], seconds["sdpa"])]
    steps = sum(len(visits)
                for _, visits in _tile_plan(n, n, TILE_Q, TILE_K, True, 0, 0, None, None))
    full = (n // TILE_Q) * (n // TILE_K)
    print(f"N = {n}, {HEADS} heads, d {d}, causal, fp32:")
    print(f"  naive score matrices: {HEADS} · {n}² · 4 B = {HEADS * n * n * 4 / 2**20:.0f} MiB")
    print(f"  tiled: one {TILE_Q}×{TILE_K} score tile per head at a time: "
          f"{HEADS} · {TILE_Q} · {TILE_K} · 4 B = "
          f"{HEADS * TILE_Q * TILE_K * 4 / 2**20:.0f} MiB; "
          f"{steps} of {full} tiles visited (the rest lie above the diagonal)")
    print(f"  max |tiled - SDPA| = {(out - ref).abs().max():.1e}")
    print(f"  time, median (min–max) of {rounds} rounds taken in turns after a warm-up: "
          f"eager tiled {results.spread(seconds['tiled'], 1e3, 0)} ms,\n"
          f"    SDPA {results.spread(seconds['sdpa'], 1e3, 0)} ms, "
          f"tiled ÷ SDPA {results.spread(ratios, digits=2)} "
          f"(python bench.py attention: compiled too, and memory)")
    with torch.inference_mode():
        one = q[:, :, -1:]
        split, _ = decode(one, k, v, chunk=CHUNK)
        whole, _ = naive(one, k, v)
    print(f"flash-decoding: 1 query over {n} cached keys in {n // CHUNK} chunks of {CHUNK}, "
          f"merged: max |split - whole| = {(split - whole).abs().max():.1e}")


def main():
    argparse.ArgumentParser(description="flash attention: the demo "
                            "(its benchmark: python bench.py attention)").parse_args()
    demo()


if __name__ == "__main__":
    main()
