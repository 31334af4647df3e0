"""export_gguf: an HF checkpoint -> GGUF -> back again, and llama.cpp running the exported file."""

import numpy as np
import pytest
import torch

import checkpoint
import model as M
from conftest import make_checkpoint
from tokenizer import Tokenizer


def config(path):
    return M.LlamaConfig.from_hf(checkpoint.read_config(path))


IDS = [5, 17, 42, 99, 3, 250, 7, 180, 64, 12, 301, 88]


def our_logits(model_dir) -> np.ndarray:
    model = M.Llama.from_pretrained(model_dir, "cpu", "float32")
    with torch.no_grad():
        return model(torch.tensor([IDS]), torch.arange(len(IDS)))[0].numpy()


def test_permute_rows_inverts_unpermute_rows():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert not np.array_equal(checkpoint.permute_rows(w, 3), w)
    assert np.array_equal(checkpoint.unpermute_rows(checkpoint.permute_rows(w, 3), 3), w)
    assert np.array_equal(checkpoint.permute_rows(checkpoint.unpermute_rows(w, 3), 3), w)


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_exact(tmp_path, tied):
    src = make_checkpoint(tmp_path / "hf", tie_word_embeddings=tied)
    path = checkpoint.export_gguf(src, tmp_path / "tiny.gguf", config(src), "f32")
    back = checkpoint.convert_gguf(path, tmp_path / "cache")

    want, got = checkpoint.read_weights(src), checkpoint.read_weights(back)
    if tied:
        want.pop("lm_head.weight", None)   # llama.cpp reads the output projection from token_embd
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t.float()), name
    np.testing.assert_array_equal(our_logits(back), our_logits(src))
    # The vocabulary survives too: the same text gives the same ids.
    text = "The quick brown fox. def add(a, b): return a + b"
    assert Tokenizer.from_dir(back).encode(text) == Tokenizer.from_dir(src).encode(text)


def test_f16_export_rounds_only(tmp_path):
    src = make_checkpoint(tmp_path / "hf")
    exported = checkpoint.export_gguf(src, tmp_path / "tiny.gguf", config(src), "f16")
    back = checkpoint.convert_gguf(exported, tmp_path / "cache")
    want, got = checkpoint.read_weights(src), checkpoint.read_weights(back)
    for name, t in want.items():
        assert torch.equal(got[name], t.half().float()), name


def test_without_tokenizer_a_synthetic_vocabulary_is_written(tmp_path):
    import gguf
    src = make_checkpoint(tmp_path / "hf", tokenizer=False)
    reader = gguf.GGUFReader(checkpoint.export_gguf(src, tmp_path / "tiny.gguf", config(src)))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    assert len(tokens) == 320 and tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>"


@pytest.mark.parametrize("tokenizer, tied", [(True, False), (False, True)])
def test_llama_cpp_runs_the_export_like_we_do(tmp_path, tokenizer, tied):
    llama_cpp = pytest.importorskip("llama_cpp")
    src = make_checkpoint(tmp_path / "hf", tokenizer=tokenizer, tie_word_embeddings=tied)
    path = checkpoint.export_gguf(src, tmp_path / "tiny.gguf", config(src), "f32")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, n_batch=64, logits_all=True, verbose=False)
    llm.eval(IDS)
    got = np.array(llm.scores[:len(IDS)])
    want = our_logits(src)
    # llama.cpp keeps its KV cache in f16, so agreement is close, not exact.
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    if tokenizer:   # the exported vocabulary, merges and pre-tokenizer cut text as ours does
        text = "The quick brown fox. def add(a, b):\n    return a + b 1234"
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == Tokenizer.from_dir(src).encode(text)


@pytest.mark.parametrize("bad", [float("nan"), 1e5])
def test_conversion_records_what_the_load_need_not_check(tmp_path, bad):
    """convert_gguf checks its output once and records the largest |w|; a load skips the full read
    only where its dtype holds that value. A NaN records nothing, and is refused by name at load;
    1e5 is finite in fp32 but inf in fp16, and is refused there."""
    src = make_checkpoint(tmp_path / "hf")
    state = {k.removeprefix("model."): v.clone() for k, v in checkpoint.read_weights(src).items()}
    state["layers.1.mlp.down_proj.weight"][3, 5] = bad
    checkpoint.save(tmp_path / "bad", state, checkpoint.read_config(src), copy_files_from=src)
    back = checkpoint.convert_gguf(checkpoint.export_gguf(tmp_path / "bad", tmp_path / "bad.gguf", config(src), "f32"),
                                   tmp_path / "cache")
    refused = "tensor layers.1.mlp.down_proj.weight in .* holds 1 non-finite values"
    if bad != bad:
        assert checkpoint.recorded_max_abs(back) is None
        with pytest.raises(checkpoint.CheckpointError, match=refused):
            M.Llama.from_pretrained(back, "cpu", "float32")
    else:
        assert checkpoint.recorded_max_abs(back) == bad
        assert M.Llama.from_pretrained(back, "cpu", "float32").layers[1].mlp.down_proj.weight[3, 5] == bad
        with pytest.raises(checkpoint.CheckpointError, match=refused):
            M.Llama.from_pretrained(back, "cpu", "float16")
