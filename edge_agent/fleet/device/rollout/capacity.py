"""A capacity release on this box: runtime settings (`parallel`, `context_length`,
`threads`, `prompt_lookup`, a model's `draft_model` and `draft_tokens`) shipped like a model,
through the same rollout and the same gate.

`fleet rollout start NAME@VERSION --config parallel=8,context_length=2048` names the
release whose golden set gates the change; the box must serve that very version (else the
rollout ends REJECTED, `not_serving`, before anything changes). Then, in its activation
(`capacity_release.CapacityRelease`):

    ACTIVATING  the golden set replayed on the serving runtime: the box's own baseline
                (each prompt's answer, tokens/s, first-token time); then the staged
                runtime: the name drained (new requests wait, running ones finish), its
                model unloaded, the new settings copied into the live settings, the same
                version loaded again with them (a load that fails rolls back at once)
    GATING      the same golden set on the staged runtime, and once more all at once (the
                concurrent burst); each prompt's checks as for a model release, its answer
                against the baseline's (`prompt:ID:baseline`: same, changed, or regressed —
                its checks passed before and fail now), tokens/s and the slowest first
                token against the baseline's (held to the gate's `tokens_per_s_floor` and
                its inverse), the gate's TTFT ceiling, memory headroom and soak
    ACTIVE      the keys written to the config overlay (`link.overlay`): they persist over
                a restart as a `config.patch` does
    ROLLED_BACK the previous settings copied back and the model loaded with them again;
                the overlay never held the new ones

A capacity change is written to the overlay only once its gate passed, and a row a
restart finds ACTIVATING or GATING is converged to ROLLED_BACK ("interrupted during
gating") with the overlay's keys put back as they were before it and the model loaded
again with the previous settings if the start took the new ones (a kill -9 between the
overlay's write and ACTIVE's commit). An operator's `rollout.rollback` of an ACTIVE one
does the same (`CapacityRelease.restore`). `runtime.*` keys are the box's:
other models take them at their next load (only the release's name is gated).

This module holds the keys, the settings' effective values, the swap of a name's runtime
and the comparison checks; it never imports the registry (`ModelOps` is the way).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from edge_agent import __version__
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.errors import InvalidRequest
from edge_agent.fleet.device.link.birth import llama_cpp_version
from edge_agent.fleet.device.link.overlay import (
    capacity_overlay_key,
    patched,
)
from edge_agent.fleet.device.rollout import health_gate
from edge_agent.fleet.device.rollout.health_gate import (
    DETAIL_CHARS,
    Check,
    GateSpec,
    Probe,
    ProbeAnswer,
)
from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.ledger.evidence import record_evidence
from edge_agent.names import ModelName

NOT_SERVING = "not_serving"  # the release named is not the version this box serves


def overlay_changes(name: str, change: Mapping[str, Any]) -> dict[str, Any]:
    """A rollout's `config` as overlay keys (`runtime.parallel`, `models.NAME.draft_model`)."""
    return {capacity_overlay_key(name, key): value for key, value in change.items()}


def staged_settings(settings: Settings, name: str, change: Mapping[str, Any]) -> Settings:
    """The settings with the change applied, validated by the settings' own bounds
    (InvalidRequest naming the key and the bound it breaks)."""
    try:
        return patched(settings, overlay_changes(name, change), capacity=True, texts=True)
    except CommandRefused as exc:
        raise InvalidRequest(exc.message) from None


def effective(settings: Settings, name: str) -> dict[str, Any]:
    """What the name runs with under `settings`, for each capacity key: its own table's
    value, else the runtime's."""
    rt = settings.runtime
    own = settings.model_override(name)
    return {"parallel": own.parallel or rt.parallel,
            "context_length": own.context_length or rt.context_length,
            "threads": own.threads or rt.threads,
            "prompt_lookup": rt.prompt_lookup if own.prompt_lookup is None
            else own.prompt_lookup,
            "kv_cache_type": own.kv_cache_type or rt.kv_cache_type,
            "draft_model": own.draft_model, "draft_tokens": own.draft_tokens}


def raw_values(settings: Settings, keys: Mapping[str, Any]) -> dict[str, Any]:
    """What `settings` holds for overlay `keys` itself (not what the name ends up with):
    `runtime.parallel` → the runtime's, `models.N.draft_model` → N's own table's or None."""
    out = {}
    for key in keys:
        head, _, rest = key.partition(".")
        if head == "runtime":
            out[key] = getattr(settings.runtime, rest)
        else:
            name, _, leaf = rest.rpartition(".")
            out[key] = getattr(settings.model_override(name), leaf)
    return out


def with_values(settings: Settings, values: Mapping[str, Any]) -> Settings:
    """`settings` with overlay keys set back to `values` (`raw_values` of an earlier time)."""
    return patched(settings, values, capacity=True, texts=True) if values else settings


async def swap_runtime(ops: ModelOps, name: str, digest: str,
                       wait_idle: Callable[[str], Awaitable[None]],
                       change: Callable[[], object]) -> None:
    """The name's model loaded again under other settings: drained (new requests wait for
    the swap, running ones end on the old runtime), unloaded, `change()` applied, loaded
    by digest (the drain refuses requests for the name), then admitted again."""
    ops.drain(name, True)
    try:
        await wait_idle(name)
        await ops.unload(name)
        change()
        await ops.load(name, digest=digest)
    finally:
        ops.drain(name, False)


# -- the replay and its comparison ----------------------------------------------------------

@dataclass(frozen=True)
class Replay:
    """One pass of the golden set: each prompt's answer or its error, and its checks."""

    answers: dict[str, ProbeAnswer]
    errors: dict[str, str]
    checks: list[Check]
    prefix: str = "prompt"  # "burst": the prompts sent all at once

    @property
    def tokens_per_s(self) -> float | None:
        return health_gate.tokens_per_s(list(self.answers.values()))

    @property
    def worst_ttft_ms(self) -> float | None:
        return max((a.ttft_ms for a in self.answers.values()), default=None)

    def passed(self, prompt_id: str) -> bool:
        prefix = f"{self.prefix}:{prompt_id}:"
        return prompt_id in self.answers and all(
            c.passed for c in self.checks if c.name.startswith(prefix))


async def replay(spec: GateSpec, model: str, probe: Probe, *, burst: bool = False
                 ) -> Replay:
    """Each golden prompt once: in order, or all at once (`burst`, the checks then named
    `burst:ID:…`); an error is a failed `…:answered` check, never an exception."""
    prefix = "burst" if burst else "prompt"

    async def one(prompt: health_gate.GoldenPrompt) -> ProbeAnswer | Exception:
        try:
            return await probe(prompt.request(model))
        except Exception as exc:  # the gate's verdict, not the runner's crash
            return exc

    if burst:
        results = await asyncio.gather(*(one(p) for p in spec.prompts))
    else:
        results = [await one(p) for p in spec.prompts]
    answers: dict[str, ProbeAnswer] = {}
    errors: dict[str, str] = {}
    checks: list[Check] = []
    for prompt, result in zip(spec.prompts, results, strict=True):
        if isinstance(result, Exception):
            message = getattr(result, "message", None) or str(result) \
                or type(result).__name__
            errors[prompt.id] = message[:DETAIL_CHARS]
            checks.append(Check(f"{prefix}:{prompt.id}:answered", False,
                                type(result).__name__, None, message[:DETAIL_CHARS]))
            continue
        answers[prompt.id] = result
        for c in health_gate.check_answer(prompt, result.text, result.completion_tokens):
            checks.append(Check(c.name.replace("prompt:", f"{prefix}:", 1), c.passed,
                                c.figure, c.limit, c.detail))
    return Replay(answers, errors, checks, prefix)


def _quote(text: str) -> str:
    return health_gate._quote(text)


def compare(spec: GateSpec, before: Replay, after: Replay) -> list[Check]:
    """Each golden prompt's answer on the staged runtime against the baseline's: `same`,
    `changed` (its own checks still pass: greedy decoding under other settings may pick
    another token where two were close) or `regressed` (its checks passed on the baseline
    and fail now, or it was answered before and is not now: failed)."""
    checks = []
    for prompt in spec.prompts:
        pid = prompt.id
        old, new = before.answers.get(pid), after.answers.get(pid)
        if old is None:
            checks.append(Check(f"prompt:{pid}:baseline", True, "no baseline", None,
                                f"not answered on the serving runtime either: "
                                f"{before.errors.get(pid, '')}"[:DETAIL_CHARS]))
        elif new is None:
            checks.append(Check(f"prompt:{pid}:baseline", False, "regressed", "answered",
                                f"answered before, now: {after.errors.get(pid, '')}"
                                [:DETAIL_CHARS]))
        elif old.text == new.text:
            checks.append(Check(f"prompt:{pid}:baseline", True, "same", None))
        else:
            regressed = before.passed(pid) and not after.passed(pid)
            checks.append(Check(f"prompt:{pid}:baseline", not regressed,
                                "regressed" if regressed else "changed", None,
                                f"before {_quote(old.text)}, now {_quote(new.text)}"
                                [:2 * DETAIL_CHARS]))
    return checks


def compare_speed(spec: GateSpec, before: Replay, after: Replay) -> list[Check]:
    """Tokens/s and the slowest first token against the box's own baseline: held to the
    gate's `tokens_per_s_floor` (and its inverse for the first token, 0.8 → 1.25×) when it
    has one, else measured and shown only."""
    floor = spec.tokens_per_s_floor
    new, old = after.tokens_per_s, before.tokens_per_s
    if floor is not None:
        speed = health_gate.check_speed(new, old, floor)
    else:
        ratio = round(new / old, 3) if new and old else None
        speed = Check("tokens_per_s", True, ratio, None,
                      f"{new or 0:.1f} tokens/s vs {old or 0:.1f} before (no floor)")
    first_new, first_old = after.worst_ttft_ms, before.worst_ttft_ms
    if first_new is None or not first_old:
        ttft = Check("ttft_vs_baseline", True, None, None, "not measured")
    else:
        ratio = round(first_new / first_old, 3)
        ceiling = round(1 / floor, 3) if floor else None
        ttft = Check("ttft_vs_baseline", ceiling is None or ratio <= ceiling, ratio, ceiling,
                     f"slowest first token {first_new:.0f} ms vs {first_old:.0f} ms before")
    return [speed, ttft]


def check_burst(burst: Replay, spec: GateSpec) -> Check:
    """Every golden prompt answered, and its own checks met, when all are sent at once
    (the slots the new `parallel` and `context_length` give hold them together)."""
    ok = [p.id for p in spec.prompts if burst.passed(p.id)]
    bad = [p.id for p in spec.prompts if p.id not in ok]
    if not bad:
        return Check("burst", True, f"{len(ok)}/{len(spec.prompts)}", len(spec.prompts),
                     "the golden prompts at once")
    first = bad[0]
    why = burst.errors.get(first) or "; ".join(
        f"{c.name.split(':', 2)[-1]} {c.figure}" for c in burst.checks
        if c.name.startswith(f"burst:{first}:") and not c.passed)
    return Check("burst", False, f"{len(ok)}/{len(spec.prompts)}", len(spec.prompts),
                 f"{', '.join(bad)} not answered or failed: {first}: {why}"[:DETAIL_CHARS])


# -- an ungated patch's evidence ---------------------------------------------------------------

def ungated_evidence(settings: Settings, command_id: str, before: Settings, after: Settings,
                     changes: Mapping[str, Any], hardware: Mapping[str, Any]) -> None:
    """One evidence row per name an ungated `config.patch` of capacity keys changes (the
    default model for `runtime.*` keys): outcome UNGATED, no check, the settings before
    and after."""
    names = {_name(key[len("models."):].rpartition(".")[0]) for key in changes
             if key.startswith("models.")}
    if any(key.startswith("runtime.") for key in changes):
        names.add(_name(settings.default_model))
    now = time.time()
    for name in sorted(names):
        record_evidence(settings.state_dir / "ledger.db", {
            "id": f"config.patch:{command_id}:{name}", "ts": now,
            "rollout_id": f"config.patch:{command_id}", "attempt": 1, "name": name,
            "version": "", "digest": "", "previous_digest": "", "outcome": "UNGATED",
            "reason": f"config.patch --ungated {', '.join(sorted(changes))}: no gate ran",
            "agent_version": __version__,
            "llama_cpp_version": llama_cpp_version() or "unknown",
            "hardware": dict(hardware),
            "parameters": {"ungated": True, "change": dict(changes),
                           "before": effective(before, name),
                           "after": effective(after, name)},
            "checks": [], "timings": {}})


def _name(given: str) -> str:
    """A model name as `models history` looks it up (as given, if it does not parse)."""
    try:
        return str(ModelName.parse(given))
    except InvalidRequest:
        return given

