"""The one run configuration: what the runner and the server run, built once from their flags.

A flag reaches the model one way: the command line's flags -> the plan (plan.choose for this
machine, nanoinfer/machine.py) -> defaults, laid over each other by `RunConfig.from_flags`, the
only code that reads flag names. Every consumer (load, the chat, the server's engine, tp) reads
the RunConfig it returns, in plain types: a torch.device, a torch.dtype, a weight scheme or None.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch

import checkpoint
import kernels
import quantize
from model import DTYPES, PREFILL_CHUNK
from nanoinfer.machine import plan_for
from plan import QUANTIZED, Plan, Serving


@dataclass
class RunConfig:
    """One run of the runner or the server; the defaults are a plain fp32 model on the CPU."""
    model: str = checkpoint.DEFAULT_MODEL   # alias, directory or .gguf (checkpoint.resolve)
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    weights: str | None = None          # int8 / int4: every Linear quantized at load; None: as stored
    group_size: int = quantize.GROUP    # int4's weights per scale
    head: str | None = None             # the LM head's scheme under ``weights`` (quantize.scheme_of)
    activations: str = "fp32"           # "int8": x in 8 bits for quantized weights (not exact)
    attn: str = "sdpa"                  # flash.ATTENTION
    prepack: bool = True                # kernels.prepack's copies (half the memory without)
    compile: bool = False               # the compiled one-token step, on a static cache
    background_compile: bool = False    # a step not built yet is built by a child process (warm_up)
    build: bool = True                  # False (compile only): a step not built yet runs eagerly
    cache: str = "dynamic"              # kvcache.CACHES
    ctx: int | None = None              # a preallocated cache's tokens (None: the model's context)
    kv: str = "contiguous"              # "paged": the engine's block pool
    block_size: int = 16                # tokens per block of the paged pool
    kv_dtype: str | None = None         # int8 / fp8 / fp8-plain KV storage; None: the model's dtype
    decoder: str = "cached"             # model.DECODERS
    prefill_chunk: int | None = PREFILL_CHUNK   # a prompt's tokens a cached pass computes at most
    draft: str | None = None            # speculative decoding: a draft model, "bundled" or "medusa"
    spec_k: int = 4                     # tokens proposed per step
    adaptive_k: bool = False
    spec_tree: str | None = None        # "W,M": a drafted tree (EAGLE head, Medusa heads)
    lookahead: str | None = None        # "W,N,G"
    prompt_lookup: int | None = None    # n-gram size of prompt lookup
    tp: int | None = None               # ranks of tensor parallelism (tp.py)
    plan: Plan | None = None            # what plan.choose chose (from_flags): --plan prints it

    @classmethod
    def from_flags(cls, args: argparse.Namespace, chosen: Plan | None = None,
                   serving: Serving | None = None) -> RunConfig:
        """The runner's or the server's flags -> the configuration: the device named (or the best
        present), this machine's plan for the model (``chosen``: a plan given instead; ``serving``:
        the server's engine's plan), and each flag given laid over the plan's choice for its item.
        What a flag implies follows:
        * --cache other than static turns the plan's compile off; --compile or --ctx alone take a static
          cache; --compile builds a step not built yet even for one answer (the plan's loads one
          built before, or runs eagerly).
        * any speculative flag (--draft, --prompt-lookup, --lookahead) replaces the plan's method;
          --no-speculation drops the plan's.
        * --kv paged (the server's engine), --tp and --decoder naive run their own decoders: no
          speculation of the plan's (and --tp: float weights), eager but for the server's engine
          (a plan made for it: Plan.serving) on a CPU, whose decode steps compile as the plan says; --weights
          int8/int4 drop the plan's speculation too.
        A flag a command does not have counts as not given."""
        g = {k: v for k, v in vars(args).items() if v is not None}
        device = kernels.pick_device(g.get("device"))      # a device this machine lacks: one line, now
        if g.get("attn") == "triton":
            kernels.check_triton(device)
        model = g.get("model", checkpoint.DEFAULT_MODEL)
        answer_tokens = g.get("max_new_tokens") if "prompt" in g else None   # one answer, or a chat
        p = chosen or plan_for(model, device, g.get("ctx"), answer_tokens, serving)

        def flag_or_plan(item):   # "auto" for a dtype is the plan's; for weights or KV, as stored
            given = g.get(item)
            keep = given not in (None, "auto") or item in ("weights", "kv_dtype") and item in g
            return given if keep else getattr(p, item)

        own = g.get("kv") == "paged" or bool(g.get("tp")) or g.get("decoder") == "naive"
        weights = flag_or_plan("weights")
        if g.get("tp") and "weights" not in g:
            weights = "auto"
        # --activations int8 multiplies quantized weights: where the plan widened a GGUF's bits
        # to fp32 (their kernels calibrated slower here), they stay as the file holds them, and
        # the plan's speculation, chosen for fp32 steps, goes with the widening
        kept = (g.get("activations") == "int8" and "weights" not in g and p.stored == "gguf"
                and weights == "float")
        if kept:
            weights = "auto"
        if "cache" in g:
            cache, compile = g["cache"], g.get("compile", p.compile and g["cache"] == "static")
        else:
            compile = g.get("compile", p.compile)
            cache = "static" if compile or "ctx" in g else "dynamic"
        if own:     # the server's engine on a CPU compiles its decode steps (fixed shapes, paged)
            engine_steps = p.serving is not None and device.type == "cpu"
            compile, cache = compile and engine_steps, g.get("cache", p.cache if p.serving else "dynamic")
        methods = {k: g.get(k) for k in ("draft", "prompt_lookup", "lookahead")}
        if g.get("no_speculation"):
            if any(v is not None for v in methods.values()):
                raise ValueError("--no-speculation turns speculation off: drop it or the speculative flag")
            draft = prompt_lookup = lookahead = None
        elif any(v is not None for v in methods.values()):
            draft, prompt_lookup, lookahead = methods.values()
        elif own or weights in QUANTIZED or kept:   # the plan's speculation assumed float weights
            draft, prompt_lookup, lookahead = None, None, p.lookahead
        else:
            draft, prompt_lookup, lookahead = p.draft, p.prompt_lookup, p.lookahead
        group_size = g.get("group_size") or quantize.GROUP
        weights = None if weights == "auto" else weights
        quantize.check_scheme(weights, group_size)
        kv_dtype = flag_or_plan("kv_dtype")
        speculates = any(v is not None for v in (draft, prompt_lookup, lookahead))
        return cls(
            model=model, device=device, dtype=DTYPES[flag_or_plan("dtype")], weights=weights,
            group_size=group_size, head=p.head, activations=g.get("activations", "fp32"),
            attn=flag_or_plan("attn"),
            # --tp: the plan's no-copy was for the quantized weights it would have chosen
            prepack=(p.prepack or bool(g.get("tp"))) and not g.get("no_prepack"), compile=compile,
            background_compile=compile and not speculates and "prompt" not in g and not g.get("compile_only"),
            build=not compile or p.build or bool(g.get("compile")) or bool(g.get("compile_only")),
            cache=cache, ctx=flag_or_plan("ctx"), kv=g.get("kv", "contiguous"), block_size=g.get("block_size", 16),
            kv_dtype=None if kv_dtype == "auto" else kv_dtype, decoder=g.get("decoder", "cached"), draft=draft,
            spec_k=flag_or_plan("spec_k"), adaptive_k=g.get("adaptive_k", False), spec_tree=g.get("spec_tree"),
            lookahead=lookahead, prompt_lookup=prompt_lookup, tp=g.get("tp"), plan=p)

    def in_effect(self) -> Plan:
        """The plan with this configuration's choices laid over it: what the runner's summary line says."""
        return replace(self.plan, dtype=str(self.dtype).removeprefix("torch."), cache=self.cache, ctx=self.ctx,
                       attn=self.attn, compile=self.compile, build=self.build, draft=self.draft, prompt_lookup=self.prompt_lookup,
                       lookahead=self.lookahead, spec_k=self.spec_k, weights=self.weights or "auto",
                       head=self.head, activations=self.activations,
                       kv_dtype=self.kv_dtype or "auto", prepack=self.prepack,
                       reasons=list(self.plan.reasons), cost=list(self.plan.cost))
