"""Exercise `minp` (extend): min-p sampling, a tail cut that follows the model's confidence.

sampling.py cuts the tail of the distribution with top-k (a fixed number of tokens) and top-p
(the smallest set reaching a fixed probability). Neither looks at how sure the model is: when
one token has 0.9, top-p 0.95 still lets in a crowd of tokens at 0.001 each; when the
distribution is flat, top-k 5 cuts good candidates. min-p scales the cut with the top token:
keep the tokens whose probability is at least min_p times the likeliest one's. A confident
step keeps one or two tokens, an open one keeps many.

Add it: implement ``sampling_probs`` below, which goes in at sampling.py:sampling_probs (where
sample() draws from, so every sampled token goes through it). It extends the lesson's function:
call the lesson's own as ``exercises.original("sampling.sampling_probs")``, then cut.

Run it:  make exercise E=minp    (or: .venv/bin/python -m pytest tests --exercise minp)

Passing means the sampling lesson's own tests still pass through your function (greedy,
temperature, top-k, top-p drawn as the textbook says), and tests/lessons/test_extend.py's judge
min-p: exactly the tokens at or above min_p times each row's largest probability are kept,
renormalized, after the lesson's cuts; min_p 0, or params without it, change nothing; 4,000
draws from sample() never give a cut token and follow the cut distribution (a chi-square test).
(The solution: exercises/solutions/minp.py; read it after.)
"""

from __future__ import annotations

import torch

import exercises
from sampling import SamplingParams


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits (..., vocab) -> the probabilities a token is drawn from, row by row: the lesson's
    (temperature, top-k, top-p; greedy a point mass), then min-p. ``p.min_p`` is the factor: the
    lesson's SamplingParams has no such field, so read it as getattr(p, "min_p", 0.0) (the tests
    pass a SamplingParams with one); 0 turns min-p off and returns the lesson's probabilities.
    Otherwise keep, in every row, the tokens whose probability is at least min_p times the
    row's largest, zero the rest, and renormalize each row to sum to 1."""
    raise NotImplementedError(
        """sampling_probs: start from the lesson's probabilities. The cut is relative: find
each row's largest probability (keep the dimension, so it broadcasts along its row), and compare
every token against min_p times it. What survives no longer sums to 1: rescale each row.""")
