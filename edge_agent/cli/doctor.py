"""`edge-agent doctor`."""

from __future__ import annotations

import click

from edge_agent.cli.common import EXIT_CHECK_FAILED, common_options, load
from edge_agent.cli.output import json_option


@click.command()
@common_options
@json_option("Print the checks as JSON.")
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check this box: config, state dir, disk, model blobs, llama.cpp, GPU, port, fleet
    link (its files and the broker, reached with its credentials)."""
    from edge_agent.doctor import render, run_checks

    checks = run_checks(load())
    click.echo(render(checks, as_json))
    if any(c.status == "fail" for c in checks):
        ctx.exit(EXIT_CHECK_FAILED)
