"""kvcache.py's measurements: `python bench.py prefix` (a shared prompt prefilled once and forked
per question), `kv-bytes` (a real cache's bytes against the formula), `offload` (the context an
offloaded cache fits, and its cost per step) and `kv-plot` (the bytes each kind of cache holds as
the context grows: a table and plots/kv_bytes.png)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import checkpoint
import kernels
import kvcache
import quantize
import results
from kvcache import KINDS, common_prefix, held_bytes, human, kv_bytes_per_token, shape_of, token_bytes
from model import GenerationStats, generate_cached
from nanoinfer.config import RunConfig
from nanoinfer.load import load
from sampling import SamplingParams, visible
from bench.common import HANDBOOK, QUESTIONS, run_setup


def bench_prefix(model_name: str = checkpoint.DEFAULT_MODEL, n_answer: int = 24):
    """Seed exercise 2: one prefill of a shared prompt, forked for many questions
    (kvcache.KVCache.fork), against encoding the whole prompt for each."""
    model, tok = load(RunConfig(model_name, kernels.pick_device()))
    system = "You are a helpful assistant. Answer from the handbook below in one short sentence.\n\n" + HANDBOOK
    convs = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                 {"role": "user", "content": q}]), add_bos=False)
             for q in QUESTIONS]
    shared = min(common_prefix(convs[0], ids) for ids in convs[1:])
    params = SamplingParams(max_new_tokens=n_answer)
    print(f"shared prefix: {shared} tokens (system prompt + handbook); {len(QUESTIONS)} questions")

    def answer(ids, cache):
        stats = GenerationStats()
        out = list(generate_cached(model, ids, params, stats, cache))
        return tok.decode([t for t in out if visible(t, model.config.eos_ids)]), stats

    t0 = time.perf_counter()
    plain = [answer(ids, kvcache.new_cache(model)) for ids in convs]
    strategies = {"re-encode the prefix": (plain, time.perf_counter() - t0, 0.0)}
    t0 = time.perf_counter()
    base = kvcache.new_cache(model)
    with torch.inference_mode():
        model(torch.tensor([convs[0][:shared]]), torch.arange(shared), base, last_only=True)
    prefix_s = time.perf_counter() - t0
    forked = [answer(ids[shared:], base.fork()) for ids in convs]
    strategies["prefill once + fork()"] = (forked, time.perf_counter() - t0, prefix_s)

    rows = []
    for name, (runs, total, once) in strategies.items():
        tokens = sum(s.prompt_tokens for _, s in runs) + (shared if once else 0)
        rows.append([name, tokens, sum(s.prefill_s for _, s in runs) + once, total])
    (_, pa, fa, ta), (_, pb, fb, tb) = rows
    same = [x for x, _ in plain] == [y for y, _ in forked]
    table = results.Table(
        f"{len(QUESTIONS)} questions after one {shared}-token shared prefix (system prompt + handbook), "
        f"{n_answer} new tokens each", ["strategy", "prefill tokens computed", "prefill wall time", "total wall time"],
        [[name, tokens, f"{prefill:.2f} s", f"{total:.2f} s"] for name, tokens, prefill, total in rows],
        [f"prefill tokens {pa / pb:.1f}x fewer, prefill time {fa / fb:.1f}x lower, total {ta / tb:.1f}x lower; "
         f"identical answers: {same}"])
    print(f"\n{table.markdown()}")
    for q, (text, _) in zip(QUESTIONS[:3], forked):
        print(f"  Q: {q}\n  A: {text.strip()}")
    print(f"saved {results.save('prefix', 'kvcache', [table])}")


def bench_kv_bytes(model_name: str = checkpoint.DEFAULT_MODEL, new_tokens: int = 64):
    """The bytes a real cache holds after a generation, against kvcache's formula."""
    model, tok = load(RunConfig(model_name, kernels.pick_device()))
    c = model.config
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about caches."}]),
                        add_bos=False)
    n = len(prompt) + new_tokens
    cache = kvcache.new_cache(model, "static", max_len=n)
    out = list(generate_cached(model, prompt, SamplingParams(max_new_tokens=new_tokens), cache=cache))
    size = model.dtype.itemsize
    formula = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, size)
    table = results.Table(
        f"{model_name}: a static cache after a generation ({len(prompt)} prompt + {len(out)} generated tokens) "
        "against kvcache.kv_bytes_per_token",
        ["layers", "KV heads", "head dim", "bytes/value", "formula B/token", "tokens", "cache holds B",
         "formula × tokens B", "equal"],
        [[c.n_layers, c.n_kv_heads, c.head_dim, size, formula, n, cache.nbytes, formula * n,
          cache.nbytes == formula * n]],
        ["formula = layers × 2 (K and V) × KV heads × head dim × bytes/value"])
    print(f"{table.title}\n\n{table.markdown()}")
    print(f"saved {results.save('kv-bytes', 'kvcache', [table])}")


def bench_offload(model_name: str = checkpoint.DEFAULT_MODEL, contexts=(256, 1024, 2048), steps: int = 12,
                  device_gib=(0.75, 1.0, 2.0)) -> Path:
    """kvcache.OffloadedCache on a real model: the longest context that fits a device's memory with the whole
    cache on it and with two layers' K/V on it (the rest in host memory), then the measured cost: a decode step
    at each context on a dynamic and an offloaded cache, steps alternating between the two (the same prompt,
    greedy), with the bytes the offloaded one moved per step."""
    if min(contexts) < 1 or steps < 2 or min(device_gib) <= 0:
        raise ValueError(f"--contexts must be positive, --steps at least 2 and --device-gib positive, got "
                         f"{list(contexts)}, {steps} and {list(device_gib)}")
    model, _ = load(RunConfig(model_name, kernels.pick_device()))
    c, dev = model.config, model.device
    if max(contexts) + steps + 1 > c.max_seq_len:
        raise ValueError(f"--contexts must leave {steps + 1} tokens of the model's {c.max_seq_len}-token context")
    per_token = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, model.dtype.itemsize)
    weights = quantize.weight_bytes(model)
    fits = []
    for gib in device_gib:
        room = gib * 2**30 - weights
        whole, offloaded = (max(0, int(room // per_token)), max(0, int(room // (2 * per_token / c.n_layers))))
        fits.append([f"{gib:g} GiB", f"{weights / 2**20:.0f} MiB", whole, offloaded,
                     f"{offloaded / whole:.1f}×" if whole else "—"])
    fit_table = results.Table(
        f"{model_name}: the longest context whose KV cache fits beside the weights on a device",
        ["device memory", "weights", "whole cache on the device (tokens)", "offloaded: 2 layers on it (tokens)",
         "gain"], fits,
        [f"{per_token / 1024:.1f} KiB per token ({c.n_layers} layers); offloaded, the device holds 2 layers' K/V "
         f"and host memory the whole cache. The model's own context is {c.max_seq_len} tokens."])
    gen, rows = torch.Generator().manual_seed(0), []
    for n in contexts:
        prompt = torch.randint(100, c.vocab_size - 100, (1, n), generator=gen).to(dev)
        caches = {kind: kvcache.new_cache(model, kind) for kind in ("dynamic", "offloaded")}
        tokens, times = {kind: [] for kind in caches}, {kind: [] for kind in caches}
        with torch.inference_mode():
            for kind, cache in caches.items():       # the prefill, not timed
                logits = model(prompt, torch.arange(n, device=dev), cache, last_only=True)
                tokens[kind].append(int(logits[0, -1].argmax()))
            for _ in range(steps):
                for kind, cache in caches.items():
                    t0 = time.perf_counter()
                    logits = model(torch.tensor([[tokens[kind][-1]]], device=dev),
                                   torch.tensor([cache.length], device=dev), cache, last_only=True)
                    tokens[kind].append(int(logits[0, -1].argmax()))
                    times[kind].append(time.perf_counter() - t0)
        dyn, off = (statistics.median(times[kind][1:]) for kind in caches)   # the first: growth, warm-up
        moved = caches["offloaded"].step_moved
        rows.append([n, 1000 * dyn, 1000 * off, f"{off / dyn:.2f}×", moved / 1e6,
                     moved / (off - dyn) / 1e9 if off > dyn else "—", 1000 * moved / (kvcache.PCIE_GBPS * 1e9),
                     moved == caches["offloaded"].length * per_token, tokens["dynamic"] == tokens["offloaded"]])
        print(f"  context {n}: dynamic {1000 * dyn:.1f} ms/step, offloaded {1000 * off:.1f} ms/step", flush=True)
    speed_table = results.Table(
        f"{run_setup(model_name, model)}: a decode step on a dynamic and an offloaded cache",
        ["context", "dynamic ms/step", "offloaded ms/step", "slowdown", "MB moved/step", "GB/s implied",
         f"ms at {kvcache.PCIE_GBPS} GB/s (PCIe 4 x16)", "moved = length × B/token", "same tokens"], rows,
        [f"Median of {steps - 1} steps each, alternating between the two caches. The offloaded cache's store and "
         f"working buffers are both in this machine's memory ({dev.type}): the copy is a memcpy, which stands in "
         "for the PCIe link; GB/s implied = bytes moved ÷ the extra time per step.",
         f"Bytes moved per step = the whole cache at the step's length ({per_token / 1024:.1f} KiB per token), "
         "every layer copied in and its new row copied out."])
    for table in (fit_table, speed_table):
        print(f"\n{table.title}\n\n{table.markdown()}")
    return results.save("offload", "kvcache", [fit_table, speed_table])


def plot_bytes(config: str, seq: int, window: int, block_size: int = 16) -> Path:
    """Bytes held against context, 1 to ``seq`` tokens, for every kind in fp16/bf16
    and int8: a plot (plots/kv_bytes.png) and a table at a few contexts (results/)."""
    shape = shape_of(config)
    if not 1 <= window <= seq:
        raise ValueError(f"--plot draws contexts up to --seq {seq}: give a --window between 1 and that")
    contexts = list(range(1, seq + 1))    # every one: each step of each staircase is drawn where it is
    shown = [n for n in (100, 1000, 5000, 20000) if n < seq] + [seq]   # the table's columns
    dtypes = {"fp16": "fp16/bf16", "int8": "int8 + scale"}
    curves = {(kind, dtype): held_bytes(kind, contexts, shape, dtype, seq, window, block_size)
              for kind in KINDS for dtype in dtypes}
    labels = {"dynamic": "dynamic (doubling)", "static": f"static (max_len {seq})",
              "sliding": f"sliding (window {window})", "paged": f"paged ({block_size}-token blocks)"}
    rows = [[labels[kind], dtypes[dtype]] + [human(curve[contexts.index(n)]) for n in shown]
            for (kind, dtype), curve in curves.items()]
    table = results.Table(
        f"{config}: bytes a cache holds, batch 1", ["cache", "dtype"] + [f"{n} tokens" for n in shown], rows,
        [f"{shape[0]} layers, {shape[1]} KV heads, d_head {shape[2]}: {human(token_bytes(shape, 'fp16'))} per "
         f"token in fp16, {human(token_bytes(shape, 'int8'))} in int8 (d_head values + a 2-byte scale per "
         f"token and head).",
         "Tokens arrive one at a time; a paged sequence holds whole blocks of a shared pool; static and "
         "sliding allocate everything up front (sliding: window + 64 rows of slack for rollbacks)."])
    print(table.markdown())
    plots, plt = [], results.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 5))
        for (kind, dtype), curve in curves.items():
            ax.plot(contexts, [b / 2 ** 20 for b in curve], drawstyle="steps-post", color=f"C{KINDS.index(kind)}",
                    ls="-" if dtype == "fp16" else "--", lw=2 if dtype == "fp16" else 1.5,
                    label=f"{labels[kind]}, {dtypes[dtype]}")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="cache bytes held (MiB, log)",
               title=f"KV cache memory against context: {config}, batch 1")
        results.plain_ticks(ax.xaxis, [4 ** k for k in range(seq.bit_length()) if 4 ** k <= seq])
        results.plain_ticks(ax.yaxis)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside the plot: no curve hidden
        plots.append(results.save_plot(fig, "kv_bytes.png", dpi=120, bbox_inches="tight"))
    return results.save("kv-bytes-by-kind", "kvcache", [table], plots=plots)


def prefix_args(p):
    """The flags of `python bench.py prefix`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)


def kv_bytes_args(p):
    """The flags of `python bench.py kv-bytes`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)


def offload_args(p):
    """The flags of `python bench.py offload`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per cache and context")
    p.add_argument("--device-gib", type=float, nargs="+", default=[0.75, 1.0, 2.0], help="device memories")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def prefix_command(args):
    bench_prefix(args.model)


def kv_bytes_command(args):
    bench_kv_bytes(args.model)


def offload_command(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_offload(args.model, args.contexts, args.steps, args.device_gib)


def kv_plot_args(p):
    """The flags of `python bench.py kv-plot` (they were kvcache.py --plot's)."""
    p.add_argument("--config", default="smollm2-135m",
                   help=f"config.json path or preset: {', '.join([*kvcache.PRESETS, *kvcache.MLA_PRESETS])}")
    p.add_argument("--seq", type=int, default=8192, help="the longest context drawn (SmolLM2's context)")
    p.add_argument("--window", type=int, default=4096, help="the sliding window (Mistral-7B's: 4096)")


def kv_plot_command(args):
    if args.seq <= 0:
        raise SystemExit(f"error: --seq must be positive, got {args.seq}")
    plot_bytes(args.config, args.seq, args.window)
