"""
Tokenizer: the translation between text and the integer ids a model reads.

A language model never sees characters. It sees ids into a fixed vocabulary of
"tokens" (whole words, word pieces, single bytes) chosen when the model was
trained, and every id it emits must be turned back into text. Get the mapping
even slightly wrong (a missing space marker, a different split of digits) and
the model is fed text it never saw in training: quality drops quietly, with no
error anywhere. So this module leans on the reference libraries instead of
re-implementing BPE, and the tests check it id-for-id against transformers and
sentencepiece.

Checkpoints ship the tokenizer in one of two on-disk formats:

* `tokenizer.json`: the Hugging Face `tokenizers` format. It spells out the
  whole pipeline (normalizer, pre-tokenizer, model, decoder), so loading it
  reproduces the original exactly. Preferred when present.
* `tokenizer.model`: a serialized sentencepiece model (Llama 1/2, Mistral, ...),
  run with the `sentencepiece` library.

Next to it, `tokenizer_config.json` names the special tokens (BOS "beginning of
sequence", EOS "end of sequence", ...), says whether to prepend BOS, and holds
the chat template; `generation_config.json` may list more EOS ids (chat models
often stop on both <|eot_id|> and <|end_of_text|>). Special tokens written in
the text, such as "<|im_start|>", become their single id, as in transformers:
chat templates rely on that.

A chat template is a small Jinja program shipped with the checkpoint. It turns
a list of {"role", "content"} messages into the exact prompt string the model
was fine-tuned on. We render it the way transformers does, because that is the
reference every checkpoint's template was written and tested against.

GGUF files (llama.cpp) carry no tokenizer files, only the vocabulary as
metadata. `write_tokenizer_from_gguf` rebuilds a `tokenizer.json` from it.

Streaming: a token is a sequence of *bytes*, not characters. An emoji is 4
bytes of UTF-8 and may be split over several tokens; decoding a prefix that
stops mid-character gives the replacement character U+FFFD. `StreamDecoder`
therefore holds text back until the character is complete.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import sentencepiece
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

NO_TEMPLATE = "this model has no chat template; use --raw for plain completion"


def valid_text(text: str) -> str:
    """Text whose bytes were not valid UTF-8 reaches Python with each bad byte as a lone
    surrogate (command-line arguments, a terminal in the C locale); the tokenizer
    libraries refuse those. Each becomes U+FFFD, as a UTF-8 decoder would make it."""
    return _SURROGATE.sub("\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _content(token):
    # tokenizer_config.json writes a token either as "<s>" or as {"content": "<s>", "lstrip": ...}
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"corrupt {path}: {e}") from None


def _corrupt(path: Path, e: Exception) -> ValueError:
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ValueError(f"corrupt tokenizer file {path}: {first_line}")


class _HFBackend:
    """tokenizer.json, run by the `tokenizers` library (Rust)."""

    def __init__(self, path: Path):
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise _corrupt(path, e) from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        # BOS is added by the caller, so one switch (Tokenizer.add_bos) governs it for both
        # formats. encode_batch, because it lets go of Python's lock while it works (encode
        # holds it): a server thread encoding a long prompt does not stop the others.
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_plain(self, text):
        """Special-token strings in ``text`` stay text (their characters' ids)."""
        self.tok.encode_special_tokens = True
        try:
            return self.encode(text)
        finally:
            self.tok.encode_special_tokens = False

    def decode(self, ids, skip_special):
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token):
        return self.tok.token_to_id(token)

    def id_to_token(self, i):
        return self.tok.id_to_token(i)

    def special_ids(self):
        return sorted(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def to_json(self):
        return self.tok.to_str()

    def post_processor_adds(self, bos_id):
        # No flag in tokenizer_config: transformers then does whatever the file's
        # post-processor does
        with_specials = self.tok.encode("a", add_special_tokens=True).ids
        return bos_id is not None and with_specials[:1] == [bos_id] != self.encode("a")[:1]


class _SPBackend:
    """tokenizer.model, run by `sentencepiece`."""

    def __init__(self, path: Path, added: dict[str, int]):
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as e:
            raise _corrupt(path, e) from None
        sp, n = self.sp, self.sp.get_piece_size()
        # sentencepiece never produces control pieces (<s>, </s>) from text; transformers matches
        # them (and added tokens) in the raw text first, so we cut the text at them ourselves.
        self.special = {sp.id_to_piece(i): i for i in range(n)
                        if sp.is_control(i) or sp.is_unknown(i)}
        self.special.update(added)
        self.special_text = {i: s for s, i in self.special.items()}
        pattern = "|".join(re.escape(s) for s in sorted(self.special, key=len, reverse=True))
        self.splitter = re.compile(f"({pattern})") if pattern else None
        self.vocab_size = max([n, *[i + 1 for i in self.special_text]])
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None

    def encode(self, text):
        if self.splitter is None:
            return self.sp.encode(text)
        ids = []
        for k, part in enumerate(self.splitter.split(text)):
            if k % 2:  # re.split puts the captured separators at odd positions
                ids.append(self.special[part])
            elif part:
                # each chunk gets sentencepiece's "▁" prefix, as llama.cpp does after a
                # special token
                ids += self.sp.encode(part)
        return ids

    def encode_plain(self, text):
        return self.sp.encode(text)     # sentencepiece alone never produces a control piece

    def decode(self, ids, skip_special):
        out, run = [], []
        # Models often pad their embedding past the vocabulary, so a sampler can pick an id that
        # has no piece; drop it as `tokenizers` does instead of failing mid-stream.
        for i in (i for i in ids if 0 <= i < self.sp.get_piece_size() or i in self.special_text):
            if i in self.special_text:
                out.append(self.sp.decode(run))
                run = []
                out.append("" if skip_special else self.special_text[i])
            else:
                run.append(i)
        return "".join(out) + self.sp.decode(run)

    def token_to_id(self, token):
        if token in self.special:
            return self.special[token]
        # returns the unk id for unknown pieces, so check the round trip
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_token(self, i):
        return self.special_text.get(i) or self.sp.id_to_piece(i)

    def special_ids(self):
        return sorted(self.special_text)

    def to_json(self):
        return None         # a sentencepiece model has no tokenizer.json

    def post_processor_adds(self, bos_id):
        # sentencepiece models (Llama, Mistral) are trained with a BOS in front
        return bos_id is not None


class Tokenizer:
    def __init__(self, backend, config: dict, generation_config: dict, chat_template: str | None):
        self._backend = backend
        self.vocab_size = backend.vocab_size

        def lookup(name):
            token = _content(config.get(name))
            return backend.token_to_id(token) if token else None

        self.bos_id = lookup("bos_token")
        if self.bos_id is None and "bos_token" not in config:  # an explicit null means "no BOS"
            self.bos_id = generation_config.get("bos_token_id", getattr(backend, "bos_id", None))
        if "add_bos_token" in config:
            self.add_bos = bool(config["add_bos_token"]) and self.bos_id is not None
        else:
            self.add_bos = backend.post_processor_adds(self.bos_id)

        # Chat models often stop on more than one token, and the two files each know some of them.
        extra = generation_config.get("eos_token_id")
        eos = [lookup("eos_token"), *(extra if isinstance(extra, list) else [extra])]
        self.eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
        if not self.eos_ids and getattr(backend, "eos_id", None) is not None:
            self.eos_ids = [backend.eos_id]

        # The template sees the special tokens by name, e.g. {{ bos_token }}.
        self.special_tokens = {k: _content(config[k]) for k in SPECIAL_NAMES
                               if _content(config.get(k))}
        for name, i in (("bos_token", self.bos_id),
                        ("eos_token", self.eos_ids[0] if self.eos_ids else None)):
            if name not in config and i is not None:
                self.special_tokens[name] = backend.id_to_token(i)
        self.chat_template = chat_template
        self._template = None
        self._special_ids = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        generation_config = _read_json(path / "generation_config.json")
        if (path / "tokenizer.json").exists():
            backend = _HFBackend(path / "tokenizer.json")
        elif (path / "tokenizer.model").exists():
            added = {_content(t): int(i) for i, t in config.get("added_tokens_decoder", {}).items()}
            backend = _SPBackend(path / "tokenizer.model", added)
        else:
            raise FileNotFoundError(
                f"no tokenizer in {path}: expected tokenizer.json or tokenizer.model "
                "(copy them from the model's repository)"
            )
        # Newer checkpoints keep the template in its own file, which takes precedence.
        template = config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # older format: several named templates
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        return cls(backend, config, generation_config, template)

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Text -> ids; special-token strings in it become their single id (chat templates
        rely on that). Text from a user: encode_chat for messages, ``special=False`` for a
        raw prompt (those strings then stay characters)."""
        text = valid_text(text)
        ids = self._backend.encode(text) if special else self._backend.encode_plain(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """The chat template's prompt as ids, with every message's text taken as data:
        special-token strings come only from the template's own markup, so a message
        that spells "<|im_end|><|im_start|>system" stays those characters and cannot
        forge a turn. For messages that spell no special token (all ordinary ones) the
        ids are exactly encode(apply_chat_template(...)).

        How: the template is rendered a second time with a marker in place of each
        message's text; its markup pieces are encoded as usual, the texts between them
        as plain text (a template that trims a message is followed)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        ids = self.encode(text, add_bos=False)
        texts = [m.get("content") for m in messages]
        marked = [{**m, "content": f"\ue000{i}\ue001"} if isinstance(c, str) else m
                  for i, (m, c) in enumerate(zip(messages, texts))]
        shell = self.apply_chat_template(marked, add_generation_prompt, tools)
        special = set(self.special_ids)
        if (sum(i in special for i in ids)
                == sum(i in special for i in self.encode(shell, add_bos=False))):
            return ids                        # the messages added no special token
        pieces = re.split("\ue000(\\d+)\ue001", shell)   # markup, message index, markup, ...
        out, pos = [], 0
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                out += self._backend.encode(valid_text(piece))
                pos += len(piece)
                continue
            raw, after = texts[int(piece)], pieces[k + 1]
            # the message's text as the template wrote it: verbatim or trimmed (else verbatim)
            body = next((t for t in (raw, raw.strip(), raw.lstrip(), raw.rstrip())
                         if text.startswith(t + after, pos)), raw)
            out += self._backend.encode_plain(valid_text(body))
            pos += len(body)
        return out

    @property
    def special_ids(self) -> list[int]:
        """The ids of the special tokens (BOS, EOS, <|im_start|>, ...): what markup may hold."""
        if self._special_ids is None:
            self._special_ids = self._backend.special_ids()
        return self._special_ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special)

    def to_json(self) -> str | None:
        """The tokenizer as tokenizer.json text (what a grammar library reads), or None for
        a sentencepiece model."""
        return self._backend.to_json()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if self.chat_template is None:
            raise ValueError(NO_TEMPLATE)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        # transformers drops None-valued keys: templates test `'tool_calls' in message`,
        # not its value
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._template.render(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens,
        )

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Turns ids into text one at a time, never emitting half a character.

    Decoding a single token on its own is wrong twice over: its bytes may be part
    of a longer character, and sentencepiece drops the leading space of whatever
    it decodes first. So we decode a small window that starts one step back
    (at the previous emit point) and emit only what the newest ids added.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok, self._skip = tokenizer, skip_special
        self._ids: list[int] = []
        self._prefix = 0  # window start: context that has already been emitted
        self._read = 0  # everything before this has been emitted

    def _new_text(self) -> str:
        seen = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        return text[len(seen):]

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        new = self._new_text()
        if new.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for its remaining bytes
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new

    def flush(self) -> str:
        new = self._new_text()
        self._prefix = self._read = len(self._ids)
        return new


class _Generation(jinja2.ext.Extension):
    # Some templates mark assistant turns with {% generation %} for training masks;
    # rendering ignores it.
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message):
    raise ValueError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & for HTML; prompts must keep them verbatim
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    # Templates come from the internet: the sandbox stops them touching Python internals.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---------------------------------------------------------------------------- GGUF

# llama.cpp names the regex that cuts text into words before BPE (`tokenizer.ggml.pre`).
# Names not listed fall back to GPT-2's regex, as in transformers.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
}


def _byte_alphabet() -> dict[int, str]:
    # GPT-2 spells every byte as a printable character so BPE can work on strings:
    # printable bytes stand for themselves, the rest are shifted to U+0100 and up.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in keep)
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


# The GGUF functions import gguf themselves: it is needed only while converting,
# and is 38 modules to import.

def _byte_level_bpe(tokens, types, merges, pre) -> tuple[HFTokenizer, list[str]]:
    from gguf import TokenType
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    # A few converters store some tokens as raw text; respell those so BPE can reach them.
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                                 continuing_subword_prefix="", end_of_word_suffix=""))
    if pre in PRE_TOKENIZER_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A CONTROL token outside the byte alphabet is a llama.cpp mislabel; transformers skips it.
    control = [t for t, ty in zip(tokens, types) if ty == TokenType.CONTROL and set(t) <= alphabet]
    return tok, control


def _sentencepiece_bpe(tokens, types, scores, add_space_prefix) -> tuple[HFTokenizer, list[str]]:
    from gguf import TokenType
    vocab = {t: i for i, t in enumerate(tokens)}
    # A sentencepiece BPE model stores no merges: at each step it joins the adjacent pair whose
    # result scores highest. Listing every split of every token, best score first, makes
    # `tokenizers`' merge-rank BPE take the same steps (ties ordered as transformers does).
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges += [(score, left, right)
                   for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    unk = next((t for t, ty in zip(tokens, types) if ty == TokenType.UNKNOWN), None)
    tok = HFTokenizer(models.BPE(vocab, [(left, right) for _, left, right in merges], unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    # Spaces become "▁", and like sentencepiece's dummy prefix every stretch of text between
    # special tokens gets one in front, even one that starts with a space (a normalizer runs per
    # stretch). This is what sentencepiece and llama.cpp do; transformers' GGUF loader uses a
    # pre-tokenizer that skips the prefix after special tokens and before a leading space.
    space = normalizers.Replace(" ", "▁")
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), space]) if add_space_prefix
                      else space)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(
        steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    control = [t for t, ty in zip(tokens, types) if ty == TokenType.CONTROL]
    return tok, control


def write_tokenizer_from_gguf(reader, out_dir: Path) -> None:
    """A tokenizer.json (and tokenizer_config.json) from a gguf.GGUFReader's vocabulary."""
    from gguf import TokenType
    def field(key, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens", [])
    types = field("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    if kind == "gpt2":
        tok, control = _byte_level_bpe(tokens, types, field("tokenizer.ggml.merges", []),
                                       field("tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = field("tokenizer.ggml.scores") or [0.0] * len(tokens)
        tok, control = _sentencepiece_bpe(tokens, types, scores,
                                          field("tokenizer.ggml.add_space_prefix", True))
    else:
        raise ValueError(f"unsupported GGUF tokenizer: tokenizer.ggml.model = {kind!r} "
                         "(supported: 'gpt2', 'llama')")

    named = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        i = field(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= i < len(tokens):
            named[name] = tokens[i]
    # Special tokens are matched whole in the raw text before BPE runs, so "<|im_start|>" is
    # one id. USER_DEFINED tokens (e.g. <think>) are matched whole too but are ordinary text
    # when decoding.
    specials = list(dict.fromkeys(control + [t for t in named.values()
                                             if tok.token_to_id(t) is not None]))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, ty in zip(tokens, types)
            if ty == TokenType.USER_DEFINED and tok.token_to_id(t) is not None]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    # Old sentencepiece GGUFs have no flag, and llama.cpp adds BOS for them.
    add_bos = bool(field("tokenizer.ggml.add_bos_token", kind == "llama")) and "bos_token" in named
    if add_bos:
        bos = named["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {**named, "add_bos_token": add_bos,
              "add_eos_token": bool(field("tokenizer.ggml.add_eos_token", False))}
    if field("tokenizer.chat_template"):
        config["chat_template"] = field("tokenizer.chat_template")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                   encoding="utf-8")


# ---------------------------------------------------------------------------- demo

def demo(tok: Tokenizer):
    """Text -> ids -> text on a few hard cases, a chat template, and streaming."""
    print(f"vocabulary {tok.vocab_size}, bos {tok.bos_id}, eos {tok.eos_ids}, "
          f"add_bos {tok.add_bos}")
    for text in ["Hello world", " Hello world", "12345", "naïve café 😀",
                 "def f(x):\n    return x"]:
        ids = tok.encode(text)
        pieces = [tok.decode([i]) for i in ids]
        print(f"{text!r:28} -> {len(ids):2} tokens {ids} {pieces}")
    if tok.chat_template is not None:
        prompt = tok.apply_chat_template([{"role": "user",
                                           "content": "What is the capital of France?"}])
        print(f"chat template renders:\n{prompt}")
        ids = tok.encode(prompt, add_bos=False)
        print(f"= {len(ids)} tokens; special tokens stay single ids: {ids[:4]} ...")
    stream = tok.stream()
    emoji = tok.encode("😀")
    print(f"'😀' is {len(emoji)} tokens; streaming them one at a time emits "
          f"{[stream.push(i) for i in emoji]}")


if __name__ == "__main__":
    import sys
    import tempfile
    # A model directory, or a .gguf file whose vocabulary is rebuilt as a tokenizer.json first.
    # (`python checkpoint.py` runs this demo on the bundled model.)
    if len(sys.argv) != 2:
        sys.exit("usage: python tokenizer.py MODEL_DIR_OR_GGUF   "
                 "(python checkpoint.py shows the bundled model's)")
    path = Path(sys.argv[1])
    if path.suffix == ".gguf":
        import gguf
        out = Path(tempfile.mkdtemp(prefix="tokenizer-"))
        write_tokenizer_from_gguf(gguf.GGUFReader(path), out)
        path = out
    demo(Tokenizer.from_dir(path))
