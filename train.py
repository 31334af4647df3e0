"""
train.py — distil a small draft model from the bundled SmolLM2-135M, for speculative decoding.

    python train.py                                  # the full run: ~45 min on 2 CPU cores
    python train.py --max-minutes 1.5 --prompts 16 --new-tokens 32 --out /tmp/draft   # a smoke run

A draft is only useful if it is much cheaper than the target and agrees with it
often (speculative.py). The target is SmolLM2-135M: 30 layers of width 576 and
a 49,152-token vocabulary. The draft reads the whole vocabulary (its ids must
mean the same) but is 6 layers of width 192, and its head scores only the
8,192 tokens the target is likeliest to write (model.Llama.head_ids; they hold
97% of the target's greedy choices on held-out answers). Another token is
never proposed, and the verification rule stays exact: q = 0 there. Why not
share the target's embedding and head at width 576 (allowed, and it would
save learning them)? That head alone is 28M multiply-adds per token, a fifth
of a target step. At width 192 the draft's own embedding is 9.4M numbers,
tied to its head, and starts from the target's: the target's 576-wide table
projected on its top 192 principal directions. 25 MB allows 6 layers.

Two phases, nanoGPT style, everything in this file:

1. Data and teacher: the target answers ~500 varied prompts (PROMPTS below,
   chat template), greedily once and then sampled at temperature 0.7 in
   further rounds so the answers differ — the draft learns the text the target
   actually writes. As the engine writes each token it also reports the
   target's top 32 next-token probabilities there (they hold nearly all of the
   mass; the full 49,152-wide rows would be GBs): the teacher comes free.
2. Distillation: the draft minimises the cross-entropy to those distributions
   (restricted to its head's tokens), which is KL(target ‖ draft) up to a
   constant: −Σ p_target log p_draft over the kept tokens. AdamW, warm-up then
   cosine decay, progress printed. The head and its log-softmax are most of a
   step, so they run only where there is a target, in bf16, over 8,192 tokens:
   a step of 8 conversations takes 0.53 s with 4 layers against 1.44 s with
   the full 49,152-wide head (0.79 s with 8 layers), so this run affords more
   layers and more data in the same 45 minutes.

The result is an ordinary HF model directory (config.json, model.safetensors
in bf16; no tokenizer files, it uses the target's): `--draft
drafts/smollm2-135m-draft`, or `--draft bundled`, which is that directory.
Two additions to a plain Llama checkpoint, EAGLE-3's convention:
config.json's draft_vocab_size and the tensor model.head_ids (transformers
loads the directory too, warns about that tensor, and scores every token).

What the committed draft's run did (43.6 min): 1,280 conversations, 420k
tokens of data in 26 min (greedy ~380 tok/s, sampled ~240), then 1,623 steps
of 8 conversations (~0.65 s each). It agrees with the target's argmax on 67%
of its training positions and 49% of held-out conversations, and on 48.5% of
the target's greedy answers to bench.py's chat prompts (the previous 4-layer
draft with the full head: 57%, 46%, 42.5%). The gap between training and
held-out text says more data would help more than more steps.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import checkpoint
import model as M
from speculative import BUNDLED_DRAFT, SUMMARISE

# ----------------------------------------------------------------------------
# The prompts: 12 kinds of request × 40 subjects, plus summaries (the draft must learn to copy).

KINDS = ["Explain {} in simple terms.", "Write a short story about {}.", "Give me three practical tips about {}.",
         "What are the pros and cons of {}?", "Describe {} to a ten-year-old.", "Write a haiku about {}.",
         "Write a short, friendly email to a colleague about {}.", "List five interesting facts about {}.",
         "How do I get started with {}?", "What is the history of {}, briefly?",
         "Write a short poem about {}.", "What are common mistakes people make with {}?"]
# None of bench.py's chat prompts' subjects (lighthouse keeper, learning a language, working from
# home, bicycles, tomato soup, weather and climate, noisy neighbours): the benchmark measures new text.
SUBJECTS = ["the water cycle", "learning to cook", "electric cars", "saving money", "the solar system",
            "gardening in small spaces", "the internet", "volcanoes", "running a small bakery", "public libraries",
            "training a puppy", "the history of chess", "recycling plastic", "a trip to the mountains",
            "how vaccines work", "writing a good CV", "the Roman Empire", "photography", "sleep",
            "the ocean", "renewable energy", "playing the guitar", "time management", "birds that migrate",
            "baking bread", "the human heart", "video games", "rainforests", "public speaking", "coffee",
            "the moon landing", "first aid", "honey bees", "trains", "friendship", "a rainy day", "recycling old phones",
            "starting a podcast", "ancient Egypt", "mathematics"]
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
DRAFT = dict(hidden_size=192, intermediate_size=640, num_hidden_layers=6, num_attention_heads=3,
             num_key_value_heads=1, head_dim=64)
HEAD_VOCAB = 8192    # the tokens the draft can propose: the target's most likely ones (model.Llama.head_ids)


def generate_data(target, tok, prompts, new_tokens, top, deadline, max_rounds=8, chunk=128):
    """Phases 1 and 2: the target answers every prompt, round after round until
    the deadline. Returns (tokens, prompt length, p, idx) per conversation: the
    template + answer, and at every answer position the target's `top` most
    likely next tokens (idx) with their probabilities (p), which the engine
    reports as it samples (SamplingParams.logprobs) — the distribution of the
    forward that wrote the token, so the teacher costs no second pass. Round
    0 is greedy (the text the draft must predict when `bench.py speculative`
    decodes greedily); later rounds sample at temperature 0.7 with new seeds,
    so the answers differ but stay close to what greedy decoding writes.
    Conversations run `chunk` at a time through the continuous-batching engine,
    in bf16: ~380 tok/s greedy and ~240 sampled here (288-token answers),
    against ~16 tok/s for one fp32 conversation at a time. Data is what limits
    the draft: a first run on 89k tokens agreed with the target on 88% of its
    training positions but on 22-80% of new answers.
    EOS is ignored, as `bench.py speculative` ignores it: the draft must also
    follow the target past the end of its answer, at every position the
    benchmark reaches."""
    from engine import LLM
    llm = LLM(target, tokenizer=tok, max_batch=chunk, kv_bytes=2 << 30)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_bos=False) for t in prompts]
    jobs = [(r, i) for r in range(max_rounds) for i in range(len(ids))]
    seqs, t0 = [], time.perf_counter()
    with M.ignore_eos(target):
        for start in range(0, len(jobs), chunk):
            part = jobs[start:start + chunk]
            params = [M.SamplingParams(temperature=0.0 if r == 0 else 0.7, top_p=0.95, seed=1000 * r + i,
                                       max_new_tokens=new_tokens, logprobs=top) for r, i in part]
            t1 = time.perf_counter()
            outs = llm.generate([ids[i] for _, i in part], params, use_tqdm=False)
            for (_, i), o in zip(part, outs):
                logp, idx = o.completions[0].logprobs
                seqs.append((torch.tensor(ids[i] + o.token_ids), len(ids[i]), logp.exp(), idx))
            print(f"data: {len(seqs)} conversations (round {part[-1][0] + 1}), "
                  f"{sum(len(s) for s, *_ in seqs)} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
            if time.perf_counter() + (time.perf_counter() - t1) > deadline:   # the next chunk would not fit
                break
    return seqs


def head_tokens(data, vocab: int, n: int) -> torch.Tensor:
    """The n tokens with the most teacher probability over the data, sorted: the
    only ones the draft's head scores. A token outside them is never proposed,
    which costs acceptance only where the target would have chosen it."""
    mass = torch.zeros(vocab)
    for _, _, p, idx in data:
        mass.index_add_(0, idx.flatten(), p.flatten().float())
    return mass.topk(n).indices.sort().values


def make_draft(target: M.Llama, target_dir: Path, ids: torch.Tensor) -> tuple[M.Llama, dict]:
    hf = checkpoint.read_config(target_dir)
    hf = {k: v for k, v in hf.items() if k not in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads", "head_dim")}
    hf.update(DRAFT, tie_word_embeddings=True, torch_dtype="bfloat16", draft_vocab_size=len(ids))
    torch.manual_seed(0)
    draft = M.Llama(M.LlamaConfig.from_hf(hf))
    draft.head_ids.copy_(ids)
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
    draft.tie_head()
    return draft, hf


def distil(draft, data, steps, batch, lr, deadline):
    """Phase 2: minimise −Σ p_target log p_draft over the kept tokens, padded batches
    of whole conversations. The 49,152-wide head and its log-softmax are most of
    a step's work, so they run only at answer positions, with bf16 matmuls."""
    ids, head = draft.head_ids, draft.lm_head
    draft.head_ids, draft.lm_head = None, torch.nn.Identity()   # forward now returns the final hidden states
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    warmup, t0, step = 30, time.perf_counter(), 0
    budget = max(deadline - t0, 1e-9)
    where = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)   # token id -> row of the head
    where[ids] = torch.arange(len(ids))
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
            logits = rows @ draft.embed_tokens.weight[ids].T                       # the tied head's rows
        logq = torch.log_softmax(logits.float(), dim=-1)                           # (rows, HEAD_VOCAB)
        # the teacher restricted to the head's tokens (renormalised: the best the draft can do)
        col = where[torch.cat([i for _, _, _, i in picks])]
        p = torch.cat([q for _, _, q, _ in picks]) * (col >= 0)
        loss = (-(p * logq.gather(-1, col.clamp(min=0))).sum(-1) / p.sum(-1).clamp(min=1e-6)).mean()
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
    draft.head_ids, draft.lm_head = ids, head
    draft.tie_head()
    draft.eval()
    return draft


@torch.inference_mode()
def agreement(draft, data) -> float:
    """How often the draft's argmax is the target's: the greedy acceptance rate per token."""
    hits = total = 0
    for s, n, p, idx in data:
        d = draft(s[None], torch.arange(len(s)))[0, n - 1:-1].argmax(-1)
        hits += int((d == idx[:, 0]).sum())
        total += len(d)
    return hits / max(total, 1)


def save(draft: M.Llama, hf: dict, out: Path):
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in M.unpack(draft).items()}
    state.pop("lm_head.weight", None)    # tied to the embedding
    save_file({"model." + k: v for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    # No tokenizer files: the draft's ids are the target's by construction, and
    # speculative.load_draft checks a tokenizer-less draft against the target's.
    mb = (out / "model.safetensors").stat().st_size / 1e6
    print(f"wrote {out} ({mb:.1f} MB)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=BUNDLED_DRAFT)
    ap.add_argument("--max-minutes", type=float, default=45.0, help="the whole run, data generation included")
    ap.add_argument("--data-share", type=float, default=0.6, help="at most this share of the time for data")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=288, help="answer length per prompt (EOS ignored)")
    ap.add_argument("--steps", type=int, default=4000, help="an upper bound: the time usually runs out first")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--top", type=int, default=32, help="teacher probabilities kept per position")
    ap.add_argument("--head-vocab", type=int, default=HEAD_VOCAB, help="tokens the draft's head scores")
    args = ap.parse_args()
    start = time.perf_counter()
    end = start + 60 * args.max_minutes
    target_dir = checkpoint.resolve(checkpoint.DEFAULT_MODEL)
    # bf16: data and teacher run 2-4x faster than in fp32; the draft only needs the target's likely tokens
    target, tok = M.load(checkpoint.DEFAULT_MODEL, "cpu", "bfloat16")
    data = generate_data(target, tok, PROMPTS[:args.prompts], args.new_tokens, args.top,
                         start + 60 * args.max_minutes * args.data_share)
    held, data = data[::20], [d for i, d in enumerate(data) if i % 20]     # 5% held out: does it generalise?
    ids = head_tokens(data, target.config.vocab_size, args.head_vocab)
    inside = torch.isin(torch.cat([idx[:, 0] for _, _, _, idx in held]), ids).float().mean()
    print(f"head: the {len(ids)} most likely tokens hold {100 * inside:.1f}% of the target's greedy "
          f"choices in held-out conversations", flush=True)
    draft, hf = make_draft(target, target_dir, ids)
    n = sum(p.numel() for p in draft.parameters() if p is not draft.lm_head.weight)
    print(f"draft: {n / 1e6:.1f}M parameters ({DRAFT})", flush=True)
    before = agreement(draft, held)
    draft = distil(draft, data, args.steps, args.batch, args.lr, end - min(90, 9 * args.max_minutes))  # time to save
    print(f"greedy agreement with the target: held-out conversations {100 * before:.0f}% -> "
          f"{100 * agreement(draft, held):.0f}%, training text {100 * agreement(draft, data[::10]):.0f}%",
          flush=True)
    save(draft, hf, args.out)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
