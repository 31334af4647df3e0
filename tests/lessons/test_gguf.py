"""GGUF import on the bundled SmolLM2-135M-Instruct (Q4_1), against transformers' own GGUF loader."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import model as M
from conftest import ROOT, bundled_gguf, run_cli


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
    assert np.array_equal(checkpoint.unpermute_rows(permuted, 3), w)


def test_conversion_is_cached(cache_home):
    again = checkpoint.convert_gguf(bundled_gguf(), cache_home / "nanoinfer")
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert checkpoint.convert_gguf(bundled_gguf(), cache_home / "nanoinfer") == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(again.parent.glob(".converting-*"))   # no half-written leftovers


def test_non_llama_gguf_is_refused(tmp_path):
    import gguf
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(checkpoint.CheckpointError, match="unsupported GGUF architecture 'gpt2' \\(general.architecture\\)"):
        checkpoint.convert_gguf(path, tmp_path / "cache")


def test_truncated_gguf_is_refused(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(bundled_gguf().read_bytes()[:5_000_000])
    with pytest.raises(checkpoint.CheckpointError, match="cannot read GGUF file"):
        checkpoint.convert_gguf(path, tmp_path / "cache")


def test_runner_answers_paris(cache_home):
    """Acceptance: the bundled model, greedy, knows the capital of France; stdout is only the answer."""
    rc, out, err = run_cli("serve_local.py", "--prompt", "What is the capital of France?", "--temperature", "0",
                           "--max-new-tokens", "40", env={"XDG_CACHE_HOME": str(cache_home)})
    assert rc == 0, err
    assert "Paris" in out
    assert "tok/s" in err and "tok/s" not in out and "loaded" not in out
    # the plan's weights (fp32, or the GGUF's int4 where its kernel is faster) + prepack's fp32 copy of every big matrix
    assert "+ 538 MB of oneDNN-prepacked copies" in err


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
    state = checkpoint.read_weights(bundled_dir)        # Hugging Face names, as every reader expects
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert q.shape == (576, 576) and k.shape == v.shape == (192, 576)
    fused = checkpoint.joined([q, k, v])                # back to back in one storage: a view
    assert fused.data_ptr() == q.data_ptr() and torch.equal(fused, torch.cat([q, k, v]))
    assert checkpoint.recorded_max_abs(bundled_dir) == max(t.abs().max().item() for t in state.values())
    apart = checkpoint.joined([k, q])                   # not in storage order: a copy
    assert apart.data_ptr() not in (q.data_ptr(), k.data_ptr()) and torch.equal(apart, torch.cat([k, q]))
    # cast converts a group as one tensor: its parts stay back to back, so joining them copies nothing either
    small = checkpoint.cast(state, "cpu", lambda name, t: torch.bfloat16)
    q16, k16, v16 = (small[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert list(small) == list(state) and q16.dtype == torch.bfloat16 and torch.equal(q16, q.bfloat16())
    assert checkpoint.joined([q16, k16, v16]).data_ptr() == q16.data_ptr()
