"""`config.patch`: the settings the controller may change on a box, kept in
`<state_dir>/config.overlay.json` and applied over the config file at every start.

Allow-list (nothing else, ever — a patch cannot reach the broker, keys, paths or models),
with the bounds of each key. The bounds are the Settings' own (`edge_agent.config`), so a
config file or an environment variable outside them stops the start just as a patch is
refused; this table copies them and a test holds the two (and docs/fleet/commands.md) together:

    key                                  bounds
    telemetry.interval_s                 1 … 86_400 (seconds)
    fleet.metrics_interval_s             1 … 86_400 (seconds)
    fleet.ledger_interval_s              1 … 86_400 (seconds)
    fleet.progress_interval_s            0.1 … 86_400 (seconds)
    fleet.max_download_bytes_per_s       1_024 … 10_000_000_000 (bytes a second), or null
    fleet.rollout_nice                   0 … 19 (nice increment)
    retention.ledger_days                1 … 3_650 (days)
    retention.content_hours              0 … 8_760 (hours)
    tenants.<name>.requests_per_minute   1 … 1_000_000, or null
    tenants.<name>.tokens_per_minute     1 … 1_000_000_000, or null
    tenants.<name>.tokens_per_day        1 … 1_000_000_000_000, or null

A tenant's keys need the tenant in the config file (a patch never creates one). Values are
JSON numbers; null where the table says so: no cap, no ceiling. They are validated by
building the whole Settings with the patch applied, before anything is written, so the
model's own bounds apply. A refused patch changes nothing, neither the overlay file nor
the running box (CommandRefused `malformed`, the message naming the key and the bound it
breaks, e.g. `'telemetry.interval_s': Input should be less than or equal to 86400`).

The file is `{"v":1,"set":{"telemetry.interval_s":10,...}}`, replaced atomically (temp
file, fsync, rename); it beats the config file, the environment and command-line flags,
because it is the later decision. This module never applies a value to a running
component: the link passes `apply_live` for the keys that can change without a restart.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from edge_agent.config import Settings
from edge_agent.files import atomic_write
from edge_agent.fleet.device.link.command_gate import Handler
from edge_agent.fleet.protocol.command import Command, is_finite_number
from edge_agent.fleet.protocol.command_types import MAX_PATCH_KEYS as MAX_KEYS
from edge_agent.fleet.protocol.refusals import MALFORMED, CommandRefused

log = logging.getLogger(__name__)
OVERLAY_FILE = "config.overlay.json"
KEYS = frozenset({"telemetry.interval_s", "fleet.metrics_interval_s", "fleet.ledger_interval_s",
                  "retention.ledger_days", "retention.content_hours",
                  # a release's transfer on a slow or shared link, from its next download
                  "fleet.max_download_bytes_per_s", "fleet.progress_interval_s",
                  "fleet.rollout_nice"})
NULLABLE = frozenset({"fleet.max_download_bytes_per_s"})  # null: no cap
TENANT_KEYS = frozenset({"requests_per_minute", "tokens_per_minute", "tokens_per_day"})


def _path(settings: Settings, key: Any) -> list[str]:
    """Where `key` lives in the settings, if the allow-list has it; else CommandRefused."""
    if not isinstance(key, str):
        raise CommandRefused(MALFORMED, "a key is not text")
    if key in KEYS:
        return key.split(".")
    head, _, rest = key.partition(".")
    name, _, leaf = rest.rpartition(".")  # a tenant's name may hold dots
    if head == "tenants" and name and leaf in TENANT_KEYS:
        if name not in settings.tenants:
            raise CommandRefused(MALFORMED, f"{_shown(key)}: no tenant {_shown(name)} here")
        return ["tenants", name, leaf]
    raise CommandRefused(MALFORMED, f"{_shown(key)} may not be patched")


def _shown(text: str) -> str:
    shown = ascii(text[:80])
    return shown + "..." if len(text) > 80 else shown


def _check_value(key: str, path: list[str], value: Any) -> None:
    if value is None and (path[0] == "tenants" or key in NULLABLE):
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRefused(MALFORMED, f"{_shown(key)} must be a number, not "
                                        f"{type(value).__name__}")
    if not is_finite_number(value):  # inf, or an integer past any float
        raise CommandRefused(MALFORMED, f"{_shown(key)} must be a finite number")


def patched(settings: Settings, changes: Mapping[str, Any]) -> Settings:
    """`settings` with `changes` applied and validated; CommandRefused (`malformed`, the key
    named) if a key is not allowed or a value is not valid. `settings` is not changed."""
    if not isinstance(changes, Mapping) or not changes:
        raise CommandRefused(MALFORMED, "nothing to set")
    if len(changes) > MAX_KEYS:
        raise CommandRefused(MALFORMED, f"{len(changes)} keys; at most {MAX_KEYS}")
    data = settings.model_dump()
    for key, value in changes.items():
        path = _path(settings, key)
        _check_value(key, path, value)
        node = data
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise CommandRefused(MALFORMED, f"{_shown(where)}: {err['msg']}") from None


def load_overlay(state_dir: Path) -> dict[str, Any]:
    """The persisted patch (`{}` if none). A file that is not an overlay is moved aside as
    `config.overlay.json.corrupt-<UTC time>` and reported in the log, never deleted."""
    path = state_dir / OVERLAY_FILE
    if not path.exists():
        return {}
    try:
        obj = json.loads(path.read_bytes())
        if (not isinstance(obj, dict) or obj.get("v") != 1 or set(obj) != {"v", "set"}
                or not isinstance(obj["set"], dict)):
            raise ValueError("not {\"v\":1,\"set\":{...}}")
        return dict(obj["set"])
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError included
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        moved = path.with_name(f"{path.name}.corrupt-{stamp}")
        os.replace(path, moved)
        log.error("config overlay %s is unreadable (%s): moved to %s; the config file's "
                  "values apply", path, exc, moved)
        return {}


def _save(state_dir: Path, values: Mapping[str, Any]) -> None:
    """A crash leaves the old or the new overlay, never half of one."""
    data = json.dumps({"v": 1, "set": dict(values)}, indent=1, sort_keys=True).encode()
    atomic_write(state_dir / OVERLAY_FILE, data, sync_dir=True)


def apply_patch(settings: Settings, state_dir: Path, changes: Mapping[str, Any]) -> Settings:
    """Validates `changes` against `settings`, then persists them merged into the overlay;
    the new settings. A refused patch persists nothing."""
    new = patched(settings, changes)
    _save(state_dir, {**load_overlay(state_dir), **changes})
    return new


def apply_overlay(settings: Settings, state_dir: Path) -> Settings:
    """At start: the settings with the persisted overlay applied over them. A key that no
    longer fits (its tenant left the config file, a bound changed) is skipped with a
    warning and stays in the file — the box starts either way."""
    for key, value in load_overlay(state_dir).items():
        try:
            settings = patched(settings, {key: value})
        except CommandRefused as exc:
            log.warning("config overlay: %s not applied (%s)", _shown(str(key)), exc.message)
    return settings


def config_patch_handler(
        current: Callable[[], Settings], state_dir: Path,
        apply_live: Callable[[Settings, dict[str, Any]], Iterable[str]] | None = None,
) -> Handler:
    """The `config.patch` handler: args `{"set": {key: value, ...}}`. `current()` gives the
    effective settings; `apply_live(new_settings, changes)` applies what it can to the
    running box and returns those keys — the rest take effect at the next start. Result:
    `{"set": {...}, "live": [keys], "on_restart": [keys]}`."""

    def handle(command: Command) -> dict[str, Any]:
        args = command.args
        if set(args) != {"set"} or not isinstance(args["set"], dict):
            raise CommandRefused(MALFORMED, 'args must be {"set": {key: value, ...}}')
        changes = dict(args["set"])
        new = apply_patch(current(), state_dir, changes)
        live = set(apply_live(new, changes)) if apply_live is not None else set()
        return {"set": changes, "live": sorted(live & set(changes)),
                "on_restart": sorted(set(changes) - live)}

    return handle
