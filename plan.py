"""
plan.py — the inference optimizer: given a machine, a model and a context, choose how
to run it, and say why.

Every earlier lesson adds a knob: the dtype (kernels.py), the cache kind and
size (kvcache.py), a compiled step (kernels.compile_step), speculative
decoding and its k (speculative.py, drafting.py), weight and KV quantization
(quantize.py). A user should not need to know six flags to get them, so the
runner asks this file. `choose` is a pure function of plain data: a Machine (what
the product measured: nanoinfer/machine.py probes it once, in a few seconds, and
caches it), the model's config.json (no weights) and a context; it applies a
handful of rules, each one printed with the numbers behind it
(`python serve_local.py --plan` on this machine, `python plan.py` on three kinds).
The server asks it too, with its engine's batch and pool (`Serving`): the same rules
for the dtype and the weights, then `choose_serving` for what an engine decides
instead of a runner (`python server.py --plan`).

The cost model. Decoding one token is memory-bound: it reads every weight
matrix once, plus the KV cache written so far, and does two flops per weight
read. So

    bytes/token  = weight bytes + ctx · n_layers · 2 · n_kv_heads · d_head · kv_dtype_size
    tok/s        ≤ bandwidth / bytes per token

(SmolLM2-135M in fp32: 135M · 4 B ≈ 540 MB of weights read per token, and
30·2·3·64·4 B = 46 KB of KV per token of context, 2,048 · 46 KB ≈ 94 MB at 2,048
tokens.) Everything the plan chooses attacks one of the two terms, or the fixed
cost per kernel call that the formula leaves out, which on a small model is as
large as the reading:

* fewer bytes per weight: bf16 halves fp32, int8 quarters it, int4 eighths it —
  but only if this machine's kernel for that dtype streams as fast as its fp32
  one. On a CPU without native bf16 (AVX2 only) a bf16 or int4 product converts
  element by element and can be several times slower than fp32; with AMX the
  same products are the fastest. So the plan times a matrix-vector product
  of the model's MLP shape in each dtype and compares ns per weight: measured,
  not assumed.
* fewer calls: a compiled step on a static cache fuses hundreds of small
  kernels into a few (kernels.compile_step), at a one-time compile cost.
* more tokens per read: speculative decoding verifies k guesses in one pass
  that reads the weights once; with an exact verifier it changes no token.
* memory: weights + the KV at the requested context must fit, with 20%
  headroom for activations, the tokenizer and the rest of the machine; when
  they do not, quantize the KV (half the bytes) before the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import checkpoint
import drafting
import quantize
import safetensors_io
from engine import padded_rows, pool_blocks
from kvcache import kv_bytes_per_token
from model import LlamaConfig

DEFAULT_CTX = 2048      # the runner's context when none is asked for (a static cache's size)
HEADROOM = 0.8          # plan to use at most this share of the machine's memory
SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZED = ("int8", "int4", "gguf")
# a narrower dtype must beat fp32 by 10%: the calibration's own noise on a shared machine
MARGIN = 0.9
# a GGUF's own bits are widened to fp32 only where their kernel takes over this many times fp32's
# time per weight: they are exact either way, and hold and read a half (16-bit) to a sixth (Q4_1's
# 5 bits a weight) of fp32's bytes
WIDEN = 2.0


# ----------------------------------------------------------------------------
# The machine: what it computes natively, how much it holds, how fast it reads.

@dataclass
class Machine:
    device: str                 # "cpu", "cuda", "mps"
    name: str                   # the CPU's model name or the GPU's
    bf16: bool                  # bf16 arithmetic in hardware (kernels.bf16_supported)
    fp16: bool
    memory: int                 # bytes
    bandwidth: float            # bytes/s a read stream reaches (kernels.read_bandwidth)
    compiler: str | None        # the C++ compiler inductor would call, or None
    threads: int
    # dtype -> one matrix-vector product's ns per weight
    ns_per_weight: dict = field(default_factory=dict)
    shape: tuple | None = None  # the (rows, columns) those products had


# ----------------------------------------------------------------------------
# The model, from its config.json alone.

# train.py writes the target's shape into its draft
DRAFT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "rope_theta", "max_position_embeddings")


@dataclass
class ModelInfo:
    name: str
    config: LlamaConfig
    matrix_params: int          # every Linear, the LM head included: what a decode step reads
    # the embedding table (a step reads one row of it), 0 if tied to the head
    embed_params: int
    # the checkpoint's own quantization: "gguf" (a GGUF's bits: gguf_hf.convert_gguf),
    # "int8"/"int4" (quantize.py)
    source: str | None = None
    # bundled drafts trained for this model: "bundled", "medusa"
    drafts: list = field(default_factory=list)
    # a GGUF's matrices: parameters per layout kind ("int4", "int8", "half") and their bytes
    file_params: dict = field(default_factory=dict)
    file_bytes: int = 0
    # a GGUF's embedding table apart from the matrices: its bytes (0 where it is the head's)
    # and its layout kind ("float": fp32)
    table_bytes: int = 0
    table_kind: str | None = None
    # a GGUF's LM head layout kind ("float": fp32)
    head_kind: str | None = None

    @property
    def head(self) -> str | None:
        """The LM head's scheme under --weights int8/int4 (quantize.scheme_of): a GGUF's head
        holds the file's own bits (the bundled one's Q8_0), which a re-rounding keeps ("float":
        as loaded, widened to fp32); None: int4 rounds it to int8."""
        return "float" if self.source == "gguf" else None

    @property
    def main_kind(self) -> str | None:
        """The layout most of a GGUF's weights have ("int4" for the bundled Q4_1)."""
        return max(self.file_params, key=self.file_params.get) if self.file_params else None

    def weight_bytes(self, weights: str, dtype: str) -> int:
        """Bytes of weights held: the matrices per ``weights`` ("gguf": as the file holds them;
        int4 keeps the LM head in int8 unless it holds its own bits: quantize.scheme_of; a
        group's scale and minimum travel in ``dtype``), the embedding in ``dtype``."""
        size, c = SIZES[dtype], self.config
        head = c.vocab_size * c.hidden_size
        if weights == "gguf":       # the table as the file holds it, apart unless tied
            floats = self.matrix_params - sum(self.file_params.values())
            return self.file_bytes + self.table_bytes + floats * size
        per = {"float": size, "int8": 1, "int4": 0.5 + 2 * size / quantize.GROUP}[weights]
        body = self.matrix_params - head
        head_scheme = quantize.scheme_of("lm_head", weights, self.head)
        head_bytes = head * {"float": size, "int8": 1, "int4": 1}[head_scheme]
        return int(body * per + head_bytes + self.embed_params * size)

    def token_bytes(self, weights: str, dtype: str) -> int:
        """Bytes one decode step reads: every matrix once (the embedding: one row)."""
        if weights == "gguf":
            return self.weight_bytes(weights, dtype) - self.table_bytes
        return self.weight_bytes(weights, dtype) - self.embed_params * SIZES[dtype]

    def kv_bytes(self, ctx: int, kv_dtype: str, dtype: str) -> int:
        """ctx · n_layers · 2 (K and V) · n_kv_heads · bytes of a head's row (int8: d values
        + a scale)."""
        c = self.config
        row = (quantize.KV_CODECS[kv_dtype].row_bytes(c.head_dim) if kv_dtype != "auto"
               else c.head_dim * SIZES[dtype])
        return round(ctx * kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim,
                                              row / c.head_dim))


def fitting_drafts(hf: dict) -> list[str]:
    """The bundled drafts (drafts/) whose target has this config's shape: train.py copies the
    target's config into the EAGLE head's (one layer); the Medusa heads record vocab and width."""
    try:
        # the target's shape, for both
        eagle = safetensors_io.read_config(drafting.BUNDLED_DRAFT)
    except ValueError:
        return []
    found = []
    for name, where in (("bundled", drafting.BUNDLED_DRAFT), ("medusa", drafting.BUNDLED_MEDUSA)):
        try:
            d = safetensors_io.read_config(where)
        except ValueError:
            continue
        keys = ("vocab_size", "hidden_size") if "medusa_heads" in d else DRAFT_KEYS
        if (all(hf.get(k) == d.get(k) for k in keys)
                and all(hf.get(k) == eagle.get(k) for k in DRAFT_KEYS)):
            found.append(name)
    return found


# hub aliases planned without a download
KNOWN_CONFIGS = {"tinyllama": checkpoint.TINYLLAMA_CONFIG}


def model_info(name: str) -> ModelInfo:
    """--model -> ModelInfo without loading a weight: the alias's known config (TinyLlama,
    offline even when not downloaded), else checkpoint.resolve (the bundled GGUF converts
    once) and its config.json."""
    key = name.lower()
    hf = KNOWN_CONFIGS.get(key) or safetensors_io.read_config(checkpoint.resolve(name))
    c = LlamaConfig.from_hf(hf)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = (c.hidden_size * (q + 2 * kv) + q * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    head = c.vocab_size * c.hidden_size
    source = (c.quantization or {}).get("weights")
    kinds, stored = {}, 0
    layers = dict((c.quantization or {}).get("layers") or {})
    table = layers.pop("embed_tokens", None)
    for layer, layout in layers.items():
        rows, cols = matrix_shape(c, layer)
        kinds[layout_kind(layout)] = kinds.get(layout_kind(layout), 0) + rows * cols
        stored += layout_bytes(layout, rows, cols)
    table_bytes, table_kind, head_kind = 0, None, None
    if source == "gguf":    # the table: at its bits, tied to the head (in it), or fp32 apart
        head_kind = layout_kind(layers.get("lm_head", {"kind": "float"}))
        table_kind = layout_kind(table) if table else head_kind
        table_bytes = (layout_bytes(table, c.vocab_size, c.hidden_size) if table
                       else 0 if c.tie_embeddings else 4 * head)
    return ModelInfo(name, c, c.n_layers * per_layer + head, 0 if c.tie_embeddings else head,
                     source, fitting_drafts(hf), kinds, stored, table_bytes, table_kind, head_kind)


def describe_layouts(info: ModelInfo) -> str:
    """A GGUF's bits by tensor kind: its matrices by layout, largest first, then its LM head's and
    its embedding table's: "matrices int4 groups of 32 79%, int8 groups 21%; LM head int8 groups;
    embedding table int8 groups (the LM head's: tied)"."""
    names = {"int4": "int4 groups of 32", "int4/16": "int4 groups of 16",
             "int4/iq": "int4 of 16 values groups of 32", "int8": "int8 groups",
             "int6": "int8 groups in 6 bits", "half": "16-bit", "float": "fp32"}
    total = sum(info.file_params.values())
    matrices = "matrices " + ", ".join(f"{names[k]} {n / total:.0%}" for k, n in
                                       sorted(info.file_params.items(), key=lambda kv: -kv[1]))
    if info.table_kind is None:
        return matrices
    tied = " (the LM head's: tied)" if info.config.tie_embeddings else ""
    return (f"{matrices}; LM head {names[info.head_kind]}; "
            f"embedding table {names[info.table_kind]}{tied}")


def matrix_shape(c: LlamaConfig, layer: str) -> tuple[int, int]:
    """A Linear's (rows, columns) by its checkpoint name ("layers.3.self_attn.k_proj")."""
    q, kv, h, f = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.hidden_size, \
        c.intermediate_size
    part = layer.rsplit(".", 1)[-1]
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f),
            "lm_head": (c.vocab_size, h), "embed_tokens": (c.vocab_size, h)}[part]


# The product machine.calibrate times for a layout kind, where it is not the kind's own name:
# int4 in groups of 16 runs int4_mm's loop (groups of 32 timed), a scale per half block; int4
# whose nibbles index 16 values (IQ4) the same loop, the values its table.
CALIBRATED_AS = {"int4/16": "int4", "int4/iq": "int4"}


def layout_kind(layout: dict) -> str:
    """A GGUF layout's kind, "int6" for int8 values held in six bits (its 5- and 6-bit blocks),
    "int4/16" for int4 in groups of 16 (its 2- and 3-bit ones), "int4/iq" for int4 whose nibbles
    index 16 values (its IQ4_NL and IQ4_XS)."""
    if layout.get("bits") == 6:
        return "int6"
    if layout.get("values"):
        return "int4/iq"
    return "int4/16" if layout["kind"] == "int4" and layout.get("group") == 16 else layout["kind"]


def layout_bytes(layout: dict, rows: int, cols: int) -> int:
    """Bytes of one matrix in a GGUF layout (gguf_hf.Packed): the integers, then a scale (and a
    minimum) per group: fp32, fp16 (gguf_hf.half_scales), or a K-quant's int8 times an fp16 per
    256 weights."""
    n = rows * cols
    if layout["kind"] == "half":
        return 2 * n
    numbers = 2 if layout.get("min") else 1
    if layout.get("scales") == "blocks":    # int8 per group, fp16 per 256 weights
        extra = n // layout["group"] * numbers + n // 256 * 2 * numbers
    else:
        extra = n // layout["group"] * (2 if layout.get("scales") == "float16" else 4) * numbers
    values = {"int4": n // 2, "int4/16": n // 2, "int4/iq": n // 2,
              "int6": n // 4 * 3}.get(layout_kind(layout), n)
    return values + extra


# ----------------------------------------------------------------------------
# The plan: every choice, and why.

@dataclass
class Serving:
    """What the server's engine (engine.Engine behind server.py) runs beyond the model: how many
    sequences decode together, the bytes of its paged KV pool, and whether the pool caches
    prefixes."""
    max_batch: int
    kv_bytes: int
    block_size: int = 16
    prefix_caching: bool = True


@dataclass
class Plan:
    model: str
    machine: str
    device: str
    dtype: str                       # float32 / bfloat16 / float16
    cache: str = "dynamic"           # kvcache.CACHES
    ctx: int = DEFAULT_CTX
    attn: str = "sdpa"
    compile: bool = False
    # False: the compiled step loads only where an earlier run built it (one answer pays for no
    # compile); a step not on disk runs eagerly
    build: bool = True
    draft: str | None = None         # None / "bundled" (the EAGLE head) / "medusa" / a model
    prompt_lookup: int | None = None
    lookahead: str | None = None     # only ever the user's (--lookahead)
    spec_k: int = 4
    # auto (the checkpoint's) / float (a GGUF's, widened) / int8 / int4
    weights: str = "auto"
    # "gguf": the checkpoint holds a GGUF's own bits, which auto keeps
    stored: str | None = None
    # the LM head's scheme under int4 (ModelInfo.head): None int8, "float" kept
    head: str | None = None
    # "int8": x rounded to 8 bits per 32 for quantized weights (llama.cpp's arithmetic): if asked
    activations: str = "fp32"
    kv_dtype: str = "auto"           # auto (the model's dtype) / int8
    # kernels.prepack's copies (fp32/bf16 weights; quantized ones' prefill copy)
    prepack: bool = True
    reasons: list = field(default_factory=list)
    cost: list = field(default_factory=list)
    serving: Serving | None = None   # a plan for the server's engine (choose_serving)


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e7 else f"{n / 1e6:.1f} MB"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def choose(machine: Machine, info: ModelInfo, ctx: int | None = None,
           answer_tokens: int | None = None, serving: Serving | None = None) -> Plan:
    """The plan for ``info`` on ``machine`` at ``ctx`` tokens (None: the runner's default),
    for a chat (``answer_tokens`` None) or one answer of at most that many tokens; or, with
    ``serving``, for the server's engine (choose_serving). Pure: probe() measures, this decides."""
    c, why = info.config, []
    limit = c.max_seq_len
    if ctx is not None and ctx > limit:
        why.append(f"ctx {limit}: you asked for {ctx}, but {info.name} was trained on {limit} "
                   f"positions (RoPE beyond them is untrained), so the cache holds {limit}")
    ctx = min(ctx or DEFAULT_CTX, limit)
    p = Plan(info.name, machine.name, machine.device, "float32", ctx=ctx, head=info.head,
             reasons=why)
    ns = machine.ns_per_weight

    # dtype: the fewest bytes per weight this device computes natively, and fast.
    if machine.device == "cuda":
        p.dtype = "bfloat16" if machine.bf16 else "float16"
        why.append(f"dtype {p.dtype}: a GPU's tensor cores compute it natively at half fp32's bytes"
                   + ("" if machine.bf16
                      else " (no bf16 on this GPU: fp16, which overflows past 65504)"))
    elif (machine.device == "cpu" and machine.bf16
          and ns.get("bfloat16", 1e9) < MARGIN * ns.get("float32", 0)):
        p.dtype = "bfloat16"
        why.append(f"dtype bfloat16: this CPU computes bf16 natively and its matrix-vector product "
                   f"took {ns['bfloat16']:.3f} ns/weight against fp32's {ns['float32']:.3f} "
                   f"(calibrated)")
    elif machine.device == "cpu" and machine.bf16:
        why.append(f"dtype float32: bf16 is native here but calibrated no faster "
                   f"({ns.get('bfloat16', 0):.3f} ns/weight against fp32's "
                   f"{ns.get('float32', 0):.3f}); fp32 is also the exact reference")
    else:
        why.append(f"dtype float32: no native bf16 on this {machine.device} (bf16 would be "
                   f"converted element by element); fp32 is the exact reference")
    fdt = p.dtype

    why.append("attention sdpa: PyTorch's fused kernel (flash-attention inside on a GPU); "
               "flash.py's tiled version is the lesson, slower when run op by op")

    # Weights: full precision unless they do not fit, or the checkpoint's own bits are 4 and
    # int4 is fast here.
    room = machine.memory * HEADROOM
    # kernels.prepack's copy
    packed = info.token_bytes("float", fdt) if machine.device == "cpu" else 0

    # a quantized layer's prefill copy is in the model's dtype too
    def held(weights, copy=True):
        return info.weight_bytes(weights, fdt) + (packed if copy else 0)

    if info.source in ("int8", "int4"):
        scheme, p.prepack = info.source, held(info.source) <= room
        why.append(f"weights {info.source}: the checkpoint is stored quantized (quantize.py) and "
                   f"loads as it is"
                   + ("" if p.prepack or not packed
                      else "; no fp32 copy for prefills (it would not fit)"))
    elif info.source == "gguf" and machine.device != "cpu":
        p.weights, scheme, p.stored = "float", "float", "gguf"
        why.append(f"weights {fdt}: the GGUF's own bits ({describe_layouts(info)}) run on the "
                   f"CPU's kernels; here they are widened to {fdt} once at load for the tensor "
                   f"cores (--dtype fp32: the file's exact values)")
    elif info.source == "gguf":
        kind, layouts = CALIBRATED_AS.get(info.main_kind, info.main_kind), describe_layouts(info)
        # The file's bits are the default: exact, and a half to a sixth of fp32's bytes to hold
        # and read. Widened only where their kernels cannot be built (no compiler: each call would
        # dequantize) or calibrate at less than half fp32's speed per weight.
        fast = machine.compiler is not None and (
            kind == "half" or ns.get(kind, 0) < WIDEN * ns.get(fdt, 1e9))
        speed = (f"calibrated {kind} {ns[kind]:.3f} ns/weight against {fdt}'s "
                 f"{ns.get(fdt, 0):.3f}" if kind in ns else "half the bytes of fp32")
        p.stored = "gguf"
        if fdt != "float32":
            # exact to the file: its values are fp32 numbers (lo + q·s), and its kernels take fp32
            why.append(f"dtype float32 after all: the GGUF's weights are exact in fp32 (a "
                       f"{fdt} copy would round them) and its kernels run with fp32 activations")
            p.dtype = fdt = "float32"
            packed = info.token_bytes("float", fdt) if machine.device == "cpu" else 0
        if fast or held("float") > room:
            # no fp32 copies for prefills either (2 to 6 times the file's bytes): kernels.wide_mm
            # widens a tile of rows at a time into BLAS's product, a little slower than the copy
            scheme, p.prepack, packed = "gguf", False, 0
            why.append(f"weights as the GGUF holds them ({layouts}): the file's own bits, exact "
                       f"(gguf_hf.Packed), held at about the file's size (prefills widen a tile of "
                       f"rows at a time: no fp32 copy); {speed}")
        else:
            p.weights, scheme = "float", "float"
            cause = ("without a C++ compiler their kernels cannot be built" if
                     machine.compiler is None else f"they compute slower here ({speed})")
            why.append(f"weights {fdt}: the GGUF's own bits ({layouts}), but {cause}, so they "
                       f"are widened to {fdt} once at load: the same values, "
                       f"{gb(held('float'))}" + (" with kernels.prepack's copy" if packed else ""))
    else:
        scheme = next((w for w in ("float", "int8", "int4") if held(w, w == "float") <= room),
                      "int4")
        if scheme != "float":
            p.weights, p.prepack = scheme, held(scheme) <= room
            why.append(f"weights {scheme}: {fdt} weights need {gb(held('float'))} (with the "
                       f"prepacked copy on a CPU), more than {HEADROOM:.0%} of "
                       f"{gb(machine.memory)}; {scheme} holds them in "
                       f"{gb(held(scheme, p.prepack))}"
                       + ("" if held(scheme, False) <= room else
                          " (still too many: expect swapping)")
                       + ("" if p.prepack or not packed
                          else "; no fp32 copy for prefills (it would not fit): "
                          "each prefill widens a matrix at a time"))
        else:
            prepacked = " with kernels.prepack's copy" if packed else ""
            why.append(f"weights {fdt}: {gb(held('float'))}{prepacked} fits in "
                       f"{gb(machine.memory)}")

    if serving is not None:
        return choose_serving(p, machine, info, serving, scheme, held(scheme, p.prepack))

    # Compiled step: removes the per-kernel fixed cost, once a compile is paid for.
    if machine.device == "cuda":
        p.compile = True
        why.append("compiled, static cache: kernels.compile_step records the step as a CUDA graph, "
                   "one launch per token instead of hundreds of ~5 µs ones")
    elif machine.device != "cpu":
        why.append(f"eager, dynamic cache: the compiled step is tuned for CPUs and CUDA, "
                   f"not {machine.device}")
    elif machine.compiler is None:
        why.append("eager, dynamic cache: no C++ compiler ($CXX, g++ or c++) for inductor to "
                   "compile the step")
    elif "bundled" in info.drafts and scheme not in QUANTIZED:
        why.append("eager, dynamic cache: the compiled step runs one token, so with this model's "
                   "draft (below) its verify passes would run eagerly anyway; the eager step with "
                   "the draft measured as fast in bench.py runner, and starts without a compile "
                   "(--compile asks for one)")
    elif answer_tokens is not None:
        p.compile, p.build = True, False
        why.append(f"the compiled one-token step on a static cache of {ctx} tokens if a chat has "
                   f"built it (its package loads in seconds), else eager: one answer of at most "
                   f"{answer_tokens} tokens does not repay a compile (minutes, once); a prompt "
                   f"longer than the cache runs eagerly on a dynamic cache")
    else:
        p.compile = True
        why.append(f"compiled one-token step on a static cache of {ctx} tokens "
                   f"({machine.compiler} found): inductor fuses the step's hundreds of small "
                   f"kernels; the first start compiles it once (minutes: kernels.AheadOfTime), "
                   f"later starts load the package in seconds")
    p.cache = "static" if p.compile else "dynamic"

    # KV: the model's dtype unless weights + KV at ctx do not fit; then int8 (half), then say
    # what ctx fits.
    w_held = held(scheme, p.prepack)
    kv = info.kv_bytes(ctx, "auto", fdt)
    if w_held + kv <= room:
        why.append(f"KV cache {fdt}: {mb(kv)} at {ctx} tokens, with the weights "
                   f"{gb(w_held + kv)} of {gb(machine.memory)}"
                   + (" (RAM taken as the tokens fill it)" if machine.device == "cpu" else ""))
    else:
        p.kv_dtype = "int8"
        kv8 = info.kv_bytes(ctx, "int8", fdt)
        line = (f"KV cache int8: {mb(kv)} in {fdt} at {ctx} tokens does not fit beside "
                f"{gb(w_held)} of weights in {HEADROOM:.0%} of {gb(machine.memory)}; int8 (a "
                f"scale per row) holds it in {mb(kv8)}")
        if w_held + kv8 > room:
            fits = max(0, int((room - w_held) // info.kv_bytes(1, "int8", fdt)))
            line += f", still too much: --ctx {fits} would fit"
        why.append(line)
        kv = kv8

    # Speculative decoding: only with a draft trained for this very model.
    if "bundled" in info.drafts and scheme in QUANTIZED:
        label = "the file's quantized" if scheme == "gguf" else scheme
        why.append(f"no speculation: with {label} weights a step is cheap (a quarter or less of "
                   f"fp32's bytes) and the fixed costs of speculating are not: a pass verifying 5 "
                   f"positions takes ~3 one-row passes' time in the quantized kernels (`python "
                   f"kernels.py` measures both) and the head drafts in 4 eager steps, so bench.py "
                   f"runner measured it slower than plain quantized decoding; --draft bundled asks "
                   f"for it anyway")
    elif "bundled" in info.drafts:
        p.draft, p.prompt_lookup, p.spec_k = "bundled", 3, 4
        exact = ("exact: in fp32 the text is the one plain greedy decoding gives"
                 if fdt == "float32" else
                 f"in {fdt} a pass verifying several positions rounds differently from a "
                 f"one-token step, so greedy texts may part from plain decoding's after a near-tie "
                 f"(--no-speculation: plain)")
        why.append(f"speculation: the bundled EAGLE head (drafts/, trained for this model) "
                   f"guesses {p.spec_k} tokens, prompt lookup (3-grams) copies repeated text "
                   f"first; one target pass checks them; {exact}")
    else:
        why.append("no speculation: no bundled draft was trained for this model (drafts/ holds "
                   "SmolLM2-135M's); --draft MODEL or --prompt-lookup N ask for one")

    # The cost model, in this plan's numbers.
    tok = info.token_bytes(scheme, fdt)
    bw = machine.bandwidth
    p.cost = [
        f"decode reads every weight once per token: {mb(tok)} "
        f"({fdt if scheme == 'float' else 'the file' if scheme == 'gguf' else scheme} matrices; "
        f"the embedding gives one row)",
        f"KV: ctx · {c.n_layers} layers · 2 · {c.n_kv_heads} kv heads · {c.head_dim} dims · "
        f"{'int8 + scale' if p.kv_dtype == 'int8' else f'{SIZES[fdt]} B'} = {mb(kv)} "
        f"at {ctx} tokens",
        f"bytes per token: {mb(tok)} at an empty context, {mb(tok + kv)} at {ctx} tokens",
        f"ceiling at the measured {bw / 1e9:.1f} GB/s read bandwidth: {bw / tok:,.0f} tok/s "
        f"empty, {bw / (tok + kv):,.0f} tok/s at {ctx} tokens (real steps add a fixed cost per "
        f"kernel call)",
        f"memory: {gb(w_held)} of weights"
        + (" (with the prepacked copy)" if packed and p.prepack else "")
        + f" + {mb(kv)} of KV = {(w_held + kv) / machine.memory:.0%} of {gb(machine.memory)}",
    ]
    if p.draft or p.prompt_lookup:
        p.cost.append(f"speculation: a pass over {p.spec_k + 1} positions reads the weights once, "
                      f"so every accepted guess is a token above this ceiling")
    return p


def choose_serving(p: Plan, machine: Machine, info: ModelInfo, s: Serving, scheme: str,
                   w_held: float) -> Plan:
    """The rest of a plan for the server's engine, after the dtype and the weights (the runner's
    rules): a paged pool that many sequences share instead of one sequence's cache, decode
    steps compiled once per batch shape, and batching where the runner would speculate."""
    c, why, fdt = info.config, p.reasons, p.dtype
    p.cache, p.ctx, p.serving = "paged", c.max_seq_len, s
    shapes = sorted({padded_rows(n) for n in range(1, s.max_batch + 1)})
    if machine.device == "cpu" and machine.compiler is not None:
        p.compile = True
        why.append(f"compiled decode steps, one per batch shape ({', '.join(map(str, shapes))} "
                   f"rows; engine.padded_rows pads a batch to the next): inductor fuses a pass's "
                   f"hundreds of small kernels, and the pool is read where it lies; the first "
                   f"start builds them in a background process (minutes) while the server "
                   f"answers on the eager step, later starts load them in seconds")
    elif machine.device == "cpu":
        why.append("eager decode steps: no C++ compiler ($CXX, g++ or c++) for inductor to "
                   "compile them")
    else:
        why.append(f"eager decode steps: the engine's compiled steps are built for a CPU; on "
                   f"{machine.device} its passes run op by op")
    kv_dtype = p.kv_dtype if p.kv_dtype != "auto" else fdt
    per_token = info.kv_bytes(1, p.kv_dtype, fdt)
    blocks = pool_blocks(s.kv_bytes, per_token, s.block_size, s.max_batch, c.max_seq_len)
    why.append(f"KV pool {kv_dtype}: {s.kv_bytes / 2 ** 30:g} GiB (--kv-gib) in {blocks:,} blocks "
               f"of {s.block_size} tokens, {blocks * s.block_size:,} tokens shared by up to "
               f"{s.max_batch} sequences at a time (--max-batch), each up to {c.max_seq_len} tokens"
               + ("; prefix caching: a prompt's full blocks already in the pool are reused, not "
                  "computed again (a chat's earlier turns, an agent's shared system prompt)"
                  if s.prefix_caching else
                  "; no prefix caching (--no-prefix-cache): every prompt is computed whole"))
    if w_held + s.kv_bytes > machine.memory * HEADROOM:
        why.append(f"memory: {gb(w_held)} of weights and the pool's {gb(s.kv_bytes)} are more "
                   f"than {HEADROOM:.0%} of {gb(machine.memory)}: a smaller --kv-gib fits")
    why.append("no speculation: a step reads each weight once for all its rows, so batching "
               "requests raises the tokens per read instead")
    tok, bw = info.token_bytes(scheme, fdt), machine.bandwidth
    p.cost = [
        f"a decode step reads every weight once for all its rows: {mb(tok)}, "
        f"{mb(tok / s.max_batch)} a token at {s.max_batch} rows",
        f"KV: {c.n_layers} layers · 2 · {c.n_kv_heads} kv heads · {c.head_dim} dims in {kv_dtype} "
        f"= {per_token / 1e3:.0f} KB a token of context, which each row reads for itself",
        f"ceiling at the measured {bw / 1e9:.1f} GB/s read bandwidth: {bw / tok:,.0f} steps/s "
        f"at an empty context; each row also multiplies every weight, so on a CPU a step's "
        f"arithmetic grows with its rows, and a large batch makes fewer steps a second",
        f"memory: {gb(w_held)} of weights + {gb(s.kv_bytes)} of KV pool = "
        f"{(w_held + s.kv_bytes) / machine.memory:.0%} of {gb(machine.memory)}",
    ]
    return p


def describe(p: Plan) -> str:
    """What `serve_local.py --plan` prints: the choices with their reasons, then the cost model."""
    lines = [f"plan for {p.model} on {p.machine} ({p.device}): "
             f"{summary(p).removeprefix('plan: ')}", "why:"]
    lines += [f"  - {r}" for r in p.reasons] + ["cost model:"] + [f"  - {c}" for c in p.cost]
    return "\n".join(lines)


def summary(p: Plan) -> str:
    """One line: the plan in effect."""
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    parts = [names.get(p.dtype, p.dtype),
             f"{p.cache} cache" + (f" {p.ctx}" if p.cache == "static" else ""),
             ("compiled" if p.build else "compiled if built before, else eager") if p.compile
             else "eager"]
    if p.attn != "sdpa":
        parts.append(f"attention {p.attn}")
    parts += [f"weights {p.weights}"] if p.weights not in (None, "auto") else []
    parts += ["weights: the file's own bits"] if p.weights == "auto" and p.stored == "gguf" else []
    parts += ["x rounded to 8 bits for quantized weights"] if p.activations == "int8" else []
    parts += [f"KV {p.kv_dtype}"] if p.kv_dtype not in (None, "auto") else []
    spec = ([{"bundled": "EAGLE head", "medusa": "Medusa heads"}.get(p.draft, p.draft)]
            if p.draft else [])
    spec += [f"prompt lookup {p.prompt_lookup}"] if p.prompt_lookup else []
    spec += [f"lookahead {p.lookahead}"] if p.lookahead else []
    parts.append(" + ".join(spec) + f", k {p.spec_k}" if spec else "no speculation")
    return "plan: " + ", ".join(parts)


# Machines of three kinds, as a probe would fill them in (illustrative numbers; `python
# serve_local.py --plan` measures this one): ns per weight of a one-row product in each
# format, at SmolLM2's MLP shape.
EXAMPLES = [
    Machine("cpu", "an AVX2 laptop (fp32 fastest)", False, False, 16 << 30, 20e9, "g++", 8,
            {"float32": 0.30, "int8": 0.70, "int4": 1.20}, (1536, 576)),
    Machine("cpu", "a server CPU with native bf16 and a fast int4 kernel", True, False, 64 << 30,
            40e9, "g++", 16, {"float32": 0.19, "bfloat16": 0.11, "int8": 0.07, "int4": 0.04},
            (1536, 576)),
    Machine("cuda", "a GPU", True, True, 80 << 30, 3e12, "g++", 1, {}, None),
]

if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="The plan for a model on three kinds of machine.")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    ap.add_argument("--ctx", type=int, default=None)
    args = ap.parse_args()
    info = model_info(args.model)
    for machine in EXAMPLES:
        print(describe(choose(machine, info, args.ctx)) + "\n")
    print("this machine, measured: python serve_local.py --plan")
