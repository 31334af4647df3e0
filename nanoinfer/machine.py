"""This machine, measured: what plan.choose decides from.

plan.py is a pure function of plain data (a Machine, a ModelInfo, a context); this file fills the
Machine in: the CPU's name and memory (or the GPU's), its C++ compiler, whether it computes bf16
natively, the read bandwidth a decode step streams at, and how fast a one-row product of the
model's MLP shape runs in each weight format (ns per weight). Measuring takes seconds; the result
is cached per CPU (or GPU), torch version, thread count and shape, so later starts read a file.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

import checkpoint
import kernels
import quantize
from plan import SIZES, Machine, Plan, Serving, choose, model_info

CALIBRATION_BYTES = 64 << 20   # weights streamed per format and pass: twice a big L3 (32 MB), so from DRAM


def find_compiler() -> str | None:
    """The C++ compiler a CPU compile needs: $CXX if set, else g++ or c++ on the PATH."""
    for name in filter(None, (os.environ.get("CXX"), "g++", "c++")):
        if shutil.which(name):
            return name
    return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30          # sysconf is POSIX; assume a small laptop elsewhere


def calibrate(shape: tuple[int, int], bf16: bool, reps: int = 5) -> dict[str, float]:
    """ns per weight of a one-row product with W of ``shape`` (the model's MLP), in fp32, bf16
    (where native: elsewhere it converts per element and is never chosen), int8 and int4 (each
    with fp32 activations, as the runner's eager step runs them). Enough copies of W to stream
    ~64 MB of each format per pass, so the kernel is measured reading DRAM, as in decoding (from a
    32 MB L3 the int4 kernel measured 0.05 ns/weight, from DRAM 0.08).
    The dtypes take turns and each call keeps its best of ``reps``: on a shared machine a descheduled
    thread stalls a call for a whole time slice, and that is the neighbour's cost, not the kernel's."""
    n, k = shape
    w, x = torch.randn(n, k) * 0.02, torch.randn(1, k)

    def copies(bytes_per_weight: float) -> int:
        return max(2, min(256, math.ceil(CALIBRATION_BYTES / (bytes_per_weight * n * k))))

    sets = {}
    for name in ("float32", "bfloat16") if bf16 else ("float32",):
        sets[name] = []
        for _ in range(copies(SIZES[name])):
            layer = nn.Linear(k, n, bias=False, device="meta")
            layer.weight = nn.Parameter(w.to(kernels.DTYPES[name], copy=True), requires_grad=False)
            sets[name].append(kernels.prepack(layer))
    if k % quantize.GROUP == 0:
        # as the runner runs them: on the C++ kernels where they build (kernels.swap_quantized)
        pair = nn.Sequential(quantize.Int8Linear.from_float(w), quantize.Int4Linear.from_float(w, quantize.GROUP))
        q8, q4 = kernels.swap_quantized(pair, torch.float32)
        sets["int8"] = [copy.deepcopy(q8) for _ in range(copies(1))]
        sets["int4"] = [copy.deepcopy(q4) for _ in range(copies(0.5 + 8 / quantize.GROUP))]
    best = {name: [float("inf")] * len(layers) for name, layers in sets.items()}
    with torch.inference_mode():
        for rep in range(reps + 1):           # the first round warms up (thread pool, kernel setup)
            for name, layers in sets.items():
                xd = x.to(kernels.DTYPES.get(name, torch.float32))
                for i, layer in enumerate(layers):
                    t0 = time.perf_counter()
                    kernels.linear(xd, layer)
                    if rep:
                        best[name][i] = min(best[name][i], time.perf_counter() - t0)
    return {name: sum(t) / (len(t) * n * k) * 1e9 for name, t in best.items()}


def probe_path(device: torch.device, name: str, shape) -> Path:
    key = f"v4-{device.type}-{name}-torch{torch.__version__}-{torch.get_num_threads()}t-{shape[0]}x{shape[1]}"
    return checkpoint.cache_root() / "plan" / (re.sub(r"[^\w.+-]+", "_", key) + ".json")


def probe(device: torch.device, shape: tuple[int, int] = (1536, 576)) -> Machine:
    """Measure this machine once (CPU: stream ~64 MB per weight format a few times, read 256 MB for
    the bandwidth: seconds, once) for a model whose MLP matrix is ``shape``;
    later calls read the result from the cache, keyed by the CPU model or GPU name, the torch version,
    the thread count and the shape. Delete ~/.cache/nanoinfer/plan to measure again."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else cpu_name() if device.type == "cpu" else device.type
    path = probe_path(device, name, shape)
    try:
        data = json.loads(path.read_text())
        return Machine(**{**data, "shape": tuple(data["shape"]) if data.get("shape") else None})
    except (OSError, ValueError, TypeError):
        pass
    bf16 = kernels.bf16_supported(device)
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else cpu_memory()
    timings = calibrate(shape, bf16) if device.type == "cpu" else {}
    bandwidth = kernels.read_bandwidth(device, 2**28)
    machine = Machine(device.type, name, bf16, cuda, memory, bandwidth, find_compiler(), torch.get_num_threads(),
                      timings, tuple(shape))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")          # two processes (torchrun) may probe at once
    tmp.write_text(json.dumps(asdict(machine), indent=1))
    os.replace(tmp, path)
    return machine


def plan_for(name: str, device: torch.device, ctx: int | None = None, answer_tokens: int | None = None,
             serving: Serving | None = None) -> Plan:
    """The runner's plan for model ``name`` (or the server's, ``serving``): its config, this machine
    measured at its MLP's shape, the rules."""
    info = model_info(name)
    return choose(probe(device, (info.config.intermediate_size, info.config.hidden_size)), info, ctx, answer_tokens,
                  serving)
