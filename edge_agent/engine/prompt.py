"""From a dialect-free request to a model's prompt tokens, sampler settings and grammar.

The one place where a request becomes a prompt: template, tool instructions, special-token
parsing, the caller's own token ids, sampling defaults (llama.cpp's < the catalog entry's <
the client's) and the grammar of a schema or a tool call. It knows nothing of tenants,
quotas or the ledger (that is `gateway/`), and it never cuts a prompt to fit: it only says
how long the prompt is.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent.engine.constrained.grammar_cache import RequestGrammars
from edge_agent.engine.constrained.json_grammar import schema_to_grammar
from edge_agent.engine.constrained.tool_calls import (
    tool_call_schema,
    tool_instructions,
    with_tool_messages,
)
from edge_agent.engine.request import GenerationRequest, SamplingParams
from edge_agent.engine.scheduling.steppolicy import common_prefix
from edge_agent.engine.text.templates import Piece
from edge_agent.errors import ContextLengthExceeded, InvalidRequest

if TYPE_CHECKING:
    from edge_agent.engine.registry import LoadedModel


GRAMMARS = RequestGrammars()


class Tokenizer(Protocol):
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...


# A system part shorter than this is recomputed in a moment: not kept apart. A system
# message needs at least SYSTEM_MIN_CHARS characters to have that many tokens.
SYSTEM_MIN_TOKENS = 64
SYSTEM_MIN_CHARS = 128


def tool_mode(req: GenerationRequest) -> bool:
    """Whether the answer is read as tool calls (tools given and not turned off)."""
    return bool(req.tools) and req.tool_choice != "none"


def grammar_for(req: GenerationRequest) -> str | None:
    """The GBNF a request's answer must follow: a tool call's, a schema's, or none.
    Checking a new grammar takes a child process (0.1-0.3 s): call it off the event loop.
    Repeats of the same schema or tools come from `GRAMMARS`, converted once."""
    if tool_mode(req):
        return GRAMMARS.get(["tools", req.tools, req.tool_choice], lambda: schema_to_grammar(
            tool_call_schema(req.tools, req.tool_choice), param="tools"))
    if req.json_schema is None:
        return None
    schema = req.json_schema
    return GRAMMARS.get(["schema", schema], lambda: schema_to_grammar(
        schema, param=req.schema_param))


def sampling_for(req: GenerationRequest, model: LoadedModel, window: int) -> SamplingParams:
    """The catalog entry's defaults under the client's settings, bounded for llama.cpp."""
    defaults = {k: v for k, v in model.info.parameters.items()
                if k in SamplingParams.field_names()}
    sampling = SamplingParams(**{**defaults, **req.sampling})
    return bounded_sampling(sampling, model.n_vocab, window)


def stops_for(req: GenerationRequest, model: LoadedModel) -> list[str]:
    return [*model.info.parameters.get("stop", []), *req.stop]


def bounded_sampling(sampling: SamplingParams, n_vocab: int, window: int) -> SamplingParams:
    """Sampler settings as llama.cpp can take them: logit_bias ids in the vocabulary;
    top_k at most the vocabulary (beyond, it would wrap around in int32); repeat_last_n at
    most the window, and -1 the window (Ollama's "num_ctx"): llama.cpp allocates that many
    tokens per request (2^28 took 1 GB) and reads -1 as "off"."""
    check_token_ids([t for t, _ in sampling.logit_bias], n_vocab, "logit_bias")
    last_n = sampling.repeat_last_n
    return dataclasses.replace(
        sampling, top_k=min(sampling.top_k, n_vocab),
        repeat_last_n=window if last_n < 0 or last_n > window else last_n)


def prompt_tokens(req: GenerationRequest, model: LoadedModel) -> list[int]:
    """The prompt's tokens: the caller's own token ids (OpenAI's token prompt, Ollama's
    `context`), checked against the vocabulary before anything is queued, then the text,
    tokenized piece by piece (see `prompt_pieces`)."""
    tokens = list(req.context_tokens)
    if len(tokens) >= model.n_ctx:
        raise ContextLengthExceeded(
            f"{req.context_param} holds {len(tokens)} tokens; the context window is "
            f"{model.n_ctx} tokens", param=req.context_param)
    check_token_ids(tokens, model.n_vocab, req.context_param)
    tokens += tokenize_pieces(model, prompt_pieces(req, model), add_special=not tokens)
    if not tokens:
        raise InvalidRequest("the prompt is empty", param="prompt")
    return tokens


def prompt_pieces(req: GenerationRequest, model: LoadedModel) -> list[Piece]:
    """The prompt as (text, parse_special) pieces. A raw prompt (`raw`, OpenAI's
    completions, a model without a template) is the caller's own text: its special-token
    text is parsed, as llama.cpp's and Ollama's servers do. Through the template, only
    the template's markers are: what the client wrote is never parsed as control tokens
    (see `ChatTemplate.render_pieces`)."""
    if req.messages is None:
        prompt = req.prompt or ""
        if req.raw or model.template is None:
            return [(prompt, True)]
        messages: list[dict[str, Any]] = []
        if req.system:
            messages.append({"role": "system", "content": req.system})
        messages.append({"role": "user", "content": prompt})
    else:
        messages = req.messages
    if model.template is None:
        raise InvalidRequest(
            f"model '{model.info.name}' has no chat template; use a completion endpoint",
            param="messages")
    if tool_mode(req):
        messages = with_tool_messages(
            messages, tool_instructions(req.tools, req.tool_choice),
            keep_tool_role=model.template.knows_tool_role)
    else:
        messages = [m for m in messages]
    return model.template.render_pieces(messages, find_special=model.special_texts)


def system_tokens(req: GenerationRequest, model: LoadedModel, tokens: list[int]) -> int:
    """How many of the prompt's `tokens` are its system part: the leading system message
    (Ollama's `system`, a chat's first message, with a tool call's instructions) as the
    template renders it, up to where the rest of the prompt starts. The prompt cache keeps
    those cells apart (`GenerationSpec.system_tokens`). 0 where there is none, it is
    shorter than SYSTEM_MIN_TOKENS, or the template cannot render it alone."""
    if req.context_tokens or model.template is None or (req.messages is None and req.raw):
        return 0
    if req.messages is None:
        if not req.system or len(req.system) < SYSTEM_MIN_CHARS:
            return 0
        alone = dataclasses.replace(req, prompt="")
    else:
        first = req.messages[0] if req.messages else {}
        content = first.get("content")
        if first.get("role") != "system" or not isinstance(content, str) \
                or len(content) < SYSTEM_MIN_CHARS:
            return 0
        alone = dataclasses.replace(req, messages=[first])
    try:
        system = tokenize_pieces(model, prompt_pieces(alone, model), add_special=True)
    except Exception:  # a template that will not render a system message alone
        return 0
    n = common_prefix(system, tokens, len(tokens))
    return n if SYSTEM_MIN_TOKENS <= n < len(tokens) else 0


def tokenize_pieces(llama: Tokenizer, pieces: list[Piece], *, add_special: bool
                    ) -> list[int]:
    """The tokens of a prompt's pieces in order, each with its own `parse_special`; BOS (if
    the model wants one) only before the first. One piece: exactly the one-string path."""
    tokens: list[int] = []
    for i, (text, special) in enumerate(pieces):
        if text or i == 0:  # an empty prompt alone still gets its BOS, as always
            tokens += llama.tokenize(text, add_special=add_special, parse_special=special)
            add_special = False
    return tokens


def check_token_ids(tokens: list[int], n_vocab: int, param: str) -> None:
    """Token ids from a client must index the vocabulary: one outside it reaches llama.cpp
    as an out-of-bounds read, one past int32 cannot even be put in a batch."""
    if tokens and (min(tokens) < 0 or max(tokens) >= n_vocab):
        bad = next(t for t in tokens if not 0 <= t < n_vocab)
        raise InvalidRequest(f"{param} holds token id {bad}, outside this model's vocabulary "
                             f"(0 to {n_vocab - 1})", param=param)


def embedding_tokens(req_inputs: list[str | list[int]], model: LoadedModel, *, truncate: bool,
                     max_tokens: int) -> tuple[list[list[int]], int]:
    """Embedding inputs as tokens, each within the embedding context (cut when the request
    allows it), all together within `max_tokens`; and how many tokens were cut."""
    limit = model.embed_ctx
    inputs: list[list[int]] = []
    truncated = total = 0
    for i, item in enumerate(req_inputs):
        tokens = (model.tokenize(item, add_special=True, parse_special=False)
                  if isinstance(item, str) else list(item))
        if not tokens:
            raise InvalidRequest(f"input {i} is empty", param="input")
        if any(t < 0 or t >= model.n_vocab for t in tokens):
            raise InvalidRequest(f"input {i} has a token id outside the vocabulary",
                                 param="input")
        if len(tokens) > limit:
            if not truncate:
                raise ContextLengthExceeded(
                    f"input {i} is {len(tokens)} tokens; the embedding context is "
                    f"{limit} tokens", param="input")
            truncated += len(tokens) - limit
            tokens = tokens[:limit]
        total += len(tokens)
        if total > max_tokens:
            raise InvalidRequest(
                f"the inputs come to more than {max_tokens} tokens, the most one "
                "embedding request may carry; split them over several requests",
                param="input")
        inputs.append(tokens)
    return inputs, truncated
