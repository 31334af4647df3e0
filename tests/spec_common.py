"""What the speculative tests share: small random targets and drafts, an EAGLE head, Medusa heads,
and the two checks every proposer must pass — greedy tokens equal to plain decoding,
and sampled tokens distributed as the target's own (a chi-square test)."""

import json
import shutil

import torch

import drafting
import model as M
import sampling
import speculative as S
from conftest import make_checkpoint
import pytest
import kvcache

SMALL = dict(tokenizer=False, max_position_embeddings=1024)
PROMPTS = [[0, 5, 17, 99, 4], [0, 250, 251, 252, 253, 7, 7, 7], [0, 42]]


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
    head = drafting.EagleHead.from_pretrained(
        M.save_random_checkpoint(cfg, root / "h", seed=2, cls=drafting.EagleHead), "cpu", torch.float32)
    return drafting.share_target(head, target)


def random_medusa(target, n_heads: int, ids: list[int], seed: int):
    """Random Medusa heads for the target (train.py --medusa's kind, untrained): blocks
    small enough that each head's guesses stay near the target's own next-token ones."""
    import drafting
    torch.manual_seed(seed)
    heads = drafting.MedusaHeads(target.config.hidden_size, n_heads, torch.tensor(ids))
    for p in heads.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    return heads.share_target(target)


@pytest.fixture(scope="module")
def medusa_heads(models):
    """Four random Medusa heads over 96 of the target's 320 tokens."""
    return random_medusa(models[0], 4, sorted([*range(0, 320, 10), *range(1, 320, 5)]), seed=4)


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
    eagle = drafting.share_target(drafting.EagleHead.from_pretrained(
        M.save_random_checkpoint(hf, root / "e", torch.float32, seed=3, cls=drafting.EagleHead), "cpu",
        torch.float32), target)
    target.config.eos_ids = draft.config.eos_ids = part.config.eos_ids = []
    return target, draft, part, eagle, random_medusa(target, 3, [0, 1, 2, 4, 5, 7, 9, 11, 12, 15], seed=5)


def sampled_counts(target, make_proposer, params, n_seqs, n_new, vocab=None):
    """Run speculative sampling on n_seqs prompts; return observed token counts and
    the expected counts: the sum over emitted tokens of the target's distribution
    given everything before it (one plain forward over each finished sequence), masked
    by the grammar's state there when params has one."""
    gen = torch.Generator().manual_seed(0)
    observed, expected = torch.zeros(16), torch.zeros(16)
    spec = S.SpecStats()
    for s in range(n_seqs):
        prompt = [0] + torch.randint(1, 16, (4,), generator=gen).tolist()
        p = M.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             seed=s, max_new_tokens=n_new, grammar=params.grammar)
        out = list(S.generate(target, prompt, p, make_proposer(), spec=spec, vocab=vocab))
        seq = prompt + out
        with torch.inference_mode():
            logits = target(torch.tensor([seq]), torch.arange(len(seq)))[0, len(prompt) - 1:-1]
        grammar = sampling.constraint(p, vocab)
        if grammar is not None:
            rows = []
            for row, token in zip(logits, out):
                rows.append(grammar.apply(row))
                grammar.advance(token)
            logits = torch.stack(rows)
        expected += sampling.sampling_probs(logits, p).sum(0)
        observed += torch.bincount(torch.tensor(out), minlength=16).float()
    return observed, expected, spec


def check_greedy(target, proposers: dict, k: int, n: int = 128):
    """Every proposer's greedy tokens equal plain greedy decoding's for n tokens on each
    prompt, and every cache holds exactly the accepted tokens after each step."""
    greedy = M.SamplingParams(temperature=0, max_new_tokens=n)
    for prompt in PROMPTS:
        want = plain(target, prompt, n)
        for name, make in proposers.items():
            spec, cache = S.SpecStats(), kvcache.new_cache(target)
            got = list(S.generate(target, prompt, greedy, make(), spec=spec, cache=cache))
            assert got == want, (name, k, prompt)
            assert cache.length == len(prompt) + n - 1
            check_cache_lengths(prompt, spec, None if name.startswith("lookup then") else "draft"
                                if name.endswith("draft") else "eagle" if name.endswith("eagle head") else None)
            if name == "self draft":     # the target as its own draft agrees with itself everywhere
                assert spec.acceptance == 1.0, spec.summary()
            if name in ("self draft", "prompt lookup", "lookahead", "lookup then draft"):
                assert spec.accepted > 0, (name, k, spec.summary())    # a random draft alone may never agree


def check_sampling(target, make, monkeypatch, n_seqs: int, n_control: int, n_new: int = 128,
                   grammar: str | None = None, vocab=None):
    """n_seqs × n_new emitted tokens against the target's exact distributions (chi-square);
    then n_control × n_new with a rule that accepts every guess, which must fail."""
    params = M.SamplingParams(temperature=1.0, top_p=0.95, grammar=grammar)
    observed, expected, spec = sampled_counts(target, make, params, n_seqs, n_new, vocab)
    assert observed.sum() == n_seqs * n_new
    assert spec.accepted > 0.05 * spec.emitted, spec.summary()      # the rule is really exercised
    assert chi_square_p(observed, expected) > 1e-3, (observed, expected)
    if not n_control:
        return
    monkeypatch.setattr(S, "accept", lambda p, token, q, gen: True)
    observed, expected, _ = sampled_counts(target, make, params, n_control, n_new)
    assert chi_square_p(observed, expected) < 1e-6
