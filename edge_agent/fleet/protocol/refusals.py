"""Why a command is refused: the exception and its reasons, the exact strings results and
tests use. Its own module because both `signing` (bad_signature) and `commands` (all
the others) raise it; `edge_agent.fleet.device.link.command_gate` re-exports it."""

from __future__ import annotations

BAD_SIGNATURE = "bad_signature"
EXPIRED = "expired"
REPLAY = "replay"
UNKNOWN_TYPE = "unknown_type"
OVERSIZED = "oversized"
WRONG_DEVICE = "wrong_device"
MALFORMED = "malformed"
REASONS = frozenset({BAD_SIGNATURE, EXPIRED, REPLAY, UNKNOWN_TYPE, OVERSIZED, WRONG_DEVICE,
                     MALFORMED})


class CommandRefused(Exception):
    """A command that is not executed; `reason` is one of REASONS, `message` says more
    (never a secret, never a payload's content beyond a name)."""

    def __init__(self, reason: str, message: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message
