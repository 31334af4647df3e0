"""`python bench.py gguf [FILE...]`: the runner against llama-server on the same GGUF files.

For each file, in one run, our runner (serve_local.py as a user starts it: its command line only)
and llama-server with its defaults, each in its own process:

* first start: from launching `serve_local.py --model FILE` until its chat is ready, with an
  empty cache folder (XDG_CACHE_HOME), so the conversion is really done; then the compiled step
  is built once (`--compile-only`, what a first chat does in the background) and what the runner
  left in that folder is its cache on disk; llama-server's load: until /health answers;
* a second start of ours (a user's next: the cache warm) and llama-server, side by side, answering
  in turn: the time to the first token of a ~500-token prompt (counted by the file's own
  tokenizer), decode tok/s on chat answers of a fixed length (both greedy), and each process's peak
  resident memory (VmHWM) once it has answered;
* the ratios the acceptance reads: cache / file, RSS / (file + KV), decode and TTFT over
  llama-server's.

Without files it writes its own, once, under ~/.cache/nanoinfer/bench-gguf/: random weights in
TinyLlama-1.1B's shape and a 3B Llama's, F16 GGUFs written tensor by tensor from a seeded
generator (the model is never whole in memory), with SmolLM2's byte-level BPE vocabulary (the
bundled model's) so that both sides tokenize English; llama-quantize, built beside llama-server by
scripts/build_llama_server.sh, makes the Q4_K_M and Q8_0 files from them (--types: the other
formats people run, as llama-quantize writes them).

The record: results/gguf-<cpu>.json for the acceptance's files (no FILE, --shapes or --types), and
results/gguf-<cpu>-formats.json for any other choice, so that a run on other files never
replaces the acceptance's record.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import checkpoint
import gguf_hf
import kernels
import results
import safetensors_io
import tokenizer
from bench.common import CHAT_PROMPTS, HANDBOOK, ROOT, SETTLE_S
from bench.peers import LlamaServerSession, llama_cpp_tool, llama_server_binary
from bench.runner import RunnerSession
from kvcache import kv_bytes_per_token
from model import LlamaConfig


# config.json fields of the shapes the bench writes; the vocabulary's size comes with the vocabulary
SHAPES = {
    "tinyllama": {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "intermediate_size": 5632,
                  "max_position_embeddings": 2048},
    "3b": {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "intermediate_size": 8192, "max_position_embeddings": 4096},
}
TYPES = ["Q4_K_M", "Q8_0", "F16", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_K_M", "Q6_K", "Q4_0",
         "Q5_0", "BF16"]
# The files the acceptance reads, when neither files nor --shapes/--types are given
DEFAULT_FILES = [("tinyllama", "Q4_K_M"), ("tinyllama", "Q8_0"), ("tinyllama", "F16"),
                 ("3b", "Q4_K_M")]
# What each ratio must reach: (column, the acceptance's bound, True where the ratio must stay below)
BOUNDS = [("cache", 1.1, True), ("RSS", 1.3, True), ("decode", 1.0, False), ("TTFT", 1.0, True)]
RANDOM_NOTE = "random weights: every answer runs to its token limit"


# ----------------------------------------------------------------------------
# The test files: random F16 GGUFs, quantized by llama-quantize.

def llama_config(shape: dict, vocab_size: int) -> dict:
    """config.json of a random Llama of ``shape`` (SHAPES' fields) and ``vocab_size``."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "vocab_size": vocab_size, **shape}


def random_tensors(c: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor of a Llama of config ``c``, in the order written."""
    h, m = c.hidden_size, c.intermediate_size
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out = [("token_embd.weight", (c.vocab_size, h))]
    for i in range(c.n_layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (m, h)), (f"blk.{i}.ffn_up.weight", (m, h)),
                (f"blk.{i}.ffn_down.weight", (h, m))]
    return out + [("output_norm.weight", (h,)), ("output.weight", (c.vocab_size, h))]


def random_tensor(index: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Tensor ``index`` of a random file, as a trained model's are scaled (no inf, no NaN through
    22 layers): norms 1, in float32 as llama.cpp's converter stores them; matrices normal with
    σ 0.02 in float16, drawn a slice of rows at a time so that at most 16M float32 values exist."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    rng, out = np.random.default_rng([seed, index]), np.empty(shape, np.float16)
    step = max(1, (1 << 24) // shape[1])
    for r in range(0, shape[0], step):
        rows = (min(step, shape[0] - r), shape[1])
        out[r:r + step] = rng.standard_normal(rows, dtype=np.float32) * 0.02
    return out


def write_random_gguf(path: Path, config: dict, vocab_dir: Path, seed: int = 0) -> Path:
    """An F16 GGUF of random weights: llama.* metadata from ``config`` (config.json's fields), the
    vocabulary of ``vocab_dir``, tensors streamed to the file one by one (GGUFWriter's tensor infos
    first, then each tensor's data), so memory holds one tensor, not the model."""
    import gguf
    c = LlamaConfig.from_hf(config)
    w = gguf_hf.llama_writer(c, gguf.LlamaFileType.MOSTLY_F16)
    gguf_hf.add_vocabulary(w, vocab_dir, c.vocab_size)
    specs = random_tensors(c)
    for name, shape in specs:
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".writing-{path.name}")     # an interrupted write never looks finished
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (_, shape) in enumerate(specs):
            w.write_tensor_data(random_tensor(i, shape, seed))
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return path


def quantize_gguf(src: Path, out: Path, qtype: str, tool: Path) -> Path:
    tmp = out.with_name(f".quantizing-{out.name}")
    done = subprocess.run([str(tool), str(src), str(tmp), qtype, str(torch.get_num_threads())],
                          capture_output=True, text=True)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise OSError(f"llama-quantize {src.name} {qtype} failed ({done.returncode}): {last[0]}")
    os.replace(tmp, out)
    return out


def vocabulary_dir() -> Path:
    """SmolLM2's byte-level BPE and chat template: the bundled model's directory."""
    return checkpoint.resolve(checkpoint.DEFAULT_MODEL)


def bench_files(pairs: list[tuple[str, str]], folder: Path, seed: int = 0) -> list[Path]:
    """The random test files of (shape, type) pairs under ``folder``, each written once: the F16
    file first, llama-quantize's Q4_K_M or Q8_0 from it."""
    def path(shape, qtype):
        return folder / f"random-{shape}-{qtype}.gguf"
    tool = llama_cpp_tool("llama-quantize")
    if tool is None and any(t != "F16" and not path(s, t).is_file() for s, t in pairs):
        raise OSError("no llama-quantize beside llama-server to make the quantized test "
                      "files: run scripts/build_llama_server.sh (it builds both), or give GGUF "
                      "files")
    files, vocab = [], None
    for shape, qtype in pairs:
        out, f16 = path(shape, qtype), path(shape, "F16")
        if not out.is_file() and not f16.is_file():
            vocab = vocab or vocabulary_dir()
            config = llama_config(SHAPES[shape], safetensors_io.read_config(vocab)["vocab_size"])
            print(f"writing {f16} (random weights, once) ...", flush=True)
            write_random_gguf(f16, config, vocab, seed)
        if not out.is_file():
            print(f"quantizing it to {out.name} (llama-quantize, once) ...", flush=True)
            quantize_gguf(f16, out, qtype, tool)
        files.append(out)
    return files


def check_gguf(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise OSError(f"{path}: no such file (give GGUF files, or none: the bench writes its own)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF'): give "
                             "llama.cpp's .gguf files")
    return path


# ----------------------------------------------------------------------------
# Measuring.

@dataclass
class Side:
    """One runner's numbers on one file."""
    start_s: float                  # ours: the first start (conversion); llama-server: its load
    next_start_s: float | None      # ours: a later start, the cache warm
    compile_s: float | None         # ours: `--compile-only` once (None: nothing to compile)
    cache_bytes: int | None         # ours: what the starts and the compile left in the cache folder
    peak_rss: int                   # VmHWM once it has answered
    rss: int                        # VmRSS then
    ttft_ms: list[float]            # the long prompt, once per round
    prompt_tokens: int              # the long prompt as the side's chat template made it
    tok_s: list[float]              # one per chat prompt
    new_tokens: list[int]


@dataclass
class FileRun:
    name: str
    file_bytes: int
    ctx: int                        # the context both sides hold a cache for
    kv_bytes: int                   # f16 K and V for ctx tokens: llama.cpp's default cache
    ours: Side
    peer: Side | None


def long_prompt(path: Path, tokens: int) -> str:
    """A one-line prompt (the chat reads a line) of about ``tokens`` tokens by the file's own
    tokenizer: the start of the handbook, to summarise."""
    import gguf
    with tempfile.TemporaryDirectory() as d:
        tokenizer.write_tokenizer_from_gguf(gguf.GGUFReader(path), Path(d))
        tok = tokenizer.Tokenizer.from_dir(d)
    head, words = "Summarise this text in two sentences: ", HANDBOOK.split()
    while len(tok.encode(" ".join(words), add_bos=False)) < tokens:
        words += HANDBOOK.split()

    def count(n):
        return len(tok.encode(head + " ".join(words[:n]), add_bos=False))
    lo, hi = 1, len(words)          # the fewest words that make ``tokens`` tokens
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < tokens else (lo, mid)
    return head + " ".join(words[:lo])


def process_memory(pid: int) -> tuple[int, int]:
    """(peak, current) resident bytes of a live process: VmHWM and VmRSS of /proc/PID/status."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def disk_bytes(folder: Path, skip: tuple[str, ...] = ()) -> int:
    """What ``folder`` takes on disk (du: allocated blocks), its top-level ``skip`` folders out."""
    total = 0
    for root, dirs, files in os.walk(folder):
        if Path(root) == Path(folder):
            dirs[:] = [d for d in dirs if d not in skip]
        total += sum(os.lstat(os.path.join(root, f)).st_blocks * 512 for f in files)
    return total


def runner_env(home: Path) -> dict:
    """Our runner's environment with ``home`` as its cache (XDG_CACHE_HOME) and the rest the
    user's: torch's C++ extensions stay where they were built (they follow XDG_CACHE_HOME too, and
    are no part of a model's cache), and the machine's plan calibration is copied in (a user's
    first start of a new file finds it: the start is the conversion, not a calibration)."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    plan = checkpoint.cache_root() / "plan"
    if plan.is_dir():
        shutil.copytree(plan, home / "nanoinfer" / "plan", dirs_exist_ok=True)
    return os.environ | {"XDG_CACHE_HOME": str(home),
                         "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR")
                         or str(user / "torch_extensions"),
                         "HF_HOME": os.environ.get("HF_HOME") or str(user / "huggingface")}


CONTEXT = re.compile(r"context \d+/(\d+)")


def runner_context(session: RunnerSession) -> int | None:
    """The context our runner holds a cache for, from its last stats line."""
    found = [int(m.group(1)) for line in session.log if (m := CONTEXT.search(line))]
    return found[-1] if found else None


def side(start_s, next_start_s, compile_s, cache_bytes, memory, answers, rounds) -> Side:
    long, chat = answers[:rounds], answers[rounds:]
    return Side(start_s, next_start_s, compile_s, cache_bytes, *memory,
                [a["ttft_ms"] for a in long], long[0]["prompt_tokens"], [a["tok_s"] for a in chat],
                [a["new_tokens"] for a in chat])


def measure_file(path: Path, prompt: str, args, peer: bool) -> FileRun:
    """Ours (first start, compile, next start) and llama-server on one file: a FileRun."""
    import gguf
    c = LlamaConfig.from_hf(gguf_hf.gguf_config(gguf.GGUFReader(path)))
    runs = checkpoint.cache_root() / "bench-gguf" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix=f"{path.stem}-", dir=runs))
    env, flags = runner_env(home), ["--model", str(path), *args.flags.split()]
    cache, threads, sessions = home / "nanoinfer", torch.get_num_threads(), {}
    try:
        print(f"{path.name}: our first start, an empty cache ...", flush=True)
        first = RunnerSession(flags, args.max_new_tokens, args.timeout, env)
        first.close()           # a background compile it started stops with it
        print(f"  ready in {first.ready_s:.1f} s; compiling once (--compile-only) ...", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "serve_local.py", *flags, "--compile-only"],
                              cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode:
            raise OSError(f"serve_local.py --compile-only: {done.stderr.strip()[-300:]}")
        compile_s = None if "nothing to compile" in done.stderr else time.perf_counter() - t0
        cache_bytes = disk_bytes(cache, skip=("plan",))
        print("  our next start ...", flush=True)
        ours = sessions["ours"] = RunnerSession(flags, args.max_new_tokens, args.timeout, env)
        ours.ask(CHAT_PROMPTS[-1])          # every side's first answer warms it up and is dropped
        ctx = runner_context(ours) or c.max_seq_len
        if peer:
            print(f"  llama-server, context {ctx} ...", flush=True)
            server = LlamaServerSession(path, args.max_new_tokens, threads, ctx)
            sessions["llama-server"] = server
            server.ask(CHAT_PROMPTS[-1])
        asks = [prompt] * args.rounds + CHAT_PROMPTS[:args.prompts]
        answers, names = {name: [] for name in sessions}, list(sessions)
        for i, p in enumerate(asks):
            print(f"  prompt {i + 1}/{len(asks)} ...", flush=True)
            for name in names if i % 2 == 0 else names[::-1]:     # neither always answers second
                time.sleep(SETTLE_S)
                answers[name].append(sessions[name].ask(p))
        memory = {name: process_memory(s.proc.pid) for name, s in sessions.items()}
    finally:
        for s in sessions.values():
            try:
                s.close()
            except (OSError, subprocess.TimeoutExpired):     # it died, or hangs: no waiting
                s.proc.kill()
        if not args.keep_cache:
            shutil.rmtree(home, ignore_errors=True)
    mine = side(first.ready_s, ours.ready_s, compile_s, cache_bytes, memory["ours"],
                answers["ours"], args.rounds)
    theirs = (side(server.ready_s, None, None, None, memory["llama-server"],
                   answers["llama-server"], args.rounds) if peer else None)
    kv = int(kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, 2) * ctx)
    return FileRun(path.name, path.stat().st_size, ctx, kv, mine, theirs)


# ----------------------------------------------------------------------------
# The tables.

def ratios(r: FileRun) -> dict[str, float | None]:
    """The acceptance's four ratios for one file (None where llama-server did not run)."""
    med = statistics.median
    return {"cache": r.ours.cache_bytes / r.file_bytes,
            "RSS": r.ours.peak_rss / (r.file_bytes + r.kv_bytes),
            "decode": med(r.ours.tok_s) / med(r.peer.tok_s) if r.peer else None,
            "TTFT": med(r.ours.ttft_ms) / med(r.peer.ttft_ms) if r.peer else None}


def short_of(ratio: dict) -> str:
    """The ratios that miss their bound, or "none"."""
    missed = [name for name, bound, below in BOUNDS if ratio[name] is not None
              and (ratio[name] > bound if below else ratio[name] < bound)]
    return ", ".join(missed) or "none"


def optional(v, fmt) -> str:
    return "-" if v is None else fmt(v)


def gguf_tables(runs: list[FileRun], setup: str, notes: list[str],
                flags: str = "") -> list[results.Table]:
    """The acceptance's ratios per file, then each side's measurements; ``flags``: those added to
    our runner's command line (none: its defaults)."""
    med, mb = statistics.median, (lambda b: f"{b / 1e6:.0f}")
    ratio_rows, rows = [], []
    for r in runs:
        q = ratios(r)
        ratio_rows.append([r.name, mb(r.file_bytes), f"{mb(r.kv_bytes)} ({r.ctx})"]
                          + ["-" if q[n] is None else f"{q[n]:.2f}" for n, _, _ in BOUNDS]
                          + [short_of(q)])
        for name, s in (("serve_local.py", r.ours), ("llama-server", r.peer)):
            if s is None:
                continue
            rows.append([r.name, name, f"{s.start_s:.1f}",
                         optional(s.next_start_s, "{:.1f}".format),
                         optional(s.compile_s, "{:.0f}".format), optional(s.cache_bytes, mb),
                         mb(s.peak_rss),
                         mb(s.rss), f"{(s.peak_rss / (r.file_bytes + r.kv_bytes)):.2f}",
                         f"{med(s.ttft_ms):.0f}", s.prompt_tokens, f"{med(s.tok_s):.1f}",
                         f"{min(s.tok_s):.1f}–{max(s.tok_s):.1f}", f"{med(s.new_tokens):.0f}"])
    bounds = {n: f"{'≤' if below else '≥'} {b}" for n, b, below in BOUNDS}
    return [
        results.Table(
            f"GGUF files: serve_local.py ({f'with {flags}' if flags else 'its defaults'}) "
            f"against llama-server's "
            f"defaults on the same file, the ratios the acceptance reads; {setup}",
            ["file", "file MB", "KV MB (context)", f"our cache / file ({bounds['cache']})",
             f"our peak RSS / (file + KV) ({bounds['RSS']})",
             f"decode × llama-server ({bounds['decode']})",
             f"TTFT × llama-server ({bounds['TTFT']})",
             "short of"], ratio_rows, notes),
        results.Table(
            "each side's measurements (the ratios above come from these)",
            ["file", "runner", "first start s", "next start s", "compile s", "cache MB",
             "peak RSS MB", "RSS MB after", "peak RSS / (file + KV)", "TTFT ms (median)",
             "prompt tokens", "decode tok/s (median)", "decode tok/s (spread)", "tokens (median)"],
            rows, [])]


SHAPE_NAMES = {"tinyllama": "TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32/4 heads, MLP 5632)",
               "3b": "a 3B Llama's (hidden 3072, 28 layers, 24/8 heads, MLP 8192)"}


def setup_line(args, shapes: list[str], vocab_size: int | None) -> str:
    """What the table's title says the numbers ran on; ``shapes``: the random files' (none: the
    files were given)."""
    made = (f"random weights in {' and '.join(SHAPE_NAMES[s] for s in shapes)} with SmolLM2's "
            f"{vocab_size:,}-token vocabulary instead of 32,000, so both sides tokenize English; "
            if shapes else "")
    return (f"{made}greedy; TTFT: a {args.prompt_tokens}-token prompt (by the file's tokenizer), "
            f"asked {args.rounds}x; decode: {args.prompts} chat prompts, at most "
            f"{args.max_new_tokens} new tokens; {torch.get_num_threads()} threads each")


def bench_gguf(args):
    """Every file: ours and llama-server, measured and put side by side (module docstring)."""
    for flag in ("rounds", "prompts", "max_new_tokens", "prompt_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, flag)}")
    shapes, vocab_size = [], None
    if not args.files:
        wanted, types = args.shapes or list(SHAPES), args.types or TYPES
        for v, known in ((wanted, SHAPES), (types, TYPES)):
            if bad := [x for x in v if x not in known]:
                raise ValueError(f"unknown {', '.join(bad)}: choose from {', '.join(known)}")
        pairs = ([(s, t) for s in wanted for t in types] if args.shapes or args.types
                 else DEFAULT_FILES)
        files = bench_files(pairs, checkpoint.cache_root() / "bench-gguf")
        shapes = list(dict.fromkeys(s for s, _ in pairs))
        vocab_size = safetensors_io.read_config(vocabulary_dir())["vocab_size"]
    else:
        files = [check_gguf(Path(f)) for f in args.files]
    peer = llama_server_binary() is not None and not args.no_peer
    if not peer and not args.no_peer:
        print("no llama-server: build it with scripts/build_llama_server.sh (or set LLAMA_SERVER); "
              "ours alone")
    if hint := kernels.busy_machine_hint():
        print(hint)
    method = ([RANDOM_NOTE] if shapes else []) + [
        "ours: first start = launching `serve_local.py --model FILE` until its chat is ready, "
        "with an empty cache folder (XDG_CACHE_HOME; the machine's plan calibration copied in); "
        "then `--compile-only` once (compile s, the load included: what a first chat does in the "
        "background); cache = what both left in that folder; the rest from a next start, the "
        "cache warm",
        "llama-server: its defaults but -t/-tb (our thread count), -c (our runner's context), "
        "--jinja (the file's chat template); first start = until /health answers",
        "RSS = each process's VmHWM (peak resident set) after its answers; KV = f16 K and V for "
        "the context (llama.cpp's default cache): layers × 2 × KV heads × head dim × 2 B × context",
        "TTFT = each side's own prefill time of the long prompt (ours: the stats line's first "
        "token; llama-server: timings.prompt_ms), the prompt wrapped in the file's chat template "
        "(prompt tokens); decode = tok/s of each chat answer (llama-server: "
        "timings.predicted_per_second); the sides answer in turn, the order alternating, each "
        "after a dropped warm-up answer"]
    runs, failed = [], []

    def save(done: bool) -> tuple[Path, list[results.Table]]:
        # Saved after every file: a run stopped midway keeps what it measured, and says so.
        partial = [] if done else [f"partial: the run stopped after {len(runs)} of {len(files)} "
                                   "files"]
        tables = gguf_tables(runs, setup_line(args, shapes, vocab_size), method + failed + partial,
                             args.flags.strip())
        # a run of other files, or with flags of ours, beside the defaults' run, not over it
        chosen = ["formats"] if args.files or args.shapes or args.types else []
        name = "-".join(["gguf", results.cpu_kind(), *chosen,
                         *re.findall(r"[a-z0-9]+", args.flags.lower())])
        return results.save(name, "runner", tables), tables

    for path in files:
        prompt = long_prompt(path, args.prompt_tokens)
        try:
            runs.append(measure_file(path, prompt, args, peer))
        except (OSError, subprocess.TimeoutExpired) as e:   # the next file may still run
            print(f"{path.name}: {e}")
            failed.append(f"{path.name}: not measured: {e}")
            continue
        print(f"  {path.name}: " + ", ".join(f"{n} {'-' if v is None else f'{v:.2f}'}"
                                             for n, v in ratios(runs[-1]).items()), flush=True)
        save(done=False)
    if not runs:
        raise OSError("no file was measured: " + "; ".join(failed))
    path, tables = save(done=True)
    for t in tables:
        print(f"\n{t.title}\n\n{t.markdown()}")
    print(f"saved {path}")


def gguf_args(p):
    """The flags of `python bench.py gguf`."""
    comma = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    p.add_argument("files", nargs="*", help="GGUF files (default: random test files, written once)")
    p.add_argument("--shapes", type=comma, default=None,
                   help=f"random test files' shapes, comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--types", type=comma, default=None,
                   help=f"their types, comma-separated: {', '.join(TYPES)} (default without "
                   "--shapes/--types: TinyLlama's shape in all three, the 3B's in Q4_K_M)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="each answer's token limit")
    p.add_argument("--prompt-tokens", type=int, default=500, help="the TTFT prompt's length")
    p.add_argument("--prompts", type=int, default=3,
                   help="chat prompts timed for decode (at most 8)")
    p.add_argument("--rounds", type=int, default=1, help="times the TTFT prompt is asked (median)")
    p.add_argument("--flags", default="", help="flags added to our runner's command line")
    p.add_argument("--no-peer", action="store_true", help="our runner alone (no llama-server)")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep each file's cache folder (under ~/.cache/nanoinfer/bench-gguf/runs/)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds a start, the compile or an answer of ours may take")
