"""Bad input ends in one clear line on stderr and exit status 1, never a traceback."""

import json

import pytest

import serve_local
from conftest import make_checkpoint
import nanoinfer.load as nl


def fails_with(capsys, argv, message):
    rc = serve_local.main(argv)
    err = capsys.readouterr().err
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, err
    assert "Traceback" not in err
    return last


def test_missing_directory(capsys, tmp_path):
    fails_with(capsys, ["--model", str(tmp_path / "nope"), "--prompt", "hi"], "model path not found")


def test_directory_without_config(capsys, tmp_path):
    fails_with(capsys, ["--model", str(tmp_path), "--prompt", "hi"], "no config.json in")


def test_missing_tokenizer(capsys, tmp_path):
    path = make_checkpoint(tmp_path / "m", tokenizer=False)
    fails_with(capsys, ["--model", str(path), "--prompt", "hi"], "no tokenizer in")


def test_missing_weights(capsys, tiny_ckpt):
    (tiny_ckpt / "model.safetensors").unlink()
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"], "no weights in")


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_corrupt_safetensors(capsys, tiny_ckpt, damage):
    f = tiny_ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"], "corrupt or truncated weights file")


def test_shape_not_matching_config(capsys, tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tiny_ckpt / "config.json").write_text(json.dumps(cfg))
    last = fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"], "do not belong together")
    assert "mlp.down_proj" in last and "(64, 128)" in last and "(64, 96)" in last


def test_unsupported_architecture(capsys, tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tiny_ckpt / "config.json").write_text(json.dumps(cfg))
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi"],
               "unsupported architecture 'gpt2' (config.json model_type)")


def test_unknown_alias(capsys):
    last = fails_with(capsys, ["--model", "llama-9000", "--prompt", "hi"], "unknown model 'llama-9000'")
    assert "tinyllama" in last and "smollm2-135m" in last


def test_prompt_longer_than_context(capsys, tmp_path):
    path = make_checkpoint(tmp_path / "short", max_position_embeddings=32)
    fails_with(capsys, ["--model", str(path), "--raw", "--prompt", "The quick brown fox " * 20],
               "tokens but the context holds 32")


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--top-k", "-3"], "top-k must be >= 0"),
])
def test_invalid_sampling_values(capsys, tiny_ckpt, flags, message):
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi", *flags], message)


def test_context_overflow_in_chat_keeps_conversation(tmp_path):
    """In chat a too-long turn is refused, the conversation and its cache stay usable."""
    import io
    import model as M
    path = make_checkpoint(tmp_path / "short", max_position_embeddings=64)
    m, tok = nl.load(nl.RunConfig(str(path)))
    chat = serve_local.Chat(m, tok, M.SamplingParams(max_new_tokens=4))
    chat.turn("hello", out=io.StringIO())
    before = (list(chat.ids), chat.cache.length, list(chat.messages))
    with pytest.raises(M.ContextOverflow, match="context holds 64; shorten the message"):   # /reset would not help
        chat.turn("The quick brown fox jumps " * 10, out=io.StringIO())
    assert (chat.ids, chat.cache.length, chat.messages) == before
    chat.reset()
    assert chat.cache.length == 0 and chat.ids == []
    chat.turn("hello", out=io.StringIO())
