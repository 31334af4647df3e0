"""`python bench.py paged --simulate N` (paged.py, seed exercise 3): fragmentation, simulated. N chat
requests through three ways of giving out one KV budget (contiguous at the context length,
contiguous at the true length, 16-token pages from paged.BlockAllocator): concurrency, requests per
step and the memory reserved but empty; a table (results/paged-simulation.json) and a plot
(plots/paged_simulation.png)."""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from paged import BLOCK_SIZE, SMOLLM2_BYTES_PER_TOKEN, BlockAllocator, OutOfBlocks
from results import Table, plot_path, pyplot, save


# Seed exercise 3: fragmentation, simulated.
#
# A workload of chat requests, all waiting at step 0 (a saturated server):
#   prompt tokens  ~ log-normal, median 256, σ = 1.0 (mean ≈ 420), clipped to [1, ctx - 1]
#   output tokens  ~ log-normal, median 192, σ = 0.8 (mean ≈ 265), clipped to [1, ctx - prompt]
# A step-based scheduler: each step every running sequence writes one token
# (an admitted one writes its prompt and its first token); requests are admitted
# first come first served while memory allows (stopping at the first that does
# not fit); a sequence retires after its output length. After k steps a
# sequence holds prompt + k tokens.
#
# Three ways to give out a fixed KV budget:
#   (a) contiguous, reserved at the context length (what a static cache does);
#   (b) contiguous, reserved at the request's true final length (an oracle);
#   (c) 16-token pages from BlockAllocator, a block at a time. Pages can run out
#       mid-decode: then the youngest sequence is preempted (freed, requeued at
#       the front, recomputed when readmitted; the prefix cache may still hold
#       its blocks). Admission keeps 1% of the blocks free as headroom.
#
# Waste, defined: reserved = KV slots held by running sequences (for pages,
# blocks × 16); written = tokens they hold. "Empty" = (reserved - written) /
# reserved, summed over all steps (the share of reserved memory that holds
# nothing at a given moment). "Never written" = slots a request held at its
# end but never wrote, as a share of what it held.

PROMPT_MEDIAN, PROMPT_SIGMA = 256, 1.0
OUTPUT_MEDIAN, OUTPUT_SIGMA = 192, 0.8


@dataclass
class Request:
    id: int
    prompt: int
    output: int


def sample_requests(n: int, ctx: int = 2048, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        p = min(max(round(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA)), 1), ctx - 1)
        o = min(max(round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA)), 1), ctx - p)
        reqs.append(Request(i, p, o))
    return reqs


@dataclass
class SimResult:
    name: str
    steps: int = 0
    peak_running: int = 0
    running_sum: int = 0       # Σ over steps of running sequences
    reserved_sum: int = 0      # Σ over steps of reserved slots
    written_sum: int = 0       # Σ over steps of written slots
    held_at_end: int = 0       # Σ over requests of slots held at retirement
    final_tokens: int = 0      # Σ over requests of tokens held at retirement
    preemptions: int = 0
    recomputed: int = 0        # tokens prefilled again after a preemption
    series: list = field(default_factory=list)  # (running, reserved, written) per step

    def record(self, running: int, reserved: int, written: int):
        self.steps += 1
        self.peak_running = max(self.peak_running, running)
        self.running_sum += running
        self.reserved_sum += reserved
        self.written_sum += written
        self.series.append((running, reserved, written))

    @property
    def empty_pct(self) -> float:
        return 100 * (self.reserved_sum - self.written_sum) / self.reserved_sum

    @property
    def never_written_pct(self) -> float:
        return 100 * (self.held_at_end - self.final_tokens) / self.held_at_end


def _simulate_contiguous(name, reqs, budget, reserve) -> SimResult:
    res, waiting, running, reserved = SimResult(name), deque(reqs), [], 0
    while waiting or running:
        while waiting and reserved + reserve(waiting[0]) <= budget:
            r = waiting.popleft()
            reserved += reserve(r)
            running.append([r, 0])
        for s in running:
            s[1] += 1
        res.record(len(running), reserved, sum(r.prompt + k for r, k in running))
        for r, k in running:
            if k == r.output:
                reserved -= reserve(r)
                res.held_at_end += reserve(r)
                res.final_tokens += r.prompt + r.output
        running = [s for s in running if s[1] < s[0].output]
    return res


def _simulate_paged(reqs, budget, block_size) -> SimResult:
    """(c) on the real allocator. Token ids are unique per request and position,
    so the prefix cache only ever hits a preempted request's own blocks."""
    res = SimResult(f"{block_size}-token pages")
    alloc = BlockAllocator(budget // block_size, block_size)
    headroom = max(1, alloc.num_blocks // 100)
    tok = lambda r, i: (r.id << 20) + i
    waiting = deque([r, 0] for r in reqs)     # [request, tokens generated so far]
    running = []                               # [request, table, generated]
    while waiting or running:
        i = 0
        while i < len(running):                # decode: oldest first, preempt the youngest
            r, table, k = running[i]
            if alloc.needs_block(table) and alloc.num_free == 0:
                vr, vtable, vk = running.pop()
                alloc.free(vtable)
                waiting.appendleft([vr, vk])
                res.preemptions += 1
                continue
            alloc.append_slot(table, tok(r, r.prompt + k))
            running[i][2] += 1
            i += 1
        while waiting:                         # admit FCFS
            r, k = waiting[0]
            if alloc.blocks_for(r.prompt + k + 1) + headroom > alloc.num_free:
                if not running:
                    raise OutOfBlocks(f"request {r.id} ({r.prompt + k + 1} tokens) does not fit in the budget")
                break
            waiting.popleft()
            table, n_cached = alloc.allocate_sequence(tok(r, j) for j in range(r.prompt + k))
            if k:
                res.recomputed += r.prompt + k - n_cached
            alloc.append_slot(table, tok(r, r.prompt + k))
            running.append([r, table, k + 1])
        in_use = (alloc.num_blocks - alloc.num_free) * block_size
        res.record(len(running), in_use, sum(t.num_tokens for _, t, _ in running))
        for r, table, k in running:
            if k == r.output:
                res.held_at_end += len(table.block_ids) * block_size
                res.final_tokens += table.num_tokens
                alloc.free(table)
        running = [s for s in running if s[2] < s[0].output]
    alloc.check_invariants()
    return res


def simulate(n: int, budget: int = 65536, ctx: int = 2048, block_size: int = BLOCK_SIZE,
             seed: int = 0) -> tuple[list[Request], list[SimResult]]:
    if budget < ctx:
        raise ValueError(f"a budget of {budget} tokens cannot hold one {ctx}-token sequence; raise --budget")
    reqs = sample_requests(n, ctx, seed)
    return reqs, [
        _simulate_contiguous(f"contiguous, reserve {ctx}", reqs, budget, lambda r: ctx),
        _simulate_contiguous("contiguous, reserve true length (oracle)", reqs, budget,
                             lambda r: r.prompt + r.output),
        _simulate_paged(reqs, budget, block_size),
    ]


def simulation_table(results: list[SimResult], n: int) -> Table:
    return Table(f"{n} simulated chat requests, one KV budget, three ways to allocate it",
                 ["allocation", "peak concurrent seqs", "mean concurrent seqs", "steps", "requests / step",
                  "reserved but empty (time avg)", "never written (at retirement)", "preemptions"],
                 [[r.name, r.peak_running, f"{r.running_sum / r.steps:.1f}", r.steps, f"{n / r.steps:.3f}",
                   f"{r.empty_pct:.1f}%", f"{r.never_written_pct:.1f}%", r.preemptions] for r in results],
                 ["reserved but empty = (reserved - written) / reserved over all steps; never written = slots "
                  "held at retirement but not written."])


def plot_simulation(results: list[SimResult], budget: int, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, color in zip(results, ["tab:red", "tab:orange", "tab:blue"]):
        running, reserved, written = zip(*r.series)
        ax1.plot(running, color=color, lw=1, label=r.name)
        ax2.plot([100 * x / budget for x in reserved], color=color, lw=1)
        ax2.plot([100 * x / budget for x in written], color=color, lw=1, ls="--")
    ax1.set(xlabel="step", ylabel="running sequences", title="sequences decoding together")
    ax2.set(xlabel="step", ylabel="% of the KV budget", title="KV memory reserved (solid) and written (dashed)",
            ylim=(0, 105))
    ax1.legend(fontsize=8)   # the colours mean the same in both panels
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_simulation(n: int, budget: int, ctx: int, block_size: int, seed: int):
    """Prints the table and saves it (results/paged-simulation.json) with a plot of the runs
    (plots/paged_simulation.png)."""
    reqs, results = simulate(n, budget, ctx, block_size, seed)
    prompts, outputs = [r.prompt for r in reqs], [r.output for r in reqs]
    workload = [f"{n} chat requests (seed {seed}), all waiting at step 0; context {ctx}",
                f"prompt tokens: log-normal, median {PROMPT_MEDIAN}, σ {PROMPT_SIGMA}, clipped → "
                f"mean {sum(prompts) / n:.0f}, max {max(prompts)}",
                f"output tokens: log-normal, median {OUTPUT_MEDIAN}, σ {OUTPUT_SIGMA}, clipped → "
                f"mean {sum(outputs) / n:.0f}, max {max(outputs)}",
                f"KV budget: {budget} tokens = {budget * SMOLLM2_BYTES_PER_TOKEN / 2**30:.2f} GiB for "
                f"SmolLM2-135M (bf16); pages of {block_size} tokens"]
    table, paged = simulation_table(results, n), results[-1]
    table.notes += [f"{paged.name}: {paged.recomputed} tokens recomputed after {paged.preemptions} preemptions; "
                    f"{paged.peak_running / results[0].peak_running:.1f}x the peak concurrency and "
                    f"{results[0].steps / paged.steps:.1f}x the requests per step of max-length reservation"]
    table.notes += workload
    print(f"{table.title}\n\n{table.markdown()}")
    path = plot_path("paged_simulation.png")
    drawn = plot_simulation(results, budget, path)
    print(f"saved {save('paged-simulation', 'paged', [table], plots=[path] if drawn else [])}"
          + f" and {path}" * drawn)


def paged_args(p):
    """The flags of `python bench.py paged` (they were paged.py's)."""
    p.add_argument("--simulate", type=int, metavar="N", default=1000,
                   help="simulate N chat requests under three allocation schemes (seed exercise 3)")
    p.add_argument("--budget", type=int, default=65536, help="KV memory budget in tokens (simulation)")
    p.add_argument("--ctx", type=int, default=2048, help="context length, the max-length reservation")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--seed", type=int, default=0)


def paged_command(args):
    for name in ("simulate", "budget", "ctx", "block_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1, got {value}")
    try:
        run_simulation(args.simulate, args.budget, args.ctx, args.block_size, args.seed)
    except OutOfBlocks as e:
        raise SystemExit(f"error: {e}") from None
