"""Helpers the benchmarks share: the repository root, the handbook and its questions, the chat
prompts, model directories (and the random TinyLlama-shaped checkpoint), measuring configurations
in turn, free memory, and starting a server process."""

from __future__ import annotations

import random
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

import checkpoint
from model import Llama, save_random_checkpoint


ROOT = Path(__file__).resolve().parents[1]   # the repository
HANDBOOK = (ROOT / "data" / "handbook.txt").read_text().strip()   # a document to ask questions about
QUESTIONS = [
    "How heavy is an empty cart?", "When does the harvest season start?",
    "What happens if the green button is pressed twice quickly?", "How are the lidar domes cleaned?",
    "What should the technician do when hail starts?", "How often is the crate latch greased?",
    "What is the record number of crates in one day?", "When must the map be recorded again?",
]
RANDOM_TINYLLAMA = "tinyllama-random"


def model_dir(name: str):
    """`tinyllama-random` is TinyLlama-1.1B's exact shape with random bf16 weights, built once."""
    if name == RANDOM_TINYLLAMA:
        path = checkpoint.cache_root() / RANDOM_TINYLLAMA
        if not (path / "model.safetensors").is_file():
            print(f"writing {path} (2.2 GB of random weights, once)")
            save_random_checkpoint(checkpoint.TINYLLAMA_CONFIG, path)
        return path
    return checkpoint.resolve(name)


# Seconds each turn of a side-by-side bench waits first: the previous configuration's threads (llama.cpp's
# spin after a request, OpenMP's after ours) stop competing for the two cores before the next one is timed.
SETTLE_S = 0.3


def measure_in_turn(fns: dict, reps: int) -> dict:
    """{name: fn(warmup) -> (ttft_s, decode_s)} -> {name: (median ttft, median decode)}: one warm-up each,
    then ``reps`` rounds in which every fn runs once in turn, so a drift of the machine's speed over the
    minutes of a run (±15-30% here) falls on every row alike instead of on whichever ran last."""
    for fn in fns.values():
        fn(warmup=True)
    runs = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            time.sleep(SETTLE_S)
            runs[name].append(fn(warmup=False))
    return {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
            for name, rs in runs.items()}


def memory_available() -> int:
    """Bytes Linux could still hand out (MemAvailable: free plus reclaimable cache); unbounded elsewhere."""
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 1 << 62
    return int(line.split()[1]) * 1024


def long_system_prompt() -> str:
    """The handbook of kvcache.py's prefix demo, plus two weeks of reports: ~1,150 tokens."""
    rng = random.Random(0)
    orchards = ["Beaulieu", "Les Vergers", "Montfort", "La Clairière", "Saint-Aubin"]
    log = "\n".join(f"Day {d} ({rng.choice(orchards)}): {rng.randint(300, 1800)} crates, {rng.randint(4, 12)} "
                    f"carts, {rng.randint(0, 3)} red cards, {rng.randint(0, 2)} emergency stops."
                    for d in range(1, 16))
    return ("You are a helpful assistant. Answer from the handbook below in one short sentence.\n\n"
            f"{HANDBOOK}\n\nAppendix: the daily reports of last season.\n{log}")


def run_setup(name: str, model: Llama) -> str:
    """What a table's and a plot's title say the numbers ran on."""
    threads = torch.get_num_threads()
    return (f"{name}, {str(model.dtype).removeprefix('torch.')}, "
            f"{threads} thread{'s' if threads > 1 else ''}")


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


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(cmd: list[str], port: int, log: Path, timeout: float = 600):
    """Start a server process (its output to ``log``) and wait until /health answers."""
    import httpx
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise OSError(f"{cmd[0]} exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise OSError(f"{cmd[0]} did not answer /health within {timeout:.0f} s: see {log}")


@contextmanager
def running(cmd: list[str], log: Path) -> Iterator[str]:
    """A server, ``cmd`` on a free ``--port``, started as start_server starts it and stopped when the
    block ends: its URL."""
    port = free_port()
    proc = start_server(cmd + ["--port", str(port)], port, log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(60)
