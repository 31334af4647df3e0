"""
train.py — distil a small draft model from the bundled SmolLM2-135M, for speculative decoding.

    python train.py                                  # the full run: ~45 min on 2 CPU cores
    python train.py --max-minutes 1.5 --prompts 4 --new-tokens 24 --out /tmp/draft   # a smoke run

A draft is only useful if it is much cheaper than the target and agrees with it
often (speculative.py). The target is SmolLM2-135M: 30 layers of width 576 and
a 49,152-token vocabulary. The draft keeps the vocabulary (its ids must mean the
same) but is 4 layers of width 192. Why not share the target's embedding and
head at width 576 (allowed, and it would save learning them)? That head alone
is 28M multiply-adds per token, a fifth of a target step: every drafted token
would cost 20% of what it saves. At width 192 the draft's own (tied) embedding
is 9.4M numbers, and it starts from the target's: the target's 576-wide table
projected on its top 192 principal directions.

Three phases, nanoGPT style, everything in this file:

1. Data: the target answers ~100 varied prompts (PROMPTS below, chat template),
   greedily once and then sampled at temperature 0.8 in further rounds so the
   answers differ — the draft learns the text the target actually writes.
2. Teacher: one forward of the target over each finished conversation gives
   its next-token distribution at every answer position; the top 32
   probabilities are kept (they hold nearly all of the mass; the full
   49,152-wide rows would be GBs).
3. Distillation: the draft minimises the cross-entropy to those distributions,
   which is KL(target ‖ draft) up to a constant: −Σ p_target log p_draft over
   the kept tokens. AdamW, warm-up then cosine decay, progress printed. The
   head and its log-softmax over 49,152 tokens are most of the work, so they
   run only where there is a target, in bf16: a step of 8 conversations went
   from ~2.5 s to ~0.8 s, three times the training in the same 45 minutes.

The result is an ordinary HF directory (config.json, model.safetensors in bf16,
the target's tokenizer files): `--draft drafts/smollm2-135m-draft`, or
`--draft bundled`, which is that directory.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch

import checkpoint
import model as M
from speculative import BUNDLED_DRAFT, SUMMARISE

# ----------------------------------------------------------------------------
# The prompts: 10 kinds of request × 10 subjects, plus summaries (the draft must learn to copy).

KINDS = ["Explain {} in simple terms.", "Write a short story about {}.", "Give me three practical tips about {}.",
         "What are the pros and cons of {}?", "Describe {} to a ten-year-old.", "Write a haiku about {}.",
         "Write a short, friendly email to a colleague about {}.", "List five interesting facts about {}.",
         "How do I get started with {}?", "What is the history of {}, briefly?"]
SUBJECTS = ["the water cycle", "learning to cook", "electric cars", "a lighthouse keeper", "saving money",
            "the solar system", "working from home", "learning a new language", "gardening in small spaces",
            "the internet", "volcanoes", "running a small bakery", "public libraries", "training a puppy",
            "the history of chess", "recycling plastic", "a trip to the mountains", "how vaccines work",
            "writing a good CV", "the Roman Empire"]
TEXTS = [
    "Bees visit flowers to collect nectar and pollen. As they move from flower to flower, they carry pollen "
    "that fertilises plants, which lets fruits and seeds form. About a third of the food we eat depends on "
    "pollinators like bees. Their numbers have fallen in many regions because of habitat loss, pesticides "
    "and disease, and farmers now plant wildflower strips to help them.",
    "The town council met on Tuesday and approved a plan to repair the old bridge over the river. Work will "
    "start in March and take about eight months. During the repairs, buses will use the north road, and a "
    "temporary footbridge will be built for pedestrians. The project will cost 2.4 million euros, most of "
    "it paid by the regional government.",
    "A good night's sleep helps memory, mood and health. Adults need seven to nine hours. Keeping a regular "
    "schedule, avoiding screens an hour before bed, and keeping the bedroom cool and dark all help. Caffeine "
    "late in the day can keep people awake for hours.",
]
PROMPTS = [k.format(s) for k in KINDS for s in SUBJECTS] + [SUMMARISE + t for t in TEXTS]

# The draft's shape (HF config.json fields); the rest is copied from the target.
DRAFT = dict(hidden_size=192, intermediate_size=640, num_hidden_layers=4, num_attention_heads=3,
             num_key_value_heads=1, head_dim=64)


def generate_data(target, tok, prompts, new_tokens, deadline, max_rounds=8):
    """Phase 1: the target answers every prompt, round after round until the
    deadline; returns (tokens, prompt length) pairs (template + answer). Round
    0 is greedy (the text the draft must predict when `bench.py speculative`
    decodes greedily); later rounds sample at temperature 0.8 with new seeds,
    so the answers differ.
    The prompts of a round run together through the continuous-batching engine:
    ~90 tok/s here against ~16 tok/s for one conversation at a time.
    EOS is ignored, as `bench.py speculative` ignores it: the draft must also
    follow the target past the end of its answer, at every position the
    benchmark reaches. (A draft trained on answers that stopped at EOS, at most
    160 tokens, agreed with the target on 88% of its training positions but
    accepted only 10% of its guesses over 8 new prompts × 256 tokens.)"""
    from engine import LLM
    llm = LLM(target, tokenizer=tok)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_bos=False) for t in prompts]
    seqs, t0 = [], time.perf_counter()
    with M.ignore_eos(target):
        for r in range(max_rounds):
            for start in range(0, len(ids), 64):      # chunks of a round, so the deadline is kept to a chunk
                chunk = ids[start:start + 64]
                params = [M.SamplingParams(temperature=0.0 if r == 0 else 0.8, top_p=0.95, seed=1000 * r + start + i,
                                           max_new_tokens=new_tokens) for i in range(len(chunk))]
                t1 = time.perf_counter()
                outs = llm.generate(chunk, params, use_tqdm=False)
                seqs += [(p + o.token_ids, len(p)) for p, o in zip(chunk, outs)]
                print(f"data round {r + 1}: {len(seqs)} conversations, {sum(len(s) for s, _ in seqs)} tokens, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
                if time.perf_counter() + (time.perf_counter() - t1) > deadline:   # the next chunk would not fit
                    return seqs
    return seqs


@torch.no_grad()      # not inference_mode: these tensors enter the training graph later
def teacher_targets(target, seqs, top: int):
    """Phase 2: the target's top-`top` next-token probabilities at every answer
    position (the draft only ever guesses answer tokens; the prompt is given)."""
    out = []
    for s, n in seqs:
        probs = torch.softmax(target(torch.tensor([s]), torch.arange(len(s)))[0, n - 1:-1], dim=-1)
        p, idx = probs.topk(top, dim=-1)
        out.append((torch.tensor(s), n, p, idx))
    return out


def make_draft(target: M.Llama, target_dir: Path) -> tuple[M.Llama, dict]:
    hf = checkpoint.read_config(target_dir)
    hf = {k: v for k, v in hf.items() if k not in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads", "head_dim")}
    hf.update(DRAFT, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    draft = M.Llama(M.LlamaConfig.from_hf(hf))
    for name, p in draft.named_parameters():
        if p.dim() == 2 and "embed" not in name:
            scale = 0.02 / math.sqrt(2 * DRAFT["num_hidden_layers"]) if name.endswith(("o_proj.weight",
                                                                                    "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, scale)
    # The target's embedding on its top principal directions: similar tokens start out similar.
    E = target.embed_tokens.weight.detach().float()
    _, _, V = torch.linalg.svd(E - E.mean(0), full_matrices=False)
    small = E @ V[:DRAFT["hidden_size"]].T
    draft.embed_tokens.weight.data.copy_(small / small.std() * E.std())
    return draft, hf


def distil(draft, data, steps, batch, lr, deadline):
    """Phase 3: minimise −Σ p_target log p_draft over the kept tokens, padded batches
    of whole conversations. The 49,152-wide head and its log-softmax are most of
    a step's work, so they run only at answer positions, with bf16 matmuls."""
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    warmup, t0, step = 30, time.perf_counter(), 0
    budget = max(deadline - t0, 1e-9)
    head, draft.lm_head = draft.lm_head, torch.nn.Identity()    # forward now returns the final hidden states
    draft.train()
    for step in range(steps):
        # linear warm-up, then cosine down to lr/10 over the steps or the time, whichever runs out first
        done = max(step / steps, (time.perf_counter() - t0) / budget)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1))))
        picks = [data[i] for i in torch.randint(len(data), (batch,), generator=gen).tolist()]
        T = max(len(s) for s, _, _, _ in picks)
        tokens = torch.zeros(batch, T, dtype=torch.long)
        for b, (s, _, _, _) in enumerate(picks):
            tokens[b, :len(s)] = s
        hidden = draft(tokens, torch.arange(T))                                   # (B, T, d)
        rows = torch.cat([hidden[b, n - 1:len(s) - 1] for b, (s, n, _, _) in enumerate(picks)])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head(rows)
        logq = torch.log_softmax(logits.float(), dim=-1)                           # (rows, V)
        p = torch.cat([q for _, _, q, _ in picks])
        idx = torch.cat([i for _, _, _, i in picks])
        loss = (-(p * logq.gather(-1, idx)).sum(-1) / p.sum(-1)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}: loss {loss.item():.3f}, lr {opt.param_groups[0]['lr']:.2e}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        if time.perf_counter() > deadline:
            print(f"train: time's up after {step + 1} steps", flush=True)
            break
    draft.lm_head = head
    draft.eval()
    return draft


@torch.inference_mode()
def agreement(target, draft, data) -> float:
    """How often the draft's argmax is the target's: the greedy acceptance rate per token."""
    hits = total = 0
    for s, n, p, idx in data:
        d = draft(s[None], torch.arange(len(s)))[0, n - 1:-1].argmax(-1)
        hits += int((d == idx[:, 0]).sum())
        total += len(d)
    return hits / max(total, 1)


def save(draft: M.Llama, hf: dict, target_dir: Path, out: Path):
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in M.unpack(draft).items()}
    state.pop("lm_head.weight", None)    # tied to the embedding
    save_file({"model." + k: v for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "tokenizer.model"):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)
    mb = (out / "model.safetensors").stat().st_size / 1e6
    print(f"wrote {out} ({mb:.1f} MB)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=BUNDLED_DRAFT)
    ap.add_argument("--max-minutes", type=float, default=45.0, help="the whole run, data generation included")
    ap.add_argument("--data-share", type=float, default=0.45, help="at most this share of the time for data")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=288, help="answer length per prompt (EOS ignored)")
    ap.add_argument("--steps", type=int, default=4000, help="an upper bound: the time usually runs out first")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--top", type=int, default=32, help="teacher probabilities kept per position")
    args = ap.parse_args()
    start = time.perf_counter()
    end = start + 60 * args.max_minutes
    target_dir = checkpoint.resolve(checkpoint.DEFAULT_MODEL)
    target, tok = M.load(checkpoint.DEFAULT_MODEL, "cpu", "float32")
    seqs = generate_data(target, tok, PROMPTS[:args.prompts], args.new_tokens,
                         start + 60 * args.max_minutes * args.data_share)
    data = teacher_targets(target, seqs, args.top)
    print(f"teacher: {sum(len(p) for _, _, p, _ in data)} answer positions, {time.perf_counter() - start:.0f} s", flush=True)
    draft, hf = make_draft(target, target_dir)
    n = sum(p.numel() for p in draft.parameters())
    print(f"draft: {n / 1e6:.1f}M parameters ({DRAFT})", flush=True)
    before = agreement(target, draft, data)
    draft = distil(draft, data, args.steps, args.batch, args.lr, end - min(60, 6 * args.max_minutes))  # time to save
    print(f"greedy agreement with the target on the training text: {100 * before:.0f}% -> "
          f"{100 * agreement(target, draft, data):.0f}%", flush=True)
    save(draft, hf, target_dir, args.out)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
