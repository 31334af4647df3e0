"""`python bench.py soak`: server.py under a long mixed load, for leaks and drift. N requests
(1,000 by default) from C concurrent clients: most stream a short chat answer to its end, 10%
leave mid-stream, and 10% ask for a non-streamed answer and leave before it is ready (a raw
socket closed: only the ASGI disconnect tells the server). Reported: the server's RSS at the
start and the end, the KV blocks and running requests left at the end (both must be 0), the
p95 latency of the first and the last 100 completed requests (drift), and any error."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

import checkpoint
import results
from bench.common import QUESTIONS, free_port, model_dir, start_server


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric(text: str, name: str) -> float:
    return next(float(x.split()[1]) for x in text.splitlines() if x.startswith(name + " "))


async def leave_unstreamed(port: int, body: dict, after_s: float):
    """A non-streamed request whose client closes its socket after ``after_s``."""
    data = json.dumps(body).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    await asyncio.sleep(after_s)
    writer.close()


async def soak_load(port: int, n: int, concurrency: int, max_tokens: int) -> dict:
    import httpx
    url, latencies, errors, kinds = f"http://127.0.0.1:{port}", [], [], {"full": 0, "left": 0, "unstreamed": 0}
    todo = iter(range(n))

    async def client(c: httpx.AsyncClient):
        for i in todo:
            kind = "left" if i % 10 == 3 else "unstreamed" if i % 10 == 7 else "full"
            kinds[kind] += 1
            body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": kind != "unstreamed"}
            if kind == "unstreamed":
                await leave_unstreamed(port, {**body, "max_tokens": 4 * max_tokens}, 0.3)
                continue
            t0, chunks = time.perf_counter(), 0
            try:
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if line.startswith('data: {"error"'):
                            errors.append(line[:200])
                        chunks += line.startswith("data: {")
                        if kind == "left" and chunks == 3:
                            break               # leaving the block closes the connection
                if kind == "full":
                    latencies.append(time.perf_counter() - t0)
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
    return {"latencies": latencies, "errors": errors, "kinds": kinds}


def bench_soak(args):
    path = model_dir(args.model)
    log = checkpoint.cache_root() / "bench" / "soak-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_server([sys.executable, "server.py", "--model", str(path), "--port", str(port)], port, log)
    import httpx
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(soak_load(port, 8, 4, 4))                       # warm-up: every kernel's first call
        start_rss, t0 = rss_mb(proc.pid), time.perf_counter()
        out = asyncio.run(soak_load(port, args.requests, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t0
        deadline = time.time() + 30
        while True:                                                 # the last leavers are noticed
            text = httpx.get(url + "/metrics").text
            left = metric(text, "nanoinfer_kv_blocks_used"), metric(text, "nanoinfer_requests_running")
            if left == (0, 0) or time.time() > deadline:
                break
            time.sleep(0.2)
        end_rss = rss_mb(proc.pid)
        cancelled = metric(text, 'nanoinfer_requests_finished_total{reason="cancelled"}')
    finally:
        proc.terminate()
        proc.wait(60)
    lat = out["latencies"]
    p95 = lambda xs: float(np.percentile(xs, 95)) * 1000 if xs else float("nan")
    kinds = out["kinds"]
    table = results.Table(
        f"server.py soaked: {args.requests} chat requests from {args.concurrency} concurrent clients, at most "
        f"{args.max_tokens} tokens each, temperature 0.7 (a seed per request); {kinds['left']} leave mid-stream, "
        f"{kinds['unstreamed']} ask for a non-streamed answer and close their socket after 0.3 s",
        ["requests", "completed", "left mid-stream", "left unstreamed", "errors", "wall s", "RSS start MB",
         "RSS end MB", "KV blocks used at the end", "running at the end", "cancelled (server's count)",
         "p95 latency, first 100 ms", "p95 latency, last 100 ms"],
        [[args.requests, len(lat), kinds["left"], kinds["unstreamed"], len(out["errors"]), f"{wall:.0f}",
          f"{start_rss:.0f}", f"{end_rss:.0f}", f"{left[0]:.0f}", f"{left[1]:.0f}", f"{cancelled:.0f}",
          f"{p95(lat[:100]):.0f}", f"{p95(lat[-100:]):.0f}"]])
    table.notes = out["errors"][:5]
    print(f"\n{table.markdown()}")
    print(f"saved {results.save('soak', 'engine', [table])}")


def soak_args(ap):
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
