"""
Paged KV memory: give the cache out in fixed 16-token blocks, like virtual memory.

A contiguous cache (kvcache.py) must know how long a sequence will get before
it starts. A server does not know that: an answer may stop after 3 tokens or
run to the context limit. So it reserves the maximum (say 2048 tokens) for
every request, and most of that reservation is never written. Memory, not
compute, then caps how many sequences decode together.

Paging is the operating system's answer to the same problem. KV memory is one
pool of physical blocks of 16 token slots each. A sequence sees logical blocks
0, 1, 2, ... (tokens 0-15, 16-31, ...), and its block table maps each logical
block to whichever physical block it was given; the blocks need not be
adjacent. A new block is taken only when the last one is full, so the only
memory a sequence holds but has not written is the tail of its last block:
fewer than 16 tokens per sequence, whatever its length. Token position p of a
sequence lives in physical slot

    slot = block_table[p // 16] * 16 + p % 16

which is all the attention kernel needs to gather K and V (and all the
storage layer needs to scatter them).

Cost model. For SmolLM2-135M (30 layers, 3 KV heads, d_head 64, bf16) one
token costs 2 · 3 · 64 · 2 B = 768 B per layer, 23040 B = 22.5 KiB over all
layers, so one 16-token block holds 16 × 22.5 KiB = 360 KiB and a sequence
wastes at most 15 × 22.5 KiB = 337.5 KiB. A 2048-token contiguous
reservation is 2048 × 22.5 KiB = 45 MiB; a typical chat request of ~600 tokens
writes 600 × 22.5 KiB ≈ 13 MiB of it and leaves 45 − 13 = 32 MiB (70%) empty.
`python bench.py paged --simulate 1000` measures this on 1,000 simulated chat
requests: with 16-token pages about 1% of the reserved memory is empty, against
about 70% when reserving the maximum, so ~2.6× as many sequences decode at once
in the same memory.

Blocks also make sharing cheap, because a block is a unit that several tables
may point at (a reference count says how many):

* Prefix caching. A full block is named by a hash that chains the previous
  block's hash with its own 16 token ids, so the hash names the whole prefix
  up to and including the block. A new request looks up its leading full
  blocks by hash and reuses every one that matches: the same system prompt or
  chat history is stored once and never prefilled again. A hash can collide,
  so a hit is verified: the cached block's token ids must equal the request's
  and its parent must be the block matched just before it. Freed blocks that
  carry a hash stay cached (in LRU order) until the free list runs dry, so a
  finished conversation's next turn, or a preempted request, finds them again.
* Copy-on-write. A fork (parallel sampling n > 1, beam-style branches) copies
  the block table, not the blocks: the branches share every block. Full
  blocks are never written again, so they stay shared; only when a branch
  writes into a shared, partially filled last block does it get a private
  copy of that one block. The bookkeeping returns the (src, dst) pair and the
  storage layer copies the block, since the tensors live elsewhere.

Everything here is plain Python that never touches a tensor:
``BlockAllocator`` (free list, reference counts, hash → block map, LRU of
evictable cached blocks) and ``BlockTable`` (one per sequence). The engine
drives it like this:

    table, n_cached = allocator.allocate_sequence(prompt_ids)  # compute prompt_ids[n_cached:]'s K/V
    slots = table.slots(n_cached)                               # where to scatter them
    slot, copy = allocator.append_slot(table, token_id)         # each decode step; copy block first
    branch = allocator.fork(table)                              # n > 1: shares every block
    allocator.free(table)                                       # finished, cancelled or preempted

The tensors live in kvcache.py's ``PagedKVCache``: one pool of blocks per layer
that a batch of sequences writes and reads through their block tables in one
forward pass (engine.py runs it).
"""

from __future__ import annotations

import argparse
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvcache import PRESETS, kv_bytes_per_token

BLOCK_SIZE = 16


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks for this request. Nothing was allocated."""


def block_hash(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    """Names a full block and, through prev_hash (0 for the first block), the whole
    prefix before it. Python's hash of a tuple of ints is the same in every process;
    a multi-host cache would use a cryptographic hash instead. Collisions are
    harmless: a lookup compares token ids and parents before it reuses a block."""
    return hash((prev_hash, token_ids))


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chain hash of every full block of ``token_ids``, in order: block i's is
    block_hash(block i-1's, its tokens as a tuple), block 0's starts from 0. A
    partial last block has none. Equal lists mean equal prefixes (up to a collision)."""
    hashes, prev = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = block_hash(prev, tuple(token_ids[start:start + block_size]))
        hashes.append(prev)
    return hashes


@dataclass(eq=False)
class Block:
    """One physical block. The last four fields are set when the block is full."""
    id: int
    ref_count: int = 0                       # how many block tables point here
    hash: int | None = None                  # chain hash of the prefix ending here
    token_ids: tuple[int, ...] | None = None  # its 16 tokens, to verify a hash hit
    parent: int = 0                          # prefix id of the block before it (0: none)
    prefix_id: int = 0                       # names exactly the tokens up to here (never reused)

    def forget(self):
        """Drop the name: the block holds nothing a lookup may find (it is free, or about to
        be rewritten)."""
        self.hash, self.token_ids, self.parent, self.prefix_id = None, None, 0, 0


@dataclass(eq=False)
class BlockTable:
    """One sequence's logical → physical map and the tokens it holds. The table
    owns a reference on each of its blocks until ``BlockAllocator.free``."""
    seq_id: int
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def slot(self, pos: int) -> int:
        """The physical slot of token position ``pos``."""
        return self.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, start: int = 0, stop: int | None = None) -> list[int]:
        return [self.slot(p) for p in range(start, self.num_tokens if stop is None else stop)]


class BlockAllocator:
    """Hands out blocks of ``block_size`` token slots from a pool of ``num_blocks``.

    Every block is in exactly one state: owned (ref_count > 0, in some tables),
    free (in ``free_ids``, no hash), or cached-and-free (ref_count 0, in
    ``evictable``, findable by hash). New blocks come from the free list first;
    when it is empty the least recently freed cached block is evicted (``victim``).

    ``events``, if a list, logs what happens to the blocks, each event naming its
    sequence: ("allocate", seq, tokens, blocks hit in the prefix cache), then
    ("alloc", seq, block) for each new block, as whenever a sequence grows into one;
    ("cow", seq, src, dst); ("fork", seq, twin); ("free", seq, {"free" | "cached" |
    "kept": blocks}). ``python engine.py --trace`` prints it step by step.
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, prefix_caching: bool = True,
                 events: list | None = None):
        self.block_size = block_size
        # False: full blocks are named but never looked up (a baseline)
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()         # oldest first
        # hash → blocks with it (two only on a collision)
        self.cached: dict[int, list[Block]] = {}
        # seq_id → table, for free() and check_invariants()
        self.live: dict[int, BlockTable] = {}
        self._next_seq = 0
        self._next_prefix = 1
        self.events = events                       # None: record nothing

    def note(self, *event):
        """Log an event if this allocator keeps a log (the engine's scheduler adds its own)."""
        if self.events is not None:
            self.events.append(event)

    # --- what the scheduler asks -------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: free ones and evictable cached ones."""
        return len(self.free_ids) + len(self.evictable)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def admission_cost(self, token_ids) -> tuple[int, int]:
        """(blocks ``allocate_sequence(token_ids)`` would take, blocks it may take from),
        counting prefix-cache hits, without allocating anything. A hit costs no block, but
        a hit on a cached-and-free block takes that block out of what is available."""
        tokens = list(token_ids)
        hits = self._match_prefix(tokens)
        return (self.blocks_for(len(tokens)) - len(hits),
                self.num_free - sum(b.ref_count == 0 for b in hits))

    def needs_block(self, table: BlockTable) -> bool:
        """Whether the next ``append_slot`` takes a block (a border, or a shared
        partial block to copy). A decode step needs at most one per sequence."""
        return (table.num_tokens % self.block_size == 0
                or self.blocks[table.block_ids[-1]].ref_count > 1)

    # --- the four operations -----------------------------------------------

    def allocate_sequence(self, token_ids, seq_id: int | None = None) -> tuple[BlockTable, int]:
        """A table holding ``token_ids``; returns it and how many leading tokens
        were found in the prefix cache (their K/V are already in the storage; the
        caller computes the rest and scatters them to ``table.slots(n_cached)``).
        ``seq_id`` names the table (the caller's sequence id; default a fresh number).

        At least one token is always left to compute: the model must run the last
        prompt token to get the next token's logits, and that K/V write has to land
        in a block this sequence owns, not in a shared cached one.

        The new full blocks enter the prefix cache at once, so a request admitted
        later may reuse them: the caller must compute this prompt in the step that
        admits it (a batched forward scatters each layer's K/V before any attention
        reads it), not free the table before that.
        Raises OutOfBlocks, having taken nothing, if the rest does not fit."""
        tokens, bs = list(token_ids), self.block_size
        hits = self._match_prefix(tokens)
        need = self.blocks_for(len(tokens)) - len(hits)
        # revived hits leave the pool
        available = self.num_free - sum(b.ref_count == 0 for b in hits)
        if need > available:
            raise self._out_of_blocks(need, available)
        table = self._new_table(seq_id)
        for block in hits:
            if block.ref_count == 0:
                del self.evictable[block.id]
            block.ref_count += 1
            table.block_ids.append(block.id)
        self.note("allocate", table.seq_id, len(tokens), list(table.block_ids))
        n_cached = len(hits) * bs
        table.token_ids = tokens[:n_cached]
        for t in tokens[n_cached:]:
            # fresh blocks: never a copy, and cannot run out (checked above)
            self.append_slot(table, t)
        return table, n_cached

    def append_slot(self, table: BlockTable, token_id: int) -> tuple[int, tuple[int, int] | None]:
        """Make room for one more token; returns its slot and, if the last block was
        shared and partially filled, the (src, dst) blocks the caller must copy
        before writing (copy-on-write). ``token_id`` is the token whose K/V goes in
        that slot. When the block becomes full it is registered in the prefix cache.
        Raises OutOfBlocks, with the table unchanged, if a block is needed and none is left."""
        self._check_live(table)
        bs, pos = self.block_size, table.num_tokens
        copy = None
        if pos % bs == 0:
            block = self._take()
            table.block_ids.append(block.id)
            self.note("alloc", table.seq_id, block.id)
        else:
            block = self.blocks[table.block_ids[-1]]
            if block.ref_count > 1:   # shared with a fork: write into a private copy
                new = self._take()
                self.release(block.id)
                table.block_ids[-1] = new.id
                copy, block = (block.id, new.id), new
                self.note("cow", table.seq_id, *copy)
        table.token_ids.append(token_id)
        if pos % bs == bs - 1:
            self._register(block, table)
        return block.id * bs + pos % bs, copy

    def fork(self, table: BlockTable, seq_id: int | None = None) -> BlockTable:
        """A branch (named ``seq_id``) that shares every block with ``table``. Costs no memory
        now."""
        self._check_live(table)
        twin = self._new_table(seq_id)
        twin.block_ids, twin.token_ids = list(table.block_ids), list(table.token_ids)
        for bid in twin.block_ids:
            self.blocks[bid].ref_count += 1
        self.note("fork", table.seq_id, twin.seq_id)
        return twin

    def free(self, table: BlockTable) -> None:
        """Release each of the table's blocks, the last ones first: those nobody else
        holds then enter the LRU before the prefix that leads to them, and go first.
        The table keeps its token ids: to preempt by recompute, free it now and later
        readmit with ``allocate_sequence(table.token_ids)``, which finds whatever
        of its blocks is still cached."""
        self._check_live(table)
        fate = {"free": [], "cached": [], "kept": []}
        for bid in reversed(table.block_ids):
            self.release(bid)
            block = self.blocks[bid]
            fate["kept" if block.ref_count else "cached" if bid in self.evictable
                 else "free"].append(bid)
        self.note("free", table.seq_id, fate)
        table.block_ids = []
        del self.live[table.seq_id]

    def release(self, block_id: int) -> None:
        """Drop one reference to a block (a table stops pointing at it). The last one
        out returns it: to the newest end of the LRU if the prefix cache can find it
        (still reusable until evicted), else, forgotten, to the free list."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if self.is_cached(block):
            self.evictable[block_id] = None
        else:
            block.forget()
            self.free_ids.append(block_id)

    # --- inside ----------------------------------------------------------------

    def _new_table(self, seq_id: int | None) -> BlockTable:
        if seq_id is None:
            seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        if seq_id in self.live:
            raise ValueError(f"sequence {seq_id} already holds a table: free it first")
        table = BlockTable(seq_id, self.block_size)
        self.live[seq_id] = table
        return table

    def _check_live(self, table: BlockTable):
        if self.live.get(table.seq_id) is not table:
            raise ValueError(f"sequence {table.seq_id} was already freed "
                             "(or belongs to another allocator)")

    def _take(self) -> Block:
        if self.free_ids:
            block = self.blocks[self.free_ids.pop()]
        elif self.evictable:
            block = self.blocks[self.victim()]
            del self.evictable[block.id]
            self.cached[block.hash].remove(block)
            if not self.cached[block.hash]:
                del self.cached[block.hash]
            block.forget()
        else:
            raise self._out_of_blocks(1, 0)
        block.ref_count = 1
        return block

    def victim(self) -> int:
        """The cached-and-free block to evict when the free list is empty: the least recently
        freed (``evictable`` is oldest first). The eviction policy is this one line; the
        exercise exercises/evict.py puts another here."""
        return next(iter(self.evictable))

    def _out_of_blocks(self, need: int, available: int) -> OutOfBlocks:
        return OutOfBlocks(f"KV cache full: need {need} more block(s) of {self.block_size} "
                           f"tokens, {available} of {self.num_blocks} free; finish, preempt or "
                           f"free a sequence first, or give the allocator more blocks")

    def _match_prefix(self, tokens: list[int]) -> list[Block]:
        """The cached blocks that hold the leading full blocks of ``tokens`` (never the
        block of the last token, which must be computed)."""
        bs, hits, parent = self.block_size, [], 0
        for i, h in enumerate(block_hashes(tokens[:-1] if self.prefix_caching else [], bs)):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            block = self._lookup(h, parent, chunk)
            if block is None:
                break
            hits.append(block)
            parent = block.prefix_id
        return hits

    def _lookup(self, h: int, parent: int, chunk: tuple[int, ...]) -> Block | None:
        return next((b for b in self.cached.get(h, ())
                     if b.parent == parent and b.token_ids == chunk), None)

    def is_cached(self, block: Block) -> bool:
        """Whether a lookup by hash can find this block (it is in the hash → blocks map)."""
        return block.hash is not None and any(b is block for b in self.cached.get(block.hash, ()))

    def _register(self, block: Block, table: BlockTable):
        """The table's last block just became full: name it, and cache it unless an
        identical block (same tokens after the same prefix) is cached already, in
        which case it shares that block's prefix id so its successors still chain."""
        bs = self.block_size
        prev = self.blocks[table.block_ids[-2]] if len(table.block_ids) > 1 else None
        prev_hash, parent = (prev.hash, prev.prefix_id) if prev else (0, 0)
        chunk = tuple(table.token_ids[-bs:])
        h = block_hash(prev_hash, chunk)
        twin = self._lookup(h, parent, chunk)
        block.hash, block.token_ids, block.parent = h, chunk, parent
        if twin is not None:
            block.prefix_id = twin.prefix_id
        else:
            block.prefix_id = self._next_prefix
            self._next_prefix += 1
            if self.prefix_caching:
                self.cached.setdefault(h, []).append(block)

    def describe(self) -> str:
        """The pool at a glance: blocks in use (×n: held by n tables), cached-and-free (oldest
        first), free."""
        held = [f"{b.id}" + f"×{b.ref_count}" * (b.ref_count > 1) for b in self.blocks
                if b.ref_count]
        ids = lambda blocks: " ".join(map(str, blocks)) or "-"
        return (f"in use {ids(held)} | cached {ids(self.evictable)} | "
                f"free {ids(sorted(self.free_ids))}")

    def check_invariants(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent: every block is
        owned, free or cached-and-free (exactly one); reference counts equal the
        number of live tables that point at the block; the cache map and the blocks
        agree; every table has exactly the blocks its tokens need."""
        def expect(ok, msg):
            if not ok:
                raise AssertionError(msg)
        bs = self.block_size
        refs = Counter(bid for t in self.live.values() for bid in t.block_ids)
        free = set(self.free_ids)
        expect(len(free) == len(self.free_ids), "a block is on the free list twice")
        in_map = [b for bucket in self.cached.values() for b in bucket]
        expect(len({b.id for b in in_map}) == len(in_map), "a block is in the cache map twice")
        in_map_ids = {b.id for b in in_map}
        for h, bucket in self.cached.items():
            expect(bucket and all(b.hash == h for b in bucket),
                   f"cache bucket {h} is empty or mislabeled")
        for b in self.blocks:
            expect(b.ref_count == refs[b.id],
                   f"block {b.id}: ref_count {b.ref_count}, {refs[b.id]} tables")
            states = [b.ref_count > 0, b.id in free, b.id in self.evictable]
            expect(sum(states) == 1,
                   f"block {b.id} is in {sum(states)} states (owned, free, evictable)")
            if b.id in free:
                expect(b.hash is None and b.id not in in_map_ids,
                       f"free block {b.id} still has a hash")
            if b.id in self.evictable:
                expect(b.id in in_map_ids, f"evictable block {b.id} is not in the cache map")
            if b.id in in_map_ids:
                expect(b.token_ids is not None and len(b.token_ids) == bs,
                       f"cached block {b.id} not full")
        for t in self.live.values():
            expect(len(t.block_ids) == self.blocks_for(t.num_tokens),
                   f"sequence {t.seq_id}: {len(t.block_ids)} blocks for {t.num_tokens} tokens")
            for i in range(t.num_tokens // bs):
                b = self.blocks[t.block_ids[i]]
                expect(b.token_ids == tuple(t.token_ids[i * bs:(i + 1) * bs]),
                       f"sequence {t.seq_id}: full block {b.id} holds other tokens")


# ----------------------------------------------------------------------------
# Demo: what paging buys, with numbers.

SMOLLM2_BYTES_PER_TOKEN = kv_bytes_per_token(*PRESETS["smollm2-135m"], 2)   # bf16: 23040 B


def demo():
    bs, kib = BLOCK_SIZE, SMOLLM2_BYTES_PER_TOKEN / 1024
    alloc = BlockAllocator(num_blocks=64)
    print(f"pool: {alloc.num_blocks} blocks × {bs} tokens; SmolLM2-135M: {kib:g} KiB/token, "
          f"{bs * kib:g} KiB/block, {alloc.num_blocks * bs * kib / 1024:g} MiB in all")

    print("\n1. three sequences: each holds ceil(n/16) blocks, so each wastes < 16 slots")
    rng = random.Random(0)
    tables = []
    for n in (37, 100, 5):
        table, _ = alloc.allocate_sequence(rng.randrange(1000, 2000) for _ in range(n))
        tables.append(table)
        held = len(table.block_ids) * bs
        print(f"   {n:3d} tokens → blocks {table.block_ids}: {held} slots, {held - n:2d} empty "
              f"(a 2048-token contiguous reservation leaves {2048 - n} empty)")
    print(f"   free blocks: {alloc.num_free} of {alloc.num_blocks}")

    print("\n2. prefix cache: two requests with the same 40-token system prompt")
    system = list(range(40))
    a, hit_a = alloc.allocate_sequence(system + [500, 501, 502])
    b, hit_b = alloc.allocate_sequence(system + [600, 601])
    print(f"   first:  blocks {a.block_ids}, {hit_a} tokens from the cache")
    print(f"   second: blocks {b.block_ids}, {hit_b} tokens from the cache "
          f"(2 full blocks shared, prefill {len(b.token_ids) - hit_b} tokens instead of "
          f"{len(b.token_ids)})")

    print("\n3. copy-on-write: a 20-token prompt forked for n = 3 samples")
    p, _ = alloc.allocate_sequence(range(3000, 3020))
    branches = [p, alloc.fork(p), alloc.fork(p)]
    print(f"   all three share blocks {p.block_ids} (block {p.block_ids[1]} holds 4 of 16 tokens)")
    for i, t in enumerate(branches):
        slot, copy = alloc.append_slot(t, 7000 + i)
        what = (f"copy block {copy[0]} → {copy[1]} first" if copy
                else "no copy: the block is its own now")
        print(f"   branch {i} writes its first sample at slot {slot}: {what}; blocks {t.block_ids}")

    for t in tables + [a, b] + branches:
        alloc.free(t)
    alloc.check_invariants()
    print(f"\nall freed: {alloc.num_free} blocks free, {len(alloc.evictable)} of them still cached "
          f"(full blocks, reused on a hit until evicted, oldest first)")


def _main():
    argparse.ArgumentParser(description="Paged KV memory: a demo (the fragmentation simulation: "
                                        "python bench.py paged --simulate N)").parse_args()
    demo()


if __name__ == "__main__":
    _main()
