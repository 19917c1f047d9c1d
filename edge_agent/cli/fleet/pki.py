"""`edge-agent fleet pki …`: the fleet's own CA and the certificates it issues
(`fleet.controller.pki`).

    fleet pki init [--dir pki] [--name TEXT] [--days 3650]
    fleet pki issue NAME --kind broker|controller|releases|bridge|box [--dns HOST]...
                    [--ip ADDRESS]... [--days 397] [--dir pki] [--json]
    fleet pki list [--dir pki] [--json]
    fleet pki renew [--within 30d] [--dir pki] [--json]

Files only: run it where the CA key is kept (a desk or an offline machine, not the broker),
then copy each certificate and key where its service reads it.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from edge_agent.cli.common import BadUsage
from edge_agent.cli.output import echo_json, json_option, table

DIR_OPTION = click.option("--dir", "folder", type=click.Path(path_type=Path, file_okay=False),
                          default=Path("pki"), show_default=True,
                          help="The CA's folder: ca.pem, ca.key, the certificates issued.")
# Where each kind goes, said after it is issued.
USE = {
    "broker": "fleet broker-config --tls-cert {pem} --tls-key {key}; each box's "
              "[fleet] ca_file and the controller's [broker] ca_file: {ca}",
    "controller": "the controller's [http] tls_cert_file = {pem}, tls_key_file = {key}; "
                  "desks: --ca-file {ca} (EDGE_AGENT_CONTROLLER_CA_FILE)",
    "releases": "the release server's certificate and key; each box's [fleet] "
                "artifacts_ca_file: {ca}",
    "bridge": "the regional broker's bridge: bridge_certfile {pem}, bridge_keyfile {key}",
    "box": "the box's [fleet] client_cert = {pem}, client_key = {key} (the broker's "
           "broker-config --ca {ca} asks for it)",
}


@click.group("pki")
def pki() -> None:
    """The fleet's certificate authority: the broker's, the controller's, the release
    server's, the bridges' and the boxes' certificates."""


@pki.command("init")
@DIR_OPTION
@click.option("--name", default="edge-agent fleet CA", show_default=True,
              help="The CA's common name, shown in every certificate it issues.")
@click.option("--days", type=click.IntRange(30, 36500), default=3650, show_default=True,
              help="How long the CA lives.")
def pki_init(folder: Path, name: str, days: int) -> None:
    """Make the fleet CA once: ca.pem (what every client trusts) and ca.key (0600)."""
    from edge_agent.fleet.controller.pki import FleetCA

    ca = FleetCA.init(folder, name=name, days=days)
    click.echo(f"wrote {ca.cert_file} (give it to every client) and {ca.key_file} (0600: "
               "keep it where only `fleet pki` runs)")


@pki.command("issue")
@DIR_OPTION
@click.argument("name")
@click.option("--kind", required=True,
              type=click.Choice(["broker", "controller", "releases", "bridge", "box"]),
              help="Servers: broker, controller, releases; clients: bridge, box (NAME is "
                   "then the device id or the bridge user).")
@click.option("--dns", multiple=True, metavar="HOST", help="A DNS name clients reach it by.")
@click.option("--ip", multiple=True, metavar="ADDRESS", help="An address clients reach it by.")
@click.option("--days", type=click.IntRange(1, 36500), default=397, show_default=True,
              help="How long the certificate lives (never past the CA).")
@json_option()
def pki_issue(folder: Path, name: str, kind: str, dns: tuple[str, ...],
              ip: tuple[str, ...], days: int, as_json: bool) -> None:
    """Issue NAME.pem and a new NAME.key (0600); issuing a name again replaces both."""
    from edge_agent.fleet.controller.pki import FleetCA

    issued = FleetCA(folder).issue(name, kind, dns=dns, ips=ip, days=days)
    if as_json:
        echo_json(issued.to_json())
        return
    pem, key = folder / f"{name}.pem", folder / f"{name}.key"
    click.echo(f"wrote {pem} and {key} ({kind}, until "
               f"{time.strftime('%Y-%m-%d', time.gmtime(issued.not_after))})")
    click.echo("use: " + USE[kind].format(pem=pem, key=key, ca=folder / "ca.pem"))


@pki.command("list")
@DIR_OPTION
@json_option()
def pki_list(folder: Path, as_json: bool) -> None:
    """Every certificate issued: kind, names, days left (renew soon: 30 or fewer)."""
    from edge_agent.fleet.controller.pki import RENEW_WITHIN_DAYS, FleetCA

    ca = FleetCA(folder)
    now = time.time()
    rows = ca.issued()
    if as_json:
        echo_json({"ca_not_after": ca.ca_not_after(),
                   "certificates": [{**i.to_json(), "days_left": round(i.left_days(now), 1)}
                                    for i in rows]})
        return
    click.echo(f"CA {ca.cert_file}: {(ca.ca_not_after() - now) / 86400:.0f} days left")
    table([("NAME", "<20"), ("KIND", "<10"), ("NAMES", "<40"), ("DAYS LEFT", ">9"),
           ("STATE", "<7")],
          [[i.name, i.kind, ",".join(i.dns + i.ips) or "-", f"{i.left_days(now):.0f}",
            "expired" if i.left_days(now) <= 0 else
            "renew" if i.left_days(now) <= RENEW_WITHIN_DAYS else "ok"] for i in rows])


@pki.command("renew")
@DIR_OPTION
@click.option("--within", default="30d", show_default=True, metavar="DURATION",
              help="Reissue every certificate that ends within this (7d, 720h …).")
@json_option()
def pki_renew(folder: Path, within: str, as_json: bool) -> None:
    """Reissue, with new keys and the same names, the certificates ending soon; run it
    from a timer, then copy and reload what it names."""
    from edge_agent.errors import InvalidRequest
    from edge_agent.fleet.controller.pki import FleetCA
    from edge_agent.fleet.controller.waves import parse_duration

    try:
        days = parse_duration(within, param="within") / 86400
    except InvalidRequest as exc:
        raise BadUsage(f"--within: {exc.message}") from None
    renewed = FleetCA(folder).renew(within_days=days)
    if as_json:
        echo_json({"renewed": [i.to_json() for i in renewed]})
        return
    if not renewed:
        click.echo(f"nothing ends within {within}")
    for i in renewed:
        click.echo(f"renewed {folder / (i.name + '.pem')} ({i.kind}): copy it and its key "
                   "where they are read, then reload that service")
