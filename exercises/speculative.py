"""Exercise `speculative`: the rule that makes speculative sampling exact.

Implement ``accept`` and ``residual`` below. They replace speculative.py:accept and
speculative.py:residual, which speculative.verify applies to every proposed token: accept
it with probability min(1, p/q); on a rejection, draw the target's token from
normalize(max(0, p - q)). The lesson's docstring proves that the tokens then follow p
exactly, whatever the proposer's q.

Run it:  make exercise E=speculative   (or: .venv/bin/python -m pytest tests --exercise speculative)

Passing means the speculative lesson's own tests pass with your rule: 20,000 verdicts on a
guess drawn from q emit tokens distributed as p (a chi-square test; a rule that accepts
every guess fails it), so do verdicts on a point-mass guess, greedy verdicts match the
token-id shortcut, and the chain algorithm with a draft model gives the general loop's tokens.
"""

from __future__ import annotations

import torch


def accept(p: torch.Tensor, token: int, q: torch.Tensor | None, gen) -> bool:
    """p (V,): the target's probabilities; token: the proposed token d; q (V,): the
    proposer's probabilities, or None for a proposer that is not a model (a point mass:
    q(d) = 1); gen: a torch.Generator (or None) for the random number.

    Accept d with probability min(1, p(d)/q(d)). Draw a random number only when the
    verdict is not certain (0 < ratio < 1), with torch.rand((), generator=gen,
    device=p.device), so greedy decoding (p a point mass) never consumes one."""
    raise NotImplementedError("""accept: compute the ratio p(d)/q(d) (q None counts as q(d) = 1).
At least 1 is a sure accept, 0 a sure reject; in between, accept when a uniform draw from gen
falls below the ratio. Deciding the sure cases without drawing keeps greedy runs reproducible.""")


def residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """After rejecting ``token``: the distribution to draw the target's own token from,
    (V,), summing to 1. With a draft's q: normalize(max(0, p - q)). With q None (a point
    mass on ``token``): p with that token's probability set to 0, renormalized. If nothing
    is left (the sum is 0), return p itself. Never modify p in place."""
    raise NotImplementedError(
        """residual: keep only the probability p has beyond what q already offered, then rescale.
max(0, p - q) removes what q covered; with a point mass that is just the rejected token.
Divide by the total so it sums to 1, and mind the case where nothing is left.""")
