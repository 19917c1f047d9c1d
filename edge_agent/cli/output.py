"""How commands print: JSON for scripts, aligned tables for people, progress on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import click

from edge_agent.cli.common import F


def json_option(help: str = "Print JSON for scripts.") -> Callable[[F], F]:
    """`--json`, passed to the command as `as_json`."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]]) -> None:
    """A header and one line per row; each column is (header, format spec such as '<24')."""
    specs = [spec for _, spec in columns]
    click.echo(" ".join(format(header, spec) for header, spec in columns))
    for row in rows:
        click.echo(" ".join(format(str(cell), spec) for cell, spec in zip(row, specs, strict=True)))


def progress(label: str) -> Callable[[int, int], None]:
    """A `progress(done, total)` callback that draws a bar on stderr."""
    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = click.progressbar(length=total, label=label, file=sys.stderr)
            bar.__enter__()
            state["bar"], state["done"] = bar, 0
        bar.update(done - state["done"])
        state["done"] = done
        if done >= total:
            bar.__exit__(None, None, None)
            state.clear()

    return update
