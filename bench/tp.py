"""`python bench.py tp` (tp.py): a decode step with 1 process and 2 ranks, and the time in
all-reduce."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import kernels
import kvcache
import model
import results
import tp
from bench.common import RANDOM_TINYLLAMA, model_dir
from nanoinfer.config import RunConfig
from nanoinfer.load import load_tp


def measure(name: str, dtype: str, prompt_tokens: int, steps: int, split: bool = True) -> dict:
    """One rank's decode steps on a static cache after a prompt_tokens prefill: the median
    step, the all-reduce time inside it, and (split) one all-reduce of hidden_size values
    alone. split=False: the plain model in this one process, for comparison."""
    cpu = torch.device("cpu")      # split: as the runner's --tp loads a rank (load_tp)
    llama = load_tp(RunConfig(name, cpu, kernels.DTYPES[dtype]), cpu)[0] if split else \
        model.load(name, "cpu", dtype)[0]
    c, stats, times, comm = llama.config, getattr(llama, "comm", tp.Comm()), [], []
    cache = kvcache.new_cache(llama, "static", prompt_tokens + steps + 1)
    with torch.inference_mode():
        llama(torch.arange(prompt_tokens)[None] % c.vocab_size, torch.arange(prompt_tokens), cache, last_only=True)
        for i in range(steps):
            pos = torch.tensor([cache.length])
            before, t0 = stats.seconds, time.perf_counter()
            llama(pos[None] % c.vocab_size, pos, cache, last_only=True)
            times.append(time.perf_counter() - t0)
            comm.append(stats.seconds - before)
        alone = []
        if split:
            x = torch.zeros(1, 1, c.hidden_size, dtype=llama.norm.weight.dtype)
            for _ in range(200):
                t0 = time.perf_counter()
                tp.collective(dist.all_reduce, x)
                alone.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "comm_s": statistics.median(comm),
            "calls": stats.calls // (steps + 1), "allreduce_s": statistics.median(alone or [0]),
            "weights": sum(tp.weight_bytes(llama)), "kv": cache.nbytes, "layers": c.n_layers,
            "threads": torch.get_num_threads()}


def bench_tp(models: list[str], dtype: str, prompt_tokens: int, steps: int) -> Path:
    """tp.py on this CPU: one process (1 thread, then 2 threads: the same 2 cores) against
    2 ranks of 1 thread each, on a static cache after a prompt; each configuration in fresh
    processes. The ranks' all-reduce time includes waiting for the slower rank; one
    all-reduce alone (hidden_size values, median of 200) is the pure communication cost."""
    runs = [("1 process, 1 thread", 1, False, 1), ("1 process, 2 threads", 1, False, 2),
            ("2 ranks × 1 thread (tp.py)", 2, True, 1)]
    rows, notes = [], []
    for name in models:
        base = None
        for label, world, split, threads in runs:
            out = tp.launch(measure, world, str(model_dir(name)), dtype, prompt_tokens, steps, split,
                            threads=threads)
            failed = [r for r in out if isinstance(r, Exception)]
            if failed:
                raise ValueError(f"{label}: {failed[0]}")
            step = max(r["step_s"] for r in out)        # the slowest rank sets every rank's pace
            base = base or step
            r0 = out[0]
            rows.append([name, label, f"{step * 1e3:.1f}", " / ".join(f"{r['comm_s'] * 1e3:.1f}" for r in out)
                         if split else "-", r0["calls"] if split else 0,
                         f"{r0['allreduce_s'] * 1e6:.0f}" if split else "-",
                         f"{r0['weights'] / 1e6:.1f}", f"{r0['kv'] / 1e6:.2f}", f"{base / step:.2f}×"])
            if world == 1 and threads == 1:
                layer = step / r0["layers"]
            if split:
                notes.append(f"{name}: a 1-thread step is {layer * 1e3:.2f} ms per layer (head included); splitting "
                             f"a layer in 2 saves at most half of that ({layer / 2 * 1e3:.2f} ms) and costs 2 "
                             f"all-reduces: {2 * r0['allreduce_s'] * 1e3:.2f} ms alone, "
                             f"{r0['comm_s'] / r0['layers'] * 1e3:.2f} ms inside the step (waiting for the other "
                             f"rank included)")
            print(f"{name}, {label}: {step * 1e3:.1f} ms/step", flush=True)
    table = results.Table(f"Batch-1 decode on a static cache after a {prompt_tokens}-token prompt, {dtype}, median "
                          f"of {steps} steps", ["model", "configuration", "ms/step", "ms in all-reduce per step "
                          "(each rank)", "all-reduces per step", "µs per all-reduce alone", "weight MB (rank 0)",
                          f"KV MB (rank 0, {prompt_tokens + steps + 1} tokens)", "× 1 thread"], rows, notes)
    print(table.markdown())
    return results.save("tp", "tp", [table])


def tp_args(p):
    """The flags of `python bench.py tp`."""
    p.add_argument("--models", nargs="+", default=[checkpoint.DEFAULT_MODEL], help=f"also {RANDOM_TINYLLAMA}")
    p.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)


def tp_command(args):
    bench_tp(args.models, args.dtype, args.prompt_tokens, args.steps)
