"""A box that takes signed commands over a real Mosquitto, as the command tests need it:
the fleet link (`edge_agent.fleet.device.link.link.Link`) with the controller's public key and the
box's handlers, the real controller's ingest storing the results, and the controller's
MQTT client that publishes commands. `restart()` stops the link and starts a new one on
the same state and broker session, to see what the broker delivers again."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edge_agent.fleet.device.link.command_gate import Handler
from edge_agent.fleet.device.link.link import Link
from tests.support.brokers import Mosquitto, MQTTClient
from tests.support.fleetkit import (
    Controller,
    Signer,
    fast_options,
    fleet_settings,
    send,
    wait_until,
)


class CommandBox:
    def __init__(self, broker: Mosquitto, root: Path, device: str,
                 handlers: Mapping[str, Handler]) -> None:
        self.broker, self.root, self.device = broker, root, device
        self.state = root / "state"
        self.handlers = dict(handlers)
        self.signer = Signer(root)
        self.controller = Controller(broker, root / "controller").start()
        self.link = self._link()
        self.boss = MQTTClient(broker, "controller")
        assert not self.boss.connect().is_failure

    def _link(self) -> Link:
        link = Link(fleet_settings(self.broker, self.device,
                                   command_public_key_file=self.signer.public_path),
                    self.state, facts=lambda: {"agent_version": "test"},
                    handlers=self.handlers, options=fast_options())
        link.start()
        assert link.wait_connected(10), "the link did not connect"
        return link

    def command(self, type_: str, args: dict[str, Any] | None = None,
                **change: Any) -> dict[str, Any]:
        return self.signer.command(self.device, type_, args, **change)

    def send(self, command: dict[str, Any]) -> None:
        send(self.boss, command)

    def result(self, command: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """The result the controller stored for `command`; AssertionError if none came."""
        found: list[dict[str, Any]] = []

        def arrived() -> bool:
            found[:] = self.controller.store.command_results(command["id"])
            return bool(found)

        assert wait_until(arrived, timeout), (
            f"no result for {command['type']} {command['id']}: {self.link.counts}")
        return found[0]

    def restart(self) -> Link:
        self.link.stop()
        self.link = self._link()
        return self.link

    def close(self) -> None:
        self.boss.close()
        self.link.stop()
        self.controller.close()
