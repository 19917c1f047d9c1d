"""What every command shares: the exit codes, the two failures a command raises, and the
--config/--state-dir options with the settings they build.

Exit codes: 0 ok, 1 a check failed, 2 usage or configuration error. A command raises
`CheckFailed` or `BadUsage` for what it finds itself; the project's own errors
(`EdgeAgentError`, `ConfigError`) it lets through, and the root group maps them (see
`edge_agent.cli.EdgeAgentGroup`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import click

from edge_agent.config import Settings, load_settings
from edge_agent.names import ModelName

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2

F = TypeVar("F", bound=Callable[..., Any])
_CONFIG = "edge_agent.config"
_STATE_DIR = "edge_agent.state_dir"
# The box's config file when --config is not given: `make run` writes ./var/config.toml and
# ./var/env exports this, so that every command acts on the box the checkout serves.
CONFIG_ENV = "EDGE_AGENT_CONFIG"


class _ModelNameType(click.ParamType):
    """A model name argument, parsed where it enters (`ModelName.parse`): a bad one is the
    same one line and exit 1 as any model error (`EdgeAgentGroup` turns it into one)."""

    name = "name"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> ModelName:
        return ModelName.parse(value)


MODEL_NAME = _ModelNameType()


class Failure(click.ClickException):
    """One line on stderr, `edge-agent: <message>`, and a non-zero exit."""

    exit_code = EXIT_CHECK_FAILED

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"edge-agent: {self.format_message()}", file=file, err=True)


class CheckFailed(Failure):
    """A check failed, or what was asked for is not there (exit 1)."""

    exit_code = EXIT_CHECK_FAILED


class BadUsage(Failure):
    """The command line or the configuration asks for something not allowed (exit 2)."""

    exit_code = EXIT_USAGE


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    # A subcommand's option left unset keeps its group's (`bench --state-dir X fleet`).
    if value is not None or f"edge_agent.{param.name}" not in ctx.meta:
        ctx.meta[f"edge_agent.{param.name}"] = value
    return value


def common_options(fn: F) -> F:
    """--config and --state-dir on a command; `load()` reads them, so the command's own
    function does not take them."""
    fn = click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False),
                      expose_value=False, callback=_remember,
                      help="State directory: ledger, model blobs, outbox.")(fn)
    fn = click.option("--config", type=click.Path(path_type=Path, dir_okay=False),
                      envvar=CONFIG_ENV, expose_value=False, callback=_remember,
                      help=f"TOML config file (default ${CONFIG_ENV}, else "
                           "/etc/edge-agent/config.toml if present).")(fn)
    return fn


def load(**flags: Any) -> Settings:
    """The settings for the running command: its --config and --state-dir, plus `flags`
    (dotted keys for nested values). A bad setting raises ConfigError (exit 2)."""
    meta = click.get_current_context().meta
    return load_settings(meta.get(_CONFIG), state_dir=meta.get(_STATE_DIR), **flags)
