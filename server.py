"""
server.py — an OpenAI-compatible HTTP server on the batching engine: llama-server's job, done by engine.py.

    python server.py                                  # the bundled model; chat page at http://127.0.0.1:8080/
    python server.py --model tinyllama --port 9000 --api-key secret
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

and any OpenAI client: ``OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="x")``.

Continuous batching and prefix caching pay only when many requests are in flight
at once, and that is a server's everyday situation. The shape of it:

    HTTP handlers (asyncio) ──jobs, cancels──▶ one engine thread ──tokens──▶ handlers

* A handler parses and checks the request, turns it into token ids (the chat
  template exactly as serve_local.py applies it: message text is data, never
  control tokens), hands a job to the engine thread and reads its tokens back
  from a queue. The HTTP side never runs the model.
* The engine thread loops: take new jobs and cancellations, ``engine.step()``,
  route every new token to its job. Requests that arrive together batch
  together; a system prompt or an earlier turn that another request already
  sent hits the prefix cache (engine.py, paged.py).
* Each branch (n > 1 forks the prompt's blocks) turns its tokens into text
  incrementally (tokenizer.StreamDecoder) and watches for stop strings, holding
  back any tail that could begin one: a stop string never reaches the client,
  not even half of one at the end of a streamed chunk.

Cost model. A decode step reads every weight once whatever the batch (for
SmolLM2-135M in fp32, 540 MB), and adds B rows of compute: while the step is
bound by memory, B concurrent requests get nearly B times the output tokens per
second of one. Time to first token = the wait for a batch slot and KV blocks +
the prefill of the prompt's uncached tokens, and a long prefill delays the
running requests' next token by one chunk of it a step (engine.py: chunked prefill).
``python bench.py serve`` measures both against concurrency, beside llama-server.

Limits and safety: binds 127.0.0.1 unless --host says otherwise; --api-key
requires ``Authorization: Bearer KEY`` (compared in constant time) on /v1 and
/metrics; bodies over --max-body bytes are refused (413); more than --max-queue
requests in flight get 429 with Retry-After; every bad input is a 400 in
OpenAI's error shape; a client that disconnects cancels its request, and its
KV blocks return at once; SIGTERM stops accepting, lets the requests in flight
finish, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hmac
import json
import queue
import signal
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, AsyncIterator, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import checkpoint
import engine
import kernels
import nanoinfer.load
import quantize
from nanoinfer.config import RunConfig
from sampling import Finish, SamplingParams
from tokenizer import Tokenizer

CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"


# ----------------------------------------------------------------------------
# Errors: OpenAI's shape, {"error": {"message", "type", "param", "code"}}.

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error"}.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# ----------------------------------------------------------------------------
# Request bodies. Unknown fields are ignored, as OpenAI's server does; wrong
# types are a 400 (strict: "0.5" is not a temperature).

class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0            # not OpenAI's; llama-server and vLLM take it too
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: "StreamOptions | None" = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "a stop string must not be empty", "stop")
        return stops


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])


class ChatBody(Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class CompletionBody(Body):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None


Body.model_rebuild()


def parse(body_type: type[Body], raw: bytes) -> Body:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return body_type.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", param=where or None) from None


# ----------------------------------------------------------------------------
# Text out of tokens: incremental decoding and stop strings.

class StopText:
    """Watches one branch's text for stop strings. ``push`` returns the text that is
    safe to send and whether a stop string matched; a tail that could still become
    a stop string is held back until the next push shows it does not."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        text, self.held = self.held + text, ""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            return text[:min(hits)], True
        if not final:
            self.held = text[len(text) - max((k for s in self.stops for k in range(1, len(s))
                                              if text.endswith(s[:k])), default=0):]
        return text[:len(text) - len(self.held)], False


@dataclass
class Job:
    """One HTTP request as the engine thread sees it: ids in, engine.Events out on ``events``."""
    ids: list[int]
    params: SamplingParams
    n: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: engine.Request | None = None
    arrival: float = field(default_factory=time.perf_counter)
    last_token: dict = field(default_factory=dict)      # branch → time of its last token

    def put(self, item):
        """From the engine thread: hand an item to the handler's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:              # that loop has closed (shutdown): nobody is listening
            pass


# ----------------------------------------------------------------------------
# Metrics, in Prometheus' text format at /metrics (a registry per server, no global state).

class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("nanoinfer_requests_running", "sequences decoding", registry=r)
        self.waiting = Gauge("nanoinfer_requests_waiting", "sequences queued for a batch slot or KV blocks",
                             registry=r)
        self.finished = Counter("nanoinfer_requests_finished", "sequences ended, by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("nanoinfer_prompt_tokens", "prompt tokens received", registry=r)
        self.hit_rate = Gauge("nanoinfer_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / all "
                              "prompt tokens, so far", registry=r)
        self.generated = Counter("nanoinfer_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("nanoinfer_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("nanoinfer_inter_token_latency_seconds", "time between a branch's tokens", registry=r,
                             buckets=(.005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56))
        self.blocks_used = Gauge("nanoinfer_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.blocks_free = Gauge("nanoinfer_kv_blocks_free", "KV blocks free, or cached and evictable", registry=r)
        self.preemptions = Counter("nanoinfer_preemptions", "sequences preempted for lack of KV blocks", registry=r)
        self.prompt_total = self.cached_total = self.preempted = 0

    def admitted(self, req: engine.Request):
        self.prompt_tokens.inc(len(req.prompt))
        self.prompt_total += len(req.prompt)
        self.cached_total += req.cached_tokens
        self.hit_rate.set(self.cached_total / self.prompt_total)

    def update(self, stats: engine.Stats):
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.blocks_free.set(stats.free_blocks)
        self.blocks_used.set(stats.used_blocks)
        self.preemptions.inc(stats.preemptions - self.preempted)
        self.preempted = stats.preemptions


# ----------------------------------------------------------------------------
# The engine thread: the only code that touches the engine.

class EngineLoop:
    def __init__(self, eng: engine.Engine, metrics: Metrics):
        self.engine, self.metrics = eng, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict[int, Job] = {}            # engine request id → job
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        """After the HTTP side has drained: cancel what is left (its blocks return) and end the thread."""
        self.inbox.put(None)
        self.thread.join()

    def submit(self, job: Job):
        self.inbox.put(("add", job))

    def cancel(self, job: Job, branch: int | None = None):
        self.inbox.put(("cancel", job, branch))

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn() on the engine thread between two steps (how a test checks the
        engine's invariants while it serves)."""
        future = concurrent.futures.Future()
        self.inbox.put(("call", fn, future))
        return future

    def run(self):
        while True:
            # Idle: sleep until something arrives. Busy: take what arrived since the last step.
            block = not self.engine.has_work()
            try:
                while True:
                    item = self.inbox.get(block=block)
                    if item is None:
                        for job in list(self.jobs.values()):
                            self.handle("cancel", job)
                        return
                    self.handle(*item)
                    block = False
            except queue.Empty:
                pass
            if self.engine.has_work():
                self.step()

    def handle(self, kind, job, arg=None):
        if kind == "call":
            try:
                arg.set_result(job())
            except BaseException as e:
                arg.set_exception(e)
            return
        if kind == "add":
            try:
                job.request = self.engine.add(job.ids, job.params, job.n)
            except (ValueError, TypeError) as e:     # this request alone fails; the engine goes on
                job.put(APIError(400, str(e)))
                return
            self.jobs[job.request.id] = job
            job.put("accepted")
        elif kind == "cancel" and job.request is not None and job.request.id in self.jobs:
            self.engine.cancel(job.request.id, arg)
            self.retire(job)
        self.metrics.update(self.engine.stats())

    def step(self):
        try:
            events = self.engine.step()
        except Exception as e:    # the model failed (NaN logits, out of memory): the engine reset its pool
            for job in self.jobs.values():
                job.put(APIError(500, f"the engine failed and dropped the requests in flight: {e}"))
            self.jobs.clear()
            self.metrics.update(self.engine.stats())
            return
        now, m, touched = time.perf_counter(), self.metrics, {}
        for ev in events:
            job = self.jobs.get(ev.request_id)
            if job is None:
                continue
            if ev.branch in job.last_token:
                m.itl.observe(now - job.last_token[ev.branch])
            elif ev.branch == 0:
                m.ttft.observe(now - job.arrival)
                m.admitted(job.request)
            job.last_token[ev.branch] = now
            m.generated.inc()
            job.put(ev)                   # the event carries all the handler needs
            touched[job.request.id] = job
        for job in touched.values():      # after all its tokens: a step may end every branch of a request
            self.retire(job)
        m.update(self.engine.stats())

    def retire(self, job: Job):
        req = job.request
        if req.finished and self.jobs.pop(req.id, None) is not None:
            for reason in req.finish_reasons:
                self.metrics.finished.labels(reason).inc()
            job.put("done")


# ----------------------------------------------------------------------------
# The HTTP side.

@dataclass
class Branch:
    """One answer of a request, as text: decoded incrementally, cut at a stop string."""
    decoder: object
    stop: StopText
    tokens: int = 0                     # generated, EOS not counted
    finish_reason: Finish | None = None


@dataclass
class Piece:
    """What one token adds to one branch's answer."""
    branch: int
    text: str
    token: int
    logprob: tuple | None
    finish_reason: Finish | None


class Server:
    """Requests in, jobs to the engine thread, OpenAI's responses out."""

    def __init__(self, eng: engine.Engine, tok: Tokenizer, name: str, api_key: str | None = None,
                 max_queue: int = 256, max_body: int = 1 << 20):
        self.engine, self.tok, self.name = eng, tok, name
        self.api_key, self.max_queue, self.max_body = api_key, max_queue, max_body
        self.metrics = Metrics()
        self.loop = EngineLoop(eng, self.metrics)
        self.in_flight = 0

    # --- checks ---------------------------------------------------------------

    def authorize(self, request: Request):
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read(self, request: Request, body_type: type[Body]) -> Body:
        self.authorize(request)
        declared = request.headers.get("content-length", "")
        too_big = APIError(413, f"the body is larger than this server takes ({self.max_body} bytes; --max-body)")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body:
                raise too_big
        return parse(body_type, bytes(raw))

    def params(self, body: Body, ids: list[int], max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        room = max(1, self.engine.max_len - len(ids))   # by default an answer may fill the context
        try:
            return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                                  max_new_tokens=max_tokens or room,
                                  logprobs=0 if logprobs is None else max(1, logprobs))
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # --- a request's life -------------------------------------------------------

    async def start(self, ids: list[int], params: SamplingParams, n: int, param: str) -> Job:
        """Check, queue, and wait until the engine has taken the job (or refused it)."""
        if n > self.engine.max_batch:
            raise APIError(400, f"n must be at most {self.engine.max_batch}, the server's "
                           "--max-batch", "n")
        try:
            self.engine.check_request(ids, params, n)     # reads only what never changes: safe off-thread
        except ValueError as e:
            long = len(ids) >= self.engine.max_len
            raise APIError(400, str(e), param, "context_length_exceeded" if long else None) from None
        if self.in_flight >= self.max_queue:
            raise APIError(429, f"the server has {self.in_flight} requests in flight, its limit (--max-queue): "
                           "retry shortly", headers={"Retry-After": "1"})
        self.in_flight += 1
        job = Job(ids, params, n, asyncio.get_running_loop())
        self.loop.submit(job)
        first = await job.events.get()
        if isinstance(first, APIError):
            self.in_flight -= 1
            raise first
        return job

    async def pieces(self, job: Job, stops: list[str]) -> AsyncIterator[Piece]:
        """The job's output as text pieces, branch by branch, until every branch has
        finished. Leaving early (a disconnect) cancels the request: its blocks return."""
        branches = [Branch(self.tok.stream(skip_special=True), StopText(stops)) for _ in range(job.n)]
        done = False
        try:
            while not done:
                item = await job.events.get()
                if isinstance(item, APIError):
                    raise item
                if item == "done":
                    done = True
                    continue
                b = branches[item.branch]
                if b.finish_reason:           # cut by a stop string: tokens already in flight are moot
                    continue
                b.tokens += item.visible      # a stop token is neither shown nor counted
                text = b.decoder.push(item.token) if item.visible else ""
                if item.finish_reason:
                    text += b.decoder.flush()
                text, hit = b.stop.push(text, final=item.finish_reason is not None)
                if hit:
                    self.loop.cancel(job, item.branch)
                b.finish_reason = Finish.STOP if hit else item.finish_reason
                lp = None if item.logprob is None else (item.logprob, item.top)
                yield Piece(item.branch, text, item.token, lp, b.finish_reason)
        finally:
            self.in_flight -= 1
            if not done:
                self.loop.cancel(job)
            job.usage = {"prompt_tokens": len(job.ids), "completion_tokens": sum(b.tokens for b in branches),
                         "total_tokens": len(job.ids) + sum(b.tokens for b in branches)}

    def token_text(self, token: int) -> str:
        return self.tok.decode([token])

    # --- the endpoints ------------------------------------------------------------

    async def chat(self, request: Request):
        body = await self.read(request, ChatBody)
        if self.tok.chat_template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        ids = self.tok.encode_chat(messages)
        body.stops()                    # checked before the engine takes the job
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = await self.start(ids, self.params(body, ids, body.max_completion_tokens or body.max_tokens, top),
                               body.n, "messages")
        return await self.respond(job, body, "chat.completion", self.chat_choice, top)

    async def complete(self, request: Request):
        body = await self.read(request, CompletionBody)
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) \
            else body.prompt
        ids = self.tok.encode(prompt, special=False) if isinstance(prompt, str) else list(prompt)   # text is data
        body.stops()
        job = await self.start(ids, self.params(body, ids, body.max_tokens, body.logprobs), body.n, "prompt")
        return await self.respond(job, body, "text_completion", self.completion_choice, body.logprobs)

    def chat_choice(self, piece: Piece, top: int | None, first: bool) -> dict:
        lp = None
        if piece.logprob is not None:
            entry = lambda t, v: {"token": (s := self.token_text(t)), "logprob": v, "bytes": list(s.encode())}
            lp = {"content": [{**entry(piece.token, piece.logprob[0]),
                               "top_logprobs": [entry(t, v) for t, v in piece.logprob[1][:top]]}]}
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        return {"index": piece.branch, "delta": delta, "logprobs": lp, "finish_reason": piece.finish_reason}

    def completion_choice(self, piece: Piece, top: int | None, first: bool) -> dict:
        lp = None
        if piece.logprob is not None:
            lp = {"tokens": [self.token_text(piece.token)], "token_logprobs": [piece.logprob[0]],
                  "top_logprobs": [{self.token_text(t): v for t, v in piece.logprob[1][:top]}] if top else None}
        return {"index": piece.branch, "text": piece.text, "logprobs": lp, "finish_reason": piece.finish_reason}

    async def respond(self, job: Job, body: Body, kind: str, choice, top: int | None):
        stops = body.stops()
        head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()), "model": self.name}
        if body.stream:
            return StreamingResponse(self.events(job, stops, head, kind, choice, top, body),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        merged = [choice(Piece(b, "", 0, None, None), top, True) for b in range(job.n)]
        async for piece in self.pieces(job, stops):
            c = choice(piece, top, False)
            m = merged[piece.branch]
            m["finish_reason"] = c["finish_reason"]
            if kind == "chat.completion":
                m["delta"]["content"] += piece.text
                if c["logprobs"]:
                    m["logprobs"] = m["logprobs"] or {"content": []}
                    m["logprobs"]["content"] += c["logprobs"]["content"]
            else:
                m["text"] += piece.text
                if c["logprobs"]:
                    m["logprobs"] = m["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
                    for key in ("tokens", "token_logprobs"):
                        m["logprobs"][key] += c["logprobs"][key]
                    m["logprobs"]["top_logprobs"] += c["logprobs"]["top_logprobs"] or [None]
        for m in merged:
            if kind == "chat.completion":
                m["message"] = m.pop("delta")
        return {**head, "object": kind, "choices": merged, "usage": job.usage}

    async def events(self, job: Job, stops, head, kind, choice, top, body) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece of text, then the usage (if asked for), then [DONE]."""
        sse = lambda obj: f"data: {json.dumps(obj)}\n\n"
        obj = f"{kind}.chunk" if kind == "chat.completion" else kind
        first = set()
        try:
            async for piece in self.pieces(job, stops):
                c = choice(piece, top, piece.branch not in first)
                first.add(piece.branch)
                yield sse({**head, "object": obj, "choices": [c]})
            if body.stream_options and body.stream_options.include_usage:
                yield sse({**head, "object": obj, "choices": [], "usage": job.usage})
            yield "data: [DONE]\n\n"
        except APIError as e:                   # after the headers went out: the error as an event
            yield sse({"error": {"message": e.message, "type": "server_error", "param": None, "code": None}})

    def models(self, request: Request):
        self.authorize(request)
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                            "owned_by": "nanoinfer"}]}

    def scrape(self, request: Request):
        self.authorize(request)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            self.loop.start()
            yield
            self.loop.stop()

        app = FastAPI(title="nanoinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(APIError, lambda request, e: e.response())
        app.add_exception_handler(StarletteHTTPException, lambda request, e: APIError(
            e.status_code, f"{request.method} {request.url.path}: {e.detail}").response())
        app.add_api_route("/", lambda: FileResponse(CHAT_PAGE), methods=["GET"])
        app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
        app.add_api_route("/metrics", self.scrape, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/v1/completions", self.complete, methods=["POST"])
        return app


# ----------------------------------------------------------------------------
# The command line.

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="OpenAI-compatible server on the batching engine (engine.py)")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL, help="alias, directory or .gguf (default: the "
                    "bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--device", default=None, help="cuda, mps or cpu (default: best available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *kernels.DTYPES],
                    help="auto: the plan's (plan.py: bf16 where native and measured faster, else fp32)")
    ap.add_argument("--weights", default="auto", choices=["auto", "float", "int8", "int4"],
                    help="auto: as stored (a GGUF's own bits); float: widened; int8/int4: re-rounded")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8-plain"],
                    help="KV pool storage (quantize.py)")
    ap.add_argument("--max-batch", type=int, default=32, help="sequences decoding together (default: 32)")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="memory for the KV pool, GiB (default: 1)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /metrics")
    ap.add_argument("--max-queue", type=int, default=256, help="requests in flight before answering 429")
    ap.add_argument("--max-body", type=int, default=1 << 20, help="largest request body, bytes (default: 1 MiB)")
    ap.set_defaults(kv="paged")     # what RunConfig.from_flags reads: the engine's block pool, eager
    return ap.parse_args(argv)


def build(args) -> Server:
    """Load the model and assemble the server from parsed arguments (ValueError: one line to show)."""
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-body", args.max_body), ("--port", args.port + 1)):
        if value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    if not args.kv_gib > 0:
        raise ValueError(f"--kv-gib must be positive, got {args.kv_gib}")
    # the runner's path: flags -> the plan (auto: its dtype; bf16 where native and measured faster) -> defaults
    cfg = RunConfig.from_flags(args)
    model, tok = nanoinfer.load.load(cfg)
    codec = quantize.kv_codec(cfg.kv_dtype)
    eng = engine.Engine(model, max_batch=args.max_batch, kv_bytes=int(args.kv_gib * (1 << 30)), codec=codec,
                        in_place=kernels.paged_reader(cfg.device, codec))
    return Server(eng, tok, Path(cfg.model).name, args.api_key, args.max_queue, args.max_body)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        t0 = time.perf_counter()
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        server = build(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {server.engine.describe()}",
          file=sys.stderr)
    print(f"serving on http://{args.host}:{args.port}/ (chat page), API at http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    # SIGTERM or Ctrl-C: uvicorn stops accepting, lets the requests in flight finish (up to
    # 30 s), then raises the signal again once it has restored these handlers: a clean exit, 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=30)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("stopped: every request finished", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
