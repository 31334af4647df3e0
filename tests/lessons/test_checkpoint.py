"""Storage: a model name resolved to a Hugging Face directory (checkpoint.py), the directory's
safetensors read as views (safetensors_io.py), and GGUF converted to and from one (gguf_hf.py).

Names: `--model tinyllama` through a real Hugging Face cache layout, offline. GGUF import: the
bundled SmolLM2-135M-Instruct (Q4_1) against transformers' own GGUF loader. GGUF export: an HF
checkpoint -> GGUF -> back again, and llama.cpp running the exported file."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import gguf_hf
import kernels
import model as M
import quantize
import safetensors_io
from conftest import ROOT, TEXT, bundled_gguf, fails_with, make_checkpoint, make_qwen_checkpoint, run_cli
from tokenizer import PRE_TOKENIZER_SPLITS, Tokenizer


# ----------------------------------------------------------------------------
# Names -> directories (checkpoint.py): an alias through a real Hugging Face cache, offline.

def test_missing_directory(capsys, tmp_path):
    fails_with(capsys, ["--model", str(tmp_path / "nope"), "--prompt", "hi"], "model path not found")


def test_unknown_alias(capsys):
    last = fails_with(capsys, ["--model", "llama-9000", "--prompt", "hi"], "unknown model 'llama-9000'")
    assert "tinyllama" in last and "smollm2-135m" in last


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


# ----------------------------------------------------------------------------
# GGUF -> HF directory, once (gguf_hf.convert_gguf), read back as views (safetensors_io).

def test_config_from_gguf_metadata(bundled_dir):
    cfg = json.loads((bundled_dir / "config.json").read_text())
    assert cfg["hidden_size"] == 576 and cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    assert (bundled_dir / "tokenizer.json").is_file() and (bundled_dir / "tokenizer_config.json").is_file()


def test_logits_match_transformers_gguf_loader(bundled_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM
    gguf = bundled_gguf()
    ref = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ours = M.Llama.from_pretrained(bundled_dir, "cpu", "float32")
    hf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = hf_tok("The capital of France is Paris, and the capital of Germany is Berlin. In Python, "
                 "a list comprehension looks like [x * x for x in range(10)].")["input_ids"][:32]
    assert len(ids) == 32
    ids = torch.tensor([ids])
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids, torch.arange(32))
    assert (got - want).abs().max().item() < 1e-3
    assert got[0, -1].argmax() == want[0, -1].argmax()


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter: reshape(n_head, 2, d/2, ...) then swap axes 1 and 2.
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(gguf_hf.unpermute_rows(permuted, 3), w)


# Every GGUF type the conversion reads, as a stand-in for gguf.ReaderTensor: K-quants (which gguf-py
# cannot quantize) as random blocks with finite fp16 scales at their offsets.
K_SCALES = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82],
            "IQ4_XS": [0]}
RANDOM = K_SCALES | {"IQ4_NL": [0]}         # blocks gguf-py does not quantize: random, d set
GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL",
              "IQ4_XS", "F16", "BF16", "F32"]


class FakeTensor:
    def __init__(self, data, kind, rows, cols):
        import gguf
        self.data, self.tensor_type, self.shape = data, gguf.GGMLQuantizationType[kind], np.array([cols, rows])


def gguf_blocks(kind: str, rows: int = 6, cols: int = 512, seed: int = 0) -> FakeTensor:
    import gguf
    from gguf.quants import quantize
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, (rows, cols)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in RANDOM:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        for at in RANDOM[kind]:
            blocks = data.reshape(-1, size)
            blocks[:, at:at + 2] = rng.normal(0, 0.01, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    else:
        data = {"F32": w, "F16": w.astype(np.float16)}.get(kind)
        data = quantize(w, qtype) if data is None else data
    return FakeTensor(data, kind, rows, cols)


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_every_gguf_type_keeps_its_bits(kind):
    """Re-laid, not re-rounded: each GGUF block type's Packed layout (int4 or int8 groups, 16-bit,
    fp32) stands for exactly the values gguf-py (ggml's reference) dequantizes (equal as numbers:
    a -0.0 may come back +0.0); the scales keep their sign (Q4_0's and Q6_K's d), and are stored
    in fp16, the same numbers, where the file's are (half_scales); a K-quant's as the file holds
    them, an int8 per group times an fp16 per 256 weights."""
    from gguf.quants import dequantize
    t = gguf_blocks(kind)
    want = dequantize(t.data, t.tensor_type).reshape(6, 512).astype(np.float32)
    p = gguf_hf.packed(t)
    assert np.array_equal(p.dequantized().numpy(), want)
    # the max |w| a conversion records: a quantized matrix's from each group's extreme values
    # alone, 16- and 32-bit weights' as they are
    quantized = p.kind.value in ("int4", "int8")
    largest = gguf_hf.largest_weight(p) if quantized else gguf_hf.abs_max(p.q)
    assert largest.item() == np.abs(want).max()
    kinds = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q3_K": "int4", "Q2_K": "int4", "IQ4_NL": "int4",
             "IQ4_XS": "int4", "F16": "half", "BF16": "half", "F32": "float"}
    assert p.kind.value == kinds.get(kind, "int8")
    # IQ4's nibbles index its 16 int8 numbers (ggml's kvalues_iq4nl), kept beside them
    assert (p.values == tuple(gguf_hf.IQ4_VALUES.tolist())) == kind.startswith("IQ4")
    assert gguf_hf.layout_of(p).get("values") == (list(p.values) if p.values else None)
    [narrow] = gguf_hf.half_scales([p])
    assert np.array_equal(narrow.dequantized().numpy(), want)
    if p.scale is not None:
        assert p.group == (16 if kind in ("Q6_K", "Q3_K", "Q2_K") else 32)
        assert p.q.dtype == (torch.uint8 if p.kind.value == "int4" else torch.int8)
        assert p.q.min() >= 0 and p.q.max() <= 15 if p.kind.value == "int4" else True
        half = kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")
        # a K-quant's: int8 sc (and m) per group, its fp16 d (and -dmin) per 256 weights
        blocks = kind in K_SCALES
        assert narrow.scale.dtype == (torch.float16 if half else torch.int8 if blocks else torch.float32)
        assert (p.scale_d is not None) == blocks
        assert (p.lo_d is not None) == (kind in ("Q4_K", "Q5_K", "Q2_K", "Q3_K"))
        # the 5- and 6-bit values stored six bits each: 0.75 byte a value, the same values back
        weight = gguf_hf.stored("w", p)["w.weight"]
        if kind in gguf_hf.SIX_BITS:
            assert p.bits == 6 and gguf_hf.layout_of(p)["bits"] == 6
            assert weight.dtype == torch.uint8 and weight.shape == (6, 512 * 3 // 4)
            assert torch.equal(safetensors_io.split_sixes(weight), p.q)
        else:
            assert p.bits == 8 and "bits" not in gguf_hf.layout_of(p)


def stored_48_rows(kind):
    """A 48×512 matrix of GGUF type ``kind`` as a conversion stores it (its layout, its tensors by
    name without a prefix) and the values gguf-py dequantizes it to."""
    from gguf.quants import dequantize
    t = gguf_blocks(kind, rows=48)
    want = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(48, 512).astype(np.float32))
    [p] = gguf_hf.half_scales([gguf_hf.packed(t)])
    state = {k.removeprefix("w."): v for k, v in gguf_hf.stored("w", p).items()}
    return gguf_hf.layout_of(p), state, want


def runs_as(layer, want):
    """A stored layer's outputs are x · Wᵀ of the file's values: the portable layer, and on the
    C++ kernels a step's one-row product and a prefill's (AMX where there)."""
    x = torch.randn(40, 512)
    exact = x.double() @ want.double().t()
    close = lambda y, e: torch.testing.assert_close(y.double(), e, rtol=0,
                                                    atol=1e-6 * (x.abs() @ want.abs().t()).max().item())
    close(layer(x), exact)
    if kernels.native_kernels(quiet=True):
        model = kernels.swap_quantized(torch.nn.Sequential(layer), torch.float32)
        assert model[0].native
        for n in (1, 40):
            close(model(x[:n]), exact[:n])
        return model[0]
    return layer


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS"])
def test_an_iq4_layer_runs_on_its_nibbles(kind):
    """An IQ4 matrix as a conversion stores it (int4 nibbles and its scales; the 16 numbers in
    its layout) becomes a stored layer whose outputs are x · Wᵀ of gguf-py's dequantized W: the
    portable layer, the C++ kernels' one-row step and prefill, and the embedding table's rows.
    Held at the file's bytes: 144 and 138 per 256 weights (the file's 144 and 136)."""
    layout, state, want = stored_48_rows(kind)
    assert sum(v.numel() * v.element_size() for v in state.values()) * 256 == \
        48 * 512 * {"IQ4_NL": 144, "IQ4_XS": 138}[kind]
    layer = quantize.stored_layer(layout, 512, 48, bias=False)
    layer.load_state_dict(state)
    rows = quantize.StoredEmbedding(layer)(torch.tensor([[5, 0, 47]]))
    assert torch.equal(rows[0], want[[5, 0, 47]])
    assert runs_as(layer, want).weight_values is not None


@pytest.mark.parametrize("kind", ["Q4_0", "Q3_K"])
def test_a_minimum_that_is_its_scale_times_a_power_of_two_is_derived_not_stored(kind):
    """Q4_0's minimum is -8d, Q3_K's -4·d·sc: a conversion stores neither (its layout names the
    factor), so Q4_0 takes the file's 18 bytes per 32 weights and Q3_K 146 per 256; the load
    derives it (safetensors_io.with_minimums) and the layer stands for the file's values, bit for
    bit widened, and x · Wᵀ on every path."""
    layout, state, want = stored_48_rows(kind)
    assert layout["min"] and layout["min_per_scale"] == {"Q4_0": -8, "Q3_K": -4}[kind]
    assert "weight_min" not in state and "weight_min_d" not in state
    assert sum(v.numel() * v.element_size() for v in state.values()) == \
        48 * 512 * {"Q4_0": 18 / 32, "Q3_K": 146 / 256}[kind]
    full = safetensors_io.with_minimums({f"w.{k}": v for k, v in state.items()}, {"w": layout})
    widened = safetensors_io.widen_layers(dict(full), {"w": layout})["w.weight"]
    assert torch.equal(widened, want)
    layer = quantize.stored_layer(layout, 512, 48, bias=False)
    layer.load_state_dict({k.removeprefix("w."): v for k, v in full.items()})
    runs_as(layer, want)
    # a checkpoint that lacks the scale too is named in one line, not a KeyError
    lacking = {f"w.{k}": v for k, v in state.items() if k != "weight_scale"}
    with pytest.raises(safetensors_io.CheckpointError, match=r"checkpoint in dir lacks \d tensors"):
        safetensors_io.check_tensors(safetensors_io.with_minimums(lacking, {"w": layout}),
                                     {k: tuple(v.shape) for k, v in full.items()}, "dir")


def test_a_q3_k_scale_beyond_what_int4_holds_is_refused():
    """Q3_K's minimum -4s is held as its int8 sc times -4d in fp16: a d of 2^14 or more would
    overflow, so such a file is refused in one line, not run with an infinite minimum."""
    t = gguf_blocks("Q3_K")
    t.data.reshape(-1, 110)[3, 108:110] = np.array([2.0 ** 14], np.float16).view(np.uint8)
    with pytest.raises(safetensors_io.CheckpointError, match="Q3_K block's scale d is 16384 or more"):
        gguf_hf.packed(t)


def test_an_unsupported_gguf_type_is_refused_in_one_line():
    """A type the layouts do not hold exactly (the IQ grids: values from codebooks of 8-value
    grids) is refused by name, with the types that are read, rather than re-rounded."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ3_S]
    t = FakeTensor(np.zeros((2, 512 // block * size), np.uint8), "IQ3_S", 2, 512)
    with pytest.raises(safetensors_io.CheckpointError,
                       match="GGUF tensor type IQ3_S is not supported: use a file quantized to F32"):
        gguf_hf.packed(t)


def test_a_group_of_mixed_types_keeps_each_part_at_its_bits(tmp_path):
    """Q4_K_M keeps some layers' V in Q6_K beside Q4_K Q and K. Parts in one layout stack into one
    matrix; parts at different bits (here V in Q4_0 beside Q8_0 Q and K, gate in Q4_0 beside a
    Q8_0 up) stay apart, each its own stored layer (quantize.StoredParts), none re-laid wider;
    beside an fp32 part, all fp32. A Q5_0 down projection is held six bits a value. The model's
    logits are the plain (widened) model's, on the C++ kernels too."""
    q, v = gguf_hf.packed(gguf_blocks("Q4_K")), gguf_hf.packed(gguf_blocks("Q6_K", seed=1))
    assert [p.kind.value for p in gguf_hf.grouped([q, q, v])] == ["int4", "int4", "int8"]
    wide = gguf_hf.grouped([q, gguf_hf.packed(gguf_blocks("F32"))])
    assert {p.kind.value for p in wide} == {"float"} and torch.equal(wide[0].dequantized(), q.dequantized())
    src = make_checkpoint(tmp_path / "hf", hidden_size=128, intermediate_size=256)
    path = gguf_hf.export_gguf(src, tmp_path / "mixed.gguf", config(src), "q8_0",
                               mixed={"v_proj.weight": "q4_0", "gate_proj.weight": "q4_0",
                                      "down_proj.weight": "q5_0"})
    back = gguf_hf.convert_gguf(path, tmp_path / "cache")
    fast = quantize.from_pretrained(back, "cpu", torch.float32)
    qkv = fast.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, quantize.StoredParts)
    assert [type(p).__name__ for p in qkv.parts] == ["Int8Linear", "Int8Linear", "Int4Linear"]
    plain = M.Llama.from_pretrained(back, "cpu", torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6] * 3])
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, torch.arange(24)), plain(ids, torch.arange(24)),
                                   atol=1e-4, rtol=0)
    if kernels.native_kernels(quiet=True):
        on_kernels = kernels.swap_quantized(quantize.from_pretrained(back, "cpu", torch.float32,
                                                                     prepare=False), torch.float32)
        assert on_kernels.layers[0].mlp.down_proj.native
        with torch.no_grad():
            for n in (1, 24):       # a step's kernel and a prefill's tiles
                torch.testing.assert_close(on_kernels(ids[:, :n], torch.arange(n)),
                                           plain(ids[:, :n], torch.arange(n)), atol=1e-4, rtol=0)
    stored = safetensors_io.read_weights(back)      # each part as the file holds it
    assert stored["model.layers.0.self_attn.v_proj.weight"].dtype == torch.uint8        # int4
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    down = stored["model.layers.0.mlp.down_proj.weight"]                                # Q5_0
    assert down.dtype == torch.uint8 and down.shape == (128, 256 * 3 // 4)


def test_a_quantized_gguf_converts_at_its_own_bits(tmp_path):
    """convert_gguf keeps a Q8_0 file's matrices as int8 groups of 32 with its fp16 scales (cache ≈
    the file, not 4x) and names each layer's layout in config.json; the plain model widens them to
    exactly the values llama.cpp reads (gguf-py's dequantization of the same file)."""
    import gguf
    from gguf.quants import dequantize
    src = make_checkpoint(tmp_path / "hf", hidden_size=128, intermediate_size=256)
    path = gguf_hf.export_gguf(src, tmp_path / "tiny.gguf", config(src), "q8_0")
    back = gguf_hf.convert_gguf(path, tmp_path / "cache")
    spec = json.loads((back / "config.json").read_text())[M.QUANTIZATION_KEY]
    assert spec["weights"] == "gguf"
    assert spec["layers"]["layers.0.mlp.down_proj"] == {"kind": "int8", "group": 32, "min": False,
                                                        "scales": "float16"}
    stored = safetensors_io.read_weights(back)
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    # Q8_0's 34 bytes per 32 weights, as the file: its fp16 d kept as it is
    assert stored["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float16
    reader = gguf.GGUFReader(path)
    want = {gguf_hf.hf_name(t.name).removeprefix("model."): dequantize(t.data, t.tensor_type)
            for t in reader.tensors}
    model = M.Llama.from_pretrained(back, "cpu", "float32")
    got = dict(M.unfuse(model))
    for name in ("layers.1.mlp.down_proj.weight", "layers.0.self_attn.v_proj.weight", "lm_head.weight",
                 "embed_tokens.weight"):
        np.testing.assert_array_equal(got[name].numpy(), want[name].reshape(got[name].shape))
    q = gguf_hf.unpermute_rows(want["layers.0.self_attn.q_proj.weight"].reshape(128, 128), 4)
    np.testing.assert_array_equal(got["layers.0.self_attn.q_proj.weight"].numpy(), q)


@pytest.mark.parametrize("tied", [False, True])
def test_the_embedding_table_keeps_its_bits(tmp_path, tied):
    """The table stays at the file's bits too (Q8_0 here: 34 bytes per 32 weights, not 128): a
    lookup widens the rows it reads (quantize.StoredEmbedding) to exactly the plain model's fp32
    rows. Tied to the head, it is stored once, as the head, and the two share its tensors."""
    src = make_checkpoint(tmp_path / "hf", hidden_size=128, intermediate_size=256,
                          tie_word_embeddings=tied)
    path = gguf_hf.export_gguf(src, tmp_path / "tiny.gguf", config(src), "q8_0")
    back = gguf_hf.convert_gguf(path, tmp_path / "cache")
    layers = json.loads((back / "config.json").read_text())[M.QUANTIZATION_KEY]["layers"]
    assert ("embed_tokens" in layers) != tied and layers["lm_head"]["kind"] == "int8"
    stored = safetensors_io.read_weights(back)
    assert ("model.embed_tokens.weight" in stored) != tied
    fast = quantize.from_pretrained(back, "cpu", torch.float32)
    plain = M.Llama.from_pretrained(back, "cpu", torch.float32)
    assert isinstance(fast.embed_tokens, quantize.StoredEmbedding)
    assert (fast.embed_tokens.weight.data_ptr() == fast.lm_head.weight.data_ptr()) == tied
    ids = torch.tensor([[0, 5, 319, 5], [7, 1, 2, 3]])
    assert torch.equal(fast.embed_tokens(ids), plain.embed_tokens(ids))
    assert fast.embed_tokens.weight.dtype == torch.int8       # the file's q, not fp32


def test_a_conversion_holds_a_tensor_not_the_model(tmp_path):
    """convert_gguf streams: each tensor (a layer's q/k/v or gate/up together) is re-laid and
    written before the next is read, the GGUF read, not mapped (mapped pages stay resident).
    Holding every tensor before one write took 4.7x this 72 MB file's bytes more memory at its
    peak (4.1 GB for a 0.72 GB Q4_K_M)."""
    src = make_checkpoint(tmp_path / "hf", hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4)
    path = gguf_hf.export_gguf(src, tmp_path / "big.gguf", config(src), "f16")
    code = ("import sys; from pathlib import Path; import gguf, gguf_hf\n"
            "def status(key):\n"
            "    return int(Path('/proc/self/status').read_text().split(key + ':')[1].split()[0])\n"
            "Path('/proc/self/clear_refs').write_text('5')      # VmHWM from here\n"
            "before = status('VmRSS')\n"
            "gguf_hf.convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))\n"
            "print((status('VmHWM') - before) * 1024)\n")
    p = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "cache")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.split()[-1]) < path.stat().st_size / 2


@pytest.mark.parametrize("room", [1 << 16, 64])
def test_tensor_writer_reads_back_as_safetensors(tmp_path, room):
    """The streaming writer's file is a safetensors file: every dtype, an empty tensor, the
    metadata; its header padded into the room left for it, or, too long for it, the data moved
    once behind it."""
    from safetensors import safe_open
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).half(), "c": torch.randn(2, 2).bfloat16(),
               "d": torch.randint(-128, 127, (4, 3), dtype=torch.int8),
               "e": torch.randint(0, 255, (9,), dtype=torch.uint8), "f": torch.zeros(0, 4)}
    out = safetensors_io.TensorWriter(tmp_path / "w.safetensors", room)
    for name, t in tensors.items():
        out.add(name, t)
    out.close({"format": "pt", "note": "x"})
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t)
    assert not list(tmp_path.glob("*.moving"))


def test_conversion_is_cached(cache_home):
    again = gguf_hf.convert_gguf(bundled_gguf(), cache_home / "nanoinfer")
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert gguf_hf.convert_gguf(bundled_gguf(), cache_home / "nanoinfer") == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(again.parent.glob(".converting-*"))   # no half-written leftovers


def test_a_new_conversion_removes_the_same_files_older_ones(tmp_path):
    """A conversion by a newer format (gguf_hf.CONVERTED_FORMAT) removes what earlier formats made
    of the same file, named by the fingerprint each gave it, and nothing else."""
    gguf_file = bundled_gguf()
    older = tmp_path / f"{gguf_file.stem}-{gguf_hf.gguf_fingerprint(gguf_file, 7)}"
    other = tmp_path / f"{gguf_file.stem}-0123456789abcdef"      # another file of that name
    for d in (older, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"old")
    out = gguf_hf.convert_gguf(gguf_file, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, other.name])


def test_non_llama_gguf_is_refused(tmp_path):
    import gguf
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(safetensors_io.CheckpointError,
                       match="unsupported GGUF architecture 'gpt2' \\(general.architecture\\): nanoinfer runs "
                             "llama, qwen2, qwen3"):
        gguf_hf.convert_gguf(path, tmp_path / "cache")


def test_truncated_gguf_is_refused(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(bundled_gguf().read_bytes()[:5_000_000])
    with pytest.raises(safetensors_io.CheckpointError, match="cannot read GGUF file"):
        gguf_hf.convert_gguf(path, tmp_path / "cache")


def test_a_tensor_cut_short_is_refused_in_one_line(tmp_path):
    """A tensor whose bytes end before its size (a file cut inside its data) is named, not
    read as zeros or garbage."""
    from types import SimpleNamespace
    path = tmp_path / "cut.bin"
    path.write_bytes(bytes(50))
    t = SimpleNamespace(name="blk.0.ffn_up.weight", n_bytes=100, data_offset=0,
                        data=np.zeros(100, np.uint8))
    with open(path, "rb") as f, pytest.raises(safetensors_io.CheckpointError,
                                              match="blk.0.ffn_up.weight is cut short; is the "
                                                    "file complete"):
        gguf_hf.read_tensor(f, t)


def test_a_group_missing_a_part_is_refused_in_one_line(tmp_path, monkeypatch):
    """A GGUF without one of a layer's q/k/v (here its K renamed away) is refused by layer and
    group, with the parts it has, and leaves no half-written cache."""
    src = make_checkpoint(tmp_path / "hf")
    path = gguf_hf.export_gguf(src, tmp_path / "tiny.gguf", config(src), "q8_0")
    hf_name = gguf_hf.hf_name
    monkeypatch.setattr(gguf_hf, "hf_name", lambda n: "model.layers.0.self_attn.k_lost.weight"
                        if n == "blk.0.attn_k.weight" else hf_name(n))
    with pytest.raises(safetensors_io.CheckpointError,
                       match=r"lacks part of layer 0's self_attn.qkv_proj \(has self_attn.q_proj"
                             r".weight, self_attn.v_proj.weight\); is it complete\?"):
        gguf_hf.convert_gguf(path, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*/model.safetensors"))
    assert not list((tmp_path / "cache").glob(".converting-*"))


def test_a_second_start_converts_copies_and_rereads_nothing(cache_home):
    """Start fast (issue 21): with the conversion cached, loading the bundled model imports neither
    gguf (no conversion) nor torch._dynamo (nothing built on the meta device calls into it) nor
    triton (no GPU, no interpreter), stacks q/k/v and gate/up without one torch.cat (the cache
    stores them stacked), and reads no weight to check it is finite (checked when converted)."""
    code = ("import json, sys, torch, model\n"
            "calls = {'cat': 0, 'isfinite': 0}\n"
            "for name in calls:\n"
            "    def counted(*a, _f=getattr(torch, name), _n=name, **k):\n"
            "        calls[_n] += 1\n"
            "        return _f(*a, **k)\n"
            "    setattr(torch, name, counted)\n"
            "m, tok = model.load()\n"
            "qkv = m.layers[0].self_attn.qkv_proj.weight\n"
            "print(json.dumps({**calls, 'imported': [n for n in ('gguf', 'torch._dynamo', 'triton') if n in sys.modules],\n"
            "                  'qkv': list(qkv.shape), 'eos': m.config.eos_ids}))\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert got == {"cat": 0, "isfinite": 0, "imported": [], "qkv": [960, 576], "eos": [2]}


def test_converted_groups_are_stored_stacked_and_read_as_views(bundled_dir):
    state = safetensors_io.read_weights(bundled_dir)        # Hugging Face names, as every reader expects
    # the file's Q4_1 as int4: two weights a byte, a scale and a minimum per 32
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert q.dtype == torch.uint8 and q.shape == (576, 288) and k.shape == v.shape == (192, 288)
    for part in (".weight", ".weight_scale", ".weight_min"):
        q, k, v = (state[f"model.layers.0.self_attn.{p}_proj{part}"] for p in "qkv")
        fused = safetensors_io.joined([q, k, v])            # back to back in one storage: a view
        assert fused.data_ptr() == q.data_ptr() and torch.equal(fused, torch.cat([q, k, v]))
    layers = json.loads((bundled_dir / "config.json").read_text())[M.QUANTIZATION_KEY]["layers"]
    wide = safetensors_io.widen_layers({k.removeprefix("model."): v for k, v in state.items()}, layers)
    assert safetensors_io.recorded_max_abs(bundled_dir) == max(t.abs().max().item() for t in wide.values())
    state = {"model." + k: v for k, v in wide.items()}       # the plain model's view: fp32
    q, k, v = (wide[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert q.shape == (576, 576) and safetensors_io.joined([q, k, v]).data_ptr() == q.data_ptr()
    apart = safetensors_io.joined([k, q])                   # not in storage order: a copy
    assert apart.data_ptr() not in (q.data_ptr(), k.data_ptr()) and torch.equal(apart, torch.cat([k, q]))
    # cast converts a group as one tensor: its parts stay back to back, so joining them copies nothing either
    small = safetensors_io.cast(state, "cpu", lambda name, t: torch.bfloat16)
    q16, k16, v16 = (small[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert list(small) == list(state) and q16.dtype == torch.bfloat16 and torch.equal(q16, q.bfloat16())
    assert safetensors_io.joined([q16, k16, v16]).data_ptr() == q16.data_ptr()


# ----------------------------------------------------------------------------
# HF directory -> GGUF (gguf_hf.export_gguf), and back.

def config(path):
    return M.LlamaConfig.from_hf(safetensors_io.read_config(path))


IDS = [5, 17, 42, 99, 3, 250, 7, 180, 64, 12, 301, 88]


def our_logits(model_dir) -> np.ndarray:
    model = M.Llama.from_pretrained(model_dir, "cpu", "float32")
    with torch.no_grad():
        return model(torch.tensor([IDS]), torch.arange(len(IDS)))[0].numpy()


def test_permute_rows_inverts_unpermute_rows():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert not np.array_equal(gguf_hf.permute_rows(w, 3), w)
    assert np.array_equal(gguf_hf.unpermute_rows(gguf_hf.permute_rows(w, 3), 3), w)
    assert np.array_equal(gguf_hf.permute_rows(gguf_hf.unpermute_rows(w, 3), 3), w)


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_exact(tmp_path, tied):
    src = make_checkpoint(tmp_path / "hf", tie_word_embeddings=tied)
    path = gguf_hf.export_gguf(src, tmp_path / "tiny.gguf", config(src), "f32")
    back = gguf_hf.convert_gguf(path, tmp_path / "cache")

    want, got = safetensors_io.read_weights(src), safetensors_io.read_weights(back)
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
    exported = gguf_hf.export_gguf(src, tmp_path / "tiny.gguf", config(src), "f16")
    back = gguf_hf.convert_gguf(exported, tmp_path / "cache")
    want, got = safetensors_io.read_weights(src), safetensors_io.read_weights(back)
    for name, t in want.items():
        assert torch.equal(got[name], t.half().float()), name


def test_without_tokenizer_a_synthetic_vocabulary_is_written(tmp_path):
    import gguf
    src = make_checkpoint(tmp_path / "hf", tokenizer=False)
    reader = gguf.GGUFReader(gguf_hf.export_gguf(src, tmp_path / "tiny.gguf", config(src)))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    assert len(tokens) == 320 and tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>"


@pytest.mark.parametrize("tokenizer, tied", [(True, False), (False, True)])
def test_llama_cpp_runs_the_export_like_we_do(tmp_path, tokenizer, tied):
    llama_cpp = pytest.importorskip("llama_cpp")
    src = make_checkpoint(tmp_path / "hf", tokenizer=tokenizer, tie_word_embeddings=tied)
    path = gguf_hf.export_gguf(src, tmp_path / "tiny.gguf", config(src), "f32")
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
    state = {k.removeprefix("model."): v.clone() for k, v in safetensors_io.read_weights(src).items()}
    state["layers.1.mlp.down_proj.weight"][3, 5] = bad
    safetensors_io.save(tmp_path / "bad", state, safetensors_io.read_config(src), copy_files_from=src)
    back = gguf_hf.convert_gguf(gguf_hf.export_gguf(tmp_path / "bad", tmp_path / "bad.gguf", config(src), "f32"),
                                   tmp_path / "cache")
    refused = "tensor layers.1.mlp.down_proj.weight in .* holds 1 non-finite values"
    if bad != bad:
        assert safetensors_io.recorded_max_abs(back) is None
        with pytest.raises(safetensors_io.CheckpointError, match=refused):
            M.Llama.from_pretrained(back, "cpu", "float32")
    else:
        assert safetensors_io.recorded_max_abs(back) == bad
        assert M.Llama.from_pretrained(back, "cpu", "float32").layers[1].mlp.down_proj.weight[3, 5] == bad
        with pytest.raises(safetensors_io.CheckpointError, match=refused):
            M.Llama.from_pretrained(back, "cpu", "float16")


# Qwen2 and Qwen3 GGUFs: their own architecture names and keys, and no row permutation.

QWEN = {"qwen2": dict(tie_word_embeddings=True), "qwen3": dict(head_dim=24)}


@pytest.mark.parametrize("family", QWEN)
def test_qwen_gguf_round_trip_matches_transformers(tmp_path, family):
    import gguf
    from transformers import AutoModelForCausalLM
    src = make_qwen_checkpoint(tmp_path / "hf", family, **QWEN[family])
    if family == "qwen2":       # Qwen's tokenizer.json splits words with its own regex
        from tokenizers import Regex, Tokenizer as HFTokenizer, pre_tokenizers
        hf = HFTokenizer.from_file(str(src / "tokenizer.json"))
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["qwen2"]), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.save(str(src / "tokenizer.json"))
    path = gguf_hf.export_gguf(src, tmp_path / f"{family}.gguf", config(src), "f32")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == family
    assert reader.fields[f"{family}.block_count"].contents() == 2
    assert reader.fields["tokenizer.ggml.pre"].contents() == {"qwen2": "qwen2", "qwen3": "gpt-2"}[family]
    # every tensor is one gguf-py (llama.cpp's own names) lists for this architecture
    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[family]
    known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch] for i in range(2)}
    names = {t.name for t in reader.tensors}
    assert {n.rpartition(".")[0] for n in names} <= known
    extra = {"qwen2": {"blk.0.attn_q.bias", "blk.1.attn_v.bias"},
             "qwen3": {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"}}[family]
    assert extra <= names and ("output.weight" in names) == (family == "qwen3")

    back = gguf_hf.convert_gguf(path, tmp_path / "cache")
    want, got = safetensors_io.read_weights(src), safetensors_io.read_weights(back)
    from safetensors import safe_open
    with safe_open(back / "model.safetensors", framework="pt") as f:     # stacked as the weights
        stacked = json.loads(f.metadata()["stacked"])
    assert ("model.layers.1.self_attn.qkv_proj.bias" in stacked) == (family == "qwen2")
    if QWEN[family].get("tie_word_embeddings"):
        want.pop("lm_head.weight", None)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t.float()), name     # rows as they were: nothing permuted
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([IDS])).logits[0].numpy()
    assert np.abs(our_logits(back) - expected).max() < 1e-4
    text = "The quick brown fox. def add(a, b):\n    return a + b 1234"
    assert Tokenizer.from_dir(back).encode(text) == Tokenizer.from_dir(src).encode(text)
    if family == "qwen2":
        # transformers' own GGUF reader takes the file as llama.cpp's converter would have written it
        read = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()
        with torch.no_grad():
            assert np.abs(read(torch.tensor([IDS])).logits[0].numpy() - expected).max() < 1e-5


def test_give_back_freed_returns_the_heaps_free_blocks():
    """gguf_hf.give_back_freed: blocks freed below a live one stay resident in glibc's heap (its
    mmap threshold grows past a freed big block, so later ones of 1 MB come from the heap), and
    go back to the system when it is called (a conversion between tensors; the runner after each
    answer)."""
    def rss_mb() -> float:
        line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    big = torch.ones(4 << 20, dtype=torch.uint8)
    del big
    blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(64)]
    keep = blocks[-1]                                           # the heap's top stays in use
    del blocks
    before = rss_mb()
    gguf_hf.give_back_freed()
    if not hasattr(kernels.libc(), "malloc_trim"):
        pytest.skip("no malloc_trim in this C library")
    assert before - rss_mb() > 32 and keep.sum() == 1 << 20
