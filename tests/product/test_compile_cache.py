"""kernels.AheadOfTime: a compiled one-token step is built once, and a second model object (a later start)
loads it instead of compiling; its tokens equal the eager step's; a different context or dtype has its own."""

import os
import queue
import subprocess
import sys
import threading
import time

import pytest

import kernels
import model as M
import nanoinfer.load as nl
from conftest import ROOT, make_checkpoint
import kvcache

pytestmark = pytest.mark.usefixtures("one_thread")


def decode(model, prompt, max_len=64, n=32):
    cache = kvcache.new_cache(model, "static", max_len=max_len)
    return list(M.generate_cached(model, prompt, M.SamplingParams(max_new_tokens=n), cache=cache))


LATER_START = """
import sys, kernels, kvcache, model as M
m = kernels.compile_decode(M.Llama.from_pretrained(sys.argv[1], "cpu", "float32"))
m.config.eos_ids = []
cache = kvcache.new_cache(m, "static", max_len=64)
list(M.generate_cached(m, [7, 8], M.SamplingParams(max_new_tokens=2), cache=cache))
print(m.compiled_step.log[0].split()[2], "torch._inductor" in sys.modules)
"""


def test_package_is_built_once_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = make_checkpoint(tmp_path / "m", tokenizer=False, num_hidden_layers=1)
    builds = []
    build = kernels.AheadOfTime.build
    monkeypatch.setattr(kernels.AheadOfTime, "build", lambda self, *a: builds.append(a[0]) or build(self, *a))

    def start(dtype="float32"):
        model = M.Llama.from_pretrained(path, "cpu", dtype)
        model.config.eos_ids = []
        return model

    eager, prompt = start(), list(range(10, 30))
    first = kernels.compile_decode(start())
    assert decode(first, prompt) == decode(eager, prompt)                # ≥ 32 greedy tokens, fp32
    assert len(builds) == 1 and "compiled (once)" in first.compiled_step.log[0]
    assert first.compiled_step.built == builds
    assert [p.name for p in (tmp_path / "xdg" / "nanoinfer" / "compiled").iterdir()] == [builds[0].name]

    second = kernels.compile_decode(start())                                     # a later start: loads, no compile
    assert decode(second, [7, 8]) == decode(eager, [7, 8])
    assert len(builds) == 1 and second.compiled_step.log == [second.compiled_step.log[0]]
    assert second.compiled_step.log[0].startswith("compiled step loaded from cache in")
    assert second.compiled_step.built == []

    handed = second.compiled_step.handed[0]                               # the model's own tensors, no copy
    assert handed["model.embed_tokens.weight"] is second.embed_tokens.weight
    # a later process loads it without importing inductor (its compiler and triton: ~140 MB held)
    later = subprocess.run([sys.executable, "-c", LATER_START, str(path)], cwd=ROOT, text=True,
                           capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert later.stdout.split() == ["loaded", "False"], later.stderr[-500:]

    lazy = kernels.compile_decode(start(), build=False)          # another context: a package of its own, not on disk yet
    assert decode(lazy, prompt, max_len=128, n=2) == decode(eager, prompt, max_len=128, n=2)   # (ran eagerly)
    assert len(builds) == 1 and [p.name for p in lazy.compiled_step.missing.values()] != [builds[0].name]
    assert len(lazy.compiled_step.missing) == 1 and lazy.compiled_step.runners == {}
    variant = next(iter(second.compiled_step.runners))
    bf16 = kernels.compile_decode(start("bfloat16"))                             # another dtype: another name
    assert bf16.compiled_step.path(variant) not in builds
    # and another source: the step's modules, and the modules their imported names come from
    def sources(llama, cache_type):
        home, code = kernels.Path(M.__file__).parent, kernels.step_code(llama, cache_type)
        return {p.name for f in code for p in kernels.project_sources(sys.modules[f.__module__], home)}
    assert {"model.py", "kernels.py", "kvcache.py"} <= sources(second, type(kvcache.new_cache(second, "static", 8)))
    # the runner's: flash.py's attention around kernels.cpp's decode, int8 layers (quantize.py)
    runner = nl.build(path, nl.RunConfig(weights="int8"))
    assert {"model.py", "kernels.py", "flash.py", "quantize.py"} <= sources(runner, None)


def test_a_first_chat_answers_on_the_eager_step_while_a_child_compiles(tmp_path):
    """No package on disk yet: one answer (--prompt) runs eagerly and builds none; the chat answers at
    once on the eager step while `serve_local.py --compile-only` builds it in a child process; the turn
    after the build loads it (same tokens, fp32), and a later start, or one answer, finds it on disk."""
    ckpt = make_checkpoint(tmp_path / "m", num_hidden_layers=1)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "OMP_NUM_THREADS": "1"}
    flags = ["serve_local.py", "--model", str(ckpt), "--compile", "--raw", "--temperature", "0", "--max-new-tokens", "8"]
    lines = queue.Queue()

    def until(text, timeout=240):
        seen, deadline = [], time.monotonic() + timeout
        while not seen or text not in seen[-1]:
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
        return seen

    folder = tmp_path / "xdg" / "nanoinfer" / "compiled"
    # one answer (--prompt) pays for no compile: with no package on disk it runs eagerly and says so
    answer = [sys.executable, *[f for f in flags if f != "--compile"], "--prompt", "The sea was"]
    alone = subprocess.run(answer, cwd=ROOT, env=env, text=True, capture_output=True, timeout=240)
    assert alone.returncode == 0 and "no compiled step on disk for these flags yet" in alone.stderr
    assert "compiled if built before, else eager" in alone.stderr and not list(folder.glob("*.pt2"))
    chat = subprocess.Popen([sys.executable, *flags], cwd=ROOT, env=env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    threading.Thread(target=lambda: [lines.put(line) for line in chat.stderr], daemon=True).start()
    try:
        assert any("compiling the decode step in the background" in s for s in until("chat:"))
        chat.stdin.write("The sea was\n")
        chat.stdin.flush()
        until("tok/s")
        assert not list(folder.glob("*.pt2"))                     # answered before the package exists
        for _ in range(120):             # a turn after the child has exited loads its package first
            chat.stdin.write("/reset\nThe sea was\n")
            chat.stdin.flush()
            if any("[compiled step ready: loaded in" in s for s in until("tok/s")):
                break
            time.sleep(2)
        else:
            raise AssertionError((folder / "background-build.log").read_text()[-500:])
        chat.stdin.write("/exit\n")
        chat.stdin.flush()
        answers = chat.communicate(timeout=60)[0].splitlines()
    finally:
        chat.kill()
    assert answers[0] == answers[-1]                               # eager, then compiled: the same tokens
    again = subprocess.run([sys.executable, *flags, "--compile-only"], cwd=ROOT, env=env, text=True,
                           capture_output=True, timeout=240)
    assert again.returncode == 0 and "compiled step loaded from cache" in again.stderr
    # and one answer now loads the chat's package: the same tokens as the eager answer before it
    loaded = subprocess.run(answer, cwd=ROOT, env=env, text=True, capture_output=True, timeout=240)
    assert loaded.returncode == 0 and "compiled step loaded from cache" in loaded.stderr
    assert "no compiled step" not in loaded.stderr and loaded.stdout == alone.stdout


def test_a_failed_background_compile_is_one_line_and_the_answers_stay_eager(capsys):
    """The child building the package exited with an error: between turns the chat says so once, with the
    log's path, drops the child and keeps answering on the eager step (it never loads a package)."""
    import serve_local

    class Failed:                   # what subprocess.Popen gives back once such a child has ended
        returncode = 1

        def poll(self):
            return self.returncode

    chat = serve_local.Chat.__new__(serve_local.Chat)
    chat.building, chat.model = Failed(), None      # a model is never touched on this path
    serve_local.take_compiled_step(chat)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the background compile failed (exit 1, log: " in err
    assert "background-build.log); the answers stay on the eager step" in err
    assert chat.building is None
    serve_local.take_compiled_step(chat)            # the next turn: nothing more to say
    assert capsys.readouterr().err == ""


def test_the_server_says_how_its_background_build_ended(tmp_path):
    """server.py builds its compiled steps in a child while it answers: when the child ends, one line
    says the steps are built, or that the build failed and where its log is; a child the server
    stopped at its own shutdown ends without a word."""
    import io
    import server
    log = tmp_path / "server-build.log"
    said = {}
    for name, code in (("built", "0"), ("failed", "3"), ("stopped", "import os, signal; "
                                                          "os.kill(os.getpid(), signal.SIGTERM)")):
        out = io.StringIO()
        server.report_build(subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"
                                              if code.isdigit() else code]), log, out)
        said[name] = out.getvalue()
    assert said["built"] == "[compiled decode steps built: each loads at its next call]\n"
    assert said["failed"] == (f"[the background compile failed (exit 3, log: {log}); the answers "
                              f"stay on the eager step]\n")
    assert said["stopped"] == ""


def test_the_engine_runs_its_decode_steps_compiled_and_each_request_gets_its_text_alone(tmp_path,
                                                                                       monkeypatch):
    """The server's engine on fixed shapes (engine.Engine(fixed_shapes=True)): decode passes padded
    to 1, 2, 3, 4 rows (padded_rows) run the compiled step, the pool written and read in place
    (paged_attention); prompts decoding together get the tokens each gets alone, greedy and
    sampled, and every block comes back. warm_up builds each shape before a request waits on it."""
    from engine import Engine
    from sampling import SamplingParams
    if not kernels.native_kernels(quiet=True):
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = make_checkpoint(tmp_path / "m", tokenizer=False, num_hidden_layers=1)
    model = M.Llama.from_pretrained(path, "cpu", attend=kernels.native_decode(M.attend))
    model.config.eos_ids = []
    kernels.compile_decode(model)

    def run(prompts, **sampling):
        engine = Engine(model, block_size=16, max_batch=4, kv_bytes=1 << 20, fixed_shapes=True,
                        in_place=kernels.paged_reader("cpu"))
        engine.warm_up()
        reqs = [engine.add(p, SamplingParams(max_new_tokens=20, **sampling)) for p in prompts]
        engine.run()
        assert engine.num_free_blocks == engine.allocator.num_blocks
        return [r.sequences[0].output for r in reqs]
    prompts = [[7], list(range(3, 20)), list(range(10, 47))]
    for sampling in ({}, {"temperature": 1.0, "seed": 5}):
        assert run(prompts, **sampling) == [run([p], **sampling)[0] for p in prompts]
    assert len(model.compiled_step.runners) == 4            # 1, 2, 3 and 4 rows
