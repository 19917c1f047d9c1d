"""`edge-agent fleet operators …`: the tokens of the people who use the controller's API,
and `fleet audit`: what they (and the controller host's users) did.

    fleet operators create NAME --role viewer|operator|admin [--json]
    fleet operators list [--json]
    fleet operators revoke NAME
    fleet audit [--since 1h|2026-12-01T08:00] [--operator NAME] [--target ID] [--json]

Run on the controller host (they open its store): a token is printed once, the store keeps
its hash; a revoked token is refused from the next request on, by a running `fleet serve`
too. The rules are `fleet.controller.operators`.
"""

from __future__ import annotations

import time

import click

from edge_agent.cli.common import BadUsage, CheckFailed
from edge_agent.cli.fleet.options import controller_options, controller_settings, open_existing
from edge_agent.cli.output import echo_json, json_option, table

ROLE_HELP = ("viewer: reads; operator: also rollouts and commands; admin: also operators "
             "and devices.")


@click.group("operators")
def operators() -> None:
    """Who may use the controller's API: tokens with a role, made and revoked here."""


@operators.command("create")
@controller_options
@click.argument("name")
@click.option("--role", required=True, type=click.Choice(["viewer", "operator", "admin"]),
              help=ROLE_HELP)
@json_option()
def operators_create(name: str, role: str, as_json: bool) -> None:
    """Make NAME a token with ROLE and print it once; only its hash is kept."""
    from edge_agent.fleet.controller.operators import check_name

    try:
        check_name(name)
    except ValueError as exc:
        raise BadUsage(str(exc)) from None
    from edge_agent.fleet.controller.audit import audited_from_cli
    from edge_agent.fleet.controller.store import DB_FILE, open_store

    settings = controller_settings()
    # The first operator may come before the first `fleet serve` (which a non-loopback
    # address refuses to start without one): this command may make the store.
    if settings.db is None and not (settings.state_dir / DB_FILE).exists():
        click.echo(f"creating the controller store {settings.state_dir / DB_FILE}", err=True)
    store = open_store(settings.db, settings.state_dir)
    try:
        with audited_from_cli(store, "operators.create", name, {"role": role}):
            token, record = store.create_operator(name, role, time.time())
    finally:
        store.close()
    if as_json:
        echo_json({**record.to_json(), "token": token})
        return
    click.echo(token)
    click.echo(f"created {role} {name} (token {record.prefix}); the token is shown only once",
               err=True)


@operators.command("list")
@controller_options
@json_option()
def operators_list(as_json: bool) -> None:
    """Every token made: name, role, prefix, created, revoked."""
    store = open_existing(controller_settings())
    try:
        records = store.operators()
    finally:
        store.close()
    if as_json:
        echo_json([r.to_json() for r in records])
        return

    def when(ts: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"

    table([("NAME", "<20"), ("ROLE", "<9"), ("PREFIX", "<9"), ("CREATED", "<17"),
           ("REVOKED", "")],
          ([r.name, r.role, r.prefix, when(r.created), when(r.revoked)] for r in records))


@operators.command("revoke")
@controller_options
@click.argument("name")
def operators_revoke(name: str) -> None:
    """Revoke NAME's token: refused from the next request on, with no restart."""
    from edge_agent.errors import ModelNotFound
    from edge_agent.fleet.controller.audit import audited_from_cli

    store = open_existing(controller_settings())
    try:
        with audited_from_cli(store, "operators.revoke", name, {}) as action:
            record = store.revoke_operator(name, time.time())
            if record is None:
                action.refused(ModelNotFound(f"operator {name!r} has no live token"))
    finally:
        store.close()
    if record is None:
        raise CheckFailed(f"operator {name!r} has no live token")
    click.echo(f"revoked {record.role} {name} (token {record.prefix})")


def _since(text: str | None) -> float | None:
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
@controller_options
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
    start = _since(since)
    store = open_existing(controller_settings())
    try:
        actions = store.actions(since=start, operator=operator_name, target=target,
                                limit=limit)
    finally:
        store.close()
    if as_json:
        echo_json([a.to_json() for a in actions])
        return
    table([("WHEN", "<19"), ("OPERATOR", "<20"), ("ROLE", "<8"), ("FROM", "<15"),
           ("ACTION", "<17"), ("TARGET", "<18"), ("OUTCOME", "")],
          ([time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a.at)), a.operator, a.role,
            a.source, a.action, a.target or "-",
            "done" if a.status < 300 else f"{a.status} {a.outcome}"] for a in actions))
