"""Structured output: JSON schemas as llama.cpp grammars, and tool calls built on them.

Tool calling works for any model, with or without native tool support in its template:
the model is told the tools and constrained, by grammar, to answer with one JSON object,
`{"tool_call": {"name": ..., "arguments": {...}}}` or (when it may choose) `{"response": "..."}`
— the generic scheme of llama.cpp's server. The arguments therefore always parse and
match the tool's parameter schema.

A tool's parameters are a schema document of their own: their local references
(`#/$defs/Person`, as pydantic writes a nested model) are resolved against them, not against
the combined answer schema they are placed in (see `tool_call_schema`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from edge_agent.engine.constrained.json_grammar import convert
from edge_agent.engine.request import ToolCall, ToolCallEvent, ToolChoice
from edge_agent.errors import InvalidRequest

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def tool_call_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
    """One schema for all the calls the model may make; each tool's parameters are first
    converted alone, so that a schema the grammar cannot take is refused naming its tool.

    Parameters that hold local references are moved under the combined schema's own
    `$defs` (`#/$defs/tool-<i>`), their references rewritten to point there, because a
    `#/...` reference means the parameters' own root: nested under `tool_call.arguments`
    it would no longer resolve."""
    selected = [(i, t) for i, t in enumerate(tools)]
    if choice not in ("auto", "required", "none"):
        selected = [(i, t) for i, t in selected if t["function"]["name"] == choice]
        if not selected:
            raise InvalidRequest(f"tool_choice names unknown function '{choice}'",
                                 param="tool_choice")
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in selected:
        params = tool["function"].get("parameters") or {"type": "object"}
        convert(params, param=f"tools.{i}.function.parameters")
        key = f"tool-{i}"
        rebased, refers = _rebased(params, f"#/$defs/{key}")
        if refers:
            defs[key] = rebased
            params = {"$ref": f"#/$defs/{key}"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": tool["function"]["name"]}, "arguments": params},
            "required": ["name", "arguments"],
        })
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "object", "properties": {"tool_call": call},
                              "required": ["tool_call"]}
    if choice == "auto":
        as_text = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
        }
        schema = {"anyOf": [schema, as_text]}
    return {"$defs": defs, **schema} if defs else schema


# Keywords whose values are schemas (one, a list, or a map of names to schemas). Any other
# value is data, copied as it is: a `$ref` key inside `const` or `default` is no reference.
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _rebased(schema: Any, base: str) -> tuple[Any, bool]:
    """A copy of `schema` whose local references (`#/...`) point to the same nodes once the
    schema sits at `base` in another document; and whether it had any. The client's schema
    is never changed. Recursive, after `convert` has bounded the schema's depth."""
    if not isinstance(schema, dict):
        return schema, False
    out: dict[str, Any] = {}
    found = False
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#/"):
            out[key], found = base + value[1:], True
            continue
        if key in _SCHEMA_MAP and isinstance(value, dict):
            parts = {name: _rebased(sub, base) for name, sub in value.items()}
            out[key] = {name: sub for name, (sub, _) in parts.items()}
            found = found or any(has for _, has in parts.values())
        elif key in _SCHEMA_LIST and isinstance(value, list):
            items = [_rebased(sub, base) for sub in value]
            out[key] = [sub for sub, _ in items]
            found = found or any(has for _, has in items)
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key], has = _rebased(value, base)
            found = found or has
        else:
            out[key] = value
    return out, found


# What the model is told besides the tools (see `tool_instructions`).
WHEN_TO_CALL = "Call a tool when the user asks for what it does; otherwise reply to the user " \
    "directly."
MUST_CALL = "Answer with a call to one of these tools."


def tool_instructions(tools: list[dict[str, Any]], choice: ToolChoice) -> str:
    """The tools, for the system prompt, and when to call one — never the answer format.

    The grammar makes the format; words about it only give a small model text to copy.
    Shown `{"response": "<your answer>"}`, SmolLM2-135M answered `<your answer>` (the
    grammar allows any text in that slot); told it "can call these tools", it answered "You
    can call the {tool_call} method". So no sample value, key name or placeholder is
    written here, and the few words there are do not read as an answer."""
    described = [
        {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "parameters": t["function"].get("parameters") or {"type": "object"},
        }
        for t in tools
    ]
    when = WHEN_TO_CALL if choice == "auto" else MUST_CALL
    return f"Tools:\n{json.dumps(described, ensure_ascii=False, indent=2)}\n\n{when}"


def with_tool_messages(
    messages: list[dict[str, Any]], instructions: str, *, keep_tool_role: bool
) -> list[dict[str, Any]]:
    """Adds the tool instructions to the system prompt and writes earlier tool turns in the
    same JSON the model is asked to produce, so the conversation stays consistent."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            first = msg["tool_calls"][0]["function"]
            args = first.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            content = json.dumps({"tool_call": {"name": first["name"], "arguments": args}})
            out.append({"role": "assistant", "content": content})
        elif msg["role"] == "tool" and not keep_tool_role:
            payload = {"tool_response": {"name": msg.get("name") or msg.get("tool_call_id") or "",
                                         "content": msg.get("content", "")}}
            out.append({"role": "user", "content": json.dumps(payload, ensure_ascii=False)})
        else:
            out.append(msg)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


def parse_tool_output(text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
    """Reads a whole grammar-shaped answer back: (answer text or None, calls)."""
    reader = ToolAnswerReader()
    reader.feed(text)
    answer = reader.finish()
    return (None if answer.calls else answer.content), answer.calls


@dataclass(frozen=True)
class ToolAnswer:
    """A tool-mode answer read back. `complete`: the JSON closed (or a call's arguments did)."""

    content: str
    calls: tuple[ToolCall, ...]
    complete: bool


class _Frame:
    """One open JSON container: an object knows the key its current value belongs to."""

    __slots__ = ("expect_key", "is_object", "key")

    def __init__(self, is_object: bool) -> None:
        self.is_object = is_object
        self.key: str | None = None
        self.expect_key = is_object


class ToolAnswerReader:
    """Reads the grammar-shaped answer while it is generated, so that a client sees a call
    as soon as its name is known and a plain answer as it is written — and never the
    internal JSON as text, even when the output limit cuts it.

    `feed` takes each piece of generated text and returns what may be shown now: answer
    text (decoded, `str`) and `ToolCallEvent`s (the call's id and name, then its arguments'
    JSON text piece by piece). `finish` reads the whole answer: a cut one keeps what
    completed (a call whose arguments closed, the answer text so far), nothing else.
    """

    def __init__(self) -> None:
        self.call_id = f"call_{secrets.token_hex(8)}"
        self._text = ""
        self._stack: list[_Frame] = []
        self._string_at: int | None = None  # where the open string's quote is
        self._string_is_key = False
        self._escaped = False
        self._name: str | None = None
        self._announced = False
        self._args: list[int] | None = None  # [start, end] of the arguments' text; end -1: open
        self._args_sent = 0
        self._answer: list[int] | None = None  # [start, end] of the "response" string's body
        self._answer_sent = 0

    def feed(self, text: str) -> list[str | ToolCallEvent]:
        start = len(self._text)
        self._text += text
        for i in range(start, len(self._text)):
            self._scan(i, self._text[i])
        return self._ready()

    def finish(self) -> ToolAnswer:
        try:
            data = json.loads(self._text)
        except json.JSONDecodeError:
            return self._cut()
        if isinstance(data, dict) and isinstance(data.get("tool_call"), dict):
            call = data["tool_call"]
            return ToolAnswer("", (self._call(call.get("name"), call.get("arguments")),), True)
        if isinstance(data, dict) and isinstance(data.get("response"), str):
            return ToolAnswer(_clean(data["response"]), (), True)
        return ToolAnswer(self._text, (), True)  # not the answer format: shown as it is

    def _cut(self) -> ToolAnswer:
        if self._name is not None and self._args is not None and self._args[1] >= 0:
            try:
                args = json.loads(self._text[self._args[0]:self._args[1]])
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                return ToolAnswer("", (self._call(self._name, args),), True)
        if self._answer is not None:
            return ToolAnswer(_decode(self._text[self._answer[0]:self._answer_end()]), (),
                              False)
        return ToolAnswer("", (), False)

    def _call(self, name: object, arguments: object) -> ToolCall:
        args: dict[str, Any] = arguments if isinstance(arguments, dict) else {}
        if "\\u" in self._text:  # an escaped lone surrogate would not encode as UTF-8
            args = json.loads(_clean(json.dumps(args, ensure_ascii=False)))
        return ToolCall(id=self.call_id, name=_clean(str(name or "")), arguments=args)

    def _at(self, *path: str) -> bool:
        """The open containers are the objects along `path` (keys from the top)."""
        return len(self._stack) == len(path) and all(
            f.is_object and f.key == k for f, k in zip(self._stack, path, strict=True))

    def _scan(self, i: int, c: str) -> None:
        if self._string_at is not None:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._string_closed(i)
            return
        top = self._stack[-1] if self._stack else None
        if c == '"':
            self._string_at = i
            self._string_is_key = top is not None and top.expect_key
            if not self._string_is_key and self._at("response"):
                self._answer = [i + 1, -1]
        elif c in "{[":
            if self._at("tool_call", "arguments") and self._args is None:
                self._args = [i, -1]
            self._stack.append(_Frame(c == "{"))
        elif c in "}]":
            if self._stack:
                self._stack.pop()
            if self._args is not None and self._args[1] < 0 and \
                    self._at("tool_call", "arguments"):
                self._args[1] = i + 1
        elif c == "," and top is not None and top.is_object:
            top.expect_key = True

    def _string_closed(self, i: int) -> None:
        assert self._string_at is not None
        raw, self._string_at = self._text[self._string_at + 1:i], None
        top = self._stack[-1] if self._stack else None
        if self._string_is_key and top is not None:
            top.key, top.expect_key = _decode(raw), False
        elif self._at("tool_call", "name") and self._name is None:
            self._name = _decode(raw)
        elif self._answer is not None and self._answer[1] < 0 and self._at("response"):
            self._answer[1] = i

    def _answer_end(self) -> int:
        assert self._answer is not None
        start, end = self._answer
        return end if end >= 0 else start + _decodable(self._text[start:])

    def _ready(self) -> list[str | ToolCallEvent]:
        out: list[str | ToolCallEvent] = []
        if self._name is not None and not self._announced:
            self._announced = True
            out.append(ToolCallEvent(0, "", id=self.call_id, name=self._name))
        if self._announced and self._args is not None:
            start, end = self._args
            begin, stop = max(self._args_sent, start), end if end >= 0 else len(self._text)
            if stop > begin:
                out.append(ToolCallEvent(0, self._text[begin:stop]))
                self._args_sent = stop
        if self._answer is not None:
            begin, stop = max(self._answer_sent, self._answer[0]), self._answer_end()
            if stop > begin:
                out.append(_decode(self._text[begin:stop]))
                self._answer_sent = stop
        return out


def _decodable(raw: str) -> int:
    """How much of an unfinished JSON string body decodes on its own: no escape, nor
    surrogate pair, cut in half."""
    i = safe = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
        elif i + 1 >= len(raw):
            break
        elif raw[i + 1] != "u":
            i += 2
        elif i + 6 > len(raw):
            break
        elif raw[i + 2:i + 4].lower() in ("d8", "d9", "da", "db"):  # a high surrogate
            tail = raw[i + 6:i + 12]
            if len(tail) < 6 and (tail.startswith("\\u") or "\\u".startswith(tail)):
                break  # its low half may still come
            i += 12 if tail.startswith("\\u") else 6
        else:
            i += 6
        safe = i
    return safe


def _decode(raw: str) -> str:
    """A JSON string body as text; a lone surrogate (valid JSON, not valid UTF-8) becomes ?."""
    try:
        return _clean(json.loads(f'"{raw}"'))
    except json.JSONDecodeError:
        return _clean(raw)


def _clean(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
