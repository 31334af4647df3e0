"""The Triton kernels (kernels.triton_attention, kernels.paged_decode) against the references.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest before
the kernels are imported), one program after another on CPU tensors through numpy: the
shapes are small and the parameters few, so the module stays well under a minute. On a
machine with CUDA the same tests run the compiled kernels on the GPU, and the tests marked
`cuda` run too (scripts/gpu_check.sh)."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (pip install -r requirements-test.txt)")

import flash  # noqa: E402
import kernels  # noqa: E402
import model as M  # noqa: E402
from conftest import make_checkpoint  # noqa: E402
from engine import Engine  # noqa: E402
from kvcache import PagedKVCache  # noqa: E402
from paged import BlockAllocator  # noqa: E402
import kvcache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# a row that sees no key takes log(0) = -inf on purpose; numpy warns about it in the interpreter
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:divide by zero")]


def qkv(B, H, Hkv, T, L, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, d, generator=g).to(DEV) for h, n in ((H, T), (Hkv, L), (Hkv, L))]


def close(got, want):
    (o, lse), (ro, rlse) = got, want
    assert o.shape == ro.shape and lse.shape == rlse.shape
    assert (o - ro).abs().max().item() < 1e-4
    assert torch.equal(torch.isinf(lse), torch.isinf(rlse))
    assert (lse - rlse).nan_to_num(posinf=0, neginf=0).abs().max().item() < 1e-4


# N (= T = L for a prefill), d, group, causal, window: every N and d, each group both ways.
FORWARD = [(1, 64, 1, True, None), (17, 128, 3, True, None), (17, 64, 1, False, None),
           (128, 64, 3, False, None), (128, 128, 1, True, 40), (300, 64, 3, True, None), (300, 64, 1, True, 100)]


@pytest.mark.parametrize("n,d,group,causal,window", FORWARD)
def test_forward_kernel_equals_naive(n, d, group, causal, window):
    q, k, v = qkv(1, 2 * group, 2, n, n, d)
    close(kernels.triton_attention(q, k, v, causal=causal, window=window),
          flash.naive(q, k, v, causal=causal, window=window))


def test_forward_kernel_queries_after_a_cache_with_a_mask_per_row():
    """Queries that follow cached keys (q_start > 0), rows with their own bool mask (a paged
    cache's), a batch of 2, and non-contiguous q (the model's transposed view)."""
    q, k, v = qkv(2, 6, 2, 5, 40, 64, seed=1)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    mask = torch.rand(2, 1, 5, 40, generator=torch.Generator().manual_seed(2)).to(DEV) > 0.4
    mask[1, 0, 3] = False                             # a row that sees nothing: out 0, lse -inf
    close(kernels.triton_attention(q, k, v, causal=False, mask=mask), flash.naive(q, k, v, causal=False, mask=mask))
    close(kernels.triton_attention(q, k, v, k_start=7), flash.naive(q, k, v, k_start=7))


@pytest.mark.parametrize("L,d,group,window", [(1, 64, 1, None), (300, 64, 3, None), (300, 128, 1, 77),
                                              (17, 64, 3, None)])
def test_decode_kernel_split_k_equals_naive(L, d, group, window):
    """One query row, the keys split into chunks of 64 (so 300 keys make 5 programs per head
    and a ragged last one), the partials merged by flash.merge_many."""
    q, k, v = qkv(2, 2 * group, 2, 1, L, d, seed=3)
    want = flash.naive(q, k, v, window=window)
    close(kernels.triton_decode(q, k, v, window=window, chunk=64), want)
    close(flash.decode(q, k, v, window=window, chunk=64), want)      # the PyTorch version, same algebra


@pytest.mark.parametrize("block_size", [16, 1])
def test_paged_kernel_equals_the_gather_path(block_size):
    """Rows of ragged lengths, each with its own scattered blocks, in a pool of random values
    (the slots no row owns too: the kernel must not read them): attention read in place
    through the block tables equals the gather path (update, then attention over its mask)."""
    lengths, heads, kv_heads, d = [1, 17, 40], 6, 2, 64
    alloc = BlockAllocator(100 // block_size + 8, block_size)
    alloc.allocate_sequence(range(5))                 # so the rows' blocks do not start at block 0
    tables = [alloc.allocate_sequence(range(n))[0] for n in lengths]
    for t in tables:                                  # the token this step computes
        alloc.append_slot(t, 1)
    g = torch.Generator().manual_seed(4)
    pool = torch.randn(1, 2, alloc.num_blocks, block_size, kv_heads, d, generator=g).to(DEV)
    q = torch.randn(len(tables), heads, 1, d, generator=g).to(DEV)
    k, v = (torch.randn(len(tables), kv_heads, 1, d, generator=g).to(DEV) for _ in range(2))
    outs = []
    for in_place in (False, True):
        cache = PagedKVCache(1, alloc.num_blocks, block_size, kv_heads, d, device=DEV,
                             in_place=kernels.paged_decode if in_place else None)
        cache.k[0].copy_(pool[0, 0].flatten(0, 1))
        cache.v[0].copy_(pool[0, 1].flatten(0, 1))
        mask = cache.bind(tables).begin(torch.tensor([[n] for n in lengths], device=DEV))
        assert cache.layers[0].in_place is in_place
        if in_place:
            outs.append(cache.layers[0].attend(q, k, v, mask))
        else:
            K, V = cache.layers[0].update(k, v, None)
            outs.append(flash.naive(q, K, V, causal=False, mask=mask)[0])
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("c") / "gqa")


@pytest.fixture(scope="module")
def llama(ckpt):
    m = M.Llama.from_pretrained(ckpt, DEV, "float32")
    m.config.eos_ids = []
    return m


def greedy_engine(model, prompts, in_place, block_size=16):
    engine = Engine(model, block_size=block_size, max_batch=len(prompts),
                    in_place=kernels.paged_decode if in_place else None)
    reqs = [engine.add(p, M.SamplingParams(max_new_tokens=12)) for p in prompts]
    engine.run()
    return [r.sequences[0].output for r in reqs]


PROMPTS = [[7], list(range(3, 8)), list(range(10, 27))]


def test_engine_reading_the_pool_in_place_gives_the_same_greedy_tokens(llama):
    """The whole engine with decode attention read in place (the path CUDA takes), here in the
    interpreter: the same greedy tokens as the gather path, block sizes 16 and 1."""
    want = greedy_engine(llama, PROMPTS, False)
    assert greedy_engine(llama, PROMPTS, True) == want
    assert greedy_engine(llama, PROMPTS, True, block_size=1) == want


def test_attn_triton_in_the_model_gives_the_same_greedy_tokens(ckpt, llama):
    """--attn triton: the model's prefill and decode attention through kernels.py's Triton kernels."""
    p = M.SamplingParams(max_new_tokens=12)
    want = [list(M.generate_cached(llama, q, p)) for q in PROMPTS]
    fast = M.Llama.from_pretrained(ckpt, DEV, "float32", attend=kernels.attend_triton)
    fast.config.eos_ids = []
    assert [list(M.generate_cached(fast, q, p)) for q in PROMPTS] == want


def test_attn_triton_without_cuda_is_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on a CUDA GPU, not on cpu: use --attn flash"):
        kernels.check_triton(torch.device("cpu"))


@pytest.mark.cuda
def test_cuda_graph_step_equals_the_eager_step(ckpt):
    """The compiled static-cache step (mode reduce-overhead: replayed as a CUDA graph) gives the
    eager step's greedy tokens, in bf16 on the GPU."""
    m = M.Llama.from_pretrained(ckpt, "cuda", "bfloat16")
    p = M.SamplingParams(max_new_tokens=16)
    want = [list(M.generate_cached(m, q, p, cache=kvcache.new_cache(m, "static", 64))) for q in PROMPTS]
    kernels.compile_decode(m)
    assert [list(M.generate_cached(m, q, p, cache=kvcache.new_cache(m, "static", 64))) for q in PROMPTS] == want


@pytest.mark.cuda
def test_engine_on_cuda_reads_the_pool_in_place(llama):
    """On CUDA an engine's cache reads in place (kernels.paged_reader, what the product passes);
    same greedy tokens as the gather."""
    engine = Engine(llama, block_size=16, max_batch=2, in_place=kernels.paged_reader(llama.norm.weight.device))
    assert engine.cache.in_place is kernels.paged_decode
    assert greedy_engine(llama, PROMPTS, True) == greedy_engine(llama, PROMPTS, False)
