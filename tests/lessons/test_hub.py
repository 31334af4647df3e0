"""`--model tinyllama` resolved through a real Hugging Face cache layout, offline; a name that
resolves to nothing is one line."""

import json

import pytest

import checkpoint
import model as M
from conftest import TEXT, fails_with, run_cli

REPO = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] "
          "+ eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + "
          "eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n"
          "{% endif %}\n{% endfor %}")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """HF_HOME/hub/models--TinyLlama--.../snapshots/<commit>/ with refs/main -> <commit>:
    TinyLlama's config with 2 of its 22 layers (what is tested is the alias and the cache layout;
    all 22 took 76 s of the suite), random bf16 weights, a sentencepiece tokenizer trained here."""
    import sentencepiece as spm
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    commit = "fe8a4ea1ffedaf415f4da2f062534de366a451e6"
    snap = repo / "snapshots" / commit
    M.save_random_checkpoint(dict(checkpoint.TINYLLAMA_CONFIG, num_hidden_layers=2), snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    corpus = home / "corpus.txt"
    corpus.write_text(TEXT.replace(". ", ".\n"))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(snap / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, bos_id=1, eos_id=2, unk_id=0,
                                   minloglevel=2)
    (snap / "tokenizer.vocab").unlink()
    (snap / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": ZEPHYR}))
    return home


def test_tinyllama_alias_offline_from_hf_cache(hf_home):
    rc, out, err = run_cli("serve_local.py", "--model", "tinyllama", "--prompt", "Hello there",
                           "--temperature", "0", "--max-new-tokens", "3", "--no-prepack",
                           env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    assert rc == 0, err
    assert "219M parameters" in err                  # 2 layers of TinyLlama
    # the dtype is the plan's: bf16 where this CPU computes it natively and measured it faster, else fp32
    planned = "bfloat16" if err.startswith("plan: bf16") else "float32"
    assert f"MB, {planned}, cpu" in err
    assert "prepacked" not in err
    assert "[prompt " in err and "generated " in err


def test_tinyllama_config_is_exact():
    cfg = M.LlamaConfig.from_hf(checkpoint.TINYLLAMA_CONFIG)
    assert (cfg.hidden_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate_size,
            cfg.vocab_size) == (2048, 22, 32, 4, 5632, 32000)


def test_tinyllama_offline_and_not_cached(tmp_path):
    rc, out, err = run_cli("serve_local.py", "--model", "tinyllama", "--prompt", "hi",
                           env={"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert rc == 1 and out == ""
    last = err.strip().splitlines()[-1]
    assert "not in the local Hugging Face cache and we are offline" in last
    assert "--model PATH" in last and "--model smollm2-135m" in last
    assert "Traceback" not in err


def test_missing_directory(capsys, tmp_path):
    fails_with(capsys, ["--model", str(tmp_path / "nope"), "--prompt", "hi"], "model path not found")


def test_unknown_alias(capsys):
    last = fails_with(capsys, ["--model", "llama-9000", "--prompt", "hi"], "unknown model 'llama-9000'")
    assert "tinyllama" in last and "smollm2-135m" in last
