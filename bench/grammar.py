"""`python bench.py grammar`: what structured output costs. Two tables:

1. The grammar libraries on the bundled model's vocabulary (49,152 tokens): the time to read the
   tokenizer, to compile each of five JSON schemas, and to compute one token's mask while a valid
   answer is fed through (median and p95 over its tokens), for llguidance (sampling.py's) and
   xgrammar where it is installed (requirements-bench.txt).
2. server.py as users run it (its default plan), the same chat questions with a JSON schema and
   without, at 1 and 16 concurrent streaming clients, alternating: decode tok/s per stream (its
   tokens after the first over the time from the first to the last, median over requests) and
   the total output tok/s; the ratio with/without is the cost."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import statistics
import sys
import time

import numpy as np

import checkpoint
import results
from bench.common import CHAT_PROMPTS, model_dir, running

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 30},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "list": {"type": "object", "additionalProperties": False, "required": ["items"],
             "properties": {"items": {"type": "array", "maxItems": 8,
                                      "items": {"type": "string", "maxLength": 20}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["mood"],
             "properties": {"mood": {"enum": ["happy", "sad", "calm"]}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["celsius"],
                "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                               "count": {"type": "integer", "minimum": 1, "maximum": 9}}},
    # long enough to fill the bench's max_tokens, as the free answers do: both sides decode
    # the same number of tokens per request
    "answer": {"type": "object", "additionalProperties": False,
               "required": ["answer", "confidence"],
               "properties": {"answer": {"type": "string", "minLength": 400, "maxLength": 800},
                              "confidence": {"type": "number", "minimum": 0, "maximum": 1}}},
}
SAMPLES = {"person": {"name": "Ada Lovelace", "age": 36}, "list": {"items": ["milk", "eggs", "bread"]},
           "enum": {"mood": "calm"}, "numbers": {"celsius": 18.5, "count": 3},
           "answer": {"answer": "Paris is the capital of France, on the Seine. " * 10, "confidence": 0.9}}


def ms(xs, p=50) -> float:
    return float(np.percentile(xs, p)) * 1000


def llguidance_row(tokenizer_json: str, eos: list[int], answers: dict) -> list:
    import sampling
    t0 = time.perf_counter()
    vocab = sampling.grammar_vocab(tokenizer_json, eos)
    load = time.perf_counter() - t0
    compile_s, masks = [], []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        c = sampling.Constraint(vocab, sampling.grammar_text(sampling.SamplingParams(json_schema=schema)))
        compile_s.append(time.perf_counter() - t0)
        for token in answers[name]:
            t0 = time.perf_counter()
            c.matcher.compute_bitmask()           # the library's call, as xgrammar's below
            masks.append(time.perf_counter() - t0)
            c.advance(token)
    return [f"llguidance {importlib.metadata.version('llguidance')}", f"{load * 1000:.0f}", f"{ms(compile_s):.2f}",
            f"{ms(masks) * 1000:.0f}", f"{ms(masks, 95) * 1000:.0f}"]


def xgrammar_row(tokenizer_json: str, eos: list[int], answers: dict, size: int) -> list | None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    import tempfile
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(tokenizer_json)
        f.flush()
        hf = PreTrainedTokenizerFast(tokenizer_file=f.name)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=size, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    load = time.perf_counter() - t0
    compile_s, masks = [], []
    bitmask = xgrammar.allocate_token_bitmask(1, size)
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        m = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        compile_s.append(time.perf_counter() - t0)
        for token in answers[name]:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            masks.append(time.perf_counter() - t0)
            m.accept_token(token)
    return [f"xgrammar {importlib.metadata.version('xgrammar')}", f"{load * 1000:.0f}", f"{ms(compile_s):.2f}",
            f"{ms(masks) * 1000:.0f}", f"{ms(masks, 95) * 1000:.0f}"]


async def one(c, url: str, question: str, schema: dict | None, max_tokens: int) -> tuple:
    """One streamed chat request: (tokens, decode seconds from the first token to the last,
    its finish reason)."""
    body = {"model": "x", "messages": [{"role": "user", "content": question}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    stamps, finish = [], None
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise OSError(f"HTTP {r.status_code}: {(await r.aread())[:200]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                finish = choices[0].get("finish_reason") or finish
                if choices[0].get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    return len(stamps), (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0, finish


async def level(url: str, clients: int, requests: int, schema: dict | None, max_tokens: int) -> dict:
    import httpx
    rates, total, cut = [], 0, 0
    queue = list(range(requests))
    t0 = time.perf_counter()

    async def client(c):
        nonlocal total, cut
        while queue:
            i = queue.pop()
            n, s, finish = await one(c, url, CHAT_PROMPTS[i % len(CHAT_PROMPTS)], schema, max_tokens)
            total, cut = total + n, cut + (finish == "length")
            if s > 0:
                rates.append((n - 1) / s)

    async with httpx.AsyncClient(timeout=600) as c:
        await asyncio.gather(*(client(c) for _ in range(clients)))
    return {"stream": statistics.median(rates), "total": total / (time.perf_counter() - t0),
            "cut": cut / requests}


def bench_grammar(args):
    path = model_dir(args.model)
    from tokenizer import Tokenizer
    tok = Tokenizer.from_dir(path)
    eos = list(tok.eos_ids)
    answers = {name: tok.encode(json.dumps(SAMPLES[name]), add_bos=False) + eos[:1] for name in SCHEMAS}
    rows = [r for r in (llguidance_row(tok.to_json(), eos, answers),
                        xgrammar_row(tok.to_json(), eos, answers, tok.vocab_size)) if r]
    libs = results.Table(
        f"Grammar libraries on {path.name}'s vocabulary ({tok.vocab_size} tokens), one thread: five "
        "JSON schemas compiled, a valid answer to each fed through token by token",
        ["library", "read the tokenizer ms", "compile a schema ms (median)", "mask µs (median)",
         "mask µs (p95)"], rows)
    print(f"\n{libs.markdown()}")
    log = checkpoint.cache_root() / "bench" / "grammar-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    measured = {}
    with running([sys.executable, "server.py", "--model", str(path)], log) as url:
        asyncio.run(level(url, 2, 4, SCHEMAS["answer"], 8))                  # warm-up
        for _ in range(args.rounds):
            for clients, requests in ((1, args.requests), (16, 4 * args.requests)):
                for schema in (None, SCHEMAS["answer"]):
                    got = asyncio.run(level(url, clients, requests, schema, args.max_tokens))
                    for key, value in got.items():
                        measured.setdefault((clients, schema is not None, key), []).append(value)
    med = lambda k: statistics.median(measured[k])
    cost = results.Table(
        f"server.py ({path.name}, its default plan) with a JSON schema (an answer string of 400 to "
        f"800 characters and a number) and without, the same {len(CHAT_PROMPTS)} chat prompts, greedy, "
        f"at most {args.max_tokens} tokens, streamed; {args.rounds} alternating rounds (medians; "
        f"'cut' = the share of answers that reached max_tokens, so both sides decode alike)",
        ["clients", "decode tok/s per stream, free", "with the schema", "ratio",
         "total output tok/s, free", "with the schema", "ratio", "cut, free", "cut, schema"],
        [[c, f"{med((c, False, 'stream')):.1f}", f"{med((c, True, 'stream')):.1f}",
          f"{med((c, True, 'stream')) / med((c, False, 'stream')):.2f}",
          f"{med((c, False, 'total')):.1f}", f"{med((c, True, 'total')):.1f}",
          f"{med((c, True, 'total')) / med((c, False, 'total')):.2f}",
          f"{med((c, False, 'cut')):.2f}", f"{med((c, True, 'cut')):.2f}"] for c in (1, 16)])
    print(f"\n{cost.markdown()}")
    print(f"saved {results.save('grammar', 'engine', [libs, cost])}")


def grammar_args(ap):
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    ap.add_argument("--requests", type=int, default=8, help="requests per level and mode and round "
                    "(x4 at 16 clients; default: 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
