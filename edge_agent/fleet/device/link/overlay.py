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

Capacity keys (a model's speed *and* its answers: `protocol.command_types.CAPACITY_KEYS`)
are gated: they ship as a capacity release (`fleet rollout start NAME@VERSION --config
parallel=…`, `device.rollout.capacity`), which writes them here once its gate passed. A
`config.patch` of one is refused unless its args say `"ungated": true`; then it is taken
at the next load of the model (the next start), and marked as ungated in the release
evidence. Bounds as in `[runtime]` and `[models."name"]`:

    runtime.parallel | context_length | threads | prompt_lookup | kv_cache_type
    models.<name>.parallel | context_length | threads | prompt_lookup | kv_cache_type
                 | draft_model | draft_tokens          (null: back to [runtime]'s)

A tenant's keys need the tenant in the config file (a patch never creates one). Values are
JSON numbers; null where the table says so: no cap, no ceiling (a model's `draft_model`, a
name, `parallel = "auto"` and a `kv_cache_type` ship only through a capacity release).
They are validated by building the whole Settings with the patch applied, before anything
is written, so the model's own bounds apply. A refused patch changes nothing, neither the
overlay file nor the running box (CommandRefused `malformed`, the message naming the key
and the bound it breaks, e.g. `'telemetry.interval_s': Input should be less than or equal
to 86400`).

The file is `{"v":1,"set":{"telemetry.interval_s":10,...}}`, replaced atomically (temp
file, fsync, rename); it beats the config file, the environment and command-line flags,
because it is the later decision. This module never applies a value to a running
component: the link passes `apply_live` for the keys that can change without a restart.
It holds the one writer of the live settings object (`copy_keys`), which `apply_live` and
the capacity releases' switch and way back all call.
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
from edge_agent.fleet.device.link.command_gate import Handler, command_args
from edge_agent.fleet.protocol.command import Command, is_finite_number
from edge_agent.fleet.protocol.command_types import CAPACITY_KEYS, PatchArgs
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
RUNTIME_CAPACITY = frozenset({"parallel", "context_length", "threads", "prompt_lookup",
                              "kv_cache_type"})
TEXT_KEYS = frozenset({"draft_model", "parallel", "kv_cache_type"})  # a name; "auto"; "q8_0"


class Gated(CommandRefused):
    """A capacity key in a `config.patch` that did not say `ungated`."""


def capacity_key(key: str) -> bool:
    """Whether `key` is a capacity setting (gated): `runtime.parallel`,
    `models.<name>.draft_model`, …"""
    head, _, rest = key.partition(".")
    if head == "runtime":
        return rest in RUNTIME_CAPACITY
    return head == "models" and rest.rpartition(".")[2] in CAPACITY_KEYS \
        and bool(rest.rpartition(".")[0])


def capacity_overlay_key(name: str, key: str) -> str:
    """Where a rollout's `--config` key lives: the runtime's where it has one (the box's
    `[runtime]`), else the rolled-out model's own table (`draft_model`, `draft_tokens`)."""
    return f"runtime.{key}" if key in RUNTIME_CAPACITY else f"models.{name}.{key}"


def _path(settings: Settings, key: Any, capacity: bool = False) -> list[str]:
    """Where `key` lives in the settings, if the allow-list has it; else CommandRefused
    (`Gated` for a capacity key unless `capacity`)."""
    if not isinstance(key, str):
        raise CommandRefused(MALFORMED, "a key is not text")
    if key in KEYS:
        return key.split(".")
    if capacity_key(key):
        if not capacity:
            leaf = key.rpartition(".")[2]
            raise Gated(MALFORMED, f"{_shown(key)} is a capacity setting: it ships through "
                        f"the release gate (edge-agent fleet rollout start NAME@VERSION "
                        f"--capacity {leaf}=...), or outside it only as an ungated patch "
                        "(fleet send ... config.patch --ungated)")
        if key.startswith("runtime."):
            return key.split(".")
        name, _, leaf = key[len("models."):].rpartition(".")
        return ["models", name, leaf]
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


def _check_value(key: str, path: list[str], value: Any, texts: bool = False) -> None:
    if value is None and (path[0] in ("tenants", "models") or key in NULLABLE):
        return
    if texts and isinstance(value, str) and path[0] in ("runtime", "models") \
            and path[-1] in TEXT_KEYS:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRefused(MALFORMED, f"{_shown(key)} must be a number, not "
                                        f"{type(value).__name__}")
    if not is_finite_number(value):  # inf, or an integer past any float
        raise CommandRefused(MALFORMED, f"{_shown(key)} must be a finite number")


def patched(settings: Settings, changes: Mapping[str, Any], *,
            capacity: bool = False, texts: bool = False) -> Settings:
    """`settings` with `changes` applied and validated; CommandRefused (`malformed`, the key
    named) if a key is not allowed (a capacity key only with `capacity`: a gated release,
    or an ungated patch) or a value is not valid (text only with `texts`: a capacity
    release's `draft_model`, `parallel = "auto"`). `settings` is not changed."""
    if not isinstance(changes, Mapping) or not changes:
        raise CommandRefused(MALFORMED, "nothing to set")
    if len(changes) > MAX_KEYS:
        raise CommandRefused(MALFORMED, f"{len(changes)} keys; at most {MAX_KEYS}")
    data = settings.model_dump()
    for key, value in changes.items():
        path = _path(settings, key, capacity)
        _check_value(key, path, value, texts)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})  # a model with no table of its own yet
        node[path[-1]] = value
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        if not where:  # a rule across keys (a quantized KV cache needs flash attention)
            raise CommandRefused(MALFORMED, str(err["msg"])) from None
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


def apply_patch(settings: Settings, state_dir: Path, changes: Mapping[str, Any], *,
                capacity: bool = False, texts: bool = False) -> Settings:
    """Validates `changes` against `settings`, then persists them merged into the overlay;
    the new settings. A refused patch persists nothing."""
    new = patched(settings, changes, capacity=capacity, texts=texts)
    _save(state_dir, {**load_overlay(state_dir), **changes})
    return new


def restore_keys(state_dir: Path, previous: Mapping[str, Any]) -> None:
    """Puts keys of the overlay back as they were (`previous[key]`: its value then, or
    `MISSING`: it was not in the overlay) — a capacity release rolled back after it was
    written."""
    values = load_overlay(state_dir)
    for key, value in previous.items():
        if value is MISSING:
            values.pop(key, None)
        else:
            values[key] = value
    _save(state_dir, values)


def overlay_values(state_dir: Path, keys: Iterable[str]) -> dict[str, Any]:
    """What the overlay holds for `keys` now (`MISSING` where it holds nothing)."""
    values = load_overlay(state_dir)
    return {key: values.get(key, MISSING) for key in keys}


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def apply_overlay(settings: Settings, state_dir: Path) -> Settings:
    """At start: the settings with the persisted overlay applied over them. A key that no
    longer fits (its tenant left the config file, a bound changed) is skipped with a
    warning and stays in the file — the box starts either way."""
    for key, value in load_overlay(state_dir).items():
        try:  # a capacity key here passed its gate, or was sent ungated
            settings = patched(settings, {key: value}, capacity=True, texts=True)
        except CommandRefused as exc:
            log.warning("config overlay: %s not applied (%s)", _shown(str(key)), exc.message)
    return settings


Ungated = Callable[[Command, Settings, Settings, dict[str, Any]], None]


def _split(key: str) -> tuple[list[str], str]:
    """Where an overlay key lives: (path to its section, field). A tenant's name may hold
    dots, so `tenants.<name>.<field>` splits at the last one."""
    if key.startswith("tenants."):
        name, _, leaf = key[len("tenants."):].rpartition(".")
        return ["tenants", name], leaf
    *path, leaf = key.split(".")
    return path, leaf


def _node(settings: Settings, path: list[str]) -> Any:
    node: Any = settings
    for part in path:
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def copy_keys(live: Settings, source: Settings, keys: Iterable[str]) -> list[str]:
    """The values of overlay `keys` from `source` (validated) into the `live` settings
    object, in place, so every part holding it (the governor, the hourly purge, the sync
    producers, the registry at a model's next load) sees them at its next read: the one
    writer of the live settings. A model's key brings its whole `[models]` table (the
    model may have had no table of its own). Returns the keys copied."""
    done = []
    for key in keys:
        if key.startswith("models."):
            live.models = source.models.model_copy(deep=True)
        else:
            path, leaf = _split(key)
            setattr(_node(live, path), leaf, getattr(_node(source, path), leaf))
        done.append(key)
    return done


def config_patch_handler(
        current: Callable[[], Settings], state_dir: Path,
        apply_live: Callable[[Settings, dict[str, Any]], Iterable[str]] | None = None,
        ungated: Ungated | None = None,
) -> Handler:
    """The `config.patch` handler: args `{"set": {key: value, ...}}` (and `"ungated":
    true` for capacity keys). `current()` gives the effective settings; `apply_live(
    new_settings, changes)` applies what it can to the running box and returns those keys
    — the rest take effect at the next start (capacity keys always: at the model's next
    load). `ungated(command, before, after, capacity_changes)` records an ungated capacity
    patch (its evidence row). Result: `{"set": {...}, "live": [keys], "on_restart":
    [keys]}`, with `"ungated": true` when capacity keys were set."""

    def handle(command: Command) -> dict[str, Any]:
        open_gate = command_args(command, PatchArgs).ungated
        changes = dict(command.args["set"])  # as sent: a whole number stays one
        before = current()
        new = apply_patch(before, state_dir, changes, capacity=open_gate)
        gated = {k: v for k, v in changes.items() if capacity_key(k)}
        if gated and ungated is not None:
            try:
                ungated(command, before, new, gated)
            except Exception:  # the patch stands; its log line says the row is missing
                log.exception("config.patch %s: ungated evidence not recorded", command.id)
        if gated:
            log.warning("config.patch %s: capacity settings %s changed UNGATED (no release "
                        "gate ran); they apply at the model's next load", command.id,
                        ", ".join(sorted(gated)))
        rest = {k: v for k, v in changes.items() if k not in gated}
        live = set(apply_live(new, rest)) if apply_live is not None and rest else set()
        return {"set": changes, "live": sorted(live & set(changes)),
                "on_restart": sorted(set(changes) - live), **({"ungated": True} if gated else {})}

    return handle
