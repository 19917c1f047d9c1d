"""The periodic review of the fleet's production models: what is due, for `fleet review`,
`GET /review` and the console's review page.

For each model name whose release in service is a `production` one (the newest production
release of the name with a COMPLETED rollout; one only published is reviewed as "not
rolled out"):

- **age**: how old its version is (its manifest's `created_at`), and which newer versions
  of the name the repository publishes;
- **coverage**: of the requests the boxes served with the model over the window, the share
  of each task kind (`slo` counts the boxes' `kinds`), and those its evaluation samples do
  not cover (`materials.eval_samples.kinds`): a request counts in its dialect and in any of
  schema, tools and long context, so the shares overlap, and the largest uncovered one is
  the least share of requests the evaluation never saw;
- **drift**: the model's figures over the last day against its baseline, those of the
  `[slo] compare_s` after its rollout completed, recorded the first time it is reviewed
  (`slo_baselines`: retention may take the metrics, never the baseline): TTFT p95, TPOT p95
  (the cost of a token: the box's compute time for it), the server-error share, and the
  tokens generated per request;
- **rollback**: whether its rollback target (`materials.rollback_target`) is still on the
  boxes and would start, from the newest answers boxes gave to `model.verify` for its
  digest (the blob, however a box came to hold it; `POST /review/verify` asks a sample of
  the boxes that serve the model);
- **due**: its review date (`materials.review_by`), overdue once past.

Each finding that asks for a person is a line in `flags`; a model without one is in order.
`ReviewQueries` is what `sql.SQLStore.review` holds (baselines, and the verify answers);
`review` joins them with the repository and the service levels.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from edge_agent.fleet.controller.slo import KINDS, Bucket, SLOQueries
from edge_agent.fleet.controller.transaction import Exec
from edge_agent.fleet.protocol.materials import PRODUCTION

if TYPE_CHECKING:
    from edge_agent.fleet.controller.releases.repository import ReleaseEntry
    from edge_agent.fleet.controller.rollout_records import RolloutRecord

DAY_S = 86400.0
WINDOW_S = 7 * DAY_S  # the requests whose kinds are read
RECENT_S = DAY_S  # the figures held against the baseline
VERIFY = "model.verify"
# A figure this much worse than its baseline is flagged (a ratio for latencies, a
# difference of shares for errors).
WORSE_BY = 1.2
MORE_ERRORS_BY = 0.02


class ReviewQueries:
    """Each call in a transaction of the store that holds this object."""

    def __init__(self, tx: Callable[[], AbstractContextManager[Exec]],
                 read: Callable[[], AbstractContextManager[Exec]]) -> None:
        self._tx = tx
        self._read = read

    def baseline(self, rollout_id: str) -> dict[str, Any] | None:
        with self._read() as db:
            rows = db.rows("SELECT recorded_at, since, until, figures FROM slo_baselines "
                           "WHERE rollout_id = ?", [rollout_id])
        if not rows:
            return None
        recorded, since, until, figures = rows[0]
        return {"recorded_at": recorded, "since": since, "until": until,
                "figures": json.loads(figures)}

    def record_baseline(self, rollout_id: str, name: str, version: str, *, since: float,
                        until: float, figures: Mapping[str, Any], now: float) -> None:
        """Once per rollout: a second recording (another controller's) leaves the first."""
        with self._tx() as db:
            db.run("INSERT INTO slo_baselines (rollout_id, name, version, recorded_at, since, "
                   "until, figures) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                   [rollout_id, name, version, now, since, until, json.dumps(figures)])

    def verify_answers(self, name: str, digest: str, limit: int = 2000
                       ) -> list[dict[str, Any]]:
        """The newest `model.verify` answer of each box for `name` at `digest`
        (`sha256:…`): the blob a version is, however the box came to have it."""
        with self._read() as db:
            rows = db.rows(
                "SELECT c.body, r.device, r.status, r.reason, r.result, r.received "
                "FROM commands c JOIN command_results r ON r.id = c.id WHERE c.type = ? "
                "ORDER BY r.received DESC LIMIT ?", [VERIFY, limit])
        newest: dict[str, dict[str, Any]] = {}
        for body, device, status, reason, result, received in rows:
            args = json.loads(body).get("args") or {}
            if args.get("name") != name or args.get("digest") != digest or device in newest:
                continue
            answer = json.loads(result) if result else {}
            newest[device] = {"device": device, "status": status, "reason": reason,
                              "received": received,
                              **{k: answer.get(k) for k in ("present", "verified", "loads",
                                                            "detail")}}
        return sorted(newest.values(), key=lambda a: str(a["device"]))


def _figures(b: Bucket) -> dict[str, Any]:
    return {"requests": b.requests, "ttft_p95": b.ttft_p95, "tpot_p95": b.tpot_p95,
            "error_rate": None if b.error_rate() is None else round(b.error_rate() or 0, 4),
            "tokens_per_request": round(b.tokens_out / b.requests, 1) if b.requests
            else None}


def _in_service(name: str, entries: Sequence[ReleaseEntry],
                rollouts: Sequence[RolloutRecord]) -> tuple[ReleaseEntry, RolloutRecord | None]:
    """The production release of `name` in service: the newest with a COMPLETED rollout,
    else the newest published."""
    production = {e.manifest.version: e for e in entries
                  if e.manifest.name == name and e.manifest.stage == PRODUCTION}
    for r in sorted(rollouts, key=lambda r: r.created_at, reverse=True):
        if r.name == name and r.config is None and r.state == "COMPLETED" \
                and r.version in production:
            return production[r.version], r
    return max(production.values(), key=lambda e: e.manifest.created_at), None


def _version_key(version: str) -> tuple[int, ...] | tuple[float, str]:
    return tuple(int(p) for p in version.split(".")) if all(
        p.isdigit() for p in version.split(".")) else (math.inf, version)


def review(store: Any, entries: Sequence[ReleaseEntry], *, compare_s: float, now: float,
           window_s: float = WINDOW_S) -> list[dict[str, Any]]:
    """One entry per model name with a production release (see the module)."""
    rollouts = store.rollouts.rollouts(limit=1000)
    names = sorted({e.manifest.name for e in entries if e.manifest.stage == PRODUCTION})
    slo: SLOQueries = store.slo
    out = []
    for name in names:
        entry, rollout = _in_service(name, entries, rollouts)
        m = entry.manifest
        flags: list[str] = []
        versions = [e.manifest.version for e in entries if e.manifest.name == name]
        newer = sorted((v for v in versions if _version_key(v) > _version_key(m.version)),
                       key=_version_key)
        age_days = round((now - m.created_at) / DAY_S, 1) if m.created_at else None
        if newer:
            flags.append(f"a newer version is published: {', '.join(newer)}")
        if rollout is None:
            flags.append("not rolled out: no completed rollout of this release")
        # Coverage of the requests' task kinds by the evaluation samples.
        total, kinds = slo.kinds(model=name, since=now - window_s, until=now)
        covered = set(m.materials.eval_samples.kinds) if m.materials.eval_samples else set()
        shares = {k: round(kinds[k] / total, 4) if total else 0.0 for k in KINDS}
        uncovered = {k: s for k, s in shares.items() if s and k not in covered}
        for k, s in sorted(uncovered.items(), key=lambda kv: -kv[1]):
            flags.append(f"{s:.0%} of its requests are {k.replace('_', ' ')}, which its "
                         f"evaluation samples do not cover")
        # Drift against the baseline recorded at its rollout.
        baseline = recent = None
        drift: dict[str, float | None] = {}
        if rollout is not None:
            held = store.review.baseline(rollout.id)
            if held is None:
                done = max((d.finished_at or 0.0 for d in
                            store.rollouts.rollout_devices(rollout.id)),
                           default=0.0) or rollout.updated_at
                if now >= done + compare_s:
                    figures = _figures(slo.window(model=name, since=done,
                                                  until=done + compare_s))
                    if figures["requests"]:
                        store.review.record_baseline(rollout.id, name, m.version, since=done,
                                                     until=done + compare_s,
                                                     figures=figures, now=now)
                        held = store.review.baseline(rollout.id)
            if held is not None:
                baseline = held["figures"]
                recent = _figures(slo.window(model=name, since=now - RECENT_S, until=now))
                drift = _drift(baseline, recent)
                for key, label in (("ttft_p95", "TTFT p95"), ("tpot_p95", "TPOT p95 (cost)")):
                    ratio = drift.get(key)
                    if ratio is not None and ratio >= WORSE_BY:
                        flags.append(f"{label} {ratio - 1:+.0%} against its baseline")
                errors = drift.get("error_rate")
                if errors is not None and errors >= MORE_ERRORS_BY:
                    flags.append(f"server errors {errors:+.1%} against its baseline")
        # The rollback target: still on the boxes, and would it start.
        target = m.materials.rollback_target
        digest = _digest_of(entries, name, target)
        answers = store.review.verify_answers(name, digest) if digest else []
        broken = [a for a in answers if not (a["status"] == "ok" and a["present"]
                                             and a["verified"] and a["loads"])]
        if target and not answers:
            flags.append(f"rollback target {target} never verified on a box "
                         f"(POST /review/verify)")
        elif broken:
            flags.append(f"rollback target {target} is missing or broken on {len(broken)} "
                         f"of {len(answers)} box(es) asked: "
                         + "; ".join(f"{a['device']}: {a['detail'] or a['reason'] or 'failed'}"
                                     for a in broken[:5]))
        # The review date.
        due = m.materials.review_by
        overdue = due is not None and dt.date.fromisoformat(due) < \
            dt.datetime.fromtimestamp(now, dt.timezone.utc).date()
        if overdue:
            flags.append(f"its review was due on {due}")
        out.append({
            "name": name, "version": m.version, "sha256": entry.sha256,
            "rollout": rollout.id if rollout else None, "age_days": age_days,
            "newer": newer, "review_by": due, "overdue": overdue,
            "requests": total, "kinds": shares, "covered": sorted(covered, key=KINDS.index),
            "uncovered": uncovered, "baseline": baseline, "recent": recent, "drift": drift,
            "rollback_target": target, "verified": answers, "flags": flags})
    return out


def _digest_of(entries: Sequence[ReleaseEntry], name: str, version: str | None) -> str | None:
    """`sha256:…` of the published `name`@`version`; None where there is none."""
    for e in entries:
        if e.manifest.name == name and e.manifest.version == version:
            return f"sha256:{e.sha256}"
    return None


def _drift(baseline: Mapping[str, Any], recent: Mapping[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        a, b = baseline.get(key), recent.get(key)
        return round(b / a, 3) if a and b is not None else None
    errors = None
    if baseline.get("error_rate") is not None and recent.get("error_rate") is not None:
        errors = round(recent["error_rate"] - baseline["error_rate"], 4)
    return {"ttft_p95": ratio("ttft_p95"), "tpot_p95": ratio("tpot_p95"),
            "error_rate": errors, "tokens_per_request": ratio("tokens_per_request")}


def verify_sample(store: Any, entries: Sequence[ReleaseEntry], sample: int,
                  rng: random.Random | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """(device, fleet, args) of the `model.verify` commands to send: for each production
    model with a rollback target, up to `sample` boxes that serve the model (by what they
    last said of their models), chosen at random among the online ones."""
    rng = rng or random.Random()
    rollouts = store.rollouts.rollouts(limit=1000)
    out = []
    for name in sorted({e.manifest.name for e in entries if e.manifest.stage == PRODUCTION}):
        entry, _ = _in_service(name, entries, rollouts)
        digest = _digest_of(entries, name, entry.manifest.materials.rollback_target)
        if digest is None:
            continue
        serving = [d for d in store.devices() if d["online"] and not d.get("retired")
                   and any(isinstance(m, Mapping) and m.get("name") == name
                           for m in (d.get("models") or []))]
        for d in rng.sample(serving, min(sample, len(serving))):
            out.append((str(d["device"]), str(d["fleet"]), {"name": name, "digest": digest}))
    return out
