"""Chat templates: the model's own Jinja template (or the catalog's), rendered sandboxed.

Templates come from model files, which are untrusted input: they run in Jinja's immutable
sandbox with only the helpers Hugging Face templates expect.

Only the template's own markers may become control tokens. `render_pieces` keeps what
clients wrote (contents, names, tool arguments, the system prompt) apart from them: any
control-token text found in client text (`<|im_end|>`, `<start_of_turn>`) is swapped for a
placeholder before rendering and comes back as a piece to tokenize as plain text, so a user
cannot close a turn and forge the next one. Client text without such markers is left where
the template put it, so ordinary prompts tokenize exactly as the rendered text always did.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge_agent.errors import InvalidRequest, ModelFileError


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


# A placeholder: private-use characters around a per-render number (digits survive any case
# or whitespace filter a template applies) and the literal's index.
_OPEN, _CLOSE = "\ue000", "\ue001"

Piece = tuple[str, bool]  # (text, whether its control-token text is parsed as such)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ModelFileError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.knows_tools = "tools" in source
        self.knows_tool_role = "'tool'" in source or '"tool"' in source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        context: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if tools:
            context["tools"] = tools
        try:
            return self._template.render(**context)
        except _TemplateRaised as exc:
            raise InvalidRequest(f"chat template rejected the messages: {exc}",
                                 param="messages") from exc
        except TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc

    def render_pieces(
        self,
        messages: list[dict[str, Any]],
        *,
        find_special: Callable[[str], Iterable[str]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[Piece]:
        """The rendered prompt as pieces to tokenize in order: template text (with any
        client text that holds no control-token text) to parse for special tokens, and the
        control-token texts clients wrote, as literals. `find_special(text)` gives the
        control-token texts in `text` (the model's vocabulary decides what they are)."""
        literals: list[str] = []
        nonce = str(secrets.randbelow(10**9))

        def shield(text: str) -> str:
            found = sorted(set(find_special(text)), key=len, reverse=True)
            if not found:
                return text

            def mark(m: re.Match[str]) -> str:
                literals.append(m.group(0))
                return f"{_OPEN}{nonce}:{len(literals) - 1}{_CLOSE}"

            return re.sub("|".join(map(re.escape, found)), mark, text)

        def walk(value: Any, key: object = None) -> Any:
            if isinstance(value, str):
                return value if key == "role" else shield(value)
            if isinstance(value, dict):
                return {shield(k) if isinstance(k, str) else k: walk(v, k)
                        for k, v in value.items()}
            if isinstance(value, list):
                return [walk(v) for v in value]
            return value

        shielded = walk(messages)
        text = self.render(shielded, tools=walk(tools) if tools else None,
                           add_generation_prompt=add_generation_prompt)
        if not literals:
            return [(text, True)]
        parts = re.split(f"{_OPEN}{nonce}:([0-9]+){_CLOSE}", text)
        pieces: list[Piece] = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                pieces.append((part, True))
            else:
                pieces.append((literals[int(part)], False))
        return pieces
