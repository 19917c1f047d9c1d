"""config.patch: only the allow-list, values validated as the config file's are, persisted
atomically and applied at start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edge_agent.config import Settings, load_settings
from edge_agent.fleet.commands import Command, CommandRefused
from edge_agent.fleet.overlay import (
    OVERLAY_FILE,
    apply_overlay,
    apply_patch,
    config_patch_handler,
    load_overlay,
    patched,
)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[tenants.shop]\nrequests_per_minute = 100\n[tenants."eu.north"]\n'
                   "[telemetry]\ninterval_s = 5\n")
    return load_settings(cfg)


def refused(exc: pytest.ExceptionInfo[CommandRefused]) -> str:
    assert exc.value.reason == "malformed"
    return exc.value.message


def test_allowed_keys_are_applied_and_persisted(settings: Settings, tmp_path: Path) -> None:
    state = tmp_path / "state"
    changes = {"telemetry.interval_s": 10, "fleet.metrics_interval_s": 30,
               "fleet.ledger_interval_s": 120.5, "retention.ledger_days": 30,
               "retention.content_hours": 0, "tenants.shop.requests_per_minute": 5,
               "tenants.shop.tokens_per_minute": 1000, "tenants.shop.tokens_per_day": None,
               "tenants.eu.north.tokens_per_day": 50_000,
               "fleet.max_download_bytes_per_s": 2_000_000, "fleet.progress_interval_s": 30,
               "fleet.rollout_nice": 15}
    new = apply_patch(settings, state, changes)
    assert new.fleet.max_download_bytes_per_s == 2_000_000
    assert (new.fleet.progress_interval_s, new.fleet.rollout_nice) == (30, 15)
    assert new.telemetry.interval_s == 10 and new.fleet.metrics_interval_s == 30
    assert new.fleet.ledger_interval_s == 120.5 and new.retention.ledger_days == 30
    assert new.tenants["shop"].requests_per_minute == 5
    assert new.tenants["shop"].tokens_per_minute == 1000
    assert new.tenants["eu.north"].tokens_per_day == 50_000
    assert settings.telemetry.interval_s == 5  # the original is untouched
    saved = json.loads((state / OVERLAY_FILE).read_text())
    assert saved == {"v": 1, "set": changes}
    assert [p.name for p in state.iterdir()] == [OVERLAY_FILE]  # no temp file left
    # At the next start: the same values over the config file.
    again = apply_overlay(settings, state)
    assert again.model_dump() == new.model_dump()


def test_patches_merge(settings: Settings, tmp_path: Path) -> None:
    apply_patch(settings, tmp_path, {"telemetry.interval_s": 10})
    apply_patch(settings, tmp_path, {"retention.ledger_days": 7})
    assert load_overlay(tmp_path) == {"telemetry.interval_s": 10, "retention.ledger_days": 7}


@pytest.mark.parametrize("key", [
    "server.port", "fleet.broker", "fleet.command_key_file", "state_dir", "telemetry",
    "telemetry.interval_s.x", "tenants.shop.models", "tenants.shop.manage_models",
    "tenants.shop", "runtime.parallel", "default_model", "tenants..requests_per_minute",
])
def test_a_key_outside_the_allow_list_is_refused(settings: Settings, tmp_path: Path,
                                                 key: str) -> None:
    with pytest.raises(CommandRefused) as info:
        apply_patch(settings, tmp_path, {"telemetry.interval_s": 10, key: 1})
    assert key in refused(info)
    assert not (tmp_path / OVERLAY_FILE).exists()  # nothing of the patch persisted


@pytest.mark.parametrize(("key", "value"), [
    ("telemetry.interval_s", 0), ("telemetry.interval_s", -1), ("telemetry.interval_s", "10"),
    ("telemetry.interval_s", True), ("telemetry.interval_s", None),
    ("retention.content_hours", -1), ("fleet.metrics_interval_s", [1]),
    ("tenants.shop.tokens_per_day", 0), ("tenants.shop.requests_per_minute", 1.5),
    ("retention.ledger_days", float("inf")), ("fleet.rollout_nice", 20),
    ("fleet.max_download_bytes_per_s", 100), ("fleet.progress_interval_s", None),
])
def test_a_bad_value_is_refused_naming_the_key(settings: Settings, tmp_path: Path, key: str,
                                               value: Any) -> None:
    with pytest.raises(CommandRefused) as info:
        apply_patch(settings, tmp_path, {key: value})
    assert key in refused(info)
    assert not (tmp_path / OVERLAY_FILE).exists()


def test_the_tenant_must_exist(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(CommandRefused) as info:
        patched(settings, {"tenants.nobody.requests_per_minute": 5})
    assert "no tenant 'nobody'" in refused(info)


def test_empty_or_oversized_patches(settings: Settings) -> None:
    for changes in ({}, {f"tenants.t{i}.tokens_per_day": 1 for i in range(65)}):
        with pytest.raises(CommandRefused):
            patched(settings, changes)


def test_a_key_that_no_longer_fits_is_skipped_at_start(settings: Settings,
                                                       tmp_path: Path) -> None:
    (tmp_path / OVERLAY_FILE).write_text(json.dumps({"v": 1, "set": {
        "tenants.gone.requests_per_minute": 5, "telemetry.interval_s": 9, "server.port": 1}}))
    new = apply_overlay(settings, tmp_path)
    assert new.telemetry.interval_s == 9
    assert new.server.port == settings.server.port
    assert (tmp_path / OVERLAY_FILE).exists()


def test_an_unreadable_overlay_is_moved_aside(settings: Settings, tmp_path: Path) -> None:
    (tmp_path / OVERLAY_FILE).write_text("{not json")
    assert apply_overlay(settings, tmp_path).model_dump() == settings.model_dump()
    moved = list(tmp_path.glob(f"{OVERLAY_FILE}.corrupt-*"))
    assert len(moved) == 1 and moved[0].read_text() == "{not json"


def _command(args: dict[str, Any]) -> Command:
    return Command("a" * 32, "f1", "d1", "config.patch", 1, 0.0, 1.0, args, "d1", b"")


def test_the_handler_reports_live_and_restart_keys(settings: Settings, tmp_path: Path) -> None:
    current = [settings]
    seen: list[dict[str, Any]] = []

    def live(new: Settings, changes: dict[str, Any]) -> list[str]:
        current[0] = new
        seen.append(changes)
        return ["tenants.shop.requests_per_minute"]

    handle = config_patch_handler(lambda: current[0], tmp_path, live)
    out = handle(_command({"set": {"tenants.shop.requests_per_minute": 7,
                                   "telemetry.interval_s": 11}}))
    assert out == {"set": {"tenants.shop.requests_per_minute": 7, "telemetry.interval_s": 11},
                   "live": ["tenants.shop.requests_per_minute"],
                   "on_restart": ["telemetry.interval_s"]}
    assert current[0].tenants["shop"].requests_per_minute == 7
    for args in ({}, {"set": []}, {"set": {}, "x": 1}, {"set": {"server.port": 1}}):
        with pytest.raises(CommandRefused, match="malformed"):
            handle(_command(args))
    assert len(seen) == 1


def test_the_download_cap_may_be_lifted_with_null(settings: Settings, tmp_path: Path) -> None:
    capped = apply_patch(settings, tmp_path, {"fleet.max_download_bytes_per_s": 1_000_000})
    assert capped.fleet.max_download_bytes_per_s == 1_000_000
    lifted = apply_patch(capped, tmp_path, {"fleet.max_download_bytes_per_s": None})
    assert lifted.fleet.max_download_bytes_per_s is None
