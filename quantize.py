"""
Quantization: store numbers in fewer bits, and pay for it in accuracy.

Batch-1 decoding is memory-bound (model.py): every generated token reads every
weight once, and at long contexts the KV cache too. Halve the bytes and the
ceiling on tokens/s doubles; the question is what the rounding costs. This file
makes both trades; `python bench.py quantize --eval` measures them on a real model.
The smallest version comes first: ``quantize_int8`` and ``SimpleInt8Linear``.

The recipe is the same for every format: pick a scale s for a group of numbers
so that the largest one maps to the edge of the small format, store round(x/s)
and s, and multiply back when reading. The error of one element is at most half
a step, s/2, so small groups (one row, one token of one head) keep s small.

    format                     bytes per number              where it is used here
    bf16                       2                             the reference
    int8, symmetric            1 + 2/group (an fp16/bf16 s)  weights (a row of W);
                                                             KV (a token of a head)
    fp8 e4m3, scaled           1 + 2/group                   KV; 3 mantissa bits:
                                                             relative error ≤ 2⁻⁴
    fp8 e4m3, plain cast       1                             KV, for comparison:
                                                             no scale, range ±448
    int4, asymmetric, grouped  0.5 + 4/group (s and a zero)  weights, groups of 32-128 along a row;
                                                             a GGUF's 2- to 4-bit ones (Q4_0/1,
                                                             Q4_K; Q3_K, Q2_K: groups of 16)
    int8, grouped              1 + 2/group (an fp16 s),      a GGUF's 8-bit weights (Q8_0):
                               + 2/group with a minimum      groups of 32
    int8 in 6 bits, grouped    0.75 + as int8, grouped       its 5- and 6-bit ones (Q5_0/1,
                                                             Q5_K, Q6_K): groups of 16, 32
    int4/int8, K-quant scales  + 1/group (an int8 s) + 2/256 a GGUF's Q2_K to Q6_K: a
                               (an fp16 per block), twice    super-block's fp16 times the group's
                               with a minimum                int8, multiplied as it is read
    fp16, bf16 (storage only)  2                             a GGUF's F16/BF16 weights, widened
                                                             to fp32 as they are read

For SmolLM2-135M (d_head 64) a KV row of one head costs 128 B in bf16 and
64 + 2 = 66 B in int8 or scaled fp8: 51.6% of bf16, the scale being 2/64 of the
saving. A weight costs 16 bits in bf16, 8 in int8 (plus a row's scale), 5 in int4
with groups of 32 (4 bits + two 16-bit numbers per 32 weights). A whole model
saves less than that ratio: its embedding table stays in full precision and an
int4 model's LM head in int8 (`python bench.py quantize --eval` prints its bytes).

A GGUF file arrives already quantized, in llama.cpp's blocks, and runs at its
own bits rather than widened to fp32 (32 bits a weight against its 4 to 8). Its
4-bit blocks become int4 groups of 32 (its 2- and 3-bit ones int4 groups of 16,
more bits than the file's); its 5-, 6- and 8-bit blocks int8 values
with a scale (and a minimum) per group of 16 or 32: int4's W = lo + q·s with a
wider q, its scales kept as the file stores them. The 5- and 6-bit values are
held six bits each (three bytes per four) and widened to int8 as a kernel reads
them (gguf_hf.py: every block type at about the file's own bytes), for one
kernel per width instead of one per block format. Its F16/BF16 tensors stay
in 16 bits, and its embedding table in its own layout (StoredEmbedding: a lookup
widens one row).

Kernels. Weights are stored quantized and never held expanded: each quantized
Linear calls PyTorch's own matrix-vector kernel for its format on a CPU:
``aten._weight_int8pack_mm`` (int8 weights, one scale per output row) and
``aten._weight_int4pack_mm_for_cpu`` (int4 in a CPU-specific tiled layout, a
scale and a zero per group). aten has none for int8 in groups or for 16-bit
weights under fp32 activations: those layers, and every layer elsewhere (a GPU
included), dequantize their weights for one matmul (correct, not fast).
kernels.py, the device layer, swaps in faster layers (kernels.Int8Linear,
kernels.Int4Linear, kernels.HalfLinear: a small C++ loop that streams the bytes
at the memory's speed and sums every row in the same order however many
positions a pass holds, so speculative decoding stays exact). The KV cache
dequantizes one layer's rows when attention reads them (kvcache.py), so only
one layer's keys are ever held in full precision.

`python quantize.py` shows each round trip's error and bytes on random
tensors; `python bench.py quantize` measures what each format costs a real
model in perplexity and agreement, and writes quantized checkpoints (--out).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import safetensors_io
# two int4 values a byte, the even column in the low nibble: the portable, on-disk layout (a
# kernel converts it into its own layout at load time)
from safetensors_io import join_nibbles, split_nibbles, split_sixes
from model import (FUSED, QUANTIZATION_KEY, Llama, LlamaConfig, adopt_checkpoint, as_dtype,
                   attend, fused_rows)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                   # the largest finite e4m3 number
TINY = 1e-8                       # a scale floor: an all-zero group must not divide by zero


# ----------------------------------------------------------------------------
# 1. Round trips. Each returns what is stored; the matching dequantize undoes it.

def quantize_int8(x: torch.Tensor, scale_dtype=torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: s = max|x| / 127, q = round(x / s) in [-127, 127].
    Every element comes back within s/2 (plus the rounding of s to ``scale_dtype``)."""
    scale = (x.float().abs().amax(-1, keepdim=True) / 127).clamp(min=TINY).to(scale_dtype)
    q = torch.round(x.float() / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


class SimpleInt8Linear(nn.Module):
    """The smallest quantized layer: W stored as int8 rows with one scale per row, widened back to
    the activations' dtype for every forward. A quarter of fp32's bytes at rest; the widening
    still reads and writes a full-precision W each call, which Int8Linear below removes (a kernel
    that reads the int8 bytes as they are), along with groups, a bias and checkpoint loading."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        q, s = quantize_int8(w, scale_dtype=torch.float32)
        self.register_buffer("weight", q)                 # (out, in) int8
        self.register_buffer("weight_scale", s)           # (out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_int8(self.weight, self.weight_scale, x.dtype))


def quantize_fp8(x: torch.Tensor, scale_dtype=torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with a scale over the last dim that maps max|x| to 448. e4m3 keeps 3
    mantissa bits, so each element comes back within a relative 2⁻⁴ (half a step),
    whatever its magnitude; tiny elements near a large one fall into subnormals."""
    scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=TINY).to(scale_dtype)
    return (x.float() / scale.float()).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def dequantize_grouped(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None = None,
                       dtype=torch.float32, scale_d: torch.Tensor | None = None,
                       lo_d: torch.Tensor | None = None) -> torch.Tensor:
    """W = lo + q·s per group along each row: q (rows, cols) integers, scale and lo (rows, groups),
    each group cols/groups long (lo None: 0; scale_d, lo_d: a K-quant's super-block numbers).
    The rule is the checkpoint format's (safetensors_io.widened), which a plain model's loader
    also applies."""
    return safetensors_io.widened(q, scale, lo, scale_d, lo_d).to(dtype)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group`` along each row: w ≈ lo + q·s with
    q in 0..15, s = (max - min) / 15. Returns q (rows, cols) uint8 and s, lo
    (rows, cols/group) fp32. Asymmetric because 16 levels are too few to waste
    half of them on a sign the group's values may not use."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"int4 groups of {group} do not divide a row of {cols}; "
                         f"use --group-size 32")
    g = w.float().reshape(rows, cols // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=TINY)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(rows, cols), scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype=torch.float32):
    return dequantize_grouped(q, scale, lo, dtype)


# ----------------------------------------------------------------------------
# 2. The KV cache. A codec turns a (…, d_head) row of K or V into bytes and back;
# kvcache.py stores the bytes and calls decode on the rows attention reads. The
# scale travels in the same row, after the values, as in llama.cpp's Q8_0
# blocks: every cache operation that moves rows (grow, crop, fork,
# copy-on-write, a ring buffer's writes) then moves the scales with them.

@dataclass(frozen=True)
class KVCodec:
    name: str
    extra: int = 0                 # bytes after the d_head values: the scale

    def row_bytes(self, head_dim: int) -> int:
        return head_dim + self.extra

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(…, d) -> (…, d + extra) uint8."""
        if self.name == "int8":
            q, s = quantize_int8(x)
            return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], -1)
        if self.name == "fp8":
            q, s = quantize_fp8(x)
            return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], -1)
        # fp8-plain: no scale, values beyond ±448 saturate
        return x.to(FP8).view(torch.uint8)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(…, d + extra) uint8 -> (…, d) in ``dtype``."""
        d = rows.shape[-1] - self.extra
        if self.name == "fp8-plain":
            return rows.view(FP8).to(dtype)
        values, scale = rows[..., :d], rows[..., d:].view(torch.float16)
        if self.name == "int8":
            return dequantize_int8(values.view(torch.int8), scale, dtype)
        return dequantize_fp8(values.view(FP8), scale, dtype)


KV_CODECS = {"int8": KVCodec("int8", 2), "fp8": KVCodec("fp8", 2),
             "fp8-plain": KVCodec("fp8-plain")}


def kv_codec(name: str | None) -> KVCodec | None:
    """``--kv-dtype``: auto (None: the model's dtype, no codec), int8, fp8, fp8-plain."""
    if name in (None, "auto"):
        return None
    if name not in KV_CODECS:
        raise ValueError(f"unknown --kv-dtype '{name}': use auto, int8, fp8 or fp8-plain")
    return KV_CODECS[name]


# ----------------------------------------------------------------------------
# 3. Weight-only quantized Linear layers. Their buffers are what a quantized
# checkpoint stores (portable layouts); `prepare` builds the device kernel's
# own layout from them once the tensors are loaded.

# int4's default group: 32, as llama.cpp's Q4_0/Q4_1 blocks. A GGUF model that llama.cpp
# quantized that way (the bundled SmolLM2 is Q4_1: lo + q·s per 32 weights) then
# requantizes onto the same grid, almost losslessly; groups of 64 would put two
# blocks' grids into one and cost far more (RESULTS.md, quantize section).
GROUP = 32


# From this many rows on, Int8Linear widens W to the activations' dtype and runs a matrix-matrix
# product: the int8 kernel is built for matrix-vector work, and a prefill is compute-bound, where
# reading fewer bytes buys nothing (`python bench.py decode` times the TTFT of each format).
PREFILL_ROWS = 16


def block_scales(layer: nn.Module, in_features: int, out_features: int, group: int | None,
                 has_min: bool, blocks: bool):
    """A stored layer's K-quant scales (``blocks``): weight_scale (and weight_min) int8 per group,
    weight_scale_d (and weight_min_d) fp16 per 256 weights; else those two are None."""
    if blocks and (group is None or in_features % 256 or 256 % group):
        raise ValueError(f"K-quant scales need rows of a multiple of 256 weights in groups that "
                         f"divide 256, not {in_features} in groups of {group}")
    per = (out_features, in_features // 256) if blocks else None
    if blocks:
        layer.weight_scale = layer.weight_scale.to(torch.int8)
        if has_min:
            layer.weight_min = layer.weight_min.to(torch.int8)
    layer.register_buffer("weight_scale_d",
                          torch.ones(per, dtype=torch.float16) if blocks else None)
    layer.register_buffer("weight_min_d", torch.zeros(per, dtype=torch.float16)
                          if blocks and has_min else None)


class Int8Linear(nn.Module):
    """SimpleInt8Linear with a kernel: y = x·Wᵀ with W stored as int8 rows and one scale per row,
    W[r] ≈ weight[r] · weight_scale[r]. The scale factors out of each row's dot
    product, so the kernel reads 1 byte per weight and multiplies once per row.

    ``group``: a scale per ``group`` weights of a row instead (weight_scale (N, K/group)), and
    with ``has_min`` a minimum per group too, int4's form with a byte per value:

        W[r, k] = weight_min[r, k // g] + weight[r, k] · weight_scale[r, k // g]

    A GGUF's 5-, 6- and 8-bit blocks load this way at their own bits, with their fp32 or fp16
    scales, or (``blocks``: a K-quant's) an int8 per group times an fp16 per 256 weights
    (weight_scale_d, weight_min_d: safetensors_io.block_scaled). ``bits`` 6: values that fit in
    -32..31 (the 5- and 6-bit blocks) stored six bits each, three bytes per four
    (safetensors_io.join_sixes; weight (N, 3K/4) uint8), the same int8 values once widened.
    A scale per group no longer factors out of the row, so this layer dequantizes and runs one
    matmul (the reference; kernels.py applies each group's scale inside its loop). ``bias``:
    added to the output."""

    def __init__(self, in_features: int, out_features: int, group: int | None = None,
                 has_min: bool = False, bias: bool = False, blocks: bool = False, bits: int = 8):
        super().__init__()
        if group is not None and (group <= 0 or in_features % group):
            raise ValueError(f"int8 groups of {group} do not divide a row of {in_features} "
                             f"weights; give a group that divides it (a GGUF's blocks: 16 or 32)")
        if has_min and group is None:
            raise ValueError("an int8 layer with a minimum needs groups: give group=16 or 32")
        if bits not in (6, 8) or bits == 6 and (group is None or in_features % 32):
            raise ValueError(f"int8 values are stored in 8 bits, or in 6 in groups along rows of a "
                             f"multiple of 32 weights; not {bits} bits, group {group}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.bits = bits
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8)
                             if bits == 8 else
                             torch.zeros(out_features, in_features // 4 * 3, dtype=torch.uint8))
        groups = () if group is None else (in_features // group,)
        self.register_buffer("weight_scale", torch.ones(out_features, *groups))
        self.register_buffer("weight_min",
                             torch.zeros(out_features, *groups) if has_min else None)
        block_scales(self, in_features, out_features, group, has_min, blocks)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Linear":
        layer = cls(w.shape[1], w.shape[0])
        q, s = quantize_int8(w, scale_dtype=torch.float32)
        layer.weight, layer.weight_scale = q, s.squeeze(-1)
        return layer

    def prepare(self, dtype: torch.dtype):
        """Ready the layer for ``dtype`` activations on its device."""
        # aten's CPU kernel (a scale per row) wants a row's scales in the activations' dtype, and
        # its own memory: it uses aligned vector loads, and a tensor mapped straight from a
        # safetensors file may start anywhere (a crash, not an error). Grouped scales stay as
        # stored (a bf16 scale would move every weight of its group), and so do grouped weights:
        # no kernel here needs them aligned, and a copy would hold them twice (the copy and the
        # file's pages it read).
        if self.group is None:
            self.weight_scale = self.weight_scale.to(dtype).contiguous()
            if self.weight.device.type == "cpu" and self.weight.data_ptr() % 64:
                self.weight = self.weight.clone()

    def dequantized(self) -> torch.Tensor:
        if self.group is None:
            return dequantize_int8(self.weight, self.weight_scale[:, None],
                                   self.weight_scale.dtype)
        q = self.weight if self.bits == 8 else split_sixes(self.weight)
        return dequantize_grouped(q, self.weight_scale, self.weight_min, torch.float32,
                                  self.weight_scale_d, self.weight_min_d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.group is not None:
            y = F.linear(x, self.dequantized().to(x.dtype))
        elif x.device.type == "cpu" and rows < PREFILL_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, -1), self.weight,
                                                   self.weight_scale)
            y = y.reshape(*x.shape[:-1], -1)
        else:
            # Many rows (a prefill) are compute-bound: widen W once, then the fast matrix-matrix
            # kernel.
            y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale
        return with_bias(y, self.bias)


class Int4Linear(nn.Module):
    """W stored as 4-bit integers in groups of ``group`` along each row, with a
    scale and a minimum per group: W ≈ lo + q·s. Half a byte per weight plus
    the group's two numbers (fp32 on disk, the model's dtype in the kernel). A GGUF's IQ4
    holds ``values``, 16 numbers each q indexes, and no minimum: W = values[q]·s."""

    def __init__(self, in_features: int, out_features: int, group: int = GROUP, bias: bool = False,
                 blocks: bool = False, has_min: bool = True,
                 values: tuple[float, ...] | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        # of the dequantized matrix; prepare() sets the model's
        self.dtype = torch.float32
        self.register_buffer("weight",
                             torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // group))
        self.register_buffer("weight_min", torch.zeros(out_features, in_features // group)
                             if has_min else None)
        # Q4_K's: an int8 scale and minimum per group of 32, an fp16 pair per 256 (Int8Linear's)
        block_scales(self, in_features, out_features, group, has_min, blocks)
        # a GGUF's IQ4_NL and IQ4_XS: the 16 numbers a nibble stands for, W = values[q]·s; None:
        # q itself, W = lo + q·s. The layout's, not the checkpoint's: made here, on the CPU (a
        # load assigns the checkpoint's tensors to a layer built on the meta device)
        self.register_buffer("weight_values", None if values is None else
                             torch.tensor(values, dtype=torch.float32, device="cpu"),
                             persistent=False)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # the CPU kernel's layout
        self.register_buffer("tiled", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int) -> "Int4Linear":
        layer = cls(w.shape[1], w.shape[0], group)
        q, s, lo = quantize_int4(w, group)
        layer.weight, layer.weight_scale, layer.weight_min = join_nibbles(q), s, lo
        return layer

    def prepare(self, dtype: torch.dtype):
        """On a CPU: convert to aten's tiled layout and drop the portable copy (it would double
        the memory). aten computes W = (q - 8)·s + z per group, so z = lo + 8·s gives our
        lo + q·s. Its groups are 32 weights or more: groups of 16 (a GGUF's Q3_K and Q2_K) stay
        as they are and dequantize for each product."""
        self.dtype = dtype
        if self.weight.device.type != "cpu" or self.group not in GROUP_SIZES or \
                self.weight_values is not None or self.weight_min is None:
            return
        q = split_nibbles(self.weight).to(torch.int32)
        s = safetensors_io.block_scaled(self.weight_scale, self.weight_scale_d).float()
        z = safetensors_io.block_scaled(self.weight_min, self.weight_min_d).float() + 8 * s
        self.tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_and_zeros = (torch.stack([s, z], -1).transpose(0, 1).contiguous().to(dtype))
        self.weight = self.weight_scale = self.weight_min = None
        self.weight_scale_d = self.weight_min_d = None

    def dequantized(self) -> torch.Tensor:
        q = safetensors_io.indexed(split_nibbles(self.weight), self.weight_values)
        return dequantize_grouped(q, self.weight_scale, self.weight_min,
                                  self.dtype, self.weight_scale_d, self.weight_min_d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.tiled,
                                                          self.group, self.scales_and_zeros)
            return with_bias(y.reshape(*x.shape[:-1], -1), self.bias)
        return with_bias(x @ self.dequantized().to(x.dtype).t(), self.bias)


class HalfLinear(nn.Module):
    """W kept in 16 bits, fp16 or bf16 (a GGUF's F16 and BF16 tensors), widened when used: every
    16-bit number widens to fp32 exactly, so an fp32 model keeps the file's values at 2 bytes a
    weight where loading them as fp32 would hold and read 4. The forward widens W to the
    activations' dtype (to fp32 where that would round: fp16 weights, bf16 activations) and
    matmuls; kernels.HalfLinear widens each weight in registers as it streams instead."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float16,
                 bias: bool = False):
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"HalfLinear keeps float16 or bfloat16 weights, not {dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    def prepare(self, dtype: torch.dtype):
        """Nothing to lay out: the weight is read as stored (Int8Linear's and Int4Linear's
        interface)."""

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(self.weight.dtype, x.dtype)
        return with_bias(F.linear(x.to(wide), self.weight.to(wide)), self.bias).to(x.dtype)


def with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


# The layers that hold their weights as stored (quantized, or 16-bit), not as an nn.Linear's.
STORED = (Int8Linear, Int4Linear, HalfLinear)


class StoredEmbedding(nn.Module):
    """The embedding table at a GGUF's bits, in a stored layer's layout (int4 or int8 groups,
    16-bit): a lookup widens the rows it reads to their exact values (safetensors_io.widened), so
    the table is held at the file's size, not at 4 bytes a weight (a Q4_K table: about 4.5 bits a
    weight against fp32's 32), and a step reads one row of it. A table tied to the LM head is the
    head's own tensors (``persistent=False``: not the checkpoint's a second time)."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype = torch.float32,
                 persistent: bool = True):
        super().__init__()
        # how the stored integers come back: two to a byte, four to three bytes, or as they are
        self.unpack = (split_nibbles if isinstance(layer, Int4Linear) else
                       split_sixes if isinstance(layer, Int8Linear) and layer.bits == 6 else None)
        self.dtype = dtype          # of the rows it returns: the model's
        for name in ("weight", *safetensors_io.SCALES):
            self.register_buffer(name, getattr(layer, name, None), persistent=persistent)
        # what an int4 nibble stands for where it indexes a table (Int4Linear.weight_values)
        self.register_buffer("weight_values", getattr(layer, "weight_values", None),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1)
        q = self.weight[ids]
        if self.weight_scale is None:       # 16-bit
            rows = q.float()
        else:
            pick = lambda t: None if t is None else t[ids]
            q = safetensors_io.indexed(self.unpack(q) if self.unpack else q, self.weight_values)
            rows = safetensors_io.widened(q,
                                          self.weight_scale[ids], pick(self.weight_min),
                                          pick(self.weight_scale_d), pick(self.weight_min_d))
        return rows.to(self.dtype).reshape(*tokens.shape, -1)


def float_weight(layer: nn.Module) -> torch.Tensor:
    """A Linear's W in full precision, whether the layer is quantized or not (an EAGLE
    head or Medusa heads copy rows of the target's LM head)."""
    if isinstance(layer, STORED):
        return layer.dequantized()
    return layer.weight.detach()

WEIGHT_SCHEMES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


def check_scheme(weights: str | None, group: int = GROUP):
    if weights not in (None, "auto", "float") + WEIGHT_SCHEMES:
        raise ValueError(f"unknown --weights '{weights}': use auto, float, int8 or int4")
    if weights == "int4" and group not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group}")


def quantized_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every Linear of the model by name: the projections of each block and the LM head."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def replace_layer(model: nn.Module, name: str, layer: nn.Module):
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, layer)


def scheme_of(name: str, weights: str, head: str | None = None) -> str:
    """The scheme a layer gets under ``weights``. The LM head's is ``head`` where given
    ("float": kept as loaded), else int4 keeps the head in int8, as llama.cpp keeps its
    output matrix at 6-8 bits: every logit goes through it, so 4 bits there cost the most
    accuracy, for the bytes of one matrix.
    A checkpoint whose head already holds its own bits (a GGUF's Q8_0 embedding, tied) passes
    head="float": re-rounding those per row would change the file's logits."""
    if name == "lm_head" and head is not None:
        return head
    return "int8" if weights == "int4" and name == "lm_head" else weights


def quantize_model(model: nn.Module, weights: str, group: int = GROUP, prepare: bool = True,
                   head: str | None = None) -> nn.Module:
    """Replace every Linear with its quantized form, in place. A tied LM head gets
    its own quantized copy; the embedding table stays in full precision (a
    lookup reads one row per token, so its bytes do not cost decode speed).
    ``head``: the LM head's scheme (scheme_of), "float" to keep it as loaded.
    ``prepare=False`` keeps the portable layout only, for saving."""
    check_scheme(weights, group)
    if weights in (None, "auto", "float"):
        return model
    if any(isinstance(m, STORED) for m in model.modules()):
        raise ValueError("the model is already quantized; "
                         "load the full-precision checkpoint to quantize again")
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    for name, lin in quantized_layers(model).items():
        if (scheme := scheme_of(name, weights, head)) == "float":
            continue
        w = lin.weight.detach()
        layer = Int8Linear.from_float(w) if scheme == "int8" else Int4Linear.from_float(w, group)
        if lin.bias is not None:    # Qwen2's q/k/v: the bias stays as it was
            layer.bias = lin.bias.detach()
        if prepare:
            layer.prepare(dtype)
        replace_layer(model, name, layer)
    return model


def empty_quantized(model: nn.Module, spec: dict):
    """For loading a quantized checkpoint: swap every Linear for an empty
    quantized layer of the right shape (on the meta device, like the model). A GGUF
    conversion names each layer's layout (gguf_hf.Packed); quantize.py's, one scheme."""
    if spec.get("weights") == "gguf":
        rows = {f"layers.{i}.{fused}": n for i, layer in enumerate(fused_rows(model))
                for fused, n in layer.items()}
        for name, lin in quantized_layers(model).items():
            if (layouts := gguf_layouts(spec["layers"], name)) is None:
                continue
            bias = lin.bias is not None
            if all(layout == layouts[0] for layout in layouts):     # stored stacked
                layer = stored_layer(layouts[0], lin.in_features, lin.out_features, bias)
            else:
                layer = StoredParts([stored_layer(layout, lin.in_features, n, bias)
                                     for layout, n in zip(layouts, rows[name])])
            replace_layer(model, name, layer)
        vocab, hidden = model.embed_tokens.weight.shape
        if (table := spec["layers"].get("embed_tokens")) is not None:
            model.embed_tokens = StoredEmbedding(stored_layer(table, hidden, vocab, False))
        elif model.config.tie_embeddings and isinstance(model.lm_head, STORED):
            # stored once, as the head: from_pretrained ties the table to it once loaded
            model.embed_tokens = StoredEmbedding(model.lm_head, persistent=False)
        return
    weights, group = spec.get("weights"), spec.get("group_size", GROUP)
    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"config.json names quantization scheme '{weights}', "
                         f"which this version does not know (int8, int4); "
                         f"re-quantize with `python bench.py quantize --weights int4 --out DIR`")
    check_scheme(weights, group)
    for name, lin in quantized_layers(model).items():
        if (scheme := scheme_of(name, weights, spec.get("head"))) == "float":
            continue
        bias = lin.bias is not None
        if scheme == "int8":
            replace_layer(model, name, Int8Linear(lin.in_features, lin.out_features, bias=bias))
        else:
            replace_layer(model, name, Int4Linear(lin.in_features, lin.out_features, group, bias))


def gguf_layouts(layers: dict[str, dict], name: str) -> list[dict] | None:
    """A model layer's layouts in a GGUF conversion's map (by checkpoint names), one per part of
    a fused layer (model.FUSED); None where the file holds it in fp32 (a plain Linear)."""
    prefix, _, fused = name.rpartition(".")
    parts = FUSED.get(f"{prefix.rpartition('.')[2]}.{fused}") if prefix else None
    names = [f"{prefix.rpartition('.')[0]}.{p}" for p in parts] if parts else [name]
    found = [layers.get(n) for n in names]
    return found if found[0] is not None else None


class StoredParts(nn.Module):
    """A fused projection (q/k/v, gate/up) whose parts a GGUF holds at different bits (Q4_K_M
    keeps some layers' V in Q6_K beside Q4_K Q and K): each part its own stored layer, their
    outputs side by side. A kernel call more per part, and no part re-laid into a wider layout
    (int4 Q and K re-laid as int8 would hold a byte where the file holds half of one)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)


def stored_layer(layout: dict, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """An empty layer holding one GGUF layout: int4 or int8 groups, or 16-bit weights."""
    blocks = layout.get("scales") == "blocks"
    if layout["kind"] == "int4":
        return Int4Linear(in_features, out_features, layout["group"], bias=bias, blocks=blocks,
                          has_min=layout.get("min", True), values=layout.get("values"))
    if layout["kind"] == "int8":
        return Int8Linear(in_features, out_features, layout["group"], layout["min"], bias=bias,
                          blocks=blocks, bits=layout.get("bits", 8))
    return HalfLinear(in_features, out_features, getattr(torch, layout["dtype"]), bias=bias)


def scheme(model: nn.Module) -> dict | None:
    """The model's quantization as a checkpoint's config.json names it ({"weights": "int4",
    "group_size": 32}, …), read off its layers; None for a float model."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, STORED)}
    if not layers:
        return None
    if any(isinstance(m, HalfLinear) or isinstance(m, Int8Linear) and m.group is not None
           for m in layers.values()):
        return {"weights": "gguf"}      # a GGUF's own layouts (gguf_hf.Packed), layer by layer
    int4 = [m for m in layers.values() if isinstance(m, Int4Linear)]
    spec = {"weights": "int4", "group_size": int4[0].group} if int4 else {"weights": "int8"}
    if "lm_head" not in layers and isinstance(getattr(model, "lm_head", None), nn.Linear):
        # kept as loaded (scheme_of)
        spec["head"] = "float"
    return spec


def check_quantized_tensors(state: dict[str, torch.Tensor], any_sign: bool = False):
    """A scale or minimum that is not finite (or a scale ≤ 0) would silently turn
    a layer's output into garbage: refuse it by name. ``any_sign``: a GGUF's scales are the
    file's own, of either sign (Q4_0's d is negative for half its blocks) and 0 for an all-zero
    block."""
    for name, t in state.items():
        if name.endswith(safetensors_io.SCALES):
            positive = name.endswith("scale") and not any_sign
            bad = ~torch.isfinite(t) | (t <= 0 if positive
                                        else torch.zeros_like(t, dtype=torch.bool))
            if bad.any():
                raise ValueError(f"corrupt quantized checkpoint: {name} has {int(bad.sum())} "
                                 f"invalid values (not finite{' or ≤ 0' if positive else ''}); "
                                 f"quantize the full-precision checkpoint again (`python "
                                 f"bench.py quantize --weights int8|int4 --out DIR`)")


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model holds in parameters and buffers (quantized tensors and their scales
    included)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# ----------------------------------------------------------------------------
# 4. Quantized checkpoints: the Hugging Face layout, with each quantized
# Linear's tensors under its usual name (weight) plus weight_scale (and
# weight_min for int4), and config.json naming the scheme under CONFIG_KEY (our
# own key: transformers' "quantization_config" would make it try its own loaders).

CONFIG_KEY = QUANTIZATION_KEY


def from_pretrained(model_dir, device="cpu", dtype=torch.float32, cfg=None, attend=attend,
                    prepare: bool = True):
    """A checkpoint quantize.py wrote (config.json names its scheme under CONFIG_KEY), loaded as
    it is stored: model.adopt_checkpoint, with empty quantized layers swapped in on the meta
    device; the scales keep their dtypes and each layer prepares its kernel's layout
    (``prepare=False``: the portable layout, for another kernel to take over)."""
    cfg = cfg or LlamaConfig.from_hf(safetensors_io.read_config(model_dir))
    device, dtype = torch.device(device or "cpu"), as_dtype(dtype)
    with torch.device("meta"):
        model = Llama(cfg, attend)
        empty_quantized(model, cfg.quantization)
    # a GGUF conversion stores its vectors and table in fp32 and 16-bit layers' weights as the
    # file does: those stay 16-bit
    gguf = cfg.quantization["weights"] == "gguf"
    plain = (lambda name, t: is_plain(name, t) and t.dtype == torch.float32) if gguf else is_plain
    adopt_checkpoint(model, model_dir, device, dtype, plain, widen=False)
    # (a tied table is still the meta placeholder: the head's, checked as the head)
    check_quantized_tensors({k: v for k, v in model.named_buffers() if not v.is_meta},
                            any_sign=gguf)
    for layer in model.modules():
        if prepare and isinstance(layer, STORED):
            layer.prepare(dtype)
    if isinstance(model.embed_tokens, StoredEmbedding):
        if "embed_tokens" not in cfg.quantization["layers"]:    # tied: the head's tensors, loaded
            model.embed_tokens = StoredEmbedding(model.lm_head, persistent=False)
        model.embed_tokens.dtype = dtype
    return model


def is_plain(name: str, t: torch.Tensor) -> bool:
    """A tensor that loads in the model's dtype: floating point and not a quantization scale."""
    return t.is_floating_point() and not name.endswith(safetensors_io.SCALES)


# ----------------------------------------------------------------------------
# Demo: each round trip on random numbers, with its bytes and its error.

def demo():
    torch.manual_seed(0)
    # a weight matrix, the scale of a trained model's
    w = torch.randn(2048, 2048) * 0.02
    print(f"a {w.shape[0]}×{w.shape[1]} weight matrix (normal, σ 0.02); "
          f"error relative to ‖W‖\n")
    print(f"{'format':24} {'bytes per weight':>16} {'relative error':>15}")
    rows = [("bf16", 2.0, w.bfloat16().float()),
            ("int8, a scale per row", 1 + 2 / w.shape[1], dequantize_int8(*quantize_int8(w)))]
    for g in GROUP_SIZES:
        rows.append((f"int4, groups of {g}", 0.5 + 4 / g,
                     dequantize_int4(*quantize_int4(w, g))))
    for name, size, back in rows:
        print(f"{name:24} {size:>16.3f} {float((back - w).norm() / w.norm()):>15.2e}")
    # KV rows: batch 1, 3 KV heads, 512 tokens, d_head 64
    k = torch.randn(1, 3, 512, 64)
    # real keys have a few large channels
    k[..., 0] *= 20
    print("\nKV rows (3 heads × 512 tokens, d_head 64, one channel 20× larger)\n")
    print(f"{'format':24} {'bytes per row':>16} {'relative error':>15}")
    print(f"{'bf16':24} {128:>16} {float((k.bfloat16().float() - k).norm() / k.norm()):>15.2e}")
    for name, codec in KV_CODECS.items():
        back = codec.decode(codec.encode(k), torch.float32)
        print(f"{name:24} {codec.row_bytes(64):>16} {float((back - k).norm() / k.norm()):>15.2e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="each round trip's bytes and error on random tensors; "
                                 "on a real model: python bench.py quantize --eval")
    _, extra = ap.parse_known_args()
    if extra:
        ap.error(f"this demo takes no arguments (got {' '.join(extra)}): the accuracy table is "
                 f"`python bench.py quantize --eval`, a quantized checkpoint "
                 f"`python bench.py quantize --weights int4 --out DIR`")
    demo()
