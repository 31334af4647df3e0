"""
bench.py — the project's benchmarks and model-level demos, one subcommand per idea. Each prints
markdown tables and saves them with results.save (results/<name>.json; plots under plots/). The
code lives in bench/, one module per family (bench/decode.py, bench/batching.py, …; the peers,
llama.cpp and transformers, in bench/peers.py); this file is the table of subcommands.

    python bench.py decode                        # bundled model + TinyLlama-shaped random checkpoint
    python bench.py decode --models tinyllama-random --dtypes bfloat16
    python bench.py attention [--quick]           # flash.py: naive vs tiled vs SDPA, time and peak memory
    python bench.py paged --simulate 1000         # paged.py: fragmentation, three allocators simulated
    python bench.py batching                      # engine.py: static vs continuous batching; prefix caching;
                                                  # chunked prefill (--long-prompts-only: just that)
    python bench.py engine                        # engine.py: chat requests joining and leaving the batch
    python bench.py engine-step                   # engine.py: one batched decode step, eager vs compiled
    python bench.py speculative                   # speculative.py: EAGLE, Medusa, lookahead, lookup vs plain
    python bench.py prefix                        # kvcache.py: a shared prompt prefilled once and forked
    python bench.py kv-bytes                      # kvcache.py: a real cache's bytes against the formula
    python bench.py kv-plot                       # kvcache.py: the bytes each kind of cache holds vs context
    python bench.py offload                       # kvcache.py: the context an offloaded cache fits, its cost
    python bench.py naive-vs-cached               # model.py: naive vs cached decoding against N, counted and timed
    python bench.py context [--dtype bfloat16]    # model.py: decode ms/token against context; prefill vs decode
    python bench.py quantize [--eval]             # quantize.py: perplexity and bytes per format on the model
    python bench.py quantize --weights int4 --out DIR   # write a quantized checkpoint
    python bench.py tp                            # tp.py: decode step with 1 process and 2 ranks, time in all-reduce
    python bench.py serve                         # server.py against llama-server: 1-32 streaming clients
    python bench.py soak                          # server.py: 1,000 mixed requests and disconnects, for leaks
    python bench.py grammar                       # structured output: the libraries, and tok/s with a schema
    python bench.py gguf [FILE...]                # serve_local.py against llama-server on the same GGUFs
    python bench.py gguf --shapes tinyllama       # ... on random TinyLlama-shaped Q4_K_M, Q8_0, F16 files

Each family's module says what its benchmark measures and how (`python bench.py SUB --help`: its flags).
"""

from __future__ import annotations

import argparse
import sys

from bench import (attention, batching, compiled, context, decode, gguf, grammar, kvcache, paged,
                   quantize_eval, runner, serve, soak, speculative, tools, tp)

# name: (the function run with the parsed flags, help, the function adding the flags)
TABLE = {
    "decode": (decode.bench_decode, "batch-1 decode speed against peers", decode.decode_args),
    "attention": (attention.attention_command, "flash.py's benchmark: naive, tiled (eager, compiled), SDPA",
                  attention.attention_args),
    "batching": (batching.bench_batching, "engine.py: static vs continuous batching, prefix caching TTFT",
                 batching.batching_args),
    "engine": (tools.engine_command, "engine.py: chat requests joining and leaving the batch, step by step",
               tools.engine_args),
    "engine-step": (compiled.bench_engine_step,
                    "engine.py: one batched decode step, eager vs compiled per batch size",
                    compiled.engine_step_args),
    "speculative": (speculative.bench_speculative,
                    "speculative.py: draft model, lookahead, prompt lookup vs plain", speculative.speculative_args),
    "prefix": (kvcache.prefix_command,
               "kvcache.py, seed exercise 2: prefill a shared prompt once, fork it per question",
               kvcache.prefix_args),
    "kv-bytes": (kvcache.kv_bytes_command,
                 "kvcache.py: the bytes a real cache holds after a generation vs the formula",
                 kvcache.kv_bytes_args),
    "kv-plot": (kvcache.kv_plot_command, "kvcache.py: the bytes each kind of cache holds against the context, "
                "fp16 and int8: a table and plots/kv_bytes.png", kvcache.kv_plot_args),
    "offload": (kvcache.offload_command, "kvcache.py: the longest context that fits a device with and without "
                "offloading the cache, and the slowdown per decode step", kvcache.offload_args),
    "paged": (paged.paged_command, "paged.py, seed exercise 3: fragmentation, simulated (contiguous vs "
              "16-token pages)", paged.paged_args),
    "naive-vs-cached": (context.naive_vs_cached_command, "model.py: naive vs cached decoding against N, the work "
                        "each computes and its time; a table and a plot", context.naive_vs_cached_args),
    "context": (context.context_command, "model.py: decode ms/token against context, prefill vs decode tok/s",
                context.context_args),
    "quantize": (quantize_eval.quantize_command, "quantize.py on a real model: perplexity and bytes per format "
                 "(--eval: the full table); --out DIR writes a quantized checkpoint", quantize_eval.quantize_args),
    "tp": (tp.tp_command, "tp.py: decode step with 1 process and 2 ranks on the CPU, and the time in all-reduce",
           tp.tp_args),
    "serve": (serve.bench_serve, "server.py against llama-server: many streaming clients, tok/s, TTFT, ITL",
              serve.serve_args),
    "soak": (soak.bench_soak, "server.py under 1,000 mixed requests (10%% leave mid-stream, 10%% leave a "
             "non-streamed answer): RSS, KV blocks and running requests at the end, latency drift",
             soak.soak_args),
    "grammar": (grammar.bench_grammar, "structured output: llguidance against xgrammar (compile, mask), "
                "and server.py's tok/s with a JSON schema against without, 1 and 16 clients",
                grammar.grammar_args),
    "runner": (runner.bench_runner, "serve_local.py as a user runs it (the plan, plain compiled and eager, "
               "fastest flags) against llama.cpp's defaults on the same GGUF", runner.runner_args),
    "gguf": (gguf.bench_gguf, "serve_local.py against llama-server on the same GGUF files (or random test "
             "files it writes): first start, cache on disk, RSS, TTFT, decode tok/s, and their ratios",
             gguf.gguf_args),
    "compiled-start": (compiled.bench_compiled_start, "kernels.py: the compiled step built once (AOTInductor) "
                       "and loaded by later starts, against torch.compile at every start; step ms; the "
                       "runner's second start", compiled.compiled_start_args),
    "report": (tools.report, "render RESULTS.md from results/*.json (what every benchmark saves)",
               tools.report_args),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (run, help_, add_args) in TABLE.items():
        add_args(sub.add_parser(name, help=help_))
    return ap


def main():
    args = parser().parse_args()
    try:
        TABLE[args.cmd][0](args)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
