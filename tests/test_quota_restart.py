"""A tenant's rate and quota windows survive a restart: each request's ledger row says what
it counted (`quota_requests`, `quota_tokens`), and a starting box reads the last day of
them back, so a restart, or a crash loop, hands no tenant a fresh quota."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from edge_agent.config import load_settings
from edge_agent.errors import RateLimited
from edge_agent.governance.keys import KeyStore
from edge_agent.governance.tenants import Governor, TenantContext
from edge_agent.ledger.store import open_ledger, quota_usage
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

CONFIG = """
[tenants.kiosk]
models = ["smollm2:*"]
requests_per_minute = 2

[tenants.metered]
models = ["smollm2:*"]
tokens_per_day = 30
"""


def _governor(tmp_path: Path) -> tuple[Governor, dict[str, TenantContext]]:
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG + "\n[tenants.per_minute]\ntokens_per_minute = 100\n")
    settings = load_settings(cfg, state_dir=tmp_path / "state")
    governor = Governor(settings, KeyStore(settings.state_dir))
    return governor, {name: TenantContext(name, governor.policy(name))
                      for name in ("kiosk", "metered", "per_minute")}


def test_restore_fills_each_window_from_the_rows_within_it(tmp_path: Path) -> None:
    governor, ctx = _governor(tmp_path)
    now = time.time()
    governor.restore([
        ("kiosk", now - 120, 1, 0),  # past the minute: forgotten
        ("kiosk", now - 30, 1, 0),
        ("kiosk", now + 3600, 1, 0),  # stamped ahead of the clock: counts as now
        ("metered", now - 80_000, 1, 25),  # within the day
        ("metered", now - 90_000, 1, 1000),  # past it
        ("per_minute", now - 61, 1, 100),
        ("gone", now, 1, 10**9),  # a tenant no longer configured: nothing to fill
    ], now=now)
    with pytest.raises(RateLimited, match="2 requests per minute") as refused:
        governor.admit(ctx["kiosk"])
    assert 29 <= refused.value.retry_after <= 31
    governor.admit(ctx["metered"])  # 25 of 30 tokens used: admitted
    governor.charge(ctx["metered"], 5)
    with pytest.raises(RateLimited, match="30 tokens per day") as spent:
        governor.admit(ctx["metered"])
    assert 6000 < spent.value.retry_after < 7000
    governor.admit(ctx["per_minute"])  # its 100 tokens were 61 s ago


def test_quota_usage_reads_what_the_rows_counted(tmp_path: Path) -> None:
    db = open_ledger(tmp_path / "ledger.db")
    now = time.time()
    db["requests"].insert_all([  # type: ignore[union-attr]
        {"id": "a", "ts": now - 10, "tenant": "kiosk", "quota_requests": 1, "quota_tokens": 7},
        {"id": "b", "ts": now - 5, "tenant": "kiosk", "status": 401},  # never admitted
        {"id": "c", "ts": now - 100_000, "tenant": "kiosk", "quota_requests": 1},
        {"id": "d", "ts": now - 1, "tenant": "metered", "quota_tokens": 12}])
    assert quota_usage(db, now - 86_400) == [("kiosk", now - 10, 1, 7),
                                             ("metered", now - 1, 0, 12)]
    db.close()


def _ask(live: LiveServer, key: str) -> httpx.Response:
    return httpx.post(f"{live.base_url}/api/generate", timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": DEFAULT_MODEL, "prompt": "Say hello to the shop.",
                            "stream": False, "options": {"num_predict": 24}})


@pytest.mark.integration
def test_a_tenants_quota_survives_a_restart(model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG)
    keys = {t: KeyStore(state).create(t)[0] for t in ("kiosk", "metered")}

    def serve() -> LiveServer:
        return start_server(load_settings(cfg, state_dir=state, **{
            "server.port": free_port(), "runtime.context_length": 512}))

    live = serve()
    try:
        spent = _ask(live, keys["metered"])  # more than its 30 tokens in one answer
        assert spent.status_code == 200, spent.text
        used = spent.json()["prompt_eval_count"] + spent.json()["eval_count"]
        assert used > 30
        assert _ask(live, keys["metered"]).status_code == 429
        admitted = [_ask(live, keys["kiosk"]) for _ in range(2)]
        second_at = time.monotonic()
        assert [r.status_code for r in admitted] == [200, 200]
        assert _ask(live, keys["kiosk"]).status_code == 429
    finally:
        live.stop()
    db = sqlite3.connect(state / "ledger.db")
    counted = db.execute("SELECT tenant, SUM(quota_requests), SUM(quota_tokens) FROM requests "
                         "GROUP BY tenant ORDER BY tenant").fetchall()
    db.close()
    assert counted == [("kiosk", 2, counted[0][2]), ("metered", 1, used)]

    live = serve()  # the same state dir: the same ledger
    try:
        again = _ask(live, keys["metered"])
        assert again.status_code == 429, again.text
        assert "30 tokens per day" in again.json()["error"]
        assert int(again.headers["Retry-After"]) > 80_000  # the day's window, not a fresh one
        # The minute's window: refused while the two requests are within it, with the wait
        # that is left of it (a box slow to restart may have let the minute pass).
        kiosk = _ask(live, keys["kiosk"])
        left = 60 - (time.monotonic() - second_at)
        if left > 2:
            assert kiosk.status_code == 429, kiosk.text
            assert int(kiosk.headers["Retry-After"]) <= left + 2
        else:
            assert kiosk.status_code in (200, 429)
    finally:
        live.stop()
