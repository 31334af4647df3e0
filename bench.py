"""
bench.py — the project's benchmarks, one subcommand per idea. Prints markdown tables.

    python bench.py decode                        # bundled model + TinyLlama-shaped random checkpoint
    python bench.py decode --model tinyllama-random --dtypes bfloat16

decode: batch 1, greedy, a fixed 128-token prompt, 128 new tokens with EOS
ignored, one warm-up run, the median of --reps runs. For each configuration:
time to first token (TTFT, i.e. prefill), prefill tok/s, decode tok/s and the
memory bandwidth that decode speed implies (bytes read per token × tok/s; a
decoder reads every weight once per token, plus the KV cache so far). Peers run
in the same process and the same run, so ratios are fair on a noisy machine:
transformers `generate` (dynamic cache) and llama.cpp (llama-cpp-python) when
they are installed. llama.cpp runs GGUF files of the same weights, measured
once per model (in the first dtype's group): the bundled model's original Q4_1
file, and exports of our checkpoint (F16; Q8_0 too for tinyllama-random) that
`checkpoint.export_gguf` writes once into the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import checkpoint
import model as M
from kvcache import kv_bytes_per_token

RANDOM_TINYLLAMA = "tinyllama-random"


def model_dir(name: str):
    """`tinyllama-random` is TinyLlama-1.1B's exact shape with random bf16 weights, built once."""
    if name == RANDOM_TINYLLAMA:
        path = checkpoint.cache_root() / RANDOM_TINYLLAMA
        if not (path / "model.safetensors").is_file():
            print(f"writing {path} (2.2 GB of random weights, once)")
            M.save_random_checkpoint(checkpoint.TINYLLAMA_CONFIG, path)
        return path
    return checkpoint.resolve(name)


def bytes_per_token(model: M.Llama, context: int) -> int:
    """What one decode step reads: every weight except the embedding table (one row
    is gathered) — unless the table doubles as the LM head — plus the KV cache."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not c.tie_embeddings:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, model.embed_tokens.weight.element_size())
    return weights + context * kv


def gguf_bytes_per_token(path, c: M.LlamaConfig, context: int) -> int:
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
            checkpoint.export_gguf(path, out, M.LlamaConfig.from_hf(checkpoint.read_config(path)), fmt)
        files[fmt.upper()] = out
    return files


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
    stats = M.GenerationStats()
    if cache is not None:
        cache.crop(0)
    out = list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=new_tokens), stats, cache))
    assert len(out) == new_tokens
    return stats.prefill_s, stats.decode_s


def run_transformers(hf, prompt, new_tokens):
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    total = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + new_tokens
    return ttft, max(total - ttft, 1e-9)


def measure(fn, reps):
    fn(warmup=True)
    runs = [fn(warmup=False) for _ in range(reps)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def bench_decode(args):
    rows = []
    for name in args.models:
        path = model_dir(name)
        for dtype in args.dtypes:
            model = M.Llama.from_pretrained(path, "cpu", dtype)
            model.config.eos_ids = []     # always generate exactly --new-tokens
            prompt = torch.randint(100, model.config.vocab_size - 100, (args.prompt_tokens,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            per_token = bytes_per_token(model, args.prompt_tokens + args.new_tokens // 2)
            n_ctx = args.prompt_tokens + args.new_tokens + 16   # a static cache sized to the job, as gpt-fast does
            # implementation -> (dtype column, bytes read per decode step, fn(warmup) -> (ttft_s, decode_s))
            impls = {"nanoinfer cached": (dtype, per_token, lambda warmup: run_ours(
                model, prompt, 8 if warmup else args.new_tokens))}
            if not args.no_compile:
                # A second instance: compile_decode() switches every one-token step to the compiled graph.
                fast = M.Llama.from_pretrained(path, "cpu", dtype)
                fast.config.eos_ids = []
                static = fast.new_cache("static", max_len=n_ctx)
                t0 = time.perf_counter()
                fast.compile_decode()
                with torch.inference_mode():
                    run_ours(fast, prompt, 2, static)
                print(f"  {name} {dtype}: compiled the decode step in {time.perf_counter() - t0:.1f} s", flush=True)
                impls["nanoinfer static+compile"] = (dtype, per_token, lambda warmup: run_ours(
                    fast, prompt, 8 if warmup else args.new_tokens, static))
            if not args.no_peers:
                try:
                    from transformers import LlamaForCausalLM
                    hf = LlamaForCausalLM.from_pretrained(path, dtype=M.DTYPES[dtype]).eval()
                    impls["transformers generate"] = (dtype, per_token, lambda warmup: run_transformers(
                        hf, prompt, 8 if warmup else args.new_tokens))
                except ImportError:
                    print("transformers not installed: skipping it (pip install -r requirements-bench.txt)")
            if not args.no_peers and dtype == args.dtypes[0]:    # GGUF rows do not depend on our dtype
                try:
                    import llama_cpp
                except ImportError:
                    print("llama-cpp-python not installed: skipping llama.cpp (pip install -r requirements-bench.txt)")
                else:
                    for label, gguf_path in llama_cpp_files(name, path).items():
                        threads = torch.get_num_threads()
                        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads,
                                              n_threads_batch=threads, n_batch=512, logits_all=False,
                                              verbose=False)
                        impls[f"llama.cpp {label}"] = (label, gguf_bytes_per_token(
                            gguf_path, model.config, args.prompt_tokens + args.new_tokens // 2),
                            lambda warmup, llm=llm: run_llama_cpp(llm, prompt, 8 if warmup else args.new_tokens))
            group = []
            for impl, (label, per_tok, fn) in impls.items():
                with torch.inference_mode():
                    ttft, decode_s = measure(fn, args.reps)
                tok_s = (args.new_tokens - 1) / decode_s
                group.append([name, impl, label, ttft * 1000, args.prompt_tokens / ttft, tok_s,
                              per_tok * tok_s / 1e9])
                print(f"  {name} {impl} {label}: decode {tok_s:.1f} tok/s", flush=True)
            # Ratios against transformers in the same dtype when it ran, else against the first row.
            base = next((r[5] for r in group if r[1] == "transformers generate"), group[0][5])
            rows += [r + [r[5] / base] for r in group]
            del model
    print(f"\nbatch 1, greedy, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, "
          f"median of {args.reps}, {torch.get_num_threads()} threads; llama.cpp rows (dtype = GGUF tensor "
          f"type) sit in the {args.dtypes[0]} group; × = decode speed over transformers generate in the group\n")
    print("| model | implementation | dtype | TTFT ms | prefill tok/s | decode tok/s | GB/s | × transformers |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="batch-1 decode speed against peers")
    d.add_argument("--models", nargs="+", default=[checkpoint.DEFAULT_MODEL, RANDOM_TINYLLAMA])
    d.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(M.DTYPES))
    d.add_argument("--prompt-tokens", type=int, default=128)
    d.add_argument("--new-tokens", type=int, default=128)
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--no-peers", action="store_true", help="skip the peers (transformers, llama.cpp)")
    d.add_argument("--no-compile", action="store_true", help="skip the compiled static-cache configuration")
    args = ap.parse_args()
    if args.cmd == "decode":
        bench_decode(args)


if __name__ == "__main__":
    main()
