"""serve_local: the conversation's KV cache survives between turns and changes no token; the chat's
input and output (text that is not UTF-8, pipes, the line history); bad flags, a device this machine
lacks, a NaN at run time and a full context end in one line, never a traceback; the paged runner's
stats line; a draft under a small static cache; greedy on the bundled model, it knows the
capital of France."""

import io
import time
import subprocess
import sys

import json
from dataclasses import replace

import pytest
import torch

import drafting
import model as M
import nanoinfer.config
import nanoinfer.load as nl
import serve_local
from conftest import INJECTION, ROOT, fails_with, make_checkpoint, run_cli
from kvcache import common_prefix


def three_turns(path, decoder, raw=False, cache_kind="dynamic"):
    m, tok = nl.load(nl.RunConfig(str(path)))
    chat = serve_local.Chat(m, tok, M.SamplingParams(max_new_tokens=12), decoder=decoder, raw=raw,
                            system=None if raw else "Be brief.", cache_kind=cache_kind, ctx=200)
    answers, stats = [], []
    for text in ["hello there", "what is the capital of France?", "def add(a, b):"]:
        out = io.StringIO()
        in_cache = chat.ids[:chat.cache.length]
        stats.append((in_cache, chat.turn(text, out=out)))
        answers.append(out.getvalue())
        assert chat.cache.length in (0, len(chat.ids) - 1)   # all but the last answer token
    return chat, answers, stats


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_turns_prefill_only_new_tokens_and_match_naive(tiny_ckpt, cache_kind):
    chat, cached, stats = three_turns(tiny_ckpt, "cached", cache_kind=cache_kind)
    _, naive, naive_stats = three_turns(tiny_ckpt, "naive")
    assert cached == naive                       # same greedy answers as recomputing everything
    assert any(a.strip() for a in cached)
    first_turn = naive_stats[0][1].prompt_tokens
    for (in_cache, s), (_, ns) in zip(stats[1:], naive_stats[1:]):
        conversation = chat.ids[:ns.prompt_tokens]   # the naive decoder re-reads all of it
        reused = common_prefix(in_cache, conversation)
        assert reused >= first_turn                  # at least the whole first turn came from the cache
        assert s.prompt_tokens == ns.prompt_tokens - reused
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 3


def test_raw_mode_continues_the_text(tiny_ckpt):
    chat, cached, stats = three_turns(tiny_ckpt, "cached", raw=True)
    _, naive, _ = three_turns(tiny_ckpt, "naive", raw=True)
    assert cached == naive
    assert chat.messages == []
    # the second turn's prompt is exactly the new text's tokens plus the last answer token
    assert stats[1][1].prompt_tokens == len(chat.tok.encode("what is the capital of France?", add_bos=False)) + 1


def test_streamed_text_equals_decoded_answer(tiny_ckpt):
    m, tok = nl.load(nl.RunConfig(str(tiny_ckpt)))
    chat = serve_local.Chat(m, tok, M.SamplingParams(max_new_tokens=20))
    out = io.StringIO()
    chat.turn("hello", out=out)
    assert out.getvalue().rstrip("\n") == chat.messages[-1]["content"]


def test_runner_prefills_in_chunks(tiny_ckpt):
    """The runner's model runs a long prompt in model.PREFILL_CHUNK chunks (memory for one chunk's
    activations); the answer is the one a whole-prompt pass gives."""
    m, tok = nl.load(nl.RunConfig(str(tiny_ckpt)))
    assert m.prefill_chunk == M.PREFILL_CHUNK
    assert nl.load(nl.RunConfig(str(tiny_ckpt), prefill_chunk=None))[0].prefill_chunk is None
    text = "the cat sat on the mat and " * 12
    answers = []
    for chunk in (5, None):
        m.prefill_chunk = chunk
        chat = serve_local.Chat(m, tok, M.SamplingParams(temperature=0, max_new_tokens=16))
        chat.turn(text, out=io.StringIO())
        answers.append(chat.messages[-1]["content"])
    assert answers[0] == answers[1]


def test_stats_line_reports_rates():
    s = M.GenerationStats(prompt_tokens=40, new_tokens=11, prefill_s=0.5, decode_s=1.0)
    line = serve_local.stats_line(s, 51, 2048)
    assert line == "[prompt 40 tok, 80.0 tok/s | generated 11 tok, 10.0 tok/s | first token 500 ms | context 51/2048]"


def test_runner_answers_paris(cache_home):
    """Acceptance: the bundled model, greedy, knows the capital of France; stdout is only the answer."""
    rc, out, err = run_cli("serve_local.py", "--prompt", "What is the capital of France?", "--temperature", "0",
                           "--max-new-tokens", "40", env={"XDG_CACHE_HOME": str(cache_home)})
    assert rc == 0, err
    assert "Paris" in out
    assert "tok/s" in err and "tok/s" not in out and "loaded" not in out
    # the plan's weights: the file's own bits, held as the file holds them (prefills widen tiles: no
    # fp32 copy), or, where their kernels cannot run, fp32 with prepack's copy of every big matrix
    if "weights: the file's own bits" in err:
        assert "prepacked" not in err and "weights gguf" in err
    else:
        assert "+ 538 MB of oneDNN-prepacked copies" in err


def test_activations_int8_is_asked_for_and_said(cache_home):
    """--activations int8 on the bundled model (its int4 layers, x rounded to 8 bits): it answers,
    and its plan line says what it does (the default never does it)."""
    rc, out, err = run_cli("serve_local.py", "--prompt", "What is the capital of France?",
                           "--max-new-tokens", "8", "--activations", "int8",
                           env={"XDG_CACHE_HOME": str(cache_home)})
    assert rc == 0, err
    assert out.strip() and "x rounded to 8 bits for quantized weights" in err


@pytest.mark.parametrize("flags", [[], ["--kv", "paged"], ["--no-speculation"]])
def test_json_schema_shapes_every_answer(capsys, bundled_dir, tmp_path, flags):
    """--json-schema on the runner's decoders (the plan's speculative one, the paged engine,
    plain cached decoding): the answer is JSON valid against the file's schema."""
    import jsonschema
    schema = {"type": "object", "additionalProperties": False, "required": ["capital", "country"],
              "properties": {"capital": {"type": "string", "maxLength": 30},
                             "country": {"type": "string", "maxLength": 30}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    argv = ["--model", str(bundled_dir), "--no-compile", "--prompt", "What is the capital of France?",
            "--json-schema", str(tmp_path / "s.json"), "--temperature", "1", "--seed", "3", *flags]
    assert serve_local.main(argv) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)


# --- the chat's input and output --------------------------------------------------------------

def run_chat(model_dir, stdin: bytes, *flags, timeout=300):
    # --no-compile: a chat's plan compiles its step where g++ is present (minutes); these test the chat's I/O
    p = subprocess.run([sys.executable, "serve_local.py", "--model", str(model_dir), "--no-compile", *flags], cwd=ROOT,
                       input=stdin, capture_output=True, timeout=timeout)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def test_invalid_utf8_on_stdin_keeps_the_chat_going(tiny_ckpt):
    rc, out, err = run_chat(tiny_ckpt, b"What is 2+2?\nhi \xff\xfe there\nName a color.\n",
                            "--max-new-tokens", "5", "--temperature", "0")
    assert rc == 0 and "Traceback" not in err, err
    assert err.count("[prompt ") == 3                  # three turns, the middle one with U+FFFD in it


def test_invalid_utf8_in_the_prompt_argument(tiny_ckpt):
    p = subprocess.run([sys.executable, "serve_local.py", "--model", str(tiny_ckpt), "--prompt", b"hi \xff",
                        "--max-new-tokens", "3"], cwd=ROOT, capture_output=True, timeout=300)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr


def test_piped_chat_writes_answers_alone_to_stdout(tiny_ckpt):
    rc, out, err = run_chat(tiny_ckpt, b"hello\n/reset\nhello\n", "--max-new-tokens", "4", "--temperature", "0")
    assert rc == 0 and "> " not in out and err.count("[prompt ") == 2
    half = len(out) // 2
    assert out[:half] == out[half:] and out.endswith("\n")   # /reset: the same question, the same answer


def test_long_pastes_stay_out_of_the_line_history(monkeypatch):
    readline = pytest.importorskip("readline")
    added = []
    monkeypatch.setattr(readline, "add_history", added.append)
    for line in ("short question", "x" * 5000):
        monkeypatch.setattr("builtins.input", lambda prompt, line=line: line)
        assert serve_local.read_line(True, readline) == line
    assert added == ["short question"]


def test_help_shows_the_sampling_defaults(capsys):
    with pytest.raises(SystemExit):
        serve_local.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("default: 0.7", "default: 40", "default: 0.9", "default: 512"):
        assert default in text


def test_the_runner_keeps_a_forged_turn_as_text(tiny_ckpt):
    m, tok = nl.load(nl.RunConfig(str(tiny_ckpt)))
    chat = serve_local.Chat(m, tok, M.SamplingParams(max_new_tokens=2))
    ids = chat.conversation_ids(INJECTION)
    special = set(tok.special_ids)
    assert sum(i in special for i in ids) == sum(i in special for i in chat.conversation_ids("hi"))


# --- flags and devices that cannot work, a NaN at run time: one line each ----------------------

@pytest.mark.parametrize("device, message", [("cuda", "--device cuda: no such CUDA GPU"),
                                             ("mps", "--device mps: Apple's Metal (MPS) is not available"),
                                             ("tpu", "unknown device 'tpu'")])
def test_missing_device_is_one_line(capsys, tiny_ckpt, device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fails_with(capsys, ["--model", str(tiny_ckpt), "--device", device, "--prompt", "hi"], message)


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--top-k", "-3"], "top-k must be >= 0"),
])
def test_invalid_sampling_values(capsys, tiny_ckpt, flags, message):
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi", *flags], message)


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "", "--raw"], "nothing to complete"),
    (["--kv", "paged", "--block-size", "0"], "--block-size must be between 1 and the context"),
    (["--kv", "paged", "--block-size", "100000"], "--block-size must be between 1 and the context"),
    (["--cache", "static", "--ctx", "-5"], "--ctx must be at least 1"),
    (["--cache", "static", "--ctx", "0"], "--ctx must be at least 1"),
    (["--ctx", "0"], "--ctx must be at least 1"),
    (["--cache", "dynamic", "--ctx", "100"], "--ctx sizes a preallocated cache"),   # --ctx alone: static
    (["--block-size", "8"], "add --kv paged"),
    (["--adaptive-k"], "add --draft"),
    (["--group-size", "64"], "add --weights int4"),
    (["--activations", "int8"], "--activations int8 rounds x for quantized weights"),     # fp32 ones
    (["--json", "--json-schema", "x.json"], "give one"),
    (["--json-schema", "/no/such.json"], "--json-schema: cannot read /no/such.json"),
    (["--json-schema", __file__], "is not JSON"),
])
def test_flags_that_cannot_work_are_one_line(capsys, tiny_ckpt, flags, message):
    argv = ["--model", str(tiny_ckpt), *flags] + ([] if "--prompt" in flags else ["--prompt", "hi"])
    fails_with(capsys, argv, message)


def test_runtime_nan_stops_the_runner_with_one_line(capsys, tiny_ckpt, monkeypatch):
    real = M.Llama.step

    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return out * float("nan")
    monkeypatch.setattr(M.Llama, "step", poisoned)
    fails_with(capsys, ["--model", str(tiny_ckpt), "--prompt", "hi", "--temperature", "0"], "NaN or infinite")


# --- a full context -----------------------------------------------------------------------------

def test_prompt_longer_than_context(capsys, tmp_path):
    path = make_checkpoint(tmp_path / "short", max_position_embeddings=32)
    fails_with(capsys, ["--model", str(path), "--raw", "--prompt", "The quick brown fox " * 20],
               "tokens but the context holds 32")


def test_context_overflow_in_chat_keeps_conversation(tmp_path):
    """In chat a too-long turn is refused, the conversation and its cache stay usable."""
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


def test_overflow_hints_fit_the_situation(tmp_path, capsys):
    path = make_checkpoint(tmp_path / "short", max_position_embeddings=64)
    last = fails_with(capsys, ["--model", str(path), "--prompt", "The quick brown fox jumps " * 10], "context holds")
    assert "/reset" not in last and "shorten the message" in last
    m, tok = nl.load(nl.RunConfig(str(path)))
    chat = serve_local.Chat(m, tok, M.SamplingParams(max_new_tokens=4))
    chat.turn("hello", out=io.StringIO())
    with pytest.raises(M.ContextOverflow) as e:     # this message alone does not fit: /reset would not help
        chat.turn("The quick brown fox jumps over the lazy dog " * 10, out=io.StringIO())
    assert "/reset" not in str(e.value) and "shorten the message" in str(e.value)
    alone = len(chat.conversation_ids("fox " * 12, history=False))
    while len(chat.conversation_ids("fox " * 12)) < 64:      # fill the context with turns
        chat.turn("The quick brown fox", out=io.StringIO())
    assert alone < 64
    with pytest.raises(M.ContextOverflow, match="/reset starts a new conversation with room for it"):
        chat.turn("fox " * 12, out=io.StringIO())


def test_an_answer_cut_by_the_context_says_so(capsys, tiny_ckpt):
    argv = ["--model", str(tiny_ckpt), "--cache", "static", "--ctx", "40", "--max-new-tokens", "100",
            "--temperature", "0", "--raw", "--prompt", "hello there"]
    with_eos = nl.load(nl.RunConfig(str(tiny_ckpt)))[0].config.eos_ids
    assert serve_local.main(argv) == 0
    err = capsys.readouterr().err
    if "context 40/40" not in err:
        pytest.skip(f"the tiny model stopped at EOS {with_eos} before the context filled")
    assert "[the answer was cut: the context is full (40 tokens); a larger --ctx]" in err


# --- the paged runner's stats line -------------------------------------------------------------

# One thread: with two, a descheduled thread stalls its partner at every join, and under CI's
# second worker that halved one kind's best rate (21 against 43 tok/s) whichever kind it hit.
@pytest.mark.usefixtures("one_thread")
def test_paged_stats_agree_with_the_contiguous_cache(bundled_dir):
    m, tok = nl.load(nl.RunConfig(str(bundled_dir)))
    params = M.SamplingParams(max_new_tokens=8, ignore_eos=True)
    runs = {"contiguous": [], "paged": []}
    for _ in range(5):          # interleaved: a slow moment hits both (the other test worker's builds)
        for kind in runs:
            chat = (serve_local.PagedChat if kind == "paged" else serve_local.Chat)(m, tok, params, ctx=512)
            t0 = time.perf_counter()
            s = chat.turn("Name three colours.", out=io.StringIO())
            # whatever the machine does, each kind's stats account for the turn's own time
            assert s.prefill_s + s.decode_s <= time.perf_counter() - t0
            runs[kind].append((s.prefill_s, (s.new_tokens - 1) / s.decode_s))
    # each kind's best: a neighbour's time slice only ever makes a run slower, never faster
    (ttft_c, rate_c), (ttft_p, rate_p) = [(min(t for t, _ in r), max(v for _, v in r)) for r in runs.values()]
    assert 0.5 < ttft_p / ttft_c < 2 and 0.5 < rate_p / rate_c < 2, runs


def test_paged_stats_with_two_tokens_are_sane(capsys, tiny_ckpt):
    assert serve_local.main(["--model", str(tiny_ckpt), "--kv", "paged", "--prompt", "hi", "--max-new-tokens", "2",
                             "--temperature", "0"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    ms = float(line.split("first token ")[1].split(" ms")[0])
    assert ms > 0.01 and "generated 2 tok" in line, line


# --- a speculative draft under a small static cache --------------------------------------------

def test_draft_with_a_small_static_cache_starts(capsys, bundled_dir, monkeypatch):
    if not (drafting.BUNDLED_DRAFT / "config.json").is_file():
        pytest.skip("no bundled draft")
    rc = serve_local.main(["--model", str(bundled_dir), "--draft", "bundled", "--cache", "static", "--ctx", "40",
                           "--prompt", "hi", "--max-new-tokens", "5", "--temperature", "0"])
    err = capsys.readouterr().err
    assert rc == 0 and "acceptance" in err, err


def test_one_answer_longer_than_the_plans_static_cache_runs_on_a_dynamic_one(capsys, tmp_path, monkeypatch):
    """One answer (--prompt) on the plan's compiled step (loaded if built before, never built for it) holds a
    static cache of the plan's context; a prompt too long for it, where the model takes more, answers on a
    dynamic cache instead of failing (with no --ctx given)."""
    path = make_checkpoint(tmp_path / "long", max_position_embeddings=4096)
    planned = nanoinfer.config.plan_for
    monkeypatch.setattr(nanoinfer.config, "plan_for", lambda *a, **k: replace(
        planned(*a, **k), compile=True, build=False, cache="static"))
    argv = ["--model", str(path), "--raw", "--temperature", "0", "--max-new-tokens", "2", "--prompt"]
    assert serve_local.main(argv + ["The quick brown fox"]) == 0
    err = capsys.readouterr().err
    assert "compiled if built before, else eager" in err and "/2048]" in err
    assert serve_local.main(argv + ["The quick brown fox " * 250]) == 0
    err = capsys.readouterr().err
    assert "/4096]" in err and "no compiled step" not in err
    prompt = int(err.split("[prompt ")[1].split(" tok")[0])
    assert 2048 < prompt < 4096
