"""quantize.py: round-trip bounds, quantized KV caches in every cache kind, weight-only
layers against their dequantized matrices, quantized checkpoints, and bad input."""

import copy
import json
import runpy
import sys

import pytest
import torch

import model as M
import nanoinfer.load as nl
import quantize as Q
from conftest import fails_with, make_checkpoint, run_cli
import kvcache
import kernels


pytestmark = pytest.mark.usefixtures("one_thread")


# --- round trips --------------------------------------------------------------

def test_int8_round_trip_within_half_a_step():
    x = torch.randn(64, 3, 128) * torch.logspace(-3, 2, 128)      # rows of very different magnitudes
    q, s = Q.quantize_int8(x)
    err = (Q.dequantize_int8(q, s) - x).abs()
    assert q.dtype == torch.int8 and s.shape == (64, 3, 1)
    assert (err <= s.float() / 2 + 1e-7).all()
    assert err.max() > 0                                           # it is lossy: the bound is tight-ish


def test_fp8_round_trip_within_e4m3_precision():
    x = torch.randn(64, 3, 128) * 5
    q, s = Q.quantize_fp8(x)
    assert q.dtype == Q.FP8
    back = Q.dequantize_fp8(q, s)
    y = x / s.float()                                              # what was cast, in units of the scale
    normal = y.abs() >= 2 ** -6                                    # e4m3's smallest normal number
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2 ** -4 + 1e-6                              # 3 mantissa bits: half a step
    assert ((back - x).abs()[~normal] <= s.float().expand_as(x)[~normal] * 2 ** -10 + 1e-9).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_and_nibble_packing(group):
    w = torch.randn(48, 256)
    q, s, lo = Q.quantize_int4(w, group)
    assert q.max() <= 15 and s.shape == (48, 256 // group)
    back = Q.dequantize_int4(q, s, lo)
    assert ((back - w).abs().reshape(48, -1, group) <= s[..., None] / 2 + 1e-6).all()
    assert torch.equal(Q.split_nibbles(Q.join_nibbles(q)), q)


# --- the KV cache ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = M.Llama.from_pretrained(make_checkpoint(tmp_path_factory.mktemp("c") / "gqa"), "cpu", "float32")
    m.config.eos_ids = []
    return m


def decode(model, prompt, cache, n):
    return list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=n), cache=cache))


PROMPT = [0, 5, 17, 42, 99, 3, 7, 250, 31]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_cache_kinds_agree_and_stay_close_to_full(llama, kv):
    """Dynamic and static caches store the same bytes, so they decode the same tokens;
    logits stay within a small distance of the full-precision cache's."""
    dyn = decode(llama, PROMPT, kvcache.new_cache(llama, "dynamic", codec=Q.kv_codec(kv)), 40)
    assert decode(llama, PROMPT, kvcache.new_cache(llama, "static", max_len=64, codec=Q.kv_codec(kv)), 40) == dyn
    ids = torch.tensor([PROMPT + dyn])
    pos = torch.arange(ids.shape[1])
    full = llama(ids, pos, kvcache.new_cache(llama, "dynamic"))
    quant = llama(ids, pos, kvcache.new_cache(llama, "dynamic", codec=Q.kv_codec(kv)))
    rel = (quant - full).norm() / full.norm()
    assert 0 < rel < (0.02 if kv == "int8" else 0.06)


def test_quantized_cache_crop_and_fork(llama):
    cache = kvcache.new_cache(llama, "dynamic", codec=Q.kv_codec("int8"))
    first = decode(llama, PROMPT, cache, 30)
    # crop back to the prompt and decode again: the same continuation
    cache.crop(len(PROMPT) - 1)
    assert decode(llama, PROMPT[-1:], cache, 30) == first
    # a fork shares the bytes (scales included) until it writes, then goes its own way
    cache.crop(len(PROMPT) + 10)
    twin = cache.fork()
    assert twin.k[0].data_ptr() == cache.k[0].data_ptr() and twin.nbytes == cache.nbytes
    a = decode(llama, [first[10]], twin, 10)
    assert twin.k[0].data_ptr() != cache.k[0].data_ptr()
    assert a == first[11:21]
    b = decode(llama, [first[10]], cache, 10)
    assert b == a


def test_quantized_cache_bytes_include_scales(llama):
    c = llama.config
    for kv, row in [("int8", c.head_dim + 2), ("fp8", c.head_dim + 2), ("fp8-plain", c.head_dim)]:
        cache = kvcache.new_cache(llama, "static", max_len=50, codec=Q.kv_codec(kv))
        assert cache.nbytes == 2 * c.n_layers * c.n_kv_heads * 50 * row
    full = kvcache.new_cache(llama, "static", max_len=50)
    assert full.nbytes == 2 * c.n_layers * c.n_kv_heads * 50 * c.head_dim * 4   # fp32 model


def test_attention_over_a_quantized_cache_is_close():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    exact = M.attend(q, k, v, None)
    for name, tol in [("int8", 0.01), ("fp8", 0.04), ("fp8-plain", 0.06)]:
        codec = Q.kv_codec(name)
        kq, vq = codec.decode(codec.encode(k), torch.float32), codec.decode(codec.encode(v), torch.float32)
        rel = (M.attend(q, kq, vq, None) - exact).norm() / exact.norm()
        assert 0 < rel < tol, name


# --- weights -----------------------------------------------------------------------

def test_simple_int8_linear_equals_int8_linear(llama):
    """The smallest quantized layer stores Int8Linear's very bytes and scales and computes its
    output (the kernel sums in its own order: equal up to float rounding); a model of them decodes
    the greedy tokens of quantize_model's int8."""
    torch.manual_seed(3)
    w = torch.randn(96, 128)
    simple, general = Q.SimpleInt8Linear(w), Q.Int8Linear.from_float(w)
    assert simple.weight.dtype == torch.int8 and torch.equal(simple.weight, general.weight)
    assert torch.equal(simple.weight_scale[:, 0], general.weight_scale)
    assert torch.equal(Q.dequantize_int8(simple.weight, simple.weight_scale), general.dequantized())
    for rows in (1, 5, Q.PREFILL_ROWS + 3):    # aten's int8 kernel, then the widened matmul
        x = torch.randn(rows, 128)
        torch.testing.assert_close(simple(x), general(x))
    general.prepare(torch.bfloat16)
    x = torch.randn(5, 128).bfloat16()
    torch.testing.assert_close(simple(x), general(x), atol=0.05, rtol=0.02)
    small = copy.deepcopy(llama)
    for name, lin in Q.quantized_layers(small).items():
        Q.replace_layer(small, name, Q.SimpleInt8Linear(lin.weight.detach()))
    int8 = Q.quantize_model(copy.deepcopy(llama), "int8")
    assert isinstance(int8.lm_head, Q.Int8Linear) and isinstance(small.lm_head, Q.SimpleInt8Linear)
    assert decode(small, PROMPT, None, 30) == decode(int8, PROMPT, None, 30)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_linear_equals_its_dequantized_matrix(scheme, dtype):
    torch.manual_seed(0)
    w, x = torch.randn(96, 128), torch.randn(5, 1, 128).to(dtype)
    layer = Q.Int8Linear.from_float(w) if scheme == "int8" else Q.Int4Linear.from_float(w, 32)
    reference = x.float() @ layer.dequantized().float().t()        # before prepare: the portable layout
    layer.prepare(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (5, 1, 96)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((y.float() - reference).norm() / reference.norm()) < tol
    # and the quantized matrix is close to the original
    exact = x.float() @ w.t()
    assert ((reference - exact).norm() / exact.norm()) < (0.01 if scheme == "int8" else 0.12)


def test_compiled_int8_decode_equals_eager(tmp_path):
    """Inside the compiled step kernels.Int8Linear is a multiply-and-sum loop, not the eager kernel:
    same tokens."""
    path = make_checkpoint(tmp_path / "m", num_hidden_layers=2)
    runs = []
    for compiled in (False, True):
        model = Q.quantize_model(M.Llama.from_pretrained(path, "cpu", "float32"), "int8", prepare=False)
        kernels.swap_quantized(model, torch.float32, native=False)     # aten's kernel when eager
        model.config.eos_ids = []
        if compiled:
            kernels.compile_decode(model)
        runs.append(decode(model, PROMPT, kvcache.new_cache(model, "static", max_len=64), 30))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_saved_checkpoint_matches_on_the_fly(tmp_path, scheme):
    src = make_checkpoint(tmp_path / "src", tie_word_embeddings=True)
    rc, out, err = run_cli("bench.py", "quantize", "--model", str(src), "--weights", scheme, "--group-size", "32",
                           "--dtype", "float32", "--out", str(tmp_path / "q"))
    assert rc == 0, err
    assert json.loads((tmp_path / "q" / "config.json").read_text())[Q.CONFIG_KEY]["weights"] == scheme
    loaded, tok = nl.load(nl.RunConfig(str(tmp_path / "q")))
    fly, _ = nl.load(nl.RunConfig(str(src), weights=scheme, group_size=32))
    assert isinstance(loaded.layers[0].mlp.down_proj, Q.Int8Linear if scheme == "int8" else Q.Int4Linear)
    assert isinstance(loaded.lm_head, Q.Int8Linear)          # int4 keeps the head in int8
    ids = torch.tensor([PROMPT])
    assert torch.equal(loaded(ids, torch.arange(len(PROMPT))), fly(ids, torch.arange(len(PROMPT))))
    assert decode(loaded, PROMPT, None, 40) == decode(fly, PROMPT, None, 40)
    assert Q.weight_bytes(loaded) < Q.weight_bytes(nl.load(nl.RunConfig(str(src)))[0]) / 2
    # the plain lesson loader names the one that reads it
    with pytest.raises(ValueError, match=f"holds {scheme} weights written by quantize.py: load it with "
                                         f"quantize.from_pretrained"):
        M.Llama.from_pretrained(tmp_path / "q", "cpu", "float32")


# --- a file's own bits: int8 in groups, 16-bit weights, biases -------------------------

def grouped_int8(n: int, k: int, group: int, has_min: bool, bias: bool = False) -> Q.Int8Linear:
    """An Int8Linear as a GGUF's 5-8-bit blocks load into it: q in -32..31 (Q6_K's range)."""
    layer = Q.Int8Linear(k, n, group, has_min, bias)
    layer.weight = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    layer.weight_scale = torch.rand(n, k // group) * 0.01 + 1e-3
    if has_min:
        layer.weight_min = -torch.rand(n, k // group) * 0.1
    if bias:
        layer.bias = torch.randn(n)
    return layer


@pytest.mark.parametrize("group,has_min", [(16, False), (32, False), (32, True)])
def test_grouped_int8_linear_is_its_formula(group, has_min):
    """W[r, k] = lo[r, k // g] + q[r, k] · s[r, k // g]; the forward is x·Wᵀ + b, in fp32 and in bf16
    (the scales stay fp32 through prepare: rounding them to bf16 would move whole groups)."""
    torch.manual_seed(group)
    layer = grouped_int8(45, 96, group, has_min, bias=True)
    cols = torch.arange(96) // group
    lo = layer.weight_min[:, cols] if has_min else 0
    w = layer.dequantized()
    assert torch.equal(w, lo + layer.weight.float() * layer.weight_scale[:, cols])
    assert layer.weight_scale.shape == (45, 96 // group)
    x = torch.randn(3, 4, 96)
    for dtype in (torch.float32, torch.bfloat16):
        layer.prepare(dtype)
        assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.dequantized(), w)
        y = layer(x.to(dtype))
        assert y.dtype == dtype
        exact = x.to(dtype).float() @ w.t() + layer.bias
        torch.testing.assert_close(y.float(), exact, **({} if dtype == torch.float32
                                                        else dict(atol=0.05, rtol=0.02)))


def test_half_linear_keeps_16_bits_and_widens_exactly():
    """fp16 and bf16 weights stay 2 bytes each; fp32 activations see the exact widened values, bf16
    ones too (fp16 weights then widen to fp32, not to bf16, which would round them)."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 64)
    for dtype in (torch.float16, torch.bfloat16):
        layer = Q.HalfLinear(64, 30, dtype, bias=True)
        layer.weight, layer.bias = torch.randn(30, 64).to(dtype), torch.randn(30)
        layer.prepare(torch.float32)
        w = layer.dequantized()
        assert layer.weight.dtype == dtype and w.dtype == torch.float32
        assert torch.equal(w, layer.weight.float()) and torch.equal(Q.float_weight(layer), w)
        torch.testing.assert_close(layer(x), x @ w.t() + layer.bias)
        y = layer(x.bfloat16())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x.bfloat16().float() @ w.t() + layer.bias, atol=0.1,
                                   rtol=0.01)
        assert Q.weight_bytes(layer) == 30 * 64 * 2 + 30 * 4


def test_int4_linear_adds_its_bias():
    torch.manual_seed(2)
    layer = Q.Int4Linear(64, 48, 32, bias=True)
    q, layer.weight_scale, layer.weight_min = Q.quantize_int4(torch.randn(48, 64), 32)
    layer.weight, layer.bias = Q.join_nibbles(q), torch.randn(48)
    w, x = layer.dequantized(), torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias)
    layer.prepare(torch.float32)                              # aten's tiled layout
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, atol=1e-4, rtol=1e-4)


def test_every_stored_layer_counts_as_quantized():
    """quantize.STORED names the layers that hold their own bits: float_weight widens each, and a
    model holding one is not quantized again."""
    assert set(Q.STORED) == {Q.Int8Linear, Q.Int4Linear, Q.HalfLinear}
    net = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), Q.HalfLinear(64, 64))
    with pytest.raises(ValueError, match="already quantized"):
        Q.quantize_model(net, "int8")


# --- bad input ------------------------------------------------------------------

def test_stored_layers_refuse_bad_shapes_in_one_line():
    with pytest.raises(ValueError, match=r"^int8 groups of 32 do not divide a row of 48 weights; "
                                         r"give a group that divides it"):
        Q.Int8Linear(48, 8, group=32)
    with pytest.raises(ValueError, match="a minimum needs groups"):
        Q.Int8Linear(64, 8, has_min=True)
    with pytest.raises(ValueError, match="float16 or bfloat16 weights"):
        Q.HalfLinear(64, 8, torch.float32)


def test_the_demo_names_the_commands_it_does_not_run(monkeypatch, capsys):
    """`python quantize.py` is the round-trip demo; a flag gets the bench command that does it."""
    monkeypatch.setattr(sys, "argv", ["quantize.py", "--eval"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(Q.__file__, run_name="__main__")     # as `python quantize.py --eval`
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and "Traceback" not in err
    assert "`python bench.py quantize --eval`" in err and "--weights int4 --out DIR" in err


def test_unknown_schemes_are_refused():
    with pytest.raises(ValueError, match="unknown --weights 'int3': use auto, float, int8 or int4"):
        Q.check_scheme("int3")
    with pytest.raises(ValueError, match="group size must be one of"):
        Q.check_scheme("int4", 48)
    with pytest.raises(ValueError, match="unknown --kv-dtype 'int2'"):
        Q.kv_codec("int2")


def test_requantizing_and_corrupt_scales_are_one_line_errors(tmp_path, capsys):
    src = make_checkpoint(tmp_path / "src")
    q = tmp_path / "q"
    assert run_cli("bench.py", "quantize", "--model", str(src), "--weights", "int8", "--out", str(q))[0] == 0
    rc, out, err = run_cli("bench.py", "quantize", "--model", str(q), "--weights", "int8", "--out", str(tmp_path / "qq"))
    assert rc == 1 and err.strip().startswith("error: ") and "already quantized" in err and "Traceback" not in err
    # the runner in process: exit status 1, one "error: " line, no traceback
    fails_with(capsys, ["--model", str(q), "--weights", "int4", "--prompt", "hi"], "already quantized (int8)")
    # a scale that is NaN or zero would silently wreck one layer: refused by name
    from safetensors.torch import load_file, save_file
    state = load_file(q / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    state[name][3] = float("nan")
    save_file(state, q / "model.safetensors")
    fails_with(capsys, ["--model", str(q), "--prompt", "hi"],
               "corrupt quantized checkpoint: layers.1.mlp.down_proj.weight_scale has 1 invalid values")
    # a scheme this version does not know
    cfg = json.loads((q / "config.json").read_text())
    cfg[Q.CONFIG_KEY] = {"weights": "int3"}
    (q / "config.json").write_text(json.dumps(cfg))
    fails_with(capsys, ["--model", str(q), "--prompt", "hi"], "quantization scheme 'int3'")


def test_runner_with_int8_weights_and_int8_kv_still_knows_paris(cache_home):
    rc, out, err = run_cli("serve_local.py", "--prompt", "What is the capital of France?", "--temperature", "0",
                           "--max-new-tokens", "20", "--dtype", "bf16", "--weights", "int8", "--kv-dtype", "int8",
                           env={"XDG_CACHE_HOME": str(cache_home), "OMP_NUM_THREADS": "1"})
    assert rc == 0, err
    assert "Paris" in out and "weights int8" in err


def test_a_layer_with_a_bias_keeps_it_when_quantized(tmp_path):
    """Qwen2's q/k/v carry a bias: quantized, a layer keeps it as it was (it is not rounded) and
    adds it on every path; the int8 model stays close to the float one, and a checkpoint of it
    loads back with the bias."""
    import model as M
    from conftest import make_qwen_checkpoint
    path = make_qwen_checkpoint(tmp_path / "qwen2", "qwen2")
    full = M.Llama.from_pretrained(path)
    bias = full.layers[0].self_attn.qkv_proj.bias.detach().clone()
    small = Q.quantize_model(M.Llama.from_pretrained(path), "int8")
    layer = small.layers[0].self_attn.qkv_proj
    assert isinstance(layer, Q.Int8Linear) and torch.equal(layer.bias, bias)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        want, got = full(ids, torch.arange(7)), small(ids, torch.arange(7))
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    x = torch.randn(3, layer.in_features)
    assert torch.allclose(layer(x), x @ layer.dequantized().t() + bias, atol=1e-5)
    import safetensors_io
    config = safetensors_io.read_config(path) | {Q.CONFIG_KEY: Q.scheme(small)}
    back = Q.from_pretrained(safetensors_io.save(tmp_path / "q", M.unfuse(small), config, path))
    assert torch.equal(back.layers[0].self_attn.qkv_proj.bias, bias)
    with torch.no_grad():
        assert torch.equal(back(ids, torch.arange(7)), got)