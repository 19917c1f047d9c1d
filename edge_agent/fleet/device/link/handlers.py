"""The command handlers that act on the box: `ledger.purge`, `keys.revoke`, and the live
half of `config.patch` — each over a callable the app passes in, since the fleet link
imports no app and no server part (`ping` and `rebirth` are the link's own; the patch's
validation and persistence are `fleet.device.link.overlay`'s).

A handler reads its `args` through the registry's schema (`command_gate.command_args`),
which raises CommandRefused(`malformed`) before anything changes. Every handler is
idempotent: a command cut short by a stop runs again at the next start. Handlers run on the
link's `fleet-commands` thread, never on the owner thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from edge_agent.config import Settings
from edge_agent.fleet.device.link.command_gate import Handler, command_args
from edge_agent.fleet.device.link.overlay import Ungated, config_patch_handler
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import PurgeArgs, RevokeArgs


def ledger_purge_handler(purge: Callable[[float | None], int]) -> Handler:
    """`ledger.purge`, args `{}` (what retention says) or `{"before": unix_ts}` (also every
    request row older than that). `purge(before)` returns the rows removed."""

    def handle(command: Command) -> dict[str, Any]:
        before = command_args(command, PurgeArgs).before
        return {"removed": purge(before), "before": before}

    return handle


def keys_revoke_handler(revoke: Callable[[str], bool]) -> Handler:
    """`keys.revoke`, args `{"prefix": "<the key's prefix>"}`; `revoke(prefix)` is True if
    a key was revoked now (False: unknown or revoked already — the same end state)."""

    def handle(command: Command) -> dict[str, Any]:
        prefix = command_args(command, RevokeArgs).prefix
        return {"prefix": prefix, "revoked": revoke(prefix)}

    return handle


def box_handlers(settings: Settings, state_dir: Path, *,
                 purge: Callable[[float | None], int], revoke: Callable[[str], bool],
                 apply_live: Callable[[Settings, dict[str, Any]], Iterable[str]],
                 ungated: Ungated | None = None) -> Mapping[str, Handler]:
    """The handlers a serving box registers besides ping and rebirth. `settings` is the
    live object `config.patch` validates against and `apply_live` updates; `ungated`
    records an ungated capacity patch (`overlay.config_patch_handler`)."""
    return {"config.patch": config_patch_handler(lambda: settings, state_dir, apply_live,
                                                 ungated),
            "ledger.purge": ledger_purge_handler(purge),
            "keys.revoke": keys_revoke_handler(revoke)}
