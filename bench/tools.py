"""The subcommands of bench.py that measure nothing: `report` (RESULTS.md from results/*.json),
`engine` (engine.py's demo: chat requests joining and leaving the batch, step by step) and
`quantize --out DIR` (write a quantized checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch

import checkpoint
import engine
import kernels
import quantize
import results
import safetensors_io
from model import as_dtype, unfuse
from nanoinfer.config import RunConfig
from nanoinfer.load import build, load
from sampling import SamplingParams


def engine_demo(model_name: str, n: int, max_batch: int):
    model, tok = load(RunConfig(model_name, kernels.pick_device()))
    system = "You are a helpful assistant. Answer in one short sentence."
    questions = ["What is 2+2?", "Name a colour.", "What is the capital of France?", "Say hello.",
                 "What do bees make?", "Name a fruit.", "How many legs has a cat?", "What is ice?"]
    eng = engine.Engine(model, max_batch=max_batch)
    for i in range(n):   # the same system prompt: later requests find its blocks in the prefix cache
        chat = [{"role": "system", "content": system}, {"role": "user", "content": questions[i % len(questions)]}]
        ids = tok.encode(tok.apply_chat_template(chat), add_bos=False)
        eng.add_request(ids, SamplingParams(max_new_tokens=8 + 6 * i))
    print(f"{n} requests queued, max batch {max_batch}, {eng.allocator.num_blocks} blocks of "
          f"{eng.allocator.block_size} tokens\n\nstep | running requests | blocks used | finished")
    while eng.has_work():
        events = eng.step()
        done = [e.request_id for e in events if e.finished]
        used = eng.allocator.num_blocks - eng.num_free_blocks
        print(f"{eng.stats().steps:4} | {' '.join(str(e.request_id) for e in events):24} | {used:11} | "
              f"{' '.join(map(str, done))}")
    s = eng.stats()
    print(f"\n{s.steps} steps; prefill computed {s.prefill_tokens} tokens, found {s.cached_tokens} in the "
          f"prefix cache; {s.decode_tokens} decode rows; every block back: {eng.num_free_blocks} free")


def quantize_write(name: str, weights: str, group_size: int, dtype: str, out_dir) -> Path:
    """A quantized checkpoint: the model read in full precision, every Linear
    quantized in its portable layout, written by safetensors_io.save with the scheme
    in config.json; `serve_local.py --model DIR` then loads it as stored."""
    quantize.check_scheme(weights, group_size)
    if weights in (None, "auto", "float"):
        raise ValueError("--out needs --weights int8 or int4")
    source = checkpoint.resolve(name)
    cfg = RunConfig(str(source), torch.device("cpu"), as_dtype(dtype), weights, group_size, prepack=False)
    model = build(source, cfg, prepare=False)
    config = safetensors_io.read_config(source) | {quantize.CONFIG_KEY: quantize.scheme(model)}
    out = safetensors_io.save(out_dir, unfuse(model), config, copy_files_from=source)
    print(f"wrote {out}: {quantize.weight_bytes(model) / 1e6:.0f} MB of weights ({weights}); "
          f"run it with: python serve_local.py --model {out}")
    return out


def engine_args(p):
    """The flags of `python bench.py engine`."""
    p.add_argument("--model", default=checkpoint.DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def report_args(p):
    """The flags of `python bench.py report`."""
    pass


def engine_command(args):
    """`bench.py engine`: the demo, with the machine's busy hint first."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if hint := kernels.busy_machine_hint():
        print(hint)
    engine_demo(args.model, args.requests, args.max_batch)


def report(args):
    """`bench.py report`: RESULTS.md rendered from results/*.json."""
    out, records = results.ROOT / "RESULTS.md", results.load(results.ROOT / "results")
    out.write_text(results.render(records))
    print(f"wrote {out.name} from {len(records)} result files")
