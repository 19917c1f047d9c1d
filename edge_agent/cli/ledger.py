"""`edge-agent ledger`: read, summarise, export and purge the request ledger."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from edge_agent.cli.common import BadUsage, CheckFailed, F, common_options, load
from edge_agent.cli.output import echo_json, json_option, table
from edge_agent.config import Settings

if TYPE_CHECKING:
    from sqlite_utils import Database


def _ledger_path(settings: Settings) -> Path:
    """The ledger of these settings; the CLI never creates one."""
    path = settings.state_dir / "ledger.db"
    if not path.exists():
        raise CheckFailed(f"no ledger at {path} (the server creates it at start)")
    return path


def _open() -> Database:
    from edge_agent.ledger.store import open_ledger

    return open_ledger(_ledger_path(load()))


def _since(ctx: click.Context, param: click.Parameter, value: str) -> float:
    from edge_agent.ledger.report import parse_since

    try:
        return parse_since(value)
    except ValueError as exc:
        raise BadUsage(str(exc)) from None


def since_option(default: str) -> Callable[[F], F]:
    """`--since 30m|1h|7d …`, passed to the command as an epoch timestamp."""
    return click.option("--since", default=default, show_default=True, callback=_since,
                        help="Window: 30m, 1h, 7d …")


@click.group()
def ledger() -> None:
    """Read, summarise, export and purge the request ledger."""


@ledger.command("tail")
@common_options
@click.option("-n", "count", type=click.IntRange(1), default=20, show_default=True,
              help="Rows to show.")
@click.option("-f", "follow", is_flag=True, help="Keep printing new rows.")
@json_option("One JSON object per row.")
def ledger_tail(count: int, follow: bool, as_json: bool) -> None:
    """Show the latest requests (metadata only; no prompt or completion text)."""
    from edge_agent.ledger.report import line
    from edge_agent.ledger.store import tail

    db = _open()
    rows = tail(db, count)
    while True:
        for row in rows:
            click.echo(json.dumps(row) if as_json else line(row))
        if not follow:
            return
        last = rows[-1]["ts"] if rows else 0.0
        time.sleep(1.0)
        rows = tail(db, count, after_ts=last) or []


@ledger.command("stats")
@common_options
@since_option("1h")
@click.option("--by", type=click.Choice(["model", "tenant", "endpoint", "dialect",
                                         "risk_tier"]),
              default="model", show_default=True, help="What to group the rows by.")
@json_option()
def ledger_stats(since: float, by: str, as_json: bool) -> None:
    """Counts, errors, p50/p95 TTFT and TPOT, and the apps' verdicts (good, bad) per
    model or tenant."""
    from edge_agent.ledger.report import stats
    from edge_agent.ledger.store import rows_since

    result = stats(rows_since(_open(), since), by)
    if as_json:
        echo_json(result)
        return

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    table([(by.upper(), "<24"), ("REQS", ">6"), ("ERRS", ">5"), ("TTFT p50", ">9"),
           ("p95", ">6"), ("TPOT p50", ">9"), ("p95", ">6"), ("GOOD", ">5"), ("BAD", ">5")],
          ([r[by], r["requests"], r["errors"], ms(r["ttft_p50_ms"]), ms(r["ttft_p95_ms"]),
            ms(r["tpot_p50_ms"]), ms(r["tpot_p95_ms"]), r["feedback_good"],
            r["feedback_bad"]] for r in result))


@ledger.command("degraded")
@common_options
@since_option("1d")
@click.option("--tier", type=click.Choice(["low", "normal", "high"]),
              help="Only requests of this risk tier.")
@click.option("--action", type=click.Choice(["fallback", "queued", "refused"]),
              help="Only what the box did: another model answered, queued, refused.")
@json_option("One JSON object per row.")
def ledger_degraded(since: float, tier: str | None, action: str | None,
                    as_json: bool) -> None:
    """Requests a saturated box served otherwise than asked, by risk tier: what it did,
    why, and the model asked → the model that answered."""
    from edge_agent.ledger.store import degraded_since

    rows = degraded_since(_open(), since, tier=tier, action=action)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    table([("TIME", "<19"), ("TIER", "<6"), ("ACTION", "<8"), ("REASON", "<10"),
           ("STATUS", ">6"), ("MODEL ASKED → ANSWERED", "<40"), ("TRACE", "<32")],
          ([time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])), r["risk_tier"],
            r["degradation"], r["degradation_reason"], r["status"],
            f"{r['requested_model']} → "
            f"{r['model'] if r['degradation'] == 'fallback' else '-'}", r["trace_id"]]
           for r in rows))


@ledger.command("export")
@common_options
@since_option("1d")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl",
              show_default=True, help="JSON lines, or CSV with a header row.")
def ledger_export(since: float, fmt: str) -> None:
    """Write the rows of a window to stdout as JSON lines or CSV."""
    from edge_agent.ledger.report import export
    from edge_agent.ledger.store import rows_since

    for chunk in export(rows_since(_open(), since), fmt):
        click.echo(chunk, nl=False)


@ledger.command("purge")
@common_options
def ledger_purge() -> None:
    """Delete rows older than retention.ledger_days (the server also does it hourly)."""
    from edge_agent.ledger.retention import purge_expired

    settings = load()
    removed = purge_expired(_ledger_path(settings), settings.retention)
    click.echo(f"removed {removed} rows older than {settings.retention.ledger_days:g} days")
