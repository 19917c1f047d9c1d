"""Pure computations behind the `metrics` message: counter deltas from the box's own
Prometheus registry, per-model figures, nearest-rank percentiles, and the hardware
readings shaped for the wire. No I/O, no clock, no state: `fleet.device.reporting.sync` keeps
the previous snapshot and hands both in.

Series are read by their exported names (`edge_agent_requests_total`,
`llamacpp:prompt_tokens_total` …), which are a public interface already (dashboards use
them), so this module never imports `telemetry.metrics` — that module names the engine's
registry for typing, and the fleet link must not reach the registry even indirectly.

Must never: read a request's text or a label holding client text (the registry's labels
are model names, dialects, statuses, error types and reasons — all the box's own words).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from edge_agent.fleet.protocol import feedback
from edge_agent.fleet.protocol.materials import EVAL_KINDS
from edge_agent.telemetry.hardware import Reading

# Counters (deltas per interval) and gauges (read at the tick), by sample name.
REQUESTS = "edge_agent_requests_total"  # labels model, dialect, status, error_type
REJECTIONS = "edge_agent_rejections_total"  # label reason
EVALUATED = "llamacpp:prompt_tokens_total"  # prompt tokens evaluated (cached ones excluded)
CACHED = "edge_agent_cached_prompt_tokens_total"  # prompt tokens reused from the KV cache
PREDICTED = "llamacpp:tokens_predicted_total"
# labels upstream, reason, status: requests sent to an upstream ([upstreams])
UPSTREAM = "edge_agent_upstream_requests_total"
FEEDBACK = "edge_agent_feedback_total"  # labels model, rating: apps' verdicts on answers
# labels model, kind (`materials.EVAL_KINDS`): requests that reached a model, by task kind
KINDS = "edge_agent_request_kinds_total"
# The prompt cache beyond the sequences: lookups, hits by tier, tokens restored, restore
# seconds, evictions, disk writes; its tiers' bytes, entries and bounds (label tier).
CACHE_COUNTERS = {
    "lookups": "edge_agent_prompt_cache_lookups_total",
    "hits": "edge_agent_prompt_cache_hits_total",
    "restored_tokens": "edge_agent_prompt_cache_restored_tokens_total",
    "restore_s": "edge_agent_prompt_cache_restore_seconds_total",
    "evictions": "edge_agent_prompt_cache_evictions_total",
    "disk_writes": "edge_agent_prompt_cache_disk_writes_total",
}
CACHE_GAUGES = {
    "bytes": "edge_agent_prompt_cache_bytes",
    "entries": "edge_agent_prompt_cache_entries",
    "limit_bytes": "edge_agent_prompt_cache_limit_bytes",
}
# label model: structured answers closed within their budget, cut (not a document), and
# requests refused for a schema or tools the box cannot follow
STRUCTURED = {
    "closed": "edge_agent_structured_closed_total",
    "cut": "edge_agent_structured_cut_total",
    "refused": "edge_agent_structured_refused_total",
}
# labels tier, reason, action: requests a saturated box served otherwise than asked
DEGRADATIONS = "edge_agent_degradations_total"
COUNTERS = frozenset({REQUESTS, REJECTIONS, EVALUATED, CACHED, PREDICTED, UPSTREAM,
                      FEEDBACK, KINDS, DEGRADATIONS, *STRUCTURED.values(),
                      *CACHE_COUNTERS.values()})
_STRUCTURED_KEYS = {name: key for key, name in STRUCTURED.items()}
WAITING = "llamacpp:requests_deferred"  # label model
RUNNING = "llamacpp:requests_processing"
GAUGES = frozenset({WAITING, RUNNING, *CACHE_GAUGES.values()})
NO_MODEL = "(none)"  # requests refused before a model was chosen (auth, a bad body)

Labels = tuple[tuple[str, str], ...]
Series = dict[tuple[str, Labels], float]


class MetricsSource(Protocol):
    """A Prometheus registry (`Metrics.registry`): anything with `collect()`."""

    def collect(self) -> Iterable[Any]: ...


def read_series(source: MetricsSource) -> tuple[Series, Series]:
    """(counters, gauges) of the series this module uses, keyed by (name, sorted labels).
    One `collect()`, so every figure of a message comes from the same instant."""
    counters: Series = {}
    gauges: Series = {}
    for family in source.collect():
        for s in family.samples:
            if s.name in COUNTERS:
                counters[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
            elif s.name in GAUGES:
                gauges[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return counters, gauges


def deltas(now: Series, before: Series) -> Series:
    """What each counter gained since `before` (zero gains left out). A counter below its
    earlier value belongs to a new registry (the process restarted): all of it is new."""
    out: Series = {}
    for key, value in now.items():
        gained = value - before.get(key, 0.0)
        if gained < 0:
            gained = value
        if gained:
            out[key] = gained
    return out


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 95)) -> dict[str, Any] | None:
    """Nearest-rank percentiles (each one an observed value: the smallest with at least q%
    of the observations at or below it) and the count; None without observations."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    out: dict[str, Any] = {f"p{q}": ordered[max(0, math.ceil(q / 100 * n) - 1)] for q in qs}
    out["n"] = n
    return out


def _empty_model() -> dict[str, Any]:
    return {"requests": {}, "tokens": {"in": 0, "out": 0, "cached": 0, "cached_share": None},
            "ttft_ms": None, "tpot_ms": None, "queue": {"waiting": 0, "running": 0},
            "feedback": feedback.empty()}


def model_metrics(gained: Series, gauges: Series,
                  latencies: Mapping[str, tuple[Sequence[float], Sequence[float]]]
                  ) -> dict[str, dict[str, Any]]:
    """Per model: requests by HTTP status, tokens in (evaluated + cached) / out / cached and
    the cached share of the tokens in, TTFT and TPOT percentiles (ms, from `latencies`:
    model → (ttft values, tpot values)), the queue at the tick, and the verdicts apps sent
    back on its answers (`fleet.protocol.feedback`), and its requests by task kind
    (`kinds`: every one of `materials.EVAL_KINDS`, zeros included, present only when the
    model had a request that reached it in the interval: a kind's share of them is what
    the central team sets against the kinds of the release's evaluation samples), and its
    structured outputs (`structured`: closed, cut and refused, all three present when
    any moved in the interval, absent otherwise: the central team charts each model's
    failure share over time). A model appears when it served, failed, is loaded (its
    gauges), has latencies, got a verdict or had a structured outcome."""
    models: dict[str, dict[str, Any]] = {}

    def entry(labels: Labels) -> dict[str, Any]:
        name = dict(labels).get("model") or NO_MODEL
        return models.setdefault(name, _empty_model())

    for (name, labels), value in gained.items():
        if name == REQUESTS:
            status = dict(labels).get("status", "")
            requests = entry(labels)["requests"]
            requests[status] = requests.get(status, 0) + int(value)
        elif name in (EVALUATED, CACHED, PREDICTED):
            tokens = entry(labels)["tokens"]
            if name == PREDICTED:
                tokens["out"] += int(value)
            else:  # tokens in = evaluated + reused from the cache
                tokens["in"] += int(value)
                if name == CACHED:
                    tokens["cached"] += int(value)
        elif name == FEEDBACK:
            rating = dict(labels).get("rating", "")
            given = entry(labels)["feedback"]
            if rating in given:
                given[rating] += int(value)
        elif name == KINDS:
            kind = dict(labels).get("kind", "")
            if kind in EVAL_KINDS:
                kinds = entry(labels).setdefault("kinds", dict.fromkeys(EVAL_KINDS, 0))
                kinds[kind] += int(value)
        elif name in _STRUCTURED_KEYS:  # only gains are here: a zero adds no key
            structured = entry(labels).setdefault("structured", dict.fromkeys(STRUCTURED, 0))
            structured[_STRUCTURED_KEYS[name]] += int(value)
    for (name, labels), value in gauges.items():
        entry(labels)["queue"]["waiting" if name == WAITING else "running"] = int(value)
    for model, (ttft, tpot) in latencies.items():
        m = models.setdefault(model or NO_MODEL, _empty_model())
        m["ttft_ms"], m["tpot_ms"] = percentiles(ttft), percentiles(tpot)
    for model, m in models.items():
        if m["requests"] and model != NO_MODEL:  # refused at the model, or the gate's: zeros
            m.setdefault("kinds", dict.fromkeys(EVAL_KINDS, 0))
        tokens = m["tokens"]
        if tokens["in"]:
            tokens["cached_share"] = round(tokens["cached"] / tokens["in"], 4)
    return models


def rejections(gained: Series) -> dict[str, int]:
    """Requests refused in the interval by reason (auth, scope, quota, queue_full …)."""
    out: dict[str, int] = {}
    for (name, labels), value in gained.items():
        if name == REJECTIONS:
            reason = dict(labels).get("reason", "")
            out[reason] = out.get(reason, 0) + int(value)
    return out


def degradations(gained: Series) -> list[dict[str, Any]]:
    """Requests a saturated box served otherwise than asked in the interval, by risk tier,
    cause (queue_full, memory, deadline) and what it did (fallback, queued, refused),
    sorted, those that did not move left out; empty when none. A list of rows rather than
    nested objects: the central team charts each combination as one series."""
    rows: dict[tuple[str, str, str], int] = {}
    for (name, labels), value in gained.items():
        if name == DEGRADATIONS:
            d = dict(labels)
            key = (d.get("tier", ""), d.get("reason", ""), d.get("action", ""))
            rows[key] = rows.get(key, 0) + int(value)
    return [{"tier": t, "reason": r, "action": a, "count": n}
            for (t, r, a), n in sorted(rows.items()) if n]


def upstream_share(gained: Series) -> dict[str, Any]:
    """Requests sent to upstreams in the interval: how many, their share of every request
    the box answered or refused (None when there were none), and per upstream by reason
    and outcome, so the central team sees which stores spill to the pool, and why."""
    total = sum(int(v) for (name, _), v in gained.items() if name == REQUESTS)
    by: dict[str, dict[str, dict[str, int]]] = {}
    sent = 0
    for (name, labels), value in gained.items():
        if name != UPSTREAM:
            continue
        d = dict(labels)
        reasons = by.setdefault(d.get("upstream", ""), {}).setdefault(d.get("reason", ""), {})
        reasons[d.get("status", "")] = reasons.get(d.get("status", ""), 0) + int(value)
        sent += int(value)
    return {"requests": sent, "share": round(sent / total, 4) if total else None, "by": by}


def prompt_cache(gained: Series, gauges: Series) -> dict[str, Any]:
    """The prompt cache in the interval (hits by tier, tokens restored, their share of the
    prompt tokens, restore time, evictions, disk writes) and its tiers now (bytes, entries
    and bound per tier), so the central team sees where recurring prompts pay."""
    out: dict[str, Any] = {}
    for key, name in CACHE_COUNTERS.items():
        by = {dict(labels).get("tier", ""): v for (n, labels), v in gained.items() if n == name}
        if key == "hits":
            out[key] = {tier: int(v) for tier, v in by.items() if tier}
        else:
            total = sum(by.values())
            out[key] = round(total, 3) if key == "restore_s" else int(total)
    prompt = sum(v for (n, _), v in gained.items() if n in (EVALUATED, CACHED))
    out["restored_share"] = round(out["restored_tokens"] / prompt, 4) if prompt else None
    for key, name in CACHE_GAUGES.items():
        for (n, labels), v in gauges.items():
            if n == name:
                out.setdefault(dict(labels).get("tier", ""), {})[key] = int(v)
    return out


def errors(gained: Series) -> list[dict[str, Any]]:
    """Failed requests in the interval by model, HTTP status and error type (the error
    tree's `error_type`), for the `errors` event; empty when none failed."""
    rows: dict[tuple[str, str, str], int] = {}
    for (name, labels), value in gained.items():
        if name != REQUESTS:
            continue
        d = dict(labels)
        if d.get("status") == "200":
            continue
        key = (d.get("model") or NO_MODEL, d.get("status", ""), d.get("error_type", ""))
        rows[key] = rows.get(key, 0) + int(value)
    return [{"model": m, "status": int(s) if s.isdigit() else s, "type": t, "count": n}
            for (m, s, t), n in sorted(rows.items())]


def hardware(readings: Iterable[Reading]) -> dict[str, Any]:
    """The sampler's latest readings: unlabelled ones flat (`cpu_utilization_ratio`,
    `memory_used_bytes`, `state_disk_free_bytes` …), GPUs as a list of objects (one per
    `gpu` label: utilization_ratio, memory_used/total_bytes, temperature_celsius,
    power_watts … where NVML or Jetson sysfs has them), other labelled readings as
    {label values joined by '/': value} (`load_average`, `temperature_celsius` by sensor,
    `power_rail_watts` by rail)."""
    out: dict[str, Any] = {}
    gpus: dict[str, dict[str, Any]] = {}
    for r in readings:
        labels = dict(r.labels)
        if r.name.startswith("gpu_") and "gpu" in labels:
            gpu = gpus.setdefault(labels["gpu"], {"gpu": labels["gpu"],
                                                  "name": labels.get("name", "")})
            gpu[r.name.removeprefix("gpu_")] = r.value
        elif not r.labels:
            out[r.name] = r.value
        else:
            out.setdefault(r.name, {})["/".join(v for _, v in r.labels)] = r.value
    if gpus:
        out["gpus"] = [gpus[k] for k in sorted(gpus, key=lambda g: (len(g), g))]
    return out
