"""
engine.py — continuous batching: many requests decoding together in one paged KV pool.

One decode step reads every weight once whatever the batch size, so a step of
16 sequences costs little more than a step of one: the weights (135M · 4 B ≈
540 MB for SmolLM2-135M in fp32) are read once for all rows, and each row adds
only its own activations and KV reads (`python bench.py engine-step` times a
step of 1 to 32 rows; `python bench.py batching` the tokens per second that
buys). Serving many requests therefore means decoding them together. The
question is which.

Static batching takes B requests, runs them until the longest is done, then
takes the next B. Chat answers vary in length (3 tokens or 300), so most rows
of a static batch finish early and then idle, yet the batch pays for the
longest; a request that arrives meanwhile waits for the whole batch.

Continuous batching (Orca's "iteration-level scheduling") decides every step:

    each step:
        admit waiting requests while the pool has blocks and the batch has room
            (prefill: compute the prompt's K/V, a chunk a step; the last samples the first token);
        one batched decode step for every running sequence, whatever its length;
        retire the finished ones and free their blocks at once.

A finished row is refilled at the next step, so the batch stays full and no
row waits for another. That needs a KV cache whose sequences come and go and
grow independently: paged.py's blocks. Rows of different lengths decode in one
forward pass: tokens (B, 1) at positions (B, 1), each row reading its keys
through its own block table, padded to the longest and masked
(kvcache.PagedKVCache), or read where they lie where the device has a reader.

The parts, bottom up:

* ``MinimalEngine`` — the loop above and nothing more: admit (one prefill pass
  each), decode every running request in one batched pass, retire. Read it
  first; the rest of the file is this loop plus the decisions below.
* ``Scheduler`` — pure bookkeeping on a ``paged.BlockAllocator``, no tensors:
  the waiting queue and the running batch, admission (first come first served,
  while blocks last, keeping a small watermark of free blocks so the running
  sequences can grow), block reservation for the decode step, preemption,
  cancellation, finishing. Unit-testable without a model.
* ``Engine`` — the tensors: the ``PagedKVCache`` pool, the forward passes,
  per-request sampling. ``add_request`` / ``step`` / ``cancel`` / ``stream``.
  What comes out is plain data: ``step()`` returns ``Event``s (a branch's token,
  whether it is shown, its log-probabilities, its finish reason) and ``stats()``
  a ``Stats``, so a consumer (server.py) never reads a sequence or the scheduler.
* ``LLM`` — the offline API: ``LLM("smollm2-135m").generate(prompts, params)``
  returns one ``Output`` per prompt, in input order, with a progress bar.

Decisions, and what they cost:

* Chunked prefill. Prefill runs one sequence per forward pass (B = 1, T = its
  uncached tokens), reading any cached prefix through its table; the running
  sequences then decode in a second pass (one pass would need ragged attention:
  rows of T = 256 beside rows of T = 1). A long prompt prefilled whole would
  stall them one long step, as long as many decode steps
  (`python bench.py batching --long-prompts-only` measures the stall), so a
  step computes at most ``chunk_tokens`` prompt tokens (model.PREFILL_CHUNK; None:
  whole prompts): a longer prompt's steps each pay one chunk, and it holds a
  batch slot but no decode row until its last chunk samples its first token.
  Its table holds only the tokens
  computed so far plus this step's chunk: the allocator enters a full block in
  the prefix cache when a table gets it, so a later request never hits a block
  not yet computed, and a sequence preempted or cancelled part-way leaves only
  computed blocks cached.
* Prefix caching: a request whose leading blocks are cached (an earlier
  request with the same system prompt, the previous turn of a chat) computes
  only the rest. ``session`` keeps a finished request's table alive, so the
  next turn of the conversation appends to it and computes exactly its new
  tokens, not the partial last block again.
* Out of blocks: the newest running sequence is preempted — its blocks are
  freed and it goes back to the front of the queue with the tokens it has;
  when readmitted it recomputes them in one prefill (most often from the
  prefix cache, which keeps its full blocks until they are evicted) and goes
  on. It samples nothing twice, so its output does not change. The cost is
  the recompute: its tokens beyond the cached blocks, once.
* n > 1 samples fork the prompt's table after one prefill (copy-on-write): branch
  i samples with seed + i, as an independent run with that seed would.
* One request never harms another. What a step does for one request alone (fork its
  branches, sample its token, apply the stop rule) is guarded: if it raises, that request
  ends with Finish.ERROR and its blocks return, and the step goes on for the others.
  Only the forward pass, which every row shares, resets the pool when it fails.
* Exactness. A row's arithmetic is not bit-identical across batch sizes and
  key paddings (other matmul blockings, other reduction lengths): the logits
  differ from the contiguous cache's in their last bits. Greedy tokens change
  only on a near-tie; the tests compare tokens and find none.
* Everything runs eagerly. Compiled steps per bucketed batch size (vLLM's CUDA graphs) lose on
  a CPU: inductor turns each layer's in-place write into the pool into a copy of that layer's
  whole pool, and its fused one-row product reads the weights once per row (bench.py engine-step).

`python engine.py --trace` shows the blocks each step takes, shares, copies and
frees; `python bench.py engine` chat requests joining and leaving the batch on
the bundled model; `python bench.py batching` measures continuous against static
batching, prefix caching and chunked prefill (RESULTS.md); server.py serves it.
"""

from __future__ import annotations

import argparse
import enum
import itertools
import math
import operator
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from kvcache import PagedKVCache, kv_bytes_per_token
from model import PREFILL_CHUNK, Llama, LlamaConfig, count_parameters, load
from paged import BLOCK_SIZE, BlockAllocator, BlockTable
from sampling import (SEEDS, Finish, SamplingParams, constraint, finish_reason, grammar_text,
                      grammar_vocab, sample, seeded_generator, visible)


# ----------------------------------------------------------------------------
# The smallest engine: admit, decode all, retire. Scheduler and Engine below are this loop plus
# chunked prefill, prefix caching, sessions, n > 1 forks, preemption and a watermark.

@dataclass(eq=False)
class SimpleRequest:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    table: BlockTable | None = None       # while running: the prompt and all output but the last

    @property
    def budget(self) -> int:              # the most tokens its table can come to hold
        return len(self.prompt) + self.params.max_new_tokens


class MinimalEngine:
    """Continuous batching and nothing else, on the paged pool. Each step admits waiting requests
    (first come first served; one prefill pass each, which samples its first token), decodes every
    running request by one token in one batched pass, and retires the finished ones, whose blocks
    the next admission takes. A request is admitted only when the pool holds its whole budget
    (prompt + max_new_tokens) beside what the running ones may still take: no preemption needed."""

    def __init__(self, model: Llama, num_blocks: int, max_batch: int = 32,
                 block_size: int = BLOCK_SIZE):
        c = model.config
        self.model, self.max_batch, self.ids = model, max_batch, itertools.count(1)
        self.alloc = BlockAllocator(num_blocks, block_size, prefix_caching=False)
        self.cache = PagedKVCache(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim,
                                  model.dtype, model.device, c.sliding_window)
        self.waiting: deque[SimpleRequest] = deque()
        self.running: list[SimpleRequest] = []          # admission order

    def add(self, prompt: list[int], params: SamplingParams) -> SimpleRequest:
        req = SimpleRequest(next(self.ids), list(prompt), params,
                            seeded_generator(params.seed, self.model.device))
        if not prompt or self.alloc.blocks_for(req.budget) > self.alloc.num_blocks:
            raise ValueError(f"prompt (not empty) + max_new_tokens must fit the pool's "
                             f"{self.alloc.num_blocks * self.alloc.block_size} tokens: "
                             f"shorten them or give the engine more blocks")
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fits(self, req: SimpleRequest) -> bool:
        owed = sum(self.alloc.blocks_for(r.budget) - len(r.table.block_ids) for r in self.running)
        return self.alloc.blocks_for(req.budget) <= self.alloc.num_free - owed

    @torch.inference_mode()
    def step(self) -> list[tuple[int, int]]:
        """One step; returns the (request id, token) pairs it sampled, in order."""
        out, dev = [], self.model.device
        while self.waiting and len(self.running) < self.max_batch and self.fits(self.waiting[0]):
            req = self.waiting.popleft()                                            # admit
            req.table, _ = self.alloc.allocate_sequence(req.prompt, req.id)
            self.running.append(req)
            ids = torch.tensor([req.prompt], device=dev)
            pos = torch.arange(len(req.prompt), device=dev)[None]
            logits = self.model(ids, pos, self.cache.bind([req.table]), last_only=True)[0, -1]
            out.append(self.emit(req, logits))
        batch = list(self.running)
        if batch:                                                                   # decode all
            for r in batch:          # a slot for the token it feeds, whose K/V this pass writes
                self.alloc.append_slot(r.table, r.output[-1])
            ids = torch.tensor([[r.output[-1]] for r in batch], device=dev)
            pos = torch.tensor([[r.table.num_tokens - 1] for r in batch], device=dev)
            logits = self.model(ids, pos, self.cache.bind([r.table for r in batch]))
            out += [self.emit(r, row) for r, row in zip(batch, logits[:, -1])]
        return out

    def emit(self, req: SimpleRequest, logits: torch.Tensor) -> tuple[int, int]:
        token, c = sample(logits, req.params, req.generator), self.model.config
        req.output.append(token)
        if finish_reason(token, len(req.output), len(req.prompt) + len(req.output), req.params,
                         c.eos_ids, c.max_seq_len):
            self.running.remove(req)                                                # retire
            self.alloc.free(req.table)
        return req.id, token


class Status(enum.Enum):
    """Where a sequence is: queued (holding no blocks), in the batch, or done."""
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Trace(str, enum.Enum):
    """The kinds of event a trace logs (``BlockAllocator(events=[...])``, ``trace()``). The
    allocator's are named by these values in paged.py (below this file, it cannot import
    them), so the enum is a str: ``Trace(kind)`` reads a logged one back."""
    ALLOCATE = "allocate"     # (seq, tokens, blocks hit in the prefix cache); its new blocks follow
    ALLOC = "alloc"           # (seq, block): a table takes a new block
    COW = "cow"               # (seq, src, dst): a shared last block copied on write
    FORK = "fork"             # (seq, twin): the twin shares every block of seq
    FREE = "free"             # (seq, {"free" | "cached" | "kept": blocks})
    DECODE = "decode"         # the scheduler's: what follows is this step's decode


# ----------------------------------------------------------------------------
# Requests and sequences. A request has n sequences (branches); a sequence is
# what the scheduler moves between the queues and what a block table holds.

@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    n: int = 1
    session: object = None          # a key: keep the finished table for the next turn (n = 1)
    sequences: list["Sequence"] = field(default_factory=list)
    arrival: float = 0.0            # perf_counter() times
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: int = 0          # prompt tokens found in the cache at the first admission
    prefill_tokens: int = 0         # prompt tokens computed at the first admission

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.sequences)

    @property
    def finish_reasons(self) -> list[Finish | None]:
        """Each branch's finish reason, in branch order (None while it runs)."""
        return [s.finish_reason for s in sorted(self.sequences, key=lambda s: s.branch)]


@dataclass(eq=False)
class Sequence:
    id: int
    request: Request
    branch: int = 0
    output: list[int] = field(default_factory=list)
    table: BlockTable | None = None   # while running: holds prompt + output except the last token
    status: Status = Status.WAITING
    finish_reason: Finish | None = None
    forks: int = 0                    # branches to fork from this one right after its first prefill
    n_cached: int = 0                 # tokens of the table already computed when admitted
    # while prefilling: tokens of the table computed before this step's chunk
    n_computed: int = 0
    # its prompt is not all computed after this step's chunk: no decode row yet
    prefilling: bool = False
    preempted: bool = False           # preempted at least once: admitting it again recomputes
    generator: object = None          # the engine's sampling state (a torch.Generator or None)
    grammar: object = None            # its schema's or grammar's state (sampling.Constraint)
    # per output token, with params.logprobs: (top values, ids, chosen's)
    logprobs: list = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.output


@dataclass(frozen=True)
class Event:
    """One new token of one branch: ``step()`` returns one per sequence that sampled.
    Everything a consumer (server.py, a benchmark) needs, so it never reads a sequence."""
    request_id: int
    branch: int
    token: int
    visible: bool                     # False for a stop token (EOS): not shown, not counted
    finish_reason: Finish | None = None  # set on the branch's last token
    logprob: float | None = None      # with params.logprobs: the token's log-probability,
    top: list[tuple[int, float]] | None = None   # and (id, log-probability) of the likeliest
    error: str | None = None          # with Finish.ERROR: what failed (token is then -1)

    @property
    def finished(self) -> bool:       # this branch is done
        return self.finish_reason is not None


# ----------------------------------------------------------------------------
# The scheduler: who runs this step. No tensors; the engine does the compute.

class Scheduler:
    """Waiting queue, running batch and the block allocator behind them.

    Invariant: a running sequence's table holds its prompt and every output token
    but the last, whose K/V the next decode step computes; while it is prefilling,
    the tokens computed so far. A waiting sequence holds no blocks; admitting it
    computes all its tokens (the prompt, plus its output so far if it was
    preempted), chunk by chunk, and samples its next token."""

    def __init__(self, allocator: BlockAllocator, max_batch: int, watermark: float = 0.01):
        self.alloc, self.max_batch = allocator, max_batch
        # free blocks admission leaves
        self.watermark = max(1, round(watermark * allocator.num_blocks))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []           # admission order: the last is the newest
        self.parked: OrderedDict[object, BlockTable] = OrderedDict()   # session → finished table
        self.copies: list[tuple[int, int]] = []     # copy-on-write block copies the storage owes
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def admit(self, budget: int | None = None) -> Iterator[Sequence]:
        """This step's prefill work, at most ``budget`` tokens (None: whole prompts): the
        sequence part-way through its prompt first, then waiting ones first come first
        served, while the pool has blocks and the batch has room. A yielded sequence's
        table ends with this step's chunk, after ``seq.n_computed`` computed tokens;
        ``seq.prefilling``: more chunks follow. The caller must compute each chunk before
        taking the next: its full blocks are in the prefix cache, the next may hit them."""
        budget = budget or math.inf
        for seq in [s for s in self.running if s.prefilling]:   # at most one: the newest
            if n := self._extend(seq, budget):
                budget -= n
                yield seq
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            width = 1 + seq.forks
            table = (self._reserve(seq, width, budget)
                     if len(self.running) + width <= self.max_batch else None)
            if table is None:
                return
            self.waiting.popleft()
            seq.table, seq.status, seq.n_computed = table, Status.RUNNING, seq.n_cached
            seq.prefilling, budget = (table.num_tokens < len(seq.tokens),
                                      budget - table.num_tokens + seq.n_cached)
            self.running.append(seq)
            yield seq

    def _extend(self, seq: Sequence, budget: float) -> int:
        """Append to a prefilling sequence's table the next chunk that ``budget`` and the free
        blocks allow (idle parked conversations go first); returns its length. 0: it waits
        for decoders to finish, or, if they run out of blocks first, to preempt it, the
        newest."""
        table, bs, seq.n_computed = seq.table, self.alloc.block_size, seq.table.num_tokens
        want = min(budget, len(seq.tokens) - table.num_tokens)
        room = lambda: -table.num_tokens % bs + bs * (self.alloc.num_free
                                                      - self.watermark * (len(self.running) > 1))
        while room() < want and self.parked:
            self.alloc.free(self.parked.popitem(last=False)[1])
        n = max(0, min(want, room()))
        for t in seq.tokens[table.num_tokens:table.num_tokens + n]:
            self.alloc.append_slot(table, t)     # its last block is its own: never a copy
        seq.prefilling = table.num_tokens < len(seq.tokens)
        return n

    def _reserve(self, seq: Sequence, width: int, budget: float) -> BlockTable | None:
        """A table for ``seq``'s tokens up to ``budget`` past those computed (cached or parked),
        or None if the pool cannot take all of them now. With others running, leave room for
        its first decode step (a block per branch: a fork copies the last block) and the
        watermark."""
        tokens, session = seq.tokens, seq.request.session
        parked = self.parked.pop(session, None) if session is not None else None
        if parked is not None and len(parked.token_ids) < len(tokens) \
                and tokens[:len(parked.token_ids)] == parked.token_ids:
            need = self.alloc.blocks_for(len(tokens)) - len(parked.block_ids)
            while not self._fits(need, self.alloc.num_free, width) and self.parked:
                # other idle conversations go first
                self.alloc.free(self.parked.popitem(last=False)[1])
            if not self._fits(need, self.alloc.num_free, width):
                self.parked[session] = parked     # keep it; maybe next step
                return None
            seq.n_cached = parked.num_tokens
            for t in tokens[parked.num_tokens:min(len(tokens), parked.num_tokens + budget)]:
                if copy := self.alloc.append_slot(parked, t)[1]:
                    self.copies.append(copy)
            return parked
        if parked is not None:
            # the conversation changed: start over from the prefix cache
            self.alloc.free(parked)
        while True:
            need, available = self.alloc.admission_cost(tokens)
            if self._fits(need, available, width):
                # The table gets this step's chunk only: blocks enter the prefix cache when
                # computed.
                hit = (self.alloc.blocks_for(len(tokens)) - need) * self.alloc.block_size
                table, seq.n_cached = self.alloc.allocate_sequence(
                    tokens[:min(len(tokens), hit + budget)], seq.id)
                return table
            if not self.parked:
                return None
            self.alloc.free(self.parked.popitem(last=False)[1])   # idle conversations go first

    def _fits(self, need: int, available: int, width: int) -> bool:
        if not self.running:
            # alone it always fits: the engine's max_len keeps a sequence within the pool
            return need <= available
        return need + width + self.watermark <= available

    def schedule_decode(self) -> list[Sequence]:
        """Give every running sequence the slot for the token it feeds next, oldest
        first. When no block is left: drop a parked conversation, else preempt the
        newest sequence. Returns the batch; block copies owed are in ``copies``."""
        self.alloc.note(Trace.DECODE)   # for a trace: the events that follow are this step's decode
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.prefilling:        # no token to feed until its prompt is computed
                i += 1
                continue
            if self.alloc.needs_block(seq.table) and self.alloc.num_free == 0:
                if self.parked:
                    self.alloc.free(self.parked.popitem(last=False)[1])
                else:
                    self.preempt(self.running[-1])
                continue
            if copy := self.alloc.append_slot(seq.table, seq.output[-1])[1]:
                self.copies.append(copy)
            i += 1
        return [s for s in self.running if not s.prefilling]

    def preempt(self, seq: Sequence):
        """Free the sequence's blocks; it waits at the front of the queue and will
        recompute its tokens (prefix cache permitting, only some of them)."""
        self.running.remove(seq)
        self.alloc.free(seq.table)
        seq.table, seq.status, seq.preempted = None, Status.WAITING, True
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def fork(self, seq: Sequence, new_id: int, branch: int, generator=None,
             grammar=None) -> Sequence:
        """A branch sharing ``seq``'s blocks (copy-on-write), running right after it, sampling
        with ``generator`` (and ``grammar``, its own copy of the grammar's state)."""
        table = self.alloc.fork(seq.table, new_id)
        twin = Sequence(new_id, seq.request, branch, list(seq.output), table, Status.RUNNING,
                        n_cached=seq.n_cached, generator=generator, grammar=grammar)
        self.running.insert(self.running.index(seq) + 1, twin)
        seq.request.sequences.append(twin)
        return twin

    def finish(self, seq: Sequence, reason: Finish):
        """Retire a sequence: its blocks go back at once (full ones stay in the prefix
        cache until evicted), or are parked for the session's next turn."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            session = seq.request.session
            kept = reason not in (Finish.CANCELLED, Finish.ERROR)
            if session is not None and kept and seq.request.n == 1:
                self.end_session(session)     # an older table of this conversation, if any
                self.parked[session] = seq.table
            else:
                self.alloc.free(seq.table)
        seq.table, seq.status, seq.finish_reason = None, Status.FINISHED, reason

    def end_session(self, session) -> bool:
        if (table := self.parked.pop(session, None)) is not None:
            self.alloc.free(table)
        return table is not None


# ----------------------------------------------------------------------------
# The engine: the pool, the forward passes, sampling.

DEFAULT_KV_BYTES = 1 << 30


@dataclass
class Counts:
    """What the engine has done so far, counted as it goes."""
    steps: int = 0
    prefill_tokens: int = 0         # prompt tokens computed (recomputed ones included)
    cached_tokens: int = 0          # prompt tokens found in the prefix cache or a parked session
    recomputed_tokens: int = 0      # computed again after a preemption
    decode_tokens: int = 0          # decode rows
    block_copies: int = 0           # copy-on-write


@dataclass
class Stats(Counts):
    """``Engine.stats()``: the batch and the pool now, then the counts. Plain numbers, so a
    reader (server.py's metrics, a benchmark) needs no scheduler or allocator."""
    running: int = 0                # sequences in the batch, prefilling ones included
    waiting: int = 0                # queued for a batch slot or blocks
    free_blocks: int = 0            # free, or cached and evictable
    used_blocks: int = 0            # held by sequences or parked sessions
    preemptions: int = 0


def pool_blocks(kv_bytes: int, token_bytes: int, block_size: int, max_batch: int,
                max_len: int) -> int:
    """The blocks of a pool given ``kv_bytes`` of memory (``token_bytes`` of K/V a token): what
    they hold, but no more than ``max_batch`` sequences of ``max_len`` tokens can fill."""
    return max(1, min(int(kv_bytes // (block_size * token_bytes)),
                      math.ceil(max_batch * max_len / block_size)))


def padded_rows(rows: int) -> int:
    """The rows of a fixed-shape decode pass that holds ``rows`` sequences: the next of 1, 2, 3, 4,
    6, 8, 12, 16, 24, ... (powers of two and 1.5 times them). A pass's cost grows with its rows
    (each row multiplies every weight), so padding costs up to a third of a pass where the next
    power of two alone would cost up to half; each shape is one compiled step to build."""
    power = 1 << (rows - 1).bit_length()
    return power * 3 // 4 if power >= 4 and rows <= power * 3 // 4 else power


class Engine:
    """Continuous batching over one paged KV pool.

        engine = Engine(model, block_size=16, max_batch=16)
        rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=64))
        while engine.has_work():
            for ev in engine.step():          # an Event: request_id, branch, token, ...
                ...
        engine.stats()                        # a Stats: the batch, the pool, the counters

    ``num_blocks`` defaults to what ``kv_bytes`` of memory holds (2³⁰ bytes), but no
    more than ``max_batch`` sequences of the model's full context need.
    ``max_len`` caps a sequence (prompt + output): the model's context, or the
    pool if that is smaller. ``kv_dtype`` is the pool's storage type (default: the
    model's); a ``codec`` (quantize.kv_codec: int8/fp8 rows and their scales) stores
    quantized rows instead. ``in_place``: how a one-token pass reads the pool where it
    lies (kvcache.PagedKVCache's; None: gather). ``chunk_tokens``: the most prompt
    tokens a step computes (None: every admitted prompt whole). ``vocab``
    (sampling.grammar_vocab): what requests with a schema or grammar need. ``fixed_shapes``: decode
    passes padded to 1, 2, 3, 4, 6, 8, ... rows (padded_rows) and tables to max_len's blocks
    (needs ``in_place``), the few shapes a compiled one-token step runs (kernels.compile_decode;
    ``warm_up`` loads them)."""

    def __init__(self, model: Llama, num_blocks: int | None = None, block_size: int = BLOCK_SIZE,
                 max_batch: int = 32, kv_bytes: int = DEFAULT_KV_BYTES,
                 prefix_caching: bool = True, max_len: int | None = None,
                 kv_dtype: torch.dtype | None = None, watermark: float = 0.01,
                 chunk_tokens: int | None = PREFILL_CHUNK, codec=None, in_place=None, vocab=None,
                 fixed_shapes: bool = False):
        c = model.config
        kv_dtype = kv_dtype or model.dtype
        if num_blocks is None:
            # A quantized row is d_head one-byte values plus its scale's bytes.
            row, size = ((codec.row_bytes(c.head_dim), 1) if codec
                         else (c.head_dim, kv_dtype.itemsize))
            token_bytes = kv_bytes_per_token(c.n_layers, c.n_kv_heads, row, size)
            num_blocks = pool_blocks(kv_bytes, token_bytes, block_size, max_batch, c.max_seq_len)
        if min(num_blocks, block_size, max_batch, chunk_tokens or 1) < 1:
            raise ValueError(f"num_blocks, block_size, max_batch and chunk_tokens (or None) "
                             f"must be >= 1 "
                             f"(got {num_blocks}, {block_size}, {max_batch}, {chunk_tokens})")
        if fixed_shapes and in_place is None:
            raise ValueError("fixed_shapes pads the passes an in-place reader reads: give in_place")
        self.model, self.device, self.vocab = model, model.device, vocab
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
        # with fixed shapes, one block more than the allocator hands out: the padding rows' own
        self.cache = PagedKVCache(c.n_layers, num_blocks + fixed_shapes, block_size, c.n_kv_heads,
                                  c.head_dim, kv_dtype, model.device, c.sliding_window, codec,
                                  in_place)
        self.max_len = min(max_len or c.max_seq_len, c.max_seq_len, num_blocks * block_size)
        # A decode pass padded to padded_rows's rows, each table to the blocks of max_len, has one
        # of a few fixed shapes: the model's compiled one-token step runs it
        # (kernels.compile_decode).
        self.width = math.ceil(self.max_len / block_size) if fixed_shapes else None
        self.padding = BlockTable(-1, block_size, [num_blocks], [0])
        self.watermark, self.chunk_tokens = watermark, chunk_tokens
        self.scheduler = Scheduler(self.allocator, max_batch, watermark)
        self.requests: dict[int, Request] = {}     # unfinished ones
        self._ids = itertools.count(1)             # request and sequence ids
        self.counts = Counts()

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    def stats(self) -> Stats:
        """The engine's state now, as plain numbers: what a server's metrics read."""
        s, free = self.scheduler, self.allocator.num_free
        return Stats(**vars(self.counts), running=len(s.running), waiting=len(s.waiting),
                     free_blocks=free, used_blocks=self.allocator.num_blocks - free,
                     preemptions=s.preemptions)

    def describe(self) -> str:
        """One line for a log: the model's size and storage, the pool, the batch."""
        m, a = self.model, self.allocator
        return (f"{count_parameters(self.model) / 1e6:.0f}M parameters, "
                f"{str(m.dtype).removeprefix('torch.')}, {m.device}; KV pool {a.num_blocks} "
                f"blocks of {a.block_size} tokens, batches of up to {self.max_batch}")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- requests -----------------------------------------------------------

    def check_request(self, prompt_ids, params: SamplingParams, n: int = 1) -> list[int]:
        """Validate a request without adding it: ValueError says what is wrong."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, "
                            f"got {type(params).__name__}")
        vocab = self.model.config.vocab_size
        try:
            ids = [operator.index(t) for t in prompt_ids]
        except TypeError:
            raise ValueError("a prompt must be a list of token ids (ints)") from None
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), the model's vocabulary")
        if params.logprobs > vocab:
            raise ValueError(f"logprobs must be at most the vocabulary size {vocab}, "
                             f"got {params.logprobs}")
        if not 1 <= n <= self.scheduler.max_batch:
            raise ValueError(f"n must be between 1 and max_batch={self.scheduler.max_batch}, "
                             f"got {n}")
        if params.seed is not None and params.seed + n - 1 >= SEEDS:
            raise ValueError(f"seed must be below 2**64 - {n - 1}: branch i samples with seed + i")
        if self.vocab is None and grammar_text(params) is not None:
            raise ValueError("this engine has no vocabulary for schemas and grammars (the model "
                             "has no tokenizer.json, or Engine was given no vocab)")
        if len(ids) >= self.max_len:
            a = self.allocator
            raise ValueError(f"prompt is {len(ids)} tokens but a sequence may hold at most "
                             f"{self.max_len} (model context {self.model.config.max_seq_len}, "
                             f"KV pool {a.num_blocks * a.block_size} tokens = "
                             f"{a.num_blocks} blocks of {a.block_size}); "
                             f"shorten it or give the engine more blocks")
        return ids

    def add_request(self, prompt_ids, params: SamplingParams | None = None, n: int = 1,
                    session=None) -> int:
        """Queue a request; returns its id. Raises (and queues nothing) on a bad
        request: the engine goes on serving the others. ``session``: keep this
        conversation's blocks after it finishes so its next turn (a request with the
        same session whose prompt extends this one) computes only its new tokens."""
        return self.add(prompt_ids, params or SamplingParams(), n, session).id

    def add(self, prompt_ids, params: SamplingParams, n: int = 1, session=None) -> Request:
        """add_request, returning the Request itself (its sequences carry the outputs)."""
        ids = self.check_request(prompt_ids, params, n)
        if session is not None and n != 1:
            raise ValueError("a session continues one conversation: n must be 1")
        grammar = constraint(params, self.vocab)
        req = Request(next(self._ids), ids, params, n, session, arrival=time.perf_counter())
        seq = Sequence(next(self._ids), req, forks=n - 1, generator=self._generator(params, 0),
                       grammar=grammar)
        req.sequences.append(seq)
        self.requests[req.id] = req
        self.scheduler.add(seq)
        return req

    def request(self, request_id: int) -> Request | None:
        return self.requests.get(request_id)

    def cancel(self, request_id: int, branch: int | None = None) -> bool:
        """Stop a request now and free its blocks; with ``branch``, that branch alone (a
        stop string matched: its finish reason is "stop"). Unknown or finished: False."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.sequences:
            if seq.status is not Status.FINISHED and branch in (None, seq.branch):
                self.scheduler.finish(seq, Finish.CANCELLED if branch is None else Finish.STOP)
        if req.finished:
            del self.requests[request_id]
            req.finish = time.perf_counter()
        return True

    def end_session(self, session) -> bool:
        """Free a finished conversation's parked blocks (full ones stay in the prefix cache)."""
        return self.scheduler.end_session(session)

    def _generator(self, params: SamplingParams, branch: int):
        """Branch i of a request samples with seed + i: each is an independent run with that
        seed."""
        return seeded_generator(None if params.seed is None else params.seed + branch, self.device)

    # --- one step -----------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admit and prefill what fits, decode every running sequence once, retire
        the finished. Returns the new tokens."""
        events = []
        try:
            for seq in self.scheduler.admit(self.chunk_tokens):
                logits = self._prefill(seq)
                if seq.prefilling:        # more chunks to come: nothing to sample yet
                    continue
                events += self._guarded(seq, lambda: [self._emit(s, logits)
                                                      for s in self._branches(seq)])
            batch = self.scheduler.schedule_decode()
            if batch:
                logits = self._decode(batch)
                for s, row in zip(batch, logits):
                    if s.status is not Status.FINISHED:   # not failed earlier in this step
                        events += self._guarded(s, lambda: [self._emit(s, row)])
        except BaseException:
            # A forward pass stopped half-way (Ctrl-C, out of memory): some slots now hold
            # no K/V, and blocks registered in the prefix cache may be incomplete. Start
            # over with an empty pool rather than ever reading them.
            self._reset()
            raise
        self.counts.steps += 1
        return events

    def _branches(self, seq: Sequence) -> list[Sequence]:
        """A prefilled sequence and the n - 1 branches forked from its table."""
        branches = [seq] + [self.scheduler.fork(seq, next(self._ids), b,
                                                self._generator(seq.request.params, b),
                                                seq.grammar and seq.grammar.fork())
                            for b in range(1, seq.forks + 1)]
        seq.forks = 0
        return branches

    def _guarded(self, seq: Sequence, work) -> list[Event]:
        """work() for one request alone: if it raises, that request ends (Finish.ERROR, its
        blocks freed) with one event saying why, and the step goes on for the others."""
        try:
            return work()
        except Exception as e:
            req = seq.request
            for s in req.sequences:
                if s.status is not Status.FINISHED:
                    self.scheduler.finish(s, Finish.ERROR)
            self.requests.pop(req.id, None)
            req.finish = time.perf_counter()
            return [Event(req.id, seq.branch, -1, False, Finish.ERROR,
                          error=f"{type(e).__name__}: {e}")]

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        self._apply_copies()
        table, start, req = seq.table, seq.n_computed, seq.request
        self.counts.prefill_tokens += table.num_tokens - start
        self.counts.recomputed_tokens += (table.num_tokens - start) * seq.preempted
        # once an admission: its first chunk
        self.counts.cached_tokens += start * (start == seq.n_cached)
        if start == seq.n_cached and not seq.preempted:
            req.cached_tokens, req.prefill_tokens = start, len(seq.tokens) - start
        ids = torch.tensor([table.token_ids[start:]], device=self.device)
        pos = torch.arange(start, table.num_tokens, device=self.device)[None]
        return self.model(ids, pos, self.cache.bind([table]), last_only=True)[0, -1]

    def _decode(self, batch: list[Sequence]) -> torch.Tensor:
        self._apply_copies()
        rows = len(batch)
        # fixed shapes: padded_rows's, with rows that write and read the spare block alone
        pad = padded_rows(rows) - rows if self.width else 0
        tables = [s.table for s in batch] + [self.padding] * pad
        ids = torch.tensor([[s.output[-1]] for s in batch] + [[0]] * pad, device=self.device)
        pos = torch.tensor([[t.num_tokens - 1] for t in tables], device=self.device)
        self.counts.decode_tokens += rows
        return self.model(ids, pos, self.cache.bind(tables, self.width))[:rows, -1]

    @torch.inference_mode()
    def warm_up(self):
        """With fixed shapes: one pass of each of them (padded_rows, up to max_batch's), every
        row a padding row, so the model's compiled step loads or builds each before a request waits
        on it (kernels.AheadOfTime). The pool's blocks are not touched: padding rows write and read
        the spare block alone."""
        if self.width is None:
            return
        for rows in sorted({padded_rows(n) for n in range(1, self.max_batch + 1)}):
            ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
            self.model(ids, ids, self.cache.bind([self.padding] * rows, self.width))

    def _apply_copies(self):
        for src, dst in self.scheduler.copies:
            self.cache.copy_block(src, dst)
        self.counts.block_copies += len(self.scheduler.copies)
        self.scheduler.copies.clear()

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> Event:
        req, p, eos_ids = seq.request, seq.request.params, self.model.config.eos_ids
        token = sample(logits, p, seq.generator, seq.grammar)
        seq.output.append(token)
        chosen = top = None
        if p.logprobs:
            lp = torch.log_softmax(logits.float(), dim=-1)
            seq.logprobs.append((*lp.topk(p.logprobs), lp[token]))
            values, ids, chosen = seq.logprobs[-1]
            chosen, top = float(chosen), list(zip(ids.tolist(), values.tolist()))
        now = time.perf_counter()
        req.first_token = req.first_token or now
        reason = finish_reason(token, len(seq.output), len(req.prompt) + len(seq.output), p,
                               eos_ids, self.max_len)
        if reason:
            self.scheduler.finish(seq, reason)
            if req.finished:
                req.finish = now
                self.requests.pop(req.id, None)
        return Event(req.id, seq.branch, token, visible(token, eos_ids), reason, chosen, top)

    def _reset(self):
        for req in list(self.requests.values()):
            for seq in req.sequences:
                seq.status, seq.table, seq.finish_reason = Status.FINISHED, None, Finish.CANCELLED
        self.requests.clear()
        a = self.allocator
        self.allocator = BlockAllocator(a.num_blocks, a.block_size, a.prefix_caching, a.events)
        self.scheduler = Scheduler(self.allocator, self.scheduler.max_batch, self.watermark)

    # --- driving it ---------------------------------------------------------

    def stream(self, request_id: int) -> Iterator[int]:
        """Step until the request is done, yielding its tokens (branch 0) as they
        come; other requests advance too. Closing the iterator early cancels it."""
        req = self.requests[request_id]
        try:
            while not req.finished:
                for ev in self.step():
                    if ev.request_id == request_id and ev.branch == 0:
                        yield ev.token
        finally:
            self.cancel(request_id)       # a no-op once it has finished

    def run(self, progress=None) -> int:
        """Step until nothing is left; returns the number of steps."""
        start = self.counts.steps
        while self.has_work():
            events = self.step()
            if progress is not None:
                progress(events)
        return self.counts.steps - start


# ----------------------------------------------------------------------------
# The offline API.

@dataclass
class Completion:
    token_ids: list[int]
    text: str | None
    finish_reason: Finish | None
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None   # (values, ids), each (tokens, N)


@dataclass
class Output:
    """What ``LLM.generate`` returns per prompt; ``text``/``token_ids`` are sample 0's."""
    request_id: int
    prompt: str | list[int]
    prompt_ids: list[int]
    completions: list[Completion]
    cached_tokens: int              # prompt tokens read from the prefix cache
    ttft_s: float                   # time to first token, from when generate() queued it
    latency_s: float                # time to the last token
    text = property(lambda self: self.completions[0].text)
    token_ids = property(lambda self: self.completions[0].token_ids)
    finish_reason = property(lambda self: self.completions[0].finish_reason)


class LLM:
    """``LLM("smollm2-135m").generate(["Hi", "2+2="], SamplingParams(max_new_tokens=32))``.

    ``model`` is a name for ``model.load`` (alias, directory, .gguf: fp32 on the CPU) or a loaded
    ``Llama`` (then pass ``tokenizer`` for text prompts and outputs); the rest
    goes to ``Engine``. Prompts are text (encoded as is, no chat template) or
    token id lists."""

    def __init__(self, model: str | Path | Llama, tokenizer=None, dtype=None, **engine_kwargs):
        if not isinstance(model, Llama):
            model, tokenizer = load(str(model), dtype=dtype)
        self.model, self.tokenizer = model, tokenizer
        vocab = tokenizer and grammar_vocab(tokenizer.to_json(), model.config.eos_ids)
        self.engine = Engine(model, vocab=vocab, **engine_kwargs)

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: "
                                 "LLM(name) or LLM(model, tokenizer=...)")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None, n: int = 1,
                 use_tqdm: bool = True) -> list[Output]:
        """Run every prompt to completion, continuously batched; outputs in input order.
        Every prompt is checked before any runs: one bad prompt raises, none is queued."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: "
                             f"give one, or one per prompt")
        encoded = [self.engine.check_request(self.encode(p), sp, n)
                   for p, sp in zip(prompts, params)]
        reqs = [self.engine.add(ids, sp, n) for ids, sp in zip(encoded, params)]
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), desc="generate", unit="req", dynamic_ncols=True,
                   disable=not use_tqdm)
        tokens, t0 = 0, time.perf_counter()
        try:
            while any(not r.finished for r in reqs):
                tokens += len(self.engine.step())
                bar.update(sum(r.finished for r in reqs) - bar.n)
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):.1f} tok/s",
                                    refresh=False)
        except BaseException:
            for r in reqs:
                self.engine.cancel(r.id)
            raise
        finally:
            bar.close()
        return [self._output(r, p) for r, p in zip(reqs, prompts)]

    def _output(self, req: Request, prompt) -> Output:
        eos_ids = self.model.config.eos_ids
        decode = ((lambda ids: self.tokenizer.decode([t for t in ids if visible(t, eos_ids)],
                                                     skip_special=True))
                  if self.tokenizer else (lambda ids: None))
        seqs = sorted(req.sequences, key=lambda s: s.branch)
        top = lambda s: (tuple(torch.stack(x) for x in list(zip(*s.logprobs))[:2])
                         if s.logprobs else None)
        return Output(req.id, prompt, req.prompt,
                      [Completion(s.output, decode(s.output), s.finish_reason, top(s))
                       for s in seqs],
                      req.cached_tokens, req.first_token - req.arrival, req.finish - req.arrival)


# ----------------------------------------------------------------------------
# Trace: the blocks of a fixed schedule, step by step, on a tiny random-weight Llama.

# a 32-token system prompt: two full blocks that every request shares
SYSTEM = list(range(100, 132))
# (prompt, new tokens, n)
TRACE = [(SYSTEM + list(range(10, 18)), 26, 1), (SYSTEM + list(range(20, 31)), 24, 1),
         (SYSTEM + list(range(40, 44)), 5, 2), (SYSTEM + list(range(50, 54)), 20, 1)]


def trace(write=print, num_blocks: int = 8, seed: int = 0) -> Engine:
    """Run TRACE with EOS ignored, so the schedule never depends on which tokens come
    out (nor on ``seed``, the weights'), and write what the allocator did each step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Llama(LlamaConfig(256, 32, 64, n_layers=1, n_heads=2, n_kv_heads=1,
                                  head_dim=16)).eval()
    engine, log, steps = Engine(model, num_blocks=num_blocks, max_batch=4), [], []
    alloc, alloc.events = engine.allocator, log
    reqs = [engine.add(p, SamplingParams(max_new_tokens=m, ignore_eos=True), n)
            for p, m, n in TRACE]
    name = lambda s: f"r{reqs.index(s.request) + 1}" + f".{s.branch}" * (s.request.n > 1)
    write(f"{num_blocks} blocks of 16 tokens; a {len(SYSTEM)}-token system prompt in common; "
          f"prompt + new tokens: "
          + ", ".join(f"r{i} {len(p)} + {m}" + f" (n = {n})" * (n > 1)
                      for i, (p, m, n) in enumerate(TRACE, 1)))
    write("0×3: block 0 held by 3 sequences; cached: free, "
          "yet the prefix cache finds it until evicted (oldest first)")
    while engine.has_work():
        log.clear()
        out = engine.step()
        seqs, lines = {key: s for r in reqs for s in r.sequences
                       for key in (s.id, (r.id, s.branch))}, []
        for kind, *a in log:
            s = seqs.get(a[0]) if a else None
            match Trace(kind):
                case Trace.DECODE:     # prefills and forks done: the rest of ``out`` is the batch
                    lines.append("decode  " + " ".join(name(seqs[e.request_id, e.branch])
                                                       for e in out[len(lines):]))
                case Trace.ALLOCATE:   # its new blocks follow, as ALLOC events
                    n, hits = a[1:]
                    new = alloc.blocks_for(n) - len(hits)
                    again = " again" * (n > len(s.request.prompt))
                    lines.append(f"prefill {name(s)}{again}: {n} tokens, "
                                 + f"hit {' '.join(map(str, hits))}, " * bool(hits)
                                 + f"computed {n - s.n_cached} into new block" + "s" * (new > 1))
                case Trace.ALLOC if lines[-1].startswith("prefill"):
                    lines[-1] += f" {a[1]}"
                case Trace.ALLOC:
                    lines.append(f"grow    {name(s)}: new block {a[1]}")
                case Trace.COW:
                    lines.append(f"grow    {name(s)}: copies block {a[1]} → {a[2]} "
                                 "(copy-on-write)")
                case Trace.FORK:
                    lines.append(f"fork    {name(seqs[a[1]])} shares every block of {name(s)}")
                case Trace.FREE:
                    fates = ", ".join(f"{fate} " + " ".join(map(str, sorted(b)))
                                      for fate, b in a[1].items() if b)
                    how = "preempt" if s.status is Status.WAITING else "finish"
                    lines.append(f"{how:8}{name(s)}: {fates}")
        steps.append(lines + [f"pool    {alloc.describe()}"])
    # a repeat: "steps 7-8"
    for lines, same in itertools.groupby(enumerate(steps, 1), key=lambda step: step[1]):
        first, *rest = [n for n, _ in same]
        write(f"\n{f'steps {first}-{rest[-1]}' if rest else f'step {first}':12}"
              + f"\n{'':12}".join(lines))
    alloc.check_invariants()
    write(f"\nevery block came back: {alloc.num_free} of {alloc.num_blocks} free "
          f"({len(alloc.evictable)} of them still cached); "
          f"{engine.stats().preemptions} preemption; check_invariants() passed")
    return engine


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="continuous batching block by block: "
                                 "a fixed schedule on a tiny random model "
                                 "(chat requests on the bundled model: python bench.py engine)")
    ap.add_argument("--trace", action="store_true", help="the same as no flag")
    ap.parse_args()
    trace()
