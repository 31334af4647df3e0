"""server.py as an adversarial client meets it: one request never takes down the others,
no request makes the server wait longer than a step, every request ends when its client
leaves, a web page cannot use a loopback server, and SIGINT drains and exits cleanly.
Each numbered finding of the hardening issue has its test here; a hypothesis fuzz of
request bodies runs beside normal streams."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
uvicorn = pytest.importorskip("uvicorn")

import engine                      # noqa: E402
import server                      # noqa: E402
import test_server                 # noqa: E402
from conftest import ROOT          # noqa: E402
from test_server import (QUESTIONS, Live, chat_ids, error_of, model_tok, reference,  # noqa: E402,F401
                         start_cli)


@pytest.fixture(scope="module")
def live(model_tok):
    model, tok = model_tok
    srv = Live(server.Server(engine.Engine(model, max_batch=16, kv_bytes=128 << 20), tok, "smollm2",
                             api_key="sesame"))
    yield srv
    srv.close()


KEY = {"Authorization": "Bearer sesame"}


def metric(live, name: str) -> float:
    return test_server.metric(live, name, KEY)


def post(live, path, body, headers=None, **kw):
    return httpx.post(live.url + path, json=body, headers={**KEY, **(headers or {})}, timeout=120, **kw)


async def stream_chat(url, question, max_tokens, **extra):
    """One streamed chat, read to its end: (text, the raw lines)."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **extra}
    lines = []
    async with httpx.AsyncClient(timeout=300) as c:
        async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=KEY) as r:
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
    text = "".join((json.loads(x[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                   for x in lines if x.startswith("data: {") and '"choices"' in x)
    return text, lines


# ----------------------------------------------------------------------------
# 1. A value one request brings never reaches the engine unchecked.

def test_a_seed_that_overflows_a_branch_is_that_requests_400(live, model_tok, reference):
    tok = model_tok[1]

    async def run():
        other = asyncio.ensure_future(stream_chat(live.url, QUESTIONS[0], 16))
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1}
            bad = [await c.post(live.url + "/v1/chat/completions", headers=KEY, json={**body, **extra})
                   for extra in ({"n": 2, "seed": 2 ** 64 - 1}, {"seed": 2 ** 64}, {"seed": -1})]
        return bad, await other
    bad, (text, lines) = asyncio.run(run())
    for r in bad:
        err = error_of(r, 400)
        assert err["param"] == "seed" and "Overflow" not in err["message"], err
    assert "branch i samples with seed + i" in bad[0].json()["error"]["message"]
    assert lines[-1] == "data: [DONE]" and text == reference(chat_ids(tok, QUESTIONS[0]), 16).text
    assert live.settled() == (0, False)


# ----------------------------------------------------------------------------
# 2. Bounded work per token: stop strings are capped, and matched in linear time.

def test_stop_strings_are_capped(live):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    err = error_of(post(live, "/v1/chat/completions", {**body, "stop": ["Q" * 250_000] * 4}), 400)
    assert err["param"] == "stop.0" and str(server.STOP_CHARS) in err["message"]
    error_of(post(live, "/v1/chat/completions", {**body, "stop": ["a"] * (server.STOPS + 1)}), 400)
    error_of(post(live, "/v1/chat/completions", {**body, "messages": body["messages"] * (server.MESSAGES + 1)}),
             400)
    assert post(live, "/v1/chat/completions", {**body, "stop": ["Q" * server.STOP_CHARS] * server.STOPS}
                ).status_code == 200


def test_health_answers_while_a_long_prompt_is_encoded(live, model_tok):
    """Encoding ~0.9 MB of text takes ~0.4 s: off the event loop, which meanwhile answers
    /health in a fraction of that (on the event loop, each probe waited for all of it)."""
    words = " ".join(["the quick brown fox jumps over a lazy dog"] * 20_000)
    t0 = time.perf_counter()
    model_tok[1].encode_chat([{"role": "user", "content": words}])
    encoding = time.perf_counter() - t0
    done, gaps = threading.Event(), []

    def send():
        r = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": words}]})
        assert error_of(r, 400)["code"] == "context_length_exceeded"
        done.set()
    sender = threading.Thread(target=send)
    sender.start()
    with httpx.Client() as c:
        while not done.is_set():
            t0 = time.perf_counter()
            r = c.get(live.url + "/health")
            assert r.status_code == 200, (r.status_code, r.text)
            gaps.append(time.perf_counter() - t0)
    sender.join()
    assert len(gaps) > 3 and max(gaps) < encoding / 2, (len(gaps), max(gaps), encoding)


def test_stop_matching_is_linear_in_the_text():
    """The worst case for a naive matcher: every stop is all but matched at every character
    (the old one sliced every prefix of every stop per token: quadratic, 35 s for 4 x 250k)."""
    stops = ["Q" * (server.STOP_CHARS - 1) + "X"] * server.STOPS
    s, t0 = server.StopText(stops), time.perf_counter()
    sent = "".join(s.push("Q")[0] for _ in range(20_000))
    assert time.perf_counter() - t0 < 2.0
    assert sent == "Q" * (20_000 - server.STOP_CHARS + 1)       # the tail that could still match is held
    assert s.push("X") == ("", True)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
       st.lists(st.text("abc", max_size=5), max_size=12))
def test_stop_text_equals_a_search_of_the_whole_text(stops, pieces):
    """Streamed in any pieces, the text sent is the text before the first stop string to
    complete (of two completing together, the one that began first), and all of it if none."""
    text = "".join(pieces)
    ends = [(e, e - len(s)) for e in range(len(text) + 1) for s in stops if text[:e].endswith(s)]
    want = (text[:min(st for e, st in ends if e == min(ends)[0])], True) if ends else (text, False)
    matcher, sent, hit = server.StopText(stops), "", False
    for i, p in enumerate(pieces):
        out, hit = matcher.push(p, final=i == len(pieces) - 1)
        sent += out
        if hit:
            break
    assert (sent, hit) == want or (not pieces and want == ("", False))


# ----------------------------------------------------------------------------
# 3. Every request ends when its client leaves, streamed or not (raw sockets).

def raw_request(live, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", live.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer sesame\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_ends_when_its_client_leaves(live, stream):
    cancelled = 'nanoinfer_requests_finished_total{reason="cancelled"}'
    before = metric(live, cancelled)
    sock = raw_request(live, {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                              "stream": stream})
    deadline = time.time() + 30
    while metric(live, "nanoinfer_kv_blocks_used") == 0:
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    sock.close()
    deadline = time.time() + 10
    while metric(live, "nanoinfer_requests_running") or metric(live, "nanoinfer_kv_blocks_used"):
        assert time.time() < deadline, "the request outlived its client"
        time.sleep(0.05)
    assert metric(live, cancelled) == before + 1
    assert live.settled() == (0, False)


# ----------------------------------------------------------------------------
# 4. A web page cannot use the server.

def test_a_cross_origin_page_cannot_post_or_read(live):
    generated = metric(live, "nanoinfer_generation_tokens_total")
    body = json.dumps({"prompt": "hi", "max_tokens": 4})
    evil = {"Origin": "http://evil.example"}
    # a form or a no-cors fetch(): text/plain, sent cross-origin without a preflight
    r = httpx.post(live.url + "/v1/completions", content=body, headers={**KEY, **evil, "Content-Type": "text/plain"})
    assert error_of(r, 403)["type"] == "permission_error" and "--allow-origin" in r.json()["error"]["message"]
    error_of(post(live, "/v1/completions", json.loads(body), evil), 403)
    # a page on the same server without the Origin check: the content type alone stops it
    r = httpx.post(live.url + "/v1/completions", content=body, headers={**KEY, "Content-Type": "text/plain"})
    assert "application/json" in error_of(r, 415)["message"]
    assert metric(live, "nanoinfer_generation_tokens_total") == generated
    # DNS rebinding: the attacker's name now points here, so its page is "same-origin"
    for path in ("/v1/models", "/metrics", "/health", "/"):
        r = httpx.get(live.url + path, headers={**KEY, "Host": "evil.example"})
        assert "--allow-host" in error_of(r, 403)["message"], path
    r = httpx.post(live.url + "/v1/completions", content=body,
                   headers={**KEY, "Host": f"evil.example:{live.port}", "Origin": f"http://evil.example:{live.port}",
                            "Content-Type": "application/json"})
    error_of(r, 403)
    # the chat page itself: same origin, JSON
    same = {"Origin": live.url, "Host": f"127.0.0.1:{live.port}"}
    assert post(live, "/v1/completions", json.loads(body), same).status_code == 200
    assert httpx.get(f"http://localhost:{live.port}/health").status_code == 200


def test_guard_rules():
    g = server.Guard("127.0.0.1")
    ok = {"host": "127.0.0.1:8080", "content-type": "application/json"}
    assert g.refuse("POST", "/v1/completions", ok) is None
    assert g.refuse("POST", "/v1/completions", {**ok, "host": "[::1]:8080"}) is None
    assert g.refuse("POST", "/v1/completions", {**ok, "content-type": "application/json; charset=utf-8"}) is None
    assert g.refuse("POST", "/v1/completions", {**ok, "host": "evil.example:8080"}).status == 403
    assert g.refuse("GET", "/", {"host": "127.0.0.1:8080", "origin": "http://127.0.0.1:8080"}) is None
    assert g.refuse("GET", "/", {"host": "127.0.0.1:8080", "origin": "null"}).status == 403
    assert server.Guard("127.0.0.1", ("box.lan",)).refuse("GET", "/", {"host": "box.lan"}) is None
    assert server.Guard("0.0.0.0").refuse("GET", "/", {"host": "box.lan"}) is None     # opened on purpose
    assert server.Guard("0.0.0.0", ("box.lan",)).refuse("GET", "/", {"host": "other"}).status == 403
    app = {"host": "127.0.0.1:8080", "origin": "https://app.example", "content-type": "application/json"}
    assert server.Guard(allow_origins=("https://app.example",)).refuse("POST", "/v1/completions", app) is None
    assert server.Guard(allow_origins=("*",)).refuse("POST", "/v1/completions", app) is None


def test_an_allowed_origin_gets_cors_and_no_other(model_tok):
    model, tok = model_tok
    srv = Live(server.Server(engine.Engine(model, max_batch=2, kv_bytes=16 << 20), tok, "s",
                             guard=server.Guard(allow_origins=("https://app.example",))))
    try:
        pre = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Origin": "https://other.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    finally:
        srv.close()


# ----------------------------------------------------------------------------
# 6. Smaller: the bearer scheme's case, the port checked before loading.

def test_the_bearer_scheme_is_case_insensitive(live):
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(live.url + "/v1/models", headers={"Authorization": f"{scheme} sesame"}).status_code == 200
    error_of(httpx.get(live.url + "/v1/models", headers={"Authorization": "Basic sesame"}), 401)
    error_of(httpx.get(live.url + "/v1/models", headers={"Authorization": "bearer sesam"}), 401)


def test_a_taken_port_is_one_line_before_loading(bundled_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.time()
        p = subprocess.run([sys.executable, "server.py", "--model", str(bundled_dir), "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and lines[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}"), p.stderr
    assert "--port" in lines[-1] and not any(line.startswith("loaded") for line in lines)
    assert "Traceback" not in p.stderr and time.time() - t0 < 60


# ----------------------------------------------------------------------------
# Isolation: a failure in one request's sampling, stop rule or detokenization, with 8 others
# streaming: that request alone fails (a 500, or an error event then [DONE]), the others
# answer as they do alone, and every block comes back.

POISON_SEED = 4242


@pytest.mark.parametrize("where", ["sample", "finish_reason", "detokenize"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_failure_in_one_request_fails_it_alone(live, model_tok, reference, monkeypatch, where, stream):
    tok = model_tok[1]
    if where == "detokenize":
        real_stream = live.server.tok.stream

        class Broken:
            def push(self, token):
                raise UnicodeError("injected")

            def flush(self):
                return ""
        poison = {"armed": False}

        def streams(**kw):                  # the poisoned request's decoders, once armed
            return Broken() if poison["armed"] else real_stream(**kw)
        monkeypatch.setattr(live.server.tok, "stream", streams)
    else:
        real = getattr(engine, where)

        def failing(*args):
            if any(isinstance(a, engine.SamplingParams) and a.seed == POISON_SEED for a in args):
                raise RuntimeError("injected")
            return real(*args)
        monkeypatch.setattr(engine, where, failing)

    async def poisoned():
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16,
                "temperature": 0.5, "seed": POISON_SEED, "stream": stream}
        async with httpx.AsyncClient(timeout=120) as c:
            if where == "detokenize":
                poison["armed"] = True
            r = await c.post(live.url + "/v1/chat/completions", json=body, headers=KEY)
            return r

    async def run():
        others = [asyncio.ensure_future(stream_chat(live.url, q, 20)) for q in QUESTIONS]
        await asyncio.sleep(0.5)                    # they are streaming
        if where == "detokenize":
            await asyncio.sleep(1.0)                # every decoder of theirs exists
        bad = await poisoned()
        return bad, await asyncio.gather(*others)
    bad, others = asyncio.run(run())
    if stream:
        lines = [x for x in bad.text.splitlines() if x]
        assert bad.status_code == 200 and lines[-1] == "data: [DONE]", bad.text
        err = json.loads(lines[-2][6:])["error"]
        assert "injected" in err["message"] and err["type"] == "server_error"
    else:
        assert "injected" in error_of(bad, 500)["message"]
    for q, (text, lines) in zip(QUESTIONS, others):
        assert lines[-1] == "data: [DONE]" and text == reference(chat_ids(tok, q), 20).text, q
    monkeypatch.undo()
    assert live.settled() == (0, False)
    ok_answer_keyed(live)


def ok_answer_keyed(live):
    r = post(live, "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " 4,", r.text


# ----------------------------------------------------------------------------
# Fuzz: request bodies of every field, wrong types, extremes and huge strings, while two
# normal streams run. No 500, /health answers within a step, the streams are unchanged.

EXTREMES = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, 1, -1, 2 ** 64]),
                     st.floats(allow_nan=False), st.sampled_from([1e308, -1e308, 0.5, 2.0]),
                     st.text(max_size=20), st.just("x" * 20_000), st.lists(st.integers(-5, 60_000), max_size=5),
                     st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 5]),
                                 "content": st.one_of(st.text(max_size=30), EXTREMES,
                                                      st.lists(st.fixed_dictionaries(
                                                          {"type": st.just("text"), "text": st.text(max_size=10)}),
                                                          max_size=3))})
FIELDS = {"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), EXTREMES),
          "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 49_151), min_size=1, max_size=8),
                              EXTREMES),
          "max_tokens": st.one_of(st.integers(1, 3), EXTREMES), "temperature": EXTREMES, "top_p": EXTREMES,
          "top_k": EXTREMES, "seed": EXTREMES, "n": st.one_of(st.integers(1, 3), EXTREMES),
          "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5), EXTREMES),
          "stream": st.one_of(st.booleans(), EXTREMES), "logprobs": EXTREMES, "top_logprobs": EXTREMES,
          "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), EXTREMES),
          "max_completion_tokens": EXTREMES}
BODY = st.fixed_dictionaries({}, optional=FIELDS)


def bounded(body: dict) -> dict:
    """Valid lengths stay short: the fuzz is about values, not about waiting for answers."""
    for key in ("max_tokens", "max_completion_tokens"):
        if type(body.get(key)) is int and body[key] >= 1:
            body[key] = min(body[key], 3)
    if "max_tokens" not in body:
        body["max_tokens"] = 2
    return body


@pytest.fixture(scope="module")
def background(live, model_tok, reference):
    """Two normal streams, restarted as they finish, for the whole fuzz; checks each answer."""
    tok, stop, failures, health = model_tok[1], threading.Event(), [], []

    def loop():
        async def run():
            i = 0
            while not stop.is_set():
                q = QUESTIONS[i % len(QUESTIONS)]
                (t1, _), (t2, _) = await asyncio.gather(stream_chat(live.url, q, 12), stream_chat(live.url, q, 12))
                want = reference(chat_ids(tok, q), 12).text
                failures.extend(x for x in (t1, t2) if x != want)
                t0 = time.perf_counter()
                async with httpx.AsyncClient() as c:
                    await c.get(live.url + "/health")
                health.append(time.perf_counter() - t0)
                i += 1
        asyncio.run(run())
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield failures, health
    stop.set()
    thread.join(120)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), BODY)
def test_fuzzed_bodies_get_an_answer_or_a_400(live, background, path, body):
    t0 = time.perf_counter()
    r = httpx.post(live.url + path, content=json.dumps(bounded(body)),      # Infinity too
                   headers={**KEY, "Content-Type": "application/json"}, timeout=120)
    assert r.status_code in (200, 400), (r.status_code, r.text[:300], body)
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    assert time.perf_counter() - t0 < 60


def test_after_the_fuzz_the_streams_were_unchanged_and_health_prompt(live, background):
    failures, health = background
    deadline = time.time() + 60
    while not health and time.time() < deadline:      # at least one round of the streams
        time.sleep(0.2)
    assert not failures and health and max(health) < 1.0, (failures, max(health, default=None))
    print(f"/health beside the fuzz: {len(health)} probes, max {max(health) * 1e3:.0f} ms")
    assert live.settled(timeout=60) == (0, False)


# ----------------------------------------------------------------------------
# 5. SIGINT with stalled readers: a drain, then an error event and [DONE] for each, exit 0.

def test_sigint_drains_then_ends_stalled_streams_and_exits_0(bundled_dir, cache_home):
    proc, url = start_cli(bundled_dir, cache_home, "--drain-seconds", "2")
    port, socks = int(url.rsplit(":", 1)[1]), []
    try:
        data = json.dumps({"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
                           "stream": True}).encode()
        for _ in range(4):                  # four streams nobody reads
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            socks.append(s)
        time.sleep(1.5)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert time.time() - t0 < 15
        err = proc.stderr.read()
        assert "Traceback" not in err and "CancelledError" not in err, err
        assert "stopped: 0 requests finished while draining, 4 cancelled" in err, err
        for s in socks:                     # each stream ends with an error event, then [DONE]
            s.settimeout(10)
            raw = b""
            while chunk := s.recv(1 << 16):
                raw += chunk
            events = [x for x in raw.decode(errors="replace").split("\n") if x.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and "shut down" in events[-2], events[-3:]
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait()
