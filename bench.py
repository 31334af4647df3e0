"""
bench.py — the project's benchmarks and model-level demos, one subcommand per idea. Each prints
markdown tables and saves them with results.save (results/<name>.json; plots under plots/).

    python bench.py decode                        # bundled model + TinyLlama-shaped random checkpoint
    python bench.py decode --models tinyllama-random --dtypes bfloat16
    python bench.py attention [--quick]           # flash.py: naive vs tiled vs SDPA, time and peak memory
    python bench.py batching                      # engine.py: static vs continuous batching; prefix caching;
                                                  # chunked prefill (--long-prompts-only: just that)
    python bench.py engine                        # engine.py: chat requests joining and leaving the batch
    python bench.py engine-step                   # engine.py: one batched decode step, eager vs compiled
    python bench.py speculative                   # speculative.py: EAGLE, Medusa, lookahead, lookup vs plain
    python bench.py prefix                        # kvcache.py: a shared prompt prefilled once and forked
    python bench.py kv-bytes                      # kvcache.py: a real cache's bytes against the formula
    python bench.py offload                       # kvcache.py: the context an offloaded cache fits, its cost
    python bench.py naive-vs-cached               # model.py: naive vs cached decoding against N, counted and timed
    python bench.py context [--dtype bfloat16]    # model.py: decode ms/token against context; prefill vs decode
    python bench.py quantize [--eval]             # quantize.py: perplexity and bytes per format on the model
    python bench.py quantize --weights int4 --out DIR   # write a quantized checkpoint
    python bench.py tp                            # tp.py: decode step with 1 process and 2 ranks, time in all-reduce
    python bench.py serve                         # server.py against llama-server: 1-32 streaming clients
    python bench.py runner                        # serve_local.py as users run it against llama.cpp's defaults
    python bench.py report                        # RESULTS.md from results/*.json

decode: batch 1, greedy, a fixed 128-token prompt, 128 new tokens with EOS
ignored, one warm-up run each, then --reps rounds in which every configuration
runs once in turn (the machine's drift falls on all alike); medians. For each configuration:
time to first token (TTFT, i.e. prefill), prefill tok/s, decode tok/s and the
memory bandwidth that decode speed implies (bytes read per token × tok/s; a
decoder reads every weight once per token, plus the KV cache so far). Peers run
in the same process and the same run, so ratios are fair on a noisy machine:
transformers `generate` (dynamic cache) and llama.cpp (llama-cpp-python) when
they are installed. llama.cpp runs GGUF files of the same weights, each timed
in turn with our rows of equal bits (F16 in the bfloat16 group; Q8_0 and Q4_1
in the float32 group, beside our int8/int4 weights): the bundled model's
original Q4_1 file, and exports of our checkpoint (F16; Q8_0 too for
tinyllama-random) that `checkpoint.export_gguf` writes once into the cache.

batching: engine.py's continuous batching against static batching (batches of
--max-batch requests, each running until its longest answer is done; padded
rows, or finished rows dropping out) on 64 chat-like requests queued at once,
then time to first token for requests sharing a 1,171-token system prompt with
the prefix cache off and on. Same engine, same kernels; only scheduling differs.
Last, chunked prefill: 1,500-2,000-token prompts arriving while short requests
decode, whole or in chunks of each --chunks size: the decoders' inter-token
latency (p50, p95, max) and the total throughput.

engine-step: one engine.py decode step (B rows, one token each, ~200 tokens
of context per row, keys read through the paged pool) timed eagerly and
compiled with kernels.compile_step for that one batch shape (the question:
would compiled steps per bucketed batch size, as vLLM captures CUDA graphs,
pay on this CPU?). Eager and compiled steps alternate; medians.

speculative: greedy, answers stopping at EOS (at most 256 new tokens;
--ignore-eos: always 256), 8 chat prompts and a summarise-this-text prompt;
plain decoding and each proposer (EAGLE head, Medusa heads, lookahead, prompt
lookup) in the same run and dtype, all eager on a dynamic cache as the runner
runs them, tokens checked against plain decoding's; per-prompt speedups, their
median and spread. --compile compiles the drafts and adds plain decoding on a
compiled static cache, the runner's fastest plain configuration.

runner: serve_local.py as a user runs it, one process per configuration with
the prompts typed into its chat (/reset between them): the plan (defaults),
plain decoding compiled and eager, and the fastest flags; then
llama.cpp's defaults (llama-server) on the very GGUF the runner loads. Greedy,
8 chat prompts and a summarise prompt, answers stopping at EOS: time until the
chat is ready, load and compile time, TTFT, decode tok/s per prompt, whether
each text equals plain decoding's, and the runner's printed speedup estimate
against the measured one.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import checkpoint
import drafting
import engine
import flash
import kernels
import kvcache
import plan
import quantize
import results
import speculative
import tp
from kvcache import KVCache, common_prefix, kv_bytes_per_token
from model import GenerationStats, Llama, LlamaConfig, generate_cached, save_random_checkpoint, unfuse
from nanoinfer.load import build, load
from sampling import SamplingParams, visible

ROOT = Path(__file__).resolve().parent
HANDBOOK = (ROOT / "data" / "handbook.txt").read_text().strip()   # a document to ask questions about
QUESTIONS = [
    "How heavy is an empty cart?", "When does the harvest season start?",
    "What happens if the green button is pressed twice quickly?", "How are the lidar domes cleaned?",
    "What should the technician do when hail starts?", "How often is the crate latch greased?",
    "What is the record number of crates in one day?", "When must the map be recorded again?",
]

RANDOM_TINYLLAMA = "tinyllama-random"
DECODE_MODELS, DECODE_DTYPES = [checkpoint.DEFAULT_MODEL, RANDOM_TINYLLAMA], ["float32", "bfloat16"]


def model_dir(name: str):
    """`tinyllama-random` is TinyLlama-1.1B's exact shape with random bf16 weights, built once."""
    if name == RANDOM_TINYLLAMA:
        path = checkpoint.cache_root() / RANDOM_TINYLLAMA
        if not (path / "model.safetensors").is_file():
            print(f"writing {path} (2.2 GB of random weights, once)")
            save_random_checkpoint(checkpoint.TINYLLAMA_CONFIG, path)
        return path
    return checkpoint.resolve(name)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes per second a device-to-device copy moves (read + write): the practical ceiling that a
    memory-bound decode step's GB/s is compared with on a GPU."""
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / kernels.best_seconds(lambda: y.copy_(x), device)


def bytes_per_token(model: Llama, context: int) -> int:
    """What one decode step reads: every weight except the embedding table (one row
    is gathered) — unless the table doubles as the LM head — plus the KV cache.
    Quantized weights count as stored, scales included (quantize.weight_bytes)."""
    c = model.config
    weights = quantize.weight_bytes(model)
    if not c.tie_embeddings or quantize.scheme(model):   # a quantized head is its own copy
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, model.embed_tokens.weight.element_size())
    return weights + context * kv


def gguf_bytes_per_token(path, c: LlamaConfig, context: int) -> int:
    """bytes_per_token for llama.cpp: the GGUF's tensors as stored, plus its f16 KV cache (the default)."""
    import gguf
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    if "output.weight" in tensors:   # untied: the embedding table is only gathered from
        tensors.pop("token_embd.weight")
    return sum(tensors.values()) + context * kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, 2)


def llama_cpp_files(name: str, path) -> dict[str, Path]:
    """The GGUFs llama.cpp runs for a model, by label: the bundled original, and our exports (written once)."""
    files = {}
    if checkpoint.ALIASES.get(name.lower()) == checkpoint.BUNDLED:
        files["Q4_1"] = checkpoint.bundled_gguf(*checkpoint.BUNDLED[1:])
    for fmt in ["f16"] + (["q8_0"] if name == RANDOM_TINYLLAMA else []):
        out = checkpoint.cache_root() / "bench" / f"{path.name}-{fmt}.gguf"
        if not out.is_file():
            print(f"writing {out} (once)", flush=True)
            checkpoint.export_gguf(path, out, LlamaConfig.from_hf(checkpoint.read_config(path)), fmt)
        files[fmt.upper()] = out
    return files


class LlamaServerDecode:
    """llama.cpp through llama-server where llama-cpp-python is not installed: the same greedy run
    (the prompt's token ids, ``new_tokens`` generated, EOS ignored), timed by the server itself.
    The server starts at the first call and joins ``servers``, which the caller stops."""

    def __init__(self, gguf: Path, threads: int, ctx: int, servers: list):
        self.gguf, self.threads, self.ctx, self.servers, self.port = gguf, threads, ctx, servers, None

    def run(self, prompt: list[int], new_tokens: int):
        def fn(warmup: bool):
            import httpx
            if self.port is None:
                self.port = free_port()
                log = checkpoint.cache_root() / "bench" / "llama-server-decode.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                command = llama_server_command(llama_server_binary(), self.gguf, self.threads, 1, self.ctx)
                self.servers.append(start_server(command + ["--port", str(self.port)], self.port, log))
            n = 8 if warmup else new_tokens
            body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
            t = httpx.post(f"http://127.0.0.1:{self.port}/completion", json=body, timeout=600).json()["timings"]
            assert t["predicted_n"] == n, t
            return t["prompt_ms"] / 1e3, (new_tokens - 1) / t["predicted_per_second"]
        return fn


def run_llama_cpp(llm, prompt, new_tokens):
    """Greedy decoding with llama.cpp's low-level loop: `eval` runs tokens through the
    model (the prompt as one batch), then we take the argmax of the last position's
    logits straight from the context. No sampler chain, and EOS never stops it."""
    import llama_cpp
    n_vocab = llm.n_vocab()

    def next_token():
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    llm.reset()                  # forget the previous run (eval drops the KV cache past n_tokens)
    t0 = time.perf_counter()
    llm.eval(prompt)
    token = next_token()
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = next_token()
    assert llm.n_tokens == len(prompt) + new_tokens - 1
    return t1 - t0, time.perf_counter() - t1


def run_ours(model, prompt, new_tokens, cache=None):
    stats = GenerationStats()
    if cache is not None:
        cache.crop(0)
    out = list(generate_cached(model, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), stats, cache))
    assert len(out) == new_tokens
    return stats.prefill_s, stats.decode_s


def run_transformers(hf, prompt, new_tokens):
    ids = torch.tensor([prompt], device=hf.device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    kernels.synchronize(hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw).device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    kernels.synchronize(out.device)     # a GPU runs ahead of the host: stop the clock when it is done
    total = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + new_tokens
    return ttft, max(total - ttft, 1e-9)


# Seconds each turn of a side-by-side bench waits first: the previous configuration's threads (llama.cpp's
# spin after a request, OpenMP's after ours) stop competing for the two cores before the next one is timed.
SETTLE_S = 0.3


def measure_in_turn(fns: dict, reps: int) -> dict:
    """{name: fn(warmup) -> (ttft_s, decode_s)} -> {name: (median ttft, median decode)}: one warm-up each,
    then ``reps`` rounds in which every fn runs once in turn, so a drift of the machine's speed over the
    minutes of a run (±15-30% here) falls on every row alike instead of on whichever ran last."""
    for fn in fns.values():
        fn(warmup=True)
    runs = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            time.sleep(SETTLE_S)
            runs[name].append(fn(warmup=False))
    return {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
            for name, rs in runs.items()}


def memory_available() -> int:
    """Bytes Linux could still hand out (MemAvailable: free plus reclaimable cache); unbounded elsewhere."""
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 1 << 62
    return int(line.split()[1]) * 1024


def gguf_group(label: str, dtypes: list[str]) -> str:
    """The dtype group a llama.cpp row is timed in, in turn with its equal-bits rows: F16 beside our bf16,
    Q8_0 and Q4_1 beside our int8/int4 weights with fp32 activations; else in the first group."""
    group = "bfloat16" if label == "F16" else "float32"
    return group if group in dtypes else dtypes[0]


def bench_decode(args):
    rows, notes = [], []
    llama_cpp, peer = None, not args.no_peers and args.device == "cpu"
    if peer:
        try:
            import llama_cpp
        except ImportError:
            pass
        peer = llama_cpp is not None or llama_server_binary() is not None
        if not peer:
            print("neither llama-cpp-python nor llama-server: skipping llama.cpp "
                  "(pip install -r requirements-bench.txt, or scripts/build_llama_server.sh)")
    for name in args.models:
        path = model_dir(name)
        # The GGUF exports first (once): writing TinyLlama's F16 beside the fp32 group's four models
        # (~15 GB) ran a 24 GB machine out of memory.
        ggufs = llama_cpp_files(name, path) if peer else {}
        info = plan.model_info(str(path))      # its config, and its Linear weights (what prepack's copies add)
        cfg = info.config
        for dtype in args.dtypes:
            prompt = torch.randint(100, cfg.vocab_size - 100, (args.prompt_tokens,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            n_ctx = args.prompt_tokens + args.new_tokens + 16   # a static cache sized to the job, as gpt-fast does
            # implementation -> (dtype column, bytes read per decode step, fn(warmup) -> (ttft_s, decode_s));
            # the eager row comes first in the table but is built last (below)
            impls = {"nanoinfer cached": None}
            for weights in ([] if args.no_compile else args.weights):
                # More instances: compile_decode() switches every one-token step to the compiled graph;
                # int8/int4 quantize every Linear first (quantize.py), activations stay in `dtype`.
                # quantized; no prepacked copies (they serve eager prefills, not the compiled step, and TinyLlama's
                # four instances would not fit in 24 GB with them)
                fast = build(path, args.device, dtype, weights, prepacked=False)
                static = kvcache.new_cache(fast, "static", max_len=n_ctx)
                t0 = time.perf_counter()
                kernels.compile_decode(fast)
                try:
                    with torch.inference_mode():
                        run_ours(fast, prompt, 2, static)
                except ValueError as e:          # a step AOTInductor cannot package without its weights
                    print(f"  {name} {dtype} {weights}: no compiled row ({e})", flush=True)
                    continue
                print(f"  {name} {dtype} {weights}: compiled the decode step in {time.perf_counter() - t0:.1f} s",
                      flush=True)
                label = dtype if weights == "auto" else f"{weights} weights, {dtype}"
                per_tok = bytes_per_token(fast, args.prompt_tokens + args.new_tokens // 2)
                impls[f"nanoinfer static+compile{'' if weights == 'auto' else ' ' + weights}"] = (
                    label, per_tok, lambda warmup, fast=fast, static=static: run_ours(
                        fast, prompt, 8 if warmup else args.new_tokens, static))
            hf = None
            if not args.no_peers:
                try:
                    from transformers import AutoConfig, LlamaForCausalLM
                    # the tensors through read_weights: a converted GGUF stores q/k/v and gate/up stacked
                    hf = LlamaForCausalLM.from_pretrained(None, config=AutoConfig.from_pretrained(path),
                                                          state_dict=checkpoint.read_weights(path),
                                                          dtype=kernels.DTYPES[dtype]).to(args.device).eval()
                except ImportError:
                    print("transformers not installed: skipping it (pip install -r requirements-bench.txt)")
            # The eager row as the runner builds it, with oneDNN's copies for its prefills, where they fit beside
            # the rest: in TinyLlama's fp32 group on a 24 GB machine they pushed llama.cpp's mapped GGUFs out to
            # disk (1.2 GB/s of page-ins). Without them its prefill is slower, its one-token steps the same.
            peers = {label: f for label, f in ggufs.items() if gguf_group(label, args.dtypes) == dtype}
            gguf_bytes = sum(f.stat().st_size for f in peers.values())
            copies = args.device != "cpu" or memory_available() > 2 * info.matrix_params * kernels.DTYPES[dtype].itemsize \
                + gguf_bytes + 2**30
            if not copies:
                notes.append(f"{name} {dtype}: nanoinfer cached without oneDNN's prepacked copies (they would not "
                             "fit in memory beside the group's other rows): slower prefill, the same decode steps")
            model = build(path, args.device, dtype, prepacked=copies)   # run_ours ignores EOS
            per_token = bytes_per_token(model, args.prompt_tokens + args.new_tokens // 2)
            impls["nanoinfer cached"] = (dtype, per_token, lambda warmup, model=model: run_ours(
                model, prompt, 8 if warmup else args.new_tokens))
            if hf is not None:
                impls["transformers generate"] = (dtype, per_token, lambda warmup: run_transformers(
                    hf, prompt, 8 if warmup else args.new_tokens))
            servers = []     # llama-server processes of this group, stopped after it
            for label, gguf_path in peers.items():
                threads = torch.get_num_threads()
                if llama_cpp is not None:
                    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads,
                                          n_threads_batch=threads, n_batch=512, logits_all=False,
                                          verbose=False)
                    fn = lambda warmup, llm=llm: run_llama_cpp(llm, prompt, 8 if warmup else args.new_tokens)
                else:
                    fn = LlamaServerDecode(gguf_path, threads, n_ctx, servers).run(prompt, args.new_tokens)
                impls[f"llama.cpp {label}"] = (label, gguf_bytes_per_token(
                    gguf_path, model.config, args.prompt_tokens + args.new_tokens // 2), fn)
            with torch.inference_mode():
                timed = measure_in_turn({impl: fn for impl, (_, _, fn) in impls.items()}, args.reps)
            for proc in servers:
                proc.terminate()
                proc.wait(60)
            group = []
            for impl, (label, per_tok, fn) in impls.items():
                ttft, decode_s = timed[impl]
                tok_s = (args.new_tokens - 1) / decode_s
                group.append([name, impl, label, ttft, args.prompt_tokens / ttft, tok_s,
                              per_tok * tok_s / 1e9])
                print(f"  {name} {impl} {label}: decode {tok_s:.1f} tok/s", flush=True)
            # Ratios against transformers in the same dtype when it ran, else against the first row.
            base = next((r[5] for r in group if r[1] == "transformers generate"), group[0][5])
            rows += [r + [r[5] / base] for r in group]
            del model
    table = decode_table(rows, args)
    table.notes += notes
    if args.device != "cpu":    # what the GB/s column is to be read against on a GPU
        peak = copy_bandwidth(torch.device(args.device)) / 1e9
        table.notes.append(f"{torch.cuda.get_device_name()}: a device-to-device copy streams {peak:.0f} GB/s "
                           f"(read + write); best row {max(r[6] for r in rows) / peak:.0%} of it")
    print(f"\n{table.title}\n\n{table.markdown()}")
    name = decode_name(args.models, args.dtypes) + ("" if args.device == "cpu" else f"-{args.device}")
    print(f"saved {results.save(name, 'runner', [table])}")


def decode_table(rows: list[list], args) -> results.Table:
    """rows: [model, implementation, dtype, TTFT s, prefill tok/s, decode tok/s, GB/s, × transformers]."""
    return results.Table(
        f"batch 1, greedy, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens (EOS ignored), "
        f"median of {args.reps} rounds, each configuration in turn, {torch.get_num_threads()} threads",
        ["model", "implementation", "dtype", "TTFT ms", "prefill tok/s", "decode tok/s", "GB/s", "× transformers"],
        [r[:3] + [f"{r[3] * 1000:.0f}", f"{r[4]:.0f}", f"{r[5]:.1f}", f"{r[6]:.1f}", f"{r[7]:.2f}"] for r in rows],
        [f"llama.cpp rows (dtype = GGUF tensor type) are timed in turn with their equal-bits rows: F16 in the "
         f"bfloat16 group, Q8_0 and Q4_1 in the float32 one (where a group did not run: {args.dtypes[0]}); × = decode speed over "
         "transformers generate in the group (over the group's first row without transformers); GB/s = bytes "
         "read per decode step × decode tok/s"])


def decode_name(models: list[str], dtypes: list[str]) -> str:
    """"decode" for the full run; a partial one is named by its models and dtypes, so it
    does not overwrite the full one (`--models smollm2-135m --dtypes bfloat16`:
    decode-smollm2-135m-bfloat16)."""
    if models == DECODE_MODELS and dtypes == DECODE_DTYPES:
        return "decode"
    return "-".join(["decode"] + [re.sub(r"[^a-z0-9.]+", "-", Path(m).name.lower()).strip("-")
                                  for m in models + dtypes])


def long_system_prompt() -> str:
    """The handbook of kvcache.py's prefix demo, plus two weeks of reports: ~1,150 tokens."""
    rng = random.Random(0)
    orchards = ["Beaulieu", "Les Vergers", "Montfort", "La Clairière", "Saint-Aubin"]
    log = "\n".join(f"Day {d} ({rng.choice(orchards)}): {rng.randint(300, 1800)} crates, {rng.randint(4, 12)} "
                    f"carts, {rng.randint(0, 3)} red cards, {rng.randint(0, 2)} emergency stops."
                    for d in range(1, 16))
    return ("You are a helpful assistant. Answer from the handbook below in one short sentence.\n\n"
            f"{HANDBOOK}\n\nAppendix: the daily reports of last season.\n{log}")


# ----------------------------------------------------------------------------
# model.py's lesson, measured: naive against cached decoding, prefill against decode.

def run_setup(name: str, model: Llama) -> str:
    """What a table's and a plot's title say the numbers ran on."""
    threads = torch.get_num_threads()
    return (f"{name}, {str(model.embed_tokens.weight.dtype).removeprefix('torch.')}, "
            f"{threads} thread{'s' if threads > 1 else ''}")


def bench_naive_vs_cached(name: str, sizes: list[int]) -> Path:
    """model.py's seed exercise against N: each decoder writes N tokens from the BOS
    token alone (greedy, EOS ignored, one run each), counting what it computes
    (GenerationStats: positions pushed through the model, query·key scores) and
    timing it. The counts are exact; the times are this machine's."""
    from model import DECODERS
    model, tok = load(name)                   # as the runner loads it: fp32 on a CPU, eager
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
    model, _ = load(name, dtype=dtype)
    c = model.config
    if min(contexts) < 1 or max(contexts) + steps + 2 > c.max_seq_len:
        raise ValueError(f"--contexts must be between 1 and {c.max_seq_len - steps - 2} (the model's context "
                         f"less the decode steps), got {contexts}")
    weights = bytes_per_token(model, 0)      # every weight a decode step reads (bench decode's rule)
    kv_token = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, model.embed_tokens.weight.element_size())
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


# ----------------------------------------------------------------------------
# batching: static against continuous batching, on one workload.

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
    model, tok = load(args.model, dtype=args.dtype)
    if args.long_prompts_only:
        return bench_long_prompts(model, args)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
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
    title = (f"chunked prefill, {args.model} ({str(model.embed_tokens.weight.dtype).removeprefix('torch.')}), "
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


# ----------------------------------------------------------------------------
# engine: requests joining and leaving the batch, step by step, on the bundled model.

def engine_demo(model_name: str, n: int, max_batch: int):
    model, tok = load(model_name)
    system = "You are a helpful assistant. Answer in one short sentence."
    questions = ["What is 2+2?", "Name a colour.", "What is the capital of France?", "Say hello.",
                 "What do bees make?", "Name a fruit.", "How many legs has a cat?", "What is ice?"]
    eng = engine.Engine(model, max_batch=max_batch)
    for i in range(n):   # the same system prompt: later requests find its blocks in the prefix cache
        chat = [{"role": "system", "content": system}, {"role": "user", "content": questions[i % len(questions)]}]
        ids = tok.encode(tok.apply_chat_template(chat), add_bos=False)
        eng.add_request(ids, SamplingParams(max_new_tokens=8 + 6 * i))
    print(f"{n} requests queued, max batch {max_batch}, {eng.allocator.num_blocks} blocks of "
          f"{eng.allocator.block_size} tokens\n\nstep | running requests | blocks used | finished")
    while eng.has_work():
        events = eng.step()
        done = [e.request_id for e in events if e.finished]
        used = eng.allocator.num_blocks - eng.num_free_blocks
        print(f"{eng.stats().steps:4} | {' '.join(str(e.request_id) for e in events):24} | {used:11} | "
              f"{' '.join(map(str, done))}")
    s = eng.stats()
    print(f"\n{s.steps} steps; prefill computed {s.prefill_tokens} tokens, found {s.cached_tokens} in the "
          f"prefix cache; {s.decode_tokens} decode rows; every block back: {eng.num_free_blocks} free")


# ----------------------------------------------------------------------------
# speculative: plain decoding against each method on the same prompts.

def compare(model: Llama, prompts: list[list[int]], methods: dict, new_tokens: int,
            ignore_eos: bool = False) -> list[dict]:
    """methods: name -> zero-argument factory of a proposer, or of None (plain
    decoding) or a cache (plain decoding on it: a static cache runs a compiled
    step). The first method is the baseline. Greedy, answers stopping at EOS (as
    a user reads them) unless ignore_eos; returns one row per method with decode
    tok/s over all prompts, the speedup on each prompt (its decode time against
    the baseline's on the same prompt: the tokens are the same) and the
    speculative stats.

    The methods take turns prompt by prompt, so a slow spell of this shared
    machine lands on all of them rather than on whichever ran then.

    Every method's tokens are checked against the baseline's: "diverged" lists,
    per prompt, the first new token that differs (None: identical). In fp32
    every method must match. In bf16 a verify pass of T tokens rounds
    differently from T one-token steps: its attention runs in SDPA's kernel, a
    one-token step's in two matmuls around an fp32 softmax (model.attend), and
    a few matrix products differ in the last bit. At a near-tie the argmax can
    flip, and the two texts part there."""
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=ignore_eos)
    runs = {name: dict(spec=speculative.SpecStats(), decode_s=[], tokens=[], outs=[]) for name in methods}
    for ids in prompts:
        for name, factory in methods.items():
            r, stats, proposer = runs[name], GenerationStats(), factory()
            if proposer is None or isinstance(proposer, KVCache):
                if proposer is not None:
                    proposer.crop(0)
                run = generate_cached(model, ids, params, stats, proposer)
            else:
                run = speculative.generate(model, ids, params, proposer, stats, r["spec"])
            r["outs"].append(list(run))
            r["decode_s"].append(stats.decode_s)
            r["tokens"].append(stats.new_tokens - 1)
    rows, reference = [], next(iter(runs.values()))
    for name, r in runs.items():
        diverged = [None if o == ref else common_prefix(o, ref) for o, ref in zip(r["outs"], reference["outs"])]
        speedups = [(n / s) / (n0 / s0) if s and s0 and n and n0 else 0.0 for n, s, n0, s0 in
                    zip(r["tokens"], r["decode_s"], reference["tokens"], reference["decode_s"])]
        rows.append({"method": name, "tok_s": sum(r["tokens"]) / sum(r["decode_s"]), "diverged": diverged,
                     "speedups": speedups, "speedup": statistics.median(speedups), "tokens": r["tokens"],
                     "spec": r["spec"] if r["spec"].steps else None})
    return rows


def same_tokens(diverged: list) -> str:
    """"yes", or how many prompts' texts parted from plain decoding's and at which new token."""
    parted = sorted(i for i in diverged if i is not None)
    return "yes" if not parted else f"{len(diverged) - len(parted)}/{len(diverged)}; others from token " + \
        ", ".join(map(str, parted))


def table(rows: list[dict], title: str = "") -> results.Table:
    """compare()'s rows; "accepted lengths" is the histogram n:steps (steps that accepted n guesses)."""
    cells = []
    for r in rows:
        s, ups = r["spec"], r["speedups"]
        cells.append([r["method"], f"{r['tok_s']:.1f}", f"{r['speedup']:.2f}×",
                      f"{min(ups):.2f}–{max(ups):.2f}×" if len(ups) > 1 else "",
                      f"{100 * s.acceptance:.0f}%" if s else "", f"{s.tokens_per_forward:.2f}" if s else "1",
                      " ".join(f"{n}:{c}" for n, c in sorted(s.histogram.items())) if s else "",
                      same_tokens(r["diverged"])])
    per_prompt = "; ".join(f"{r['method']}: {' '.join(f'{u:.2f}' for u in r['speedups'])}" for r in rows[1:])
    return results.Table(title, ["method", "decode tok/s", "speedup (median)", "spread (min–max)", "acceptance",
                                 "tokens/forward", "accepted lengths", "same tokens"], cells,
                         ["speedup = a prompt's decode time with plain decoding over its time with the method, in "
                          "the same run (same tokens: same count); median and spread over the prompts; decode "
                          "tok/s over all of them; accepted lengths n:count = target forwards that accepted n "
                          "guesses", f"answer lengths (new tokens): {' '.join(map(str, rows[0]['tokens']))}",
                          f"per-prompt speedups, in prompt order: {per_prompt}"])


def plot_accepted(groups: dict[str, list[dict]], title: str = "") -> Path | None:
    """One panel per prompt group: for each speculative method, how many steps accepted 0, 1, … k guesses."""
    plt = results.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], groups.items()):
        spec = [r for r in rows if r["spec"]]
        longest = max(max(r["spec"].histogram, default=0) for r in spec) if spec else 0
        width = 0.8 / max(len(spec), 1)
        for i, r in enumerate(spec):
            ax.bar([n + (i - (len(spec) - 1) / 2) * width for n in range(longest + 1)],
                   [r["spec"].histogram.get(n, 0) for n in range(longest + 1)], width, label=r["method"])
        ax.set(xlabel="guesses accepted in one target forward", ylabel="target forwards", title=name,
               xticks=range(longest + 1))
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return results.save_plot(fig, "speculative_accepted.png", dpi=100)


CHAT_PROMPTS = [
    "Explain in simple terms why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "What are three tips for learning a new language?",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Write a polite email asking a neighbour to turn down their music.",
    "List some good habits for staying healthy while working from home.",
]


def bench_speculative(args):
    """Greedy, answers stopping at EOS (--ignore-eos: always new-tokens long): plain
    decoding against each speculative method, same prompts, same run. Target and
    drafts run eagerly, as the runner runs them; --compile compiles the draft
    models' steps and adds the compiled plain step, as the runner's --compile does."""
    model, tok = load(args.model, "cpu", args.dtype)

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)

    methods = {"plain": lambda: None}
    tree = speculative.parse_tree(args.spec_tree) if args.spec_tree else None
    mtree = speculative.parse_tree(args.medusa_tree) if args.medusa_tree else None
    for name in (n for n in (args.draft, args.medusa) if n):
        draft = drafting.load_draft(name, model, tok, "cpu", args.dtype)
        if isinstance(draft, drafting.MedusaHeads):
            mk = args.medusa_k or len(draft.blocks)
            methods[f"medusa {name}, chain k={mk}"] = lambda d=draft, mk=mk: drafting.draft_proposer(d, model, mk)
            if mtree:
                methods[f"medusa {name}, tree of {mtree[1]} (W={mtree[0]}, depth {mk})"] = \
                    lambda d=draft, mk=mk: drafting.draft_proposer(d, model, mk, tree=mtree)
            continue
        k, c = args.spec_k, args.compile        # the same for every draft
        methods[f"draft {name}, k={k}"] = lambda d=draft: drafting.draft_proposer(d, model, k, compile=c)
        methods[f"draft {name}, adaptive k"] = \
            lambda d=draft: drafting.draft_proposer(d, model, k, adaptive=True, compile=c)
        if draft.config.eagle and tree:
            methods[f"draft {name}, tree of {tree[1]} (W={tree[0]}, depth {k})"] = \
                lambda d=draft: drafting.draft_proposer(d, model, k, tree=tree)
        methods[f"draft {name}, k={k} + lookup N={args.prompt_lookup}"] = \
            lambda d=draft: drafting.LookupThenDraft(drafting.draft_proposer(d, model, k, compile=c), args.prompt_lookup)
        if c:
            t0 = time.perf_counter()        # for every static-cache size the prompts use
            drafting.draft_proposer(draft, model, k, compile=True).warm_up(model)
            print(f"draft step compiled in {time.perf_counter() - t0:.0f} s (not timed below)", flush=True)
    methods[f"lookahead {args.lookahead}"] = lambda: speculative.Lookahead(*speculative.parse_lookahead(args.lookahead))
    methods[f"prompt lookup N={args.prompt_lookup}, k={args.lookup_k}"] = \
        lambda: speculative.PromptLookup(args.prompt_lookup, args.lookup_k)
    if args.compile:
        # The target runs eagerly in every method above; the runner's fastest plain
        # decoding is the compiled one-token step on a static cache, which a
        # several-token verify pass cannot use. This row shows what it decodes at.
        t0 = time.perf_counter()
        kernels.compile_decode(model)
        static = kvcache.new_cache(model, "static", 2048)        # the runner's default context
        list(generate_cached(model, [0], SamplingParams(max_new_tokens=2), cache=static))
        methods["plain, compiled (--cache static --compile)"] = lambda: static
        print(f"plain decode step compiled in {time.perf_counter() - t0:.0f} s (not timed below)", flush=True)
    groups = {f"{args.prompts} chat prompts": [chat(t) for t in CHAT_PROMPTS[:args.prompts]],
              "summarise-this-text prompt": [chat(speculative.SUMMARISE + HANDBOOK)]}
    ending = "EOS ignored" if args.ignore_eos else "answers stopping at EOS"
    how = "drafts compiled" if args.compile else "target and drafts eager, as the runner runs them"
    tables, rows = [], {}
    for name, prompts in groups.items():
        title = (f"{name}: {args.model} {args.dtype}, greedy, {'' if args.ignore_eos else 'at most '}"
                 f"{args.new_tokens} new tokens, {ending}, "
                 f"{how}, {torch.get_num_threads()} threads")
        print(f"\n{title}", flush=True)
        rows[name] = compare(model, prompts, methods, args.new_tokens, args.ignore_eos)
        tables.append(table(rows[name], title))
        print(f"\n{tables[-1].markdown()}", flush=True)
    plot = plot_accepted(rows, f"{args.model} {args.dtype}: guesses accepted per target forward, greedy, "
                               f"at most {args.new_tokens} new tokens per prompt, {ending}")
    print(f"saved {results.save('speculative', 'speculative', tables, plots=[plot] if plot else [])}")


# ----------------------------------------------------------------------------
# prefix and kv-bytes: the KV cache lesson on the bundled model.

def bench_prefix(model_name: str = checkpoint.DEFAULT_MODEL, n_answer: int = 24):
    """Seed exercise 2: one prefill of a shared prompt, forked for many questions
    (kvcache.KVCache.fork), against encoding the whole prompt for each."""
    model, tok = load(model_name)
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
    model, tok = load(model_name)
    c = model.config
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about caches."}]),
                        add_bos=False)
    n = len(prompt) + new_tokens
    cache = kvcache.new_cache(model, "static", max_len=n)
    out = list(generate_cached(model, prompt, SamplingParams(max_new_tokens=new_tokens), cache=cache))
    size = model.embed_tokens.weight.element_size()
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
    model, _ = load(model_name)
    c, dev = model.config, model.embed_tokens.weight.device
    if max(contexts) + steps + 1 > c.max_seq_len:
        raise ValueError(f"--contexts must leave {steps + 1} tokens of the model's {c.max_seq_len}-token context")
    per_token = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, model.embed_tokens.weight.element_size())
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


# ----------------------------------------------------------------------------
# quantize: what each format costs a real model; writing a quantized checkpoint.

EVAL_TEXT = "data/eval_text.txt"   # perplexity text for `bench.py quantize`
EVAL_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for sleeping better.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of a heist movie you invent, in one paragraph.",
    "How do I boil an egg so the yolk stays soft?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "List the planets of the solar system in order from the sun.",
]
CONFIGS = [  # label, weights, kv dtype
    ("full", None, None), ("KV int8", None, "int8"), ("KV fp8", None, "fp8"),
    ("KV fp8, plain cast", None, "fp8-plain"), ("weights int8", "int8", None),
    ("weights int4 (g32)", "int4", None), ("weights int8 + KV int8", "int8", "int8")]


def perplexity(model, ids: list[int], kv_dtype: str | None, chunk: int = 128) -> float:
    """exp(mean negative log-likelihood) of ``ids``, fed through the cache ``chunk``
    tokens at a time, so each chunk attends to the stored (quantized) past."""
    cache, nll = kvcache.new_cache(model, "dynamic", codec=quantize.kv_codec(kv_dtype)), 0.0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:min(start + chunk, len(ids) - 1)]
            logits = model(torch.tensor([piece]), torch.arange(start, start + len(piece)), cache)[0]
            target = torch.tensor(ids[start + 1:start + 1 + len(piece)])
            nll += torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum").item()
    return float(torch.exp(torch.tensor(nll / (len(ids) - 1))))


def quantize_eval(name: str, dtype: str, new_tokens: int, n_prompts: int, speed_tokens: int = 64):
    """The table of RESULTS.md's quantize section. Agreement is teacher-forced: the full model writes
    ``new_tokens`` greedy tokens per prompt once; every configuration then reads
    those same sequences in one forward, and we count the positions where its
    top-1 token equals the full model's (read the same way). Free-running texts
    are no measure: after the first differing token they are different texts."""
    text = (ROOT / EVAL_TEXT).read_text()
    title = (f"{name}, {dtype}: perplexity over {EVAL_TEXT}; top-1 agreement over {n_prompts} prompts × "
             f"{new_tokens} tokens; decode tok/s: {speed_tokens} tokens, eager, dynamic cache, "
             f"{torch.get_num_threads()} threads")
    print(f"{title}\n", flush=True)
    rows, sequences, reference = [], None, None
    for label, weights, kv in CONFIGS:
        model, tok = load(name, "cpu", dtype, weights=weights)
        if sequences is None:   # the full model, first in CONFIGS, writes the continuations
            chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                     for p in EVAL_PROMPTS[:n_prompts]]
            prompts = [tok.encode(c, add_bos=False) for c in chats]
            sequences = [(len(p), p + list(generate_cached(model, p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))))
                         for p in prompts]
        ppl = perplexity(model, tok.encode(text), kv)
        with torch.inference_mode():
            top1 = [model(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1),
                          kvcache.new_cache(model, "dynamic", codec=quantize.kv_codec(kv)))[0, n - 1:].argmax(-1) for n, seq in sequences]
        reference = reference or (ppl, top1)
        agree = sum(int((a == b).sum()) for a, b in zip(top1, reference[1])) / sum(len(a) for a in top1)
        stats, cache = GenerationStats(), kvcache.new_cache(model, "dynamic", codec=quantize.kv_codec(kv))
        list(generate_cached(model, sequences[0][1][:sequences[0][0]], SamplingParams(
            max_new_tokens=speed_tokens, ignore_eos=True), stats, cache))
        rows.append((label, cache.nbytes / cache.capacity, quantize.weight_bytes(model), ppl,
                     100 * (ppl / reference[0] - 1), 100 * agree, (stats.new_tokens - 1) / stats.decode_s))
        print(f"  {label}: ppl {ppl:.3f}, agreement {100 * agree:.1f}%", flush=True)
        del model
    table = quantize_table(rows, title)
    print(f"\n{table.markdown()}")
    print(f"saved {results.save('quantize-eval', 'quantize', [table])}")


def quantize_table(rows: list[tuple], title: str = "") -> results.Table:
    """rows: (configuration, KV bytes/token, weight bytes, perplexity, Δ ppl %, agreement %, decode tok/s)."""
    return results.Table(title, ["configuration", "KV bytes/token", "weight MB", "perplexity", "Δ ppl",
                                 "top-1 agreement", "decode tok/s"],
                         [[label, f"{kvb:.0f}", f"{wb / 1e6:.0f}", f"{ppl:.3f}", f"{dppl:+.2f}%", f"{agr:.1f}%",
                           f"{tps:.1f}"] for label, kvb, wb, ppl, dppl, agr, tps in rows],
                         ["Δ ppl against the first row; agreement = teacher-forced top-1 tokens equal to the full "
                          "model's"])


def quantize_demo(name: str, dtype: str, n_tokens: int = 512):
    """A short tour: the bytes each format holds and the perplexity it costs, on the
    first ``n_tokens`` of the evaluation text (the full table: --eval)."""
    text = (ROOT / EVAL_TEXT).read_text()
    print(f"{name}, {dtype}; perplexity on the first {n_tokens} tokens of {EVAL_TEXT}\n")
    print(f"{'configuration':24} {'weights MB':>10} {'KV B/token':>10} {'perplexity':>10}")
    base = None
    for label, weights, kv in [c for c in CONFIGS if "plain" not in c[0] and "+" not in c[0]]:
        model, tok = load(name, "cpu", dtype, weights=weights)
        ids = tok.encode(text)[:n_tokens]
        ppl = perplexity(model, ids, kv)
        base = base or ppl
        cache = kvcache.new_cache(model, "static", max_len=1, codec=quantize.kv_codec(kv))
        print(f"{label:24} {quantize.weight_bytes(model) / 1e6:>10.0f} {cache.nbytes:>10} {ppl:>10.3f}"
              f"  ({100 * (ppl / base - 1):+.2f}%)", flush=True)


def quantize_write(name: str, weights: str, group_size: int, dtype: str, out_dir) -> Path:
    """A quantized checkpoint: the model read in full precision, every Linear
    quantized in its portable layout, written by checkpoint.save with the scheme
    in config.json; `serve_local.py --model DIR` then loads it as stored."""
    quantize.check_scheme(weights, group_size)
    if weights in (None, "auto"):
        raise ValueError("--out needs --weights int8 or int4")
    source = checkpoint.resolve(name)
    model = build(source, "cpu", dtype, weights, group_size, prepacked=False, prepare=False)
    config = checkpoint.read_config(source) | {quantize.CONFIG_KEY: quantize.scheme(model)}
    out = checkpoint.save(out_dir, unfuse(model), config, copy_files_from=source)
    print(f"wrote {out}: {quantize.weight_bytes(model) / 1e6:.0f} MB of weights ({weights}); "
          f"run it with: python serve_local.py --model {out}")
    return out


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
            out = tp.launch(tp.measure, world, str(model_dir(name)), dtype, prompt_tokens, steps, split,
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


# ----------------------------------------------------------------------------
# serve: our HTTP server against llama.cpp's llama-server, many streaming clients at once.

def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(cmd: list[str], port: int, log: Path, timeout: float = 600):
    """Start a server process (its output to ``log``) and wait until /health answers."""
    import httpx
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise OSError(f"{cmd[0]} exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise OSError(f"{cmd[0]} did not answer /health within {timeout:.0f} s: see {log}")


def serve_requests(n: int) -> list[list[dict]]:
    """A fixed mix of chat requests: short questions alone, and questions after a shared
    ~400-token system prompt (the handbook), alternating."""
    system = "You are a helpful assistant. Answer from the handbook below in one short sentence.\n\n" + HANDBOOK
    return [[{"role": "system", "content": system}] * (i % 2) + [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            for i in range(n)]


async def serve_load(url: str, concurrency: int, requests: list, max_tokens: int, seconds: float) -> dict:
    """``concurrency`` clients, each sending requests from ``requests`` (client i starts at
    the i-th and walks the list) one after another for ``seconds``, greedy, answers stopping
    at EOS: C requests in flight all the time. When the time is up, the answers in flight are
    dropped (their clients disconnect). Per request: time to first token, the gaps between
    its tokens (one SSE chunk each); the tokens received within the time and the requests
    completed."""
    import asyncio
    import json
    import httpx
    ttft, itl, tokens, done = [], [], 0, 0
    end = time.perf_counter() + seconds

    async def client(c: httpx.AsyncClient, i: int):
        nonlocal tokens, done
        while True:
            messages, i = requests[i % len(requests)], i + concurrency
            body = {"model": "x", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            last, first = time.perf_counter(), True
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise OSError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]}")
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if now > end:
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if not choices[0].get("delta", {}).get("content"):
                        continue
                    (ttft if first else itl).append(now - last)
                    first, last, tokens = False, now, tokens + 1
            done += 1

    # A fresh connection per request, for both servers: llama-server closes idle keep-alive
    # connections, and a request sent on one just closed fails.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        await asyncio.gather(*(client(c, i) for i in range(concurrency)))
    await asyncio.sleep(2)        # let the server notice the dropped streams before the next level
    q = lambda xs, p: float(np.percentile(xs, p)) * 1000 if xs else float("nan")
    return {"concurrency": concurrency, "requests": done, "tokens": tokens, "wall_s": seconds,
            "tok_s": tokens / seconds, "req_s": done / seconds, "ttft_p50": q(ttft, 50), "ttft_p95": q(ttft, 95),
            "itl_p50": q(itl, 50), "itl_p95": q(itl, 95)}


def llama_server_binary() -> Path | None:
    import shutil
    found = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    built = checkpoint.cache_root() / "llama-server" / "build" / "bin" / "llama-server"
    return Path(found) if found else built if built.is_file() else None


def llama_server_command(binary: Path, gguf: Path, threads: int, slots: int, ctx: int) -> list[str]:
    """llama-server with its defaults but for what a fair comparison fixes: our thread count, the
    parallel slots, the context, and the GGUF's own chat template (--jinja)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
            "--parallel", str(slots), "-c", str(ctx), "--jinja"]


def bench_serve(args):
    import asyncio
    if hint := kernels.busy_machine_hint():
        print(hint)
    path = model_dir(args.model)
    slots, threads = max(args.concurrency), torch.get_num_threads()
    log_dir = checkpoint.cache_root() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    # One server at a time, each stopped before the next starts: (name, command, its log)
    servers = [("nanoinfer server.py", [sys.executable, "server.py", "--model", str(path), "--max-batch", str(slots)],
                log_dir / "server.log")]
    binary = None if args.no_peer else llama_server_binary()
    if binary is None and not args.no_peer:
        print("no llama-server: build it with scripts/build_llama_server.sh (or set LLAMA_SERVER); ours alone")
    elif binary is not None:
        # the same weights at our server's bits: fp32, or bf16 where this CPU computes it natively
        dtype = "bf16" if kernels.bf16_supported(torch.device("cpu")) else "f32"
        gguf = log_dir / f"{path.name}-{dtype}.gguf"
        if not gguf.is_file():
            print(f"writing {gguf} (once)", flush=True)
            checkpoint.export_gguf(path, gguf, LlamaConfig.from_hf(checkpoint.read_config(path)), dtype)
        servers.append((f"llama-server {dtype.upper()}",
                        llama_server_command(binary, gguf, threads, slots, slots * 1024), log_dir / "llama-server.log"))
    rows = []
    for name, cmd, log in servers:
        port = free_port()
        proc = start_server(cmd + ["--port", str(port)], port, log)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(serve_load(url, 2, serve_requests(2), 8, 5))        # warm-up: first calls of every kernel
            for c in args.concurrency:
                r = asyncio.run(serve_load(url, c, serve_requests(16), args.max_tokens, args.seconds))
                rows.append({"server": name, **r})
                print(f"  {name}, {c:2} clients: {r['tok_s']:6.1f} tok/s, TTFT p50/p95 {r['ttft_p50']:.0f}/"
                      f"{r['ttft_p95']:.0f} ms, ITL p50/p95 {r['itl_p50']:.0f}/{r['itl_p95']:.0f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    single = {r["server"]: r["tok_s"] for r in rows if r["concurrency"] == min(args.concurrency)}
    table = results.Table(
        f"{args.model} served over HTTP, {threads} threads each, {slots} parallel slots each: C streaming clients "
        f"for {args.seconds:.0f} s, each sending chat requests from a fixed mix (half with a shared ~400-token system "
        f"prompt) one after another; greedy, answers stop at EOS (at most {args.max_tokens} tokens)",
        ["server", "clients", "requests done", "output tok/s", "× its 1 client", "req/s", "TTFT p50 ms", "TTFT p95 ms",
         "ITL p50 ms", "ITL p95 ms"],
        [[r["server"], r["concurrency"], r["requests"], f"{r['tok_s']:.1f}",
          f"{r['tok_s'] / single[r['server']]:.2f}×", f"{r['req_s']:.2f}", f"{r['ttft_p50']:.0f}",
          f"{r['ttft_p95']:.0f}", f"{r['itl_p50']:.0f}", f"{r['itl_p95']:.0f}"] for r in rows])
    notes = []
    if len(servers) > 1:
        for c in args.concurrency:
            a, b = ([r for r in rows if r["concurrency"] == c and r["server"] == s[0]][0] for s in servers[:2])
            notes.append(f"{c} clients: ours {a['tok_s'] / b['tok_s']:.2f}× llama-server's tok/s, "
                         f"TTFT p95 {a['ttft_p95'] / b['ttft_p95']:.2f}× its")
    table.notes = notes
    print(f"\n{table.markdown()}")
    plot = plot_serve(rows, args.model)
    print(f"saved {results.save('serve', 'engine', [table], plots=[plot] if plot else [])}")


def plot_serve(rows: list[dict], model: str) -> Path | None:
    plt = results.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        xs = [r["concurrency"] for r in mine]
        ax1.plot(xs, [r["tok_s"] for r in mine], "o-", label=name)
        ax2.plot(xs, [r["ttft_p95"] / 1000 for r in mine], "o-", label=name)
    for ax, label in ((ax1, "total output tokens/s"), (ax2, "time to first token, p95 (s)")):
        ax.set_xscale("log", base=2)
        results.plain_ticks(ax.xaxis)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(f"{model}: our server against llama-server, answers stopping at EOS")
    return results.save_plot(fig, "serve.png")

def bench_engine_step(args):
    """One batched decode step of engine.Engine, eager against compiled for a fixed
    batch size (one compile per bucket), at each thread count."""
    model, _ = load(args.model, dtype=args.dtype)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
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


# ----------------------------------------------------------------------------
# runner: serve_local.py as a user runs it, against llama.cpp's defaults on the same GGUF.

STATS = re.compile(r"\[prompt (\d+) tok.*?generated (\d+) tok, ([\d.]+) tok/s \| first token (\d+) ms")
ESTIMATE = re.compile(r"~([\d.]+)x plain decoding")


class RunnerSession:
    """One `python serve_local.py FLAGS` process with its stdin a pipe: a user typing
    prompts, /reset between them (one process per configuration, as a user keeps one
    chat open). The answer of a turn is on stdout, its stats line on stderr; the runner
    writes and flushes the answer before the stats line, so once that line arrives the
    whole answer already sits in the stdout pipe and a non-blocking read takes it."""

    def __init__(self, flags: list[str], max_new_tokens: int, timeout: float = 900):
        self.t0, self.timeout = time.perf_counter(), timeout
        self.proc = subprocess.Popen([sys.executable, "serve_local.py", "--temperature", "0", "--max-new-tokens",
                                      str(max_new_tokens), *flags], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for f in (self.proc.stdout, self.proc.stderr):
            os.set_blocking(f.fileno(), False)
        self.err, self.log = b"", []
        self.loaded_s = self.compile_s = None
        lines = self.until(lambda line: line.startswith("chat:"))     # ready for the first line
        self.ready_s = time.perf_counter() - self.t0
        for line in lines:
            if m := re.match(r"loaded in ([\d.]+) s", line):
                self.loaded_s = float(m.group(1))
            if m := re.search(r"compiled in ([\d.]+) s|loaded from cache in ([\d.]+) s", line):
                self.compile_s = float(m.group(1) or m.group(2))

    def read(self, f) -> bytes:
        chunks = []
        while True:
            try:
                b = os.read(f.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)

    def until(self, done) -> list[str]:
        """stderr lines up to and including the first for which done(line) holds."""
        import select
        seen, deadline = [], time.perf_counter() + self.timeout
        while time.perf_counter() < deadline:
            select.select([self.proc.stderr], [], [], 1.0)
            self.err += self.read(self.proc.stderr)
            while b"\n" in self.err:
                line, self.err = self.err.split(b"\n", 1)
                text = line.decode(errors="replace")
                seen.append(text)
                self.log.append(text)
                if done(text):
                    return seen
            if self.proc.poll() is not None and not self.err:
                raise OSError("serve_local.py exited: " + " | ".join(self.log[-5:]))
        self.proc.kill()
        raise OSError(f"serve_local.py gave no answer within {self.timeout:.0f} s: " + " | ".join(self.log[-5:]))

    def ask(self, prompt: str) -> dict:
        self.read(self.proc.stdout)
        self.proc.stdin.write(prompt.encode() + b"\n/reset\n")
        self.proc.stdin.flush()
        lines = self.until(lambda line: STATS.search(line) is not None)
        text = self.read(self.proc.stdout).decode(errors="replace").strip()
        m = STATS.search(lines[-1])
        self.until(lambda line: "[conversation cleared]" in line)
        estimate = [float(e.group(1)) for line in self.log[-4:] if (e := ESTIMATE.search(line))]
        return {"prompt_tokens": int(m.group(1)), "new_tokens": int(m.group(2)), "tok_s": float(m.group(3)),
                "ttft_ms": float(m.group(4)), "text": text, "estimate": estimate[-1] if estimate else None}

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(60)


def per_prompt(answers: list[dict]) -> dict:
    """One prompt's answers over the rounds as one: the median speed, TTFT and estimate; the first text
    (greedy: every round gives it, else "texts differ between rounds" shows in the text column)."""
    first, med = answers[0], statistics.median
    estimates = [a["estimate"] for a in answers if a["estimate"] is not None]
    same = all(a["text"] == first["text"] for a in answers)
    return first | {"tok_s": med(a["tok_s"] for a in answers), "ttft_ms": med(a["ttft_ms"] for a in answers),
                    "estimate": med(estimates) if estimates else None,
                    "text": first["text"] if same else "texts differ between rounds"}


class LlamaServerSession:
    """llama.cpp's defaults on ``gguf`` (llama-server: its own chat template, greedy, stops at EOS),
    asked as RunnerSession is; each answer's numbers are from its own timings."""

    def __init__(self, gguf: Path, max_new_tokens: int, threads: int):
        binary, self.port, self.max_new_tokens = llama_server_binary(), free_port(), max_new_tokens
        log = checkpoint.cache_root() / "bench" / "llama-server-runner.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.proc = start_server(llama_server_command(binary, gguf, threads, 1, 4096) + ["--port", str(self.port)],
                                 self.port, log)
        self.ready_s = time.perf_counter() - t0
        self.loaded_s = self.compile_s = None

    def ask(self, prompt: str) -> dict:
        import httpx
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": self.max_new_tokens,
                "temperature": 0, "cache_prompt": False}
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body, timeout=600).json()
        t = r["timings"]
        return {"prompt_tokens": t["prompt_n"], "new_tokens": t["predicted_n"], "tok_s": t["predicted_per_second"],
                "ttft_ms": t["prompt_ms"], "text": r["choices"][0]["message"]["content"], "estimate": None}

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)


PLAIN = "--cache dynamic --no-speculation"      # the exactness reference: plain greedy decoding, eager


COMPILED = "--compile --no-speculation"         # plain greedy decoding, the compiled step on a static cache


def runner_configs(fastest: list[str]) -> list[tuple[str, list[str]]]:
    """(name, flags): the plan, plain decoding compiled and eager (every text is compared with the
    eager one), the fastest flags."""
    return [("serve_local.py (defaults: the plan)", []),
            (f"serve_local.py {COMPILED}", COMPILED.split()),
            (f"serve_local.py {PLAIN}", PLAIN.split()),
            ("serve_local.py " + " ".join(fastest), fastest)]


def bench_runner(args):
    """The runner as a user runs it, each configuration in its own process, and llama.cpp's
    defaults on the very GGUF the runner loads, in the same run."""
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if hint := kernels.busy_machine_hint():
        print(hint)
    prompts = CHAT_PROMPTS[:args.prompts] + [" ".join((speculative.SUMMARISE + HANDBOOK).split())]
    threads = torch.get_num_threads()
    fastest = args.fastest.split()
    if args.model != checkpoint.DEFAULT_MODEL:
        args.flags = f"--model {args.model} {args.flags}"
    notes = []
    for label, flags in (("the defaults", []), ("the fastest flags", fastest)):   # build the compiled steps once
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "serve_local.py", "--compile-only", *flags, *args.flags.split()],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"serve_local.py --compile-only {' '.join(flags)}: {done.stderr.strip()[-300:]}")
        notes.append(f"before the runs below, `serve_local.py --compile-only` with {label}: {time.perf_counter() - t0:.1f}"
                     f" s (a chat's first start runs it in the background and answers on the eager step meanwhile)")
    notes.append("the rows below start as a user's next start does: the compiled steps load from disk; every "
                 "configuration is open at once and answers each prompt in turn, each prompt starting with the next one "
                 "(this machine's speed drifts from minute to minute: each sees the same windows)")
    sessions = {}
    try:
        for name, flags in runner_configs(fastest):
            print(f"starting {name} ...", flush=True)
            sessions[name] = RunnerSession([*flags, *args.flags.split()], args.max_new_tokens)
        gguf = checkpoint.bundled_gguf(*checkpoint.BUNDLED[1:]) if args.model == checkpoint.DEFAULT_MODEL else None
        if gguf is not None and llama_server_binary() is not None and not args.no_peer:
            print("starting llama.cpp (llama-server, defaults) ...", flush=True)
            peer = sessions[f"llama.cpp defaults ({gguf.name})"] = LlamaServerSession(gguf, args.max_new_tokens, threads)
            peer.ask(prompts[0])                            # its first answer warms it up and is dropped
        elif not args.no_peer:
            print("no llama-server: build it with scripts/build_llama_server.sh (or set LLAMA_SERVER); ours alone")
        asked = {name: [[] for _ in prompts] for name in sessions}      # each prompt's answers, one per round
        names = list(sessions)
        for r in range(args.rounds):
            for i, p in enumerate(prompts):
                print(f"round {r + 1}/{args.rounds}, prompt {i + 1}/{len(prompts)} ...", flush=True)
                # Each prompt starts one configuration further on, and each turn waits SETTLE_S: the configuration
                # that always came right after llama.cpp's turn measured 7% and 11% slower than its twin (the
                # same flags) in two runs.
                for name in names[(i + r) % len(names):] + names[:(i + r) % len(names)]:
                    time.sleep(SETTLE_S)
                    asked[name][i].append(sessions[name].ask(p))
        runs = {name: {"ready_s": s.ready_s, "loaded_s": s.loaded_s, "compile_s": s.compile_s,
                       "answers": [per_prompt(a) for a in asked[name]]} for name, s in sessions.items()}
    finally:
        for session in sessions.values():
            session.close()
    plain = runs[f"serve_local.py {PLAIN}"]["answers"]
    peer = next((r for n, r in runs.items() if n.startswith("llama.cpp")), None)
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    rows = []
    for name, r in runs.items():
        a = r["answers"]
        speed = [x["tok_s"] for x in a]
        same = sum(x["text"] == p["text"] for x, p in zip(a, plain))
        vs = f"{med(speed) / med([x['tok_s'] for x in peer['answers']]):.2f}×" if peer else "-"
        rows.append([name, f"{r['ready_s']:.1f}", "-" if r["loaded_s"] is None else f"{r['loaded_s']:.1f}",
                     "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
                     f"{med([x['ttft_ms'] for x in a]):.0f}", f"{min(speed):.1f}–{max(speed):.1f}",
                     f"{med(speed):.1f}", vs, f"{med([x['new_tokens'] for x in a]):.0f}",
                     "-" if name.startswith("llama.cpp") else f"{same}/{len(a)}"])
        # the runner's estimate is against its own plain step: compiled for --compile, else eager
        base = runs[f"serve_local.py {COMPILED}"]["answers"] if "--compile" in name else plain
        est = [(x["estimate"], x["tok_s"] / p["tok_s"]) for x, p in zip(a, base) if x["estimate"]]
        if est:
            notes.append(f"{name}: the runner's printed speedup estimate, median {med([e for e, _ in est]):.2f}×, "
                         f"against the measured ratio to plain decoding {'compiled' if base is not plain else 'eager'}"
                         f" on the same prompts, median "
                         f"{med([m for _, m in est]):.2f}× (per prompt, estimate/measured: "
                         + ", ".join(f"{e / m:.2f}" for e, m in est) + ")")
    table = results.Table(
        f"{args.model}: serve_local.py as a user runs it (one process per configuration, prompts typed into "
        f"its chat, /reset between them) and llama.cpp's defaults (llama-server) on the same GGUF; {len(prompts)} "
        f"prompts ({args.prompts} chat + summarise-this-text), each asked {args.rounds}x (per prompt: the median "
        f"of its rounds), greedy, answers stop at EOS (at most {args.max_new_tokens} tokens), {threads} threads each",
        ["configuration", "ready s", "load s", "compile s", "TTFT ms (median)", "decode tok/s (spread)",
         "decode tok/s (median)", "× llama.cpp", "tokens (median)", "text = plain eager run"], rows, notes)
    print(f"\n{table.markdown()}")
    print(f"saved {results.save('runner', 'runner', [table])}")
# compiled-start: a compiled step built once and loaded by later starts (kernels.AheadOfTime).

def bench_compiled_start(args):
    """What a compiled configuration's start costs and what its step gains: torch.compile (traced at every
    start) against an AOTInductor package (built once, loaded later); the per-step ms of eager, torch.compile
    and the package, alternating; their greedy tokens; and the runner's second start to its first token."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load(args.model, dtype=args.dtype)
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
    proc = subprocess.Popen([sys.executable, "serve_local.py", *flags], cwd=Path(__file__).parent, env=env,
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="batch-1 decode speed against peers")
    d.add_argument("--models", nargs="+", default=DECODE_MODELS)
    d.add_argument("--dtypes", nargs="+", default=DECODE_DTYPES, choices=list(kernels.DTYPES))
    d.add_argument("--prompt-tokens", type=int, default=128)
    d.add_argument("--new-tokens", type=int, default=128)
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--device", default="cpu", help="cpu, or cuda (compiled rows: CUDA graphs; no llama.cpp rows)")
    d.add_argument("--no-peers", action="store_true", help="skip the peers (transformers, llama.cpp)")
    d.add_argument("--no-compile", action="store_true", help="skip the compiled static-cache configuration")
    d.add_argument("--weights", nargs="+", default=["auto", "int8", "int4"], choices=["auto", "int8", "int4"],
                   help="weight formats of the compiled configuration (auto = the dtype itself)")
    a = sub.add_parser("attention", help="flash.py's benchmark: naive, tiled (eager, compiled), SDPA")
    a.add_argument("--quick", action="store_true", help="N = 512, 2048, 8192 and d 64 only")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b = sub.add_parser("batching", help="engine.py: static vs continuous batching, prefix caching TTFT")
    b.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    b.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    b.add_argument("--requests", type=int, default=64)
    b.add_argument("--max-batch", type=int, default=16)
    b.add_argument("--questions", type=int, default=6, help="prefix caching: requests per configuration")
    b.add_argument("--skip-dropped", action="store_true", help="skip the static run whose finished rows drop out")
    b.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); on a busy shared machine 1 avoids OpenMP stalls")
    b.add_argument("--long-prompts-only", action="store_true", help="only the chunked-prefill scenario")
    b.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 256],
                   help="chunked prefill: tokens a step to compare (0: whole prompts, the baseline, first)")
    b.add_argument("--decoders", type=int, default=8, help="chunked prefill: requests decoding throughout")
    b.add_argument("--decode-tokens", type=int, default=32, help="chunked prefill: tokens each decoder produces")
    b.add_argument("--long-prompts", type=int, default=2, help="chunked prefill: 1,500-2,000-token prompts")
    e = sub.add_parser("engine", help="engine.py: chat requests joining and leaving the batch, step by step")
    e.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    e.add_argument("--requests", type=int, default=8)
    e.add_argument("--max-batch", type=int, default=4)
    e.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    es = sub.add_parser("engine-step", help="engine.py: one batched decode step, eager vs compiled per batch size")
    es.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    es.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    es.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    es.add_argument("--compile-batches", type=int, nargs="+", default=[1, 4],
                    help="the batch sizes also compiled (each compile: 1-3 min on 2 busy cores)")
    es.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    es.add_argument("--context", type=int, default=200)
    es.add_argument("--reps", type=int, default=5)
    sp = sub.add_parser("speculative", help="speculative.py: draft model, lookahead, prompt lookup vs plain")
    sp.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    sp.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    sp.add_argument("--draft", default="bundled", help="draft model; '' to skip (default: train.py's EAGLE head)")
    sp.add_argument("--medusa", default="medusa", help="Medusa heads; '' to skip (default: train.py --medusa's)")
    sp.add_argument("--medusa-k", type=int, default=0, help="Medusa: heads used, the depth (default: all)")
    sp.add_argument("--spec-k", type=int, default=3, help="draft tokens per step")
    sp.add_argument("--lookahead", default="4,3,4", metavar="W,N,G")
    sp.add_argument("--spec-tree", default="4,10", metavar="W,M", help="EAGLE head: also draft a tree, W children "
                    "per node, --spec-k levels, M tokens verified ('' to skip)")
    sp.add_argument("--medusa-tree", default="4,10", metavar="W,M", help="Medusa: also a tree, W children per node, "
                    "--medusa-k levels, M tokens verified ('' to skip)")
    sp.add_argument("--prompt-lookup", type=int, default=3, metavar="N")
    sp.add_argument("--lookup-k", type=int, default=4, help="prompt lookup: tokens proposed per step")
    sp.add_argument("--new-tokens", type=int, default=256, help="at most this many per answer")
    sp.add_argument("--ignore-eos", action="store_true", help="always --new-tokens per answer, past its end")
    sp.add_argument("--prompts", type=int, default=8, help="chat prompts (at most 8)")
    sp.add_argument("--compile", action="store_true", help="compile the draft models' steps and add plain "
                    "decoding compiled on a static cache (1-2.5 min to compile once), as the runner's --compile")
    pr = sub.add_parser("prefix", help="kvcache.py, seed exercise 2: prefill a shared prompt once, fork it per question")
    pr.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    kb = sub.add_parser("kv-bytes", help="kvcache.py: the bytes a real cache holds after a generation vs the formula")
    kb.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    of = sub.add_parser("offload", help="kvcache.py: the longest context that fits a device with and without "
                                        "offloading the cache, and the slowdown per decode step")
    of.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    of.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    of.add_argument("--steps", type=int, default=12, help="decode steps timed per cache and context")
    of.add_argument("--device-gib", type=float, nargs="+", default=[0.75, 1.0, 2.0], help="device memories")
    of.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    nc = sub.add_parser("naive-vs-cached", help="model.py: naive vs cached decoding against N, the work each "
                                               "computes and its time; a table and a plot")
    nc.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    nc.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128], help="the N to try")
    nc.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 avoids OpenMP "
                    "stalls on a busy shared machine)")
    cx = sub.add_parser("context", help="model.py: decode ms/token against context, prefill vs decode tok/s")
    cx.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    cx.add_argument("--dtype", default="auto", choices=["auto", *kernels.DTYPES], help="auto: fp32 on a CPU")
    cx.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024, 2048])
    cx.add_argument("--steps", type=int, default=8, help="decode steps timed per run")
    cx.add_argument("--reps", type=int, default=3)
    cx.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    q = sub.add_parser("quantize", help="quantize.py on a real model: perplexity and bytes per format (--eval: the "
                                        "full table); --out DIR writes a quantized checkpoint")
    q.add_argument("--model", default=checkpoint.DEFAULT_MODEL, help="alias, directory or .gguf")
    q.add_argument("--weights", default="int8", help="int8 or int4 (with --out)")
    q.add_argument("--group-size", type=int, default=32, help="int4 group size: 32, 64 or 128")
    q.add_argument("--out", default=None, help="write the quantized checkpoint to this directory")
    q.add_argument("--eval", action="store_true", help="the accuracy/memory/speed table")
    q.add_argument("--dtype", default="bfloat16", help="activations and unquantized weights")
    q.add_argument("--new-tokens", type=int, default=256)
    q.add_argument("--prompts", type=int, default=8)
    tq = sub.add_parser("tp", help="tp.py: decode step with 1 process and 2 ranks on the CPU, and the time in "
                                   "all-reduce")
    tq.add_argument("--models", nargs="+", default=[checkpoint.DEFAULT_MODEL], help=f"also {RANDOM_TINYLLAMA}")
    tq.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    tq.add_argument("--prompt-tokens", type=int, default=128)
    tq.add_argument("--steps", type=int, default=32)
    sv = sub.add_parser("serve", help="server.py against llama-server: many streaming clients, tok/s, TTFT, ITL")
    sv.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    sv.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    sv.add_argument("--seconds", type=float, default=40, help="how long each concurrency level runs")
    sv.add_argument("--no-peer", action="store_true", help="our server alone (no llama-server)")
    sv.add_argument("--max-tokens", type=int, default=128)
    rn = sub.add_parser("runner", help="serve_local.py as a user runs it (the plan, plain compiled and eager, fastest flags) "
                        "against llama.cpp's defaults on the same GGUF")
    rn.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    rn.add_argument("--prompts", type=int, default=8, help="chat prompts (at most 8), then the summarise prompt")
    rn.add_argument("--max-new-tokens", type=int, default=256)
    rn.add_argument("--fastest", default="--cache static --compile --draft bundled --prompt-lookup 3",
                    help="the third configuration's flags")
    rn.add_argument("--flags", default="", help="flags added to every configuration (e.g. --model)")
    rn.add_argument("--no-peer", action="store_true", help="our runner alone (no llama-server)")
    rn.add_argument("--rounds", type=int, default=2, help="times each prompt is asked (per prompt: the median): one "
                    "run's twin configurations differed by 10%% with one round")
    cs = sub.add_parser("compiled-start", help="kernels.py: the compiled step built once (AOTInductor) and loaded by "
                        "later starts, against torch.compile at every start; step ms; the runner's second start")
    cs.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    cs.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    cs.add_argument("--ctx", type=int, default=2048)
    cs.add_argument("--tokens", type=int, default=32)
    cs.add_argument("--rounds", type=int, default=8)
    cs.add_argument("--threads", type=int, default=None)
    sub.add_parser("report", help="render RESULTS.md from results/*.json (what every benchmark saves)")
    args = ap.parse_args()
    try:
        if args.cmd == "report":
            out, records = results.ROOT / "RESULTS.md", results.load(results.ROOT / "results")
            out.write_text(results.render(records))
            print(f"wrote {out.name} from {len(records)} result files")
        elif args.cmd == "speculative":
            bench_speculative(args)
        elif args.cmd == "batching":
            bench_batching(args)
        elif args.cmd == "engine-step":
            bench_engine_step(args)
        elif args.cmd == "compiled-start":
            bench_compiled_start(args)
        elif args.cmd == "engine":
            if args.threads:
                torch.set_num_threads(args.threads)
            if hint := kernels.busy_machine_hint():
                print(hint)
            engine_demo(args.model, args.requests, args.max_batch)
        elif args.cmd == "decode":
            bench_decode(args)
        elif args.cmd == "attention":
            flash.bench(args.quick, args.dtype)
        elif args.cmd == "prefix":
            bench_prefix(args.model)
        elif args.cmd == "kv-bytes":
            bench_kv_bytes(args.model)
        elif args.cmd == "offload":
            if args.threads:
                torch.set_num_threads(args.threads)
            bench_offload(args.model, args.contexts, args.steps, args.device_gib)
        elif args.cmd in ("naive-vs-cached", "context"):
            if args.threads:
                torch.set_num_threads(args.threads)
            if args.cmd == "context":
                bench_context(args.model, args.dtype, args.contexts, args.steps, args.reps)
            else:
                bench_naive_vs_cached(args.model, args.tokens)
        elif args.cmd == "serve":
            bench_serve(args)
        elif args.cmd == "runner":
            bench_runner(args)
        elif args.cmd == "tp":
            bench_tp(args.models, args.dtype, args.prompt_tokens, args.steps)
        elif args.cmd == "quantize":
            if args.out:
                quantize_write(args.model, args.weights, args.group_size, args.dtype, args.out)
            elif args.eval:
                quantize_eval(args.model, args.dtype, args.new_tokens, args.prompts)
            else:
                quantize_demo(args.model, args.dtype)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
