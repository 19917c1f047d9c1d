"""An app's verdict on an answer, kept on the request's own ledger row (`feedback`,
`feedback_reason`, `feedback_at`; migration `m011_feedback`).

A verdict is a word from a closed set and, optionally, a reason from another: never the
app's or its user's own text, so the row stays metadata only (`ledger.store`), and the
fleet can count verdicts without a privacy screen to pass. A second verdict on the same
request replaces the first: the row holds what the app thinks now, and the caller is told
that it replaced one.

The row is the request's own: only the tenant that made the request may rate it, and a
row of another tenant reads as no row at all. Must never: create a row (a verdict on a
request the ledger does not hold is refused by the caller), or touch any column but the
three feedback ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from sqlite_utils import Database

from edge_agent.ledger.store import REQUESTS

Rating = Literal["good", "bad"]
Reason = Literal["wrong", "unsafe", "format", "incomplete", "slow", "other"]
RATINGS: tuple[str, ...] = get_args(Rating)
REASONS: tuple[str, ...] = get_args(Reason)


@dataclass(frozen=True)
class Rated:
    """A verdict as kept: the request, the model that answered it (the row's `model`, ""
    where the request named none), and whether an earlier verdict was replaced."""

    request_id: str
    model: str
    rating: str
    reason: str | None
    at: float
    replaced: bool


def rate(db: Database, request_id: str, tenant: str, rating: str, reason: str | None,
         at: float) -> Rated | None:
    """Keeps the verdict on the tenant's row `request_id`; None when the ledger holds no
    such row of this tenant (unknown, purged, another tenant's). Read and write in one
    transaction, so `replaced` says what this write replaced."""
    with db.atomic():
        found = db.execute(f"SELECT model, feedback FROM {REQUESTS} WHERE id = ? AND tenant = ?",
                           [request_id, tenant]).fetchone()
        if found is None:
            return None
        db.execute(f"UPDATE {REQUESTS} SET feedback = ?, feedback_reason = ?, feedback_at = ? "
                   "WHERE id = ?", [rating, reason, at, request_id])
    model, before = found
    return Rated(request_id, str(model or ""), rating, reason, at, before is not None)
