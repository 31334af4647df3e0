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
  9 query heads and 3 KV heads, TinyLlama 32 and 4, so the KV cache is 9/3 and
  32/4 times smaller than with one K/V per query head (MHA).
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
product: 135M parameters × 4 B = 540 MB in fp32, so tokens/s ≤ bandwidth ÷ 540 MB;
bf16 or int8 weights raise that cap) plus the cache so far. A prefill reads them
once for all its positions, so it runs many more tokens per second. `python
bench.py naive-vs-cached` and `python bench.py context` measure all this.

Read first the smallest complete version, right below: forward_simple, then the two loops over
it, generate_naive_simple and generate_cached_simple. The rest of the file is the same model
made general (the Llama class, the decoders generate_naive and generate_cached that the other
lessons build on), and the tests check that both give the same logits and tokens.
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
import safetensors_io
from sampling import Finish, SamplingParams, constraint, finish_reason, sample, seeded_generator
from tokenizer import Tokenizer


# ----------------------------------------------------------------------------
# The smallest complete Llama: plain functions of a checkpoint's tensors, by their Hugging Face
# names without "model." ("layers.0.self_attn.q_proj.weight"; unfuse(model) gives a loaded
# Llama's), for one sequence, greedy. What it leaves out, the general code below adds.

def rms_norm(x, weight, eps):
    """x scaled to unit root-mean-square over its last dimension, then by a learned gain."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, positions, theta):
    """Rotate each pair of dimensions (i, i + d/2) of x (..., T, d) by the angle
    position · theta^(-2i/d): q·k of a rotated query and key depends only on how far apart they
    are."""
    d = x.shape[-1]
    # in float64, then fp32, as the Llama class below: both round alike
    freq = 1 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angle = (positions[:, None].float() * freq.float()).repeat(1, 2)            # (T, d)
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * angle.cos() + rotated * angle.sin()


def attention(q, k, v):
    """softmax(q·kᵀ/√d)·v for the last T of L positions: q (H, T, d); k, v (H_kv, L, d). Query i
    sits at position L - T + i and reads the keys up to its own (causal). GQA: each K/V head
    serves H / H_kv neighbouring query heads, so it is repeated that many times."""
    (H, T, d), L = q.shape, k.shape[1]
    k, v = (t.repeat_interleave(H // t.shape[0], dim=0) for t in (k, v))
    scores = q @ k.transpose(1, 2) / math.sqrt(d)                                # (H, T, L)
    causal = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
    return torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1) @ v


def forward_simple(w: dict, cfg: LlamaConfig, tokens: list[int], cache: list | None = None):
    """Logits (T, vocab) at each of ``tokens``: the whole sequence, or with ``cache`` the tokens
    that follow those it holds. The cache is a list of [K, V] per layer, each (H_kv, L, d); a
    pass appends its own (start from []: nothing held)."""
    if cfg.rope_scaling or cfg.sliding_window or cfg.qkv_bias or cfg.qk_norm or cfg.head_vocab:
        raise ValueError("forward_simple runs a plain Llama (no rope_scaling, sliding window, "
                         "q/k/v bias, q/k norm or draft head): run this model with Llama")
    T, start = len(tokens), cache[0][0].shape[1] if cache else 0
    x = w["embed_tokens.weight"][torch.tensor(tokens, device=w["norm.weight"].device)]
    pos = torch.arange(start, start + T, device=x.device)
    for i in range(cfg.n_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        h = rms_norm(x, w[f"layers.{i}.input_layernorm.weight"], cfg.rms_eps)
        q, k, v = (F.linear(h, w[f"{a}{n}_proj.weight"]).view(T, -1, cfg.head_dim).transpose(0, 1)
                   for n in "qkv")                                               # (heads, T, d)
        q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
        if cache is not None:       # earlier tokens' K and V, kept: never computed again
            if i == len(cache):
                cache.append([k, v])
            else:
                cache[i] = [torch.cat([cache[i][0], k], dim=1), torch.cat([cache[i][1], v], dim=1)]
            k, v = cache[i]
        x = x + F.linear(attention(q, k, v).transpose(0, 1).reshape(T, -1), w[a + "o_proj.weight"])
        h = rms_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"], cfg.rms_eps)
        gate, up = F.linear(h, w[m + "gate_proj.weight"]), F.linear(h, w[m + "up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, w[m + "down_proj.weight"])
    # a tied head is the embedding table itself
    return F.linear(rms_norm(x, w["norm.weight"], cfg.rms_eps),
                    w.get("lm_head.weight", w["embed_tokens.weight"]))


@torch.inference_mode()
def generate_naive_simple(w: dict, cfg: LlamaConfig, prompt: list[int], n: int) -> list[int]:
    """n tokens, greedy, the whole sequence through the model at every step: the step that
    picks new token t (from 0) runs len(prompt) + t positions. (generate_naive below adds
    sampling, stop rules, a context check and the work counts.)"""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(forward_simple(w, cfg, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@torch.inference_mode()
def generate_cached_simple(w: dict, cfg: LlamaConfig, prompt: list[int], n: int) -> list[int]:
    """The same n tokens, each position run once: the prompt in one pass (prefill), then one
    token per step (decode) that reads the cached K and V of every token before it."""
    cache, feed, new = [], list(prompt), []
    while len(new) < n:
        new.append(int(forward_simple(w, cfg, feed, cache)[-1].argmax()))
        feed = new[-1:]
    return new


# ============================================================================
# The general Llama: the same model for batches of sequences at their own positions, with
# fused weight matrices, a fast attention path, every cache kind (kvcache.py), quantized layers
# (quantize.py) and draft heads (drafting.py).
#
# It runs the Llama family's close relatives too, each one field of LlamaConfig read from
# config.json's model_type: Mistral attends over a sliding window of recent positions,
# Qwen2/2.5 adds a learned bias to the q, k and v projections, and Qwen3 normalises each head's
# q and k (RMSNorm) before RoPE.

# config.json's key for a quantized checkpoint (safetensors_io): quantize.py reads and writes it; a
# plain Llama refuses quantize.py's and widens a GGUF conversion's to fp32.
QUANTIZATION_KEY = safetensors_io.QUANTIZATION_KEY


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
    qkv_bias: bool = False              # Qwen2: q, k and v projections add a learned bias
    qk_norm: bool = False               # Qwen3: an RMSNorm over each head's q and k before RoPE
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    quantization: dict | None = None    # a checkpoint written by quantize.py:
                                        # {"weights": "int8"}, ...
    head_vocab: int | None = None       # an LM head over only this many tokens (a draft's,
                                        # train.py)
    eagle: bool = False                 # config.json's "eagle": an EAGLE draft head
                                        # (drafting.EagleHead)

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaConfig":
        theta, rope, kind = safetensors_io.check_llama_config(c)
        eos, family = c.get("eos_token_id"), c.get("model_type")
        n_heads = c["num_attention_heads"]
        # Mistral's window is on unless switched off; Qwen's is off unless switched on
        # (check_llama_config refuses it on: it covers only some of Qwen's layers)
        windowed = c.get("use_sliding_window", family in ("llama", "mistral"))
        try:
            return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                intermediate_size=c["intermediate_size"], n_layers=c["num_hidden_layers"],
                n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
                rms_eps=c.get("rms_norm_eps", 1e-5), rope_theta=float(theta),
                rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
                max_seq_len=c.get("max_position_embeddings", 2048),
                tie_embeddings=c.get("tie_word_embeddings", False), bos_id=c.get("bos_token_id"),
                sliding_window=c.get("sliding_window") if windowed else None,
                qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
                eos_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
                quantization=c.get(QUANTIZATION_KEY), head_vocab=c.get("draft_vocab_size"),
                eagle=bool(c.get("eagle", False)))
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]}") from None


# ----------------------------------------------------------------------------
# RoPE. Frequencies θ_i = theta^(-2i/d); position p rotates pair i by p·θ_i.
# HF layout pairs dimension i with i + d/2 ("rotate half").

def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    d = cfg.head_dim
    # d/2 numbers, on the CPU even while Llama.__init__ builds on the meta device (whose arange
    # imports torch._dynamo)
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d)
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
    # positions (B, T): each row its own positions (a batch of sequences, engine.py);
    # (B, 1, T, d) broadcasts over the heads
    if angles.dim() == 3:
        angles = angles[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------
# Which keys a query may read, and what that costs.

def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None,
                   causal: bool = True) -> torch.Tensor:
    """The one mask rule (the caches, paged.py, flash.py and speculative.py use it): q_pos (..., T)
    and k_pos (L,) -> (..., T, L) bool, True where the query at q_pos[i] may read the key at
    k_pos[j]: causal (a key at or before the query), and with a sliding window only the last
    ``window`` positions. Key slots that hold no token carry position -1 (ring) or a position
    beyond every query (static, paged), so they are never visible."""
    q, k = q_pos[..., None], k_pos
    ok = (k >= 0) & ((k <= q) if causal else torch.ones_like(q, dtype=torch.bool))
    if window is not None:
        ok = ok & (k > q - window)
    return ok


def causal_scores(new: int, total: int) -> int:
    """How many query·key scores one head computes in one layer when the last ``new`` of ``total``
    positions each read every key up to their own (what the causal mask above allows, without a
    window): new·(total − new) + new(new + 1)/2. A prefill of L tokens: L(L+1)/2; one decode step
    at context L: L (the decoders below count both)."""
    return new * (total - new) + new * (new + 1) // 2


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


def attend(q, k, v, mask, window: int | None = None):
    """attention() above, batched and fast: softmax(q·kᵀ/√d)·v for q (B, H, T, d) over k, v
    (B, H_kv, L, d); mask (T, L) or None = causal. ``window``: causal over the last ``window``
    keys only (a sliding-window model without a cache; with one, the cache's mask holds it).

    Prefill (T > 1) uses PyTorch's fused SDPA kernel, which never builds the T×L score matrix
    (but for a window, whose band is a mask here: flash.py's tiles skip the keys outside it);
    enable_gqa lets each group of H/H_kv query heads read one K/V head without materialising
    repeated copies of K and V. Decode (T = 1): the query heads sharing a KV head are rows of one
    matrix, so GQA costs no copy; K/V gathered head-major (the paged pool) batch in (H_kv, B)
    order: matmul copies them no second time."""
    (B, H, T, d), n_kv = q.shape, k.shape[1]
    if window is not None and mask is None:
        pos = torch.arange(k.shape[2], device=q.device)
        mask = attention_mask(pos[-T:], pos, window)
    if T > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=H != n_kv)
    swap = ((lambda x: x.transpose(0, 1)) if B > 1 and k.transpose(0, 1).is_contiguous()
            else (lambda x: x))
    # (…, group, L)
    scores = swap(q.reshape(B, n_kv, H // n_kv, d)) @ swap(k).transpose(-1, -2) * d ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~(swap(mask) if mask.dim() == 4 else mask), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return swap(probs @ swap(v)).reshape(B, H, 1, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, attend=attend):
        super().__init__()
        # softmax(q·kᵀ/√d)·v: `attend` above, or another with its signature (flash.py's
        # tiles; a device's kernel, which kernels.py swaps in)
        self.attend = attend
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.config = cfg     # the model's own: its sliding_window, read at each pass
        # W_q, W_k, W_v stacked into one matrix: one matmul call instead of three (see FUSED)
        self.split = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim,
                      cfg.n_kv_heads * cfg.head_dim]
        # Qwen2's q, k and v add a bias: stacked like their rows, one vector for the three
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # Qwen3 scales each head's q and k to unit RMS (one gain per dimension, shared by the
        # heads): q·k is then bounded by those gains, not by the activations (steadier training)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask, cache_layer=None, positions=None):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # a paged one-token pass read in place (kvcache.py): mask is then the cache's rows
        in_place = getattr(cache_layer, "in_place", False)
        if cache_layer is not None and not in_place:
            # all K/V so far (B, n_kv, L, d); a static cache's mask covers its live rows only
            # (kvcache.py)
            k, v = (t[:, :, :None if mask is None else mask.shape[-1]]
                    for t in cache_layer.update(k, v, positions))
        # else (a cache or a mask given) the window is in the mask
        window = self.config.sliding_window if cache_layer is None and mask is None else None
        y = cache_layer.attend(q, k, v, mask) if in_place else self.attend(q, k, v, mask, window)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # [W_gate; W_up]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, attend=attend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, attend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache_layer=None, positions=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_layer, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


# Checkpoints store W_q, W_k, W_v and W_gate, W_up as separate matrices; the model
# keeps each group stacked ("fused"), so a decode step makes 4 matmul calls per layer,
# not 7: batch-1 decode is a chain of small matrix-vector products whose fixed cost
# per call counts (kernels.py's cost model). The groups: safetensors_io.FUSED.
FUSED = safetensors_io.FUSED


def fused_rows(model: "Llama") -> list[dict[str, list[int]]]:
    """Per layer, each fused matrix's parts' row counts (FUSED's order)."""
    return [{"self_attn.qkv_proj": list(layer.self_attn.split),
             "mlp.gate_up_proj": [model.config.intermediate_size] * 2}
            for layer in model.layers]


def unfuse(model: "Llama") -> dict:
    """The model's tensors by checkpoint names (without "model."): each fused matrix
    split back into its parts (a quantized layer's scales too)."""
    return safetensors_io.split_fused(dict(model.state_dict()), FUSED, fused_rows(model))


def checkpoint_shapes(model: "Llama") -> dict[str, tuple]:
    """The tensors a checkpoint must hold for this model (a model on the meta device
    will do), by checkpoint name, each with its shape."""
    shapes = {k: tuple(v.shape) for k, v in unfuse(model).items() if k not in model.borrowed}
    if model.config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
        shapes.pop("lm_head.weight", None)
    return shapes


# The prompt tokens a pass computes at most where memory should stay near the weights' (the
# runner's prefill, Llama.prefill_chunk; the engine's chunked prefill, engine.py). Each chunk reads
# every weight once more, a few percent of a short prompt's prefill; a long prompt's chunks are no
# slower than one pass, their activations nearer the cores.
PREFILL_CHUNK = 256


class Llama(nn.Module):
    # Submodule names follow Hugging Face's (minus the "model." prefix) so a
    # checkpoint's tensors load by name.
    borrowed: tuple[str, ...] = ()      # tensors taken from another model, not from the checkpoint
    def __init__(self, cfg: LlamaConfig, attend=attend):
        super().__init__()
        self.config = cfg
        # every layer's (a model built like this one passes it on: tp.py)
        self.attend = attend
        # On the meta device, where from_pretrained builds, nn.Embedding's own init (normal_)
        # imports torch._dynamo, hundreds of modules, at every start. So the table is drawn (the
        # same draws) only on a device with memory.
        w = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*w.shape, _weight=w if w.is_meta else nn.init.normal_(w))
        self.layers = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        # A draft model's head may score only the tokens it is ever likely to
        # propose (EAGLE-3 does this too): train.py's draft keeps 8,192 of 49,152,
        # so its head is a sixth of the full one to run and to train. `head_ids` are
        # their ids; every other token gets logit −inf, i.e. probability 0, which
        # speculative.py's rejection rule handles exactly.
        self.register_buffer("head_ids", torch.zeros(cfg.head_vocab, dtype=torch.long)
                             if cfg.head_vocab else None)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.head_vocab or cfg.vocab_size, bias=False)
        if cfg.tie_embeddings and "lm_head.weight" not in self.borrowed:
            self.tie_head()
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        # A faster one-token step with step's signature (a compiled one: the product sets it),
        # run in its place for one token on a cache of fixed shapes; None: step itself.
        self.compiled_step = None
        # A cached pass of more new tokens than this runs as chunks of it, in order (None: at
        # once; the product sets PREFILL_CHUNK): see forward.
        self.prefill_chunk: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its norms'), whatever its weights are stored in."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None,
                last_only: bool = False, mask: torch.Tensor | None = None,
                features: torch.Tensor | None = None, hidden: bool = False):
        """tokens (B, T) at absolute positions (T,) -> logits (B, T, vocab).
        Positions (B, T) give each row its own (a paged cache's batch, engine.py).

        Without a cache the T tokens are the whole sequence (causal attention).
        With one, they follow the cache's contents and each attends to every
        cached key plus the new keys up to its own position. ``last_only`` skips
        the LM head for all but the last position (a 500-token prefill would
        spend 500 · 576 · 49,152 of SmolLM2's multiply-adds on logits nobody reads). ``mask`` (T, L)
        bool replaces the causal mask of the new tokens over all L keys
        (speculative.py packs token trees at overlapping positions into one pass).
        ``hidden`` also returns the features (B, T, hidden_size), the final
        normalised states the LM head reads, at every position; ``features`` is
        that input, for a head that reads another model's (``embed``)."""
        # a long prompt on a contiguous cache goes in chunks (chunked); a paged batch's passes,
        # positions (B, T), are the engine's to chunk
        chunk, T = self.prefill_chunk, tokens.shape[1]
        if cache is not None and mask is None and last_only and chunk and T > chunk \
                and positions.dim() == 1:
            return self.chunked(tokens, positions, cache, features, hidden)
        if cache is not None:
            own = cache.begin(positions)      # host-side bookkeeping, then pure tensor work below
            mask = own if mask is None else mask
        # else: the given mask, or None = causal (a sliding window's: attend() skips the tiles
        # outside it)
        # a compiled step was traced for one token on a cache of fixed shapes; anything else
        # runs eagerly
        fixed = (self.compiled_step is not None and tokens.shape[1] == 1
                 and getattr(cache, "fixed_shape", False))
        step = self.compiled_step if fixed else self.step
        return step(tokens, positions, mask, cache, last_only, features, hidden)

    def chunked(self, tokens, positions, cache, features=None, hidden=False):
        """A long prompt's cached pass as chunks of at most ``prefill_chunk`` tokens, each
        attending to the cache (the chunks before it) and causally within: the same K/V and last
        logits as one pass, up to summation order, while memory holds one chunk's activations, not
        the prompt's (its MLP's alone are T · intermediate_size floats, twice over). The fewest
        chunks, of equal length: each reads every weight once, and a short last one would pay
        that read for a few tokens."""
        T = tokens.shape[1]
        c, out = -(-T // -(-T // self.prefill_chunk)), []
        for a in range(0, T, c):
            part = None if features is None else features[:, a:a + c]
            out.append(self(tokens[:, a:a + c], positions[a:a + c], cache, True, None, part,
                            hidden))
        return (out[-1][0], torch.cat([h for _, h in out], 1)) if hidden else out[-1]

    def step(self, tokens, positions, mask, cache, last_only, features=None, hidden=False):
        """The tensor work of a forward pass; with a StaticCache and one token it
        has fixed shapes, so torch.compile turns it into one fused program."""
        x = self.embed(tokens, features)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, mask, None if cache is None else cache.layers[i], positions)
        if last_only and not hidden:
            x = x[:, -1:]
        h = self.norm(x)
        logits = self.lm_head(h[:, -1:] if last_only else h).float()
        if self.head_ids is not None:
            full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), -math.inf)
            logits = full.index_copy_(-1, self.head_ids, logits)
        return (logits, h) if hidden else logits

    def embed(self, tokens, features=None):
        """The input at each position: the token's embedding (a draft head may mix in more:
        ``features``, drafting.EagleHead)."""
        return self.embed_tokens(tokens)

    def tie_head(self):
        """Share the embedding with the LM head: the same matrix, or its head_ids
        rows (a copy: gathering them on every step would cost more than it saves)."""
        w = self.embed_tokens.weight
        self.lm_head.weight = (w if self.head_ids is None
                               else nn.Parameter(w.detach()[self.head_ids], requires_grad=False))

    @classmethod
    def from_pretrained(cls, model_dir, device="cpu", dtype=torch.float32,
                        cfg: LlamaConfig | None = None, attend=attend) -> "Llama":
        """Build on the meta device (no memory), then adopt the checkpoint's mmap-backed tensors
        with assign=True: no random init, no second copy. ``dtype`` a torch.dtype or a name
        (DTYPES)."""
        cfg = cfg or LlamaConfig.from_hf(safetensors_io.read_config(model_dir))
        if cfg.quantization and cfg.quantization["weights"] != "gguf":
            raise ValueError(f"{model_dir} holds {cfg.quantization['weights']} weights written by "
                             f"quantize.py: load it with quantize.from_pretrained")
        device, dtype = torch.device(device or "cpu"), as_dtype(dtype)
        with torch.device("meta"):
            model = cls(cfg, attend)
        return adopt_checkpoint(model, model_dir, device, dtype)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def as_dtype(name) -> torch.dtype:
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}': use float32, bfloat16 or float16 "
                         "(fp32/bf16/fp16)")
    return DTYPES[name]


def adopt_checkpoint(model: "Llama", model_dir, device: torch.device, dtype: torch.dtype,
                     plain=lambda name, t: t.is_floating_point(), widen: bool = True) -> "Llama":
    """Give ``model`` (built on the meta device) a checkpoint's tensors, by the model's names (no
    "model." prefix, no rotary buffers), checked against the tensors it needs: those ``plain``
    picks in ``dtype`` (floats; integer tensors such as a draft's head_ids stay as stored),
    fused, the head tied where the checkpoint stores none. A GGUF conversion's layers, stored at
    the file's bits, are widened to their exact values (``widen``; quantize.py's loader keeps
    them)."""
    cfg = model.config
    state = {k.removeprefix("model."): v for k, v in safetensors_io.read_weights(model_dir).items()
             if not k.endswith("rotary_emb.inv_freq")}
    if (cfg.quantization or {}).get("weights") == "gguf":
        state = safetensors_io.with_minimums(state, cfg.quantization["layers"])
        if widen:
            state = safetensors_io.widen_layers(state, cfg.quantization["layers"])
    tied = (cfg.tie_embeddings and isinstance(model.lm_head, nn.Linear)
            and "lm_head.weight" not in model.borrowed)
    if tied:
        head = state.pop("lm_head.weight", None)
        if "embed_tokens.weight" not in state and head is not None:
            # a GGUF conversion stores a tied table once, as the head (at the file's bits)
            state["embed_tokens.weight"] = head
    safetensors_io.check_tensors(state, checkpoint_shapes(model), model_dir)
    state = safetensors_io.cast(state, device, lambda k, v: dtype if plain(k, v) else None)
    safetensors_io.check_finite({k: v for k, v in state.items() if plain(k, v)}, model_dir)
    state = safetensors_io.fuse(state, FUSED, cfg.n_layers)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_head()
    model.inv_freq = rope_frequencies(cfg).to(device)
    return model.eval()


def save_random_checkpoint(hf_config: dict, out_dir, dtype=torch.bfloat16, seed: int = 0, cls=None):
    """Write an HF directory with random weights for ``hf_config`` (tests and
    benchmarks of real model shapes without downloading the real weights), the
    tensors of a ``cls`` (Llama, or a Llama subclass such as drafting.EagleHead)."""
    cfg = LlamaConfig.from_hf(hf_config)
    with torch.device("meta"):
        shapes = checkpoint_shapes((cls or Llama)(cfg))
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.ones(shape, dtype=dtype) if name.endswith("norm.weight") else
             torch.randperm(cfg.vocab_size, generator=gen)[:shape[0]].sort().values
             if name == "head_ids" else
             torch.empty(shape, dtype=dtype).normal_(0, 0.02, generator=gen)
             for name, shape in shapes.items()}
    return safetensors_io.save(out_dir, state, hf_config)


def read_model_dir(name: str):
    """Alias, directory or .gguf -> (its directory, its config with every EOS id either file knows,
    its tokenizer): the cheap checks, before any gigabytes of weights are read."""
    model_dir = checkpoint.resolve(name)
    cfg = LlamaConfig.from_hf(safetensors_io.read_config(model_dir))
    tok = Tokenizer.from_dir(model_dir)
    cfg.eos_ids = sorted(set(tok.eos_ids) | set(cfg.eos_ids))   # generation_config may add ids
    return model_dir, cfg, tok


def load(name: str = checkpoint.DEFAULT_MODEL, device="cpu",
         dtype=torch.float32) -> tuple[Llama, Tokenizer]:
    """Alias, directory or .gguf -> (model, tokenizer), the weights in ``dtype`` (nanoinfer.load
    runs it fast: quantized, native kernels, prepacked)."""
    model_dir, cfg, tok = read_model_dir(name)
    return Llama.from_pretrained(model_dir, device, dtype, cfg), tok


# ----------------------------------------------------------------------------
# The two decoders: generate_naive_simple and generate_cached_simple made general (any Llama and
# cache, sampling and structured output, stop rules, a context check). Both are generators that
# yield token ids as they are produced (so a caller can stream) and fill in a GenerationStats.

class ContextOverflow(ValueError):
    pass


@dataclass
class GenerationStats:
    prompt_tokens: int = 0      # tokens run through the model before the first new token
    new_tokens: int = 0
    prefill_s: float = 0.0      # wall time to the first new token (TTFT)
    decode_s: float = 0.0       # wall time of the rest
    positions_computed: int = 0  # query positions pushed through the model, all steps
    scores_computed: int = 0    # query·key scores of one head in one layer, all steps
                                # (causal_scores)
    finish_reason: Finish | None = None   # why the answer ended (sampling.finish_reason)

    def clock(self, i: int, t0: float) -> float:
        """Token i is out: the first ends the prefill (TTFT), later ones extend the decode time."""
        t1 = time.perf_counter()
        if i == 0:
            self.prefill_s, t0 = t1 - t0, t1
        else:
            self.decode_s = t1 - t0
        self.new_tokens += 1
        return t0


class Cache:
    """forward_simple's cache behind the interface the Llama class calls: each layer's keys and
    values so far, grown by concatenation (kvcache.py holds the general ones, tested equal to
    this). A pass over T new tokens appends their K/V and attends over everything held;
    ``begin`` says which keys each new token may read."""
    limit = None                # it grows with the conversation: only the model's context bounds it

    def __init__(self, config: LlamaConfig):
        self.window, self.length = config.sliding_window, 0
        self.layers = [CacheLayer() for _ in range(config.n_layers)]

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        self.length += positions.shape[-1]
        return attention_mask(positions, torch.arange(self.length, device=positions.device),
                              self.window)


class CacheLayer:
    def __init__(self):
        self.k = self.v = None

    def update(self, k, v, positions):
        """Append this pass's k, v (B, H_kv, T, d); return all held (B, H_kv, L, d)."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def count_parameters(model: nn.Module) -> int:
    """Numbers the model holds as weights: its parameters, plus the matrices of layers that keep
    theirs in buffers (quantize.py's: each names its in_features × out_features)."""
    stored = sum(m.in_features * m.out_features for m in model.modules()
                 if hasattr(m, "in_features") and not isinstance(m, nn.Linear))
    return sum(p.numel() for p in model.parameters()) + stored


def context_limit(model: Llama, cache=None) -> int:
    """The model's context, or less when the cache is preallocated smaller."""
    limit = model.config.max_seq_len
    return limit if cache is None or cache.limit is None else min(limit, cache.limit)


def check_context(model: Llama, n_tokens: int, cache=None):
    if n_tokens >= (limit := context_limit(model, cache)):
        raise ContextOverflow(f"prompt is {n_tokens} tokens but the context holds {limit}")


@torch.inference_mode()
def generate_naive(model: Llama, prompt: list[int], p: SamplingParams,
                   stats: GenerationStats | None = None, vocab=None) -> Iterator[int]:
    """O(N²): every step runs the whole sequence so far through the model.
    (``vocab``: sampling.grammar_vocab, for a schema or grammar in ``p``.)"""
    stats = stats if stats is not None else GenerationStats()
    check_context(model, len(prompt))
    dev, tokens = model.device, list(prompt)
    gen, grammar = seeded_generator(p.seed, dev), constraint(p, vocab)
    stats.prompt_tokens, t0 = len(prompt), time.perf_counter()
    for i in range(p.max_new_tokens):
        ids = torch.tensor([tokens], device=dev)
        logits = model(ids, torch.arange(len(tokens), device=dev), last_only=True)
        stats.positions_computed += len(tokens)
        stats.scores_computed += causal_scores(len(tokens), len(tokens))
        nxt = sample(logits[0, -1], p, gen, grammar)
        t0 = stats.clock(i, t0)
        yield nxt
        tokens.append(nxt)
        stats.finish_reason = finish_reason(nxt, i + 1, len(tokens), p, model.config.eos_ids,
                                            context_limit(model))
        if stats.finish_reason:
            return


@torch.inference_mode()
def generate_cached(model: Llama, prompt: list[int], p: SamplingParams,
                    stats: GenerationStats | None = None, cache=None, vocab=None) -> Iterator[int]:
    """O(N): prefill the prompt once, then feed one token per step.

    ``prompt`` holds the tokens not yet in ``cache`` (a new chat turn passes the
    conversation's cache and only its own tokens). On exit the cache holds
    everything except the last yielded token, which the caller may feed next."""
    stats = stats if stats is not None else GenerationStats()
    cache = cache if cache is not None else Cache(model.config)
    start, limit = cache.length, context_limit(model, cache)
    check_context(model, start + len(prompt), cache)
    dev = model.device
    gen, grammar = seeded_generator(p.seed, dev), constraint(p, vocab)
    stats.prompt_tokens, t0 = len(prompt), time.perf_counter()
    ids, pos = (torch.tensor([prompt], device=dev),
                torch.arange(start, start + len(prompt), device=dev))
    for i in range(p.max_new_tokens):
        logits = model(ids, pos, cache, last_only=True)
        stats.positions_computed += ids.shape[1]
        stats.scores_computed += causal_scores(ids.shape[1], cache.length)
        nxt = sample(logits[0, -1], p, gen, grammar)
        t0 = stats.clock(i, t0)
        yield nxt
        stats.finish_reason = finish_reason(nxt, i + 1, cache.length + 1, p, model.config.eos_ids,
                                            limit)
        if stats.finish_reason:
            return
        ids, pos = torch.tensor([[nxt]], device=dev), torch.tensor([cache.length], device=dev)


DECODERS = {"naive": generate_naive, "cached": generate_cached}


# ----------------------------------------------------------------------------
# Demo: the seed lesson on the bundled model. It prints counts, not times: they are the same on
# a busy machine (`python bench.py naive-vs-cached` times them).

if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="naive vs KV-cached decoding: the same tokens, "
                                             "and the work each does")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=50)
    # One by default: on a busy machine each small op of a second thread that is descheduled
    # stalls the first, which made this demo many times slower. The counts do not change.
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    if (args := ap.parse_args()).tokens < 1 or args.threads < 1:
        ap.error(f"--tokens and --threads must be at least 1, got {args.tokens} and "
                 f"{args.threads}")
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    # BOS alone: naive steps run 1, 2, ..., N positions
    prompt = [tok.bos_id if tok.bos_id is not None else 0]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)   # exactly N tokens
    stats = {name: GenerationStats() for name in DECODERS}
    out = {name: list(decode(model, prompt, params, stats[name]))
           for name, decode in DECODERS.items()}
    naive, cached = stats["naive"], stats["cached"]
    print(f"generated {len(out['cached'])} tokens from a 1-token prompt")
    print(f"{'decoder':8} {'positions computed':>19} {'attention scores per head and layer':>36}")
    for name, s in stats.items():
        print(f"{name:8} {s.positions_computed:>19} {s.scores_computed:>36}")
    print(f"the cache computes {naive.positions_computed / cached.positions_computed:.1f}x fewer "
          f"positions and {naive.scores_computed / cached.scores_computed:.1f}x fewer attention "
          "scores: it removes\nthe recomputation, but each new token still reads every earlier "
          "key: attention per token grows with\nthe context (timed against N and plotted: "
          "python bench.py naive-vs-cached)")
    print(f"generate_naive and generate_cached give the same tokens: "
          f"{out['naive'] == out['cached']}")
    try:        # the simple version at the top of this file, on the same tensors
        w = unfuse(model)
        simple = [f(w, model.config, prompt, args.tokens)
                  for f in (generate_naive_simple, generate_cached_simple)]
        print(f"generate_naive_simple and generate_cached_simple give them too: "
              f"{simple == [out['cached']] * 2}")
    except ValueError as e:
        print(f"(the simple loops skipped: {e})")
    print(f"text: {tok.decode(out['cached'])[:200]!r}")
