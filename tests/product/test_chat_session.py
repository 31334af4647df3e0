"""The chat as a person types it, in a real terminal (pexpect): Ctrl-C stops an answer,
Ctrl-C at the prompt clears the line and keeps the conversation, and the next turn
answers exactly as a fresh chat with the same history would."""

import io
import re
import os
import sys

import pytest

import model as M
import nanoinfer.load as nl
import serve_local
from conftest import ROOT

pexpect = pytest.importorskip("pexpect")

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
STORY = "Write a long story about a dragon who learns to cook."
FOLLOW_UP = "What is 2+2?"


def test_ctrl_c_in_an_answer_and_at_the_prompt(bundled_dir, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), "TERM": "dumb", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],     # conftest: the one kernel build
           "OMP_NUM_THREADS": "1"}      # beside the other test worker, a second thread stalls each step
    child = pexpect.spawn(sys.executable, ["serve_local.py", "--model", str(bundled_dir), "--temperature", "0",
                                           "--max-new-tokens", "300", "--dtype", "float32",
                                           "--no-compile"],   # the plan's EAGLE head + lookup, eager (no compile wait)
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=120)
    try:
        child.expect_exact("> ")
        child.sendline(STORY)
        child.expect_exact(STORY)                          # the terminal's echo of the line
        child.expect(r"\w+\W+\w+\W+\w+\W+\w+\W+\w+")        # the answer is streaming
        shown = child.before + child.after
        child.sendintr()
        child.expect_exact(" [interrupted]")
        shown += child.before
        child.expect_exact("> ")
        held_back = child.before                           # characters flushed after the interrupt, if any
        child.sendintr()                                   # at the prompt: clear the line, keep the chat
        child.expect_exact("Ctrl-C again or Ctrl-D to quit")
        child.expect_exact("> ")
        child.sendline(FOLLOW_UP)
        child.expect_exact(FOLLOW_UP)
        child.expect(r"\[prompt \d+ tok")
        answer = child.before
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    except pexpect.TIMEOUT:        # the whole screen, not pexpect's last 100 characters
        pytest.fail(f"no {child.searcher} within {child.timeout} s; the terminal showed:\n{child.before[-3000:]}")
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.exitstatus

    def clean(text):             # the terminal's escapes, line ends, and its echo of Ctrl-C out
        return ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "").replace("^C", "")
    # What the first answer showed before the interrupt is what the conversation kept.
    partial = clean(shown).removeprefix("\n") + clean(held_back).split("\n", 1)[0]
    got = clean(answer).strip("\n")

    m, tok = nl.load(nl.RunConfig(str(bundled_dir)))
    fresh = serve_local.Chat(m, tok, M.SamplingParams(max_new_tokens=300))
    fresh.messages = [{"role": "user", "content": STORY}, {"role": "assistant", "content": partial}]
    out = io.StringIO()
    fresh.turn(FOLLOW_UP, out=out)
    assert partial.strip() and got == out.getvalue().rstrip("\n")
