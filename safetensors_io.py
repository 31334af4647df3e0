"""
A Hugging Face model directory: config.json and safetensors, read and written.

The one layout the whole project knows: ``config.json`` (the architecture as numbers),
``model.safetensors`` (or shards listed by ``model.safetensors.index.json``) and tokenizer
files. safetensors is a JSON header followed by raw tensor bytes, so a reader can ``mmap``
the file and hand out tensors that are views of the page cache: a 1.1B fp16 model
(1.1B · 2 B = 2.2 GB) costs no extra copy until a tensor is converted or written to.

The model multiplies some groups of matrices as one (q/k/v, gate/up: FUSED). A file may
store such a group stacked, its header naming the parts and their rows: read_weights hands
the parts out as row views of the stack, and fuse (or cast, for another dtype) joins them
back without a copy. A header may also record the largest |w| of its weights, checked when
the file was written, so a load need not read every weight again to know they are finite
(check_finite). save writes a directory back, the weights to a temporary file renamed into
place; TensorWriter writes a file one tensor at a time, for a conversion that must not hold
the whole model.

Everything that can go wrong on disk (a missing file, a truncated or corrupt weight, a config
this project cannot run, a tensor of the wrong shape) ends in a one-line
:class:`CheckpointError` that says what to do.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file


class CheckpointError(ValueError):
    """A checkpoint could not be found or read; the message says what to do."""


# ----------------------------------------------------------------------------
# An HF directory -> config dict and a state dict (mmap-backed tensors).

def read_config(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {model_dir}: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download it") from None


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed ({e}); re-download it") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"no weights in {model_dir}: expected model.safetensors or "
                          f"model.safetensors.index.json (.bin/.pth checkpoints are not supported)")


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by their Hugging Face names, memory-mapped (no copy until
    converted or moved). A group convert_gguf stored stacked comes back as its parts: row views
    of the stacked matrix."""
    state = {}
    for f in weight_files(Path(model_dir)):
        try:
            with safe_open(f, framework="pt") as h:
                stacked = json.loads((h.metadata() or {}).get("stacked", "{}"))
                state.update((k, h.get_tensor(k)) for k in h.keys())
        except (SafetensorError, OSError, ValueError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"corrupt or truncated weights file {f} ({reason}); "
                                  f"re-download or re-convert it") from None
        for name, parts in stacked.items():
            state.update(zip([p for p, _ in parts], state.pop(name).split([n for _, n in parts])))
    return state


def recorded_max_abs(model_dir: Path) -> float | None:
    """The largest |w| a conversion recorded in its file's header (convert_gguf checks what it
    writes), or None: a checkpoint from elsewhere, or several files. Reads the header only."""
    files = weight_files(Path(model_dir))
    if len(files) != 1:
        return None
    try:
        with safe_open(files[0], framework="pt") as h:
            largest = (h.metadata() or {}).get("max_abs")
    except (SafetensorError, OSError):
        return None
    return float(largest) if largest is not None else None


def check_llama_config(c: dict) -> tuple[float, dict, str]:
    """Refuse, in one line, a config.json this project cannot run; returns RoPE's
    (theta, scaling parameters, scaling kind) for model.LlamaConfig.from_hf."""
    arch = c.get("model_type")
    # Mistral adds a sliding window, Qwen2 a bias on q/k/v, Qwen3 a norm on q/k (model.py)
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"unsupported architecture '{arch}' (config.json model_type): "
                         f"nanoinfer runs Llama-family checkpoints "
                         f"(model_type llama, mistral, qwen2 or qwen3)")
    # Qwen2's q/k/v always have a bias and its config names none; elsewhere attention_bias
    # puts one on o_proj too, which the model has no place for
    for key in ("mlp_bias",) if arch == "qwen2" else ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"unsupported config.json {key}=true: the only biases "
                             f"nanoinfer runs are Qwen2's, on q, k and v")
    if arch in ("qwen2", "qwen3") and c.get("use_sliding_window"):
        raise ValueError("unsupported config.json use_sliding_window=true: Qwen's window covers "
                         "only the layers from max_window_layers on, and a window here covers "
                         "all of them; set it false to attend over the whole context")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported config.json hidden_act '{c['hidden_act']}': expected silu")
    # transformers ≥ 5 writes rope_parameters (theta inside); older files rope_theta +
    # rope_scaling.
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope_scaling type '{kind}' "
                         f"(config.json rope_scaling.rope_type): supported are linear and llama3")
    return theta, rope, kind


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, tuple], model_dir):
    """The checkpoint's tensors (names without "model.") against the shapes the
    config implies: each one present, known and of its shape, else a one-line
    CheckpointError that says which."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint in {model_dir} lacks {len(missing)} tensors "
                              f"(first: {missing[0]}); it is incomplete or not a Llama-family "
                              f"model")
    for name, t in state.items():
        if name not in expected:
            raise CheckpointError(f"unexpected tensor '{name}' in {model_dir}: "
                                  f"not a Llama-family model nanoinfer runs")
        if tuple(t.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)} but config.json "
                                  f"implies {tuple(expected[name])}: "
                                  f"weights and config.json do not belong together")


def check_finite(state: dict[str, torch.Tensor], model_dir):
    """One NaN or inf in a weight turns every logit into garbage, silently. One
    reduction per tensor (no copy) finds it: the sum of finite weights is finite.
    That is still a read of every weight (134.5M · 4 B ≈ 538 MB for SmolLM2 in fp32) at each start,
    so a checkpoint we converted ourselves is checked once, when written: its header
    records the largest |w|, and a tensor whose dtype holds that value is finite."""
    largest = recorded_max_abs(model_dir)
    for name, t in state.items():
        if largest is not None and t.is_floating_point() and largest <= torch.finfo(t.dtype).max:
            continue
        if t.is_floating_point() and not torch.isfinite(t.sum(dtype=torch.float32)):
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointError(f"tensor {name} in {model_dir} holds {bad} non-finite "
                                      f"values (NaN or inf): the checkpoint is corrupt; "
                                      f"re-download or re-convert it")


# ----------------------------------------------------------------------------
# Fused projections. Checkpoints store W_q, W_k, W_v (and W_gate, W_up) apart; the
# model keeps each group stacked by rows in one matrix (model.py says why). A layout
# maps each fused name to its parts, in their row order.

# A quantized layer's scales and minimums (and a K-quant's super-block numbers for them:
# block_scaled); a layer's tensors in a checkpoint: its weight, those, a bias
SCALES = ("weight_scale", "weight_min", "weight_scale_d", "weight_min_d")
SUFFIXES = ("weight", *SCALES, "bias")

FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse(state: dict, layout: dict[str, tuple[str, ...]], n_layers: int) -> dict:
    """Checkpoint tensors -> the model's: each group's parts stacked by rows, in every layer;
    parts that cannot stack (apart) keep their tensors, as ``{fused}.parts.{j}.{suffix}``."""
    for i in range(n_layers):
        for fused, parts in layout.items():
            names = [f"layers.{i}.{p}." for p in parts]
            own = [{k.removeprefix(n): k for k in state if k.startswith(n)} for n in names]
            if not own[0]:
                continue
            if apart([{suffix: state[k] for suffix, k in o.items()} for o in own]):
                for j, o in enumerate(own):
                    for suffix, k in o.items():
                        state[f"layers.{i}.{fused}.parts.{j}.{suffix}"] = state.pop(k)
                continue
            for suffix in own[0]:
                state[f"layers.{i}.{fused}.{suffix}"] = joined(
                    [state.pop(f"{n}{suffix}") for n in names])
    return state


def apart(parts: list[dict[str, torch.Tensor]]) -> bool:
    """Whether a group's parts (each one's tensors by suffix) cannot stack into one matrix: a
    GGUF may hold them at different bits (Q4_K_M keeps some layers' V in Q6_K beside Q4_K Q
    and K: int8 rows beside int4 ones, other scales)."""
    first = parts[0]
    return any(p.keys() != first.keys() or any(
        p[k].dtype != first[k].dtype or p[k].shape[1:] != first[k].shape[1:] for k in p)
        for p in parts[1:])


def back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether the tensors lie one after another in one storage, each contiguous, rows of
    one width: then they already are the matrix that stacks them."""
    first, offset = parts[0], parts[0].storage_offset()
    for p in parts:
        if not (p.dim() and p.is_contiguous() and p.dtype == first.dtype
                and p.device == first.device
                and p.shape[1:] == first.shape[1:] and p.storage_offset() == offset
                and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return False
        offset += p.numel()
    return True


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) by rows. Parts back to back in one storage (the row views
    read_weights makes of a stacked group) are already that matrix: a view over them,
    no copy. Copying costs SmolLM2 30 · (960 + 3,072) · 576 · 4 B ≈ 279 MB of writes in fp32
    (q/k/v and gate/up rows of 30 layers) at every start."""
    if not back_to_back(parts):
        return torch.cat(parts)
    return parts[0].as_strided((sum(len(p) for p in parts), *parts[0].shape[1:]),
                               parts[0].stride())


def cast(state: dict, device, dtype_of) -> dict:
    """Each tensor on ``device`` in dtype_of(name, tensor) (None: its own). The parts of a
    stacked group are converted as one tensor and handed out as views of it again, so
    fuse still joins them without a copy: casting each part and then concatenating
    would write the group twice (a bf16 load of SmolLM2: 30 · (960 + 3,072) · 576 · 2 B ≈ 139 MB
    more)."""
    groups = {}
    for name, t in state.items():
        groups.setdefault(t.untyped_storage().data_ptr() if t.numel() else name, []).append(name)
    out = {}
    for names in groups.values():
        names.sort(key=lambda n: state[n].storage_offset())
        parts, dtypes = [state[n] for n in names], {dtype_of(n, state[n]) for n in names}
        if len(parts) > 1 and len(dtypes) == 1 and back_to_back(parts):
            whole = joined(parts).to(device=device, dtype=dtypes.pop())
            out.update(zip(names, whole.split([len(p) for p in parts])))
        else:
            out.update((n, state[n].to(device=device, dtype=dtype_of(n, state[n])))
                       for n in names)
    return {name: out[name] for name in state}


def stack_layer(state: dict, i: int) -> dict:
    """How convert_gguf stores layer i's FUSED groups (``state``: that layer's tensors, "model."
    names): each group stacked into one tensor per suffix (its weights, a quantized layer's
    scales and minimums, and its biases where it has them: Qwen2's q/k/v), in place; returns the
    header entries that name each stack's parts and rows for read_weights."""
    def own(part):
        return {s: state[f"{part}.{s}"] for s in SUFFIXES if f"{part}.{s}" in state}
    groups = {f"model.layers.{i}.{fused}.{suffix}":
              [[f"model.layers.{i}.{p}.{suffix}", 0] for p in parts]
              for fused, parts in FUSED.items()
              if not apart([own(f"model.layers.{i}.{p}") for p in parts])
              for suffix in SUFFIXES if f"model.layers.{i}.{parts[0]}.{suffix}" in state}
    for name, parts in groups.items():
        for part in parts:
            part[1] = len(state[part[0]])
        state[name] = torch.cat([state.pop(p) for p, _ in parts])
    return groups


def split_fused(state: dict, layout: dict[str, tuple[str, ...]],
                rows: list[dict[str, list[int]]]) -> dict:
    """fuse's inverse: rows[i][fused] lists the row count of each part in layer i."""
    for i, layer_rows in enumerate(rows):
        for fused, parts in layout.items():
            prefix = f"layers.{i}.{fused}."
            for key in [k for k in state if k.startswith(prefix)]:
                if key.startswith(f"{prefix}parts."):       # kept apart: part j's own tensors
                    j, suffix = key.removeprefix(f"{prefix}parts.").split(".", 1)
                    state[f"layers.{i}.{parts[int(j)]}.{suffix}"] = state.pop(key)
                    continue
                for part, t in zip(parts, state.pop(key).split(layer_rows[fused])):
                    state[f"layers.{i}.{part}.{key.removeprefix(prefix)}"] = t.contiguous()
    return state


# ----------------------------------------------------------------------------
# Quantized layers on disk. A checkpoint quantize.py wrote, or convert_gguf made from a GGUF,
# names its layout under config.json's QUANTIZATION_KEY (our own key: transformers'
# "quantization_config" would make it try its own loaders) and stores each quantized Linear as
# ``weight`` (integers: int8, or int4 two to a byte, the even column in the low nibble),
# ``weight_scale`` and ``weight_min`` per group: W = min + q·scale.

QUANTIZATION_KEY = "nanoinfer_quantization"


def join_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values per byte (even column in the low nibble): the portable, on-disk layout.
    A kernel converts it into its own layout at load time."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def split_nibbles(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)


def join_sixes(q: torch.Tensor) -> torch.Tensor:
    """Values -32..31 (int8, a row a multiple of 32 long) in six bits each, 24 bytes per 32 (a
    GGUF's 5- and 6-bit blocks: three bytes per four values where int8 takes four). Each value
    plus 32: the low 4 bits of value i of a block in byte i's low nibble, of value i + 16 in its
    high one; then the top 2 bits of value 8k + j in bits 2k, 2k + 1 of byte 16 + j."""
    u = (q.to(torch.int16) + 32).to(torch.uint8).reshape(q.shape[0], -1, 32)
    low = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
    top = (u >> 4).reshape(*u.shape[:2], 4, 8)
    top = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return torch.cat([low, top], -1).reshape(q.shape[0], -1)


def split_sixes(b: torch.Tensor) -> torch.Tensor:
    """join_sixes' inverse: (rows, 3K/4) bytes -> (rows, K) int8."""
    blocks = b.reshape(b.shape[0], -1, 24)
    low = torch.cat([blocks[..., :16] & 15, blocks[..., :16] >> 4], -1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(4, 1)
    top = ((blocks[..., None, 16:] >> shifts) & 3).reshape(*blocks.shape[:2], 32)
    return ((low | (top << 4)).to(torch.int16) - 32).to(torch.int8).reshape(b.shape[0], -1)


def block_scaled(sub: torch.Tensor | None, d: torch.Tensor | None) -> torch.Tensor | None:
    """A group's scale (or minimum) as one number. A K-quant stores an int8 per group (``sub``)
    and an fp16 per 256-weight super-block (``d``): their product, exact in fp32. Without
    ``d``, ``sub`` as it is."""
    if sub is None or d is None:
        return sub
    return d.float().repeat_interleave(sub.shape[-1] // d.shape[-1], -1) * sub.float()


def derived_minimum(scale: torch.Tensor, scale_d: torch.Tensor | None,
                    per_scale: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layout's minimum that is ``per_scale`` times its scale (Q4_0's -8, Q3_K's -4: a power
    of two, so exact where the product stays in the dtype's range, which the conversion checks
    before it leaves the minimum out): (lo, lo_d) as block_scaled reads them, per_scale · scale,
    or for a K-quant's int8 scale and fp16 super-block number, the same int8 beside
    per_scale · scale_d."""
    if scale_d is None:
        return scale * per_scale, None
    return scale.clone(), scale_d * per_scale


def with_minimums(state: dict[str, torch.Tensor], layers: dict[str, dict]) -> dict:
    """A GGUF conversion's tensors (by checkpoint name without "model.") with the minimums its
    layouts (config.json's map) derive from their scales put in, as if stored (a layout's
    ``min_per_scale``: derived_minimum). A layer whose scale is missing gets none: check_tensors
    names what the checkpoint lacks."""
    for name, spec in layers.items():
        if (per_scale := spec.get("min_per_scale")) is not None and \
                f"{name}.weight_scale" in state:
            lo, lo_d = derived_minimum(state[f"{name}.weight_scale"],
                                       state.get(f"{name}.weight_scale_d"), per_scale)
            state[f"{name}.weight_min"] = lo
            if lo_d is not None:
                state[f"{name}.weight_min_d"] = lo_d
    return state


def indexed(q: torch.Tensor, values) -> torch.Tensor:
    """q as the numbers it stands for: values[q] in fp32 where int4 nibbles index a table (a
    GGUF's IQ4: 16 numbers, as a sequence or a tensor), else q itself."""
    if values is None:
        return q
    return torch.as_tensor(values, dtype=torch.float32, device=q.device)[q.long()]


def widened(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None,
            scale_d: torch.Tensor | None = None, lo_d: torch.Tensor | None = None) -> torch.Tensor:
    """W = lo + q·scale in fp32, a scale (and a minimum) per group of q's columns (one group:
    a scale per row): the value every kernel's sums stand for. ``scale_d``, ``lo_d``: the
    super-blocks' numbers of a K-quant's int8 scale and lo (block_scaled)."""
    scale, lo = block_scaled(scale, scale_d), block_scaled(lo, lo_d)
    rows, cols = q.shape
    g = q.float().reshape(rows, scale.shape[1] if scale.dim() == 2 else 1, -1)
    w = g * scale.float().reshape(rows, -1, 1)
    return (w if lo is None else w + lo.float().reshape(rows, -1, 1)).reshape(rows, cols)


def widen_layers(state: dict[str, torch.Tensor], layers: dict[str, dict]) -> dict:
    """A GGUF conversion's quantized layers (``layers``: config.json's map, by checkpoint name
    without "model.") as fp32 weights, for a reader that runs the plain model: the file's
    exact values, four bytes each. A group stored stacked (FUSED: its parts in one layout) is
    widened as one matrix, so its parts come out back to back again and `fuse` joins them
    without a copy."""
    groups, seen = [], set()
    for name in layers:
        prefix, _, _ = name.rpartition(".")       # "layers.3.self_attn"
        for parts in FUSED.values():
            names = [f"{prefix.rpartition('.')[0]}.{p}" for p in parts]
            if name in names and all(layers.get(n) == layers[name] for n in names) \
                    and name not in seen:
                groups.append(names)
                seen.update(names)
    for names in groups + [[n] for n in layers if n not in seen]:
        spec, rows = layers[names[0]], [len(state[f"{n}.weight"]) for n in names]
        take = lambda suffix: joined([state.pop(f"{n}.{suffix}") for n in names])
        w = take("weight")
        if spec["kind"] in ("int4", "int8"):
            q = indexed(split_nibbles(w), spec.get("values")) if spec["kind"] == "int4" else \
                split_sixes(w) if spec.get("bits") == 6 else w
            blocks, has_min = spec.get("scales") == "blocks", spec.get("min")
            w = widened(q, take("weight_scale"), take("weight_min") if has_min else None,
                        take("weight_scale_d") if blocks else None,
                        take("weight_min_d") if blocks and has_min else None)
        state.update(zip([f"{n}.weight" for n in names], w.float().split(rows)))
    return state


# ----------------------------------------------------------------------------
# Tensors -> an HF directory: the one writer (random test models, quantized
# checkpoints, trained drafts all go through it).

def save(out_dir, tensors: dict[str, torch.Tensor], config: dict, copy_files_from=None) -> Path:
    """Write an HF Llama directory: ``tensors`` by checkpoint name without the
    "model." prefix (model.unfuse gives them so), ``config`` as config.json, and
    every other file of ``copy_files_from`` that is not weights (tokenizer,
    generation config). The weights are written to a temporary file and renamed,
    so an interrupted save never looks finished."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = {(k if k.startswith("lm_head.") else "model." + k): t.contiguous()
             for k, t in tensors.items()}
    save_file(named, out / "model.safetensors.tmp", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if copy_files_from is not None:
        for f in Path(copy_files_from).iterdir():
            if f.is_file() and f.suffix not in (".safetensors", ".bin", ".gguf") \
                    and f.name != "config.json" and not f.name.endswith(".index.json"):
                shutil.copy2(f, out / f.name)
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    return out


# safetensors' element types by torch dtype (the format's names).
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.float64: "F64", torch.int8: "I8", torch.uint8: "U8",
                      torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                      torch.bool: "BOOL"}


class TensorWriter:
    """A safetensors file written one tensor at a time, for a conversion that must not hold a
    whole model (the safetensors package writes a dict given at once: a 7B GGUF's tensors,
    re-laid, would all sit in memory beside the file's). The header comes first in the format
    and names every tensor's offsets, so ``room`` bytes are left for it, the data written after
    them as it comes, and the header written last, padded with spaces (JSON allows them; the
    format pads its header so too). A header larger than its room moves the data once."""

    def __init__(self, path: Path, room: int):
        self.path, self.room = Path(path), (room + 7) // 8 * 8
        self.file = open(self.path, "wb")
        self.file.seek(8 + self.room)
        self.entries, self.end = {}, 0

    def __enter__(self) -> "TensorWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()       # a conversion that failed: its folder is removed, unfinished

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name} written twice")
        t = t.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self.file.write(data)
        size = t.numel() * t.element_size()
        self.entries[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.end, self.end + size]}
        self.end += size

    def close(self, metadata: dict[str, str]) -> None:
        header = json.dumps({"__metadata__": metadata, **self.entries},
                            separators=(",", ":")).encode()
        if len(header) <= self.room:
            self.file.seek(0)
            self.file.write(self.room.to_bytes(8, "little"))
            self.file.write(header.ljust(self.room))
            self.file.close()
            return
        self.file.close()
        header = header.ljust((len(header) + 7) // 8 * 8)
        moved = self.path.with_name(self.path.name + ".moving")
        with open(self.path, "rb") as src, open(moved, "wb") as dst:
            dst.write(len(header).to_bytes(8, "little"))
            dst.write(header)
            src.seek(8 + self.room)
            shutil.copyfileobj(src, dst, 16 << 20)
        os.replace(moved, self.path)
