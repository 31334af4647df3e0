"""tp.py: two CPU ranks (gloo) against one process. One launch of 2 ranks runs a random
GQA checkpoint and the bundled model (tokens, logits, bytes, all-reduces), sampling with
a shared seed, a rank that stalls, mismatched checkpoints and a rank that dies; torchrun
runs the runner once. The bad setups must end in one line, not a hang."""

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import bench.tp
import model
import results
import serve_local
import tp
from conftest import ROOT, make_checkpoint, make_qwen_checkpoint
from sampling import SamplingParams
from tokenizer import Tokenizer
import kvcache
import nanoinfer.load
from nanoinfer.config import RunConfig

pytestmark = pytest.mark.usefixtures("one_thread")
NEW, KV_TOKENS = 64, 256
CPU = torch.device("cpu")


def two_ranks(paths: dict, prompts: dict, other: str) -> dict:
    """Every phase of the main launch, on each rank; rank 0 returns what all ranks saw."""
    rank, out, models = dist.get_rank(), {}, {}
    for key in prompts:
        llama, _ = nanoinfer.load.load_tp(RunConfig(paths[key]), CPU)     # as the runner loads a rank
        models[key], prompt = llama, prompts[key]
        tokens = tp.generate(llama, prompt, NEW)
        ids = prompt + tokens
        with torch.inference_mode():
            logits = llama(torch.tensor([ids]), torch.arange(len(ids)))[0]
        out[key] = {"tokens": tokens, "logits": logits.clone() if rank == 0 else None, "part": llama.part,
                    "weights": tp.weight_bytes(llama), "kv": kvcache.new_cache(llama, "static", KV_TOKENS).nbytes,
                    "calls": llama.comm.calls, "bytes": llama.comm.bytes}
    seed = tp.shared_seed(None)           # no seed given: rank 0's random one, for every rank
    out["sampled"] = (seed, tp.generate(models["gqa"], prompts["gqa"], 32, seed, temperature=0.9))
    out["dynamic"] = tp.generate(models["gqa"], prompts["gqa"], 16, cache="dynamic")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: out[k]["tokens"] for k in prompts} |
                           {k: out[k] for k in ("sampled", "dynamic")})
    out["every"] = every
    # A group whose collectives time out after 1 s, and rank 1 quiet for 3 s: rank 0 gives up.
    stalled = dist.new_group(timeout=datetime.timedelta(seconds=1))
    t0 = time.perf_counter()
    if rank == 1:
        time.sleep(3)
    else:
        try:
            tp.shared_seed(None, stalled)
            out["stalled"] = None
        except ConnectionError as e:
            out["stalled"] = str(e), time.perf_counter() - t0
    try:                                  # rank 1 was given another checkpoint of the same shapes
        nanoinfer.load.load_tp(RunConfig(paths["gqa"] if rank == 0 else other), CPU)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    if rank == 1:                         # dies after 5 tokens of an answer, without a word
        for i, _ in enumerate(model.generate_cached(models["gqa"], prompts["gqa"], SamplingParams(
                max_new_tokens=NEW, ignore_eos=True))):
            if i == 5:
                os._exit(3)
    t0 = time.perf_counter()
    try:
        tp.generate(models["gqa"], prompts["gqa"], NEW)
        out["died"] = None
    except ConnectionError as e:
        out["died"] = str(e)
    out["died_after_s"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory, bundled_dir):
    tmp = tmp_path_factory.mktemp("tp")
    paths = {"gqa": str(make_checkpoint(tmp / "gqa", num_attention_heads=4, num_key_value_heads=2)),
             "bundled": str(bundled_dir),
             # a rank keeps its heads' rows of Qwen2's q/k/v biases; Qwen3's q/k norms are per head_dim
             **{f: str(make_qwen_checkpoint(tmp / f, f)) for f in ("qwen2", "qwen3")}}
    other = str(make_checkpoint(tmp / "other", initializer_range=0.05))
    tok = Tokenizer.from_dir(bundled_dir)
    prompts = {"gqa": [0, 17, 42, 99, 5], "bundled": tok.encode_chat([{"role": "user", "content": "Name a color."}]),
               "qwen2": [0, 17, 42, 99, 5], "qwen3": [0, 17, 42, 99, 5]}
    t0 = time.perf_counter()
    ranks = tp.launch(two_ranks, 2, paths, prompts, other, timeout_s=30)
    return paths, prompts, ranks, time.perf_counter() - t0


@pytest.fixture(scope="module")
def alone(launched):
    """The same models in this one process: (model, greedy tokens, logits of the full pass), their
    weights in fp32 as the ranks split them (a GGUF's widened: --weights float)."""
    paths, prompts, _, _ = launched
    out = {}
    for key, prompt in prompts.items():
        llama, _ = nanoinfer.load.load(RunConfig(paths[key], weights="float"))
        tokens = tp.generate(llama, prompt, NEW)
        with torch.inference_mode():
            logits = llama(torch.tensor([prompt + tokens]), torch.arange(len(prompt) + NEW))[0]
        out[key] = llama, tokens, logits
    return out


@pytest.mark.parametrize("key", ["gqa", "bundled", "qwen2", "qwen3"])
def test_two_ranks_match_one_process(launched, alone, key):
    paths, prompts, (r0, r1), _ = launched
    assert isinstance(r1, ChildProcessError)          # it was told to die (last phase)
    assert not isinstance(r0, Exception), r0
    one, tokens, logits = alone[key]
    got = r0[key]
    assert got["tokens"] == tokens and len(tokens) == NEW             # greedy, static cache
    assert r0["every"][1][key] == tokens                               # and rank 1 drew the same
    # fp32, every position. The ranks add their partial sums in another order (and slices small enough
    # for F.linear skip oneDNN's kernel), so the last bits differ, more after 30 layers: within 1e-4 on
    # the 2-layer checkpoint; within 2e-5 of the largest logit on SmolLM2 (~40: 8e-4), where one
    # process's own cached and full passes differ by 1e-4 too.
    error, scale = (got["logits"] - logits).abs().max().item(), logits.abs().max().item()
    assert error < (1e-4 if key == "gqa" else 2e-5 * scale)
    # Two all-reduces per layer per pass (64 decode passes + the full pass), of hidden_size values
    # at each position the pass ran.
    c, n = one.config, len(prompts[key])
    assert got["calls"] == 2 * c.n_layers * (NEW + 1)
    assert got["bytes"] == 2 * c.n_layers * c.hidden_size * 4 * (n + (NEW - 1) + (n + NEW))


def test_bytes_per_rank(launched, alone):
    """The split products are halved (GQA 4/2 heads: exactly; SmolLM2's 3 KV heads: 2 and 1,
    its MLP exactly); the embedding, head and norms stay whole on every rank."""
    r0 = launched[2][0]
    one = alone["gqa"][0]
    split, whole = tp.weight_bytes(one)
    assert r0["gqa"]["weights"] == (split // 2, whole)
    assert r0["gqa"]["kv"] * 2 == kvcache.new_cache(one, "static", KV_TOKENS).nbytes
    assert whole == 4 * (2 * 320 * 64 + 5 * 64 + 8)      # embedding + untied head, 5 norms, RoPE's 8 frequencies
    bundled = alone["bundled"][0]
    c, (split, whole) = bundled.config, tp.weight_bytes(bundled)
    part = r0["bundled"]["part"]
    assert (part.heads, part.kv_heads, part.units) == (range(0, 6), range(0, 2), range(0, 768))
    d, h = c.head_dim, c.hidden_size
    attention = c.n_layers * 4 * (h * (len(part.heads) + 2 * len(part.kv_heads)) * d + len(part.heads) * d * h)
    mlp = c.n_layers * 4 * 3 * h * len(part.units)
    assert r0["bundled"]["weights"] == (attention + mlp, whole)
    assert mlp * 2 == c.n_layers * 4 * 3 * h * c.intermediate_size
    assert r0["bundled"]["kv"] * 3 == kvcache.new_cache(bundled, "static", KV_TOKENS).nbytes * 2
    assert whole == 4 * (c.vocab_size * h + (2 * c.n_layers + 1) * h + d // 2)   # tied embedding


def test_sampling_agrees_across_ranks(launched, alone):
    _, prompts, (r0, _), _ = launched
    seed, tokens = r0["sampled"]
    assert r0["every"][1]["sampled"] == (seed, tokens)
    one = alone["gqa"][0]
    assert tp.generate(one, prompts["gqa"], 32, seed, temperature=0.9) == tokens
    assert r0["every"][1]["dynamic"] == r0["dynamic"] == tp.generate(one, prompts["gqa"], 16, cache="dynamic")


def test_bad_setups_end_in_one_line(launched):
    _, _, (r0, r1), seconds = launched
    assert r0["mismatch"].startswith("ranks loaded different models: rank 0 ") and "same --model" in r0["mismatch"]
    assert r0["died"].startswith("another rank died or stopped answering (") and "by peer" in r0["died"]
    assert "\n" not in r0["died"] and r0["died_after_s"] < 10        # the closed socket, not the 30 s timeout
    assert "exit code 3" in str(r1)
    print(f"launch of 2 ranks, every phase: {seconds:.1f} s\n{r0['mismatch']}\n{r0['died']}\n{r0['stalled']}")


def test_plan_splits_whole_kv_groups():
    cfg = model.LlamaConfig(vocab_size=8, hidden_size=576, intermediate_size=1536, n_layers=1, n_heads=9,
                            n_kv_heads=3, head_dim=64)
    parts = [tp.plan(cfg, r, 2) for r in range(2)]
    assert [(p.heads, p.kv_heads, p.units) for p in parts] == [(range(0, 6), range(0, 2), range(0, 768)),
                                                               (range(6, 9), range(2, 3), range(768, 1536))]
    with pytest.raises(ValueError, match="^4 ranks but the model has 3 KV heads: .* use --tp 3 or fewer$"):
        tp.plan(cfg, 0, 4)


def test_a_stalled_rank_times_out(launched):
    message, waited = launched[2][0]["stalled"]
    assert message.startswith("another rank died or stopped answering (Timed out waiting 1000ms for ")
    assert "\n" not in message and 0.9 < waited < 2.9


def test_tp_flags(monkeypatch, capsys):
    for flags, error in [
            (["--tp", "2", "--kv", "paged", "--prompt", "x"], "--tp runs the plain decoders on float weights: "
                                                              "drop --kv paged"),
            (["--tp", "2", "--weights", "int8", "--compile", "--cache", "static", "--prompt", "x"],
             "--tp runs the plain decoders on float weights: drop --compile, --weights"),
            (["--tp", "2"], "--tp answers one --prompt (a typed line would reach rank 0 alone): add --prompt"),
            (["--tp", "0", "--prompt", "x"], "--tp must be at least 1 process, got 0"),
            (["--tp", "2", "--prompt", "x", "--device", "cpu"], "--tp 2 runs one process per rank: launch it with "
                                                                "torchrun --nproc-per-node 2 serve_local.py --tp 2 ...")]:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        assert serve_local.main(flags) == 1
        assert capsys.readouterr().err == f"error: {error}\n"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert serve_local.main(["--tp", "3", "--prompt", "x", "--device", "cpu"]) == 1
    assert capsys.readouterr().err == ("error: --tp 3 but the launcher started 2 processes: use torchrun "
                                       "--nproc-per-node 3\n")


def test_torchrun_runs_the_runner(tmp_path, capfd):
    """The runner under torchrun: rank 0 prints the answer one process gives (sampled, seeded,
    static cache), and what it holds; rank 1 prints nothing."""
    ckpt = make_checkpoint(tmp_path / "tiny")
    flags = ["--model", str(ckpt), "--prompt", "hello there", "--temperature", "0.8", "--seed", "7",
             "--cache", "static", "--ctx", "96", "--max-new-tokens", "40", "--device", "cpu"]
    assert serve_local.main(flags) == 0
    alone = capfd.readouterr().out       # Chat.turn writes to the real stdout
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "serve_local.py", "--tp", "2", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert p.stdout == alone and len(alone) > 10
    assert "rank 0 of 2: query heads 0-1, KV head 0, MLP units 0-63;" in p.stderr
    assert "rank 1 of 2" not in p.stderr and p.stderr.count("loading ") == 1


def test_bench_tp_table(monkeypatch, capsys):
    """bench.py tp's table and record, from fabricated measurements (the real run takes a minute)."""
    def fake(fn, world, name, dtype, prompt_tokens, steps, split, threads):
        step = {(1, 1): 0.060, (1, 2): 0.040}.get((world, threads), 0.050)
        return [{"step_s": step + 0.001 * r, "comm_s": 0.020 + 0.001 * r, "calls": 60, "allreduce_s": 0.0004,
                 "weights": 343_400_000 if split else 538_100_000, "kv": 4_950_000 if split else 7_420_000,
                 "layers": 30, "threads": threads} for r in range(world)]
    monkeypatch.setattr(tp, "launch", fake)
    monkeypatch.setattr(bench.tp, "model_dir", lambda name: name)
    bench.tp.bench_tp(["smollm2-135m"], "float32", 128, 32)
    r = results.load()
    record = next(x for x in r if x["name"] == "tp")
    assert record["lesson"] == "tp" and "tp" in results.LESSONS
    table = record["tables"][0]
    assert table["rows"] == [
        ["smollm2-135m", "1 process, 1 thread", "60.0", "-", 0, "-", "538.1", "7.42", "1.00×"],
        ["smollm2-135m", "1 process, 2 threads", "40.0", "-", 0, "-", "538.1", "7.42", "1.50×"],
        ["smollm2-135m", "2 ranks × 1 thread (tp.py)", "51.0", "20.0 / 21.0", 60, "400", "343.4", "4.95", "1.18×"]]
    assert table["notes"] == ["smollm2-135m: a 1-thread step is 2.00 ms per layer (head included); splitting a "
                              "layer in 2 saves at most half of that (1.00 ms) and costs 2 all-reduces: 0.80 ms "
                              "alone, 0.67 ms inside the step (waiting for the other rank included)"]
    assert "| smollm2-135m | 2 ranks × 1 thread (tp.py) | 51.0 |" in capsys.readouterr().out
