"""`python bench.py serve`: server.py against llama-server, 1-32 streaming clients: tok/s, TTFT
and the gaps between tokens."""

from __future__ import annotations

import statistics
import subprocess
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
from bench.common import CHAT_PROMPTS, HANDBOOK, QUESTIONS, ROOT, model_dir, running
from bench.peers import completion_rate, llama_cpp_tool, llama_server_binary, llama_server_command


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
    own = bundled_gguf_of(args.model)
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
        with running(cmd, log) as url:
            asyncio.run(serve_load(url, 2, serve_requests(2), 8, 5))        # warm-up: first calls of every kernel
            for c in args.concurrency:
                r = asyncio.run(serve_load(url, c, serve_requests(16), args.max_tokens, args.seconds))
                rows.append({"server": name, **r})
                print(f"  {name}, {c:2} clients: {r['tok_s']:6.1f} tok/s, TTFT p50/p95 {r['ttft_p50']:.0f}/"
                      f"{r['ttft_p95']:.0f} ms, ITL p50/p95 {r['itl_p50']:.0f}/{r['itl_p95']:.0f} ms", flush=True)
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
    tables = [table] + ([] if args.no_runner else [single_stream(args, ours, log_dir)])
    print("\n" + "\n\n".join(t.markdown() for t in tables))
    plot = plot_serve(rows, args.model)
    print(f"saved {results.save('serve', 'engine', tables, plots=[plot] if plot else [])}")


def bundled_gguf_of(model: str) -> Path | None:
    """The GGUF a user downloads for ``model`` where it is the bundled one (its peers' file)."""
    return checkpoint.bundled_gguf(*checkpoint.BUNDLED[1:]) if model == checkpoint.DEFAULT_MODEL else None


def stream_rate(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One streamed greedy chat answer: decode tok/s from its first token to its last, and its
    tokens (one SSE chunk each)."""
    import httpx
    body = {"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan"), len(times)


def single_stream(args, ours: list[str], log_dir: Path) -> results.Table:
    """One client through server.py against the runner (serve_local.py, its plan, compiled step
    built first) on the same prompts in the same run, prompt by prompt alternating: decode tok/s
    from first token to last, each prompt's median over the rounds. Beside them, where the bundled
    GGUF's peers are built, llama.cpp's own pair on the same prompts: llama-server through the same
    client against llama-completion, its command-line runner. What a token costs between an
    engine and a client over HTTP (the server's event loop, the loopback socket, the client's
    wake-up) shows in both ratios alike."""
    from bench.runner import RunnerSession
    subprocess.run([sys.executable, "serve_local.py", "--model", args.model, "--compile-only"], cwd=ROOT,
                   check=True, capture_output=True)       # the runner's compiled step, built once
    own, server_bin = bundled_gguf_of(args.model), llama_server_binary()
    cli = llama_cpp_tool("llama-completion")
    peers = own is not None and server_bin is not None and not args.no_peer
    if peers and cli is None:
        print("no llama-completion beside llama-server: scripts/build_llama_server.sh builds it; the single "
              "stream without llama.cpp's pair")
    pair = peers and cli is not None
    threads = torch.get_num_threads()
    runner = RunnerSession(["--model", args.model], args.max_tokens)
    try:
        with running(ours, log_dir / "server-single.log") as url:
            rates = alternating(url, lambda p: runner.ask(p)["tok_s"], args.single_rounds, args.max_tokens)
    finally:
        runner.close()
    theirs = {p: ([], []) for p in rates}
    if pair:
        with running(llama_server_command(server_bin, own, threads, 1, 4096),
                     log_dir / "llama-server-single.log") as url:
            theirs = alternating(url, lambda p: completion_rate(cli, own, p, threads, args.max_tokens),
                                 args.single_rounds, args.max_tokens)
    return single_stream_table({p: rates[p] + theirs[p] for p in rates}, args.single_rounds, args.max_tokens,
                               own.name if pair else None)


def alternating(url: str, runner_rate, rounds: int, max_tokens: int) -> dict[str, tuple[list, list]]:
    """Each chat prompt streamed from the server at ``url``, then asked of its command-line runner
    (runner_rate(prompt): decode tok/s), in turn, ``rounds`` times after a warm-up answer: each
    prompt's (server rates, runner rates)."""
    rates = {p: ([], []) for p in CHAT_PROMPTS}
    stream_rate(url, CHAT_PROMPTS[0], 8)                   # warm-up
    for _ in range(rounds):
        for p in CHAT_PROMPTS:
            rates[p][0].append(stream_rate(url, p, max_tokens)[0])
            rates[p][1].append(runner_rate(p))
    return rates


def single_stream_table(rates: dict[str, tuple[list, ...]], rounds: int, max_tokens: int,
                        peer: str | None) -> results.Table:
    """The single-stream table from each prompt's rates (server.py, serve_local.py, and with
    ``peer``, the GGUF llama.cpp's pair ran: llama-server, llama-completion): per prompt the
    medians and their ratio, and in the notes each ratio's median and spread."""
    med = statistics.median
    columns = ["prompt", "server.py tok/s", "serve_local.py tok/s", "ratio"]
    if peer:
        columns += ["llama-server tok/s", "llama-completion tok/s", "its ratio"]
    rows, ratios, theirs = [], [], []
    for p, (s, r, ls, lc) in rates.items():
        ratios.append(med(s) / med(r))
        row = [p[:40], f"{med(s):.1f}", f"{med(r):.1f}", f"{ratios[-1]:.2f}"]
        if peer:
            theirs.append(med(ls) / med(lc))
            row += [f"{med(ls):.1f}", f"{med(lc):.1f}", f"{theirs[-1]:.2f}"]
        rows.append(row)
    table = results.Table(
        f"One streaming client: server.py against the runner (serve_local.py, its plan) on the same {len(rates)} "
        f"prompts, alternating, {rounds} rounds; greedy, at most {max_tokens} tokens, stopping at EOS; decode tok/s "
        f"from the first token to the last (the runners: their own timings), each prompt's median"
        + (f"; llama.cpp's pair likewise on {peer}" if peer else ""), columns, rows)
    table.notes = [f"server.py over serve_local.py: median {med(ratios):.2f}×, from {min(ratios):.2f}× to "
                   f"{max(ratios):.2f}×"]
    if peer:
        table.notes.append(f"llama-server over llama-completion: median {med(theirs):.2f}×, from {min(theirs):.2f}× "
                           f"to {max(theirs):.2f}×")
    return table


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
    p.add_argument("--no-runner", action="store_true", help="without the single stream against serve_local.py")
    p.add_argument("--single-rounds", type=int, default=3, help="rounds of the single-stream comparison")
    p.add_argument("--max-tokens", type=int, default=128)
