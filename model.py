"""
The Llama decoder, and the two ways to generate text with it.

A Llama is a stack of identical blocks over token embeddings:

    x = embed(tokens)
    for each block:  x = x + Attention(RMSNorm(x));  x = x + MLP(RMSNorm(x))
    logits = lm_head(RMSNorm(x))

* RMSNorm scales each vector to unit root-mean-square, then by a learned gain.
* Attention uses RoPE: q and k are rotated by an angle proportional to their
  position, so q·k depends only on the distance between tokens. With grouped-
  query attention (GQA) several query heads share one K/V head: SmolLM2-135M has
  9 query heads and 3 KV heads, TinyLlama 32 and 4, so the KV cache is 3-8×
  smaller than with one K/V per query head (MHA).
* The MLP is SwiGLU: down(silu(gate(x)) * up(x)).

Generating is a loop: run the model, pick the next token from the last
position's logits, append it, repeat. The naive loop re-runs the whole prefix
every step: the step that produces token t pushes t positions through every
layer, so N tokens cost 1 + 2 + ... + N = N(N+1)/2 position-forwards (5050 for
100 tokens). The cached loop keeps each layer's K and V (kvcache.py), runs the
prompt once (prefill) and then one new position per step (decode): N forwards
(100 for 100 tokens). Both produce the same tokens; `python model.py` shows it.

What the cache does not remove is attention over the context. A pass over L
positions computes L(L+1)/2 query·key scores per head and layer (causal): the
naive loop computes Σ t(t+1)/2 = N(N+1)(N+2)/6 ≈ N³/6 of them (171,700 for 100
tokens), the cached one still N(N+1)/2 (5,050), as each new token reads every
earlier key: its attention grows with the context.

Decoding one token reads every weight once (a memory-bound matrix-vector
product: 540 MB for 135M parameters in fp32, so tokens/s ≤ bandwidth ÷ 540 MB;
bf16 or int8 weights raise that cap) plus the cache so far. A prefill reads them
once for all its positions, so it runs many more tokens per second. `python
bench.py naive-vs-cached` and `python bench.py context` measure all this.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import flash
import kernels
import quantize
from kvcache import DynamicCache, KVCache, OffloadedCache, SlidingWindowCache, StaticCache, causal_scores
from sampling import SamplingParams, finish_reason, sample, seeded_generator
from tokenizer import Tokenizer


# ----------------------------------------------------------------------------
# Configuration: the numbers in a Hugging Face config.json that shape a Llama.

@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None    # {"rope_type": "linear"|"llama3", ...} or None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    sliding_window: int | None = None   # Mistral-style: attend to the last W positions only
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    quantization: dict | None = None    # a checkpoint written by quantize.py: {"weights": "int8"}, ...
    head_vocab: int | None = None       # an LM head over only this many tokens (a draft's, train.py)
    eagle: bool = False                 # an EAGLE draft head: reads the target's features too (below)

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaConfig":
        theta, rope, kind = checkpoint.check_llama_config(c)
        eos = c.get("eos_token_id")
        n_heads = c["num_attention_heads"]
        try:
            return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                intermediate_size=c["intermediate_size"], n_layers=c["num_hidden_layers"],
                n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
                rms_eps=c.get("rms_norm_eps", 1e-5), rope_theta=float(theta),
                rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
                max_seq_len=c.get("max_position_embeddings", 2048),
                tie_embeddings=c.get("tie_word_embeddings", False), bos_id=c.get("bos_token_id"),
                sliding_window=c.get("sliding_window") if c.get("use_sliding_window", True) else None,
                eos_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
                quantization=c.get(quantize.CONFIG_KEY), head_vocab=c.get("draft_vocab_size"),
                eagle=bool(c.get("eagle", False)))
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]}") from None


# ----------------------------------------------------------------------------
# RoPE. Frequencies θ_i = theta^(-2i/d); position p rotates pair i by p·θ_i.
# HF layout pairs dimension i with i + d/2 ("rotate half").

def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    d = cfg.head_dim
    # d/2 numbers, on the CPU even while Llama.__init__ builds on the meta device (whose arange imports torch._dynamo)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    if s["rope_type"] == "linear":  # positions squeezed by `factor`: a longer context, same angles
        return (inv_freq / s["factor"]).float()
    # llama3: long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
    # and the band in between is interpolated smoothly.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, scaled)
    return torch.where(wavelen < old_ctx / hi, inv_freq, scaled).float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype):
    angles = positions.to(inv_freq.dtype)[..., None] * inv_freq   # (..., T, d/2)
    angles = torch.cat([angles, angles], dim=-1)                 # (..., T, d)
    if angles.dim() == 3:   # positions (B, T): each row its own positions (a batch of sequences, engine.py);
        angles = angles[:, None]                                 # (B, 1, T, d) broadcasts over the heads
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------
# The blocks.

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32: the mean of squares overflows/underflows in fp16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.config = cfg     # the model's own: its sliding_window, read at each pass
        # W_q, W_k, W_v stacked into one matrix: one matmul call instead of three (see FUSED)
        self.split = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache_layer=None, positions=None, attn="sdpa"):
        B, T, _ = x.shape
        q, k, v = kernels.linear(x, self.qkv_proj).split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        in_place = getattr(cache_layer, "in_place", False)     # a paged decode step on a GPU (kvcache.py)
        if cache_layer is not None and not in_place:
            # all K/V so far (B, n_kv, L, d); a static cache's mask covers its live rows only (kvcache.py)
            k, v = (t[:, :, :None if mask is None else mask.shape[-1]] for t in cache_layer.update(k, v, positions))
        window = self.config.sliding_window if cache_layer is None and mask is None else None   # else in the mask
        y = cache_layer.attend(q, k, v) if in_place else attend(q, k, v, mask, attn, window)
        return kernels.linear(y.transpose(1, 2).reshape(B, T, -1), self.o_proj)


ATTN = ("sdpa", "flash", "naive", "triton")   # attend()'s implementations: --attn
CACHES = ("dynamic", "static", "sliding", "offloaded")   # Llama.new_cache's kinds: --cache


def attend(q, k, v, mask, impl: str = "sdpa", window: int | None = None):
    """softmax(q·kᵀ/√d)·v for q (B, H, T, d) over k, v (B, H_kv, L, d); mask (T, L) or None = causal.
    ``window``: causal over the last ``window`` keys only (a sliding-window model without a cache); flash.py's
    tiles skip the keys outside it, whatever ``impl``, so no T×L mask is ever built (but by "naive").

    impl "sdpa" (the default) is described below. "flash" runs flash.py's own kernels:
    Q×K/V tiles with causal tile skipping for prefill (compiled once a prompt fills a
    256×256 tile; the first such prompt waits for the compile), flash-decoding (split keys,
    merged partials) for one token; a cache's mask is taken as it is, and its empty tiles
    are skipped too. "triton": the same two as Triton kernels (flash.py section 5; CUDA).
    "naive" builds the whole T×L score matrix (flash.naive), the reference the others must match.

    Prefill (T > 1) uses PyTorch's fused SDPA kernel, which never builds the
    T×L score matrix; enable_gqa lets each group of H/H_kv query heads read one
    K/V head without materialising repeated copies of K and V.
    Decode (T = 1) on a CPU, fp32 or bf16, is one C++ call (kernels.decode_attention). Elsewhere the query heads
    sharing a KV head are rows of one matrix (GQA costs no copy; ~3.5× SDPA with a mask, bf16, 9 heads × 512
    keys); K/V gathered head-major (the paged pool) batch in (H_kv, B) order: matmul copies them no second time."""
    if impl == "naive":
        return flash.naive(q, k, v, causal=mask is None, mask=mask, window=window)[0]
    if impl in ("flash", "triton") or window and q.shape[2] > 1:    # mask None: causal, queries = last T positions
        if q.shape[2] == 1:
            return (flash.decode if impl == "flash" else flash.triton_decode)(q, k, v, mask, causal=mask is None)[0]
        if impl == "triton":
            return flash.triton_attention(q, k, v, causal=mask is None, mask=mask, window=window)[0]
        return flash.attention(q, k, v, causal=mask is None, mask=mask, window=window, compiled=impl == "flash")[0]
    (B, H, T, d), n_kv = q.shape, k.shape[1]
    if T > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=H != n_kv)
    if (y := kernels.decode_attention(q, k, v, mask)) is not None:
        return y
    swap = (lambda x: x.transpose(0, 1)) if B > 1 and k.transpose(0, 1).is_contiguous() else (lambda x: x)
    scores = swap(q.reshape(B, n_kv, H // n_kv, d)) @ swap(k).transpose(-1, -2) * d ** -0.5    # (…, group, L)
    if mask is not None:
        scores = scores.masked_fill(~(swap(mask) if mask.dim() == 4 else mask), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return swap(probs @ swap(v)).reshape(B, H, 1, d)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # [W_gate; W_up]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = kernels.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return kernels.linear(F.silu(gate) * up, self.down_proj)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache_layer=None, positions=None, attn="sdpa"):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_layer, positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


# Checkpoints store W_q, W_k, W_v and W_gate, W_up as separate matrices; the model
# keeps each group stacked ("fused"), so a decode step makes 4 matmul calls per layer,
# not 7: batch-1 decode is a chain of small matrix-vector products whose fixed cost
# per call counts (kernels.py's cost model). The groups: checkpoint.FUSED.
FUSED = checkpoint.FUSED


def unfuse(model: "Llama") -> dict:
    """The model's tensors by checkpoint names (without "model."): each fused matrix
    split back into its parts (a quantized layer's scales too)."""
    rows = [{"self_attn.qkv_proj": layer.self_attn.split, "mlp.gate_up_proj": [model.config.intermediate_size] * 2}
            for layer in model.layers]
    return checkpoint.split_fused(dict(model.state_dict()), FUSED, rows)


def checkpoint_shapes(model: "Llama") -> dict[str, tuple]:
    """The tensors a checkpoint must hold for this model (a model on the meta device
    will do), by checkpoint name, each with its shape."""
    shapes = {k: tuple(v.shape) for k, v in unfuse(model).items()}
    if model.config.eagle:           # an EAGLE head uses the target's embedding and head (Llama.share_target)
        shapes.pop("embed_tokens.weight")
        shapes.pop("lm_head.weight")
    elif model.config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
        shapes.pop("lm_head.weight")
    return shapes


class Llama(nn.Module):
    # Submodule names follow Hugging Face's (minus the "model." prefix) so a
    # checkpoint's tensors load by name.
    def __init__(self, cfg: LlamaConfig, attn: str = "sdpa"):
        super().__init__()
        if attn not in ATTN:
            raise ValueError(f"unknown attention '{attn}': use {', '.join(ATTN)}")
        self.config = cfg
        self.attn = attn            # attend()'s implementation, passed down to every layer
        # On the meta device, where from_pretrained builds, nn.Embedding's own init (normal_) imports torch._dynamo:
        # 894 more modules at every start. So the table is drawn (the same draws) only on a device with memory.
        w = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*w.shape, _weight=w if w.is_meta else nn.init.normal_(w))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        # A draft model's head may score only the tokens it is ever likely to
        # propose (EAGLE-3 does this too): train.py's draft keeps 8,192 of 49,152,
        # which makes its head 6x cheaper to run and to train. `head_ids` are
        # their ids; every other token gets logit −inf, i.e. probability 0, which
        # speculative.py's rejection rule handles exactly.
        self.register_buffer("head_ids", torch.zeros(cfg.head_vocab, dtype=torch.long) if cfg.head_vocab else None)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.head_vocab or cfg.vocab_size, bias=False)
        # An EAGLE draft head (Li et al. 2024; drafting.EagleDraft) is a Llama of
        # one block whose input at position j is fc([embed(x_j+1); f_j]): the next
        # token together with the *target's* feature at j (its final normalised
        # hidden state, what the target's LM head reads). Its own output there,
        # norm(x), predicts the target's feature at j+1, and the target's LM head
        # turns that into a token. It owns no embedding or head (share_target).
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False) if cfg.eagle else None
        if cfg.tie_embeddings and not cfg.eagle:
            self.tie_head()
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self.compiled_step = None
        self.quantization = None    # set by quantize.py: {"weights": "int8"}, ...

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                last_only: bool = False, mask: torch.Tensor | None = None, features: torch.Tensor | None = None,
                hidden: bool = False):
        """tokens (B, T) at absolute positions (T,) -> logits (B, T, vocab).
        Positions (B, T) give each row its own (a paged cache's batch, engine.py).

        Without a cache the T tokens are the whole sequence (causal attention).
        With one, they follow the cache's contents and each attends to every
        cached key plus the new keys up to its own position. ``last_only`` skips
        the LM head for all but the last position (a 500-token prefill would
        spend 14 GFLOP of SmolLM2's on logits nobody reads). ``mask`` (T, L)
        bool replaces the causal mask of the new tokens over all L keys
        (speculative.py packs token trees at overlapping positions into one pass).
        ``hidden`` also returns the features (B, T, hidden_size), the final
        normalised states the LM head reads, at every position; ``features`` is
        that input, for an EAGLE head."""
        if self.config.eagle and (features is None or features.shape[:2] != tokens.shape):
            raise ValueError(f"an EAGLE head needs the target's features for each of its {tuple(tokens.shape)} "
                             f"tokens, got {None if features is None else tuple(features.shape)}")
        if cache is not None:
            own = cache.begin(positions)      # host-side bookkeeping, then pure tensor work below
            mask = own if mask is None else mask
        # else: the given mask, or None = causal (a sliding window's: attend() skips the tiles outside it)
        # the compiled step was traced for one token on a static cache; anything else runs eagerly
        compiled = self.compiled_step is not None and tokens.shape[1] == 1 and isinstance(cache, StaticCache)
        step = self.compiled_step if compiled else self.step
        return step(tokens, positions, mask, cache, last_only, features, hidden)

    def step(self, tokens, positions, mask, cache, last_only, features=None, hidden=False):
        """The tensor work of a forward pass; with a StaticCache and one token it
        has fixed shapes, so torch.compile turns it into one fused program."""
        x = self.embed_tokens(tokens)
        if self.fc is not None:
            dtype = self.norm.weight.dtype      # the head's own; its embedding is the target's
            x = kernels.linear(torch.cat([x.to(dtype), features.to(dtype)], dim=-1), self.fc)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, mask, None if cache is None else cache.layers[i], positions, self.attn)
        if last_only and not hidden:
            x = x[:, -1:]
        h = self.norm(x)
        logits = kernels.linear(h[:, -1:] if last_only else h, self.lm_head).float()
        if self.head_ids is not None:
            full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), -math.inf)
            logits = full.index_copy_(-1, self.head_ids, logits)
        return (logits, h) if hidden else logits

    def tie_head(self):
        """Share the embedding with the LM head: the same matrix, or its head_ids
        rows (a copy: gathering them on every step would cost more than it saves)."""
        w = self.embed_tokens.weight
        self.lm_head.weight = w if self.head_ids is None else nn.Parameter(w.detach()[self.head_ids],
                                                                           requires_grad=False)

    def share_target(self, target: "Llama"):
        """An EAGLE head reads tokens with the target's embedding and scores with its LM head (head_ids rows, copied once
        in the head's dtype: a bf16 head under an fp32 target), so its features mean the target's; ~113 MB saved."""
        self.embed_tokens = target.embed_tokens
        w = quantize.float_weight(target.lm_head)
        w = w if self.head_ids is None else w[self.head_ids]
        self.lm_head.weight = nn.Parameter(w.to(self.norm.weight.dtype), requires_grad=False)
        return self

    def new_cache(self, kind: str = "dynamic", max_len: int | None = None, batch: int = 1,
                  kv_dtype: str | None = None) -> KVCache:
        """kind (CACHES): dynamic (grows), static (preallocated to max_len, default the model's context),
        sliding (ring buffer; needs a sliding_window config) or offloaded (in host memory, one layer at a time
        on the device). kv_dtype: auto (the model's dtype), int8, fp8 or fp8-plain (quantize.py)."""
        c, w = self.config, self.norm.weight     # the blocks' dtype (an EAGLE head borrows its embedding)
        shape, codec = (c.n_layers, batch, c.n_kv_heads, c.head_dim), quantize.kv_codec(kv_dtype)
        if kind in ("dynamic", "offloaded"):
            grows = DynamicCache if kind == "dynamic" else OffloadedCache
            return grows(*shape, dtype=w.dtype, device=w.device, window=c.sliding_window, codec=codec)
        if kind == "static":
            return StaticCache(*shape, max_len or c.max_seq_len, w.dtype, w.device, c.sliding_window, codec)
        if kind == "sliding":
            if c.sliding_window is None:
                raise ValueError("--cache sliding needs a model whose config.json sets sliding_window")
            return SlidingWindowCache(*shape, c.sliding_window, w.dtype, w.device, codec=codec)
        raise ValueError(f"unknown cache kind '{kind}': use {', '.join(CACHES)}")

    def compile_decode(self, build: bool = True):
        """Compile the one-token step (with a StaticCache: fixed shapes, one compile): the elementwise work between
        the matrix products fuses and the eager per-op dispatch goes away (kernels.compile_step). A CPU builds it
        once into cache_root()/compiled (``build=False``: not here) and later starts load it (kernels.AheadOfTime)."""
        folder = checkpoint.cache_root() / "compiled"
        self.compiled_step = kernels.compile_step(self.step, self.norm.weight.device, folder, build)
        return self

    @classmethod
    def from_pretrained(cls, model_dir, device=None, dtype=None, cfg: LlamaConfig | None = None,
                        attn: str = "sdpa") -> "Llama":
        """Build on the meta device (no memory), then adopt the checkpoint's mmap-backed tensors with assign=True:
        no random init, no second copy. A checkpoint written by quantize.py loads as it is stored (int8/int4)."""
        cfg = cfg or LlamaConfig.from_hf(checkpoint.read_config(model_dir))
        device = kernels.pick_device(device)
        dtype = kernels.pick_dtype(dtype, device)
        with torch.device("meta"):
            model = cls(cfg, attn)
            if cfg.quantization:
                quantize.empty_quantized(model, cfg.quantization)
        state = {k.removeprefix("model."): v for k, v in checkpoint.read_weights(model_dir).items()
                 if not k.endswith("rotary_emb.inv_freq")}
        if cfg.tie_embeddings and not cfg.quantization:
            state.pop("lm_head.weight", None)
        checkpoint.check_tensors(state, checkpoint_shapes(model), model_dir)
        # Quantized tensors and their scales keep their dtypes; the layers prepare them below.
        state = checkpoint.cast(state, device, lambda k, v: dtype if quantize.is_plain(k, v) else None)
        checkpoint.check_finite({k: v for k, v in state.items() if quantize.is_plain(k, v)}, model_dir)
        state = checkpoint.fuse(state, FUSED, cfg.n_layers)
        if cfg.quantization:
            quantize.check_quantized_tensors(state)
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_embeddings and not cfg.quantization and not cfg.eagle:
            model.tie_head()
        for layer in model.modules():
            if hasattr(layer, "prepare"):
                layer.prepare(dtype)
        model.inv_freq = rope_frequencies(cfg).to(device)
        return model.eval()


def save_random_checkpoint(hf_config: dict, out_dir, dtype=torch.bfloat16, seed: int = 0):
    """Write an HF directory with random weights for ``hf_config`` (tests and
    benchmarks of real model shapes without downloading the real weights)."""
    cfg = LlamaConfig.from_hf(hf_config)
    with torch.device("meta"):
        shapes = checkpoint_shapes(Llama(cfg))
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.ones(shape, dtype=dtype) if name.endswith("norm.weight") else
             torch.randperm(cfg.vocab_size, generator=gen)[:shape[0]].sort().values if name == "head_ids" else
             torch.empty(shape, dtype=dtype).normal_(0, 0.02, generator=gen) for name, shape in shapes.items()}
    return checkpoint.save(out_dir, state, hf_config)


def build(model_dir, device=None, dtype=None, weights: str | None = None, group_size: int = quantize.GROUP,
          attn: str = "sdpa", prepacked: bool = True, prepare: bool = True, cfg: LlamaConfig | None = None,
          head: str | None = None) -> Llama:
    """The one way a model is assembled from a checkpoint directory: read it, quantize every Linear if ``weights``
    (int8/int4) asks (the LM head per ``head``: quantize.scheme_of), build the CPU's C++ kernels, give eager passes
    their prepacked weights (``prepacked=False``: half the memory, slower several-position passes).
    ``prepare=False``: quantized layers stay portable (to save)."""
    quantize.check_scheme(weights, group_size)
    cfg = cfg or LlamaConfig.from_hf(checkpoint.read_config(model_dir))
    if cfg.quantization and weights not in (None, "auto"):
        raise ValueError(f"{model_dir} is already quantized ({cfg.quantization['weights']}); "
                         f"drop --weights or load the full-precision checkpoint")
    model = Llama.from_pretrained(model_dir, device, dtype, cfg, attn)
    if model.embed_tokens.weight.device.type == "cpu":
        kernels.native_kernels()
    quantize.quantize_model(model, weights, group_size, prepare, head)
    kernels.prepack(model, copies=prepacked)    # a no-op off the CPU
    return model


def load(name: str = checkpoint.DEFAULT_MODEL, device=None, dtype=None, weights: str | None = None,
         group_size: int = quantize.GROUP, attn: str = "sdpa", prepacked: bool = True,
         head: str | None = None) -> tuple[Llama, Tokenizer]:
    """Alias, directory or .gguf -> (model, tokenizer): `build` on the resolved
    directory, its tokenizer, and every EOS id either file knows."""
    quantize.check_scheme(weights, group_size)
    model_dir = checkpoint.resolve(name)
    # Cheap checks first: a bad config or missing tokenizer should not wait for gigabytes of weights.
    cfg = LlamaConfig.from_hf(checkpoint.read_config(model_dir))
    tok = Tokenizer.from_dir(model_dir)
    model = build(model_dir, device, dtype, weights, group_size, attn, prepacked, cfg=cfg, head=head)
    model.config.eos_ids = sorted(set(tok.eos_ids) | set(model.config.eos_ids))   # generation_config may add ids
    return model, tok


# ----------------------------------------------------------------------------
# The two decoders. Both are generators that yield token ids as they are
# produced (so a caller can stream) and fill in a GenerationStats.

class ContextOverflow(ValueError):
    pass


@dataclass
class GenerationStats:
    prompt_tokens: int = 0      # tokens run through the model before the first new token
    new_tokens: int = 0
    prefill_s: float = 0.0      # wall time to the first new token (TTFT)
    decode_s: float = 0.0       # wall time of the rest
    positions_computed: int = 0  # query positions pushed through the model, all steps
    scores_computed: int = 0    # query·key scores of one head in one layer, all steps (causal_scores)
    finish_reason: str | None = None   # why the answer ended: "stop" (EOS) or "length" (sampling.finish_reason)

    def clock(self, i: int, t0: float) -> float:
        """Token i is out: the first ends the prefill (TTFT), later ones extend the decode time."""
        t1 = time.perf_counter()
        if i == 0:
            self.prefill_s, t0 = t1 - t0, t1
        else:
            self.decode_s = t1 - t0
        self.new_tokens += 1
        return t0


def context_limit(model: Llama, cache: KVCache | None = None) -> int:
    """The model's context, or less when the cache is preallocated smaller."""
    limit = model.config.max_seq_len
    return limit if cache is None or cache.limit is None else min(limit, cache.limit)


def check_context(model: Llama, n_tokens: int, cache: KVCache | None = None):
    if n_tokens >= (limit := context_limit(model, cache)):
        raise ContextOverflow(f"prompt is {n_tokens} tokens but the context holds {limit}")


@torch.inference_mode()
def generate_naive(model: Llama, prompt: list[int], p: SamplingParams,
                   stats: GenerationStats | None = None) -> Iterator[int]:
    """O(N²): every step runs the whole sequence so far through the model."""
    stats = stats if stats is not None else GenerationStats()
    check_context(model, len(prompt))
    dev, tokens = model.embed_tokens.weight.device, list(prompt)
    gen = seeded_generator(p.seed, dev)
    stats.prompt_tokens, t0 = len(prompt), time.perf_counter()
    for i in range(p.max_new_tokens):
        ids = torch.tensor([tokens], device=dev)
        logits = model(ids, torch.arange(len(tokens), device=dev), last_only=True)
        stats.positions_computed += len(tokens)
        stats.scores_computed += causal_scores(len(tokens), len(tokens))
        nxt = sample(logits[0, -1], p, gen)
        t0 = stats.clock(i, t0)
        yield nxt
        tokens.append(nxt)
        stats.finish_reason = finish_reason(nxt, i + 1, len(tokens), p, model.config.eos_ids, context_limit(model))
        if stats.finish_reason:
            return


@torch.inference_mode()
def generate_cached(model: Llama, prompt: list[int], p: SamplingParams,
                    stats: GenerationStats | None = None, cache=None) -> Iterator[int]:
    """O(N): prefill the prompt once, then feed one token per step.

    ``prompt`` holds the tokens not yet in ``cache`` (a new chat turn passes the
    conversation's cache and only its own tokens). On exit the cache holds
    everything except the last yielded token, which the caller may feed next."""
    stats = stats if stats is not None else GenerationStats()
    cache = cache if cache is not None else model.new_cache()
    start, limit = cache.length, context_limit(model, cache)
    check_context(model, start + len(prompt), cache)
    dev = model.embed_tokens.weight.device
    gen = seeded_generator(p.seed, dev)
    stats.prompt_tokens, t0 = len(prompt), time.perf_counter()
    ids, pos = torch.tensor([prompt], device=dev), torch.arange(start, start + len(prompt), device=dev)
    for i in range(p.max_new_tokens):
        logits = model(ids, pos, cache, last_only=True)
        stats.positions_computed += ids.shape[1]
        stats.scores_computed += causal_scores(ids.shape[1], cache.length)
        nxt = sample(logits[0, -1], p, gen)
        t0 = stats.clock(i, t0)
        yield nxt
        stats.finish_reason = finish_reason(nxt, i + 1, cache.length + 1, p, model.config.eos_ids, limit)
        if stats.finish_reason:
            return
        ids, pos = torch.tensor([[nxt]], device=dev), torch.tensor([cache.length], device=dev)


DECODERS = {"naive": generate_naive, "cached": generate_cached}


# ----------------------------------------------------------------------------
# Demo: the seed lesson on the bundled model.

if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="naive vs KV-cached decoding: the same tokens, and the work each does")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=100)
    if (args := ap.parse_args()).tokens < 1:
        ap.error(f"--tokens must be at least 1, got {args.tokens}")
    model, tok = load(args.model)
    prompt = [tok.bos_id if tok.bos_id is not None else 0]   # BOS alone: naive steps run 1, 2, ..., N positions
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)   # exactly N tokens
    stats = {name: GenerationStats() for name in DECODERS}
    out = {name: list(decode(model, prompt, params, stats[name])) for name, decode in DECODERS.items()}
    naive, cached = stats["naive"], stats["cached"]
    print(f"generated {len(out['cached'])} tokens from a 1-token prompt; identical: {out['naive'] == out['cached']}")
    print(f"text: {tok.decode(out['cached'])[:200]!r}")
    print(f"{'decoder':8} {'positions computed':>19} {'attention scores per head and layer':>36}")
    for name, s in stats.items():
        print(f"{name:8} {s.positions_computed:>19} {s.scores_computed:>36}")
    print(f"the cache computes {naive.positions_computed / cached.positions_computed:.1f}x fewer positions and "
          f"{naive.scores_computed / cached.scores_computed:.1f}x fewer attention scores: it removes\nthe "
          "recomputation, but each new token still reads every earlier key: attention per token grows with\nthe "
          "context (timed against N and plotted: python bench.py naive-vs-cached)")
