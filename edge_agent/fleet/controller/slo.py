"""The fleet's service levels over time: each box's `metrics` message, per model, as a row
of `slo_intervals`, read back as series over a window (the fleet, a model, a box), beside
every release that started in it, and as a before/after table per rollout wave.

Why rows of their own and not the stored messages: a chart of a day for a fleet of 10,000
boxes covers 14 million intervals; read from the messages' JSON bodies that is a parse per
row. So each interval is a row (`slo_intervals`: a box's chart, a release's before/after
per box), and its figures are also added into `slo_minutes`, one row per minute, fleet and
model, which the fleet's and a model's charts read whatever the number of boxes. Both are
written in the ingest's own transaction (`sql.SQLStore.ingest`), so a message and its rows
are stored or lost together, and a duplicate message (already stored) adds nothing.

What a row holds is what the box measured over its interval: requests by status class,
tokens out, TTFT and TPOT p50/p95 with the count behind each (nearest-rank, from the box's
ledger), upstream requests, structured answers closed or cut and requests refused for what
they asked, the task kinds of the requests (`review`), and the answers people sent back
(`fleet.protocol.feedback`: also summed per box and model over a window,
`feedback_sums`). A box's degradations (a saturated box serving otherwise than asked, by
risk tier) are the box's, not a model's: `slo_degradations` per minute and fleet, drawn
for the fleet or a fleet whatever the model. `slo_totals` keeps, per box
and model, the running sums and the latest interval's percentiles: what the Prometheus
export (`slo_export`) reads at a scrape without touching the intervals. Error types come
from the box's `errors` events (`slo_errors`).

Percentiles across boxes cannot be added up; a bucket's "p95" of several boxes is the
mean of their interval p95s weighted by the requests behind each (what a typical
request's box saw), and its "worst" is the highest. Both are said so wherever shown.

Time is the box's: an interval sits where the box's clock put its end, so a store that was
offline for a day fills in its day when it comes back rather than piling it onto the
minute it reconnected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.transaction import Exec
from edge_agent.fleet.protocol import feedback
from edge_agent.fleet.protocol.agent_release import is_agent_name

SCHEMA: tuple[str, ...] = (
    """CREATE TABLE slo_intervals (
        device TEXT NOT NULL, boot_id TEXT NOT NULL, seq BIGINT NOT NULL,
        model TEXT NOT NULL, fleet TEXT NOT NULL,
        start_ts DOUBLE PRECISION NOT NULL, end_ts DOUBLE PRECISION NOT NULL,
        requests BIGINT NOT NULL, ok BIGINT NOT NULL, client_errors BIGINT NOT NULL,
        server_errors BIGINT NOT NULL, tokens_out BIGINT NOT NULL,
        ttft_p50 DOUBLE PRECISION, ttft_p95 DOUBLE PRECISION, ttft_n BIGINT NOT NULL,
        tpot_p50 DOUBLE PRECISION, tpot_p95 DOUBLE PRECISION, tpot_n BIGINT NOT NULL,
        upstream BIGINT NOT NULL, feedback_good BIGINT NOT NULL,
        feedback_bad BIGINT NOT NULL, structured_closed BIGINT NOT NULL,
        structured_cut BIGINT NOT NULL, structured_refused BIGINT NOT NULL,
        PRIMARY KEY (device, boot_id, seq, model))""",
    "CREATE INDEX slo_intervals_by_end ON slo_intervals (end_ts)",
    "CREATE INDEX slo_intervals_by_model ON slo_intervals (model, end_ts)",
    "CREATE INDEX slo_intervals_by_device ON slo_intervals (device, end_ts)",
    """CREATE TABLE slo_errors (
        device TEXT NOT NULL, boot_id TEXT NOT NULL, seq BIGINT NOT NULL,
        model TEXT NOT NULL, status BIGINT NOT NULL, type TEXT NOT NULL,
        fleet TEXT NOT NULL, end_ts DOUBLE PRECISION NOT NULL, count BIGINT NOT NULL,
        PRIMARY KEY (device, boot_id, seq, model, status, type))""",
    "CREATE INDEX slo_errors_by_end ON slo_errors (end_ts)",
    """CREATE TABLE slo_minutes (
        minute BIGINT NOT NULL, fleet TEXT NOT NULL, model TEXT NOT NULL,
        reports BIGINT NOT NULL, requests BIGINT NOT NULL, ok BIGINT NOT NULL,
        client_errors BIGINT NOT NULL, server_errors BIGINT NOT NULL,
        tokens_out BIGINT NOT NULL, upstream BIGINT NOT NULL,
        feedback_good BIGINT NOT NULL, feedback_bad BIGINT NOT NULL,
        ttft_p50_sum DOUBLE PRECISION NOT NULL, ttft_p95_sum DOUBLE PRECISION NOT NULL,
        ttft_n BIGINT NOT NULL, ttft_worst DOUBLE PRECISION,
        tpot_p50_sum DOUBLE PRECISION NOT NULL, tpot_p95_sum DOUBLE PRECISION NOT NULL,
        tpot_n BIGINT NOT NULL, tpot_worst DOUBLE PRECISION,
        kind_ollama BIGINT NOT NULL, kind_openai BIGINT NOT NULL,
        kind_schema BIGINT NOT NULL, kind_tools BIGINT NOT NULL,
        kind_long_context BIGINT NOT NULL, structured_closed BIGINT NOT NULL,
        structured_cut BIGINT NOT NULL, structured_refused BIGINT NOT NULL,
        PRIMARY KEY (minute, fleet, model))""",
    # The boxes' degradations (a saturated box serving otherwise than asked) are theirs,
    # not a model's: per minute, fleet, risk tier, cause and what the box did.
    """CREATE TABLE slo_degradations (
        minute BIGINT NOT NULL, fleet TEXT NOT NULL, tier TEXT NOT NULL,
        reason TEXT NOT NULL, action TEXT NOT NULL, count BIGINT NOT NULL,
        PRIMARY KEY (minute, fleet, tier, reason, action))""",
    # What the periodic review (`review`) compares a production release against: its
    # figures once its rollout completed, recorded the first time it is reviewed.
    """CREATE TABLE slo_baselines (
        rollout_id TEXT PRIMARY KEY, name TEXT NOT NULL, version TEXT NOT NULL,
        recorded_at DOUBLE PRECISION NOT NULL, since DOUBLE PRECISION NOT NULL,
        until DOUBLE PRECISION NOT NULL, figures TEXT NOT NULL)""",
    """CREATE TABLE slo_totals (
        device TEXT NOT NULL, model TEXT NOT NULL, fleet TEXT NOT NULL,
        ok BIGINT NOT NULL, client_errors BIGINT NOT NULL, server_errors BIGINT NOT NULL,
        tokens_out BIGINT NOT NULL, upstream BIGINT NOT NULL,
        feedback_good BIGINT NOT NULL, feedback_bad BIGINT NOT NULL,
        ttft_p50 DOUBLE PRECISION, ttft_p95 DOUBLE PRECISION,
        tpot_p50 DOUBLE PRECISION, tpot_p95 DOUBLE PRECISION,
        last_end DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (device, model))""",
)

# The counted columns, in the order both tables take them.
_SUMS = ("ok", "client_errors", "server_errors", "tokens_out", "upstream", "feedback_good",
         "feedback_bad")
_LATEST = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95")
# The latest percentiles only move forward in the box's time (a late, older interval
# from an outbox that was offline leaves them as they are).
_NEWER = "excluded.last_end >= slo_totals.last_end"
_TOTALS_UPSERT = (
    f"INSERT INTO slo_totals (device, model, fleet, {', '.join(_SUMS)}, "
    f"{', '.join(_LATEST)}, last_end) "
    f"VALUES ({', '.join('?' * (3 + len(_SUMS) + len(_LATEST) + 1))}) "
    f"ON CONFLICT (device, model) DO UPDATE SET fleet = excluded.fleet, "
    + ", ".join(f"{c} = slo_totals.{c} + excluded.{c}" for c in _SUMS) + ", "
    + ", ".join(f"{c} = CASE WHEN {_NEWER} THEN excluded.{c} ELSE slo_totals.{c} END"
                for c in _LATEST)
    + f", last_end = CASE WHEN {_NEWER} THEN excluded.last_end ELSE slo_totals.last_end END")
# The task kinds of the requests a model served (the box's `kinds`, `telemetry.task_kinds`;
# the evaluation samples' too), each a column of the minutes: spelt out, as a schema step
# is never edited once released.
KINDS = ("ollama", "openai", "schema", "tools", "long_context")
# Structured output (a schema or tools): answers closed within their budget, cut short,
# and requests refused for what they asked (the box's `structured`).
STRUCTURED = ("closed", "cut", "refused")
_STRUCTURED = tuple(f"structured_{o}" for o in STRUCTURED)
_MINUTE_SUMS = ("reports", "requests", *_SUMS, "ttft_p50_sum", "ttft_p95_sum", "ttft_n",
                "tpot_p50_sum", "tpot_p95_sum", "tpot_n", *(f"kind_{k}" for k in KINDS),
                *_STRUCTURED)
_WORST = ("ttft_worst", "tpot_worst")
_MINUTES_UPSERT = (
    f"INSERT INTO slo_minutes (minute, fleet, model, {', '.join(_MINUTE_SUMS)}, "
    f"{', '.join(_WORST)}) VALUES ({', '.join('?' * (3 + len(_MINUTE_SUMS) + len(_WORST)))}) "
    f"ON CONFLICT (minute, fleet, model) DO UPDATE SET "
    + ", ".join(f"{c} = slo_minutes.{c} + excluded.{c}" for c in _MINUTE_SUMS) + ", "
    + ", ".join(f"{c} = CASE WHEN slo_minutes.{c} IS NULL OR excluded.{c} > slo_minutes.{c} "
                f"THEN excluded.{c} ELSE slo_minutes.{c} END" for c in _WORST))
_DEGRADATIONS_UPSERT = (
    "INSERT INTO slo_degradations (minute, fleet, tier, reason, action, count) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (minute, fleet, tier, reason, action) "
    "DO UPDATE SET count = slo_degradations.count + excluded.count")
# A box's interval is at most this long to count (one that claims a week is a clock jump).
MAX_INTERVAL_S = 86400.0
# Chart buckets: at most this many in a window (the step grows with the window).
MAX_BUCKETS = 240


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0 else 0


def _ms(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value >= 0 else None


def _percentiles(value: Any) -> tuple[float | None, float | None, int]:
    if not isinstance(value, Mapping):
        return None, None, 0
    n = _count(value.get("n"))
    return _ms(value.get("p50")), _ms(value.get("p95")), n


@dataclass
class IntervalRow:
    """One model's figures in one `metrics` message."""

    model: str
    ok: int = 0
    client_errors: int = 0
    server_errors: int = 0
    tokens_out: int = 0
    upstream: int = 0
    feedback_good: int = 0
    feedback_bad: int = 0
    ttft: tuple[float | None, float | None, int] = (None, None, 0)
    tpot: tuple[float | None, float | None, int] = (None, None, 0)
    kinds: tuple[int, ...] = (0,) * len(KINDS)
    structured: tuple[int, ...] = (0,) * len(STRUCTURED)

    @property
    def requests(self) -> int:
        return self.ok + self.client_errors + self.server_errors


def interval_rows(body: Mapping[str, Any], sent: float | None = None
                  ) -> tuple[float | None, float | None, list[IntervalRow]]:
    """(start, end, rows) of a `metrics` body; its interval's end is `sent` (the envelope's
    time) where the body has none; (None, None, []) without either. A model that only has
    its queue gauges (loaded, idle) gives no row."""
    interval = body.get("interval")
    start = end = None
    if isinstance(interval, Mapping):
        start, end = _ms(interval.get("start")), _ms(interval.get("end"))
    if end is None:
        end = _ms(sent)
    if end is None:
        return None, None, []
    if start is None or not 0 <= end - start <= MAX_INTERVAL_S:
        start = end
    rows: list[IntervalRow] = []
    verdicts = feedback.counts(body)
    models = body.get("models")
    for name, m in (models.items() if isinstance(models, Mapping) else ()):
        if not isinstance(m, Mapping) or not isinstance(name, str):
            continue
        row = IntervalRow(str(name)[:200])
        requests = m.get("requests")
        for status, n in (requests.items() if isinstance(requests, Mapping) else ()):
            code = str(status)
            if code.startswith("2"):
                row.ok += _count(n)
            elif code.startswith("4"):
                row.client_errors += _count(n)
            else:
                row.server_errors += _count(n)
        tokens = m.get("tokens")
        if isinstance(tokens, Mapping):
            row.tokens_out = _count(tokens.get("out"))
        row.ttft, row.tpot = _percentiles(m.get("ttft_ms")), _percentiles(m.get("tpot_ms"))
        kinds = m.get("kinds")
        if isinstance(kinds, Mapping):
            row.kinds = tuple(_count(kinds.get(k)) for k in KINDS)
        structured = m.get("structured")
        if isinstance(structured, Mapping):
            row.structured = tuple(_count(structured.get(o)) for o in STRUCTURED)
        given = verdicts.get(row.model, {})
        row.feedback_good, row.feedback_bad = given.get("good", 0), given.get("bad", 0)
        if row.requests or row.ttft[2] or row.tpot[2] or row.feedback_good \
                or row.feedback_bad or any(row.structured):
            rows.append(row)
    upstream = body.get("upstream")
    sent = _count(upstream.get("requests")) if isinstance(upstream, Mapping) else 0
    if sent:
        # Upstream requests are the box's, not a model's: they go with its busiest model.
        busiest = max(rows, key=lambda r: r.requests, default=None)
        if busiest is None:
            busiest = IntervalRow("(none)")
            rows.append(busiest)
        busiest.upstream = sent
    return start, end, rows


class MinuteSums:
    """What a batch of messages adds to `slo_minutes`: per (minute, fleet, model), the sums
    in `_MINUTE_SUMS` order and the worst p95s."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, str, str], list[float]] = {}
        self.worst: dict[tuple[int, str, str], list[float | None]] = {}
        self.degraded: dict[tuple[int, str, str, str, str], int] = {}

    def add_degradations(self, minute: int, fleet: str, body: Mapping[str, Any]) -> None:
        """A body's `degradations` (`[{"tier", "reason", "action", "count"}]`); what is
        not of that shape counts as nothing."""
        given = body.get("degradations")
        for d in given if isinstance(given, list) else ():
            if not isinstance(d, Mapping):
                continue
            n = _count(d.get("count"))
            tier, reason, action = (str(d.get(k) or "")[:64] for k in ("tier", "reason",
                                                                        "action"))
            if n and tier and reason and action:
                key = (minute, fleet, tier, reason, action)
                self.degraded[key] = self.degraded.get(key, 0) + n

    def add(self, minute: int, fleet: str, r: IntervalRow) -> None:
        key = (minute, fleet, r.model)
        t50, t95, tn = r.ttft
        p50, p95, pn = r.tpot
        tn = tn if t95 is not None else 0
        pn = pn if p95 is not None else 0
        values = (1, r.requests, r.ok, r.client_errors, r.server_errors, r.tokens_out,
                  r.upstream, r.feedback_good, r.feedback_bad, (t50 or 0.0) * tn,
                  (t95 or 0.0) * tn, tn, (p50 or 0.0) * pn, (p95 or 0.0) * pn, pn, *r.kinds,
                  *r.structured)
        sums = self.sums.setdefault(key, [0] * len(values))
        for i, v in enumerate(values):
            sums[i] += v
        worst = self.worst.setdefault(key, [None, None])
        for i, pct in enumerate((t95, p95)):
            held = worst[i]
            if pct is not None and (held is None or pct > held):
                worst[i] = pct


@dataclass
class Bucket:
    """One step of a series: sums, and the request-weighted mean and the worst of the
    boxes' interval percentiles (ms)."""

    start: float
    requests: int = 0
    ok: int = 0
    client_errors: int = 0
    server_errors: int = 0
    tokens_out: int = 0
    upstream: int = 0
    feedback_good: int = 0
    feedback_bad: int = 0
    structured_closed: int = 0
    structured_cut: int = 0
    structured_refused: int = 0
    reports: int = 0  # box intervals behind the bucket
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    ttft_worst: float | None = None
    tpot_p50: float | None = None
    tpot_p95: float | None = None
    tpot_worst: float | None = None
    # Degradations by risk tier (the boxes', whatever the model: a fleet's or the fleet's).
    degraded: dict[str, int] = field(default_factory=dict)

    def error_rate(self) -> float | None:
        return self.server_errors / self.requests if self.requests else None

    def to_json(self, step: float) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()}
        out["error_rate"] = None if self.requests == 0 else round(self.error_rate() or 0.0, 4)
        out["tokens_per_s"] = round(self.tokens_out / step, 3) if step else None
        return out


@dataclass
class Series:
    since: float
    until: float
    step: float
    scope: dict[str, str | None]
    buckets: list[Bucket] = field(default_factory=list)
    markers: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"since": self.since, "until": self.until, "step": self.step,
                "scope": self.scope, "buckets": [b.to_json(self.step) for b in self.buckets],
                "markers": self.markers, "errors": self.errors,
                "percentiles": "request-weighted mean of the boxes' interval percentiles; "
                               "worst: the highest"}


def step_for(window_s: float) -> float:
    """A round step giving at most MAX_BUCKETS buckets over `window_s`."""
    for step in (60, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400):
        if window_s / step <= MAX_BUCKETS:
            return float(step)
    return math.ceil(window_s / MAX_BUCKETS / 86400) * 86400.0


def _aggregates(prefix: str = "") -> str:
    p = prefix
    return (f"SUM({p}requests), SUM({p}ok), SUM({p}client_errors), SUM({p}server_errors), "
            f"SUM({p}tokens_out), SUM({p}upstream), SUM({p}feedback_good), "
            f"SUM({p}feedback_bad), COUNT(*), "
            f"SUM({p}ttft_p50 * {p}ttft_n), SUM({p}ttft_p95 * {p}ttft_n), "
            f"SUM(CASE WHEN {p}ttft_p95 IS NULL THEN 0 ELSE {p}ttft_n END), "
            f"MAX({p}ttft_p95), "
            f"SUM({p}tpot_p50 * {p}tpot_n), SUM({p}tpot_p95 * {p}tpot_n), "
            f"SUM(CASE WHEN {p}tpot_p95 IS NULL THEN 0 ELSE {p}tpot_n END), "
            f"MAX({p}tpot_p95), "
            + ", ".join(f"SUM({p}{c})" for c in _STRUCTURED))


# `_aggregates`' columns, in its order, from the per-minute sums.
_MINUTE_AGGREGATES = (
    "SUM(requests), SUM(ok), SUM(client_errors), SUM(server_errors), SUM(tokens_out), "
    "SUM(upstream), SUM(feedback_good), SUM(feedback_bad), SUM(reports), "
    "SUM(ttft_p50_sum), SUM(ttft_p95_sum), SUM(ttft_n), MAX(ttft_worst), "
    "SUM(tpot_p50_sum), SUM(tpot_p95_sum), SUM(tpot_n), MAX(tpot_worst), "
    + ", ".join(f"SUM({c})" for c in _STRUCTURED))


def _fill(bucket: Bucket, values: Sequence[Any]) -> Bucket:
    (bucket.requests, bucket.ok, bucket.client_errors, bucket.server_errors,
     bucket.tokens_out, bucket.upstream, bucket.feedback_good, bucket.feedback_bad,
     bucket.reports) = (int(v or 0) for v in values[:9])
    t50, t95, tn, tworst, p50, p95, pn, pworst = values[9:17]
    if tn:
        bucket.ttft_p50 = round(float(t50) / float(tn), 2)
        bucket.ttft_p95 = round(float(t95) / float(tn), 2)
    bucket.ttft_worst = None if tworst is None else float(tworst)
    if pn:
        bucket.tpot_p50 = round(float(p50) / float(pn), 3)
        bucket.tpot_p95 = round(float(p95) / float(pn), 3)
    bucket.tpot_worst = None if pworst is None else float(pworst)
    bucket.structured_closed, bucket.structured_cut, bucket.structured_refused = (
        int(v or 0) for v in values[17:20])
    return bucket


def _scope_where(model: str | None, device: str | None, fleet: str | None,
                 prefix: str = "") -> tuple[list[str], list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    for column, value in (("model", model), ("device", device), ("fleet", fleet)):
        if value:
            where.append(f"{prefix}{column} = ?")
            params.append(value)
    return where, params


class SLOQueries:
    """The SLO series, each call in a transaction of the store that holds this object
    (`sql.SQLStore.slo`): `tx` opens a write, `read` a read. The ingest writes through
    `metrics_message` / `errors_event` inside its own transaction."""

    def __init__(self, tx: Callable[[], AbstractContextManager[Exec]],
                 read: Callable[[], AbstractContextManager[Exec]]) -> None:
        self._tx = tx
        self._read = read

    # -- written at ingest ------------------------------------------------------------

    @staticmethod
    def metrics_message(db: Exec, msg: Inbound, minutes: MinuteSums | None = None) -> None:
        """The message's rows; its figures also added to `minutes` (per minute, fleet and
        model), which the ingest writes once its batch is read (`write_minutes`)."""
        start, end, rows = interval_rows(msg.body, msg.ts)
        if end is None:
            return
        assert start is not None
        if minutes is not None:
            # The minute (m, m + 60] it ended in, as the intervals' buckets count.
            minute = (math.ceil(end) - 1) // 60
            minutes.add_degradations(minute, msg.fleet, msg.body)
            for r in rows:
                minutes.add(minute, msg.fleet, r)
        if not rows:
            return
        db.many(
            "INSERT INTO slo_intervals (device, boot_id, seq, model, fleet, start_ts, end_ts, "
            "requests, ok, client_errors, server_errors, tokens_out, ttft_p50, ttft_p95, "
            "ttft_n, tpot_p50, tpot_p95, tpot_n, upstream, feedback_good, feedback_bad, "
            f"{', '.join(_STRUCTURED)}) VALUES ({', '.join('?' * (21 + len(_STRUCTURED)))}) "
            "ON CONFLICT DO NOTHING",
            [(msg.device, msg.boot_id, msg.seq, r.model, msg.fleet, start, end, r.requests,
              r.ok, r.client_errors, r.server_errors, r.tokens_out, r.ttft[0], r.ttft[1],
              r.ttft[2], r.tpot[0], r.tpot[1], r.tpot[2], r.upstream, r.feedback_good,
              r.feedback_bad, *r.structured) for r in rows])
        db.many(_TOTALS_UPSERT, [
            (msg.device, r.model, msg.fleet, r.ok, r.client_errors, r.server_errors,
             r.tokens_out, r.upstream, r.feedback_good, r.feedback_bad, r.ttft[0], r.ttft[1],
             r.tpot[0], r.tpot[1], end) for r in rows])

    @staticmethod
    def write_minutes(db: Exec, minutes: MinuteSums) -> None:
        """A batch's per-minute sums, added in key order: two controllers adding to the
        same minutes (one PostgreSQL) then take the rows' locks in one order, never in a
        circle."""
        if minutes.sums:
            db.many(_MINUTES_UPSERT, [(*key, *values, *minutes.worst[key])
                                      for key, values in sorted(minutes.sums.items())])
        if minutes.degraded:
            db.many(_DEGRADATIONS_UPSERT, [(*key, n) for key, n in
                                           sorted(minutes.degraded.items())])

    @staticmethod
    def errors_event(db: Exec, msg: Inbound) -> None:
        """An `errors` event: failed requests of the interval by model, status and type."""
        interval = msg.body.get("interval")
        end = _ms(interval.get("end")) if isinstance(interval, Mapping) else None
        errors = msg.body.get("errors")
        if not isinstance(errors, list):
            raise ValueError("errors must be a list")
        counts: dict[tuple[str, int, str], int] = {}
        for e in errors:
            if not isinstance(e, Mapping):
                continue
            status = e.get("status")
            key = (str(e.get("model") or "(none)")[:200],
                   int(status) if isinstance(status, int) and not isinstance(status, bool)
                   else 0, str(e.get("type") or "")[:100])
            counts[key] = counts.get(key, 0) + _count(e.get("count"))
        db.many("INSERT INTO slo_errors (device, boot_id, seq, model, status, type, fleet, "
                "end_ts, count) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [(msg.device, msg.boot_id, msg.seq, m, s, t, msg.fleet,
                  msg.ts if end is None else end, n) for (m, s, t), n in counts.items() if n])

    # -- read ---------------------------------------------------------------------------

    def series(self, *, since: float, until: float, step: float | None = None,
               model: str | None = None, device: str | None = None,
               fleet: str | None = None) -> Series:
        """Buckets of `step` seconds (None: `step_for` the window) from `since` to `until`
        for the scope given (none: the fleet), the releases that started in the window as
        markers, and the error types seen in it."""
        step = float(max(60, round((step or step_for(until - since)) / 60) * 60))
        since = math.floor(since / step) * step
        where, params = _scope_where(model, device, fleet)
        with self._read() as db:
            if device is None:
                # The fleet, a fleet or a model: the per-minute sums, whatever the boxes.
                # A minute's intervals are those that ended in it.
                where += ["minute >= ?", "minute < ?"]
                params += [int(since // 60), math.ceil(until / 60)]
                rows = db.rows(
                    f"SELECT (minute * 60 - ?) / ?, {_MINUTE_AGGREGATES} FROM slo_minutes "
                    f"WHERE {' AND '.join(where)} GROUP BY 1 ORDER BY 1",
                    [int(since), int(step), *params])
            else:
                # One box: its intervals. A bucket holds the intervals that ended in
                # (start, start + step] (one that ended on the minute is that minute's).
                # Integer division, the same in both databases (SQLite may lack FLOOR).
                where += ["end_ts > ?", "end_ts <= ?"]
                params += [since, until]
                rows = db.rows(
                    f"SELECT (CAST(end_ts AS BIGINT) - ? - 1) / ?, {_aggregates()} "
                    f"FROM slo_intervals WHERE {' AND '.join(where)} GROUP BY 1 ORDER BY 1",
                    [int(since), int(step), *params])
            markers = _markers(db, since, until)
            ewhere, eparams = _scope_where(model, device, fleet)
            ewhere += ["end_ts > ?", "end_ts <= ?"]
            errors = db.rows(
                f"SELECT model, status, type, SUM(count) FROM slo_errors "
                f"WHERE {' AND '.join(ewhere)} GROUP BY 1, 2, 3 ORDER BY 4 DESC LIMIT 50",
                [*eparams, since, until])
            dwhere, dparams = _scope_where(None, None, fleet)
            dwhere += ["minute >= ?", "minute < ?"]
            degraded = db.rows(
                f"SELECT (minute * 60 - ?) / ?, tier, SUM(count) FROM slo_degradations "
                f"WHERE {' AND '.join(dwhere)} GROUP BY 1, 2",
                [int(since), int(step), *dparams, int(since // 60), math.ceil(until / 60)]) \
                if device is None else []
        by_index = {max(0, int(r[0])): r[1:] for r in rows}
        n = max(1, math.ceil((until - since) / step))
        buckets = [_fill(Bucket(since + i * step), by_index[i]) if i in by_index
                   else Bucket(since + i * step) for i in range(n)]
        for index, tier, count in degraded:
            if 0 <= int(index) < n:
                buckets[int(index)].degraded[str(tier)] = int(count)
        return Series(since, until, step, {"model": model, "device": device, "fleet": fleet},
                      buckets, markers,
                      [{"model": m, "status": int(s), "type": t, "count": int(c)}
                       for m, s, t, c in errors])

    def release_impact(self, rollout_id: str, *, window_s: float) -> dict[str, Any] | None:
        """Per wave of a rollout: the same `window_s` before each box started the release
        and after it finished, for the rollout's model (every model for a capacity or
        agent release, or where the model's name never reported). None: no such rollout."""
        with self._read() as db:
            found = db.rows("SELECT name, version, config FROM rollouts WHERE id = ?",
                            [rollout_id])
            if not found:
                return None
            name, version, config = found[0]
            model_filter, params = "", []
            if config is None and db.rows(
                    "SELECT 1 FROM slo_intervals s JOIN rollout_devices rd "
                    "ON rd.device = s.device WHERE rd.rollout_id = ? AND s.model = ? LIMIT 1",
                    [rollout_id, name]):
                model_filter, params = " AND s.model = ?", [name]
            side = ("CASE WHEN s.end_ts <= rd.started_at THEN 'before' ELSE 'after' END")
            rows = db.rows(
                f"SELECT rd.wave, {side}, {_aggregates('s.')} FROM rollout_devices rd "
                f"JOIN slo_intervals s ON s.device = rd.device "
                f"WHERE rd.rollout_id = ? AND rd.started_at IS NOT NULL{model_filter} AND ("
                f"(s.end_ts <= rd.started_at AND s.end_ts > rd.started_at - ?) OR "
                f"(rd.finished_at IS NOT NULL AND s.start_ts >= rd.finished_at "
                f"AND s.start_ts < rd.finished_at + ?)) GROUP BY 1, 2 ORDER BY 1, 2",
                [rollout_id, *params, window_s, window_s])
            waves = db.rows("SELECT wave, COUNT(*), SUM(CASE WHEN finished_at IS NULL "
                            "THEN 0 ELSE 1 END) FROM rollout_devices WHERE rollout_id = ? "
                            "GROUP BY 1 ORDER BY 1", [rollout_id])
        sides: dict[tuple[int, str], Bucket] = {
            (int(r[0]), str(r[1])): _fill(Bucket(0.0), r[2:]) for r in rows}
        out = []
        for wave, devices, finished in waves:
            before = sides.get((int(wave), "before"), Bucket(0.0))
            after = sides.get((int(wave), "after"), Bucket(0.0))
            out.append({"wave": int(wave), "devices": int(devices),
                        "finished": int(finished or 0),
                        "before": before.to_json(window_s), "after": after.to_json(window_s),
                        "change": _change(before, after)})
        return {"rollout": rollout_id, "name": name, "version": version,
                "model": params[0] if params else None, "window_s": window_s, "waves": out}

    def window(self, *, model: str | None, since: float, until: float) -> Bucket:
        """The fleet's figures for `model` (None: every model) over one window, from the
        per-minute sums (the minutes that ended within it)."""
        where, params = _scope_where(model, None, None)
        where += ["minute >= ?", "minute * 60 + 60 <= ?"]
        params += [math.ceil(since / 60), until]
        with self._read() as db:
            rows = db.rows(f"SELECT {_MINUTE_AGGREGATES} FROM slo_minutes "
                           f"WHERE {' AND '.join(where)}", params)
        return _fill(Bucket(since), rows[0]) if rows and rows[0][0] is not None \
            else Bucket(since)

    def kinds(self, *, model: str, since: float, until: float) -> tuple[int, dict[str, int]]:
        """(requests, requests of each task kind) the boxes served with `model` over the
        window; a request counts in its dialect (one of the two) and in each of the others
        it is, so the requests are the two dialects' sum (the box's requests total also
        counts refusals at the model and its health gate's probes, which have no kind)."""
        columns = ", ".join(f"SUM(kind_{k})" for k in KINDS)
        with self._read() as db:
            rows = db.rows(f"SELECT {columns} FROM slo_minutes WHERE "
                           f"model = ? AND minute >= ? AND minute * 60 + 60 <= ?",
                           [model, math.ceil(since / 60), until])
        kinds = {k: int(v or 0) for k, v in zip(KINDS, rows[0] if rows else (), strict=False)}
        kinds = {k: kinds.get(k, 0) for k in KINDS}
        return kinds["ollama"] + kinds["openai"], kinds

    def feedback_sums(self, *, since: float, until: float | None = None,
                      device: str | None = None) -> list[dict[str, Any]]:
        """Per box and model with a verdict in the window [since, until): its fleet, the
        verdicts by rating and the messages they came in; sorted by box, then model."""
        where, params = _scope_where(None, device, None)
        where += ["end_ts >= ?", "feedback_good + feedback_bad > 0"]
        params.append(since)
        if until is not None:
            where.append("end_ts < ?")
            params.append(until)
        with self._read() as db:
            rows = db.rows(f"SELECT device, MAX(fleet), model, SUM(feedback_good), "
                           f"SUM(feedback_bad), COUNT(*) FROM slo_intervals "
                           f"WHERE {' AND '.join(where)} GROUP BY device, model "
                           f"ORDER BY device, model", params)
        return [{"device": d, "fleet": f, "model": m, "good": int(g), "bad": int(b),
                 "messages": int(n)} for d, f, m, g, b, n in rows]

    def totals(self) -> list[dict[str, Any]]:
        """Per box and model: running sums and the latest interval's percentiles."""
        cols = ("device", "model", "fleet", *_SUMS, *_LATEST, "last_end")
        with self._read() as db:
            rows = db.rows(f"SELECT {', '.join(cols)} FROM slo_totals ORDER BY device, model")
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def markers(self, since: float, until: float) -> list[dict[str, Any]]:
        with self._read() as db:
            return _markers(db, since, until)

    def releases(self) -> list[dict[str, Any]]:
        """Every rollout's start, for the export (one series each, the newest 200)."""
        with self._read() as db:
            return _markers(db, 0.0, math.inf, limit=200)


def _markers(db: Exec, since: float, until: float, limit: int = 500) -> list[dict[str, Any]]:
    """Rollouts (model, capacity and agent releases) created in the window."""
    rows = db.rows("SELECT id, name, version, state, created_at, config FROM rollouts "
                   "WHERE created_at >= ? AND created_at < ? ORDER BY created_at DESC LIMIT ?",
                   [since, until if math.isfinite(until) else 1e18, limit])
    return [{"rollout": r[0], "name": r[1], "version": r[2], "state": r[3], "at": float(r[4]),
             "kind": "capacity" if r[5] is not None else "agent" if is_agent_name(r[1])
             else "model"} for r in reversed(rows)]


def _change(before: Bucket, after: Bucket) -> dict[str, float | None]:
    """After / before, for the figures where both sides have one."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(b / a, 3) if a and b is not None else None
    return {"ttft_p95": ratio(before.ttft_p95, after.ttft_p95),
            "tpot_p95": ratio(before.tpot_p95, after.tpot_p95),
            "error_rate": None if before.error_rate() is None or after.error_rate() is None
            else round((after.error_rate() or 0.0) - (before.error_rate() or 0.0), 4)}
