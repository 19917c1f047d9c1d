"""The dialect-free request and the events a generation yields.

Both API dialects translate into `GenerationRequest` and out of the `Event`s; everything
below them (templates, limits, scheduling, llama.cpp) sees only these types. They say what
is asked of a model, never how the request path treats the request (its tier, deadline,
priority, end user: `gateway.controls.Controls`, which travels beside them).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

ToolChoice = Literal["auto", "none", "required"] | str  # a str other than those: a function name


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampler settings. Defaults are llama.cpp's; a catalog entry may override."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(cls.__dataclass_fields__)


@dataclass
class GenerationRequest:
    model: str
    messages: list[dict[str, Any]] | None = None  # chat: OpenAI-shaped messages
    prompt: str | None = None  # completion: text to template (raw=False) or to send as is
    raw: bool = False
    system: str | None = None  # Ollama /api/generate's system prompt
    context_tokens: list[int] = field(default_factory=list)  # Ollama's `context`
    context_param: str = "context"  # how the dialect names context_tokens, for errors
    sampling: dict[str, Any] = field(default_factory=dict)  # only what the client set
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    json_schema: dict[str, Any] | None = None
    schema_param: str = "format"  # how the dialect names it, for errors
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool objects
    tool_choice: ToolChoice = "auto"
    num_ctx: int | None = None  # Ollama's load-time size, as sent; the box's context applies
    max_tokens_param: str = "max_tokens"  # how the dialect names it, for errors
    cache_key: str | None = None  # a client's prompt-cache hint: prefer the slot it used last
    draft: int | None = None  # prompt-lookup draft tokens a step (None: the model's setting)
    # Whether the client reads the answer as it is written (False: a whole response, whose
    # text the engine hands over once, at its end).
    stream: bool = True


@dataclass
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]
    truncate: bool = False


@dataclass(frozen=True)
class GenerationSpec:
    """What the engine is asked to run: the prompt's tokens and every limit already
    decided (the request path's job); the engine only schedules it."""

    prompt: list[int]
    params: SamplingParams
    grammar: str | None
    max_tokens: int
    stops: list[str]
    priority: Literal["interactive", "batch"] = "interactive"
    load_ns: int = 0  # how long the request waited for its model to load
    cache_key: str | None = None
    draft: int | None = None  # prompt-lookup draft tokens a step (None: the model's setting)
    # False: only the first piece of text comes as a TokenEvent (the time to the first
    # token); the rest is in the DoneEvent's `text`, with no wake-up of the caller's event
    # loop per step for text nobody reads until the end.
    stream: bool = True
    # True (a batch's line, not streamed): it starts only in the pauses of other work and
    # gives its sequence back when other work needs it, to run again from its start
    # (`scheduling.scheduler`; the caller then gets a RestartEvent).
    yields: bool = False
    # The prompt's leading system part, in tokens (0: none worth keeping): its cells are
    # kept apart in the prompt cache, and on disk once a second request sent it.
    system_tokens: int = 0


@dataclass
class Generation:
    """A queued generation, as its caller holds it: the events (exactly one DoneEvent or
    ErrorEvent last) and the switch that cancels it at the next step."""

    events: asyncio.Queue[Event]
    cancelled: threading.Event
    submitted_ns: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Nanoseconds, as Ollama reports them."""

    queue_ns: int = 0
    load_ns: int = 0
    prompt_ns: int = 0
    eval_ns: int = 0
    total_ns: int = 0


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class TokenEvent:
    text: str


DoneReason = Literal["stop", "length", "tool_calls", "cancelled"]


@dataclass(frozen=True)
class DoneEvent:
    reason: DoneReason
    usage: Usage
    timings: Timings
    text: str = ""  # the whole text, for non-streamed responses
    tool_calls: tuple[ToolCall, ...] = ()
    context: tuple[int, ...] = ()  # prompt + completion tokens (Ollama `context`)
    # A JSON answer the budget's last tokens closed (`constrained.closing`): it ends with
    # `stop` and is whole, but the model was steered to end it.
    closed: bool = False


@dataclass(frozen=True)
class ErrorEvent:
    error: Exception


@dataclass(frozen=True)
class ToolCallEvent:
    """A tool call while it is generated, in OpenAI's streamed shape: first its id and name
    (with `arguments` ""), then fragments of the arguments' JSON text, in order."""

    index: int
    arguments: str
    id: str = ""
    name: str = ""


@dataclass(frozen=True)
class RestartEvent:
    """A yielding job (`GenerationSpec.yields`) gave its sequence back to other work and
    runs again from its start: the text sent so far is void."""


Event = TokenEvent | DoneEvent | ErrorEvent | ToolCallEvent | RestartEvent


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int
    truncated_tokens: int
    timings: Timings
