"""Speculative decoding (speculative.py): exact for every proposer, greedy and sampled.

Greedy: token-for-token equal to plain greedy decoding. Sampled: a chi-square
test of emitted token counts against the target's own distributions, which a
deliberately wrong rule (accept everything) must fail."""

import json

import pytest
import torch

import model as M
import nanoinfer.load as nl
import bench.speculative
import drafting as D
import serve_local
import speculative as S
from conftest import make_checkpoint
from spec_common import PROMPTS, SMALL, check_greedy, check_sampling, chi_square_p, plain
import kvcache


pytestmark = pytest.mark.usefixtures("one_thread")


class FixedTree(S.Proposer):
    """A proposer that knows the answer and offers it last, behind wrong branches,
    one of which shares its first token: [wrong], [right₀, wrong...], [right]."""
    needs_dynamic_cache, k = True, 4

    def __init__(self, prompt, want, vocab):
        self.n, self.want, self.vocab = len(prompt), want, vocab

    def propose(self, context, k, room, params, gen):
        right = self.want[len(context) - self.n:][:k]
        wrong = [(t + 1) % self.vocab for t in right]
        return S.Proposal([wrong, right[:1] + wrong[1:], right])


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
    proposer = D.Lookahead(5, 3, 4) if branches == "lookahead" else \
        FixedTree(prompt, want, target.config.vocab_size)
    spec, cache = S.SpecStats(), kvcache.new_cache(target)
    out = list(S.generate(target, prompt, M.SamplingParams(temperature=0, max_new_tokens=96),
                          proposer, spec=spec, cache=cache))
    assert out == want
    if branches == "tree":          # the last branch wins every step: 4 guesses and the target's next token
        assert spec.histogram[4] >= 18 and spec.tokens_per_forward > 4.5, spec.summary()
    ref = kvcache.new_cache(target)
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
        for proposer in (D.DraftModel(draft, target, 8), D.PromptLookup(1, 8), D.Lookahead(3, 4, 2)):
            got = list(S.generate(target, PROMPTS[1], M.SamplingParams(temperature=0, max_new_tokens=n), proposer))
            assert got == plain(target, PROMPTS[1], n)


# ----------------------------------------------------------------------------
# Sampling: the rule keeps the target's distribution.

@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identical_to_plain(models, k):
    """The proposers without a second model (drafting.py's are tested in test_drafting.py)."""
    target, _ = models
    check_greedy(target, {"prompt lookup": lambda: D.PromptLookup(3, k), "lookahead": lambda: D.Lookahead(4, k + 1, 3)}, k)


@pytest.mark.parametrize("method", ["prompt lookup", "lookahead"])
def test_sampling_matches_target(small_vocab, method, monkeypatch):
    target = small_vocab[0]
    make = {"prompt lookup": lambda: D.PromptLookup(2, 4), "lookahead": lambda: D.Lookahead(3, 3, 3)}[method]
    check_sampling(target, make, monkeypatch, n_seqs=40, n_control=24)


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


def test_bad_input(models, eagle_head, tmp_path, monkeypatch):
    target, draft = models
    for k in (0, -1):
        with pytest.raises(ValueError, match="spec-k must be >= 1"):
            D.DraftModel(draft, target, k)
        with pytest.raises(ValueError, match="spec-k must be >= 1"):
            D.PromptLookup(3, k)
    for text in ["5,1,5", "0,3,2", "5,3,0", "5,3", "a,b,c"]:
        with pytest.raises(ValueError, match="--lookahead"):
            D.parse_lookahead(text)
    with pytest.raises(ValueError, match="prompt-lookup N needs N >= 1"):
        D.PromptLookup(0)
    other = M.Llama.from_pretrained(make_checkpoint(tmp_path / "v", vocab_size=352, **SMALL), "cpu")
    with pytest.raises(ValueError, match="must use the target's tokenizer"):
        D.DraftModel(other, target)
    with pytest.raises(ValueError, match="EAGLE head"):
        D.EagleDraft(draft, target)
    narrow = M.Llama.from_pretrained(make_checkpoint(tmp_path / "n", hidden_size=32, **SMALL), "cpu")
    wide_cfg = json.loads((tmp_path / "n" / "config.json").read_text())
    wide_cfg.update(num_hidden_layers=1, eagle=True, draft_vocab_size=8)
    head = D.share_target(D.EagleHead.from_pretrained(
        M.save_random_checkpoint(wide_cfg, tmp_path / "e", cls=D.EagleHead), "cpu"), narrow)
    with pytest.raises(ValueError, match="width is 32 but the target's is 64"):
        D.EagleDraft(head, target)
    with pytest.raises(ValueError, match="needs the target's features"):
        head(torch.tensor([[1, 2]]), torch.arange(2))
    for proposer in (D.Lookahead(3, 3, 3), D.EagleDraft(eagle_head, target, 3, tree=(2, 4))):
        with pytest.raises(ValueError, match="need the dynamic cache"):
            next(S.generate(target, [0, 1], M.SamplingParams(), proposer,
                            cache=kvcache.new_cache(target, "static", max_len=64)))
    for text in ["0,4", "2,0", "2", "a,b"]:
        with pytest.raises(ValueError, match="--spec-tree"):
            S.parse_tree(text)
    with pytest.raises(ValueError, match="--spec-tree W,M needs W >= 1"):
        D.EagleDraft(eagle_head, target, 3, tree=(0, 4))


def test_runner_flags(tmp_path, monkeypatch, capsys):
    import serve_local
    tgt = str(make_checkpoint(tmp_path / "t"))
    monkeypatch.setattr(D, "BUNDLED_DRAFT", tmp_path / "no-draft")
    monkeypatch.setattr(D, "BUNDLED_MEDUSA", tmp_path / "no-medusa")
    cases = [(["--draft", "bundled"], "python train.py"), (["--draft", "medusa"], "python train.py --medusa 4"), (["--spec-k", "0", "--prompt-lookup", "3"], "spec-k"),
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
    for proposer in (D.DraftModel(draft, target, 4), D.PromptLookup(3, 4)):
        cache = kvcache.new_cache(target, "static", max_len=128)
        assert list(S.generate(target, prompt, greedy, proposer, cache=cache)) == want
        assert cache.length == len(prompt) + 64 - 1
    model, tok = nl.load(nl.RunConfig(str(make_checkpoint(tmp_path / "chat"))))
    model.config.eos_ids = []
    params = M.SamplingParams(temperature=0, max_new_tokens=40)
    chats = [serve_local.Chat(model, tok, params),
             serve_local.Chat(model, tok, params, proposer=D.PromptLookup(2, 4)),
             serve_local.Chat(model, tok, params, proposer=D.Lookahead(3, 3, 3))]
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
    got = list(S.generate(target, prompt, M.SamplingParams(temperature=0, max_new_tokens=96), D.Lookahead(4, 3, 4)))
    assert got == want


def test_compare_reports_where_texts_part(models):
    """bench.py's table: exact methods match plain decoding on every prompt; a text
    that parts from it is reported with the first new token that differs."""
    target, _ = models
    static = kvcache.new_cache(target, "static", 64)      # plain decoding on a given cache, reused prompt after prompt
    rows = bench.speculative.compare(target, PROMPTS[:2], {"plain": lambda: None, "lookup": lambda: D.PromptLookup(2, 3),
                                           "static": lambda: static}, 24)
    assert [r["diverged"] for r in rows] == [[None, None]] * 3
    assert rows[0]["speedup"] == 1.0 and rows[0]["speedups"] == [1.0, 1.0]
    assert rows[1]["spec"].steps > 0 and rows[2]["spec"] is None and len(rows[1]["speedups"]) == 2
    assert rows[0]["tokens"] == [23, 23]      # the target's eos_ids are cleared: every answer runs to 24 tokens
    assert bench.speculative.same_tokens([None, None]) == "yes"
    assert bench.speculative.same_tokens([None, 7, 3]) == "1/3; others from token 3, 7"


def test_plain_step_baseline_uses_the_given_cache(models):
    """The runner's baseline runs through its own cache (compiled with --compile) and leaves
    it as it found it: empty, or holding the conversation, whose entries stay untouched."""
    target, _ = models
    cache = kvcache.new_cache(target, "static", 256)
    assert serve_local.plain_step_s(target, cache) > 0 and cache.length == 0
    assert serve_local.plain_step_s(target) > 0
    with torch.inference_mode():
        target(torch.tensor([PROMPTS[0]]), torch.arange(len(PROMPTS[0])), cache)
    n = len(PROMPTS[0])
    held = [cache.k[0][:, :, :n].clone(), cache.v[0][:, :, :n].clone()]
    assert serve_local.plain_step_s(target, cache) > 0 and cache.length == n
    assert torch.equal(cache.k[0][:, :, :n], held[0]) and torch.equal(cache.v[0][:, :, :n], held[1])
    full = kvcache.new_cache(target, "static", len(PROMPTS[0]))
    with torch.inference_mode():
        target(torch.tensor([PROMPTS[0]]), torch.arange(len(PROMPTS[0])), full)
    assert serve_local.plain_step_s(target, full) == 0.0 and full.length == len(PROMPTS[0])


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
