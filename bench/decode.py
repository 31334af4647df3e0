"""`python bench.py decode`: batch-1 decode speed against the peers.

Batch 1, greedy, a fixed 128-token prompt, 128 new tokens with EOS
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
tinyllama-random) that `gguf_hf.export_gguf` writes once into the cache.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

import checkpoint
import kernels
import plan
import quantize
import results
import safetensors_io
from kvcache import kv_bytes_per_token
from model import GenerationStats, Llama, LlamaConfig, generate_cached
from nanoinfer.config import RunConfig
from nanoinfer.load import build
from sampling import SamplingParams
from bench.common import RANDOM_TINYLLAMA, measure_in_turn, memory_available, model_dir
from bench.peers import LlamaServerDecode, llama_cpp_files, llama_server_binary, run_llama_cpp, run_transformers
import kvcache


DECODE_MODELS, DECODE_DTYPES = [checkpoint.DEFAULT_MODEL, RANDOM_TINYLLAMA], ["float32", "bfloat16"]


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
    # the table, unless it is the head's own tensor (counted once: weight_bytes)
    if model.embed_tokens.weight.data_ptr() != model.lm_head.weight.data_ptr():
        weights -= quantize.weight_bytes(model.embed_tokens)
    kv = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, model.dtype.itemsize)
    return weights + context * kv


def gguf_bytes_per_token(path, c: LlamaConfig, context: int) -> int:
    """bytes_per_token for llama.cpp: the GGUF's tensors as stored, plus its f16 KV cache (the default)."""
    import gguf
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    if "output.weight" in tensors:   # untied: the embedding table is only gathered from
        tensors.pop("token_embd.weight")
    return sum(tensors.values()) + context * kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, 2)


def run_ours(model, prompt, new_tokens, cache=None):
    stats = GenerationStats()
    if cache is not None:
        cache.crop(0)
    out = list(generate_cached(model, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), stats, cache))
    assert len(out) == new_tokens
    return stats.prefill_s, stats.decode_s


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
                fast = build(path, RunConfig(str(path), kernels.pick_device(args.device), kernels.DTYPES[dtype],
                                             None if weights == "auto" else weights, prepack=False))
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
                                                          state_dict=safetensors_io.read_weights(path),
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
            model = build(path, RunConfig(str(path), kernels.pick_device(args.device), kernels.DTYPES[dtype],
                                          prepack=copies))   # run_ours ignores EOS
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


def decode_args(p):
    """The flags of `python bench.py decode`."""
    p.add_argument("--models", nargs="+", default=DECODE_MODELS)
    p.add_argument("--dtypes", nargs="+", default=DECODE_DTYPES, choices=list(kernels.DTYPES))
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (compiled rows: CUDA graphs; no llama.cpp rows)")
    p.add_argument("--no-peers", action="store_true", help="skip the peers (transformers, llama.cpp)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled static-cache configuration")
    p.add_argument("--weights", nargs="+", default=["auto", "int8", "int4"], choices=["auto", "int8", "int4"],
                   help="weight formats of the compiled configuration (auto = the dtype itself)")
