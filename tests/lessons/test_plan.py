"""plan.py: the runner's configuration, chosen from a machine (built by hand here, so every kind of
machine is testable on any), a model's config and a context, with a reason per choice; the flags
laid over it (nanoinfer/config.py: RunConfig.from_flags); this machine measured (nanoinfer/machine.py)."""

import json
from dataclasses import replace

import pytest
import torch

import checkpoint
import engine
import kernels
import plan
import serve_local
from conftest import run_cli
import nanoinfer.load as nl
from nanoinfer import machine

GB = 1 << 30


def cpu(bf16=False, memory=32 * GB, compiler="g++", **ns):
    timings = {"float32": 0.30, "int8": 0.70, "int4": 1.20, **ns}   # an AVX2 CPU: fp32 fastest
    if bf16:
        timings.setdefault("bfloat16", 0.16)
    return plan.Machine("cpu", "fake CPU", bf16, False, memory, 20e9, compiler, 2, timings, (1536, 576))


CUDA = plan.Machine("cuda", "fake GPU", True, True, 80 * GB, 3e12, "g++", 1, {}, None)


@pytest.fixture(scope="module")
def smol():
    return plan.model_info("smollm2-135m")


@pytest.fixture(scope="module")
def tiny():
    return plan.model_info("tinyllama")


def test_model_info_from_configs(smol, tiny):
    assert (smol.config.n_layers, smol.config.n_kv_heads, smol.config.head_dim) == (30, 3, 64)
    assert smol.source == "gguf" and smol.drafts == ["bundled", "medusa"] and smol.main_kind == "int4"
    # the file's Q4_1 matrices (int4) and its tied Q8_0 head (int8 groups of 32), as stored
    assert set(smol.file_params) == {"int4", "int8"} and smol.file_params["int8"] == 49152 * 576
    # --plan names the bits of each kind of tensor
    assert plan.describe_layouts(smol) == ("matrices int4 groups of 32 79%, int8 groups 21%; LM head "
                                           "int8 groups; embedding table int8 groups (the LM head's: tied)")
    # a Q3_K or Q2_K matrix: int4 in groups of 16, a K-quant's scale and minimum per group
    q3 = {"kind": "int4", "group": 16, "min": True, "scales": "blocks"}
    assert plan.layout_kind(q3) == "int4/16" and plan.layout_bytes(q3, 32, 256) == 32 * 164
    # re-rounded to int4, the head would stay fp32 (ModelInfo.head): the file's Q8_0 head reads less
    assert smol.token_bytes("gguf", "float32") < smol.token_bytes("int4", "float32")
    assert 134e6 < smol.matrix_params < 136e6 and smol.embed_params == 0      # tied: the head is the table
    assert tiny.drafts == [] and tiny.source is None and tiny.config.max_seq_len == 2048
    assert 1.09e9 < tiny.matrix_params + tiny.embed_params < 1.11e9
    # bytes/token: weights once + ctx · n_layers · 2 · n_kv · d_head · size
    assert smol.kv_bytes(2048, "auto", "float32") == 2048 * 30 * 2 * 3 * 64 * 4
    assert smol.kv_bytes(2048, "int8", "float32") == 2048 * 30 * 2 * 3 * (64 + 2)
    assert smol.token_bytes("float", "float32") == smol.matrix_params * 4
    assert smol.token_bytes("int4", "float32") < smol.token_bytes("int8", "float32") < \
        smol.token_bytes("float", "bfloat16") < smol.token_bytes("float", "float32")


def test_cpu_without_bf16(smol):
    p = plan.choose(cpu(), smol)
    # a draft exists: eager with the EAGLE head + lookup (a compiled step would verify its guesses eagerly)
    assert (p.dtype, p.attn, p.cache, p.ctx, p.compile) == ("float32", "sdpa", "dynamic", 2048, False)
    assert (p.draft, p.prompt_lookup, p.spec_k, p.weights, p.kv_dtype) == ("bundled", 3, 4, "float", "auto")
    text = plan.describe(p)
    assert "no native bf16" in text and "verify passes would run eagerly" in text and "exact: in fp32" in text
    q = overlay(p, "--compile")                            # asked for: compiled, still speculating
    assert (q.cache, q.compile, q.draft) == ("static", True, "bundled")
    # --activations int8 multiplies the file's bits: not widened after all, nor speculating
    q = overlay(p, "--activations", "int8")
    assert (q.weights, q.activations, q.draft, q.prompt_lookup) == ("auto", "int8", None, None)
    assert overlay(p, "--activations", "int8", "--weights", "float").weights == "float"
    assert "the GGUF's own bits (matrices int4 groups of 32" in text and "compute slower here (calibrated int4 1.200" in text
    # a file mostly in int4 groups of 16 (Q3_K, Q2_K) is timed as int4's loop: widened alike
    q3 = plan.choose(cpu(), replace(smol, file_params={"int4/16": smol.file_params["int4"]}))
    assert q3.weights == "float" and "(calibrated int4 1.200" in plan.describe(q3)
    tok = smol.token_bytes("float", "float32")
    assert f"{20e9 / tok:,.0f} tok/s empty" in text            # ceiling = bandwidth / bytes per token
    assert len(p.reasons) == 6 and all(p.reasons)


def test_cpu_with_bf16_and_fast_int4(smol):
    p = plan.choose(cpu(bf16=True, int4=0.05), smol)
    assert (p.dtype, p.weights, p.stored) == ("float32", "auto", "gguf")     # the file's bits, fp32 activations
    text = plan.describe(p)
    assert "computes bf16 natively" in text and "0.160 ns/weight against fp32's 0.300" in text
    assert "dtype float32 after all" in text and "against bfloat16's 0.160" in text
    assert "file's own bits" in text and p.draft is None and "fixed costs of speculating" in text
    assert "weights: the file's own bits" in plan.summary(p)
    # no draft: the compiled step; no fp32 copies of the file's weights (prefills widen tiles)
    assert p.compile and not p.prepack and "no fp32 copy" in text
    assert plan.choose(cpu(compiler=None), smol).weights == "float"     # no kernels: widened
    # slower per weight than fp32 but within 2x: still the file's bits (a quarter of the bytes)
    assert plan.choose(cpu(int4=0.5), smol).weights == "auto"
    assert p.head == "float" and "int8 groups" in text        # the head keeps the file's bits (its Q8_0)
    p = plan.choose(cpu(bf16=True), smol, answer_tokens=256)
    # bf16 would round the file's values: they are widened to fp32, exact
    assert (p.dtype, p.weights, p.draft) == ("float32", "float", "bundled")
    p = plan.choose(cpu(bf16=True), replace(smol, source=None, file_params={}), answer_tokens=256)
    assert (p.dtype, p.weights, p.draft) == ("bfloat16", "auto", "bundled")    # a float checkpoint
    assert "rounds differently from a one-token step" in plan.describe(p)   # bf16 speculation is not exact
    # bf16 native but measured no faster: fp32
    assert plan.choose(cpu(bf16=True, bfloat16=0.29), smol).dtype == "float32"


def test_cuda(smol):
    p = plan.choose(CUDA, smol)
    assert (p.dtype, p.attn, p.cache, p.compile) == ("bfloat16", "sdpa", "static", True)
    assert "CUDA graph" in plan.describe(p)
    old = plan.Machine("cuda", "old GPU", False, True, 16 * GB, 3e11, None, 1, {}, None)
    assert plan.choose(old, smol).dtype == "float16"


def test_no_compiler_one_answer_and_no_draft(smol, tiny):
    assert plan.choose(cpu(compiler=None), smol).compile is False
    p = plan.choose(cpu(), smol, answer_tokens=64)      # float weights: the draft's verify passes
    assert (p.compile, p.cache, p.draft) == (False, "dynamic", "bundled")
    assert "verify passes would run eagerly" in plan.describe(p)
    # one answer, where a chat compiles: the step a chat built loads, none is built for it
    p = plan.choose(cpu(int4=0.05), smol, answer_tokens=64)
    assert (p.compile, p.build, p.cache, p.draft) == (True, False, "static", None)
    assert "does not repay a compile" in plan.describe(p)
    assert "compiled if built before, else eager" in plan.summary(p)
    one = nl.RunConfig.from_flags(serve_local.parse_args(["--prompt", "x"]), p)
    assert (one.compile, one.build, one.background_compile, one.cache) == (True, False, False, "static")
    asked = nl.RunConfig.from_flags(serve_local.parse_args(["--prompt", "x", "--compile"]), p)
    assert (asked.compile, asked.build, asked.background_compile) == (True, True, False)
    eager = nl.RunConfig.from_flags(serve_local.parse_args(["--prompt", "x", "--cache", "dynamic"]), p)
    assert (eager.compile, eager.build) == (False, True)
    p = plan.choose(cpu(), tiny, ctx=8192)
    assert (p.draft, p.prompt_lookup, p.ctx) == (None, None, 2048)
    assert "no speculation" in plan.summary(p) and "trained on 2048 positions" in plan.describe(p)


def test_kv_quantized_when_the_context_does_not_fit(tiny):
    weights = tiny.weight_bytes("float", "float32") + tiny.token_bytes("float", "float32")   # + prepacked copy
    kv = tiny.kv_bytes(2048, "auto", "float32")
    memory = int((weights + 0.75 * kv) / plan.HEADROOM)        # the fp32 KV does not fit, int8 (~half) does
    p = plan.choose(cpu(memory=memory), tiny)
    assert (p.weights, p.kv_dtype) == ("auto", "int8")
    assert "KV cache int8" in plan.describe(p) and "would fit" not in plan.describe(p)
    p = plan.choose(cpu(memory=int((weights + 0.1 * kv) / plan.HEADROOM)), tiny)
    fits = [r for r in p.reasons if "would fit" in r]
    assert p.kv_dtype == "int8" and fits and 0 < int(fits[0].split("--ctx ")[1].split()[0]) < 2048


def test_weights_quantized_when_the_model_does_not_fit(tiny):
    p = plan.choose(cpu(memory=4 * GB), tiny)        # 8.5 GB in fp32 with its prepacked copy; int8 ~1.1 GB
    assert p.weights == "int8" and "weights int8" in plan.describe(p)
    # quantized to fit: no fp32 copy of them for prefills (4.4 GB) beside the 1.1 GB of int8
    assert not p.prepack and "no fp32 copy for prefills" in plan.describe(p)
    assert plan.choose(cpu(memory=int(1.2 * GB)), tiny).weights == "int4"
    assert plan.choose(CUDA, tiny).weights == "auto"


def overlay(p, *flags):
    """The plan in effect under the runner's ``flags``: RunConfig.from_flags lays them over ``p``."""
    return nl.RunConfig.from_flags(serve_local.parse_args(list(flags)), p).in_effect()


def test_explicit_flags_override_the_plan(smol, tiny):
    p = plan.choose(cpu(), smol)
    assert overlay(p) == p
    q = overlay(p, "--dtype", "bf16", "--weights", "int8", "--kv-dtype", "int8", "--attn", "flash",
                "--spec-k", "6", "--ctx", "512", "--draft", "medusa")
    assert (q.dtype, q.weights, q.kv_dtype, q.attn, q.spec_k, q.ctx) == ("bfloat16", "int8", "int8", "flash", 6, 512)
    assert (q.draft, q.prompt_lookup) == ("medusa", None)
    compiled = plan.choose(cpu(), tiny)                    # no draft: compiled
    assert (compiled.cache, compiled.compile, compiled.draft) == ("static", True, None)
    assert "compiles it once" in plan.describe(compiled)
    q = overlay(compiled, "--cache", "dynamic")            # an explicit cache turns the plan's compile off
    assert (q.cache, q.compile) == ("dynamic", False)
    q = overlay(p, "--no-compile")
    assert (q.cache, q.compile) == ("dynamic", False)
    eager = plan.choose(cpu(compiler=None), smol)
    q = overlay(eager, "--compile")                        # --compile alone takes a static cache
    assert (q.cache, q.compile) == ("static", True)
    assert overlay(eager, "--ctx", "256").cache == "static"
    q = overlay(p, "--weights", "int4")                    # speculation was planned for float weights
    assert (q.weights, q.draft, q.prompt_lookup) == ("int4", None, None)
    assert overlay(p, "--weights", "int4", "--draft", "bundled").draft == "bundled"
    q = overlay(p, "--prompt-lookup", "2")                 # a method given replaces the plan's
    assert (q.draft, q.prompt_lookup) == (None, 2)
    q = overlay(p, "--lookahead", "4,3,4")
    assert (q.draft, q.prompt_lookup, q.lookahead) == (None, None, "4,3,4")
    for flags in (["--kv", "paged"], ["--decoder", "naive"], ["--tp", "2", "--prompt", "x"]):
        q = overlay(p, *flags)
        assert (q.compile, q.cache, q.draft, q.prompt_lookup) == (False, "dynamic", None, None), flags
    with pytest.raises(ValueError, match="--compile needs --cache static"):
        serve_local.check_flags(serve_local.parse_args(["--compile", "--cache", "dynamic"]))


def test_no_speculation(smol):
    p = overlay(plan.choose(cpu(), smol), "--no-speculation")
    assert (p.draft, p.prompt_lookup, p.lookahead) == (None, None, None)
    assert "no speculation" in plan.summary(p)
    with pytest.raises(ValueError, match="--no-speculation"):
        overlay(p, "--no-speculation", "--draft", "bundled")



def test_one_run_config_from_either_command(smol):
    """The runner's and the server's flags become one RunConfig the same way, in torch's types; the
    server runs the engine (paged, no speculation, its decode steps compiled as the plan says,
    built in the background) on the plan's dtype; the runner's --kv paged chat stays eager."""
    import server
    p = plan.choose(cpu(bf16=True, int4=0.05), smol)          # fp32, int4 weights, compiled
    served = plan.choose(cpu(bf16=True, int4=0.05), smol, serving=plan.Serving(32, GB))
    cfg = nl.RunConfig.from_flags(server.parse_args([]), served)
    assert (cfg.device, cfg.dtype, cfg.weights, cfg.kv_dtype, cfg.head) == (torch.device("cpu"), torch.float32,
                                                                             None, None, "float")
    assert (cfg.kv, cfg.compile, cfg.draft, cfg.prompt_lookup, cfg.attn) == ("paged", True, None, None, "sdpa")
    assert cfg.background_compile and cfg.cache == "paged"
    assert not nl.RunConfig.from_flags(server.parse_args(["--no-compile"]), served).compile
    assert not nl.RunConfig.from_flags(server.parse_args(["--compile-only"]), served).background_compile
    assert not nl.RunConfig.from_flags(serve_local.parse_args(["--kv", "paged"]), p).compile
    cfg = nl.RunConfig.from_flags(server.parse_args(["--dtype", "bf16", "--weights", "int8"]), served)
    assert (cfg.dtype, cfg.weights) == (torch.bfloat16, "int8")
    one = nl.RunConfig.from_flags(serve_local.parse_args(["--prompt", "x"]), p)
    assert (one.dtype, one.weights, one.compile, one.background_compile) == (torch.float32, None, True, False)
    assert nl.RunConfig.from_flags(serve_local.parse_args([]), p).background_compile     # a chat's first start
    assert not nl.RunConfig.from_flags(serve_local.parse_args(["--compile-only"]), p).background_compile
    with pytest.raises(ValueError, match="int4 group size must be one of"):
        nl.RunConfig.from_flags(serve_local.parse_args(["--weights", "int4", "--group-size", "48"]), p)


def test_the_servers_plan(smol):
    """With plan.Serving (server.py's engine), the model's dtype and weights follow the runner's
    rules; the rest is the engine's: a paged pool (blocks as engine.Engine counts them), decode
    steps compiled once per batch shape where a compiler is found, and batching, not speculation,
    even for a model with a draft."""
    serving = plan.Serving(max_batch=8, kv_bytes=GB, block_size=16, prefix_caching=True)
    p = plan.choose(cpu(bf16=True, int4=0.05), smol, serving=serving)
    assert (p.dtype, p.weights, p.cache, p.compile, p.draft, p.prompt_lookup) == (
        "float32", "auto", "paged", True, None, None)
    text = plan.describe(p)
    assert "fp32, paged cache, compiled, weights: the file's own bits, no speculation" in text
    assert "(1, 2, 3, 4, 6, 8 rows; engine.padded_rows" in text
    blocks = engine.pool_blocks(GB, smol.kv_bytes(1, "auto", "float32"), 16, 8, smol.config.max_seq_len)
    assert f"1 GiB (--kv-gib) in {blocks:,} blocks of 16 tokens" in text and "prefix caching:" in text
    assert "batching requests raises the tokens per read" in text and "a large batch" in text
    p = plan.choose(cpu(compiler=None), smol, serving=replace(serving, prefix_caching=False))
    assert not p.compile and "no C++ compiler" in plan.describe(p) and "no prefix caching" in plan.describe(p)
    assert "a smaller --kv-gib fits" in plan.describe(plan.choose(cpu(memory=GB), smol, serving=serving))
    assert not plan.choose(CUDA, smol, serving=serving).compile


def test_server_plan_prints_and_exits_and_compile_only_says_when_nothing_compiles():
    rc, out, err = run_cli("server.py", "--plan", env={"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert rc == 0, err[-2000:]
    assert out.startswith("plan for ") and "paged cache" in out and "cost model:" in out
    assert "loading" not in err
    rc, out, err = run_cli("server.py", "--compile-only", "--no-compile", env={"HF_HUB_OFFLINE": "1"},
                           timeout=120)
    assert rc == 1 and err.strip().splitlines()[-1] == (
        "error: nothing to compile: this server's decode steps run eagerly here (server.py --plan "
        "says why)")
    assert "loading" not in err


def test_probe_measures_once_and_caches(tmp_path, monkeypatch):
    kernels.native_kernels(quiet=True)       # built (or found) where it lives, not again under tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    m = machine.probe(torch.device("cpu"), (256, 128))
    assert m.device == "cpu" and m.memory > GB and m.bandwidth > 1e8 and m.threads == torch.get_num_threads()
    assert set(m.ns_per_weight) >= {"float32", "int8", "int4"} and all(v > 0 for v in m.ns_per_weight.values())
    [path] = (tmp_path / "nanoinfer" / "plan").glob("*.json")
    assert json.loads(path.read_text())["name"] == m.name
    # the second call reads the cache: it measures nothing (a measurement here would raise)
    monkeypatch.setattr(machine, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(kernels, "read_bandwidth", lambda *a, **k: pytest.fail("measured again"))
    assert machine.probe(torch.device("cpu"), (256, 128)) == m


@pytest.mark.parametrize("flags", [[], ["--model", "tinyllama", "--ctx", "8192"]])
def test_serve_local_plan_prints_and_exits(flags):
    """As a user runs it: the converted bundled model and the probe's cache in ~/.cache/nanoinfer."""
    rc, out, err = run_cli("serve_local.py", "--plan", *flags, env={"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert rc == 0, err[-2000:]
    assert out.startswith("plan for ") and "why:" in out and "cost model:" in out and "tok/s" in out
    assert "loading" not in err                  # no weights read
    # the bundled model: its EAGLE head, or its own Q4_1 bits through the int4 kernels where they measure faster
    assert ("EAGLE head" in out or "weights: the file's own bits" in out) == (not flags)
    print(out)


def test_the_plan_needs_no_download():
    assert plan.model_info("TinyLlama").config.vocab_size == checkpoint.TINYLLAMA_CONFIG["vocab_size"]


# Twenty chat prompts; the first is the one on which an int8-rounded head (the file's Q8_0 embedding
# re-rounded per row) answered "1. **1.1.1.1.1…" where fp32 answers "1. **Avoiding Caffeine…".
EXACT_PROMPTS = [
    "Give me three tips for sleeping better.", "Explain in simple terms why the sky is blue.",
    "Write a short poem about a lighthouse keeper.", "What are three tips for learning a new language?",
    "Describe how a bicycle works to a ten-year-old.", "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?", "What is the capital of France?",
    "Write a polite email asking a neighbour to turn down their music.", "How do plants make food?",
    "List some good habits for staying healthy while working from home.", "What is a prime number?",
    "Summarise the plot of Romeo and Juliet in two sentences.", "Why do cats purr?",
    "Suggest a name for a small bakery.", "How does a refrigerator keep food cold?",
    "Translate 'good morning' into French and Spanish.", "What should I pack for a day hike?",
    "Explain what a computer virus is.", "Write a haiku about autumn leaves.",
]


def test_default_plan_is_exact_to_the_file(bundled_dir, smol, one_thread):
    """The plan's int4 weights on the bundled GGUF are the file's own bits, so its greedy answers are those
    of the file's weights dequantized to fp32: checked by teacher forcing, one fp32 pass over each prompt
    and the plan's answer, whose argmax at every position must be the answer's next token."""
    import model as M
    from sampling import SamplingParams
    import quantize
    p = plan.choose(cpu(bf16=True, int4=0.05), smol)
    assert (p.weights, p.stored, p.head) == ("auto", "gguf", "float")
    ours, tok = nl.load(nl.RunConfig(str(bundled_dir), dtype=kernels.DTYPES[p.dtype], weights=None,
                                     head=p.head))
    # the head holds the file's Q8_0 embedding as int8 groups of 32, not re-rounded per row
    assert isinstance(ours.lm_head, quantize.Int8Linear) and ours.lm_head.group == 32
    exact, _ = nl.load(nl.RunConfig(str(bundled_dir), weights="float"))       # widened to fp32
    assert isinstance(exact.lm_head, torch.nn.Linear) and exact.lm_head.weight.dtype == torch.float32
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    for text in EXACT_PROMPTS:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)
        answer = list(M.generate_cached(ours, prompt, greedy))
        with torch.inference_mode():
            logits = exact(torch.tensor([prompt + answer]), torch.arange(len(prompt) + len(answer)))
        assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == answer, (text, tok.decode(answer))
    first = EXACT_PROMPTS[0]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": first}]), add_bos=False)
    assert tok.decode(list(M.generate_cached(ours, prompt, greedy))).startswith("1. **Avoiding Caffeine")
