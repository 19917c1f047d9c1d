"""Chat templates: the model's own Jinja template (or the catalog's), rendered sandboxed.

Templates come from model files, which are untrusted input: they run in Jinja's immutable
sandbox with only the helpers Hugging Face templates expect.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge_agent.errors import InvalidRequest, ModelFileError


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


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
