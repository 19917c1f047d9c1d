"""The evaluation files a release is published with (`fleet release add|push
--eval-samples FILE.jsonl --eval-results FILE.json`), summarised into its signed
materials (`protocol.materials`): the files themselves are not uploaded anywhere, their
digests pin them, so whoever holds them can show that these are the ones the release was
judged by.

Samples: JSON Lines, one object per sample, each naming the task kinds it exercises in
`kind` (a string, or a list of them): `ollama` or `openai` (the dialect it is asked in),
`schema` (a JSON schema answer), `tools` (tool calls), `long_context`. Blank lines are
skipped; a line that is not such an object is refused, naming the line, since a summary
that counts what it cannot read would say more than the file does.

    {"kind": ["openai", "tools"], "messages": [...], "tools": [...]}
    {"kind": "ollama", "prompt": "..."}

Results: a table of metric → number (JSON, or TOML unless the name ends in .json) is
carried as it is when it is small (`materials.MAX_METRICS` numbers at the top level);
any other file is carried as its digest alone.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, TypeVar

import tomllib
from pydantic import BaseModel, ValidationError

from edge_agent.errors import InvalidRequest
from edge_agent.fleet.protocol.manifest import first_error
from edge_agent.fleet.protocol.materials import (
    EVAL_KINDS,
    MAX_METRICS,
    EvalResults,
    EvalSamples,
)

_Summary = TypeVar("_Summary", bound=BaseModel)


def samples_summary(data: bytes, *, source: str = "eval samples") -> EvalSamples:
    """Digest, count and kinds of a JSON Lines file of samples (module docstring)."""
    kinds: set[str] = set()
    count = 0
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except ValueError as exc:
            raise InvalidRequest(f"{source} line {number}: not JSON: {exc}") from None
        given = sample.get("kind") if isinstance(sample, dict) else None
        listed = [given] if isinstance(given, str) else given
        if not isinstance(listed, list) or not listed or \
                not all(isinstance(k, str) and k in EVAL_KINDS for k in listed):
            raise InvalidRequest(f"{source} line {number}: an object whose `kind` is one "
                                 f"or a list of {', '.join(EVAL_KINDS)}")
        kinds.update(listed)
        count += 1
    if count == 0:
        raise InvalidRequest(f"{source}: no sample in the file")
    return _checked(EvalSamples, {"sha256": hashlib.sha256(data).hexdigest(),
                                  "count": count, "kinds": sorted(kinds)}, source)


def results_summary(data: bytes, *, json_file: bool, source: str = "eval results"
                    ) -> EvalResults:
    """The results' digest, and their metrics when the file is a small table of numbers."""
    digest = hashlib.sha256(data).hexdigest()
    table: Any = None
    try:
        text = data.decode("utf-8")
        table = json.loads(text) if json_file else tomllib.loads(text)
    except ValueError:  # JSON, TOML and UTF-8 errors alike: carried as its digest
        pass
    if isinstance(table, dict) and 0 < len(table) <= MAX_METRICS and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in table.values()):
        try:
            return EvalResults(sha256=digest, metrics=table)
        except ValidationError:
            pass  # names that are not metric names: the digest says it all
    return _checked(EvalResults, {"sha256": digest}, source)


def _checked(model: type[_Summary], data: dict[str, Any], source: str) -> _Summary:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(f"{source}: {first_error(exc)}") from None
