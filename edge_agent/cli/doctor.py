"""`edge-agent doctor`."""

from __future__ import annotations

import click

from edge_agent.cli.common import EXIT_CHECK_FAILED, common_options, load
from edge_agent.cli.output import json_option


@click.command()
@common_options
@click.option("--host", help="The address the box serves on, as given to serve.")
@click.option("--port", type=int, help="The port the box serves on, as given to serve.")
@json_option("Print the checks as JSON.")
@click.pass_context
def doctor(ctx: click.Context, host: str | None, port: int | None, as_json: bool) -> None:
    """Check this box: config, state dir, disk, model blobs, llama.cpp, GPU, TLS files
    (dates, key), port (over HTTPS with TLS), fleet link (its files and the broker,
    reached with its credentials). Give it the same
    --config, --state-dir, --host and --port as serve: it checks the box it is told of,
    not the one the config file alone describes (a second box on one machine)."""
    from edge_agent.doctor import render, run_checks

    checks = run_checks(load(**{"server.host": host, "server.port": port}))
    click.echo(render(checks, as_json))
    if any(c.status == "fail" for c in checks):
        ctx.exit(EXIT_CHECK_FAILED)
