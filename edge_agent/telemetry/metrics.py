"""The Prometheus registry: request metrics observed as requests end, and live gauges
(scheduler state, loaded models, hardware) read at scrape time without locking the
decode loop. One registry per app — never prometheus-client's global one.

Series that llama.cpp's server also exports keep its names (`llamacpp:*`), so existing
dashboards work; everything else is `edge_agent_*`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge_agent.errors import (
    ContextLengthExceeded,
    EdgeAgentError,
    Forbidden,
    ModelNotFound,
    NotDegraded,
    PayloadTooLarge,
    QueueFull,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
    Unauthorized,
)
from edge_agent.telemetry.hardware import HardwareSampler
from edge_agent.telemetry.task_kinds import TASK_KINDS

if TYPE_CHECKING:
    from edge_agent.engine.registry import LoadedModel
    from edge_agent.engine.request import DoneEvent
    from edge_agent.engine.scheduling.prompt_cache import PromptCache
    from edge_agent.ledger.writer import LedgerWriter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


def rejection_reason(exc: EdgeAgentError) -> str:
    if isinstance(exc, Unauthorized):
        return "auth"
    if isinstance(exc, Forbidden):
        return "scope"
    if isinstance(exc, (ContextLengthExceeded, PayloadTooLarge)):
        return "limit"
    if isinstance(exc, RateLimited):
        return "quota"
    if isinstance(exc, NotDegraded):
        return "saturated"
    if isinstance(exc, QueueFull):
        return "queue_full"
    if isinstance(exc, ServiceUnavailable):
        return "unavailable"
    if isinstance(exc, RequestTimeout):
        return "timeout"
    if isinstance(exc, ModelNotFound):
        return "not_found"
    return "invalid" if exc.status_code < 500 else "error"


class Metrics:
    def __init__(self, loaded: Callable[[], list[LoadedModel]],
                 hardware: HardwareSampler | None = None,
                 ledger: Callable[[], LedgerWriter | None] | None = None,
                 prompt_cache: PromptCache | None = None) -> None:
        self.registry = CollectorRegistry()  # no auto-describe: live gauges read at scrape
        # Errors already counted: the metrics' own record, never a mark on the exception.
        self._counted: weakref.WeakSet[EdgeAgentError] = weakref.WeakSet()
        r = self.registry
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Prompt tokens evaluated",
                                     ["model"], registry=r)
        self.predicted = Counter("llamacpp:tokens_predicted", "Tokens generated", ["model"],
                                 registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Time spent on prompts",
                                      ["model"], registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds",
                                         "Time spent generating", ["model"], registry=r)
        labels = ["model", "dialect"]
        self.ttft = Histogram("edge_agent_time_to_first_token_seconds", "TTFT", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("edge_agent_time_per_output_token_seconds", "TPOT", labels,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("edge_agent_request_duration_seconds", "End-to-end duration",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("edge_agent_queue_wait_seconds", "Time queued", labels,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("edge_agent_requests", "Requests by outcome",
                                ["model", "dialect", "status", "error_type"], registry=r)
        self.rejections = Counter("edge_agent_rejections", "Requests refused, by reason",
                                  ["reason"], registry=r)
        self.cached = Counter("edge_agent_cached_prompt_tokens",
                              "Prompt tokens reused from the KV cache", ["model"], registry=r)
        self.structured_closed = Counter(
            "edge_agent_structured_closed", "JSON answers closed within their max_tokens by "
            "the last tokens of the budget (runtime.structured_close_tokens), instead of cut",
            ["model"], registry=r)
        self.structured_cut = Counter(
            "edge_agent_structured_cut", "Answers under a grammar (a JSON schema or tools) "
            "that ended incomplete, not a document (cut by max_tokens, cancelled): "
            "`structured_failure` on their ledger row",
            ["model"], registry=r)
        self.structured_refused = Counter(
            "edge_agent_structured_refused", "Requests refused (400) because the box cannot "
            "follow the structured output they asked for: a JSON schema, tools or tool_choice "
            "no grammar here can enforce or that exceeds a limit; by the installed model asked",
            ["model"], registry=r)
        self.degradations = Counter(
            "edge_agent_degradations", "Requests a saturated box served otherwise than asked, "
            "by risk tier, cause (queue_full, memory, deadline) and what it did (fallback: another "
            "model answered; queued: a one-line batch; refused: 503)",
            ["tier", "reason", "action"], registry=r)
        self.upstream_requests = Counter(
            "edge_agent_upstream_requests", "Requests sent to an upstream ([upstreams]), by "
            "upstream, why (not_installed, context, saturated, asked, route, batch) and how it "
            "went (ok, client_error, server_error, timeout, unreachable, too_large, broken)",
            ["upstream", "reason", "status"], registry=r)
        self.upstream_breaker = Gauge(
            "edge_agent_upstream_breaker_state", "Each upstream's circuit breaker: 0 closed "
            "(requests go), 1 half-open (a probe decides), 2 open (none go)", ["upstream"],
            registry=r)
        self.egress_entities = Counter(
            "edge_agent_egress_redacted_entities", "Personal data replaced by placeholders "
            "before a request left for an upstream (egress = \"redacted\"), by entity",
            ["upstream", "entity"], registry=r)
        self.feedback = Counter(
            "edge_agent_feedback", "Verdicts apps sent back on answers (POST "
            "/edge/v1/feedback), by the model that answered and rating (good, bad); a verdict "
            "that replaces an earlier one counts again", ["model", "rating"], registry=r)
        self.request_kinds = Counter(
            "edge_agent_request_kinds", "Generation requests that reached a model, by the "
            "task kinds they are of (ollama, openai: the dialect; schema: structured output "
            "asked; tools: tools given; long_context: a prompt of at least half the model's "
            "context per sequence or 8192 tokens, whichever is fewer); a request counts in "
            "each kind it is of",
            ["model", "kind"], registry=r)
        r.register(_LiveCollector(loaded, hardware, ledger or (lambda: None)))
        if prompt_cache is not None:
            r.register(_PromptCacheCollector(prompt_cache))

    def observe_done(self, model: str, dialect: str, done: DoneEvent, ttft_s: float, *,
                     engine: bool = True, cut: bool = False) -> None:
        """`engine` False: an upstream answered; its latency and outcome count with the
        box's requests, its tokens not in the engine's own (`llamacpp:*`) counters. `cut`:
        a structured answer that did not complete (the request path decides, as it does
        for the ledger row's `structured_failure`)."""
        u, t = done.usage, done.timings
        if engine:
            self.prompt_tokens.labels(model).inc(u.prompt_tokens - u.cached_tokens)
            self.predicted.labels(model).inc(u.completion_tokens)
            self.prompt_seconds.labels(model).inc(t.prompt_ns / 1e9)
            self.predicted_seconds.labels(model).inc(t.eval_ns / 1e9)
            self.cached.labels(model).inc(u.cached_tokens)
        self.ttft.labels(model, dialect).observe(ttft_s)
        if u.completion_tokens > 1:
            self.tpot.labels(model, dialect).observe(t.eval_ns / 1e9 / (u.completion_tokens - 1))
        self.e2e.labels(model, dialect).observe(t.total_ns / 1e9)
        self.queue_wait.labels(model, dialect).observe(t.queue_ns / 1e9)
        self.requests.labels(model, dialect, "200", "").inc()
        if done.closed:
            self.structured_closed.labels(model).inc()
        if cut:
            self.structured_cut.labels(model).inc()

    def observe_structured_refused(self, model: str) -> None:
        """A request refused for the schema or tools it asked to follow, beside its count
        in `edge_agent_requests_total` (400): `model` is an installed model's name, never
        the client's string, so the label set stays the box's own."""
        self.structured_refused.labels(model).inc()

    def observe_kinds(self, model: str, kinds: Iterable[str]) -> None:
        """Counts a request that reached `model` once in each of its `kinds`; a word that
        is not one of `task_kinds.TASK_KINDS` is dropped, so the label set stays fixed."""
        for kind in kinds:
            if kind in TASK_KINDS:
                self.request_kinds.labels(model, kind).inc()

    def observe_degradation(self, tier: str, reason: str, action: str) -> None:
        self.degradations.labels(tier, reason, action).inc()

    def observe_upstream(self, upstream: str, reason: str, status: str) -> None:
        self.upstream_requests.labels(upstream, reason, status).inc()

    def set_upstream_breaker(self, upstream: str, state: str) -> None:
        self.upstream_breaker.labels(upstream).set(
            {"closed": 0, "half_open": 1, "open": 2}[state])

    def observe_egress(self, upstream: str, entities: dict[str, int]) -> None:
        for entity, count in entities.items():
            self.egress_entities.labels(upstream, entity).inc(count)

    def observe_feedback(self, model: str, rating: str) -> None:
        self.feedback.labels(model, rating).inc()

    def observe_error(self, model: str, dialect: str, exc: EdgeAgentError) -> None:
        """Counts a request that ended in `exc`, once: the request path counts it with its
        model where it knows one, and the API's error handler, which sees every error that
        becomes a response, calls again without one (a no-op for an error seen before)."""
        if exc in self._counted:
            return
        self._counted.add(exc)
        self.requests.labels(model, dialect, str(exc.status_code), exc.error_type).inc()
        if exc.status_code != 500:
            self.rejections.labels(rejection_reason(exc)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PromptCacheCollector(Collector):
    """The prompt cache's counters and sizes (`engine.scheduling.prompt_cache`), read at
    scrape time. `tier`: `ram`, or `disk` for a hit on a state loaded from the disk tier
    (a system prompt kept across a restart) and for the disk tier's own size."""

    def __init__(self, cache: PromptCache) -> None:
        self._cache = cache

    def collect(self) -> Iterable[Metric]:
        st, cache = self._cache.stats, self._cache
        lookups = CounterMetricFamily(
            "edge_agent_prompt_cache_lookups", "Prompts looked up in the prompt cache")
        lookups.add_metric([], st.lookups)
        hits = CounterMetricFamily(
            "edge_agent_prompt_cache_hits", "Prompts started on a state restored from the "
            "prompt cache, by the tier it came from", labels=["tier"])
        for tier, n in st.hits.items():
            hits.add_metric([tier], n)
        restored = CounterMetricFamily(
            "edge_agent_prompt_cache_restored_tokens", "Prompt tokens restored from the "
            "prompt cache instead of computed")
        restored.add_metric([], st.restored_tokens)
        seconds = CounterMetricFamily(
            "edge_agent_prompt_cache_restore_seconds", "Time spent restoring states")
        seconds.add_metric([], st.restore_s)
        evictions = CounterMetricFamily(
            "edge_agent_prompt_cache_evictions", "States dropped from the RAM tier to stay "
            "within prompt_cache_mib")
        evictions.add_metric([], st.evictions)
        written = CounterMetricFamily(
            "edge_agent_prompt_cache_disk_writes", "System prompts' states written to the "
            "disk tier")
        written.add_metric([], st.disk_written)
        size = GaugeMetricFamily("edge_agent_prompt_cache_bytes", "Bytes each tier holds",
                                 labels=["tier"])
        size.add_metric(["ram"], st.ram_bytes)
        size.add_metric(["disk"], st.disk_bytes)
        entries = GaugeMetricFamily("edge_agent_prompt_cache_entries", "States each tier "
                                    "holds", labels=["tier"])
        entries.add_metric(["ram"], st.ram_entries)
        entries.add_metric(["disk"], st.disk_entries)
        limit = GaugeMetricFamily("edge_agent_prompt_cache_limit_bytes", "Each tier's bound",
                                  labels=["tier"])
        limit.add_metric(["ram"], cache.limit_bytes)
        limit.add_metric(["disk"], cache.disk.limit_bytes if cache.disk is not None else 0)
        yield from (lookups, hits, restored, seconds, evictions, written, size, entries, limit)


class _LiveCollector(Collector):
    def __init__(self, loaded: Callable[[], list[LoadedModel]],
                 hardware: HardwareSampler | None,
                 ledger: Callable[[], LedgerWriter | None]) -> None:
        self._loaded = loaded
        self._hardware = hardware
        self._ledger = ledger

    def collect(self) -> Iterable[Metric]:
        g = {name: GaugeMetricFamily(name, doc, labels=["model"]) for name, doc in (
            ("llamacpp:requests_processing", "Requests being decoded"),
            ("llamacpp:requests_deferred", "Requests waiting in the queue"),
            ("llamacpp:kv_cache_usage_ratio", "KV cells in use / all cells"),
            ("llamacpp:kv_cache_tokens", "KV cells in use"),
            ("edge_agent_kv_cache_cells", "KV cells in all"),
            ("edge_agent_batch_tokens", "Tokens in the last decode step"),
            ("edge_agent_model_memory_bytes", "Weights + KV cache of a loaded model"),
            ("edge_agent_parallel_sequences", "Sequences a loaded model decodes together"),
            ("edge_agent_decode_threads", "Threads a loaded model's passes use now (fewer "
             "while other processes keep cores busy: runtime.threads_follow_load)"),
        )}
        drafted = CounterMetricFamily(
            "edge_agent_draft_tokens", "Prompt-lookup draft tokens decoded (since the model "
            "was loaded)", labels=["model"])
        confirmed = CounterMetricFamily(
            "edge_agent_draft_accepted_tokens", "Of them, those the sampler confirmed",
            labels=["model"])
        put_back = CounterMetricFamily(
            "edge_agent_batch_lines_put_back", "Batch lines whose sequence the scheduler took "
            "back for other work, to run again later (since the model was loaded)",
            labels=["model"])
        loaded = GaugeMetricFamily("edge_agent_loaded_models", "Models resident")
        models = self._loaded()
        loaded.add_metric([], len(models))
        for m in models:
            st = m.worker.stats
            name: str = m.info.name
            g["llamacpp:requests_processing"].add_metric([name], st.running)
            g["llamacpp:requests_deferred"].add_metric([name], m.worker.queued)
            g["llamacpp:kv_cache_usage_ratio"].add_metric([name], st.kv_used / st.kv_total)
            g["llamacpp:kv_cache_tokens"].add_metric([name], st.kv_used)
            g["edge_agent_kv_cache_cells"].add_metric([name], st.kv_total)
            g["edge_agent_batch_tokens"].add_metric([name], st.last_step_tokens)
            g["edge_agent_model_memory_bytes"].add_metric([name], m.memory)
            g["edge_agent_parallel_sequences"].add_metric([name], m.parallel)
            g["edge_agent_decode_threads"].add_metric([name], m.worker.threads_now)
            drafted.add_metric([name], st.drafted)
            confirmed.add_metric([name], st.draft_accepted)
            put_back.add_metric([name], st.put_back)
        yield loaded
        yield from g.values()
        yield drafted
        yield confirmed
        yield put_back
        writer = self._ledger()
        if writer is not None:
            lag = GaugeMetricFamily("edge_agent_ledger_write_lag_seconds",
                                    "Age of the oldest ledger row not yet committed")
            lag.add_metric([], writer.lag_s)
            rows = GaugeMetricFamily("edge_agent_ledger_rows_written",
                                     "Ledger rows committed since start")
            rows.add_metric([], writer.rows_written)
            yield lag
            yield rows
        if self._hardware is None:
            return
        families: dict[str, GaugeMetricFamily] = {}
        for reading in self._hardware.snapshot:
            name = f"edge_agent_{reading.name}"
            fam = families.get(name)
            if fam is None:
                fam = families[name] = GaugeMetricFamily(
                    name, reading.help or name, labels=[k for k, _ in reading.labels])
            fam.add_metric([v for _, v in reading.labels], reading.value)
        yield from families.values()
