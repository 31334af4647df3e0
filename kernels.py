"""
kernels.py — which kernel runs each product on this machine, and why.

The lessons compute with plain PyTorch: a Linear layer is x·Wᵀ, a decode step
is a function that `torch.compile` may fuse. This file is the one place that
says *how* those run fast on a given device: which library kernel a matrix
product goes to, in which weight layout, and with which compiler settings.
Porting to another device, or tuning another CPU, touches this file alone
(flash.py and quantize.py teach the algorithms in plain PyTorch; their GPU and C++
kernels live here).

The cost model behind every choice. Batch-1 decoding is a chain of
matrix-vector products that read every weight once per token and do two
flops per weight read, so a step takes

    time ≈ bytes of weights / memory bandwidth  +  calls × fixed cost per call

A 135M-parameter model in bf16 is 135M · 2 B = 270 MB: read at 20 GB/s, that is
270 MB / 20 GB/s = 13.5 ms a token before any overhead (`python bench.py context`
prints the GB/s a step implies here). The first term wants kernels that stream W at full
bandwidth; the second wants few calls, because a small model's matrices are
so small that a kernel's fixed cost (dispatch, thread fork/join, a weight
reorder) is comparable to its work. Each choice below names which term it
attacks and what it measured (`python bench.py decode` reruns the whole step).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import inspect
import mmap
import os
import platform
import subprocess
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import flash
import model
import quantize
import safetensors_io

# Triton (GPU kernels written in Python): optional, used by flash_kernel and paged_decode below.
# They run on a CUDA GPU or in Triton's CPU interpreter; elsewhere its import (79 modules) is
# skipped.
triton = tl = None
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:
        pass


def jit(fn):
    """triton.jit where Triton is installed (TRITON_INTERPRET=1 must be set before this runs, i.e.
    before the import, to get the CPU interpreter); without it the kernel stays a plain function
    that nothing launches (check_triton stops its callers first), so every module imports without
    Triton."""
    return fn if triton is None else triton.jit(fn)


def check_triton(device: torch.device):
    """Triton kernels run on a CUDA GPU (or on a CPU in Triton's interpreter); elsewhere, one
    line."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"--attn triton runs on a CUDA GPU, not on {device.type}: "
                         f"use --attn flash (the same algorithm in PyTorch) or sdpa")
    if triton is None:
        raise ValueError("the Triton kernels need triton: pip install triton==3.9.0 "
                         "(CUDA builds of torch ship with it)")


# ----------------------------------------------------------------------------
# Flash attention on a GPU: flash.py's algorithm as a Triton kernel (Triton is optional). Read it
# beside flash.tile_step: one program (a thread block) owns one Q tile of one KV head's group, holds
# m, s and acc in registers, and streams K/V tiles through SRAM. Causal tiles above the diagonal are
# never visited (the loop's upper bound), the window's older tiles neither (its lower bound); masks
# are computed from positions in registers. A third grid axis splits the keys into chunks:
# flash-decoding. Each chunk's program writes its partial (out, lse), and merge_many, in torch,
# combines them: the partials are S·B·H·T·d floats (a few KB for a decode step), so a merge kernel
# would save one tiny launch and add a second kernel to read.
#
# What changes on a GPU. HBM (by the vendors' specs, 3-5 TB/s on a data-centre GPU, ~1 TB/s on a
# consumer one) holds Q, K, V; each SM has a few hundred KiB of SRAM (shared memory and registers),
# an order of magnitude faster. A program reads its
# Q tile once and each K/V tile once, so for causal prefill HBM traffic is ~N²·d/BLOCK_M elements of
# K/V instead of the N² scores a materialised S writes and reads back. The tile sizes trade: a
# larger BLOCK_M reads K/V fewer times but needs more registers (fewer programs resident per SM to
# hide latency); BLOCK_N sets the size of each tl.dot (tensor cores want multiples of 16) and of the
# score tile in registers. Decode has one query row per head: BLOCK_M is padded to 16 (the smallest
# tl.dot) and holds the group's G heads, and with B·H_kv programs a GPU of 100+ SMs would sit idle;
# split-K puts L/chunk programs on every head. With TRITON_INTERPRET=1 they run on CPU tensors
# (numpy): the tests.

@jit
def flash_kernel(Q, K, V, Out, Lse, Mask, sq_b, sq_h, sq_t, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l,
                 so_s, so_b, so_h, so_t, sl_s, sl_b, sl_h, sm_b, sm_t, Hkv, G, T, L, q_start,
                 k_start, window, scale, chunk, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 HAS_MASK: tl.constexpr, IEEE: tl.constexpr):
    tile, bk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv = bk // Hkv, bk % Hkv
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)        # rows = (group member g, query t), g-major
    real = r < G * T
    # GQA by index: query head h reads KV head h // G
    t, h = r % T, kv * G + r // T
    dims = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + dims[None, :],
                mask=real[:, None], other=0.)
    q_pos = q_start + t
    lo, hi = split * chunk, tl.minimum(L, split * chunk + chunk)
    if CAUSAL:      # keys after the tile's last query position: never read
        hi = tl.minimum(hi, tl.max(tl.where(real, q_pos, 0), 0) + 1 - k_start)
    if WINDOW:      # keys older than the window of the tile's first query: never read
        lo = tl.maximum(lo, tl.min(tl.where(real, q_pos, q_start + T), 0) - window + 1 - k_start)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * sk_b + kv * sk_h + cols[:, None] * sk_l + dims[None, :],
                    mask=cols[:, None] < hi, other=0.)
        v = tl.load(V + b * sv_b + kv * sv_h + cols[:, None] * sv_l + dims[None, :],
                    mask=cols[:, None] < hi, other=0.)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else "tf32") * scale
        ok = cols[None, :] < hi
        if CAUSAL:
            ok &= k_start + cols[None, :] <= q_pos[:, None]
        if WINDOW:
            ok &= k_start + cols[None, :] > q_pos[:, None] - window
        if HAS_MASK:
            ok &= tl.load(Mask + b * sm_b + t[:, None] * sm_t + cols[None, :], mask=ok,
                          other=0) != 0
        scores = tl.where(ok, scores, float("-inf"))
        # from here on, tile_step line by line
        m_new = tl.maximum(m, tl.max(scores, 1))
        base = tl.where(m_new == float("-inf"), 0., m_new)
        p = tl.exp(scores - base[:, None])
        shrink = tl.exp(m - base)
        s = s * shrink + tl.sum(p, 1)
        acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v,
                                             input_precision="ieee" if IEEE else "tf32")
        m = m_new
    out = acc / tl.where(s > 0, s, 1.)[:, None]
    tl.store(Out + split * so_s + b * so_b + h[:, None] * so_h + t[:, None] * so_t + dims[None, :],
             out.to(Out.dtype.element_ty), mask=real[:, None])
    tl.store(Lse + split * sl_s + b * sl_b + h * sl_h + t, m + tl.log(s), mask=real)   # s = 0: -inf


def triton_attention(q, k, v, causal: bool = True, q_start: int | None = None, k_start: int = 0,
                     window: int | None = None, mask: torch.Tensor | None = None,
                     scale: float | None = None, block_m: int = 64, block_n: int = 64,
                     chunk: int | None = None):
    """flash.attention's arguments and results, computed by flash_kernel (CUDA tensors, or CPU ones
    under TRITON_INTERPRET=1). ``chunk``: split the keys into chunks of that many, one program
    each, and merge the partial results (flash-decoding; ``triton_decode``)."""
    check_triton(q.device)
    (B, H, T, d), Hkv, L = q.shape, k.shape[1], k.shape[2]
    G, S = H // Hkv, max(1, -(-L // chunk)) if chunk else 1
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton kernel needs a head_dim that is a power of two >= 16, "
                         f"got {d}")
    q_start = k_start + L - T if q_start is None else q_start
    # decode: G rows, padded to 16
    block_m = max(16, min(block_m, 1 << (G * T - 1).bit_length()))
    out = torch.empty(S, B, H, T, d, dtype=q.dtype if S == 1 else torch.float32, device=q.device)
    lse = torch.empty(S, B, H, T, dtype=torch.float32, device=q.device)
    if mask is not None:        # (T, L) or (B, 1, T, L) bool -> bytes, batch stride 0 when shared
        mask = flash.as_4d(mask).expand(-1, 1, T, L).to(torch.uint8).contiguous()
    m_args = ((mask, mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2))
              if mask is not None else (q, 0, 0))
    flash_kernel[(-(-G * T // block_m), B * Hkv, S)](
        q, k, v, out, lse, m_args[0], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *out.stride()[:4], *lse.stride()[:3], *m_args[1:], Hkv, G, T, L, q_start, k_start,
        window or 0, d ** -0.5 if scale is None else scale, chunk or max(L, 1), D=d,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, WINDOW=window is not None,
        HAS_MASK=mask is not None, IEEE=q.dtype == torch.float32)
    if S == 1:
        return out[0], lse[0]
    out, lse = flash.merge_many(out, lse, dim=0)
    return out.to(q.dtype), lse


def triton_decode(q, k, v, mask: torch.Tensor | None = None, causal: bool = True,
                  q_start: int | None = None, k_start: int = 0, window: int | None = None,
                  scale: float | None = None, chunk: int = flash.CHUNK):
    """flash.decode's arguments and results: flash_kernel with the keys split into chunks."""
    return triton_attention(q, k, v, causal, q_start, k_start, window, mask, scale, chunk=chunk)


def attend_triton(q, k, v, mask, window=None):
    """flash.attend_flash as Triton kernels (a CUDA GPU)."""
    if q.shape[2] == 1:
        return triton_decode(q, k, v, mask, causal=mask is None)[0]
    return triton_attention(q, k, v, causal=mask is None, mask=mask, window=window)[0]


ATTENTION = {**flash.ATTENTION, "triton": attend_triton}    # --attn NAME


def attention_named(name: str):
    """--attn NAME -> the function a Llama attends with."""
    if name not in ATTENTION:
        raise ValueError(f"unknown attention '{name}': use {', '.join(ATTENTION)}")
    return ATTENTION[name]


# ----------------------------------------------------------------------------
# Devices and dtypes.

DTYPES = model.DTYPES


def pick_device(name: str | None = None) -> torch.device:
    """The best device present, unless one is named (then it must be here)."""
    if name:
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ValueError(f"unknown device '{name}': use cpu, cuda or mps") from None
        build = "" if torch.backends.cuda.is_built() else " (this torch is a CPU-only build)"
        if dev.type == "cuda" and not (torch.cuda.is_available()
                                       and (dev.index or 0) < torch.cuda.device_count()):
            raise ValueError(f"--device {name}: no such CUDA GPU on this machine{build}; "
                             f"use --device cpu")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"--device {name}: Apple's Metal (MPS) is not available here; "
                             f"use --device cpu")
        if dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"--device {name}: nanoinfer runs on cpu, cuda or mps")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def bf16_supported(device: torch.device) -> bool:
    """Whether this device computes bf16 natively (a CPU: oneDNN's avx512_bf16/AMX kernels).
    Elsewhere bf16 is converted to fp32 per element and gains little."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def synchronize(device: torch.device):
    """Wait for the device's queued work (a GPU's kernels run after the host moves on): call before
    reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, reps: int = 5) -> float:
    """The fastest of ``reps`` runs of fn(), the device's queue drained around each: on a shared
    machine the slower runs measure the neighbours, not the memory."""
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(device: torch.device, nbytes: int = 2**28) -> float:
    """Bytes per second BLAS's fp32 matrix-vector product streams (a plain sum streamed less on a
    Xeon), as a decode step reads its weights once: its ceiling in tok/s is this over bytes per
    token."""
    w, v = torch.ones(nbytes // 16384, 4096, device=device), torch.ones(4096, device=device)
    return nbytes / best_seconds(lambda: torch.mv(w, v), device)


def busy_machine_hint() -> str | None:
    """A hint, or None: on a machine whose other processes keep every core busy, OpenMP threads wait
    for each other whenever one is descheduled (a decode step can take many times longer with two
    threads than with one)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if torch.get_num_threads() > 1 and load > cores:
        return (f"note: this machine is busy (load {load:.1f} on {cores} cores); "
                f"with {torch.get_num_threads()} threads every step may stall, "
                f"--threads 1 runs steadier")
    return None


# ----------------------------------------------------------------------------
# The linear layer: x·Wᵀ on the fastest kernel for the case at hand.
#
# Eager fp32 on a CPU: F.linear calls MKL's sgemm; oneDNN's kernel (the one torch uses for bf16, and
# inductor for its fused linears) was the faster for a one-token SmolLM2 step on an AMD EPYC, and
# its time grew less than MKL's for 2 or 3 tokens. It has no gradient, so only inference uses it.
# `python kernels.py` measures both on this machine (its last column: F.linear's time over it).
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# oneDNN's call has a fixed cost before any work, so below 512×512 F.linear is faster.
ONEDNN_MIN = 512 * 512


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """x·Wᵀ (+ b, a layer with a bias: Qwen2's q/k/v) for a Linear layer (a quantized layer
    brings its own forward).

    * Inside a compiled one-token step on a CPU: bf16 weights on kernels.cpp's
      bf16_mm (on Zen 4 as fast as inductor's loop or faster; on a Xeon faster than aten's),
      others as `matvec_sum`, which inductor fuses into one loop over W.
    * Eager CPU inference: oneDNN, on the weight's prepacked copy when it has one.
    * Everywhere else (training, GPUs): F.linear, the right kernel there."""
    if not isinstance(layer, nn.Linear):
        return layer(x)
    bias = layer.bias
    if x.shape[-2] == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
        if x.dtype == layer.weight.dtype == torch.bfloat16 and x.shape[-1] % 32 == 0 and \
                hasattr(torch.ops.nanoinfer, "bf16_mm"):
            y = bf16_mm(x.reshape(-1, x.shape[-1]).contiguous(),
                        layer.weight).view(*x.shape[:-1], -1)
        else:
            y = matvec_sum(x, layer.weight)
        return y if bias is None else y + bias
    cpu_inference = x.device.type == "cpu" and not torch.is_grad_enabled()
    packed = packed_weight(layer)
    if packed is not None and packed.dtype == x.dtype and cpu_inference \
            and not torch.compiler.is_compiling():
        return prepacked_linear(x, packed, bias)
    if x.dtype == layer.weight.dtype == torch.float32 and cpu_inference and ONEDNN and \
            layer.weight.numel() >= ONEDNN_MIN:
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, bias, "none", [], "")
    return F.linear(x, layer.weight, bias)


class Linear(nn.Linear):
    """An nn.Linear whose product (and bias, if it has one) runs on `linear` above; ``onednn``:
    prepack's copy of its weight."""
    onednn: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x):
        return linear(x, self)


def swap_linears(module: nn.Module) -> nn.Module:
    """Make a built model fast without changing it: every plain nn.Linear becomes a `Linear` holding
    the same weight (a tied head stays tied), so its products take this machine's kernels. Quantized
    layers bring their own. Idempotent."""
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                fast = Linear(child.in_features, child.out_features, bias=child.bias is not None,
                              device="meta")
                fast.weight, fast.bias = child.weight, child.bias
                setattr(parent, name, fast)
    return module


def native_decode(attend):
    """``attend`` (model.attend's signature) with a one-token pass on kernels.cpp's decode_attention
    where it applies (a CPU, fp32 or bf16: below), else ``attend`` itself."""
    def call(q, k, v, mask, window=None):
        if q.shape[2] == 1 and (y := decode_attention(q, k, v, mask)) is not None:
            return y
        return attend(q, k, v, mask, window)
    return call


def compile_decode(llama: model.Llama, build: bool = True) -> model.Llama:
    """Compile the one-token step (with a StaticCache: fixed shapes, one compile): the elementwise
    work between the matrix products fuses and the eager per-op dispatch goes away (compile_step). A
    CPU builds it once into cache_root()/compiled (``build=False``: not here) and later starts load
    it (AheadOfTime). The model's Linears run on `linear` (swap_linears) first."""
    swap_linears(llama)
    folder = checkpoint.cache_root() / "compiled"
    llama.compiled_step = compile_step(llama.step, llama.norm.weight.device, folder, build)
    return llama


def matvec_sum(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) · w (N, K)ᵀ as multiply-and-sum, times ``scale`` (N,) if given: the one-token
    product inside a compiled step (`linear` for float weights, quantize.Int8Linear for int8 rows
    and their scales). Inductor fuses it into one vectorized loop that widens each weight to fp32 as
    it reads it and accumulates in fp32: more bandwidth than oneDNN's kernel behind F.linear (8
    matrices 5632×2048, bf16, same run). Inductor sums a float reduction longer than 4,096 terms
    through a cascade helper that is much slower (2048 x 4112 read at about half the bandwidth of
    2048 x 4096). So a longer row (TinyLlama's down projection has 5,632) is read as two rows of
    K/2, each against its half of x, and each pair of partial sums is added: that matrix then takes
    well under its whole-row time."""
    n, k = w.shape
    if k <= 4096 or k % 2:
        out = (x.float().unsqueeze(-2) * w.float()).sum(-1)
    else:
        half = k // 2
        # (M, 2N, K/2)
        rows = x.reshape(-1, 2, half).float()[:, torch.arange(2 * n, device=w.device) % 2]
        # (M, 2N)
        partial = (rows * w.view(2 * n, half).float()).sum(-1)
        out = partial.view(-1, n, 2).sum(-1).reshape(*x.shape[:-1], n)
    return (out if scale is None else out * scale.float()).to(x.dtype)


# ----------------------------------------------------------------------------
# int4, int8 and bf16 weights, one token's attention: C++ kernels (kernels.cpp), built on first use.
#
# aten's CPU kernels for int4 and int8 weights are compute-bound (slower per weight at one row than
# oneDNN's fp32 product, which reads four times the bytes of int8); ours stream int8 and bf16 near
# the memory's speed and int4 at ~4.5 cycles per 32 weights (kernels.cpp's header says how;
# `python kernels.py` prints each kernel's ns per weight). Each output is summed in one fixed order
# whatever the rows and the instruction set, so a pass verifying k+1 positions gives each the bits
# a one-token step gives it: speculation stays exact. Built with torch.utils.cpp_extension (a C++
# compiler and ninja; seconds, once, cached under ~/.cache/torch_extensions). Without them: aten's
# kernels and attend's own path, slower, same math.

NATIVE_SOURCE = Path(__file__).with_name("kernels.cpp")     # the C++ source, read when built


# Each instruction set's compiler flags (F16C: fp16 weights widened in registers).
VECTOR_FLAGS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"],
                "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512dq", "-mavx512bw",
                           "-mavx512vl"]}


def vector_flags() -> list[str]:
    """This CPU's build: its instruction set's flags, and AVX-512 VNNI where it has it (int4_x8_mm's
    integer dot products in one instruction, the same integers as without it)."""
    capability = torch.backends.cpu.get_cpu_capability()
    vnni = capability == "AVX512" and torch.cpu.get_capabilities().get("avx512_vnni", False)
    return VECTOR_FLAGS.get(capability, []) + (["-mavx512vnni"] if vnni else [])


@functools.cache
def native_kernels(quiet: bool = False) -> bool:
    """Build (first use: seconds) or load the kernels above; False where they cannot be built: not
    x86, no compiler or ninja, or NANOINFER_NATIVE=0 (how the tests run the aten fallback)."""
    if hasattr(torch.ops.nanoinfer, "int4_mm"):
        return True
    if os.environ.get("NANOINFER_NATIVE") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not build_kernels("nanoinfer", vector_flags(), quiet):
        return False
    # their outputs' shapes, for torch.compile and torch.export to trace them
    torch.library.register_fake("nanoinfer::int4_mm")(
        lambda x, q, s, lo, group, sd=None, lod=None, values=None: x.new_empty(x.shape[0],
                                                                             q.shape[0]))
    torch.library.register_fake("nanoinfer::int4_x8_mm")(
        lambda x, q, s, lo, group, sd=None, lod=None: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("nanoinfer::int8g_x8_mm")(
        lambda x, q, s, lo, group, sd=None, lod=None: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("nanoinfer::int8_mm")(
        lambda x, q, s: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("nanoinfer::int8g_mm")(
        lambda x, q, s, lo, group, sd=None, lod=None: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("nanoinfer::half_mm")(
        lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake("nanoinfer::wide_mm")(
        lambda x, w, s, lo, group, sd=None, lod=None, amx=False, values=None: x.new_empty(
            x.shape[0], w.shape[0]))
    torch.library.register_fake("nanoinfer::decode_attention")(
        lambda q, k, v, mask: q.new_empty(q.shape))
    torch.library.register_fake("nanoinfer::paged_attention")(
        lambda q, k, v, tables, positions, window: q.new_empty(q.shape))
    torch.library.register_fake("nanoinfer::bf16_mm")(
        lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
    return True


def build_kernels(library: str, vector: list[str], quiet: bool = False) -> bool:
    """Build kernels.cpp with an instruction set's flags (``vector``: VECTOR_FLAGS', [] for none)
    and load its ops as torch.ops.<library>; False where it cannot be built. Built once per source
    and flags (seconds), then loaded. The tests build it again as other libraries (AVX2, no SIMD) in
    the same process and compare their bits with nanoinfer's."""
    if hasattr(getattr(torch.ops, library), "int4_mm"):
        return True
    # OpenMP: parallel_for
    flags = ["-O3", "-fopenmp", *vector] + ([f"-DLIBRARY={library}"] if library != "nanoinfer"
                                            else [])
    key = hashlib.sha256((NATIVE_SOURCE.read_text() + " ".join(flags)
                          + torch.__version__).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    # torch's place
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache) / f"{library}_native_{key}"
    so = folder / f"{library}_native.so"
    if not so.exists() and not quiet:
        print("building the C++ CPU kernels (once, seconds)", file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if so.exists():
                # built before from this source and flags: no ninja check (a subprocess a start)
                torch.ops.load_library(str(so))
            else:
                from torch.utils import cpp_extension
                cpp_extension.load(f"{library}_native", [str(NATIVE_SOURCE)],
                                   is_python_module=False, extra_cflags=flags,
                                   extra_ldflags=["-fopenmp"], build_directory=str(folder))
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
        if not quiet:
            print(f"no C++ kernels ({str(e).strip().splitlines()[0][:100]}); using aten's, slower "
                  f"(they need a C++ compiler and ninja)", file=sys.stderr)
        return False
    return True


def int4_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None,
            group: int, scale_d: torch.Tensor | None = None, lo_d: torch.Tensor | None = None,
            values: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) fp32 · Wᵀ for W (N, K) int4 as quantize.Int4Linear stores it: q (N, K/2) uint8 (even
    column in the low nibble), scale and lo (N, K/group) fp32 or fp16, or int8 times their
    256-weight super-block's fp16 number (scale_d, lo_d: a K-quant's); W = lo + q·s (lo None: 0);
    with ``values`` (16 fp32) W = values[q]·s (a GGUF's IQ4_NL and IQ4_XS); group 16 (a GGUF's
    Q3_K and Q2_K), 32, 64 or 128. Needs native_kernels()."""
    return torch.ops.nanoinfer.int4_mm(x, q, scale, lo, group, scale_d, lo_d, values)


def int4_x8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
               group: int, scale_d: torch.Tensor | None = None,
               lo_d: torch.Tensor | None = None) -> torch.Tensor:
    """int4_mm's product with each 32 of x rounded to int8 (d = max|x|/127, llama.cpp's Q8_0)
    first: integer dot products, not exact to the file (asked for: RunConfig.activations).
    Needs native_kernels()."""
    return torch.ops.nanoinfer.int4_x8_mm(x, q, scale, lo, group, scale_d, lo_d)


def int8g_x8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None,
                group: int, scale_d: torch.Tensor | None = None,
                lo_d: torch.Tensor | None = None) -> torch.Tensor:
    """int8g_mm's product with x rounded as int4_x8_mm rounds it: integer dot products of the
    int8 (or six-bit) values with the rounded x. Needs native_kernels()."""
    return torch.ops.nanoinfer.int8g_x8_mm(x, q, scale, lo, group, scale_d, lo_d)


def bf16_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) · wᵀ, both bf16, summed in fp32 (int8_mm's order), each result rounded to bf16.
    Needs native_kernels()."""
    return torch.ops.nanoinfer.bf16_mm(x, w)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) fp32 · Wᵀ for W = q (N, K) int8 · scale (N,) fp32, per row. Needs
    native_kernels()."""
    return torch.ops.nanoinfer.int8_mm(x, q, scale)


def int8g_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None,
             group: int, scale_d: torch.Tensor | None = None,
             lo_d: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) fp32 · Wᵀ for W int8 in groups as quantize.Int8Linear holds it: q (N, K) int8 (or
    its values six bits each: (N, 3K/4) uint8, safetensors_io.join_sixes), scale (N, K/group) as
    int4_mm's, lo None or as scale, group 16 or 32, K a multiple of 32;
    W = lo + q·s. Needs native_kernels()."""
    return torch.ops.nanoinfer.int8g_mm(x, q, scale, lo, group, scale_d, lo_d)


def half_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) fp32 · wᵀ for w (N, K) fp16 or bf16 (K a multiple of 32), each weight widened to
    fp32 as it is read, summed in fp32 in int8_mm's order. Needs native_kernels()."""
    return torch.ops.nanoinfer.half_mm(x, w)


def wide_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
            lo: torch.Tensor | None = None, group: int = 0, scale_d: torch.Tensor | None = None,
            lo_d: torch.Tensor | None = None, amx: bool = False,
            values: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) fp32 · Wᵀ for many rows of x (a prefill) on oneDNN's (else BLAS's) fp32 GEMM, W
    dequantized a tile of rows at a time into an fp32 scratch: no fp32 copy of W is held. W as a
    stored layer holds it: int8 (N, K) with scale (N,) (group 0) or in groups; int4 bytes (N, K/2)
    with scale and lo or values (as int4_mm's); fp16 or bf16 (N, K) alone. ``amx``: int4 or int8
    values in groups of 32 on Intel's tile unit where the CPU has one (x cut into three bf16
    pieces that sum back to it exactly, so every product is exact: the same sums in another
    order, several times faster), and int4 or int8 values in groups of 16 with a K-quant's scales
    (Q6_K, Q3_K, Q2_K: each int8 scale folded into the values, in two exact bf16 pieces or one;
    a minimum that is the scale times a small integer folded in too, any other added as one fp32
    product of x's sums per group). Needs native_kernels()."""
    return torch.ops.nanoinfer.wide_mm(x, w, scale, lo, group, scale_d, lo_d, amx, values)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """One token's attention (kernels.cpp): q (B, H, 1, d), k, v (B, H_kv, L, d) all fp32 or all
    bf16 (summed in fp32) on a CPU, mask None or bool (B or 1, 1, 1, L); None where it does not
    apply or the kernels are not built. model.attend's own decode path (two batched products, a
    softmax) runs aten's small-M GEMMs: 3 query rows a KV head read K and V far below the memory's
    bandwidth. This reads
    each K/V row once for its query heads, 64 keys at a time (flash.decode's split, in fixed
    order)."""
    if not (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[2] == 1 and k.stride(-1) == 1
            and v.stride(-1) == 1 and q.shape[-1] % 8 == 0
            and hasattr(torch.ops.nanoinfer, "decode_attention")):
        return None
    if mask is not None and not (mask.dtype == torch.bool and mask.shape[-2:] == (1, k.shape[2])
                                 and mask.numel() in (k.shape[2], q.shape[0] * k.shape[2])):
        return None
    return torch.ops.nanoinfer.decode_attention(q, k, v,
                                                None if mask is None else mask.contiguous())


# ----------------------------------------------------------------------------
# Stored layers on the C++ kernels. quantize.py's layers run aten's kernels (int8 in rows, int4) or
# dequantize for one matmul (int8 in groups, 16-bit weights); these subclasses hold the same tensors
# and run the loops above where they apply: fp32 activations on a CPU, rows a multiple of 32 long.
# From DRAM int8_mm and int4_mm stream at the memory's speed: several times faster per weight than
# aten's kernels, and faster than fp32's product, which reads four to five times the bytes
# (`python kernels.py` prints ns per weight and GB/s for each). int8g_mm and half_mm stream as
# int8_mm does, near aten's fp32 product's bandwidth (an Intel Xeon with AVX-512 and AMX, 2
# threads, one row, TinyLlama's 5632×2048 from DRAM). On an Intel CPU a decode step's int4, int8
# and 16-bit loops read their rows from 4 distant parts of the matrix at once (kernels.cpp:
# distant_rows): there a core streams several distant places faster than one. Each sums every
# row in the same order however many positions a pass holds, and whichever rows it takes
# together, so speculative decoding stays exact.
#
# A prefill is compute-bound: its rows go to BLAS on fp32 weights, prepack's fp32 copy for int8 rows
# and int4 (4 bytes a weight against their 1 and 0.75, held), else wide_mm's tiles (no copy). On
# that Xeon, 128 and 512 rows through a 2048×5632 matrix: the tiles took a little longer than the
# copy, and less than widening the whole matrix at each call (the fallback before them). Where the
# CPU has AMX, int4 and int8 values in groups of 32 skip both: their exact products run on the
# tile unit (wide_mm(amx=True)), whose bf16 multiply-adds outrun fp32's FMAs even at three per
# product; so do the groups of 16 of Q6_K, at six, and of Q3_K and Q2_K, at three.
#
# Asked for (RunConfig.activations "int8": swap_quantized's round_x), int4 and grouped int8 layers
# round each 32 of x to 8 bits and multiply in integers (int4_x8_mm, int8g_x8_mm): llama.cpp's
# arithmetic. Where the fp32 loops are compute-bound (int4, six-bit values) a step gets faster,
# and a prefill of int4 or int8 values skips the widening; the sums are no longer those of the
# file's weights, so the plan never chooses it.

def uses_native(layer: nn.Module, dtype: torch.dtype, native: bool | None) -> bool:
    """Whether a stored layer runs the C++ kernels: fp32 activations on a CPU, rows a multiple of 32
    long, int8 groups 16 or 32 long, and the kernels built (``native`` None: build them if they
    can be)."""
    fits = (layer.weight.device.type == "cpu" and dtype == torch.float32
            and layer.in_features % 32 == 0
            and not (isinstance(layer, quantize.Int8Linear) and layer.group not in (None, 16, 32)))
    return fits and (native_kernels() if native is None else native)


def kernel_scales(layer: nn.Module):
    """A stored layer's group scales and minimums as the C++ kernels read them: a GGUF's fp16 and
    int8 ones kept (widened exactly as they are read: half or a quarter of fp32's bytes), any
    other as fp32."""
    for name in safetensors_io.SCALES:
        if (t := getattr(layer, name)) is not None:
            setattr(layer, name,
                    (t if t.dtype in (torch.float16, torch.int8) else t.float()).contiguous())


def wide_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A many-row pass of a stored layer, bias aside: compute-bound, so oneDNN's matrix-matrix
    kernel on prepack's fp32 copy of the dequantized weights where the model keeps one (a prefill
    as fast as fp32's, several times faster than widening every matrix at every call),
    else wide_mm's tiles or AMX (a layer on the C++ kernels), else the weights widened for this
    call."""
    packed = packed_weight(layer)
    if packed is not None and not torch.is_grad_enabled():
        return prepacked_linear(x, packed)
    if layer.native and x.dtype == torch.float32:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if isinstance(layer, quantize.HalfLinear):
            y = wide_mm(rows, layer.weight)
        else:
            y = wide_mm(rows, layer.weight, layer.weight_scale, layer.weight_min, layer.group or 0,
                        layer.weight_scale_d, layer.weight_min_d, amx=True,
                        values=getattr(layer, "weight_values", None))
        return y.reshape(*x.shape[:-1], -1)
    return F.linear(x, layer.dequantized().to(x.dtype))


def tiled_prefill(layer: nn.Module) -> bool:
    """Whether a layer on the C++ kernels runs its prefills without an fp32 copy even where prepack
    could give it one: int8 in groups and 16-bit weights, whose point is their bytes, on wide_mm's
    tiles; int4 with x rounded to 8 bits, on its integer products."""
    return isinstance(layer, HalfLinear) or (isinstance(layer, Int8Linear)
                                             and layer.group is not None) or \
        (isinstance(layer, Int4Linear) and layer.round_x)


class Int8Linear(quantize.Int8Linear):
    """quantize.Int8Linear on int8_mm (a scale per row) or int8g_mm (per group) where ``native``;
    without them, inside a compiled one-token step, a layer with a scale per row runs `matvec_sum`,
    which inductor fuses into one loop that widens each int8 weight as it reads it. ``onednn``:
    prepack's fp32 copy for prefills (rows only). ``round_x`` (groups only): int8g_x8_mm for
    one-row passes, and for prefills of int8 values (six-bit ones widen faster into wide_mm's
    tiles: their prefills stay there, exact)."""
    native: bool = False
    round_x: bool = False
    onednn: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, dtype: torch.dtype, native: bool | None = None, round_x: bool = False):
        super().prepare(dtype)
        self.native = uses_native(self, dtype, native)
        if self.native and self.group is not None:
            self.weight = self.weight.contiguous()
            self.round_x = round_x
            kernel_scales(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.native and x.dtype == torch.float32:
            if rows >= quantize.PREFILL_ROWS and not (self.round_x and self.bits == 8):
                return quantize.with_bias(wide_linear(self, x), self.bias)
            flat = x.reshape(rows, -1).contiguous()
            grouped = int8g_x8_mm if self.round_x else int8g_mm
            y = (int8_mm(flat, self.weight, self.weight_scale) if self.group is None
                 else grouped(flat, self.weight, self.weight_scale, self.weight_min, self.group,
                              self.weight_scale_d, self.weight_min_d))
            return quantize.with_bias(y.reshape(*x.shape[:-1], -1), self.bias)
        if rows == 1 and self.group is None and x.device.type == "cpu" and \
                torch.compiler.is_compiling():
            return quantize.with_bias(matvec_sum(x, self.weight, self.weight_scale), self.bias)
        return super().forward(x)

    def extra_repr(self) -> str:
        return "x rounded to 8 bits" if self.round_x else ""


class Int4Linear(quantize.Int4Linear):
    """quantize.Int4Linear on int4_mm (``native``), which reads the portable layout itself: no
    tiled copy. ``onednn``: prepack's fp32 copy for prefills. ``round_x``: every pass, one row or
    a prefill's, on int4_x8_mm (x rounded to 8 bits: asked for, not exact), but for a layer whose
    nibbles index a table (IQ4: int4_x8_mm's integers are the nibbles themselves)."""
    native: bool = False
    round_x: bool = False
    onednn: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, dtype: torch.dtype, native: bool | None = None, round_x: bool = False):
        self.native = uses_native(self, dtype, native)
        if not self.native:
            return super().prepare(dtype)
        self.dtype, self.round_x = dtype, round_x and self.weight_values is None
        self.weight = self.weight.contiguous()
        kernel_scales(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.native and x.dtype == torch.float32:
            if rows >= quantize.PREFILL_ROWS and not self.round_x:
                return quantize.with_bias(wide_linear(self, x), self.bias)
            args = (x.reshape(rows, -1).contiguous(), self.weight, self.weight_scale,
                    self.weight_min, self.group, self.weight_scale_d, self.weight_min_d)
            y = int4_x8_mm(*args) if self.round_x else int4_mm(*args, self.weight_values)
            return quantize.with_bias(y.reshape(*x.shape[:-1], -1), self.bias)
        return super().forward(x)

    def extra_repr(self) -> str:
        # in the compiled step's key (AheadOfTime.path): the two products are different steps
        return "x rounded to 8 bits" if self.round_x else ""


class HalfLinear(quantize.HalfLinear):
    """quantize.HalfLinear on half_mm (``native``): each 16-bit weight widened in registers as it
    streams, 2 bytes read a weight. Without it, inside a compiled one-token step, on `matvec_sum`
    (inductor's loop widens each weight as it reads it, as for a float model's)."""
    native: bool = False

    def prepare(self, dtype: torch.dtype, native: bool | None = None):
        super().prepare(dtype)
        self.native = uses_native(self, dtype, native)
        if self.native:
            self.weight = self.weight.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.native and x.dtype == torch.float32:
            if rows >= quantize.PREFILL_ROWS:
                return quantize.with_bias(wide_linear(self, x), self.bias)
            y = half_mm(x.reshape(rows, -1).contiguous(), self.weight)
            return quantize.with_bias(y.reshape(*x.shape[:-1], -1), self.bias)
        if rows == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
            return quantize.with_bias(matvec_sum(x, self.weight), self.bias)
        return super().forward(x)


FAST = {quantize.Int8Linear: Int8Linear, quantize.Int4Linear: Int4Linear,
        quantize.HalfLinear: HalfLinear}


def swap_quantized(model: nn.Module, dtype: torch.dtype, native: bool | None = None,
                   round_x: bool = False) -> nn.Module:
    """Give every stored layer (still in quantize.py's portable layout: prepare not called) its
    fast form, holding the same tensors, prepared for ``dtype`` activations (``native``:
    uses_native's; ``round_x``: int4 and grouped int8 layers with x rounded to 8 bits, on
    int4_x8_mm and int8g_x8_mm). Idempotent."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) not in FAST:
                continue
            bias = child.bias is not None
            with torch.device("meta"):
                if isinstance(child, quantize.Int4Linear):
                    if child.tiled is not None:
                        raise ValueError("swap_quantized needs unprepared layers: "
                                         "quantize with prepare=False")
                    fast = Int4Linear(child.in_features, child.out_features, child.group, bias,
                                      has_min=child.weight_min is not None)
                elif isinstance(child, quantize.Int8Linear):
                    fast = Int8Linear(child.in_features, child.out_features, child.group,
                                      child.weight_min is not None, bias, bits=child.bits)
                else:
                    fast = HalfLinear(child.in_features, child.out_features, child.weight.dtype,
                                      bias)
            for key, buffer in child.named_buffers(recurse=False):
                setattr(fast, key, buffer)
            if isinstance(fast, (Int4Linear, Int8Linear)):
                fast.prepare(dtype, native, round_x)
            else:
                fast.prepare(dtype, native)
            setattr(parent, name, fast)
    return model


# ----------------------------------------------------------------------------
# Prepacked weights: the layout oneDNN wants, made once.

def prepack(model: nn.Module, copies: bool = True) -> nn.Module:
    """Lay out a CPU model's weights once: every weight a decode step streams moves to 2-MiB pages
    (huge_pages, below), and with ``copies`` every big Linear also gets a copy in oneDNN's blocked
    layout for `linear`'s eager inference. Handed a row-major W, oneDNN reorders it on every call
    over more than one position: a product over 4 rows takes several times one row's time, and
    little more on a weight reordered once (`python kernels.py` times 1, 4 and 11 rows both ways).
    With the copy, checking 4 speculated guesses costs about one step; the values are bitwise
    equal. The price is a second copy (+135M · 4 B ≈ 540 MB for SmolLM2 in fp32): the compiled
    step, quantization and checkpoints read the plain one. A layer keeps its copy only while its
    weight is the same tensor (tying swaps it: prepack again);
    in-place changes (an optimizer step) are not noticed, so train with F.linear (grad enabled) or
    not prepacked. Embedding tables left in a mapped file take memory for the rows read
    (rows_on_demand)."""
    bf16_ok, streamed = ONEDNN and bf16_supported(torch.device("cpu")), []
    swap_linears(model)
    for m in model.modules():
        w, native = getattr(m, "weight", None), getattr(m, "native", False)
        if not (native or isinstance(m, nn.Linear)) or w is None or w.device.type != "cpu" \
                or packed_weight(m) is not None:
            continue
        if native:
            # a stored layer on the C++ kernels (quantize.py): its one-row passes read the small
            # weights; a prefill (compute-bound) gets the same values widened to fp32, blocked once,
            # unless it runs wide_mm's tiles
            streamed += list(m.buffers(recurse=False))
            if copies and ONEDNN and not tiled_prefill(m):
                m.onednn = (w, torch.ops.mkldnn._reorder_linear_weight(m.dequantized().float(), 16))
            continue
        streamed.append(w)          # what a compiled step reads
        if copies and ONEDNN and w.numel() >= ONEDNN_MIN and (w.dtype == torch.float32
                                                               or w.dtype == torch.bfloat16
                                                               and bf16_ok):
            # the size hint (16 rows) picks the blocking; any number of rows can use it
            m.onednn = (w, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16))
    huge_pages(streamed)
    # embedding tables, unless tied to a weight a step streams: a step reads one row of them
    whole = {t.data_ptr() for t in streamed}
    tables = [t for m in model.modules() if isinstance(m, (nn.Embedding, quantize.StoredEmbedding))
              for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    rows_on_demand([t for t in tables if t.data_ptr() not in whole])
    return model


HUGE_PAGE = 2 << 20


def huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Move CPU tensors (in place: every reference sees the move) into one buffer of 2-MiB pages,
    where Linux's transparent huge pages allow it on request. A decode step streams every weight
    once, from 4-KiB pages: SmolLM2's int4 weights (106M · 0.75 B + its int8 head's 28M · 1 B ≈
    108 MB) fill 26,000 of them, a TLB miss each and a stop for the hardware prefetcher at each
    page's end; 2-MiB pages, 54. Timed in alternating processes on a Zen 4, they raised the median
    tok/s of SmolLM2's int4 step a little and of TinyLlama's bf16 step by half. Returns the
    tensors moved. A tensor copied out of a memory-mapped file (a checkpoint) gives its pages back
    as it moves (file_pages_out), a piece at a time (COPY_PIECE), so the weights are resident
    once, not twice, even for a moment."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if not tensors or not hasattr(mmap, "MADV_HUGEPAGE") or not thp.exists() \
            or "[never]" in thp.read_text():
        return []
    # each aligned to 4,096 bytes
    sizes = [-(-t.numel() * t.element_size() // 4096) * 4096 for t in tensors]
    arena = mmap.mmap(-1, sum(sizes) + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # before the first write: pages become huge as they fault in
    arena.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(arena, dtype=torch.uint8)     # keeps the mapping alive
    offset = -flat.data_ptr() % HUGE_PAGE
    files = file_mappings()
    with torch.no_grad():
        for t, size in zip(tensors, sizes):
            nbytes = t.numel() * t.element_size()
            view = flat[offset:offset + nbytes].view(t.dtype).view(t.shape)
            source = (t.data_ptr(), nbytes)
            if t.is_contiguous():   # a piece at a time: the file's pages out before the next
                src, dst = t.reshape(-1).view(torch.uint8), flat[offset:offset + nbytes]
                for i in range(0, nbytes, COPY_PIECE):
                    dst[i:i + COPY_PIECE].copy_(src[i:i + COPY_PIECE])
                    file_pages_out(source[0] + i, min(COPY_PIECE, nbytes - i), files)
            else:
                view.copy_(t)
            t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
            file_pages_out(*source, files)      # the pages the pieces' edges shared
            offset += size
    return tensors


# huge_pages copies a tensor this many bytes at a time: a mapped file's pages are resident only
# while their piece is copied, not the whole of the largest tensor beside the copy (an LM head of
# 49,152 · 2,048 weights in six bits: 49,152 · 2,048 · 0.75 B ≈ 75 MB)
COPY_PIECE = 8 << 20


def file_mappings() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's mappings of regular files
    (/proc/self/maps), or none where there is no such file."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            spans.append((int(start, 16), int(end, 16), int(fields[2], 16), fields[5]))
    return spans


MADV_PAGEOUT = 21       # Linux 5.4; Python's mmap module does not name it


def whole_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(start, end) of the 4-KiB pages wholly inside [ptr, ptr + nbytes): advice about a page
    must not reach a neighbour's bytes."""
    return -(-ptr // 4096) * 4096, (ptr + nbytes) // 4096 * 4096


def file_pages_out(ptr: int, nbytes: int, files: list[tuple]) -> None:
    """Give back the whole pages of [ptr, ptr + nbytes) where they lie in a file mapping (a
    safetensors file stays mapped while any of its tensors lives): their bytes copied (huge_pages)
    or left to be read row by row (rows_on_demand), they leave this process's resident set, and a
    later read faults them in again from the file. MADV_PAGEOUT reclaims them from the file's
    cache too, but skips what it cannot reclaim now, such as a large folio the range covers only
    in part (a file just written is cached in 2-MiB folios, which cross tensors' edges): the
    bench twice found hundreds of MB of a conversion's pages still mapped beside their copy.
    MADV_DONTNEED then unmaps whatever is left. On a private mapping it would drop a page
    written since it was mapped, but nothing writes a checkpoint's weights (and huge_pages holds
    their copy). A kernel without MADV_PAGEOUT refuses it: the unmap still applies."""
    start, end = whole_pages(ptr, nbytes)
    if end > start and any(a <= start and end <= b for a, b, *_ in files):
        libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)
        libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


def rows_on_demand(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Let tables read a few rows at a time (embeddings) take less memory for the rows read,
    where they are views of a mapped file (a checkpoint's or a GGUF conversion's). Reading a
    byte of a mapped file maps what the file's cache holds around it: a whole large folio where
    the file was written or read ahead in big pieces, hundreds of times a row of a GGUF's Q4_K
    table (1,152 B), so a prompt of a few hundred tokens made most of such a table resident.
    Each table's part of the file's cache is dropped (POSIX_FADV_DONTNEED: clean pages no other
    process maps) and read again without read-ahead (POSIX_FADV_RANDOM on the descriptor that
    reads it, once per start), which caches it in single pages: a row read then maps the cached
    pages of its fault-around window (16 pages), not a folio. Read back, not left to each lookup
    to fault in from the disk: a decode step that met a new token waited on the disk for its
    row. The table is marked random access too (MADV_RANDOM: pages the system evicts later come
    back alone), and the pages this process held of it are given back (file_pages_out). Pages
    the file has not written back yet stay as they are (a conversion's, in its first start).
    Returns the tensors so marked."""
    files, done = file_mappings(), []
    for t in tensors:
        start, end = whole_pages(t.data_ptr(), t.numel() * t.element_size())
        span = next((f for f in files if f[0] <= start and end <= f[1]), None)
        if t.device.type != "cpu" or end <= start or span is None:
            continue
        libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_RANDOM)
        file_pages_out(start, end - start, files)
        try:
            fd = os.open(span[3], os.O_RDONLY)
        except OSError:         # the file was replaced or removed: its pages stay as they are
            continue
        try:
            offset = span[2] + start - span[0]
            os.posix_fadvise(fd, offset, end - start, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, offset, end - start, os.POSIX_FADV_RANDOM)
            buffer = bytearray(1 << 20)
            for at in range(offset, offset + end - start, len(buffer)):
                os.preadv(fd, [memoryview(buffer)[:offset + end - start - at]], at)
            done.append(t)
        except OSError:         # a file system without this advice: its cache as it was
            pass
        finally:
            os.close(fd)
    return done


@functools.cache
def libc():
    return ctypes.CDLL(None, use_errno=True)


def packed_weight(layer: nn.Module) -> torch.Tensor | None:
    """The layer's copy from prepack, if it is a copy of its current weight."""
    packed = getattr(layer, "onednn", None)
    return packed[1] if packed is not None and packed[0] is layer.weight else None


def prepacked_bytes(model: nn.Module) -> int:
    """The memory prepack's copies take (the runner prints it next to the weights')."""
    packed = (packed_weight(m) for m in model.modules())
    return sum(p.numel() * p.element_size() for p in packed if p is not None)


def prepacked_linear(x: torch.Tensor, packed: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ (+ bias) on prepack's blocked copy of W (oneDNN)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# ----------------------------------------------------------------------------
# Paged attention in place: a decode step's attention read straight from the
# block pool (kvcache.PagedKVCache), on a GPU.
#
# The gather path copies every row's blocks into a contiguous (B, H_kv, L, d) tensor per
# layer, then attends: the K/V bytes cross memory three times (read, write, read again).
# This kernel reads them once: for key j of row b it reads slot j % block_size of block
# tables[b, j // block_size], so rows of different lengths share one launch, no padding read.
# One program per (row, KV head); the G query heads of the group are the rows of its tile
# (padded to 16), with flash_kernel's running (max, sum) loop. Keys 0 … p are visible
# to a query at position p (within the window, if any). Quantized pools keep the gather path.

@jit
def paged_decode_kernel(Q, K, V, Out, Tables, Pos, sq_b, sq_h, sk_blk, sk_slot, sk_h, so_b, so_h,
                        st_b, Hkv, G, block_size, window, scale, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                        IEEE: tl.constexpr):
    b, kv = tl.program_id(0) // Hkv, tl.program_id(0) % Hkv
    g, dims = tl.arange(0, BLOCK_M), tl.arange(0, D)
    h = kv * G + g
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + dims[None, :], mask=g[:, None] < G, other=0.)
    pos = tl.load(Pos + b)
    lo = tl.maximum(pos - window + 1, 0) if WINDOW else 0
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, pos + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = j <= pos
        block = tl.load(Tables + b * st_b + j // block_size, mask=ok, other=0)
        # K and V share strides
        at = block * sk_blk + (j % block_size) * sk_slot + kv * sk_h
        k = tl.load(K + at[:, None] + dims[None, :], mask=ok[:, None], other=0.)
        v = tl.load(V + at[:, None] + dims[None, :], mask=ok[:, None], other=0.)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else "tf32") * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        # every row sees key `pos`: m_new is finite
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        shrink = tl.exp(m - m_new)
        s = s * shrink + tl.sum(p, 1)
        acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v,
                                             input_precision="ieee" if IEEE else "tf32")
        m = m_new
    tl.store(Out + b * so_b + h[:, None] * so_h + dims[None, :],
             (acc / s[:, None]).to(Out.dtype.element_ty), mask=g[:, None] < G)


def paged_reader(device, codec=None):
    """How an engine's pool on ``device`` serves a one-token pass (kvcache.PagedKVCache's
    ``in_place``): paged_decode on CUDA for plain rows with Triton installed, kernels.cpp's
    paged_attention on a CPU with the kernels built, else None (the gather)."""
    device = torch.device(device)
    if codec is not None:
        return None
    if device.type == "cuda" and triton is not None:
        return paged_decode
    if device.type == "cpu" and native_kernels(quiet=True):
        return paged_attention
    return None


def paged_attention(q, k_pool, v_pool, tables, positions, window: int | None = None):
    """One query per row against a paged pool, in place, on a CPU (kernels.cpp): paged_decode's
    arguments, fp32 or bf16 pools. The same chunks in the same order as decode_attention on the
    gathered keys, so the same bits, without the gather: a padded copy of every row's keys and
    values, each step, in every layer."""
    return torch.ops.nanoinfer.paged_attention(q, k_pool, v_pool, tables, positions, window or 0)


def paged_decode(q, k_pool, v_pool, tables, positions, window: int | None = None,
                 block_n: int = 64):
    """One query per row against a paged pool, in place. q (B, H, 1, d); k_pool, v_pool
    [num_blocks, block_size, H_kv, d] (one layer's, with this step's K/V already written);
    tables (B, n) int block ids; positions (B,) each row's query position -> (B, H, 1, d)."""
    check_triton(q.device)
    B, H, _, d = q.shape
    block_size, Hkv = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty_like(q)
    paged_decode_kernel[(B * Hkv,)](
        q, k_pool, v_pool, out, tables, positions.contiguous(), q.stride(0), q.stride(1),
        *k_pool.stride()[:3], out.stride(0), out.stride(1), tables.stride(0), Hkv, H // Hkv,
        block_size, window or 0, d ** -0.5, D=d,
        BLOCK_M=max(16, 1 << (H // Hkv - 1).bit_length()), BLOCK_N=block_n,
        WINDOW=window is not None, IEEE=q.dtype == torch.float32)
    return out


# ----------------------------------------------------------------------------
# Compiling a decode step.

# inductor's settings for a CPU step: compile_step says why
CPU_OPTIONS = {"realize_opcount_threshold": 0}


def compile_step(step, device: torch.device = torch.device("cpu"), folder: Path | None = None,
                 build: bool = True):
    """torch.compile a one-token decode step whose shapes never change (a static cache), so it
    compiles once, for the device its weights are on.

    On CUDA: mode="reduce-overhead": the step's kernels are recorded once as a CUDA graph and
    replayed with one launch per token (a small model's few hundred launches, microseconds each
    from Python, rival their work); the cache's tensors are marked static (static_address) so
    writing into them does not stop the replay. cuBLAS does the matrix-vector products there.

    On a CPU inductor emits C++ loops that fuse the elementwise work between matmuls (RMSNorm, RoPE,
    SiLU·up, residual adds), called from C++ (cpp_wrapper: called from Python, they were a fifth
    of a SmolLM2 bf16 step).
    realize_opcount_threshold 0 stores every reused elementwise result (a few KB per token):
    otherwise inductor inlines RMSNorm into the next matrix-vector loop and redoes it for every
    weight row (several times slower on that matrix). Not `freezing` (it would fold W.float() into
    an fp32 copy of every weight), not max_autotune (no faster).

    Given a ``folder``, a CPU step is compiled ahead of time instead, with the same settings
    (AheadOfTime below): built once, loaded by every later start (``build=False``: loaded if built,
    else eager; another process builds it). Without one, torch.compile compiles it again at every
    start."""
    if torch.device(device).type == "cuda":
        graphed, marked = (torch.compile(step, mode="reduce-overhead", dynamic=False,
                                         fullgraph=True),
                           weakref.WeakSet())

        def replay(tokens, positions, mask, cache, *rest):
            if cache not in marked:     # its K/V are written in place by the replayed graph
                marked.add(cache)
                for t in cache.k + cache.v:
                    static_address(t)
            return graphed(tokens, positions, mask, cache, *rest)
        return replay
    if folder is not None and torch.device(device).type == "cpu":
        return AheadOfTime(step, folder, build)
    compiled = torch.compile(step, dynamic=False, fullgraph=True,
                             options={"cpp_wrapper": True, **CPU_OPTIONS})

    def call(tokens, positions, mask, cache, *rest):
        live = live_rows(mask, cache)
        if live is False:
            return step(tokens, positions, mask, cache, *rest)
        if live:
            # one graph for every length, not one each
            torch._dynamo.mark_dynamic(mask, mask.dim() - 1, min=2, max=cache.capacity - 1)
        return compiled(tokens, positions, mask, cache, *rest)
    return call


def live_rows(mask: torch.Tensor | None, cache) -> bool | None:
    """For a static cache whose mask covers its live rows only (kvcache.StaticCache.live): whether
    this call's length is one a compiled step covers, 2 to all rows but one (export fixes lengths 0
    and 1, and all rows make the slice a no-op); those others run the eager step. None for any other
    call (fixed shapes)."""
    if mask is None or not getattr(cache, "live", False):
        return None
    return 2 <= mask.shape[-1] < cache.capacity


class AheadOfTime:
    """A model's one-token step compiled once into a file that later starts load.

    torch.compile keeps its result in the process: every start traces the step again and rebuilds
    the wrapper. AOTInductor exports the step (torch.export), compiles it to a shared library with
    compile_step's settings and packages it as a .pt2 file; a later start dlopens it, and each call
    runs with no Python guards (`python bench.py compiled-start` measures both). A package holds one
    set of shapes: each variant of a call (a cache size, last_only, hidden, features) gets its own
    file, built at its first call.

    The weights are not in the package (package_constants_in_so off): the library reads the model's
    own tensors (user_managed: no copy), so the file is a few MB of code, not a second copy of the
    weights (135M · 4 B ≈ 540 MB for SmolLM2 in fp32), and one package serves every checkpoint of
    the same shapes. The library keeps the pointers it was handed at a variant's first call: if a
    weight is swapped for another tensor later (tying, quantizing), compile again.

    The cache's K/V are inputs the step writes in place, the current ones at each call (a fork
    replaces them). The file's name is a digest of everything the compiled code depends on, so a
    different model, dtype, context, attention, cache codec, torch version, CPU or source of the
    step never loads a wrong one: the call's shapes and flags, every weight's name, shape and dtype,
    the model's config and module tree, and the source of the step's module and of the project
    modules it imports."""

    def __init__(self, step, folder: Path, build: bool = True):
        self.step, self.folder, self.build_missing = step, Path(folder), build
        self.model = step.__self__
        self.runners = {}           # variant -> loaded package
        self.handed = []            # the weights each runner reads: kept alive
        self.log: list[str] = []    # what each variant cost: loaded or compiled, in seconds
        self.built: list[Path] = []  # the packages this object compiled (the others were loaded)
        # build=False: variant -> the package not on disk; those calls run eagerly
        self.missing = {}
        # called with the package's path before a build (minutes): the runner says so
        self.announce = None

    def __call__(self, tokens, positions, mask, cache, last_only, features=None, hidden=False):
        # a static cache's live rows: one package for every length
        live = live_rows(mask, cache)
        keys = None if mask is None else (*mask.shape[:-1],
                                          mask.shape[-1] if live is None else "live")
        # the cache's class last: its code is traced into the step too (path reads it)
        variant = (tuple(tokens.shape), keys, cache.k[0].shape,
                   cache.k[0].dtype, len(cache.k), repr(cache.codec), last_only, hidden,
                   None if features is None else (features.shape, features.dtype), type(cache))
        runner = self.runners.get(variant)
        if variant in self.missing and self.missing[variant].exists():   # another process built it
            del self.missing[variant]
        # built (or loaded) even by a call that then runs eagerly: a warm-up's
        if runner is None and variant not in self.missing:
            call = (tokens, positions, mask, cache, last_only, features, hidden)
            path = self.path(variant)
            if self.build_missing or path.exists():
                runner = self.runners[variant] = self.load(variant, call, path)
            else:
                self.missing[variant] = path
        if runner is None or live is False:
            return self.step(tokens, positions, mask, cache, last_only, features, hidden)
        return runner(tokens, positions, mask, *cache.k, *cache.v, features)

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by the names the package uses (tied ones under each
        name)."""
        found = dict(self.model.named_parameters("model", remove_duplicate=False))
        found.update(self.model.named_buffers("model", remove_duplicate=False))
        return found

    def path(self, variant) -> Path:
        """Where this variant's package lives: its name is the digest of what its code depends
        on."""
        m = self.model
        home = Path(sys.modules[type(m).__module__].__file__).parent
        # ids: not in the step
        config = {k: v for k, v in vars(m.config).items() if k not in ("eos_ids", "bos_id")}
        code = step_code(m, variant[-1])
        key = [repr(variant), repr(config), str(m), torch.__version__, platform.machine(),
               torch.backends.cpu.get_cpu_capability()]
        key += [f"{f.__module__}.{f.__qualname__}" for f in code]
        key += [f"{k} {tuple(t.shape)} {t.dtype}" for k, t in self.weights().items()]
        digest = hashlib.sha256("\n".join(key).encode())
        modules = {sys.modules[f.__module__] for f in code}
        for source in sorted(set().union(*(project_sources(mod, home) for mod in modules))):
            digest.update(source.read_bytes())
        return self.folder / f"{type(m).__name__.lower()}-{digest.hexdigest()[:16]}.pt2"

    def load(self, variant, call, path: Path):
        """Load this variant's package (at ``path``), compiling it first if no earlier run did."""
        t0 = time.perf_counter()
        if not path.exists():
            if self.announce is not None:
                self.announce(path)
            self.build(path, call)
            self.built.append(path)
            self.log.append(f"compiled (once) in {time.perf_counter() - t0:.1f} s: {path}")
            t0 = time.perf_counter()
        # A package built where a step ran kernels.cpp calls its operators: they must be
        # registered before it loads, which a fresh process has not done yet.
        native_kernels(quiet=True)
        # The package's own C++ loader, as torch._inductor.aoti_load_package wraps it: importing
        # torch._inductor to call that would hold its compiler (sympy, triton) in a runner's
        # memory for nothing a built step runs.
        runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        weights = self.weights()
        own = [k for k in runner.get_constant_fqns() if k not in weights]
        if own:
            # tensors inductor made at compile time (aten's int4 kernel with bf16 activations does)
            raise ValueError(f"the compiled step made tensors of its own ({own[0]}, ...), "
                             f"which a package without weights cannot hold: "
                             f"run this configuration without --compile")
        self.handed.append({k: weights[k] for k in runner.get_constant_fqns()})
        runner.load_constants(self.handed[-1], False, True, True, False)  # active, checked, ours
        self.log.append(f"compiled step loaded from cache in {time.perf_counter() - t0:.2f} s")
        # The inputs in the order export flattened them, without the package's own Python call: that
        # one parses its call spec and walks the 60 K/V tensors as a tree at every step (a few
        # percent of a SmolLM2 step).
        out = torch.utils._pytree.treespec_loads(runner.get_call_spec()[1])
        return lambda *inputs: torch.utils._pytree.tree_unflatten(
            runner.boxed_run([t for t in inputs if t is not None]), out)

    def build(self, path: Path, call):
        """torch.export the step on stand-in tensors of the call's shapes, then AOTInductor."""
        tokens, positions, mask, cache, last_only, features, hidden = call
        # another process may build it too
        part = path.with_name(f"{path.stem}.{os.getpid()}.pt2")
        path.parent.mkdir(parents=True, exist_ok=True)
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # torch 2.13 pickles its spec via a deprecated check
            warnings.simplefilter("ignore", FutureWarning)
            like = [None if t is None else torch.zeros_like(t)
                    for t in (tokens, positions, mask, features)]
            live = None
            if live_rows(mask, cache) is not None:      # the keys read: any length live_rows allows
                like[2] = mask.new_zeros(*mask.shape[:-1],
                                         min(max(mask.shape[-1], 2), cache.capacity - 1))
                live = {mask.dim() - 1: torch.export.Dim("live", min=2, max=cache.capacity - 1)}
            args = (*like[:3], [torch.zeros_like(t) for t in cache.k],
                    [torch.zeros_like(t) for t in cache.v], like[3])
            shapes = (None, None, live, [None] * len(cache.k), [None] * len(cache.v), None)
            program = torch.export.export(StepModule(self.step, cache, last_only, hidden), args,
                                          strict=False, dynamic_shapes=shapes)
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(part),
                inductor_configs={**CPU_OPTIONS, "aot_inductor.package_constants_in_so": False})
        os.replace(part, path)


class StepModule(nn.Module):
    """The step for torch.export: the model a submodule (its weights the package's constants,
    model.*), the cache's K/V lists the inputs while it runs."""

    def __init__(self, step, cache, last_only: bool, hidden: bool):
        super().__init__()
        self.model, self.step, self.cache, self.flags = (step.__self__, step, cache,
                                                         (last_only, hidden))

    def forward(self, tokens, positions, mask, k, v, features):
        cache, kept = self.cache, (self.cache.k, self.cache.v)
        cache.k, cache.v = list(k), list(v)
        try:
            return self.step(tokens, positions, mask, cache, self.flags[0], features, self.flags[1])
        finally:
            cache.k, cache.v = kept


def step_code(llama: nn.Module, cache_type=None) -> list:
    """What a model's step runs, by the classes and functions that hold the code: every module's
    class (kernels.Linear, a quantized layer), each layer's attention function and the functions it
    wraps (native_decode's), and the cache's class."""
    code = {type(m) for m in llama.modules()} | ({cache_type} if cache_type is not None else set())
    todo = [m.attend for m in llama.modules() if callable(getattr(m, "attend", None))]
    while todo:
        f = todo.pop()
        if f not in code and hasattr(f, "__module__") and hasattr(f, "__qualname__"):
            code.add(f)
            todo += [c.cell_contents for c in (getattr(f, "__closure__", None) or ())
                     if callable(c.cell_contents)]
    return sorted(code, key=lambda f: f"{f.__module__}.{f.__qualname__}")


def project_sources(module, home: Path) -> set[Path]:
    """The files of ``module`` and of every module in ``home`` that it imports, directly or not: the
    modules among its globals and those its imported names come from
    (``from kvcache import StaticCache``)."""
    found, todo = set(), [module]
    while todo:
        m = todo.pop()
        path = Path(getattr(m, "__file__", None) or "/")
        if path.parent == home and path not in found:
            found.add(path)
            todo += [v if inspect.ismodule(v)
                     else sys.modules.get(getattr(v, "__module__", None) or "")
                     for v in vars(m).values()]
    return found


def static_address(t: torch.Tensor) -> torch.Tensor:
    """A preallocated tensor a compiled step writes into (a static cache's K/V): on CUDA, say so to
    torch.compile, or its CUDA graph is skipped for mutating an input."""
    if t.device.type == "cuda":
        torch._dynamo.mark_static_address(t)
    return t


def quantized_table(n: int = 1536, k: int = 576, stream: int = 64 << 20):
    """ns per weight of x·Wᵀ from DRAM (copies of W past the L3 cache) at 1 and 5 rows of x:
    fp32 (oneDNN, prepacked), aten's int8 and int4 kernels and ours (int4: groups of 32)."""
    import results
    q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s, lo = torch.rand(n, k // 32) * 0.01, torch.rand(n, k // 32) * -0.05
    tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.stack([q4 & 15, q4 >> 4], -1).reshape(n, k).to(torch.int32), 1)
    zeros = torch.stack([s, lo + 8 * s], -1).transpose(0, 1).contiguous()
    q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01
    fp32 = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k), 16)
    kinds = {   # name: (bytes per weight, the tensors one copy holds, the call on a copy)
        "fp32, oneDNN prepacked": (4, (fp32,), lambda x, w: prepacked_linear(x, w)),
        "int8, aten": (1, (q8, s8), lambda x, q, sc: torch.ops.aten._weight_int8pack_mm(x, q, sc)),
        "int8, kernels.int8_mm": (1, (q8, s8), int8_mm),
        "int4, aten": (0.75, (tiled, zeros),
                       lambda x, t, z: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t, 32, z)),
        "int4, kernels.int4_mm": (0.75, (q4, s, lo), lambda x, q, a, b: int4_mm(x, q, a, b, 32)),
    }
    rows = []
    with torch.inference_mode():
        for name, (size, tensors, call) in kinds.items():
            copies = [[t.clone() for t in tensors]
                      for _ in range(max(2, int(stream / (size * n * k))))]
            row = [name, size]
            for m in (1, 5):
                x = torch.randn(m, k)
                seconds = best_seconds(lambda: [call(x, *c) for c in copies], torch.device("cpu"))
                row.append(f"{seconds / (len(copies) * n * k) * 1e9:.3f}")
            rows.append(row + [f"{size / float(row[2]):.1f}"])
    return results.Table(f"x·Wᵀ with W {n}×{k} (SmolLM2's MLP) read from DRAM, ns per weight "
                         f"(best of 5 passes over {stream >> 20} MB of copies), "
                         f"{torch.get_num_threads()} threads",
                         ["kernel", "bytes per weight", "1 row", "5 rows", "GB/s at 1 row"], rows)


if __name__ == "__main__":
    import argparse
    import results
    ap = argparse.ArgumentParser(description="the linear layers' fast paths, timed")
    ap.add_argument("--save", action="store_true", help="write results/kernels-linear.json")
    args = ap.parse_args()
    dev = pick_device("cpu")
    print(f"device {dev}, {torch.get_num_threads()} threads; oneDNN: {ONEDNN}; computes bf16: "
          f"{bf16_supported(dev)}")
    layer, packed = nn.Linear(2048, 5632, bias=False), prepack(nn.Linear(2048, 5632, bias=False))
    rows, rounds = [], 20
    with torch.inference_mode():
        for n in (1, 4, 11):          # one decode step; the passes speculative decoding verifies
            x = torch.randn(n, 2048)
            # the three take turns, call by call: a burst of load slows each alike
            seconds = results.alternate({"F.linear": lambda: F.linear(x, layer.weight),
                                         "linear": lambda: linear(x, layer),
                                         "prepacked": lambda: linear(x, packed)}, rounds)
            ratios = [a / b for a, b in zip(seconds["F.linear"], seconds["prepacked"])]
            rows.append([n] + [results.spread(t, 1e3, 2) for t in seconds.values()]
                        + [results.spread(ratios, digits=2, unit="×")])
    table = results.Table(f"x·Wᵀ, W 5632×2048 fp32, ms per call: median (min–max) of {rounds} "
                          f"calls each, taken in turns after a warm-up",
                          ["rows of x", "F.linear", "kernels.linear", "kernels.linear, prepacked",
                           "F.linear / prepacked"], rows)
    print(table.markdown())
    tables = [table]
    if native_kernels():
        tables.append(quantized_table())
        print(tables[-1].markdown())
    if args.save:                 # the tracked results change only when asked
        print(f"saved {results.save('kernels-linear', 'kernels', tables)}")
