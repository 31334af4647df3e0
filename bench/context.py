"""`python bench.py naive-vs-cached` and `python bench.py context` (model.py): naive against cached
decoding as N grows, the work each does and its time; decode ms per token against the context, and
prefill against decode tok/s."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import checkpoint
import kernels
import results
from kvcache import kv_bytes_per_token
from model import GenerationStats, generate_cached
from nanoinfer.config import RunConfig
from nanoinfer.load import load
from sampling import SamplingParams
from bench.common import run_setup
from bench.decode import bytes_per_token


def bench_naive_vs_cached(name: str, sizes: list[int]) -> Path:
    """model.py's seed exercise against N: each decoder writes N tokens from the BOS
    token alone (greedy, EOS ignored, one run each), counting what it computes
    (GenerationStats: positions pushed through the model, query·key scores) and
    timing it. The counts are exact; the times are this machine's."""
    from model import DECODERS
    model, tok = load(RunConfig(name, kernels.pick_device()))   # fp32, eager
    if min(sizes) < 1 or max(sizes) >= model.config.max_seq_len:
        raise ValueError(f"--tokens must be between 1 and {model.config.max_seq_len - 1}, got {sizes}")
    prompt = [tok.bos_id if tok.bos_id is not None else 0]
    list(generate_cached(model, prompt, SamplingParams(max_new_tokens=4)))   # warm-up: one-time setup untimed
    rows, ratios, runs = [], [], {decoder: [] for decoder in DECODERS}   # runs: decoder -> [(stats, s)]
    for n in sizes:
        outs = {}
        for decoder, decode in DECODERS.items():
            stats, t0 = GenerationStats(), time.perf_counter()
            outs[decoder] = list(decode(model, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), stats))
            runs[decoder].append((stats, time.perf_counter() - t0))
            rows.append([n, decoder, stats.positions_computed, stats.scores_computed, runs[decoder][-1][1],
                         1000 * runs[decoder][-1][1] / n])
        (sa, ta), (sb, tb) = runs["naive"][-1], runs["cached"][-1]
        ratios.append([n, f"{sa.positions_computed / sb.positions_computed:.1f}×",
                       f"{sa.scores_computed / sb.scores_computed:.1f}×", f"{ta / tb:.1f}×",
                       "yes" if outs["naive"] == outs["cached"] else "no"])
        print(f"  N = {n}: naive {ta:.1f} s, cached {tb:.1f} s", flush=True)
    setup = run_setup(name, model)
    tables = [
        results.Table(f"{setup}: N tokens from a 1-token prompt",
                      ["N", "decoder", "positions computed", "q·k scores per head and layer", "time s", "ms/token"],
                      rows, ["naive: step t runs the t tokens so far: N(N+1)/2 positions and Σ t(t+1)/2 = "
                             "N(N+1)(N+2)/6 scores (causal). cached: one position per step, N in all, whose query "
                             "reads every key so far: N(N+1)/2 scores."]),
        results.Table("naive ÷ cached", ["N", "positions", "q·k scores", "time", "same tokens"], ratios,
                      ["The cache removes the recomputation, not the cost of attending over a long context: "
                       "each new token still reads every earlier key, so attention per token grows with the "
                       "context (`python bench.py context`).",
                       "Time falls by less than the counts: a pass over a few positions reads the same weights "
                       "as a pass over one, and for a small model reading them is most of a short pass's time."])]
    for table in tables:
        print("\n" + table.markdown())
    plots, plt = [], results.pyplot()
    if plt is not None:
        fig, (work, clock) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
        formulas = {"naive": ("N(N+1)/2", "N(N+1)(N+2)/6"), "cached": ("N", "N(N+1)/2")}
        for i, (decoder, done) in enumerate(runs.items()):
            work.plot(sizes, [s.positions_computed for s, _ in done], "o-", color=f"C{i}",
                      label=f"{decoder}: positions, {formulas[decoder][0]}")
            work.plot(sizes, [s.scores_computed for s, _ in done], "s--", color=f"C{i}",
                      label=f"{decoder}: q·k scores, {formulas[decoder][1]}")
            clock.plot(sizes, [t for _, t in done], "o-", color=f"C{i}", label=decoder)
        for power, decoder in ((1, "cached"), (2, "naive")):   # guides through each decoder's first point
            t = runs[decoder][0][1]
            clock.plot(sizes, [t * (n / sizes[0]) ** power for n in sizes], ":", color="grey", lw=1)
            clock.annotate(f"∝ N{'²' if power == 2 else ''}", (sizes[-1], t * (sizes[-1] / sizes[0]) ** power),
                           color="grey", fontsize=8, ha="right", va="bottom")
        work.set(title="work counted (exact)", ylabel="positions, or q·k scores per head and layer")
        clock.set(title="time measured", ylabel="wall time (s)")
        for ax in (work, clock):
            ax.set(xscale="log", yscale="log", xlabel="N, tokens generated")
            results.plain_ticks(ax.xaxis, sizes)
            results.plain_ticks(ax.yaxis)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"naive vs cached decoding: {setup}")
        plots.append(results.save_plot(fig, "naive_vs_cached.png", dpi=120, bbox_inches="tight"))
    return results.save("naive-vs-cached", "model", tables, plots=plots)


def bench_context(name: str, dtype: str, contexts: list[int], steps: int = 8, reps: int = 3) -> Path:
    """Decode time per token against context, prefill tok/s against decode tok/s, on
    the runner's default configuration (eager, dynamic cache; fp32 on a CPU unless
    ``dtype``): for each context n, generate_cached prefills n random tokens (timed
    to the first token) and decodes steps + 2 more, one at a time; ms/token is the
    median step, the first skipped (a dynamic cache may double its storage there).
    The median of ``reps`` runs each."""
    if steps < 1 or reps < 1:
        raise ValueError(f"--steps and --reps must be at least 1, got {steps} and {reps}")
    dtype = torch.float32 if dtype == "auto" else kernels.DTYPES[dtype]
    model, _ = load(RunConfig(name, kernels.pick_device(), dtype))
    c = model.config
    if min(contexts) < 1 or max(contexts) + steps + 2 > c.max_seq_len:
        raise ValueError(f"--contexts must be between 1 and {c.max_seq_len - steps - 2} (the model's context "
                         f"less the decode steps), got {contexts}")
    weights = bytes_per_token(model, 0)      # every weight a decode step reads (bench decode's rule)
    kv_token = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, model.dtype.itemsize)
    gen, rows, measured = torch.Generator().manual_seed(0), [], []
    for n in contexts:
        prompt = torch.randint(100, c.vocab_size - 100, (n,), generator=gen).tolist()
        prefill, decode = [], []
        for _ in range(reps):
            times, t0 = [], time.perf_counter()
            for _ in generate_cached(model, prompt, SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)):
                t1 = time.perf_counter()
                times, t0 = times + [t1 - t0], t1
            prefill.append(times[0])
            decode += times[2:]
        p_s, d_s = statistics.median(prefill), statistics.median(decode)
        measured.append((n, p_s, d_s))
        kv = n * kv_token
        rows.append([n, 1000 * p_s, n / p_s, 1000 * d_s, 1 / d_s, f"{n / p_s * d_s:.0f}×", weights / 1e6,
                     kv / 1e6, f"{100 * kv / weights:.1f}%", (weights + kv) / d_s / 1e9])
        print(f"  context {n}: prefill {n / p_s:.0f} tok/s, decode {1000 * d_s:.1f} ms/token", flush=True)
    setup = run_setup(name, model)
    crossover = weights / kv_token
    beyond = " (beyond this model's context)" if crossover > c.max_seq_len else ""
    table = results.Table(
        f"{setup}, eager, dynamic cache",
        ["context", "prefill ms", "prefill tok/s", "decode ms/token", "decode tok/s", "prefill ÷ decode",
         "weights MB read/step", "KV MB read/step", "KV ÷ weights", "GB/s implied"], rows,
        [f"Prefill: n random tokens in one pass, timed to the first new token, median of {reps}. Decode: one "
         f"token per step at context n + 2 .. n + {steps + 1}, median of {steps * reps} steps.",
         f"A decode step reads every weight ({weights / 1e6:.0f} MB) and the K and V of every earlier token "
         f"({kv_token / 1024:.1f} KiB each): KV reads equal the weights' at {crossover:.0f} tokens{beyond}. "
         f"A prefill reads the weights once for all n positions (matrix-matrix products), so it makes many "
         f"tokens per weight read; its attention grows as n²/2 scores.",
         "GB/s implied = (weights + KV) bytes per step ÷ decode time: what the step would stream if reading were "
         "all it did."])
    print("\n" + table.markdown())
    plots, plt = [], results.pyplot()
    if plt is not None:
        fig, (dec, speed) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
        n0, _, d0 = measured[0]
        dec.plot(contexts, [1000 * d for _, _, d in measured], "o-", color="C1", label="measured")
        dec.plot(contexts, [1000 * d0 * (weights + n * kv_token) / (weights + n0 * kv_token) for n in contexts], ":",
                 color="grey", label="bytes read (weights + KV), scaled to the first point")
        dec.set(title="decode: time per token", ylabel="ms/token", ylim=(0, None))
        speed.plot(contexts, [n / p for n, p, _ in measured], "o-", color="C0", label="prefill")
        speed.plot(contexts, [1 / d for _, _, d in measured], "o-", color="C1", label="decode")
        speed.set(title="prefill vs decode", ylabel="tokens/s (log)", yscale="log")
        results.plain_ticks(speed.yaxis)
        for ax in (dec, speed):
            ax.set(xscale="log", xlabel="context (tokens)")
            results.plain_ticks(ax.xaxis, contexts)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"prefill vs decode against context: {setup}")
        plots.append(results.save_plot(fig, "context.png", dpi=120, bbox_inches="tight"))
    return results.save("context", "model", [table], plots=plots)


def naive_vs_cached_args(p):
    """The flags of `python bench.py naive-vs-cached`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128], help="the N to try")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 avoids OpenMP "
                   "stalls on a busy shared machine)")


def context_args(p):
    """The flags of `python bench.py context`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", *kernels.DTYPES], help="auto: fp32 on a CPU")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024, 2048])
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def naive_vs_cached_command(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_naive_vs_cached(args.model, args.tokens)


def context_command(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_context(args.model, args.dtype, args.contexts, args.steps, args.reps)
