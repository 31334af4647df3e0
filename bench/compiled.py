"""Compiled steps: `python bench.py engine-step` (engine.py's batched decode step, eager against
compiled per batch size) and `python bench.py compiled-start` (kernels.py: an AOTInductor package
built once and loaded by later starts, against torch.compile at every start).

One engine.py decode step (B rows, one token each, ~200 tokens
of context per row, keys read through the paged pool) timed eagerly and
compiled with kernels.compile_step for that one batch shape (the question:
would compiled steps per bucketed batch size, as vLLM captures CUDA graphs,
pay on this CPU?). Eager and compiled steps alternate; medians.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch

import checkpoint
import engine
import kernels
import results
from kvcache import common_prefix
from nanoinfer.config import RunConfig
from nanoinfer.load import load
from bench.common import ROOT
import kvcache


def bench_engine_step(args):
    """One batched decode step of engine.Engine, eager against compiled for a fixed
    batch size (one compile per bucket), at each thread count."""
    model, _ = load(RunConfig(args.model, kernels.pick_device(), kernels.DTYPES[args.dtype]))
    dtype = str(model.dtype).removeprefix("torch.")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for B in args.batches:
            # the tightest pool that holds the rows (a compiled step writes into it; see the notes)
            need = math.ceil((args.context + 1) / engine.BLOCK_SIZE)
            eng = engine.Engine(model, num_blocks=B * need, max_batch=B)
            tables = [eng.allocator.allocate_sequence(list(range(i, i + args.context)))[0] for i in range(B)]
            ids = torch.randint(0, model.config.vocab_size, (B, 1))
            pos = torch.tensor([[t.num_tokens - 1] for t in tables])

            def run(step):       # what Engine._decode does, with the step chosen
                return step(ids, pos, eng.cache.bind(tables).begin(pos), eng.cache, False)
            eager, compiled, times = model.step, None, {"eager": [], "compiled": []}
            with torch.inference_mode():
                run(eager)
                if B in args.compile_batches:
                    t0 = time.perf_counter()
                    compiled = kernels.compile_step(model.step)
                    diff = (run(compiled) - run(eager)).abs().max().item()
                    compile_s = time.perf_counter() - t0
                for _ in range(args.reps):
                    for name, step in (("eager", eager), ("compiled", compiled)):
                        if step is not None:
                            t0 = time.perf_counter()
                            run(step)
                            times[name].append((time.perf_counter() - t0) * 1e3)
            e = statistics.median(times["eager"])
            if compiled is None:
                rows.append([threads, B, f"{e:.1f}", "", "", "", ""])
            else:
                c = statistics.median(times["compiled"])
                rows.append([threads, B, f"{e:.1f}", f"{c:.1f}", f"{e / c:.2f}×", f"{compile_s:.0f}", f"{diff:.1e}"])
            print(f"  {threads} threads, B={B}: {rows[-1][2:]}", flush=True)
    table = results.Table(
        f"{args.model} ({dtype}): one engine decode step, B rows of one token, {args.context} tokens of context "
        f"per row (paged pool, block {engine.BLOCK_SIZE}); median ms of {args.reps} steps, eager and compiled "
        f"alternating",
        ["threads", "B", "eager ms", "compiled ms", "eager / compiled", "compile s", "max |Δ logit|"], rows,
        notes=["compiled: kernels.compile_step(model.step), dynamic=False, one compile per batch size (inductor's "
              "disk cache may shorten a rerun's compile). The pool is the smallest that holds the rows: the step "
              "writes into it, and a compiled graph that mutates its input may copy it."])
    print(f"\n{table.markdown()}")
    print(f"saved {results.save('engine-step', 'engine', [table])}")


def bench_compiled_start(args):
    """What a compiled configuration's start costs and what its step gains: torch.compile (traced at every
    start) against an AOTInductor package (built once, loaded later); the per-step ms of eager, torch.compile
    and the package, alternating; their greedy tokens; and the runner's second start to its first token."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load(RunConfig(args.model, kernels.pick_device(), kernels.DTYPES[args.dtype]))
    dtype, cpu = str(model.norm.weight.dtype).removeprefix("torch."), torch.device("cpu")
    prompt = list(range(100, 130))

    def ready(step) -> float:      # seconds until its first one-token step has run
        t0, cache = time.perf_counter(), kvcache.new_cache(model, "static", max_len=args.ctx)
        with torch.inference_mode():
            pos = torch.tensor([0])
            step(torch.tensor([[1]]), pos, cache.begin(pos), cache, True)
        return time.perf_counter() - t0

    def decode(step, cache, tokens) -> list[int]:
        out = []
        with torch.inference_mode():
            for t in tokens:
                pos = torch.tensor([cache.length])
                out.append(int(step(torch.tensor([[t]]), pos, cache.begin(pos), cache, True)[0, -1].argmax()))
        return out

    first = kernels.compile_step(model.step, cpu, checkpoint.cache_root() / "compiled")
    first_s = ready(first)
    built = bool(first.built)
    package = kernels.compile_step(model.step, cpu, checkpoint.cache_root() / "compiled")   # a later start's
    load_s = ready(package)
    print(f"package {'built' if built else 'found'} in {first_s:.1f} s, loaded by a second object in {load_s:.2f} s",
          flush=True)
    compiled = kernels.compile_step(model.step, cpu)
    compile_s = ready(compiled)
    print(f"torch.compile ready in {compile_s:.1f} s", flush=True)
    steps = {"eager": model.step, "torch.compile": compiled, "AOTInductor package": package}
    texts = {}
    for name, step in steps.items():     # greedy: each step's own argmax fed back, from the same prefill
        cache = kvcache.new_cache(model, "static", max_len=args.ctx)
        with torch.inference_mode():
            t = int(model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, last_only=True)[0, -1].argmax())
        texts[name] = [t]
        for _ in range(args.tokens - 1):
            texts[name] += decode(step, cache, texts[name][-1:])
    caches = {name: kvcache.new_cache(model, "static", max_len=args.ctx) for name in steps}
    for cache in caches.values():
        decode(model.step, cache, prompt)
    ms = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            caches[name].crop(len(prompt))
            t0 = time.perf_counter()
            decode(step, caches[name], [5] * 10)
            ms[name].append((time.perf_counter() - t0) / 10 * 1e3)
    start = {"eager": "", "torch.compile": f"{compile_s:.1f} (every start)",
             "AOTInductor package": f"{load_s:.2f} (built once: {first_s:.0f} s)" if built else f"{load_s:.2f}"}
    rows = [[name, f"{statistics.median(ms[name]):.1f}", f"{min(ms[name]):.1f}", start[name],
             "yes" if texts[name] == texts["eager"] else f"no (parts at {common_prefix(texts[name], texts['eager'])})"]
            for name in steps]
    size = package.path(next(iter(package.runners))).stat().st_size
    step_table = results.Table(
        f"{args.model} ({dtype}, {torch.get_num_threads()} threads): the one-token step on a {args.ctx}-row static "
        f"cache, ms per step ({args.rounds} rounds of 10, alternating), and the seconds until the first step runs",
        ["step", "median ms", "min ms", "ready in s", f"{args.tokens} greedy tokens equal eager's"], rows,
        notes=[f"the package (kernels.AheadOfTime) holds no weights: {size / 1e6:.1f} MB on disk; it reads the "
               f"model's own tensors", "torch.compile's start: tracing and inductor's on-disk cache, in this process "
               "after an earlier run filled that cache", f"load average {os.getloadavg()[0]:.1f} on this machine's "
               f"{os.cpu_count()} cores at the end of the run (other processes slow every column alike)"])
    print(f"\n{step_table.markdown()}", flush=True)
    # The runner as a user starts it a second time: the package is on disk now.
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    flags = ["--model", args.model, "--dtype", dtype, "--cache", "static", "--compile", "--ctx", str(args.ctx),
             "--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "16"]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "serve_local.py", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.read(1)           # the answer's first character: the first token is out
    first_token_s = time.perf_counter() - t0
    err = proc.communicate(timeout=600)[1]
    said = {key: re.search(rf"{key} in ([\d.]+) s", err) for key in ("loaded", "loaded from cache")}
    runner = results.Table(
        f"python serve_local.py {' '.join(flags)}: a second start (the package on disk), s",
        ["to its first token", "model load", "compiled step loaded and run once"],
        [[f"{first_token_s:.1f}", *(m.group(1) if m else "?" for m in said.values())]],
        notes=["from starting the process to the answer's first character on stdout"])
    print(f"\n{runner.markdown()}")
    print(f"saved {results.save(f'compiled-start-{dtype}', 'kernels', [step_table, runner])}")


def engine_step_args(p):
    """The flags of `python bench.py engine-step`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--compile-batches", type=int, nargs="+", default=[1, 4],
                   help="the batch sizes also compiled (each compile: 1-3 min on 2 busy cores)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)


def compiled_start_args(p):
    """The flags of `python bench.py compiled-start`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
