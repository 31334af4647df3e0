"""
serve_local.py — chat with a Llama-family model on this machine, llama.cpp style.

    python serve_local.py                       # chat with the bundled SmolLM2-135M-Instruct, as plan.py chooses
    python serve_local.py --plan                # what it chooses on this machine, and why (then exits)
    python serve_local.py --prompt "Hi" --temperature 0     # answer once; stdout = the answer only
    python serve_local.py --model tinyllama --dtype bf16
    python serve_local.py --dtype bf16 --cache static --compile   # fastest on a CPU with AVX512-BF16
    python serve_local.py --kv paged            # engine.py's block pool: prefix-cached turns and system prompts
    torchrun --nproc-per-node 2 serve_local.py --tp 2 --prompt "Hi"   # every layer split across 2 processes (tp.py)

What makes a chat turn cheap: the conversation's KV cache lives across turns.
Each turn renders the whole conversation with the model's chat template,
tokenizes it, and compares it with the tokens already in the cache; only the
tokens after the common prefix are prefilled (the new user message and the
template's markup around it), so turn 10 costs what turn 1 costs, not the sum
of all of them. The stats line after each answer shows it: `prompt N tok` is
what this turn actually ran.

Everything except the answer goes to stderr, so `--prompt` composes with pipes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

import checkpoint
import drafting
import engine
import gguf_hf
import kernels
import kvcache
import nanoinfer.load
import plan
import quantize
import speculative
import tp
from kvcache import common_prefix
from model import (DECODERS, ContextOverflow, GenerationStats, Llama, check_context, context_limit,
                   count_parameters, generate_cached, generate_naive)
from nanoinfer.config import RunConfig
from sampling import Finish, SamplingParams, grammar_vocab, visible
from tokenizer import Tokenizer


@dataclass
class Chat:
    """A conversation and the contiguous KV cache that holds it."""
    model: Llama
    tok: Tokenizer
    params: SamplingParams
    decoder: str = "cached"
    raw: bool = False
    system: str | None = None
    cache_kind: str = "dynamic"
    ctx: int | None = None        # static cache size (default: the model's context)
    kv_dtype: str | None = None   # int8 / fp8: quantized KV storage (quantize.py)
    messages: list = field(default_factory=list)
    ids: list = field(default_factory=list)   # the conversation's tokens; the cache holds a prefix of them
    proposer: object = None       # speculative decoding (speculative.py): --draft, --lookahead, --prompt-lookup
    spec: object = None           # the last turn's speculative stats
    plain_step_s: float = 0.0     # one plain decode step after the last answer: the speedup's baseline
    building: object = None       # the process building the compiled step (warm_up), till take_compiled_step
    vocab: object = None          # --json, --json-schema: the grammar's vocabulary (sampling.grammar_vocab)

    def __post_init__(self):
        self.cached_tokens = None     # paged: prompt tokens the last turn found in the cache
        self.cache = self.new_cache()
        self.reset()

    def new_cache(self):
        return kvcache.new_cache(self.model, self.cache_kind, self.ctx, codec=quantize.kv_codec(self.kv_dtype))

    def reset(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.forget()
        self.ids = []

    def forget(self):
        """Drop the conversation's K/V."""
        self.cache.crop(0)

    def conversation_ids(self, user_text: str, history: bool = True) -> list[int]:
        """The tokens of the conversation with ``user_text`` as its next message (without
        the earlier turns: ``history=False``). Message text is data: it never becomes a
        control token (Tokenizer.encode_chat); the template writes BOS where it belongs."""
        if self.raw:   # plain completion: the new text continues everything so far
            before = self.ids if history else []
            return before + self.tok.encode(user_text, add_bos=None if not before else False)
        system = [m for m in self.messages if m["role"] == "system"]
        return self.tok.encode_chat((self.messages if history else system) + [{"role": "user", "content": user_text}])

    def limit(self) -> int:
        return context_limit(self.model, self.cache)

    def turn(self, user_text: str, out=sys.stdout) -> GenerationStats:
        """Run one turn, streaming the answer to ``out``. Raises ContextOverflow
        with the conversation unchanged if it no longer fits, saying what would help."""
        ids = self.conversation_ids(user_text)
        if not ids:
            raise ValueError("nothing to complete: give some text (--raw continues the text you give)")
        try:
            check_context(self.model, len(ids), self.cache)
        except ContextOverflow as e:
            alone = len(self.conversation_ids(user_text, history=False))
            if alone < self.limit() and len(ids) > alone:
                raise ContextOverflow(f"{e}; /reset starts a new conversation with room for it") from None
            bigger = "" if self.cache.limit is None else ", or raise --ctx"
            raise ContextOverflow(f"{e}; shorten the message{bigger}") from None
        stats, answer, stream = GenerationStats(), [], self.tok.stream()
        prefix, tokens = self.generate(ids, stats)
        try:
            for t in tokens:
                answer.append(t)
                if visible(t, self.model.config.eos_ids):
                    out.write(stream.push(t))
                    out.flush()
        except KeyboardInterrupt:
            out.write(" [interrupted]")
        finally:
            tokens.close()
            out.write(stream.flush() + "\n")
            out.flush()
            # The cache holds the prompt and every answer token but the last; after an
            # interrupt some layers may hold one more, so crop all to the agreed length.
            self.keep(len(ids) + len(answer) - 1 if answer else prefix)
            gguf_hf.give_back_freed()
            self.ids = ids + answer
        if self.proposer is not None:      # the baseline of the speedup the stats line prints
            self.plain_step_s = plain_step_s(self.model, self.cache) or self.plain_step_s
        text = self.tok.decode([t for t in answer if visible(t, self.model.config.eos_ids)], skip_special=True)
        if not self.raw:
            self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        return stats

    def generate(self, ids: list[int], stats: GenerationStats):
        """(tokens of ids already in the cache, the answer's token iterator)."""
        if self.decoder == "naive":
            return 0, generate_naive(self.model, ids, self.params, stats, self.vocab)
        prefix = common_prefix(self.ids[:self.cache.length], ids)
        prefix = min(prefix, len(ids) - 1)     # at least one token must run to get logits
        self.cache.crop(prefix)
        if self.proposer is not None:
            self.spec = speculative.SpecStats()
            return prefix, speculative.generate(self.model, ids[prefix:], self.params, self.proposer, stats,
                                                self.spec, self.cache, history=ids[:prefix],
                                                vocab=self.vocab)
        return prefix, generate_cached(self.model, ids[prefix:], self.params, stats, self.cache,
                                       self.vocab)

    def keep(self, n: int):
        """After a turn: the cache holds the conversation's first n tokens."""
        self.cache.crop(n)


@dataclass
class PagedChat(Chat):
    """The conversation in the engine's block pool (engine.py): each turn is one
    request in this conversation's session, so the engine appends to the previous
    turn's blocks (or finds the conversation's full blocks in the prefix cache)
    and computes only what is new."""
    block_size: int = 16          # tokens per block

    def new_cache(self):
        ctx = self.ctx or self.model.config.max_seq_len
        # One conversation's context; blocks it no longer holds stay in the prefix cache.
        codec = quantize.kv_codec(self.kv_dtype)
        self.engine = engine.Engine(self.model, num_blocks=-(-ctx // self.block_size), block_size=self.block_size,
                                    max_batch=1, codec=codec,
                                    in_place=kernels.paged_reader(self.model.norm.weight.device, codec),
                                    vocab=self.vocab)
        self.session_key = object()
        return self.engine.cache

    def forget(self):
        self.engine.end_session(self.session_key)   # its full blocks stay cached for the next one

    def keep(self, n: int):
        pass                                          # the engine keeps the session's blocks itself

    def generate(self, ids: list[int], stats: GenerationStats):
        return 0, self.paged_tokens(ids, stats)

    def paged_tokens(self, ids: list[int], stats: GenerationStats):
        """The turn as one engine request. Ctrl-C is held until the step in flight
        ends, so the pool never keeps a half-written step."""
        t0 = time.perf_counter()
        rid = self.engine.add_request(ids, self.params, session=self.session_key)
        req, stream = self.engine.request(rid), self.engine.stream(rid)
        with held_interrupts() as interrupted:
            try:
                for i, t in enumerate(stream):
                    # A new request's first step prefills and decodes: its two tokens arrive
                    # together, so the first token's time is the engine's, not this loop's.
                    if i == 0:
                        stats.prompt_tokens, self.cached_tokens = req.prefill_tokens, req.cached_tokens
                        stats.prefill_s = req.first_token - t0
                    else:
                        stats.decode_s = time.perf_counter() - req.first_token
                    stats.new_tokens += 1
                    stats.finish_reason = req.sequences[0].finish_reason
                    stats.positions_computed += stats.prompt_tokens if i == 0 else 1
                    yield t
                    if interrupted:
                        raise KeyboardInterrupt
            finally:
                stream.close()       # cancels the request if it is still running


@contextmanager
def held_interrupts():
    """Within the block, Ctrl-C sets a flag (a list that becomes non-empty) instead of
    raising wherever the program happens to be."""
    hits = []
    try:
        old = signal.signal(signal.SIGINT, lambda *_: hits.append(True))
    except ValueError:          # not the main thread: signals cannot be caught here anyway
        old = None
    try:
        yield hits
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


def stats_line(s: GenerationStats, context: int, max_ctx: int, cached: int | None = None) -> str:
    prefill = s.prompt_tokens / s.prefill_s if s.prefill_s else 0.0
    decode = (s.new_tokens - 1) / s.decode_s if s.decode_s else 0.0
    hit = "" if cached is None else f" (+{cached} cached)"
    return (f"[prompt {s.prompt_tokens} tok{hit}, {prefill:.1f} tok/s | generated {s.new_tokens} tok, "
            f"{decode:.1f} tok/s | first token {s.prefill_s * 1000:.0f} ms | context {context}/{max_ctx}]")


# ----------------------------------------------------------------------------
# Speculative decoding as the runner sets it up and reports it.

def plain_step_s(model: Llama, cache=None, context: int = 64, steps: int = 6) -> float:
    """The time of one plain decode step (median), the runner's baseline for the
    speedup. Pass the runner's own cache: with --compile a static cache's one-token
    step is the compiled one (several times faster than the eager step), and the
    baseline must be what decoding without a proposer would cost. On a cache that
    holds the conversation the steps run after it, at the context the answer reached,
    and are cropped off again: timed right after the answer, because a CPU's bandwidth
    drifts minute to minute and the baseline must see the answer's own minute. An empty
    cache first takes a `context`-token prompt. 0.0 when the cache has no room left."""
    dev = model.device
    cache = kvcache.new_cache(model) if cache is None else cache
    start, times = cache.length, []
    with torch.inference_mode():
        if start == 0:     # a small --ctx holds it too
            context = max(1, min(context, context_limit(model, cache) - steps - 1))
            model(torch.zeros(1, context, dtype=torch.long, device=dev), torch.arange(context, device=dev), cache)
        for _ in range(min(steps, context_limit(model, cache) - cache.length)):
            t0 = time.perf_counter()
            model(torch.zeros(1, 1, dtype=torch.long, device=dev), torch.tensor([cache.length], device=dev),
                  cache, last_only=True)
            times.append(time.perf_counter() - t0)
    cache.crop(start)
    return sorted(times)[len(times) // 2] if times else 0.0


def spec_stats_line(spec: speculative.SpecStats, stats: GenerationStats, plain_s: float) -> str:
    speed = (stats.new_tokens - 1) / stats.decode_s if stats.decode_s else 0.0
    if not plain_s:     # the context was full: no room to time a plain step
        return f"[speculative: {spec.summary()}]"
    return f"[speculative: {spec.summary()} | ~{speed * plain_s:.2f}x plain decoding ({1 / plain_s:.1f} tok/s)]"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Chat with a Llama-family model locally.")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL,
                    help=f"alias ({', '.join(checkpoint.ALIASES)}), HF directory, .gguf file or hub id")
    ap.add_argument("--device", default=None, help="cuda, mps or cpu (default: best available)")
    ap.add_argument("--plan", action="store_true", help="print the configuration plan.py chooses for this "
                    "machine, --model and --ctx, one reason per line with the cost model, and exit")
    ap.add_argument("--dtype", default=None, choices=["auto", *kernels.DTYPES], help="default: the plan's")
    ap.add_argument("--prompt", default=None, help="answer this once and exit (answer on stdout)")
    ap.add_argument("--system", default=None, help="system message for the chat template")
    ap.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="most tokens an answer may have (default: 512)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
    ap.add_argument("--top-k", type=int, default=40, help="keep the k likeliest tokens; 0 = off (default: 40)")
    ap.add_argument("--top-p", type=float, default=0.9, help="keep the likeliest tokens up to this probability "
                    "(default: 0.9)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="every answer is a JSON object (a grammar "
                    "decides which tokens may come: sampling.py)")
    ap.add_argument("--json-schema", default=None, metavar="FILE", help="every answer is JSON valid "
                    "against the JSON schema in FILE")
    ap.add_argument("--decoder", choices=list(DECODERS), default="cached")
    ap.add_argument("--cache", choices=list(kvcache.CACHES), default=None,
                    help="KV cache: grows (dynamic), preallocated (static), a ring (sliding-window models), or "
                         "grows in host memory and visits the device a layer at a time (offloaded); default: "
                         "static where the plan compiles, else dynamic")
    ap.add_argument("--ctx", type=int, default=None,
                    help="the context in tokens of a preallocated cache: --cache static (on a GPU attention reads "
                         "all of it every step, so size it to the conversation) or --kv paged, the block pool "
                         "(default: min(model context, 2048); alone, it asks for a static cache)")
    ap.add_argument("--kv", choices=["contiguous", "paged"], default="contiguous",
                    help="paged: the continuous-batching engine's block pool (engine.py); the conversation "
                         "stays in its blocks between turns, and full blocks are shared by prefix caching")
    ap.add_argument("--block-size", type=int, default=None, help="--kv paged: tokens per block (default: 16)")
    ap.add_argument("--attn", choices=list(kernels.ATTENTION), default=None,
                    help="attention kernel: PyTorch's fused SDPA, flash.py's tiled one, the naive "
                         "full score matrix, or kernels.py's Triton kernels (a CUDA GPU); default: the plan's (sdpa)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the decode step on a static cache (warm-up is printed); default: the "
                         "plan's (compiled where a C++ compiler is present, unless it speculates with the model's bundled draft)")
    ap.add_argument("--compile-only", action="store_true",
                    help="build the compiled decode step of these flags and exit (a chat's first start runs this in "
                         "the background and answers on the eager step meanwhile)")
    ap.add_argument("--no-prepack", action="store_true",
                    help="keep one copy of the model's weights: half the memory on a CPU, slower eager steps "
                         "(kernels.prepack: +540 MB for SmolLM2 in fp32; several-position passes get slower)")
    ap.add_argument("--kv-dtype", default=None, choices=["auto", "int8", "fp8", "fp8-plain"],
                    help="KV cache storage: the model's dtype (auto), or int8/fp8 with a scale per token "
                         "and head (half the bytes); fp8-plain casts without a scale; default: the plan's")
    ap.add_argument("--weights", default=None, choices=["auto", "float", "int8", "int4"],
                    help="auto: as stored (a GGUF's own bits); float: a GGUF's weights widened to the "
                         "dtype (the exact reference); int8 (per row) or int4 (grouped): every Linear "
                         "re-rounded at load; default: the plan's")
    ap.add_argument("--activations", default=None, choices=["fp32", "int8"],
                    help="int8: round x to 8 bits per 32 in the products with quantized weights, as "
                         "llama.cpp does (integer dot products, faster; close to the file, not "
                         "exact); default fp32, exact to the file")
    ap.add_argument("--group-size", type=int, default=None, help="--weights int4: 32, 64 or 128 weights share "
                    "a scale (default: 32)")
    ap.add_argument("--draft", default=None, help="speculative decoding with a draft model of the same "
                    "tokenizer (alias, directory, .gguf; `bundled` = train.py's EAGLE head for SmolLM2, `medusa` = its Medusa "
                    "heads, train.py --medusa 4)")
    ap.add_argument("--spec-k", type=int, default=None, help="tokens proposed per step (--draft, --prompt-lookup; "
                    "default: the plan's, 4)")
    ap.add_argument("--no-speculation", action="store_true", help="plain decoding: drop the speculative method "
                    "the plan chose (for the bundled model: its EAGLE head and prompt lookup)")
    ap.add_argument("--spec-tree", default=None, metavar="W,M", help="--draft with an EAGLE head or Medusa heads: draft a "
                    "tree, W children per node, --spec-k levels, and verify the M likeliest tokens in one pass (e.g. 4,10)")
    ap.add_argument("--adaptive-k", action="store_true", help="--draft: grow k after full acceptance, shrink "
                    "it after early rejection")
    ap.add_argument("--lookahead", default=None, metavar="W,N,G", help="lookahead decoding: Jacobi window W, "
                    "n-gram size N, up to G candidates verified per step (e.g. 4,3,4)")
    ap.add_argument("--prompt-lookup", type=int, default=None, metavar="N", help="speculate by copying what "
                    "followed the latest earlier match of the last N..1 tokens; with --draft, copy where the "
                    "last N tokens occurred before (up to 2K tokens) and draft elsewhere")
    ap.add_argument("--tp", type=int, default=None, metavar="N", help="tensor parallelism (tp.py): split every "
                    "layer across N processes, one per GPU or CPU share; run under torchrun --nproc-per-node N "
                    "with --prompt (rank 0 prints)")
    return ap.parse_args(argv)


def report(chat: Chat, stats: GenerationStats, interactive: bool = True):
    """The turn's stats line(s), on stderr: the answer alone goes to stdout. An answer
    the context cut short says so, and what would give it room."""
    limit = chat.limit()
    print(stats_line(stats, len(chat.ids), limit, chat.cached_tokens), file=sys.stderr)
    if chat.spec is not None:
        print(spec_stats_line(chat.spec, stats, chat.plain_step_s), file=sys.stderr)
    if stats.finish_reason == Finish.LENGTH and len(chat.ids) >= limit:
        room = ["/reset to start over"] if interactive else []
        room += ["a larger --ctx"] if chat.cache.limit is not None and limit < chat.model.config.max_seq_len else []
        print(f"[the answer was cut: the context is full ({limit} tokens)"
              + (f"; {' or '.join(room)}" if room else "") + "]", file=sys.stderr)


def warm_up(chat: Chat, argv: list[str] | None = None):
    """Compile before the user types: one throwaway decode step through the real cache. On a CPU a compiled
    step is built once and loaded by every later start (kernels.AheadOfTime); its log says which happened.
    Given the chat's flags (``argv``: RunConfig.background_compile, the step loaded with build=False), a step
    not built yet is built by a child process (--compile-only, ~1 min) while the chat answers on the eager
    step; take_compiled_step then loads it."""
    t0 = time.perf_counter()
    draft = getattr(chat.proposer, "draft", chat.proposer)    # LookupThenDraft holds one
    drafted = isinstance(draft, drafting.DraftModel) and draft.static   # its step is compiled too (nanoinfer.load.proposer)
    steps = [chat.model.compiled_step] + ([draft.model.compiled_step] if drafted else [])
    ahead = all(isinstance(step, kernels.AheadOfTime) for step in steps)
    for step in steps if ahead else []:
        step.announce = lambda path: print(f"compiling (once) a decode step into {path} ...", file=sys.stderr,
                                           flush=True)
    if not ahead:
        print("compiling the decode step ...", file=sys.stderr, flush=True)
    step_once(chat.model, chat.cache)
    if getattr(chat.model.compiled_step, "missing", None):
        chat.cache.crop(0)
        log = build_log()
        chat.building = nanoinfer.load.build_in_background(Path(__file__).resolve(), argv, log)
        print(f"compiling the decode step in the background (once, ~1 min; log: {log}); until then the answers "
              f"run on the eager step", file=sys.stderr)
        return
    if chat.proposer is not None and chat.proposer.needs_features:
        # An EAGLE head reads the target's features, so a one-token target step (a
        # turn's last token, where nothing is left to draft) asks for them: a second
        # variant of the compiled step, compiled now rather than mid-answer (~7 s).
        dev = chat.model.device
        with torch.inference_mode():
            chat.model(torch.zeros(1, 1, dtype=torch.long, device=dev), torch.tensor([chat.cache.length], device=dev),
                       chat.cache, last_only=True, hidden=True)
    chat.cache.crop(0)
    if drafted:
        draft.warm_up(chat.model, sizes=(512, 1024))   # a chat's first turns, then longer ones
    took = time.perf_counter() - t0
    if ahead and not any(step.built for step in steps):
        print(f"compiled step loaded from cache in {took:.1f} s", file=sys.stderr)
    else:
        print(f"compiled in {took:.1f} s (cached on disk for the next run)", file=sys.stderr)


def step_once(model, cache):
    """Two throwaway tokens through ``cache``: a compiled step's first call loads (or builds) its package."""
    list(generate_cached(model, [0], SamplingParams(max_new_tokens=2), cache=cache))


def said_step(step: kernels.AheadOfTime):
    """After one answer on a step that is not built here (RunConfig.build False): whether a package
    on disk served it, or the answer ran eagerly and how to change that."""
    for line in step.log:
        print(line, file=sys.stderr)
    if step.missing:
        print("no compiled step on disk for these flags yet: the answer ran on the eager step (a chat "
              "builds one once, in the background; then answers like this one load it)",
              file=sys.stderr)


def build_log() -> Path:
    return checkpoint.cache_root() / "compiled" / "background-build.log"


def take_compiled_step(chat: Chat):
    """Between turns: once warm_up's background build has finished, load its package (~2 s) and answer on it."""
    if chat.building is None or chat.building.poll() is None:
        return
    proc, chat.building = chat.building, None
    if proc.returncode:
        print(nanoinfer.load.build_failed(proc.returncode, build_log()), file=sys.stderr)
        return
    t0 = time.perf_counter()
    nanoinfer.load.load_compiled(chat.model)
    step_once(chat.model, chat.new_cache())         # the conversation's cache is live: a scratch one
    print(f"[compiled step ready: loaded in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)


HISTORY_LINE = 500      # longer lines (pastes) stay out of the ↑ history


def read_line(tty: bool, editing=None) -> str:
    """The next line: with a prompt on a terminal (and ↑ history where ``editing``,
    the readline module, is loaded); from a pipe, without a prompt, so that stdout
    holds the answers alone."""
    if tty:
        line = input("> ")
        if editing is not None and line.strip() and len(line) <= HISTORY_LINE:
            editing.add_history(line)
        return line
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line


def interactive(chat: Chat):
    tty = sys.stdin.isatty()
    editing = history = None
    if tty:             # loaded for a terminal only: line editing and ↑ history for input()
        # Ctrl-C stops an answer even where the runner was started with SIGINT ignored (a shell's
        # background job passes SIG_IGN on, and Python then never raises KeyboardInterrupt).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            import readline as editing
            editing.set_auto_history(False)
            editing.set_history_length(1000)
            history = checkpoint.cache_root() / "chat_history"
            history.parent.mkdir(parents=True, exist_ok=True)
            if history.exists():
                editing.read_history_file(history)
        except (ImportError, OSError):
            history = None
    print("chat: /reset starts over, /exit or Ctrl-D quits; Ctrl-C stops an answer, twice at the prompt quits",
          file=sys.stderr)
    interrupted = False      # Ctrl-C at the prompt: the first clears the line, a second in a row quits
    try:
        while True:
            try:
                line = read_line(tty, editing).strip()
            except EOFError:
                print(file=sys.stderr)
                break
            except KeyboardInterrupt:
                if interrupted:
                    print(file=sys.stderr)
                    break
                interrupted = True
                print("\n[Ctrl-C again or Ctrl-D to quit]", file=sys.stderr)
                continue
            interrupted = False
            try:
                if not line:
                    continue
                if line in ("/exit", "/quit"):
                    break
                if line == "/reset":
                    chat.reset()
                    print("[conversation cleared]", file=sys.stderr)
                    continue
                take_compiled_step(chat)
                stats = chat.turn(line)
                report(chat, stats)
            except ContextOverflow as e:
                print(f"[context full: {e}]", file=sys.stderr)
            except ValueError as e:       # this turn failed (the model computed NaN, ...); the chat goes on
                print(f"error: {e}", file=sys.stderr)
            except KeyboardInterrupt:     # between an answer's end and the next prompt: nothing to stop
                print(file=sys.stderr)
    finally:
        if history is not None:
            editing.write_history_file(history)
        if chat.building is not None and chat.building.poll() is None:     # quit before it finished
            chat.building.terminate()
            print("[the background compile stopped: the next start begins it again]", file=sys.stderr)


def check_flags(args):
    """Flags that make no sense together: one line each, before anything loads."""
    if args.ctx is not None and args.ctx < 1:
        raise ValueError(f"--ctx must be at least 1 token, got {args.ctx}")
    if args.ctx is not None and args.cache in ("dynamic", "offloaded") and args.kv != "paged":
        raise ValueError("--ctx sizes a preallocated cache: add --cache static or --kv paged (the dynamic "
                         "and offloaded caches grow up to the model's context by themselves)")
    if args.block_size is not None and args.kv != "paged":
        raise ValueError("--block-size sets the blocks of the paged pool: add --kv paged")
    if args.adaptive_k and args.draft is None:
        raise ValueError("--adaptive-k adapts a draft model's k: add --draft")
    if args.json and args.json_schema is not None:
        raise ValueError("--json asks for any JSON object and --json-schema for one schema: give one")
    if args.group_size is not None and args.weights != "int4":
        raise ValueError("--group-size sets int4's groups: add --weights int4")
    if args.compile and args.cache not in (None, "static"):
        raise ValueError("--compile needs --cache static (fixed shapes compile once)")
    if args.kv == "paged" and (args.cache not in (None, "dynamic") or args.compile or args.decoder != "cached"):
        raise ValueError("--kv paged runs the engine's own cached decoder on its block pool: "
                         "drop --cache, --compile and --decoder")
    if args.tp is not None:
        if args.tp < 1:
            raise ValueError(f"--tp must be at least 1 process, got {args.tp}")
        bad = [flag for flag, on in (("--kv paged", args.kv == "paged"), ("--compile", args.compile),
                                     ("--weights", args.weights not in (None, "auto")),
                                     ("--activations int8", args.activations == "int8"),
                                     ("--draft", args.draft is not None),
                                     ("--lookahead", args.lookahead is not None),
                                     ("--prompt-lookup", args.prompt_lookup is not None)) if on]
        if bad:
            raise ValueError(f"--tp runs the plain decoders on float weights: drop {', '.join(bad)}")
        if args.prompt is None:
            raise ValueError("--tp answers one --prompt (a typed line would reach rank 0 alone): add --prompt")


def json_schema(args) -> dict | None:
    """--json (any object) or --json-schema FILE, as SamplingParams.json_schema."""
    if args.json_schema is None:
        return {"type": "object"} if args.json else None
    try:
        schema = json.loads(Path(args.json_schema).read_text())
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {args.json_schema}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--json-schema: {args.json_schema} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: {args.json_schema} holds no JSON object")
    return schema


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prompt is None and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")     # bytes that are not UTF-8 become U+FFFD, not an error
    errors, rank = sys.stderr, 0
    try:
        check_flags(args)
        cfg = RunConfig.from_flags(args)       # every flag given overrides the plan's choice
        if args.plan:
            print(plan.describe(cfg.plan))
            return 0
        seed, device = args.seed, cfg.device
        if cfg.tp:
            rank, device = tp.start(cfg.tp, cfg.device)
            if rank:        # rank 0 prints; the others compute the same tokens silently
                sys.stdout = sys.stderr = open(os.devnull, "w")
            seed = tp.shared_seed(seed)
        print(f"{plan.summary(cfg.in_effect())} — --plan says why", file=sys.stderr)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=seed, max_new_tokens=args.max_new_tokens,
                                json_schema=json_schema(args))
        t0 = time.perf_counter()
        print(f"loading {cfg.model} ...", file=sys.stderr, flush=True)
        if cfg.tp:
            model, tok = nanoinfer.load.load_tp(cfg, device)
            print(tp.describe(model), file=sys.stderr)
        else:
            model, tok = nanoinfer.load.load(cfg)
        quant = f", weights {q['weights']}" if (q := quantize.scheme(model)) else ""
        packed = kernels.prepacked_bytes(model)
        packed = f" + {packed / 1e6:.0f} MB of oneDNN-prepacked copies" if packed else ""
        print(f"loaded in {time.perf_counter() - t0:.1f} s: {count_parameters(model) / 1e6:.0f}M "
              f"parameters in {quantize.weight_bytes(model) / 1e6:.0f} MB{packed}, "
              f"{str(model.dtype).removeprefix('torch.')}{quant}, {model.device}", file=sys.stderr)
        raw = args.raw or tok.chat_template is None
        if not 1 <= cfg.block_size <= cfg.ctx:
            raise ValueError(f"--block-size must be between 1 and the context ({cfg.ctx} tokens), "
                             f"got {cfg.block_size}")
        vocab = None
        if params.json_schema is not None:
            vocab = grammar_vocab(tok.to_json(), model.config.eos_ids)
            if vocab is None:
                raise ValueError("--json and --json-schema need the model's tokenizer.json (this "
                                 "model has a sentencepiece tokenizer.model alone)")
        proposer = nanoinfer.load.proposer(cfg, model, tok)
        if proposer is not None and (cfg.kv == "paged" or cfg.decoder != "cached"):
            raise ValueError("speculative decoding runs on the contiguous cached decoder: drop --kv paged "
                             "and --decoder naive")
        if cfg.kv == "paged":
            chat = PagedChat(model, tok, params, cfg.decoder, raw, args.system, cfg.cache, cfg.ctx, cfg.kv_dtype,
                             vocab=vocab, block_size=cfg.block_size)
        else:
            chat = Chat(model, tok, params, cfg.decoder, raw, args.system, cfg.cache, cfg.ctx, cfg.kv_dtype,
                        proposer=proposer, vocab=vocab)
        if cfg.compile and cfg.build:   # a chat's first start answers while a child compiles (warm_up)
            warm_up(chat, (sys.argv[1:] if argv is None else list(argv)) if cfg.background_compile else None)
        if args.compile_only:
            print("compiled step ready" if cfg.compile else "nothing to compile: these flags run eagerly",
                  file=sys.stderr)
            return 0
        if args.prompt is None:
            interactive(chat)
            return 0
        if not cfg.build and args.ctx is None and \
                len(chat.conversation_ids(args.prompt)) + params.max_new_tokens > chat.limit():
            # one answer too long for the plan's static cache (of a step built before): eager, on a
            # dynamic cache
            chat.cache_kind = "dynamic"
            chat.cache = chat.new_cache()
        stats = chat.turn(args.prompt, out=sys.stdout)   # sys.stdout now: a follower rank's is devnull
        if not cfg.build and chat.cache_kind == "static":
            said_step(chat.model.compiled_step)
        report(chat, stats, interactive=False)
        return 0
    except (ValueError, OSError) as e:
        # Every expected failure (bad weights, bad flags, context overflow, a lost rank) is one line.
        print(f"error: {f'rank {rank}: ' if rank else ''}{e}", file=errors)
        return 1
    except KeyboardInterrupt:   # Ctrl-C while loading or converting
        print(file=errors)
        return 130
    finally:
        tp.stop()


if __name__ == "__main__":
    sys.exit(main())
