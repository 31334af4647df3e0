"""Structured output (sampling.py's Constraint): the grammar's mask is applied where logits
become a token, so every decoder keeps to it: the cached and naive loops, the engine's rows
and branches, and speculative decoding, whose verification under the mask is exact (greedy:
the same tokens as plain masked decoding; sampled: distributed as the masked target)."""

import re
import string

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

import drafting as D
import model as M
import sampling
import speculative as S
from engine import Engine
from spec_common import PROMPTS, check_sampling, random_medusa

pytestmark = pytest.mark.usefixtures("one_thread")


def char_vocab(tokens: list[str]):
    """A grammar vocabulary whose id i is tokens[i], with an EOS id (len(tokens)) that lies
    past a model of len(tokens) ids: a random model never ends, and the grammar alone says
    which tokens may come."""
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return sampling.grammar_vocab(tok.to_str(), [len(tokens)])


# 16 ids: the letters a..p. Pairs of a low letter and a high one.
LETTERS = list(string.ascii_lowercase[:16])
PAIRS = "start: /([a-h][i-p])*/"
# 320 ids: the 256 byte symbols, then 64 two-letter tokens (a grammar must see inside them).
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
WIDE = BYTES + [a + b for a in "abcdefgh" for b in "stuvwxyz"]
# words of three letters from a..h, each followed by one of s..z
WORDS = "start: /([a-h]{3}[s-z])*/"


def text_of(ids: list[int], tokens: list[str]) -> str:
    return "".join(tokens[i] for i in ids)


def test_the_mask_allows_what_continues_the_grammar():
    vocab = char_vocab(LETTERS)
    c = sampling.Constraint(vocab, sampling.grammar_text(M.SamplingParams(grammar=PAIRS)))
    low, high = torch.arange(16) < 8, torch.arange(16) >= 8
    assert torch.equal(c.allowed(16), low)
    c.advance(0)
    assert torch.equal(c.allowed(16), high)
    logits = c.apply(torch.zeros(16))
    assert torch.equal(logits == -torch.inf, low)
    twin = c.fork()                       # a branch follows the grammar on its own
    twin.advance(9)
    assert torch.equal(twin.allowed(16), low) and torch.equal(c.allowed(16), high)
    c.rollback(1)
    assert torch.equal(c.allowed(16), low)
    # in a wider model: EOS (id 16) where the grammar may end (between pairs), and no id
    # the tokenizer lacks
    assert torch.equal(c.allowed(20), torch.cat([low, torch.tensor([True, False, False, False])]))
    c.advance(0)
    assert not c.allowed(20)[16]
    with pytest.raises(ValueError, match="breaks the grammar"):
        c.advance(3)           # a low letter where a high one must come
    # the sampler draws only allowed tokens, greedy or not, and moves the state
    c = sampling.Constraint(vocab, sampling.grammar_text(M.SamplingParams(grammar=PAIRS)))
    best_forbidden = torch.arange(16.0).flip(0) * -1 + 20 * high     # argmax: a high letter
    assert sampling.sample(best_forbidden, M.SamplingParams(), None, c) == 7
    assert torch.equal(c.allowed(16), high)
    gen = torch.Generator().manual_seed(0)
    p = M.SamplingParams(temperature=1.0)
    assert all(sampling.sample(torch.zeros(16), p, gen, c.fork()) >= 8 for _ in range(50))


@pytest.mark.parametrize("kwargs, message", [
    (dict(json_schema={"type": "objekt"}), "the JSON schema is not supported: .*objekt"),
    (dict(json_schema={"type": "string", "pattern": "(("}), "the JSON schema is not supported"),
    (dict(json_schema=[1]), "must be a JSON object"),
    (dict(grammar="start: (("), "the grammar is not supported"),
    (dict(json_schema={}, grammar=PAIRS), "not both"),
    (dict(json_schema={"type": "object"}, ignore_eos=True), "ignore_eos"),
])
def test_a_bad_schema_or_grammar_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        M.SamplingParams(**kwargs)
    assert "\n" not in str(e.value)


def test_every_decoder_keeps_to_the_grammar(models):
    target, _ = models
    vocab, n = char_vocab(WIDE), 24
    words = re.compile(r"([a-h]{3}[s-z])*[a-h]{0,3}")
    for temperature in (0.0, 1.0):
        p = M.SamplingParams(temperature=temperature, seed=1, max_new_tokens=n, grammar=WORDS)
        for prompt in PROMPTS:
            cached = list(M.generate_cached(target, prompt, p, vocab=vocab))
            assert len(cached) == n and words.fullmatch(text_of(cached, WIDE))
            assert list(M.generate_naive(target, prompt, p, vocab=vocab)) == cached
    free = list(M.generate_cached(target, PROMPTS[0], M.SamplingParams(max_new_tokens=n)))
    assert not words.fullmatch(text_of(free, WIDE))        # the mask is what shapes it
    with pytest.raises(ValueError, match="vocabulary"):
        list(M.generate_cached(target, PROMPTS[0], M.SamplingParams(grammar=WORDS)))


def test_the_engine_keeps_each_branch_to_the_grammar(models):
    target, _ = models
    vocab, n = char_vocab(WIDE), 16
    words = re.compile(r"([a-h]{3}[s-z])*[a-h]{0,3}")
    engine = Engine(target, num_blocks=64, block_size=4, max_batch=8, vocab=vocab)
    greedy = M.SamplingParams(max_new_tokens=n, grammar=WORDS)
    sampled = M.SamplingParams(temperature=1.0, seed=5, max_new_tokens=n, grammar=WORDS)
    plain = engine.add(PROMPTS[1], M.SamplingParams(max_new_tokens=n))     # a free row beside
    reqs = [engine.add(prompt, greedy) for prompt in PROMPTS] + [engine.add(PROMPTS[0], sampled, 3)]
    engine.run()
    for prompt, req in zip(PROMPTS, reqs):
        assert req.sequences[0].output == list(M.generate_cached(target, prompt, greedy, vocab=vocab))
    branches = [s.output for s in reqs[-1].sequences]
    assert all(words.fullmatch(text_of(b, WIDE)) for b in branches) and len(set(map(tuple, branches))) > 1
    assert plain.sequences[0].output == list(M.generate_cached(target, PROMPTS[1],
                                                               M.SamplingParams(max_new_tokens=n)))
    assert engine.num_free_blocks == engine.allocator.num_blocks
    with pytest.raises(ValueError, match="no vocabulary"):
        Engine(target, num_blocks=8, block_size=4).add(PROMPTS[0], greedy)


@pytest.mark.parametrize("k", [2, 4])
def test_speculative_under_a_grammar_equals_masked_decoding(models, k):
    """Guesses the grammar forbids are rejected, the rest verified as usual: the tokens are
    plain masked decoding's, for every kind of proposer, chains and trees."""
    target, draft = models
    vocab, n = char_vocab(WIDE), 32
    p = M.SamplingParams(max_new_tokens=n, grammar=WORDS)
    heads = random_medusa(target, k, list(range(0, 320, 3)), seed=4)
    proposers = {"prompt lookup": lambda: D.PromptLookup(2, k),
                 "lookahead": lambda: D.Lookahead(4, k + 1, 3),
                 "draft": lambda: D.DraftModel(draft, target, k),
                 "self draft": lambda: D.DraftModel(target, target, k),
                 "medusa tree": lambda: D.MedusaDraft(heads, target, k, tree=(2, 2 * k))}
    spec = S.SpecStats()
    for prompt in PROMPTS:
        want = list(M.generate_cached(target, prompt, p, vocab=vocab))
        for name, make in proposers.items():
            got = list(S.generate(target, prompt, p, make(), spec=spec, vocab=vocab))
            assert got == want, (name, k, prompt)
    assert 0 < spec.accepted < spec.proposed      # guesses both taken and turned down


@pytest.mark.parametrize("method", ["draft", "prompt lookup"])
def test_speculative_sampling_under_a_grammar_is_exact(small_vocab, method, monkeypatch):
    """Sampled: the emitted tokens follow the masked target's distributions (chi-square),
    although the proposers guess from all 16 tokens."""
    target, draft = small_vocab[:2]
    make = {"draft": lambda: D.DraftModel(draft, target, 3),
            "prompt lookup": lambda: D.PromptLookup(2, 4)}[method]
    check_sampling(target, make, monkeypatch, n_seqs=40, n_control=0, grammar=PAIRS,
                   vocab=char_vocab(LETTERS))


def test_speculative_under_a_json_schema_on_the_bundled_model(bundled_dir):
    """The bundled model, its EAGLE head (a tree and a chain) and prompt lookup, under a JSON
    schema: the tokens of plain masked decoding, and an answer that validates."""
    import json

    import jsonschema
    import nanoinfer.load as nl

    model, tok = M.load(str(bundled_dir))
    vocab = sampling.grammar_vocab(tok.to_json(), model.config.eos_ids)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 30},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    ids = tok.encode_chat([{"role": "user", "content": "Give the name and age of a person."}])
    p = M.SamplingParams(max_new_tokens=40, json_schema=schema)
    want = list(M.generate_cached(model, ids, p, vocab=vocab))
    assert want[-1] in model.config.eos_ids
    jsonschema.validate(json.loads(tok.decode(want[:-1])), schema)
    head = nl.load_draft("bundled", model, tok)
    for proposer in (D.PromptLookup(3, 4), D.draft_proposer(head, model, 4),
                     D.draft_proposer(head, model, 4, tree=(2, 6))):
        spec = S.SpecStats()
        assert list(S.generate(model, ids, p, proposer, spec=spec, vocab=vocab)) == want


def test_llm_generate_takes_a_schema(tiny_ckpt):
    """The offline API: SamplingParams(json_schema=...) in LLM.generate, n branches each valid;
    an answer the grammar has closed can only end (EOS), even from a random model."""
    import json

    from engine import LLM
    llm = LLM(str(tiny_ckpt))
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"enum": ["yes", "no"]}, "b": {"type": "integer", "minimum": 0,
                                                                "maximum": 9}}}
    p = M.SamplingParams(temperature=1.0, seed=0, max_new_tokens=40, json_schema=schema)
    (out,) = llm.generate(["hi"], p, n=3, use_tqdm=False)
    for c in out.completions:
        assert c.finish_reason == "stop" and json.loads(c.text)["a"] in ("yes", "no"), c.text
