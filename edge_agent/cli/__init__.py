"""`edge-agent`: serve, models, keys, ledger, doctor, bench, fleet.

One module per command group; settings are built in each command from its --config and
--state-dir (`edge_agent.cli.common`) and passed down. Exit codes: 0 ok, 1 a check failed,
2 usage or configuration error; the project's errors become them in one place, the root
group's `invoke`.
"""

from __future__ import annotations

import errno
from typing import Any

import click

from edge_agent import __version__
from edge_agent.cli.bench import bench
from edge_agent.cli.common import BadUsage, CheckFailed
from edge_agent.cli.doctor import doctor
from edge_agent.cli.fleet import fleet as fleet_group  # the package keeps its name
from edge_agent.cli.keys import keys
from edge_agent.cli.ledger import ledger
from edge_agent.cli.models import models
from edge_agent.cli.serve import serve
from edge_agent.config import ConfigError
from edge_agent.errors import EdgeAgentError

__all__ = ["EdgeAgentGroup", "main"]


class EdgeAgentGroup(click.Group):
    """The root group. Every command runs inside its `invoke`, so this is where an error a
    command lets through becomes one line on stderr and an exit code:

        ConfigError      exit 2   a setting, the config file or a flag is wrong
        EdgeAgentError   exit 1   a model is missing or broken, a check failed
        OSError          exit 1   the state directory's side: no space, no permission
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            raise BadUsage(str(exc)) from exc
        except EdgeAgentError as exc:
            raise CheckFailed(exc.message) from exc
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # click's own handling: a closed pipe exits quietly
                raise
            raise CheckFailed(str(exc)) from exc


@click.group(cls=EdgeAgentGroup)
@click.version_option(__version__, prog_name="edge-agent")
def main() -> None:
    """edge-agent: a governed local LLM appliance (Ollama- and OpenAI-compatible)."""


for _command in (serve, models, keys, ledger, doctor, bench, fleet_group):
    main.add_command(_command)
