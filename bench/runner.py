"""`python bench.py runner`: serve_local.py as users run it, against llama.cpp's defaults.

Serve_local.py as a user runs it, one process per configuration with
the prompts typed into its chat (/reset between them): the plan (defaults),
plain decoding compiled and eager, and the fastest flags; then
llama.cpp's defaults (llama-server) on the very GGUF the runner loads. Greedy,
8 chat prompts and a summarise prompt, answers stopping at EOS: time until the
chat is ready, load and compile time, TTFT, decode tok/s per prompt, whether
each text equals plain decoding's, and the runner's printed speedup estimate
against the measured one.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time

import torch

import checkpoint
import kernels
import results
import drafting
from bench.common import CHAT_PROMPTS, HANDBOOK, ROOT, SETTLE_S
from bench.peers import LlamaServerSession, llama_server_binary


STATS = re.compile(r"\[prompt (\d+) tok.*?generated (\d+) tok, ([\d.]+) tok/s \| first token (\d+) ms")
ESTIMATE = re.compile(r"~([\d.]+)x plain decoding")


class RunnerSession:
    """One `python serve_local.py FLAGS` process with its stdin a pipe: a user typing
    prompts, /reset between them (one process per configuration, as a user keeps one
    chat open). The answer of a turn is on stdout, its stats line on stderr; the runner
    writes and flushes the answer before the stats line, so once that line arrives the
    whole answer already sits in the stdout pipe and a non-blocking read takes it."""

    def __init__(self, flags: list[str], max_new_tokens: int, timeout: float = 900, env: dict | None = None):
        self.t0, self.timeout = time.perf_counter(), timeout
        self.proc = subprocess.Popen([sys.executable, "serve_local.py", "--temperature", "0", "--max-new-tokens",
                                      str(max_new_tokens), *flags], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for f in (self.proc.stdout, self.proc.stderr):
            os.set_blocking(f.fileno(), False)
        self.err, self.log = b"", []
        self.loaded_s = self.compile_s = None
        lines = self.until(lambda line: line.startswith("chat:"))     # ready for the first line
        self.ready_s = time.perf_counter() - self.t0
        for line in lines:
            if m := re.match(r"loaded in ([\d.]+) s", line):
                self.loaded_s = float(m.group(1))
            if m := re.search(r"compiled in ([\d.]+) s|loaded from cache in ([\d.]+) s", line):
                self.compile_s = float(m.group(1) or m.group(2))

    def read(self, f) -> bytes:
        chunks = []
        while True:
            try:
                b = os.read(f.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)

    def until(self, done) -> list[str]:
        """stderr lines up to and including the first for which done(line) holds."""
        import select
        seen, deadline = [], time.perf_counter() + self.timeout
        while time.perf_counter() < deadline:
            select.select([self.proc.stderr], [], [], 1.0)
            self.err += self.read(self.proc.stderr)
            while b"\n" in self.err:
                line, self.err = self.err.split(b"\n", 1)
                # what a terminal shows of it: a progress bar's last state
                text = line.decode(errors="replace").rsplit("\r", 1)[-1]
                seen.append(text)
                self.log.append(text)
                if done(text):
                    return seen
            if self.proc.poll() is not None and not self.err:
                raise OSError("serve_local.py exited: " + " | ".join(self.log[-5:]))
        self.proc.kill()
        raise OSError(f"serve_local.py gave no answer within {self.timeout:.0f} s: " + " | ".join(self.log[-5:]))

    def ask(self, prompt: str) -> dict:
        self.read(self.proc.stdout)
        self.proc.stdin.write(prompt.encode() + b"\n/reset\n")
        self.proc.stdin.flush()
        lines = self.until(lambda line: STATS.search(line) is not None)
        text = self.read(self.proc.stdout).decode(errors="replace").strip()
        m = STATS.search(lines[-1])
        self.until(lambda line: "[conversation cleared]" in line)
        estimate = [float(e.group(1)) for line in self.log[-4:] if (e := ESTIMATE.search(line))]
        return {"prompt_tokens": int(m.group(1)), "new_tokens": int(m.group(2)), "tok_s": float(m.group(3)),
                "ttft_ms": float(m.group(4)), "text": text, "estimate": estimate[-1] if estimate else None}

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(60)


def per_prompt(answers: list[dict]) -> dict:
    """One prompt's answers over the rounds as one: the median speed, TTFT and estimate; the first text
    (greedy: every round gives it, else "texts differ between rounds" shows in the text column)."""
    first, med = answers[0], statistics.median
    estimates = [a["estimate"] for a in answers if a["estimate"] is not None]
    same = all(a["text"] == first["text"] for a in answers)
    return first | {"tok_s": med(a["tok_s"] for a in answers), "ttft_ms": med(a["ttft_ms"] for a in answers),
                    "estimate": med(estimates) if estimates else None,
                    "text": first["text"] if same else "texts differ between rounds"}


# The exactness reference: plain greedy decoding, eager, of the file's weights in fp32 (a GGUF's
# widened: --weights float), not the plan's layouts compared with themselves
PLAIN = "--cache dynamic --no-speculation --dtype fp32 --weights float"
COMPILED = "--compile --no-speculation"         # plain greedy decoding, the compiled step on a static cache


def runner_configs(fastest: list[str]) -> list[tuple[str, list[str]]]:
    """(name, flags): the plan, plain decoding compiled and eager (every text is compared with the
    eager one), the fastest flags."""
    return [("serve_local.py (defaults: the plan)", []),
            (f"serve_local.py {COMPILED}", COMPILED.split()),
            (f"serve_local.py {PLAIN}", PLAIN.split()),
            ("serve_local.py " + " ".join(fastest), fastest)]


def bench_runner(args):
    """The runner as a user runs it, each configuration in its own process, and llama.cpp's
    defaults on the very GGUF the runner loads, in the same run."""
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if hint := kernels.busy_machine_hint():
        print(hint)
    prompts = CHAT_PROMPTS[:args.prompts] + [" ".join((drafting.SUMMARISE + HANDBOOK).split())]
    threads = torch.get_num_threads()
    fastest = args.fastest.split()
    if args.model != checkpoint.DEFAULT_MODEL:
        args.flags = f"--model {args.model} {args.flags}"
    notes = []
    for label, flags in (("the defaults", []), ("the fastest flags", fastest)):   # build the compiled steps once
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "serve_local.py", "--compile-only", *flags, *args.flags.split()],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"serve_local.py --compile-only {' '.join(flags)}: {done.stderr.strip()[-300:]}")
        notes.append(f"before the runs below, `serve_local.py --compile-only` with {label}: {time.perf_counter() - t0:.1f}"
                     f" s (a chat's first start runs it in the background and answers on the eager step meanwhile)")
    notes.append("the rows below start as a user's next start does: the compiled steps load from disk; every "
                 "configuration is open at once and answers each prompt in turn, each prompt starting with the next one "
                 "(this machine's speed drifts from minute to minute: each sees the same windows)")
    sessions = {}
    try:
        for name, flags in runner_configs(fastest):
            print(f"starting {name} ...", flush=True)
            sessions[name] = RunnerSession([*flags, *args.flags.split()], args.max_new_tokens)
        gguf = checkpoint.bundled_gguf(*checkpoint.BUNDLED[1:]) if args.model == checkpoint.DEFAULT_MODEL else None
        if gguf is not None and llama_server_binary() is not None and not args.no_peer:
            print("starting llama.cpp (llama-server, defaults) ...", flush=True)
            peer = sessions[f"llama.cpp defaults ({gguf.name})"] = LlamaServerSession(gguf, args.max_new_tokens, threads)
            peer.ask(prompts[0])                            # its first answer warms it up and is dropped
        elif not args.no_peer:
            print("no llama-server: build it with scripts/build_llama_server.sh (or set LLAMA_SERVER); ours alone")
        asked = {name: [[] for _ in prompts] for name in sessions}      # each prompt's answers, one per round
        names = list(sessions)
        for r in range(args.rounds):
            for i, p in enumerate(prompts):
                print(f"round {r + 1}/{args.rounds}, prompt {i + 1}/{len(prompts)} ...", flush=True)
                # Each prompt starts one configuration further on, and each turn waits SETTLE_S: the configuration
                # that always came right after llama.cpp's turn measured 7% and 11% slower than its twin (the
                # same flags) in two runs.
                for name in names[(i + r) % len(names):] + names[:(i + r) % len(names)]:
                    time.sleep(SETTLE_S)
                    asked[name][i].append(sessions[name].ask(p))
        runs = {name: {"ready_s": s.ready_s, "loaded_s": s.loaded_s, "compile_s": s.compile_s,
                       "answers": [per_prompt(a) for a in asked[name]]} for name, s in sessions.items()}
    finally:
        for session in sessions.values():
            session.close()
    plain = runs[f"serve_local.py {PLAIN}"]["answers"]
    peer = next((r for n, r in runs.items() if n.startswith("llama.cpp")), None)
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    rows = []
    for name, r in runs.items():
        a = r["answers"]
        speed = [x["tok_s"] for x in a]
        same = sum(x["text"] == p["text"] for x, p in zip(a, plain))
        vs = f"{med(speed) / med([x['tok_s'] for x in peer['answers']]):.2f}×" if peer else "-"
        rows.append([name, f"{r['ready_s']:.1f}", "-" if r["loaded_s"] is None else f"{r['loaded_s']:.1f}",
                     "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
                     f"{med([x['ttft_ms'] for x in a]):.0f}", f"{min(speed):.1f}–{max(speed):.1f}",
                     f"{med(speed):.1f}", vs, f"{med([x['new_tokens'] for x in a]):.0f}",
                     "-" if name.startswith("llama.cpp") else f"{same}/{len(a)}"])
        # the runner's estimate is against its own plain step: compiled for --compile, else eager
        base = runs[f"serve_local.py {COMPILED}"]["answers"] if "--compile" in name else plain
        est = [(x["estimate"], x["tok_s"] / p["tok_s"]) for x, p in zip(a, base) if x["estimate"]]
        if est:
            notes.append(f"{name}: the runner's printed speedup estimate, median {med([e for e, _ in est]):.2f}×, "
                         f"against the measured ratio to plain decoding {'compiled' if base is not plain else 'eager'}"
                         f" on the same prompts, median "
                         f"{med([m for _, m in est]):.2f}× (per prompt, estimate/measured: "
                         + ", ".join(f"{e / m:.2f}" for e, m in est) + ")")
    table = results.Table(
        f"{args.model}: serve_local.py as a user runs it (one process per configuration, prompts typed into "
        f"its chat, /reset between them) and llama.cpp's defaults (llama-server) on the same GGUF; {len(prompts)} "
        f"prompts ({args.prompts} chat + summarise-this-text), each asked {args.rounds}x (per prompt: the median "
        f"of its rounds), greedy, answers stop at EOS (at most {args.max_new_tokens} tokens), {threads} threads each",
        ["configuration", "ready s", "load s", "compile s", "TTFT ms (median)", "decode tok/s (spread)",
         "decode tok/s (median)", "× llama.cpp", "tokens (median)", "text = fp32 plain eager"], rows, notes)
    print(f"\n{table.markdown()}")
    print(f"saved {results.save(f'runner-{results.cpu_kind()}', 'runner', [table])}")


def runner_args(p):
    """The flags of `python bench.py runner`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--prompts", type=int, default=8, help="chat prompts (at most 8), then the summarise prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--fastest", default="--cache static --compile --draft bundled --prompt-lookup 3",
                   help="the third configuration's flags")
    p.add_argument("--flags", default="", help="flags added to every configuration (e.g. --model)")
    p.add_argument("--no-peer", action="store_true", help="our runner alone (no llama-server)")
    p.add_argument("--rounds", type=int, default=2, help="times each prompt is asked (per prompt: the median): one "
                   "run's twin configurations differed by 10%% with one round")
