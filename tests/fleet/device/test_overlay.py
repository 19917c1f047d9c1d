"""config.patch: only the allow-list, values validated as the config file's are (every key
within its bounds, the same from a file, the environment or a patch, and the docs saying
them), persisted atomically and applied at start; a patch out of bounds refused over the
real broker with nothing changed."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import annotated_types
import pytest

from edge_agent.config import Settings, TenantPolicy, load_settings
from edge_agent.fleet.device.link import overlay
from edge_agent.fleet.device.link.handlers import box_handlers
from edge_agent.fleet.device.link.overlay import (
    KEYS,
    NULLABLE,
    OVERLAY_FILE,
    TENANT_KEYS,
    apply_overlay,
    apply_patch,
    config_patch_handler,
    copy_keys,
    load_overlay,
    patched,
)
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.telemetry.hardware import HardwareSampler
from tests.support.brokers import Mosquitto
from tests.support.commandbox import CommandBox


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
    "server.port", "fleet.broker", "fleet.command_public_key_file", "state_dir", "telemetry",
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


# -- bounds: every allowed key has them, in the Settings, and the docs say them ---------------

@pytest.mark.parametrize(("key", "value", "bound"), [
    ("telemetry.interval_s", 1e10, "86400"), ("telemetry.interval_s", 1e-6, "1"),
    ("telemetry.interval_s", 0.5, "1"), ("fleet.metrics_interval_s", 1e-6, "1"),
    ("fleet.metrics_interval_s", 86_401, "86400"), ("fleet.ledger_interval_s", 1e-6, "1"),
    ("fleet.ledger_interval_s", 1e10, "86400"), ("fleet.progress_interval_s", 0.01, "0.1"),
    ("fleet.progress_interval_s", 1e10, "86400"),
    ("fleet.max_download_bytes_per_s", 10**30, "10000000000"),
    ("retention.ledger_days", 0.001, "1"), ("retention.ledger_days", 1e10, "3650"),
    ("retention.content_hours", 1e10, "8760"), ("fleet.rollout_nice", -1, "0"),
    ("tenants.shop.requests_per_minute", 2**64, "1000000"),
    ("tenants.shop.tokens_per_minute", 10**10, "1000000000"),
    ("tenants.eu.north.tokens_per_day", 10**13, "1000000000000"),
])
def test_a_value_past_its_bound_is_refused_naming_the_key_and_the_bound(
        settings: Settings, tmp_path: Path, key: str, value: Any, bound: str) -> None:
    apply_patch(settings, tmp_path, {"retention.ledger_days": 7})
    before = (tmp_path / OVERLAY_FILE).read_bytes()
    with pytest.raises(CommandRefused) as info:
        # with a good key beside it: the whole patch is refused, nothing of it half-taken
        apply_patch(settings, tmp_path, {"telemetry.interval_s": 10, key: value})
    message = refused(info)
    assert key in message and message.endswith(f" {bound}"), message
    assert (tmp_path / OVERLAY_FILE).read_bytes() == before


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_an_integer_past_any_float_is_refused_not_raised(settings: Settings, tmp_path: Path,
                                                         value: int) -> None:
    for key in ("telemetry.interval_s", "tenants.shop.tokens_per_day"):
        with pytest.raises(CommandRefused) as info:
            apply_patch(settings, tmp_path, {key: value})
        assert key in refused(info) and "finite" in refused(info)
    assert not (tmp_path / OVERLAY_FILE).exists()


def test_the_bounds_themselves_are_taken(settings: Settings, tmp_path: Path) -> None:
    edges = {"telemetry.interval_s": (1, 86_400), "fleet.metrics_interval_s": (1, 86_400),
             "fleet.ledger_interval_s": (1, 86_400), "fleet.progress_interval_s": (0.1, 86_400),
             "fleet.max_download_bytes_per_s": (1024, 10**10),
             "retention.ledger_days": (1, 3650), "retention.content_hours": (0, 8760),
             "tenants.shop.requests_per_minute": (1, 10**6),
             "tenants.shop.tokens_per_minute": (1, 10**9),
             "tenants.shop.tokens_per_day": (1, 10**12)}
    for key, pair in edges.items():
        for value in pair:
            assert _leaf(apply_patch(settings, tmp_path, {key: value}), key) == value


def _leaf(settings: Settings, key: str) -> Any:
    node: Any = settings
    if key.startswith("tenants."):
        name, _, leaf = key[len("tenants."):].rpartition(".")
        return getattr(settings.tenants[name], leaf)
    for part in key.split("."):
        node = getattr(node, part)
    return node


def settings_bounds(key: str) -> tuple[float, float, bool]:
    """(low, high, nullable) of a patchable key, as the Settings model's fields hold them."""
    if key.startswith("tenants."):
        model: Any = TenantPolicy
    else:
        model = Settings.model_fields[key.split(".")[0]].annotation
    info = model.model_fields[key.rpartition(".")[2]]
    low = high = None
    for bound in info.metadata:
        assert not isinstance(bound, annotated_types.Gt | annotated_types.Lt), (
            f"{key}: the docs give bounds as inclusive (ge/le)")
        if isinstance(bound, annotated_types.Ge):
            low = bound.ge
        if isinstance(bound, annotated_types.Le):
            high = bound.le
    assert low is not None and high is not None, f"{key} has no bounds in the Settings"
    return float(low), float(high), type(None) in get_args(info.annotation)


def _documented(rows: list[tuple[str, str]]) -> dict[str, tuple[float, float, bool]]:
    out = {}
    for key, cell in rows:
        m = re.match(r"\s*([\d_.]+) … ([\d_.]+)", cell)
        assert m is not None, f"{key}: no 'low … high' in {cell!r}"
        out[key] = (float(m.group(1)), float(m.group(2)), "null" in cell)
    return out


def _patchable() -> set[str]:
    return set(KEYS) | {f"tenants.<name>.{leaf}" for leaf in TENANT_KEYS}


def test_the_documented_bounds_are_the_settings_own() -> None:
    """The allow-list with its bounds, in this module's docstring and in the manual, is
    the Settings' constraints and the overlay's keys — no more, no less."""
    settings = {key: settings_bounds(key) for key in _patchable()}
    assert {k for k, (_, _, nullable) in settings.items() if nullable} == (
        set(NULLABLE) | {k for k in settings if k.startswith("tenants.")})
    doc = overlay.__doc__ or ""
    rows = re.findall(r"^ {4}((?:telemetry|fleet|retention|tenants)\.\S+) +(.+)$", doc, re.M)
    assert _documented(rows) == settings
    page = (Path(__file__).resolve().parents[3] / "docs" / "fleet" / "commands.md").read_text()
    section = page.split("## `config.patch`: settings the controller may change", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_<>.]+)` \| ([^|]+) \|", section, re.M)
    assert _documented(rows) == settings


@pytest.mark.broker
def test_a_patch_past_a_bound_on_the_real_broker_is_refused_and_nothing_changes(
        tmp_path: Path, mosquitto_factory: Callable[..., Mosquitto]) -> None:
    """`telemetry.interval_s = 1e10` (which ended the hardware sampler at every start) and
    `fleet.metrics_interval_s = 1e-6` (hundreds of messages a second) are refused with the
    key and the bound; nothing is persisted or applied; a good patch after them is taken."""
    box_id = "store-patch"
    broker = mosquitto_factory(devices=(box_id,)).start()
    state = tmp_path / "state"
    settings = Settings(state_dir=state, tenants={"shop": TenantPolicy()})
    sampler = HardwareSampler([], interval_s=settings.telemetry.interval_s)
    sampler.start()

    def apply_live(new: Settings, changes: dict[str, Any]) -> list[str]:
        done = copy_keys(settings, new, changes)
        sampler.interval_s = settings.telemetry.interval_s
        return done

    handlers = box_handlers(settings, state, purge=lambda before: 0,
                            revoke=lambda prefix: False, apply_live=apply_live)
    box = CommandBox(broker, tmp_path, box_id, handlers)
    try:
        bad = [(box.command("config.patch", {"set": {"telemetry.interval_s": 1e10}}),
                "'telemetry.interval_s': Input should be less than or equal to 86400"),
               (box.command("config.patch", {"set": {"fleet.metrics_interval_s": 1e-6,
                                                     "retention.ledger_days": 30}}),
                "'fleet.metrics_interval_s': Input should be greater than or equal to 1")]
        for command, _ in bad:
            box.send(command)
        for command, message in bad:
            got = box.result(command)
            assert (got["status"], got["reason"]) == ("refused", "malformed"), got
            assert got["result"] == {"message": message}
        assert not (state / OVERLAY_FILE).exists()
        assert (settings.telemetry.interval_s, settings.fleet.metrics_interval_s,
                settings.retention.ledger_days) == (5.0, 60.0, 90)
        good = box.command("config.patch", {"set": {"telemetry.interval_s": 86_400}})
        box.send(good)
        assert box.result(good)["status"] == "ok"
        assert load_overlay(state) == {"telemetry.interval_s": 86_400}
        assert sampler.interval_s == 86_400 and sampler.running
    finally:
        box.close()
        sampler.stop()


def test_an_overlay_saved_past_a_bound_is_skipped_at_start(
        settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An overlay written before the bounds held (`telemetry.interval_s = 1e10`, which ended
    the hardware sampler at every start) no longer reaches the box: the config file's
    value applies, the warning names the key and the bound."""
    (tmp_path / OVERLAY_FILE).write_text(json.dumps({"v": 1, "set": {
        "telemetry.interval_s": 1e10, "fleet.metrics_interval_s": 1e-6,
        "retention.ledger_days": 30}}))
    with caplog.at_level("WARNING", logger="edge_agent.fleet.device.link.overlay"):
        new = apply_overlay(settings, tmp_path)
    assert (new.telemetry.interval_s, new.fleet.metrics_interval_s,
            new.retention.ledger_days) == (5.0, 60.0, 30)
    assert "'telemetry.interval_s' not applied" in caplog.text and "86400" in caplog.text
