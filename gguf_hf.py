"""
GGUF <-> a Hugging Face directory: llama.cpp's format, converted once each way.

A GGUF file (llama.cpp's format) is one file holding metadata (architecture, vocabulary,
chat template) and tensors, usually block-quantized (Q4_1 keeps 32 weights in 16 bytes of
nibbles + an fp16 scale and minimum = 5 bits per weight). Its ``general.architecture`` names
the family, and its metadata keys carry that name (``qwen2.block_count``). For the llama
architecture llama.cpp's converter also reorders the rows of W_q and W_k so its RoPE can rotate
adjacent pairs instead of the two halves; we undo that. Qwen2 and Qwen3 files keep HF's order:
llama.cpp runs them with the rotation of halves (its NEOX RoPE).

convert_gguf turns a GGUF file once into an HF directory (safetensors_io.py's layout) under
a cache folder the caller names, so the rest of the project knows a single layout; a later
start finds the directory by the file's fingerprint and reads nothing of the GGUF.
The matrices keep the file's bits: each block is re-laid, not re-rounded, into the layout a
kernel reads (int4 or int8 groups with a scale and a minimum, 16-bit, fp32: the table below),
and config.json names each layer's. Expanded to fp32 they would take 4 bytes a weight
(134.5M · 4 B ≈ 538 MB for SmolLM2-135M, against the file's 5 bits a weight in Q4_1); kept, a
model reads the file's bytes per token, and a plain model (model.py) still gets the exact fp32
values, widened as it loads (safetensors_io.widen_layers). Vectors and the embedding table are
stored in fp32. The converted file is laid out for a fast start: each group the model
multiplies as one (q/k/v, gate/up) is stored stacked, so a load stacks nothing, and the
conversion checks once that every weight is finite and records the largest |w|, so a load need
not read all of them again.

export_gguf is the way back: an HF directory written as a GGUF file, so llama.cpp can run
the very same weights we do.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import numpy as np
import torch

import tokenizer
from safetensors_io import (FUSED, QUANTIZATION_KEY, CheckpointError, TensorWriter, block_scaled,
                            derived_minimum, indexed, join_nibbles, join_sixes, read_weights,
                            stack_layer, widened)


# ----------------------------------------------------------------------------
# GGUF -> HF directory, once.

GGUF_NAMES = {  # llama.cpp tensor name -> Hugging Face name ("{i}" is the layer)
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",        # qwen2
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # qwen3
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# general.architecture -> config.json's architectures entry (its model_type is the same name)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# the architectures whose W_q, W_k rows (and biases, were there any) llama.cpp stores permuted
PERMUTED = ("llama",)


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, key = parts[1], ".".join(["blk", "{i}"] + parts[2:])
        if key in GGUF_NAMES:
            return GGUF_NAMES[key].format(i=layer)
    elif gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    raise CheckpointError(f"GGUF tensor '{gguf_name}' has no counterpart in the models "
                          f"nanoinfer runs ({', '.join(ARCHITECTURES)})")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Per head it stores rows as pairs
    (x0, x_half, x1, x_half+1, ...) so RoPE rotates neighbours; HF rotates the
    two halves (rotate_half). Reshape to (head, half, 2) and swap back."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `unpermute_rows`: HF's (halves) row order -> llama.cpp's (pairs).
    Per head the rows form a (2, half) grid that llama.cpp stores transposed."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> dict:
    """config.json from GGUF metadata keys (``{arch}.block_count`` etc.)."""
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"unsupported GGUF architecture '{arch}' (general.architecture): "
                              f"nanoinfer runs {', '.join(ARCHITECTURES)}")
    # every family spells its keys alike after its name: qwen2.block_count -> block_count
    meta = {k.removeprefix(f"{arch}."): v for k, v in meta.items()}
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError("this GGUF stores llama3 rope scaling as a rope_freqs tensor, "
                              "which is not supported yet; "
                              "use the model's Hugging Face directory instead")
    n_heads = meta["attention.head_count"]
    hidden = meta["embedding_length"]
    n_vocab = meta.get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "hidden_size": hidden, "intermediate_size": meta["feed_forward_length"],
        "num_hidden_layers": meta["block_count"], "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get("attention.head_count_kv", n_heads),
        "head_dim": meta.get("attention.key_length", hidden // n_heads),
        "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get("context_length", 2048),
        "vocab_size": n_vocab, "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    scaling = meta.get("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(meta["rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise CheckpointError(f"unsupported GGUF rope scaling '{scaling}' "
                              f"({arch}.rope.scaling.type)")
    ids = {key: int(reader.fields[f"tokenizer.ggml.{key}_token_id"].contents())
           for key in ("bos", "eos", "eot", "eom")
           if f"tokenizer.ggml.{key}_token_id" in reader.fields}
    if "bos" in ids:
        cfg["bos_token_id"] = ids["bos"]
    # llama.cpp also stops on end-of-turn / end-of-message tokens (Llama 3 chat's <|eot_id|>).
    stops = list(dict.fromkeys(ids[k] for k in ("eos", "eot", "eom") if k in ids))
    if stops:
        cfg["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    return cfg


# ----------------------------------------------------------------------------
# GGUF blocks -> the kernels' layouts, the file's bits kept.
#
# Every llama.cpp weight format this project runs is, per group of 16 or 32 weights along a row,
# W = lo + q·s: q a small integer, s and lo numbers of the group. So a block can be re-laid, not
# re-rounded, into one of three layouts the kernels read (quantize.py's layers), exactly:
#
#     GGUF type          per group                      becomes
#     Q4_0               s = d, lo = -8d, q 0..15       int4, groups of 32
#     Q4_1               s = d, lo = m, q 0..15         int4, groups of 32
#     Q4_K               s = d·sc, lo = -dmin·m         int4, groups of 32 (8 in a 256-block)
#     Q8_0               s = d, q -127..127             int8, groups of 32
#     Q5_0               s = d, q -16..15               int8 in 6 bits, groups of 32
#     Q5_1, Q5_K         s as Q4_1 / Q4_K, q 0..31      int8 in 6 bits with a minimum, groups of 32
#     Q6_K               s = d·sc, q -32..31            int8 in 6 bits, groups of 16
#     Q3_K               s = d·sc, lo = -4s, q 0..7     int4, groups of 16
#     Q2_K               s = d·sc, lo = -dmin·m, q 0..3 int4, groups of 16
#     IQ4_NL, IQ4_XS     s = d (·(ls - 32)), v[q] one   int4 with a table, groups of 32
#                        of 16 int8 values v (a codebook)
#     F16, BF16          -                              16-bit weights, fp32 arithmetic
#     F32                -                              fp32
#
# Each s and lo is what ggml's own dequantization computes, in fp32 (d and dmin are fp16, sc and
# m 6-bit integers, Q6_K's sc 8-bit: their products are exact in fp32), so lo + q·s is, bit for
# bit, the value llama.cpp dequantizes. A negative s (Q4_0 and Q6_K store d with the sign of the
# group's largest weight) stays negative: the kernels' sums do not care. The numbers are stored
# as the file holds them, not widened: d and m in fp16 (half_scales), a K-quant's sc and m
# as int8 per group beside its fp16 d and -dmin per 256 weights (Packed.scale_d, lo_d), which the
# kernels multiply as they read them. A minimum that is a power of two times the scale (Q4_0's
# -8d, Q3_K's -4·d·sc) is not stored: the load derives it (Packed.min_per_scale), so Q4_0
# takes the file's 18 bytes per 32 weights. The 5- and 6-bit values are held six bits each
# (safetensors_io.join_sixes: three bytes per four), which the kernels widen to the same int8
# values. Q4_K then takes 148 bytes per 256 weights (the file 144), Q6_K 210 (the file's 210),
# Q5_K 212 (176), Q8_0, Q4_0 and Q4_1 as many as the file. Q3_K's values (-4..3) are held as q + 4
# with the minimum -4s, its sc - 32 beside d (146 bytes per 256 weights against the file's 110),
# Q2_K's with its own sc and m (164 against 84): no kernel reads 2 or 3 bits a value (a Q3_K_M
# file keeps its larger tensors in Q4_K, Q5_K and Q6_K). IQ4_NL's and
# IQ4_XS's nibbles are kept as int4 beside the 16 values they index (-127..113, Packed.values):
# W = v[q]·s, 144 and 138 bytes per 256 weights against the file's 144 and 136; the kernels look
# each nibble's number up where they would convert it. The other IQ types (codebooks of 8-value
# grids, signs apart) are refused.


class Kind(Enum):
    INT4 = "int4"       # q 0..15, a scale and a minimum per group
    INT8 = "int8"       # q int8, a scale per group, a minimum where ``lo`` is not None
    HALF = "half"       # float16 / bfloat16 weights, widened to fp32 as they are read
    FLOAT = "float"     # fp32


# The GGUF types whose values fit in six bits (-32..31): held six bits each (join_sixes).
SIX_BITS = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
# The types whose minimum is a power of two times the scale (Q4_0's q - 8, Q3_K's q + 4 less 4):
# not stored, derived at load (Packed.min_per_scale).
MIN_PER_SCALE = {"Q4_0": -8, "Q3_K": -4}


@dataclass
class Packed:
    """One GGUF matrix (rows, K) in a kernel layout: W[r, k] = lo[r, k // group] + q[r, k] ·
    scale[r, k // group] (lo absent: 0); HALF and FLOAT hold the weights in ``q``. A K-quant's
    scale and lo are int8 per group times ``scale_d`` and ``lo_d``, fp16 per 256 weights
    (safetensors_io.block_scaled). ``bits``: an INT8 layout's values are stored in 6 bits each
    (their range allows it) or 8; ``q`` holds them as int8 either way."""
    kind: Kind
    q: torch.Tensor
    scale: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    group: int | None = None
    scale_d: torch.Tensor | None = None
    lo_d: torch.Tensor | None = None
    bits: int = 8
    values: tuple[int, ...] | None = None     # INT4: the number each q stands for (IQ4's table)
    # lo is this times the scale (Q4_0: -8, Q3_K: -4): derived at load (derived_minimum), not stored
    min_per_scale: int | None = None

    def dequantized(self) -> torch.Tensor:
        if self.kind in (Kind.HALF, Kind.FLOAT):
            return self.q.float()
        return widened(indexed(self.q, self.values), self.scale, self.lo, self.scale_d, self.lo_d)

    def rows(self, index) -> "Packed":
        """The same layout over a selection of rows (llama.cpp's Q/K row order undone)."""
        pick = lambda t: None if t is None else t[index]
        return replace(self, q=pick(self.q), scale=pick(self.scale), lo=pick(self.lo),
                       scale_d=pick(self.scale_d), lo_d=pick(self.lo_d))

    def derives_min(self) -> bool:
        """Whether its minimum is min_per_scale times its scale, bit for bit, as it will be held
        (the scales' dtype chosen: half_scales): then the checkpoint need not store it."""
        if self.min_per_scale is None or self.lo is None:
            return False
        lo, lo_d = derived_minimum(self.scale, self.scale_d, self.min_per_scale)
        same = lambda a, b: a is None and b is None or a is not None and b is not None and \
            a.dtype == b.dtype and torch.equal(a, b)
        return same(lo, self.lo) and same(lo_d, self.lo_d)


def halves(qs: np.ndarray) -> np.ndarray:
    """(n, 16·c) bytes -> (n, 32·c) nibbles: per 16-byte chunk, the low nibbles are weights 0..15
    and the high ones 16..31 (ggml's order, unlike our int4 layout's even/odd)."""
    n, width = qs.shape
    chunks = qs.reshape(n, width // 16, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 15).reshape(n, -1)


def fp16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5's fifth bits: bit j of the little-endian words is weight j's."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits[:, :count]


def k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums (ggml's packing: the
    first four of each in the low 6 bits of bytes 0-3 / 4-7, the last four split over bytes
    8-11 and the top 2 bits of bytes 0-7)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl): a nibble indexes them.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.int8)


def unpack_blocks(blocks: np.ndarray, kind: str):
    """(n, type size) bytes of one GGUF block type -> (q, s, lo, group, s_d, lo_d): q (n, block)
    integers, s and lo (n, block // group) fp32 (lo None where the type has none); a K-quant's
    s and lo are its int8 sc and m, s_d and lo_d its fp16 d and -dmin per block (else None)."""
    if kind == "Q4_0":
        d = fp16(blocks[:, :2])
        return halves(blocks[:, 2:]), d, -8 * d, 32, None, None
    if kind == "Q4_1":
        return halves(blocks[:, 4:]), fp16(blocks[:, :2]), fp16(blocks[:, 2:4]), 32, None, None
    if kind == "Q5_0":
        q = halves(blocks[:, 6:]) | (high_bits(blocks[:, 2:6], 32) << 4)
        return q.astype(np.int8) - 16, fp16(blocks[:, :2]), None, 32, None, None
    if kind == "Q5_1":
        q = halves(blocks[:, 8:]) | (high_bits(blocks[:, 4:8], 32) << 4)
        return q.astype(np.int8), fp16(blocks[:, :2]), fp16(blocks[:, 2:4]), 32, None, None
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
        return q, fp16(blocks[:, :2]), None, 32, None, None
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = fp16(blocks[:, :2]), fp16(blocks[:, 2:4])
        sc, mn = k_scales(blocks[:, 4:16])
        # Q4_K: 4 chunks of 32 bytes, chunk j the sub-blocks 2j (low nibbles) and 2j+1 (high)
        shift = np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = ((blocks[:, -128:].reshape(-1, 4, 1, 32) >> shift) & 15).reshape(-1, 256)
        if kind == "Q5_K":      # the fifth bit of sub-block i is bit i of qh's 32 bytes
            bit = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            qh = blocks[:, 16:48].reshape(-1, 1, 32) >> bit
            q = q | ((qh & 1).reshape(-1, 256) << 4)
        return q.astype(np.int8 if kind == "Q5_K" else np.uint8), sc, mn, 32, d, -dmin
    if kind == "Q6_K":
        ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1)
        q = ((ql & 15).reshape(-1, 256) | ((qh & 3).reshape(-1, 256) << 4)).astype(np.int8) - 32
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
        return q, sc, None, 16, fp16(blocks[:, 208:210]), None
    if kind in ("Q2_K", "Q3_K"):
        # 2-bit values, 128 a 32-byte run: bits 2j, 2j + 1 of byte b are value 32·j + b of it
        shift = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        at = 16 if kind == "Q2_K" else 32       # after Q2_K's scales, Q3_K's high bits
        low = ((blocks[:, at:at + 64].reshape(-1, 2, 1, 32) >> shift) & 3).reshape(-1, 256)
    if kind == "Q2_K":      # per 16: a byte of 4-bit sc (low) and m (high); then d, dmin
        scales = blocks[:, :16]
        d, dmin = fp16(blocks[:, 80:82]), fp16(blocks[:, 82:84])
        return (low.astype(np.uint8), (scales & 15).astype(np.int8),
                (scales >> 4).astype(np.int8), 16, d, -dmin)
    if kind == "Q3_K":      # bit i of hmask byte b clear: value 32·i + b less 4; 6-bit sc - 32
        bit = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        high = ((blocks[:, :32].reshape(-1, 1, 32) >> bit) & 1).reshape(-1, 256)
        packed_sc = blocks[:, 96:108]
        lo4 = (packed_sc[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1))
        hi2 = (packed_sc[:, 8:].reshape(-1, 1, 4) >> shift.reshape(1, 4, 1))
        sc = ((lo4.reshape(-1, 16) & 15) | ((hi2.reshape(-1, 16) & 3) << 4)).astype(np.int8) - 32
        # q + 4 (0..7) with lo = -4·s: the minimum's d is -4d, exact in fp16 below 2^14
        d = fp16(blocks[:, 108:110])
        if np.abs(d).max(initial=0) >= 2 ** 14:
            raise CheckpointError("a Q3_K block's scale d is 16384 or more, beyond what this "
                                  "runner holds exactly: requantize the file")
        return (low.astype(np.uint8) | (high.astype(np.uint8) << 2), sc, sc.copy(), 16, d,
                -4 * d)
    if kind in ("IQ4_NL", "IQ4_XS"):
        # each nibble picks one of 16 int8 values (ggml's kvalues_iq4nl), in Q4_0's order: the
        # nibbles are kept (packed: Packed.values)
        if kind == "IQ4_NL":        # per 32: fp16 d, 16 bytes
            return halves(blocks[:, 2:]), fp16(blocks[:, :2]), None, 32, None, None
        # per 256: fp16 d, the 6-bit ls of its 8 groups (2 high bits each in a uint16, 4 low
        # in 4 bytes), 128 bytes; a group's s = d·(ls - 32)
        high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16) >> (2 * np.arange(
            8, dtype=np.uint16))
        low = blocks[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)
        ls = (low.reshape(-1, 8) & 15) | ((high & 3).astype(np.uint8) << 4)
        return (halves(blocks[:, 8:]), ls.astype(np.int8) - 32, None, 32,
                fp16(blocks[:, :2]), None)
    raise CheckpointError(f"GGUF tensor type {kind} is not supported: use a file quantized to "
                          f"F32, F16, BF16, Q2_K, Q3_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, "
                          f"Q6_K, IQ4_NL or IQ4_XS")


# A conversion's work on a big matrix goes some rows at a time, about this many bytes of them.
CHUNK_BYTES = 8 << 20


def read_tensor(file, tensor) -> np.ndarray:
    """A gguf.ReaderTensor's data read from ``file`` (the GGUF, open), as its ``data`` view
    holds it. Read, not touched through the reader's memory map: mapped pages count in the
    process's resident memory until unmapped, so a conversion would hold the whole file."""
    out = np.empty(tensor.n_bytes, np.uint8)
    file.seek(tensor.data_offset)
    if file.readinto(out) != tensor.n_bytes:
        raise CheckpointError(f"GGUF tensor {tensor.name} is cut short; is the file complete?")
    return out.view(tensor.data.dtype).reshape(tensor.data.shape)


def unpack_rows(data: np.ndarray, kind: str, rows: int):
    """unpack_blocks over a matrix's blocks some rows at a time into arrays of the whole: its
    temporaries (several bytes a weight) stay those of a chunk, not of a vocabulary's head."""
    blocks = data.reshape(-1, data.shape[-1])
    per_row = len(blocks) // rows
    step = max(1, CHUNK_BYTES // 2 // (per_row * blocks.shape[1])) * per_row
    out = None
    for b0 in range(0, len(blocks), step):
        part = unpack_blocks(blocks[b0:b0 + step], kind)
        if out is None:
            out = [a if not isinstance(a, np.ndarray) else
                   np.empty((len(blocks), *a.shape[1:]), a.dtype) for a in part]
        for whole, a in zip(out, part):
            if isinstance(a, np.ndarray):
                whole[b0:b0 + len(a)] = a
    return out


def packed(tensor, data: np.ndarray | None = None) -> Packed:
    """A gguf.ReaderTensor (a matrix) -> its Packed layout, the file's bits kept (table above);
    ``data``: its bytes as read_tensor gives them (None: the reader's view)."""
    kind = tensor.tensor_type.name
    rows, k = (int(n) for n in reversed(tensor.shape.tolist()))
    own = data is not None          # read_tensor's array, not a view of the reader's map
    data = np.asarray(tensor.data if data is None else data)
    kept = lambda a: a if own else a.copy()
    if kind == "F32":
        return Packed(Kind.FLOAT, torch.from_numpy(data.reshape(rows, k).astype(np.float32)))
    if kind == "F16":
        return Packed(Kind.HALF, torch.from_numpy(kept(data.reshape(rows, k))))
    if kind == "BF16":      # numpy has no bfloat16: the raw 16 bits, viewed as torch's
        raw = torch.from_numpy(kept(np.ascontiguousarray(data).view(np.int16).reshape(rows, k)))
        return Packed(Kind.HALF, raw.view(torch.bfloat16))
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    q, s, lo, group, s_d, lo_d = unpack_rows(data.reshape(-1, size), kind, rows)
    blocks = s_d is not None
    per_row = lambda a, n, dtype: None if a is None else torch.from_numpy(
        np.ascontiguousarray(a.reshape(rows, n), dtype))
    # a K-quant's sc and m (6-bit, or Q6_K's int8) as int8, d and -dmin as the file's fp16
    sub = np.int8 if blocks else np.float32
    return Packed(Kind.INT4 if q.dtype == np.uint8 else Kind.INT8,
                  torch.from_numpy(np.ascontiguousarray(q.reshape(rows, k))),
                  per_row(s, k // group, sub), per_row(lo, k // group, sub), group,
                  per_row(s_d, k // 256, np.float16), per_row(lo_d, k // 256, np.float16),
                  6 if kind in SIX_BITS else 8,
                  tuple(int(v) for v in IQ4_VALUES) if kind in ("IQ4_NL", "IQ4_XS") else None,
                  MIN_PER_SCALE.get(kind))


def grouped(parts: list[Packed]) -> list[Packed]:
    """The parts of a group the model multiplies as one matrix (q/k/v, gate/up) as they are
    stored: in one layout they stack (one matrix, one kernel call), else each keeps its own
    (quantize.StoredParts: Q4_K_M keeps some layers' V in Q6_K beside Q4_K Q and K); beside an
    fp32 part, all in fp32."""
    if any(p.kind == Kind.FLOAT for p in parts):
        return [p if p.kind == Kind.FLOAT else Packed(Kind.FLOAT, p.dequantized()) for p in parts]
    if len({json.dumps(layout_of(p)) for p in parts}) == 1:
        return half_scales(parts)
    return [half_scales([p])[0] for p in parts]


def half_scales(parts: list[Packed]) -> list[Packed]:
    """The parts of a group (or one matrix) with their scales and minimums in fp16 where every one
    of them is an fp16 number: the file's own for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (d, m and -8d),
    half the bytes of fp32 and the same values. A K-quant's d·sc is not one, in general."""
    def exact(t):
        return t is None or torch.equal(t.half().float(), t)
    if not all(p.kind in (Kind.INT4, Kind.INT8) and p.scale_d is None and exact(p.scale)
               and exact(p.lo) for p in parts):
        return parts
    half = lambda t: None if t is None else t.half()
    return [replace(p, scale=half(p.scale), lo=half(p.lo)) for p in parts]


def in_rows(join, q: torch.Tensor) -> torch.Tensor:
    """join(q) some of q's rows at a time, into one tensor: join_sixes' int16 temporaries over
    a whole vocabulary's head would take several times its bytes."""
    step = max(1, CHUNK_BYTES // 2 // max(1, q.shape[1]))
    first = join(q[:step])
    out = first.new_empty((len(q), *first.shape[1:]))
    out[:len(first)] = first
    for r in range(step, len(q), step):
        out[r:r + step] = join(q[r:r + step])
    return out


def stored(name: str, p: Packed) -> dict[str, torch.Tensor]:
    """A Packed matrix as a checkpoint stores it (quantize.py's portable layout): ``weight``
    (int4: two weights a byte, the even column in the low nibble), ``weight_scale``,
    ``weight_min``."""
    if p.kind in (Kind.HALF, Kind.FLOAT):
        return {f"{name}.weight": p.q}
    q = in_rows(join_nibbles, p.q) if p.kind == Kind.INT4 else \
        in_rows(join_sixes, p.q) if p.bits == 6 else p.q
    out = {f"{name}.weight": q, f"{name}.weight_scale": p.scale}
    if p.scale_d is not None:
        out[f"{name}.weight_scale_d"] = p.scale_d
    if p.lo is not None and not p.derives_min():
        out[f"{name}.weight_min"] = p.lo
        if p.lo_d is not None:
            out[f"{name}.weight_min_d"] = p.lo_d
    return out


def layout_of(p: Packed) -> dict:
    """A layer's entry in config.json's quantization map."""
    spec = {"kind": p.kind.value}
    if p.kind in (Kind.INT4, Kind.INT8):
        # "blocks": int8 per group times an fp16 per 256 weights (a K-quant's)
        spec |= {"group": p.group, "min": p.lo is not None,
                 "scales": "blocks" if p.scale_d is not None
                 else str(p.scale.dtype).removeprefix("torch.")}
    if p.kind == Kind.INT8 and p.bits == 6:
        spec["bits"] = 6            # join_sixes
    if p.values is not None:
        spec["values"] = list(p.values)
    if p.derives_min():
        spec["min_per_scale"] = p.min_per_scale
    if p.kind == Kind.HALF:
        spec["dtype"] = str(p.q.dtype).removeprefix("torch.")
    return spec


# What convert_gguf writes, by version; a new one keys a new cache directory, so every
# cache converts again, once. 2: groups stored stacked, the largest |w| recorded. 3: matrices
# at the file's own bits (Packed), not widened to fp32. 4: fp16 scales where the file's are.
# 5: the embedding table at its bits (tied: stored once, as the head). 6: K-quants' scales as
# int8 per group times fp16 per 256 weights. 7: a group's parts at different bits kept apart.
# 8: 5- and 6-bit values in six bits (join_sixes), not a byte. 9: Q3_K and Q2_K as int4 in
# groups of 16, not six-bit int8. 10: IQ4_NL and IQ4_XS as int4 with their 16 values, not int8.
# 11: Q4_0's and Q3_K's minimums derived from their scales at load, not stored.
CONVERTED_FORMAT = 11


def gguf_fingerprint(path: Path, version: int = CONVERTED_FORMAT) -> str:
    # Size + the first MiB (header, metadata, start of the tensors) name a file
    # well enough for a cache key without reading gigabytes.
    h = hashlib.sha256(f"{version}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(path: Path, out_root: Path) -> Path:
    """Convert a GGUF file into an HF directory under ``out_root`` (once) and return it: each
    matrix in the kernel layout that keeps its bits (Packed), named in config.json's
    QUANTIZATION_KEY ({"weights": "gguf", "layers": {name: layout}}), the embedding table too (a
    lookup widens the row it reads); vectors in fp32."""
    path = Path(path)
    out = Path(out_root) / f"{path.stem}-{gguf_fingerprint(path)}"
    if (out / "model.safetensors").is_file():
        return out
    import gguf     # here, not above: a start that finds the cache does not import its 38 modules
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueError/struct errors on bad files
        raise CheckpointError(f"cannot read GGUF file {path} ({e}); is it complete?") from None
    cfg = gguf_config(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename: an interrupted conversion never looks finished.
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        # One tensor (a group: one layer's parts) at a time into the file: memory holds a layer,
        # not the model (all of its tensors re-laid, held for one write, took several times the
        # file's bytes: a 7B file would not have fit a machine that runs it).
        room = header_room(len(reader.tensors))
        with TensorWriter(tmp / "model.safetensors", room) as writer:
            meta = {"format": "pt", "source": path.name}
            layers, largest = converted(reader, cfg, writer, meta)
            if math.isfinite(largest):
                meta["max_abs"] = repr(largest)
            writer.close(meta)
        if layers:
            cfg[QUANTIZATION_KEY] = {"weights": "gguf", "layers": layers}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.write_tokenizer_from_gguf(reader, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # this file's conversions by earlier versions of the format: their names carry the
    # fingerprint that version gave it, and nothing reads them any more
    for old in (Path(out_root) / f"{path.stem}-{gguf_fingerprint(path, v)}"
                for v in range(1, CONVERTED_FORMAT)):
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------
# HF directory -> GGUF: the way back, so llama.cpp can run our weights.


def header_room(tensors: int) -> int:
    """Bytes to leave for the converted file's header: a GGUF tensor becomes at most five
    (weight, scales, minimums and their super-block numbers), each entry under 400 bytes, plus
    the stacked groups' names (TensorWriter moves the data once if this is short)."""
    return 4096 + tensors * 5 * 400


def give_back_freed() -> None:
    """Hands the C heap's freed pages back to the OS (glibc's malloc_trim; elsewhere nothing).
    A conversion frees temporaries of every size, tensor after tensor; glibc keeps those under
    its mapping threshold in its heap, where, fragmented, they were not reused: the resident
    memory grew with every layer, as if the model were held after all. The runner calls it too
    when an answer ends, and the server when its last request has: a prefill's freed
    activations would otherwise stay resident until the next one."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| some rows at a time: ``t.abs()`` of a 16-bit head would be a copy of it."""
    step = max(1, CHUNK_BYTES // (4 * max(1, t[0].numel()))) if t.dim() > 1 else len(t)
    return torch.stack([t[r:r + step].abs().max() for r in range(0, len(t), step)]).max()


def largest_weight(p: Packed) -> torch.Tensor:
    """max |w| of a quantized matrix without widening it: w = q·s + lo rises (or falls) with q
    within a group, in fp32 as in exact arithmetic (each rounding keeps order), so the group's
    extremes are those of its smallest and largest q, computed as Packed.dequantized does."""
    def part(c: Packed) -> torch.Tensor:
        groups = c.q.reshape(len(c.q), -1, c.group)
        s, lo = block_scaled(c.scale, c.scale_d).float(), block_scaled(c.lo, c.lo_d)
        ends = [indexed(q, c.values).float() * s + (0 if lo is None else lo.float())  # ascend
                for q in (groups.amin(-1), groups.amax(-1))]
        return torch.maximum(ends[0].abs().max(), ends[1].abs().max())
    step = max(1, CHUNK_BYTES // (4 * (p.q.shape[1] // p.group)))    # rows of fp32 group ends
    return torch.stack([part(p.rows(slice(r, r + step)))
                        for r in range(0, len(p.q), step)]).max()


def converted(reader, cfg: dict, writer: TensorWriter, meta: dict) -> tuple[dict, float]:
    """The GGUF's tensors written as convert_gguf stores them, in the file's order, each layer's
    FUSED groups (their weights and any biases: Qwen2's q/k/v) once all their members are read;
    meta["stacked"] names the stacked groups. Returns the layouts by layer name and the largest
    |w| the file dequantizes to, checked once here so that a load need not read every weight
    (check_finite): a non-finite weight leaves it non-finite (NaN stays NaN through max),
    convert_gguf records nothing, the load names it."""
    from gguf.quants import dequantize
    from tqdm import tqdm
    layers, largest, groups, waiting = {}, [], {}, {}
    part_of = {part: fused for fused, parts in FUSED.items() for part in parts}
    in_file = {hf_name(t.name).removeprefix("model.") for t in reader.tensors}

    def named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:   # as the file has it
        return {n if n.startswith("lm_head") else f"model.{n}": t for n, t in state.items()}

    def write(state: dict[str, torch.Tensor]):
        for name, t in state.items():
            if t.is_floating_point() and t.numel():
                largest.append(abs_max(t))
            writer.add(name, t)

    def laid(name: str, p: Packed) -> dict[str, torch.Tensor]:
        """A matrix's tensors as the file names them, its layout noted (fp32 has none), and a
        quantized one's max |w| (write takes the max of 16- and 32-bit weights as it writes)."""
        if p.kind != Kind.FLOAT:
            layers[name] = layout_of(p)
        if p.kind in (Kind.INT4, Kind.INT8):
            largest.append(largest_weight(p))
        return named(stored(name, p))

    def write_layer_group(i: int, fused: str, have: dict):
        state = {}
        for part, p in zip(FUSED[fused], grouped([have[f"{q}.weight"] for q in FUSED[fused]])):
            name = f"layers.{i}.{part}"
            state.update(laid(name, p))
            if f"{part}.bias" in have:
                state.update(named({f"{name}.bias": have[f"{part}.bias"]}))
        groups.update(stack_layer(state, i))
        write(state)

    def wait(i: int, part: str, member: str, value):
        """A member of layer i's group (``member``: "weight" or "bias"); the group written once
        every part's weight and the biases the file holds are here."""
        fused = part_of[part]
        have = waiting.setdefault((i, fused), {})
        have[f"{part}.{member}"] = value
        need = [f"{q}.weight" for q in FUSED[fused]] + [
            f"{q}.bias" for q in FUSED[fused] if f"layers.{i}.{q}.bias" in in_file]
        if all(n in have for n in need):
            write_layer_group(i, fused, waiting.pop((i, fused)))

    with open(reader.data.filename, "rb") as file:
        for t in tqdm(reader.tensors, desc=f"converting {meta['source']}", unit="tensor",
                      leave=False):
            name = hf_name(t.name).removeprefix("model.")
            give_back_freed()
            data = read_tensor(file, t)
            layer, _, rest = name.removeprefix("layers.").partition(".")
            part, _, member = rest.rpartition(".")
            in_group = name.startswith("layers.") and part in part_of
            if len(t.shape) == 1:       # norms, biases
                w = dequantize(data, t.tensor_type).astype(np.float32)
                w = torch.from_numpy(np.ascontiguousarray(w))
                if in_group:
                    wait(int(layer), part, member, w)
                else:
                    write(named({name: w}))
                continue
            p = packed(t, data)
            if name == "embed_tokens.weight":
                if p.kind == Kind.FLOAT:    # an fp32 table (tied: the head as it is)
                    write(named({name: p.q}))
                else:   # at its bits: read a row at a time (quantize.StoredEmbedding); tied, once
                    write(laid("lm_head" if cfg["tie_word_embeddings"] else "embed_tokens",
                                half_scales([p])[0]))
                continue
            product = t.name.split(".")[-2]       # blk.3.attn_q.weight -> attn_q
            if cfg["model_type"] in PERMUTED and product in ("attn_q", "attn_k"):
                rows = unpermute_rows(np.arange(len(p.q)), cfg["num_attention_heads" if
                                      product == "attn_q" else "num_key_value_heads"])
                p = p.rows(torch.from_numpy(rows))
            if in_group:
                wait(int(layer), part, member, p)
            else:
                write(laid(name.removesuffix(".weight"), half_scales([p])[0]))
    if waiting:
        (i, fused), have = next(iter(waiting.items()))
        raise CheckpointError(f"the GGUF lacks part of layer {i}'s {fused} "
                              f"(has {', '.join(sorted(have))}); is it complete?")
    meta["stacked"] = json.dumps(groups)
    return layers, torch.stack(largest).max().item() if largest else float("nan")


def gguf_arch(c) -> str:
    """The GGUF architecture of a model.LlamaConfig: qwen3 where q and k are normalised, qwen2
    where q/k/v have a bias, else llama."""
    return "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias else "llama"


def llama_writer(c, file_type) -> "gguf.GGUFWriter":
    """A GGUFWriter holding the {arch}.* metadata of ``c`` (model.LlamaConfig; gguf_arch) and the
    file type (gguf.LlamaFileType): what every Llama-family file we write starts with."""
    import gguf

    scaling = (c.rope_scaling or {}).get("rope_type")
    w = gguf.GGUFWriter(None, gguf_arch(c))     # its add_* methods write {arch}.* keys
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    if c.head_dim != c.hidden_size // c.n_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    if scaling == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_scaling["factor"])
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return w


def add_vocabulary(w, model_dir: Path, vocab_size: int) -> None:
    """The vocabulary of ``model_dir`` into the writer ``w``: its byte-level BPE tokenizer.json
    (and tokenizer_config.json: BOS, EOS, chat template); a directory without one gets a
    synthetic sentencepiece-style vocabulary that runs token ids but tokenizes no text."""
    import warnings

    import gguf

    T = gguf.TokenType
    model_dir = Path(model_dir)
    # The vocabulary: llama.cpp needs exactly vocab_size tokens, one per embedding row.
    spec = (json.loads((model_dir / "tokenizer.json").read_text())
            if (model_dir / "tokenizer.json").is_file() else {})
    bpe, added = spec.get("model") or {}, spec.get("added_tokens", [])
    if bpe.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        t = tokenizer.Tokenizer.from_dir(model_dir)
        vocab = {**bpe["vocab"], **{a["content"]: a["id"] for a in added}}
        if max(vocab.values()) >= vocab_size:
            raise CheckpointError(f"{model_dir}/tokenizer.json has ids beyond "
                                  f"vocab_size={vocab_size}")
        tokens = [f"[PAD{i}]" for i in range(vocab_size)]        # rows the tokenizer never uses
        types = [T.UNUSED] * vocab_size
        for piece, i in vocab.items():
            tokens[i], types[i] = piece, T.NORMAL
        for a in added:
            types[a["id"]] = T.CONTROL if a.get("special") else T.USER_DEFINED
        # tokenizer.ggml.pre names the regex that splits text into words; unknown to us means
        # GPT-2's.
        pre = spec.get("pre_tokenizer") or {}
        splits = [p["pattern"].get("Regex") for p in pre.get("pretokenizers", [])
                  if p.get("type") == "Split"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(next((n for n, rx in tokenizer.PRE_TOKENIZER_SPLITS.items()
                                  if rx in splits), "gpt-2"))
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                            for m in bpe.get("merges", [])])
        if t.bos_id is not None:
            w.add_bos_token_id(t.bos_id)
        if t.eos_ids:
            w.add_eos_token_id(t.eos_ids[0])
        w.add_add_bos_token(t.add_bos)
        if t.chat_template:
            w.add_chat_template(t.chat_template)
    else:
        if list(model_dir.glob("tokenizer*")):
            warnings.warn(f"{model_dir} has no byte-level BPE tokenizer.json; "
                          f"the GGUF gets a synthetic vocabulary "
                          f"and llama.cpp will not tokenize text correctly with it")
        # A sentencepiece-style vocabulary: <unk> <s> </s>, the 256 byte pieces llama.cpp looks up
        # (e.g. <0x0A> for newline), then filler up to vocab_size.
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
        if vocab_size < len(tokens):
            raise CheckpointError(f"vocab_size={vocab_size} is too small "
                                  f"for a synthetic GGUF vocabulary")
        types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
        types += [T.UNUSED] * (vocab_size - len(tokens))
        tokens += [f"<unused{i}>" for i in range(len(tokens), vocab_size)]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores([0.0] * vocab_size)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)


def export_gguf(model_dir: Path, out_path: Path, c, dtype: str = "f16",
                mixed: dict[str, str] | None = None) -> Path:
    """Write an HF directory as a GGUF file of its architecture (llama; qwen2 where q/k/v have
    a bias, qwen3 where q and k are normalised): the inverse of `convert_gguf`.

    Why: bench.py compares us with llama.cpp, and that comparison is only fair
    on the very same weights, not on some other file's rounding or quantization.
    So we write them ourselves: {arch}.* metadata from config.json, tensors
    renamed by GGUF_NAMES, a llama's Q/K rows permuted to llama.cpp's order, matrices
    stored as ``dtype`` ("f32", "f16", "bf16", "q8_0" or "q4_0"; norms and biases stay f32, as
    llama.cpp's own converter does). The vocabulary comes from the directory's
    byte-level BPE tokenizer.json; a directory without one (a random benchmark
    checkpoint) gets a synthetic vocabulary of the right size, enough for
    llama.cpp to load the file and run token ids — but not to tokenize text.
    ``c`` is the directory's parsed config (model.LlamaConfig): config.json is
    parsed in one place, above this module, so the caller passes it down. ``mixed``: another
    type for the matrices whose name ends so ({"v_proj.weight": "q4_0"}), as llama-quantize's
    K-mixes keep some tensors at more bits.
    """
    import gguf
    from gguf.quants import quantize

    Q = gguf.GGMLQuantizationType
    formats = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
               "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
               "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
               "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
               "q5_0": (Q.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
               "q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0)}
    mixed = mixed or {}
    if dtype not in formats or not set(mixed.values()) <= set(formats):
        raise ValueError(f"unknown GGUF dtype '{dtype}': use one of {', '.join(formats)}")
    qtype, file_type = formats[dtype]
    model_dir, out_path = Path(model_dir), Path(out_path)
    scaling = (c.rope_scaling or {}).get("rope_type")
    if scaling not in (None, "linear"):
        raise CheckpointError(f"exporting rope scaling '{scaling}' to GGUF is not supported")

    arch = gguf_arch(c)
    w = llama_writer(c, file_type)
    add_vocabulary(w, model_dir, c.vocab_size)

    to_gguf = {hf.format(i=i): name.format(i=i)
               for name, hf in GGUF_NAMES.items() for i in range(c.n_layers)}
    for name, tensor in read_weights(model_dir).items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and c.tie_embeddings):
            continue   # tied: llama.cpp reads the output projection from token_embd
        if name not in to_gguf:
            raise CheckpointError(f"tensor '{name}' in {model_dir} has no GGUF counterpart: "
                                  f"not a {arch} model")
        a = tensor.float().numpy()
        qtype = next((formats[t][0] for end, t in mixed.items() if name.endswith(end)),
                     formats[dtype][0])
        product = name.split(".")[-2]       # model.layers.3.self_attn.q_proj.weight -> q_proj
        if arch in PERMUTED and product in ("q_proj", "k_proj"):
            a = permute_rows(a, c.n_heads if product == "q_proj" else c.n_kv_heads)
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(to_gguf[name], np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(to_gguf[name], a.astype(np.float16))
        else:   # bf16, q8_0 and q4_0 come back from gguf.quants as raw bytes
            w.add_tensor(to_gguf[name], quantize(a, qtype), raw_dtype=qtype)

    # Write into a temporary sibling and rename: an interrupted export never looks finished.
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".exporting-", suffix=".gguf", dir=out_path.parent)
    os.close(fd)
    try:
        w.write_header_to_file(Path(tmp))
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path
