"""engine.py --trace: a fixed schedule on a tiny random-weight Llama, printed block by block.

The text must equal a golden copy, tests/lessons/golden/engine_trace.txt (after an intended change
to the schedule or the format: `python engine.py --trace > tests/lessons/golden/engine_trace.txt`,
and read the diff). EOS is ignored, so the schedule depends on no token: other weights print the
same text. The run must also mean what the text says: one preemption, recomputed mostly from the
prefix cache, prefix hits, one copy-on-write block, every block back."""

from pathlib import Path

import pytest
import torch

import engine

GOLDEN = Path(__file__).parent / "golden" / "engine_trace.txt"

pytestmark = pytest.mark.usefixtures("one_thread")


def run(seed=0):
    lines = []
    return engine.trace(lines.append, seed=seed), "".join(line + "\n" for line in lines)


def test_trace_prints_the_golden_schedule():
    _, text = run()
    assert text == GOLDEN.read_text(encoding="utf-8")
    assert text.count(" preempt r") == 1 and "prefill r4 again: 54 tokens, hit 0 1 4, computed 6" in text


def test_trace_means_what_it_prints():
    eng, _ = run()
    s, alloc = eng.stats(), eng.allocator
    assert eng.scheduler.preemptions == s.preemptions == 1
    # r2, r3, r4: the system prompt; r4 again: its block 4 too
    assert s.cached_tokens == 32 + 32 + 32 + 48
    # r1, r2, r3 (once for both branches), r4, r4 again
    assert s.prefill_tokens == 40 + 11 + 4 + 4 + 6
    assert s.recomputed_tokens == 6 and s.block_copies == 1
    assert not eng.has_work() and not eng.requests
    assert not alloc.live and alloc.num_free == alloc.num_blocks == 8
    alloc.check_invariants()


def test_trace_depends_on_no_token():
    eng0, text0 = run(seed=0)
    eng1, text1 = run(seed=1)
    assert not torch.equal(eng0.model.lm_head.weight, eng1.model.lm_head.weight)
    assert text1 == text0
