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
The release side adds its reason codes (`device.release.source`); `body()` is what an
audit message or a rollout's row records. This module holds data only: no I/O.
"""

from __future__ import annotations

from typing import Any, ClassVar

from edge_agent.errors import EdgeAgentError


class ReleaseError(EdgeAgentError):
    """A release that cannot (yet) be installed. `reason`: a short stable word;
    `details`: the figures (bytes needed and free, versions, the URL …)."""

    retry: ClassVar[bool] = True

    def __init__(self, reason: str, message: str = "", **details: Any) -> None:
        if not reason:
            raise ValueError("a release outcome needs a reason")
        super().__init__(message)
        self.reason = reason
        self.details = details

    def body(self) -> dict[str, Any]:
        """For an audit message or a rollout's state row."""
        return {"reason": self.reason, "message": self.message, "retry": self.retry,
                **self.details}


class ReleaseRejected(ReleaseError):
    """Final: this release cannot be installed here; trying again changes nothing."""

    retry = False


class ReleaseFailed(ReleaseError):
    """This attempt failed (network, clock, the controller's re-signing); another may
    succeed (retried up to the limit)."""

    retry = True
