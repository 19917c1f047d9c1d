"""The health gate a release must pass on this box before it counts as active.

The gate spec comes with the signed release manifest (`manifest["gate"]`):

    {"prompts": [{"id": "capital",
                  "messages": [{"role": "user", "content": "Capital of France?"}],
                  "max_tokens": 16,
                  "expect": {"contains": ["Paris"], "not_contains": ["Berlin"],
                             "max_output_tokens": 16}},
                 {"id": "json", "prompt": "A user record:", "max_tokens": 64,
                  "expect": {"json_schema": {"type": "object", ...}}},
                 {"id": "count", "prompt": "1, 2, 3,", "raw": true, "max_tokens": 8,
                  "expect": {"contains": ["4"]}},
                 {"id": "greedy", "messages": [{"role": "user", "content":
                  "Continue: 1, 2, 3,"}], "max_tokens": 8,
                  "expect": {"exact": "4, 5, 6, 7,"}}],
     "tokens_per_s_floor": 0.8, "ttft_ms_max": 1500,
     "memory_headroom_bytes": 268435456, "soak": {"requests": 20, "within_s": 600}}

Every golden prompt runs greedily (temperature 0, seed 0) as a real request on the real
engine (`Probe`, the app's adapter over the request path), so it meets the same template,
limits and scheduler as a client's — a `prompt` too goes through the model's chat template
when it has one, unless it says `"raw": true` (Ollama's raw generate: a continuation of the
text as it is, what a base model is good for); a base model's chat answers hold to their
length, not to what they say. A prompt with a
`json_schema` is asked with that schema as its response format and its answer validated
against it.

This module holds the spec's parsing, the pure checks (each a `Check` with its figure and
limit) and `run_prompts`; it never switches a pointer, loads a model or reads the ledger
(the rollout runner does, and calls the checks with what it measured). It must never
import the request path's service (it imports the registry): the probe is injected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from edge_agent.engine.request import GenerationRequest

DEFAULT_FLOOR = 0.8  # the new version's tokens/s at least 0.8x the old one's, here
DEFAULT_MAX_TOKENS = 32
DEFAULT_SOAK_S = 600.0
MAX_PROMPTS = 32
DETAIL_CHARS = 200  # an answer quoted in a failed check, cut to this
GATE_DIALECT = "gate"  # how the gate's own requests are labelled (metrics, logs)


class ProbeAnswer(Protocol):
    """One golden prompt's answer as the probe reports it."""

    @property
    def text(self) -> str: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def ttft_ms(self) -> float: ...

    @property
    def eval_ms(self) -> float: ...  # decoding time after the first token

    @property
    def digest(self) -> str: ...  # the version that answered


class Probe(Protocol):
    """Runs one request on the name's active version (`gateway.probe.ServiceProbe`)."""

    async def __call__(self, request: GenerationRequest) -> ProbeAnswer: ...


@dataclass(frozen=True)
class Expect:
    contains: tuple[str, ...] = ()
    not_contains: tuple[str, ...] = ()
    exact: str | None = None
    json_schema: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    ignore_case: bool = False


@dataclass(frozen=True)
class GoldenPrompt:
    id: str
    messages: list[dict[str, Any]] | None
    prompt: str | None
    max_tokens: int
    expect: Expect
    raw: bool = False  # the prompt as it is, no template

    def request(self, model: str) -> GenerationRequest:
        """Greedy, so `exact` means something and two versions are compared fairly."""
        return GenerationRequest(
            model=model, messages=self.messages, prompt=self.prompt, raw=self.raw,
            sampling={"temperature": 0.0, "seed": 0}, max_tokens=self.max_tokens,
            json_schema=self.expect.json_schema)


@dataclass(frozen=True)
class GateSpec:
    prompts: tuple[GoldenPrompt, ...] = ()
    tokens_per_s_floor: float | None = None  # relative to the previous version
    ttft_ms_max: float | None = None
    memory_headroom_bytes: int | None = None
    soak_requests: int = 0
    soak_within_s: float = 0.0

    @property
    def needs_baseline(self) -> bool:
        return bool(self.prompts) and self.tokens_per_s_floor is not None


@dataclass(frozen=True)
class Check:
    """One check's verdict with its figure: what was measured against what was asked."""

    name: str
    passed: bool
    figure: Any = None
    limit: Any = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GateReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def reason(self) -> str | None:
        """The first failed check, named with its figure and limit."""
        for c in self.checks:
            if not c.passed:
                limit = f" (limit {c.limit})" if c.limit is not None else ""
                return f"gate check {c.name} failed: {c.figure}{limit}"
        return None

    def as_list(self) -> list[dict[str, Any]]:
        return [c.as_dict() for c in self.checks]


# -- the spec ---------------------------------------------------------------------------

def parse_spec(raw: Any) -> GateSpec:
    """A manifest's gate, checked; ValueError naming what is wrong. None or {}: no checks
    but the served digest (and the release still needs to load)."""
    if raw is None:
        return GateSpec()
    if not isinstance(raw, Mapping):
        raise ValueError("gate: not an object")
    known = {"prompts", "tokens_per_s_floor", "ttft_ms_max", "memory_headroom_bytes", "soak"}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"gate: unknown field(s) {sorted(unknown)}")
    prompts_raw = raw.get("prompts") or []
    if not isinstance(prompts_raw, list) or len(prompts_raw) > MAX_PROMPTS:
        raise ValueError(f"gate.prompts: a list of at most {MAX_PROMPTS} prompts")
    prompts = tuple(_prompt(p, i) for i, p in enumerate(prompts_raw))
    if len({p.id for p in prompts}) != len(prompts):
        raise ValueError("gate.prompts: ids must be unique")
    floor = raw.get("tokens_per_s_floor", DEFAULT_FLOOR if prompts else None)
    soak = raw.get("soak") or {}
    if not isinstance(soak, Mapping) or set(soak) - {"requests", "within_s"}:
        raise ValueError('gate.soak: {"requests": N, "within_s": T}')
    return GateSpec(
        prompts=prompts,
        tokens_per_s_floor=_number(floor, "tokens_per_s_floor", positive=True),
        ttft_ms_max=_number(raw.get("ttft_ms_max"), "ttft_ms_max", positive=True),
        memory_headroom_bytes=_int(raw.get("memory_headroom_bytes"),
                                   "memory_headroom_bytes"),
        soak_requests=_int(soak.get("requests"), "soak.requests") or 0,
        soak_within_s=_number(soak.get("within_s"), "soak.within_s", positive=True)
        or (DEFAULT_SOAK_S if soak.get("requests") else 0.0))


def _prompt(raw: Any, index: int) -> GoldenPrompt:
    where = f"gate.prompts[{index}]"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: not an object")
    unknown = set(raw) - {"id", "messages", "prompt", "raw", "max_tokens", "expect"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    pid = raw.get("id", f"p{index}")
    if not isinstance(pid, str) or not pid or len(pid) > 64:
        raise ValueError(f"{where}.id: a string of 1-64 characters")
    messages, prompt = raw.get("messages"), raw.get("prompt")
    if (messages is None) == (prompt is None):
        raise ValueError(f"{where}: exactly one of messages and prompt")
    if messages is not None and not (
            isinstance(messages, list) and messages and all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
        raise ValueError(f"{where}.messages: a list of {{role, content}} objects")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}.prompt: a string")
    as_is = raw.get("raw", False)
    if not isinstance(as_is, bool) or (as_is and prompt is None):
        raise ValueError(f"{where}.raw: true or false, with a prompt (not messages)")
    max_tokens = _int(raw.get("max_tokens", DEFAULT_MAX_TOKENS), f"{where}.max_tokens")
    if not max_tokens:
        raise ValueError(f"{where}.max_tokens: at least 1")
    return GoldenPrompt(pid, [dict(m) for m in messages] if messages else None, prompt,
                        max_tokens, _expect(raw.get("expect") or {}, where), as_is)


def _expect(raw: Any, where: str) -> Expect:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}.expect: not an object")
    known = {"contains", "not_contains", "exact", "json_schema", "max_output_tokens",
             "ignore_case"}
    if set(raw) - known:
        raise ValueError(f"{where}.expect: unknown field(s) {sorted(set(raw) - known)}")
    lists = {}
    for key in ("contains", "not_contains"):
        value = raw.get(key, [])
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{where}.expect.{key}: a string or a list of strings")
        lists[key] = tuple(value)
    exact = raw.get("exact")
    if exact is not None and not isinstance(exact, str):
        raise ValueError(f"{where}.expect.exact: a string")
    schema = raw.get("json_schema")
    if schema is not None:
        if not isinstance(schema, Mapping):
            raise ValueError(f"{where}.expect.json_schema: a JSON schema object")
        _validator(dict(schema))  # a schema that is itself invalid is the release's fault
    ignore_case = raw.get("ignore_case", False)
    if not isinstance(ignore_case, bool):
        raise ValueError(f"{where}.expect.ignore_case: true or false")
    return Expect(lists["contains"], lists["not_contains"], exact,
                  dict(schema) if schema is not None else None,
                  _int(raw.get("max_output_tokens"), f"{where}.expect.max_output_tokens"),
                  ignore_case)


def _number(value: Any, name: str, *, positive: bool = False) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not _finite(value) or (positive and value <= 0):
        raise ValueError(f"gate.{name}: a {'positive ' if positive else ''}number")
    return float(value)


def _finite(value: int | float) -> bool:
    """A JSON integer past the float range is not a number here: `math.isfinite` would
    raise OverflowError on it, which is not the ValueError a bad spec is refused with."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: a whole number, 0 or more")
    return value


def _validator(schema: dict[str, Any]) -> Any:
    import jsonschema  # only releases with a schema check need it

    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"json_schema is not a valid schema: {exc.message}") from None
    return cls(schema)


# -- the pure checks ----------------------------------------------------------------------

def _quote(text: str) -> str:
    return json.dumps(text[:DETAIL_CHARS], ensure_ascii=False)


def check_answer(prompt: GoldenPrompt, text: str, completion_tokens: int) -> list[Check]:
    """The expectations of one golden prompt against its answer."""
    e, checks = prompt.expect, []
    hay = text.lower() if e.ignore_case else text
    name = f"prompt:{prompt.id}"
    for needle in e.contains:
        found = (needle.lower() if e.ignore_case else needle) in hay
        checks.append(Check(f"{name}:contains", found, "found" if found else "missing",
                            needle, "" if found else f"answer {_quote(text)}"))
    for needle in e.not_contains:
        found = (needle.lower() if e.ignore_case else needle) in hay
        checks.append(Check(f"{name}:not_contains", not found,
                            "found" if found else "absent", needle,
                            f"answer {_quote(text)}" if found else ""))
    if e.exact is not None:
        same = text == e.exact
        checks.append(Check(f"{name}:exact", same, "equal" if same else "different",
                            None, "" if same else f"expected {_quote(e.exact)}, "
                                                  f"got {_quote(text)}"))
    if e.json_schema is not None:
        checks.append(check_schema(name, e.json_schema, text))
    if e.max_output_tokens is not None:
        checks.append(Check(f"{name}:max_output_tokens", completion_tokens <= e.max_output_tokens,
                            completion_tokens, e.max_output_tokens))
    return checks


def check_schema(name: str, schema: dict[str, Any], text: str) -> Check:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return Check(f"{name}:json_schema", False, "not JSON", None,
                     f"{exc.msg} at {exc.pos}; answer {_quote(text)}")
    errors = sorted(_validator(schema).iter_errors(value), key=lambda err: list(err.path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.path) or "(root)"
        return Check(f"{name}:json_schema", False, f"{len(errors)} error(s)", None,
                     f"{where}: {first.message[:DETAIL_CHARS]}")
    return Check(f"{name}:json_schema", True, "valid")


def tokens_per_s(answers: Sequence[ProbeAnswer]) -> float | None:
    """Decoding speed over a set of answers: tokens after the first per second of
    decoding (None when nothing was decoded past a first token)."""
    tokens = sum(max(0, a.completion_tokens - 1) for a in answers)
    seconds = sum(a.eval_ms for a in answers) / 1000
    return tokens / seconds if tokens and seconds > 0 else None


def check_speed(new: float | None, old: float | None, floor: float) -> Check:
    """The new version's tokens/s at least `floor` x the previous version's, both
    measured here on the same prompts."""
    if new is None or old is None:
        return Check("tokens_per_s", True, None, floor,
                     "not measured (no decoded tokens, or no previous version)")
    ratio = new / old
    return Check("tokens_per_s", ratio >= floor, round(ratio, 3), floor,
                 f"{new:.1f} tokens/s vs {old:.1f} before")


def check_ttft(answers: Sequence[ProbeAnswer], ceiling_ms: float) -> Check:
    worst = max((a.ttft_ms for a in answers), default=0.0)
    return Check("ttft_ms", worst <= ceiling_ms, round(worst, 1), ceiling_ms,
                 "slowest first token of the golden prompts")


def check_memory(available: int, need: int) -> Check:
    return Check("memory_headroom", available >= need, available, need,
                 "bytes available after the load")


def check_template(previous: str | None, new: str | None) -> Check:
    """The new version answers chats where the previous one did: a release with no chat
    template (none in its GGUF, none in its manifest, as a base model published without
    `--template`) replacing a version that had one would have every chat refused."""
    kept = new is not None or previous is None
    return Check("chat_template", kept, "present" if new is not None else "none",
                 "present" if previous is not None else None,
                 "" if kept else "the previous version serves chats with a template; the "
                 "release brings none (fleet release add --template)")


def check_served(answers: Sequence[ProbeAnswer], digest: str) -> Check:
    """Every golden prompt was answered by the new version (not by the old one)."""
    others = sorted({a.digest[:12] for a in answers if a.digest != digest})
    return Check("served_digest", not others, others[0] if others else digest[:12],
                 digest[:12], "answered by another version" if others else "")


def check_soak(errors: int, seen: int, wanted: int, within_s: float) -> Check:
    return Check("soak", errors == 0, errors, 0,
                 f"{seen} of the first {wanted} real requests seen within {within_s:g} s "
                 f"had {errors} server error(s)")


# -- running the prompts --------------------------------------------------------------------

async def run_prompts(spec: GateSpec, model: str, probe: Probe
                      ) -> tuple[list[ProbeAnswer], list[Check]]:
    """Each golden prompt once, in order; a prompt the engine refuses or fails is a
    failed check naming the error, not an exception."""
    answers: list[ProbeAnswer] = []
    checks: list[Check] = []
    for prompt in spec.prompts:
        try:
            answer = await probe(prompt.request(model))
        except Exception as exc:  # the gate's verdict, not the runner's crash
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            checks.append(Check(f"prompt:{prompt.id}:answered", False, type(exc).__name__,
                                None, message[:DETAIL_CHARS]))
            continue
        answers.append(answer)
        checks.extend(check_answer(prompt, answer.text, answer.completion_tokens))
    return answers, checks
