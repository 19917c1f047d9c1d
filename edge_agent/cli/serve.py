"""`edge-agent serve`."""

from __future__ import annotations

import click

from edge_agent.cli.common import BadUsage, CheckFailed, common_options, load
from edge_agent.logs import configure_logging
from edge_agent.netaddr import is_loopback


@click.command()
@common_options
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="TCP port (default 11434).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              help="Log level (default info).")
def serve(host: str | None, port: int | None, log_level: str | None) -> None:
    """Serve both API dialects on one port."""
    from edge_agent.app import create_app
    from edge_agent.fleet.device.link.overlay import apply_overlay
    from edge_agent.governance.keys import KeyStore
    from edge_agent.server import serve as run_server

    settings = load(log_level=log_level, **{"server.host": host, "server.port": port})
    if not is_loopback(settings.server.host) and not KeyStore(settings.state_dir).any_active():
        raise BadUsage(f"refusing to listen on {settings.server.host}: no API key exists, so "
                       "only a loopback address is allowed (edge-agent keys create --tenant "
                       "NAME)")
    configure_logging(settings.log_level, settings.log_format)
    # What the fleet controller patched (config.patch) beats the file: the later decision.
    settings = apply_overlay(settings, settings.state_dir)
    if not run_server(create_app(settings), settings):
        raise CheckFailed(f"the server did not start on {settings.server.host}:"
                          f"{settings.server.port} (see the log above)")
