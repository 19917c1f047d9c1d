"""The prefill cost model the scheduler sizes prompt chunks with."""

from __future__ import annotations

import pytest

from edge_agent.engine.scheduling.stepcost import DEFAULT_TOKEN_S, PrefillCost


def test_before_any_measurement_it_uses_the_default() -> None:
    assert PrefillCost().per_token(500) == DEFAULT_TOKEN_S


def test_follows_cost_that_grows_with_depth() -> None:
    """A long prompt's chunks get dearer as it grows: the model must price the next,
    deeper chunk above the average of the ones it has seen."""
    cost = PrefillCost()
    seen = []
    for depth in range(0, 1000, 20):
        per_token = 0.003 + 0.000004 * depth  # 3 ms at the top, 7 ms 1,000 deep
        cost.observe(20, depth, 20 * per_token)
        seen.append(per_token)
    assert cost.per_token(1000) == pytest.approx(0.007, rel=0.02)
    assert cost.per_token(1000) > sum(seen[-10:]) / 10
    assert cost.slope() == pytest.approx(0.000004, rel=0.02)


def test_flat_cost_gives_no_slope() -> None:
    cost = PrefillCost()
    for _ in range(5):
        cost.observe(16, 40, 16 * 0.005)
    assert cost.slope() == 0.0
    assert cost.per_token(2000) == pytest.approx(0.005)


def test_old_chunks_fade() -> None:
    """After the machine slows down (another tenant, thermal limits), recent chunks
    decide the price within about ten chunks."""
    cost = PrefillCost()
    for depth in range(0, 200, 10):
        cost.observe(10, depth, 10 * 0.002)
    for depth in range(200, 400, 10):
        cost.observe(10, depth, 10 * 0.006)
    assert cost.per_token(400) > 0.005


def test_a_falling_line_never_prices_tokens_near_zero() -> None:
    cost = PrefillCost()
    cost.observe(10, 0, 10 * 0.010)
    cost.observe(10, 1000, 10 * 0.001)
    assert cost.slope() == 0.0
    assert cost.per_token(5000) > 0.001
