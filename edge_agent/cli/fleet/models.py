"""`edge-agent fleet models history NAME`: a model's story on the controller's side, every
rollout of it, newest first: which version, how far it went, and who started, paused,
aborted or rolled it back (the audit trail). The box's own `edge-agent models history`
tells the same story from the box (each switch `by` its rollout)."""

from __future__ import annotations

import time
from typing import Any

import click

from edge_agent.cli.fleet.client import client_options, controller_client
from edge_agent.cli.output import echo_json, json_option, table


@click.group("models")
def models() -> None:
    """The fleet's models, as the controller's rollouts changed them."""


@models.command("history")
@client_options
@click.argument("name")
@click.option("-n", "limit", type=click.IntRange(1, 1000), default=50, show_default=True,
              help="Only the newest N rollouts.")
@json_option()
def models_history(name: str, limit: int, as_json: bool) -> None:
    """Every rollout of NAME, newest first, with who acted on it."""
    with controller_client() as api:
        found = api.get("/model-history", name=name, limit=limit)
    if as_json:
        echo_json(found)
        return

    def when(ts: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"

    def who(r: dict[str, Any]) -> str:
        return "; ".join(f"{a['action'].removeprefix('rollout.')} by {a['operator']}"
                         for a in r.get("actions") or () if a["status"] < 300) or "-"

    click.echo(f"{found['name']}: {len(found['rollouts'])} rollout(s)")
    table([("CREATED", "<17"), ("ROLLOUT", "<18"), ("VERSION", "<10"), ("STATE", "<12"),
           ("ACTIVE", ">6"), ("FAILED", ">6"), ("WHO", "")],
          ([when(r["created_at"]), r["id"], r["version"], r["state"],
            r["phases"]["succeeded"], r["phases"]["failed"], who(r)]
           for r in found["rollouts"]))
