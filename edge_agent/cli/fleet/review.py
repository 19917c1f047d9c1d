"""`edge-agent fleet review`: what is due for each production model (`controller.review`):
its age and newer versions, the task kinds its evaluation does not cover, its drift from
the baseline recorded at its rollout, whether its rollback target is still on the boxes
and starts (`--verify` asks a sample of them first), and its review date. Exits 1 when
anything is flagged, so a scheduled run can page."""

from __future__ import annotations

from typing import Any

import click

from edge_agent.cli.common import CheckFailed
from edge_agent.cli.fleet.client import client_options, controller_client, sending_client
from edge_agent.cli.output import echo_json, json_option


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value - 1:+.0%}"


@click.command("review")
@client_options
@click.option("--verify", is_flag=True,
              help="First ask a sample of the boxes serving each production model whether "
                   "its rollback target is there, intact and loads (signed model.verify).")
@click.option("--sample", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Boxes asked per model with --verify.")
@click.option("--wait", "wait_s", type=click.FloatRange(0, 60), default=30.0,
              show_default=True, help="Seconds to wait for their answers.")
@json_option()
def review(verify: bool, sample: int, wait_s: float, as_json: bool) -> None:
    """Review the production models: what is due, per model (exit 1 if anything is)."""
    if verify:  # signed on the controller's host with its key, as `fleet send` is
        with sending_client(None, None, None, None) as api:
            found: dict[str, Any] = api.post("/review/verify", {"sample": sample,
                                                                "wait_s": wait_s})
    else:
        with controller_client() as api:
            found = api.get("/review")
    models = found["models"]
    if as_json:
        echo_json(found)
    else:
        if not models:
            click.echo("no production release published")
        for m in models:
            verified = m["verified"]
            good = sum(1 for a in verified if a["present"] and a["verified"] and a["loads"])
            click.echo(f"{m['name']}@{m['version']}  age {m['age_days']} d, review by "
                       f"{m['review_by'] or '-'}{' (OVERDUE)' if m['overdue'] else ''}")
            kinds = ", ".join(f"{k} {s:.0%}" for k, s in m["kinds"].items() if s)
            click.echo(f"  requests (7 d)  {m['requests']}: {kinds or '-'}; evaluation "
                       f"covers {', '.join(m['covered']) or 'nothing'}")
            drift = m["drift"]
            errors = drift.get("error_rate")
            click.echo(f"  vs baseline     TTFT p95 {_pct(drift.get('ttft_p95'))}, TPOT p95 "
                       f"{_pct(drift.get('tpot_p95'))}, server errors "
                       f"{'-' if errors is None else format(errors, '+.1%')}")
            click.echo(f"  rollback target {m['rollback_target'] or '-'}: {good} of "
                       f"{len(verified)} box(es) asked have it intact and loading")
            for flag in m["flags"]:
                click.echo(f"  ! {flag}")
    flagged = [m["name"] for m in models if m["flags"]]
    if flagged:
        raise CheckFailed(f"due: {', '.join(flagged)}")
