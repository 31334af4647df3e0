"""serve_local.Chat: the conversation's KV cache survives between turns and changes no token."""

import io

import pytest

import model as M
import nanoinfer.load as nl
import serve_local
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


def test_stats_line_reports_rates():
    s = M.GenerationStats(prompt_tokens=40, new_tokens=11, prefill_s=0.5, decode_s=1.0)
    line = serve_local.stats_line(s, 51, 2048)
    assert line == "[prompt 40 tok, 80.0 tok/s | generated 11 tok, 10.0 tok/s | first token 500 ms | context 51/2048]"
