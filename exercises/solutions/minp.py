"""Solution of exercise `minp`: min-p after the lesson's cuts (read exercises/minp.py for the
contract)."""

from __future__ import annotations

import torch

import exercises
from sampling import SamplingParams


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The lesson's probabilities, then only the tokens at or above min_p times each row's
    likeliest, renormalized."""
    probs = exercises.original("sampling.sampling_probs")(logits, p)
    min_p = getattr(p, "min_p", 0.0)
    if not min_p:
        return probs
    probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)
