"""model.py against transformers' LlamaForCausalLM, and the two decoders against each other."""

import json

import pytest
import torch

import model as M
import quantize
from conftest import make_checkpoint

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


def test_cached_logits_match_full_forward(tiny_ckpt):
    """Prefill in two chunks then decode: every position's logits equal one full pass."""
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    ids = torch.randint(0, 320, (1, 50), generator=torch.Generator().manual_seed(2))
    full = model(ids, torch.arange(50))
    cache = model.new_cache()
    parts = [model(ids[:, :20], torch.arange(20), cache), model(ids[:, 20:45], torch.arange(20, 45), cache)]
    parts += [model(ids[:, i:i + 1], torch.tensor([i]), cache) for i in range(45, 50)]
    assert cache.length == 50
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_attention_work_counts_5050_vs_100(tiny_ckpt):
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    model.config.eos_ids = []
    params = M.SamplingParams(max_new_tokens=100)
    naive, cached = M.GenerationStats(), M.GenerationStats()
    a = list(M.generate_naive(model, [0], params, naive))
    b = list(M.generate_cached(model, [0], params, cached))
    assert a == b
    assert (naive.positions_computed, cached.positions_computed) == (5050, 100)
    assert cached.new_tokens == 100 and cached.prompt_tokens == 1


def test_generation_stops_on_any_eos(tiny_ckpt):
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    model.config.eos_ids = []
    free = list(M.generate_cached(model, [0, 1, 2], M.SamplingParams(max_new_tokens=30)))
    model.config.eos_ids = [999, free[4]]          # eos may be a list; any id ends generation
    stopped = list(M.generate_cached(model, [0, 1, 2], M.SamplingParams(max_new_tokens=30)))
    assert stopped == free[:free.index(free[4]) + 1]


def test_sampling_controls():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    greedy = M.SamplingParams()
    assert M.sample(logits, greedy) == 0
    # top-k 1 and a tiny top-p both collapse to the argmax whatever the temperature
    assert all(M.sample(logits, M.SamplingParams(temperature=5.0, top_k=1)) == 0 for _ in range(20))
    assert all(M.sample(logits, M.SamplingParams(temperature=5.0, top_p=0.01)) == 0 for _ in range(20))
    # top-k 2 never emits a token outside the top two
    gen = torch.Generator().manual_seed(0)
    ks = {M.sample(logits, M.SamplingParams(temperature=2.0, top_k=2), gen) for _ in range(300)}
    assert ks == {0, 1}
    # plain temperature sampling follows softmax(logits / T): frequencies within 3 sigma
    p = torch.softmax(logits / 1.5, -1)
    n = 4000
    counts = torch.bincount(torch.tensor([M.sample(logits, M.SamplingParams(temperature=1.5), gen)
                                          for _ in range(n)]), minlength=5).float()
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 3 * sigma + 1).all(), (counts, n * p)
    # top-p 0.8 keeps the smallest prefix of the sorted distribution reaching 0.8
    probs = torch.softmax(logits, -1)       # [0.61, 0.22, 0.14, 0.03, 0.004]
    kept = {M.sample(logits, M.SamplingParams(temperature=1.0, top_p=0.8), gen) for _ in range(300)}
    assert kept == {0, 1} and probs[:2].sum() >= 0.8


def test_top_p_equals_a_full_sort_of_the_vocabulary():
    """sampling_probs ranks only the 256 likeliest tokens when they reach top_p,
    and sorts everything when they fall short: both must equal the textbook rule."""
    gen = torch.Generator().manual_seed(0)
    for scale, nucleus_inside in ((8.0, True), (0.1, False)):   # peaked, then nearly flat over 2,000 tokens
        logits = torch.randn(3, 2000, generator=gen) * scale
        got = M.sampling_probs(logits, M.SamplingParams(temperature=1.0, top_p=0.9))
        probs = torch.softmax(logits, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        want = torch.zeros_like(probs).scatter_(-1, order, sorted_p * (sorted_p.cumsum(-1) - sorted_p < 0.9))
        torch.testing.assert_close(got, want / want.sum(-1, keepdim=True))
        kept = (got > 0).sum(-1)
        assert bool((kept < 256).all()) if nucleus_inside else bool((kept > 256).all()), kept


def test_seed_makes_sampling_reproducible(tiny_ckpt):
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    model.config.eos_ids = []
    p = M.SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_new_tokens=30)
    a = list(M.generate_cached(model, [0, 1], p))
    b = list(M.generate_cached(model, [0, 1], p))
    c = list(M.generate_cached(model, [0, 1], M.SamplingParams(temperature=1.0, seed=124, max_new_tokens=30)))
    assert a == b and a != c


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), "top-p must be in (0, 1]"),
    (dict(top_p=1.5), "top-p must be in (0, 1]"),
    (dict(top_k=-1), "top-k must be >= 0"),
    (dict(max_new_tokens=0), "max-new-tokens must be >= 1"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        M.SamplingParams(**kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(tiny_ckpt, dtype):
    ref = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    half = M.Llama.from_pretrained(tiny_ckpt, "cpu", dtype)
    assert half.embed_tokens.weight.dtype == M.DTYPES[dtype]
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


def test_linear_uses_onednn_for_fp32_inference_and_keeps_gradients():
    """model.linear: eager fp32 inference goes through oneDNN (MKL's small-batch
    sgemm is slow on some CPUs); same values as F.linear, and training still gets
    F.linear's gradients."""
    assert M._ONEDNN                     # every CPU wheel of torch ships oneDNN
    layer = torch.nn.Linear(64, 300, bias=False)
    for t in (1, 3, 8):
        x = torch.randn(2, t, 64)
        with torch.inference_mode():
            torch.testing.assert_close(M.linear(x, layer), torch.nn.functional.linear(x, layer.weight),
                                       atol=1e-5, rtol=1e-5)
    x = torch.randn(1, 3, 64, requires_grad=True)
    M.linear(x, layer).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear(dtype):
    """model.prepack: big Linears get oneDNN's blocked copy of their weight, used
    by eager CPU inference for any number of rows, with F.linear's values; a
    swapped weight is used as it is (the stale copy is not), and with
    gradients on it is F.linear again."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bf16 oneDNN kernels")
    net = torch.nn.Sequential(torch.nn.Linear(512, 640, bias=False), torch.nn.Linear(64, 32, bias=False)).to(dtype)
    M.prepack(net)
    big, small = net
    assert big.onednn[0] is big.weight and big.onednn[1].is_mkldnn and not hasattr(small, "onednn")
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    swapped = torch.nn.Parameter(torch.randn(640, 512, dtype=dtype))
    with torch.inference_mode():
        for rows in (1, 2, 4, 11):
            x = torch.randn(2, rows, 512, dtype=dtype)
            torch.testing.assert_close(M.linear(x, big), torch.nn.functional.linear(x, big.weight), **tol)
        twice = torch.ops.mkldnn._reorder_linear_weight(2 * big.weight, 16)     # proof the copy is what runs
        big.onednn = (big.weight, twice)
        torch.testing.assert_close(M.linear(x, big), 2 * torch.nn.functional.linear(x, big.weight), **tol)
        big.weight = swapped
        torch.testing.assert_close(M.linear(x, big), torch.nn.functional.linear(x, big.weight), **tol)
        M.prepack(net)
        assert big.onednn[0] is big.weight
        torch.testing.assert_close(M.linear(x, big), torch.nn.functional.linear(x, big.weight), **tol)
    x = torch.randn(1, 3, 512, dtype=dtype, requires_grad=True)
    M.linear(x, big).sum().backward()
    assert big.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("k", [256, 4608])
def test_compiled_matvec_equals_linear(k):
    """Inside a compiled step `linear` is a multiply-and-sum; rows over 4,096 long
    are summed as two halves (matvec_sum). Both equal F.linear."""
    layer = torch.nn.Linear(k, 96, bias=False)
    x = torch.randn(1, 1, k)
    step = torch.compile(lambda x: M.linear(x, layer), dynamic=False, fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(step(x), torch.nn.functional.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(quantize.matvec_sum(x, layer.weight), torch.nn.functional.linear(x, layer.weight),
                                   atol=1e-4, rtol=1e-4)
        # int8 rows and their scales take the same path (quantize.Int8Linear)
        q8 = quantize.Int8Linear.from_float(layer.weight)
        q8.prepare(torch.float32)
        step8 = torch.compile(lambda x: q8(x), dynamic=False, fullgraph=True)
        torch.testing.assert_close(step8(x), torch.nn.functional.linear(x, q8.dequantized()), atol=1e-4, rtol=1e-4)
