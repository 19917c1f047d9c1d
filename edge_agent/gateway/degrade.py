"""Degradation by risk tier: what a saturated box does with a request, instead of one 503
for everyone.

Saturated means the model asked cannot take the request now: its queue is full; or it is
not loaded and the memory it needs is held by models serving requests; or requests wait
for it already and the request's own deadline ends before its turn would come. Then, by the
request's tier ([risk] in the settings):

- low: queued for later as a one-line batch, when the client said it accepts that
  (`X-Edge-Defer: batch`); else 503 with Retry-After;
- normal: answered by the model's `fallback` ([models."name"]) if it is installed and the
  tenant may use it, the answer naming the model that wrote it; else 503;
- high: never another model; 503 with Retry-After and the reason.

An embedding is refused on a saturated model whatever its tier (`refuse_embedding`): its
vectors are compared with others the same model made (a store's search index), and
another model's would not compare, so a fallback would corrupt the index without a word;
nor can it be deferred (a batch is a chat completion's later answer).

Every degradation (fallback, queued, refused) is noted on the request's ledger row (tier,
reason, the model asked) and counted in `edge_agent_degradations_total`. A request that
was not saturated is not degraded, whatever its tier: the tier only decides what happens
when the box cannot serve it as asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from edge_agent.config import Settings
from edge_agent.errors import (
    DeadlineUnmet,
    Deferrable,
    EdgeAgentError,
    MemoryShort,
    ModelNotFound,
    NotDegraded,
    QueueFull,
)
from edge_agent.governance.tenants import TenantContext
from edge_agent.logs import note
from edge_agent.names import ModelName
from edge_agent.telemetry.metrics import Metrics

_CAUSES = {"queue_full": "the queue for model '{model}' is full",
           "memory": "no memory is free to load model '{model}'",
           "deadline": "the request's deadline ends before model '{model}' could start it"}


def saturation(exc: BaseException) -> str | None:
    """The reason `exc` means the box is saturated ('queue_full', 'memory', 'deadline'),
    or None."""
    if isinstance(exc, QueueFull):
        return "queue_full"
    if isinstance(exc, DeadlineUnmet):
        return "deadline"
    if isinstance(exc, MemoryShort):
        return "memory"
    return None


@dataclass(frozen=True)
class Degradation:
    """A request served otherwise than asked: by the fallback model (its row's `model` is
    the one that answered; `requested` the one asked)."""

    tier: str
    reason: str
    action: str  # fallback | queued | refused
    requested: str

    def header(self) -> str:
        """`X-Edge-Degraded`, so the client that got a fallback's answer can tell."""
        return (f"{self.action}; tier={self.tier}; reason={self.reason}; "
                f"requested={self.requested}")


class RiskPolicy:
    def __init__(self, settings: Settings, metrics: Metrics | None,
                 installed: Callable[[ModelName], bool]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.installed = installed
        self.can_defer = False  # set by the app when a batch queue takes deferred requests

    @staticmethod
    def tier(tenant: TenantContext | None, asked: str | None) -> str:
        tier = tenant.tier(asked) if tenant is not None else asked or "normal"
        note(risk_tier=tier)
        return tier

    def degrade(self, tier: str, reason: str, name: ModelName, tenant: TenantContext | None,
                cause: EdgeAgentError, *, defer: bool) -> ModelName:
        """The model a normal-tier request goes to instead of `name`; raises the tier's
        refusal when there is none it may use (Deferrable for a low one that may wait)."""
        if tier == "low":
            raise self._low(reason, name, cause, defer)
        if tier == "high":
            raise self.refuse(tier, reason, name, cause, "not degraded")
        if self.settings.risk.normal != "fallback":
            raise self.refuse(tier, reason, name, cause, "not degraded ([risk] normal = "
                              "\"refuse\")")
        configured = self.settings.model_override(str(name)).fallback
        if configured is None:
            raise self.refuse(tier, reason, name, cause, "no fallback model is set")
        fallback = ModelName.parse(configured)
        if tenant is not None and not tenant.allows(fallback):
            raise self.refuse(tier, reason, name, cause,
                              f"tenant '{tenant.name}' may not use the fallback model")
        if fallback == name or not self._installed(fallback):
            raise self.refuse(tier, reason, name, cause,
                              f"the fallback model '{fallback}' is not installed")
        return fallback

    def fell_back(self, tier: str, reason: str, name: ModelName) -> Degradation:
        return self._record(Degradation(tier, reason, "fallback", str(name)))

    def fallback_failed(self, tier: str, reason: str, name: ModelName, fallback: ModelName,
                        exc: EdgeAgentError) -> NotDegraded:
        """The fallback model is saturated too (or cannot load): the original refusal."""
        return self.refuse(tier, reason, name, exc,
                           f"its fallback model '{fallback}' is unavailable too")

    def deferred(self, exc: Deferrable) -> Degradation:
        """The API queued a Deferrable request as a batch."""
        return self._record(Degradation(exc.tier, exc.reason, "queued", exc.model))

    def refuse(self, tier: str, reason: str, name: ModelName, cause: EdgeAgentError,
               why: str) -> NotDegraded:
        self._record(Degradation(tier, reason, "refused", str(name)))
        return NotDegraded(self._message(tier, reason, name, why),
                           retry_after=self._retry_after(cause))

    def refuse_embedding(self, tier: str, reason: str, name: ModelName,
                         cause: EdgeAgentError) -> NotDegraded:
        """The refusal of an embedding on a saturated model, for every tier: vectors from
        another model do not compare with the asked model's, so a fallback's answer would
        be silently wrong wherever they are searched together."""
        return self.refuse(tier, reason, name, cause,
                           "not degraded: an embedding is never answered by another model "
                           "(its vectors would not compare)")

    def _low(self, reason: str, name: ModelName, cause: EdgeAgentError, defer: bool
             ) -> NotDegraded:
        if not defer:
            return self.refuse("low", reason, name, cause, "not queued: send X-Edge-Defer: "
                               "batch to have it answered later, as a batch")
        if self.settings.risk.low == "refuse":
            return self.refuse("low", reason, name, cause, "not queued ([risk] low = "
                               "\"refuse\")")
        if not self.can_defer:
            return self.refuse("low", reason, name, cause, "not queued: this box has no "
                               "batch queue")
        return Deferrable(self._message("low", reason, name, "not queued"), tier="low",
                          reason=reason, model=str(name), retry_after=self._retry_after(cause))

    def _installed(self, name: ModelName) -> bool:
        try:
            return self.installed(name)
        except ModelNotFound:
            return False

    def _record(self, degradation: Degradation) -> Degradation:
        note(degradation=degradation.action, degradation_reason=degradation.reason,
             requested_model=degradation.requested)
        if self.metrics is not None:
            self.metrics.observe_degradation(degradation.tier, degradation.reason,
                                             degradation.action)
        return degradation

    def _retry_after(self, cause: EdgeAgentError) -> float:
        return max(self.settings.risk.retry_after_s, cause.retry_after or 0.0)

    @staticmethod
    def _message(tier: str, reason: str, name: ModelName, why: str) -> str:
        return f"risk tier {tier}: {why} ({_CAUSES[reason].format(model=name)}); retry later"
