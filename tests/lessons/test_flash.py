"""flash.py: the scalar lesson, tiled prefill, flash-decoding and merge against the naive
softmax(QKᵀ/√d)V; the compiled tiles; `--attn flash` end to end on the bundled model."""

import math
import random

import pytest
import torch

import flash
import kernels
import kvcache as K
import model as M
import nanoinfer.load as nl
from conftest import make_checkpoint

NS = [1, 7, 128, 1000, 2049]
TILES = [16, 64, 128]


pytestmark = pytest.mark.usefixtures("one_thread")


def qkv(T, L, group, n_kv=2, d=16, batch=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_kv * group, T, d, generator=g)
    k, v = (torch.randn(batch, n_kv, L, d, generator=g) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def close(got, want, tol):
    (out, lse), (out_ref, lse_ref) = got, want
    assert (out.float() - out_ref.float()).abs().max().item() < tol
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - lse_ref[finite]).abs().max().item() < tol


@pytest.mark.parametrize("n", NS)
def test_scalar_tiled_softmax_matches_one_shot(n):
    rnd = random.Random(n)
    d = 8
    q = [rnd.gauss(0, 1) for _ in range(d)]
    K_ = [[rnd.gauss(0, 1) for _ in range(d)] for _ in range(n)]
    V = [[rnd.gauss(0, 1) for _ in range(d)] for _ in range(n)]
    one_shot = flash.softmax_dot(q, K_, V)
    p = torch.softmax(torch.tensor(K_, dtype=torch.float64) @ torch.tensor(q, dtype=torch.float64) / math.sqrt(d), 0)
    assert max(abs(a - b) for a, b in zip(one_shot, (p @ torch.tensor(V, dtype=torch.float64)).tolist())) < 1e-12
    for tile in TILES:
        assert max(abs(a - b) for a, b in zip(flash.tiled_softmax_dot(q, K_, V, tile), one_shot)) < 1e-5


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("n", NS)
def test_tiled_prefill_matches_naive_fp32(n, tile):
    """Causal and not, GQA ratios 1/3/8, lengths that are not multiples of the tile."""
    for group in (1, 3, 8):
        q, k, v = qkv(n, n, group, n_kv=1)
        for causal in (True, False):
            if n * n > 5000 * tile * tile and (group, causal) != (3, True):
                continue     # 2049 in tiles of 16: 16K tile steps per call; one case covers the shape
            close(flash.attention(q, k, v, causal=causal, tile_q=tile, tile_k=tile),
                  flash.naive(q, k, v, causal=causal), 1e-5)


@pytest.mark.parametrize("n", NS)
def test_tiled_prefill_bf16(n):
    q, k, v = qkv(n, n, 3, dtype=torch.bfloat16)
    want = flash.naive(q.float(), k.float(), v.float())
    got = flash.attention(q, k, v, tile_q=64, tile_k=128)
    assert got[0].dtype == torch.bfloat16
    close(got, want, 2e-2)


def test_rectangular_tiles_and_causal_skipping():
    q, k, v = qkv(1000, 1000, 3)
    want = flash.naive(q, k, v)
    for tq, tk in ((16, 128), (128, 16), (64, 48)):
        close(flash.attention(q, k, v, tile_q=tq, tile_k=tk), want, 1e-5)
    plan = flash._tile_plan(1024, 1024, 128, 128, True, 0, 0, None, None)
    visited = sum(len(v) for _, v in plan)
    masked = sum(m for _, v in plan for _, m in v)
    assert visited == 8 * 9 // 2 and masked == 8      # the lower triangle; only the diagonal is masked


@pytest.mark.parametrize("n,window", [(7, 3), (1000, 1), (1000, 100), (2049, 300)])
def test_sliding_window(n, window):
    q, k, v = qkv(n, n, 3)
    want = flash.naive(q, k, v, window=window)
    close(flash.attention(q, k, v, window=window, tile_q=64, tile_k=64), want, 1e-5)
    plan = flash._tile_plan(n, n, 64, 64, True, 0, 0, window, None)
    assert max(len(v) for _, v in plan) <= 2 + window // 64    # tiles older than the window are skipped


def test_explicit_positions_offsets_and_masks():
    # keys at positions 1000..1299, queries at 1200..1249: the causal diagonal is offset
    q, k, v = qkv(50, 300, 3)
    for kw in (dict(q_start=1200, k_start=1000), dict(q_start=1200, k_start=1000, window=64),
               dict(k_start=1000), dict(causal=False, q_start=0, k_start=1000)):
        close(flash.attention(q, k, v, tile_q=16, tile_k=64, **kw), flash.naive(q, k, v, **kw), 1e-5)
        close(flash.decode(q, k, v, chunk=64, **kw), flash.naive(q, k, v, **kw), 1e-5)
    # a ring buffer (SlidingWindowCache's layout): arbitrary positions per slot, -1 = empty
    slots = torch.tensor(list(range(280, 300)) + [-1] * 10 + list(range(240, 280)))        # 70 ring slots
    q2, k2, v2 = qkv(30, 100, 3)                                                        # + 30 new tokens
    mask = K.attention_mask(torch.arange(300, 330), torch.cat([slots, torch.arange(300, 330)]), 64)
    close(flash.attention(q2, k2, v2, causal=False, mask=mask, tile_q=16, tile_k=32),
          flash.naive(q2, k2, v2, causal=False, mask=mask), 1e-5)
    # a mask per sequence, (B, 1, T, L) as a paged cache gives; a row that sees nothing: out 0, lse -inf
    q, k, v = qkv(40, 100, 2, batch=3)
    mask = torch.rand(3, 1, 40, 100, generator=torch.Generator().manual_seed(0)) > 0.6
    mask[1, :, 5] = False
    got = flash.attention(q, k, v, causal=False, mask=mask, tile_q=16, tile_k=32)
    close(got, flash.naive(q, k, v, causal=False, mask=mask), 1e-5)
    close(flash.decode(q, k, v, mask, causal=False, chunk=32), flash.naive(q, k, v, causal=False, mask=mask), 1e-5)
    assert got[0][1, :, 5].abs().max() == 0 and torch.isinf(got[1][1, :, 5]).all()


@pytest.mark.parametrize("L", [1, 7, 300, 2049])
def test_split_k_decode_matches_full_decode(L):
    for T, group in ((1, 1), (1, 3), (4, 8)):
        q, k, v = qkv(T, L, group)
        want = flash.naive(q, k, v)
        whole = flash.decode(q, k, v, chunk=L)          # one chunk: the plain decode
        close(whole, want, 1e-5)
        for chunk in (16, 64, 256):
            close(flash.decode(q, k, v, chunk=chunk), whole, 1e-5)
        # a static cache's mask: slots past the query's position hold nothing
        mask = K.attention_mask(torch.arange(T) + L // 2, torch.arange(L))
        close(flash.decode(q, k, v, mask, causal=False, chunk=16), flash.naive(q, k, v, causal=False, mask=mask), 1e-5)


def test_merge_of_partials_equals_the_whole():
    q, k, v = qkv(64, 500, 3)
    whole = flash.attention(q, k, v, q_start=400, tile_q=32, tile_k=64)
    bounds = [0, 100, 130, 420, 500]       # the last part lies partly after some queries: causal inside
    parts = [flash.attention(q, k[:, :, a:b], v[:, :, a:b], q_start=400, k_start=a, tile_q=32, tile_k=64)
             for a, b in zip(bounds, bounds[1:])]
    assert torch.isinf(parts[-1][1][..., 0]).all()          # query 400 sees nothing in keys 420..499
    out, lse = parts[0]
    for o, l in parts[1:]:
        out, lse = flash.merge(out, lse, o, l)
    close((out, lse), whole, 1e-5)
    out, lse = flash.merge_many(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), 0)
    close((out, lse), whole, 1e-5)
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    close(flash.merge(*empty, *whole), whole, 1e-6)           # an empty part changes nothing


def test_compiled_tiles_match_and_do_not_recompile_for_new_lengths():
    """The compiled path on small shapes: static tiles, so a new length reuses the graphs."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    q, k, v = qkv(300, 300, 2)
    close(flash.attention(q, k, v, tile_q=64, tile_k=128, compiled=True), flash.naive(q, k, v), 1e-5)
    assert counters["stats"]["unique_graphs"] >= 2          # full tiles and masked ones
    q, k, v = qkv(200, 200, 2, seed=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        close(flash.attention(q, k, v, tile_q=64, tile_k=128, compiled=True), flash.naive(q, k, v), 1e-5)
        q, k, v = qkv(150, 470, 2, seed=2)
        close(flash.attention(q, k, v, tile_q=64, tile_k=128, compiled=True), flash.naive(q, k, v), 1e-5)


# ----------------------------------------------------------------------------
# The model with --attn flash / naive / sdpa.

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("c") / "gqa", tokenizer=False)


def test_model_attn_choices_agree(tiny):
    models = {a: M.Llama.from_pretrained(tiny, "cpu", "float32", attend=f) for a, f in flash.ATTENTION.items()}
    ids = torch.randint(0, 320, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = {a: m(ids, torch.arange(150)) for a, m in models.items()}
    assert (logits["flash"] - logits["sdpa"]).abs().max() < 1e-4
    assert (logits["naive"] - logits["sdpa"]).abs().max() < 1e-4
    prompt = list(range(10, 50))
    for kind in ("dynamic", "static"):
        runs = {a: list(M.generate_cached(m, prompt, M.SamplingParams(max_new_tokens=40),
                                          cache=K.new_cache(m, kind, max_len=128)))
                for a, m in models.items()}
        assert runs["flash"] == runs["sdpa"] == runs["naive"]
    with pytest.raises(ValueError, match="unknown attention 'fast'"):
        kernels.attention_named("fast")


def test_sliding_window_model_with_flash(tmp_path):
    """A Mistral-style window through every cache, the ring buffer included."""
    path = make_checkpoint(tmp_path / "w", tokenizer=False, sliding_window=16)
    models = {a: M.Llama.from_pretrained(path, "cpu", "float32", attend=flash.ATTENTION[a]) for a in ("flash", "naive")}
    assert models["flash"].config.sliding_window == 16
    for kind in ("dynamic", "static", "sliding"):
        runs = [list(M.generate_cached(m, list(range(3, 43)), M.SamplingParams(max_new_tokens=30),
                                       cache=K.new_cache(m, kind, max_len=128))) for m in models.values()]
        assert runs[0] == runs[1]


def test_serve_local_takes_attn():
    import serve_local
    assert serve_local.parse_args(["--attn", "flash"]).attn == "flash"
    assert serve_local.parse_args([]).attn is None          # not given: the plan chooses (plan.py: sdpa)


def test_bundled_model_greedy_flash_equals_naive(bundled_dir):
    """Acceptance: 128 greedy tokens, fp32, --attn flash vs --attn naive."""
    prompt = None
    runs = {}
    for attn in ("flash", "naive"):
        model, tok = nl.load(nl.RunConfig(str(bundled_dir), attn=attn))
        model.config.eos_ids = []
        prompt = prompt or tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]), add_bos=False)
        runs[attn] = list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=128)))
    assert len(runs["flash"]) == 128 and runs["flash"] == runs["naive"]
