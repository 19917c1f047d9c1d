"""How commands print: JSON for scripts, aligned tables for people, progress on stderr
(a download's bar only where stderr is a terminal)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

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


def is_terminal(stream: IO[Any]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def duration(seconds: float | None) -> str:
    """An ETA as a clock: 0:07, 12:30, 1:02:03; `--` when unknown."""
    if seconds is None:
        return "--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def transfer_figures(done: int, total: int, rate_bps: float, eta_s: float | None, *,
                     sizes: bool = True) -> str:
    """`42%  12.6/30.0 MB  3.1 MB/s  ETA 0:06` (without the sizes: for a table)."""
    percent = 100 * done / total if total else 100.0
    sizes_part = [f"{done / 1e6:.1f}/{total / 1e6:.1f} MB"] if sizes else []
    return "  ".join([f"{percent:3.0f}%", *sizes_part, f"{rate_bps / 1e6:.1f} MB/s",
                      f"ETA {duration(eta_s)}"])


class TransferBar:
    """A download's `progress(done, total, rate_bps, eta_s)`: one line on `file`, redrawn
    in place: a bar, bytes done and total, the rate and the ETA. `close()` ends the line
    (the transfer's last call may come short of the total when it stopped)."""

    def __init__(self, label: str, file: IO[Any], width: int = 24) -> None:
        self.label, self.file, self.width = label, file, width
        self._drawn = 0  # characters of the line on screen; 0: none

    def __call__(self, done: int, total: int, rate_bps: float, eta_s: float | None) -> None:
        filled = self.width * done // total if total else self.width
        line = (f"{self.label} [{'#' * filled}{' ' * (self.width - filled)}] "
                f"{transfer_figures(done, total, rate_bps, eta_s)}")
        self.file.write("\r" + line.ljust(self._drawn))
        self.file.flush()
        self._drawn = len(line)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._drawn:
            self.file.write("\n")
            self.file.flush()
            self._drawn = 0


def transfer_bar(label: str, *, quiet: bool = False) -> TransferBar | None:
    """A bar on stderr when it is a terminal (and not `quiet`, as with --json); else None:
    a pipe or a log gets no carriage returns."""
    if quiet or not is_terminal(sys.stderr):
        return None
    return TransferBar(label, sys.stderr)
