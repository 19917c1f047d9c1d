"""The task kinds of a generation request: the one vocabulary shared by the box's counter
(`edge_agent_request_kinds_total`, `telemetry.metrics`), the `metrics` message that carries
its deltas, and a release's evaluation samples (`fleet.protocol.materials.EVAL_KINDS`), so
the central team can set what a model serves against what it was judged on.

    ollama, openai  the dialect the request came in (exactly one of them)
    schema          it asked for structured output: Ollama `format` (a schema or "json"),
                    OpenAI `response_format` json_schema or json_object
    tools           it carried tools
    long_context    its prompt was long for the model that took it (`is_long`)

A request counts in every kind that applies. Defined here, below the request path and the
fleet link, because both name them and neither may import the other. Pure: no registry,
no request types; must never take a client's text, so its words are the only labels.
"""

from __future__ import annotations

from typing import Literal, get_args

TaskKind = Literal["ollama", "openai", "schema", "tools", "long_context"]
TASK_KINDS: tuple[TaskKind, ...] = get_args(TaskKind)
DIALECTS: tuple[TaskKind, ...] = ("ollama", "openai")
# A prompt this long is long on any model: a large context does not make 8k tokens short
# for the review, which asks whether the evaluation had prompts of that size at all.
LONG_PROMPT_TOKENS = 8192


def long_threshold(n_ctx: int | None) -> int:
    """Prompt tokens from which a prompt is long: half the context one sequence of the
    model has (a prompt that leaves the answer at most half of it), or `LONG_PROMPT_TOKENS`,
    whichever is smaller; `LONG_PROMPT_TOKENS` where the context is not known (an upstream
    that declares no `context_length`)."""
    if not n_ctx:
        return LONG_PROMPT_TOKENS
    return min(max(1, n_ctx // 2), LONG_PROMPT_TOKENS)


def kinds_of(dialect: str, *, schema: bool, tools: bool, prompt_tokens: int,
             n_ctx: int | None) -> tuple[TaskKind, ...]:
    """The kinds of one request, in `TASK_KINDS` order. A request of no client dialect (the
    health gate's own probes) has none: the review is about what clients ask."""
    if dialect not in DIALECTS:
        return ()
    flags = {"schema": schema, "tools": tools,
             "long_context": prompt_tokens >= long_threshold(n_ctx)}
    return tuple(k for k in TASK_KINDS if k == dialect or flags.get(k, False))
