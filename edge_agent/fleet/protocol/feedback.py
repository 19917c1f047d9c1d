"""The verdicts apps sent back on a box's answers, as the `metrics` message carries them:
each model's entry has `"feedback": {"good": n, "bad": n}`, the verdicts the box took in
the message's interval (deltas of its `edge_agent_feedback_total` counter, as the request
counts are). Both ratings are always there, zero included, so a reader never guesses
whether a missing one means none.

The box writes it (`fleet.device.reporting.summaries`), the controller reads it
(`fleet.controller.slo`) with `counts`, which takes any body and keeps only what has
this shape: a box of another version, or a body an attacker shaped, is read as far as it
is sound and never raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RATINGS: tuple[str, ...] = ("good", "bad")  # the box's `ledger.feedback.RATINGS`


def empty() -> dict[str, int]:
    return dict.fromkeys(RATINGS, 0)


def counts(body: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Model → rating → verdicts of a `metrics` body; models without a verdict left out."""
    out: dict[str, dict[str, int]] = {}
    models = body.get("models")
    if not isinstance(models, Mapping):
        return out
    for model, entry in models.items():
        given = entry.get("feedback") if isinstance(entry, Mapping) else None
        if not isinstance(model, str) or not isinstance(given, Mapping):
            continue
        found = {r: n for r in RATINGS
                 if isinstance(n := given.get(r), int) and not isinstance(n, bool) and n > 0}
        if found:
            out[model] = {**empty(), **found}
    return out
