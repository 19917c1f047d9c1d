"""Download progress over the link: the throttle's choice (the first report, at most one
per `fleet.progress_interval_s`, the last), on a clock of its own and through the real
rollout runner, including a download that stops short."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge_agent.config import ConfigError, load_settings
from edge_agent.fleet.device.rollout.outcomes import ReleaseFailed
from edge_agent.fleet.device.rollout.progress import ProgressThrottle
from edge_agent.fleet.protocol.envelope import AUDIT
from edge_agent.fleet.protocol.rollout_states import ACTIVE, FAILED
from tests.fleet.device.test_rollout import Box, _roll, make_box, run

CHUNK = 64 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_throttle_sends_the_first_one_per_interval_and_the_last() -> None:
    clock = Clock()
    throttle = ProgressThrottle(5.0, clock=clock)
    sent = []
    for step in range(1, 41):  # 40 reports, 0.25 s apart: 10 s of download
        clock.now = 100.0 + 0.25 * step
        figures = throttle.offer(step * 1000, 40_000)
        if figures is not None:
            sent.append((clock.now, figures))
    assert [f["bytes"] for _, f in sent] == [1000, 21000, 40000]  # first, +5 s, last
    first, second, last = (f for _, f in sent)
    assert (first["rate_bps"], first["eta_s"]) == (0, None)  # no rate from one point
    assert second["rate_bps"] == 4000 and second["eta_s"] == 4.8  # 20 kB in 5 s
    assert (last["total"], last["eta_s"]) == (40_000, 0.0)
    assert throttle.held() is None  # the last went: nothing kept back


def test_what_a_stopped_download_reached_is_held_once_and_rates_exclude_the_part() -> None:
    clock = Clock()
    throttle = ProgressThrottle(5.0, clock=clock)
    assert throttle.offer(30_000, 100_000) is not None  # a resumed part: 30 kB there
    clock.now += 1.0
    assert throttle.offer(32_000, 100_000) is None
    clock.now += 1.0
    assert throttle.offer(34_000, 100_000) is None
    held = throttle.held()
    assert held is not None and held["bytes"] == 34_000
    assert held["rate_bps"] == 2000  # what this attempt fetched, not the part
    assert held["eta_s"] == 33.0
    assert throttle.held() is None


def test_the_interval_is_a_setting() -> None:
    assert load_settings(None).fleet.progress_interval_s == 5.0
    assert load_settings(None, **{"fleet.progress_interval_s": 30}).fleet \
        .progress_interval_s == 30
    with pytest.raises(ConfigError, match="progress_interval_s"):
        load_settings(None, **{"fleet.progress_interval_s": 0})


def _progress(box: Box) -> list[tuple[int, str, dict[str, Any]]]:
    return [(i, cls, body) for i, (_k, cls, body) in enumerate(box.emitted)
            if body["event"] == "rollout.progress"]


def test_a_rollout_sends_progress_at_most_once_per_interval(tmp_path: Path) -> None:
    interval = 0.1
    box = make_box(tmp_path, fleet={"progress_interval_s": interval}, floats=640_000)
    box.releases.chunk_delay_s = 0.01  # 40 chunks, a callback each: ~0.5 s of download
    length = box.releases.releases[("m:1", "2")].length
    chunks = -(-length // CHUNK)
    assert run(_roll(box)).state == ACTIVE
    sent = _progress(box)
    bodies = [b for _, _, b in sent]
    assert {cls for _, cls, _ in sent} == {AUDIT}
    assert bodies[0]["bytes"] == CHUNK and bodies[0]["rollout_id"] == "r1"
    assert bodies[-1]["bytes"] == bodies[-1]["total"] == length
    assert [b["bytes"] for b in bodies] == sorted({b["bytes"] for b in bodies})
    gaps = [b["ts"] - a["ts"] for a, b in zip(bodies[:-2], bodies[1:-1], strict=True)]
    assert all(gap >= interval - 0.02 for gap in gaps), gaps  # the last may come sooner
    elapsed = bodies[-1]["ts"] - bodies[0]["ts"]
    assert 3 <= len(bodies) <= 2 + elapsed / interval + 1 and len(bodies) < chunks / 2, (
        len(bodies), chunks, elapsed)
    assert bodies[1]["rate_bps"] > 0 and bodies[1]["eta_s"] > 0


def test_a_download_that_stops_short_sends_where_it_stopped(tmp_path: Path) -> None:
    box = make_box(tmp_path, fleet={"progress_interval_s": 60, "rollout_max_failures": 1},
                   floats=640_000)
    length = box.releases.releases[("m:1", "2")].length

    def cut(done: int, total: int) -> None:
        if done >= total // 2:
            raise ReleaseFailed("unreachable", done=done)

    box.releases.after_chunk = cut
    r = run(_roll(box))
    assert (r.state, r.reason) == (FAILED, "unreachable")
    sent = _progress(box)
    assert [b["bytes"] for _, _, b in sent] == [CHUNK, (length // 2 // CHUNK + 1) * CHUNK]
    failed = next(i for i, (_k, _c, b) in enumerate(box.emitted)
                  if b["event"] == "rollout.transition" and b["to"] == FAILED)
    assert sent[-1][0] < failed  # reported before the failure it explains
