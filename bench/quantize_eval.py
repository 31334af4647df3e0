"""`python bench.py quantize` (quantize.py on a real model): perplexity, bytes and speed per
format (--eval: the full table); `--out DIR` writes a checkpoint (bench/tools.py)."""

from __future__ import annotations

import torch

import checkpoint
import quantize
import results
from model import GenerationStats, as_dtype, generate_cached
from nanoinfer.config import RunConfig
from nanoinfer.load import load
from sampling import SamplingParams
from bench.common import ROOT
from bench.tools import quantize_write
import kvcache


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
        model, tok = load(RunConfig(name, torch.device("cpu"), as_dtype(dtype), weights))
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
        model, tok = load(RunConfig(name, torch.device("cpu"), as_dtype(dtype), weights))
        ids = tok.encode(text)[:n_tokens]
        ppl = perplexity(model, ids, kv)
        base = base or ppl
        cache = kvcache.new_cache(model, "static", max_len=1, codec=quantize.kv_codec(kv))
        print(f"{label:24} {quantize.weight_bytes(model) / 1e6:>10.0f} {cache.nbytes:>10} {ppl:>10.3f}"
              f"  ({100 * (ppl / base - 1):+.2f}%)", flush=True)


def quantize_args(p):
    """The flags of `python bench.py quantize`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL, help="alias, directory or .gguf")
    p.add_argument("--weights", default="int8", help="int8 or int4 (with --out)")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size: 32, 64 or 128")
    p.add_argument("--out", default=None, help="write the quantized checkpoint to this directory")
    p.add_argument("--eval", action="store_true", help="the accuracy/memory/speed table")
    p.add_argument("--dtype", default="bfloat16", help="activations and unquantized weights")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=8)


def quantize_command(args):
    """`bench.py quantize`: --out writes a checkpoint (bench/tools.py), --eval the full table, else the demo."""
    if args.out:
        quantize_write(args.model, args.weights, args.group_size, args.dtype, args.out)
    elif args.eval:
        quantize_eval(args.model, args.dtype, args.new_tokens, args.prompts)
    else:
        quantize_demo(args.model, args.dtype)
