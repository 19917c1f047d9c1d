"""The controller host's role (ansible/roles/fleet_controller), read and rendered here; it
runs for real under systemd in tests/test_systemd_controller.py.

Its variables are documented twice over (argument_specs and the manual) and named for the
role; its unit template renders to systemd/edge-agent-fleet.service with the defaults; its
config template renders a controller.toml that the controller's own loader takes; its
dispatch runs the parts in the order the controller needs them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from edge_agent.config.controller import load_controller_settings
from tests.test_ansible_role import render

ROOT = Path(__file__).resolve().parents[1]
ROLE = ROOT / "ansible" / "roles" / "fleet_controller"
PREFIX = "fleet_controller_"


def _options() -> dict[str, dict[str, object]]:
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    options: dict[str, dict[str, object]] = specs["argument_specs"]["main"]["options"]
    return options


def test_argument_specs_and_defaults_name_the_same_variables() -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert set(_options()) == set(defaults)
    assert all(name.startswith(PREFIX) for name in defaults)
    assert all(spec.get("description") and spec.get("type") for spec in _options().values())
    internal = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    assert all(name.startswith(f"_{PREFIX}") for name in internal)


def test_the_manual_documents_every_variable() -> None:
    page = (ROOT / "docs" / "fleet" / "controller-host.md").read_text()
    table = page.split("## The role's variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(rf"^\| `({PREFIX}\w+)` \|", table, re.M))
    assert documented == set(_options())


def test_tasks_main_only_dispatches_the_parts_in_order() -> None:
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    assert [t["ansible.builtin.import_tasks"] for t in tasks] == [
        "install.yml", "broker.yml", "database.yml", "configure.yml", "service.yml"]
    assert all(t.get("tags") for t in tasks)


UNITS = ("edge-agent-fleet.service", "edge-agent-fleet-timestamp.service",
         "edge-agent-fleet-timestamp.timer", "edge-agent-fleet-releases.service")


@pytest.mark.parametrize("unit", UNITS)
def test_the_unit_templates_render_to_systemds_units(tmp_path: Path, unit: str) -> None:
    rendered = render(tmp_path, f"{unit}.j2", tmp_path / "unit", role=ROLE)
    assert rendered == (ROOT / "systemd" / unit).read_text()


@pytest.mark.parametrize("unit", UNITS[:2])
def test_another_state_dir_is_writable_in_the_sandbox(tmp_path: Path, unit: str) -> None:
    rendered = render(tmp_path, f"{unit}.j2", tmp_path / "unit",
                      "fleet_controller_state_dir=/srv/fleet", role=ROLE)
    assert "\nReadWritePaths=/srv/fleet\n" in rendered
    assert "\nWorkingDirectory=/srv/fleet\n" in rendered


def test_the_config_template_is_what_the_controller_loads(tmp_path: Path) -> None:
    out = tmp_path / "controller.toml"
    render(tmp_path, "controller.toml.j2", out, "inventory_hostname=fleet-central",
           "fleet_controller_tls_cert=PEM", "fleet_controller_http_host=0.0.0.0",
           '{"fleet_controller_extra_settings": {"retention": {"metrics_days": 7}}}',
           role=ROLE)
    settings = load_controller_settings(out)
    assert settings.db == "postgresql://edge-agent-fleet@/edge_fleet?host=/run/postgresql"
    assert settings.broker.url == "mqtt://127.0.0.1:1883"
    assert settings.broker.password_file == Path("/etc/edge-agent-fleet/controller.password")
    assert settings.command_signing_key_file == Path(
        "/var/lib/edge-agent-fleet/keys/command.pem")
    assert settings.http.host == "0.0.0.0"
    assert settings.http.tls_cert_file == Path("/etc/edge-agent-fleet/tls/controller.pem")
    assert settings.retention.metrics_days == 7
    # The release server: on by default, every address, plain HTTP without its certificate.
    assert (settings.releases.host, settings.releases.port) == ("0.0.0.0", 9465)
    assert settings.releases.tls_cert_file is None


def test_the_release_servers_certificate_goes_into_its_section(tmp_path: Path) -> None:
    out = tmp_path / "controller.toml"
    render(tmp_path, "controller.toml.j2", out, "inventory_hostname=fleet-central",
           "fleet_controller_releases_tls_cert=PEM", "fleet_controller_releases_port=8443",
           role=ROLE)
    settings = load_controller_settings(out)
    assert settings.releases.port == 8443
    assert settings.releases.tls_cert_file == Path("/etc/edge-agent-fleet/tls/releases.pem")
    assert settings.releases.tls_key_file == Path("/etc/edge-agent-fleet/tls/releases.key")
    assert settings.http.tls_cert_file is None  # the API's own stays as it was


def test_a_host_without_the_release_server_has_no_section(tmp_path: Path) -> None:
    out = tmp_path / "controller.toml"
    render(tmp_path, "controller.toml.j2", out, "inventory_hostname=fleet-central",
           '{"fleet_controller_releases_enabled": false}', role=ROLE)
    assert "[releases]" not in out.read_text()
