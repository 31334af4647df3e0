"""
sampling.py — turn the model's logits into the next token, and decide when to stop.

A forward pass ends in logits: one score per vocabulary entry for the next
token. Decoding policy is separate from the model and shared by every decoder
(model.py's naive and cached loops, speculative.py, the engine):

* greedy: the argmax. Deterministic; what the tests and benchmarks use, since
  it makes every optimisation checkable token for token.
* temperature T: softmax(logits / T). T < 1 sharpens the distribution, T > 1
  flattens it; T → 0 is greedy.
* top-k: keep the k likeliest tokens; top-p (nucleus): keep the smallest set
  whose probability reaches p. Both cut the long tail of unlikely tokens,
  where a sampled answer goes off the rails.

Speculative decoding needs the distribution itself, not just a token
(`sampling_probs`): its acceptance rule compares the target's p with the
draft's q, both shaped by the same temperature, top-k and top-p.

Cost: a few vector operations over the vocabulary (49,152 entries for SmolLM2)
per token; only top-p's sort is noticeable, so it ranks the 256 likeliest first.

Structured output. An application that parses the answer (JSON for a program, a
function call for an agent) needs it to be valid every time, not usually. So a
grammar decides which tokens may come next: before a token is drawn, every token
that would break the grammar gets a score of −inf, and after it is drawn the
grammar's state advances by it. The model still picks among what is allowed, so
the answer is the model's, in the shape asked for. EOS is allowed only where the
grammar may end, so an answer never stops half-way through a structure (it may
still hit max_new_tokens, as any answer may).

The grammar work is llguidance's (llama.cpp's choice), not hand-written: turning a
JSON schema into a grammar, and finding which of 49,152 tokens can continue it,
take a parser that walks the vocabulary as a trie, and that is a library's job.
We took it over xgrammar (vLLM's), measured by ``python bench.py grammar``:
xgrammar computes a mask faster, but compiles a new schema hundreds of times
slower, and a server compiles each request's schema when it arrives, so that is
time to first token; llguidance's mask is small beside a forward pass. And
llguidance needs nothing else installed, where xgrammar brings transformers,
triton and a runtime of its own.

Cost: one mask per token per answer, computed on the CPU after the forward pass
and applied as one masked_fill; speculative decoding masks each row it verifies.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import llguidance
import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy (argmax)
    top_k: int = 0               # 0 = off; else keep the k most likely tokens
    top_p: float = 1.0           # keep the smallest set whose probability reaches top_p
    seed: int | None = None
    max_new_tokens: int = 256
    logprobs: int = 0            # the engine also returns the N most likely tokens'
                                 # log-probabilities at every output position, from the
                                 # raw distribution (before temperature)
    ignore_eos: bool = False     # run to max_new_tokens: benchmarks and training data
                                 # need exact lengths
    json_schema: dict | None = None   # the answer is JSON valid against this schema
    grammar: str | None = None   # or text this Lark grammar matches (llguidance's
                                 # dialect, where %json {...} embeds a schema)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (0 returns none), got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < SEEDS:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("give a JSON schema or a grammar, not both")
        if self.ignore_eos and grammar_text(self) is not None:
            raise ValueError("ignore_eos cannot go with a schema or grammar: the answer ends "
                             "where the grammar does")
        check_grammar(self)


SEEDS = 2 ** 64    # torch.Generator's seeds: 64-bit


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits (..., vocab) -> the probabilities a token is drawn from, row by row:
    temperature, then top-k, then top-p. Greedy: a point mass on the argmax.
    (speculative.py applies the same to the draft's and the target's logits.)"""
    logits = logits.float()
    if p.temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        # The nucleus is usually a few dozen tokens: rank only the 256 likeliest
        # (1/5 of the time to sort all 49,152 here), and sort the rest
        # only for a row whose 256 fall short of top_p.
        sorted_p, order = probs.topk(min(256, probs.shape[-1]), dim=-1)
        cum = sorted_p.cumsum(-1)
        if not bool((cum[..., -1] >= p.top_p).all()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = cum - sorted_p >= p.top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class NonFiniteLogits(ValueError):
    """The model computed NaN or +inf scores: any token drawn from them would be garbage."""


def check_logits(logits: torch.Tensor | float):
    """Refuse NaN or +inf logits (−inf is fine: a token ruled out, as a draft head's
    head_ids or top-k make it). One comparison over the vocabulary per token."""
    if not (logits < math.inf if isinstance(logits, float) else bool((logits < math.inf).all())):
        raise NonFiniteLogits("the model computed NaN or infinite scores, so no token can be "
                              "trusted: its weights hold NaN/inf, or this dtype overflows "
                              "(try --dtype float32)")


def greedy(logits: torch.Tensor) -> int:
    """The first index of the largest score. argmax takes NaN for the largest, so the chosen
    score is NaN or +inf exactly when some score is: one value checked, not the vocabulary. On a
    CPU the row is read through numpy, one vectorised pass with no torch operator to dispatch: a
    share of a small model's decode step, which has just streamed the weights through the caches
    and finds the interpreter's and torch's working set there no more."""
    cpu_fp32 = logits.device.type == "cpu" and logits.dtype == torch.float32
    row = logits.detach().numpy() if cpu_fp32 else logits
    token = int(row.argmax())
    check_logits(float(row[token]))
    return token


def sample(logits: torch.Tensor, p: SamplingParams,
           generator: torch.Generator | None = None, grammar: Constraint | None = None) -> int:
    """logits (vocab,) fp32 -> token id; with ``grammar``, one it allows, and its state
    moves past that token."""
    if grammar is not None:
        token = sample(grammar.apply(logits), p, generator)
        grammar.advance(token)
        return token
    if p.temperature == 0:
        return greedy(logits)
    check_logits(logits)
    return int(torch.multinomial(sampling_probs(logits, p), 1, generator=generator))


# ----------------------------------------------------------------------------
# Structured output: the tokens a grammar allows next.

# JSON as people write it on one line (", " and ": "), and no other whitespace: a grammar
# that allows any run of spaces lets a small model fill its answer with them.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(p: SamplingParams) -> str | None:
    """The request's schema or Lark grammar as one llguidance grammar; None for free text."""
    if p.json_schema is not None:
        if not isinstance(p.json_schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(p.json_schema, defaults=JSON_LAYOUT)
    if p.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(p.grammar)
    return None


def check_grammar(p: SamplingParams):
    """ValueError naming what is wrong with the schema or grammar (no tokenizer needed)."""
    text = grammar_text(p)
    error = text and llguidance.LLMatcher.validate_grammar(text)
    if error:
        what = "JSON schema" if p.json_schema is not None else "grammar"
        raise ValueError(f"the {what} is not supported: {error.strip().splitlines()[0]}")


def grammar_vocab(tokenizer_json: str | None, eos_ids) -> llguidance.LLTokenizer | None:
    """The vocabulary as the grammar library reads it: every token's bytes, from the
    checkpoint's tokenizer.json (None without one: then no grammar can run). EOS ids
    are the tokens a grammar allows where it may end. Build it once per model."""
    if tokenizer_json is None:
        return None
    return llguidance.LLTokenizer(tokenizer_json, eos_token=list(eos_ids))


class Constraint:
    """One answer's grammar state. ``apply`` rules out the tokens the grammar does not
    allow next; ``advance`` moves it by the token drawn; ``rollback`` takes tokens back
    (speculative decoding, after a rejected guess); ``fork`` copies it (a request's n
    branches each follow the grammar on their own)."""

    def __init__(self, vocab: llguidance.LLTokenizer, grammar: str,
                 matcher: llguidance.LLMatcher | None = None):
        self.vocab = vocab
        self.matcher = matcher or llguidance.LLMatcher(vocab, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar does not compile: {self.error()}")

    def error(self) -> str:
        """The library's error, its first line (the rest is a dump of the parser's state)."""
        return (self.matcher.get_error().strip().splitlines() or ["(none)"])[0]

    def allowed(self, size: int) -> torch.Tensor:
        """(size,) bool: the tokens that may come next. Ids the tokenizer lacks (a model's
        padded vocabulary) never may."""
        ok = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8) != 0
        if size > ok.numel():
            ok = torch.cat([ok, ok.new_zeros(size - ok.numel())])
        ok = ok[:size]
        if not bool(ok.any()):
            raise ValueError(f"the grammar allows no token here: {self.error()}")
        return ok

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (vocab,) -> the same with every token the grammar forbids at −inf."""
        ok = self.allowed(logits.shape[-1]).to(logits.device)
        return logits.float().masked_fill(~ok, -math.inf)

    def advance(self, token: int):
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} breaks the grammar: {self.error()}")

    def rollback(self, n: int):
        if n and not self.matcher.rollback(n):
            raise ValueError(f"the grammar cannot take back {n} tokens")

    def fork(self) -> Constraint:
        return Constraint(self.vocab, "", self.matcher.deep_copy())


def constraint(p: SamplingParams, vocab: llguidance.LLTokenizer | None) -> Constraint | None:
    """The grammar state a decoder starts an answer with: None for free text."""
    text = grammar_text(p)
    if text is None:
        return None
    if vocab is None:
        raise ValueError("structured output needs the model's tokenizer.json (this model has "
                         "none, or the decoder was given no vocabulary)")
    return Constraint(vocab, text)


# ----------------------------------------------------------------------------
# When to stop, and the random state.

class Finish(enum.StrEnum):
    """Why an answer ended; the values are OpenAI's ``finish_reason`` strings."""
    STOP = "stop"               # an EOS id (or, in a server, a stop string)
    LENGTH = "length"           # max_new_tokens or the context limit
    CANCELLED = "cancelled"     # the client left, or the request was cancelled
    ERROR = "error"             # this request's own work (its sampling, its stop rule) raised
    TOOL_CALLS = "tool_calls"   # a server read tool calls in an answer that stopped


def finish_reason(token: int, generated: int, length: int, p: SamplingParams, eos_ids,
                  limit: int) -> Finish | None:
    """The stop rule, one for every decoder (model.py, speculative.py) and the
    engine: after ``token``, the ``generated``-th new token, the sequence holds
    ``length`` tokens. STOP on an EOS id (unless p.ignore_eos), LENGTH at
    max_new_tokens or the context limit, None to go on."""
    if token in eos_ids and not p.ignore_eos:
        return Finish.STOP
    if generated >= p.max_new_tokens or length >= limit:
        return Finish.LENGTH
    return None


def visible(token: int, eos_ids) -> bool:
    """The stop token's other half: an EOS id ends the answer (``finish_reason``) but is
    not part of it. Every reader applies this one rule: the engine marks its events with
    it, and a decoder's text and a server's completion-token count leave such a token out."""
    return token not in eos_ids


def seeded_generator(seed: int | None, device) -> torch.Generator | None:
    """Sampling's random state: seeded for reproducible runs, None for torch's global one."""
    return None if seed is None else torch.Generator(device).manual_seed(seed)


if __name__ == "__main__":
    # A toy vocabulary of 8 tokens: what each setting leaves to draw from.
    logits = torch.tensor([4.0, 3.5, 3.0, 2.0, 1.0, 0.0, -1.0, -3.0])
    print("logits      " + " ".join(f"{x:6.1f}" for x in logits.tolist()))
    for name, p in [("greedy", SamplingParams()), ("T = 1", SamplingParams(temperature=1.0)),
                    ("T = 0.5", SamplingParams(temperature=0.5)),
                    ("T = 2", SamplingParams(temperature=2.0)),
                    ("top-k 3", SamplingParams(temperature=1.0, top_k=3)),
                    ("top-p 0.9", SamplingParams(temperature=1.0, top_p=0.9))]:
        print(f"{name:11} " + " ".join(f"{x:6.3f}" for x in sampling_probs(logits, p).tolist()))
    gen = seeded_generator(0, "cpu")
    draws = [sample(logits, SamplingParams(temperature=1.0, top_p=0.9, seed=0), gen)
             for _ in range(20)]
    print(f"20 draws at T = 1, top-p 0.9, seed 0: {draws}")
