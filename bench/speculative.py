"""`python bench.py speculative` (speculative.py, drafting.py): every proposer against plain decoding.

Greedy, answers stopping at EOS (at most 256 new tokens;
--ignore-eos: always 256), 8 chat prompts and a summarise-this-text prompt;
plain decoding and each proposer (EAGLE head, Medusa heads, lookahead, prompt
lookup) in the same run and dtype, all eager on a dynamic cache as the runner
runs them, tokens checked against plain decoding's; per-prompt speedups, their
median and spread. --compile compiles the drafts and adds plain decoding on a
compiled static cache, the runner's fastest plain configuration.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import checkpoint
import drafting
import kernels
import results
import speculative
from kvcache import KVCache, common_prefix
from model import GenerationStats, Llama, generate_cached
import nanoinfer.load
from nanoinfer.config import RunConfig
from nanoinfer.load import load
from sampling import SamplingParams
from bench.common import CHAT_PROMPTS, HANDBOOK
import kvcache


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


def bench_speculative(args):
    """Greedy, answers stopping at EOS (--ignore-eos: always new-tokens long): plain
    decoding against each speculative method, same prompts, same run. Target and
    drafts run eagerly, as the runner runs them; --compile compiles the draft
    models' steps and adds the compiled plain step, as the runner's --compile does."""
    model, tok = load(RunConfig(args.model, torch.device("cpu"), kernels.DTYPES[args.dtype]))

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)

    methods = {"plain": lambda: None}
    tree = speculative.parse_tree(args.spec_tree) if args.spec_tree else None
    mtree = speculative.parse_tree(args.medusa_tree) if args.medusa_tree else None
    for name in (n for n in (args.draft, args.medusa) if n):
        draft = nanoinfer.load.load_draft(name, model, tok)
        if isinstance(draft, drafting.MedusaHeads):
            mk = args.medusa_k or len(draft.blocks)
            methods[f"medusa {name}, chain k={mk}"] = lambda d=draft, mk=mk: drafting.draft_proposer(d, model, mk)
            if mtree:
                methods[f"medusa {name}, tree of {mtree[1]} (W={mtree[0]}, depth {mk})"] = \
                    lambda d=draft, mk=mk: drafting.draft_proposer(d, model, mk, tree=mtree)
            continue
        k = args.spec_k        # the same for every draft
        if args.compile:       # a compiled draft drafts on a static cache (drafting.DraftModel)
            kernels.compile_decode(draft)
        methods[f"draft {name}, k={k}"] = lambda d=draft: drafting.draft_proposer(d, model, k)
        methods[f"draft {name}, adaptive k"] = \
            lambda d=draft: drafting.draft_proposer(d, model, k, adaptive=True)
        if draft.config.eagle and tree:
            methods[f"draft {name}, tree of {tree[1]} (W={tree[0]}, depth {k})"] = \
                lambda d=draft: drafting.draft_proposer(d, model, k, tree=tree)
        methods[f"draft {name}, k={k} + lookup N={args.prompt_lookup}"] = \
            lambda d=draft: drafting.LookupThenDraft(drafting.draft_proposer(d, model, k), args.prompt_lookup)
        if args.compile:
            t0 = time.perf_counter()        # for every static-cache size the prompts use
            drafting.draft_proposer(draft, model, k).warm_up(model)
            print(f"draft step compiled in {time.perf_counter() - t0:.0f} s (not timed below)", flush=True)
    methods[f"lookahead {args.lookahead}"] = lambda: drafting.Lookahead(*drafting.parse_lookahead(args.lookahead))
    methods[f"prompt lookup N={args.prompt_lookup}, k={args.lookup_k}"] = \
        lambda: drafting.PromptLookup(args.prompt_lookup, args.lookup_k)
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
              "summarise-this-text prompt": [chat(drafting.SUMMARISE + HANDBOOK)]}
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


def speculative_args(p):
    """The flags of `python bench.py speculative`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=list(kernels.DTYPES))
    p.add_argument("--draft", default="bundled", help="draft model; '' to skip (default: train.py's EAGLE head)")
    p.add_argument("--medusa", default="medusa", help="Medusa heads; '' to skip (default: train.py --medusa's)")
    p.add_argument("--medusa-k", type=int, default=0, help="Medusa: heads used, the depth (default: all)")
    p.add_argument("--spec-k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--lookahead", default="4,3,4", metavar="W,N,G")
    p.add_argument("--spec-tree", default="4,10", metavar="W,M", help="EAGLE head: also draft a tree, W children "
                   "per node, --spec-k levels, M tokens verified ('' to skip)")
    p.add_argument("--medusa-tree", default="4,10", metavar="W,M", help="Medusa: also a tree, W children per node, "
                   "--medusa-k levels, M tokens verified ('' to skip)")
    p.add_argument("--prompt-lookup", type=int, default=3, metavar="N")
    p.add_argument("--lookup-k", type=int, default=4, help="prompt lookup: tokens proposed per step")
    p.add_argument("--new-tokens", type=int, default=256, help="at most this many per answer")
    p.add_argument("--ignore-eos", action="store_true", help="always --new-tokens per answer, past its end")
    p.add_argument("--prompts", type=int, default=8, help="chat prompts (at most 8)")
    p.add_argument("--compile", action="store_true", help="compile the draft models' steps and add plain "
                   "decoding compiled on a static cache (1-2.5 min to compile once), as the runner's --compile")
