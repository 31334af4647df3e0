"""engine.py and kvcache.PagedKVCache: paged decoding equals the contiguous cache, batched equals
solo, preemption and prefix caching change no token, forks are independent, bad input is refused
while the engine keeps serving, every block comes back; the scheduler driven without a model;
the chat runner's --kv paged."""

import dataclasses
import io
import os
import random
import signal

import pytest
import torch

import model as M
import nanoinfer.load as nl
import serve_local
from conftest import make_checkpoint
from engine import LLM, Engine, MinimalEngine, Request, Scheduler, Sequence, Status, padded_rows
from kvcache import PagedKVCache
from paged import BlockAllocator
import engine as engine_mod
import kvcache
import quantize

GREEDY = M.SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = M.Llama.from_pretrained(make_checkpoint(tmp_path_factory.mktemp("c") / "gqa"), "cpu", "float32")
    m.config.eos_ids = []   # every request runs to max_new_tokens, so lengths are under the test's control
    return m


def contiguous(model, prompt, params):
    return list(M.generate_cached(model, prompt, params))


def run_engine(engine, prompts, params, n=1):
    """Queue everything, step until done; returns each request's outputs (one list per branch)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add(p, sp, n) for p, sp in zip(prompts, params)]
    engine.run()
    return [[s.output for s in sorted(r.sequences, key=lambda s: s.branch)] for r in reqs]


def all_blocks_back(engine):
    engine.allocator.check_invariants()
    assert not engine.allocator.live
    assert engine.allocator.num_free == engine.allocator.num_blocks


PROMPTS = [[7], list(range(3, 8)), list(range(10, 26)), list(range(30, 47)), list(range(50, 83)),
           list(range(100, 140))]   # 1, 5, 16, 17, 33, 40 tokens: at, before and after block borders


@pytest.fixture(scope="module")
def reference(llama):
    return [contiguous(llama, p, GREEDY(max_new_tokens=40)) for p in PROMPTS]


def arrive_and_step(engine, arrivals):
    """Add each (step, prompt, params) at its step and step until everything is done; returns
    each request's output and, per step, the (arrival index, token) pairs sampled."""
    pending, reqs, index, steps = list(arrivals), [], {}, []
    while pending or engine.has_work():
        while pending and pending[0][0] <= len(steps):
            _, prompt, params = pending.pop(0)
            reqs.append(engine.add(prompt, params))
            index[reqs[-1].id] = len(reqs) - 1
        events = engine.step()
        steps.append([(index[e.request_id], e.token) if isinstance(e, engine_mod.Event)
                      else (index[e[0]], e[1]) for e in events])
    outputs = [r.output if isinstance(r, engine_mod.SimpleRequest) else r.sequences[0].output
               for r in reqs]
    return outputs, steps


def test_minimal_engine_equals_the_engine(llama):
    """The smallest loop (admit, decode all, retire) samples the full Engine's tokens, at the same
    steps: requests of different lengths arriving at different steps, more of them than the batch
    holds, one sampled with a seed."""
    sampled = M.SamplingParams(temperature=1.0, top_k=50, seed=3, max_new_tokens=18)
    arrivals = [(0, PROMPTS[0], GREEDY(max_new_tokens=12)), (0, PROMPTS[1], GREEDY(max_new_tokens=30)),
                (1, PROMPTS[2], GREEDY(max_new_tokens=5)), (3, PROMPTS[3], sampled),
                (3, PROMPTS[4], GREEDY(max_new_tokens=1)), (3, PROMPTS[5], GREEDY(max_new_tokens=20)),
                (9, list(range(200, 209)), GREEDY(max_new_tokens=25)), (40, [11, 12], GREEDY(max_new_tokens=4))]
    minimal = MinimalEngine(llama, num_blocks=64, max_batch=4)
    want, want_steps = arrive_and_step(Engine(llama, num_blocks=64, max_batch=4), arrivals)
    got, got_steps = arrive_and_step(minimal, arrivals)
    assert got == want and got_steps == want_steps
    assert [len(o) for o in got] == [12, 30, 5, 18, 1, 20, 25, 4]
    first = [min(i for i, step in enumerate(got_steps) if any(r == j for r, _ in step))
             for j in range(len(arrivals))]
    assert [f - a[0] for f, a in zip(first, arrivals)] == [0, 0, 0, 0, 2, 2, 2, 0]  # 3 waited for room
    assert minimal.alloc.num_free == 64 and not minimal.alloc.live    # every block came back
    with pytest.raises(ValueError, match="must fit the pool"):
        minimal.add(list(range(1000)), GREEDY())


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_decoding_equals_contiguous_cache(llama, reference, block_size):
    alone = [run_engine(Engine(llama, block_size=block_size, max_batch=1), [p], GREEDY(max_new_tokens=40))[0][0]
             for p in PROMPTS]
    assert alone == reference
    engine = Engine(llama, block_size=block_size, max_batch=len(PROMPTS))
    batched = [o[0] for o in run_engine(engine, PROMPTS, GREEDY(max_new_tokens=40))]
    assert batched == reference
    all_blocks_back(engine)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_pages_equal_the_quantized_contiguous_cache(llama, kv):
    """The same rows, encoded the same way, whether they live in blocks or in one tensor."""
    want = [list(M.generate_cached(llama, p, GREEDY(max_new_tokens=30), cache=kvcache.new_cache(llama, codec=quantize.kv_codec(kv))))
            for p in PROMPTS]
    engine = Engine(llama, block_size=16, max_batch=len(PROMPTS), codec=quantize.kv_codec(kv))
    assert engine.cache.dtype == torch.uint8
    assert engine.cache.k[0].shape[-1] == llama.config.head_dim + 2         # the values, then the scale
    assert [o[0] for o in run_engine(engine, PROMPTS, GREEDY(max_new_tokens=30))] == want
    all_blocks_back(engine)


def test_paged_cache_mask_and_gather(llama):
    """Rows of different lengths: the mask hides each row's padding; update returns every
    row's own keys in position order."""
    c = llama.config
    alloc = BlockAllocator(16, 4)
    cache = PagedKVCache(c.n_layers, 16, 4, c.n_kv_heads, c.head_dim)
    a, _ = alloc.allocate_sequence(range(10))
    b, _ = alloc.allocate_sequence(range(3))
    mask = cache.bind([a, b]).begin(torch.tensor([[9], [2]]))
    assert mask.shape == (2, 1, 1, 12) and mask.dtype == torch.bool
    assert mask[0, 0, 0].tolist() == [True] * 10 + [False] * 2
    assert mask[1, 0, 0].tolist() == [True] * 3 + [False] * 9
    k = torch.arange(2 * c.n_kv_heads * c.head_dim, dtype=torch.float32).view(2, c.n_kv_heads, 1, c.head_dim)
    K, V = cache.layers[0].update(k, -k, None)
    assert K.shape == (2, c.n_kv_heads, 12, c.head_dim)
    assert torch.equal(K[0, :, 9], k[0, :, 0]) and torch.equal(K[1, :, 2], k[1, :, 0])
    assert torch.equal(V[1, :, 2], -k[1, :, 0])
    assert torch.equal(cache.k[0].view(-1, c.n_kv_heads, c.head_dim)[a.slot(9)], k[0, :, 0])


def test_prefix_cache_hits_produce_the_tokens_of_misses(llama):
    system = list(range(200, 245))          # 45 shared tokens: two full 16-token blocks and a partial one
    prompts = [system + [5 + i, 9, 11 + i] for i in range(4)]
    want = [contiguous(llama, p, GREEDY(max_new_tokens=24)) for p in prompts]
    for caching in (False, True):
        engine = Engine(llama, max_batch=2, prefix_caching=caching)
        reqs = [engine.add(p, GREEDY(max_new_tokens=24)) for p in prompts]
        engine.run()
        assert [r.sequences[0].output for r in reqs] == want
        assert [r.cached_tokens for r in reqs] == ([0, 32, 32, 32] if caching else [0] * 4)
        assert [r.prefill_tokens for r in reqs] == ([48, 16, 16, 16] if caching else [48] * 4)
        all_blocks_back(engine)


def test_forked_branches_equal_independent_runs(llama):
    """n = 3 samples share the prompt's blocks; the shared partial block is copied on write,
    and branch i produces exactly what a lone request with seed + i produces."""
    prompt = list(range(60, 81))            # 21 tokens: the last block is shared and partly filled
    p = M.SamplingParams(temperature=1.0, top_k=50, seed=7, max_new_tokens=30)
    engine = Engine(llama, max_batch=4)
    (branches,) = run_engine(engine, [prompt], p, n=3)
    assert engine.stats().block_copies >= 2
    assert engine.stats().prefill_tokens == len(prompt)      # one prefill for all three
    alone = [run_engine(Engine(llama, max_batch=1), [prompt],
                        M.SamplingParams(temperature=1.0, top_k=50, seed=7 + i, max_new_tokens=30))[0][0]
             for i in range(3)]
    assert branches == alone
    assert len({tuple(b) for b in branches}) == 3             # they did diverge
    all_blocks_back(engine)


def random_jobs(n, seed, vocab=320, max_prompt=60, max_new=50):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    return prompts, [GREEDY(max_new_tokens=rng.randint(1, max_new)) for _ in range(n)]


def test_batch_of_32_equals_each_request_alone(llama):
    prompts, params = random_jobs(32, seed=1)
    want = [contiguous(llama, p, sp) for p, sp in zip(prompts, params)]
    engine = Engine(llama, max_batch=32)
    got = [o[0] for o in run_engine(engine, prompts, params)]
    assert got == want
    admission = -(-sum(map(len, prompts)) // engine.chunk_tokens)                  # steps of prompt chunks
    # they really ran together
    assert engine.stats().steps <= max(sp.max_new_tokens for sp in params) + admission
    all_blocks_back(engine)


def test_preempted_requests_produce_the_same_tokens(llama):
    prompts, params = random_jobs(10, seed=2, max_prompt=20, max_new=40)
    want = [contiguous(llama, p, sp) for p, sp in zip(prompts, params)]
    engine = Engine(llama, num_blocks=20, block_size=4, max_batch=10)   # 80 token slots for ~10 × 35
    got = [o[0] for o in run_engine(engine, prompts, params)]
    assert engine.scheduler.preemptions > 0
    assert engine.stats().recomputed_tokens > 0
    assert got == want
    all_blocks_back(engine)


def test_sliding_window_model_in_pages(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=320, max_position_embeddings=256, sliding_window=16,
                        initializer_range=0.1, bos_token_id=0, eos_token_id=2)
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    m = M.Llama.from_pretrained(tmp_path, "cpu", "float32")
    m.config.eos_ids = []
    prompts = [list(range(10, 50)), list(range(3, 9))]
    want = [contiguous(m, p, GREEDY(max_new_tokens=30)) for p in prompts]
    assert [o[0] for o in run_engine(Engine(m, max_batch=2), prompts, GREEDY(max_new_tokens=30))] == want


def test_bundled_model_batched_equals_alone(bundled_dir):
    m, tok = nl.load(nl.RunConfig(str(bundled_dir)))
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_bos=False)
               for q in ["What is the capital of France?", "Write a haiku about the sea.",
                         "Name three primes."]]
    params = [GREEDY(max_new_tokens=n) for n in (16, 6, 10)]
    want = [contiguous(m, p, sp) for p, sp in zip(prompts, params)]
    engine = Engine(m, max_batch=3)
    assert [o[0] for o in run_engine(engine, prompts, params)] == want
    all_blocks_back(engine)


# --- bad input, cancellation, limits ------------------------------------------

def test_request_longer_than_the_pool_is_rejected_and_others_go_on(llama):
    prompts, params = random_jobs(3, seed=3, max_prompt=10, max_new=12)
    want = [contiguous(llama, p, sp) for p, sp in zip(prompts, params)]
    engine = Engine(llama, num_blocks=8, block_size=4, max_batch=4)          # 32 token slots
    reqs = [engine.add(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    with pytest.raises(ValueError, match=r"prompt is 40 tokens but a sequence may hold at most 32.*KV pool"):
        engine.add_request(list(range(3, 43)), GREEDY())
    engine.run()
    assert [r.sequences[0].output for r in reqs] == want
    # A sequence that outgrows the pool stops at its limit instead of failing.
    rid = engine.add_request([5, 6, 7], GREEDY(max_new_tokens=100))
    req = engine.request(rid)
    engine.run()
    assert len(req.prompt) + len(req.sequences[0].output) == 32 and req.sequences[0].finish_reason == "length"
    all_blocks_back(engine)


def test_cancel_frees_blocks_at_once_and_is_harmless_otherwise(llama):
    engine = Engine(llama, num_blocks=64, block_size=4, max_batch=2)
    a = engine.add_request(list(range(3, 30)), GREEDY(max_new_tokens=50))
    b = engine.add_request(list(range(40, 50)), GREEDY(max_new_tokens=5))
    c = engine.add_request(list(range(60, 70)), GREEDY(max_new_tokens=5))   # waits: max_batch 2
    engine.step()
    free = engine.num_free_blocks
    assert engine.cancel(a) is True
    assert engine.num_free_blocks > free                  # at once, not at the next step
    assert engine.cancel(a) is False                      # already cancelled
    assert engine.cancel(12345) is False                  # unknown
    assert engine.cancel(c) is True                       # still waiting: leaves the queue
    engine.run()
    assert engine.cancel(b) is False                      # finished
    assert not engine.has_work()
    all_blocks_back(engine)


def test_bad_requests_are_refused_and_nothing_is_queued(llama):
    with pytest.raises(ValueError, match="temperature"):
        M.SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top-p"):
        M.SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max-new-tokens"):
        M.SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        M.SamplingParams(logprobs=-1)
    engine = Engine(llama, max_batch=4)
    with pytest.raises(ValueError, match="logprobs must be at most the vocabulary size"):
        engine.add_request([1, 2], GREEDY(logprobs=10**6))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], GREEDY())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 999999], GREEDY())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("not ids", GREEDY())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match="n must be"):
        engine.add_request([1, 2], GREEDY(), n=0)
    with pytest.raises(ValueError, match="seed must be an integer in"):
        M.SamplingParams(seed=2 ** 64)
    with pytest.raises(ValueError, match="seed must be below 2\\*\\*64 - 1"):
        engine.add_request([1, 2], GREEDY(temperature=1, seed=2 ** 64 - 1), n=2)  # branch 1: 2**64
    assert not engine.has_work()
    llm = LLM(llama)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY(), GREEDY()])
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate(["text"])
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 6], [1, 10**6]])              # the good prompt is not queued either
    assert not llm.engine.has_work()


def test_llm_generate_returns_outputs_in_input_order(tiny_ckpt, capsys):
    llm = LLM(str(tiny_ckpt), max_batch=3)
    tok = llm.tokenizer
    prompts = ["The quick brown fox", "Paris is", [0, 5, 6, 7], "def add(a, b):\n", "hello there! " * 5]
    params = [GREEDY(max_new_tokens=n) for n in (30, 3, 12, 20, 7)]
    outs = llm.generate(prompts, params)
    assert "generate" in capsys.readouterr().err          # the progress bar
    eos = llm.model.config.eos_ids
    for out, prompt, sp in zip(outs, prompts, params):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt == prompt and out.prompt_ids == ids
        assert out.token_ids == contiguous(llm.model, ids, sp)
        assert out.text == tok.decode([t for t in out.token_ids if t not in eos], skip_special=True)
        assert out.finish_reason == ("stop" if out.token_ids[-1] in eos else "length")
        assert 0 < out.ttft_s <= out.latency_s
    all_blocks_back(llm.engine)


def test_logprobs_are_the_models_own_distribution_at_each_output_token(llama):
    """SamplingParams(logprobs=N): the top-N log-probabilities the engine returns
    at every output position equal a plain forward over prompt + output, whatever
    the batch and the temperature (they are the raw distribution)."""
    prompts, params = PROMPTS[1:4], [GREEDY(max_new_tokens=12, logprobs=5),
                                     M.SamplingParams(temperature=0.8, seed=3, max_new_tokens=9, logprobs=5),
                                     GREEDY(max_new_tokens=7)]
    outs = LLM(llama, max_batch=4).generate(prompts, params, use_tqdm=False)
    assert outs[2].completions[0].logprobs is None
    for prompt, out, sp in zip(prompts[:2], outs, params):
        values, ids = out.completions[0].logprobs
        assert values.shape == ids.shape == (sp.max_new_tokens, 5)
        seq = prompt + out.token_ids
        with torch.inference_mode():
            full = torch.log_softmax(llama(torch.tensor([seq]), torch.arange(len(seq)))[0, len(prompt) - 1:-1], -1)
        want_values, want_ids = full.topk(5)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(values, want_values, atol=1e-4, rtol=0)
        if sp.temperature == 0:
            assert ids[:, 0].tolist() == out.token_ids


def test_events_carry_logprobs_finish_reason_and_stop_tokens(llama, monkeypatch):
    """What server.py reads, it reads from the events: each branch's tokens in order, the
    chosen token's log-probability and the top N (the model's own distribution), the
    finish reason on the last one only, and the EOS that ended a branch marked not visible."""
    prompt, free = [5, 6, 7, 8], contiguous(llama, [5, 6, 7, 8], GREEDY(max_new_tokens=20))
    k = next(i for i in range(2, 20) if free[i] not in free[:i])
    monkeypatch.setattr(llama.config, "eos_ids", [free[k]])        # greedy stops after k + 1 tokens
    engine = Engine(llama, max_batch=4)
    a = engine.add(prompt, GREEDY(max_new_tokens=20, logprobs=3))
    b = engine.add([9, 10], GREEDY(max_new_tokens=5))
    c = engine.add([11, 12, 13], M.SamplingParams(temperature=1.0, seed=1, max_new_tokens=6), n=2)
    events = []
    while engine.has_work():
        events += engine.step()
    of = lambda req, branch=0: [e for e in events if (e.request_id, e.branch) == (req.id, branch)]
    assert [e.token for e in of(a)] == free[:k + 1] == a.sequences[0].output
    assert [e.finish_reason for e in of(a)] == [None] * k + ["stop"]
    assert [e.visible for e in of(a)] == [True] * k + [False]         # the EOS: not shown
    assert [e.finished for e in of(a)] == [False] * k + [True]
    with torch.inference_mode():
        seq = prompt + free[:k + 1]
        logits = llama(torch.tensor([seq]), torch.arange(len(seq)))[0, len(prompt) - 1:-1]
        full = torch.log_softmax(logits, -1)
    values, ids = full.topk(3)
    for e, v, i, row in zip(of(a), values, ids, full):
        assert [t for t, _ in e.top] == i.tolist() and i[0] == e.token    # greedy: the likeliest
        torch.testing.assert_close(torch.tensor([x for _, x in e.top]), v, atol=1e-4, rtol=0)
        assert abs(e.logprob - float(row[e.token])) < 1e-4
    assert [e.finish_reason for e in of(b)] == [None] * 4 + ["length"]
    assert all(e.logprob is None and e.top is None and e.visible for e in of(b))
    for branch in (0, 1):
        mine = of(c, branch)
        assert [e.token for e in mine] == c.sequences[branch].output and mine[-1].finished
    assert c.finish_reasons == [of(c, 0)[-1].finish_reason, of(c, 1)[-1].finish_reason]
    all_blocks_back(engine)


def test_stats_are_plain_numbers_of_the_batch_and_the_pool(llama):
    """Engine.stats(): a dataclass of ints that says what the scheduler and the allocator
    hold, so a reader (server.py's metrics) needs neither."""
    engine = Engine(llama, num_blocks=16, block_size=4, max_batch=2)
    s = engine.stats()
    assert dataclasses.is_dataclass(s)
    assert all(type(v) is int for v in dataclasses.asdict(s).values())
    assert (s.running, s.waiting, s.free_blocks, s.used_blocks, s.steps) == (0, 0, 16, 0, 0)
    reqs = [engine.add(list(range(3 + i, 12 + i)), GREEDY(max_new_tokens=30)) for i in range(3)]
    assert engine.stats().waiting == 3
    engine.step()
    s, sched, alloc = engine.stats(), engine.scheduler, engine.allocator
    assert (s.running, s.waiting) == (len(sched.running), len(sched.waiting)) == (2, 1)
    assert s.free_blocks == alloc.num_free
    assert s.used_blocks == alloc.num_blocks - alloc.num_free > 0
    assert (s.steps, s.prefill_tokens, s.decode_tokens) == (1, 18, 2)
    before, frozen = dataclasses.asdict(s), s
    engine.run()
    assert dataclasses.asdict(frozen) == before                  # a snapshot, not a view
    s = engine.stats()
    assert (s.running, s.waiting, s.free_blocks, s.used_blocks) == (0, 0, 16, 0)
    assert s.preemptions == sched.preemptions > 0    # 16 blocks of 4: two rows of 39 tokens need 20
    assert s.recomputed_tokens > 0 and all(r.finished for r in reqs)
    all_blocks_back(engine)


def test_stream_yields_tokens_and_closing_it_cancels(llama):
    engine = Engine(llama, max_batch=2)
    want = contiguous(llama, [5, 6, 7], GREEDY(max_new_tokens=9))
    assert list(engine.stream(engine.add_request([5, 6, 7], GREEDY(max_new_tokens=9)))) == want
    stream = engine.stream(engine.add_request([8, 9], GREEDY(max_new_tokens=50)))
    next(stream), next(stream)
    stream.close()
    assert not engine.has_work()
    all_blocks_back(engine)


def test_a_step_that_fails_half_way_leaves_a_clean_engine(llama, monkeypatch):
    """Ctrl-C or out-of-memory inside a forward pass: the pool may hold half-written slots,
    so the engine drops every request and its prefix cache, and serves new ones correctly."""
    engine = Engine(llama, max_batch=4)
    rids = [engine.add_request(list(range(3, 40)), GREEDY(max_new_tokens=20)) for _ in range(2)]
    engine.step()
    calls = {"n": 0}
    forward = type(llama).forward

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(type(llama), "forward", flaky)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            engine.step()
    monkeypatch.undo()
    assert not engine.has_work() and all(engine.cancel(r) is False for r in rids)
    all_blocks_back(engine)
    assert not engine.allocator.cached                 # nothing half-written can be hit later
    prompt = list(range(3, 40))
    assert list(engine.stream(engine.add_request(prompt, GREEDY(max_new_tokens=12)))) == \
        contiguous(llama, prompt, GREEDY(max_new_tokens=12))


@pytest.mark.parametrize("where", ["sample", "finish_reason", "seeded_generator"])
def test_a_failure_in_one_requests_own_work_ends_that_request_alone(llama, monkeypatch, where):
    """Sampling, the stop rule or forking n > 1 branches raising for one request: it ends with
    Finish.ERROR and an event saying why, its blocks return, and every other request produces
    the tokens it produces alone."""
    import engine as E
    prompts = [list(range(3, 3 + k)) for k in (5, 17, 9, 30)]
    solo = [contiguous(llama, p, GREEDY(max_new_tokens=8)) for p in prompts]
    poison = GREEDY(max_new_tokens=8, temperature=1.0, seed=7)      # its own params object
    real, calls = getattr(E, where), {"n": 0}

    def failing(*args):
        hit = poison in args or (where == "seeded_generator" and args[0] == poison.seed + 1)
        calls["n"] += hit
        if hit and calls["n"] == (1 if where == "seeded_generator" else 3):
            raise RuntimeError("injected")
        return real(*args)
    monkeypatch.setattr(E, where, failing)
    engine = Engine(llama, max_batch=8)
    reqs = [engine.add(p, GREEDY(max_new_tokens=8)) for p in prompts[:2]]
    bad = engine.add(list(range(40, 60)), poison, n=2)
    reqs += [engine.add(p, GREEDY(max_new_tokens=8)) for p in prompts[2:]]
    events = []
    while engine.has_work():
        events += engine.step()
    failed = [e for e in events if e.request_id == bad.id and e.finish_reason is M.Finish.ERROR]
    assert len(failed) == 1 and failed[0].error == "RuntimeError: injected" and failed[0].token == -1
    assert bad.finished and set(bad.finish_reasons) == {M.Finish.ERROR}
    assert [r.sequences[0].output for r in reqs] == solo
    all_blocks_back(engine)


def test_sessions_keep_a_conversation_until_blocks_are_needed(llama):
    engine = Engine(llama, num_blocks=12, block_size=4, max_batch=2)     # 48 token slots
    turn1 = list(range(3, 20))
    out1 = list(engine.stream(engine.add_request(turn1, GREEDY(max_new_tokens=6), session="chat")))
    assert engine.num_free_blocks < 12                                   # parked, not freed
    turn2 = turn1 + out1 + [40, 41, 42]
    rid = engine.add_request(turn2, GREEDY(max_new_tokens=6), session="chat")
    req = engine.request(rid)
    out2 = list(engine.stream(rid))
    assert out2 == contiguous(llama, turn2, GREEDY(max_new_tokens=6))
    assert (req.cached_tokens, req.prefill_tokens) == (len(turn1) + 5, 4)   # only the new tokens ran
    # The other requests need the whole pool: the idle conversation gives its blocks back.
    others = [list(range(100, 130)), list(range(150, 160))]
    got = [o[0] for o in run_engine(engine, others, GREEDY(max_new_tokens=10))]
    assert got == [contiguous(llama, p, GREEDY(max_new_tokens=10)) for p in others]
    assert engine.end_session("chat") is False                           # already given back
    all_blocks_back(engine)


# --- the scheduler alone: no model, no torch tensors ---------------------------

def fake_next(tokens):
    """A deterministic 'model': the next token is a hash of every token it reads."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 2654435761) % 1000


@pytest.mark.parametrize("budget", [None, 5])
def test_scheduler_bookkeeping_without_a_model(budget):
    """A fake storage holds, per slot, the token id written there; the fake model reads a
    sequence back through its block table. Admission (whole, or in chunks of at most
    ``budget`` tokens a step), preemption with recompute, forks with copy-on-write and
    finishing must hand every sequence exactly its own tokens."""
    rng = random.Random(0)
    alloc = BlockAllocator(24, 4)
    sched = Scheduler(alloc, max_batch=6)
    storage, next_id = {}, 1000
    for i in range(12):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 14))]
        req = Request(i, prompt, M.SamplingParams(max_new_tokens=rng.randint(1, 25)), n=2 if i % 5 == 0 else 1)
        seq = Sequence(i, req, forks=req.n - 1)
        req.sequences.append(seq)
        sched.add(seq)

    def compute(seq, start):
        for src, dst in sched.copies:
            storage.update({dst * 4 + j: storage.get(src * 4 + j) for j in range(4)})
        sched.copies.clear()
        t = seq.table
        for p in range(start, t.num_tokens):
            storage[t.slot(p)] = t.token_ids[p]
        return fake_next([storage[t.slot(p)] for p in range(t.num_tokens)])

    def emit(seq, token):
        seq.output.append(token + seq.branch)        # branches diverge
        if len(seq.output) >= seq.request.params.max_new_tokens:
            sched.finish(seq, "length")

    everything = [r.sequences[0] for r in {id(s.request): s.request for s in sched.waiting}.values()]
    while sched.has_work():
        for seq in sched.admit(budget):
            token = compute(seq, seq.n_computed)
            if seq.prefilling:
                continue
            twins = [sched.fork(seq, next_id + b, b + 1) for b in range(seq.forks)]
            next_id, seq.forks = next_id + len(twins), 0
            everything += twins
            for s in [seq] + twins:
                emit(s, token)
        for seq in sched.schedule_decode():
            emit(seq, compute(seq, seq.table.num_tokens - 1))
        alloc.check_invariants()
        for h, blocks in alloc.cached.items():          # the prefix cache finds only computed blocks
            assert all(storage.get(b.id * 4 + j) == b.token_ids[j] for b in blocks for j in range(4))
    assert sched.preemptions > 0
    assert alloc.num_free == alloc.num_blocks and not alloc.live
    assert len(everything) == 12 + 3                           # three requests had n = 2
    for seq in everything:                                     # replay without paging: the same tokens
        want = []
        for _ in range(seq.request.params.max_new_tokens):
            want.append(fake_next(seq.request.prompt + want) + seq.branch)
        assert seq.status is Status.FINISHED and seq.output == want, f"sequence {seq.id}"


def test_out_of_blocks_frees_parked_conversations_first_then_preempts_the_newest():
    """Three sequences whose last blocks fill up in the same step, with no block free: an idle
    parked conversation gives its blocks back first; without one, the newest sequence is
    preempted (back to the front of the queue) and the two oldest decode."""
    for parked in (True, False):
        alloc = BlockAllocator(9 if parked else 6, 4)
        sched = Scheduler(alloc, max_batch=4)

        def start(rid, prompt, session=None):
            req = Request(rid, prompt, M.SamplingParams(max_new_tokens=50), session=session)
            req.sequences.append(Sequence(rid, req))
            sched.add(req.sequences[0])
            return req.sequences[0]
        if parked:
            chat = start(0, [9] * 11, session="chat")
            assert list(sched.admit()) == [chat]
            chat.output.append(1)
            sched.finish(chat, "stop")                     # its 3 blocks stay, parked for a next turn
        seqs = [start(i, [i] * 4) for i in (1, 2, 3)]
        assert list(sched.admit()) == seqs
        batch = seqs
        for _ in range(4):                                 # 4 decode steps: every table reaches 8 tokens
            for s in batch:
                s.output.append(7)
            batch = sched.schedule_decode()
            assert batch == seqs and sched.preemptions == 0
        for s in batch:
            s.output.append(7)
        assert alloc.num_free == 0 and all(alloc.needs_block(s.table) for s in seqs)
        batch = sched.schedule_decode()
        if parked:
            assert batch == seqs and not sched.parked and sched.preemptions == 0
        else:
            assert batch == seqs[:2] and sched.preemptions == 1
            assert list(sched.waiting) == [seqs[2]] and seqs[2].table is None
            assert seqs[2].status is Status.WAITING
        assert all(s.table.num_tokens == 9 for s in batch) and not sched.copies
        alloc.check_invariants()


# --- chunked prefill -------------------------------------------------------------

def test_fixed_shape_passes_pad_less_than_a_third():
    """A fixed-shape decode pass (the compiled engine's) pads its rows to a few shapes, each a
    compiled step to build, and wastes less than a third of a pass on padding rows."""
    assert sorted({padded_rows(n) for n in range(1, 33)}) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    for n in range(1, 1000):
        assert n <= padded_rows(n) and 3 * (padded_rows(n) - n) < padded_rows(n)


def test_chunked_prefill_produces_the_tokens_of_whole_prompts(llama):
    """Prompts longer than a step's budget are prefilled over several steps, never more
    than the budget a step; every request's greedy tokens equal the unchunked engine's:
    long and short prompts, a shared prefix, n = 2, and a small pool that preempts."""
    rng = random.Random(5)
    system = list(range(200, 261))                    # 61 shared tokens
    prompts = [system + [rng.randrange(3, 320) for _ in range(rng.randint(1, 90))] for _ in range(6)] + \
        [[rng.randrange(3, 320) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    rng.shuffle(prompts)
    params = [GREEDY(max_new_tokens=rng.randint(1, 30)) for _ in prompts]
    for pool in (dict(), dict(num_blocks=24, block_size=8)):        # the second: 192 slots for ~12 × 130
        outputs = {}
        for chunk in (None, 7, 32):
            engine = Engine(llama, max_batch=8, chunk_tokens=chunk, **pool)
            reqs = [engine.add(p, sp, n=2) for p, sp in zip(prompts, params)]
            most = 0
            while engine.has_work():
                before = engine.stats().prefill_tokens
                engine.step()
                most = max(most, engine.stats().prefill_tokens - before)
                engine.allocator.check_invariants()
            assert most == chunk if chunk else most > 32     # unchunked: several whole prompts a step
            outputs[chunk] = [[s.output for s in sorted(r.sequences, key=lambda s: s.branch)] for r in reqs]
            assert [r.cached_tokens + r.prefill_tokens for r in reqs] == list(map(len, prompts))
            assert (engine.scheduler.preemptions > 0) == bool(pool)
            all_blocks_back(engine)
        assert outputs[7] == outputs[32] == outputs[None]
        assert all(len(o[0]) == sp.max_new_tokens and o[0] == o[1] for o, sp in zip(outputs[None], params))
    llama.prefill_chunk = 9     # a runner's model: the engine's passes stay the engine's (whole prompts here)
    try:
        engine = Engine(llama, max_batch=8, chunk_tokens=None, **pool)
        reqs = [engine.add(p, sp, n=2) for p, sp in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        assert [[s.output for s in sorted(r.sequences, key=lambda s: s.branch)] for r in reqs] == outputs[None]
        all_blocks_back(engine)
    finally:
        llama.prefill_chunk = None


def test_a_sequence_preempted_mid_prefill_produces_the_same_tokens(llama):
    """Two sequences decode in a 14-block pool while a 32-token prompt is prefilled 2 tokens
    a step; when they run out of blocks the newest, the half-prefilled one, goes back to the
    queue, and when readmitted computes what the prefix cache no longer holds."""
    engine = Engine(llama, num_blocks=14, block_size=4, max_batch=4, chunk_tokens=2)
    reqs = [engine.add([5, 6, 7, 8], GREEDY(max_new_tokens=30)), engine.add([9, 10, 11], GREEDY(max_new_tokens=30))]
    engine.step(), engine.step()
    reqs.append(engine.add(list(range(20, 52)), GREEDY(max_new_tokens=5)))
    preempted, preempt = [], engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append((seq.request.id, seq.prefilling)), preempt(seq))[1]
    engine.run()
    assert (reqs[2].id, True) in preempted
    assert [r.sequences[0].output for r in reqs] == [contiguous(llama, r.prompt, r.params) for r in reqs]
    assert (reqs[2].cached_tokens, reqs[2].prefill_tokens) == (0, 32)     # as first admitted
    all_blocks_back(engine)


def test_cancel_mid_prefill_leaves_only_computed_blocks_in_the_prefix_cache(llama):
    """A client disconnects while its long prompt is half prefilled: its blocks return at
    once, the prefix cache holds exactly the blocks computed so far, and a later request
    with the same prompt hits those and produces the tokens of a cold run."""
    prompt = list(range(3, 103))                           # 100 tokens: 25 blocks of 4
    engine = Engine(llama, block_size=4, max_batch=4, chunk_tokens=10)
    a = engine.add(prompt, GREEDY(max_new_tokens=5))
    for _ in range(3):
        assert engine.step() == [] and a.sequences[0].prefilling
    assert a.sequences[0].table.num_tokens == 30 and len(engine.allocator.cached) == 7   # 28 tokens in full blocks
    assert engine.cancel(a.id)
    all_blocks_back(engine)
    assert len(engine.allocator.cached) == 7
    b = engine.add(prompt, GREEDY(max_new_tokens=12))
    engine.run()
    assert (b.cached_tokens, b.prefill_tokens) == (28, 72)
    assert b.sequences[0].output == contiguous(llama, prompt, GREEDY(max_new_tokens=12))
    all_blocks_back(engine)


# --- the chat runner on the engine --------------------------------------------

class InterruptAfter(io.StringIO):
    """An output stream that presses Ctrl-C (a real SIGINT) after n writes."""
    def __init__(self, n):
        super().__init__()
        self.n = n

    def write(self, text):
        self.n -= 1
        if self.n == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def test_chat_paged_ctrl_c_stops_the_answer_between_steps(tiny_ckpt):
    m, tok = nl.load(nl.RunConfig(str(tiny_ckpt)))
    chat = serve_local.PagedChat(m, tok, M.SamplingParams(max_new_tokens=30), raw=True, ctx=200)
    m.config.eos_ids = []
    out = InterruptAfter(3)
    chat.turn("hello there", out=out)
    assert out.getvalue().rstrip().endswith("[interrupted]")
    assert not chat.engine.has_work()
    assert len(chat.ids) == len(tok.encode("hello there")) + 3         # three tokens were shown
    # The next turn continues from the prefix cache, and answers as if nothing happened.
    stats = chat.turn(" and more", out=io.StringIO())
    want = contiguous(m, chat.ids[:-stats.new_tokens], M.SamplingParams(max_new_tokens=30))
    assert chat.ids[-stats.new_tokens:] == want
    chat.engine.allocator.check_invariants()


def test_chat_paged_turns_reuse_blocks(bundled_dir):
    m, tok = nl.load(nl.RunConfig(str(bundled_dir)))
    params = M.SamplingParams(max_new_tokens=8)
    runs = {}
    for kv in ("contiguous", "paged"):
        kind = serve_local.PagedChat if kv == "paged" else serve_local.Chat
        chat = kind(m, tok, params, system="You are a concise geography assistant.", ctx=512)
        turns = []
        for text in ["What is the capital of France?", "And of Italy?"]:
            out = io.StringIO()
            stats = chat.turn(text, out=out)
            turns.append((out.getvalue(), stats.prompt_tokens, chat.cached_tokens, len(chat.ids)))
        chat.reset()
        stats = chat.turn("What is the capital of Spain?", out=io.StringIO())
        runs[kv] = turns, (stats.prompt_tokens, chat.cached_tokens, len(chat.ids) - stats.new_tokens)
    (c1, c2), _ = runs["contiguous"]
    (p1, p2), (new_prompt, new_cached, new_len) = runs["paged"]
    assert (p1[0], p2[0]) == (c1[0], c2[0])                     # the same answers
    assert p1[1] == c1[1] and p1[2] == 0                        # turn 1: everything computed
    assert p2[1] == c2[1] < c1[3]                               # turn 2: only the new tokens, like the contiguous cache
    assert p2[2] == c1[3] - 1                                   # ... after the whole first turn, from its blocks
    line = serve_local.stats_line(M.GenerationStats(prompt_tokens=p2[1], new_tokens=3, prefill_s=0.1, decode_s=0.1),
                                  p2[3], 512, p2[2])
    assert f"prompt {p2[1]} tok (+{p2[2]} cached)" in line
    # A new conversation with the same system prompt reuses the system prompt's full blocks.
    assert new_cached >= 16 and new_prompt == new_len - new_cached
