"""The one way a model is assembled for running.

A lesson builds a Llama in plain PyTorch (model.Llama.from_pretrained); running it fast is a series
of swaps on that model, each a lesson's or the device layer's:

    checkpoint (model.py, or quantize.py for one it wrote)
      -> attention: flash.py's choice by name, kernels.cpp's one-token kernel under "sdpa"
      -> quantize every Linear (quantize.quantize_model; the LM head per ``head``)
      -> the CPU's C++ kernels (kernels.swap_quantized), prepacked weights (kernels.prepack)

The compiled step (kernels.compile_decode) and the drafts (load_draft) come on top of a built model.
"""

from __future__ import annotations

from pathlib import Path

import torch

import checkpoint
import drafting
import kernels
import quantize
import safetensors_io
from model import Llama, LlamaConfig, read_model_dir
from tokenizer import Tokenizer


def attention(name: str = "sdpa"):
    """--attn NAME -> the function every layer attends with (kernels.ATTENTION); under "sdpa" a
    one-token pass on a CPU runs kernels.cpp's decode_attention."""
    attend = kernels.attention_named(name)
    return kernels.native_decode(attend) if name == "sdpa" else attend


def build(model_dir, device=None, dtype=None, weights: str | None = None, group_size: int = quantize.GROUP,
          attn: str = "sdpa", prepacked: bool = True, prepare: bool = True, cfg: LlamaConfig | None = None,
          head: str | None = None) -> Llama:
    """A checkpoint directory -> a model ready to run: read it, quantize every Linear if ``weights``
    (int8/int4) asks (the LM head per ``head``: quantize.scheme_of), build the CPU's C++ kernels,
    give eager passes their prepacked weights (``prepacked=False``: half the memory, slower
    several-position passes). ``prepare=False``: quantized layers stay portable (to save)."""
    quantize.check_scheme(weights, group_size)
    cfg = cfg or LlamaConfig.from_hf(safetensors_io.read_config(model_dir))
    if cfg.quantization and weights not in (None, "auto"):
        raise ValueError(f"{model_dir} is already quantized ({cfg.quantization['weights']}); "
                         f"drop --weights or load the full-precision checkpoint")
    device = kernels.pick_device(device)
    dtype = kernels.pick_dtype(dtype, device)
    if cfg.quantization:        # portable layers: swap_quantized prepares them for its kernels
        model = quantize.from_pretrained(model_dir, device, dtype, cfg, attention(attn), prepare=False)
    else:
        model = (drafting.EagleHead if cfg.eagle else Llama).from_pretrained(model_dir, device, dtype,
                                                                             cfg, attention(attn))
    if device.type == "cpu":
        kernels.native_kernels()
    quantize.quantize_model(model, weights, group_size, prepare=False, head=head)
    if prepare:
        kernels.swap_quantized(model, dtype)
    kernels.prepack(model, copies=prepacked)    # a no-op off the CPU
    return model


def load(name: str = checkpoint.DEFAULT_MODEL, device=None, dtype=None, weights: str | None = None,
         group_size: int = quantize.GROUP, attn: str = "sdpa", prepacked: bool = True,
         head: str | None = None) -> tuple[Llama, Tokenizer]:
    """Alias, directory or .gguf -> (model, tokenizer): `build` on the resolved directory, with
    every EOS id either file knows."""
    quantize.check_scheme(weights, group_size)
    model_dir, cfg, tok = read_model_dir(name)
    return build(model_dir, device, dtype, weights, group_size, attn, prepacked, cfg=cfg, head=head), tok


def narrow_draft(stored: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Run a bf16-stored draft in bf16 under an fp32 target on a CPU that computes
    bf16 (avx512_bf16/AMX): its weights hold nothing finer, and drafting is
    memory-bound, so half the bytes is half the time. The bundled EAGLE head
    drafting 3 tokens for fp32 SmolLM2 took 2/3 of its fp32 time in bf16, with the
    same tokens per forward. Verification, and so the output, is the target's."""
    return stored == "bfloat16" and dtype == torch.float32 and device.type == "cpu" and kernels.bf16_supported(device)


def load_draft(name: str, target: Llama, target_tok, device=None, dtype=None,
               compile: bool = False) -> Llama | drafting.MedusaHeads:
    """--draft MODEL: any model name `load` accepts, `bundled` (train.py's EAGLE
    head) or `medusa` (train.py --medusa's heads, or any directory it writes);
    ``compile``: a draft model's one-token step compiled (it then drafts on a static cache).
    A model directory without tokenizer files (what train.py writes: its drafts use
    the target's tokenizer by construction) is checked against the target's."""
    if name in drafting.TRAIN:
        where = drafting.BUNDLED_DRAFT if name == "bundled" else drafting.BUNDLED_MEDUSA
        if not (where / "config.json").is_file():
            raise ValueError(f"no trained draft in {where}: run `{drafting.TRAIN[name]} or pass --draft MODEL")
        name = str(where)
    path = Path(name)
    if path.is_dir() and "medusa_heads" in safetensors_io.read_config(path):
        heads = drafting.MedusaHeads.from_dir(path, target.embed_tokens.weight.dtype, target.embed_tokens.weight.device)
        if len(heads.head_ids) and int(heads.head_ids.max()) >= target.config.vocab_size:
            raise ValueError(f"the Medusa heads in {path} score tokens beyond the target's vocabulary "
                             f"({target.config.vocab_size} ids): they were trained for another model")
        return heads.share_target(target)       # MedusaDraft checks their width
    if path.is_dir() and not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        dev = kernels.pick_device(device)
        if narrow_draft(safetensors_io.read_config(path).get("torch_dtype"), dev, kernels.pick_dtype(dtype, dev)):
            dtype = torch.bfloat16
        draft, tok = build(path, dev, dtype), target_tok
    else:
        draft, tok = load(name, device, dtype)
    drafting.check_same_vocab(target_tok, tok, target, draft)
    if draft.config.eagle:      # its width is checked by EagleDraft, the one way to use it
        drafting.share_target(draft, target)   # a new LM head weight: prepack it
    kernels.prepack(draft)
    return kernels.compile_decode(draft) if compile else draft
