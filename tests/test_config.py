from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge_agent.config import ConfigError, load_settings


def test_defaults() -> None:
    s = load_settings(None)
    assert (s.server.host, s.server.port) == ("127.0.0.1", 11434)
    assert s.server.max_body_bytes == 8 * 1024 * 1024
    assert s.default_model == "smollm2:135m"


def test_precedence_toml_then_env_then_flags(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('state_dir = "/srv/a"\n[server]\nport = 1000\nhost = "127.0.0.2"\n'
                   '[runtime]\ncontext_length = 1024\n[models."gemma3:270m"]\nthreads = 1\n')
    s = load_settings(cfg)
    assert (s.server.port, s.server.host, str(s.state_dir)) == (1000, "127.0.0.2", "/srv/a")
    assert s.model_override("gemma3:270m").threads == 1
    monkeypatch.setenv("EDGE_AGENT_SERVER__PORT", "2000")
    monkeypatch.setenv("EDGE_AGENT_RUNTIME__CONTEXT_LENGTH", "512")
    s = load_settings(cfg)
    assert (s.server.port, s.runtime.context_length, s.server.host) == (2000, 512, "127.0.0.2")
    s = load_settings(cfg, **{"server.port": 3000, "server.host": None})
    assert (s.server.port, s.server.host) == (3000, "127.0.0.2")


def test_bad_values_name_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[server]\nport = 99999\n")
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_settings(cfg)
    cfg.write_text("[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match=r"server\.prot"):
        load_settings(cfg)
    cfg.write_text("[server\n")
    with pytest.raises(ConfigError, match="config.toml"):
        load_settings(cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")



def test_relative_folders_are_pinned_where_the_command_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = load_settings(None, state_dir=Path("./var"), catalog_dir=Path("cat"))
    assert s.state_dir == tmp_path / "var"
    assert s.catalog_dir == tmp_path / "cat"
    monkeypatch.chdir("/")
    assert s.state_dir == tmp_path / "var"  # unchanged by a later chdir


@pytest.mark.parametrize(("key", "value", "bound"), [
    ("telemetry.interval_s", "1e10", "less than or equal to 86400"),
    ("telemetry.interval_s", "1e-6", "greater than or equal to 1"),
    ("fleet.metrics_interval_s", "1e-6", "greater than or equal to 1"),
    ("fleet.ledger_interval_s", "0", "greater than or equal to 1"),
    ("fleet.progress_interval_s", "1e10", "less than or equal to 86400"),
    ("retention.ledger_days", "1e10", "less than or equal to 3650"),
    ("retention.content_hours", "1e10", "less than or equal to 8760"),
])
def test_a_value_out_of_its_bounds_stops_the_start_from_the_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, value: str,
        bound: str) -> None:
    """The bounds `config.patch` is held to are the model's own: a config file or an
    environment variable with the same value is one config error naming key and bound."""
    section, leaf = key.split(".")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"[{section}]\n{leaf} = {value}\n")
    with pytest.raises(ConfigError, match=rf"invalid setting {re.escape(key)} in .*{bound}"):
        load_settings(cfg)
    monkeypatch.setenv(f"EDGE_AGENT_{section.upper()}__{leaf.upper()}", value)
    with pytest.raises(ConfigError, match=rf"invalid setting {re.escape(key)}: .*{bound}"):
        load_settings(None)


def test_a_tenant_limit_out_of_its_bounds_stops_the_start(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"[tenants.shop]\ntokens_per_day = {2**64}\n")
    with pytest.raises(ConfigError, match=r"tenants\.shop\.tokens_per_day .*1000000000000"):
        load_settings(cfg)


# -- renamed keys: the old name read for one release, with one warning ------------------------

@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent.config import base

    monkeypatch.setattr(base, "_warned", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def test_the_boxs_command_key_is_its_public_key_file(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[fleet]\ncommand_public_key_file = "/etc/edge-agent/fleet/command.pub.pem"\n')
    assert load_settings(cfg).fleet.command_public_key_file == Path(
        "/etc/edge-agent/fleet/command.pub.pem")


@pytest.mark.usefixtures("fresh_warnings")
def test_the_boxs_old_command_key_file_is_read_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[fleet]\ncommand_key_file = "/etc/edge-agent/command.pub.pem"\n')
    for _ in range(3):  # the box loads its settings more than once (the overlay, doctor)
        settings = load_settings(cfg)
    assert settings.fleet.command_public_key_file == Path("/etc/edge-agent/command.pub.pem")
    monkeypatch.setenv("EDGE_AGENT_FLEET__COMMAND_KEY_FILE", "/k.pem")
    assert load_settings(None).fleet.command_public_key_file == Path("/k.pem")
    assert _warnings(caplog) == [
        "fleet.command_key_file is deprecated and will stop being read in the next release: "
        "rename it to fleet.command_public_key_file"]


def test_the_old_and_the_new_name_together_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[fleet]\ncommand_key_file = "/a.pem"\ncommand_public_key_file = "/b.pem"\n')
    with pytest.raises(ConfigError, match="set only command_public_key_file"):
        load_settings(cfg)


@pytest.mark.usefixtures("fresh_warnings")
def test_the_controllers_command_key_is_its_signing_key_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from edge_agent.config.controller import load_controller_settings

    cfg = tmp_path / "controller.toml"
    cfg.write_text('command_signing_key_file = "/keys/command.pem"\n')
    assert load_controller_settings(cfg).command_signing_key_file == Path("/keys/command.pem")
    assert _warnings(caplog) == []
    cfg.write_text('command_key_file = "/keys/command.pem"\n')
    assert load_controller_settings(cfg).command_signing_key_file == Path("/keys/command.pem")
    load_controller_settings(cfg)
    assert _warnings(caplog) == [
        "command_key_file is deprecated and will stop being read in the next release: "
        "rename it to command_signing_key_file"]
    cfg.write_text('command_key_file = "/a.pem"\ncommand_signing_key_file = "/b.pem"\n')
    with pytest.raises(ConfigError, match="set only command_signing_key_file"):
        load_controller_settings(cfg)


def test_a_quantized_kv_cache_without_flash_attention_stops_the_start(tmp_path: Path) -> None:
    from edge_agent.config import ConfigError

    assert load_settings(None, state_dir=tmp_path, **{
        "runtime.kv_cache_type": "q8_0"}).runtime.kv_cache_type == "q8_0"
    for flags in ({"runtime.kv_cache_type": "q8_0"},
                  {"models": {"smollm2:135m": {"kv_cache_type": "q4_0"}}}):
        with pytest.raises(ConfigError, match="needs flash attention"):
            load_settings(None, state_dir=tmp_path, **{"runtime.flash_attn": "off", **flags})
