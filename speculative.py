"""
Speculative decoding: guess several tokens cheaply, let the model check all of them in one pass.

Why checking k guesses costs about one decode step. Batch-1 decoding is
memory-bound (model.py): a step reads every weight once to compute one
position. A forward pass over k+1 positions reads the same weights once and
does k+1 times the arithmetic, which on a CPU stays cheap up to a handful of
positions (SmolLM2-135M in fp32 reads 135M · 4 B ≈ 540 MB per pass whether it
computes 1 position or 5; with prepacked weights, kernels.prepack, an eager
4-position pass costs about one plain step). So if someone proposes tokens
d1..dk, the target runs one forward over [last token, d1, ..., dk] and gets its
own next-token distribution after each prefix, for the price of one step. The
exception is a compiled one-token step (--compile): a fused matrix-vector loop
that a several-position pass cannot use, so against it a proposer must land
about 2 tokens per forward to break even.

The verification rule. At position i the target says p, the proposer said q
(and drew dᵢ from q). Accept dᵢ with probability min(1, p(dᵢ)/q(dᵢ)); on the
first rejection emit a token drawn from normalize(max(0, p − q)) and stop; if
all k are accepted, the target's distribution after dk gives one bonus token.
Why this emits exactly p, whatever q is: the chance of emitting x is

    q(x)·min(1, p(x)/q(x))  +  P(reject)·max(0, p(x)−q(x)) / Σ max(0, p−q)
      = min(p(x), q(x))     +  (1 − Σ min(p, q)) · max(0, p(x)−q(x)) / (1 − Σ min(p, q))
      = min(p(x), q(x)) + max(0, p(x) − q(x))  =  p(x).

(P(reject) = Σ_y q(y)(1 − min(1, p(y)/q(y))) = 1 − Σ min(p, q), and Σ max(0, p−q)
is the same number.) A proposer that is not a model is a point mass, q = 1 at
its guess: accept with probability p(d), else draw from p with d removed. Greedy
decoding is the special case where p is a point mass on the target's argmax:
accept exactly when the guess is the argmax, else emit the argmax — so greedy
speculative output is token-for-token the plain greedy output. Temperature,
top-k and top-p are applied to the logits of both models before the rule
(sampling.sampling_probs, which plain sampling draws from too), so "p" is
exactly plain sampling's distribution.

How much it buys. If each guess survives with probability α, a step emits the
accepted prefix plus one token: 1 + α + α² + ... + α^k = (1 − α^(k+1)) / (1 − α)
tokens per target forward (α = 0.7, k = 4: 2.8). The cost is the proposer's
time plus a target forward slightly dearer than a plain step.

Proposers, one verifier. A proposer is anything that follows the Proposer
protocol below; drafting.py holds them all: free ones (prompt lookup, which
proposes what followed the latest earlier occurrence of the context's last n
tokens; lookahead, Fu et al. 2024, where the target itself runs Jacobi
iterations on a window of future positions and keeps the n-grams it "thought
of") and models (a small draft model, an EAGLE head that reads the target's own
hidden states, Medusa heads that guess several tokens ahead from the last of
them). A draft model's or an EAGLE chain's guesses come with the draft's
distributions q when sampling; trees, lookahead's and Medusa's guesses are point
masses.

One pass, several branches. Lookahead (drafting.py) verifies several candidates, and an
EAGLE head or Medusa heads can draft a tree (drafting.EagleDraft and
MedusaDraft, `--spec-tree W,M`: the likeliest few tokens at each depth
instead of the one best guess). The
candidates are merged into a token tree (TokenTree): a prefix several share is
computed once. For lookahead the forward input is

    [x_t | the candidate tree | window row 0 (W) | ... | row N−2 (W)]

at positions t; t+depth for a tree token; t+1+r+i for window row r, column i.
Positions overlap, so the causal mask is wrong; `Llama.forward(mask=...)` takes
a (T, L) mask instead: everything sees the cached prefix and x_t; a tree token
sees its ancestors and itself; window token (r, i) sees row 0's columns 0..i
and rows 1..r of its own column — the sequence x_t, row0[0..i], row1[i], ..,
rowr[i] at consecutive positions, so the output at (r, i) is the model's next
token after that column's chain. The dynamic cache stores the new K/V rows in
input order. After verification the accepted path's rows are moved right
behind x_t (KVCache.move: their K/V was computed at the right positions and
over exactly the accepted prefix, so moving is exact — no recompute) and the
cache is cropped: it holds the accepted tokens and nothing else, as after
every step here. A tree buys tokens per forward where the head is unsure, and
pays for them with a wider verify pass and more head passes (RESULTS.md,
speculative section, has the measured trade).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

import kvcache
from kvcache import DynamicCache
from model import (GenerationStats, Llama, attention_mask, check_context, context_limit,
                   generate_cached, load)
from sampling import (Constraint, SamplingParams, check_logits, constraint, finish_reason,
                      sample, sampling_probs, seeded_generator)

ROOT = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------
# 1. The rule, on probability vectors.

def accept(p: torch.Tensor, token: int, q: torch.Tensor | None, gen) -> bool:
    """Accept with probability min(1, p(d)/q(d)); q None is a point mass on d."""
    ratio = float(p[token]) / (float(q[token]) if q is not None else 1.0)
    if ratio >= 1 or ratio <= 0:            # greedy always lands here: no random number drawn
        return ratio >= 1
    return float(torch.rand((), generator=gen, device=p.device)) < ratio


def residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """After rejecting d: normalize(max(0, p − q)) (q None: p with d removed)."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def verify(target: list[torch.Tensor], candidates: list[list[int]],
           draft: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> tuple[int, int, int]:
    """The target's verdict on one or more proposed continuations.

    target[c]: (len(candidates[c]) + 1, V), the target's distribution after the
    last accepted token and after each of candidate c's tokens; draft: (k, V), the
    draft model's distributions for a single candidate, or None for point masses.
    Several candidates (lookahead) are tried in turn at each depth: rejecting
    one removes its token from p, so the next is judged against what is left —
    the same argument as above, applied once per distinct token.
    Returns (candidate index, tokens accepted n, next token)."""
    if draft is not None and len(candidates) > 1:
        raise ValueError("a draft distribution goes with exactly one candidate")
    live = list(range(len(candidates))) or [0]
    cands = candidates or [[]]
    depth = 0
    while True:
        p = target[live[0]][depth]
        taken, tried = None, set()
        for c in live:
            if len(cands[c]) <= depth or cands[c][depth] in tried:
                continue
            token = cands[c][depth]
            q = draft[depth] if draft is not None else None
            if accept(p, token, q, generator):
                taken = token
                break
            tried.add(token)
            p = residual(p, token, q)
        if taken is None:   # every guess rejected (or none left): the target's own token
            return live[0], depth, int(torch.multinomial(p, 1, generator=generator))
        live = [c for c in live if len(cands[c]) > depth and cands[c][depth] == taken]
        depth += 1


def verify_greedy(best: list[int], rows: list[list[int]],
                  candidates: list[list[int]]) -> tuple[int, int, int]:
    """`verify` when every distribution is a point mass (greedy): the same verdict
    from token ids alone. best[r] is the target's argmax after the token in row r
    of the pass; rows[c] lists the rows of x_t and of candidate c's tokens (a
    TokenTree, below, shares rows between candidates). Returns (candidate index,
    tokens accepted n, next token) for the longest match; no 49,152-wide rows
    are built."""
    c, n = 0, 0
    for i, (path, cand) in enumerate(zip(rows, candidates)):
        m = 0
        while m < len(cand) and cand[m] == best[path[m]]:
            m += 1
        if m > n:
            c, n = i, m
    return c, n, best[rows[c][n]] if rows else best[0]


@dataclass
class TokenTree:
    """Candidates merged into a tree: a prefix that several share is computed once.

    tokens[i] sits at depth depths[i] (1 = right after x_t) below parents[i]
    (0 = x_t, i + 1 = tokens[i]: the indices are rows of the verify pass, whose
    row 0 is x_t); rows[c] lists the rows of x_t and of candidate c's tokens."""
    tokens: list[int]
    depths: list[int]
    parents: list[int]
    rows: list[list[int]]

    @property
    def is_chain(self) -> bool:
        """Each token follows the one before it: the plain causal mask is right."""
        return all(p == i for i, p in enumerate(self.parents))

    def mask(self) -> torch.Tensor:
        """(1 + n, 1 + n) bool: row r sees x_t, its ancestors and itself."""
        n = len(self.tokens) + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[0, 0] = True
        for i, p in enumerate(self.parents, start=1):
            m[i] = m[p]
            m[i, i] = True
        return m


def token_tree(candidates: list[list[int]]) -> TokenTree:
    """Merge candidates (lists of tokens after x_t) into one TokenTree."""
    tree, child = TokenTree([], [], [], []), {}       # (parent row, token) -> row
    for cand in candidates:
        path = [0]
        for depth, token in enumerate(cand, start=1):
            key = (path[-1], token)
            if key not in child:
                child[key] = len(tree.tokens) + 1
                tree.tokens.append(token)
                tree.depths.append(depth)
                tree.parents.append(path[-1])
            path.append(child[key])
        tree.rows.append(path)
    return tree


# ----------------------------------------------------------------------------
# 2. Proposers. propose() returns candidates (and a draft's distributions, or
# extra "branch" tokens the target should run in the same pass); update() sees
# the context after the step.

@dataclass
class Proposal:
    candidates: list[list[int]] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None      # (k, V): one candidate drawn from a model
    # lookahead: extra tokens for the same pass
    branch: list[int] = field(default_factory=list)
    branch_offsets: list[int] = field(default_factory=list)  # their positions relative to x_t
    branch_mask: torch.Tensor | None = None      # (E, E): what branch tokens see among themselves


class Proposer:
    """What `generate` asks of a proposer (drafting.py's: PromptLookup, Lookahead, the drafts).

    Each step it calls ``propose(context, k, room, params, gen)`` for at most k guesses after the
    context (``room``: positions left in the cache), verifies them in one target pass, then calls
    ``update(context, n, k, branch_logits)`` with the n accepted. A proposer that reads the target's
    features (``needs_features``: EAGLE, Medusa) gets them through ``observe(start, features)``,
    for the positions the target computed. ``needs_dynamic_cache``: its guesses share positions
    (trees, lookahead's branches), which only a dynamic cache holds. ``cache``: its own KV cache,
    or None (the trace reports its length)."""
    needs_dynamic_cache = False
    needs_features = False
    cache = None

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        raise NotImplementedError

    def observe(self, start: int, features: torch.Tensor):
        pass

    def update(self, context, n, k, branch_logits):
        pass


def check_k(k: int):
    if k < 1:
        raise ValueError(f"--spec-k must be >= 1 (tokens proposed per step), got {k}")


def check_tree(w: int, m: int):
    if w < 1 or m < 1:
        raise ValueError(f"--spec-tree W,M needs W >= 1 (children per node) and M >= 1 "
                         f"(tokens verified), got {w},{m}")


# ----------------------------------------------------------------------------
# 3. The loop: the chain algorithm on its own, then the general one.

@torch.inference_mode()
def generate_simple(model: Llama, prompt: list[int], p: SamplingParams, draft: Llama,
                    k: int = 4) -> Iterator[int]:
    """The chain algorithm alone, before the general loop below: a draft model
    proposes k tokens one at a time, the target scores all of them in one pass,
    the rule keeps the agreed prefix plus one token of the target's, and both
    caches are cropped back to what was kept. Greedy or sampled, exact either way;
    `generate` with a DraftModel produces the same tokens (the tests check it)."""
    dev = model.device
    gen, eos = seeded_generator(p.seed, dev), set(model.config.eos_ids)
    cache, dcache, limit = kvcache.new_cache(model), kvcache.new_cache(draft), context_limit(model)
    check_context(model, len(prompt))
    logits = model(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev), cache,
                   last_only=True)
    context = prompt + [sample(logits[0, -1], p, gen)]
    yield context[-1]
    while not finish_reason(context[-1], len(context) - len(prompt), len(context), p, eos, limit):
        t = cache.length                                   # x_t = context[-1] sits at position t
        n_k = min(k, p.max_new_tokens - (len(context) - len(prompt)) - 1, limit - 2 - t)
        guesses, qs, feed = [], [], context[dcache.length:]
        # draft: one token at a time, from its own cache
        for _ in range(n_k):
            pos = torch.arange(dcache.length, dcache.length + len(feed), device=dev)
            q = sampling_probs(draft(torch.tensor([feed], device=dev), pos, dcache,
                                     last_only=True)[0, -1], p)
            guesses.append(int(q.argmax()) if p.temperature == 0
                           else int(torch.multinomial(q, 1, generator=gen)))
            qs.append(q)
            feed = guesses[-1:]
        # target: x_t and every guess in one pass; probs[i] is its distribution after guess i
        probs = sampling_probs(model(torch.tensor([context[-1:] + guesses], device=dev),
                                     torch.arange(t, t + 1 + n_k, device=dev), cache)[0], p)
        _, n, nxt = verify([probs], [guesses], torch.stack(qs) if qs else None, gen)
        cache.crop(t + 1 + n)                              # rejected guesses leave both caches
        dcache.crop(min(dcache.length, t + 1 + n))
        for token in guesses[:n] + [nxt]:
            context.append(token)
            yield token
            if finish_reason(token, len(context) - len(prompt), len(context), p, eos, limit):
                return


@dataclass
class SpecStats:
    steps: int = 0            # target forwards after the prefill
    proposed: int = 0         # guesses offered (the longest candidate per step)
    accepted: int = 0         # guesses accepted
    emitted: int = 0          # tokens emitted by those forwards
    histogram: Counter = field(default_factory=Counter)   # accepted length -> steps
    # per step: (emitted so far, n, k, target cache, draft cache)
    trace: list = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def summary(self) -> str:
        hist = " ".join(f"{n}:{c}" for n, c in sorted(self.histogram.items()))
        return (f"acceptance {100 * self.acceptance:.0f}% | {self.tokens_per_forward:.2f} tokens "
                f"per target forward | accepted lengths {hist}")


def constrain_rows(logits: torch.Tensor, rows: list[list[int]], cands: list[list[int]],
                   grammar: Constraint) -> torch.Tensor:
    """Under a grammar, each verified row gets the mask of the state it follows: row
    rows[c][i] comes after x_t and cands[c][:i]. A guess the grammar forbids then has
    probability 0 in its row, so the rule above rejects it like any unlikely guess, and
    what is accepted is exactly what masked plain decoding draws. The rows after a
    forbidden guess are never read (verification stops there), so masking stops too.
    The grammar ends where it began."""
    out = logits.float().clone()
    done = set()
    for path, cand in zip(rows, cands) if cands else [([0], [])]:
        taken = 0
        for r, token in zip(path, cand + [None]):
            if r not in done:          # a row shared by several candidates: one state
                out[r] = grammar.apply(logits[r])
                done.add(r)
            if token is None or out[r, token] == -torch.inf:
                break
            grammar.advance(token)
            taken += 1
        grammar.rollback(taken)
    return out


@torch.inference_mode()
def generate(model: Llama, prompt: list[int], p: SamplingParams, proposer,
             stats: GenerationStats | None = None, spec: SpecStats | None = None, cache=None,
             history: list[int] | None = None, vocab=None) -> Iterator[int]:
    """Like model.generate_cached, but each step verifies the proposer's guesses.

    ``history`` is what ``cache`` already holds (a chat's earlier turns): the
    proposers look at the whole context. On exit the cache holds everything
    except the last yielded token, exactly as after generate_cached. ``vocab``:
    sampling.grammar_vocab, for a schema or grammar in ``p`` (constrain_rows)."""
    stats = stats if stats is not None else GenerationStats()
    spec = spec if spec is not None else SpecStats()
    cache = cache if cache is not None else kvcache.new_cache(model)
    history = list(history or [])
    if len(history) != cache.length:
        raise ValueError(f"history has {len(history)} tokens but the cache holds {cache.length}")
    if proposer.needs_dynamic_cache and not isinstance(cache, DynamicCache):
        raise ValueError("lookahead decoding and draft trees need the dynamic cache "
                         "(--cache dynamic): their branches share positions, so their K/V rows "
                         "are kept in input order")
    limit = context_limit(model, cache)
    check_context(model, cache.length + len(prompt), cache)
    dev = model.device
    gen, grammar = seeded_generator(p.seed, dev), constraint(p, vocab)
    stats.prompt_tokens, t0 = len(prompt), time.perf_counter()
    pos = torch.arange(cache.length, cache.length + len(prompt), device=dev)
    feats = proposer.needs_features
    logits = model(torch.tensor([prompt], device=dev), pos, cache, last_only=True, hidden=feats)
    if feats:
        logits, hidden = logits
        proposer.observe(len(history), hidden[0])
    stats.positions_computed += len(prompt)
    context = history + prompt + [sample(logits[0, -1], p, gen, grammar)]
    t0 = stats.clock(0, t0)
    yield context[-1]
    done, eos = 1, set(model.config.eos_ids)
    stats.finish_reason = finish_reason(context[-1], done, cache.length + 1, p, eos, limit)
    if stats.finish_reason:
        return
    while True:
        t = cache.length                                  # x_t = context[-1] sits at position t
        room = limit - 1 - (t + 1)                        # rows this forward may add beyond x_t
        k = max(0, min(proposer.k, p.max_new_tokens - done - 1, room))
        prop = proposer.propose(context, k, room, p, gen) if k else Proposal()
        cands = [c for c in prop.candidates if c] if prop.draft_probs is None else prop.candidates
        # One pass: x_t, the candidates as a token tree, the lookahead branch.
        tree = token_tree(cands)
        ids, offsets, rows = [context[-1]] + tree.tokens, [0] + tree.depths, tree.rows
        b0 = len(ids)
        ids += prop.branch
        offsets += prop.branch_offsets
        mask = None
        if not tree.is_chain or prop.branch:
            T = len(ids)
            mask = torch.zeros(T, t + T, dtype=torch.bool)
            mask[:, :t + 1] = True                        # the cached prefix and x_t
            mask[:b0, t:t + b0] = tree.mask()
            if prop.branch:
                mask[b0:, t + b0:] = prop.branch_mask
            # keys are rows 0..t-1, then the new tokens
            if model.config.sliding_window is not None:
                queries = torch.tensor(offsets) + t
                keys = torch.cat([torch.arange(t), queries])
                mask &= attention_mask(queries, keys, model.config.sliding_window, causal=False)
            mask = mask.to(dev)
        pos = torch.tensor(offsets, device=dev) + t
        # Nothing proposed: x_t alone is plain decoding's step, called the same way
        # (last_only), so the runner's compiled one-token step serves it, not a recompile.
        logits = model(torch.tensor([ids], device=dev), pos, cache, last_only=len(ids) == 1,
                       mask=mask, hidden=feats)
        if feats:
            logits, hidden = logits
        logits = logits[0]
        stats.positions_computed += len(ids)
        check_logits(logits[:b0])
        if grammar is not None:
            logits = torch.cat([constrain_rows(logits[:b0], rows, cands, grammar),
                                logits[b0:].float()])
        if p.temperature == 0:
            c, n, nxt = verify_greedy(logits[:b0].argmax(-1).tolist(), rows, cands)
        else:
            probs = sampling_probs(logits[:b0], p)
            target = [probs[path] for path in rows] or [probs[:1]]
            c, n, nxt = verify(target, cands, prop.draft_probs, gen)
        accepted = (cands[c][:n] if cands else []) + [nxt]
        for token in accepted if grammar is not None else []:
            grammar.advance(token)
        # the pass's rows of x_t and the accepted guesses
        kept = rows[c][:n + 1] if cands else [0]
        if kept != list(range(n + 1)):                    # bring their K/V right behind x_t
            cache.move([t + r for r in kept[1:]], t + 1)
        cache.crop(t + 1 + n)
        if feats:       # the features of x_t and the accepted guesses: positions t..t+n
            proposer.observe(t, hidden[0, kept])
        context += accepted
        proposer.update(context, n, k, logits[b0:] if prop.branch else None)
        spec.steps += 1
        spec.proposed += max((len(c) for c in cands), default=0)
        spec.accepted += n
        spec.emitted += len(accepted)
        spec.histogram[n] += 1
        draft_cache = proposer.cache
        spec.trace.append((done + len(accepted), n, k, cache.length,
                           draft_cache and draft_cache.length))
        for i, token in enumerate(accepted):
            t0 = stats.clock(done, t0)
            yield token
            done += 1
            # plain decoding's cache length at this token
            held = len(context) - len(accepted) + i
            stats.finish_reason = finish_reason(token, done, held + 1, p, eos, limit)
            if stats.finish_reason:
                cache.crop(held)
                return


def parse_tree(text: str) -> tuple[int, int]:
    try:
        w, m = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--spec-tree takes W,M (children per node, tokens verified), e.g. 4,10; "
                         f"got '{text}'")
    check_tree(w, m)
    return w, m


# ----------------------------------------------------------------------------
# Demo: the chain algorithm with the target as its own draft. Every guess is the target's own
# greedy token, so every one is accepted and the text is the plain decoder's; the draft costs a
# full step per guess, so it is no faster: a real proposer makes its guesses cheaply (drafting.py,
# `python drafting.py`; `python bench.py speculative` compares them all).

if __name__ == "__main__":
    model, tok = load()
    chat = [{"role": "user", "content": "Name three colours."}]
    prompt = tok.encode(tok.apply_chat_template(chat), add_bos=False)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = list(generate_cached(model, prompt, params))
    for k in (1, 4):
        same = list(generate_simple(model, prompt, params, model, k)) == plain
        print(f"generate_simple, k = {k}, the target as its draft: {len(plain)} greedy tokens, "
              f"the plain decoder's: {'yes' if same else 'no'}")
    print(tok.decode(plain))
