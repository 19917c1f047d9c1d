"""Structured output: JSON schemas as llama.cpp grammars, and tool calls built on them.

Tool calling works for any model, with or without native tool support in its template:
the model is told the tools and constrained, by grammar, to answer with one JSON object,
`{"tool_call": {"name": ..., "arguments": {...}}}` or (when it may choose) `{"response": "..."}`
— the generic scheme of llama.cpp's server. The arguments therefore always parse and
match the tool's parameter schema.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from edge_agent.engine.json_grammar import convert
from edge_agent.engine.request import ToolCall, ToolChoice
from edge_agent.errors import InvalidRequest

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def tool_call_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
    """One schema for all the calls the model may make; each tool's parameters are first
    converted alone, so that a schema the grammar cannot take is refused naming its tool."""
    selected = tools
    if choice not in ("auto", "required", "none"):
        selected = [t for t in tools if t["function"]["name"] == choice]
        if not selected:
            raise InvalidRequest(f"tool_choice names unknown function '{choice}'",
                                 param="tool_choice")
    chosen = {id(t) for t in selected}
    for i, tool in enumerate(tools):
        if id(tool) in chosen:
            convert(tool["function"].get("parameters") or {"type": "object"},
                    param=f"tools.{i}.function.parameters")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in selected
    ]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    as_call = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]}
    if choice == "auto":
        as_text = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
        }
        return {"anyOf": [as_call, as_text]}
    return as_call


def tool_instructions(tools: list[dict[str, Any]], choice: ToolChoice) -> str:
    described = [
        {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "parameters": t["function"].get("parameters") or {"type": "object"},
        }
        for t in tools
    ]
    text = (
        "You can call these tools:\n"
        + json.dumps(described, ensure_ascii=False, indent=2)
        + '\n\nTo call a tool, answer with JSON: {"tool_call": {"name": "<tool name>", '
        '"arguments": {...}}}.'
    )
    if choice == "auto":
        text += ' To answer directly, reply with JSON: {"response": "<your answer>"}.'
    return text


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
    """Reads the grammar-shaped answer back; a truncated answer is returned as plain text."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text, ()
    if isinstance(data, dict) and isinstance(data.get("tool_call"), dict):
        call = data["tool_call"]
        return None, (
            ToolCall(
                id=f"call_{secrets.token_hex(8)}",
                name=str(call.get("name", "")),
                arguments=call.get("arguments") or {},
            ),
        )
    if isinstance(data, dict) and isinstance(data.get("response"), str):
        return data["response"], ()
    return text, ()
