"""Tenants: who is calling (API key → tenant), what they may use, and how much.

With no key at all, the box runs open as tenant `local` (loopback binds only: serve
refuses a public address without keys). With keys, every API call needs one. Rates and
token quotas are sliding windows kept in memory and written down on each request's ledger
row (what it counted: `quota_requests`, `quota_tokens`); at a start the windows are read
back from the ledger (`Governor.restore`), so a restart, or a crash loop, hands no tenant a
fresh quota. A crash loses at most the ledger's last batch window (0.2 s) of charges.

Model management (delete, unload, loading a model outside the tenant's `models`) changes
what every tenant gets, so it takes an operator: a key created with `--admin`, a tenant
with `manage_models = true`, or the open `local` tenant (no keys at all, loopback only).
"""

from __future__ import annotations

import fnmatch
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from edge_agent.config import Settings, TenantPolicy
from edge_agent.errors import Forbidden, InvalidRequest, RateLimited, Unauthorized
from edge_agent.governance.keys import KeyStore, match
from edge_agent.logs import note

OPEN_TENANT = "local"
_RELOAD_EVERY_S = 5.0
TIERS = ("low", "normal", "high")  # risk tiers, least cautious first


class OperatorKeyRequired(Forbidden):
    """403 for model management without an operator key or tenant flag."""

    code = "operator_key_required"


class RiskTierNotAllowed(Forbidden):
    """403 for a request asking a risk tier below its tenant's without `risk_may_lower`."""

    code = "risk_tier_not_allowed"


@dataclass(frozen=True)
class TenantContext:
    name: str
    policy: TenantPolicy
    key_prefix: str = ""
    manage: bool = False  # may manage models: operator key, manage_models, or open mode

    def allows(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.policy.models)

    def check_model(self, model: str) -> None:
        """403 for a model outside the scope, decided on the name alone: whether such a
        model is installed is not revealed."""
        if not self.allows(model):
            raise Forbidden(f"model '{model}' is not allowed for tenant '{self.name}'",
                            param="model")

    def reaches(self, model: str) -> bool:
        """What `check_reach` lets through; listings show only these."""
        return self.manage or self.allows(model)

    def check_reach(self, model: str) -> None:
        """Reading or loading a model: within the scope, or any model for an operator."""
        if not self.manage:
            self.check_model(model)

    def tier(self, asked: str | None) -> str:
        """The request's risk tier: the tenant's own, or the one it asked (X-Edge-Risk).
        Asking more caution is always allowed; asking less only where the policy says so,
        since a lower tier buys a degraded answer instead of a refusal. A header changes
        its own request only: no tenant reaches another's tier."""
        own = self.policy.risk
        if asked is None or asked == own:
            return own
        if TIERS.index(asked) < TIERS.index(own) and not self.policy.risk_may_lower:
            raise RiskTierNotAllowed(
                f"risk tier '{asked}' is below tenant '{self.name}''s tier '{own}', and the "
                "tenant may not lower it (risk_may_lower)", param="X-Edge-Risk")
        return asked

    def check_manage(self, action: str, param: str = "model") -> None:
        if not self.manage:
            raise OperatorKeyRequired(
                f"{action} is model management: it needs an operator key "
                f"(edge-agent keys create --admin) or manage_models = true for tenant "
                f"'{self.name}'", param=param)


@dataclass
class _Window:
    span_s: float
    events: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def add(self, now: float, amount: int) -> None:
        self.events.append((now, amount))
        self.total += amount

    def trim(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - self.span_s:
            self.total -= self.events.popleft()[1]

    def retry_after(self, now: float) -> float:
        return max(1.0, self.events[0][0] + self.span_s - now) if self.events else 1.0


class Governor:
    def __init__(self, settings: Settings, keys: KeyStore) -> None:
        self.settings = settings
        self.keys = keys
        self._lock = threading.Lock()
        self._stamp = keys.stamp()
        self._active = keys.load_active()
        self._loaded_at = time.monotonic()
        self._used: dict[str, float] = {}
        self._windows: dict[tuple[str, str], _Window] = {}

    @property
    def open(self) -> bool:
        return not self._active

    def policy(self, tenant: str) -> TenantPolicy:
        policy = self.settings.tenants.get(tenant)
        if policy is None:
            if tenant == OPEN_TENANT:
                return TenantPolicy.model_validate({})
            raise Forbidden(f"tenant '{tenant}' has no policy in the configuration")
        return policy

    def authenticate(self, authorization: str | list[str] | None) -> TenantContext:
        """The caller's tenant. Several Authorization headers are refused (400), in open
        mode too: which one a proxy or server would pick is not defined."""
        if isinstance(authorization, list):
            if len(authorization) > 1:
                raise InvalidRequest("send one Authorization header, not "
                                     f"{len(authorization)}", param="Authorization")
            authorization = authorization[0] if authorization else None
        self._maybe_reload()
        if self.open:
            return TenantContext(OPEN_TENANT, self.policy(OPEN_TENANT), manage=True)
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized("missing API key: send Authorization: Bearer <key>")
        key = authorization[7:].strip()
        found = match(key, self._active)
        if found is None and self._reload():
            found = match(key, self._active)
        if found is None:
            raise Unauthorized("invalid or revoked API key")
        self._used[found.prefix] = time.time()
        policy = self.policy(found.tenant)
        return TenantContext(found.tenant, policy, found.prefix,
                             manage=found.admin or policy.manage_models)

    def admit(self, ctx: TenantContext) -> None:
        """Request rate and token quotas; raises 429 with the wait until a slot frees."""
        p, now = ctx.policy, time.monotonic()
        with self._lock:
            checks = [("requests", 60.0, p.requests_per_minute),
                      ("tokens", 60.0, p.tokens_per_minute),
                      ("tokens_day", 86400.0, p.tokens_per_day)]
            for kind, span, limit in checks:
                if limit is None:
                    continue
                w = self._window(ctx.name, kind, span)
                w.trim(now)
                if w.total >= limit:
                    what = {"requests": f"{limit} requests per minute",
                            "tokens": f"{limit} tokens per minute",
                            "tokens_day": f"{limit} tokens per day"}[kind]
                    raise RateLimited(f"tenant '{ctx.name}' is over its limit of {what}",
                                      retry_after=math.ceil(w.retry_after(now)))
            if p.requests_per_minute is not None:
                self._window(ctx.name, "requests", 60.0).add(now, 1)
        note(quota_requests=1)  # on the ledger row, for `restore` after a restart

    def charge(self, ctx: TenantContext, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            if ctx.policy.tokens_per_minute is not None:
                self._window(ctx.name, "tokens", 60.0).add(now, tokens)
            if ctx.policy.tokens_per_day is not None:
                self._window(ctx.name, "tokens_day", 86400.0).add(now, tokens)
        note(quota_tokens=tokens)

    def restore(self, usage: Iterable[tuple[str, float, int, int]], *,
                now: float | None = None) -> None:
        """The windows as the ledger left them: `usage` is (tenant, ts, requests, tokens)
        of each request of the last day that counted (`ledger.store.quota_usage`), oldest
        first; only windows a tenant's policy has are filled. A row stamped in the future
        (the wall clock set back since) counts as now."""
        wall = time.time() if now is None else now
        mono = time.monotonic()
        with self._lock:
            for tenant, ts, requests, tokens in usage:
                policy = self.settings.tenants.get(tenant)
                if policy is None:
                    continue
                at = mono - max(0.0, wall - ts)
                for kind, span, limit, amount in (
                        ("requests", 60.0, policy.requests_per_minute, requests),
                        ("tokens", 60.0, policy.tokens_per_minute, tokens),
                        ("tokens_day", 86400.0, policy.tokens_per_day, tokens)):
                    if limit is not None and amount and wall - ts < span:
                        self._window(tenant, kind, span).add(at, amount)

    def flush_last_used(self) -> None:
        used, self._used = self._used, {}
        self.keys.touch(used)

    def reload_keys(self) -> None:
        """Reads the key store now (a key revoked by the fleet link stops working at once,
        not at the next periodic reload)."""
        self._stamp = self.keys.stamp()
        self._active = self.keys.load_active()
        self._loaded_at = time.monotonic()

    def _window(self, tenant: str, kind: str, span: float) -> _Window:
        return self._windows.setdefault((tenant, kind), _Window(span))

    def _maybe_reload(self) -> None:
        if time.monotonic() - self._loaded_at > _RELOAD_EVERY_S:
            self._reload()

    def _reload(self) -> bool:
        """Picks up keys created or revoked by the CLI while serving: at most every 0.5 s
        (a flood of bad keys must not mean a read each), unless the store was written
        since the last read (a key created a moment ago works at once)."""
        stamp = self.keys.stamp()
        if time.monotonic() - self._loaded_at < 0.5 and stamp == self._stamp:
            return False
        self._stamp = stamp
        self._active = self.keys.load_active()
        self._loaded_at = time.monotonic()
        return True
