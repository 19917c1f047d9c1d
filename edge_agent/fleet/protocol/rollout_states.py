"""A rollout's states on a box, and the transitions between them: the names a box sends in
`rollout.*` events and the controller stores, so both sides read them from here.

    RECEIVED → DOWNLOADING → VERIFYING → STAGED → ACTIVATING → GATING → ACTIVE
                                                                      ↘ ROLLED_BACK
    any state before ACTIVATING → FAILED (retried: → RECEIVED) | REJECTED | CANCELLED

The box persists and checks the graph in `device.rollout.store`; the controller's wave
policy counts devices by these states. `describe` words who holds a model name on a box
(the `live` of a `rollout.refused` event), the same on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RECEIVED, DOWNLOADING, VERIFYING, STAGED = "RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED"
ACTIVATING, GATING, ACTIVE = "ACTIVATING", "GATING", "ACTIVE"
ROLLED_BACK, FAILED, REJECTED, CANCELLED = "ROLLED_BACK", "FAILED", "REJECTED", "CANCELLED"
STATES = (RECEIVED, DOWNLOADING, VERIFYING, STAGED, ACTIVATING, GATING, ACTIVE,
          ROLLED_BACK, FAILED, REJECTED, CANCELLED)
_ENDINGS = {FAILED, REJECTED, CANCELLED}  # how a rollout may end before it activates
NEXT: dict[str, frozenset[str]] = {
    RECEIVED: frozenset({DOWNLOADING, STAGED} | _ENDINGS),  # STAGED: already installed
    DOWNLOADING: frozenset({VERIFYING, STAGED} | _ENDINGS),
    VERIFYING: frozenset({STAGED} | _ENDINGS),
    STAGED: frozenset({ACTIVATING} | _ENDINGS),
    # ACTIVE straight from ACTIVATING: the target was the active version already.
    ACTIVATING: frozenset({GATING, ACTIVE, ROLLED_BACK, FAILED}),
    GATING: frozenset({ACTIVE, ROLLED_BACK}),
    ACTIVE: frozenset({ROLLED_BACK}),  # an operator's rollout.rollback
    FAILED: frozenset({RECEIVED, CANCELLED}),  # the retry; or given up
    ROLLED_BACK: frozenset(), REJECTED: frozenset(), CANCELLED: frozenset(),
}
# States a box reaches only with the release's file in place (downloaded, or installed
# already): what a view shows as the download done once its figures are gone.
FILE_IN_PLACE = frozenset({VERIFYING, STAGED, ACTIVATING, GATING, ACTIVE, ROLLED_BACK})
# States in which the box's serving version may be the new one while no gate passed yet:
# `resume` converges them (switch back), never continues them.
SWITCHING = frozenset({ACTIVATING, GATING})


def describe(holder: Mapping[str, Any]) -> str:
    """`models pull m:1@2 (pid 812)`, `rollout ro-1 (DOWNLOADING)`."""
    if holder.get("pull"):
        return f"models pull {holder['pull']} (pid {holder.get('pid', '?')})"
    if holder.get("change"):
        return f"{holder['change']} (pid {holder.get('pid', '?')})"
    if holder.get("rollout_id"):
        state = holder.get("state")
        return f"rollout {holder['rollout_id']}" + (f" ({state})" if state else "")
    return "another process"
