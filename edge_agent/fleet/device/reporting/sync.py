"""What the box tells the fleet on its own: `metrics`, `ledger` summaries and `events`,
produced on their intervals and handed to the outbox (`emit`, `Outbox.append`'s shape).

- `metrics` (class `metrics`, every `fleet.metrics_interval_s`): per model the requests by
  status, tokens in/out/cached and the cached share — deltas of the box's Prometheus
  counters since the last message —, TTFT and TPOT p50/p95 of the interval, the queue at
  the tick, the verdicts apps sent back on its answers (`feedback`: good and bad, from
  `edge_agent_feedback_total`, `fleet.protocol.feedback`), its requests by task kind
  (`kinds`, from `edge_agent_request_kinds_total`), its structured outputs closed, cut
  and refused (`structured`, from `edge_agent_structured_{closed,cut,refused}_total`);
  rejections by reason; degradations by risk tier, cause and action (`degradations`,
  from `edge_agent_degradations_total`); the hardware sampler's latest readings; the
  outbox's depth and oldest age. Counters reset with the process, so the first message
  after a start covers the time since that start.
- `ledger` (class `audit`, every `fleet.ledger_interval_s`, only when rows were
  committed): `fleet.device.reporting.ledger_summary` — counts, never text, each row exactly once.
- `events` (class `audit`): model installed / removed / activated / loaded / unloaded
  (polled every `events_interval_s` from `ModelOps`, or pushed by `model_event`),
  readiness changes, and failed requests by type (with each metrics tick, from the same
  counter snapshot). After any change of the models (and at the first poll: what the
  birth told may be stale by then, a first start installs the default after it), a
  `models.state` event carries the whole list the birth carries (`birth.models`): the
  controller's view of the box is current without a rebirth (Sparkplug's DATA on
  change), and durable, through the outbox.

Percentiles come from the ledger's rows, not from the histograms' buckets: the rows hold
each request's exact TTFT and TPOT, the read is one range scan on the primary key over
the interval's rows (a few thousand at most), and a p95 from buckets is only known to lie
somewhere in its bucket — up to 2x off with these bounds (0.5-1 s, 1-2.5 s). The same
rows are the ones the counters count (both are written as a request ends; the ledger's
batch window may move a row to the next interval).

Every body passes `fleet.device.reporting.privacy.screen` before it is emitted. A tick that fails is
logged once (then quietly, until it succeeds again), counted in `failures`, and leaves its
baseline where it was, so the next tick covers the failed interval too.

Threads: `tick_*` do blocking reads (SQLite, models.db) and run off the event loop
(`run` uses `asyncio.to_thread`), one at a time. `model_event` may be called from any
thread. Must never: read prompt or completion text or the ledger's content table, import
the scheduler, the runtime or the registry, or let a failure reach the caller of `run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from edge_agent.fleet.device.link import birth
from edge_agent.fleet.device.link.outbox import OutboxStats
from edge_agent.fleet.device.reporting import summaries
from edge_agent.fleet.device.reporting.ledger_summary import (
    LedgerSummaries,
    latencies,
    max_rowid,
)
from edge_agent.fleet.device.reporting.privacy import TEXT_LIMIT, screen
from edge_agent.fleet.protocol.envelope import AUDIT, METRICS
from edge_agent.names import ModelName
from edge_agent.telemetry.hardware import Reading

log = logging.getLogger(__name__)
MODEL_EVENTS = frozenset({"model.installed", "model.removed", "model.activated",
                          "model.loaded", "model.unloaded"})
KINDS = ("events", "metrics", "ledger")


class Emit(Protocol):
    """`Outbox.append`: buffers the message (commits it too when `commit`); its seq."""

    def __call__(self, kind: str, cls: str, body: Mapping[str, Any], *,
                 commit: bool = False) -> int: ...


class Named(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def digest(self) -> str: ...


class Serving(Protocol):
    @property
    def info(self) -> Named: ...


class ModelView(Protocol):
    """What sync reads of the models (`engine.modelops.ModelOps` is one)."""

    def installed(self) -> Sequence[Named]: ...

    def loaded(self) -> Sequence[Serving]: ...

    def is_installed(self, name: ModelName) -> bool: ...

    def versions(self, name: ModelName) -> Sequence[Any]: ...


class Sync:
    def __init__(self, *, emit: Emit, ledger_path: Path, state_path: Path,
                 metrics: summaries.MetricsSource | None = None,
                 hardware: Callable[[], Sequence[Reading]] | None = None,
                 outbox_stats: Callable[[], OutboxStats | None] | None = None,
                 models: ModelView | None = None,
                 ready: Callable[[], bool] | None = None,
                 metrics_interval_s: float = 60.0, ledger_interval_s: float = 60.0,
                 events_interval_s: float = 5.0, text_limit: int = TEXT_LIMIT,
                 clock: Callable[[], float] = time.time) -> None:
        """`emit`: `outbox.append`. `ledger_path`: ledger.db (read only). `state_path`: the
        watermark file (`<state_dir>/fleet-sync.json`). `metrics`: the Prometheus registry
        (`Metrics.registry`; None with telemetry.metrics off: no request figures).
        `hardware`: the latest readings (`lambda: sampler.snapshot`). `outbox_stats`:
        `outbox.stats`. `models`: the app's `ModelOps`. `ready`: whether /ready would say
        ready. Whatever is None is left out of the bodies. Reads the ledger's last rowid
        (latencies count from the start, like the counters): build it at start-up, and
        let `run` end before the outbox closes (its last ticks append)."""
        self._emit_fn = emit
        self._metrics = metrics
        self._hardware = hardware
        self._outbox_stats = outbox_stats
        self._models = models
        self._ready = ready
        self._clock = clock
        self.text_limit = text_limit
        self.ledger_path = ledger_path
        self.intervals = {"metrics": metrics_interval_s, "ledger": ledger_interval_s,
                          "events": events_interval_s}
        # A ledger row's name is the client's string: parsed here, where it enters.
        known = (lambda name: models.is_installed(ModelName.parse(name))) \
            if models is not None else None
        self.ledger = LedgerSummaries(ledger_path, state_path, known)
        self.failures = dict.fromkeys(KINDS, 0)  # ticks failed, all time
        self.withheld = 0  # strings the privacy screen kept off the wire
        self._failing = dict.fromkeys(KINDS, False)
        self._withheld_logged = False
        self._lock = threading.Lock()  # the model baseline, shared with model_event
        # Metrics baseline: counters at the last message (the process's start: none).
        self._counters: summaries.Series = {}
        self._metrics_start = clock()
        self._latency_rowid: int | None = _start_rowid(ledger_path)
        # Events baseline: None until the first tick (the birth message tells the state).
        self._installed: dict[str, str] | None = None
        self._loaded: set[tuple[str, str]] = set()
        self._hook_gen = 0
        self._was_ready: bool | None = None
        self._state: list[dict[str, Any]] | None = None  # the last models.state sent

    # -- configuration -------------------------------------------------------------------

    def set_intervals(self, *, metrics_s: float | None = None,
                      ledger_s: float | None = None) -> None:
        """A `config.patch` of `fleet.metrics_interval_s` / `fleet.ledger_interval_s`,
        live: `run` uses the new value from its next wake-up (within a second)."""
        for kind, value in (("metrics", metrics_s), ("ledger", ledger_s)):
            if value is not None:
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"{kind} interval {value!r} is not a positive number")
                self.intervals[kind] = float(value)

    # -- ticks ---------------------------------------------------------------------------

    def tick_metrics(self, now: float | None = None) -> bool:
        return self._guarded("metrics", self._tick_metrics, now)

    def tick_ledger(self, now: float | None = None) -> bool:
        return self._guarded("ledger", self._tick_ledger, now)

    def tick_events(self, now: float | None = None) -> bool:
        return self._guarded("events", self._tick_events, now)

    def _tick_metrics(self, now: float) -> None:
        counters: summaries.Series = {}
        gauges: summaries.Series = {}
        if self._metrics is not None:
            counters, gauges = summaries.read_series(self._metrics)
        gained = summaries.deltas(counters, self._counters)
        lat: dict[str, tuple[list[float], list[float]]] = {}
        rowid = self._latency_rowid
        if rowid is None:  # the ledger was unreadable at start: begin here
            with contextlib.suppress(FileNotFoundError):
                rowid = max_rowid(self.ledger_path)
        else:
            with contextlib.suppress(FileNotFoundError):
                lat, rowid = latencies(self.ledger_path, rowid)
        interval = {"start": self._metrics_start, "end": now}
        body: dict[str, Any] = {
            "interval": interval,
            "models": summaries.model_metrics(gained, gauges, lat),
            "rejections": summaries.rejections(gained),
            "degradations": summaries.degradations(gained),
            "upstream": summaries.upstream_share(gained),
            "prompt_cache": summaries.prompt_cache(gained, gauges),
            "hardware": summaries.hardware(self._hardware()) if self._hardware else {},
        }
        st = self._outbox_stats() if self._outbox_stats is not None else None
        if st is not None:  # None: the outbox is not open (yet, or any more)
            body["outbox"] = {"depth": st.depth, "bytes": st.bytes,
                              "oldest_age_s": round(st.oldest_age_s, 3),
                              "buffered": st.buffered, "dropped_rows": st.dropped_rows,
                              "refused": st.refused}
        failed = summaries.errors(gained)
        self._emit("metrics", body)
        if failed:
            self._emit("events", {"event": "errors", "interval": interval, "errors": failed})
        self._counters, self._metrics_start, self._latency_rowid = counters, now, rowid

    def _tick_ledger(self, now: float) -> None:
        prepared = self.ledger.prepare(now)
        if prepared is None:
            return
        rng, body = prepared
        # Committed before the watermark moves: a summary is never lost with its rows.
        self._emit("ledger", body, commit=True)
        self.ledger.commit(rng)

    def _tick_events(self, now: float) -> None:
        if self._models is not None:
            with self._lock:
                gen = self._hook_gen
            installed = {m.name: m.digest for m in self._models.installed()}
            loaded = {(s.info.name, s.info.digest) for s in self._models.loaded()}
            with self._lock:
                # A hook reported a change while we read: our read may predate it.
                if gen == self._hook_gen:
                    for body in _model_changes(self._installed, installed, self._loaded,
                                               loaded):
                        self._emit("events", body, commit=True)
                    self._installed, self._loaded = installed, loaded
            state = birth.models(self._models)  # type: ignore[arg-type]
            if state != self._state:
                self._emit("events", {"event": "models.state", "models": state}, commit=True)
                self._state = state
        if self._ready is not None:
            ready = bool(self._ready())
            if ready != self._was_ready:
                self._emit("events", {"event": "readiness", "ready": ready,
                                      "previous": self._was_ready}, commit=True)
                self._was_ready = ready

    def model_event(self, event: str, name: str, digest: str | None = None,
                    previous: str | None = None) -> None:
        """A hook for the app: a model change as it happens (any thread; buffered in the
        outbox, not committed). The poll then takes it as known and does not repeat it."""
        if event not in MODEL_EVENTS:
            raise ValueError(f"unknown model event {event!r}; one of {sorted(MODEL_EVENTS)}")
        body: dict[str, Any] = {"event": event, "name": name}
        if digest is not None:
            body["digest"] = digest
        if previous is not None:
            body["previous"] = previous
        with self._lock:
            self._hook_gen += 1
            self._emit("events", body)
            if self._installed is not None:
                if event in ("model.installed", "model.activated") and digest:
                    self._installed[name] = digest
                elif event == "model.removed":
                    self._installed.pop(name, None)
            if event == "model.loaded" and digest:
                self._loaded.add((name, digest))
            elif event == "model.unloaded":
                self._loaded = {m for m in self._loaded
                                if m[0] != name or digest not in (None, m[1])}

    # -- running -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, final: bool = True) -> None:
        """Ticks until `stop` is set: events and the ledger at once (a backlog from before
        a restart goes out first), metrics after one interval; then, with `final`, one
        last metrics and ledger tick so a clean stop loses no interval."""
        ticks = {"events": self.tick_events, "metrics": self.tick_metrics,
                 "ledger": self.tick_ledger}
        started = time.monotonic()
        last = {"events": -math.inf, "metrics": started, "ledger": -math.inf}
        while not stop.is_set():
            for kind in KINDS:
                if time.monotonic() - last[kind] >= self.intervals[kind]:
                    last[kind] = time.monotonic()
                    await asyncio.to_thread(ticks[kind])
            due = min(last[k] + self.intervals[k] for k in KINDS) - time.monotonic()
            # At most a second asleep, so a new interval from set_intervals applies soon.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(max(due, 0.0), 1.0))
        if final:
            await asyncio.to_thread(self.tick_metrics)
            await asyncio.to_thread(self.tick_ledger)

    # -- inside --------------------------------------------------------------------------

    def _guarded(self, kind: str, tick: Callable[[float], None], now: float | None) -> bool:
        """Runs a tick; a failure is counted and logged once per run of failures."""
        try:
            tick(self._clock() if now is None else now)
        except Exception:
            self.failures[kind] += 1
            if not self._failing[kind]:
                log.exception("fleet sync: the %s tick failed (logged once until it works "
                              "again; the next tick covers this interval)", kind)
                self._failing[kind] = True
            else:
                log.debug("fleet sync: the %s tick failed again", kind, exc_info=True)
            return False
        if self._failing[kind]:
            log.info("fleet sync: the %s tick works again", kind)
            self._failing[kind] = False
        return True

    def _emit(self, kind: str, body: Mapping[str, Any], *, commit: bool = False) -> int:
        screened = screen(body, self.text_limit)
        if screened.withheld:
            self.withheld += len(screened.withheld)
            if not self._withheld_logged:
                log.warning("fleet sync withheld %d strings that are not names or ids from a "
                            "%s message (at %s); logged once", len(screened.withheld), kind,
                            ", ".join(screened.withheld[:5]))
                self._withheld_logged = True
        cls = METRICS if kind == "metrics" else AUDIT
        return self._emit_fn(kind, cls, screened.body, commit=commit)


def _start_rowid(ledger_path: Path) -> int | None:
    """The ledger's last rowid at start: latencies count from here, like the counters."""
    try:
        return max_rowid(ledger_path)
    except FileNotFoundError:
        return 0  # no ledger yet: every row will be new
    except Exception as exc:
        log.warning("fleet sync: ledger %s unreadable at start (%s)", ledger_path, exc)
        return None


def _model_changes(before: dict[str, str] | None, now: dict[str, str],
                   loaded_before: set[tuple[str, str]], loaded_now: set[tuple[str, str]]
                   ) -> list[dict[str, Any]]:
    """Events for the difference of two polls. `before` None: the first poll, whose
    installed set the birth message already told (loaded models are still reported)."""
    out: list[dict[str, Any]] = []
    if before is not None:
        for name in sorted(now.keys() - before.keys()):
            out.append({"event": "model.installed", "name": name, "digest": now[name]})
        for name in sorted(before.keys() & now.keys()):
            if before[name] != now[name]:
                out.append({"event": "model.activated", "name": name, "digest": now[name],
                            "previous": before[name]})
        for name in sorted(before.keys() - now.keys()):
            out.append({"event": "model.removed", "name": name, "previous": before[name]})
    for name, digest in sorted(loaded_before - loaded_now):
        out.append({"event": "model.unloaded", "name": name, "digest": digest})
    for name, digest in sorted(loaded_now - loaded_before):
        out.append({"event": "model.loaded", "name": name, "digest": digest})
    return out
