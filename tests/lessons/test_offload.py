"""kvcache.OffloadedCache: the same tokens as the dynamic cache, the bytes it moves per step, and the MLA and
offload lines of the memory calculator."""

import pytest
import torch

import kvcache as K
import model as M
from conftest import make_checkpoint
import quantize

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = M.Llama.from_pretrained(make_checkpoint(tmp_path_factory.mktemp("c") / "gqa", num_hidden_layers=3),
                                "cpu", "float32")
    m.config.eos_ids = []
    return m


def decode(model, prompt, cache, n):
    return list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=n), cache=cache))


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_offloaded_greedy_equals_dynamic(llama, kv_dtype):
    for prompt in ([0], [0, 5, 17, 42, 99, 3], list(range(10, 50))):
        want = decode(llama, prompt, K.new_cache(llama, "dynamic", codec=quantize.kv_codec(kv_dtype)), 80)
        cache = K.new_cache(llama, "offloaded", codec=quantize.kv_codec(kv_dtype))
        assert isinstance(cache, K.OffloadedCache) and decode(llama, prompt, cache, 80) == want
        assert cache.length == len(prompt) + 79


def test_bytes_moved_per_step_are_the_whole_cache(llama):
    """Every pass copies each layer's stored rows in and its new rows out: length · bytes per token."""
    c = llama.config
    per_token = K.kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, 4)      # fp32: 3 · 2 · 2 · 16 · 4 B
    assert per_token == 768
    cache, moved = K.new_cache(llama, "offloaded"), []
    prompt = list(range(3, 23))
    params = M.SamplingParams(max_new_tokens=40)
    for _ in M.generate_cached(llama, prompt, params, cache=cache):
        moved.append((cache.length, cache.step_moved))
    assert [m for _, m in moved] == [n * per_token for n, _ in moved]
    assert moved[0] == (20, 20 * 768) and moved[-1] == (59, 59 * 768)    # the prefill writes only; then all
    # a crop rolls back: the next pass moves the shorter cache
    cache.crop(30)
    with torch.inference_mode():      # the cache was written inside generate_cached's
        llama(torch.tensor([[7]]), torch.tensor([30]), cache)
    assert cache.step_moved == 31 * 768
    # the device holds 2 layers' K and V (at the store's capacity), the host all 3
    assert sum(t.nbytes for pair in cache.work for t in pair) == 2 * cache.nbytes // 3


def test_offloaded_crop_and_fork(llama):
    prompt = list(range(3, 23))
    cache = K.new_cache(llama, "offloaded")
    first = decode(llama, prompt, cache, 40)
    cache.crop(len(prompt) + 25)
    assert decode(llama, [first[25]], cache, 14) == first[26:40]
    twin = cache.fork()
    assert twin.k[0].data_ptr() == cache.k[0].data_ptr()
    assert decode(llama, [5, 6], twin, 10) == decode(llama, [5, 6], cache, 10)


def test_cache_kinds_are_one_table(llama):
    for kind in ("dynamic", "static", "offloaded"):
        assert kind in K.CACHES and K.new_cache(llama, kind, max_len=8) is not None
    with pytest.raises(ValueError, match="use dynamic, static, sliding, offloaded"):
        K.new_cache(llama, "pinned")


def test_calculator_mla_and_offload_lines():
    # DeepSeek-V3: one 512-wide latent + one 64-wide RoPE key per token and layer, stored once
    out = K.calculator("deepseek-v3", 32768, 1, "bf16", None)
    assert "61 layers, MLA" in out and "(512 + 64) · 2 = 1152 B/token/layer" in out
    assert "per token:           68.62 KiB/token" in out          # 1,152 B × 61 layers = 70,272 B
    assert "(512 + 64) · 2 = 1152" in K.calculator("deepseek-v2", 1024, 1, "bf16", None)
    mha = K.calculator("llama3-70b-mha", 32768, 1, "bf16", None)
    assert "65536 B/token/layer" not in mha and "2 · 64 · 128 · 2 = 32768 B/token/layer" in mha
    # the offload line: Llama-3-70B at 32K in fp16 is 10 GiB, crossing PCIe 4 x16 every decode step
    out = K.calculator("llama3-70b", 32768, 1, "fp16", 80)
    assert "all of it crosses the link every decode step, 429 ms at 25 GB/s" in out
    # 80 GiB hold 80 · 2^30 / 320 KiB = 262144 tokens; two layers' worth (8 KiB a token) 40x more
    assert "longest context there, batch 1: 262144 tokens; offloaded (2 layers on the GPU): 10485760" in out


def test_bench_offload_saves_its_tables(tmp_path, capsys):
    """bench.py offload on a tiny checkpoint (3 layers, 2 KV heads, d_head 16, fp32: 768 B per token)."""
    import json

    import bench.kvcache
    import results
    path = bench.kvcache.bench_offload(str(make_checkpoint(tmp_path / "tiny", num_hidden_layers=3)), contexts=[16, 64],
                               steps=4, device_gib=[0.001])
    record = json.loads(path.read_text())
    assert (record["name"], record["lesson"]) == ("offload", "kvcache") and path.parent == results.directory()
    fits, speed = record["tables"]
    # 0.001 GiB less the weights (fp32: embedding, head, 3 × (qkv, o, gate_up, down, 2 norms), final norm)
    # over 768 B per token; offloaded, over 2 layers' 512 B: 1.5x here, n_layers / 2
    (row,) = fits["rows"]
    room = 0.001 * 2**30 - 4 * (2 * 320 * 64 + 3 * (64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64)
    assert row[2:5] == [int(room // 768), int(room // 512), "1.5×"]
    assert [r[0] for r in speed["rows"]] == [16, 64]
    for r in speed["rows"]:
        assert r[-2] is True and r[-1] is True              # moved = the formula; the same greedy tokens
        assert r[4] == pytest.approx((r[0] + 4) * 768 / 1e6)  # the last step's length: prompt + 4 new tokens
    assert "offloaded ms/step" in capsys.readouterr().out
