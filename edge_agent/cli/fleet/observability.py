"""`edge-agent fleet observability rules|dashboard`: the Prometheus alerting rules and the
Grafana dashboard the controller ships for its two scrape jobs (`/metrics`, the controller;
`/fleet-metrics`, every box's service levels), printed to load into those tools."""

from __future__ import annotations

from pathlib import Path

import click

SHIPPED = Path(__file__).resolve().parents[2] / "fleet" / "controller" / "observability"


@click.group("observability")
def observability() -> None:
    """The alerting rules and dashboard for Prometheus and Grafana."""


@observability.command("rules")
def rules() -> None:
    """Print the Prometheus alerting rules (box offline, TTFT p95 over its SLO, server
    errors up after a release); thresholds come from the controller's [slo]."""
    click.echo((SHIPPED / "alerts.yml").read_text(), nl=False)


@observability.command("dashboard")
def dashboard() -> None:
    """Print the Grafana dashboard (JSON): the service levels with every release as an
    annotation."""
    click.echo((SHIPPED / "grafana-dashboard.json").read_text(), nl=False)
