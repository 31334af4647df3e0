"""Speculative decoding (speculative.py): exact for every proposer, greedy and sampled.

Greedy: token-for-token equal to plain greedy decoding. Sampled: a chi-square
test of emitted token counts against the target's own distributions, which a
deliberately wrong rule (accept everything) must fail."""

import json
import shutil

import pytest
import torch

import model as M
import sampling
import bench
import drafting as D
import serve_local
import speculative as S
from conftest import make_checkpoint

SMALL = dict(tokenizer=False, max_position_embeddings=1024)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target and a different, smaller random draft with the same 320-token vocabulary."""
    root = tmp_path_factory.mktemp("spec")
    target = M.Llama.from_pretrained(make_checkpoint(root / "target", **SMALL), "cpu", torch.float32)
    draft = M.Llama.from_pretrained(make_checkpoint(root / "draft", hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, num_key_value_heads=1,
                                                    intermediate_size=64, **SMALL), "cpu", torch.float32)
    target.config.eos_ids = draft.config.eos_ids = []     # always generate the full length
    return target, draft


PROMPTS = [[0, 5, 17, 99, 4], [0, 250, 251, 252, 253, 7, 7, 7], [0, 42]]


def head_subset(src, dst, ids: list[int]):
    """A copy of a draft checkpoint whose head scores only `ids` (train.py's kind of draft)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"][ids].contiguous()
    state["model.head_ids"] = torch.tensor(ids)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": len(ids)}))
    return dst


@pytest.fixture(scope="module")
def subset_draft(tmp_path_factory):
    """A draft whose tied head scores 96 of the 320 tokens, as train.py writes them:
    embedding rows shared with the head, `head_ids` and draft_vocab_size stored."""
    cfg = json.loads((make_checkpoint(tmp_path_factory.mktemp("cfg") / "c", tokenizer=False) / "config.json")
                     .read_text())
    cfg.update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=64, max_position_embeddings=1024, tie_word_embeddings=True, draft_vocab_size=96)
    path = M.save_random_checkpoint(cfg, tmp_path_factory.mktemp("subset") / "d", seed=1)
    return M.Llama.from_pretrained(path, "cpu", torch.float32)


@pytest.fixture(scope="module")
def eagle_head(models, tmp_path_factory):
    """A random EAGLE head for the target: one block of its width, a head over 96
    tokens, the target's embedding and LM head rows (train.py's kind of head)."""
    target, _ = models
    root = tmp_path_factory.mktemp("eagle")
    cfg = json.loads((make_checkpoint(root / "c", **SMALL) / "config.json").read_text())
    cfg.update(num_hidden_layers=1, eagle=True, draft_vocab_size=96)
    head = M.Llama.from_pretrained(M.save_random_checkpoint(cfg, root / "h", seed=2), "cpu", torch.float32)
    return head.share_target(target)


def test_head_subset_logits(models, subset_draft, tmp_path):
    """A head over part of the vocabulary gives the full head's logits on its
    tokens and −inf (probability 0) on every other; tied, its rows are the
    embedding's."""
    target, _ = models
    ids = list(range(0, 320, 3))
    full = M.Llama.from_pretrained(make_checkpoint(tmp_path / "full", **SMALL), "cpu", torch.float32)
    part = M.Llama.from_pretrained(head_subset(tmp_path / "full", tmp_path / "part", ids), "cpu", torch.float32)
    tokens = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        want, got = (m(tokens, torch.arange(tokens.shape[1])) for m in (full, part))
    torch.testing.assert_close(got[..., ids], want[..., ids])
    assert torch.isneginf(got).sum() == got[..., :1].numel() * (320 - len(ids))
    d = subset_draft
    assert d.head_ids.shape == (96,) and torch.equal(d.lm_head.weight, d.embed_tokens.weight[d.head_ids])
    with torch.inference_mode():
        probs = sampling.sampling_probs(d(tokens, torch.arange(tokens.shape[1]))[0], M.SamplingParams(temperature=1.0))
    outside = torch.ones(320, dtype=torch.bool)
    outside[d.head_ids] = False
    assert (probs[:, outside] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(len(probs)))


def plain(model, prompt, n):
    return list(M.generate_cached(model, prompt, M.SamplingParams(temperature=0, max_new_tokens=n)))


def check_cache_lengths(prompt, spec, draft: str | None):
    """After every step the target's cache holds exactly the accepted tokens (all but
    the last emitted one, which is fed next); a draft's holds the same, less its
    own last guess after a fully accepted step (that guess never ran through it);
    an EAGLE head's only its entries on true features: those before the step."""
    for emitted, n, k, target_len, draft_len in spec.trace:
        assert target_len == len(prompt) + emitted - 1
        if draft == "draft" and k:    # k = 0: a plain last step, the draft was not asked
            assert draft_len == target_len - (1 if n == k else 0)
        if draft == "eagle" and k:
            assert draft_len == target_len - 1 - n


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identical_to_plain(models, subset_draft, eagle_head, k):
    target, draft = models
    proposers = {"draft": lambda: D.DraftModel(draft, target, k),
                 "eagle head": lambda: D.EagleDraft(eagle_head, target, k),
                 "adaptive eagle head": lambda: D.EagleDraft(eagle_head, target, k, adaptive=True),
                 "tree eagle head": lambda: D.EagleDraft(eagle_head, target, k, tree=(3, 2 * k)),
                 "lookup then tree eagle":
                     lambda: D.LookupThenDraft(D.EagleDraft(eagle_head, target, k, tree=(2, 6)), 2),
                 "lookup then draft": lambda: D.LookupThenDraft(D.DraftModel(draft, target, k, adaptive=True), 2),
                 "lookup then eagle": lambda: D.LookupThenDraft(D.EagleDraft(eagle_head, target, k), 2),
                 "subset-head draft": lambda: D.DraftModel(subset_draft, target, k),
                 "adaptive draft": lambda: D.DraftModel(draft, target, k, adaptive=True),
                 "self draft": lambda: D.DraftModel(target, target, k),
                 "prompt lookup": lambda: S.PromptLookup(3, k),
                 "lookahead": lambda: S.Lookahead(4, k + 1, 3)}
    greedy = M.SamplingParams(temperature=0, max_new_tokens=128)
    for prompt in PROMPTS:
        want = plain(target, prompt, 128)
        for name, make in proposers.items():
            spec, cache = S.SpecStats(), target.new_cache()
            got = list(S.generate(target, prompt, greedy, make(), spec=spec, cache=cache))
            assert got == want, (name, k, prompt)
            assert cache.length == len(prompt) + 128 - 1
            check_cache_lengths(prompt, spec, None if name.startswith("lookup then") else "draft"
                                if name.endswith("draft") else "eagle" if name.endswith("eagle head") else None)
            if name == "self draft":     # the target as its own draft agrees with itself everywhere
                assert spec.acceptance == 1.0, spec.summary()
            if name in ("self draft", "prompt lookup", "lookahead", "lookup then draft"):
                assert spec.accepted > 0, (name, k, spec.summary())    # a random draft alone may never agree


@pytest.mark.parametrize("kind", ["draft", "eagle", "bf16 eagle"])
def test_compiled_draft_equals_plain(models, subset_draft, eagle_head, kind):
    """A draft model (or an EAGLE head) with compile=True drafts on a static
    cache through the compiled one-token step; the output is still the
    target's own, and the cache resets when it is too small. Both have subset
    heads, like the bundled one. A bf16 head under the fp32 target (what
    load_draft makes of the bundled one here) reads fp32 embeddings and
    features and keeps a bf16 cache."""
    import copy
    target, _ = models
    draft = copy.deepcopy(subset_draft if kind == "draft" else eagle_head)  # its compiled step stays off the fixture
    if kind != "draft":
        draft.to(torch.bfloat16 if kind == "bf16 eagle" else torch.float32).share_target(target)
        assert draft.lm_head.weight.dtype == draft.fc.weight.dtype == draft.new_cache().spec[3]
    proposer = D.draft_proposer(draft, target, 4, compile=True)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=64)
    for prompt in PROMPTS[:2]:
        spec = S.SpecStats()
        assert list(S.generate(target, prompt, greedy, proposer, spec=spec)) == plain(target, prompt, 64)
        check_cache_lengths(prompt, spec, kind)
    assert draft.compiled_step is not None and proposer.cache.limit == 512     # the smallest size
    long = list(range(1, 300)) * 3
    proposer = D.draft_proposer(draft, target, 4, compile=True)
    assert list(S.generate(target, long, greedy, proposer)) == plain(target, long, 64)
    assert proposer.cache.limit == 1024          # the next power of two: the model's whole context here


def test_lookup_then_draft_chooses(models):
    """The lookup proposes only after an exact match of all N tokens, up to 2k of
    what followed; otherwise the draft guesses; adaptive k follows the draft's own
    guesses only."""
    target, draft = models
    greedy = M.SamplingParams(temperature=0)
    hybrid = D.LookupThenDraft(D.DraftModel(draft, target, 3, adaptive=True), 3)
    with torch.inference_mode():
        repeat = [0, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 7, 8, 9]
        assert hybrid.propose(repeat, 6, 100, greedy, None).candidates == [[10, 11, 12, 13, 14, 15]]
        assert hybrid.looked_up and hybrid.k == 6
        hybrid.update(repeat + [10, 11, 12, 13, 14, 15, 16], 6, 6, None)
        assert hybrid.draft.k == 3                       # a fully accepted lookup step: no growth
        once = [0, 7, 8, 9, 10, 5, 6, 9]                 # only "9" repeats: a 1-token match, not 3
        prop = hybrid.propose(once, 6, 100, greedy, None)
        assert not hybrid.looked_up and len(prop.candidates[0]) == 3
        assert prop.candidates == D.DraftModel(draft, target, 3).propose(once, 3, 100, greedy, None).candidates


def test_eagle_reads_the_right_features(models, eagle_head):
    """The head's cache, built step by step from the features each verify pass
    reported (and only the accepted ones), equals one fresh pass of the head over
    the whole context with the target's features from one fresh forward: entry j
    reads (token j+1, feature j). Its next guess is that pass's argmax."""
    target, _ = models
    proposer = D.EagleDraft(eagle_head, target, 4)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=48)
    prompt = PROMPTS[1]
    context = prompt + list(S.generate(target, prompt, greedy, proposer))
    with torch.inference_mode():
        guess = proposer.propose(context, 1, 100, greedy, None).candidates[0][0]
    t = len(context) - 1
    with torch.inference_mode():
        _, feats = target(torch.tensor([context]), torch.arange(t + 1), hidden=True)
        fresh = eagle_head.new_cache()
        logits = eagle_head(torch.tensor([context[1:]]), torch.arange(t), fresh, features=feats[:, :t])
    assert proposer.cache.length == t
    for layer in range(len(fresh.k)):
        torch.testing.assert_close(proposer.cache.k[layer][:, :, :t], fresh.k[layer][:, :, :t], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(proposer.cache.v[layer][:, :, :t], fresh.v[layer][:, :, :t], atol=1e-4, rtol=1e-4)
    assert guess == int(logits[0, -1].argmax())
    # a wrong alignment (feature j+1 with token j+1) builds a different cache
    with torch.inference_mode():
        wrong = eagle_head.new_cache()
        eagle_head(torch.tensor([context[1:]]), torch.arange(t), wrong, features=feats[:, 1:])
    assert not torch.allclose(proposer.cache.k[0][:, :, :t], wrong.k[0][:, :, :t], atol=1e-3)


class FixedTree:
    """A proposer that knows the answer and offers it last, behind wrong branches,
    one of which shares its first token: [wrong], [right₀, wrong...], [right]."""
    needs_dynamic_cache, needs_features, k = True, False, 4

    def __init__(self, prompt, want, vocab):
        self.n, self.want, self.vocab = len(prompt), want, vocab

    def propose(self, context, k, room, params, gen):
        right = self.want[len(context) - self.n:][:k]
        wrong = [(t + 1) % self.vocab for t in right]
        return S.Proposal([wrong, right[:1] + wrong[1:], right])

    def update(self, context, n, k, branch_logits):
        pass


def test_token_tree():
    tree = S.token_tree([[5, 6, 7], [5, 6, 8], [5, 9], [4]])
    assert tree.tokens == [5, 6, 7, 8, 9, 4]          # 5 and 6 once
    assert tree.parents == [0, 1, 2, 2, 1, 0] and tree.depths == [1, 2, 3, 3, 2, 1]
    assert tree.rows == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5], [0, 6]]
    mask = tree.mask()
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 4]      # 8 sees x_t, 5, 6 and itself
    assert mask[6].nonzero().flatten().tolist() == [0, 6]
    assert not tree.is_chain and S.token_tree([[1, 2, 3]]).is_chain and S.token_tree([]).is_chain


@pytest.mark.parametrize("branches", ["lookahead", "tree"])
def test_accepted_rows_moved_behind_x_t(models, branches):
    """With several candidates the accepted one may not sit right behind x_t; its K/V
    rows are moved there. The cache must then equal a plain prefill of the same tokens."""
    target, _ = models
    prompt = [0, 9, 8, 7, 9, 8, 7, 9, 8]
    want = plain(target, prompt, 96)
    proposer = S.Lookahead(5, 3, 4) if branches == "lookahead" else \
        FixedTree(prompt, want, target.config.vocab_size)
    spec, cache = S.SpecStats(), target.new_cache()
    out = list(S.generate(target, prompt, M.SamplingParams(temperature=0, max_new_tokens=96),
                          proposer, spec=spec, cache=cache))
    assert out == want
    if branches == "tree":          # the last branch wins every step: 4 guesses and the target's next token
        assert spec.histogram[4] >= 18 and spec.tokens_per_forward > 4.5, spec.summary()
    ref = target.new_cache()
    with torch.inference_mode():
        seq = prompt + out[:-1]
        target(torch.tensor([seq]), torch.arange(len(seq)), ref)
    assert cache.length == ref.length
    for a, b in zip(cache.k + cache.v, ref.k + ref.v):
        torch.testing.assert_close(a[:, :, :ref.length], b[:, :, :ref.length], atol=1e-5, rtol=1e-5)


def test_spec_k_and_context_limit(models):
    """k shrinks near max_new_tokens and the end of the context; output still exact."""
    target, draft = models
    limit = target.config.max_seq_len
    prompt = list(range(1, 300)) * 4
    prompt = prompt[:limit - 20]
    want = plain(target, prompt, 64)
    got = list(S.generate(target, prompt, M.SamplingParams(temperature=0, max_new_tokens=64),
                          D.DraftModel(draft, target, 8)))
    assert got == want and len(got) == 20     # the context, not max_new_tokens, ends it
    for n in (1, 2, 3):
        for proposer in (D.DraftModel(draft, target, 8), S.PromptLookup(1, 8), S.Lookahead(3, 4, 2)):
            got = list(S.generate(target, PROMPTS[1], M.SamplingParams(temperature=0, max_new_tokens=n), proposer))
            assert got == plain(target, PROMPTS[1], n)


# ----------------------------------------------------------------------------
# Sampling: the rule keeps the target's distribution.

def chi_square_p(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's test; cells expecting fewer than min_expected counts are pooled into one."""
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_rule_on_probability_vectors():
    """verify() alone, one guess drawn from q: the emitted token follows p; a rule
    that accepts every guess emits q instead and fails the same test."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.08, 0.05, 0.02])
    q = torch.tensor([0.05, 0.10, 0.10, 0.30, 0.05, 0.20, 0.20])
    n = 20000
    guesses = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    counts = torch.zeros(len(p))
    target = [torch.stack([p, p])]
    for d in guesses:
        _, accepted, nxt = S.verify(target, [[d]], q[None], gen)
        counts[d if accepted else nxt] += 1
    assert chi_square_p(counts, p * n) > 1e-3
    point = torch.zeros(len(p))              # a deterministic proposer (point mass) too
    for _ in range(n):
        _, accepted, nxt = S.verify(target, [[3]], None, gen)
        point[3 if accepted else nxt] += 1
    assert chi_square_p(point, p * n) > 1e-3
    assert chi_square_p(torch.bincount(torch.tensor(guesses), minlength=len(p)).float(), p * n) < 1e-6


def test_greedy_verdict_from_token_ids():
    """verify_greedy (token ids) gives verify's verdict on point masses: the same
    accepted length and next token, for one or several candidates."""
    gen = torch.Generator().manual_seed(0)
    V = 6
    for trial in range(300):
        lens = torch.randint(1, 4, (int(torch.randint(1, 4, ())),), generator=gen).tolist()
        cands = [torch.randint(0, 3, (n,), generator=gen).tolist() for n in lens]
        starts = [1 + sum(lens[:i]) for i in range(len(lens))]      # every candidate in rows of its own

        def argmax_after(prefix):     # a target: its greedy choice depends on the tokens so far only
            return hash((trial, *prefix)) % 3
        best = [argmax_after(())] + [argmax_after(tuple(c[:j + 1])) for c in cands for j in range(len(c))]
        onehot = torch.nn.functional.one_hot(torch.tensor(best), V).float()
        target = [onehot[[0] + list(range(st, st + len(c)))] for st, c in zip(starts, cands)]
        c, n, nxt = S.verify(target, cands, None, gen)
        rows = [[0] + list(range(st, st + len(c))) for st, c in zip(starts, cands)]
        c2, n2, nxt2 = S.verify_greedy(best, rows, cands)
        assert (n2, nxt2, cands[c2][:n2]) == (n, nxt, cands[c][:n]), (best, cands)


def test_distribution_is_what_sample_draws():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(12, generator=gen) * 2
    for params in [M.SamplingParams(temperature=0.8), M.SamplingParams(temperature=1.2, top_k=5),
                   M.SamplingParams(temperature=1.0, top_p=0.7), M.SamplingParams(temperature=0.5, top_k=6,
                                                                                   top_p=0.9)]:
        probs = sampling.sampling_probs(logits[None], params)[0]
        counts = torch.bincount(torch.tensor([sampling.sample(logits, params, gen) for _ in range(4000)]),
                                minlength=12).float()
        assert ((counts > 0) <= (probs > 0)).all()
        assert chi_square_p(counts, probs * 4000) > 1e-3


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec16")
    cfg = dict(vocab_size=16, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
               tokenizer=False, max_position_embeddings=256)
    target = M.Llama.from_pretrained(make_checkpoint(root / "t", num_hidden_layers=2, **cfg), "cpu", torch.float32)
    draft = M.Llama.from_pretrained(make_checkpoint(root / "d", num_hidden_layers=1, **cfg), "cpu", torch.float32)
    # a draft that can only propose 10 of the 16 tokens: q = 0 elsewhere, the rule must stay exact
    part = M.Llama.from_pretrained(head_subset(root / "d", root / "part", [0, 1, 2, 4, 5, 7, 9, 11, 12, 15]),
                                   "cpu", torch.float32)
    # an EAGLE head for the target, over the same 10 tokens
    hf = json.loads((root / "d" / "config.json").read_text())
    hf.update(hidden_size=32, num_hidden_layers=1, eagle=True, draft_vocab_size=10)
    eagle = M.Llama.from_pretrained(M.save_random_checkpoint(hf, root / "e", torch.float32, seed=3), "cpu",
                                    torch.float32).share_target(target)
    target.config.eos_ids = draft.config.eos_ids = part.config.eos_ids = []
    return target, draft, part, eagle


def sampled_counts(target, make_proposer, params, n_seqs, n_new):
    """Run speculative sampling on n_seqs prompts; return observed token counts and
    the expected counts: the sum over emitted tokens of the target's distribution
    given everything before it (one plain forward over each finished sequence)."""
    gen = torch.Generator().manual_seed(0)
    observed, expected = torch.zeros(16), torch.zeros(16)
    spec = S.SpecStats()
    for s in range(n_seqs):
        prompt = [0] + torch.randint(1, 16, (4,), generator=gen).tolist()
        p = M.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             seed=s, max_new_tokens=n_new)
        out = list(S.generate(target, prompt, p, make_proposer(), spec=spec))
        seq = prompt + out
        with torch.inference_mode():
            logits = target(torch.tensor([seq]), torch.arange(len(seq)))[0, len(prompt) - 1:-1]
        expected += sampling.sampling_probs(logits, p).sum(0)
        observed += torch.bincount(torch.tensor(out), minlength=16).float()
    return observed, expected, spec


@pytest.mark.parametrize("method", ["draft", "subset-head draft", "eagle head", "eagle tree head", "lookup then draft",
                                    "prompt lookup", "lookahead"])
def test_sampling_matches_target(small_vocab, method, monkeypatch):
    """≥ 20,000 emitted tokens (the draft) against the target's exact distributions;
    then the same with a rule that accepts every guess, which must fail."""
    target, draft, part, eagle = small_vocab
    make = {"draft": lambda: D.DraftModel(draft, target, 3),
            "subset-head draft": lambda: D.DraftModel(part, target, 3),
            "eagle head": lambda: D.EagleDraft(eagle, target, 3),
            "eagle tree head": lambda: D.EagleDraft(eagle, target, 2, tree=(3, 4)),
            "lookup then draft": lambda: D.LookupThenDraft(D.DraftModel(draft, target, 3), 2),
            "prompt lookup": lambda: S.PromptLookup(2, 4),
            "lookahead": lambda: S.Lookahead(3, 3, 3)}[method]
    params = M.SamplingParams(temperature=1.0, top_p=0.95)
    model = method.endswith(("draft", "head"))     # lookup then draft: partly point masses, partly q
    n_seqs = 160 if model else 40
    observed, expected, spec = sampled_counts(target, make, params, n_seqs, 128)
    assert observed.sum() >= (20000 if model else 5000)
    assert spec.accepted > 0.05 * spec.emitted, spec.summary()      # the rule is really exercised
    assert chi_square_p(observed, expected) > 1e-3, (observed, expected)
    monkeypatch.setattr(S, "accept", lambda p, token, q, gen: True)
    observed, expected, _ = sampled_counts(target, make, params, 40, 128)
    assert chi_square_p(observed, expected) < 1e-6


# ----------------------------------------------------------------------------
# Bad input: one clear error each.

def test_bad_input(models, eagle_head, tmp_path, monkeypatch):
    target, draft = models
    for k in (0, -1):
        with pytest.raises(ValueError, match="spec-k must be >= 1"):
            D.DraftModel(draft, target, k)
        with pytest.raises(ValueError, match="spec-k must be >= 1"):
            S.PromptLookup(3, k)
    for text in ["5,1,5", "0,3,2", "5,3,0", "5,3", "a,b,c"]:
        with pytest.raises(ValueError, match="--lookahead"):
            S.parse_lookahead(text)
    with pytest.raises(ValueError, match="prompt-lookup N needs N >= 1"):
        S.PromptLookup(0)
    other = M.Llama.from_pretrained(make_checkpoint(tmp_path / "v", vocab_size=352, **SMALL), "cpu")
    with pytest.raises(ValueError, match="must use the target's tokenizer"):
        D.DraftModel(other, target)
    with pytest.raises(ValueError, match="EAGLE head"):
        D.EagleDraft(draft, target)
    narrow = M.Llama.from_pretrained(make_checkpoint(tmp_path / "n", hidden_size=32, **SMALL), "cpu")
    wide_cfg = json.loads((tmp_path / "n" / "config.json").read_text())
    wide_cfg.update(num_hidden_layers=1, eagle=True, draft_vocab_size=8)
    head = M.Llama.from_pretrained(M.save_random_checkpoint(wide_cfg, tmp_path / "e"), "cpu").share_target(narrow)
    with pytest.raises(ValueError, match="width is 32 but the target's is 64"):
        D.EagleDraft(head, target)
    with pytest.raises(ValueError, match="needs the target's features"):
        head(torch.tensor([[1, 2]]), torch.arange(2))
    for proposer in (S.Lookahead(3, 3, 3), D.EagleDraft(eagle_head, target, 3, tree=(2, 4))):
        with pytest.raises(ValueError, match="need the dynamic cache"):
            next(S.generate(target, [0, 1], M.SamplingParams(), proposer,
                            cache=target.new_cache("static", max_len=64)))
    for text in ["0,4", "2,0", "2", "a,b"]:
        with pytest.raises(ValueError, match="--spec-tree"):
            S.parse_tree(text)
    with pytest.raises(ValueError, match="--spec-tree W,M needs W >= 1"):
        D.EagleDraft(eagle_head, target, 3, tree=(0, 4))


def test_draft_vocabulary_checked_at_load(tmp_path):
    tgt_dir = make_checkpoint(tmp_path / "t")
    bad_dir = make_checkpoint(tmp_path / "d", vocab_size=352)
    target, tok = M.load(str(tgt_dir))
    with pytest.raises(ValueError, match="draft's vocabulary .* differs"):
        D.load_draft(str(bad_dir), target, tok)
    assert D.load_draft(str(tgt_dir), target, tok).config.vocab_size == 320
    # train.py's drafts carry no tokenizer files: they load with the target's, vocabulary still checked
    for d in (tgt_dir, bad_dir):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).unlink(missing_ok=True)
    assert D.load_draft(str(tgt_dir), target, tok).config.vocab_size == 320
    with pytest.raises(ValueError, match="draft's vocabulary .* differs"):
        D.load_draft(str(bad_dir), target, tok)


def test_runner_flags(tmp_path, monkeypatch, capsys):
    import serve_local
    tgt = str(make_checkpoint(tmp_path / "t"))
    monkeypatch.setattr(D, "BUNDLED_DRAFT", tmp_path / "no-draft")
    cases = [(["--draft", "bundled"], "python train.py"), (["--spec-k", "0", "--prompt-lookup", "3"], "spec-k"),
             (["--lookahead", "4,1,4"], "--lookahead"), (["--lookahead", "4,3,4", "--prompt-lookup", "2"],
                                                         "choose one speculative method"),
             (["--spec-tree", "4,10"], "--spec-tree needs --draft"), (["--draft", tgt, "--spec-tree", "4,10"],
                                                                      "--spec-tree needs an EAGLE head"),
             (["--draft", tgt, "--spec-tree", "4"], "--spec-tree takes W,M")]
    for flags, message in cases:
        assert serve_local.main(["--model", tgt, "--prompt", "hi", *flags]) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error: ") and message in err, err
    for flags in (["--prompt-lookup", "2"], ["--draft", tgt, "--prompt-lookup", "2"]):
        assert serve_local.main(["--model", tgt, "--prompt", "hello", "--temperature", "0",
                                 "--max-new-tokens", "24", *flags]) == 0
        assert "acceptance" in capsys.readouterr().err


def test_static_cache_and_chat_turns(models, tmp_path):
    """Draft and prompt lookup run on a static cache too; in a chat, later turns see the
    whole conversation (history) and still match plain decoding turn by turn."""
    import io
    import serve_local
    target, draft = models
    prompt = PROMPTS[1]
    want = plain(target, prompt, 64)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=64)
    for proposer in (D.DraftModel(draft, target, 4), S.PromptLookup(3, 4)):
        cache = target.new_cache("static", max_len=128)
        assert list(S.generate(target, prompt, greedy, proposer, cache=cache)) == want
        assert cache.length == len(prompt) + 64 - 1
    model, tok = M.load(str(make_checkpoint(tmp_path / "chat")))
    model.config.eos_ids = []
    params = M.SamplingParams(temperature=0, max_new_tokens=40)
    chats = [serve_local.Chat(model, tok, params),
             serve_local.Chat(model, tok, params, proposer=S.PromptLookup(2, 4)),
             serve_local.Chat(model, tok, params, proposer=S.Lookahead(3, 3, 3))]
    for text in ["hello there", "the quick brown fox", "how can I help"]:
        answers = [io.StringIO() for _ in chats]
        for chat, out in zip(chats, answers):
            chat.turn(text, out)
        assert answers[1].getvalue() == answers[0].getvalue() == answers[2].getvalue()
        assert chats[1].cache.length == chats[0].cache.length == chats[2].cache.length


def test_lookahead_mask_respects_sliding_window(tmp_path):
    target = M.Llama.from_pretrained(make_checkpoint(tmp_path / "w", **SMALL), "cpu", torch.float32)
    target.config.eos_ids, target.config.sliding_window = [], 12     # Mistral-style attention window
    prompt = [0, 9, 8, 7, 9, 8, 7, 9, 8, 3, 4]
    want = plain(target, prompt, 96)
    got = list(S.generate(target, prompt, M.SamplingParams(temperature=0, max_new_tokens=96), S.Lookahead(4, 3, 4)))
    assert got == want


def test_committed_draft(bundled_dir):
    """drafts/ holds train.py's EAGLE head for the bundled model: within the 25 MB
    budget, no tokenizer, embedding or LM head of its own (it uses the target's),
    a head over part of the vocabulary; speculative output with it is still the
    target's own, and it guesses well (a random head gives ~1.0 token per forward)."""
    files = list(D.BUNDLED_DRAFT.iterdir())
    assert sum(f.stat().st_size for f in files) <= 25e6 and {f.name for f in files} == {"config.json",
                                                                                          "model.safetensors"}
    target, tok = M.load(str(bundled_dir), "cpu", "float32")
    head = D.load_draft("bundled", target, tok)
    assert head.config.eagle and head.embed_tokens is target.embed_tokens
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()       # stored in bf16: run in bf16 where the CPU can
    assert head.fc.weight.dtype == head.lm_head.weight.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert head.head_ids is not None and len(head.head_ids) < target.config.vocab_size
    text = "Write a short poem about a lighthouse keeper."     # bench.py's second chat prompt
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=64)
    want = list(M.generate_cached(target, prompt, greedy))
    per_forward = []
    for proposer in (D.EagleDraft(head, target, 3), D.LookupThenDraft(D.EagleDraft(head, target, 3), 3),
                     serve_local.make_proposer(target, tok, "bundled", 3, tree="4,10")):
        spec = S.SpecStats()
        assert list(S.generate(target, prompt, greedy, proposer, spec=spec)) == want
        per_forward.append(spec.tokens_per_forward)
    # measured: 1.85 (head alone), 2.62 (a tree of 10 from the same head)
    assert min(per_forward) > 1.5 and per_forward[2] > per_forward[0] + 0.3, per_forward


def test_narrow_draft():
    """A bf16-stored draft runs in bf16 only under an fp32 target on a CPU that computes bf16."""
    cpu = torch.device("cpu")
    assert D.narrow_draft("bfloat16", cpu, torch.float32) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not D.narrow_draft("float32", cpu, torch.float32)
    assert not D.narrow_draft(None, cpu, torch.float32)
    assert not D.narrow_draft("bfloat16", torch.device("cuda"), torch.float32)


def test_compare_reports_where_texts_part(models):
    """bench.py's table: exact methods match plain decoding on every prompt; a text
    that parts from it is reported with the first new token that differs."""
    target, _ = models
    static = target.new_cache("static", 64)      # plain decoding on a given cache, reused prompt after prompt
    rows = bench.compare(target, PROMPTS[:2], {"plain": lambda: None, "lookup": lambda: S.PromptLookup(2, 3),
                                           "static": lambda: static}, 24)
    assert [r["diverged"] for r in rows] == [[None, None]] * 3
    assert rows[0]["speedup"] == 1.0 and rows[1]["spec"].steps > 0 and rows[2]["spec"] is None
    assert bench.same_tokens([None, None]) == "yes"
    assert bench.same_tokens([None, 7, 3]) == "1/3; others from token 3, 7"


def test_plain_step_baseline_uses_the_given_cache(models):
    """The runner's baseline runs through its own cache (compiled with --compile) and leaves it empty."""
    target, _ = models
    cache = target.new_cache("static", 256)
    assert serve_local.plain_step_s(target, cache) > 0 and cache.length == 0
    assert serve_local.plain_step_s(target) > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_simple_chain_equals_the_general_loop(models, temperature):
    """speculative.generate_simple, the algorithm alone, gives the general loop's tokens
    with a DraftModel: greedy, and sampled with the same seed (the same draws in the same order)."""
    target, draft = models
    for k in (1, 3):
        for prompt in PROMPTS:
            p = M.SamplingParams(temperature=temperature, seed=7, max_new_tokens=30)
            simple = list(S.generate_simple(target, prompt, p, draft, k))
            general = list(S.generate(target, prompt, p, D.DraftModel(draft, target, k)))
            assert simple == general and len(simple) == 30
    plain = list(M.generate_cached(target, PROMPTS[0], M.SamplingParams(max_new_tokens=30)))
    assert list(S.generate_simple(target, PROMPTS[0], M.SamplingParams(max_new_tokens=30), draft)) == plain
