"""`python bench.py serve`: server.py against llama-server, 1-32 streaming clients: tok/s, TTFT
and the gaps between tokens."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

import checkpoint
import gguf_hf
import kernels
import results
import safetensors_io
from model import LlamaConfig
from bench.common import HANDBOOK, QUESTIONS, free_port, model_dir, start_server
from bench.peers import llama_server_binary, llama_server_command


def serve_requests(n: int) -> list[list[dict]]:
    """A fixed mix of chat requests: short questions alone, and questions after a shared
    ~400-token system prompt (the handbook), alternating."""
    system = "You are a helpful assistant. Answer from the handbook below in one short sentence.\n\n" + HANDBOOK
    return [[{"role": "system", "content": system}] * (i % 2) + [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            for i in range(n)]


async def serve_load(url: str, concurrency: int, requests: list, max_tokens: int, seconds: float) -> dict:
    """``concurrency`` clients, each sending requests from ``requests`` (client i starts at
    the i-th and walks the list) one after another for ``seconds``, greedy, answers stopping
    at EOS: C requests in flight all the time. When the time is up, the answers in flight are
    dropped (their clients disconnect). Per request: time to first token, the gaps between
    its tokens (one SSE chunk each); the tokens received within the time and the requests
    completed."""
    import asyncio
    import json
    import httpx
    ttft, itl, tokens, done = [], [], 0, 0
    shared = []         # TTFT of the requests that carry the shared system prompt
    end = time.perf_counter() + seconds

    async def client(c: httpx.AsyncClient, i: int):
        nonlocal tokens, done
        while True:
            messages, i = requests[i % len(requests)], i + concurrency
            body = {"model": "x", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            last, first = time.perf_counter(), True
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise OSError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]}")
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if now > end:
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if not choices[0].get("delta", {}).get("content"):
                        continue
                    (ttft if first else itl).append(now - last)
                    if first and messages[0]["role"] == "system":
                        shared.append(now - last)
                    first, last, tokens = False, now, tokens + 1
            done += 1

    # A fresh connection per request, for both servers: llama-server closes idle keep-alive
    # connections, and a request sent on one just closed fails.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        await asyncio.gather(*(client(c, i) for i in range(concurrency)))
    await asyncio.sleep(2)        # let the server notice the dropped streams before the next level
    q = lambda xs, p: float(np.percentile(xs, p)) * 1000 if xs else float("nan")
    return {"concurrency": concurrency, "requests": done, "tokens": tokens, "wall_s": seconds,
            "tok_s": tokens / seconds, "req_s": done / seconds, "ttft_p50": q(ttft, 50), "ttft_p95": q(ttft, 95),
            "itl_p50": q(itl, 50), "itl_p95": q(itl, 95), "shared_ttft_p50": q(shared, 50)}


def bench_serve(args):
    import asyncio
    if hint := kernels.busy_machine_hint():
        print(hint)
    path = model_dir(args.model)
    slots, threads = max(args.concurrency), torch.get_num_threads()
    log_dir = checkpoint.cache_root() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    # One server at a time, each stopped before the next starts: (name, command, its log)
    ours = [sys.executable, "server.py", "--model", str(path), "--max-batch", str(slots)]
    servers = [(OURS, ours, log_dir / "server.log"),
               (OURS_UNCACHED, ours + ["--no-prefix-cache"], log_dir / "server-uncached.log")]
    binary = None if args.no_peer else llama_server_binary()
    # the headline peer: llama-server on the GGUF a user downloaded, at its own bits
    own = checkpoint.bundled_gguf(*checkpoint.BUNDLED[1:]) if args.model == checkpoint.DEFAULT_MODEL else None
    if binary is None and not args.no_peer:
        print("no llama-server: build it with scripts/build_llama_server.sh (or set LLAMA_SERVER); ours alone")
    elif binary is not None and own is not None:
        # our server runs the file's own bits too: this peer is the equal-bits one as well
        servers.append((f"llama-server {own.name}", llama_server_command(binary, own, threads, slots, slots * 1024),
                        log_dir / "llama-server-own.log"))
    elif binary is not None:
        # another checkpoint: its weights at our server's bits, fp32 or bf16 where this CPU computes it natively
        dtype = "bf16" if kernels.bf16_supported(torch.device("cpu")) else "f32"
        gguf = log_dir / f"{path.name}-{dtype}.gguf"
        if not gguf.is_file():
            print(f"writing {gguf} (once)", flush=True)
            gguf_hf.export_gguf(path, gguf, LlamaConfig.from_hf(safetensors_io.read_config(path)), dtype)
        servers.append((f"llama-server {dtype.upper()}",
                        llama_server_command(binary, gguf, threads, slots, slots * 1024), log_dir / "llama-server.log"))
    rows = []
    for name, cmd, log in servers:
        port = free_port()
        proc = start_server(cmd + ["--port", str(port)], port, log)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(serve_load(url, 2, serve_requests(2), 8, 5))        # warm-up: first calls of every kernel
            for c in args.concurrency:
                r = asyncio.run(serve_load(url, c, serve_requests(16), args.max_tokens, args.seconds))
                rows.append({"server": name, **r})
                print(f"  {name}, {c:2} clients: {r['tok_s']:6.1f} tok/s, TTFT p50/p95 {r['ttft_p50']:.0f}/"
                      f"{r['ttft_p95']:.0f} ms, ITL p50/p95 {r['itl_p50']:.0f}/{r['itl_p95']:.0f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    single = {r["server"]: r["tok_s"] for r in rows if r["concurrency"] == min(args.concurrency)}
    table = results.Table(
        f"{args.model} served over HTTP, {threads} threads each, {slots} parallel slots each: C streaming clients "
        f"for {args.seconds:.0f} s, each sending chat requests from a fixed mix (half with a shared ~400-token system "
        f"prompt) one after another; greedy, answers stop at EOS (at most {args.max_tokens} tokens)",
        ["server", "clients", "requests done", "output tok/s", "× its 1 client", "req/s", "TTFT p50 ms", "TTFT p95 ms",
         "TTFT p50 ms, shared prompt", "ITL p50 ms", "ITL p95 ms"],
        [[r["server"], r["concurrency"], r["requests"], f"{r['tok_s']:.1f}",
          f"{r['tok_s'] / single[r['server']]:.2f}×", f"{r['req_s']:.2f}", f"{r['ttft_p50']:.0f}",
          f"{r['ttft_p95']:.0f}", f"{r['shared_ttft_p50']:.0f}", f"{r['itl_p50']:.0f}", f"{r['itl_p95']:.0f}"]
         for r in rows])
    table.notes = serve_notes(rows, [name for name, _, _ in servers], args.concurrency)
    print(f"\n{table.markdown()}")
    plot = plot_serve(rows, args.model)
    print(f"saved {results.save('serve', 'engine', [table], plots=[plot] if plot else [])}")


OURS, OURS_UNCACHED = "nanoinfer server.py", "nanoinfer server.py, no prefix cache"


def serve_notes(rows: list[dict], names: list[str], levels: list[int]) -> list[str]:
    """Per level: ours against each peer (tok/s, TTFT p95), and what the prefix cache buys the
    requests that share the system prompt (their TTFT p50 without it over with it)."""
    at = {(r["server"], r["concurrency"]): r for r in rows}
    notes = []
    for c in levels:
        a, plain = at[OURS, c], at[OURS_UNCACHED, c]
        line = [f"{c} clients: the prefix cache cuts the shared-prompt TTFT p50 "
                f"{plain['shared_ttft_p50'] / a['shared_ttft_p50']:.1f}×"]
        for peer in names[2:]:
            b = at[peer, c]
            line.append(f"ours {a['tok_s'] / b['tok_s']:.2f}× {peer}'s tok/s, "
                        f"TTFT p95 {a['ttft_p95'] / b['ttft_p95']:.2f}× its")
        notes.append("; ".join(line))
    return notes


def plot_serve(rows: list[dict], model: str) -> Path | None:
    plt = results.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        xs = [r["concurrency"] for r in mine]
        ax1.plot(xs, [r["tok_s"] for r in mine], "o-", label=name)
        ax2.plot(xs, [r["ttft_p95"] / 1000 for r in mine], "o-", label=name)
    for ax, label in ((ax1, "total output tokens/s"), (ax2, "time to first token, p95 (s)")):
        ax.set_xscale("log", base=2)
        results.plain_ticks(ax.xaxis)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(f"{model}: our server against llama-server, answers stopping at EOS")
    return results.save_plot(fig, "serve.png")


def serve_args(p):
    """The flags of `python bench.py serve`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--seconds", type=float, default=40, help="how long each concurrency level runs")
    p.add_argument("--no-peer", action="store_true", help="our server alone (no llama-server)")
    p.add_argument("--max-tokens", type=int, default=128)
