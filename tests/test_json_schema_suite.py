"""The converter against the official JSON Schema Test Suite (tests/data/json-schema-test-suite).

For every schema of the suite's draft 2020-12 and draft 7 files that the converter accepts,
every instance the suite marks invalid must be refused by the grammar, judged by llama.cpp's
own grammar engine over the default model's vocabulary: a grammar that takes an invalid
instance breaks the promise that an accepted schema is enforced, and fails the test.

Each instance is written as the grammar writes JSON: compact (`,` and `:` with no space;
the grammar's optional space is then simply not taken), non-ASCII characters raw, and in
strings the escapes JSON requires (`\\"`, `\\\\`, control characters; DEL as `\\u007f`).
Valid instances are counted, not required: a grammar may leave out valid texts (a number
with an exponent where bounds apply, `1.0` for an integer, an extra tuple item).

Schemas whose `$ref`s reach outside the document (`refRemote.json`, a metaschema) are
refused by the converter with a 400, and counted as refused like any other.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp as ll
import pytest

from edge_agent.engine.constrained.grammar_check import CheckedGrammar, audit
from edge_agent.engine.constrained.json_grammar import convert
from edge_agent.engine.runtime.llama import LlamaModel
from edge_agent.errors import EdgeAgentError
from tests.support.grammar_engine import grammar_sampler, takes

SUITE = Path(__file__).parent / "data" / "json-schema-test-suite"
DRAFTS = ("draft2020-12", "draft7")


def canonical(instance: Any) -> str:
    """The instance as the grammar writes it (DEL only appears inside strings)."""
    return json.dumps(instance, ensure_ascii=False, separators=(",", ":")).replace(
        "\x7f", "\\u007f")


@pytest.fixture(scope="module")
def vocab_model(model_path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(model_path, n_gpu_layers=0)
    yield model
    model.close()


def _judge(model: LlamaModel, schema: Any) -> tuple[str | None, Any]:
    """(refusal reason or None, grammar sampler or None)."""
    try:
        grammar = convert(schema, param="schema")
    except EdgeAgentError as exc:
        return f"{exc.param}: {exc}", None
    audit(grammar)  # our own converter's text never fails the audit
    return None, grammar_sampler(model, CheckedGrammar(grammar))


def test_every_invalid_instance_of_an_accepted_schema_is_refused(
        vocab_model: LlamaModel) -> None:
    rows = []
    admitted: list[str] = []
    totals = [0, 0, 0, 0, 0, 0, 0]
    for draft in DRAFTS:
        for path in sorted((SUITE / draft).glob("*.json")):
            row = [0, 0, 0, 0, 0, 0, 0]  # schemas, accepted, invalid, refused, valid, taken
            for group in json.loads(path.read_text()):
                row[0] += 1
                reason, sampler = _judge(vocab_model, group["schema"])
                if sampler is None:
                    continue
                row[1] += 1
                try:
                    for case in group["tests"]:
                        text = canonical(case["data"])
                        ll.llama_sampler_reset(sampler)
                        took = takes(vocab_model, sampler, text)
                        if case["valid"]:
                            row[4] += 1
                            row[5] += took
                        else:
                            row[2] += 1
                            row[3] += not took
                            if took:
                                admitted.append(f"{draft}/{path.name}: {group['description']}"
                                                f" / {case['description']}: {text[:80]}")
                finally:
                    ll.llama_sampler_free(sampler)
            rows.append((f"{draft}/{path.stem}", row))
            totals = [t + r for t, r in zip(totals, row, strict=True)]
    _print(rows, totals)
    assert not admitted, "grammars took invalid instances:\n" + "\n".join(admitted)


def _print(rows: list[tuple[str, list[int]]], totals: list[int]) -> None:
    print(f"\n{'file':44} {'accepted':>10} {'invalid refused':>16} {'valid taken':>12}")
    for name, (n, ok, bad, refused, good, taken, _) in [*rows, ("total", totals)]:
        print(f"{name:44} {ok:>4}/{n:<5} {refused:>7}/{bad:<8} {taken:>5}/{good:<6}")
    n, ok = totals[0], totals[1]
    print(f"schemas accepted: {ok}/{n} ({100 * ok / max(n, 1):.0f}%)")


# The refusals, most frequent first: python -m tests.test_json_schema_suite [substring]
if __name__ == "__main__":
    import collections
    import re
    import sys

    reasons: collections.Counter[str] = collections.Counter()
    for draft in DRAFTS:
        for path in sorted((SUITE / draft).glob("*.json")):
            for group in json.loads(path.read_text()):
                try:
                    convert(group["schema"], param="schema")
                except EdgeAgentError as exc:
                    reasons[re.sub(r"\d+", "N", str(exc))[:110]] += 1
                    if len(sys.argv) > 1 and sys.argv[1] in str(exc):
                        print(path.name, json.dumps(group["schema"])[:300], "->", exc)
    for reason, n in reasons.most_common():
        print(f"{n:4} {reason}")
