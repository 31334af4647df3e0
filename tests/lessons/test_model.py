"""model.py against transformers' LlamaForCausalLM, its simple version (forward_simple and its
two loops) against the general Llama, and the two decoders against each other; a Hugging Face
directory that cannot load is one line, never a traceback."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import model as M
import results
import kernels
from conftest import fails_with, make_checkpoint, make_qwen_checkpoint
from model import causal_scores
import kvcache

# many small forward passes, checked for values, not speed (conftest.one_thread says why)
pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "mqa-tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "gqa-untied-llama3": dict(num_key_value_heads=2, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "linear-rope-classic": dict(num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                classic_config=True),
    "llama3-classic": dict(num_key_value_heads=4, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
                           classic_config=True),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(tmp_path, variant):
    from transformers import LlamaForCausalLM
    path = make_checkpoint(tmp_path / variant, **VARIANTS[variant])
    ours = M.Llama.from_pretrained(path, "cpu", "float32")
    ref = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert ours.config.tie_embeddings == ref.config.tie_word_embeddings
    if VARIANTS[variant].get("rope_scaling"):
        assert ours.config.rope_scaling["rope_type"] == VARIANTS[variant]["rope_scaling"]["rope_type"]
    ids = torch.randint(0, 320, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids, torch.arange(100))
    assert (got - want).abs().max().item() < 1e-4
    assert want.abs().max() > 0.1   # not a vacuous comparison of zeros


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa-tied"])
def test_cached_equals_naive_greedy(tmp_path, variant):
    path = make_checkpoint(tmp_path / variant, **VARIANTS[variant])
    model = M.Llama.from_pretrained(path, "cpu", "float32")
    model.config.eos_ids = []
    params = M.SamplingParams(max_new_tokens=80)
    seen = set()
    for prompt in ([0], [0, 5, 17, 42, 99, 3], list(range(10, 40))):
        naive = list(M.generate_naive(model, prompt, params))
        cached = list(M.generate_cached(model, prompt, params))
        assert len(cached) == 80
        assert naive == cached
        seen |= set(cached)
    assert len(seen) > 3   # not a degenerate model that emits one token whatever the prompt


# --- the simple version (the lesson's first functions) equals the general one

def simple_matches_general(model, prompts, n):
    """forward_simple on the model's own tensors: one pass's logits, the same logits in chunks
    through its list cache, and both simple loops' greedy tokens, against the Llama class."""
    w, cfg = M.unfuse(model), model.config
    ids = list(range(3, 3 * 25, 3))
    with torch.inference_mode():
        want = model(torch.tensor([ids]), torch.arange(len(ids)))[0]
        whole, cache = M.forward_simple(w, cfg, ids), []
        parts = torch.cat([M.forward_simple(w, cfg, ids[a:b], cache)
                           for a, b in [(0, 10), (10, 20), (20, 21), (21, len(ids))]])
    # The same sums in other orders: the Llama class multiplies fused Q/K/V and gate/up matrices,
    # and BLAS blocks each shape its own way; through the bundled model's 30 layers that moves
    # fp32 logits by up to ~2e-5 of their scale on an AVX-512 Xeon.
    scale = want.abs().max()
    assert scale > 0.1 and (whole - want).abs().max() < 1e-4 * scale
    assert (parts - want).abs().max() < 1e-4 * scale
    assert len(cache) == cfg.n_layers
    assert cache[0][0].shape == (cfg.n_kv_heads, len(ids), cfg.head_dim)
    seen = set()
    for prompt in prompts:
        general = list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=n)))
        assert len(general) == n
        assert M.generate_cached_simple(w, cfg, prompt, n) == general
        assert M.generate_naive_simple(w, cfg, prompt, n) == general
        seen |= set(general)
    assert len(seen) > 3   # not a degenerate model that emits one token whatever the prompt


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa-tied"])
def test_simple_version_equals_the_general_one(tmp_path, variant):
    model = M.Llama.from_pretrained(make_checkpoint(tmp_path / variant, **VARIANTS[variant]),
                                    "cpu", "float32")
    model.config.eos_ids = []
    simple_matches_general(model, [[0], [0, 5, 17, 42, 99, 3]], 30)


def test_simple_version_equals_the_general_one_on_the_bundled_model(bundled_dir):
    model = M.Llama.from_pretrained(bundled_dir, "cpu", "float32")
    model.config.eos_ids = []
    simple_matches_general(model, [[1, 504, 3458, 282]], 12)


def test_simple_version_refuses_what_it_does_not_run(tmp_path):
    model = M.Llama.from_pretrained(make_checkpoint(tmp_path / "l3", tokenizer=False,
                                                    **VARIANTS["gqa-untied-llama3"]), "cpu")
    with pytest.raises(ValueError, match="forward_simple runs a plain Llama .*: run this model "
                                         "with Llama"):
        M.forward_simple(M.unfuse(model), model.config, [0, 1])


def test_cached_logits_match_full_forward(tiny_ckpt):
    """Prefill in two chunks then decode: every position's logits equal one full pass."""
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    ids = torch.randint(0, 320, (1, 50), generator=torch.Generator().manual_seed(2))
    full = model(ids, torch.arange(50))
    cache = kvcache.new_cache(model)
    parts = [model(ids[:, :20], torch.arange(20), cache), model(ids[:, 20:45], torch.arange(20, 45), cache)]
    parts += [model(ids[:, i:i + 1], torch.tensor([i]), cache) for i in range(45, 50)]
    assert cache.length == 50
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_prefill_chunk_gives_one_pass_results(tiny_ckpt):
    """A prompt longer than prefill_chunk runs as chunks, in order: the last logits, the cached
    K/V, the features (hidden) and the greedy answer are one pass's; a mask, or every position's
    logits, still take one pass."""
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    ids = torch.randint(0, 320, (1, 23), generator=torch.Generator().manual_seed(3))
    whole, whole_cache = model(ids, torch.arange(23), kvcache.new_cache(model), last_only=True,
                               hidden=True), kvcache.new_cache(model)
    model(ids, torch.arange(23), whole_cache, last_only=True)
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[1]))
    model.prefill_chunk = 10            # the fewest chunks (3), of equal length
    cache = kvcache.new_cache(model)
    logits, h = model(ids, torch.arange(23), cache, last_only=True, hidden=True)
    assert calls == [23, 8, 8, 7] and cache.length == 23
    assert torch.allclose(logits, whole[0], atol=1e-5) and torch.allclose(h, whole[1], atol=1e-5)
    for a, b in zip(cache.k + cache.v, whole_cache.k + whole_cache.v):
        assert torch.allclose(a[..., :23, :], b[..., :23, :], atol=1e-5)
    calls.clear()
    model(ids, torch.arange(23), kvcache.new_cache(model))
    model(ids, torch.arange(23), kvcache.new_cache(model), last_only=True,
          mask=torch.ones(23, 23, dtype=torch.bool).tril())
    assert calls == [23, 23]
    p = M.SamplingParams(temperature=0, max_new_tokens=12)
    chunked = list(M.generate_cached(model, ids[0].tolist(), p))
    model.prefill_chunk = None
    assert chunked == list(M.generate_cached(model, ids[0].tolist(), p))


def test_attention_work_counts_5050_vs_100(tiny_ckpt):
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    model.config.eos_ids = []
    params = M.SamplingParams(max_new_tokens=100)
    naive, cached = M.GenerationStats(), M.GenerationStats()
    a = list(M.generate_naive(model, [0], params, naive))
    b = list(M.generate_cached(model, [0], params, cached))
    assert a == b
    assert (naive.positions_computed, cached.positions_computed) == (5050, 100)
    # q·k scores per head and layer: Σ t(t+1)/2 = N(N+1)(N+2)/6 against Σ t = N(N+1)/2
    assert (naive.scores_computed, cached.scores_computed) == (171700, 5050)
    assert cached.new_tokens == 100 and cached.prompt_tokens == 1


def test_attention_scores_with_a_longer_prompt(tiny_ckpt):
    """A 6-token prompt, 5 new tokens: naive steps run 6..10 positions, each a causal
    pass; the cached prefill is one 6-token causal pass, then one query per step."""
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    model.config.eos_ids = []
    naive, cached = M.GenerationStats(), M.GenerationStats()
    params = M.SamplingParams(max_new_tokens=5)
    list(M.generate_naive(model, [0, 5, 17, 42, 99, 3], params, naive))
    list(M.generate_cached(model, [0, 5, 17, 42, 99, 3], params, cached))
    assert naive.scores_computed == 21 + 28 + 36 + 45 + 55
    assert cached.scores_computed == 21 + 7 + 8 + 9 + 10
    assert [causal_scores(1, 7), causal_scores(3, 3), causal_scores(2, 5)] == [7, 6, 4 + 5]


def test_bench_naive_vs_cached_counts_saves_and_plots(tiny_ckpt):
    import bench.context
    path = bench.context.bench_naive_vs_cached(str(tiny_ckpt), [4, 8])
    record = json.loads(path.read_text())
    assert (path.name, record["name"], record["lesson"]) == ("naive-vs-cached.json", "naive-vs-cached", "model")
    work, ratios = record["tables"]
    assert work["columns"] == ["N", "decoder", "positions computed", "q·k scores per head and layer", "time s",
                               "ms/token"]
    counts = {(r[0], r[1]): (r[2], r[3]) for r in work["rows"]}
    for n in (4, 8):
        assert counts[n, "naive"] == (n * (n + 1) // 2, n * (n + 1) * (n + 2) // 6)
        assert counts[n, "cached"] == (n, n * (n + 1) // 2)
    assert [r[1:3] + r[4:] for r in ratios["rows"]] == [["2.5×", "2.0×", "yes"], ["4.5×", "3.3×", "yes"]]
    assert all(r[4] > 0 for r in work["rows"])
    assert_plot(record, "naive_vs_cached.png")


def test_bench_context_table_cost_model_and_plot(tiny_ckpt):
    import bench.context
    path = bench.context.bench_context(str(tiny_ckpt), "float32", [8, 64], steps=2, reps=1)
    record = json.loads(path.read_text())
    assert (path.name, record["name"], record["lesson"]) == ("context.json", "context", "model")
    (table,) = record["tables"]
    assert table["columns"][:5] == ["context", "prefill ms", "prefill tok/s", "decode ms/token", "decode tok/s"]
    assert table["columns"][6:8] == ["weights MB read/step", "KV MB read/step"]
    # the tiny model: 2 layers, 2 KV heads, d_head 16, fp32 -> 512 B of K and V per token
    assert [r[0] for r in table["rows"]] == [8, 64]
    assert [r[7] for r in table["rows"]] == [8 * 512 / 1e6, 64 * 512 / 1e6]
    assert all(r[1] > 0 and r[3] > 0 for r in table["rows"])
    assert_plot(record, "context.png")
    with pytest.raises(ValueError, match="--contexts must be between 1 and"):
        bench.context.bench_context(str(tiny_ckpt), "float32", [300], steps=2, reps=1)


def assert_plot(record, name):
    """The plot exists where results.plot_path puts it (the tests' scratch directory), when
    matplotlib is installed (requirements-bench.txt; the tables are saved without it)."""
    if importlib.util.find_spec("matplotlib") is None:
        assert record["plots"] == []
    else:
        assert record["plots"] == [name] and results.plot_path(name).stat().st_size > 10_000


def test_generation_stops_on_any_eos(tiny_ckpt):
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    model.config.eos_ids = []
    free = list(M.generate_cached(model, [0, 1, 2], M.SamplingParams(max_new_tokens=30)))
    model.config.eos_ids = [999, free[4]]          # eos may be a list; any id ends generation
    stopped = list(M.generate_cached(model, [0, 1, 2], M.SamplingParams(max_new_tokens=30)))
    assert stopped == free[:free.index(free[4]) + 1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(tiny_ckpt, dtype):
    ref = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    half = M.Llama.from_pretrained(tiny_ckpt, "cpu", dtype)
    assert half.embed_tokens.weight.dtype == kernels.DTYPES[dtype]
    ids = torch.randint(0, 320, (1, 30), generator=torch.Generator().manual_seed(3))
    a, b = ref(ids, torch.arange(30)), half(ids, torch.arange(30))
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_config_errors_name_the_field():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2' \\(config.json model_type\\)"):
        M.LlamaConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        M.LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="config.json lacks the field vocab_size"):
        M.LlamaConfig.from_hf({k: v for k, v in base.items() if k != "vocab_size"})
    cfg = M.LlamaConfig.from_hf({**base, "eos_token_id": [5, 7]})
    assert cfg.eos_ids == [5, 7] and cfg.n_kv_heads == 2 and cfg.head_dim == 4


# --- a Hugging Face directory that cannot be loaded: one line through the runner, never a traceback

def test_directory_without_config(capsys, tmp_path):
    fails_with(capsys, ["--model", str(tmp_path), "--prompt", "hi"], "no config.json in")


def test_missing_weights(capsys, tiny_ckpt):
    (tiny_ckpt / "model.safetensors").unlink()
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"], "no weights in")


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_corrupt_safetensors(capsys, tiny_ckpt, damage):
    f = tiny_ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"], "corrupt or truncated weights file")


def test_shape_not_matching_config(capsys, tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tiny_ckpt / "config.json").write_text(json.dumps(cfg))
    last = fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"], "do not belong together")
    assert "mlp.down_proj" in last and "(64, 128)" in last and "(64, 96)" in last


def test_unsupported_architecture(capsys, tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tiny_ckpt / "config.json").write_text(json.dumps(cfg))
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"],
               "unsupported architecture 'gpt2' (config.json model_type): nanoinfer runs "
               "Llama-family checkpoints (model_type llama, mistral, qwen2 or qwen3)")


def test_nan_weight_is_caught_at_load_with_its_name(capsys, tiny_ckpt):
    path = tiny_ckpt / "model.safetensors"
    state = load_file(path)
    state["model.layers.1.self_attn.q_proj.weight"][3, 5] = float("nan")
    save_file(state, path, metadata={"format": "pt"})
    for flags in ([], ["--temperature", "0.7"]):
        last = fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi", *flags], "non-finite values")
        assert "tensor layers.1.self_attn.q_proj.weight " in last


# --- Qwen2/2.5 (a bias on q/k/v) and Qwen3 (RMSNorm on each head's q and k): one field each

QWEN = {"qwen2": dict(tie_word_embeddings=True),
        "qwen3": dict(head_dim=24)}          # Qwen3 states its head_dim, here not hidden / heads


@pytest.mark.parametrize("family", QWEN)
def test_qwen_logits_match_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM
    path = make_qwen_checkpoint(tmp_path / family, family, tokenizer=False, **QWEN[family])
    ours = M.Llama.from_pretrained(path, "cpu", "float32")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c = ours.config
    assert (c.qkv_bias, c.qk_norm) == (family == "qwen2", family == "qwen3")
    assert c.head_dim == QWEN[family].get("head_dim", 64 // 4)
    ids = torch.randint(0, 320, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids, torch.arange(100))
    assert (got - want).abs().max().item() < 1e-4
    assert want.abs().max() > 0.1
    # the cached decoder gives the naive one's tokens
    c.eos_ids = []
    params, seen = M.SamplingParams(max_new_tokens=40), set()
    for prompt in ([0, 5, 17, 42, 99, 3], list(range(10, 40))):
        cached = list(M.generate_cached(ours, prompt, params))
        assert cached == list(M.generate_naive(ours, prompt, params)) and len(cached) == 40
        seen |= set(cached)
    assert len(seen) > 3


def test_qwen_settings_it_cannot_run_are_refused():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(ValueError, match="use_sliding_window=true: Qwen's window covers only"):
        M.LlamaConfig.from_hf({**base, "model_type": "qwen2", "use_sliding_window": True,
                               "sliding_window": 4})
    with pytest.raises(ValueError, match="attention_bias=true: the only biases nanoinfer runs"):
        M.LlamaConfig.from_hf({**base, "model_type": "qwen3", "attention_bias": True})
    with pytest.raises(ValueError, match="model_type llama, mistral, qwen2 or qwen3"):
        M.LlamaConfig.from_hf({**base, "model_type": "qwen2_moe"})
    # Qwen's window is off unless switched on (its configs carry a size even then); Mistral's on
    off = M.LlamaConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 4096})
    on = M.LlamaConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 4096})
    assert (off.sliding_window, on.sliding_window) == (None, 4096)
