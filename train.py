"""
train.py — train an EAGLE draft head (or Medusa heads) for the bundled SmolLM2-135M, for
speculative decoding.

    python train.py                                  # the full run: most of an hour on 2 cores
    python train.py --max-minutes 1.5 --prompts 16 --new-tokens 32 --out /tmp/draft   # a smoke run
    # Medusa heads:
    python train.py --medusa 4 --max-minutes 29 --new-tokens 224 --chunk 32 --batch 4

A draft is only useful if it is much cheaper than the target and agrees with it
often (speculative.py). The target is SmolLM2-135M: 30 blocks of width 576 and
a 49,152-token vocabulary. The draft is an EAGLE head (Li et al. 2024;
drafting.EagleDraft): one block of the target's width whose input at
position j is the next token together with the target's own feature there
(its final normalised hidden state), and which predicts the target's next
feature; the target's LM head, restricted to the 8,192 tokens the target is
likeliest to write (model.Llama.head_ids: 99% of its greedy choices), turns
that into a token. It shares the target's embedding and LM head, so it owns
4.2M numbers (4.2M · 2 B ≈ 8.4 MB in bf16), and a drafted token costs one block where the
target runs 30.

Three phases, nanoGPT style, everything in this file:

1. Data: the target answers ~500 varied prompts (PROMPTS below, chat
   template), greedily once and then sampled at temperature 0.7 in further
   rounds so the answers differ — the head learns the text the target actually
   writes. The engine batches 128 conversations in bf16 (many times the tokens
   per second of one conversation at a time in fp32).
2. Features: one batched bf16 forward over every conversation keeps the
   target's feature at every position (~340k positions × 576 × 2 B ≈ 0.4 GB).
3. Training: at every answer position the head reads (x_j+1, f_j) and must
   predict f_j+1 (smooth L1) and the target's next-token distribution, the
   softmax of f_j+1 through the LM head rows (cross-entropy, i.e. KL up to a
   constant). A second pass feeds the head its own predicted features instead
   of the target's, as drafting steps 2..k do ("training-time test"). AdamW,
   warm-up then cosine decay, progress printed.

The result is an HF-style directory (config.json with "eagle": true and
draft_vocab_size, model.safetensors in bf16; no tokenizer, embedding or LM
head: drafting.load_draft takes the target's): `--draft bundled`.

`--medusa K` trains Medusa heads instead (drafting.MedusaHeads; Cai et al.
2024) from the same two phases, the answers now stopping at EOS as users read
them: head k reads the target's feature f_j alone and learns the target's
distribution over x_j+k+1 (medusa_loss). Their blocks start at zero, so each
head starts as the target's own next-token head. config.json holds
"medusa_heads": K; `--draft medusa`. What the committed heads' run did (the
command above, on a shared 2-core CPU without bf16 arithmetic, so fp32): 32
greedy answers, 7,380 tokens of data and their features, then 165 steps of 4
conversations (the run prints each phase's time). Greedy agreement per head on
held-out conversations 36% / 27% / 16% / 12%, on training text 86% / 79% /
77% / 71%: far too little data, so the heads memorise it (the EAGLE head
above had 1,024 conversations).

What the committed head's run did: 1,024 conversations, 336k tokens of data and
their features, then 731 steps of 8 conversations. It agrees with the target's argmax on 54% of
held-out positions from the target's features (47% from its own predicted
ones, drafting step 2), and 67% / 62% on training text. On the target's
128-token greedy answers to bench.py's 8 chat prompts: 46% / 39%.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import checkpoint
import kernels
import safetensors_io
from engine import LLM
from model import Llama, LlamaConfig, unfuse
from nanoinfer.config import RunConfig
from nanoinfer.load import load
from sampling import SamplingParams
from drafting import BUNDLED_DRAFT, BUNDLED_MEDUSA, EagleHead, MedusaHeads, share_target
from drafting import SUMMARISE

# ----------------------------------------------------------------------------
# The prompts: 12 kinds of request × 40 subjects, plus summaries (the draft must learn to copy).

KINDS = ["Explain {} in simple terms.", "Write a short story about {}.",
         "Give me three practical tips about {}.", "What are the pros and cons of {}?",
         "Describe {} to a ten-year-old.", "Write a haiku about {}.",
         "Write a short, friendly email to a colleague about {}.",
         "List five interesting facts about {}.", "How do I get started with {}?",
         "What is the history of {}, briefly?", "Write a short poem about {}.",
         "What are common mistakes people make with {}?"]
# None of bench.py's chat prompts' subjects (lighthouse keeper, learning a language, working
# from home, bicycles, tomato soup, weather and climate, noisy neighbours): the benchmark
# measures new text.
SUBJECTS = ["the water cycle", "learning to cook", "electric cars", "saving money",
            "the solar system", "gardening in small spaces", "the internet", "volcanoes",
            "running a small bakery", "public libraries", "training a puppy",
            "the history of chess", "recycling plastic", "a trip to the mountains",
            "how vaccines work", "writing a good CV", "the Roman Empire", "photography", "sleep",
            "the ocean", "renewable energy", "playing the guitar", "time management",
            "birds that migrate", "baking bread", "the human heart", "video games", "rainforests",
            "public speaking", "coffee", "the moon landing", "first aid", "honey bees", "trains",
            "friendship", "a rainy day", "recycling old phones", "starting a podcast",
            "ancient Egypt", "mathematics"]
TEXTS = [
    "Bees visit flowers to collect nectar and pollen. As they move from flower to flower, they "
    "carry pollen that fertilises plants, which lets fruits and seeds form. About a third of the "
    "food we eat depends on pollinators like bees. Their numbers have fallen in many regions "
    "because of habitat loss, pesticides and disease, and farmers now plant wildflower strips to "
    "help them.",
    "The town council met on Tuesday and approved a plan to repair the old bridge over the river. "
    "Work will start in March and take about eight months. During the repairs, buses will use the "
    "north road, and a temporary footbridge will be built for pedestrians. The project will cost "
    "2.4 million euros, most of it paid by the regional government.",
    "A good night's sleep helps memory, mood and health. Adults need seven to nine hours. Keeping "
    "a regular schedule, avoiding screens an hour before bed, and keeping the bedroom cool and "
    "dark all help. Caffeine late in the day can keep people awake for hours.",
]
PROMPTS = [k.format(s) for k in KINDS for s in SUBJECTS] + [SUMMARISE + t for t in TEXTS]

# The head's shape: one block of the target's own width (it reads and predicts the target's
# features).
HEAD = dict(num_hidden_layers=1)
# the tokens the head can propose: the target's most likely ones (model.Llama.head_ids)
HEAD_VOCAB = 8192


def generate_data(target, tok, prompts, new_tokens, top, deadline, max_rounds=8, chunk=128,
                  ignore_eos=True):
    """Phase 1: the target answers every prompt, round after round until the
    deadline. Returns (tokens, prompt length, p, idx) per conversation: the
    template + answer, and at every answer position the target's `top` most
    likely next tokens (idx) with their probabilities (p), which the engine
    reports as it samples (SamplingParams.logprobs); they choose the head's
    tokens (head_tokens). Round 0 is greedy (the text the draft must predict
    when `bench.py speculative` decodes greedily); later rounds sample at
    temperature 0.7 with new seeds, so the answers differ but stay close to
    what greedy decoding writes. Conversations run `chunk` at a time through
    the continuous-batching engine, in bf16: many times the tokens per second
    of one fp32 conversation at a time (288-token answers).
    With ignore_eos the draft also learns to follow the target past the end
    of its answer (`bench.py speculative --ignore-eos` reaches there); without,
    the answers stop at EOS, as users read them, and no time goes past it."""
    llm = LLM(target, tokenizer=tok, max_batch=chunk, kv_bytes=2 << 30)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_bos=False)
           for t in prompts]
    jobs = [(r, i) for r in range(max_rounds) for i in range(len(ids))]
    seqs, t0 = [], time.perf_counter()
    for start in range(0, len(jobs), chunk):
        part = jobs[start:start + chunk]
        params = [SamplingParams(temperature=0.0 if r == 0 else 0.7, top_p=0.95, seed=1000 * r + i,
                                 max_new_tokens=new_tokens, logprobs=top, ignore_eos=ignore_eos)
                  for r, i in part]
        t1 = time.perf_counter()
        outs = llm.generate([ids[i] for _, i in part], params, use_tqdm=False)
        for (_, i), o in zip(part, outs):
            logp, idx = o.completions[0].logprobs
            seqs.append((torch.tensor(ids[i] + o.token_ids), len(ids[i]), logp.exp(), idx))
        print(f"data: {len(seqs)} conversations (round {part[-1][0] + 1}), "
              f"{sum(len(s) for s, *_ in seqs)} tokens, {time.perf_counter() - t0:.0f} s",
              flush=True)
        # the next chunk would not fit
        if time.perf_counter() + (time.perf_counter() - t1) > deadline:
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


def padded(seqs) -> torch.Tensor:
    """Sequences of different lengths (tokens (L,) or features (L, d)) as one
    (B, T, ...) batch, zeros after each end."""
    out = seqs[0].new_zeros(len(seqs), max(len(s) for s in seqs), *seqs[0].shape[1:])
    for b, s in enumerate(seqs):
        out[b, :len(s)] = s
    return out


@torch.inference_mode()
def target_features(target, data, batch=8):
    """Phase 2: the target's feature at every position of every conversation
    (final normalised hidden states, bf16): one batched forward pass each,
    ~340k positions × 576 × 2 bytes ≈ 0.4 GB for the full run (it prints its rate).
    The head learns to predict them, and the target's LM head over them is the teacher."""
    t0 = time.perf_counter()
    # similar lengths: little padding
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))
    out = [None] * len(data)
    for start in range(0, len(order), batch):
        part = order[start:start + batch]
        tokens = padded([data[i][0] for i in part])
        _, h = target(tokens, torch.arange(tokens.shape[1]), hidden=True)
        for b, i in enumerate(part):
            out[i] = h[b, :len(data[i][0])].to(torch.bfloat16).clone()
    print(f"features: {sum(len(f) for f in out)} positions in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return out


def make_head(target: Llama, target_dir: Path, ids: torch.Tensor) -> tuple[Llama, dict]:
    hf = safetensors_io.read_config(target_dir)
    hf.update(HEAD, eagle=True, torch_dtype="bfloat16", draft_vocab_size=len(ids))
    torch.manual_seed(0)
    head = EagleHead(LlamaConfig.from_hf(hf))
    head.head_ids.copy_(ids)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0.0, 0.02)
    # fc starts by passing the feature through (plus small noise from the token), the
    # final norm as the target's: the head starts from the target's own feature scale.
    d = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, d:] += torch.eye(d)
        head.norm.weight.copy_(target.norm.weight.float())
    share_target(head, target)
    head.embed_tokens.weight.requires_grad_(False)
    return head, hf


@contextmanager
def features_only(head):
    """The head's forward returns its features and skips its LM head: the loss
    scores them against the head's 8,192 rows itself (a 49,152-wide logits row
    per position, −inf outside them, would be 49,152 × 4 B ≈ 0.2 MB each)."""
    ids, lm = head.head_ids, head.lm_head
    head.head_ids, head.lm_head = None, torch.nn.Identity()
    try:
        yield head
    finally:
        head.head_ids, head.lm_head = ids, lm


def head_loss(head, tokens, feats, n_prompt, passes=2):
    """The loss of one batch, and the argmax agreement of each pass. tokens (B, T),
    feats (B, T, d): the target's. Head position j reads (x_j+1, f_j) and must
    predict f_j+1 (smooth L1) and the target's distribution over x_j+2,
    softmax(f_j+1 · E_idsᵀ) over the head's rows E_ids (cross-entropy = KL up to
    a constant). Pass 2 feeds the head its own predictions f̂_j in place of f_j,
    as drafting steps 2..k do."""
    B, T = tokens.shape
    teacher_rows = head.lm_head.weight.detach().to(torch.bfloat16)
    inp, nxt, target_f = tokens[:, 1:], feats[:, :-1].float(), feats[:, 1:].float()
    valid = torch.zeros(B, T - 1, dtype=torch.bool)
    for b, (n, L) in enumerate(n_prompt):
        valid[b, max(n - 2, 0):L - 1] = True          # predicting answer tokens x_n.. only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        teacher = torch.softmax((target_f[valid] @ teacher_rows.T).float(), dim=-1)
    losses, agree = [], []
    f_in = nxt
    for _ in range(passes):
        with torch.autocast("cpu", dtype=torch.bfloat16), features_only(head):
            _, h = head(inp, torch.arange(T - 1), features=f_in, hidden=True)
            logits = h[valid] @ teacher_rows.T
        logq = torch.log_softmax(logits.float(), dim=-1)
        cls = -(teacher * logq).sum(-1).mean()
        reg = torch.nn.functional.smooth_l1_loss(h[valid].float(), target_f[valid])
        losses.append(cls + reg)
        agree.append((logits.argmax(-1) == teacher.argmax(-1)).float().mean().item())
        f_in = torch.cat([nxt[:, :1], h[:, :-1].float()], dim=1)     # position j now reads f̂_j
    return sum(losses) / passes, agree


def medusa_loss(heads, tokens, feats, n_prompt):
    """Medusa's loss on one batch, and each head's argmax agreement. feats (B, T, d):
    the target's. Head k reads f_j alone and must predict the target's
    distribution over x_j+k+1, softmax(f_j+k · E_idsᵀ) (cross-entropy, i.e. KL up
    to a constant), at every answer position j (from the last prompt token's,
    whose feature drafting reads first) with j+k inside the conversation. Head k
    weighs 0.8^(k-1), as in the paper: the nearer guesses decide most steps."""
    B, T, _ = feats.shape
    spans = [(b * T + j, L - 1 - j) for b, (n, L) in enumerate(n_prompt)
             for j in range(max(n - 1, 0), L - 1)]
    src, left = (torch.tensor(c) for c in zip(*spans))      # flat position j, positions after it
    flat = feats.reshape(B * T, -1)
    with torch.no_grad():
        teacher = torch.softmax(flat @ heads.rows.T, dim=-1)
    logq = torch.log_softmax(heads(flat[src]), dim=-1)      # (N, K, head vocabulary)
    loss, agree = 0.0, []
    for k in range(1, len(heads.blocks) + 1):
        ok = left >= k
        t, lq = teacher[src[ok] + k], logq[ok, k - 1]
        loss = loss + 0.8 ** (k - 1) * -(t * lq).sum(-1).mean()
        agree.append((lq.argmax(-1) == t.argmax(-1)).float().mean().item())
    return loss, agree


def make_medusa(target: Llama, k: int, ids: torch.Tensor) -> MedusaHeads:
    """K heads whose blocks start at zero: each starts as the target's own
    next-token head (SiLU(0) + f = f), the paper's initialisation."""
    heads = MedusaHeads(target.config.hidden_size, k, ids)
    for p in heads.parameters():
        torch.nn.init.zeros_(p)
    return heads.share_target(target)


def distil(head, data, feats, steps, batch, lr, deadline, loss_fn):
    """Phase 3: AdamW on the head (fc, one block, final norm; the embedding and
    LM head are the target's and stay fixed; or Medusa's K blocks), warm-up then
    cosine decay. loss_fn(head, tokens, feats, n_prompt) -> (loss, agreements)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    warmup, t0, step = 30, time.perf_counter(), 0
    budget = max(deadline - t0, 1e-9)
    head.train()
    for step in range(steps):
        done = max(step / steps, (time.perf_counter() - t0) / budget)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1))))
        picks = torch.randint(len(data), (batch,), generator=gen).tolist()
        tokens, f = padded([data[i][0] for i in picks]), padded([feats[i] for i in picks]).float()
        loss, agree = loss_fn(head, tokens, f, [(data[i][1], len(data[i][0])) for i in picks])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}: loss {loss.item():.3f}, agreement "
                  f"{' / '.join(f'{100 * a:.0f}%' for a in agree)}, "
                  f"lr {opt.param_groups[0]['lr']:.2e}, {time.perf_counter() - t0:.0f} s",
                  flush=True)
        if time.perf_counter() > deadline:
            print(f"train: time's up after {step + 1} steps", flush=True)
            break
    head.eval()
    return head


@torch.no_grad()
def agreement(head, data, feats, loss_fn) -> list[float]:
    """How often the head's argmax is the target's: for an EAGLE head from true
    features (drafting step 1) and from its own predicted ones (step 2), for
    Medusa per head: the greedy acceptance rates."""
    hits = 0
    for (s, n), f in zip(data, feats):
        hits = hits + torch.tensor(loss_fn(head, s[None], f[None].float(), [(n, len(s))])[1])
    return (hits / max(len(data), 1)).tolist()


def save(head: Llama | MedusaHeads, hf: dict, out: Path):
    # No tokenizer, embedding or LM head: the head uses the target's (drafting.load_draft).
    state = head.state_dict() if isinstance(head, MedusaHeads) else unfuse(head)
    state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v)
             for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    safetensors_io.save(out, state, hf)
    mb = (out / "model.safetensors").stat().st_size / 1e6
    print(f"wrote {out} ({mb:.1f} MB)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help=f"default: {BUNDLED_DRAFT} ({BUNDLED_MEDUSA} with --medusa)")
    ap.add_argument("--medusa", type=int, default=0, metavar="K",
                    help="train K Medusa heads instead of an EAGLE head")
    ap.add_argument("--max-minutes", type=float, default=45.0,
                    help="the whole run, data generation included")
    ap.add_argument("--data-share", type=float, default=0.45,
                    help="at most this share of the time for data")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=288,
                    help="answer length per prompt (EOS ignored; with --medusa at most this, "
                         "stopping at EOS)")
    ap.add_argument("--chunk", type=int, default=128,
                    help="conversations the engine answers at once (the time limit is checked "
                         "between chunks)")
    ap.add_argument("--steps", type=int, default=4000,
                    help="an upper bound: the time usually runs out first")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--passes", type=int, default=2,
                    help="1: true features only; 2: also from its own")
    ap.add_argument("--head-vocab", type=int, default=HEAD_VOCAB, help="tokens the head scores")
    args = ap.parse_args()
    if args.medusa < 0 or args.max_minutes <= 0:
        ap.error("--medusa K needs K >= 1 heads (0: the EAGLE head) "
                 "and --max-minutes a positive time")
    out = args.out or (BUNDLED_MEDUSA if args.medusa else BUNDLED_DRAFT)
    start = time.perf_counter()
    end = start + 60 * args.max_minutes
    target_dir = checkpoint.resolve(checkpoint.DEFAULT_MODEL)
    # bf16 where the CPU computes it (data and features several times faster than fp32); else it is
    # emulated, slower
    cpu = torch.device("cpu")
    target, tok = load(RunConfig(checkpoint.DEFAULT_MODEL, cpu,
                                 torch.bfloat16 if kernels.bf16_supported(cpu) else torch.float32))
    # every kind of request early: a short run answers only the first prompts
    prompts = random.Random(0).sample(PROMPTS, len(PROMPTS))[:args.prompts]
    data = generate_data(target, tok, prompts, args.new_tokens, 8,
                         start + 60 * args.max_minutes * args.data_share,
                         chunk=args.chunk, ignore_eos=not args.medusa)
    ids = head_tokens(data, target.config.vocab_size, args.head_vocab)
    inside = torch.isin(torch.cat([idx[::20, 0] for _, _, _, idx in data[::20]]),
                        ids).float().mean()
    data = [(s, n) for s, n, _, _ in data]
    feats = target_features(target, data)
    # 5% held out: does it generalise?
    held, data = data[::20], [d for i, d in enumerate(data) if i % 20]
    held_f, feats = feats[::20], [f for i, f in enumerate(feats) if i % 20]
    print(f"head: the {len(ids)} most likely tokens hold {100 * inside:.1f}% of the target's "
          f"greedy choices", flush=True)
    if args.medusa:
        head, loss_fn = make_medusa(target, args.medusa, ids), medusa_loss
        hf, what = (dict(head.hf_config(), vocab_size=target.config.vocab_size),
                    f"{args.medusa} residual blocks")
    else:
        (head, hf), what = make_head(target, target_dir, ids), "fc + 1 block + norm"
        loss_fn = lambda h, tokens, f, n: head_loss(h, tokens, f, n, args.passes)   # noqa: E731
    n = sum(p.numel() for p in head.parameters() if p.requires_grad)
    print(f"head: {n / 1e6:.1f}M parameters of its own ({what})", flush=True)
    head = distil(head, data, feats, args.steps, args.batch, args.lr,
                  end - min(90, 9 * args.max_minutes), loss_fn)
    show = lambda a: " / ".join(f"{100 * x:.0f}%" for x in a)
    steps = "head 1 / 2 / ..." if args.medusa else "drafting step 1 / step 2"
    print(f"greedy agreement with the target ({steps}): held-out conversations "
          f"{show(agreement(head, held, held_f, loss_fn))}, training text "
          f"{show(agreement(head, data[::10], feats[::10], loss_fn))}", flush=True)
    save(head, hf, out)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
