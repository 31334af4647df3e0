"""
The KV cache: remember K and V of past tokens instead of recomputing them.

In a decoder, token t attends to the keys and values of tokens 0..t. Those
depend only on earlier tokens, so once computed they never change. A decoder
without a cache re-runs the whole prefix every step (step t pushes t positions
through every layer); with a cache, step t runs one position and reads t cached
rows. Generating N tokens drops from N(N+1)/2 position-forwards to N.

The price is memory. Per token and layer the cache holds one K and one V row
per KV head:

    bytes per token per layer = 2 · n_kv_heads · d_head · dtype_size
    Llama-2-7B   (32 KV heads, d_head 128, fp16): 16 KiB; × 32 layers = 512 KiB per token, 16 GiB at 32K
    Llama-3-70B  ( 8 KV heads, GQA):               4 KiB; × 80 layers = 10 GiB at 32K, 40 GiB at 128K
    the same 70B with 64 KV heads (MHA):          80 GiB at 32K — GQA is an 8× cache saving
    SmolLM2-135M ( 3 KV heads, d_head 64, bf16): 768 B; × 30 layers = 22.5 KiB per token

`python kvcache.py --config llama2-7b --seq 32768` prints these for any config.

Three contiguous caches share one interface (paged, quantized and speculative
code build on it):

* ``DynamicCache`` grows as tokens arrive, doubling its capacity, so appending
  is an amortised O(1) copy rather than a ``torch.cat`` of the whole history.
* ``StaticCache`` is preallocated to ``max_len``: every decode step sees the
  same tensor shapes, so ``torch.compile`` compiles the step once, and the
  memory is known up front. Unwritten rows are hidden by the mask.
* ``SlidingWindowCache`` (Mistral-style ``sliding_window`` configs) is a ring
  buffer of the last W positions (plus a little slack so speculative decoding
  can roll back): memory O(W) however long the conversation.

The interface. A cache has ``layers``; per forward pass the model calls
``cache.begin(positions)`` once (host-side bookkeeping: grow, copy-on-write,
advance ``length``) which returns the attention mask over the keys that each
layer's ``update(k, v, positions)`` will return; ``crop(n)`` rolls back to the
first n tokens (a chat turn that diverges, rejected speculative tokens);
``fork()`` makes a branch that shares the prefix until either side writes;
``nbytes`` is the memory the cache's tensors really occupy.

Any of them can store K and V quantized (``codec``, from quantize.py: int8 or
fp8 with a scale per token and head): rows of bytes instead of numbers, about
half of bf16's, decoded one layer at a time when attention reads them.
"""

from __future__ import annotations

import argparse

import torch

from quantize import KVCodec


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_size: float) -> float:
    return n_layers * 2 * n_kv_heads * head_dim * dtype_size


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(T, L) bool: query at q_pos[i] may read key at k_pos[j]. Causal, and with a
    sliding window only the last ``window`` positions. Key slots that hold no
    token carry position -1 (ring) or a position beyond every query (static)."""
    q, k = q_pos[:, None], k_pos[None, :]
    ok = (k <= q) & (k >= 0)
    if window is not None:
        ok &= k > q - window
    return ok


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share: what a cache of ``a`` can keep for ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Shared:
    """A reference count on storage: forks share it until one of them writes."""
    def __init__(self):
        self.refs = 1


class KVCache:
    """What every contiguous cache has in common; subclasses say how storage grows."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, dtype, device, capacity, window=None,
                 codec: KVCodec | None = None):
        self.spec = (batch, n_kv_heads, head_dim, dtype, torch.device(device))
        self.window = window   # a model with sliding-window attention masks beyond it in any cache
        self.codec = codec     # quantized storage (quantize.py): rows of bytes, decoded when read
        self.k = [self._alloc(capacity) for _ in range(n_layers)]
        self.v = [self._alloc(capacity) for _ in range(n_layers)]
        self.layers = [_Layer(self, i) for i in range(n_layers)]
        self.length = 0
        self._shared = _Shared()

    def _alloc(self, capacity):
        b, h, d, dtype, device = self.spec
        if self.codec is not None:
            return torch.zeros(b, h, capacity, self.codec.row_bytes(d), dtype=torch.uint8, device=device)
        return torch.zeros(b, h, capacity, d, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def limit(self) -> int | None:
        """The most tokens this cache can hold (None: no limit of its own)."""
        return None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def crop(self, n: int):
        self.length = min(self.length, n)

    def fork(self) -> "KVCache":
        """A branch with the same contents. No data is copied now: both point at
        the same storage, and whichever writes first takes a private copy."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.k, twin.v = list(self.k), list(self.v)
        twin.layers = [_Layer(twin, i) for i in range(len(self.layers))]
        self._shared.refs += 1
        return twin

    def _reallocate(self, capacity: int, rows: int):
        """Move to fresh storage of ``capacity`` rows, keeping the first ``rows``."""
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                store[i] = self._alloc(capacity)
                store[i][:, :, :rows] = old[:, :, :rows]

    def _own(self, rows: int):
        """Before writing: if the storage is shared, copy the first ``rows`` rows
        (the part that matters) into storage of our own."""
        if self._shared.refs > 1:
            self._shared.refs -= 1
            self._shared = _Shared()
            self._reallocate(self.capacity, rows)

    def begin(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Called once per forward pass with the new tokens' positions (T,).
        Returns the (T, L) mask for the keys that update() will return, or None
        when every returned key is visible (one new token, no window)."""
        raise NotImplementedError

    def _write(self, layer: int, k, v, positions):
        raise NotImplementedError


class _Layer:
    """One layer's view of its cache: ``update`` stores the new rows and returns all keys/values."""
    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """k, v: (batch, n_kv_heads, T, d_head) -> K, V: (batch, n_kv_heads, L, d_head).
        A quantized cache encodes the new rows and decodes this layer's rows for
        attention: one layer's K and V exist in full precision at a time, briefly."""
        codec = self.cache.codec
        if codec is None:
            return self.cache._write(self.index, k, v, positions)
        K, V = self.cache._write(self.index, codec.encode(k), codec.encode(v), positions)
        return codec.decode(K, k.dtype), codec.decode(V, v.dtype)


class DynamicCache(KVCache):
    """Contiguous, growing: positions 0..length-1 live in rows 0..length-1."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 window=None, chunk=256, codec=None):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, dtype, device, 0, window, codec)
        self.chunk = chunk

    def begin(self, positions):
        t = positions.shape[-1]
        self._own(self.length)
        if self.length + t > self.capacity:
            # Double (at least one chunk): N tokens cost O(N) copying in total, not O(N²).
            self._reallocate(max(self.length + t, 2 * self.capacity, self.chunk), self.length)
        self._start, self.length = self.length, self.length + t
        if t == 1 and self.window is None:
            return None
        return attention_mask(positions, torch.arange(self.length, device=positions.device), self.window)

    def _write(self, layer, k, v, positions):
        end = self._start + k.shape[2]
        self.k[layer][:, :, self._start:end] = k
        self.v[layer][:, :, self._start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class StaticCache(KVCache):
    """Preallocated to ``max_len``; position p lives in row p. Attention always
    reads all ``max_len`` rows and the mask hides rows past the query, so the
    shapes of a decode step never change (one compilation) and a crop is free:
    stale rows sit beyond every future query until they are overwritten."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype=torch.float32, device="cpu",
                 window=None, codec=None):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, dtype, device, max_len, window, codec)
        self.slots = torch.arange(max_len, device=device)

    @property
    def limit(self) -> int:
        return self.capacity

    def begin(self, positions):
        t = positions.shape[-1]
        if self.length + t > self.capacity:
            raise ValueError(f"static cache is full: {self.length} + {t} tokens > max_len {self.capacity}")
        self._own(self.length)
        self.length += t
        return attention_mask(positions, self.slots, self.window)

    def _write(self, layer, k, v, positions):
        # index_copy_ at tensor positions: no host sync, same graph every step
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)
        return self.k[layer], self.v[layer]


class SlidingWindowCache(KVCache):
    """A ring buffer of ``window + slack`` rows: position p lives in row p mod C.

    A forward pass attends over [ring contents, new tokens] and then writes the
    new tokens into the ring, so a prefill longer than the window still sees
    every key it needs. The slack rows keep positions just outside the window,
    so ``crop`` can roll back up to ``slack`` tokens (speculative decoding)."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, window, dtype=torch.float32, device="cpu",
                 slack=64, codec=None):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, dtype, device, window + slack, window, codec)
        self.slack = slack
        self.slot_pos = torch.full((window + slack,), -1, dtype=torch.long, device=device)

    def crop(self, n: int):
        if n < self.length - self.slack:
            raise ValueError(f"a sliding-window cache can roll back at most {self.slack} tokens "
                             f"(asked {self.length} -> {n})")
        self.slot_pos = self.slot_pos.masked_fill(self.slot_pos >= n, -1)
        super().crop(n)

    def fork(self):
        twin = super().fork()
        twin.slot_pos = self.slot_pos.clone()
        return twin

    def begin(self, positions):
        self._own(self.capacity)
        t = positions.shape[-1]
        mask = attention_mask(positions, torch.cat([self.slot_pos, positions]), self.window)
        # Only the last C new tokens survive in the ring; earlier ones are read this pass only.
        keep = positions[-self.capacity:]
        self._rows = keep % self.capacity
        self.slot_pos = self.slot_pos.index_copy(0, self._rows, keep)
        self.length += t
        return mask

    def _write(self, layer, k, v, positions):
        keys = torch.cat([self.k[layer], k], dim=2)
        values = torch.cat([self.v[layer], v], dim=2)
        n = self._rows.shape[0]
        self.k[layer].index_copy_(2, self._rows, k[:, :, -n:])
        self.v[layer].index_copy_(2, self._rows, v[:, :, -n:])
        return keys, values


# ----------------------------------------------------------------------------
# The memory calculator: what a cache costs before you allocate it.

PRESETS = {  # name: (layers, KV heads, d_head)
    "llama2-7b": (32, 32, 128),
    "llama3-70b": (80, 8, 128),
    "llama3-70b-mha": (80, 64, 128),
    "tinyllama": (22, 4, 64),
    "smollm2-135m": (30, 3, 64),
}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.2f} {unit}"
        n /= 1024


def shape_of(config: str) -> tuple[int, int, int]:
    if config in PRESETS:
        return PRESETS[config]
    import json
    from pathlib import Path
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"error: no preset or config.json '{config}'; presets: {', '.join(PRESETS)}")
    c = json.loads(path.read_text())
    heads = c["num_attention_heads"]
    return (c["num_hidden_layers"], c.get("num_key_value_heads") or heads,
            c.get("head_dim") or c["hidden_size"] // heads)


def calculator(config: str, seq: int, batch: int, dtype: str, gpu_gib: float | None) -> str:
    layers, kv_heads, d_head = shape_of(config)
    size = DTYPE_BYTES[dtype]
    per_layer = kv_bytes_per_token(1, kv_heads, d_head, size)
    per_token = per_layer * layers
    lines = [f"{config}: {layers} layers, {kv_heads} KV heads, d_head {d_head}, {dtype}",
             f"  per token per layer: 2 · {kv_heads} · {d_head} · {size} = {per_layer:.0f} B/token/layer",
             f"  per token:           {human(per_token)}/token",
             f"  per sequence of {seq}: {human(per_token * seq)}",
             f"  batch of {batch}:      {human(per_token * seq * batch)}"]
    if gpu_gib:
        total = per_token * seq * batch
        fits = int(gpu_gib * 2**30 // (per_token * seq))
        lines.append(f"  on a {gpu_gib:g} GiB GPU: the cache alone takes {100 * total / (gpu_gib * 2**30):.0f}% "
                     f"of memory; at most {fits} sequences of {seq} fit (before weights)")
    return "\n".join(lines)


def _main():
    ap = argparse.ArgumentParser(description="KV cache memory calculator and demos")
    ap.add_argument("--config", default="smollm2-135m", help=f"config.json path or preset: {', '.join(PRESETS)}")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="fp16", choices=list(DTYPE_BYTES))
    ap.add_argument("--gpu-gib", type=float, default=None)
    ap.add_argument("--demo", choices=["prefix", "measure"], default=None,
                    help="prefix: shared-prefix reuse with fork(); measure: bytes held after a real generation")
    args = ap.parse_args()
    if args.demo == "prefix":
        demo_prefix()
    elif args.demo == "measure":
        demo_measure()
    else:
        print(calculator(args.config, args.seq, args.batch, args.dtype, args.gpu_gib))



# ----------------------------------------------------------------------------
# Demos on the bundled model. They need model.py, which sits above this module,
# so they import it when run, never at import time.

HANDBOOK = """Northwind Robotics — field handbook, chapter 3: the harvest season.
Northwind builds small autonomous carts that carry crates of fruit from the rows of an orchard to the
packing shed. Each cart weighs 140 kilograms empty, carries up to 300 kilograms, and drives at a walking
pace of 1.2 metres per second so that pickers can work beside it safely. A cart runs for nine hours on
one battery; the batteries are swapped, not charged in place, and a swap takes about four minutes.
The season starts in the first week of August with early plums, moves to pears at the end of August,
and ends with late apples in the middle of October. During the season every orchard has one Northwind
technician on site from six in the morning until four in the afternoon. The technician's first task
each day is the walk-around: tyres, bumpers, the emergency stop button, the two lidar domes and the
crate latch. A cart that fails any check is tagged with a red card and parked by the shed.
The carts find their way with a map that the technician records at the start of the season by driving
the cart once along every row with the handheld controller. The map must be recorded again if rows
are added, if a fence is moved, or if the cart reports more than three localisation warnings in one
hour. Carts stop for anything taller than twenty centimetres in their path and wait ten seconds; if
the obstacle is still there they reverse one metre and ask the technician for help over the radio.
Pickers signal a full crate by pressing the green button on the cart's side. The cart then drives to
the shed, where a conveyor unloads the crate, and returns to the same row. If the green button is
pressed twice within five seconds, the cart treats it as a mistake and ignores both presses.
Safety rules: nobody rides on a cart; nobody walks in front of a moving cart; the emergency stop may
be pressed by anyone at any time and must be reset by the technician, who writes the reason in the
logbook. Rain is not a problem for the carts, but hail is: at the first sign of hail the technician
sends all carts to the shed with the "home" command on the controller.
Maintenance: the lidar domes are cleaned every morning with a dry cloth, never with water. The crate
latch is greased every Friday. Tyres are replaced every 2,000 kilometres or when the tread is thinner
than three millimetres, whichever comes first. Spare parts are ordered through the regional office in
Lyon, which promises delivery within two working days during the season.
Reporting: at the end of each day the technician sends a short report with the number of crates moved,
the distance driven by each cart, any red cards, and any emergency stops. The record for a single day
is 1,874 crates, set at the Beaulieu orchard in September of last year by a fleet of twelve carts."""

QUESTIONS = [
    "How heavy is an empty cart?", "When does the harvest season start?",
    "What happens if the green button is pressed twice quickly?", "How are the lidar domes cleaned?",
    "What should the technician do when hail starts?", "How often is the crate latch greased?",
    "What is the record number of crates in one day?", "When must the map be recorded again?",
]


def demo_prefix(model_name: str = "smollm2-135m", n_answer: int = 24):
    """Seed exercise 2: one prefill of a shared prompt, forked for many questions."""
    import time
    import model as M
    model, tok = M.load(model_name)
    system = "You are a helpful assistant. Answer from the handbook below in one short sentence.\n\n" + HANDBOOK
    convs = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                 {"role": "user", "content": q}]), add_bos=False)
             for q in QUESTIONS]
    shared = len(convs[0])
    for ids in convs[1:]:
        shared = min(shared, next((i for i, (a, b) in enumerate(zip(convs[0], ids)) if a != b), len(ids)))
    params = M.SamplingParams(max_new_tokens=n_answer)
    print(f"shared prefix: {shared} tokens (system prompt + handbook); {len(QUESTIONS)} questions")

    def answer(ids, cache):
        stats = M.GenerationStats()
        out = list(M.generate_cached(model, ids, params, stats, cache))
        return tok.decode([t for t in out if t not in model.config.eos_ids]), stats

    results = {}
    t0 = time.perf_counter()
    plain = [answer(ids, model.new_cache()) for ids in convs]
    results["re-encode the prefix"] = (plain, time.perf_counter() - t0, 0.0)
    t0 = time.perf_counter()
    base = model.new_cache()
    with torch.inference_mode():
        model(torch.tensor([convs[0][:shared]]), torch.arange(shared), base, last_only=True)
    prefix_s = time.perf_counter() - t0
    forked = [answer(ids[shared:], base.fork()) for ids in convs]
    results["prefill once + fork()"] = (forked, time.perf_counter() - t0, prefix_s)

    print(f"\n| strategy | prefill tokens computed | prefill wall time | total wall time |\n|---|---:|---:|---:|")
    for name, (runs, total, once) in results.items():
        tokens = sum(s.prompt_tokens for _, s in runs) + (shared if once else 0)
        prefill = sum(s.prefill_s for _, s in runs) + once
        print(f"| {name} | {tokens} | {prefill:.2f} s | {total:.2f} s |")
    (a, ta, _), (b, tb, once) = results.values()
    pa = sum(s.prompt_tokens for _, s in a)
    pb = sum(s.prompt_tokens for _, s in b) + shared
    fa, fb = sum(s.prefill_s for _, s in a), sum(s.prefill_s for _, s in b) + once
    same = [x for x, _ in a] == [y for y, _ in b]
    print(f"\nprefill tokens {pa / pb:.1f}x fewer, prefill time {fa / fb:.1f}x lower, "
          f"total {ta / tb:.1f}x lower; identical answers: {same}")
    for q, (text, _) in zip(QUESTIONS[:3], b):
        print(f"  Q: {q}\n  A: {text.strip()}")


def demo_measure(model_name: str = "smollm2-135m", new_tokens: int = 64):
    """The bytes a real cache holds after a generation, against the formula."""
    import model as M
    model, tok = M.load(model_name)
    c = model.config
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about caches."}]),
                        add_bos=False)
    n = len(prompt) + new_tokens
    cache = model.new_cache("static", max_len=n)
    out = list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=new_tokens), cache=cache))
    size = model.embed_tokens.weight.element_size()
    formula = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, size)
    print(f"{model_name}: {c.n_layers} layers × 2 · {c.n_kv_heads} KV heads · {c.head_dim} · {size} B "
          f"= {formula:.0f} B per token")
    print(f"static cache for {n} tokens ({len(prompt)} prompt + {len(out)} generated): "
          f"holds {cache.nbytes} B; formula × {n} = {formula * n:.0f} B; equal: {cache.nbytes == formula * n}")


if __name__ == "__main__":
    _main()
