"""The peers, run beside our rows: llama.cpp (llama-cpp-python in process, or llama-server as a
process: its GGUF files, its binary, its command line, a chat session against it) and
transformers `generate`."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

import checkpoint
import gguf_hf
import kernels
import safetensors_io
from model import LlamaConfig
from bench.common import RANDOM_TINYLLAMA, free_port, start_server


def llama_cpp_files(name: str, path) -> dict[str, Path]:
    """The GGUFs llama.cpp runs for a model, by label: the bundled original, and our exports (written once)."""
    files = {}
    if checkpoint.ALIASES.get(name.lower()) == checkpoint.BUNDLED:
        files["Q4_1"] = checkpoint.bundled_gguf(*checkpoint.BUNDLED[1:])
    for fmt in ["f16"] + (["q8_0"] if name == RANDOM_TINYLLAMA else []):
        out = checkpoint.cache_root() / "bench" / f"{path.name}-{fmt}.gguf"
        if not out.is_file():
            print(f"writing {out} (once)", flush=True)
            gguf_hf.export_gguf(path, out, LlamaConfig.from_hf(safetensors_io.read_config(path)), fmt)
        files[fmt.upper()] = out
    return files


class LlamaServerDecode:
    """llama.cpp through llama-server where llama-cpp-python is not installed: the same greedy run
    (the prompt's token ids, ``new_tokens`` generated, EOS ignored), timed by the server itself.
    The server starts at the first call and joins ``servers``, which the caller stops."""

    def __init__(self, gguf: Path, threads: int, ctx: int, servers: list):
        self.gguf, self.threads, self.ctx, self.servers, self.port = gguf, threads, ctx, servers, None

    def run(self, prompt: list[int], new_tokens: int):
        def fn(warmup: bool):
            import httpx
            if self.port is None:
                self.port = free_port()
                log = checkpoint.cache_root() / "bench" / "llama-server-decode.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                command = llama_server_command(llama_server_binary(), self.gguf, self.threads, 1, self.ctx)
                self.servers.append(start_server(command + ["--port", str(self.port)], self.port, log))
            n = 8 if warmup else new_tokens
            body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
            t = httpx.post(f"http://127.0.0.1:{self.port}/completion", json=body, timeout=600).json()["timings"]
            assert t["predicted_n"] == n, t
            return t["prompt_ms"] / 1e3, (new_tokens - 1) / t["predicted_per_second"]
        return fn


def run_llama_cpp(llm, prompt, new_tokens):
    """Greedy decoding with llama.cpp's low-level loop: `eval` runs tokens through the
    model (the prompt as one batch), then we take the argmax of the last position's
    logits straight from the context. No sampler chain, and EOS never stops it."""
    import llama_cpp
    n_vocab = llm.n_vocab()

    def next_token():
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    llm.reset()                  # forget the previous run (eval drops the KV cache past n_tokens)
    t0 = time.perf_counter()
    llm.eval(prompt)
    token = next_token()
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = next_token()
    assert llm.n_tokens == len(prompt) + new_tokens - 1
    return t1 - t0, time.perf_counter() - t1


def run_transformers(hf, prompt, new_tokens):
    ids = torch.tensor([prompt], device=hf.device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    kernels.synchronize(hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw).device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    kernels.synchronize(out.device)     # a GPU runs ahead of the host: stop the clock when it is done
    total = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + new_tokens
    return ttft, max(total - ttft, 1e-9)


def llama_server_binary() -> Path | None:
    import shutil
    found = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    built = checkpoint.cache_root() / "llama-server" / "build" / "bin" / "llama-server"
    return Path(found) if found else built if built.is_file() else None


def llama_cpp_tool(name: str) -> Path | None:
    """A llama.cpp tool built beside llama-server from the same tree (scripts/build_llama_server.sh
    builds llama-quantize and llama-completion too)."""
    server = llama_server_binary()
    tool = server.parent / name if server is not None else None
    return tool if tool is not None and tool.is_file() else None


def completion_rate(binary: Path, gguf: Path, prompt: str, threads: int, max_tokens: int) -> float:
    """llama.cpp's own command-line runner, llama-completion, on one chat turn (the GGUF's template,
    greedy, stopping at EOS): its decode tok/s from its own timings. It is to llama-server what
    serve_local.py is to server.py."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", prompt, "-n", str(max_tokens),
                          "--temp", "0", "-cnv", "-st", "--jinja"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=600)
    for line in out.stderr.splitlines():
        if "prompt eval time" not in line and (m := re.search(r"eval time =.*?([\d.]+) tokens per second", line)):
            return float(m.group(1))
    last = " | ".join(out.stderr.strip().splitlines()[-3:])
    raise OSError(f"llama-completion printed no timings (exit {out.returncode}): {last}")


def llama_server_command(binary: Path, gguf: Path, threads: int, slots: int, ctx: int) -> list[str]:
    """llama-server with its defaults but for what a fair comparison fixes: our thread count, the
    parallel slots, the context, and the GGUF's own chat template (--jinja)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
            "--parallel", str(slots), "-c", str(ctx), "--jinja"]


class LlamaServerSession:
    """llama.cpp's defaults on ``gguf`` (llama-server: its own chat template, greedy, stops at EOS),
    asked as RunnerSession is; each answer's numbers are from its own timings."""

    def __init__(self, gguf: Path, max_new_tokens: int, threads: int, ctx: int = 4096):
        binary, self.port, self.max_new_tokens = llama_server_binary(), free_port(), max_new_tokens
        log = checkpoint.cache_root() / "bench" / "llama-server-runner.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.proc = start_server(llama_server_command(binary, gguf, threads, 1, ctx) + ["--port", str(self.port)],
                                 self.port, log)
        self.ready_s = time.perf_counter() - t0
        self.loaded_s = self.compile_s = None

    def ask(self, prompt: str) -> dict:
        import httpx
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": self.max_new_tokens,
                "temperature": 0, "cache_prompt": False}
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body, timeout=600).json()
        t = r["timings"]
        return {"prompt_tokens": t["prompt_n"], "new_tokens": t["predicted_n"], "tok_s": t["predicted_per_second"],
                "ttft_ms": t["prompt_ms"], "text": r["choices"][0]["message"]["content"], "estimate": None}

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)
