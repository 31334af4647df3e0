"""Structured output and tool calling through server.py, with the official openai client on the
bundled model: every answer under a schema parses and validates (greedy and sampled, streamed and
not, n = 2), forced tool calls are valid calls, a tool round trip completes, streamed tool-call
deltas reassemble, and a bad schema or an unimplemented field is a 400."""

import concurrent.futures
import json

import httpx
import jsonschema
import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

import engine
import server
from nanoinfer import tools
from sampling import grammar_vocab
from test_server import Live, error_of, model_tok  # noqa: F401 (fixture)

PERSON = {"type": "object", "additionalProperties": False, "required": ["person"],
          "properties": {"person": {"type": "object", "additionalProperties": False,
                                    "required": ["name", "age"],
                                    "properties": {"name": {"type": "string", "maxLength": 30},
                                                   "age": {"type": "integer", "minimum": 0,
                                                           "maximum": 120}}}}}
SCHEMAS = {
    "nested object": ("Describe a person.", PERSON),
    "array": ("List some colours.", {
        "type": "object", "additionalProperties": False, "required": ["colours"],
        "properties": {"colours": {"type": "array", "minItems": 1, "maxItems": 4,
                                   "items": {"type": "string", "maxLength": 15}}}}),
    "enums": ("How do you feel today?", {
        "type": "object", "additionalProperties": False, "required": ["mood", "level"],
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                       "level": {"type": "string", "enum": ["low", "high"]}}}),
    "bounded numbers": ("Give a weather reading.", {
        "type": "object", "additionalProperties": False, "required": ["celsius", "stations"],
        "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                       "stations": {"type": "integer", "minimum": 1, "maximum": 9}}}),
    "optional fields": ("Name a film.", {
        "type": "object", "additionalProperties": False, "required": ["title"],
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "genre": {"type": "string", "maxLength": 20}}}),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 40}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live(model_tok):
    model, tok = model_tok
    eng = engine.Engine(model, max_batch=16, kv_bytes=256 << 20,
                        vocab=grammar_vocab(tok.to_json(), model.config.eos_ids))
    srv = Live(server.Server(eng, tok, "smollm2"))
    yield srv
    srv.close()


def client(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def streamed(stream) -> list:
    """The official client's own assembly of a stream into whole choices."""
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", SCHEMAS)
def test_every_answer_under_a_schema_is_valid(live, name, stream):
    question, schema = SCHEMAS[name]
    for temperature, n in ((0.0, 1), (1.0, 2)):
        kw = dict(model="x", messages=[{"role": "user", "content": question}], n=n, seed=7,
                  temperature=temperature, response_format=schema_format(schema), max_tokens=200)
        if stream:
            choices = streamed(client(live).chat.completions.create(stream=True, **kw))
        else:
            choices = client(live).chat.completions.create(**kw).choices
        assert len(choices) == n
        for c in choices:
            assert c.finish_reason == "stop", (name, c.message.content)
            jsonschema.validate(json.loads(c.message.content), schema)
    assert live.settled() == (0, False)


def test_fifty_sampled_answers_are_all_valid(live):
    question, schema = SCHEMAS["nested object"]

    def ask(seed):
        r = client(live).chat.completions.create(
            model="x", messages=[{"role": "user", "content": question}], temperature=1.0,
            seed=seed, response_format=schema_format(schema), max_tokens=200)
        return r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(50)))
    for c in answers:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    assert len({c.message.content for c in answers}) > 10        # sampled, not one answer


def test_json_object_mode_answers_an_object(live):
    r = client(live).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        temperature=0, response_format={"type": "json_object"}, max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_a_tool_round_trip(live):
    """Tools offered, a call made (required), its result sent back as a tool message, and a
    text answer to finish."""
    c = client(live)
    first = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice="required", temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments),
                        {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                        ["function"]["parameters"])
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": json.dumps({"celsius": 18, "sky": "sunny"})}]
    final = c.chat.completions.create(model="x", messages=history, tools=[WEATHER, TIME],
                                      tool_choice="none", temperature=0, max_tokens=60)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_is_a_valid_call_of_that_tool(live, stream):
    kw = dict(model="x", messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
              tools=[WEATHER, TIME], temperature=1.0, seed=3, n=2,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:      # deltas the client reassembles
        choices = streamed(client(live).chat.completions.create(stream=True, **kw))
    else:
        choices = client(live).chat.completions.create(**kw).choices
    for c in choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_tool_calls_in_free_text_are_parsed_and_never_split(live):
    """tool_choice auto: the model may write text, calls, or both, and the parser takes them
    apart however the stream cuts the text: text that may begin a call is held until the
    call closes, so a chunk never shows part of one."""
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call> Done. <tool_')
    cuts = [[text[:i], text[i:]] for i in range(len(text))] + [list(text)]
    for chunks in cuts:
        calls, shown, made = tools.Calls(tools.Format()), [], []
        for chunk in chunks + [""]:
            s, m = calls.push(chunk, final=chunk == "")
            shown.append(s)
            made += m
        assert "".join(shown) == "Let me check.  Done. <tool_", chunks
        assert [(c.name, json.loads(c.arguments)) for c in made] == [("get_weather", {"city": "Paris"})]
        assert all("<tool_call" not in s for s in shown)
    bare = tools.Format(tagged=False, arguments="parameters", in_template=True)
    assert tools.parse(' {"name": "get_time", "parameters": {"zone": "UTC"}}', bare)[1][0].name == "get_time"
    assert tools.parse("It is noon.", bare) == ("It is noon.", [])
    # through the server: auto leaves the choice to the model; this one answers in text
    r = client(live).chat.completions.create(model="x", messages=ASK, tools=[WEATHER],
                                             temperature=0, max_tokens=40)
    c = r.choices[0]
    assert (c.finish_reason, c.message.tool_calls) in (("length", None), ("stop", None)) or \
        c.finish_reason == "tool_calls"


def test_bad_schemas_and_unimplemented_fields_are_400(live):
    url = live.url + "/v1/chat/completions"
    ask = {"messages": ASK, "max_tokens": 4}
    for extra, param in [
        ({"response_format": schema_format({"type": "objekt"})}, "response_format"),
        ({"response_format": schema_format({"type": "string", "pattern": "(("})}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"whatever": 1}, "whatever"),
    ]:
        err = error_of(httpx.post(url, json={**ask, **extra}, timeout=60), 400)
        assert err["param"] == param, (extra, err)
    # fields OpenAI's server ignores, and unimplemented ones at their neutral values
    neutral = {"user": "me", "metadata": {"a": "b"}, "store": False, "frequency_penalty": 0,
               "presence_penalty": 0, "logit_bias": {}, "parallel_tool_calls": True}
    assert httpx.post(url, json={**ask, **neutral}, timeout=60).status_code == 200
