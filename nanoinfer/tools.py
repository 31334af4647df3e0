"""Tool calling: the functions a request offers go into the prompt, and the calls the model
writes come out of its answer as OpenAI's ``tool_calls``.

Into the prompt. A chat template that takes a ``tools`` variable (Qwen 2.5, Llama 3.1, Hermes,
...) renders them the way its model was trained to read them. One that does not (SmolLM2's)
gets them from one system prompt, ``tool_prompt``, which shows the functions as JSON and asks
for calls in Hermes' format. A template that knows no tool messages gets each earlier call as
that format in the assistant's text, and each result as a user turn in <tool_response> tags.

Out of the answer. Models write a call in one of two shapes, and ``Format`` says which:
  * tagged (Hermes, Qwen, and our system prompt): <tool_call>{"name": ..., "arguments": {...}}
    </tool_call>, any number of them, text around them allowed;
  * bare (Llama 3.1): the whole answer is {"name": ..., "parameters": {...}}.
``Calls`` reads a streamed answer: text that cannot be part of a call passes on at once, text
that may begin one is held until the call closes (then it is a call) or cannot (then it is
text), so no call is ever split across chunks.

With tool_choice "required" or a named function, ``call_grammar`` constrains the answer
(sampling.py) to exactly one call, in the format the model writes, whose arguments match that
function's JSON schema: the call is valid by construction, not by luck.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from sampling import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Format:
    """How a model writes a call: in tags (Hermes) or as the bare answer (Llama 3.1), and the
    key its arguments go under."""
    tagged: bool = True
    arguments: str = "arguments"
    in_template: bool = False          # the template renders tools itself

    @classmethod
    def of(cls, template: str | None) -> Format:
        if template is None or not re.search(r"\btools\b", template):
            return cls()
        if OPEN in template:
            return cls(in_template=True)
        return cls(False, "parameters" if '"parameters"' in template else "arguments", True)


@dataclass
class Call:
    name: str
    arguments: str                     # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def tool_prompt(tools: list[dict]) -> str:
    """The system prompt that offers ``tools`` to a model whose template has no place for them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to answer. The functions, as JSON schemas:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, answer with a JSON object of its name and arguments in tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{CLOSE}')


def messages_for(messages: list[dict], tools: list[dict] | None, fmt: Format) -> list[dict]:
    """OpenAI messages (tool results, assistant turns with tool_calls) as the template takes
    them: passed on where the template renders tools, else spelled in text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if fmt.in_template:
            if calls:     # templates read a call's arguments as an object, not JSON text
                m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments":
                                                             loads_or_text(c["function"]["arguments"])}}
                                         for c in calls]}
            out.append(m)
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif calls:
            text = "\n".join(f"{OPEN}\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": loads_or_text(c["function"]["arguments"])},
                ensure_ascii=False) + f"\n{CLOSE}" for c in calls)
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools and not fmt.in_template:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + tool_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt(tools)})
    return out


def loads_or_text(text: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def call_schema(functions: list[dict], fmt: Format) -> dict:
    """A JSON schema that one call of any of ``functions`` matches."""
    one = [{"type": "object", "additionalProperties": False, "required": ["name", fmt.arguments],
            "properties": {"name": {"const": f["name"]},
                           fmt.arguments: f.get("parameters") or {"type": "object"}}}
           for f in functions]
    return {"x-guidance": JSON_LAYOUT, **(one[0] if len(one) == 1 else {"anyOf": one})}


def call_grammar(functions: list[dict], fmt: Format) -> str:
    """A Lark grammar (llguidance's dialect) for an answer that is exactly one call."""
    body = f"%json {json.dumps(call_schema(functions, fmt))}"
    if not fmt.tagged:
        return f"start: call\ncall: {body}\n"
    return f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: {body}\n"


def as_call(obj, fmt: Format) -> Call | None:
    """A parsed JSON value as a call, if it is one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fmt.arguments, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        args = loads_or_text(args) if isinstance(args, str) else None
        if not isinstance(args, dict):
            return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


class Calls:
    """A streamed answer split into text and calls. ``push(text)`` returns (text to show now,
    calls completed now); ``push("", final=True)`` at the end returns what was held."""

    def __init__(self, fmt: Format):
        self.fmt, self.held, self.started = fmt, "", False
        self.bare = None                     # bare format: is the answer a JSON object?

    def push(self, text: str, final: bool = False) -> tuple[str, list[Call]]:
        self.held += text
        if not self.fmt.tagged:
            return self.push_bare(final)
        shown, calls = "", []
        while self.held:
            start = self.held.find(OPEN)
            if start < 0:
                # hold a tail that may begin OPEN
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                             if OPEN.startswith(self.held[-k:])), 0)
                keep = 0 if final else keep
                shown += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            shown += self.held[:start]
            self.held = self.held[start:]
            end = self.held.find(CLOSE)
            if end < 0:
                if final:                       # an unclosed call: it is text after all
                    shown, self.held = shown + self.held, ""
                break
            call = as_call(loads_or_text(self.held[len(OPEN):end].strip()), self.fmt)
            if call is None:
                shown += self.held[:end + len(CLOSE)]
            else:
                calls.append(call)
            self.held = self.held[end + len(CLOSE):]
        return shown, calls

    def push_bare(self, final: bool) -> tuple[str, list[Call]]:
        if self.bare is None and self.held.strip():
            self.bare = self.held.lstrip().startswith("{")
        if not self.bare:
            if self.bare is None and not final:
                return "", []
            shown, self.held = self.held, ""
            return shown, []
        if not final:
            return "", []
        held, self.held = self.held, ""
        call = as_call(loads_or_text(held.strip()), self.fmt)
        return ("", [call]) if call else (held, [])


def parse(text: str, fmt: Format) -> tuple[str, list[Call]]:
    """A whole answer as (its text outside calls, the calls)."""
    return Calls(fmt).push(text, final=True)
