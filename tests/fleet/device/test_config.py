"""[fleet]: ids refused at load with the key named, the broker URL parsed, the parts that
must go together."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.config import BrokerAddress, ConfigError, load_settings, parse_broker
from edge_agent.fleet.protocol.ids import check_id
from edge_agent.names import check_fleet_id


def _load(tmp_path: Path, text: str) -> object:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    return load_settings(cfg)


def test_disabled_by_default_with_a_local_broker() -> None:
    fleet = load_settings(None).fleet
    assert not fleet.enabled
    assert fleet.broker_address == BrokerAddress("127.0.0.1", 1883, False)
    assert fleet.outbox_max_bytes == 64 * 1024 * 1024
    assert (fleet.metrics_interval_s, fleet.keepalive_s) == (60, 30)


def test_enabled_with_ids(tmp_path: Path) -> None:
    s = _load(tmp_path, '[fleet]\nenabled = true\nfleet_id = "f1"\ndevice_id = "store-042"\n'
                        'broker = "mqtts://broker.example:9883"\n')
    fleet = s.fleet  # type: ignore[attr-defined]
    assert (fleet.fleet_id, fleet.device_id) == ("f1", "store-042")
    assert fleet.broker_address == BrokerAddress("broker.example", 9883, True)


@pytest.mark.parametrize("device", ["storeB/x", "a+b", "a#", "all", "x" * 65, "caf\u00e9"])
def test_a_bad_device_id_fails_at_load_naming_the_key(tmp_path: Path, device: str) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.device_id") as info:
        _load(tmp_path, f'[fleet]\nenabled = true\nfleet_id = "f1"\ndevice_id = "{device}"\n')
    assert "device id" in str(info.value)


def test_a_bad_id_is_refused_even_while_disabled(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.fleet_id"):
        _load(tmp_path, '[fleet]\nfleet_id = "f/1"\n')


@pytest.mark.parametrize("missing", ["fleet_id", "device_id"])
def test_ids_are_required_when_enabled(tmp_path: Path, missing: str) -> None:
    ids = {"fleet_id": "f1", "device_id": "d1"}
    del ids[missing]
    lines = "".join(f'{k} = "{v}"\n' for k, v in ids.items())
    with pytest.raises(ConfigError, match=rf"fleet\.{missing} is required"):
        _load(tmp_path, f"[fleet]\nenabled = true\n{lines}")


def test_environment_sets_fleet_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_FLEET__DEVICE_ID", "bad/id")
    with pytest.raises(ConfigError, match=r"fleet\.device_id"):
        load_settings(None)


@pytest.mark.parametrize(("url", "address"), [
    ("mqtt://127.0.0.1", BrokerAddress("127.0.0.1", 1883, False)),
    ("mqtt://h:1884", BrokerAddress("h", 1884, False)),
    ("mqtts://h", BrokerAddress("h", 8883, True)),
    ("mqtts://[::1]:8884/", BrokerAddress("::1", 8884, True)),
])
def test_broker_urls(url: str, address: BrokerAddress) -> None:
    assert parse_broker(url) == address


@pytest.mark.parametrize(("url", "why"), [
    ("tcp://h:1883", "mqtt:// or mqtts://"), ("h:1883", "mqtt:// or mqtts://"),
    ("mqtt://h:99999", "out of range"), ("mqtt://h:port", "broker"),
    ("mqtt://", "no host"), ("mqtt://u:p@h", "credentials"), ("mqtt://h/x", "only"),
    ("ws://h", "mqtt://"),
])
def test_other_broker_urls_are_refused(tmp_path: Path, url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_broker(url)
    with pytest.raises(ConfigError, match=r"fleet\.broker"):
        _load(tmp_path, f'[fleet]\nbroker = "{url}"\n')


@pytest.mark.parametrize(("text", "why"), [
    ('password_file = "/p"\n', "needs fleet.username"),
    ('broker = "mqtts://h"\nclient_cert = "/c"\n', "go together"),
    ('client_cert = "/c"\nclient_key = "/k"\n', "mqtts://"),
    ('ca_file = "/ca"\n', "mqtts://"),
    ("reconnect_min_s = 10\nreconnect_max_s = 5\n", "reconnect_min_s"),
    ("outbox_max_bytes = 10\n", "outbox_max_bytes"),
    ("metrics_interval_s = 0\n", "metrics_interval_s"),
])
def test_parts_that_go_together(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        _load(tmp_path, f"[fleet]\n{text}")


def test_the_fleet_rule_is_one_function() -> None:
    assert check_id is check_fleet_id
