"""How the request path treats one request, beside what it asks of a model: its dialect,
priority, risk tier, deadline, whether a saturated box may defer it or must refuse it (a
batch's line), who the end user is, and the side (here, an upstream) it asks to run on.
The API reads them (headers, a body's field) and hands them to `service` beside the
request; the engine's request types name none of them (`engine.request`), so nothing
below the request path can act on policy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Priority = Literal["interactive", "batch"]
Tier = Literal["low", "normal", "high"]


@dataclass(frozen=True)
class Controls:
    dialect: str = ""  # "openai", "ollama", or the health gate's: for metrics and logs
    priority: Priority | None = None  # None: the tenant's default
    risk: Tier | None = None  # the tier asked (X-Edge-Risk); None: the tenant's
    defer: bool = False  # a low-tier request that may be answered later, as a batch
    draft: int | None = None  # prompt-lookup draft tokens a step asked by header
    timeout_s: float | None = None  # deadline from submission; None: the operator's default
    # A line of a batch: never degraded (no fallback, not queued again); on a saturated
    # box it gets the plain 503, and the batch runner tries it again later.
    batch_line: bool = False
    end_user: str | None = None  # a client's end-user id; only its keyed digest is recorded
    # X-Edge-Route: the side the client asks for (`gateway.routing`); None: the route's.
    route: Literal["local", "upstream"] | None = None

    def with_timeout(self, timeout_ms: int | None) -> Controls:
        """With a body's own deadline (OpenAI's `timeout_ms`) beside the header's: the
        smaller wins."""
        if not timeout_ms:
            return self
        asked = timeout_ms / 1000
        return replace(self, timeout_s=asked if self.timeout_s is None
                       else min(asked, self.timeout_s))


# A batch's line: at the batch priority, and never degraded (a 503 waits and runs again).
BATCH_LINE = Controls(dialect="openai", priority="batch", batch_line=True)
