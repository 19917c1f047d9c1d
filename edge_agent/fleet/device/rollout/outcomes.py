"""How fetching a release can end badly, as the rollout state machine tells the cases apart.

Raised by the release side (`edge_agent.fleet.device.release.source`: TUF lookup, transfer,
install) and caught by the rollout runner (`edge_agent.fleet.device.rollout.runner`), which owns
no release code: the two meet only at these two names.

- `ReleaseRejected`: the release can never be installed on this box as it is — a bad
  signature, a replayed or rolled-back metadata version, an unknown target, an agent too
  old, not enough disk or memory, an unsupported architecture. The rollout ends REJECTED
  and is never retried.
- `ReleaseFailed`: this attempt did not work but another may — metadata expired (the
  controller may refresh it), the server unreachable, a transfer cut, a hash mismatch of a
  blob that may have been damaged on the way. The rollout ends FAILED and is retried up
  to `fleet.rollout_max_failures`, with backoff.

`reason` is a short stable word for results and tests (`bad_signature`, `disk_full`,
`unreachable`…); `details` holds the figures (bytes needed and free, versions…), JSON-able.
This module holds data only: no I/O, no imports beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class _ReleaseOutcome(Exception):
    def __init__(self, reason: str, details: Mapping[str, Any] | None = None,
                 message: str = "") -> None:
        if not reason:
            raise ValueError("a release outcome needs a reason")
        self.reason = reason
        self.details: dict[str, Any] = dict(details or {})
        self.message = message
        super().__init__(f"{reason}: {message}" if message else reason)


class ReleaseRejected(_ReleaseOutcome):
    """Final: this release cannot be installed here (not retried)."""


class ReleaseFailed(_ReleaseOutcome):
    """This attempt failed; another may succeed (retried up to the limit)."""
