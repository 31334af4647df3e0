"""
tp.py — one model across several processes: tensor parallelism, Megatron-style.

    torchrun --nproc-per-node 2 serve_local.py --tp 2 --prompt "Hi" --temperature 0
    python tp.py                  # 2 ranks against 1 process: same tokens, half the bytes each
    python bench.py tp            # step time with 1 and 2 ranks, and the time spent in all-reduce

When a model's weights (or its KV cache) outgrow one device, split every layer
across N devices ("ranks", one process each) so that each holds about 1/N of it
and all N work on every token at once (Shoeybi et al. 2019, Megatron-LM; what
gpt-fast's tp.py, vLLM and SGLang do). Each block is two pairs of products, and
each pair is split the same way:

    column-parallel first: rank r keeps some output rows of W_q, W_k, W_v (its
        heads) and of W_gate, W_up (its slice of the MLP's intermediate units)
        and computes them from the full input. Attention is per head and SwiGLU
        per unit, so both run on the slice with no communication.
    row-parallel second: rank r keeps the matching input columns of W_o and
        W_down. Its product is a partial sum of the full output; an all-reduce
        (the sum over ranks, left on every rank) completes it.

So a block costs two all-reduces of hidden_size values per position, and all
else (embedding, norms, residual adds, the LM head, sampling) runs replicated on
identical values: every rank holds the same hidden state after each all-reduce,
so with the same seed every rank samples the same token and none has to send it.

Heads. A rank keeps whole KV groups (a KV head and the query heads that read
it), so grouped-query attention needs nothing from other ranks and each rank's
KV cache holds only its KV heads (its config says n_kv_heads / N). When N does
not divide the KV heads, the groups are split as evenly as they go: SmolLM2's 3
KV heads (9 query heads) on 2 ranks become 2 and 1. That runs, but unevenly:
rank 0 holds 54% of each layer's weights and rank 1 46% (the MLP splits evenly),
and every all-reduce waits for rank 0. vLLM refuses such a split (the heads must
be divisible by the TP size) and, for N > KV heads, copies KV heads onto several
ranks; here N > KV heads is an error (a rank would have no head).

Embedding and LM head: replicated, the simple choice: each rank looks tokens up
and computes all logits itself, with no communication. It costs memory: SmolLM2's
tied 49,152 × 576 table is a fifth of its weights, and it is not divided. The
vocabulary-parallel alternative gives rank r V/N rows of each: the lookup zeroes
ids outside its rows and all-reduces (one more all-reduce of hidden_size values
per position), the head computes V/N logits and all-gathers them (V values per
token; or each rank samples from its own share and they exchange a candidate).

Cost model, per rank, for N ranks and batch-1 decode (bytes b per value):
    weights  = replicated (embedding, LM head, norms) + sharded (the 7 products) / N
    KV cache = 2 × layers × (KV heads / N) × head_dim × b per token
    compute  ≈ the bytes of its weights / memory bandwidth (decode streams them)
    sent     = 2 × layers all-reduces of hidden_size × b per token
             (fp32: SmolLM2 60 all-reduces of 2,304 bytes, TinyLlama 44 of 8,192)
An all-reduce of a few KB costs its latency, not its bandwidth: a ring over N
ranks takes 2(N−1) hops. Splitting a layer saves (1 − 1/N) × its streaming time,
so TP pays while that exceeds two all-reduces: a TinyLlama layer is 44M × 2 B =
88 MB in bf16, a SmolLM2 layer 3.5M × 4 B = 14 MB in fp32, and the lower the
per-layer compute (faster memory, smaller layers, more ranks) the sooner latency
wins. That is why TP stays inside one machine's fast links (NVLink) and serving
engines cross machines with pipeline parallelism (whole layers per machine).
`python bench.py tp` measures
both sides on this machine: the step with 1 and 2 ranks, the time inside the
all-reduces, and one all-reduce alone.

Failures end, they do not hang: the process group has a timeout (a stalled rank),
a dead peer's closed connection fails the next collective at once, and either
becomes one ConnectionError; ranks that loaded different checkpoints are caught
at setup by comparing fingerprints.
"""

from __future__ import annotations

import datetime
import hashlib
import multiprocessing
import os
import pickle
import queue
import random
import re
import socket
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint
import kvcache
import model
import quantize
import safetensors_io
from sampling import SamplingParams

TIMEOUT_S = 120     # the longest a rank waits for the others (loading included) before giving up


# ----------------------------------------------------------------------------
# Which part of each layer a rank keeps.

@dataclass(frozen=True)
class Part:
    """Rank `rank` of `world` keeps these heads and units of every layer (and all of the rest)."""
    rank: int
    world: int
    kv_heads: range     # its KV heads: whole GQA groups
    heads: range        # the query heads that read them
    units: range        # its slice of the MLP's intermediate units


def even(n: int, world: int, rank: int) -> range:
    """Rank `rank`'s share of n items in `world` contiguous runs; the first n % world
    get one more."""
    size, extra = divmod(n, world)
    lo = rank * size + min(rank, extra)
    return range(lo, lo + size + (rank < extra))


def plan(cfg: model.LlamaConfig, rank: int, world: int) -> Part:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}: need 0 <= rank < world size")
    if world > cfg.n_kv_heads:
        raise ValueError(f"{world} ranks but the model has {cfg.n_kv_heads} KV heads: each rank "
                         f"needs a whole KV head and its query heads; use --tp {cfg.n_kv_heads} "
                         f"or fewer")
    group, kv = cfg.n_heads // cfg.n_kv_heads, even(cfg.n_kv_heads, world, rank)
    return Part(rank, world, kv, range(kv.start * group, kv.stop * group),
                even(cfg.intermediate_size, world, rank))


# Checkpoint names of the split products, and which of a Part's ranges picks their rows
# (column-parallel: W's output rows) or their columns (row-parallel: W's input columns).
COLUMN = {"self_attn.q_proj": "heads", "self_attn.k_proj": "kv_heads",
          "self_attn.v_proj": "kv_heads", "mlp.gate_proj": "units", "mlp.up_proj": "units"}
ROW = {"self_attn.o_proj": "heads", "mlp.down_proj": "units"}


def slice_tensor(name: str, t: torch.Tensor, part: Part, head_dim: int) -> torch.Tensor:
    """A checkpoint tensor -> this rank's copy (its own memory: the full one can go)."""
    # layers.3.self_attn.q_proj.weight -> self_attn.q_proj; a column-parallel product's bias
    # (Qwen2's q/k/v) goes with its rows
    product = name.split(".", 2)[2].rpartition(".")[0] if name.startswith("layers.") else None
    if product not in COLUMN and product not in ROW:
        return t                        # replicated: embedding, head, norms (Qwen3's per head too)
    which = (COLUMN | ROW)[product]
    # a head: head_dim rows (or columns)
    span, unit = getattr(part, which), 1 if which == "units" else head_dim
    lo, hi = span.start * unit, span.stop * unit
    return (t[lo:hi] if product in COLUMN else t[:, lo:hi]).clone()


# ----------------------------------------------------------------------------
# The one layer that talks: a row-parallel product.

@dataclass
class Comm:
    """What a rank's all-reduces cost (every RowParallel of a model adds to one). On a GPU
    the call returns once NCCL has queued the work, so there `seconds` is the launch only."""
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


class RowParallel(nn.Module):
    """y = Σ_r x_r · W_rᵀ: this rank's product over its slice of the input features (the
    Linear it wraps: the device layer makes it fast by swapping it, kernels.swap_linears),
    then the sum over ranks."""

    def __init__(self, local: nn.Linear, comm: Comm, group=None):
        super().__init__()
        self.local, self.comm, self.group = local, comm, group

    def forward(self, x):
        y = self.local(x)
        t0 = time.perf_counter()
        collective(dist.all_reduce, y, group=self.group)
        self.comm.calls, self.comm.bytes = (self.comm.calls + 1,
                                            self.comm.bytes + y.numel() * y.element_size())
        self.comm.seconds += time.perf_counter() - t0
        return y


def collective(op, *args, **kwargs):
    """Run a torch.distributed call; a peer that died (its socket closed) or stalled past
    the timeout fails it, and that becomes one line instead of a C++ backtrace."""
    try:
        return op(*args, **kwargs)
    # gloo/NCCL errors (DistBackendError, DistStoreError) are RuntimeErrors
    except RuntimeError as e:
        # gloo's [file:line]
        detail = re.sub(r"^\[[^]]*\] ", "", (str(e).strip() or type(e).__name__).splitlines()[0])
        detail = detail.split(". ")[0][:160]
        raise ConnectionError(f"another rank died or stopped answering ({detail}); the launcher's "
                              f"log says which one") from None


# ----------------------------------------------------------------------------
# A rank's model: an ordinary Llama of a narrower config.

class Rank(model.Llama):
    """A Llama of this rank's narrower config, with what it holds of the whole (``part``) and
    the counter its RowParallel layers share (``comm``)."""
    part: Part | None = None
    comm: Comm | None = None


def shard(full: model.Llama, part: Part, group=None) -> Rank:
    """This rank's model: the same Llama class built from a config with its head and unit
    counts (attention reads them from there, and so does new_cache: the cache holds only
    its KV heads), its slices of each product, and o_proj/down_proj wrapped in RowParallel."""
    c = full.config
    if quantize.scheme(full):
        raise ValueError(f"tensor parallelism splits float weights, and this model is quantized "
                         f"({quantize.scheme(full)['weights']}): load the full-precision "
                         f"checkpoint")
    local = replace(c, n_heads=len(part.heads), n_kv_heads=len(part.kv_heads),
                    intermediate_size=len(part.units))
    state = {name: slice_tensor(name, t, part, c.head_dim)
             for name, t in model.unfuse(full).items()}
    state = safetensors_io.fuse(state, model.FUSED, c.n_layers)
    with torch.device("meta"):
        mine = Rank(local, full.attend)
    mine.load_state_dict(state, assign=True)
    if c.tie_embeddings and not c.eagle:
        mine.tie_head()
    mine.inv_freq = full.inv_freq
    mine.part, mine.comm = part, Comm()
    for block in mine.layers:
        block.self_attn.o_proj = RowParallel(block.self_attn.o_proj, mine.comm, group)
        block.mlp.down_proj = RowParallel(block.mlp.down_proj, mine.comm, group)
    return mine.eval()


def weight_bytes(llama: model.Llama) -> tuple[int, int]:
    """(bytes of the seven split products, bytes every rank holds in full)."""
    split = sum(quantize.weight_bytes(b.self_attn) + quantize.weight_bytes(b.mlp)
                for b in llama.layers)
    return split, quantize.weight_bytes(llama) - split


def describe(llama: model.Llama) -> str:
    """One line for the runner: what this rank holds and what it sends."""
    p, c = llama.part, llama.config
    split, whole = weight_bytes(llama)
    return (f"rank {p.rank} of {p.world}: query {span(p.heads, 'head')}, "
            f"KV {span(p.kv_heads, 'head')}, MLP {span(p.units, 'unit')}; "
            f"{split / 1e6:.1f} MB split + {whole / 1e6:.1f} MB replicated; "
            f"2 all-reduces of {c.hidden_size} values per layer per token")


def span(r: range, what: str) -> str:
    return f"{what} {r.start}" if len(r) == 1 else f"{what}s {r.start}-{r.stop - 1}"


# ----------------------------------------------------------------------------
# Joining the ranks, and checking that they agree.

def start(world: int | None, device: torch.device,
          timeout_s: float = TIMEOUT_S) -> tuple[int, torch.device]:
    """Join the process group that torchrun (or `launch`) describes in the environment:
    NCCL with one GPU per rank (``device`` a CUDA one: this rank's is cuda:LOCAL_RANK), gloo
    on CPUs. Returns (rank, this rank's device)."""
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        n = world or 2
        raise ValueError(f"--tp {n} runs one process per rank: launch it with torchrun "
                         f"--nproc-per-node {n} serve_local.py --tp {n} ...")
    if world is not None and int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"--tp {world} but the launcher started {os.environ['WORLD_SIZE']} "
                         f"processes: use torchrun --nproc-per-node {world}")
    dev = device
    if dev.type == "mps":
        raise ValueError("tensor parallelism runs on CUDA GPUs (NCCL) or CPUs (gloo): "
                         "use --device cuda or cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))     # one GPU per rank
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {dev}: no such CUDA GPU on this machine; use --device cpu")
        torch.cuda.set_device(dev)
    collective(dist.init_process_group, "nccl" if dev.type == "cuda" else "gloo",
               timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dev


def stop():
    """Leave the group together: a barrier first, so that no rank tears down its
    connections while a peer still uses them (gloo then aborts the process at exit:
    "terminate called without an active exception")."""
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:
            pass            # a peer is gone: there is nobody left to wait for
        dist.destroy_process_group()


def fingerprint(llama: model.Llama) -> str:
    """The config, every tensor's name, shape and dtype, and 4,096 evenly spaced values of
    each, bit for bit: a different checkpoint, dtype or version differs (one edited weight
    may not; hashing every byte would read the whole model once more on every rank)."""
    h = hashlib.sha256(repr(llama.config).encode())
    for name, t in sorted(llama.state_dict().items()):
        flat = t.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // 4096)][:4096].contiguous().cpu()
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode()
                 + sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_same(llama: model.Llama, source: str, group=None):
    """Every rank must hold the same model before it keeps its part: the others' slices
    would otherwise be summed with its own into fluent nonsense."""
    every = [None] * dist.get_world_size(group)
    collective(dist.all_gather_object, every, (fingerprint(llama), source), group=group)
    odd = [r for r, (fp, _) in enumerate(every) if fp != every[0][0]]
    if odd:
        (fp0, src0), (fp, src) = every[0], every[odd[0]]
        raise ValueError(f"ranks loaded different models: rank 0 {src0} (fingerprint "
                         f"{fp0[:12]}), rank {odd[0]} {src} (fingerprint {fp[:12]}); start every "
                         f"rank with the same --model and --dtype")


def shared_seed(seed: int | None, group=None) -> int:
    """Ranks draw the same token only from the same random stream: rank 0's seed (a random
    one when none is given) for all."""
    box = [seed if seed is not None else random.randrange(2 ** 31)]
    collective(dist.broadcast_object_list, box, src=0, group=group)
    return box[0]


def load(name: str, device: torch.device, dtype: torch.dtype, attend=model.attend,
         group=None) -> tuple[model.Llama, object]:
    """Every rank: read the checkpoint on the CPU (mmap-backed: no device ever holds all of
    it), check that the ranks agree, keep this rank's part and move it to ``device``; its
    layers attend with ``attend`` (model.attend's signature)."""
    model_dir, cfg, tok = model.read_model_dir(name)
    # before reading any weight
    part = plan(cfg, dist.get_rank(group), dist.get_world_size(group))
    full = model.Llama.from_pretrained(model_dir, "cpu", dtype, cfg, attend)
    check_same(full, str(name), group)
    return shard(full, part, group).to(device), tok


# ----------------------------------------------------------------------------
# Launching ranks from Python (tests, bench.py, the demo): what torchrun does.

def launch(fn, world: int, *args, threads: int = 1, timeout_s: float = TIMEOUT_S,
           limit_s: float = 900) -> list:
    """Run fn(*args) in `world` new processes joined in one gloo group (collectives time out
    after timeout_s; ranks still running after limit_s are killed): each rank's return value,
    or the exception it raised, or a ChildProcessError when it died without one. fn must be
    importable (a module-level function)."""
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as s:      # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box = ctx.Queue()
    procs = [ctx.Process(target=run_rank,
                         args=(fn, rank, world, port, threads, timeout_s, box, args))
             for rank in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + limit_s
    while len(out) < world and time.monotonic() < deadline:
        try:
            rank, value = pickle.loads(box.get(timeout=0.5))
            out[rank] = value
        except queue.Empty:
            if not any(p.is_alive() for r, p in enumerate(procs) if r not in out):
                try:                # a value may still be in the pipe after its process ended
                    rank, value = pickle.loads(box.get(timeout=2))
                    out[rank] = value
                except queue.Empty:
                    break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    return [out[r] if r in out
            else ChildProcessError(f"rank {r} ended (exit code {p.exitcode}) without a result")
            for r, p in enumerate(procs)]


def run_rank(fn, rank, world, port, threads, timeout_s, box, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    try:
        start(world, torch.device("cpu"), timeout_s)
        value = fn(*args)
    except Exception as e:          # sent back as a plain exception: gloo's own may not pickle
        value = e if type(e).__module__ == "builtins" else RuntimeError(f"{type(e).__name__}: {e}")
    finally:
        stop()
    # Pickled here, by value: the queue's own pickler would share tensors through this
    # process's memory, gone by the time they are read.
    box.put(pickle.dumps((rank, value)))
    box.close()
    box.join_thread()


# ----------------------------------------------------------------------------
# What one rank does in the demo.

def generate(llama: model.Llama, prompt: list[int], new_tokens: int, seed: int | None = None,
             temperature: float = 0.0, cache: str = "static") -> list[int]:
    """new_tokens tokens (EOS ignored) from the cached decoder, on a `cache` sized to fit."""
    p = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=new_tokens,
                       ignore_eos=True)
    kv = kvcache.new_cache(llama, cache, len(prompt) + new_tokens + 1)
    return list(model.generate_cached(llama, prompt, p, cache=kv))


def demo_rank(name: str, prompt: list[int], new_tokens: int) -> dict:
    llama, _ = load(name, torch.device("cpu"), torch.float32)
    tokens = generate(llama, prompt, new_tokens)
    return {"tokens": tokens, "bytes": weight_bytes(llama),
            "kv": kvcache.new_cache(llama, "static", 1024).nbytes,
            "comm": llama.comm, "describe": describe(llama)}


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="tensor parallelism: N CPU ranks against one process")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    one, tok = model.load(args.model, "cpu", "float32")
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    plain = generate(one, prompt, args.tokens)
    ranks = launch(demo_rank, args.ranks, args.model, prompt, args.tokens)
    for r in ranks:
        if isinstance(r, Exception):
            raise SystemExit(f"error: {r}")
    split, whole = weight_bytes(one)
    print(f"1 process: {split / 1e6:.1f} MB to split + {whole / 1e6:.1f} MB replicated, KV "
          f"{kvcache.new_cache(one, 'static', 1024).nbytes / 1e6:.1f} MB for 1,024 tokens")
    for r in ranks:
        print(f"{r['describe']}; KV {r['kv'] / 1e6:.1f} MB for 1,024 tokens; "
              f"{r['comm'].calls} all-reduces, {r['comm'].bytes / 1e6:.2f} MB sent")
    same = all(r["tokens"] == plain for r in ranks)
    print(f"{args.tokens} greedy tokens, identical to one process on every rank: {same}")
    print(f"text: {tok.decode(plain)!r}")
