"""sampling.py: logits -> a token. Greedy, temperature, top-k and top-p draw what the
textbook rule says (counted against the distribution sampling_probs gives), bad values are
refused in one line, NaN logits end an answer with an error, a seed reproduces a sampled answer, and one rule says which token ends
an answer and which is shown."""

import pytest
import torch

import model as M
import sampling
from sampling import finish_reason, visible
from spec_common import chi_square_p

GREEDY = M.SamplingParams


def test_sampling_controls():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    greedy = M.SamplingParams()
    assert sampling.sample(logits, greedy) == 0
    # top-k 1 and a tiny top-p both collapse to the argmax whatever the temperature
    assert all(sampling.sample(logits, M.SamplingParams(temperature=5.0, top_k=1)) == 0 for _ in range(20))
    assert all(sampling.sample(logits, M.SamplingParams(temperature=5.0, top_p=0.01)) == 0 for _ in range(20))
    # top-k 2 never emits a token outside the top two
    gen = torch.Generator().manual_seed(0)
    ks = {sampling.sample(logits, M.SamplingParams(temperature=2.0, top_k=2), gen) for _ in range(300)}
    assert ks == {0, 1}
    # plain temperature sampling follows softmax(logits / T): frequencies within 3 sigma
    p = torch.softmax(logits / 1.5, -1)
    n = 4000
    counts = torch.bincount(torch.tensor([sampling.sample(logits, M.SamplingParams(temperature=1.5), gen)
                                          for _ in range(n)]), minlength=5).float()
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 3 * sigma + 1).all(), (counts, n * p)
    # top-p 0.8 keeps the smallest prefix of the sorted distribution reaching 0.8
    probs = torch.softmax(logits, -1)       # [0.61, 0.22, 0.14, 0.03, 0.004]
    kept = {sampling.sample(logits, M.SamplingParams(temperature=1.0, top_p=0.8), gen) for _ in range(300)}
    assert kept == {0, 1} and probs[:2].sum() >= 0.8


def test_top_p_equals_a_full_sort_of_the_vocabulary():
    """sampling_probs ranks only the 256 likeliest tokens when they reach top_p,
    and sorts everything when they fall short: both must equal the textbook rule."""
    gen = torch.Generator().manual_seed(0)
    for scale, nucleus_inside in ((8.0, True), (0.1, False)):   # peaked, then nearly flat over 2,000 tokens
        logits = torch.randn(3, 2000, generator=gen) * scale
        got = sampling.sampling_probs(logits, M.SamplingParams(temperature=1.0, top_p=0.9))
        probs = torch.softmax(logits, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        want = torch.zeros_like(probs).scatter_(-1, order, sorted_p * (sorted_p.cumsum(-1) - sorted_p < 0.9))
        torch.testing.assert_close(got, want / want.sum(-1, keepdim=True))
        kept = (got > 0).sum(-1)
        assert bool((kept < 256).all()) if nucleus_inside else bool((kept > 256).all()), kept


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


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), "top-p must be in (0, 1]"),
    (dict(top_p=1.5), "top-p must be in (0, 1]"),
    (dict(top_k=-1), "top-k must be >= 0"),
    (dict(max_new_tokens=0), "max-new-tokens must be >= 1"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        M.SamplingParams(**kwargs)


def test_seed_makes_sampling_reproducible(tiny_ckpt):
    model = M.Llama.from_pretrained(tiny_ckpt, "cpu", "float32")
    model.config.eos_ids = []
    p = M.SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_new_tokens=30)
    a = list(M.generate_cached(model, [0, 1], p))
    b = list(M.generate_cached(model, [0, 1], p))
    c = list(M.generate_cached(model, [0, 1], M.SamplingParams(temperature=1.0, seed=124, max_new_tokens=30)))
    assert a == b and a != c


def test_visible_is_the_one_stop_token_rule():
    """sampling.visible: an EOS id ends an answer but is never part of its text or its count;
    any other id is shown, whatever ignore_eos says about stopping."""
    assert visible(5, [2, 7]) and not visible(2, [2, 7]) and not visible(7, {2, 7})
    assert all(visible(t, []) for t in range(10))        # a model without EOS shows everything
    assert finish_reason(2, 1, 10, GREEDY(), [2], 100) == "stop" and not visible(2, [2])
    assert finish_reason(2, 1, 10, GREEDY(ignore_eos=True), [2], 100) is None


def test_greedy_is_torch_argmax_first_index_and_refuses_nan_anywhere():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = torch.randn(4099, generator=gen)
        assert sampling.greedy(row) == int(row.argmax())
        assert sampling.greedy(row.bfloat16()) == int(row.bfloat16().argmax())
    row = torch.zeros(300)
    row[[7, 200]] = 1.0
    assert sampling.greedy(row) == 7 == int(row.argmax())     # a tie: the first
    assert sampling.greedy(torch.full((5,), float("-inf"))) == 0
    for where in (0, 150, 299):
        for bad in (float("nan"), float("inf")):
            row = torch.zeros(300)
            row[where] = bad
            with pytest.raises(sampling.NonFiniteLogits):
                sampling.greedy(row)


def test_non_finite_logits_end_the_answer_with_an_error():
    logits = torch.zeros(10)
    logits[4] = float("nan")
    for p in (sampling.SamplingParams(), sampling.SamplingParams(temperature=0.8)):
        with pytest.raises(sampling.NonFiniteLogits, match="NaN or infinite"):
            sampling.sample(logits, p)
    ruled_out = torch.full((10,), float("-inf"))
    ruled_out[2] = 1.0                                  # -inf is a token ruled out, not an error
    assert sampling.sample(ruled_out, sampling.SamplingParams()) == 2
