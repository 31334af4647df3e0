"""The one way a model is assembled for running: load(RunConfig).

A lesson builds a Llama in plain PyTorch (model.Llama.from_pretrained); running it fast is a series
of swaps on that model, each a lesson's or the device layer's, all of them here:

    checkpoint (model.py, or quantize.py for one it wrote)
      -> attention: flash.py's choice by name, kernels.cpp's one-token kernel under "sdpa"
      -> quantize every Linear (quantize.quantize_model; the LM head per ``head``)
      -> the CPU's C++ kernels (kernels.swap_quantized), prepacked weights (kernels.prepack)
      -> the compiled one-token step (kernels.compile_decode)

A tensor-parallel rank's part takes the same swaps (load_tp), and the drafts of speculative
decoding load here too (proposer, load_draft).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

import drafting
import kernels
import quantize
import safetensors_io
import speculative
import tp
from model import Llama, LlamaConfig, read_model_dir
from nanoinfer.config import RunConfig
from tokenizer import Tokenizer


def attention(name: str = "sdpa"):
    """--attn NAME -> the function every layer attends with (kernels.ATTENTION); under "sdpa" a
    one-token pass on a CPU runs kernels.cpp's decode_attention."""
    attend = kernels.attention_named(name)
    return kernels.native_decode(attend) if name == "sdpa" else attend


def load(cfg: RunConfig) -> tuple[Llama, Tokenizer]:
    """cfg.model (alias, directory or .gguf) -> (model, tokenizer): `build` on the resolved
    directory, with every EOS id either file knows."""
    model_dir, config, tok = read_model_dir(cfg.model)
    return build(model_dir, cfg, config), tok


def build(model_dir, cfg: RunConfig, config: LlamaConfig | None = None, prepare: bool = True) -> Llama:
    """A checkpoint directory -> a model ready to run as ``cfg`` says: read it, quantize every
    Linear if cfg.weights (int8/int4) asks (the LM head per cfg.head: quantize.scheme_of), build
    the CPU's C++ kernels, give eager passes their prepacked weights (cfg.prepack False: half the
    memory, slower several-position passes), compile the one-token step (cfg.compile), run a
    long prompt in chunks of cfg.prefill_chunk tokens.
    ``prepare=False``: quantized layers stay portable (to save)."""
    config = config or LlamaConfig.from_hf(safetensors_io.read_config(model_dir))
    # a GGUF's own bits load as the file holds them; --weights float widens them (the same
    # values), int8/int4 re-round them, as asked
    stored = (config.quantization or {}).get("weights")
    own = stored is not None and (stored != "gguf" or cfg.weights is None)
    if stored not in (None, "gguf") and cfg.weights is not None:
        raise ValueError(f"{model_dir} is already quantized ({config.quantization['weights']}); "
                         f"drop --weights or load the full-precision checkpoint")
    attend = attention(cfg.attn)
    if own:     # portable layers: swap_quantized prepares them for its kernels
        model = quantize.from_pretrained(model_dir, cfg.device, cfg.dtype, config, attend, prepare=False)
    else:
        read = (drafting.EagleHead if config.eagle else Llama).from_pretrained
        model = read(model_dir, cfg.device, cfg.dtype, config, attend)
    if cfg.device.type == "cpu":
        kernels.native_kernels()
    quantize.quantize_model(model, cfg.weights, cfg.group_size, prepare=False, head=cfg.head)
    if prepare:
        kernels.swap_quantized(model, cfg.dtype, round_x=cfg.activations == "int8")
        if cfg.activations == "int8" and not any(getattr(m, "round_x", False)
                                                 for m in model.modules()):
            raise ValueError("--activations int8 rounds x for quantized weights on the C++ "
                             "kernels (int4, or int8 in groups, fp32 on a CPU), and this model "
                             "has none: drop it")
    kernels.prepack(model, copies=cfg.prepack)    # a no-op off the CPU
    model.prefill_chunk = cfg.prefill_chunk
    if cfg.compile:
        kernels.compile_decode(model, build=cfg.build and not cfg.background_compile)
    return model


def load_compiled(model: Llama) -> Llama:
    """After a background build (cfg.background_compile): the step again, which now loads the package."""
    return kernels.compile_decode(model)


def build_in_background(script: Path, argv: list[str], log: Path) -> subprocess.Popen:
    """``script argv --compile-only`` as a child process, its output to ``log``: how a first start
    of the runner or the server builds its compiled steps while it answers on the eager ones
    (kernels.AheadOfTime loads each once its file is there)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(script), *argv, "--compile-only"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


def build_failed(code: int, log: Path) -> str:
    """The one line a runner or server prints when its background build (build_in_background)
    failed: it goes on answering on the eager step."""
    return f"[the background compile failed (exit {code}, log: {log}); the answers stay on the eager step]"


def load_tp(cfg: RunConfig, device: torch.device, group=None) -> tuple[Llama, Tokenizer]:
    """This rank's part of the model on ``device`` (tp.load: read on the CPU, checked against the
    other ranks, split), then the swaps `build` makes: the CPU's C++ kernels, prepacked weights."""
    model, tok = tp.load(cfg.model, device, cfg.dtype, attention(cfg.attn), group)
    model.prefill_chunk = cfg.prefill_chunk
    if device.type == "cpu":
        kernels.native_kernels()
    return kernels.prepack(model, copies=cfg.prepack), tok


def narrow_draft(stored: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Run a bf16-stored draft in bf16 under an fp32 target on a CPU that computes
    bf16 (avx512_bf16/AMX): its weights hold nothing finer, and drafting is
    memory-bound, so half the bytes is half the time. The bundled EAGLE head
    drafting 3 tokens for fp32 SmolLM2 took 2/3 of its fp32 time in bf16, with the
    same tokens per forward. Verification, and so the output, is the target's."""
    return stored == "bfloat16" and dtype == torch.float32 and device.type == "cpu" and kernels.bf16_supported(device)


def load_draft(name: str, target: Llama, target_tok, compile: bool = False) -> Llama | drafting.MedusaHeads:
    """--draft MODEL: any model name `load` accepts, `bundled` (train.py's EAGLE
    head) or `medusa` (train.py --medusa's heads, or any directory it writes), on the
    target's device in the target's dtype; ``compile``: a draft model's one-token step
    compiled (it then drafts on a static cache: drafting.DraftModel). A model directory without tokenizer files
    (what train.py writes: its drafts use the target's tokenizer by construction) is
    checked against the target's."""
    if name in drafting.TRAIN:
        where = drafting.BUNDLED_DRAFT if name == "bundled" else drafting.BUNDLED_MEDUSA
        if not (where / "config.json").is_file():
            raise ValueError(f"no trained draft in {where}: run `{drafting.TRAIN[name]} or pass --draft MODEL")
        name = str(where)
    path, dtype, device = Path(name), target.dtype, target.device
    if path.is_dir() and "medusa_heads" in safetensors_io.read_config(path):
        heads = drafting.MedusaHeads.from_dir(path, dtype, device)
        if len(heads.head_ids) and int(heads.head_ids.max()) >= target.config.vocab_size:
            raise ValueError(f"the Medusa heads in {path} score tokens beyond the target's vocabulary "
                             f"({target.config.vocab_size} ids): they were trained for another model")
        return heads.share_target(target)       # MedusaDraft checks their width
    cfg = RunConfig(name, device, dtype)
    if path.is_dir() and not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        if narrow_draft(safetensors_io.read_config(path).get("torch_dtype"), device, dtype):
            cfg = replace(cfg, dtype=torch.bfloat16)
        draft, tok = build(path, cfg), target_tok
    else:
        draft, tok = load(cfg)
    drafting.check_same_vocab(target_tok, tok, target, draft)
    if draft.config.eagle:      # its width is checked by EagleDraft, the one way to use it
        drafting.share_target(draft, target)   # a new LM head weight: prepack it
    kernels.prepack(draft)
    return kernels.compile_decode(draft) if compile else draft


def proposer(cfg: RunConfig, target: Llama, tok) -> speculative.Proposer | None:
    """cfg's speculative settings -> a proposer (or None for plain decoding). One at a time.
    cfg.compile compiles a draft model's one-token step; cfg.spec_tree "W,M" makes an
    EAGLE head or Medusa heads draft a tree (EagleDraft.propose_tree, MedusaDraft)."""
    chosen = [name for name, v in (("--draft", cfg.draft), ("--lookahead", cfg.lookahead),
                                   ("--prompt-lookup", cfg.prompt_lookup)) if v is not None]
    if cfg.lookahead is not None and len(chosen) > 1:
        raise ValueError(f"choose one speculative method, not {' and '.join(chosen)} "
                         f"(only --draft and --prompt-lookup combine)")
    speculative.check_k(cfg.spec_k)
    shape = speculative.parse_tree(cfg.spec_tree) if cfg.spec_tree is not None else None
    if cfg.draft is not None:
        model = load_draft(cfg.draft, target, tok, cfg.compile)
        if shape is not None and isinstance(model, Llama) and not model.config.eagle:
            raise ValueError(f"--spec-tree needs an EAGLE head or Medusa heads as the draft (train.py's `bundled` "
                             f"or `medusa`); {cfg.draft} is a standalone draft model")
        found = drafting.draft_proposer(model, target, cfg.spec_k, cfg.adaptive_k, shape)
        return found if cfg.prompt_lookup is None else drafting.LookupThenDraft(found, cfg.prompt_lookup)
    if shape is not None:
        raise ValueError("--spec-tree needs --draft with an EAGLE head or Medusa heads (--draft bundled or medusa)")
    if cfg.lookahead is not None:
        return drafting.Lookahead(*drafting.parse_lookahead(cfg.lookahead))
    if cfg.prompt_lookup is not None:
        return drafting.PromptLookup(cfg.prompt_lookup, cfg.spec_k)
    return None
