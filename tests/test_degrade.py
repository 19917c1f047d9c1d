"""The risk-tier policy alone: which saturation it degrades, and how, by tier."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.config import load_settings
from edge_agent.errors import (
    Deferrable,
    MemoryShort,
    NotDegraded,
    QueueFull,
    RequestTimeout,
    ServiceUnavailable,
)
from edge_agent.gateway.degrade import RiskPolicy, saturation
from edge_agent.governance.tenants import RiskTierNotAllowed, TenantContext
from edge_agent.names import ModelName
from edge_agent.telemetry.metrics import Metrics

SMOL, GEMMA = ModelName.parse("smollm2:135m"), ModelName.parse("gemma3:270m")


def _policy(tmp_path: Any, installed: tuple[ModelName, ...] = (SMOL, GEMMA), **flags: Any
            ) -> tuple[RiskPolicy, Metrics]:
    settings = load_settings(None, state_dir=tmp_path, **{
        "models": {str(SMOL): {"fallback": str(GEMMA)}}, **flags})
    metrics = Metrics(lambda: [])
    return RiskPolicy(settings, metrics, lambda name: name in installed), metrics


def _tenant(**policy: Any) -> TenantContext:
    from edge_agent.config import TenantPolicy

    return TenantContext("shop", TenantPolicy.model_validate(policy))


def _count(metrics: Metrics, tier: str, action: str, reason: str = "queue_full") -> float:
    value = metrics.registry.get_sample_value(
        "edge_agent_degradations_total", {"tier": tier, "reason": reason, "action": action})
    return value or 0.0


def test_only_a_full_queue_and_memory_held_by_serving_models_are_saturation() -> None:
    assert saturation(QueueFull("full")) == "queue_full"
    assert saturation(MemoryShort("no room")) == "memory"
    assert saturation(ServiceUnavailable("loading")) is None
    assert saturation(RequestTimeout("late")) is None


def test_normal_goes_to_the_fallback_high_never(tmp_path: Any) -> None:
    policy, metrics = _policy(tmp_path)
    cause = QueueFull("full", retry_after=2)
    assert policy.degrade("normal", "queue_full", SMOL, _tenant(), cause, defer=False) == GEMMA
    with pytest.raises(NotDegraded) as refused:
        policy.degrade("high", "memory", SMOL, _tenant(), cause, defer=True)
    assert refused.value.message.startswith("risk tier high: not degraded (no memory")
    assert refused.value.retry_after == 5.0  # [risk] retry_after_s, above the cause's 2 s
    assert _count(metrics, "high", "refused", "memory") == 1
    assert _count(metrics, "normal", "fallback") == 0  # counted once it is answered


@pytest.mark.parametrize(("why", "tenant", "installed", "flags"), [
    ("no fallback model is set", {}, (SMOL, GEMMA), {"models": {}}),
    ("may not use the fallback", {"models": ["smollm2:*"]}, (SMOL, GEMMA), {}),
    ("is not installed", {}, (SMOL,), {}),
    ("[risk] normal = \"refuse\"", {}, (SMOL, GEMMA), {"risk.normal": "refuse"}),
])
def test_normal_without_a_fallback_it_may_use_is_refused(
        tmp_path: Any, why: str, tenant: dict[str, Any], installed: tuple[ModelName, ...],
        flags: dict[str, Any]) -> None:
    policy, metrics = _policy(tmp_path, installed, **flags)
    with pytest.raises(NotDegraded) as refused:
        policy.degrade("normal", "queue_full", SMOL, _tenant(**tenant), QueueFull("full"),
                       defer=False)
    assert refused.value.message.startswith("risk tier normal:") and why in refused.value.message
    assert not isinstance(refused.value, Deferrable)
    assert _count(metrics, "normal", "refused") == 1


def test_low_waits_only_when_asked_and_a_batch_queue_takes_it(tmp_path: Any) -> None:
    policy, metrics = _policy(tmp_path)
    with pytest.raises(NotDegraded) as refused:
        policy.degrade("low", "queue_full", SMOL, _tenant(), QueueFull("full"), defer=False)
    assert "send X-Edge-Defer: batch" in refused.value.message
    with pytest.raises(NotDegraded) as refused:
        policy.degrade("low", "queue_full", SMOL, _tenant(), QueueFull("full"), defer=True)
    assert "no batch queue" in refused.value.message and not isinstance(refused.value,
                                                                         Deferrable)
    policy.can_defer = True
    with pytest.raises(Deferrable) as deferred:
        policy.degrade("low", "queue_full", SMOL, _tenant(), QueueFull("full"), defer=True)
    assert (deferred.value.tier, deferred.value.reason, deferred.value.model) == (
        "low", "queue_full", str(SMOL))
    assert _count(metrics, "low", "refused") == 2 and _count(metrics, "low", "queued") == 0
    policy.deferred(deferred.value)
    assert _count(metrics, "low", "queued") == 1


def test_a_request_may_raise_its_tier_and_lower_it_only_where_allowed() -> None:
    assert _tenant().tier(None) == "normal"
    assert _tenant().tier("high") == "high"
    with pytest.raises(RiskTierNotAllowed):
        _tenant().tier("low")
    assert _tenant(risk_may_lower=True).tier("low") == "low"
    with pytest.raises(RiskTierNotAllowed):
        _tenant(risk="high").tier("normal")
    assert _tenant(risk="low").tier("high") == "high"


def test_a_fallback_name_that_is_no_model_name_stops_the_start(tmp_path: Any) -> None:
    from edge_agent.config import ConfigError

    with pytest.raises(ConfigError, match="fallback"):
        load_settings(None, state_dir=tmp_path, **{"models": {"a:1": {"fallback": "no good"}}})


def test_a_health_gate_request_is_high_tier_never_answered_by_a_fallback() -> None:
    """The gate judges the version it asked for: its requests go in at the high tier."""
    import asyncio

    from edge_agent.engine.request import GenerationRequest
    from edge_agent.gateway.controls import Controls
    from edge_agent.gateway.probe import ServiceProbe

    asked: list[Controls] = []

    class Saturated:
        async def prepare(self, request: GenerationRequest, controls: Controls) -> None:
            asked.append(controls)
            raise NotDegraded("risk tier high: not degraded")

    with pytest.raises(NotDegraded):
        asyncio.run(ServiceProbe(Saturated(), dialect="gate")(  # type: ignore[arg-type]
            GenerationRequest(model=str(SMOL), prompt="Hi")))
    assert [(c.risk, c.dialect) for c in asked] == [("high", "gate")]
