"""
bench.py — the project's benchmarks, one subcommand per idea. Prints markdown tables.

    python bench.py decode                        # bundled model + TinyLlama-shaped random checkpoint
    python bench.py decode --model tinyllama-random --dtypes bfloat16
    python bench.py attention [--quick]           # flash.py: naive vs tiled vs SDPA, time and peak memory
    python bench.py batching                      # engine.py: static vs continuous batching; prefix caching
    python bench.py speculative                   # speculative.py: draft, lookahead, prompt lookup vs plain

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

batching: engine.py's continuous batching against static batching (batches of
--max-batch requests, each running until its longest answer is done; padded
rows, or finished rows dropping out) on 64 chat-like requests queued at once,
then time to first token for requests sharing a 1,171-token system prompt with
the prefix cache off and on. Same engine, same kernels; only scheduling differs.

speculative: greedy, 256 new tokens with EOS ignored, 8 chat prompts and a
summarise-this-text prompt; plain decoding and each proposer in the same run
and dtype, all eager on a dynamic cache, tokens checked against plain
decoding's. A last row decodes plainly on a compiled static cache, the
runner's fastest configuration, which the verify passes cannot use.
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
import quantize
from kvcache import common_prefix, kv_bytes_per_token

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
    is gathered) — unless the table doubles as the LM head — plus the KV cache.
    Quantized weights count as stored, scales included (quantize.weight_bytes)."""
    c = model.config
    weights = quantize.weight_bytes(model)
    if not c.tie_embeddings or model.quantization:   # a quantized head is its own copy
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
            model = M.prepack(M.Llama.from_pretrained(path, "cpu", dtype))      # as model.load does
            model.config.eos_ids = []     # always generate exactly --new-tokens
            prompt = torch.randint(100, model.config.vocab_size - 100, (args.prompt_tokens,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            per_token = bytes_per_token(model, args.prompt_tokens + args.new_tokens // 2)
            n_ctx = args.prompt_tokens + args.new_tokens + 16   # a static cache sized to the job, as gpt-fast does
            # implementation -> (dtype column, bytes read per decode step, fn(warmup) -> (ttft_s, decode_s))
            impls = {"nanoinfer cached": (dtype, per_token, lambda warmup: run_ours(
                model, prompt, 8 if warmup else args.new_tokens))}
            for weights in ([] if args.no_compile else args.weights):
                # More instances: compile_decode() switches every one-token step to the compiled graph;
                # int8/int4 quantize every Linear first (quantize.py), activations stay in `dtype`.
                fast = M.Llama.from_pretrained(path, "cpu", dtype)
                fast.config.eos_ids = []
                M.prepack(quantize.quantize_model(fast, weights))      # the prefill runs eagerly
                static = fast.new_cache("static", max_len=n_ctx)
                t0 = time.perf_counter()
                fast.compile_decode()
                with torch.inference_mode():
                    run_ours(fast, prompt, 2, static)
                print(f"  {name} {dtype} {weights}: compiled the decode step in {time.perf_counter() - t0:.1f} s",
                      flush=True)
                label = dtype if weights == "auto" else f"{weights} weights, {dtype}"
                per_tok = bytes_per_token(fast, args.prompt_tokens + args.new_tokens // 2)
                impls[f"nanoinfer static+compile{'' if weights == 'auto' else ' ' + weights}"] = (
                    label, per_tok, lambda warmup, fast=fast, static=static: run_ours(
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


def long_system_prompt() -> str:
    """The handbook of kvcache.py's prefix demo, plus two weeks of reports: ~1,150 tokens."""
    import random
    from kvcache import HANDBOOK
    rng = random.Random(0)
    orchards = ["Beaulieu", "Les Vergers", "Montfort", "La Clairière", "Saint-Aubin"]
    log = "\n".join(f"Day {d} ({rng.choice(orchards)}): {rng.randint(300, 1800)} crates, {rng.randint(4, 12)} "
                    f"carts, {rng.randint(0, 3)} red cards, {rng.randint(0, 2)} emergency stops."
                    for d in range(1, 16))
    return ("You are a helpful assistant. Answer from the handbook below in one short sentence.\n\n"
            f"{HANDBOOK}\n\nAppendix: the daily reports of last season.\n{log}")


def bench_batching(args):
    """Continuous against static batching on a chat-like workload, and time to first
    token with and without prefix caching; everything through engine.Engine, so the
    kernels are the same and only the scheduling (or the cache) differs."""
    import engine as E
    from kvcache import QUESTIONS
    if args.threads:
        torch.set_num_threads(args.threads)
    if hint := E.busy_machine_hint():
        print(hint)
    model, tok = M.load(args.model, dtype=args.dtype)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    jobs = E.chat_workload(args.requests, model.config.vocab_size, seed=0)
    outs = sorted(j.output_len for j in jobs)
    prompts = [len(j.prompt) for j in jobs]
    print(f"{args.model} ({dtype}), {torch.get_num_threads()} threads: {args.requests} requests, all queued at "
          f"t = 0; prompts uniform 20-100 tokens (mean {statistics.mean(prompts):.0f}); answers log-uniform "
          f"8-128 tokens, EOS ignored (median {statistics.median(outs):.0f}, mean {statistics.mean(outs):.0f}, "
          f"max {outs[-1]}); static batch = continuous max batch = {args.max_batch}", flush=True)
    E.run_continuous(model, jobs[:4], 4)          # warm-up: first calls of every kernel
    runs = [lambda: E.run_static(model, jobs, args.max_batch, pad=True)]
    if not args.skip_dropped:
        runs.append(lambda: E.run_static(model, jobs, args.max_batch, pad=False))
    runs.append(lambda: E.run_continuous(model, jobs, args.max_batch))
    results = []
    for run in runs:
        results.append(run())
        r = results[-1]
        print(f"  {r.name}: {r.wall_s:.1f} s, {r.tok_s:.1f} tok/s", flush=True)
    same = all(r.outputs == results[0].outputs for r in results)
    print(f"\n{E.batching_table(results)}\n\nsame tokens in every run (greedy): {same}; latency = from t = 0 "
          f"until the request's answer is complete (a padded static batch returns its answers together)")

    system = long_system_prompt()
    convs = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                 {"role": "user", "content": q}]), add_bos=False)
             for q in QUESTIONS[:args.questions]]
    shared = min(common_prefix(convs[0], c) for c in convs[1:])
    print(f"\nprefix caching: {len(convs)} requests, one at a time; each is the same system prompt plus a short "
          f"question ({min(map(len, convs))}-{max(map(len, convs))} tokens, the first {shared} shared); "
          f"TTFT = add_request to first token", flush=True)
    rows = []
    for caching in (False, True):
        engine = E.Engine(model, max_batch=1, prefix_caching=caching)
        ttfts, computed, answers = [], [], []
        for ids in convs:
            t0 = time.perf_counter()
            rid = engine.add_request(ids, M.SamplingParams(max_new_tokens=1))
            req = engine.request(rid)
            while not req.finished:
                engine.step()
            ttfts.append(req.first_token - t0)
            computed.append(req.prefill_tokens)
            answers.append(req.sequences[0].output)
        warm = ttfts[1:]          # with the cache on, the first request fills it
        rows.append((caching, ttfts[0], statistics.median(warm), statistics.median(computed[1:]), answers))
        print(f"  prefix cache {'on' if caching else 'off'}: TTFT {[round(t * 1000) for t in ttfts]} ms", flush=True)
    off = rows[0][2]
    print("\n| prefix cache | first request TTFT ms | later requests: TTFT ms (median) | prompt tokens computed "
          "(median) | × faster |\n|---|---:|---:|---:|---:|")
    for caching, first, median, comp, _ in rows:
        print(f"| {'on' if caching else 'off'} | {first * 1000:.0f} | {median * 1000:.0f} | {comp:.0f} "
              f"| {off / median:.1f} |")
    print(f"\nsame first tokens with and without the cache: {rows[0][4] == rows[1][4]}")


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
    """Greedy, EOS ignored: plain decoding against each speculative method, same prompts, same run."""
    import speculative as S
    from kvcache import HANDBOOK
    model, tok = M.load(args.model, "cpu", args.dtype)

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)

    methods = {"plain": lambda: None}
    if args.draft:
        draft = S.load_draft(args.draft, model, tok, "cpu", args.dtype)
        methods[f"draft {args.draft}, k={args.spec_k}"] = lambda: S.draft_proposer(draft, model, args.spec_k,
                                                                                    compile=True)
        methods[f"draft {args.draft}, adaptive k"] = \
            lambda: S.draft_proposer(draft, model, args.spec_k, adaptive=True, compile=True)
        if draft.config.eagle and args.spec_tree:
            tree = S.parse_tree(args.spec_tree)
            methods[f"draft {args.draft}, tree of {tree[1]} (W={tree[0]}, depth {args.spec_k})"] = \
                lambda: S.draft_proposer(draft, model, args.spec_k, tree=tree)
        methods[f"draft {args.draft}, k={args.spec_k} + lookup N={args.prompt_lookup}"] = \
            lambda: S.LookupThenDraft(S.draft_proposer(draft, model, args.spec_k, compile=True), args.prompt_lookup)
        t0 = time.perf_counter()        # for every static-cache size the prompts use
        S.draft_proposer(draft, model, args.spec_k, compile=True).warm_up(model)
        print(f"draft step compiled in {time.perf_counter() - t0:.0f} s (not timed below)", flush=True)
    methods[f"lookahead {args.lookahead}"] = lambda: S.Lookahead(*S.parse_lookahead(args.lookahead))
    methods[f"prompt lookup N={args.prompt_lookup}, k={args.lookup_k}"] = \
        lambda: S.PromptLookup(args.prompt_lookup, args.lookup_k)
    if args.compiled:
        # The target runs eagerly in every method above; the runner's fastest plain
        # decoding is the compiled one-token step on a static cache, which a
        # several-token verify pass cannot use. This row shows what it decodes at.
        t0 = time.perf_counter()
        model.compile_decode()
        static = model.new_cache("static", 2048)        # the runner's default context
        list(M.generate_cached(model, [0], M.SamplingParams(max_new_tokens=2), cache=static))
        methods["plain, compiled (--cache static --compile)"] = lambda: static
        print(f"plain decode step compiled in {time.perf_counter() - t0:.0f} s (not timed below)", flush=True)
    groups = {f"{args.prompts} chat prompts": [chat(t) for t in CHAT_PROMPTS[:args.prompts]],
              "summarise-this-text prompt": [chat(S.SUMMARISE + HANDBOOK)]}
    threads = torch.get_num_threads()
    for name, prompts in groups.items():
        print(f"\n{name}: {args.model} {args.dtype}, greedy, {args.new_tokens} new tokens each (EOS ignored), "
              f"{threads} threads; speedup = decode tok/s over plain decoding in the same run\n", flush=True)
        print(S.table(S.compare(model, prompts, methods, args.new_tokens)), flush=True)


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
    d.add_argument("--weights", nargs="+", default=["auto", "int8", "int4"], choices=["auto", "int8", "int4"],
                   help="weight formats of the compiled configuration (auto = the dtype itself)")
    a = sub.add_parser("attention", help="flash.py's benchmark: naive, tiled (eager, compiled), SDPA")
    a.add_argument("--quick", action="store_true", help="N = 512, 2048, 8192 and d 64 only")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b = sub.add_parser("batching", help="engine.py: static vs continuous batching, prefix caching TTFT")
    b.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    b.add_argument("--dtype", default="float32", choices=list(M.DTYPES))
    b.add_argument("--requests", type=int, default=64)
    b.add_argument("--max-batch", type=int, default=16)
    b.add_argument("--questions", type=int, default=6, help="prefix caching: requests per configuration")
    b.add_argument("--skip-dropped", action="store_true", help="skip the static run whose finished rows drop out")
    b.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); on a busy shared machine 1 avoids OpenMP stalls")
    sp = sub.add_parser("speculative", help="speculative.py: draft model, lookahead, prompt lookup vs plain")
    sp.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    sp.add_argument("--dtype", default="float32", choices=list(M.DTYPES))
    sp.add_argument("--draft", default="bundled", help="draft model; '' to skip (default: train.py's draft)")
    sp.add_argument("--spec-k", type=int, default=3, help="draft tokens per step (bundled head, 4 chat prompts: k=3 1.39x, k=4 1.30x in one run)")
    sp.add_argument("--lookahead", default="4,3,4", metavar="W,N,G")
    sp.add_argument("--spec-tree", default="4,10", metavar="W,M", help="EAGLE head: also draft a tree, W children "
                    "per node, --spec-k levels, M tokens verified ('' to skip)")
    sp.add_argument("--prompt-lookup", type=int, default=3, metavar="N")
    sp.add_argument("--lookup-k", type=int, default=4, help="prompt lookup: tokens proposed per step (4 beat 8 here: 1.75x vs 1.33x on the summarise prompt)")
    sp.add_argument("--new-tokens", type=int, default=256)
    sp.add_argument("--prompts", type=int, default=8, help="chat prompts (at most 8)")
    sp.add_argument("--no-compiled", dest="compiled", action="store_false",
                    help="skip the last row: plain decoding compiled on a static cache (1-2.5 min to compile once)")
    args = ap.parse_args()
    if args.cmd == "speculative":
        bench_speculative(args)
    elif args.cmd == "batching":
        bench_batching(args)
    elif args.cmd == "decode":
        bench_decode(args)
    elif args.cmd == "attention":
        import flash
        flash.bench(args.quick, args.dtype)


if __name__ == "__main__":
    main()
