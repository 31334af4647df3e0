"""train.py's Medusa mode on a small random target: what each head is scored against,
where, and that training on it lowers the loss (the full run takes ~30 minutes; its
heads are checked in test_drafting.py::test_committed_medusa)."""

import time

import pytest
import torch

import train
from spec_common import PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")


def test_medusa_loss_scores_head_k_against_the_target_k_ahead(models):
    """Zero-initialised heads are the target's own next-token head (SiLU(0) + f = f), so
    head k at answer position j guesses argmax(logits_j) and is scored against the
    target's choice at j+k: agreement is that match rate over j = n-1 .. L-1-k. A few
    AdamW steps on the conversation lower the loss and raise head 1's agreement."""
    target, _ = models
    n = len(PROMPTS[0])
    tokens = torch.tensor([PROMPTS[0] + [(7 * i) % 300 + 3 for i in range(40)]])
    L = tokens.shape[1]
    with torch.inference_mode():
        logits, f = target(tokens, torch.arange(L), hidden=True)
    f, best = f.clone(), logits[0].argmax(-1)
    heads = train.make_medusa(target, 2, torch.arange(320))
    loss, agree = train.medusa_loss(heads, tokens, f, [(n, L)])
    for k in (1, 2):
        want = (best[n - 1:L - k] == best[n - 1 + k:L]).float().mean().item()
        assert agree[k - 1] == pytest.approx(want), k
    trained = train.distil(heads, [(tokens[0], n)], [f[0]], steps=40, batch=1, lr=1e-2,
                           deadline=time.perf_counter() + 120, loss_fn=train.medusa_loss)
    with torch.no_grad():
        after, agree_after = train.medusa_loss(trained, tokens, f, [(n, L)])
    # the loss's floor is the teacher's entropy, ~5.7 nats per head for this random target
    assert after < loss - 0.25 and agree_after[0] > agree[0] + 0.1, (loss, after, agree, agree_after)
