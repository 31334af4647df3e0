"""bench.py's tables and saved records. The cheap benchmarks run for real on a tiny
checkpoint; the slow ones (decode, batching, speculative, quantize --eval take
minutes) have their tables built from fabricated rows. Records land under
NANOINFER_RESULTS (conftest), never in the committed results/."""

import argparse
import importlib.util
import json
import sys
from collections import Counter

import pytest
import torch

import bench.batching
import bench.common
import bench.compiled
import bench.decode
import bench.gguf
import bench.kvcache
import bench.quantize_eval
import bench.runner
import bench.serve
import bench.speculative
import results
import speculative as S
from conftest import make_checkpoint, write_tiny_tokenizer

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
pytestmark = pytest.mark.usefixtures("one_thread")


def record(name: str) -> dict:
    return json.loads((results.directory() / f"{name}.json").read_text())


def test_kv_bytes_saves_its_table(tmp_path, capsys):
    bench.kvcache.bench_kv_bytes(str(make_checkpoint(tmp_path / "tiny")))
    r = record("kv-bytes")
    assert (r["name"], r["lesson"]) == ("kv-bytes", "kvcache")
    table = r["tables"][0]
    assert table["columns"] == ["layers", "KV heads", "head dim", "bytes/value", "formula B/token", "tokens",
                                "cache holds B", "formula × tokens B", "equal"]
    layers, heads, dim, size, formula, n, held, expected, equal = table["rows"][0]
    assert (layers, heads, dim) == (2, 2, 16) and formula == layers * 2 * heads * dim * size
    assert held == expected == formula * n and equal is True
    assert "| 2 | 2 | 16 |" in capsys.readouterr().out


def test_prefix_saves_its_table(tmp_path):
    ckpt = make_checkpoint(tmp_path / "tiny", max_position_embeddings=4096)   # the handbook: ~2,300 tiny-BPE tokens
    bench.kvcache.bench_prefix(str(ckpt), n_answer=1)
    r = record("prefix")
    assert (r["name"], r["lesson"]) == ("prefix", "kvcache")
    table = r["tables"][0]
    assert table["columns"] == ["strategy", "prefill tokens computed", "prefill wall time", "total wall time"]
    (plain, plain_tokens, *_), (fork, fork_tokens, *_) = table["rows"]
    assert (plain, fork) == ("re-encode the prefix", "prefill once + fork()") and fork_tokens < plain_tokens / 4
    assert table["notes"][0].endswith("identical answers: True")


def test_decode_table_and_name():
    args = argparse.Namespace(prompt_tokens=128, new_tokens=128, reps=3, dtypes=["float32"])
    table = bench.decode.decode_table([["smollm2-135m", "nanoinfer cached", "float32", 0.0514, 2490.2, 41.26, 22.3, 1.5]],
                               args)
    assert table.columns == ["model", "implementation", "dtype", "TTFT ms", "prefill tok/s", "decode tok/s", "GB/s",
                             "× transformers"]
    assert table.rows == [["smollm2-135m", "nanoinfer cached", "float32", "51", "2490", "41.3", "22.3", "1.50"]]
    assert "EOS ignored" in table.title
    assert bench.decode.decode_name(bench.decode.DECODE_MODELS, bench.decode.DECODE_DTYPES) == "decode"
    assert bench.decode.decode_name(["smollm2-135m"], ["bfloat16"]) == "decode-smollm2-135m-bfloat16"
    assert bench.decode.decode_name(["/tmp/My Model/"], ["float32", "bfloat16"]) == "decode-my-model-float32-bfloat16"


def fake_runs() -> list:
    outs = [[1, 2, 3], [4, 5]]
    return [bench.batching.RunResult("static, padded rows (batch 2)", outs, 2.0, 3, 6, [2.0, 2.0]),
            bench.batching.RunResult("continuous (max batch 2)", outs, 1.0, 3, 5, [1.0, 0.5])]


def test_batching_tables():
    table = bench.batching.batching_table(fake_runs(), "workload")
    assert table.columns == ["scheduling", "steps", "decode rows computed", "output tokens", "wall s", "tokens/s",
                             "× first row", "mean latency s"]
    assert table.rows[1] == ["continuous (max batch 2)", 3, 5, 5, "1.0", "5.0", "2.00", "0.8"]
    assert "same tokens in every run (greedy): True" in table.notes[0]
    prefix = bench.batching.prefix_cache_table([(False, 0.5, 0.4, 1200, [[7]]), (True, 0.5, 0.02, 30, [[7]])])
    assert prefix.rows == [["off", "500", "400", "1200", "1.0"], ["on", "500", "20", "30", "20.0"]]
    assert prefix.notes == ["same first tokens with and without the cache: True"]


def test_speculative_table_and_histogram():
    lookup = S.SpecStats(steps=4, proposed=8, accepted=6, emitted=10, histogram=Counter({0: 1, 2: 3}))
    rows = [{"method": "plain", "tok_s": 10.0, "speedup": 1.0, "speedups": [1.0, 1.0, 1.0], "tokens": [9, 30, 4],
             "diverged": [None] * 3, "spec": None},
            {"method": "lookup", "tok_s": 20.0, "speedup": 2.0, "speedups": [1.5, 2.0, 3.25], "tokens": [9, 30, 4],
             "diverged": [None, 12, None], "spec": lookup}]
    table = bench.speculative.table(rows, "3 chat prompts: at most 256 new tokens, answers stopping at EOS")
    assert table.columns == ["method", "decode tok/s", "speedup (median)", "spread (min–max)", "acceptance",
                             "tokens/forward", "accepted lengths", "same tokens"]
    assert table.rows == [["plain", "10.0", "1.00×", "1.00–1.00×", "", "1", "", "yes"],
                          ["lookup", "20.0", "2.00×", "1.50–3.25×", "75%", "2.50", "0:1 2:3", "2/3; others from token 12"]]
    assert table.notes[1:] == ["answer lengths (new tokens): 9 30 4",
                               "per-prompt speedups, in prompt order: lookup: 1.50 2.00 3.25"]
    path = bench.speculative.plot_accepted({"chat": rows, "summarise": rows})
    assert (path == results.plot_path("speculative_accepted.png") and path.is_file()) if HAS_MATPLOTLIB else path is None


def test_quantize_table():
    table = bench.quantize_eval.quantize_table([("full", 46080, 269e6, 10.123, 0.0, 100.0, 41.0),
                                  ("KV int8", 12000, 269e6, 10.2, 0.76, 97.25, 40.0)])
    assert table.columns == ["configuration", "KV bytes/token", "weight MB", "perplexity", "Δ ppl", "top-1 agreement",
                             "decode tok/s"]
    assert table.rows[1] == ["KV int8", "12000", "269", "10.200", "+0.76%", "97.2%", "40.0"]


def test_batching_plot_or_one_line(capsys, monkeypatch):
    if HAS_MATPLOTLIB:
        path = bench.batching.plot_batching(fake_runs(), "two runs")
        assert path == results.plot_path("batching.png") and path.stat().st_size > 1000
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # as if it were not installed
    capsys.readouterr()
    assert bench.batching.plot_batching(fake_runs(), "two runs") is None
    assert capsys.readouterr().out.count("\n") == 1


def test_engine_step_table(tmp_path):
    """Eager rows only (a compile takes minutes): one row per thread count and batch size."""
    args = argparse.Namespace(model=str(make_checkpoint(tmp_path / "tiny")), dtype="float32", batches=[1, 3],
                              compile_batches=[], threads=[1], context=40, reps=2)
    bench.compiled.bench_engine_step(args)
    r = record("engine-step")
    assert (r["name"], r["lesson"]) == ("engine-step", "engine")
    table = r["tables"][0]
    assert table["columns"][:4] == ["threads", "B", "eager ms", "compiled ms"]
    assert [row[:2] for row in table["rows"]] == [[1, 1], [1, 3]]
    assert all(float(row[2]) > 0 and row[3] == "" for row in table["rows"])


def test_long_prompts_scenario_saves_its_table(tmp_path, capsys):
    """The chunked-prefill scenario run for real on a tiny checkpoint: its table, the same
    tokens with and without chunks, and the decoders' gaps counted."""
    from nanoinfer.config import RunConfig
    from nanoinfer.load import load
    model, _ = load(RunConfig(str(make_checkpoint(tmp_path / "tiny", max_position_embeddings=4096))))
    args = argparse.Namespace(model="tiny", decoders=2, decode_tokens=12, long_prompts=2, chunks=[0, 256], max_batch=8)
    bench.batching.bench_long_prompts(model, args)
    r = record("chunked-prefill")
    assert (r["name"], r["lesson"]) == ("chunked-prefill", "engine")
    table = r["tables"][0]
    assert table["columns"][:3] == ["prefill chunk (tokens a step)", "decoders' inter-token ms: p50", "p95"]
    assert [row[0] for row in table["rows"]] == ["off (whole prompts)", 256]
    assert table["rows"][0][4] == "1.00" and table["rows"][0][-1] == "1.00"
    assert table["notes"][0].startswith("same tokens in every run (greedy): True; 22 inter-token gaps per run")
    assert "2 requests decode 12 tokens each while 2 prompts of" in table["title"]
    assert "| off (whole prompts) |" in capsys.readouterr().out


def test_runner_session_reads_each_answer_and_its_stats():
    """bench.py runner's driver: prompts typed into a real runner's chat, /reset between them. Each
    answer comes back whole and equals what `serve_local.py --prompt` prints for the same prompt."""
    import subprocess
    flags = ["--cache", "dynamic", "--no-speculation"]
    session = bench.runner.RunnerSession(flags, max_new_tokens=12, timeout=300)
    try:
        answers = [session.ask(p) for p in ("What is the capital of France?", "Name a colour.")]
    finally:
        session.close()
    assert session.loaded_s is not None and session.ready_s >= session.loaded_s
    alone = subprocess.run([sys.executable, "serve_local.py", "--prompt", "What is the capital of France?",
                            "--temperature", "0", "--max-new-tokens", "12", *flags], cwd=bench.common.ROOT,
                           capture_output=True, text=True, timeout=300)
    assert answers[0]["text"] == alone.stdout.strip() and "Paris" in answers[0]["text"]
    assert answers[1]["text"] and answers[1]["text"] != answers[0]["text"]     # /reset: a fresh conversation
    for a in answers:
        assert 0 < a["new_tokens"] <= 12 and a["tok_s"] > 0 and a["ttft_ms"] > 0 and a["estimate"] is None


def test_runner_rounds_become_one_answer_per_prompt_and_zero_rounds_is_one_line():
    """bench.py runner --rounds: a prompt's rounds give their median speed and TTFT and the first text;
    a text that changed between rounds says so (greedy answers must not); --rounds 0 is one line."""
    from conftest import run_cli
    rounds = [{"tok_s": 10.0, "ttft_ms": 5.0, "estimate": None, "text": "a", "new_tokens": 3},
              {"tok_s": 30.0, "ttft_ms": 9.0, "estimate": 0.5, "text": "a", "new_tokens": 3},
              {"tok_s": 20.0, "ttft_ms": 7.0, "estimate": 0.7, "text": "a", "new_tokens": 3}]
    assert bench.runner.per_prompt(rounds) == {"tok_s": 20.0, "ttft_ms": 7.0, "estimate": 0.6, "text": "a", "new_tokens": 3}
    assert bench.runner.per_prompt(rounds[:2] + [rounds[2] | {"text": "b"}])["text"] == "texts differ between rounds"
    rc, out, err = run_cli("bench.py", "runner", "--rounds", "0", timeout=120)
    assert rc == 1 and err.strip() == "error: --rounds must be at least 1, got 0" and out == ""


def test_gguf_random_file_reads_back_with_its_weights_and_tokenizer(tmp_path):
    """bench.py gguf's test-file writer on a tiny shape: convert_gguf reads the very f16 weights
    back (Q and K in HF's row order again), and the vocabulary tokenizes a sentence and back."""
    import gguf_hf
    import tokenizer
    from model import LlamaConfig
    from safetensors_io import read_weights
    path, config = write_tiny_random_gguf(tmp_path, seed=3)
    back = gguf_hf.convert_gguf(path, tmp_path / "cache")
    weights, c = read_weights(back), LlamaConfig.from_hf(config)
    names = {hf.format(i=i): g.format(i=i)
             for g, hf in gguf_hf.GGUF_NAMES.items() for i in range(2)}
    specs = {name: (i, shape)
             for i, (name, shape) in enumerate(bench.gguf.random_tensors(c))}
    assert len(weights) == len(specs) == 2 + 2 * 9 + 1
    for name, w in weights.items():
        i, shape = specs[names[name]]
        expected = bench.gguf.random_tensor(i, shape, seed=3)
        if name.endswith("q_proj.weight"):
            expected = gguf_hf.unpermute_rows(expected, c.n_heads)
        elif name.endswith("k_proj.weight"):
            expected = gguf_hf.unpermute_rows(expected, c.n_kv_heads)
        assert torch.equal(w, torch.from_numpy(expected.astype("float32"))), name
    assert bench.gguf.random_tensor(0, (64, 8), seed=3).dtype.name == "float16"
    assert bench.gguf.random_tensor(1, (64,), seed=3).tolist() == [1.0] * 64
    tok = tokenizer.Tokenizer.from_dir(back)
    sentence = "The quick brown fox jumps over the lazy dog."
    assert tok.decode(tok.encode(sentence, add_bos=False)) == sentence
    assert tok.chat_template and tok.eos_ids
    prompt = bench.gguf.long_prompt(path, 60)
    assert "\n" not in prompt and 60 <= len(tok.encode(prompt, add_bos=False)) < 70


def write_tiny_random_gguf(folder, seed=0):
    write_tiny_tokenizer(folder)
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256}
    config = bench.gguf.llama_config(shape, 320)
    return bench.gguf.write_random_gguf(folder / "random.gguf", config, folder, seed), config


def fake_side(start_s, cache, peak, ttft, tok_s, next_start=None, compile_s=None):
    return bench.gguf.Side(start_s, next_start, compile_s, cache, peak, peak - 10**6, ttft, 530,
                           tok_s, [64] * 3)


def test_gguf_tables_read_off_the_ratios():
    """The acceptance's four ratios per file: cache / file, peak RSS / (file + KV), decode and
    TTFT over llama-server's (medians), and the ones short of their bound; a file without
    llama-server."""
    mb = 10**6
    ours = fake_side(30.0, 1050 * mb, 1400 * mb, [90.0, 110.0], [12.0, 10.0, 11.0], 5.0, 60.0)
    ok = bench.gguf.FileRun("a-Q4_K_M.gguf", 1000 * mb, 2048, 100 * mb, ours,
                            fake_side(1.0, None, 1100 * mb, [120.0], [10.0, 9.0, 10.5]))
    bad = bench.gguf.FileRun("b-F16.gguf", 1000 * mb, 2048, 100 * mb,
                             fake_side(30.0, 4000 * mb, 5000 * mb, [300.0], [2.0, 3.0, 4.0]), None)
    assert bench.gguf.ratios(ok) == pytest.approx(
        {"cache": 1.05, "RSS": 1400 / 1100, "decode": 11 / 10, "TTFT": 100 / 120})
    ratio_table, sides = bench.gguf.gguf_tables([ok, bad], "setup", ["a note"])
    assert ratio_table.columns == [
        "file", "file MB", "KV MB (context)", "our cache / file (≤ 1.1)",
        "our peak RSS / (file + KV) (≤ 1.3)", "decode × llama-server (≥ 1.0)",
        "TTFT × llama-server (≤ 1.0)", "short of"]
    assert ratio_table.rows == [
        ["a-Q4_K_M.gguf", "1000", "100 (2048)", "1.05", "1.27", "1.10", "0.83", "none"],
        ["b-F16.gguf", "1000", "100 (2048)", "4.00", "4.55", "-", "-", "cache, RSS"]]
    assert ratio_table.notes == ["a note"] and ratio_table.title.endswith("; setup")
    assert [r[:2] for r in sides.rows] == [["a-Q4_K_M.gguf", "serve_local.py"],
                                           ["a-Q4_K_M.gguf", "llama-server"],
                                           ["b-F16.gguf", "serve_local.py"]]
    assert sides.rows[0][2:] == ["30.0", "5.0", "60", "1050", "1400", "1399", "1.27", "100", 530,
                                 "11.0", "10.0–12.0", "64"]
    assert sides.rows[1][3:6] == ["-", "-", "-"]
    missed = bench.gguf.short_of({"cache": 1.0, "RSS": 1.0, "decode": 0.9, "TTFT": 1.2})
    assert missed == "decode, TTFT"


def test_gguf_bench_saves_after_every_file(tmp_path, monkeypatch):
    """bench.py gguf on given files, the measuring faked: a record after each file says it is
    partial, the last one does not; a file that failed is a note, the others still run. Given
    files are not the acceptance's: their record is gguf-<cpu>-formats, beside the defaults'."""
    path, _ = write_tiny_random_gguf(tmp_path)
    mb, seen = 10**6, []

    def measure(p, prompt, args, peer):
        seen.append(record(f"gguf-{results.cpu_kind()}-formats")["tables"][0]["notes"][-1]
                    if seen else None)
        if len(seen) == 2:
            raise OSError("serve_local.py exited: out of memory")
        side = fake_side(3.0, 2 * mb, 5 * mb, [50.0], [10.0, 12.0])
        return bench.gguf.FileRun(p.name, 2 * mb, 256, mb, side, side)
    monkeypatch.setattr(bench.gguf, "measure_file", measure)
    ap = argparse.ArgumentParser()
    bench.gguf.gguf_args(ap)
    bench.gguf.bench_gguf(ap.parse_args([str(path)] * 3 + ["--no-peer"]))
    assert seen == [None, "partial: the run stopped after 1 of 3 files",
                    "partial: the run stopped after 1 of 3 files"]
    r = record(f"gguf-{results.cpu_kind()}-formats")
    assert (r["name"], r["lesson"]) == (f"gguf-{results.cpu_kind()}-formats", "runner")
    assert not (results.directory() / f"gguf-{results.cpu_kind()}.json").exists()
    ratio_table = r["tables"][0]
    assert [row[0] for row in ratio_table["rows"]] == ["random.gguf", "random.gguf"]
    assert ratio_table["notes"][-1] == ("random.gguf: not measured: serve_local.py exited: "
                                        "out of memory")
    assert "500-token prompt" in ratio_table["title"]


def test_gguf_without_llama_quantize_or_with_a_bad_file_is_one_line(tmp_path, monkeypatch, capsys):
    """The quantized test files need llama-quantize beside llama-server: without it, one line saying
    how to build it, before anything is written; a missing file and a non-GGUF, one line each."""
    from conftest import run_cli
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "bin" / "llama-server"))
    with pytest.raises(OSError) as e:
        bench.gguf.bench_files([("tinyllama", "Q4_K_M")], tmp_path / "files")
    assert "scripts/build_llama_server.sh" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "files").exists()
    (tmp_path / "not.gguf").write_text("hello")
    rc, out, err = run_cli("bench.py", "gguf", str(tmp_path / "missing.gguf"),
                           str(tmp_path / "not.gguf"), timeout=120)
    assert rc == 1 and out == "" and err.strip().count("\n") == 0
    assert "missing.gguf: no such file" in err
    rc, out, err = run_cli("bench.py", "gguf", str(tmp_path / "not.gguf"), timeout=120)
    assert rc == 1 and err.strip().count("\n") == 0 and "is not a GGUF file" in err


def test_serve_notes_compare_the_prefix_cache_and_each_peer():
    """bench.py serve's notes: per level, what the prefix cache buys the shared-prompt requests
    (TTFT p50 without it over with it) and ours against each llama-server."""
    serve = bench.serve
    row = lambda name, c, tok, p95, shared: {"server": name, "concurrency": c, "tok_s": tok,
                                             "ttft_p95": p95, "shared_ttft_p50": shared}
    rows = [row(serve.OURS, 4, 90.0, 300, 100), row(serve.OURS_UNCACHED, 4, 30.0, 2000, 1200),
            row("llama-server x.gguf", 4, 100.0, 250, 90)]
    names = [serve.OURS, serve.OURS_UNCACHED, "llama-server x.gguf"]
    assert serve.serve_notes(rows, names, [4]) == [
        "4 clients: the prefix cache cuts the shared-prompt TTFT p50 12.0×; "
        "ours 0.90× llama-server x.gguf's tok/s, TTFT p95 1.20× its"]


def test_llama_completion_rate_reads_its_own_timings_and_a_silent_one_is_one_line(tmp_path, monkeypatch):
    """bench.py serve's llama.cpp pair: llama-completion beside llama-server, and its decode
    tok/s read from its timing lines (the eval line, not the prompt's)."""
    import bench.peers
    binaries = tmp_path / "bin"
    binaries.mkdir()
    monkeypatch.setenv("LLAMA_SERVER", str(binaries / "llama-server"))
    assert bench.peers.llama_cpp_tool("llama-completion") is None
    tool = binaries / "llama-completion"
    tool.write_text("#!/bin/sh\necho 'the answer'\n"
                    "echo 'common_perf_print: prompt eval time =  117.87 ms /  40 tokens (  2.95 ms per "
                    "token,   339.35 tokens per second)' >&2\n"
                    "echo 'common_perf_print:        eval time =  940.03 ms /  125 runs   (  7.52 ms per "
                    "token,   132.98 tokens per second)' >&2\n")
    tool.chmod(0o755)
    assert bench.peers.llama_cpp_tool("llama-completion") == tool
    assert bench.peers.completion_rate(tool, tmp_path / "x.gguf", "Hi", 2, 8) == 132.98
    tool.write_text("#!/bin/sh\necho 'error: no such model' >&2\nexit 1\n")
    with pytest.raises(OSError) as e:
        bench.peers.completion_rate(tool, tmp_path / "x.gguf", "Hi", 2, 8)
    assert "printed no timings (exit 1): error: no such model" in str(e.value) and "\n" not in str(e.value)


def test_single_stream_table_gives_each_pairs_ratio():
    """bench.py serve's single stream: per prompt server.py over serve_local.py, and with the
    llama.cpp pair beside it, llama-server over llama-completion; medians over the rounds."""
    rates = {"a prompt": ([90.0, 80.0, 100.0], [100.0, 100.0, 90.0], [45.0, 50.0, 40.0], [50.0, 50.0, 60.0]),
             "another": ([70.0], [100.0], [48.0], [50.0])}
    alone = bench.serve.single_stream_table(rates, 3, 128, None)
    assert alone.columns[-1] == "ratio" and alone.rows[0][1:] == ["90.0", "100.0", "0.90"]
    assert alone.notes == ["server.py over serve_local.py: median 0.80×, from 0.70× to 0.90×"]
    both = bench.serve.single_stream_table(rates, 3, 128, "model.gguf")
    assert both.rows[0][4:] == ["45.0", "50.0", "0.90"] and both.rows[1][4:] == ["48.0", "50.0", "0.96"]
    assert both.notes[1] == "llama-server over llama-completion: median 0.93×, from 0.90× to 0.96×"
    assert "llama.cpp's pair likewise on model.gguf" in both.title


def test_running_gives_a_servers_url_and_stops_it(tmp_path):
    """bench.common.running: the command on a free --port, up once /health answers, stopped
    when the block ends (every bench that starts a server goes through it)."""
    import httpx
    script = ("import sys, http.server\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[-1])), H).serve_forever()\n")
    with bench.common.running([sys.executable, "-c", script], tmp_path / "server.log") as url:
        assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
