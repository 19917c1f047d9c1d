"""`edge-agent serve`."""

from __future__ import annotations

import logging
import os
import sys

import click

from edge_agent.cli.common import BadUsage, CheckFailed, common_options, load
from edge_agent.config import Settings
from edge_agent.logs import configure_logging
from edge_agent.netaddr import is_loopback, port_holder

log = logging.getLogger(__name__)


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
    from edge_agent.server import server_tls
    from edge_agent.tls import TLSFileError

    settings = load(log_level=log_level, **{"server.host": host, "server.port": port})
    _run_current_agent(settings)
    loopback = is_loopback(settings.server.host)
    if not loopback and not KeyStore(settings.state_dir).any_active():
        raise BadUsage(f"refusing to listen on {settings.server.host}: no API key exists, so "
                       "only a loopback address is allowed (edge-agent keys create --tenant "
                       "NAME)")
    try:
        tls = server_tls(settings)
    except TLSFileError as exc:
        raise BadUsage(f"cannot serve HTTPS: {exc}") from None
    configure_logging(settings.log_level, settings.log_format)
    if not loopback and tls is None:
        # A warning, not a refusal: boxes set up before TLS existed go on serving.
        log.warning("serving on %s without TLS: API keys and prompts cross the network in "
                    "clear; set [server] tls_cert_file and tls_key_file",
                    settings.server.host)
    # Before anything starts (the fleet link would announce a box that then fails to bind).
    holder = port_holder(settings.server.host, settings.server.port)
    if holder is not None:
        raise CheckFailed(f"{settings.server.host}:{settings.server.port} is taken by "
                          f"{holder}: stop it, or serve on another --port")
    # What the fleet controller patched (config.patch) beats the file: the later decision.
    settings = apply_overlay(settings, settings.state_dir)
    if not run_server(create_app(settings), settings, tls=tls):
        raise CheckFailed(f"the server did not start on {settings.server.scheme}://"
                          f"{settings.server.host}:{settings.server.port} (see the log above)")
    from edge_agent.fleet.device.agent.boot import RESTART_EXIT, restart_requested

    if restart_requested(settings.state_dir):
        log.info("stopped for an agent switch: exiting %d for systemd to start it again",
                 RESTART_EXIT)
        raise SystemExit(RESTART_EXIT)


def _run_current_agent(settings: Settings) -> None:
    """Before anything opens the state: the agent version that should run now (the entry's
    boot counter, `fleet.device.agent.boot`), exec'd in place of this one."""
    from edge_agent.fleet.device.agent.boot import at_start, restart_requested

    configure_logging(settings.log_level, settings.log_format)
    restart_requested(settings.state_dir)  # a mark a killed process left
    target = at_start(settings)
    if target is not None:
        log.info("running agent %s (%s)", target.parent.parent.name, target)
        os.execv(target, [str(target), *sys.argv[1:]])
