"""The controller options every `edge-agent fleet …` command that reads the controller's
settings or store shares (`--config`, `--state-dir`, and `--db` where it opens the store;
`keygen` and `release …` take the first two), apart from the group
(`cli.fleet`) so that the command modules it registers (`rollout`, `release`) use them too.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from edge_agent.cli.common import CheckFailed, F

if TYPE_CHECKING:
    from edge_agent.config.controller import ControllerSettings
    from edge_agent.fleet.controller.store import ControllerStore

_META = "edge_agent.fleet."


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    ctx.meta[f"{_META}{param.name}"] = value
    return value


_CONFIG = click.option(
    "--config", type=click.Path(path_type=Path, dir_okay=False), expose_value=False,
    callback=_remember,
    help="Controller TOML file (default /etc/edge-agent-fleet/controller.toml if present).")
_STATE_DIR = click.option(
    "--state-dir", type=click.Path(path_type=Path, file_okay=False), expose_value=False,
    callback=_remember,
    help="Controller state dir (default /var/lib/edge-agent-fleet); keys/ and releases/ "
         "live in it.")
_DB = click.option("--db", expose_value=False, callback=_remember,
                   help="postgresql://… (default: SQLite in the state dir).")


def controller_options(fn: F) -> F:
    """--config, --state-dir and --db on a controller command; `controller_settings()`
    reads them."""
    return _CONFIG(_STATE_DIR(_DB(fn)))


def files_options(fn: F) -> F:
    """--config and --state-dir on a command that works on the controller's files (its
    keys, the release repository) and never opens its store: the state dir comes from the
    same file as `fleet serve`'s, so that every command finds the same keys."""
    return _CONFIG(_STATE_DIR(fn))


def controller_settings(**flags: Any) -> ControllerSettings:
    from edge_agent.config.controller import load_controller_settings

    meta = click.get_current_context().meta
    return load_controller_settings(meta.get(f"{_META}config"),
                                    state_dir=meta.get(f"{_META}state_dir"),
                                    db=meta.get(f"{_META}db"), **flags)


def given_options() -> str:
    """The controller options this command was given, as words to repeat in a follow-up
    command it prints (which would otherwise read the default paths)."""
    meta = click.get_current_context().meta
    words = []
    for name in ("config", "state_dir", "db"):
        value = meta.get(f"{_META}{name}")
        if value is not None:
            words += [f"--{name.replace('_', '-')}", shlex.quote(str(value))]
    return " ".join(words)


def open_existing(settings: ControllerSettings) -> ControllerStore:
    """The controller's store, for reading; the CLI never creates a SQLite one."""
    from edge_agent.fleet.controller.store import DB_FILE, open_store

    if settings.db is None and not (settings.state_dir / DB_FILE).exists():
        raise CheckFailed(f"no controller store at {settings.state_dir / DB_FILE} "
                          "(edge-agent fleet serve creates it)")
    return open_store(settings.db, settings.state_dir)
