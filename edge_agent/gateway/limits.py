"""How much of the context a request may take: the tenant's window and output ceiling,
the oldest-turns truncation, and the refusal when it still does not fit.

Nothing here cuts a prompt silently: a truncation or a clamp is reported (the response's
`X-Edge-Truncated` / `X-Edge-Clamped` headers, the ledger's flags) and anything else that
does not fit is refused with the phrases clients look for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_agent.engine.prompt import prompt_tokens, system_tokens
from edge_agent.engine.request import GenerationRequest
from edge_agent.errors import ContextLengthExceeded, InvalidRequest

if TYPE_CHECKING:
    from edge_agent.config import TenantPolicy
    from edge_agent.engine.registry import LoadedModel


@dataclass(frozen=True)
class Fit:
    """A prompt that fits, and what its answer may take."""

    tokens: list[int]
    max_tokens: int
    window: int  # the context this request is served with
    truncated_tokens: int = 0  # dropped by `truncate = "oldest_turns"`
    system_tokens: int = 0  # the prompt's system part (`prompt.system_tokens`)
    clamped: bool = False  # max_tokens lowered to the tenant's ceiling


def window_for(n_ctx: int, policy: TenantPolicy | None) -> int:
    """Ollama's num_ctx sizes a model at load time; clients send back whatever /api/show
    reported. The box serves the context it is configured for (X-Edge-Context says which),
    or the tenant's smaller `max_context_tokens`."""
    if policy and policy.max_context_tokens and policy.max_context_tokens < n_ctx:
        return policy.max_context_tokens
    return n_ctx


def requested_output(req: GenerationRequest, policy: TenantPolicy | None
                     ) -> tuple[int | None, bool]:
    """The output tokens asked for (None: as many as fit) and whether the tenant's ceiling
    clamped them; over the ceiling without `output_limit = "clamp"` is a 400."""
    ceiling = policy.max_output_tokens if policy else None
    requested = req.max_tokens if req.max_tokens is not None and req.max_tokens >= 0 \
        else None
    if requested is not None and ceiling is not None and requested > ceiling:
        if policy is None or policy.output_limit != "clamp":
            raise InvalidRequest(
                f"{req.max_tokens_param} {requested} exceeds the ceiling of {ceiling} "
                "output tokens", param=req.max_tokens_param)
        return ceiling, True
    return requested, False


def fit(req: GenerationRequest, model: LoadedModel, policy: TenantPolicy | None, *,
        window: int, requested: int | None, clamped: bool) -> Fit:
    """The request's prompt within `window` (see `window_for`) with room for `requested`
    output tokens (see `requested_output`), or the error that says why not."""
    reserve = requested if requested is not None else 1
    tokens = prompt_tokens(req, model)
    truncated = 0
    if len(tokens) + reserve > window and policy is not None and \
            policy.truncate == "oldest_turns" and req.messages:
        tokens, truncated = drop_oldest_turns(req, model, tokens, window - reserve)
    if len(tokens) >= window:
        raise too_long(req, window, len(tokens), None)
    if requested is None:
        max_tokens = window - len(tokens)
        ceiling = policy.max_output_tokens if policy else None
        if ceiling is not None:
            max_tokens = min(max_tokens, ceiling)
    elif len(tokens) + requested > window:
        raise too_long(req, window, len(tokens), requested)
    else:
        max_tokens = requested
    return Fit(tokens=tokens, max_tokens=max_tokens, window=window,
               truncated_tokens=truncated, clamped=clamped,
               system_tokens=system_tokens(req, model, tokens))


def drop_oldest_turns(req: GenerationRequest, model: LoadedModel, tokens: list[int],
                      budget: int) -> tuple[list[int], int]:
    """The tenant's `truncate = "oldest_turns"`: keep the system prompt and the latest
    turn, drop the oldest turns until the prompt fits. Returns (tokens, dropped)."""
    assert req.messages is not None
    messages = list(req.messages)
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"),
                 len(messages))
    original = len(tokens)
    while len(tokens) > budget and len(messages) - first > 1:
        del messages[first]
        while len(messages) - first > 1 and messages[first]["role"] == "tool":
            del messages[first]  # a tool result without its call makes no sense
        tokens = prompt_tokens(dataclasses.replace(req, messages=messages), model)
    return tokens, original - len(tokens)


def too_long(req: GenerationRequest, window: int, prompt: int, output: int | None
             ) -> ContextLengthExceeded:
    """Worded with the phrases Ollama's clients (and litellm's generic check) look for; the
    numbers ride along so the OpenAI dialect can say it in OpenAI's words."""
    kind = "messages" if req.messages is not None else "prompt"
    if output is None:
        what, param = f"a prompt of {prompt} tokens", kind
    else:
        what = (f"a request of {prompt + output} tokens ({prompt} in the prompt, {output} "
                f"for {req.max_tokens_param})")
        param = req.max_tokens_param
    return ContextLengthExceeded(
        f"the input length exceeds the context length: {what} exceeds the available context "
        f"size (the context window is {window} tokens)", param=param, window=window,
        prompt_tokens=prompt, output_tokens=output, input_kind=kind)
