"""Structured coverage: how many real-world JSON schemas a server takes as `response_format`,
and how many of its answers then fit them, on a sample of JSONSchemaBench (250 schemas,
25 from each of its ten categories, shipped in `jsonschemabench/` beside this module with
the dataset's licence and source commit).

Each schema is sent once to each server, as its authors' harness asks: a system message
"You need to generate a JSON object that matches the schema below." and the schema as the
user message (compact JSON, cut at PROMPT_SCHEMA_CHARS with a note, so that a 190 KB schema
still fits the context: the grammar, built from the whole schema, does the enforcing),
zero-shot (their harness adds two worked examples per category, ~1,000 tokens more of
prompt per request), temperature 0, `repeat_penalty` 1, `max_tokens` 384, streamed (see
`ask`), and the whole schema as `response_format: {"type": "json_schema", …}`. Each
answer is one of:

- refused: a 4xx (the server says it cannot enforce the schema);
- valid: finished with `stop`, parses as JSON and validates against the schema (the
  validator its `$schema` names, Draft 2020-12 when it names none, formats checked, no
  remote `$ref` fetched);
- invalid: finished with `stop` and does not parse or does not validate: a schema was
  taken and not held to, the serious case;
- cut: finished with `length`, the answer unfinished at `max_tokens`;
- error: a 5xx, a timeout, a dropped connection, or any other finish.

Declared coverage is accepted (valid + invalid + cut) / N, empirical coverage valid / N
(the paper's two figures). Without a llama-server binary only edge-agent's columns are
printed. Never: a verdict of its own (the bounds are in `targets`).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import referencing
import referencing.exceptions

from edge_agent.bench.serving.peers import EdgeAgentPeer, HttpPeer, LlamaServerPeer
from edge_agent.bench.targets import report

Echo = Callable[[str], None]
SAMPLE = "jsonschemabench/sample.jsonl"
INSTRUCTION = "You need to generate a JSON object that matches the schema below."
PROMPT_SCHEMA_CHARS = 4000
MAX_TOKENS = 384
TIMEOUT_S = 180.0  # the dataset's own harness gives generation 60 s
OUTCOMES = ("refused", "valid", "invalid", "cut", "error")
SIDES = ("edge-agent", "llama-server")


@dataclass(frozen=True)
class Case:
    category: str
    file: str  # the dataset's path, data/<category>/<name>.json
    schema: dict[str, Any]


@dataclass(frozen=True)
class Sample:
    source: str
    commit: str
    cases: tuple[Case, ...]

    @property
    def categories(self) -> list[str]:
        return sorted({c.category for c in self.cases})

    def pick(self, per_category: int | None = None,
             categories: Sequence[str] = ()) -> Sample:
        """The first `per_category` of each category (a seeded sample in turn), of only
        `categories` when given."""
        seen: Counter[str] = Counter()
        kept = []
        for case in self.cases:
            if categories and case.category not in categories:
                continue
            seen[case.category] += 1
            if per_category is None or seen[case.category] <= per_category:
                kept.append(case)
        return Sample(self.source, self.commit, tuple(kept))


def load_sample() -> Sample:
    """The sample shipped with the bench: a header line (source, commit), then a case a
    line."""
    text = resources.files("edge_agent.bench.serving").joinpath(SAMPLE).read_text(encoding="utf-8")
    header, *rows = (json.loads(line) for line in text.splitlines() if line.strip())
    return Sample(header["source"], header["commit"],
                  tuple(Case(r["category"], r["file"], r["schema"]) for r in rows))


def messages(schema: dict[str, Any]) -> list[dict[str, str]]:
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > PROMPT_SCHEMA_CHARS:
        text = text[:PROMPT_SCHEMA_CHARS] + f" … (schema shortened: {len(text):,} characters)"
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}]


def request_body(model: str, schema: dict[str, Any]) -> dict[str, Any]:
    """What is sent for one schema (the same to every server)."""
    return {"model": model, "messages": messages(schema), "max_tokens": MAX_TOKENS,
            "temperature": 0, "repeat_penalty": 1.0, "stream": True,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema}}}


# The formats jsonschema checks with what is installed, and the two it checks only with an
# optional package (rfc3339-validator), which edge-agent's grammars claim to hold: RFC 3339.
FORMATS = jsonschema.FormatChecker()
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


@FORMATS.checks("time")
def _is_time(value: object) -> bool:
    return not isinstance(value, str) or re.fullmatch(_TIME, value) is not None


@FORMATS.checks("date-time")
def _is_date_time(value: object) -> bool:
    return not isinstance(value, str) or re.fullmatch(f"{_DATE}[Tt ]{_TIME}", value) is not None


@dataclass(frozen=True)
class Verdict:
    outcome: str  # one of OUTCOMES
    detail: str = ""  # why, for every outcome but valid: the server's error, the mismatch

    @property
    def accepted(self) -> bool:
        return self.outcome in ("valid", "invalid", "cut")


def mismatch(instance: Any, schema: dict[str, Any]) -> str | None:
    """Why `instance` does not fit `schema`, or None when it does: the validator of the
    draft its `$schema` names, formats checked (as the dataset's authors check them). An
    empty registry: a remote `$ref` is never fetched, and one the answer reaches is a
    mismatch."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator = cls(schema, format_checker=FORMATS,
                        registry=referencing.Registry())
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    except referencing.exceptions.Unresolvable as e:
        return f"unresolvable $ref: {e}"
    except Exception as e:  # a schema its validator cannot run (the authors count it so)
        return f"validator failed: {type(e).__name__}: {e}"
    return None if error is None else f"{error.json_path}: {error.message}"


def classify(status: int | None, body: Any, schema: dict[str, Any]) -> Verdict:
    """One answer's outcome: `status` None for no HTTP answer (a timeout, a dropped
    connection), `body` the decoded JSON (or the text, or the exception)."""
    if status is None:
        return Verdict("error", str(body)[:300])
    if httpx.codes.is_client_error(status):
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        return Verdict("refused", str(message or body)[:300])
    if not httpx.codes.is_success(status):
        return Verdict("error", f"HTTP {status}: {str(body)[:300]}")
    try:
        choice = body["choices"][0]
        finish, content = choice["finish_reason"], choice["message"].get("content") or ""
    except (TypeError, KeyError, IndexError, AttributeError):
        return Verdict("error", f"not a chat completion: {str(body)[:300]}")
    if finish == "length":
        return Verdict("cut")
    if finish != "stop":
        return Verdict("error", f"finish_reason {finish!r}")
    try:
        instance = json.loads(content)
    except ValueError as e:
        return Verdict("invalid", f"not JSON ({e}): {content[:200]!r}")
    why = mismatch(instance, schema)
    return Verdict("valid") if why is None else Verdict("invalid", why[:300])


def ask(peer: HttpPeer, case: Case, timeout: float = TIMEOUT_S) -> Verdict:
    """One schema, streamed: an answer given up on at `timeout` closes its stream, which
    frees the server's slot (a non-streamed request whose client left runs to its end,
    and the answers queued behind it time out in turn)."""
    deadline = time.monotonic() + timeout
    text: list[str] = []
    finish = None
    try:
        with peer.client.stream("POST", "/v1/chat/completions", timeout=timeout,
                                json=request_body(peer.model, case.schema)) as r:
            if not r.is_success:
                r.read()
                try:
                    body: Any = r.json()
                except ValueError:
                    body = r.text
                return classify(r.status_code, body, case.schema)
            for line in r.iter_lines():
                if time.monotonic() > deadline:
                    return classify(None, f"no answer within {timeout:.0f} s", case.schema)
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):  # failed after the stream began
                    return classify(500, chunk, case.schema)
                for choice in chunk.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, ValueError) as e:
        return classify(None, f"{type(e).__name__}: {e}", case.schema)
    return classify(200, {"choices": [{"finish_reason": finish,
                                       "message": {"content": "".join(text)}}]}, case.schema)


@dataclass
class Tally:
    """The outcomes of one server over some cases."""

    counts: Counter[str]

    @property
    def n(self) -> int:
        return sum(self.counts.values())

    @property
    def declared(self) -> float:
        accepted = sum(self.counts[o] for o in ("valid", "invalid", "cut"))
        return accepted / self.n if self.n else float("nan")

    @property
    def empirical(self) -> float:
        return self.counts["valid"] / self.n if self.n else float("nan")

    def figures(self) -> dict[str, Any]:
        return {"n": self.n, **{o: self.counts[o] for o in OUTCOMES},
                "declared_coverage": self.declared, "empirical_coverage": self.empirical}


def tally(verdicts: Sequence[Verdict]) -> Tally:
    counts = Counter(dict.fromkeys(OUTCOMES, 0))
    counts.update(v.outcome for v in verdicts)
    return Tally(counts)


def run_side(peer: HttpPeer, cases: Sequence[Case], parallel: int, echo: Echo,
             timeout: float = TIMEOUT_S, every: int = 50) -> tuple[list[Verdict], float]:
    """Every case once against `peer`, `parallel` at a time: the verdicts in the cases'
    order and the wall time. A line every `every` answers says how far it got (the whole
    sample takes many minutes on a small box)."""
    start = time.perf_counter()
    verdicts: dict[int, Verdict] = {}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(ask, peer, case, timeout): i for i, case in enumerate(cases)}
        for future in as_completed(futures):
            verdicts[futures[future]] = future.result()
            if len(verdicts) % every == 0 and len(verdicts) != len(cases):
                echo(f"  {peer.name}: {len(verdicts)} of {len(cases)} schemas, "
                     f"{time.perf_counter() - start:.0f} s")
    return [verdicts[i] for i in range(len(cases))], time.perf_counter() - start


def summarise(sample: Sample, verdicts: dict[str, list[Verdict]]) -> dict[str, Any]:
    """Per side: per category and overall tallies."""
    out: dict[str, Any] = {}
    for side, got in verdicts.items():
        by_category = {c: tally([v for case, v in zip(sample.cases, got, strict=True)
                                 if case.category == c]) for c in sample.categories}
        out[side] = {"categories": {c: t.figures() for c, t in by_category.items()},
                     "overall": tally(got).figures()}
    return out


def reasons(verdicts: Sequence[Verdict], outcome: str = "refused", top: int = 8
            ) -> list[tuple[str, int]]:
    """The most frequent reasons for `outcome`, numbers and dicts folded (`'maxLength'
    4096 exceeds…` and `'maxLength' 1024 exceeds…` are one reason): where coverage is lost."""
    folded = Counter(re.sub(r"\d+", "N", re.sub(r"\{.*\}", "{…}", v.detail))
                     for v in verdicts if v.outcome == outcome)
    return folded.most_common(top)


def _cell(figures: dict[str, Any]) -> str:
    return (f"{figures['declared_coverage']:>8.2f} {figures['empirical_coverage']:>9.2f} "
            f"{figures['invalid']:>7} {figures['cut']:>4} {figures['error']:>4}")


def print_table(echo: Echo, sample: Sample, summary: dict[str, Any]) -> None:
    sides = [s for s in SIDES if s in summary]
    head = f"{'declared':>8} {'empirical':>9} {'invalid':>7} {'cut':>4} {'err':>4}"
    echo(f"  {'':16} {'':>4}  " + "  ".join(f"{s:<36}" for s in sides).rstrip())
    echo(f"  {'category':<16} {'n':>4}  " + "  ".join(head for _ in sides))
    for c in [*sample.categories, "overall"]:
        cells = [summary[s]["overall"] if c == "overall" else summary[s]["categories"][c]
                 for s in sides]
        echo(f"  {c:<16} {cells[0]['n']:>4}  " + "  ".join(_cell(f) for f in cells))


@contextmanager
def _server(make: Callable[[], HttpPeer]) -> Iterator[HttpPeer]:
    peer = make()
    try:
        yield peer
    finally:
        peer.close()


def bench_schema_coverage(state_dir: Path, model: str, *, threads: int, context: int,
                          echo: Echo, model_path: Path | None = None,
                          llama_server: Path | None = None, per_category: int | None = None,
                          categories: Sequence[str] = (), parallel: int = 4,
                          timeout: float | Callable[[HttpPeer], float] = TIMEOUT_S
                          ) -> dict[str, Any]:
    """The sample (or its first `per_category` of each of `categories`) against
    edge-agent, then against llama-server when its binary and the model's file are given;
    each server alone on the machine, `parallel` requests at a time on `parallel` slots.
    `timeout`: each answer's bound in seconds, or a function that works it out from each
    server once it runs (the tests size it from the speed they measure on it, which a
    loaded machine divides by tens)."""
    sample = load_sample().pick(per_category, categories)
    makers: dict[str, Callable[[], HttpPeer]] = {"edge-agent": lambda: EdgeAgentPeer(
        state_dir, model, threads=threads, context=context, parallel=parallel)}
    if llama_server is not None and model_path is not None:
        makers["llama-server"] = lambda: LlamaServerPeer(
            llama_server, model_path, model, threads=threads, context=context,
            parallel=parallel)
    verdicts: dict[str, list[Verdict]] = {}
    wall: dict[str, float] = {}
    for side, make in makers.items():
        with _server(make) as peer:
            per_answer = timeout(peer) if callable(timeout) else timeout
            verdicts[side], wall[side] = run_side(peer, sample.cases, parallel, echo,
                                                  per_answer)
    summary = summarise(sample, verdicts)
    commit = sample.commit[:7]
    echo(f"structured coverage: {len(sample.cases)} JSONSchemaBench schemas "
         f"({sample.source.removeprefix('https://github.com/')}@{commit}), response_format "
         f"json_schema, max_tokens {MAX_TOKENS}, temperature 0; declared = accepted / n, "
         f"empirical = valid / n")
    print_table(echo, sample, summary)
    echo("  " + "; ".join(f"{side}: {wall[side]:.0f} s ({parallel} at a time)"
                          for side in verdicts))
    for side, got in verdicts.items():
        for outcome in ("refused", "invalid", "error"):
            common = reasons(got, outcome)
            if common:
                echo(f"  {side}, {outcome}: " + "; ".join(f"{n}x {why[:90]}"
                                                         for why, n in common))
    edge = summary["edge-agent"]["overall"]
    out: dict[str, Any] = {
        "source": sample.source, "commit": sample.commit, "schemas": len(sample.cases),
        "max_tokens": MAX_TOKENS, "parallel": parallel, "wall_s": wall, **summary,
        "edge_invalid": edge["invalid"], "declared_coverage": edge["declared_coverage"],
        "empirical_coverage": edge["empirical_coverage"],
        "refusal_reasons": {side: reasons(got) for side, got in verdicts.items()},
        "cases": [{"category": case.category, "file": case.file,
                   **{side: {"outcome": got[i].outcome, "detail": got[i].detail}
                      for side, got in verdicts.items()}}
                  for i, case in enumerate(sample.cases)]}
    report(echo, "structured_coverage.edge_invalid", edge["invalid"], n=edge["n"])
    report(echo, "structured_coverage.declared_coverage", edge["declared_coverage"])
    report(echo, "structured_coverage.empirical_coverage", edge["empirical_coverage"])
    if "llama-server" in summary:
        theirs = summary["llama-server"]["categories"]
        behind = [c for c, f in summary["edge-agent"]["categories"].items()
                  if f["empirical_coverage"] < theirs[c]["empirical_coverage"]]
        out["categories_below_llama_server"] = len(behind)
        out["behind_llama_server"] = behind
        report(echo, "structured_coverage.categories_below_llama_server", len(behind),
               categories=len(sample.categories))
    return out
