"""llama.cpp's own grammar engine as a judge: does a grammar take a text, token by token?"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import llama_cpp as ll

from edge_agent.engine.grammar_cache import ParsedGrammars
from edge_agent.engine.grammar_check import CheckedGrammar
from edge_agent.engine.runtime import LlamaModel


def grammar_sampler(model: LlamaModel, grammar: CheckedGrammar) -> Any:
    """A grammar sampler over the model's vocabulary (the caller frees it)."""
    return ParsedGrammars.parse(model.vocab, grammar)


def takes(model: LlamaModel, sampler: Any, text: str) -> bool:
    """Whether the grammar sampler (fresh, or reset) takes `text` whole: each of its tokens
    in turn (a one-candidate array, as the sampler checks a chosen token), then the end."""
    one = ll.llama_token_data(0, 1.0, 0.0)
    arr = ll.llama_token_data_array(data=ctypes.pointer(one), size=1, selected=-1,
                                    sorted=False)

    def allowed(token: int) -> bool:
        one.id, one.logit = token, 1.0  # type: ignore[assignment]
        arr.size, arr.selected = 1, -1
        ll.llama_sampler_apply(sampler, ctypes.pointer(arr))
        return bool(one.logit != -math.inf)

    for token in model.tokenize(text, add_special=False, parse_special=False):
        if not allowed(token):
            return False
        ll.llama_sampler_accept(sampler, token)
    return allowed(model.eos)
