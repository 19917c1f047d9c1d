"""Compiled grammars kept for the next request: a store's app sends the same schema (or the
same tools) with every request, and none of it should be compiled twice.

Two levels, each a bounded LRU:

- `RequestGrammars`: a request's grammar inputs (its JSON schema, or its tools and tool
  choice), as JSON text, to the checked grammar text. A hit skips the schema conversion
  (0.5 ms for a 5-field record, ~5 ms for six tools) and the audit; `grammar_check` is still
  asked, but its verdict is cached by the same text. Thread-safe: the gateway's threads call
  it. Only successes are kept; a refused schema is refused again the same way.
- `ParsedGrammars`: grammar text to a llama.cpp grammar sampler parsed once for one model's
  vocabulary; each request gets a clone (`llama_sampler_clone` copies the parsed rules and
  the start state: ~0.01 ms, where parsing a tool grammar takes milliseconds). Owned by one
  scheduler and used by its worker thread only.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llama_cpp as ll

from edge_agent.engine.constrained.grammar_check import CheckedGrammar
from edge_agent.errors import EdgeAgentError

REQUEST_GRAMMARS = 256  # distinct schemas / tool sets remembered (a digest and a grammar each)
PARSED_GRAMMARS = 32  # parsed grammars per loaded model


class RequestGrammars:
    """A request's grammar inputs to its checked grammar, keyed by their JSON text (in the
    order the client wrote it: property order is output order)."""

    def __init__(self, capacity: int = REQUEST_GRAMMARS) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, CheckedGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, inputs: Any, make: Callable[[], CheckedGrammar]) -> CheckedGrammar:
        """The grammar `make` returns for `inputs`, made only the first time."""
        key = _digest(inputs)
        if key is None:  # not JSON (never from the wire): not cached
            return make()
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return grammar
            self.misses += 1
        grammar = make()
        with self._lock:
            self._entries[key] = grammar
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._entries)


def _digest(inputs: Any) -> str | None:
    try:
        text = json.dumps(inputs, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


class ParsedGrammars:
    """llama.cpp grammar samplers of one model's vocabulary, parsed once per grammar text;
    `sampler` hands out clones, which the caller frees."""

    def __init__(self, vocab: ctypes.c_void_p, capacity: int = PARSED_GRAMMARS) -> None:
        self.vocab = vocab
        self.capacity = capacity
        self._parsed: OrderedDict[str, ctypes.c_void_p] = OrderedDict()
        self.parses = 0

    @staticmethod
    def parse(vocab: ctypes.c_void_p, grammar: CheckedGrammar) -> ctypes.c_void_p:
        g = ll.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not g:
            raise EdgeAgentError("llama.cpp refused a grammar its parser had accepted")
        return g  # type: ignore[no-any-return]

    def sampler(self, grammar: CheckedGrammar) -> ctypes.c_void_p:
        """A grammar sampler in its start state, the caller's to free."""
        proto = self._parsed.get(grammar)
        if proto is None:
            proto = self.parse(self.vocab, grammar)
            self.parses += 1
            self._parsed[grammar] = proto
            while len(self._parsed) > self.capacity:
                _, old = self._parsed.popitem(last=False)
                ll.llama_sampler_free(old)
        else:
            self._parsed.move_to_end(grammar)
        clone = ll.llama_sampler_clone(proto)
        if not clone:
            raise EdgeAgentError("llama.cpp could not copy a grammar")
        return clone  # type: ignore[no-any-return]

    def close(self) -> None:
        while self._parsed:
            _, proto = self._parsed.popitem()
            ll.llama_sampler_free(proto)
