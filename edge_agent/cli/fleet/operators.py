"""`edge-agent fleet operators …`: the tokens of the people who use the controller's API,
and `fleet audit`: what they (and the controller host's users) did.

    fleet operators create NAME --role viewer|operator|admin [--json]
    fleet operators list [--json]
    fleet operators revoke NAME
    fleet audit [--since 1h|2026-12-01T08:00] [--operator NAME] [--target ID] [--json]

An admin's commands, on the controller host (in-process, as every `fleet` command there)
or from a desk with --controller and an admin's token: a token is printed once, the store
keeps its hash; a revoked token is refused from the next request on, by a running `fleet
serve` too. The rules are `fleet.controller.operators`, the routes
`fleet.controller.operator_api`.
"""

from __future__ import annotations

import time

import click

from edge_agent.cli.common import BadUsage
from edge_agent.cli.fleet.client import client_options, controller_client, segment
from edge_agent.cli.output import echo_json, json_option, table

ROLE_HELP = ("viewer: reads; operator: also rollouts and commands; admin: also operators "
             "and devices.")


@click.group("operators")
def operators() -> None:
    """Who may use the controller's API: tokens with a role, made and revoked here."""


@operators.command("create")
@client_options
@click.argument("name")
@click.option("--role", required=True, type=click.Choice(["viewer", "operator", "admin"]),
              help=ROLE_HELP)
@json_option()
def operators_create(name: str, role: str, as_json: bool) -> None:
    """Make NAME a token with ROLE and print it once; only its hash is kept."""
    # The first operator may come before the first `fleet serve` (which an address other
    # than loopback refuses to start without one): this command may make the store.
    with controller_client(create=True) as api:
        made = api.post("/operators", {"name": name, "role": role})
    if as_json:
        echo_json(made)
        return
    click.echo(made["token"])
    click.echo(f"created {role} {name} (token {made['prefix']}); the token is shown only once",
               err=True)


@operators.command("list")
@client_options
@json_option()
def operators_list(as_json: bool) -> None:
    """Every token made: name, role, prefix, created, revoked."""
    with controller_client() as api:
        records = api.get("/operators")
    if as_json:
        echo_json(records)
        return

    def when(ts: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"

    table([("NAME", "<20"), ("ROLE", "<9"), ("PREFIX", "<9"), ("CREATED", "<17"),
           ("REVOKED", "")],
          ([r["name"], r["role"], r["prefix"], when(r["created"]), when(r["revoked"])]
           for r in records))


@operators.command("revoke")
@client_options
@click.argument("name")
def operators_revoke(name: str) -> None:
    """Revoke NAME's token: refused from the next request on, with no restart."""
    with controller_client() as api:
        record = api.post(f"/operators/{segment(name)}/revoke")
    click.echo(f"revoked {record['role']} {name} (token {record['prefix']})")


def since_time(text: str | None) -> float | None:
    """`1h` (that long ago), an ISO date or time (local unless it says), or Unix seconds."""
    import datetime

    from edge_agent.errors import InvalidRequest
    from edge_agent.fleet.controller.waves import parse_duration

    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return time.time() - parse_duration(text, param="since")
    except InvalidRequest:
        pass
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise BadUsage(f"--since {text!r}: a duration ago (90m, 1d), an ISO date or time, or "
                       "Unix seconds") from None


@click.command("audit")
@client_options
@click.option("--since", help="Only actions since then: 1h (ago), 2026-12-01T08:00, or Unix "
                              "seconds.")
@click.option("--operator", "operator_name", help="Only this operator's (local:USER for the "
                                                  "controller host's CLI).")
@click.option("--target", help="Only actions on this rollout id or operator name.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=1000, show_default=True,
              help="The latest this many.")
@json_option()
def audit(since: str | None, operator_name: str | None, target: str | None, limit: int,
          as_json: bool) -> None:
    """Who did what: each operator action (rollouts, operators), done or refused, oldest
    first."""
    start = since_time(since)
    with controller_client() as api:
        actions = api.get("/audit", since=start, operator=operator_name, target=target,
                          limit=limit)["actions"]
    if as_json:
        echo_json(actions)
        return
    table([("WHEN", "<19"), ("OPERATOR", "<20"), ("ROLE", "<8"), ("FROM", "<15"),
           ("ACTION", "<17"), ("TARGET", "<18"), ("OUTCOME", "")],
          ([time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["at"])), a["operator"],
            a["role"], a["source"], a["action"], a["target"] or "-",
            "done" if a["status"] < 300 else f"{a['status']} {a['outcome']}"] for a in actions))
