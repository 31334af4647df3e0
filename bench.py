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
transformers `generate` (dynamic cache) when it is installed.
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def run_ours(model, prompt, new_tokens):
    stats = M.GenerationStats()
    out = list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=new_tokens), stats))
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
            impls = {"nanoinfer cached": lambda warmup: run_ours(model, prompt, 8 if warmup else args.new_tokens)}
            if not args.no_peers:
                try:
                    from transformers import LlamaForCausalLM
                    hf = LlamaForCausalLM.from_pretrained(path, dtype=M.DTYPES[dtype]).eval()
                    impls["transformers generate"] = lambda warmup: run_transformers(
                        hf, prompt, 8 if warmup else args.new_tokens)
                except ImportError:
                    print("transformers not installed: skipping it (pip install -r requirements-bench.txt)")
            base = None
            for impl, fn in impls.items():
                with torch.inference_mode():
                    ttft, decode_s = measure(fn, args.reps)
                tok_s = (args.new_tokens - 1) / decode_s
                base = base or tok_s
                rows.append((name, impl, dtype, ttft * 1000, args.prompt_tokens / ttft, tok_s,
                             per_token * tok_s / 1e9, tok_s / base))
                print(f"  {name} {impl} {dtype}: decode {tok_s:.1f} tok/s", flush=True)
            del model
    print(f"\nbatch 1, greedy, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, "
          f"median of {args.reps}, {torch.get_num_threads()} threads\n")
    print("| model | implementation | dtype | TTFT ms | prefill tok/s | decode tok/s | GB/s | × nanoinfer |")
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
    d.add_argument("--no-peers", action="store_true", help="skip transformers")
    args = ap.parse_args()
    if args.cmd == "decode":
        bench_decode(args)


if __name__ == "__main__":
    main()
