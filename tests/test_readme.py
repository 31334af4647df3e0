"""Every command README.md, RUNNING.md and RESULTS.md show works on a fresh clone.

Each command is run here (the quick ones), or named with the test that runs it, or listed as slow
with its time on 2 cores (those are run by hand before a release; see the issue notes). A command
added to the docs without a place in one of these tables fails the first test."""

import re
import shlex

import pytest

from conftest import ROOT, run_cli

# Run here: command → seconds allowed. Interactive runner commands get a prompt appended.
QUICK = {
    "python kvcache.py --config llama2-7b --seq 32768": 60,
    "python bench.py kv-plot": 60,
    "python flash.py": 60,
    "python paged.py": 60,
    "python bench.py paged --simulate 1000": 120,
    "python quantize.py": 60,
    "python tp.py": 120,
    "python engine.py --trace": 120,
    "python sampling.py": 60,
    "python kernels.py": 60,
    "python serve_local.py --kv paged": 120,
    "python serve_local.py --weights int4 --kv-dtype int8": 120,
    "python serve_local.py --draft bundled --prompt-lookup 3": 120,
    "python bench.py -h": 60,
    "python serve_local.py --help": 60,
    "python server.py --help": 60,
    "python serve_local.py --plan": 60,
    "python server.py --plan": 60,
}
# Run by another test.
COVERED = {
    "make chat": "test_chat_session.py (the runner in a terminal)",
    'make chat ARGS="--dtype bf16"': "test_chat_session.py; --dtype in test_runner.py",
    "make test": "CI itself",
    "python serve_local.py --activations int8": "test_runner.py (--activations int8 on the bundled model)",
    "make exercise": "test_exercises.py",
    "make exercise E=flash": "test_exercises.py",
    "python -m pytest tests --exercise flash": "test_exercises.py",
    "python -m pytest tests/lessons/test_flash.py": "CI itself",
    "python serve_local.py": "test_chat_session.py",
    "python serve_local.py --plan --model tinyllama --ctx 8192": "test_plan.py",
    "python serve_local.py --prompt \"What is the capital of France?\" --temperature 0":
        "test_runner.py::test_runner_answers_paris",
    "python serve_local.py --model tinyllama --dtype bf16": "test_checkpoint.py (a real HF cache layout, offline)",
    "python serve_local.py --model ./my-llama-dir": "test_model.py (HF directories, and those that cannot load)",
    "python serve_local.py --model ./model.Q4_K_M.gguf": "test_checkpoint.py (GGUF files)",
    "python tokenizer.py PATH": "test_tokenizer.py",
    "python serve_local.py --json-schema person.json": "test_runner.py::test_json_schema_shapes_every_answer",
    "python serve_local.py --draft medusa --spec-tree 4,10": "test_drafting.py::test_committed_medusa "
                                                             "(nanoinfer.load.proposer with these flags)",
    "python bench.py report": "test_results.py (RESULTS.md is what results/*.json render to)",
    "make serve": "test_server.py::test_sigterm_finishes_streams_and_exits_0 (python server.py)",
    "python server.py": "test_server.py::test_sigterm_finishes_streams_and_exits_0",
    "python server.py --api-key secret --port 8080": "test_server.py (--api-key: test_api_key_body_cap_and_full_queue)",
    "make gpu-check": "test_gpu_check.py (its dry run; the real run needs a CUDA GPU)",
    "bash scripts/gpu_check.sh --dry-run": "test_gpu_check.py",
}
# Another project's command, shown for comparison (not installed here).
EXTERNAL = {"python -m sglang.launch_server --model-path TinyLlama/TinyLlama-1.1B-Chat-v1.0 --tp 2"}
# Run by hand: the time each takes on a 2-core CPU, roughly.
SLOW = {
    "python model.py": "~1 min",
    "python speculative.py": "~1 min",
    "python drafting.py": "~1 min",
    "python drafting.py --save": "~1 min (writes results/speculative-demo.json)",
    "python kernels.py --save": "~1 min (writes results/kernels-linear.json)",
    "python bench.py prefix": "~1 min",
    "python bench.py context": "~2 min",
    "python bench.py naive-vs-cached": "~1 min",
    "python serve_local.py --dtype bf16 --cache static --compile": "1-2.5 min to compile the first time, then chat",
    "python bench.py compiled-start --threads 1": "~4 min (a first run also builds the package: +1-2.5 min)",
    "python bench.py attention": "~5 min",
    "python bench.py attention --quick": "~1 min",
    "python bench.py batching": "~3 min",
    "python bench.py soak": "~5 min",
    "python bench.py grammar": "~4 min",
    "python bench.py batching --threads 1": "~3 min",
    "python bench.py engine-step": "~8 min cold (four compiles), ~3 min with inductor's disk cache",
    "python bench.py engine-step --threads 1": "~3 min cold (two compiles), ~1.5 min with inductor's disk cache",
    "python bench.py speculative": "~15 min",
    "python bench.py decode": "~25 min",
    "python bench.py decode --models smollm2-135m --dtypes bfloat16": "~4 min",
    "python bench.py decode --models smollm2-135m --dtypes float32": "~4 min",
    "python bench.py decode --dtypes float32": "~17 min (TinyLlama's fp32 rows and compiles take most)",
    "python bench.py decode --dtypes bfloat16": "~15 min (TinyLlama's bf16 rows and compiles take most)",
    "python bench.py runner --fastest --weights int8 --compile --no-speculation": "~12 min",
    "python bench.py quantize --eval": "~10 min",
    "python bench.py kv-bytes": "~30 s",
    "python bench.py offload": "~2 min",
    "python bench.py offload --threads 1": "~2 min",
    "python bench.py tp": "~1 min",
    "python bench.py engine": "~1 min",
    "python bench.py batching --long-prompts-only": "~4 min (7 on a 2-core machine at load 6)",
    "python bench.py serve": "~6 min (llama-server beside it: scripts/build_llama_server.sh, ~10 min once)",
    "python bench.py serve --seconds 30": "~5 min",
    "python bench.py runner": "~10 min (a first run builds the compiled step: +1-2.5 min)",
    "python bench.py runner --rounds 1": "~5 min",
    "python bench.py runner --rounds 2": "~8 min",
    "python bench.py gguf": "~15 min (a first run writes and quantizes its files: +3 min; needs "
                            "scripts/build_llama_server.sh)",
    "python bench.py gguf --flags '--activations int8'": "~12 min (the F16 file refuses the flag)",
    "python bench.py gguf --shapes tinyllama --types Q5_K_M,Q6_K,Q4_0,Q5_0,BF16,IQ4_XS,IQ4_NL,"
    "Q3_K_M,Q2_K": "~22 min (a first run quantizes its files: +2 min)",
}


def documented_commands() -> set[str]:
    found = set()
    for doc in ("README.md", "RUNNING.md", "RESULTS.md"):
        text = (ROOT / doc).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            found |= {line.split("  #")[0].strip() for line in block.splitlines() if line.strip()}
        found |= {" ".join(c.split()) for c in re.findall(r"`((?:python|make) [^`]+)`", text)}
        found |= {c for c in re.findall(r"`(make \w+)`", text)}
    return {c for c in found if c.startswith(("python ", "make "))}


def test_the_front_page_is_a_course():
    """README.md stays short enough to read as the course's front page, its table first; the
    runner's and the server's reference lives in RUNNING.md."""
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 12_000, len(text)
    assert [h for h in re.findall(r"^## (.+)$", text, re.M)][0] == "The course"
    assert "(RUNNING.md)" in text


def test_every_documented_command_has_a_place():
    known = set(QUICK) | set(COVERED) | set(SLOW) | EXTERNAL
    assert sorted(documented_commands() - known) == []


@pytest.mark.parametrize("command", sorted(QUICK))
def test_quick_command_runs(command, cache_home):
    args = shlex.split(command)[1:]
    if args[0] == "serve_local.py" and "--prompt" not in args and "--help" not in args:
        args += ["--prompt", "Say hi.", "--max-new-tokens", "8", "--temperature", "0"]
    rc, out, err = run_cli(*args, env={"XDG_CACHE_HOME": str(cache_home)}, timeout=QUICK[command])
    assert rc == 0, err[-2000:]
    assert out.strip(), f"{command} printed nothing"
    assert "Traceback" not in err


def test_read_first_names_exist():
    """The course table's `file.py:function` (and the names after it) are real definitions,
    and each lesson's first one, what to read first, starts in its file's first 150 lines."""
    import importlib
    import inspect
    text = (ROOT / "README.md").read_text()
    pairs, first = [], []
    for line in text.splitlines():
        for k, m in enumerate(re.finditer(r"`(\w+)\.py:([\w.]+)`", line)):
            pairs.append((m.group(1), m.group(2)))
            first += [pairs[-1]] if k == 0 and line.startswith("| ") else []
            tail = line[m.end():].split("|")[0]
            pairs += [(m.group(1), n) for n in re.findall(r"`([\w.]+)`", tail)]
    assert len(pairs) >= 14 and len(first) >= 9
    found = {}
    for module, name in pairs:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        found[module, name] = obj
    late = {f"{m}.py:{n}": line for (m, n) in first
            if (line := inspect.getsourcelines(found[m, n])[1]) > 150}
    assert not late, f"read-first code past line 150: {late}"
