"""
server.py — an OpenAI-compatible HTTP server on the batching engine: llama-server's job, done by engine.py.

    python server.py                                  # the bundled model; chat page at http://127.0.0.1:8080/
    python server.py --model tinyllama --port 9000 --api-key secret
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \
         -d '{"messages": [{"role": "user", "content": "Hi"}]}'

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
  sent hits the prefix cache (engine.py, paged.py). It is the only thread that
  runs the model's parallel loops: the model loads on a thread that then ends
  (``build_apart``), and the handlers run none.
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

Limits and safety:
* Binds 127.0.0.1 unless --host says otherwise. A web page the user visits must not drive
  it: a request's ``Host`` must name the bound address, localhost or an --allow-host name
  (a DNS-rebinding page's does not); an ``Origin``, when sent, must be the server's own
  (the chat page) or an --allow-origin entry, which alone get CORS headers; a POST to /v1
  must be ``Content-Type: application/json``, which a page can send cross-origin only
  after a CORS preflight that this server grants to allowed origins alone.
* --api-key requires ``Authorization: Bearer KEY`` (any case of "Bearer", the key compared
  in constant time) on /v1 and /metrics.
* Every value a request brings is checked before the engine sees it, and every list and
  string it brings is capped (stop strings: STOPS of at most STOP_CHARS characters); a
  bad one is a 400 in OpenAI's error shape. Bodies over --max-body bytes are refused
  (413); more than --max-queue requests in flight get 429 with Retry-After.
* One request never harms another: whatever raises while serving one request (its
  sampling, its stop rule, its detokenization) fails that request alone, with a 500 in
  OpenAI's shape (an error event, then ``[DONE]``, in a stream). Only a failing forward
  pass, which every row shares, drops the requests in flight, and says so.
* Bounded work per token: stop strings are matched in time linear in the text (StopText).
* A client that disconnects, streaming or not, cancels its request, and its KV blocks
  return at once.
* SIGINT and SIGTERM alike: new requests get 503, those in flight may finish for up to
  --drain-seconds, the rest end with an error (an error event and ``[DONE]`` in a
  stream), and the process exits 0, saying how many finished and how many were cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, AsyncIterator, Literal
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import checkpoint
import engine
import gguf_hf
import kernels
import nanoinfer.load
import plan
import quantize
from nanoinfer import tools
from nanoinfer.config import RunConfig
from sampling import SEEDS, Finish, SamplingParams, grammar_vocab
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
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# ----------------------------------------------------------------------------
# Request bodies. Wrong types are a 400 (strict: "0.5" is not a temperature). Every
# list and string a request brings is capped, besides --max-body on the whole. A field
# this server does not implement is never dropped in silence: OpenAI's fields that
# change nothing here are accepted (IGNORED), the ones it would need to honour are a 400
# unless their value asks for nothing (UNSUPPORTED), and any other field is a 400, as it
# is at OpenAI. README.md lists them.

STOPS, STOP_CHARS = 4, 1000         # stop strings a request may give, and their length
MESSAGES, PROMPT_IDS, TOOLS = 4096, 1 << 17, 128
StopString = Annotated[str, Field(min_length=1, max_length=STOP_CHARS)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
UNSUPPORTED = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
               "functions": (), "function_call": (), "audio": (), "modalities": (["text"],),
               "prediction": (), "web_search_options": (), "reasoning_effort": (),
               "verbosity": (), "best_of": (1,), "echo": (False,), "suffix": ()}


class Part(BaseModel):
    """A part of a request body: strict types; keys it does not name are ignored (the body
    itself, Body, refuses unknown ones)."""
    model_config = ConfigDict(extra="ignore", strict=True)


class JsonSchema(Part):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: Name
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class Function(Part):
    name: Name
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Part):
    type: Literal["function"]
    function: Function


class FunctionName(Part):
    name: Name


class NamedTool(Part):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Part):
    name: Name
    arguments: str


class ToolCall(Part):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0            # not OpenAI's; llama-server and vLLM take it too
    seed: Annotated[int, Field(ge=0, lt=SEEDS)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=STOPS)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    response_format: ResponseFormat | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check(self):
        """What no field alone can say: branch i of n samples with seed + i, a 64-bit seed;
        the fields this server does not implement."""
        if self.seed is not None and self.seed + self.n - 1 >= SEEDS:
            raise APIError(400, f"seed must be below 2**64 - {self.n - 1} with n = {self.n}: "
                           "branch i samples with seed + i", "seed")
        for key, value in (self.model_extra or {}).items():
            if key in IGNORED or (key in UNSUPPORTED and value in (None, *UNSUPPORTED[key])):
                continue
            if key in UNSUPPORTED:
                raise APIError(400, f"{key} is not supported by this server (README.md: request "
                               "fields); leave it out", key)
            raise APIError(400, f"unknown field {key!r} (README.md lists the fields this server "
                           "takes)", key)
        rf = self.response_format
        if rf and rf.type == "json_schema" and rf.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema: "
                           "{name, schema}", "response_format")

    def json_schema(self) -> dict | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        return {"type": "object"} if rf.type == "json_object" else rf.json_schema.schema_


class StreamOptions(Part):
    include_usage: bool = False


class TextPart(Part):
    type: Literal["text"]
    text: str


class Message(Part):
    # other keys of a message are ignored: clients send back what they got (refusal,
    # annotations, audio: None)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MESSAGES)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=TOOLS)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def openai(self) -> dict:
        """As the chat template (and nanoinfer.tools) take it: developer is system."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatBody(Body):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True

    def check(self):
        super().check()
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise APIError(400, "tool_choice asks for a call but the request offers no tools",
                           "tool_choice")
        if isinstance(choice, NamedTool) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not "
                           "among the tools", "tool_choice")
        if len(set(names)) != len(names):
            raise APIError(400, "two tools have the same name", "tools")
        if self.forced_call() and self.response_format and self.response_format.type != "text":
            raise APIError(400, "a forced tool call and a response_format cannot both shape "
                           "the answer", "response_format")
        for t in self.tools or []:
            try:
                SamplingParams(json_schema=t.function.parameters or {"type": "object"})
            except ValueError as e:
                raise APIError(400, f"tool {t.function.name!r}: {e}", "tools") from None

    def offered(self) -> list[dict]:
        """The functions the model is told about: none with tool_choice "none"."""
        if self.tool_choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def forced_call(self) -> list[dict]:
        """The functions one of which the answer must call (required, or the named one)."""
        if self.tool_choice == "required":
            return self.offered()
        if isinstance(self.tool_choice, NamedTool):
            return [f for f in self.offered() if f["name"] == self.tool_choice.function.name]
        return []


class CompletionBody(Body):
    prompt: (str | Annotated[list[int], Field(min_length=1, max_length=PROMPT_IDS)]
             | Annotated[list[str], Field(min_length=1, max_length=1)])
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None


Body.model_rebuild()


def is_shape(part) -> bool:
    """A step of a pydantic error's location that names a union's shape, not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


def parse(body_type: type[Body], raw: bytes) -> Body:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        body = body_type.model_validate(data)
    except ValidationError as e:
        # A field of several shapes (a string or a list of them) fails once per shape: the
        # error worth showing is one past the type check, in the shape the input has.
        errors = e.errors()
        err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
        where = ".".join(str(p) for p in err["loc"] if not is_shape(p))
        raise APIError(400, f"{where}: {err['msg']}", param=where or None) from None
    body.check()
    return body


# ----------------------------------------------------------------------------
# Text out of tokens: incremental decoding and stop strings.

class StopText:
    """Watches one branch's text for stop strings. ``push`` returns the text that is
    safe to send and whether a stop string matched; a tail that could still become
    a stop string is held back until the next push shows it does not.

    Linear in the text, whatever the stops: per stop string, the length of its
    longest prefix that the text ends with, advanced a character at a time along
    the string's failure links (Knuth-Morris-Pratt). The held tail is the longest
    such prefix; the answer ends where a stop string first completes (of two
    completing on the same character, at the one that began first)."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""
        self.matched = [0] * len(stops)
        self.links = [failure_links(s) for s in stops]

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        out, base = self.held + text, len(self.held)
        for i, ch in enumerate(text):
            first = None
            for j, stop in enumerate(self.stops):
                k = self.matched[j]
                while k and stop[k] != ch:
                    k = self.links[j][k - 1]
                k += stop[k] == ch
                if k == len(stop):
                    start = base + i + 1 - k
                    first = start if first is None else min(first, start)
                    k = self.links[j][k - 1]
                self.matched[j] = k
            if first is not None:
                self.held = ""
                return out[:first], True
        keep = 0 if final else max(self.matched, default=0)
        self.held = out[len(out) - keep:] if keep else ""
        return out[:len(out) - keep], False


def failure_links(s: str) -> list[int]:
    """links[k]: the length of the longest proper prefix of s[:k + 1] that is also its suffix."""
    links = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = links[k - 1]
        k += s[i] == s[k]
        links[i] = k
    return links


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

    def cancel_all(self, error: APIError):
        """End every request in flight with ``error`` (shutdown: the drain time is up)."""
        self.inbox.put(("cancel_all", error))

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
                if not self.engine.has_work():      # the last request ended: its memory back
                    gguf_hf.give_back_freed()

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
            except Exception as e:
                job.put(APIError(500, f"the engine could not take this request: {e}"))
                return
            self.jobs[job.request.id] = job
            job.put("accepted")
        elif kind == "cancel" and job.request is not None and job.request.id in self.jobs:
            self.engine.cancel(job.request.id, arg)
            self.retire(job)
        elif kind == "cancel_all":
            error = job
            for j in list(self.jobs.values()):
                self.engine.cancel(j.request.id)
                self.jobs.pop(j.request.id)
                j.put(error)
        self.metrics.update(self.engine.stats())

    def step(self):
        try:
            events = self.engine.step()
        except Exception as e:    # the forward pass failed (out of memory): the engine reset its pool
            for job in self.jobs.values():
                job.put(APIError(500, "the model failed, so the engine reset its KV pool and dropped "
                                 f"every request in flight: {type(e).__name__}: {e}"))
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
# Who may drive the server from a browser.

@dataclass
class Guard:
    """A web page the user visits can send requests to a loopback server: a form or a
    fetch() in no-cors mode posts text/plain cross-origin without asking, and a page
    whose name the attacker re-binds to 127.0.0.1 reads the answers as same-origin.
    So every request's Host must name this server, an Origin must be its own or an
    allowed one, and a POST to /v1 must be JSON (a cross-origin page may send that only
    after a CORS preflight, which only allowed origins pass)."""
    host: str = "127.0.0.1"                  # the bound address
    allow_hosts: tuple[str, ...] = ()        # other names it is reached by (--allow-host)
    allow_origins: tuple[str, ...] = ()      # pages that may use it (--allow-origin; * for any)

    def hosts(self) -> set[str] | None:
        """The names a Host header may give; None (any) when bound to every interface
        with no --allow-host: whoever did that reaches it by names we cannot know."""
        if self.host in ("0.0.0.0", "::", "") and not self.allow_hosts:
            return None
        return {self.host.lower(), "localhost", "127.0.0.1", "::1",
                *(h.lower() for h in self.allow_hosts)}

    def refuse(self, method: str, path: str, headers: dict[str, str]) -> APIError | None:
        host = headers.get("host", "")
        try:
            name = urlsplit("//" + host).hostname
        except ValueError:
            name = None
        allowed = self.hosts()
        if allowed is not None and name not in allowed:
            return APIError(403, f"this server does not answer to Host {host!r}: reach it as "
                            f"{self.host} or localhost, or start it with --allow-host NAME")
        origin = headers.get("origin")
        if origin is not None and origin.lower() not in (f"http://{host}".lower(), f"https://{host}".lower()) \
                and not {origin, "*"} & set(self.allow_origins):
            return APIError(403, f"pages from {origin} may not use this server: start it with "
                            f"--allow-origin {origin} to let them")
        if method == "POST" and path.startswith("/v1/"):
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return APIError(415, "send the body as JSON, with the header "
                                "'Content-Type: application/json'")
        return None


class Guarded:
    """ASGI middleware: Guard.refuse's error for a request it refuses, before any route runs."""

    def __init__(self, app, guard: Guard):
        self.app, self.guard = app, guard

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            if (e := self.guard.refuse(scope["method"], scope["path"], headers)) is not None:
                return await e.response()(scope, receive, send)
        await self.app(scope, receive, send)


def failed(e: Exception) -> APIError:
    """Any error while serving one request, as that request's error (a 500 unless it says)."""
    return e if isinstance(e, APIError) else APIError(500, f"this request failed: {type(e).__name__}: {e}")


async def disconnected(request: Request):
    """Return once the client has gone: ASGI's http.disconnect, after the body has been read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------------------------
# The HTTP side.

@dataclass
class Branch:
    """One answer of a request, as text: decoded incrementally, cut at a stop string, its
    tool calls taken out (when the request offers tools)."""
    decoder: object
    stop: StopText
    calls: tools.Calls | None = None
    tokens: int = 0                     # generated, EOS not counted
    called: int = 0                     # tool calls so far
    finish_reason: Finish | None = None


@dataclass
class Piece:
    """What one token adds to one branch's answer."""
    branch: int
    text: str
    token: int
    logprob: tuple | None
    finish_reason: Finish | None
    calls: list[tools.Call] = field(default_factory=list)
    first_call: int = 0                 # the index of calls[0] among the branch's calls


class Server:
    """Requests in, jobs to the engine thread, OpenAI's responses out."""

    def __init__(self, eng: engine.Engine, tok: Tokenizer, name: str, api_key: str | None = None,
                 max_queue: int = 256, max_body: int = 1 << 20, guard: Guard | None = None,
                 unbuilt: bool = False):
        self.engine, self.tok, self.name = eng, tok, name
        self.unbuilt = unbuilt      # compiled steps not built yet: main builds them in the background
        self.tool_format = tools.Format.of(tok.chat_template)
        self.api_key, self.max_queue, self.max_body = api_key, max_queue, max_body
        self.guard = guard or Guard()
        self.metrics = Metrics()
        self.loop = EngineLoop(eng, self.metrics)
        self.in_flight = 0
        self.draining = False               # shutting down: new requests get 503
        # Encoding a long prompt takes a while (~0.4 s a MB): on a thread of its own, so
        # the event loop goes on streaming the others' tokens meanwhile.
        self.encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self.drain_until = 0.0              # while draining: when the requests left are cancelled

    # --- checks ---------------------------------------------------------------

    def authorize(self, request: Request):
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self.api_key.encode()):
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
        forced = body.forced_call() if isinstance(body, ChatBody) else []
        try:
            return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                                  max_new_tokens=max_tokens or room,
                                  logprobs=0 if logprobs is None else max(1, logprobs),
                                  json_schema=body.json_schema(),
                                  grammar=tools.call_grammar(forced, self.tool_format) if forced else None)
        except ValueError as e:
            raise APIError(400, str(e), "response_format" if body.response_format else None) from None

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
        if self.draining:
            raise APIError(503, "the server is shutting down: send this request to another one",
                           headers={"Connection": "close"})
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

    async def pieces(self, job: Job, stops: list[str], calls: int = 0) -> AsyncIterator[Piece]:
        """The job's output as text pieces, branch by branch, until every branch has
        finished; with ``calls``, up to that many tool calls taken out of each branch's text
        (those past it dropped). Leaving early (a disconnect) cancels the request: its
        blocks return."""
        branches = [Branch(self.tok.stream(skip_special=True), StopText(stops),
                           tools.Calls(self.tool_format) if calls else None) for _ in range(job.n)]
        done = False
        try:
            while not done:
                item = await job.events.get()
                if isinstance(item, APIError):
                    raise item
                if item == "done":
                    done = True
                    continue
                if item.finish_reason is Finish.ERROR:
                    raise APIError(500, f"this request failed inside the engine: {item.error}")
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
                made = []
                if b.calls is not None:
                    text, made = b.calls.push(text, final=b.finish_reason is not None)
                    made = made[:calls - b.called]
                    b.called += len(made)
                    if b.finish_reason is Finish.STOP and b.called:
                        b.finish_reason = Finish.TOOL_CALLS
                lp = None if item.logprob is None else (item.logprob, item.top)
                yield Piece(item.branch, text, item.token, lp, b.finish_reason, made,
                            b.called - len(made))
        finally:
            self.in_flight -= 1
            if not done:
                self.loop.cancel(job)
            job.usage = {"prompt_tokens": len(job.ids), "completion_tokens": sum(b.tokens for b in branches),
                         "total_tokens": len(job.ids) + sum(b.tokens for b in branches)}

    async def encode(self, fn, *args, **kwargs) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.encoder, lambda: fn(*args, **kwargs))

    def token_text(self, token: int) -> str:
        return self.tok.decode([token])

    # --- the endpoints ------------------------------------------------------------

    async def chat(self, request: Request):
        body = await self.read(request, ChatBody)
        if self.tok.chat_template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        offered, fmt = body.offered(), self.tool_format
        messages = tools.messages_for([m.openai() for m in body.messages], offered, fmt)
        ids = await self.encode(self.tok.encode_chat, messages,
                                tools=[{"type": "function", "function": f} for f in offered]
                                if offered and fmt.in_template else None)
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = await self.start(ids, self.params(body, ids, body.max_completion_tokens or body.max_tokens, top),
                               body.n, "messages")
        calls = (1 if body.forced_call() or not body.parallel_tool_calls else TOOLS) if offered else 0
        return await self.respond(request, job, body, "chat.completion", self.chat_choice, top, calls)

    async def complete(self, request: Request):
        body = await self.read(request, CompletionBody)
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) \
            else body.prompt
        ids = await self.encode(self.tok.encode, prompt, special=False) if isinstance(prompt, str) \
            else list(prompt)                                                    # text is data
        job = await self.start(ids, self.params(body, ids, body.max_tokens, body.logprobs), body.n, "prompt")
        return await self.respond(request, job, body, "text_completion", self.completion_choice, body.logprobs)

    def chat_choice(self, piece: Piece, top: int | None, first: bool) -> dict:
        lp = None
        if piece.logprob is not None:
            entry = lambda t, v: {"token": (s := self.token_text(t)), "logprob": v, "bytes": list(s.encode())}
            lp = {"content": [{**entry(piece.token, piece.logprob[0]),
                               "top_logprobs": [entry(t, v) for t, v in piece.logprob[1][:top]]}]}
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        if piece.calls:
            delta["content"] = piece.text or None
            delta["tool_calls"] = [c.openai(piece.first_call + i) for i, c in enumerate(piece.calls)]
        return {"index": piece.branch, "delta": delta, "logprobs": lp, "finish_reason": piece.finish_reason}

    def completion_choice(self, piece: Piece, top: int | None, first: bool) -> dict:
        lp = None
        if piece.logprob is not None:
            lp = {"tokens": [self.token_text(piece.token)], "token_logprobs": [piece.logprob[0]],
                  "top_logprobs": [{self.token_text(t): v for t, v in piece.logprob[1][:top]}] if top else None}
        return {"index": piece.branch, "text": piece.text, "logprobs": lp, "finish_reason": piece.finish_reason}

    async def respond(self, request: Request, job: Job, body: Body, kind: str, choice, top: int | None,
                      calls: int = 0):
        stops = body.stops()
        head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()), "model": self.name}
        if body.stream:
            return StreamingResponse(self.events(job, stops, calls, head, kind, choice, top, body),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        # Nothing is sent until the answer is whole, so only the ASGI disconnect message tells
        # that the client left: watch for it beside the answer, and cancel the answer if it comes.
        answer = asyncio.ensure_future(self.whole(job, stops, calls, head, kind, choice, top))
        gone = asyncio.ensure_future(disconnected(request))
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not answer.done():
            answer.cancel()                 # its pieces() generator closes: the request is cancelled
            await asyncio.gather(answer, return_exceptions=True)
            return Response(status_code=499)    # nobody is listening
        return answer.result()

    async def whole(self, job: Job, stops, calls, head, kind, choice, top) -> dict:
        """A non-streamed answer: every piece, merged per branch."""
        merged = [choice(Piece(b, "", 0, None, None), top, True) for b in range(job.n)]
        async for piece in self.pieces(job, stops, calls):
            c = choice(piece, top, False)
            m = merged[piece.branch]
            m["finish_reason"] = c["finish_reason"]
            if kind == "chat.completion":
                m["delta"]["content"] += piece.text
                if piece.calls:
                    m["delta"].setdefault("tool_calls", []).extend(c.openai() for c in piece.calls)
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
                if m["message"].get("tool_calls"):
                    m["message"]["content"] = m["message"]["content"].strip() or None
        return {**head, "object": kind, "choices": merged, "usage": job.usage}

    async def events(self, job: Job, stops, calls, head, kind, choice, top, body) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece of text, then the usage (if asked for), then [DONE]."""
        sse = lambda obj: f"data: {json.dumps(obj)}\n\n"
        obj = f"{kind}.chunk" if kind == "chat.completion" else kind
        first = set()
        try:
            async for piece in self.pieces(job, stops, calls):
                if calls and piece.branch in first and not (piece.text or piece.calls or piece.logprob
                                                            or piece.finish_reason):
                    continue            # text held while it may begin a call: nothing to send
                c = choice(piece, top, piece.branch not in first)
                first.add(piece.branch)
                yield sse({**head, "object": obj, "choices": [c]})
            if body.stream_options and body.stream_options.include_usage:
                yield sse({**head, "object": obj, "choices": [], "usage": job.usage})
            yield "data: [DONE]\n\n"
        except Exception as e:                  # after the headers went out: the error as an event
            e = failed(e)
            yield sse({"error": {"message": e.message, "type": "server_error", "param": None, "code": None}})
            yield "data: [DONE]\n\n"

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
            self.encoder.shutdown(cancel_futures=True)

        def alone(handler):
            """handler, with anything it raises made this request's error: the server goes on."""
            async def run(request: Request):
                try:
                    return await handler(request)
                except Exception as e:
                    raise failed(e) from None
            return run

        app = FastAPI(title="nanoinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(APIError, lambda request, e: e.response())
        app.add_exception_handler(StarletteHTTPException, lambda request, e: APIError(
            e.status_code, f"{request.method} {request.url.path}: {e.detail}").response())
        app.add_api_route("/", lambda: FileResponse(CHAT_PAGE), methods=["GET"])
        app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
        app.add_api_route("/metrics", self.scrape, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/chat/completions", alone(self.chat), methods=["POST"])
        app.add_api_route("/v1/completions", alone(self.complete), methods=["POST"])
        if self.guard.allow_origins:        # their pages' fetch() needs CORS headers; no other page's
            app.add_middleware(CORSMiddleware, allow_origins=list(self.guard.allow_origins),
                               allow_methods=["GET", "POST"], allow_headers=["*"])
        app.add_middleware(Guarded, guard=self.guard)
        return app

    async def drain(self, seconds: float) -> tuple[int, int]:
        """Shutdown: refuse new requests, let those in flight finish for up to ``seconds``,
        then end the rest with an error. Returns (finished, cancelled)."""
        self.draining, start = True, self.in_flight
        self.drain_until = time.perf_counter() + seconds
        while self.in_flight and time.perf_counter() < self.drain_until:
            await asyncio.sleep(0.05)
        left = self.in_flight
        if left:
            self.loop.cancel_all(APIError(503, f"the server shut down before this answer finished "
                                          f"(it waited {seconds:g} s: --drain-seconds)"))
            deadline = time.perf_counter() + 5
            while self.in_flight and time.perf_counter() < deadline:   # their error goes out
                await asyncio.sleep(0.05)
        return start - left, left


# ----------------------------------------------------------------------------
# The command line.

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="OpenAI-compatible server on the batching engine (engine.py)")
    ap.add_argument("--model", default=checkpoint.DEFAULT_MODEL, help="alias, directory or .gguf (default: the "
                    "bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--plan", action="store_true", help="print the configuration plan.py chooses for this "
                    "server on this machine, and why, then exit")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--device", default=None, help="cuda, mps or cpu (default: best available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *kernels.DTYPES],
                    help="auto: the plan's (plan.py: bf16 where native and measured faster, else fp32)")
    ap.add_argument("--weights", default="auto", choices=["auto", "float", "int8", "int4"],
                    help="auto: as stored (a GGUF's own bits); float: widened; int8/int4: re-rounded")
    ap.add_argument("--activations", default=None, choices=["fp32", "int8"],
                    help="int8: x rounded to 8 bits per 32 in products with quantized weights, as "
                         "llama.cpp does (faster, not exact); default fp32, exact to the file")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8-plain"],
                    help="KV pool storage (quantize.py)")
    ap.add_argument("--max-batch", type=int, default=32, help="sequences decoding together (default: 32)")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="memory for the KV pool, GiB (default: 1)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compiled decode steps on a CPU (default: the plan's); the first start builds them "
                    "in the background (minutes) while the server answers on the eager step")
    ap.add_argument("--compile-only", action="store_true",
                    help="build the compiled decode steps, then exit (what that background build runs)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="compute every prompt whole (what the prefix cache buys: bench.py serve)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /metrics")
    ap.add_argument("--max-queue", type=int, default=256, help="requests in flight before answering 429")
    ap.add_argument("--max-body", type=int, default=1 << 20, help="largest request body, bytes (default: 1 MiB)")
    ap.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                    help="another name clients reach this server by (its Host header); repeatable")
    ap.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                    help="a web page origin (https://app.example) that may use this server, or * for "
                    "any; repeatable (default: only the server's own chat page)")
    ap.add_argument("--drain-seconds", type=float, default=30.0,
                    help="on SIGINT or SIGTERM, how long requests in flight may take to finish (default: 30)")
    # what RunConfig.from_flags reads: the engine's block pool
    ap.set_defaults(kv="paged")
    return ap.parse_args(argv)


def configure(args) -> RunConfig:
    """Parsed arguments -> the server's configuration: the runner's path (flags -> the plan ->
    defaults), with the plan made for the engine (plan.Serving). ValueError: one line to show."""
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-body", args.max_body), ("--port", args.port + 1)):
        if value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    if not args.kv_gib > 0:
        raise ValueError(f"--kv-gib must be positive, got {args.kv_gib}")
    if not args.drain_seconds >= 0:
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    serving = plan.Serving(args.max_batch, int(args.kv_gib * (1 << 30)), engine.BLOCK_SIZE,
                           not args.no_prefix_cache)
    cfg = RunConfig.from_flags(args, serving=serving)
    if args.compile_only and not cfg.compile:
        raise ValueError("nothing to compile: this server's decode steps run eagerly here "
                         "(server.py --plan says why)")
    return cfg


def build(args) -> Server:
    """Load the model and assemble the server from parsed arguments (ValueError: one line to show)."""
    cfg = configure(args)
    if not args.compile_only:             # the background build runs beside the server on its port
        check_port(args.host, args.port)  # before minutes of loading, not after
    print(f"{plan.summary(cfg.in_effect())} — --plan says why", file=sys.stderr)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model, tok = nanoinfer.load.load(cfg)
    codec = quantize.kv_codec(cfg.kv_dtype)
    reader = kernels.paged_reader(cfg.device, codec)
    serving = cfg.plan.serving          # the batch and pool the plan was made for (configure)
    eng = engine.Engine(model, max_batch=serving.max_batch, kv_bytes=serving.kv_bytes,
                        block_size=serving.block_size, codec=codec,
                        prefix_caching=serving.prefix_caching, in_place=reader,
                        vocab=grammar_vocab(tok.to_json(), model.config.eos_ids),
                        fixed_shapes=cfg.compile and reader is not None)
    eng.warm_up()       # each compiled step loaded, built (--compile-only) or found missing
    guard = Guard(args.host, tuple(args.allow_host), tuple(args.allow_origin))
    unbuilt = bool(getattr(model.compiled_step, "missing", None))      # kernels.AheadOfTime's
    return Server(eng, tok, Path(cfg.model).name, args.api_key, args.max_queue, args.max_body, guard,
                  unbuilt)


def build_apart(args) -> Server:
    """``build`` on a thread that ends when it returns. OpenMP keeps a team of worker threads, for
    good, for each thread that ever runs a parallel loop; once two teams share the cores, libgomp's
    workers stop spinning between loops and sleep, so each of a decode step's hundreds of short
    loops waits for a woken thread (the engine thread's step took about twice the main thread's,
    SmolLM2 on 2 cores). Loading on a passing thread, whose team ends with it, leaves the engine
    thread's the only one."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="load") as loader:
        return loader.submit(build, args).result()


def build_in_background(server: Server, argv: list[str]) -> subprocess.Popen | None:
    """The compiled decode steps not built yet (the first start on this machine) are built by a
    child process (this command with --compile-only, log in the cache folder) while the server
    answers on the eager step; each loads at its next call once its file is there
    (kernels.AheadOfTime). None when every step was there or nothing compiles."""
    if not server.unbuilt:
        return None
    log = checkpoint.cache_root() / "compiled" / "server-build.log"
    child = nanoinfer.load.build_in_background(Path(__file__).resolve(), argv, log)
    print(f"compiling the decode steps in the background (once, minutes; log: {log}); until then "
          f"the answers run on the eager step", file=sys.stderr)
    threading.Thread(target=report_build, args=(child, log), daemon=True, name="build").start()
    return child


def report_build(child: subprocess.Popen, log: Path, out=None):
    """Wait for the background build, then say in one line how it ended: built (each step loads at
    its next call), or failed, with its log; stopped by the server's own shutdown: nothing."""
    code, out = child.wait(), out or sys.stderr
    if code == 0:
        print("[compiled decode steps built: each loads at its next call]", file=out, flush=True)
    elif code > 0:
        print(nanoinfer.load.build_failed(code, log), file=out, flush=True)


def check_port(host: str, port: int):
    """ValueError unless ``host:port`` can be bound now (uvicorn binds the same way)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET                     # a name, such as localhost
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): another server may hold "
                             "it; pick another with --port") from None


class Uvicorn(uvicorn.Server):
    """uvicorn's server, whose first SIGINT or SIGTERM drains (Server.drain) before uvicorn
    stops: uvicorn alone would wait 30 s, then cancel the streams mid-answer. A second
    signal cuts the drain short."""

    def __init__(self, config: uvicorn.Config, server: Server, drain_seconds: float):
        super().__init__(config)
        self.server, self.drain_seconds, self.drain_task = server, drain_seconds, None
        self.outcome: tuple[int, int] | None = None

    def handle_exit(self, sig, frame):
        if self.drain_task is not None:       # a second signal: no more waiting
            self.server.drain_until = 0.0
            return
        loop = asyncio.get_running_loop()
        print(f"stopping: {self.server.in_flight} requests in flight may finish for "
              f"{self.drain_seconds:g} s (--drain-seconds)", file=sys.stderr, flush=True)
        self.drain_task = loop.create_task(self.drain())

    async def drain(self):
        self.outcome = await self.server.drain(self.drain_seconds)
        self.should_exit = True


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        try:
            print(plan.describe(configure(args).plan))
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        t0 = time.perf_counter()
        server = build_apart(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {server.engine.describe()}",
          file=sys.stderr)
    if args.compile_only:
        print("compiled decode steps built", file=sys.stderr)
        return 0
    builder = build_in_background(server, sys.argv[1:] if argv is None else list(argv))
    print(f"serving on http://{args.host}:{args.port}/ (chat page), API at http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app(), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5)
    runner = Uvicorn(config, server, args.drain_seconds)
    try:
        runner.run()
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if builder is not None and builder.poll() is None:
        builder.terminate()
    finished, cancelled = runner.outcome or (0, 0)
    print(f"stopped: {finished} requests finished while draining, {cancelled} cancelled",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
