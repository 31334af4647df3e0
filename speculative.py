"""
Speculative decoding: guess several tokens cheaply, let the model check all of them in one pass.

Why checking k guesses costs about one decode step. Batch-1 decoding is
memory-bound (model.py): a step reads every weight once to compute one
position. A forward pass over k+1 positions reads the same weights once and
does k+1 times the arithmetic, which on this 2-core CPU stays cheap up to a
handful of positions: SmolLM2-135M in fp32 reads 540 MB per pass whether it
computes 1 position or 5. With the weights in oneDNN's own layout
(model.prepack) an eager fp32 pass takes ~33 ms for 1 position, ~30 for 4 and
~41 for 11; bf16 27, 25 and 30. (Before prepacking, 4 positions cost 1.3x one:
oneDNN reordered every weight on every several-row call.) So if someone
proposes tokens d1..dk, the target runs one forward over [last token, d1, ...,
dk] and gets its own next-token distribution after each prefix, for the price
of one step. The exception is a compiled step (--compile): one position
becomes a fused matrix-vector loop, 13 ms in bf16, that a several-position
pass cannot use, so against compiled decoding a proposer must land ~2 tokens
per forward to break even (README).

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
(`model.sampling_probs`, which plain sampling draws from too), so "p" is exactly
plain sampling's distribution.

How much it buys. If each guess survives with probability α, a step emits the
accepted prefix plus one token: 1 + α + α² + ... + α^k = (1 − α^(k+1)) / (1 − α)
tokens per target forward (α = 0.7, k = 4: 2.8). The cost is the proposer's
time plus a target forward slightly dearer than a plain step.

Proposers, one verifier:

* PromptLookup(N): find the latest earlier occurrence of the context's last
  n tokens (n = N..1) and propose what followed it. Free, and strong when the
  answer quotes its input (summaries, code edits, extraction).
* DraftModel: a small model with the same tokenizer drafts k tokens one by one
  from its own KV cache (train.py distils one from the bundled model). Its
  head may score only part of the vocabulary (model.Llama.head_ids): q = 0
  for the other tokens, which the rule above handles like any other q.
  Adaptive k grows k after a fully accepted step and shrinks it after an early
  rejection.
* EagleDraft (Li et al. 2024): the draft is a one-block head that reads the
  target's own last hidden states (its "features") next to the tokens, so it
  starts from everything the target has worked out instead of from scratch.
  The verify pass returns the features of the positions it computed.
* LookupThenDraft: prompt lookup where the last N tokens occurred before, the
  draft model elsewhere (`--draft X --prompt-lookup N`).
* Lookahead(W, N, G) (Fu et al. 2024): no second model. The target itself runs
  Jacobi iterations on a window of W future positions; every column of the
  window's last N−1 trajectories is an n-gram the model "thought of", kept in a
  pool keyed by its first token. Up to G pool n-grams starting with the current
  token are verified — in the same forward pass as the next Jacobi iteration.

One pass, several branches. Lookahead verifies several candidates, and an
EAGLE head can draft a tree (EagleDraft.propose_tree, `--spec-tree W,M`: the
head's likeliest few tokens at each depth instead of its one best guess). The
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
behind x_t (their K/V was computed at the right positions and over exactly the
accepted prefix, so moving is exact — no recompute) and the cache is cropped:
it holds the accepted tokens and nothing else, as after every step here.
A tree buys tokens per forward where the head is unsure: on bench.py's 8 chat
prompts the bundled head's chain of 3 made 1.75 tokens per forward, a tree of
10 tokens (W = 4, depth 3) 2.26. It pays for them with a wider verify pass (11
positions: ~42 ms against ~34 for 4, fp32 here) and 3 eager head passes (~7 ms
against the chain's ~4), so on this CPU it is no faster than the chain: 1.61x
plain against 1.66x in fp32, 1.62x against 1.66x in bf16 (README).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

import checkpoint
import model as M
from kvcache import DynamicCache, KVCache, common_prefix

ROOT = Path(__file__).resolve().parent
BUNDLED_DRAFT = ROOT / "drafts" / "smollm2-135m-draft"   # written by train.py


# ----------------------------------------------------------------------------
# 1. The rule, on probability vectors.

def _accept(p: torch.Tensor, token: int, q: torch.Tensor | None, gen) -> bool:
    """Accept with probability min(1, p(d)/q(d)); q None is a point mass on d."""
    ratio = float(p[token]) / (float(q[token]) if q is not None else 1.0)
    if ratio >= 1 or ratio <= 0:            # greedy always lands here: no random number drawn
        return ratio >= 1
    return float(torch.rand((), generator=gen, device=p.device)) < ratio


def _residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """After rejecting d: normalize(max(0, p − q)) (q None: p with d removed)."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def verify(target: list[torch.Tensor], candidates: list[list[int]], draft: torch.Tensor | None = None,
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
            if _accept(p, token, q, generator):
                taken = token
                break
            tried.add(token)
            p = _residual(p, token, q)
        if taken is None:   # every guess rejected (or none left): the target's own token
            return live[0], depth, int(torch.multinomial(p, 1, generator=generator))
        live = [c for c in live if len(cands[c]) > depth and cands[c][depth] == taken]
        depth += 1


def verify_greedy(best: list[int], rows: list[list[int]], candidates: list[list[int]]) -> tuple[int, int, int]:
    """`verify` when every distribution is a point mass (greedy): the same verdict
    from token ids alone. best[r] is the target's argmax after the token in row r
    of the pass; rows[c] lists the rows of x_t and of candidate c's tokens (a
    TokenTree, below, shares rows between candidates). Returns (candidate index,
    tokens accepted n, next token) for the longest match; no 49,152-wide rows
    are built (~1 ms a step here)."""
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
    branch: list[int] = field(default_factory=list)        # lookahead: extra tokens for the same pass
    branch_offsets: list[int] = field(default_factory=list)  # their positions relative to x_t
    branch_mask: torch.Tensor | None = None      # (E, E): what branch tokens see among themselves


class PromptLookup:
    """Propose the continuation of the latest earlier occurrence of the last n tokens."""
    needs_dynamic_cache = False
    needs_features = False     # EagleDraft: the target's features, through observe()

    def __init__(self, ngram: int = 3, k: int = 4, min_ngram: int = 1):
        if ngram < 1:
            raise ValueError(f"--prompt-lookup N needs N >= 1 (the n-gram length to match), got {ngram}")
        check_k(k)
        self.ngram, self.k, self.min_ngram = ngram, k, min(min_ngram, ngram)

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        last = len(context)
        for n in range(min(self.ngram, last - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            for start in range(last - n - 1, -1, -1):      # latest first, never the tail itself
                if context[start + n - 1] == tail[-1] and context[start:start + n] == tail:
                    return Proposal([context[start + n:start + n + k]])
        return Proposal()

    def update(self, context, n, k, branch_logits):
        pass


class DraftModel:
    """A small model with the same tokenizer drafts k tokens autoregressively.

    A drafted token must cost a small fraction of a target step. A draft of 6
    layers of width 192 with a head over 8,192 tokens (what train.py trained
    before the EAGLE head) run eagerly takes 3.6 ms a token here, mostly per-op
    overhead, against 41 ms for a SmolLM2 step (fp32). With ``compile=True``
    its one-token step is compiled (model.compile_decode) on a static cache: 1.5 ms a drafted token (k = 3,
    300-token context). The static cache is sized in powers of two (≥ 512) so
    the compiled step sees few shapes; a longer context gets a bigger one.
    (Attention reads the whole static cache: at 1,024 rows instead of 512 a
    drafted token cost 1.8 ms.) Greedy drafting takes the argmax of the logits
    and hands verify no distributions."""
    needs_dynamic_cache = False
    needs_features = False

    def __init__(self, draft: M.Llama, target: M.Llama, k: int = 4, adaptive: bool = False, k_max: int = 12,
                 compile: bool = False):
        check_k(k)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft's vocabulary has {draft.config.vocab_size} tokens and the target's "
                             f"{target.config.vocab_size}: a draft must use the target's tokenizer")
        self.model, self.k, self.adaptive, self.k_max = draft, k, adaptive, max(k, k_max)
        if compile and draft.compiled_step is None:
            draft.compile_decode()
        self.static = compile
        self.cache = None if compile else draft.new_cache()
        self.ids: list[int] = []        # the tokens in self.cache

    def reserve(self, n: int):
        """A static cache that holds n tokens (a new, empty one if the current is too small)."""
        if self.cache is None or self.cache.limit < n:
            size = min(max(512, 1 << (n - 1).bit_length()), self.model.config.max_seq_len)
            with torch.inference_mode():    # as in propose: the compiled step's guards tell the two apart
                self.cache = self.model.new_cache("static", max_len=size)
            self.ids = []

    def warm_up(self, target: M.Llama, sizes=(512, 1024, 2048)):
        """Compile the draft's step now for these static-cache sizes (~13 s the first
        time, then from inductor's disk cache), so that no timed step waits for it."""
        for n in sizes:
            self.reserve(n)
            list(generate(target, [1, 2, 3], M.SamplingParams(max_new_tokens=4), self))

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        dev = self.model.embed_tokens.weight.device
        if self.static:
            self.reserve(len(context) + k)
        keep = min(common_prefix(self.ids, context), len(context) - 1)
        self.cache.crop(keep)
        feed, tokens, rows = context[keep:], [], []
        for _ in range(k):
            pos = torch.arange(self.cache.length, self.cache.length + len(feed), device=dev)
            logits = self.model(torch.tensor([feed], device=dev), pos, self.cache, last_only=True)[0, -1]
            tokens.append(self.choose(logits, params, gen, rows))
            feed = tokens[-1:]
        self.ids = context + tokens[:-1]
        return Proposal([tokens], torch.stack(rows) if rows else None)

    @staticmethod
    def choose(logits: torch.Tensor, params, gen, rows: list) -> int:
        """The drafted token; sampling also keeps its distribution q in rows for verify."""
        if params.temperature == 0:     # a point mass: verify needs only the token
            return int(logits.argmax())
        rows.append(M.sampling_probs(logits, params))
        return int(torch.multinomial(rows[-1], 1, generator=gen))

    def update(self, context, n, k, branch_logits):
        self.sync(context)
        self.adapt(n, k)

    def sync(self, context: list[int]):
        """Drop what the target rejected: the cache keeps the accepted tokens it holds."""
        accepted = len(context) - 1           # what the target's cache holds now
        self.ids = self.ids[:min(len(self.ids), accepted)]
        self.cache.crop(len(self.ids))

    def adapt(self, n: int, k: int):
        if self.adaptive:                      # grow on full acceptance, shrink on early rejection
            if n == k:
                self.k = min(self.k + 1, self.k_max)
            elif n < k // 2:
                self.k = max(self.k - 1, 1)


class EagleDraft(DraftModel):
    """EAGLE (Li et al. 2024): a one-block head drafts from the target's own features.

    A separate small model must rediscover, from tokens alone, what the target
    has already worked out. EAGLE's head instead reads the target's feature f_j
    (the final normalised hidden state, what the LM head reads) next to the
    token x_j+1 that followed, and predicts f_j+1; the target's LM head turns
    the prediction into a token (model.Llama.fc and share_target):

        head input at position j:  fc([embed(x_j+1); f_j])   ->   f̂_j+1  ->  token x̂_j+2

    The verify forward hands the features of the positions it computed to
    observe(); only accepted ones are kept. Drafting step 1 then runs the head
    over every position whose true feature is new (the last accepted tokens, one
    forward), which yields d1; steps 2..k feed the head's own predicted feature
    with the token it just drafted. Its cache holds entries for true features
    only between steps: the entries built on predictions are dropped, as the
    target's rows for rejected guesses are.
    A drafted token costs fc, one block and a head over 8,192 tokens, ~9M
    multiply-adds against the target's ~135M. The bundled head (train.py),
    compiled, at context ~300: 1.15 ms a drafted token in fp32, 0.77 in bf16
    (load_draft runs it in bf16, see narrow_draft), against ~33 ms for an
    eager fp32 SmolLM2 step. Its cache and outputs are in its own dtype; the
    target's features are cast on the way in, and the features it predicts
    are kept in the target's dtype, so the compiled step sees one dtype.
    With ``tree=(W, M)`` it drafts a tree instead of a chain (propose_tree)."""
    needs_features = True

    def __init__(self, head: M.Llama, target: M.Llama, k: int = 4, adaptive: bool = False, k_max: int = 12,
                 compile: bool = False, tree: tuple[int, int] | None = None):
        if not head.config.eagle:
            raise ValueError("EagleDraft needs an EAGLE head (config.json \"eagle\": true); use DraftModel")
        if head.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"the EAGLE head's width is {head.config.hidden_size} but the target's is "
                             f"{target.config.hidden_size}: it reads the target's features, so it was trained "
                             f"for another model")
        if tree is not None:
            check_tree(*tree)
        # a tree grows level by level with several tokens per head pass: the eager step, a dynamic cache
        super().__init__(head, target, k, adaptive, k_max, compile and tree is None)
        self.tree = tree
        self.needs_dynamic_cache = tree is not None      # the target's rows too: tree tokens share positions
        w = target.embed_tokens.weight
        self.features = torch.zeros(0, target.config.hidden_size, dtype=w.dtype, device=w.device)

    def observe(self, start: int, features: torch.Tensor):
        """The target's features (T, hidden) at positions start..start+T-1 of the context."""
        end, have = start + len(features), len(self.features)
        if have < end:
            self.features = torch.cat([self.features, self.features.new_zeros(max(end, 2 * have) - have,
                                                                              self.features.shape[1])])
        self.features[start:end] = features

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        t = len(context) - 1      # x_t is the last token; the target has features for 0..t-1
        if self.static:
            self.reserve(len(context) + k)
        if len(self.features) < t:   # positions computed without features (a resumed chat): zeros
            self.observe(len(self.features), self.features.new_zeros(t - len(self.features), self.features.shape[1]))
        # entry j reads token j+1: entries 0..keep-1 still hold true features of this context
        keep = max(0, min(common_prefix(self.ids, context) - 1, t - 1))
        self.cache.crop(keep)
        feed, feats, tokens, rows = context[keep + 1:t + 1], self.features[keep:t], [], []
        self.ids = context[:t + 1]            # the entries on predicted features are not kept
        if self.tree is not None:
            return self.propose_tree(feed, feats, t, k, room)
        for _ in range(k):
            logits, h = self.head_pass(feed, torch.arange(self.cache.length, self.cache.length + len(feed)), feats)
            tokens.append(self.choose(logits[0, -1], params, gen, rows))
            feed, feats = tokens[-1:], h[0, -1:].to(self.features.dtype)
        return Proposal([tokens], torch.stack(rows) if rows else None)

    def head_pass(self, tokens: list[int], positions: torch.Tensor, features: torch.Tensor, mask=None):
        """The head over new entries (token, feature) -> (logits, predicted features);
        without a mask only the last position's logits."""
        dev = features.device
        return self.model(torch.tensor([tokens], device=dev), positions.to(dev), self.cache,
                          last_only=mask is None, mask=None if mask is None else mask.to(dev),
                          features=features[None], hidden=True)

    def propose_tree(self, feed: list[int], feats: torch.Tensor, t: int, k: int, room: int) -> Proposal:
        """A tree of guesses, grown like EAGLE-2: level 1 is the head's top W
        tokens for x_t+1; each next level expands the W most likely nodes of the
        last (likely = the product of the head's probabilities along the path),
        W children each, all in one head pass whose mask lets a node see its own
        ancestors only. After k levels the M most likely nodes are verified (a
        node is never likelier than its parent, so they form a tree). The guesses
        are fixed functions of the head's scores, so verify treats them as point
        masses, several per depth: exact for sampling as for greedy."""
        W, budget = self.tree
        logits, h = self.head_pass(feed, torch.arange(self.cache.length, self.cache.length + len(feed)), feats)
        # per node: its token, parent (-1: x_t), log-probability of its path, the feature it reads
        tokens, parents, scores, inputs = [], [], [], []
        entry = {}                            # an expanded node -> its row in the head's cache

        def lineage(i):                       # node i, its parent, ..., up to depth 1
            while i >= 0:
                yield i
                i = parents[i]

        def grow(logits_row, parent, feature):
            top = torch.log_softmax(logits_row.float(), -1).topk(W)
            base = scores[parent] if parent >= 0 else 0.0
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                tokens.append(token)
                parents.append(parent)
                scores.append(base + lp)
                inputs.append(feature)
            return range(len(tokens) - W, len(tokens))

        level = grow(logits[0, -1], -1, h[0, -1])
        for depth in range(1, k):
            expand = sorted(level, key=lambda i: -scores[i])[:W]
            L = self.cache.length
            mask = torch.zeros(len(expand), L + len(expand), dtype=torch.bool)
            mask[:, :t] = True                                  # the true entries
            for j, i in enumerate(expand):
                entry[i] = L + j
                mask[j, [entry[a] for a in lineage(i)]] = True
            logits, h = self.head_pass([tokens[i] for i in expand], torch.full((len(expand),), t - 1 + depth),
                                       torch.stack([inputs[i] for i in expand]), mask)
            level = [n for j, i in enumerate(expand) for n in grow(logits[0, j], i, h[0, j])]
        chosen = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:max(1, min(budget, room))]
        leaves = set(chosen) - {parents[i] for i in chosen}
        return Proposal([[tokens[a] for a in lineage(leaf)][::-1]
                         for leaf in sorted(leaves, key=lambda i: (-scores[i], i))])

    def sync(self, context: list[int]):
        self.cache.crop(max(0, len(self.ids) - 1))     # entries on predicted features go


class LookupThenDraft:
    """Prompt lookup where the text repeats itself, the draft model elsewhere.

    The two are strong in different places. Chat answers repeat their own
    phrases, lists and the prompt's words; there an exact match of the last N
    tokens proposes a long continuation for free, often wholly accepted. Where
    nothing repeats, the draft model guesses. Measured on bench.py's chat
    prompts (see README): the hybrid beats either alone, because the lookup's
    steps are long (up to 2k tokens here) and the draft fills the rest. Either
    way each guess is verified by the same rule, so output stays exact."""

    def __init__(self, draft: DraftModel, ngram: int = 3):
        # an exact match of all N tokens only (a 1-token match is a weak guess: the
        # draft does better there), and twice the draft's k: a lookup's guesses cost nothing
        self.lookup, self.draft = PromptLookup(ngram, 2 * draft.k, min_ngram=ngram), draft
        self.needs_features, self.needs_dynamic_cache = draft.needs_features, draft.needs_dynamic_cache
        self.looked_up = False        # whether this step's guess came from the lookup

    @property
    def k(self) -> int:
        return max(self.lookup.k, self.draft.k)

    @property
    def cache(self):
        return self.draft.cache

    def observe(self, start: int, features: torch.Tensor):
        self.draft.observe(start, features)

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        prop = self.lookup.propose(context, min(k, self.lookup.k), room, params, gen)
        self.looked_up = bool(prop.candidates and prop.candidates[0])
        return prop if self.looked_up else self.draft.propose(context, min(k, self.draft.k), room, params, gen)

    def update(self, context, n, k, branch_logits):
        self.draft.sync(context)
        if not self.looked_up:        # adaptive k follows the draft's own guesses only
            self.draft.adapt(n, k)


class Lookahead:
    """Jacobi iteration over W future positions; n-grams from its trajectories; verify up to G."""
    needs_dynamic_cache = True
    needs_features = False

    def __init__(self, window: int, ngram: int, guesses: int, seed: int = 0):
        if window < 1 or ngram < 2 or guesses < 1:
            raise ValueError(f"--lookahead W,N,G needs W >= 1 (window), N >= 2 (n-gram size) and G >= 1 "
                             f"(candidates verified per step), got {window},{ngram},{guesses}")
        self.W, self.N, self.G, self.k = window, ngram, guesses, ngram - 1
        self.rng = random.Random(seed)
        self.rows: list[list[int]] = []          # the trajectories, oldest first (at most N−1)
        self.pool: dict[int, list[tuple]] = {}   # first token -> continuations, most recent first

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        if not self.rows:   # start the window from tokens of the context
            self.rows = [[self.rng.choice(context) for _ in range(self.W)]]
        cands = [list(c[:k]) for c in self.pool.get(context[-1], [])[:self.G]] if k else []
        R, W = len(self.rows), self.W
        if room < R + W + k:            # near the end of the context: verify only
            return Proposal(cands)
        mask = torch.zeros(R * W, R * W, dtype=torch.bool)
        for r in range(R):
            for i in range(W):
                row = r * W + i
                mask[row, :i + 1] = True                           # row 0, columns 0..i
                mask[row, [s * W + i for s in range(1, r + 1)]] = True   # rows 1..r of column i
        return Proposal(cands, branch=[t for row in self.rows for t in row],
                        branch_offsets=[1 + r + i for r in range(R) for i in range(W)], branch_mask=mask)

    def update(self, context, n, k, branch_logits):
        if branch_logits is None:
            return
        new = branch_logits[-self.W:].argmax(-1).tolist()     # the last row's next tokens
        if len(self.rows) < self.N - 1:                       # warming up: the window grows a row
            self.rows.append(new)
            return
        for i in range(self.W):
            gram = tuple(row[i] for row in self.rows) + (new[i],)
            known = self.pool.setdefault(gram[0], [])
            if gram[1:] in known:
                known.remove(gram[1:])
            known.insert(0, gram[1:])
            del known[self.G:]
        self.rows = self.rows[1:] + [new]


def check_k(k: int):
    if k < 1:
        raise ValueError(f"--spec-k must be >= 1 (tokens proposed per step), got {k}")


def check_tree(w: int, m: int):
    if w < 1 or m < 1:
        raise ValueError(f"--spec-tree W,M needs W >= 1 (children per node) and M >= 1 (tokens verified), "
                         f"got {w},{m}")


def check_same_vocab(target_tok, draft_tok, target: M.Llama, draft: M.Llama):
    """A draft's token ids must mean what the target's mean."""
    sizes = (target.config.vocab_size, draft.config.vocab_size, target_tok.vocab_size, draft_tok.vocab_size)
    if sizes[0] != sizes[1] or sizes[2] != sizes[3]:
        raise ValueError(f"the draft's vocabulary ({sizes[1]} ids, tokenizer {sizes[3]}) differs from the "
                         f"target's ({sizes[0]} ids, tokenizer {sizes[2]}): a draft must use the same tokenizer")
    n = min(sizes[2], sizes[3])
    probe = list(range(0, n, max(1, n // 64)))
    if [target_tok.decode([i]) for i in probe] != [draft_tok.decode([i]) for i in probe]:
        raise ValueError("the draft's tokenizer maps ids to different text than the target's: "
                         "a draft must use the same tokenizer")


def narrow_draft(stored: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Run a bf16-stored draft in bf16 under an fp32 target on a CPU that computes
    bf16 (avx512_bf16/AMX): its weights hold nothing finer, and drafting is
    memory-bound, so half the bytes is half the time. The bundled EAGLE head
    drafting 3 tokens for fp32 SmolLM2: ~6 ms a step in fp32, ~4 ms in bf16, the
    same tokens per forward. Verification, and so the output, is the target's."""
    return stored == "bfloat16" and dtype == torch.float32 and device.type == "cpu" and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()


def load_draft(name: str, target: M.Llama, target_tok, device=None, dtype=None) -> M.Llama:
    """--draft MODEL: any model name model.load accepts, or `bundled` (train.py's draft).
    A model directory without tokenizer files (what train.py writes: its drafts use
    the target's tokenizer by construction) is checked against the target's."""
    if name == "bundled":
        if not (BUNDLED_DRAFT / "config.json").is_file():
            raise ValueError(f"no trained draft in {BUNDLED_DRAFT}: run `python train.py` "
                             f"(distils one from the bundled model, ~45 min on 2 CPU cores) or pass --draft MODEL")
        name = str(BUNDLED_DRAFT)
    path = Path(name)
    if path.is_dir() and not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        hf, dev = checkpoint.read_config(path), M.pick_device(device)
        if narrow_draft(hf.get("torch_dtype"), dev, M.pick_dtype(dtype, dev)):
            dtype = torch.bfloat16
        draft, tok = M.Llama.from_pretrained(path, dev, dtype, M.LlamaConfig.from_hf(hf)), target_tok
    else:
        draft, tok = M.load(name, device, dtype)
    check_same_vocab(target_tok, tok, target, draft)
    if draft.config.eagle:      # its width is checked by EagleDraft, the one way to use it
        draft.share_target(target)
    return M.prepack(draft)


# ----------------------------------------------------------------------------
# 3. The loop.

@dataclass
class SpecStats:
    steps: int = 0            # target forwards after the prefill
    proposed: int = 0         # guesses offered (the longest candidate per step)
    accepted: int = 0         # guesses accepted
    emitted: int = 0          # tokens emitted by those forwards
    propose_s: float = 0.0    # time spent in the proposer
    histogram: Counter = field(default_factory=Counter)   # accepted length -> steps
    trace: list = field(default_factory=list)   # per step: (emitted so far, n, k, target cache, draft cache)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def merge(self, other: "SpecStats"):
        for name in ("steps", "proposed", "accepted", "emitted", "propose_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.histogram.update(other.histogram)

    def summary(self) -> str:
        hist = " ".join(f"{n}:{c}" for n, c in sorted(self.histogram.items()))
        return (f"acceptance {100 * self.acceptance:.0f}% | {self.tokens_per_forward:.2f} tokens per target "
                f"forward | accepted lengths {hist}")


def _move_rows(cache: DynamicCache, src: list[int], dst: int):
    """Copy the K/V rows src (a list) to dst, dst+1, ... in every layer (stored form, quantized or not)."""
    idx = torch.tensor(src, device=cache.k[0].device)
    for store in (cache.k, cache.v):
        for t in store:
            t[:, :, dst:dst + len(src)] = t[:, :, idx]


@torch.inference_mode()
def generate(model: M.Llama, prompt: list[int], p: M.SamplingParams, proposer,
             stats: M.GenerationStats | None = None, spec: SpecStats | None = None, cache=None,
             history: list[int] | None = None) -> Iterator[int]:
    """Like model.generate_cached, but each step verifies the proposer's guesses.

    ``history`` is what ``cache`` already holds (a chat's earlier turns): the
    proposers look at the whole context. On exit the cache holds everything
    except the last yielded token, exactly as after generate_cached."""
    stats = stats if stats is not None else M.GenerationStats()
    spec = spec if spec is not None else SpecStats()
    cache = cache if cache is not None else model.new_cache()
    history = list(history or [])
    if len(history) != cache.length:
        raise ValueError(f"history has {len(history)} tokens but the cache holds {cache.length}")
    if proposer.needs_dynamic_cache and not isinstance(cache, DynamicCache):
        raise ValueError("lookahead decoding and draft trees need the dynamic cache (--cache dynamic): their "
                         "branches share positions, so their K/V rows are kept in input order")
    limit = M.context_limit(model, cache)
    M.check_context(model, cache.length + len(prompt), cache)
    dev, gen = model.embed_tokens.weight.device, M._generator(model, p)
    stats.prompt_tokens, t0 = len(prompt), time.perf_counter()
    pos = torch.arange(cache.length, cache.length + len(prompt), device=dev)
    feats = proposer.needs_features
    logits = model(torch.tensor([prompt], device=dev), pos, cache, last_only=True, hidden=feats)
    if feats:
        logits, hidden = logits
        proposer.observe(len(history), hidden[0])
    stats.positions_computed += len(prompt)
    context = history + prompt + [M.sample(logits[0, -1], p, gen)]
    t0 = M._clock(stats, 0, t0)
    yield context[-1]
    done = 1
    if context[-1] in model.config.eos_ids or done >= p.max_new_tokens or cache.length + 1 >= limit:
        return
    eos = set(model.config.eos_ids)
    while True:
        t = cache.length                                  # x_t = context[-1] sits at position t
        room = limit - 1 - (t + 1)                        # rows this forward may add beyond x_t
        k = max(0, min(proposer.k, p.max_new_tokens - done - 1, room))
        ts = time.perf_counter()
        prop = proposer.propose(context, k, room, p, gen) if k else Proposal()
        spec.propose_s += time.perf_counter() - ts
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
            if model.config.sliding_window is not None:    # keys are rows 0..t-1, then the new tokens
                keys = torch.cat([torch.arange(t), torch.tensor(offsets) + t])
                mask &= keys[None, :] > (torch.tensor(offsets) + t)[:, None] - model.config.sliding_window
            mask = mask.to(dev)
        pos = torch.tensor(offsets, device=dev) + t
        # Nothing proposed: x_t alone is plain decoding's step, called the same way
        # (last_only), so the runner's compiled one-token step serves it, not a recompile.
        logits = model(torch.tensor([ids], device=dev), pos, cache, last_only=len(ids) == 1, mask=mask, hidden=feats)
        if feats:
            logits, hidden = logits
        logits = logits[0]
        stats.positions_computed += len(ids)
        if p.temperature == 0:
            c, n, nxt = verify_greedy(logits[:b0].argmax(-1).tolist(), rows, cands)
        else:
            probs = M.sampling_probs(logits[:b0], p)
            target = [probs[path] for path in rows] or [probs[:1]]
            c, n, nxt = verify(target, cands, prop.draft_probs, gen)
        accepted = (cands[c][:n] if cands else []) + [nxt]
        kept = rows[c][:n + 1] if cands else [0]       # the pass's rows of x_t and the accepted guesses
        if kept != list(range(n + 1)):                    # bring their K/V right behind x_t
            _move_rows(cache, [t + r for r in kept[1:]], t + 1)
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
        draft_cache = getattr(proposer, "cache", None)
        spec.trace.append((done + len(accepted), n, k, cache.length, draft_cache and draft_cache.length))
        for i, token in enumerate(accepted):
            t0 = M._clock(stats, done, t0)
            yield token
            done += 1
            held = len(context) - len(accepted) + i       # plain decoding's cache length at this token
            if token in eos or done >= p.max_new_tokens or held + 1 >= limit:
                cache.crop(held)
                return


def make_proposer(target: M.Llama, tok, draft: str | None = None, k: int = 4, adaptive: bool = False,
                  lookahead: str | None = None, prompt_lookup: int | None = None, device=None, dtype=None,
                  compile: bool = False, tree: str | None = None):
    """The runner's flags -> a proposer (or None for plain decoding). One at a time.
    ``compile`` compiles a draft model's one-token step; ``tree`` "W,M" makes an
    EAGLE head draft a tree (EagleDraft.propose_tree)."""
    chosen = [name for name, v in (("--draft", draft), ("--lookahead", lookahead),
                                   ("--prompt-lookup", prompt_lookup)) if v is not None]
    if lookahead is not None and len(chosen) > 1:
        raise ValueError(f"choose one speculative method, not {' and '.join(chosen)} "
                         f"(only --draft and --prompt-lookup combine)")
    check_k(k)
    shape = parse_tree(tree) if tree is not None else None
    if draft is not None:
        model = load_draft(draft, target, tok, device, dtype)
        if shape is not None and not model.config.eagle:
            raise ValueError(f"--spec-tree needs an EAGLE head as the draft (train.py's `bundled`); {draft} is a "
                             f"standalone draft model")
        proposer = draft_proposer(model, target, k, adaptive, compile, shape)
        return proposer if prompt_lookup is None else LookupThenDraft(proposer, prompt_lookup)
    if shape is not None:
        raise ValueError("--spec-tree needs --draft with an EAGLE head (e.g. --draft bundled)")
    if lookahead is not None:
        return Lookahead(*parse_lookahead(lookahead))
    if prompt_lookup is not None:
        return PromptLookup(prompt_lookup, k)
    return None


def draft_proposer(draft: M.Llama, target: M.Llama, k: int = 4, adaptive: bool = False, compile: bool = False,
                   tree: tuple[int, int] | None = None):
    """The proposer for a loaded draft: an EAGLE head drafts from the target's features."""
    if draft.config.eagle:
        return EagleDraft(draft, target, k, adaptive, compile=compile, tree=tree)
    return DraftModel(draft, target, k, adaptive, compile=compile)


def parse_lookahead(text: str) -> tuple[int, int, int]:
    try:
        w, n, g = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--lookahead takes W,N,G (window, n-gram size, candidates), e.g. 5,3,5; got '{text}'")
    Lookahead(w, n, g)   # validates
    return w, n, g


def parse_tree(text: str) -> tuple[int, int]:
    try:
        w, m = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--spec-tree takes W,M (children per node, tokens verified), e.g. 4,10; got '{text}'")
    check_tree(w, m)
    return w, m


def plain_step_s(model: M.Llama, cache=None, context: int = 64, steps: int = 6) -> float:
    """The time of one plain decode step (median), the runner's baseline for the
    speedup. Pass the runner's own (empty) cache: with --compile a static cache's
    one-token step is the compiled one (12 ms for SmolLM2 bf16 against 32 eager),
    and the baseline must be what decoding without a proposer would cost."""
    dev = model.embed_tokens.weight.device
    cache = model.new_cache() if cache is None else cache
    times = []
    with torch.inference_mode():
        model(torch.zeros(1, context, dtype=torch.long, device=dev), torch.arange(context, device=dev), cache)
        for _ in range(steps):
            t0 = time.perf_counter()
            model(torch.zeros(1, 1, dtype=torch.long, device=dev), torch.tensor([cache.length], device=dev),
                  cache, last_only=True)
            times.append(time.perf_counter() - t0)
    cache.crop(0)
    return sorted(times)[len(times) // 2]


def stats_line(spec: SpecStats, stats: M.GenerationStats, plain_s: float) -> str:
    speed = (stats.new_tokens - 1) / stats.decode_s if stats.decode_s else 0.0
    return f"[speculative: {spec.summary()} | ~{speed * plain_s:.2f}x plain decoding ({1 / plain_s:.1f} tok/s)]"


# ----------------------------------------------------------------------------
# 4. Measuring: plain decoding against each method on the same prompts.

def compare(model: M.Llama, prompts: list[list[int]], methods: dict, new_tokens: int) -> list[dict]:
    """methods: name -> zero-argument factory of a proposer, or of None (plain
    decoding) or a cache (plain decoding on it: a static cache runs a compiled
    step). The first method is the baseline. Greedy, EOS ignored; returns one
    row per method with decode tok/s, speedup and the speculative stats.

    The methods take turns prompt by prompt, so a slow spell of this shared
    machine lands on all of them rather than on whichever ran then (one bf16
    run measured the draft at 1.29× where two others had 1.63× and 1.76×).

    Every method's tokens are checked against the baseline's: "diverged" lists,
    per prompt, the first new token that differs (None: identical). In fp32
    every method must match. In bf16 a verify pass of T tokens rounds
    differently from T one-token steps: its attention runs in SDPA's kernel, a
    one-token step's in two matmuls around an fp32 softmax (model.attend), and
    a few matrix products differ in the last bit. At a near-tie the argmax can
    flip, and the two texts part there."""
    params = M.SamplingParams(temperature=0, max_new_tokens=new_tokens)
    runs = {name: dict(spec=SpecStats(), decode_s=0.0, tokens=0, outs=[]) for name in methods}
    with M.ignore_eos(model):
        for ids in prompts:
            for name, factory in methods.items():
                r, stats, proposer = runs[name], M.GenerationStats(), factory()
                if proposer is None or isinstance(proposer, KVCache):
                    if proposer is not None:
                        proposer.crop(0)
                    run = M.generate_cached(model, ids, params, stats, proposer)
                else:
                    run = generate(model, ids, params, proposer, stats, r["spec"])
                r["outs"].append(list(run))
                r["decode_s"] += stats.decode_s
                r["tokens"] += stats.new_tokens - 1
    rows, reference = [], next(iter(runs.values()))
    for name, r in runs.items():
        diverged = [None if o == ref else common_prefix(o, ref) for o, ref in zip(r["outs"], reference["outs"])]
        rows.append({"method": name, "tok_s": r["tokens"] / r["decode_s"], "diverged": diverged,
                     "spec": r["spec"] if r["spec"].steps else None})
    for row in rows:
        row["speedup"] = row["tok_s"] / rows[0]["tok_s"]
    return rows


def same_tokens(diverged: list) -> str:
    """"yes", or how many prompts' texts parted from plain decoding's and at which new token."""
    parted = sorted(i for i in diverged if i is not None)
    return "yes" if not parted else f"{len(diverged) - len(parted)}/{len(diverged)}; others from token " + \
        ", ".join(map(str, parted))


def table(rows: list[dict]) -> str:
    lines = ["| method | decode tok/s | speedup | acceptance | tokens/forward | accepted lengths | same tokens |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        s = r["spec"]
        hist = " ".join(f"{n}:{c}" for n, c in sorted(s.histogram.items())) if s else ""
        lines.append(f"| {r['method']} | {r['tok_s']:.1f} | {r['speedup']:.2f}× | "
                     f"{f'{100 * s.acceptance:.0f}%' if s else ''} | {f'{s.tokens_per_forward:.2f}' if s else '1'} "
                     f"| {hist} | {same_tokens(r['diverged'])} |")
    return "\n".join(lines)


SUMMARISE = "Summarise this text in a few sentences, keeping the key numbers:\n\n"

if __name__ == "__main__":
    import argparse
    from kvcache import HANDBOOK
    ap = argparse.ArgumentParser(description="speculative decoding on the bundled model: plain vs each method")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    model, tok = M.load()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": SUMMARISE + HANDBOOK[:1500]}]),
                          add_bos=False)]
    methods = {"plain": lambda: None, "prompt lookup N=3, k=8": lambda: PromptLookup(3, 8),
               "lookahead 4,3,4": lambda: Lookahead(4, 3, 4)}
    if (BUNDLED_DRAFT / "config.json").is_file():
        draft = load_draft("bundled", model, tok)
        draft_proposer(draft, model, 3, compile=True).warm_up(model)
        methods["draft (bundled), k=3, compiled"] = lambda: draft_proposer(draft, model, 3, compile=True)
        methods["draft (bundled), tree of 10 (W=4, depth 3)"] = lambda: draft_proposer(draft, model, 3, tree=(4, 10))
        methods["draft (bundled), k=3 + lookup N=3"] = \
            lambda: LookupThenDraft(draft_proposer(draft, model, 3, compile=True), 3)
    print(f"summarise-this-text prompt ({len(prompts[0])} tokens), greedy, {args.new_tokens} new tokens, fp32\n")
    print(table(compare(model, prompts, methods, args.new_tokens)))
