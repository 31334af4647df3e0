"""
drafting.py — the proposers of speculative decoding (speculative.py's Proposer protocol).

Speculative decoding is exact whatever proposes the guesses; how fast it goes
depends on two numbers: the share of guesses the target accepts (α) and what a
guess costs next to a target step. Two proposers need no model at all:

* PromptLookup(N): find the latest earlier occurrence of the context's last
  n tokens (n = N..1) and propose what followed it. Free, and strong when the
  answer quotes its input (summaries, code edits, extraction).
* Lookahead(W, N, G) (Fu et al. 2024): no second model. The target itself runs
  Jacobi iterations on a window of W future positions; every column of the
  window's last N−1 trajectories is an n-gram the model "thought of", kept in a
  pool keyed by its first token. Up to G pool n-grams starting with the current
  token are verified — in the same forward pass as the next Jacobi iteration
  (speculative.py's module docstring has the mask that makes it one pass).

A proposer that is itself a language model trades α against cost:

* a standalone draft (DraftModel): a small model with the same tokenizer,
  run autoregressively from its own KV cache. It must rediscover from tokens
  alone what the target has worked out, so a small one agrees less often.
* an EAGLE head (EagleDraft; Li et al. 2024): one transformer block that reads
  the target's own final hidden states ("features") next to the tokens and
  predicts the next feature; the target's LM head turns it into a token. It
  starts from the target's understanding, so one block agrees about as often
  as a much larger standalone draft, and a guess costs ~9M multiply-adds
  against SmolLM2's ~135M per token. It can also draft a tree of guesses.
* Medusa heads (MedusaHeads, MedusaDraft; Cai et al. 2024): K small heads
  on the target's last feature, head k guessing the token k places further
  on, all at once from that one feature. No cache and no step per guess
  (~20M multiply-adds for 4 heads, most of them one 4-row product with the
  LM head's rows), but head k never sees the guesses before it, so it is right
  less often than a head that drafts token by token; a tree of each head's
  top few tokens buys that back in the verify pass.
* LookupThenDraft: free prompt lookup where the text repeats itself, the
  model elsewhere.

Cost model per speculative step with k guesses:

    time ≈ k · (draft step) + (target pass over k+1 positions)
    tokens ≈ (1 − α^(k+1)) / (1 − α)

so a draft pays when α is high and its step is a small fraction of the
target's. A draft whose one-token step was compiled (kernels.compile_decode, the
runner's --compile) drafts on a static cache, since a tiny model's eager step is
mostly per-op overhead. train.py trains the bundled
EAGLE head (`--draft bundled`) and Medusa heads (`--draft medusa`);
`python bench.py speculative` measures every proposer against plain decoding.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

import kvcache
import quantize
import safetensors_io
from kvcache import common_prefix
from model import GenerationStats, Llama, attend, generate_cached, load
from sampling import SamplingParams, sampling_probs
from speculative import Proposal, Proposer, SpecStats, check_k, check_tree, generate

ROOT = Path(__file__).resolve().parent
BUNDLED_DRAFT = ROOT / "drafts" / "smollm2-135m-draft"   # written by train.py
BUNDLED_MEDUSA = ROOT / "drafts" / "smollm2-135m-medusa"  # written by train.py --medusa 4
TRAIN = {"bundled": "python train.py` (distils an EAGLE head from the bundled model, "
                    "~45 min on 2 CPU cores)",
         "medusa": "python train.py --medusa 4` (~30 min on 2 CPU cores)"}


# ----------------------------------------------------------------------------
# Proposers without a model.

class PromptLookup(Proposer):
    """Propose the continuation of the latest earlier occurrence of the last n tokens."""

    def __init__(self, ngram: int = 3, k: int = 4, min_ngram: int = 1):
        if ngram < 1:
            raise ValueError(f"--prompt-lookup N needs N >= 1 (the n-gram length to match), "
                             f"got {ngram}")
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


class Lookahead(Proposer):
    """Jacobi iteration over W future positions; n-grams from its trajectories; verify up to G."""
    needs_dynamic_cache = True

    def __init__(self, window: int, ngram: int, guesses: int, seed: int = 0):
        if window < 1 or ngram < 2 or guesses < 1:
            raise ValueError(f"--lookahead W,N,G needs W >= 1 (window), N >= 2 (n-gram size) "
                             f"and G >= 1 (candidates verified per step), "
                             f"got {window},{ngram},{guesses}")
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
                        branch_offsets=[1 + r + i for r in range(R) for i in range(W)],
                        branch_mask=mask)

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




def parse_lookahead(text: str) -> tuple[int, int, int]:
    try:
        w, n, g = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--lookahead takes W,N,G (window, n-gram size, candidates), e.g. 5,3,5; "
                         f"got '{text}'")
    Lookahead(w, n, g)   # validates
    return w, n, g





# ----------------------------------------------------------------------------
# Proposers that are models.

class DraftModel(Proposer):
    """A small model with the same tokenizer drafts k tokens autoregressively.

    A drafted token must cost a small fraction of a target step. Run eagerly, a
    tiny draft's step is mostly per-op overhead, so a draft whose one-token step
    was compiled (kernels.compile_decode; ``static`` defaults to whether it was)
    runs it on a static cache, sized in powers of two (≥ 512) so the compiled step
    sees few shapes (attention reads the whole static cache, so it is not made
    larger than needed).
    Greedy drafting takes the argmax of the logits and hands verify no
    distributions."""

    def __init__(self, draft: Llama, target: Llama, k: int = 4, adaptive: bool = False,
                 k_max: int = 12, static: bool | None = None):
        check_k(k)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft's vocabulary has {draft.config.vocab_size} tokens and the "
                             f"target's {target.config.vocab_size}: a draft must use the target's "
                             f"tokenizer")
        self.model, self.k, self.adaptive, self.k_max = draft, k, adaptive, max(k, k_max)
        self.static = draft.compiled_step is not None if static is None else static
        self.cache = None if self.static else kvcache.new_cache(draft)
        self.ids: list[int] = []        # the tokens in self.cache

    def reserve(self, n: int):
        """A static cache that holds n tokens (a new, empty one if the current is too small)."""
        if self.cache is None or self.cache.limit < n:
            size = min(max(512, 1 << (n - 1).bit_length()), self.model.config.max_seq_len)
            # as in propose: the compiled step's guards tell the two apart
            with torch.inference_mode():
                self.cache = kvcache.new_cache(self.model, "static", max_len=size)
            self.ids = []

    def warm_up(self, target: Llama, sizes=(512, 1024, 2048)):
        """Compile the draft's step now for these static-cache sizes (a compile the first
        time, then from inductor's disk cache), so that no timed step waits for it."""
        for n in sizes:
            self.reserve(n)
            list(generate(target, [1, 2, 3], SamplingParams(max_new_tokens=4), self))

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        dev = self.model.device
        if self.static:
            self.reserve(len(context) + k)
        keep = min(common_prefix(self.ids, context), len(context) - 1)
        self.cache.crop(keep)
        feed, tokens, rows = context[keep:], [], []
        for _ in range(k):
            pos = torch.arange(self.cache.length, self.cache.length + len(feed), device=dev)
            logits = self.model(torch.tensor([feed], device=dev), pos, self.cache,
                                last_only=True)[0, -1]
            tokens.append(self.choose(logits, params, gen, rows))
            feed = tokens[-1:]
        self.ids = context + tokens[:-1]
        return Proposal([tokens], torch.stack(rows) if rows else None)

    @staticmethod
    def choose(logits: torch.Tensor, params, gen, rows: list) -> int:
        """The drafted token; sampling also keeps its distribution q in rows for verify."""
        if params.temperature == 0:     # a point mass: verify needs only the token
            return int(logits.argmax())
        rows.append(sampling_probs(logits, params))
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
    the prediction into a token (EagleHead and share_target):

        head input at position j:  fc([embed(x_j+1); f_j])   ->   f̂_j+1  ->  token x̂_j+2

    The verify forward hands the features of the positions it computed to
    observe(); only accepted ones are kept. Drafting step 1 then runs the head
    over every position whose true feature is new (the last accepted tokens, one
    forward), which yields d1; steps 2..k feed the head's own predicted feature
    with the token it just drafted. Its cache holds entries for true features
    only between steps: the entries built on predictions are dropped, as the
    target's rows for rejected guesses are.
    A drafted token costs fc, one block and a head over 8,192 tokens, ~9M
    multiply-adds against the target's ~135M (load_draft may run it in bf16
    under an fp32 target, see narrow_draft). Its cache and outputs are in its own dtype; the
    target's features are cast on the way in, and the features it predicts
    are kept in the target's dtype, so the compiled step sees one dtype.
    With ``tree=(W, M)`` it drafts a tree instead of a chain (propose_tree)."""
    needs_features = True

    def __init__(self, head: Llama, target: Llama, k: int = 4, adaptive: bool = False,
                 k_max: int = 12, tree: tuple[int, int] | None = None):
        if not head.config.eagle:
            raise ValueError("EagleDraft needs an EAGLE head (config.json \"eagle\": true); "
                             "use DraftModel")
        if head.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"the EAGLE head's width is {head.config.hidden_size} but the "
                             f"target's is {target.config.hidden_size}: it reads the target's "
                             f"features, so it was trained for another model")
        if tree is not None:
            check_tree(*tree)
        # a tree grows level by level with several tokens per head pass:
        # the eager step, a dynamic cache
        super().__init__(head, target, k, adaptive, k_max,
                         head.compiled_step is not None and tree is None)
        self.tree = tree
        # the target's rows too: tree tokens share positions
        self.needs_dynamic_cache = tree is not None
        self.features = torch.zeros(0, target.config.hidden_size, dtype=target.dtype,
                                    device=target.device)

    def observe(self, start: int, features: torch.Tensor):
        """The target's features (T, hidden) at positions start..start+T-1 of the context."""
        end, have = start + len(features), len(self.features)
        if have < end:
            self.features = torch.cat([self.features,
                                       self.features.new_zeros(max(end, 2 * have) - have,
                                                               self.features.shape[1])])
        self.features[start:end] = features

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        t = len(context) - 1      # x_t is the last token; the target has features for 0..t-1
        if self.static:
            self.reserve(len(context) + k)
        if len(self.features) < t:   # positions computed without features (a resumed chat): zeros
            self.observe(len(self.features),
                         self.features.new_zeros(t - len(self.features), self.features.shape[1]))
        # entry j reads token j+1: entries 0..keep-1 still hold true features of this context
        keep = max(0, min(common_prefix(self.ids, context) - 1, t - 1))
        self.cache.crop(keep)
        feed, feats, tokens, rows = context[keep + 1:t + 1], self.features[keep:t], [], []
        self.ids = context[:t + 1]            # the entries on predicted features are not kept
        if self.tree is not None:
            return self.propose_tree(feed, feats, t, k, room)
        for _ in range(k):
            logits, h = self.head_pass(
                feed, torch.arange(self.cache.length, self.cache.length + len(feed)), feats)
            tokens.append(self.choose(logits[0, -1], params, gen, rows))
            feed, feats = tokens[-1:], h[0, -1:].to(self.features.dtype)
        return Proposal([tokens], torch.stack(rows) if rows else None)

    def head_pass(self, tokens: list[int], positions: torch.Tensor, features: torch.Tensor,
                  mask=None):
        """The head over new entries (token, feature) -> (logits, predicted features);
        without a mask only the last position's logits."""
        dev = features.device
        return self.model(torch.tensor([tokens], device=dev), positions.to(dev), self.cache,
                          last_only=mask is None, mask=None if mask is None else mask.to(dev),
                          features=features[None], hidden=True)

    def propose_tree(self, feed: list[int], feats: torch.Tensor, t: int, k: int,
                     room: int) -> Proposal:
        """A tree of guesses, grown like EAGLE-2: level 1 is the head's top W
        tokens for x_t+1; each next level expands the W most likely nodes of the
        last (likely = the product of the head's probabilities along the path),
        W children each, all in one head pass whose mask lets a node see its own
        ancestors only. After k levels the M most likely nodes are verified (a
        node is never likelier than its parent, so they form a tree). The guesses
        are fixed functions of the head's scores, so verify treats them as point
        masses, several per depth: exact for sampling as for greedy."""
        W, budget = self.tree
        logits, h = self.head_pass(
            feed, torch.arange(self.cache.length, self.cache.length + len(feed)), feats)
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
            logits, h = self.head_pass([tokens[i] for i in expand],
                                       torch.full((len(expand),), t - 1 + depth),
                                       torch.stack([inputs[i] for i in expand]), mask)
            level = [n for j, i in enumerate(expand) for n in grow(logits[0, j], i, h[0, j])]
        return Proposal(best_paths(tokens, parents, scores, max(1, min(budget, room))))

    def sync(self, context: list[int]):
        self.cache.crop(max(0, len(self.ids) - 1))     # entries on predicted features go


def best_paths(tokens: list[int], parents: list[int], scores: list[float],
               budget: int) -> list[list[int]]:
    """A drafted tree's `budget` likeliest nodes (score: the log-probability of the
    path; parent -1 is x_t), as candidates from x_t to each leaf, likeliest first.
    A node is never likelier than its parent, so the chosen nodes form a tree."""
    def path(i):
        out = []
        while i >= 0:
            out.append(tokens[i])
            i = parents[i]
        return out[::-1]
    chosen = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    leaves = set(chosen) - {parents[i] for i in chosen}
    return [path(leaf) for leaf in sorted(leaves, key=lambda i: (-scores[i], i))]


class MedusaHeads(nn.Module):
    """Medusa (Cai et al. 2024): K heads on the target's last feature, no draft model.

    The target's feature f_j (its final normalised hidden state at position j,
    what its LM head reads to predict x_j+1) already holds much of what comes
    after. Head k reads f_j alone and predicts x_j+1+k, the token k places
    further on:

        head k:  logits = E_ids · (SiLU(W_k f_j + b_k) + f_j)

    a residual block (W_k starts at zero: head k starts as the target's own
    next-token head) and the target's LM head over its likeliest tokens E_ids
    (head_ids, as the EAGLE head's). Unlike an EAGLE head it never sees the
    tokens it guessed before: all K guesses come from one feature at once, so
    they are cheaper (K blocks of 576², ~0.3M multiply-adds each, then one
    K-row product with the 8,192 LM head rows, 4 × 8,192 × 576 ≈ 19M for
    K = 4, which reads 8,192 × 576 × 4 B ≈ 19 MB of fp32 rows once against the
    target's 135M × 4 B ≈ 540 MB per step; no cache, no step per token) and
    less often right further out. train.py --medusa K trains them."""

    def __init__(self, hidden_size: int, n_heads: int, head_ids: torch.Tensor):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(n_heads))
        self.register_buffer("head_ids", head_ids.clone())
        # the target's LM head rows for head_ids (share_target)
        self.rows: torch.Tensor | None = None

    def share_target(self, target: Llama) -> "MedusaHeads":
        w = quantize.float_weight(target.lm_head)
        self.rows = w[self.head_ids.to(w.device)].to(self.blocks[0].weight.dtype)
        return self

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """Features (..., hidden) -> logits (..., K, len(head_ids)): head k's row k-1."""
        x = torch.stack([torch.nn.functional.silu(b(f)) + f for b in self.blocks], dim=-2)
        return x @ self.rows.T

    def hf_config(self) -> dict:
        return {"medusa_heads": len(self.blocks), "hidden_size": self.blocks[0].in_features,
                "draft_vocab_size": len(self.head_ids), "torch_dtype": "bfloat16"}

    @classmethod
    def from_dir(cls, path: Path, dtype: torch.dtype, device) -> "MedusaHeads":
        c = safetensors_io.read_config(path)
        state = {k.removeprefix("model."): v for k, v in safetensors_io.read_weights(path).items()}
        heads = cls(c["hidden_size"], c["medusa_heads"], state["head_ids"])
        heads.load_state_dict(state)
        return heads.to(device=device, dtype=dtype)


class MedusaDraft(Proposer):
    """The proposer for MedusaHeads: from the feature of the last token the target
    computed (position t-1; x_t, the token it chose there, is already emitted),
    head k guesses x_t+k. A chain takes each head's top token; with ``tree=(W, M)``
    level d holds head d's top W tokens under each of the W likeliest nodes of
    level d-1, and the M likeliest nodes are verified (best_paths; a path's
    likelihood is the product of the heads' probabilities, as if independent).
    The guesses are fixed functions of the heads' scores: point masses for verify,
    exact for sampling as for greedy. Costs one call of the heads per step."""
    needs_features = True

    def __init__(self, heads: MedusaHeads, target: Llama, k: int | None = None,
                 tree: tuple[int, int] | None = None):
        if heads.blocks[0].in_features != target.config.hidden_size or heads.rows is None:
            raise ValueError(f"the Medusa heads' width is {heads.blocks[0].in_features} but the "
                             f"target's is {target.config.hidden_size}: they read the target's "
                             f"features, so they were trained for another model")
        if tree is not None:
            check_tree(*tree)
        self.heads, self.tree = heads, tree
        self.k = min(k or len(heads.blocks), len(heads.blocks))
        check_k(self.k)
        # tree tokens share positions in the target's cache
        self.needs_dynamic_cache = tree is not None
        self.feature, self.position, self.cache = None, -1, None

    def observe(self, start: int, features: torch.Tensor):
        self.feature, self.position = features[-1], start + len(features) - 1

    def propose(self, context: list[int], k: int, room: int, params, gen) -> Proposal:
        # no feature of x_t's predecessor: plain step
        if self.position != len(context) - 2 or k < 1:
            return Proposal()
        logp = torch.log_softmax(self.heads(self.feature.to(self.heads.rows.dtype)).float(), -1)[:k]
        if self.tree is None:
            return Proposal([self.heads.head_ids[logp.argmax(-1)].tolist()])
        W, budget = self.tree
        top = logp.topk(W)
        values, ids = top.values.tolist(), self.heads.head_ids[top.indices].tolist()
        tokens, parents, scores, level = [], [], [], [-1]
        for d in range(k):
            parent_level, level = level, []
            for parent in sorted(parent_level, key=lambda i: -scores[i] if i >= 0 else 0)[:W]:
                for lp, token in zip(values[d], ids[d]):
                    level.append(len(tokens))
                    tokens.append(token)
                    parents.append(parent)
                    scores.append((scores[parent] if parent >= 0 else 0.0) + lp)
        return Proposal(best_paths(tokens, parents, scores, max(1, min(budget, room))))

    def update(self, context, n, k, branch_logits):
        pass

    def sync(self, context):        # LookupThenDraft's calls: no cache, nothing adapts
        pass

    def adapt(self, n, k):
        pass


class LookupThenDraft(Proposer):
    """Prompt lookup where the text repeats itself, the draft model elsewhere.

    The two are strong in different places. Chat answers repeat their own
    phrases, lists and the prompt's words; there an exact match of the last N
    tokens proposes a long continuation for free, often wholly accepted. Where
    nothing repeats, the draft model guesses. Measured on bench.py's chat
    prompts (RESULTS.md, speculative section): the hybrid beats either alone, because the lookup's
    steps are long (up to 2k tokens here) and the draft fills the rest. Either
    way each guess is verified by the same rule, so output stays exact."""

    def __init__(self, draft: DraftModel, ngram: int = 3):
        # an exact match of all N tokens only (a 1-token match is a weak guess: the
        # draft does better there), and twice the draft's k: a lookup's guesses cost nothing
        self.lookup, self.draft = PromptLookup(ngram, 2 * draft.k, min_ngram=ngram), draft
        self.needs_features, self.needs_dynamic_cache = (draft.needs_features,
                                                         draft.needs_dynamic_cache)
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
        return prop if self.looked_up else self.draft.propose(context, min(k, self.draft.k), room,
                                                              params, gen)

    def update(self, context, n, k, branch_logits):
        self.draft.sync(context)
        if not self.looked_up:        # adaptive k follows the draft's own guesses only
            self.draft.adapt(n, k)


# ----------------------------------------------------------------------------
# Loading a draft.

def check_same_vocab(target_tok, draft_tok, target: Llama, draft: Llama):
    """A draft's token ids must mean what the target's mean."""
    sizes = (target.config.vocab_size, draft.config.vocab_size,
             target_tok.vocab_size, draft_tok.vocab_size)
    if sizes[0] != sizes[1] or sizes[2] != sizes[3]:
        raise ValueError(f"the draft's vocabulary ({sizes[1]} ids, tokenizer {sizes[3]}) differs "
                         f"from the target's ({sizes[0]} ids, tokenizer {sizes[2]}): a draft must "
                         f"use the same tokenizer")
    n = min(sizes[2], sizes[3])
    probe = list(range(0, n, max(1, n // 64)))
    if [target_tok.decode([i]) for i in probe] != [draft_tok.decode([i]) for i in probe]:
        raise ValueError("the draft's tokenizer maps ids to different text than the target's: "
                         "a draft must use the same tokenizer")


class EagleHead(Llama):
    """An EAGLE draft head (Li et al. 2024; EagleDraft below) is a Llama of one block whose input
    at position j is fc([embed(x_j+1); f_j]): the next token together with the *target's* feature
    at j (its final normalised hidden state, what the target's LM head reads). Its own output
    there, norm(x), predicts the target's feature at j+1, and the target's LM head turns that into
    a token. It owns no embedding or head: share_target lends it the target's."""
    borrowed = ("embed_tokens.weight", "lm_head.weight")

    def __init__(self, cfg, attend=attend):
        super().__init__(cfg, attend)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, tokens, positions, cache=None, last_only=False, mask=None, features=None,
                hidden=False):
        if features is None or features.shape[:2] != tokens.shape:
            raise ValueError(f"an EAGLE head needs the target's features for each of its "
                             f"{tuple(tokens.shape)} tokens, got "
                             f"{None if features is None else tuple(features.shape)}")
        return super().forward(tokens, positions, cache, last_only, mask, features, hidden)

    def embed(self, tokens, features=None):
        dtype = self.norm.weight.dtype      # the head's own; its embedding is the target's
        x = self.embed_tokens(tokens).to(dtype)
        return self.fc(torch.cat([x, features.to(dtype)], dim=-1))


def share_target(head: Llama, target: Llama) -> Llama:
    """An EAGLE head reads tokens with the target's embedding and scores with its LM head (head_ids
    rows, copied once in the head's dtype: a bf16 head under an fp32 target), so its features mean
    the target's; an fp32 table's 49,152 × 576 × 4 B ≈ 113 MB saved."""
    head.embed_tokens = target.embed_tokens
    w = quantize.float_weight(target.lm_head)
    w = w if head.head_ids is None else w[head.head_ids]
    head.lm_head.weight = nn.Parameter(w.to(head.norm.weight.dtype), requires_grad=False)
    return head


def draft_proposer(draft: Llama | MedusaHeads, target: Llama, k: int = 4, adaptive: bool = False,
                   tree: tuple[int, int] | None = None):
    """The proposer for a loaded draft: an EAGLE head or Medusa heads draft from the
    target's features (Medusa: up to one token per head, eager, k fixed). A draft whose
    step was compiled (kernels.compile_decode) drafts on a static cache."""
    if isinstance(draft, MedusaHeads):
        return MedusaDraft(draft, target, k, tree)
    if draft.config.eagle:
        return EagleDraft(draft, target, k, adaptive, tree=tree)
    return DraftModel(draft, target, k, adaptive)


SUMMARISE = "Summarise this text in a few sentences, keeping the key numbers:\n\n"


# ----------------------------------------------------------------------------
# Demo: prompt lookup on a summary, where the answer quotes its input
# (`python bench.py speculative` compares every proposer on chat prompts).

if __name__ == "__main__":
    import argparse
    import results
    ap = argparse.ArgumentParser(description="prompt lookup on a summary, against plain decoding")
    ap.add_argument("--save", action="store_true", help="write results/speculative-demo.json")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    model, tok = load()
    text = (ROOT / "data" / "handbook.txt").read_text().strip()[:1500]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": SUMMARISE + text}]),
                        add_bos=False)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    methods = {"plain": None, "prompt lookup N=3, k=8": PromptLookup(3, 8)}
    outs, specs, speeds = {}, {}, {name: [] for name in methods}
    # Round 0 warms up and counts; then the two sides take turns, so a burst of load on a busy
    # machine slows both alike, and the speedup is taken within each round.
    for r in range(1 + args.rounds):
        for name, proposer in methods.items():
            stats, spec = GenerationStats(), SpecStats()
            out = list(generate_cached(model, prompt, params, stats) if proposer is None else
                       generate(model, prompt, params, proposer, stats, spec))
            outs[name], specs[name] = out, spec
            if r:
                speeds[name].append((stats.new_tokens - 1) / stats.decode_s)
    rows = []
    for name in methods:
        ratios = [a / b for a, b in zip(speeds[name], speeds["plain"])]
        rows.append([name, f"{specs[name].tokens_per_forward:.2f}" if specs[name].steps else "1",
                     "yes" if outs[name] == outs["plain"] else "no",
                     results.spread(speeds[name]), results.spread(ratios, digits=2, unit="×")])
    table = results.Table(f"a {len(prompt)}-token summarise-this-text prompt, greedy, "
                          f"{params.max_new_tokens} new tokens, EOS ignored; times: median "
                          f"(min–max) of {args.rounds} rounds in turns, after a warm-up",
                          ["method", "tokens/forward", "same tokens", "decode tok/s",
                           "speedup"], rows)
    print(table.markdown())
    print("tokens/forward and the tokens are the same on every machine and every run; the times "
          "move with\nthe machine's load (python bench.py speculative: every proposer, 8 prompts)")
    if args.save:                 # the tracked results change only when asked
        print(f"saved {results.save('speculative-demo', 'speculative', [table])}")
