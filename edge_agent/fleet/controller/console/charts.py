"""Line charts as SVG, drawn by the server: the service levels over a window with every
release that started in it as a marker.

The console fetches nothing from elsewhere and has no build step, so a chart is markup the
template embeds: a polyline per series, its axes labelled, a dashed vertical line and a
label per release, and a `<title>` on each point and marker for the figure under the
pointer. Values are escaped like any other text (`markupsafe`); the labels are the
controller's own words and the releases' names and versions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup, escape

WIDTH, HEIGHT = 720, 200
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 14, 28
COLOURS = ("#1f5fa8", "#c0392b", "#2e8b57", "#8e44ad")


@dataclass(frozen=True)
class Line:
    label: str
    points: Sequence[float | None]  # one per bucket; None: nothing measured there


@dataclass(frozen=True)
class Marker:
    at: float
    label: str
    href: str


def _nice_top(value: float) -> float:
    """A round number at or above `value` for the y axis."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


def _clock(ts: float, step: float) -> str:
    return time.strftime("%H:%M" if step < 86400 else "%m-%d", time.localtime(ts))


def line_chart(chart_id: str, title: str, unit: str, starts: Sequence[float], step: float,
               lines: Sequence[Line], markers: Sequence[Marker]) -> Markup:
    """An SVG chart of `lines` over buckets starting at `starts` (each `step` long)."""
    n = len(starts)
    values = [v for line in lines for v in line.points if v is not None]
    top = _nice_top(max(values, default=0.0))
    t0 = starts[0] if starts else 0.0
    span = max(step * n, step)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(ts: float) -> float:
        return LEFT + (ts - t0) / span * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - v / top * plot_h

    parts = [f'<svg id="{escape(chart_id)}" class="chart" role="img" viewBox="0 0 {WIDTH} '
             f'{HEIGHT}" width="{WIDTH}" height="{HEIGHT}" aria-labelledby="{escape(chart_id)}-t"'
             f' xmlns="http://www.w3.org/2000/svg"><title id="{escape(chart_id)}-t">'
             f'{escape(title)}</title>']
    parts.append(f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH - RIGHT}" '
                 f'y2="{TOP + plot_h}" class="axis"/>')
    parts.append(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" class="axis"/>')
    for frac in (0.0, 0.5, 1.0):
        tick = top * frac
        parts.append(f'<text x="{LEFT - 4}" y="{y(tick) + 4:.1f}" text-anchor="end" '
                     f'class="tick">{tick:g}{escape(unit)}</text>')
    for i in range(0, n, max(1, n // 6)):
        parts.append(f'<text x="{x(starts[i]):.1f}" y="{HEIGHT - 8}" text-anchor="middle" '
                     f'class="tick">{_clock(starts[i], step)}</text>')
    for k, line in enumerate(lines):
        colour = COLOURS[k % len(COLOURS)]
        runs: list[list[str]] = [[]]
        for i, v in enumerate(line.points):
            if v is None:
                runs.append([])
                continue
            px, py = x(starts[i] + step / 2), y(v)
            runs[-1].append(f"{px:.1f},{py:.1f}")
            parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2" fill="{colour}">'
                         f'<title>{escape(line.label)} {v:g}{escape(unit)} at '
                         f'{_clock(starts[i], step)}</title></circle>')
        for run in runs:
            if len(run) > 1:
                parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                             f'points="{" ".join(run)}"/>')
        parts.append(f'<text x="{LEFT + 8 + 150 * k}" y="{TOP + 10}" fill="{colour}" '
                     f'class="legend">{escape(line.label)}</text>')
    for m in markers:
        if not t0 <= m.at <= t0 + span:
            continue
        mx = x(m.at)
        # The label on the side of the line with room for it.
        right = mx < LEFT + plot_w * 0.6
        lx, anchor = (mx + 3, "start") if right else (mx - 3, "end")
        parts.append(f'<a href="{escape(m.href)}" class="marker"><line x1="{mx:.1f}" '
                     f'y1="{TOP}" x2="{mx:.1f}" y2="{TOP + plot_h}" stroke-dasharray="4 3"/>'
                     f'<text x="{lx:.1f}" y="{TOP + plot_h - 4}" text-anchor="{anchor}" '
                     f'class="marker-label">{escape(m.label)}</text>'
                     f'<title>{escape(m.label)} started '
                     f'{time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.at))}</title></a>')
    parts.append("</svg>")
    return Markup(f'<figcaption>{escape(title)}</figcaption>{"".join(parts)}')


def service_levels(series: dict[str, Any]) -> list[Markup]:
    """The SLO page's charts from `SLOQueries.series(…).to_json()`: latency, requests and
    their outcome, throughput, structured output, degradations, and the answers people
    sent back."""
    buckets = series["buckets"]
    starts = [b["start"] for b in buckets]
    step = float(series["step"])
    markers = [Marker(m["at"], f'{m["name"]}@{m["version"]}', f'/console/rollouts/{m["rollout"]}')
               for m in series["markers"]]

    def col(key: str) -> list[float | None]:
        return [b[key] for b in buckets]

    def counted(key: str) -> list[float | None]:
        return [b[key] if b["requests"] or b[key] else None for b in buckets]

    return [
        line_chart("chart-ttft", "Time to first token (ms)", " ms", starts, step,
                   [Line("p95", col("ttft_p95")), Line("p50", col("ttft_p50")),
                    Line("worst box p95", col("ttft_worst"))], markers),
        line_chart("chart-tpot", "Time per output token (ms)", " ms", starts, step,
                   [Line("p95", col("tpot_p95")), Line("p50", col("tpot_p50"))], markers),
        line_chart("chart-requests", "Requests by outcome", "", starts, step,
                   [Line("ok", counted("ok")), Line("server errors", counted("server_errors")),
                    Line("client errors", counted("client_errors")),
                    Line("to upstreams", counted("upstream"))], markers),
        line_chart("chart-tokens", "Tokens generated per second", "", starts, step,
                   [Line("tokens/s", [b["tokens_per_s"] if b["requests"] else None
                                      for b in buckets])], markers),
        line_chart("chart-structured", "Structured output: closed, cut, refused", "", starts,
                   step, [Line("closed", counted("structured_closed")),
                          Line("cut", counted("structured_cut")),
                          Line("refused", counted("structured_refused"))], markers),
        line_chart("chart-degradations", "Degraded requests by risk tier (the boxes')", "",
                   starts, step, [Line(tier, [b["degraded"].get(tier) for b in buckets])
                                  for tier in _busiest_tiers(buckets)], markers),
        line_chart("chart-feedback", "Answers rated by people", "", starts, step,
                   [Line("good", counted("feedback_good")),
                    Line("bad", counted("feedback_bad"))], markers),
    ]


def _busiest_tiers(buckets: Sequence[dict[str, Any]], most: int = len(COLOURS)) -> list[str]:
    """The risk tiers with the most degraded requests in the window, at most one per
    colour."""
    totals: dict[str, int] = {}
    for b in buckets:
        for tier, n in b["degraded"].items():
            totals[tier] = totals.get(tier, 0) + n
    return sorted(totals, key=lambda t: (-totals[t], t))[:most]
