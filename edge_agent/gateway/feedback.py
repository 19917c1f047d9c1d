"""An app's verdict on an answer, below the dialect: kept on the request's ledger row
(`ledger.feedback`) and counted (`edge_agent_feedback_total{model,rating}`), which the
fleet link reports with each `metrics` message.

The row is written by the ledger's writer after the answer's last byte, on its batch
window: a verdict sent at once after the answer may reach the box before the row is on
disk, so the writer is flushed before the row is looked up. A request whose answer is
still streaming has no row yet, and reads as unknown.

Must never: block the event loop on SQLite (the look-up and the write run on a worker
thread), or say whether another tenant's request exists (it is not found, as an unknown
one).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from edge_agent.errors import NotFound, ServiceUnavailable
from edge_agent.governance.tenants import TenantContext
from edge_agent.ledger.feedback import Rated, rate
from edge_agent.ledger.store import open_ledger
from edge_agent.ledger.writer import LedgerWriter
from edge_agent.logs import note
from edge_agent.telemetry.metrics import Metrics

FLUSH_TIMEOUT_S = 5.0  # rows queued before the verdict: committed within a batch window


def _keep(writer: LedgerWriter, path: Path, request_id: str, tenant: str, rating: str,
          reason: str | None) -> Rated | None:
    writer.flush(FLUSH_TIMEOUT_S)  # a row still queued after this one reads as unknown
    db = open_ledger(path)
    try:
        return rate(db, request_id, tenant, rating, reason, time.time())
    finally:
        db.close()


async def give_feedback(writer: LedgerWriter | None, metrics: Metrics | None,
                        tenant: TenantContext, request_id: str, rating: str,
                        reason: str | None) -> Rated:
    """Keeps and counts the tenant's verdict on its request `request_id` (a ledger row
    id); 404 when the ledger holds no such request of this tenant."""
    if writer is None:  # only between the app's start and its lifespan: never serving
        raise ServiceUnavailable("the ledger is not open", retry_after=1.0)
    rated = await asyncio.to_thread(_keep, writer, writer.path, request_id, tenant.name,
                                    rating, reason)
    if rated is None:
        raise NotFound(f"no request '{request_id}' to rate", param="request_id")
    note(model=rated.model, feedback=rating)
    if metrics is not None:
        metrics.observe_feedback(rated.model, rating)
    return rated
