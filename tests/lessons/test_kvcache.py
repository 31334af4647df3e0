"""kvcache.py: every cache decodes exactly like the naive decoder; crop, fork, nbytes, the calculator."""

import pytest
import torch

import kvcache as K
import model as M
from conftest import make_checkpoint, run_cli
import kernels

WINDOW = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = M.Llama.from_pretrained(make_checkpoint(tmp_path_factory.mktemp("c") / "gqa"), "cpu", "float32")
    m.config.eos_ids = []
    return m


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A sliding-window model (window 16), written by transformers' MistralForCausalLM."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=320, max_position_embeddings=256,
                        sliding_window=WINDOW, initializer_range=0.1, bos_token_id=0, eos_token_id=2)
    ref = MistralForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("c") / "mistral"
    ref.save_pretrained(path)
    m = M.Llama.from_pretrained(path, "cpu", "float32")
    m.config.eos_ids = []
    return m, ref


def decode(model, prompt, cache, n):
    return list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=n), cache=cache))


PROMPTS = [[0], [0, 5, 17, 42, 99, 3], list(range(10, 50))]


def test_write_rows_puts_each_row_where_its_position_says():
    """The write of the static cache (row = position) and the ring (row = position mod capacity)."""
    store = torch.zeros(2, 3, 8, 4)
    new = torch.arange(1, 2 * 3 * 3 * 4 + 1, dtype=torch.float32).view(2, 3, 3, 4)
    assert K.write_rows(store, torch.tensor([6, 1, 4]), new) is store            # in place
    assert torch.equal(store[:, :, [6, 1, 4]], new)
    assert not store[:, :, [0, 2, 3, 5, 7]].any()                                # nothing else written
    static = K.StaticCache(1, 1, 1, 2, max_len=6)
    static.begin(torch.arange(3, 5))                                              # positions 3, 4
    k = torch.tensor([[[[1., 2.], [3., 4.]]]])
    keys, values = static.layers[0].update(k, -k, torch.arange(3, 5))
    assert keys[0, 0].tolist() == [[0, 0], [0, 0], [0, 0], [1, 2], [3, 4], [0, 0]]
    assert torch.equal(values, -keys)
    ring = K.SlidingWindowCache(1, 1, 1, 1, window=3, slack=1)                    # 4 rows
    ring.begin(torch.arange(6))                                                   # only 2..5 survive
    ring.layers[0].update(torch.arange(10., 16.).view(1, 1, 6, 1), torch.zeros(1, 1, 6, 1), torch.arange(6))
    assert ring.k[0].flatten().tolist() == [14, 15, 12, 13]                       # rows 0..3: positions 4, 5, 2, 3


@pytest.mark.parametrize("which", ["llama", "mistral"])
def test_smallest_caches_equal_the_static_cache(llama, mistral, which):
    """The two smallest caches (per-pass tensors in lists, joined when read; one tensor per layer
    written in place) decode the static cache's greedy tokens and hold exactly its rows."""
    model = llama if which == "llama" else mistral[0]
    c = model.config
    for prompt in PROMPTS:
        static = K.new_cache(model, "static", max_len=128)
        lists = K.ListCache(c.n_layers, c.sliding_window)
        tensor = K.TensorCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 128, window=c.sliding_window)
        want = decode(model, prompt, static, 70)
        assert decode(model, prompt, lists, 70) == want
        assert decode(model, prompt, tensor, 70) == want
        n = static.length
        assert lists.length == tensor.length == n == len(prompt) + 69
        for i in range(c.n_layers):
            for kv in ("k", "v"):
                rows = getattr(static, kv)[i][:, :, :n]
                assert torch.equal(torch.cat(getattr(lists.layers[i], kv), dim=2), rows)
                assert torch.equal(getattr(tensor, kv)[i][:, :, :n], rows)
        assert len(lists.layers[0].k) == 70     # one tensor per pass: the prefill, then 69 steps
    with pytest.raises(ValueError, match="cache is full"):
        tensor.begin(torch.arange(n, 129))


@pytest.mark.parametrize("kind", ["dynamic", "static", "offloaded"])
def test_caches_equal_naive_greedy(llama, kind):
    for prompt in PROMPTS:
        naive = list(M.generate_naive(llama, prompt, M.SamplingParams(max_new_tokens=70)))
        cache = K.new_cache(llama, kind, max_len=128)
        assert decode(llama, prompt, cache, 70) == naive
        assert cache.length == len(prompt) + 69     # all but the last token were fed back


def test_sliding_window_model_matches_transformers_mistral(mistral):
    ours, ref = mistral
    assert ours.config.sliding_window == WINDOW
    ids = torch.randint(0, 320, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
    got = ours(ids, torch.arange(60))
    assert (got - want).abs().max() < 1e-4
    # and the window matters: full causal attention gives different logits past position 16
    ours.config.sliding_window = None
    assert (ours(ids, torch.arange(60)) - want)[0, WINDOW + 1:].abs().max() > 1e-3
    ours.config.sliding_window = WINDOW


def test_sliding_window_without_cache_builds_no_full_mask(mistral, monkeypatch):
    """No cache: each layer attends through flash.attention(window=), which skips the tiles outside the
    window; the only masks built are flash's own, one 256×256 tile at most, never 600×600."""
    import flash
    ours, ref = mistral
    calls, shapes, mask_rule, real = [], [], K.attention_mask, flash.attention
    monkeypatch.setattr(flash, "attention", lambda *a, **kw: calls.append((kw["window"], kw["mask"])) or real(*a, **kw))
    monkeypatch.setattr(flash, "attention_mask", lambda q, k, *a, **kw: shapes.append((len(q), len(k))) or
                        mask_rule(q, k, *a, **kw))
    for block in ours.layers:       # the runner's "sdpa" (nanoinfer.load.attention)
        monkeypatch.setattr(block.self_attn, "attend", flash.attend_sdpa)
    ids = torch.randint(0, 320, (1, 600), generator=torch.Generator().manual_seed(1))
    got = ours(ids, torch.arange(600))          # attn "sdpa": flash's tiles, run eagerly
    with torch.no_grad():
        assert (got - ref(ids).logits).abs().max() < 1e-4
    assert calls == [(WINDOW, None)] * 2 and max(shapes) == (256, 256)


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "offloaded"])
def test_sliding_window_caches_equal_naive(mistral, kind):
    model, _ = mistral
    for prompt in PROMPTS:   # the 40-token prompt is longer than the window
        naive = list(M.generate_naive(model, prompt, M.SamplingParams(max_new_tokens=70)))
        cache = K.new_cache(model, kind, max_len=128)
        assert decode(model, prompt, cache, 70) == naive
    if kind == "sliding":    # memory stays window + slack rows, however long the sequence
        assert cache.capacity == WINDOW + cache.slack and cache.length == 40 + 69


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_crop_then_redecode_reproduces(llama, mistral, kind):
    model = mistral[0] if kind == "sliding" else llama
    prompt = list(range(3, 23))
    cache = K.new_cache(model, kind, max_len=128)
    first = decode(model, prompt, cache, 40)
    cache.crop(len(prompt) + 25)         # roll back 14 tokens (speculative decoding's move)
    assert cache.length == len(prompt) + 25
    again = decode(model, [first[25]], cache, 14)
    assert again == first[26:40]


def test_sliding_crop_beyond_slack_is_refused(mistral):
    cache = K.new_cache(mistral[0], "sliding")
    decode(mistral[0], list(range(3, 23)), cache, 100)
    with pytest.raises(ValueError, match="can roll back at most 64 tokens"):
        cache.crop(10)


@pytest.mark.parametrize("kind", ["dynamic", "static", "offloaded"])
def test_fork_shares_until_write_and_branches_are_independent(llama, kind):
    prefix, questions = list(range(30, 70)), [[5, 6, 7], [9], [11, 12]]
    cache = K.new_cache(llama, kind, max_len=128)
    llama(torch.tensor([prefix]), torch.arange(len(prefix)), cache)
    parent_ptr, parent_bytes = cache.k[0].data_ptr(), cache.nbytes
    branches = [cache.fork() for _ in questions]
    assert all(b.k[0].data_ptr() == parent_ptr and b.length == len(prefix) for b in branches)
    outs = [decode(llama, q, b, 20) for q, b in zip(questions, branches)]
    for q, out, b in zip(questions, outs, branches):
        alone = decode(llama, prefix + q, K.new_cache(llama, kind, max_len=128), 20)
        assert out == alone                              # exactly an independent run
        assert b.k[0].data_ptr() != parent_ptr           # wrote -> got its own storage
    assert len(set(map(tuple, outs))) > 1
    # the parent was never written through: it still continues as before
    assert cache.k[0].data_ptr() == parent_ptr and cache.length == len(prefix) and cache.nbytes == parent_bytes
    assert decode(llama, [5, 6, 7], cache, 20) == outs[0]


def test_dynamic_growth_is_amortised(llama):
    cache = K.new_cache(llama, "dynamic")
    capacities = set()
    for p in range(1000):
        k = torch.zeros(1, 2, 1, 16)
        cache.begin(torch.tensor([p]))
        for layer in cache.layers:
            layer.update(k, k, torch.tensor([p]))
        capacities.add(cache.capacity)
    assert cache.length == 1000 and sorted(capacities) == [256, 512, 1024]   # 3 allocations, not 1000


def test_static_nbytes_is_the_formula_and_full_cache_is_refused(llama):
    c = llama.config
    cache = K.new_cache(llama, "static", max_len=50)
    assert cache.nbytes == 50 * K.kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, 4)
    decode(llama, list(range(40)), cache, 10)
    with pytest.raises(M.ContextOverflow, match="context holds 50"):   # the decoder checks first
        decode(llama, [1, 2], cache, 5)
    with pytest.raises(ValueError, match="static cache is full"):        # and the cache itself refuses
        cache.begin(torch.arange(49, 52))


def resident_mb() -> float:
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return int(status["VmRSS"].split()[0]) / 1024


@pytest.mark.skipif(not hasattr(K.mmap, "MAP_PRIVATE"), reason="no private mappings here")
def test_a_cpu_cache_takes_memory_as_its_rows_are_written():
    """A static cache for 4096 tokens (64 MiB) holds in RAM the rows written, not its capacity;
    its unwritten rows read as zeros (a paged pool's masked keys meet them in probs @ V)."""
    before = resident_mb()
    cache = K.StaticCache(n_layers=8, batch=1, n_kv_heads=4, head_dim=64, max_len=4096)
    assert cache.nbytes == 64 << 20
    cache.begin(torch.arange(16))
    for layer in cache.layers:
        layer.update(torch.ones(1, 4, 16, 64), torch.ones(1, 4, 16, 64), torch.arange(16))
    assert resident_mb() - before < 16
    assert cache.k[3][0, 2, 16:].abs().sum() == 0 and cache.k[3][0, 2, :16].sum() == 16 * 64
    pool = K.PagedKVCache(n_layers=8, num_blocks=256, block_size=16, n_kv_heads=4, head_dim=64)
    assert resident_mb() - before < 16 and not pool.v[7].any()


def test_calculator_prints_the_lesson_numbers():
    out = K.calculator("llama2-7b", 32768, 1, "fp16", None)
    assert "16384 B/token/layer" in out and "512 KiB/token" in out and "per sequence of 32768: 16 GiB" in out
    out = K.calculator("llama3-70b", 32768, 1, "fp16", None)
    assert "4096 B/token/layer" in out and "per sequence of 32768: 10 GiB" in out
    assert "per sequence of 131072: 40 GiB" in K.calculator("llama3-70b", 131072, 1, "fp16", None)
    assert "per sequence of 32768: 80 GiB" in K.calculator("llama3-70b-mha", 32768, 1, "fp16", None)
    out = K.calculator("llama2-7b", 4096, 8, "int8", 80)
    assert "8192 B/token/layer" in out and "batch of 8:      8 GiB" in out and "at most 80 sequences" in out


def test_kvcache_calculator_refuses_negative_sizes():
    rc, out, err = run_cli("kvcache.py", "--seq", "-5")
    assert rc == 2 and "--seq must be positive" in err and "Traceback" not in err


def test_bytes_by_kind_equal_real_caches():
    """held_bytes against the nbytes of real caches of a tiny shape, fed one token at a
    time, in fp16 and in quantize.py's int8 rows (d_head values + an fp16 scale)."""
    import paged
    import quantize
    layers, heads, d = 2, 2, 8
    shape, contexts = (layers, heads, d), [1, 100, 256, 257, 600]
    assert K.row_bytes(d, "int8") == quantize.kv_codec("int8").row_bytes(d) == 10
    for dtype, codec in (("fp16", None), ("int8", quantize.kv_codec("int8"))):
        want = {kind: K.held_bytes(kind, contexts, shape, dtype, max_len=600, window=64) for kind in K.KINDS}
        dynamic, kv = K.DynamicCache(layers, 1, heads, d, torch.float16, codec=codec), torch.ones(1, heads, 1, d)
        for n, expected in zip(contexts, want["dynamic"]):
            while dynamic.length < n:
                pos = torch.tensor([dynamic.length])
                dynamic.begin(pos)
                for layer in dynamic.layers:
                    layer.update(kv.half(), kv.half(), pos)
            assert dynamic.nbytes == expected
        fp16 = dict(dtype=torch.float16, codec=codec)
        assert want["static"] == [K.StaticCache(layers, 1, heads, d, 600, **fp16).nbytes] * 5
        assert want["sliding"] == [K.SlidingWindowCache(layers, 1, heads, d, 64, **fp16).nbytes] * 5
        for n, expected in zip(contexts, want["paged"]):
            table, _ = paged.BlockAllocator(64, 16).allocate_sequence(range(n))     # the blocks one sequence takes
            assert K.PagedKVCache(layers, len(table.block_ids), 16, heads, d, **fp16).nbytes == expected
    # by hand: a row is K and V × 2 layers × 2 heads × 16 B (fp16) = 128 B, or × 10 B (int8) = 80 B
    assert K.held_bytes("dynamic", [1, 256, 257, 600], shape, "fp16", 600, 64) == [256 * 128, 256 * 128,
                                                                                 512 * 128, 1024 * 128]
    assert K.held_bytes("sliding", [1, 600], shape, "fp16", 600, 64) == [128 * 128] * 2      # window + 64 slack
    assert K.held_bytes("paged", [1, 16, 17], shape, "int8", 600, 64) == [16 * 80, 16 * 80, 32 * 80]


def test_calculator_reads_config_json(tmp_path, llama):
    path = make_checkpoint(tmp_path / "m", tokenizer=False)
    assert "2 layers, 2 KV heads, d_head 16" in K.calculator(str(path), 10, 1, "fp32", None)


def test_attention_mask_rules():
    q = torch.tensor([5, 6])
    k = torch.tensor([-1, 0, 3, 5, 6, 7])
    assert K.attention_mask(q, k).tolist() == [[False, True, True, True, False, False],
                                               [False, True, True, True, True, False]]
    assert K.attention_mask(q, k, window=3).tolist() == [[False, False, True, True, False, False],
                                                         [False, False, False, True, True, False]]


def test_compiled_static_decode_equals_eager(tmp_path):
    """The torch.compile path (freezing + cpp_wrapper) on small shapes: same greedy tokens."""
    model = M.Llama.from_pretrained(make_checkpoint(tmp_path / "m", num_hidden_layers=1), "cpu", "float32")
    model.config.eos_ids = []
    prompt = list(range(10, 30))
    eager = decode(model, prompt, K.new_cache(model, "static", max_len=64), 30)
    kernels.compile_decode(model)
    compiled = decode(model, prompt, K.new_cache(model, "static", max_len=64), 30)
    assert compiled == eager
    plain = M.Llama.from_pretrained(tmp_path / "m", "cpu", "float32")
    plain.config.eos_ids = []
    again = decode(model, [7, 8], K.new_cache(model, "static", max_len=64), 30)   # same graph, new cache
    assert again == decode(plain, [7, 8], K.new_cache(plain, "static", max_len=64), 30)
