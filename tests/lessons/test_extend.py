"""The extend exercises' own tests (exercises/__init__.py, kind "extend"): each judges a feature
a lesson lacks, put in at the lesson's hook. Under `--exercise NAME` they run the learner's code
(tests/conftest.py swapped it in); in the plain suite, the reference solution in
exercises/solutions/NAME.py, installed for each test by the fixtures below.

evict: paged.BlockAllocator.victim evicts the deepest cached block first (a shared prefix's
blocks are the shallow ones), the least recently freed among equals, and a block no lookup can
reach before all. minp: sampling.sampling_probs keeps only the tokens at or above min_p times the
likeliest, after the lesson's own cuts."""

from dataclasses import dataclass

import pytest
import torch

import exercises
import sampling
from paged import BlockAllocator
from sampling import SamplingParams
from spec_common import chi_square_p
from test_paged import Driver


def installed(config, name):
    """The exercise's function at its hook for one test: the learner's (or, with
    --exercise-solution, the reference) when the run is that exercise's, else the solution."""
    ex = exercises.EXERCISES[name]
    if config.exercise is ex:           # conftest's exercise_swap put it there for the session
        yield
        return
    restore = ex.install(ex.references())
    yield
    restore()


@pytest.fixture
def evict(request):
    yield from installed(request.config, "evict")


@pytest.fixture
def minp(request):
    yield from installed(request.config, "minp")


# ----------------------------------------------------------------------------
# evict: deepest first.

def eviction_order(d: Driver, n: int) -> list[int]:
    """The next n blocks the allocator evicts (its free list must be empty): one single-token
    request each, which takes exactly one block."""
    assert not d.alloc.free_ids
    return [d.new([10_000 + i])[0].block_ids[0] for i in range(n)]


@pytest.mark.usefixtures("evict")
def test_evict_deepest_first_then_least_recently_freed():
    d = Driver(9, 4)
    a, _ = d.new([1] * 4 + [2] * 4 + [3] * 4 + [0])     # 3 full blocks (depths 1-3) + 1 token
    b, _ = d.new([5] * 4 + [0])                         # depth 1
    c, _ = d.new([6] * 4 + [7] * 4 + [0])               # depths 1-2
    (a1, a2, a3, _), (b1, _), (c1, c2, _) = a.block_ids, b.block_ids, c.block_ids
    for t in (a, b, c):
        d.free(t)
    assert list(d.alloc.evictable) == [a3, a2, a1, b1, c2, c1]      # LRU order
    for i in range(3):
        d.new([20_000 + i])                             # the 3 partial blocks, from the free list
    assert eviction_order(d, 6) == [a3, a2, c2, a1, b1, c1]           # LRU: a3 a2 a1 b1 c2 c1
    d.check()
    d.free_all()


@pytest.mark.usefixtures("evict")
def test_evict_unreachable_blocks_before_any_other():
    """A block whose parent was evicted is dead weight: a lookup walks a prompt from its first
    block, so it can never be found. Here b's second block is a twin of a's (same tokens after
    the same block: not cached, it borrows a's prefix id), so b's third block hangs from a's
    second; evicting that one orphans it."""
    d = Driver(10, 4)
    a, _ = d.new([1] * 4 + [2] * 4 + [9])
    b, hit = d.new([1] * 4 + [2])
    assert hit == 4
    for t in [2, 2, 2, 3, 3, 3, 3, 4]:
        d.append(b, t)
    a1, a2 = a.block_ids[:2]
    b3 = b.block_ids[2]
    assert d.alloc.is_cached(d.alloc.blocks[b3]) and not d.alloc.is_cached(d.alloc.blocks[b.block_ids[1]])
    d.free(a)                                           # a2 the only evictable block
    x, _ = d.new(list(range(100, 121)))                 # 6 blocks: the 5 free, then a2
    assert a2 in x.block_ids
    d.free(x)                                           # 5 cached blocks, depths 1-5
    d.free(b)                                           # b3 orphaned; a1 (depth 1)
    assert list(d.alloc.evictable)[-2:] == [b3, a1]
    assert d.alloc.victim() == b3                       # before x's depth-5 block, freed earlier
    assert d.new([1] * 4 + [2] * 4 + [3] * 4 + [0])[1] == 4     # indeed unreachable: a1 only
    d.check()
    d.free_all()


class LRU(BlockAllocator):
    """The lesson's policy, whatever is installed at BlockAllocator.victim."""
    victim = exercises.original("paged.BlockAllocator.victim")


@pytest.mark.usefixtures("evict")
def test_evict_keeps_a_shared_system_prompt_through_a_flood():
    """Three chats share a one-block system prompt, then ten one-off requests of 5 full blocks
    each go through a pool of 24 blocks: they evict 28 cached blocks. LRU evicts the system
    prompt (the oldest); deepest-first evicts the one-off requests' deep blocks instead."""
    system = [7] * 4
    hits = {}
    for policy in ("lru", "yours"):
        d = Driver(24, 4)
        if policy == "lru":
            d.alloc = LRU(24, 4)
        for q in range(3):
            chat, hit = d.new(system + [50 + q, 60 + q])
            assert hit == 4 * (q > 0)
            d.free(chat)
        evicted = 0
        for r in range(10):
            free = len(d.alloc.free_ids)
            one_off, _ = d.new([1000 + 100 * r + i for i in range(21)])     # 5 full blocks + 1
            evicted += max(0, len(one_off.block_ids) - free)
            d.free(one_off)
        assert evicted == 28
        hits[policy] = d.new(system + [99])[1]
        d.check()
        d.free_all()
    assert hits == {"lru": 0, "yours": 4}


# ----------------------------------------------------------------------------
# minp: keep the tokens within a factor of the likeliest.

@dataclass
class MinP(SamplingParams):
    min_p: float = 0.0      # keep tokens whose probability is >= min_p × the likeliest one's


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0],       # softmax: .61 .22 .14 .03 .004
                       [0.0, 0.1, -0.1, 0.05, -5.0]])     # flat, and one far below


@pytest.mark.usefixtures("minp")
def test_min_p_keeps_the_tokens_within_min_p_of_the_likeliest():
    lesson = exercises.original("sampling.sampling_probs")
    logits = LOGITS.clone()
    got = sampling.sampling_probs(logits, MinP(temperature=1.0, min_p=0.2))
    assert (got > 0).tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    torch.testing.assert_close(got.sum(-1), torch.ones(2))
    assert torch.equal(logits, LOGITS)                   # the input is left alone
    for params in [MinP(temperature=1.0, min_p=0.2), MinP(temperature=0.7, top_k=4, min_p=0.05),
                   MinP(temperature=1.3, top_p=0.9, min_p=0.3), MinP(temperature=1.0, min_p=1.0)]:
        base = lesson(LOGITS, params)                    # min-p comes after the lesson's cuts
        keep = base >= params.min_p * base.amax(-1, keepdim=True)
        got = sampling.sampling_probs(LOGITS, params)
        torch.testing.assert_close(got, base * keep / (base * keep).sum(-1, keepdim=True))
    assert (sampling.sampling_probs(LOGITS, MinP(temperature=1.0, min_p=1.0)) > 0).sum().item() == 2
    greedy = sampling.sampling_probs(LOGITS, MinP(min_p=0.5))
    assert greedy.tolist() == [[1.0, 0, 0, 0, 0], [0, 1.0, 0, 0, 0]]


@pytest.mark.usefixtures("minp")
def test_min_p_off_changes_nothing():
    lesson = exercises.original("sampling.sampling_probs")
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for params in [SamplingParams(), SamplingParams(temperature=0.8, top_k=5), MinP(temperature=1.0),
                   MinP(temperature=1.2, top_p=0.8, min_p=0.0)]:
        assert torch.equal(sampling.sampling_probs(logits, params), lesson(logits, params))


@pytest.mark.usefixtures("minp")
def test_min_p_draws_follow_the_cut_distribution():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(12, generator=gen) * 2
    params = MinP(temperature=1.0, min_p=0.1)
    probs = torch.softmax(logits, -1)
    want = probs * (probs >= 0.1 * probs.max())
    want = want / want.sum()
    assert 1 < (want > 0).sum() < 12                     # a real cut, not all or one
    counts = torch.bincount(torch.tensor([sampling.sample(logits, params, gen) for _ in range(4000)]),
                            minlength=12).float()
    assert ((counts > 0) <= (want > 0)).all()
    assert chi_square_p(counts, want * 4000) > 1e-3
