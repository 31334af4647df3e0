"""paged.py bookkeeping: slots, prefix caching (with forced hash collisions), copy-on-write,
out-of-blocks errors, LRU eviction, randomized and property-based invariant runs (the simulation:
tests/bench/test_bench_lessons.py).

A fake KV storage (one list entry per slot, holding the token id written there) stands in
for the tensors: every sequence must read back exactly its own tokens through its block table."""

import random

import pytest
from hypothesis import given, settings, strategies as st

import paged as P
from paged import BlockAllocator, OutOfBlocks



class Driver:
    """Drives an allocator like an engine would, writing token ids into a fake storage."""

    def __init__(self, num_blocks, block_size):
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.storage = [None] * (num_blocks * block_size)
        self.tables = []

    def new(self, tokens):
        table, n_cached = self.alloc.allocate_sequence(tokens)
        for p in range(n_cached):   # a hit must already hold this prefix
            assert self.storage[table.slot(p)] == tokens[p], "prefix cache returned a block with other tokens"
        for p in range(n_cached, len(tokens)):
            self.storage[table.slot(p)] = tokens[p]
        self.tables.append(table)
        return table, n_cached

    def append(self, table, token):
        slot, copy = self.alloc.append_slot(table, token)
        if copy:
            bs = self.alloc.block_size
            src, dst = copy
            self.storage[dst * bs:(dst + 1) * bs] = self.storage[src * bs:(src + 1) * bs]
        self.storage[slot] = token
        return slot, copy

    def fork(self, table):
        twin = self.alloc.fork(table)
        self.tables.append(twin)
        return twin

    def free(self, table):
        self.alloc.free(table)
        self.tables.remove(table)

    def check(self):
        self.alloc.check_invariants()
        for t in self.tables:
            assert [self.storage[s] for s in t.slots()] == t.token_ids, f"sequence {t.seq_id} reads other tokens"

    def free_all(self):
        for t in list(self.tables):
            self.free(t)
        self.check()
        a = self.alloc
        assert a.num_free == a.num_blocks and not a.live, "blocks leaked"
        assert all(b.ref_count == 0 for b in a.blocks)


def test_slots_follow_the_block_table():
    d = Driver(8, 16)
    t, n_cached = d.new(list(range(20)))
    assert n_cached == 0 and len(t.block_ids) == 2
    assert t.slots() == [t.block_ids[p // 16] * 16 + p % 16 for p in range(20)]
    for tok in range(20, 32):             # fill block 1: no new block
        d.append(t, tok)
    assert len(t.block_ids) == 2 and d.alloc.needs_block(t)
    slot, copy = d.append(t, 32)          # position 32 starts block 2
    assert len(t.block_ids) == 3 and slot == t.block_ids[2] * 16 and copy is None
    d.check()
    d.free_all()


def test_block_hashes_chain_every_full_block():
    tokens = list(range(100, 140))                                 # 2 full blocks of 16, and 8 more
    h0 = P.block_hash(0, tuple(range(100, 116)))
    h1 = P.block_hash(h0, tuple(range(116, 132)))
    assert P.block_hashes(tokens, 16) == [h0, h1]
    assert P.block_hashes(tokens[:32], 16) == [h0, h1] and P.block_hashes(tokens[:31], 16) == [h0]
    assert P.block_hashes(tokens[:15], 16) == []
    other = [0] + tokens[1:]                                       # the first block differs: so does every name
    assert all(a != b for a, b in zip(P.block_hashes(other, 16), [h0, h1]))
    assert P.block_hashes(tokens[16:32], 16) != [h1]               # the same tokens after another prefix


def test_prefix_cache_reuses_the_same_blocks_for_the_same_prefix():
    d = Driver(32, 16)
    system = list(range(100, 140))                     # 40 tokens: 2 full blocks + 8
    a, hit_a = d.new(system + [1, 2, 3])
    b, hit_b = d.new(system + [4, 5])
    assert hit_a == 0 and hit_b == 32
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert all(d.alloc.blocks[i].ref_count == 2 for i in a.block_ids[:2])
    c, hit_c = d.new([999] + system[1:] + [4, 5])      # first token differs: nothing shared
    assert hit_c == 0 and not set(c.block_ids) & set(a.block_ids)
    e, hit_e = d.new(system[:16] + [7] * 24)           # first block only
    assert hit_e == 16 and e.block_ids[0] == a.block_ids[0] and e.block_ids[1] != a.block_ids[1]
    kept = a.block_ids[:2]
    for t in (a, b, c, e):
        d.free(t)
    d.check()
    f, hit_f = d.new(system + [9])                     # freed, still cached: revived from the LRU
    assert hit_f == 32 and f.block_ids[:2] == kept
    d.check()
    d.free_all()


def test_a_block_aligned_prompt_leaves_its_last_block_to_compute():
    d = Driver(8, 16)
    a, _ = d.new(list(range(32)))
    b, hit = d.new(list(range(32)))
    assert hit == 16 and b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    d.check()
    d.free_all()


def test_decoded_blocks_enter_the_prefix_cache():
    d = Driver(16, 4)
    a, _ = d.new([1, 2, 3])
    for tok in [4, 5, 6, 7, 8, 9]:
        d.append(a, tok)                               # blocks [1..4] and [5..8] are now full
    b, hit = d.new([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert hit == 8 and b.block_ids[:2] == a.block_ids[:2]
    d.check()
    d.free_all()


def test_forced_hash_collisions_never_return_another_prefix(monkeypatch):
    monkeypatch.setattr(P, "block_hash", lambda prev_hash, token_ids: 42)   # every block collides
    d = Driver(32, 4)
    x, y, z = [1] * 4, [2] * 4, [3] * 4
    a, _ = d.new(x + y + [0])
    b, hit = d.new(z + y + [0])        # same second block after a different first one
    assert hit == 0 and not set(b.block_ids) & set(a.block_ids)
    c, hit = d.new(y + x + [0])        # a's blocks in another order
    assert hit == 0
    e, hit = d.new(x + z + [0])        # right first block, wrong second
    assert hit == 4 and e.block_ids[0] == a.block_ids[0] and e.block_ids[1] != a.block_ids[1]
    f, hit = d.new(x + y + [5])        # the same prefix still hits, block for block
    assert hit == 8 and f.block_ids[:2] == a.block_ids[:2]
    g, hit = d.new(z + y + [7])        # and so does b's, to b's own blocks
    assert hit == 8 and g.block_ids[:2] == b.block_ids[:2]
    assert len(d.alloc.cached) == 1 and len(d.alloc.cached[42]) > 2
    d.check()
    d.free_all()


def test_copy_on_write_keeps_branches_independent():
    d = Driver(16, 16)
    root, _ = d.new(list(range(20)))                   # block 0 full, block 1 holds 4 tokens
    branches = [root, d.fork(root), d.fork(root)]
    assert all(t.block_ids == root.block_ids for t in branches)
    assert d.alloc.blocks[root.block_ids[1]].ref_count == 3
    shared_full, shared_tail = root.block_ids
    copies = [d.append(t, 1000 + i)[1] for i, t in enumerate(branches)]
    assert copies[0] == (shared_tail, branches[0].block_ids[1])
    assert copies[1] == (shared_tail, branches[1].block_ids[1])
    assert copies[2] is None and branches[2].block_ids[1] == shared_tail   # the last holder writes in place
    assert all(t.block_ids[0] == shared_full for t in branches)            # full blocks stay shared
    assert len({t.block_ids[1] for t in branches}) == 3
    for step in range(30):                             # keep decoding different tokens
        for i, t in enumerate(branches):
            assert d.append(t, 2000 + 100 * i + step)[1] is None
    d.check()
    assert [t.token_ids[20] for t in branches] == [1000, 1001, 1002]
    d.free(branches[1])
    d.check()
    d.free_all()


def test_forking_a_full_last_block_needs_no_copy():
    d = Driver(8, 4)
    a, _ = d.new([1, 2, 3, 4])
    b = d.fork(a)
    assert d.alloc.needs_block(a)
    assert d.append(a, 5)[1] is None and d.append(b, 6)[1] is None
    assert a.block_ids[0] == b.block_ids[0] and a.block_ids[1] != b.block_ids[1]
    d.check()
    d.free_all()


def test_out_of_blocks_is_clear_and_leaks_nothing():
    d = Driver(4, 16)
    a, _ = d.new(list(range(40)))                      # 3 of 4 blocks
    with pytest.raises(OutOfBlocks) as err:
        d.new(list(range(100, 140)))                   # needs 3, 1 free
    msg = str(err.value)
    assert "\n" not in msg and "need 3 more block" in msg and "free a sequence" in msg
    assert d.alloc.num_free == 1
    d.check()
    # a prefix hit on a cached, freed block counts against the pool: still all-or-nothing
    b, hit = d.new(list(range(33)))                    # shares a's 2 full blocks, takes the last one
    assert hit == 32 and d.alloc.num_free == 0
    for tok in range(40, 48):
        d.append(a, tok)                               # fills a's last block: no new block yet
    before = (list(a.block_ids), list(a.token_ids))
    with pytest.raises(OutOfBlocks):
        d.append(a, 48)                                # a block border with nothing free
    assert (a.block_ids, a.token_ids) == before
    c = d.fork(b)                                      # b's last block is shared and partial
    with pytest.raises(OutOfBlocks):
        d.append(c, 7)                                 # copy-on-write needs a block: none
    assert c.block_ids == b.block_ids and c.num_tokens == 33
    d.check()
    d.free_all()


def test_lru_evicts_the_least_recently_freed_cached_block():
    d = Driver(4, 4)
    a, _ = d.new([1, 1, 1, 1, 9])
    b, _ = d.new([2, 2, 2, 2, 9])
    a0, b0 = a.block_ids[0], b.block_ids[0]
    d.free(a)                                          # a's full block is freed first: oldest in the LRU
    d.free(b)
    assert list(d.alloc.evictable) == [a0, b0] and len(d.alloc.free_ids) == 2
    c, _ = d.new([5] * 9)                              # 3 blocks: the 2 free ones, then evicts a0
    assert list(d.alloc.evictable) == [b0] and a0 in c.block_ids
    d.free(c)
    b2, hit = d.new([2, 2, 2, 2, 8])
    assert hit == 4 and b2.block_ids[0] == b0          # b's block survived
    assert d.new([1, 1, 1, 1, 8])[1] == 0              # a's did not
    d.check()
    d.free_all()


def test_double_free_is_refused():
    a = BlockAllocator(4)
    t, _ = a.allocate_sequence([1, 2, 3])
    a.free(t)
    with pytest.raises(ValueError, match="already freed"):
        a.free(t)
    with pytest.raises(ValueError):
        a.append_slot(t, 4)


def random_workload(seed, n_requests, num_blocks=48, block_size=4):
    """An engine's life in fast-forward: admissions with shared prefixes, decode steps,
    forks (n > 1), cancellations, finishes and preemptions (free, requeue, readmit)."""
    rng = random.Random(seed)
    d = Driver(num_blocks, block_size)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    preempted, admitted = [], 0
    stats = dict(forks=0, cancels=0, preemptions=0, readmitted=0, refused=0, hits=0)
    while admitted < n_requests or d.tables or preempted:
        op = rng.random()
        if op < 0.25 and (admitted < n_requests or preempted):
            readmit = bool(preempted) and (admitted >= n_requests or rng.random() < 0.5)
            tokens = preempted.pop(0) if readmit else \
                rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
            free_before = d.alloc.num_free
            try:
                _, hit = d.new(tokens)
                stats["hits"] += hit > 0
                stats["readmitted"] += readmit
                admitted += not readmit
            except OutOfBlocks:
                assert d.alloc.num_free == free_before and d.tables   # an empty pool fits any request here
                stats["refused"] += 1
                if readmit:
                    preempted.insert(0, tokens)
                victim = rng.choice(d.tables)          # make room: preempt a random sequence
                preempted.append(list(victim.token_ids))
                d.free(victim)
                stats["preemptions"] += 1
        elif op < 0.75 and d.tables:
            t = rng.choice(d.tables)
            try:
                d.append(t, rng.randrange(4))
            except OutOfBlocks:
                d.free(t)                              # preempted by recompute
                preempted.append(list(t.token_ids))
                stats["preemptions"] += 1
        elif op < 0.82 and d.tables:
            d.fork(rng.choice(d.tables))
            stats["forks"] += 1
        elif op < 0.9 and d.tables:
            d.free(rng.choice(d.tables))
            stats["cancels"] += 1
        elif d.tables and (admitted >= n_requests or op < 0.95):
            d.free(rng.choice(d.tables))               # finished
        if rng.random() < 0.1:
            d.check()
    d.check()
    d.free_all()
    return stats


def test_randomized_run_of_1000_requests_keeps_every_invariant():
    stats = random_workload(seed=0, n_requests=1000)
    assert all(v > 20 for v in stats.values()), stats   # every path was exercised


def snapshot(alloc):
    return (list(alloc.free_ids), list(alloc.evictable), [b.ref_count for b in alloc.blocks],
            {i: (list(t.block_ids), list(t.token_ids)) for i, t in alloc.live.items()})


OPS = st.lists(st.tuples(st.sampled_from("nafxp"), st.integers(0, 30), st.lists(st.integers(0, 2), max_size=12)),
               max_size=40)


@settings(max_examples=150, deadline=None, database=None)   # no .hypothesis/ in the tree
@given(OPS, st.sampled_from([1, 2, 4]))
def test_property_any_sequence_of_operations(ops, block_size):
    d = Driver(12, block_size)
    for op, pick, tokens in ops:
        table = d.tables[pick % len(d.tables)] if d.tables else None
        if op == "p" and table is not None:                 # preempt, then readmit its tokens
            op, tokens = "n", list(table.token_ids)
            d.free(table)
        before = snapshot(d.alloc)
        try:
            if op == "n" or table is None:
                d.new(tokens)
            elif op == "a":
                d.append(table, tokens[0] if tokens else 0)
            elif op == "f":
                d.fork(table)
            elif op == "x":
                d.free(table)
        except OutOfBlocks:
            assert snapshot(d.alloc) == before, "a failed call changed the bookkeeping"
        d.check()
    d.free_all()
