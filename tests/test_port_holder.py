"""A port that is taken is named with what holds it, before anything starts: `serve` and
`fleet serve` stop with one line saying which process to stop, and `fleet broker-config`
warns that its broker would not listen (Debian's own mosquitto.service holds 1883)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.netaddr import port_holder


@pytest.fixture
def taken() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_listening_port_is_named_with_its_process(taken: int) -> None:
    said = port_holder("127.0.0.1", taken)
    assert said is not None and said.startswith(f"pid {os.getpid()} (")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert port_holder("127.0.0.1", port) is None  # bound no more: free
    assert port_holder("127.0.0.1", 0) is None


def test_serve_on_a_taken_port_stops_at_once_naming_the_holder(taken: int,
                                                                tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["serve", "--state-dir", str(tmp_path / "state"),
                                    "--port", str(taken)])
    assert out.exit_code == 1, out.output
    assert f"127.0.0.1:{taken} is taken by pid {os.getpid()}" in out.output
    assert "another --port" in out.output
    assert not (tmp_path / "state" / "ledger.db").exists()  # nothing started


def test_fleet_serve_on_a_taken_port_stops_naming_the_holder(taken: int,
                                                             tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["fleet", "serve", "--state-dir", str(tmp_path),
                                    "--port", str(taken), "--username", ""])
    assert out.exit_code == 1, out.output
    assert f"127.0.0.1:{taken} is taken by pid {os.getpid()}" in out.output


def test_broker_config_warns_when_its_port_is_taken(taken: int, tmp_path: Path) -> None:
    (tmp_path / "devices.txt").write_text("store-001\n")
    args = ["fleet", "broker-config", "--devices", str(tmp_path / "devices.txt"),
            "--out", str(tmp_path / "broker"), "--fleet", "shops",
            "--data-dir", str(tmp_path / "broker" / "data")]
    out = CliRunner().invoke(main, [*args, "--port", str(taken)])
    assert out.exit_code == 0, out.output
    assert f"127.0.0.1:{taken} is taken by pid {os.getpid()}" in out.output
    assert "systemctl disable --now mosquitto" in out.output
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    quiet = CliRunner().invoke(main, [*args, "--port", str(port)])
    assert quiet.exit_code == 0 and "is taken" not in quiet.output
