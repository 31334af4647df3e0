"""`python bench.py batching` (engine.py): continuous against static batching, prefix caching, and
chunked prefill.

Engine.py's continuous batching against static batching (batches of
--max-batch requests, each running until its longest answer is done; padded
rows, or finished rows dropping out) on 64 chat-like requests queued at once,
then time to first token for requests sharing a 1,171-token system prompt with
the prefix cache off and on. Same engine, same kernels; only scheduling differs.
Last, chunked prefill: 1,500-2,000-token prompts arriving while short requests
decode, whole or in chunks of each --chunks size: the decoders' inter-token
latency (p50, p95, max) and the total throughput.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import checkpoint
import engine
import kernels
import results
from kvcache import common_prefix
from model import Llama
from nanoinfer.config import RunConfig
from nanoinfer.load import load
from sampling import SamplingParams
from bench.common import QUESTIONS, long_system_prompt


@dataclass
class Job:
    prompt: list[int]
    output_len: int      # the answer's length: EOS is ignored, so every run produces exactly this


def chat_workload(n: int, vocab_size: int, seed: int = 0, prompt_range=(20, 100),
                  output_range=(8, 128)) -> list[Job]:
    """n chat-like requests: prompt lengths uniform in prompt_range (random token ids),
    answer lengths log-uniform in output_range, so short answers are common and long
    ones rare (for 8-128: median 32, mean 43, one in four above 64)."""
    rng = random.Random(seed)
    lo, hi = output_range
    return [Job([rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_range))],
                min(hi, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
            for _ in range(n)]


@dataclass
class RunResult:
    name: str
    outputs: list[list[int]]   # each job's answer, in job order
    wall_s: float
    steps: int
    rows: int                  # decode rows computed (padding included)
    latencies: list[float]     # per job: from the start until its answer is complete

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def mean_latency(self) -> float:
        return sum(self.latencies) / len(self.latencies)


def run_continuous(model: Llama, jobs: list[Job], max_batch: int, **engine_kwargs) -> RunResult:
    """Every job queued at t = 0; the engine keeps up to max_batch decoding."""
    eng = engine.Engine(model, max_batch=max_batch, **engine_kwargs)
    t0 = time.perf_counter()
    reqs = [eng.add(j.prompt, SamplingParams(max_new_tokens=j.output_len, ignore_eos=True)) for j in jobs]
    rows = eng.stats().decode_tokens
    steps = eng.run()
    wall = time.perf_counter() - t0
    return RunResult(f"continuous (max batch {max_batch})", [r.sequences[0].output for r in reqs], wall, steps,
                     eng.stats().decode_tokens - rows, [r.finish - t0 for r in reqs])


def run_static(model: Llama, jobs: list[Job], batch: int, pad: bool = True, **engine_kwargs) -> RunResult:
    """Batches of ``batch`` jobs in order; a batch starts when the previous one is done.
    pad=True is a fixed-shape batch (what `generate` on a padded batch does): every row
    decodes until the batch's longest answer is done, and the batch's answers are
    returned together. pad=False lets finished rows drop out, but nothing refills them."""
    eng = engine.Engine(model, max_batch=batch, **engine_kwargs)
    outputs, latencies, steps, t0 = [], [], 0, time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i:i + batch]
        longest = max(j.output_len for j in group)
        reqs = [eng.add(j.prompt, SamplingParams(max_new_tokens=longest if pad else j.output_len, ignore_eos=True))
                for j in group]
        steps += eng.run()
        end = time.perf_counter() - t0
        for j, r in zip(group, reqs):
            outputs.append(r.sequences[0].output[:j.output_len])
            latencies.append(end if pad else r.finish - t0)
    wall = time.perf_counter() - t0
    name = "static, padded rows" if pad else "static, finished rows dropped"
    return RunResult(f"{name} (batch {batch})", outputs, wall, steps, eng.stats().decode_tokens, latencies)


def batching_table(runs: list[RunResult], title: str = "") -> results.Table:
    base = runs[0]
    same = all(r.outputs == base.outputs for r in runs)
    return results.Table(title, ["scheduling", "steps", "decode rows computed", "output tokens", "wall s",
                                 "tokens/s", "× first row", "mean latency s"],
                         [[r.name, r.steps, r.rows, r.tokens, f"{r.wall_s:.1f}", f"{r.tok_s:.1f}",
                           f"{r.tok_s / base.tok_s:.2f}", f"{r.mean_latency:.1f}"] for r in runs],
                         [f"same tokens in every run (greedy): {same}; latency = from t = 0 until the request's "
                          "answer is complete (a padded static batch returns its answers together)"])


def prefix_cache_table(rows: list[tuple], title: str = "") -> results.Table:
    """rows: (caching, first TTFT s, median later TTFT s, median prompt tokens computed, first tokens)."""
    off = rows[0][2]
    return results.Table(title, ["prefix cache", "first request TTFT ms", "later requests: TTFT ms (median)",
                                 "prompt tokens computed (median)", "× faster"],
                         [["on" if caching else "off", f"{first * 1000:.0f}", f"{median * 1000:.0f}", f"{comp:.0f}",
                           f"{off / median:.1f}"] for caching, first, median, comp, _ in rows],
                         [f"same first tokens with and without the cache: {rows[0][4] == rows[1][4]}"])


def plot_batching(runs: list[RunResult], title: str) -> Path | None:
    """Two bar panels, one bar per scheduling: tokens per second, and mean latency."""
    plt = results.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r.name.replace(" (", "\n(") for r in runs]
    colors = [f"C{i}" for i in range(len(runs))]
    for ax, values, label, heading, fmt in (
            (axes[0], [r.tok_s for r in runs], "output tokens/s", "throughput (higher is better)", "%.1f"),
            (axes[1], [r.mean_latency for r in runs], "seconds from t = 0 to the answer's end",
             "mean latency (lower is better)", "%.3g")):
        ax.bar_label(ax.bar(names, values, color=colors), fmt=fmt)
        ax.set(ylabel=label, title=heading)
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return results.save_plot(fig, "batching.png", dpi=100)


def bench_batching(args):
    """Continuous against static batching on a chat-like workload, and time to first
    token with and without prefix caching; everything through engine.Engine, so the
    kernels are the same and only the scheduling (or the cache) differs."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if hint := kernels.busy_machine_hint():
        print(hint)
    model, tok = load(RunConfig(args.model, kernels.pick_device(), kernels.DTYPES[args.dtype]))
    if args.long_prompts_only:
        return bench_long_prompts(model, args)
    dtype = str(model.dtype).removeprefix("torch.")
    jobs = chat_workload(args.requests, model.config.vocab_size, seed=0)
    outs = sorted(j.output_len for j in jobs)
    prompts = [len(j.prompt) for j in jobs]
    title = (f"{args.model} ({dtype}), {torch.get_num_threads()} threads: {args.requests} requests, all queued at "
             f"t = 0; prompts uniform 20-100 tokens (mean {statistics.mean(prompts):.0f}); answers log-uniform "
             f"8-128 tokens, EOS ignored (median {statistics.median(outs):.0f}, mean {statistics.mean(outs):.0f}, "
             f"max {outs[-1]}); static batch = continuous max batch = {args.max_batch}")
    print(title, flush=True)
    run_continuous(model, jobs[:4], 4)          # warm-up: first calls of every kernel
    schedules = [lambda: run_static(model, jobs, args.max_batch, pad=True)]
    if not args.skip_dropped:
        schedules.append(lambda: run_static(model, jobs, args.max_batch, pad=False))
    schedules.append(lambda: run_continuous(model, jobs, args.max_batch))
    runs = []
    for schedule in schedules:
        runs.append(schedule())
        print(f"  {runs[-1].name}: {runs[-1].wall_s:.1f} s, {runs[-1].tok_s:.1f} tok/s", flush=True)
    scheduling = batching_table(runs, title)
    print(f"\n{scheduling.markdown()}")

    system = long_system_prompt()
    convs = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                 {"role": "user", "content": q}]), add_bos=False)
             for q in QUESTIONS[:args.questions]]
    shared = min(common_prefix(convs[0], c) for c in convs[1:])
    title = (f"prefix caching: {len(convs)} requests, one at a time; each is the same system prompt plus a short "
             f"question ({min(map(len, convs))}-{max(map(len, convs))} tokens, the first {shared} shared); "
             f"TTFT = add_request to first token")
    print(f"\n{title}", flush=True)
    rows = []
    for caching in (False, True):
        eng = engine.Engine(model, max_batch=1, prefix_caching=caching)
        ttfts, computed, answers = [], [], []
        for ids in convs:
            t0 = time.perf_counter()
            req = eng.add(ids, SamplingParams(max_new_tokens=1))
            while not req.finished:
                eng.step()
            ttfts.append(req.first_token - t0)
            computed.append(req.prefill_tokens)
            answers.append(req.sequences[0].output)
        warm = ttfts[1:]          # with the cache on, the first request fills it
        rows.append((caching, ttfts[0], statistics.median(warm), statistics.median(computed[1:]), answers))
        print(f"  prefix cache {'on' if caching else 'off'}: TTFT {[round(t * 1000) for t in ttfts]} ms", flush=True)
    prefix = prefix_cache_table(rows, title)
    print(f"\n{prefix.markdown()}")
    plot = plot_batching(runs, f"{args.model} ({dtype}), {torch.get_num_threads()} threads: {args.requests} chat "
                               f"requests queued at once, batches of {args.max_batch}, EOS ignored")
    print(f"saved {results.save('batching', 'engine', [scheduling, prefix], plots=[plot] if plot else [])}")
    bench_long_prompts(model, args)


@dataclass
class LongPromptRun:
    chunk: int | None
    outputs: list[list[int]]   # every request's answer: the decoders', then the long prompts'
    wall_s: float
    gaps: list[float]          # the decoders' inter-token latencies, s
    ttft: list[float]          # the long prompts' time to first token, s

    def itl(self, q: float) -> float:
        return float(np.quantile(self.gaps, q)) * 1000


def run_long_prompts(model: Llama, decoders: list[Job], long: list[Job], every: int, chunk: int | None,
                     max_batch: int) -> LongPromptRun:
    """The decoders are queued at t = 0; long prompt i is added after step 2 + i * every,
    while they decode. Records the gap between each decoder's consecutive tokens."""
    eng = engine.Engine(model, max_batch=max_batch, chunk_tokens=chunk)
    params = lambda j: SamplingParams(max_new_tokens=j.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [eng.add(j.prompt, params(j)) for j in decoders]
    watched, last, gaps, late = {r.id for r in reqs}, {}, [], []
    while eng.has_work() or len(late) < len(long):
        if len(late) < len(long) and eng.stats().steps == 2 + len(late) * every:
            late.append(eng.add(long[len(late)].prompt, params(long[len(late)])))
        events = eng.step()
        now = time.perf_counter()
        for ev in events:
            if ev.request_id in watched and ev.request_id in last:
                gaps.append(now - last[ev.request_id])
            last[ev.request_id] = now
    return LongPromptRun(chunk, [r.sequences[0].output for r in reqs + late], time.perf_counter() - t0, gaps,
                         [r.first_token - r.arrival for r in late])


def bench_long_prompts(model: Llama, args):
    """Chunked prefill: long prompts arrive while short ones decode. Without chunks each
    stalls every decoder for its whole prefill; with them each step pays one chunk."""
    rng = random.Random(1)
    vocab = model.config.vocab_size
    decoders = [Job(j.prompt, args.decode_tokens) for j in chat_workload(args.decoders, vocab, seed=1)]
    long = [Job([rng.randrange(vocab) for _ in range(rng.randint(1500, 2000))], 8) for _ in range(args.long_prompts)]
    every = max(1, (args.decode_tokens - 8) // args.long_prompts)
    title = (f"chunked prefill, {args.model} ({str(model.dtype).removeprefix('torch.')}), "
             f"{torch.get_num_threads()} threads: {args.decoders} requests decode {args.decode_tokens} tokens each "
             f"while {args.long_prompts} prompts of {min(len(j.prompt) for j in long)}-"
             f"{max(len(j.prompt) for j in long)} tokens arrive, one every {every} steps (8 new tokens each); "
             "EOS ignored")
    print(f"\n{title}", flush=True)
    run_long_prompts(model, decoders[:2], [Job(long[0].prompt[:300], 2)], 2, 128, args.max_batch)   # warm-up
    runs = []
    for chunk in args.chunks:
        runs.append(run_long_prompts(model, decoders, long, every, chunk or None, args.max_batch))
        r = runs[-1]
        print(f"  chunk {chunk or 'off'}: {r.wall_s:.1f} s, inter-token p95 {r.itl(0.95):.0f} ms", flush=True)
    base = runs[0]
    tokens = sum(map(len, base.outputs))
    table = results.Table(title, ["prefill chunk (tokens a step)", "decoders' inter-token ms: p50", "p95", "max",
                                  "p95 × no chunks", "long prompts' TTFT s (mean)", "wall s", "output tokens/s",
                                  "tokens/s × no chunks"],
                          [[r.chunk or "off (whole prompts)", f"{r.itl(0.5):.0f}", f"{r.itl(0.95):.0f}",
                            f"{r.itl(1):.0f}", f"{r.itl(0.95) / base.itl(0.95):.2f}", f"{statistics.mean(r.ttft):.1f}",
                            f"{r.wall_s:.1f}", f"{tokens / r.wall_s:.1f}", f"{base.wall_s / r.wall_s:.2f}"]
                           for r in runs],
                          [f"same tokens in every run (greedy): {all(r.outputs == base.outputs for r in runs)}; "
                           f"{len(base.gaps)} inter-token gaps per run (the decoders'); a step with a chunk runs "
                           "two forward passes, the chunk's then the decoders'"])
    print(f"\n{table.markdown()}")
    print(f"saved {results.save('chunked-prefill', 'engine', [table])}")


def batching_args(p):
    """The flags of `python bench.py batching`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--questions", type=int, default=6, help="prefix caching: requests per configuration")
    p.add_argument("--skip-dropped", action="store_true", help="skip the static run whose finished rows drop out")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); on a busy shared machine 1 avoids OpenMP stalls")
    p.add_argument("--long-prompts-only", action="store_true", help="only the chunked-prefill scenario")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 256],
                   help="chunked prefill: tokens a step to compare (0: whole prompts, the baseline, first)")
    p.add_argument("--decoders", type=int, default=8, help="chunked prefill: requests decoding throughout")
    p.add_argument("--decode-tokens", type=int, default=32, help="chunked prefill: tokens each decoder produces")
    p.add_argument("--long-prompts", type=int, default=2, help="chunked prefill: 1,500-2,000-token prompts")
