"""
serve_local.py — chat with a Llama-family model on this machine, llama.cpp style.

    python serve_local.py                       # chat with the bundled SmolLM2-135M-Instruct
    python serve_local.py --prompt "Hi" --temperature 0     # answer once; stdout = the answer only
    python serve_local.py --model tinyllama --dtype bf16
    python serve_local.py --dtype bf16 --cache static --compile   # fastest on a CPU with AVX512-BF16

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
import sys
import time
from dataclasses import dataclass, field

import checkpoint
import model as M
from tokenizer import Tokenizer


@dataclass
class Chat:
    """A conversation and the KV cache that holds it."""
    model: M.Llama
    tok: Tokenizer
    params: M.SamplingParams
    decoder: str = "cached"
    raw: bool = False
    system: str | None = None
    cache_kind: str = "dynamic"
    ctx: int | None = None        # static cache size (default: the model's context)
    messages: list = field(default_factory=list)
    ids: list = field(default_factory=list)   # the conversation's tokens; the cache holds a prefix of them

    def __post_init__(self):
        self.cache = self.model.new_cache(self.cache_kind, self.ctx)
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache.crop(0)
        self.ids = []

    def conversation_ids(self, user_text: str) -> list[int]:
        if self.raw:   # plain completion: the new text continues everything so far
            return self.ids + self.tok.encode(user_text, add_bos=None if not self.ids else False)
        text = self.tok.apply_chat_template(self.messages + [{"role": "user", "content": user_text}])
        # The template writes BOS itself where the model wants one (as transformers does).
        return self.tok.encode(text, add_bos=False)

    def turn(self, user_text: str, out=sys.stdout) -> M.GenerationStats:
        """Run one turn, streaming the answer to ``out``. Raises ContextOverflow
        with the conversation unchanged if it no longer fits."""
        ids = self.conversation_ids(user_text)
        M.check_context(self.model, len(ids), self.cache)
        stats, answer, stream = M.GenerationStats(), [], self.tok.stream()
        if self.decoder == "naive":
            prefix, tokens = 0, M.generate_naive(self.model, ids, self.params, stats)
        else:
            prefix = common_prefix(self.ids[:self.cache.length], ids)
            prefix = min(prefix, len(ids) - 1)     # at least one token must run to get logits
            self.cache.crop(prefix)
            tokens = M.generate_cached(self.model, ids[prefix:], self.params, stats, self.cache)
        try:
            for t in tokens:
                answer.append(t)
                if t not in self.model.config.eos_ids:
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
            kept = len(ids) + len(answer) - 1 if answer else prefix
            self.cache.crop(kept)
            self.ids = ids + answer
        text = self.tok.decode([t for t in answer if t not in self.model.config.eos_ids], skip_special=True)
        if not self.raw:
            self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        return stats


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def stats_line(s: M.GenerationStats, context: int, max_ctx: int) -> str:
    prefill = s.prompt_tokens / s.prefill_s if s.prefill_s else 0.0
    decode = (s.new_tokens - 1) / s.decode_s if s.decode_s else 0.0
    return (f"[prompt {s.prompt_tokens} tok, {prefill:.1f} tok/s | generated {s.new_tokens} tok, "
            f"{decode:.1f} tok/s | first token {s.prefill_s * 1000:.0f} ms | context {context}/{max_ctx}]")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Chat with a Llama-family model locally.")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL,
                    help=f"alias ({', '.join(checkpoint.ALIASES)}), HF directory, .gguf file or hub id")
    ap.add_argument("--device", default=None, help="cuda, mps or cpu (default: best available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *M.DTYPES])
    ap.add_argument("--prompt", default=None, help="answer this once and exit (answer on stdout)")
    ap.add_argument("--system", default=None, help="system message for the chat template")
    ap.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=40, help="0 = off")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--decoder", choices=list(M.DECODERS), default="cached")
    ap.add_argument("--cache", choices=["dynamic", "static", "sliding"], default="dynamic",
                    help="KV cache: grows (dynamic), preallocated (static), or a ring (sliding-window models)")
    ap.add_argument("--ctx", type=int, default=None,
                    help="static cache size in tokens (default: min(model context, 2048)); attention "
                         "reads all of it every step, so size it to the conversation")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the decode step (needs --cache static; warm-up is printed)")
    return ap.parse_args(argv)


def warm_up(chat: Chat):
    """Compile before the user types: one throwaway decode step through the real cache."""
    t0 = time.perf_counter()
    print("compiling the decode step ...", file=sys.stderr, flush=True)
    chat.model.compile_decode()
    list(M.generate_cached(chat.model, [0], M.SamplingParams(max_new_tokens=2), cache=chat.cache))
    chat.cache.crop(0)
    print(f"compiled in {time.perf_counter() - t0:.1f} s (cached on disk for the next run)", file=sys.stderr)


def interactive(chat: Chat):
    try:
        import readline   # noqa: F401 — line editing and ↑ history for input()
        history = checkpoint.cache_root() / "chat_history"
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
    except (ImportError, OSError):
        history = None
    print("chat: /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                break
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                chat.reset()
                print("[conversation cleared]", file=sys.stderr)
                continue
            try:
                stats = chat.turn(line)
            except M.ContextOverflow as e:
                print(f"[context full: {e}]", file=sys.stderr)
                continue
            print(stats_line(stats, len(chat.ids), M.context_limit(chat.model, chat.cache)), file=sys.stderr)
    finally:
        if history is not None:
            readline.write_history_file(history)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        params = M.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  seed=args.seed, max_new_tokens=args.max_new_tokens)
        t0 = time.perf_counter()
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        model, tok = M.load(args.model, args.device, None if args.dtype == "auto" else args.dtype)
        w = model.embed_tokens.weight
        n_params = sum(p.numel() for p in model.parameters())
        print(f"loaded in {time.perf_counter() - t0:.1f} s: {n_params / 1e6:.0f}M parameters, "
              f"{str(w.dtype).removeprefix('torch.')}, {w.device}", file=sys.stderr)
        raw = args.raw or tok.chat_template is None
        if args.compile and args.cache != "static":
            raise ValueError("--compile needs --cache static (fixed shapes compile once)")
        ctx = args.ctx or min(model.config.max_seq_len, 2048)
        chat = Chat(model, tok, params, args.decoder, raw, args.system, args.cache, ctx)
        if args.compile:
            warm_up(chat)
        if args.prompt is None:
            interactive(chat)
            return 0
        stats = chat.turn(args.prompt)
        print(stats_line(stats, len(chat.ids), M.context_limit(model, chat.cache)), file=sys.stderr)
        return 0
    except (ValueError, OSError) as e:
        # Every expected failure (bad weights, bad flags, context overflow) is one line.
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # Ctrl-C while loading or converting
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
