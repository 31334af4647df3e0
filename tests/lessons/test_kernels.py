"""kernels.py: the device-specific fast paths give the plain computation's values."""

import pytest
import torch

import kernels
import quantize


def test_linear_uses_onednn_for_fp32_inference_and_keeps_gradients():
    """kernels.linear: eager fp32 inference goes through oneDNN (MKL's small-batch
    sgemm is slow on some CPUs); same values as F.linear, and training still gets
    F.linear's gradients."""
    assert kernels.ONEDNN                     # every CPU wheel of torch ships oneDNN
    layer = torch.nn.Linear(64, 300, bias=False)
    for t in (1, 3, 8):
        x = torch.randn(2, t, 64)
        with torch.inference_mode():
            torch.testing.assert_close(kernels.linear(x, layer), torch.nn.functional.linear(x, layer.weight),
                                       atol=1e-5, rtol=1e-5)
    x = torch.randn(1, 3, 64, requires_grad=True)
    kernels.linear(x, layer).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear(dtype):
    """kernels.prepack: big Linears get oneDNN's blocked copy of their weight, used
    by eager CPU inference for any number of rows, with F.linear's values; a
    swapped weight is used as it is (the stale copy is not), and with
    gradients on it is F.linear again."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bf16 oneDNN kernels")
    net = torch.nn.Sequential(torch.nn.Linear(512, 640, bias=False), torch.nn.Linear(64, 32, bias=False)).to(dtype)
    kernels.prepack(net)
    big, small = net
    assert isinstance(big, kernels.Linear) and big.onednn[0] is big.weight and big.onednn[1].is_mkldnn
    assert small.onednn is None
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    swapped = torch.nn.Parameter(torch.randn(640, 512, dtype=dtype))
    with torch.inference_mode():
        for rows in (1, 2, 4, 11):
            x = torch.randn(2, rows, 512, dtype=dtype)
            torch.testing.assert_close(kernels.linear(x, big), torch.nn.functional.linear(x, big.weight), **tol)
        twice = torch.ops.mkldnn._reorder_linear_weight(2 * big.weight, 16)     # proof the copy is what runs
        big.onednn = (big.weight, twice)
        torch.testing.assert_close(kernels.linear(x, big), 2 * torch.nn.functional.linear(x, big.weight), **tol)
        big.weight = swapped
        torch.testing.assert_close(kernels.linear(x, big), torch.nn.functional.linear(x, big.weight), **tol)
        kernels.prepack(net)
        assert big.onednn[0] is big.weight
        torch.testing.assert_close(kernels.linear(x, big), torch.nn.functional.linear(x, big.weight), **tol)
    x = torch.randn(1, 3, 512, dtype=dtype, requires_grad=True)
    kernels.linear(x, big).sum().backward()
    assert big.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bias_survives_every_path(dtype):
    """A Linear with a bias (Qwen2's q/k/v) is swapped and prepacked like any other, and every
    path of `linear` adds it: F.linear, oneDNN on the plain and the prepacked weight, and the
    multiply-and-sum of a compiled one-token step."""
    layer = torch.nn.Linear(512, 640).to(dtype)
    torch.nn.init.normal_(layer.bias, 0, 1.0)
    net = torch.nn.Sequential(layer)
    x = torch.randn(2, 3, 512, dtype=dtype)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    kernels.swap_linears(net)
    fast = net[0]
    assert isinstance(fast, kernels.Linear) and fast.bias is layer.bias
    with torch.inference_mode():
        torch.testing.assert_close(net(x), want, **tol)
        kernels.prepack(net)
        torch.testing.assert_close(net(x), want, **tol)
        one = torch.compile(lambda t: kernels.linear(t, fast), fullgraph=True)(x[:, :1])
    torch.testing.assert_close(one, want[:, :1], **tol)


@pytest.mark.parametrize("k", [256, 4608])
def test_compiled_matvec_equals_linear(k):
    """Inside a compiled step `linear` is a multiply-and-sum; rows over 4,096 long
    are summed as two halves (matvec_sum). Both equal F.linear."""
    layer = torch.nn.Linear(k, 96, bias=False)
    x = torch.randn(1, 1, k)
    step = torch.compile(lambda x: kernels.linear(x, layer), dynamic=False, fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(step(x), torch.nn.functional.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kernels.matvec_sum(x, layer.weight), torch.nn.functional.linear(x, layer.weight),
                                   atol=1e-4, rtol=1e-4)
        # int8 rows and their scales take the same path (kernels.Int8Linear)
        q8 = kernels.Int8Linear.from_float(layer.weight)
        q8.prepare(torch.float32, native=False)
        step8 = torch.compile(lambda x: q8(x), dynamic=False, fullgraph=True)
        torch.testing.assert_close(step8(x), torch.nn.functional.linear(x, q8.dequantized()), atol=1e-4, rtol=1e-4)


# --- the C++ int4/int8 kernels ------------------------------------------------------

def native_or_skip():
    if not kernels.native_kernels(quiet=True):
        pytest.skip("no C++ compiler or ninja here: the quantized layers run aten's kernels")


def quantized_pair(scheme, w, group):
    """The same quantized layer twice: on the C++ kernel (kernels.swap_quantized's form) and on
    aten's (quantize.py's own)."""
    make = (lambda: quantize.Int8Linear.from_float(w)) if scheme == "int8" else \
        (lambda: quantize.Int4Linear.from_float(w, group))
    native, aten = torch.nn.Sequential(make()), make()
    reference = aten.dequantized()
    native = kernels.swap_quantized(native, torch.float32)[0]
    aten.prepare(torch.float32)
    assert native.native and type(aten) in (quantize.Int8Linear, quantize.Int4Linear)
    return native, aten, reference


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_native_kernels_equal_aten_and_the_dequantized_matrix(scheme, group):
    native_or_skip()
    torch.manual_seed(0)
    w = torch.randn(176, 384) * 0.05       # aten needs rows in 16s
    native, aten, reference = quantized_pair(scheme, w, group)
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 9, 40):               # 40: a prefill, through the widened matrix
            x = torch.randn(1, rows, 384)
            exact = x @ reference.t()
            for y in (native(x), aten(x)):
                assert y.shape == (1, rows, 176)
                assert (y - exact).abs().max() < 1e-4 * exact.abs().max()
            assert (native(x) - aten(x)).abs().max() < 1e-4


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_native_kernels_are_batch_invariant(scheme):
    """Each position of a several-row pass gets the bits a one-row call gives it: what keeps
    speculative decoding exact with quantized weights."""
    native_or_skip()
    torch.manual_seed(1)
    layer = quantized_pair(scheme, torch.randn(96, 160 * 2) * 0.05, 32)[0]
    x = torch.randn(7, 320)
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(7)])
    assert torch.equal(together, alone)


def test_bf16_kernel_in_the_compiled_step():
    """bf16 weights in a compiled one-token step: kernels.bf16_mm (fp32 sums, rounded to bf16), with the
    plain product's values; each row of a several-row call gets a one-row call's bits (on an Intel CPU a
    one-row call over rows of 2048 or more takes 8 weight rows at a time, 99 = 12 · 8 + 3 here, and over
    shorter rows prefetches; a several-row call takes one row at a time)."""
    native_or_skip()
    for k in (5632, 576):
        check_bf16_kernel(k)


def check_bf16_kernel(k: int):
    torch.manual_seed(3)
    layer = torch.nn.Linear(k, 99, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 1, k, dtype=torch.bfloat16)
    exact = (x.double() @ layer.weight.double().t()).float()
    step = torch.compile(lambda x: kernels.linear(x, layer), dynamic=False, fullgraph=True)
    with torch.inference_mode():
        y = step(x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, kernels.bf16_mm(x[0], layer.weight)[None])
        torch.testing.assert_close(y.float(), exact, atol=0.02, rtol=0.01)
        rows = torch.randn(7, k, dtype=torch.bfloat16)
        assert torch.equal(kernels.bf16_mm(rows, layer.weight),
                           torch.cat([kernels.bf16_mm(rows[i:i + 1], layer.weight) for i in range(7)]))


def test_huge_pages_keep_the_tensors_and_their_values():
    """kernels.huge_pages moves tensors in place into one 2 MB-page buffer: the same objects, the same
    values after the caller's other references are gone; where Linux offers no huge pages, nothing moves."""
    a, b = torch.randn(1000, 3), torch.randint(0, 255, (77,), dtype=torch.uint8)
    copies = [a.clone(), b.clone()]
    moved = kernels.huge_pages([a, b])
    import gc
    gc.collect()
    assert torch.equal(a, copies[0]) and torch.equal(b, copies[1])
    if moved:
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
        a += 1                                          # still an ordinary, writable tensor
        assert torch.equal(a, copies[0] + 1)


@pytest.mark.parametrize("B,H,H_kv,d,L", [(1, 9, 3, 64, 1), (1, 9, 3, 64, 200), (2, 8, 2, 32, 70), (3, 4, 4, 128, 65)])
def test_decode_attention_kernel_equals_sdpa(B, H, H_kv, d, L):
    """kernels.cpp's one-token attention against PyTorch's SDPA: GQA, K/V read as a static cache's
    slices (strided), masks per batch row or shared, lengths across its 64-key chunks."""
    native_or_skip()
    torch.manual_seed(2)
    q = torch.randn(B, H, 1, d)
    k, v = (torch.randn(B, H_kv, 256, d)[:, :, :L] for _ in range(2))
    masks = [None, torch.rand(B, 1, 1, L) > 0.4, torch.ones(1, L, dtype=torch.bool)]
    masks[1][..., -1] = True
    for mask in masks:
        y = kernels.decode_attention(q, k, v, mask)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != H_kv)
        torch.testing.assert_close(y, ref, atol=2e-6, rtol=1e-5)
        # a bf16 cache: read as stored, summed in fp32, the result rounded once to bf16
        bf = kernels.decode_attention(*(t.bfloat16() for t in (q, k, v)), mask)
        exact = torch.nn.functional.scaled_dot_product_attention(*(t.bfloat16().double() for t in (q, k, v)),
                                                                 attn_mask=mask, enable_gqa=H != H_kv)
        assert bf.dtype == torch.bfloat16
        torch.testing.assert_close(bf.double(), exact, atol=1e-2, rtol=8e-3)
    assert kernels.decode_attention(q.double(), k.double(), v.double(), None) is None        # fp32 or bf16 only
    assert kernels.decode_attention(q, k, v, torch.ones(B, H, 1, L, dtype=torch.bool)) is None       # per head: not here
