"""drafting.py's proposers, the ones that are models (a draft model, an EAGLE head, a
tree of its guesses, lookup then draft): exact like every proposer — greedy tokens equal
to plain decoding's, sampled tokens distributed as the target's own — plus what each
needs of its own (a head over a subset of the vocabulary, features read at the right
positions, the committed draft, compiled drafting)."""

import pytest
import torch

import model as M
import nanoinfer.load as nl
import drafting as D
import sampling
import speculative as S
from conftest import make_checkpoint
from spec_common import PROMPTS, SMALL, check_cache_lengths, check_greedy, check_sampling, head_subset, plain
import kernels
import kvcache


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identical_to_plain(models, subset_draft, eagle_head, medusa_heads, k):
    target, draft = models
    check_greedy(target, {
        "medusa chain": lambda: D.MedusaDraft(medusa_heads, target, k),
        "medusa tree": lambda: D.MedusaDraft(medusa_heads, target, k, tree=(3, 2 * k)),
        "lookup then medusa tree": lambda: D.LookupThenDraft(D.MedusaDraft(medusa_heads, target, k, tree=(2, 6)), 2),
        "draft": lambda: D.DraftModel(draft, target, k),
        "eagle head": lambda: D.EagleDraft(eagle_head, target, k),
        "adaptive eagle head": lambda: D.EagleDraft(eagle_head, target, k, adaptive=True),
        "tree eagle head": lambda: D.EagleDraft(eagle_head, target, k, tree=(3, 2 * k)),
        "lookup then tree eagle": lambda: D.LookupThenDraft(D.EagleDraft(eagle_head, target, k, tree=(2, 6)), 2),
        "lookup then draft": lambda: D.LookupThenDraft(D.DraftModel(draft, target, k, adaptive=True), 2),
        "lookup then eagle": lambda: D.LookupThenDraft(D.EagleDraft(eagle_head, target, k), 2),
        "subset-head draft": lambda: D.DraftModel(subset_draft, target, k),
        "adaptive draft": lambda: D.DraftModel(draft, target, k, adaptive=True),
        "self draft": lambda: D.DraftModel(target, target, k)}, k, n=64)


@pytest.mark.parametrize("method", ["draft", "subset-head draft", "eagle head", "eagle tree head", "lookup then draft",
                                    "medusa chain", "medusa tree"])
def test_sampling_matches_target(small_vocab, method, monkeypatch):
    """Each model proposer: 3,072 emitted tokens against the target's exact distributions
    (speculative.py's rule alone is checked on 20,000 draws in test_speculative.py)."""
    target, draft, part, eagle, medusa = small_vocab
    make = {"medusa chain": lambda: D.MedusaDraft(medusa, target, 3),
            "medusa tree": lambda: D.MedusaDraft(medusa, target, 3, tree=(3, 5)),
            "draft": lambda: D.DraftModel(draft, target, 3),
            "subset-head draft": lambda: D.DraftModel(part, target, 3),
            "eagle head": lambda: D.EagleDraft(eagle, target, 3),
            "eagle tree head": lambda: D.EagleDraft(eagle, target, 2, tree=(3, 4)),
            "lookup then draft": lambda: D.LookupThenDraft(D.DraftModel(draft, target, 3), 2)}[method]
    check_sampling(target, make, monkeypatch, n_seqs=32, n_control=16, n_new=96)


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


@pytest.mark.parametrize("kind", ["draft", "eagle", "bf16 eagle"])
def test_compiled_draft_equals_plain(models, subset_draft, eagle_head, kind):
    """A draft model (or an EAGLE head) whose step is compiled drafts on a static
    cache through the compiled one-token step; the output is still the
    target's own, and the cache resets when it is too small. Both have subset
    heads, like the bundled one. A bf16 head under the fp32 target (what
    load_draft makes of the bundled one here) reads fp32 embeddings and
    features and keeps a bf16 cache."""
    import copy
    target, _ = models
    draft = copy.deepcopy(subset_draft if kind == "draft" else eagle_head)  # its compiled step stays off the fixture
    if kind != "draft":
        D.share_target(draft.to(torch.bfloat16 if kind == "bf16 eagle" else torch.float32), target)
        assert draft.lm_head.weight.dtype == draft.fc.weight.dtype == kvcache.new_cache(draft).spec[3]
    kernels.compile_decode(draft)
    proposer = D.draft_proposer(draft, target, 4)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=64)
    for prompt in PROMPTS[:2]:
        spec = S.SpecStats()
        assert list(S.generate(target, prompt, greedy, proposer, spec=spec)) == plain(target, prompt, 64)
        check_cache_lengths(prompt, spec, kind)
    assert draft.compiled_step is not None and proposer.cache.limit == 512     # the smallest size
    if kind != "draft":
        return      # growing the cache is the same code for every draft: one kind builds the second size
    long = list(range(1, 300)) * 3
    proposer = D.draft_proposer(draft, target, 4)
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
        fresh = kvcache.new_cache(eagle_head)
        logits = eagle_head(torch.tensor([context[1:]]), torch.arange(t), fresh, features=feats[:, :t])
    assert proposer.cache.length == t
    for layer in range(len(fresh.k)):
        torch.testing.assert_close(proposer.cache.k[layer][:, :, :t], fresh.k[layer][:, :, :t], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(proposer.cache.v[layer][:, :, :t], fresh.v[layer][:, :, :t], atol=1e-4, rtol=1e-4)
    assert guess == int(logits[0, -1].argmax())
    # a wrong alignment (feature j+1 with token j+1) builds a different cache
    with torch.inference_mode():
        wrong = kvcache.new_cache(eagle_head)
        eagle_head(torch.tensor([context[1:]]), torch.arange(t), wrong, features=feats[:, 1:])
    assert not torch.allclose(proposer.cache.k[0][:, :, :t], wrong.k[0][:, :, :t], atol=1e-3)


def test_medusa_reads_the_last_feature(models, medusa_heads, tmp_path):
    """After generating, Medusa holds the target's feature at the position before
    the last token (one fresh forward's), and head k's guess is the argmax of
    E_ids · (SiLU(W_k f + b_k) + f), each head on that one feature. A tree of W=2
    starts with head 1's top 2 tokens. Saved as train.py saves them and loaded
    through load_draft, the heads are the same (to bf16's precision)."""
    import safetensors_io
    target, _ = models
    h, silu = medusa_heads, torch.nn.functional.silu
    proposer = D.MedusaDraft(h, target)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=40)
    context = PROMPTS[0] + list(S.generate(target, PROMPTS[0], greedy, proposer))
    with torch.inference_mode():
        _, feats = target(torch.tensor([context]), torch.arange(len(context)), hidden=True)
        f = feats[0, -2]
        torch.testing.assert_close(proposer.feature, f, atol=1e-4, rtol=1e-4)
        scores = [(silu(b(f)) + f) @ h.rows.T for b in h.blocks]
        assert proposer.propose(context, 4, 100, greedy, None).candidates == \
            [[int(h.head_ids[s.argmax()]) for s in scores]]
        tree = D.MedusaDraft(h, target, 3, tree=(2, 5))
        tree.observe(len(context) - 2, feats[0, -2:-1])
        cands = tree.propose(context, 3, 100, greedy, None).candidates
    assert {c[0] for c in cands} <= set(h.head_ids[scores[0].topk(2).indices].tolist())
    assert len(S.token_tree(cands).tokens) == 5 and max(map(len, cands)) <= 3
    assert proposer.propose(context + [7], 4, 100, greedy, None).candidates == []   # no feature before x_t
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in h.state_dict().items()}
    safetensors_io.save(tmp_path / "m", state, dict(h.hf_config(), vocab_size=320))
    loaded = nl.load_draft(str(tmp_path / "m"), target, None)
    assert isinstance(loaded, D.MedusaHeads) and loaded.rows.dtype == torch.float32
    assert torch.equal(loaded.head_ids, h.head_ids) and torch.equal(loaded.rows, h.rows)
    torch.testing.assert_close(loaded.blocks[2].weight, h.blocks[2].weight, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="width is 64 but the target's is 32"):
        D.MedusaDraft(loaded, M.Llama.from_pretrained(make_checkpoint(tmp_path / "n", hidden_size=32, **SMALL)))


def test_draft_vocabulary_checked_at_load(tmp_path):
    tgt_dir = make_checkpoint(tmp_path / "t")
    bad_dir = make_checkpoint(tmp_path / "d", vocab_size=352)
    target, tok = nl.load(nl.RunConfig(str(tgt_dir)))
    with pytest.raises(ValueError, match="draft's vocabulary .* differs"):
        nl.load_draft(str(bad_dir), target, tok)
    assert nl.load_draft(str(tgt_dir), target, tok).config.vocab_size == 320
    # train.py's drafts carry no tokenizer files: they load with the target's, vocabulary still checked
    for d in (tgt_dir, bad_dir):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).unlink(missing_ok=True)
    assert nl.load_draft(str(tgt_dir), target, tok).config.vocab_size == 320
    with pytest.raises(ValueError, match="draft's vocabulary .* differs"):
        nl.load_draft(str(bad_dir), target, tok)


def test_committed_draft(bundled_dir):
    """drafts/ holds train.py's EAGLE head for the bundled model: within the 25 MB
    budget, no tokenizer, embedding or LM head of its own (it uses the target's),
    a head over part of the vocabulary; speculative output with it is still the
    target's own, and it guesses well (a random head gives ~1.0 token per forward)."""
    files = list(D.BUNDLED_DRAFT.iterdir())
    assert sum(f.stat().st_size for f in files) <= 25e6 and {f.name for f in files} == {"config.json",
                                                                                          "model.safetensors"}
    target, tok = nl.load(nl.RunConfig(str(bundled_dir)))
    head = nl.load_draft("bundled", target, tok)
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
                     nl.proposer(nl.RunConfig(draft="bundled", spec_k=3, spec_tree="4,10"), target, tok)):
        spec = S.SpecStats()
        assert list(S.generate(target, prompt, greedy, proposer, spec=spec)) == want
        per_forward.append(spec.tokens_per_forward)
    # measured: 1.85 (head alone), 2.62 (a tree of 10 from the same head)
    assert min(per_forward) > 1.5 and per_forward[2] > per_forward[0] + 0.3, per_forward



def test_committed_draft_with_int4_weights(bundled_dir):
    """The plan's int4 target (the GGUF's own Q4_1 bits, an int8 LM head): the EAGLE head scores with the
    head's dequantized rows (not its raw int8 codes), so it still guesses well, and with the C++ kernels
    (batch-invariant) the speculative text is the int4 model's own greedy text."""
    target, tok = nl.load(nl.RunConfig(str(bundled_dir), weights="int4", prepack=False))
    head = nl.load_draft("bundled", target, tok)
    text = "Write a short poem about a lighthouse keeper."
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=32)
    spec = S.SpecStats()
    got = list(S.generate(target, prompt, greedy, D.EagleDraft(head, target, 3), spec=spec))
    if target.lm_head.native:
        assert got == list(M.generate_cached(target, prompt, greedy))
    assert spec.tokens_per_forward > 1.5, spec.tokens_per_forward

def test_committed_medusa(bundled_dir):
    """drafts/ also holds train.py --medusa 4's heads for the bundled model: within the
    25 MB budget, only their blocks and head_ids (the LM head is the target's);
    speculative output with them, a chain or a tree (the runner's flags), is still
    the target's own, and they guess well (a random head gives ~1.0 token per forward)."""
    files = list(D.BUNDLED_MEDUSA.iterdir())
    assert sum(f.stat().st_size for f in files) <= 25e6 and {f.name for f in files} == {"config.json",
                                                                                          "model.safetensors"}
    target, tok = nl.load(nl.RunConfig(str(bundled_dir)))
    heads = nl.load_draft("medusa", target, tok)
    assert isinstance(heads, D.MedusaHeads) and len(heads.blocks) == 4
    assert heads.rows.shape == (len(heads.head_ids), target.config.hidden_size) and len(heads.head_ids) < 49152
    text = "Write a short poem about a lighthouse keeper."     # bench.py's second chat prompt
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)
    greedy = M.SamplingParams(temperature=0, max_new_tokens=64)
    want = list(M.generate_cached(target, prompt, greedy))
    per_forward = []
    for proposer in (D.MedusaDraft(heads, target), nl.proposer(nl.RunConfig(draft="medusa", spec_k=4, spec_tree="4,10"), target, tok)):
        spec = S.SpecStats()
        assert list(S.generate(target, prompt, greedy, proposer, spec=spec)) == want
        per_forward.append(spec.tokens_per_forward)
    # measured: 1.40 (a chain of 4), 1.62 (a tree of 10); the EAGLE head: 1.85 and 2.62 (above)
    assert min(per_forward) > 1.25 and per_forward[1] > per_forward[0] + 0.1, per_forward


def test_narrow_draft():
    """A bf16-stored draft runs in bf16 only under an fp32 target on a CPU that computes bf16."""
    cpu = torch.device("cpu")
    assert nl.narrow_draft("bfloat16", cpu, torch.float32) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not nl.narrow_draft("float32", cpu, torch.float32)
    assert not nl.narrow_draft(None, cpu, torch.float32)
    assert not nl.narrow_draft("bfloat16", torch.device("cuda"), torch.float32)
