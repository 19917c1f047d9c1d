"""llama.cpp's own grammar engine as a judge: does a grammar take a text, token by token?"""

from __future__ import annotations

import ctypes
import math
import random
from typing import Any

import llama_cpp as ll
import numpy as np

from edge_agent.engine.constrained.grammar_cache import ParsedGrammars
from edge_agent.engine.constrained.grammar_check import CheckedGrammar
from edge_agent.engine.runtime.llama import LlamaModel


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


_CLOSING = set(b'"]},')


def walk(model: LlamaModel, sampler: Any, rng: random.Random, max_tokens: int = 64,
         stop: float = 0.3) -> str | None:
    """A random text the grammar writes: at each step a token drawn among all those the
    grammar allows, the end taken with probability `stop` once allowed; None when the text
    grows past `max_tokens`. The grammar's own output, as the sampler would let it be."""
    n = model.n_vocab
    pristine = (ll.llama_token_data * n)(*[ll.llama_token_data(i, 0.0, 0.0) for i in range(n)])
    data = (ll.llama_token_data * n)()
    out: list[int] = []
    while len(out) < max_tokens:
        ctypes.memmove(data, pristine, ctypes.sizeof(data))
        arr = ll.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
        ll.llama_sampler_apply(sampler, ctypes.pointer(arr))
        logits = np.ctypeslib.as_array(data).view(np.float32).reshape(n, 3)[:, 1]
        allowed = np.flatnonzero(logits != -np.inf).tolist()
        if not allowed:
            raise AssertionError(f"the grammar allows no token after {out!r}")
        if model.eos in allowed and (len(allowed) == 1 or rng.random() < stop):
            return b"".join(model.piece(t) for t in out).decode("utf-8")
        choices = [t for t in allowed if t != model.eos]
        closing = [t for t in choices if set(model.piece(t)) & _CLOSING]
        # Half the time a token that closes something, or a string could run on for ever.
        choice = rng.choice(closing if closing and rng.random() < 0.5 else choices)
        ll.llama_sampler_accept(sampler, choice)
        out.append(choice)
    return None
