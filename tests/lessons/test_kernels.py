"""kernels.py: the device-specific fast paths give the plain computation's values."""

import itertools
import os

import pytest
import torch

import kernels
import kvcache
from engine import Engine
import model as M
import quantize
import safetensors_io
from conftest import make_checkpoint


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


def test_big_matrices_give_the_same_bits_on_any_number_of_threads():
    """A matrix of 2 MB or more is read in runs that the threads take in turn (stream_items):
    which thread computes a row must not change its bits, nor may a run be left out or taken
    twice (a partial last run included)."""
    native_or_skip()
    torch.manual_seed(2)
    n, k = 2304, 2048          # int4 rows of 1 KB: 9 runs of 256 KB; fp16 rows of 4 KB: 36
    q4, s4, lo4 = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // 32),
                   torch.randn(n, k // 32))
    q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32).half()
    w16, srow = torch.randn(n, k).half(), torch.rand(n)
    ops = torch.ops.nanoinfer
    calls = [lambda x: ops.int4_mm(x, q4, s4, lo4, 32), lambda x: ops.int4_x8_mm(x, q4, s4, lo4, 32),
             lambda x: ops.int8g_mm(x, q8, s8, None, 32), lambda x: ops.half_mm(x, w16),
             lambda x: ops.int8_mm(x, q8, srow)]
    threads = torch.get_num_threads()
    try:
        for x in (torch.randn(1, k), torch.randn(3, k)):
            torch.set_num_threads(1)
            alone = [call(x) for call in calls]
            torch.set_num_threads(2)
            for call, y in zip(calls, alone):
                assert torch.equal(call(x), y)
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(alone[3], x @ w16.float().T, rtol=1e-4, atol=1e-3)


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


def status_mb(field: str) -> float:
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def resident_file_mb() -> float:
    return status_mb("RssFile")


def test_weights_moved_out_of_a_mapped_checkpoint_are_resident_once(tmp_path):
    """A checkpoint's tensors are views of its memory-mapped file: huge_pages copies them and gives
    the file's pages back (file_pages_out), so the process holds the weights once, not the copy and
    the mapped file both (a GGUF conversion's F16 weights had peaked at twice the file). The
    values stay, and the tensors left in the file still read right."""
    from safetensors.torch import save_file
    import safetensors_io
    torch.manual_seed(0)
    state = {"w": torch.randn(4096, 2048), "small": torch.randn(3, 5)}
    save_file(state, tmp_path / "model.safetensors")
    read = safetensors_io.read_weights(tmp_path)
    before = resident_file_mb()
    assert torch.equal(read["w"], state["w"])                   # faults the 32 MB in
    assert resident_file_mb() - before > 24
    open("/proc/self/clear_refs", "w").write("5")              # the peak (VmHWM) from here
    rss = status_mb("VmRSS")
    if not kernels.huge_pages([read["w"]]):
        pytest.skip("no transparent huge pages here")
    assert resident_file_mb() - before < 8
    # a piece at a time (COPY_PIECE): the file's pages leave as the copy grows, never both whole
    assert status_mb("VmHWM") - rss < 16
    assert torch.equal(read["w"], state["w"]) and torch.equal(read["small"], state["small"])


def test_an_embedding_table_in_a_mapped_file_holds_the_rows_read(tmp_path):
    """kernels.rows_on_demand: a table in a mapped checkpoint (an embedding: a prompt reads a few
    hundred of its rows) takes memory for the pages around the rows read (at most Linux's
    fault-around window of 16 pages each), not the file cache's large folios around each (the
    whole 32 MB table for 26 rows, on this machine's file system, without it); the rows read are
    the table's."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    table = torch.randn(8192, 1024)                             # rows of 4 KB
    save_file({"table": table}, tmp_path / "model.safetensors")
    fd = os.open(tmp_path / "model.safetensors", os.O_RDONLY)
    os.fsync(fd)            # as a cache written by an earlier start: its pages clean
    os.close(fd)
    read = safetensors_io.read_weights(tmp_path)["table"]
    if not kernels.rows_on_demand([read]):
        pytest.skip("no mapped file seen here (/proc/self/maps)")
    ids = torch.arange(0, 8192, 320)
    assert torch.equal(read[ids], table[ids])
    assert mapped_mb(tmp_path / "model.safetensors") < 26 * 17 * 4 / 1024  # 17 pages a row at most


def mapped_mb(path) -> float:
    """What this process holds of the file at ``path`` (/proc/self/smaps: its mappings' Rss)."""
    kb, mine = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:            # a mapping's first line
            mine = fields[-1] == str(path)
        elif mine and fields[0] == "Rss:":
            kb += int(fields[1])
    return kb / 1024


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


# --- a GGUF at its own bits: int8 in groups, fp16/bf16 weights, the tiled prefill --------------------

@pytest.fixture(scope="module")
def builds():
    """kernels.cpp as built for this CPU (torch.ops.nanoinfer) and built again, each as a library of its
    own in this process, for the other instruction sets this CPU runs: AVX2 (on an AVX-512 machine) and
    none (plain C++, -DLIBRARY names the library). Every build must give every output the same bits."""
    native_or_skip()
    mine = torch.backends.cpu.get_cpu_capability()
    libs = {mine: torch.ops.nanoinfer}
    others = [("AVX2", kernels.VECTOR_FLAGS["AVX2"])] if mine == "AVX512" else []
    if kernels.vector_flags() != kernels.VECTOR_FLAGS.get(mine, []):      # built with VNNI: without
        others.append(("AVX512_plain", kernels.VECTOR_FLAGS["AVX512"]))
    for name, flags in others + ([("scalar", [])] if mine in kernels.VECTOR_FLAGS else []):
        assert kernels.build_kernels(f"nanoinfer_{name.lower()}", flags, quiet=True)
        libs[name] = getattr(torch.ops, f"nanoinfer_{name.lower()}")
    return libs


def same_bits_everywhere(builds, call, x):
    """call(lib, x) in every build, for all of x's rows at once and one row at a time: one result."""
    first = call(next(iter(builds.values())), x)
    for name, lib in builds.items():
        assert torch.equal(call(lib, x), first), name
        assert torch.equal(torch.cat([call(lib, x[i:i + 1]) for i in range(len(x))]), first), name
    return first


def near(y, exact, terms, k):
    """Within a few fp32 roundings per term of each sum, relative to Σ|term|."""
    assert ((y.double() - exact).abs() <= terms * k * 2 ** -23 + 1e-30).all()


@pytest.mark.parametrize("k", [576, 2048])
@pytest.mark.parametrize("group,has_min", [(16, False), (16, True), (32, False), (32, True)])
def test_int8g_kernel(builds, k, group, has_min):
    """int8g_mm: W = lo + q·s per group of 16 or 32; the exact product within float error, and the same
    bits in every build, for 7 rows and for each row alone; 77 weight rows (odd: the tiles' tails)."""
    torch.manual_seed(k + group + has_min)
    n = 77
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n, k // group) * 0.01 + 1e-3
    lo = -torch.rand(n, k // group) * 0.1 if has_min else None
    w = (q.double().view(n, -1, group) * s.double()[..., None]
         + (0 if lo is None else lo.double()[..., None])).view(n, k)      # exact
    x = torch.randn(7, k)                                                  # tiles of 4 + 3
    y = same_bits_everywhere(builds, lambda lib, x: lib.int8g_mm(x, q, s, lo, group), x)
    near(y, x.double() @ w.t(), x.double().abs() @ w.abs().t(), k)


@pytest.mark.parametrize("k", [576, 2048])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_kernel(builds, k, dtype):
    """half_mm: fp32 x against fp16 or bf16 weights widened as read, fp32 out."""
    torch.manual_seed(k)
    w, x = (torch.randn(61, k) * 0.05).to(dtype), torch.randn(5, k)
    y = same_bits_everywhere(builds, lambda lib, x: lib.half_mm(x, w), x)
    assert y.dtype == torch.float32
    near(y, x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t(), k)


def test_older_kernels_give_every_build_the_same_bits(builds):
    """int4_mm, int8_mm and bf16_mm: the same bits in every build too."""
    torch.manual_seed(4)
    q4, s4, lo4 = torch.randint(0, 256, (50, 288), dtype=torch.uint8), torch.rand(50, 18), torch.randn(50, 18)
    q8, s8 = torch.randint(-127, 128, (50, 576), dtype=torch.int8), torch.rand(50)
    w16, x = torch.randn(50, 576).bfloat16(), torch.randn(5, 576)
    for rows in (x, torch.randn(11, 576), torch.randn(6, 576)):     # tiles 4 + 1, 4 + 4 + 3, 4 + 2
        same_bits_everywhere(builds, lambda lib, x: lib.int4_mm(x, q4, s4, lo4, 32), rows)
    same_bits_everywhere(builds, lambda lib, x: lib.int8_mm(x, q8, s8), x)
    same_bits_everywhere(builds, lambda lib, x: lib.bf16_mm(x.bfloat16(), w16), x)


@pytest.mark.parametrize("k", [576, 2048])
def test_fp16_scales_give_the_bits_of_the_same_scales_in_fp32(builds, k):
    """A GGUF's fp16 scales and minimums (Q4_0, Q4_1, Q8_0: d, m, -8d, of either sign) are read as
    stored and widened exactly: int4_mm, int8g_mm and wide_mm give the bits they give the same
    numbers in fp32, in every build, for every tail of the lanes (k/32 groups: 18 and 64)."""
    torch.manual_seed(k)
    n, x = 77, torch.randn(6, k)                                           # tiles of 4 + 2
    s, lo = (torch.randn(n, k // 32) * 0.01).half(), (torch.randn(n, k // 32) * 0.1).half()
    s16, lo16 = (torch.randn(n, k // 16) * 0.01).half(), (torch.randn(n, k // 16) * 0.1).half()
    q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    calls = [lambda lib, x, a, b: lib.int4_mm(x, q4, a, b, 32),
             lambda lib, x, a, b: lib.int8g_mm(x, q8, a, b, 32),
             lambda lib, x, a, b: lib.int8g_mm(x, q8, a, None, 32)]
    for call in calls:
        y = same_bits_everywhere(builds, lambda lib, x: call(lib, x, s, lo), x)
        assert torch.equal(y, call(torch.ops.nanoinfer, x, s.float(), lo.float()))
    y = same_bits_everywhere(builds, lambda lib, x: lib.int8g_mm(x, q8, s16, lo16, 16), x)
    assert torch.equal(y, torch.ops.nanoinfer.int8g_mm(x, q8, s16.float(), lo16.float(), 16))
    rows = torch.randn(40, k)
    for args in [(q4, s, lo, 32), (q8, s16, lo16, 16), (q8, s, None, 32)]:
        wide = [t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t for t in args]
        for lib in builds.values():
            assert torch.equal(lib.wide_mm(rows, *args), kernels.wide_mm(rows, *wide))


@pytest.mark.parametrize("k", [576, 2048])
def test_int4_nibbles_indexing_sixteen_values(builds, k):
    """A GGUF's IQ4_NL and IQ4_XS: each nibble picks one of 16 int8 numbers (values), no minimum,
    W = values[q]·s with fp16 scales (IQ4_NL's d) or a K-quant's (IQ4_XS's ls - 32 times d):
    int4_mm gives every build the same bits, for several rows and each row alone, within float
    error of the exact product; without values it is the int4 it was (the nibble's own number);
    wide_mm's tiles and AMX (groups of 32) sum the same products, in another order."""
    torch.manual_seed(k)
    n = 77
    values = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                           113], dtype=torch.float32)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    nibbles = torch.stack([q & 15, q >> 4], -1).reshape(n, k).long()
    d = (torch.rand(n, k // 32) * 0.01).half()
    x, rows = torch.randn(6, k), torch.randn(40, k)                        # tiles of 4 + 2; AMX's 32
    cases = [((d, None, 32), d.double())]
    if k % 256 == 0:                            # IQ4_XS: 256-weight super-blocks
        sc, sd = torch.randint(-32, 32, (n, k // 32), dtype=torch.int8), (torch.rand(n, k // 256) * 0.01).half()
        cases.append(((sc, None, 32, sd), sc.double() * sd.double().repeat_interleave(8, 1)))
    for args, s in cases:
        w = values.double()[nibbles] * s.repeat_interleave(32, 1)            # exact
        y = same_bits_everywhere(builds, lambda lib, x: lib.int4_mm(x, q, *args, values=values), x)
        near(y, x.double() @ w.t(), x.double().abs() @ w.abs().t(), k)
        for amx in (False, True):
            for lib in builds.values():
                y = lib.wide_mm(rows, q, *args, amx=amx, values=values)
                near(y, rows.double() @ w.t(), rows.double().abs() @ w.abs().t(), k)
    lo = torch.randn(n, k // 32).half()
    plain = same_bits_everywhere(builds, lambda lib, x: lib.int4_mm(x, q, d, lo, 32), x)
    assert torch.equal(plain, kernels.int4_mm(x, q, d, lo, 32, values=torch.arange(16.)))


@pytest.mark.parametrize("k", [512, 2048])
def test_k_quant_block_scales_give_the_bits_of_the_same_scales_in_fp32(builds, k):
    """A K-quant's scales as the file holds them (an int8 per group times an fp16 per 256
    weights: KScales) give int4_mm, int8g_mm and wide_mm the bits of their products stored in
    fp32, in every build: each product is exact in fp32. Q4_K (int4, groups of 32, a minimum),
    Q6_K (int8, groups of 16, none), Q5_K (int8, groups of 32, a minimum), Q2_K (int8, groups of
    16, a minimum)."""
    torch.manual_seed(k)
    n, x, rows = 77, torch.randn(5, k), torch.randn(40, k)
    d = lambda: (torch.randn(n, k // 256) * 0.01).half()
    sub = lambda group, low=0: torch.randint(low, 64, (n, k // group), dtype=torch.int8)
    q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    q8 = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    cases = [("int4_mm", q4, sub(32), sub(32), 32, d(), d()),          # Q4_K
             ("int8g_mm", q8, sub(16, -64), None, 16, d(), None),      # Q6_K
             ("int8g_mm", q8, sub(32), sub(32), 32, d(), d()),         # Q5_K
             ("int8g_mm", q8 & 3, sub(16), sub(16), 16, d(), d())]     # Q2_K
    for op, q, sc, m, group, sd, md in cases:
        flat = (safetensors_io.block_scaled(sc, sd), safetensors_io.block_scaled(m, md))
        call = lambda lib, x: getattr(lib, op)(x, q, sc, m, group, sd, md)
        y = same_bits_everywhere(builds, call, x)
        assert torch.equal(y, getattr(torch.ops.nanoinfer, op)(x, q, *flat, group))
        for lib in builds.values():
            assert torch.equal(lib.wide_mm(rows, q, sc, m, group, sd, md),
                               kernels.wide_mm(rows, q, *flat, group))


@pytest.mark.parametrize("k", [544, 2048])
def test_int4_in_groups_of_16(builds, k):
    """int4 with two scales a block of 32 (a GGUF's Q3_K and Q2_K): int4_mm the exact product
    within float error, int4_x8_mm its rounded-x arithmetic's, wide_mm the dequantized matrix's;
    the same bits in every build, for 7 rows and each alone (17 blocks: a last quad of one); fp16
    scales and a K-quant's (Q2_K: sc and m 4-bit; Q3_K: sc - 32 for both, lo's d = -4d) read as
    the same numbers in fp32."""
    torch.manual_seed(k)
    n, x, rows = 77, torch.randn(7, k), torch.randn(40, k)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s, lo = (torch.rand(n, k // 16) * 0.01).half(), (torch.randn(n, k // 16) * 0.1).half()
    w = quantize.dequantize_grouped(quantize.split_nibbles(q), s.float(), lo.float()).double()
    terms = x.double().abs() @ w.abs().t()
    y = same_bits_everywhere(builds, lambda lib, x: lib.int4_mm(x, q, s.float(), lo.float(), 16), x)
    near(y, x.double() @ w.t(), terms, 4)
    assert torch.equal(same_bits_everywhere(builds, lambda lib, x: lib.int4_mm(x, q, s, lo, 16), x), y)
    r = same_bits_everywhere(builds, lambda lib, x: lib.int4_x8_mm(x, q, s.float(), lo.float(), 16), x)
    near(r, rounded_x_product(x, q, s.float(), lo.float(), 16)[0], terms, 8)
    wide = kernels.wide_mm(rows, q, s.float(), lo.float(), 16)
    near(wide, rows.double() @ w.t(), rows.double().abs() @ w.abs().t(), 8)
    for lib in builds.values():
        assert torch.equal(lib.wide_mm(rows, q, s, lo, 16), wide)
    if k % 256:
        return
    d = (torch.randn(n, k // 256) * 0.01).half()
    sc = lambda low, high: torch.randint(low, high, (n, k // 16), dtype=torch.int8)
    q3 = sc(-32, 32)
    for scale, m, sd, md in [(sc(0, 16), sc(0, 16), d, -d), (q3, q3, d, -4 * d)]:    # Q2_K, Q3_K
        flat = (safetensors_io.block_scaled(scale, sd), safetensors_io.block_scaled(m, md))
        for op in ("int4_mm", "int4_x8_mm"):
            call = lambda lib, x: getattr(lib, op)(x, q, scale, m, 16, sd, md)
            assert torch.equal(same_bits_everywhere(builds, call, x),
                               getattr(torch.ops.nanoinfer, op)(x, q, *flat, 16))
        for lib in builds.values():
            assert torch.equal(lib.wide_mm(rows, q, scale, m, 16, sd, md),
                               kernels.wide_mm(rows, q, *flat, 16))


def test_decode_rows_from_distant_parts_give_the_bits_of_rows_end_to_end(builds):
    """A decode step's int4 product of a matrix of 256 KB or more takes its rows from distant
    parts of it, row i of each part together (distant_rows, on an Intel CPU; the plain C++ build
    always): each row's sum is the one its rows end to end give, in every build and for several
    rows of x at once; 1027 rows leave a last row or three to take alone. Scales in fp32, fp16,
    a K-quant's (Q4_K), groups of 16, and a table of values (IQ4_NL)."""
    torch.manual_seed(5)
    n, k = 1027, 512
    x = torch.randn(3, k)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s, lo = (torch.rand(n, k // 32) * 0.01).half(), (torch.randn(n, k // 32) * 0.1).half()
    sc = torch.randint(0, 64, (n, k // 32), dtype=torch.int8)
    d = (torch.rand(n, k // 256) * 0.01).half()
    s16, lo16 = (torch.rand(n, k // 16) * 0.01).half(), (torch.randn(n, k // 16) * 0.1).half()
    values = torch.tensor([-127., -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                           113])
    w = quantize.dequantize_grouped(quantize.split_nibbles(q), s.float(), lo.float()).double()
    cases = [((s.float(), lo.float(), 32), {}), ((s, lo, 32), {}), ((sc, sc, 32, d, -d), {}),
             ((s16, lo16, 16), {}), ((s, None, 32), {"values": values})]
    for args, kw in cases:
        y = same_bits_everywhere(builds, lambda lib, x: lib.int4_mm(x, q, *args, **kw), x)
        assert torch.equal(torch.cat([torch.ops.nanoinfer.int4_mm(x, q[i:i + 1], *(
            a[i:i + 1] if isinstance(a, torch.Tensor) else a for a in args), **kw)
            for i in range(n)], dim=1), y)
    near(same_bits_everywhere(builds, lambda lib, x: lib.int4_mm(x, q, s, lo, 32), x),
         x.double() @ w.t(), x.double().abs() @ w.abs().t(), 4)


def test_int8_decode_rows_from_distant_parts_give_the_bits_of_rows_end_to_end(builds):
    """int8g_mm's decode takes its rows from distant parts too (AVX-512 and the plain C++ build):
    int8 values and six-bit ones (Q8_0, Q6_K, Q5_K), with and without minimums, give each row
    the bits of that row alone, in every build."""
    torch.manual_seed(6)
    n, k = 1027, 512
    x = torch.randn(3, k)
    q8 = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    six = safetensors_io.join_sixes(q8)
    s32, s16 = (torch.rand(n, k // 32) * 0.01).half(), (torch.rand(n, k // 16) * 0.01).half()
    sc, m = (torch.randint(0, 64, (n, k // g), dtype=torch.int8) for g in (16, 32))
    d = (torch.rand(n, k // 256) * 0.01).half()
    cases = [(s32, None, 32), (s16, None, 16), (s32, -s32, 32), (sc, None, 16, d, None),
             (m, m, 32, d, -d)]
    for q in (q8, six):
        for args in cases:
            y = same_bits_everywhere(builds, lambda lib, x: lib.int8g_mm(x, q, *args), x)
            rows = [torch.ops.nanoinfer.int8g_mm(x, q[i:i + 1], *(
                a[i:i + 1] if isinstance(a, torch.Tensor) else a for a in args)) for i in range(n)]
            assert torch.equal(torch.cat(rows, dim=1), y)


def test_16_bit_decode_rows_from_distant_parts_give_the_bits_of_rows_end_to_end(builds):
    """half_mm's decode takes its rows from distant parts too (AVX-512 and the plain C++ build):
    fp16 and bf16 weights give each row the bits of that row alone, in every build."""
    torch.manual_seed(7)
    n, k = 1027, 512
    x = torch.randn(3, k)
    for dtype in (torch.float16, torch.bfloat16):
        w = torch.randn(n, k).to(dtype)
        y = same_bits_everywhere(builds, lambda lib, x: lib.half_mm(x, w), x)
        assert torch.equal(torch.cat([torch.ops.nanoinfer.half_mm(x, w[i:i + 1])
                                      for i in range(n)], dim=1), y)


def test_six_bit_values_give_the_bits_of_the_same_values_in_int8(builds):
    """int8 values held in six bits (safetensors_io.join_sixes: a GGUF's 5- and 6-bit blocks) are
    widened to the same int8 values: int8g_mm and wide_mm give the bits those values in int8 give,
    in every build, for groups of 16 and 32, with and without a minimum, with fp32, fp16 or a
    K-quant's scales."""
    torch.manual_seed(9)
    n, k, x, rows = 77, 512, torch.randn(6, 512), torch.randn(40, 512)
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    q[0, :64] = torch.arange(-32, 32)                 # every value, both halves of a block
    six = safetensors_io.join_sixes(q)
    assert six.shape == (n, k * 3 // 4) and torch.equal(safetensors_io.split_sixes(six), q)
    sc = lambda group: torch.randint(-64, 64, (n, k // group), dtype=torch.int8)
    d = lambda: (torch.randn(n, k // 256) * 0.01).half()
    cases = [(torch.rand(n, k // 16), None, 16, None, None),
             (torch.rand(n, k // 32), torch.randn(n, k // 32), 32, None, None),
             (torch.rand(n, k // 32).half(), torch.randn(n, k // 32).half(), 32, None, None),
             (sc(16), None, 16, d(), None),                                          # Q6_K
             (sc(32), sc(32), 32, d(), d())]                                        # Q5_K
    for s, lo, group, sd, md in cases:
        call = lambda lib, x: lib.int8g_mm(x, six, s, lo, group, sd, md)
        y = same_bits_everywhere(builds, call, x)
        assert torch.equal(y, torch.ops.nanoinfer.int8g_mm(x, q, s, lo, group, sd, md))
        for lib in builds.values():
            assert torch.equal(lib.wide_mm(rows, six, s, lo, group, sd, md),
                               torch.ops.nanoinfer.wide_mm(rows, q, s, lo, group, sd, md))


def test_tiled_prefill_equals_the_dequantized_matrix(builds):
    """wide_mm: tiles of W dequantized into a scratch, one fp32 product each (BLAS's for 40 rows of x,
    oneDNN's for 256: kernels.cpp's tile_product), for every stored kind; the tiles hold the same
    values in every build, so the product gives the same bits."""
    torch.manual_seed(5)
    n, k = 300, 576          # 300 rows: tiles and a partial one
    q8, s16, lo16 = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, 36), torch.randn(n, 36)
    q4, s32, lo32 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, 18), torch.randn(n, 18)
    s1, h = torch.rand(n), torch.randn(n, k)
    cases = [((q8, s16, lo16, 16), quantize.dequantize_grouped(q8, s16, lo16)),
             ((q8, s16, None, 16), quantize.dequantize_grouped(q8, s16)),
             ((q8, s1, None, 0), quantize.dequantize_int8(q8, s1[:, None])),
             ((q4, s32, lo32, 32), quantize.dequantize_int4(quantize.split_nibbles(q4), s32, lo32)),
             ((h.half(), None, None, 0), h.half().float()), ((h.bfloat16(), None, None, 0), h.bfloat16().float())]
    for (args, w), x in itertools.product(cases, (torch.randn(40, k), torch.randn(256, k))):
        y = kernels.wide_mm(x, *args)
        torch.testing.assert_close(y, x @ w.t(), atol=1e-5 * float((x.abs() @ w.abs().t()).max()), rtol=0)
        for lib in builds.values():
            assert torch.equal(lib.wide_mm(x, *args), y)


@pytest.mark.parametrize("m,k,n", [(32, 512, 300), (45, 2048, 77), (530, 2048, 600)])
def test_amx_prefill_sums_the_products_of_the_file_weights(m, k, n):
    """wide_mm(amx=True): int4 and int8 values (a byte or six bits each) in groups of 32 on AMX
    where this CPU has it (x in three bf16 pieces that sum back to it, each product exact):
    within fp32's own rounding of the float64 product of the dequantized matrix, as the fp32
    tiles are (with a piece left out it is not); fp16 and K-quant scales give the bits of the
    same scales in fp32. Groups of 16 with a K-quant's scales (Q6_K) run with each int8 sc folded
    into the values (amx_folded), within the same bound, int8 values as six-bit ones; so do Q3_K's
    (its minimum, the scale times -4, folded in: the bits whether or not it shares sc's bytes) and
    Q2_K's and any minimum with its own d (added after the tiles); with fp32 scales they stay on
    the tiles. Without AMX every kind is the tiles' product, bit for bit."""
    native_or_skip()
    torch.manual_seed(m)
    x, q4 = torch.randn(m, k), torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    q8, q6 = (torch.randint(-lim, lim, (n, k), dtype=torch.int8) for lim in (128, 32))
    sub = lambda group: torch.randint(0, 64, (n, k // group), dtype=torch.int8)
    d = lambda: (torch.rand(n, k // 256) * 0.01).half()
    half = lambda group: (torch.rand(n, k // group) * 0.01).half()
    signed = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)         # Q6_K's sc
    q3 = torch.randint(0, 8, (n, k), dtype=torch.uint8)                       # Q3_K: 0..7
    q3 = q3[:, ::2] | q3[:, 1::2] << 4
    q2 = torch.randint(0, 4, (n, k), dtype=torch.uint8)                       # Q2_K: 0..3
    q2 = q2[:, ::2] | q2[:, 1::2] << 4
    sc3, d3 = torch.randint(-32, 32, (n, k // 16), dtype=torch.int8), d()
    kinds = [(q4, quantize.split_nibbles(q4), 32, sub(32), sub(32), d(), d()),       # Q4_K
             (q8, q8, 32, half(32), None, None, None),                              # Q8_0
             (safetensors_io.join_sixes(q6), q6, 32, sub(32), sub(32), d(), d()),   # Q5_K
             (safetensors_io.join_sixes(q6), q6, 16, signed, None, d(), None),      # Q6_K
             (q8, q8, 16, signed, None, d(), None),       # int8 values, the largest sc·q
             (q3, quantize.split_nibbles(q3), 16, sc3, sc3, d3, d3 * -4),            # Q3_K
             (q4, quantize.split_nibbles(q4), 16, signed, signed.clone(), d(), d()),  # own d
             (q2, quantize.split_nibbles(q2), 16, sub(16), sub(16), d(), d())]      # Q2_K
    has = torch.cpu.get_capabilities()
    amx = has.get("amx_bf16") and torch.backends.cpu.get_cpu_capability() == "AVX512"
    for q, values, group, sc, mn, sd, md in kinds:
        if sd is None:
            s, lo = sc.float(), None
        else:
            s = safetensors_io.block_scaled(sc, sd)
            lo = None if mn is None else safetensors_io.block_scaled(mn, md)
        w = quantize.dequantize_grouped(values, s, lo).double()
        y = kernels.wide_mm(x, q, s, lo, group, amx=True)
        bound = float((x.abs() @ w.abs().t().float()).max())
        assert (y.double() - x.double() @ w.t()).abs().max() < 5e-7 * bound
        blocks = kernels.wide_mm(x, q, sc, mn, group, sd, md, amx=True)
        if amx and group == 16:
            assert (blocks.double() - x.double() @ w.t()).abs().max() < 5e-7 * bound
            if mn is sc:            # the minimum folded in whether or not it shares sc's bytes
                assert torch.equal(kernels.wide_mm(x, q, sc, sc.clone(), group, sd, md, amx=True),
                                   blocks)
            elif q.shape[1] * 4 == k * 3:   # six-bit values: the bits of the same values in int8
                assert torch.equal(kernels.wide_mm(x, values, sc, mn, group, sd, md, amx=True),
                                   blocks)
        else:
            assert torch.equal(blocks, y)
        if not amx or group == 16:
            assert torch.equal(y, kernels.wide_mm(x, q, s, lo, group))


# --- int4 with x rounded to 8 bits (asked for: --activations int8) ------------------------------

def rounded_x(x):
    """x with each 32 rounded to int8 times d = max|x|/127 (ties to even), in float64; and d."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    xq = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))[..., None])
    return (xq.double() * d.double()[..., None]).view(m, k), d


def rounded_x_product(x, q, s, lo, group):
    """int4_x8_mm's arithmetic in float64: the file's dequantized weights (lo + q·s) by the rounded
    x, the minimum's share on the rounded x's sums too, as llama.cpp's."""
    xr, d = rounded_x(x)
    w = quantize.split_nibbles(q).double().view(len(q), -1, group) * s.double()[..., None] \
        + lo.double()[..., None]
    return xr @ w.view(len(q), -1).t(), d


@pytest.mark.parametrize("k,group", [(544, 32), (576, 32), (2048, 64), (512, 128), (512, 32)])
def test_int4_with_x_rounded_to_8_bits(builds, k, group):
    """int4_x8_mm: the same bits in every build (integer sums, then one fixed order of float
    ones), for 7 rows and each alone, with 17 and 18 blocks a row (a last quad of 1 and 2); within
    fp32 error of its arithmetic in float64; off the exact product by at most the rounding of x
    (half a step of d per element); fp16 and a K-quant's scales read as the same fp32 ones."""
    torch.manual_seed(k + group)
    n, x = 77, torch.randn(7, k)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s, lo = (torch.rand(n, k // group) * 0.01).half().float(), (torch.randn(n, k // group) * 0.1).half().float()
    y = same_bits_everywhere(builds, lambda lib, x: lib.int4_x8_mm(x, q, s, lo, group), x)
    ref, d = rounded_x_product(x, q, s, lo, group)
    w = (quantize.split_nibbles(q).double().view(n, -1, group) * s.double()[..., None]
         + lo.double()[..., None]).view(n, -1, 32)
    terms = torch.einsum("mc,nck->mn", d.double() * 127, w.abs() + lo.double().abs().repeat_interleave(
        group // 32, dim=1)[..., None])
    near(y, ref, terms, 4)
    exact = kernels.int4_mm(x, q, s, lo, group).double()
    rounding = torch.einsum("mc,nck->mn", d.double() / 2, w.abs())       # half a step of d each
    assert ((y.double() - exact).abs() <= rounding + terms * k * 2 ** -23).all()
    assert not torch.equal(y, exact.float())                  # it is not the exact product
    assert torch.equal(same_bits_everywhere(builds, lambda lib, x: lib.int4_x8_mm(x, q, s.half(), lo.half(),
                                                                                   group), x), y)
    if k % 256 == 0 and group == 32:                                      # Q4_K's scales
        sc, m = (torch.randint(0, 64, (n, k // 32), dtype=torch.int8) for _ in range(2))
        sd, md = ((torch.randn(n, k // 256) * 0.01).half() for _ in range(2))
        call = lambda lib, x: lib.int4_x8_mm(x, q, sc, m, 32, sd, md)
        flat = (safetensors_io.block_scaled(sc, sd), safetensors_io.block_scaled(m, md))
        assert torch.equal(same_bits_everywhere(builds, call, x), kernels.int4_x8_mm(x, q, *flat, 32))


@pytest.mark.parametrize("k,group,six,has_min", [(544, 32, False, True), (576, 16, False, False),
                                                  (512, 16, True, False), (2048, 32, True, True)])
def test_int8_groups_with_x_rounded_to_8_bits(builds, k, group, six, has_min):
    """int8g_x8_mm: int8 values (or six-bit ones) by x rounded as int4_x8_mm rounds it: the same bits
    in every build (VNNI's w + 128 and its correction, the others' |w| by signed x: the same
    integers), for 7 rows and each alone, an odd number of blocks (544) included; within fp32 error of
    its arithmetic in float64; six-bit values give the bits of the same values in int8; a K-quant's
    scales the bits of the same scales in fp32."""
    torch.manual_seed(k + group + six)
    n, x = 77, torch.randn(7, k)
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8) if six else \
        torch.randint(-128, 128, (n, k), dtype=torch.int8)
    stored = safetensors_io.join_sixes(q) if six else q
    s = torch.rand(n, k // group) * 0.01
    lo = torch.randn(n, k // group) * 0.1 if has_min else None
    y = same_bits_everywhere(builds, lambda lib, x: lib.int8g_x8_mm(x, stored, s, lo, group), x)
    assert torch.equal(y, kernels.int8g_x8_mm(x, q, s, lo, group))
    w = q.double().view(n, -1, group) * s.double()[..., None]
    terms = x.double().abs() @ w.abs().view(n, k).t()
    if lo is not None:
        terms += x.double().abs() @ (w.abs() + lo.double().abs()[..., None]).view(n, k).t()
        w = w + lo.double()[..., None]
    near(y, rounded_x(x)[0] @ w.view(n, k).t(), terms, 4)
    if k % 256 == 0:                                                   # Q6_K's or Q5_K's scales
        sc = torch.randint(-64, 64, (n, k // group), dtype=torch.int8)
        sd = (torch.randn(n, k // 256) * 0.01).half()
        m, md = (torch.randint(0, 64, (n, k // group), dtype=torch.int8),
                 (torch.randn(n, k // 256) * 0.01).half()) if has_min else (None, None)
        call = lambda lib, x: lib.int8g_x8_mm(x, stored, sc, m, group, sd, md)
        flat = (safetensors_io.block_scaled(sc, sd),
                None if m is None else safetensors_io.block_scaled(m, md))
        assert torch.equal(same_bits_everywhere(builds, call, x),
                           kernels.int8g_x8_mm(x, stored, *flat, group))


def test_int4_layer_with_x_rounded_runs_every_pass_on_it():
    """swap_quantized(round_x=True): an int4 layer's one-row passes and prefills (40 rows: no fp32
    copy from prepack) all run int4_x8_mm, so each row of a prefill has a step's bits; its repr
    says so (the compiled step's key); a compiled step gives the eager bits."""
    native_or_skip()
    portable = stored_pair("int4", True)[0]
    fast = kernels.swap_quantized(torch.nn.Sequential(portable), torch.float32, round_x=True)[0]
    assert fast.round_x and "x rounded to 8 bits" in repr(fast)
    kernels.prepack(torch.nn.Sequential(fast))
    assert fast.onednn is None
    with torch.inference_mode():
        x = torch.randn(40, 576)
        y = fast(x)
        assert torch.equal(y, torch.cat([fast(x[i:i + 1]) for i in range(40)]))
        assert torch.equal(y, kernels.int4_x8_mm(x, fast.weight, fast.weight_scale, fast.weight_min,
                                                 32) + fast.bias)
        step = torch.compile(fast, dynamic=False, fullgraph=True)
        assert torch.equal(step(x[:1]), y[:1])


@pytest.mark.parametrize("bits", [8, 6])
def test_int8_group_layer_with_x_rounded(bits):
    """swap_quantized(round_x=True) on int8 in groups: one-row passes on int8g_x8_mm; a prefill of
    int8 values too (each row a step's bits), of six-bit values on wide_mm's tiles (exact: they
    widen faster there than the integer loop unpacks them)."""
    native_or_skip()
    portable = stored_pair("int8g32", True)[0]
    if bits == 6:
        portable.weight, portable.bits = safetensors_io.join_sixes(portable.weight), 6
    fast = kernels.swap_quantized(torch.nn.Sequential(portable), torch.float32, round_x=True)[0]
    assert fast.round_x and "x rounded to 8 bits" in repr(fast)
    with torch.inference_mode():
        x = torch.randn(40, 576)
        one = torch.cat([fast(x[i:i + 1]) for i in range(40)])
        assert torch.equal(one[:1], kernels.int8g_x8_mm(x[:1], fast.weight, fast.weight_scale,
                                                        fast.weight_min, 32) + fast.bias)
        if bits == 8:
            assert torch.equal(fast(x), one)
        else:
            exact = x @ portable.dequantized().t() + portable.bias
            torch.testing.assert_close(fast(x), exact, atol=1e-5, rtol=1e-5)


def stored_pair(kind: str, bias: bool):
    """A stored layer twice: quantize.py's (portable) and kernels.swap_quantized's fast form of a copy."""
    torch.manual_seed(6)
    n, k = 99, 576
    if kind == "half":
        layer = quantize.HalfLinear(k, n, torch.float16, bias)
        layer.weight = (torch.randn(n, k) * 0.05).half()
    elif kind == "int4":
        layer = quantize.Int4Linear(k, n, 32, bias)
        q, layer.weight_scale, layer.weight_min = quantize.quantize_int4(torch.randn(n, k) * 0.05, 32)
        layer.weight = quantize.join_nibbles(q)
    else:
        group = int(kind[5:])
        layer = quantize.Int8Linear(k, n, group, group == 32, bias)
        layer.weight = torch.randint(-32, 32, (n, k), dtype=torch.int8)
        layer.weight_scale = torch.rand(n, k // group) * 0.001
        if group == 32:
            layer.weight_min = -torch.rand(n, k // group) * 0.01
    if bias:
        layer.bias = torch.randn(n)
    portable = torch.nn.Sequential(layer)
    tensors = {key: t.data_ptr() for key, t in layer.named_buffers()}
    fast = kernels.swap_quantized(torch.nn.Sequential(layer), torch.float32)[0]
    assert {key: t.data_ptr() for key, t in fast.named_buffers()} == tensors    # the same tensors
    return portable[0], fast


@pytest.mark.parametrize("kind", ["int8g16", "int8g32", "half", "int4"])
def test_fast_stored_layers(kind):
    """kernels.swap_quantized's form of each stored layer: on the C++ kernels, with the portable layer's
    values up to the order of the sums (bias included), each row of a several-row pass with a one-row
    pass's bits, and a prefill (40 rows: wide_mm's tiles) close to the same."""
    native_or_skip()
    for bias in (False, True):
        portable, fast = stored_pair(kind, bias)
        assert fast.native and type(fast) is kernels.FAST[type(portable)]
        assert (fast.bias is not None) == bias
        with torch.inference_mode():
            for rows in (1, 5, 40):
                x = torch.randn(1, rows, 576)
                exact = x @ portable.dequantized().t() + (0 if portable.bias is None else portable.bias)
                torch.testing.assert_close(fast(x), exact, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(portable(x), exact, atol=1e-5, rtol=1e-5)
            x = torch.randn(7, 576)
            assert torch.equal(fast(x), torch.cat([fast(x[i:i + 1]) for i in range(7)]))


def test_new_layers_prefill_without_a_copy_and_compile():
    """prepack: int8 in groups and fp16/bf16 layers keep no fp32 copy (their prefills run wide_mm's tiles)
    and their buffers move to huge pages with the rest; int8 in rows keeps its copy. A compiled one-token
    step calls int8g_mm and half_mm (their fakes trace them): the eager bits."""
    native_or_skip()
    g8, half = stored_pair("int8g32", True)[1], stored_pair("half", True)[1]
    rows = kernels.swap_quantized(torch.nn.Sequential(quantize.Int8Linear.from_float(torch.randn(99, 576))),
                                  torch.float32)[0]
    net = torch.nn.ModuleList([g8, half, rows])
    kernels.prepack(net)
    assert g8.onednn is None and kernels.packed_weight(half) is None and rows.onednn is not None
    if kernels.huge_pages([torch.ones(1)]):                      # where Linux gives 2 MB pages
        assert len({t.untyped_storage().data_ptr() for layer in net for t in layer.buffers()}) == 1
    x = torch.randn(1, 1, 576)
    step = torch.compile(lambda x: [layer(x) for layer in net], dynamic=False, fullgraph=True)
    with torch.inference_mode():
        for compiled, eager in zip(step(x), [layer(x) for layer in net]):
            assert torch.equal(compiled, eager)


def test_compiled_step_ahead_of_time_with_the_new_layers(tmp_path, monkeypatch):
    """compile_decode exports the one-token step (torch.export, AOTInductor) with int8g_mm and half_mm
    inside it: the eager step's tokens (fp32, greedy)."""
    native_or_skip()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = make_checkpoint(tmp_path / "m", tokenizer=False, num_hidden_layers=1)
    runs = []
    for compiled in (False, True):
        torch.manual_seed(7)
        llama = M.Llama.from_pretrained(path, "cpu", "float32")
        block = llama.layers[0]
        for owner, name, layer in [(block.mlp, "gate_up_proj", quantize.HalfLinear(64, 256, bias=True)),
                                   (block.mlp, "down_proj", quantize.Int8Linear(128, 64, 32, True, True)),
                                   (block.self_attn, "o_proj", quantize.Int8Linear(64, 64, 16))]:
            w = getattr(owner, name).weight.detach()
            if isinstance(layer, quantize.HalfLinear):
                layer.weight, layer.bias = w.half(), torch.randn(w.shape[0]) * 0.01
            else:
                scale = w.abs().view(w.shape[0], -1, layer.group).amax(-1) / 31
                layer.weight = torch.round(w / scale.repeat_interleave(layer.group, 1)).to(torch.int8)
                layer.weight_scale = scale
                if layer.bias is not None:
                    layer.weight_min, layer.bias = torch.randn_like(scale) * 1e-3, torch.randn(w.shape[0]) * 0.01
            setattr(owner, name, layer)
        kernels.swap_quantized(llama, torch.float32)
        assert block.mlp.down_proj.native and block.mlp.gate_up_proj.native
        llama.config.eos_ids = []
        if compiled:
            kernels.compile_decode(llama)
        cache = kvcache.new_cache(llama, "static", max_len=64)
        runs.append(list(M.generate_cached(llama, [0, 5, 17, 42, 99], M.SamplingParams(max_new_tokens=16),
                                           cache=cache)))
    assert "compiled (once)" in llama.compiled_step.log[0]
    assert runs[0] == runs[1]


# --- the engine's pool read where it lies --------------------------------------------------------

def gathered(pool, tables, positions, window):
    """What an engine's pass reads without an in-place reader: every row's blocks copied in table
    order (kvcache.PagedKVCache._update's gather), under the positional mask."""
    B, n = tables.shape
    Hkv, d = pool.shape[-2:]
    kv = pool.permute(0, 3, 1, 2, 4).index_select(2, tables.flatten()).view(2, Hkv, B, -1, d)
    keys = torch.arange(kv.shape[3])
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1), M.attention_mask(positions[:, None], keys, window)[:, None]


@pytest.mark.parametrize("B,H,H_kv,d,block,window", [(3, 9, 3, 64, 16, None), (2, 8, 2, 32, 16, 37),
                                                      (4, 4, 4, 128, 8, None), (1, 9, 3, 64, 1, 5)])
def test_paged_attention_reads_the_pool_where_it_lies(B, H, H_kv, d, block, window):
    """paged_attention (a CPU engine's one-token pass) against decode_attention on the gathered copy:
    the same bits, for rows of different lengths in shuffled blocks (one at position 0, one at its
    table's end), with a sliding window, fp32 and bf16 pools, and fp32 queries on a bf16 pool."""
    native_or_skip()
    torch.manual_seed(B + d)
    n, blocks = 9, 40
    pool = torch.randn(2, blocks, block, H_kv, d)
    tables = torch.stack([torch.randperm(blocks)[:n] for _ in range(B)])
    positions = torch.randint(0, n * block, (B,))
    positions[0], positions[-1] = 0, n * block - 1
    q = torch.randn(B, H, 1, d)
    for pool_type, q_type in [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]:
        p, x = pool.to(pool_type), q.to(q_type)
        k, v, mask = gathered(p, tables, positions, window)
        want = kernels.decode_attention(x, k.to(q_type), v.to(q_type), mask.contiguous())
        assert torch.equal(kernels.paged_attention(x, p[0], p[1], tables, positions, window), want)
        # as an engine hands them: columns of one (B, 2 + n) tensor of rows, read through strides
        rows = torch.cat([torch.zeros_like(positions)[:, None], positions[:, None], tables], 1)
        assert torch.equal(kernels.paged_attention(x, p[0], p[1], rows[:, 2:], rows[:, 1], window), want)
    with pytest.raises(RuntimeError, match="beyond"):
        kernels.paged_attention(q, pool[0], pool[1], tables + blocks, positions, None)


def test_a_cpu_engine_reads_its_pool_in_place_with_the_same_outputs(tmp_path):
    """The product's engine on a CPU (kernels.paged_reader: paged_attention, no gather) gives the
    gather's tokens, greedy and sampled (a seeded draw notices any changed logit bit), for prompts
    of different lengths decoding together across block boundaries."""
    native_or_skip()
    # the gather's one-token pass on decode_attention, as the product loads it
    llama = M.Llama.from_pretrained(make_checkpoint(tmp_path / "m"), "cpu", torch.float32,
                                    attend=kernels.native_decode(M.attend))
    reader = kernels.paged_reader("cpu")
    assert reader is kernels.paged_attention and kernels.paged_reader("cpu", quantize.kv_codec("int8")) is None
    prompts = [[7], list(range(3, 8)), list(range(10, 47))]

    def run(in_place, **sampling):
        engine = Engine(llama, block_size=16, max_batch=3, in_place=in_place)
        reqs = [engine.add(p, M.SamplingParams(max_new_tokens=24, **sampling)) for p in prompts]
        engine.run()
        return [r.sequences[0].output for r in reqs]
    for sampling in ({}, {"temperature": 1.0, "seed": 5}):
        assert run(reader, **sampling) == run(None, **sampling)
