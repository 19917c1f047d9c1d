"""Many simulated devices in one process on one selector loop, each running the agent's
own link code (`fleet.sim.device`): the fleet behind `edge-agent bench fleet` and behind
tests that need a hundred boxes (rollout waves).

    sim = Simulator(broker.url, fleet="f1", devices=ids, password_file=broker.password_file,
                    root=tmp, script=outcome, public_key=load_public(pub_path))
    sim.start(); sim.wait_connected(60)
    sim.produce(10.0)           # one metrics message per device per 10 s, phases spread
    ...                         # commands from the controller run `outcome(device, command)`
    sim.pause(); sim.wait_drained(60)
    sim.expected()              # {device: (boot_id, last seq)}: what the controller must hold
    sim.stop()

Each device is its own broker user (`password_file(device)` → its credentials file, as
`fleet broker-config` writes them), born at each connect with a Will for its death, with an
outbox and link state of its own (`SimOptions.store`: in-memory SQLite by default, or files
as a box has them). Paho's threaded loop cannot do this (it uses `select()`, which fails
past descriptor 1,023): one `sim-loop` thread owns a selector and drives every device's
`Owner` (`fleet.sim.loop`); scripts run on `workers` threads (`sim-command`), never on it.
This module builds the devices and is the API, callable from any thread.

Scripted outcomes (`simdevice.Script`): `script(device, command)` returns the result
(status ok), raises `CommandRefused(reason)` (refused) or anything else (failed); called
once per command id for the types in `script_types`: by default every registered type
(`protocol.command_types`) but those the link answers itself (ping and rebirth).
It may `device.emit(kind, cls, body)` (e.g. `rollout` transitions) or schedule later ones
with `sim.call_later(delay_s, fn)` (fn runs on the loop thread and must not block).

Must never: block the loop thread (no script, no sleep there), keep a descriptor of a
stopped device, or leave a thread running after `stop()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent.config import FleetSettings
from edge_agent.fleet.device.link.core import OWN_TYPES
from edge_agent.fleet.protocol.command_types import COMMAND_TYPES
from edge_agent.fleet.sim.device import Facts, Script, SimDevice, default_facts, default_metrics
from edge_agent.fleet.sim.loop import MetricsBody, SimLoop, SimOptions
from edge_agent.fleet.sim.testbed import raise_nofile, wait_until

__all__ = ["SCRIPT_TYPES", "Facts", "MetricsBody", "Script", "SimDevice", "SimOptions",
           "Simulator"]
RESERVED_FDS = 256  # the process's own: stdio, logs, a controller or broker client, slack
SCRIPT_TYPES = frozenset(COMMAND_TYPES) - OWN_TYPES


class Simulator(SimLoop):
    def __init__(self, broker: str, *, fleet: str, devices: Sequence[str],
                 password_file: Callable[[str], Path] | None, root: Path,
                 script: Script | None = None, script_types: Iterable[str] = SCRIPT_TYPES,
                 public_key: Ed25519PublicKey | None = None, facts: Facts = default_facts,
                 metrics: MetricsBody = default_metrics,
                 options: SimOptions | None = None) -> None:
        self.options = opts = options or SimOptions()
        # One descriptor per device (its socket), six more with files (two SQLite
        # databases, each with its -wal and -shm): refused up front, not at the 1,000th.
        need = len(devices) * (7 if opts.store == "files" else 1) + RESERVED_FDS
        self.nofile = raise_nofile(need)
        if self.nofile < need:
            raise RuntimeError(f"{len(devices):,} simulated devices need about {need:,} file "
                               f"descriptors; this process may open {self.nofile:,} "
                               "(ulimit -n)")
        super().__init__(opts, metrics)
        self.root = root
        types = frozenset(script_types)
        for name in devices:
            settings = FleetSettings.model_validate({
                "enabled": True, "broker": broker, "fleet_id": fleet, "device_id": name,
                "username": name,
                "password_file": password_file(name) if password_file is not None else None,
                "keepalive_s": opts.keepalive_s, "reconnect_min_s": opts.reconnect_min_s,
                "reconnect_max_s": opts.reconnect_max_s,
                "outbox_max_bytes": opts.outbox_max_bytes})
            self.devices[name] = SimDevice(
                settings, sel=self.sel, wake=self._wake, run=self._run_command,
                store=root / name if opts.store == "files" else None, public_key=public_key,
                script=script, script_types=types, facts=facts, options=opts.link,
                interval_s=0.0)

    # -- from any thread ---------------------------------------------------------------------

    def start(self) -> Simulator:
        """Starts the loop; devices connect at up to `connect_rate` a second."""
        now = time.monotonic()
        for device in self.devices.values():
            self._push(now, device)
        self._thread = threading.Thread(target=self._loop, name="sim-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, clean: bool = True, timeout: float = 60.0) -> None:
        """Clean: each device publishes its death and disconnects (as a box stopping).
        Not clean: every socket is dropped (the broker sends the Wills), as at a power cut.
        Then the stores close."""
        self._clean = clean
        self._stopping.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for device in self.devices.values():
            device.close()
        self._wake_r.close()
        self._wake_w.close()

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Runs `fn` on the loop thread after `delay_s` (it must not block)."""
        due = time.monotonic() + max(0.0, delay_s)
        self._call(lambda: self._push(due, fn))

    def produce(self, interval_s: float) -> None:
        """From now on every device emits one metrics message per `interval_s`, the
        devices' phases spread evenly over the interval."""
        def begin() -> None:
            now, n = time.monotonic(), max(1, len(self.devices))
            self._interval = interval_s
            for i, device in enumerate(self.devices.values()):
                device.sim_interval_s = interval_s
                device.next_metrics = now + interval_s * (i + 0.5) / n
                self._push(device.next_metrics, device)
        self._call(begin)

    def pause(self) -> None:
        """No more metrics messages (what is queued still goes out)."""
        done = threading.Event()

        def halt() -> None:
            self._interval = None
            for device in self.devices.values():
                device.next_metrics = None
            done.set()
        self._call(halt)
        done.wait(10)

    def take_offline(self, device: str) -> None:
        """The device's network goes: its connection drops without a DISCONNECT (the
        broker publishes its Will) and it stays away — its outbox keeps what it emits —
        until `bring_online`."""
        target = self.devices[device]

        def cut() -> None:
            target.offline = True
            target.owner.cut("simulated network cut")
        self._call(cut)

    def bring_online(self, device: str) -> None:
        """The device's network is back: it connects (birth, resend) at once."""
        target = self.devices[device]

        def back() -> None:
            target.offline = False
            target.owner.next_connect = time.monotonic()
            self._push(time.monotonic(), target)
        self._call(back)

    def emit(self, device: str, kind: str, cls: str, body: Mapping[str, Any]) -> bool:
        return self.devices[device].emit(kind, cls, body)

    def connected(self) -> int:
        """Devices connected and subscribed (a command sent now reaches them)."""
        return sum(1 for d in self.devices.values() if d.connected)

    def wait_connected(self, timeout: float, count: int | None = None) -> bool:
        want = len(self.devices) if count is None else count
        return wait_until(lambda: self.connected() >= want, timeout)

    def drained(self) -> bool:
        """Every outbox empty: all that was emitted is acknowledged by the controller."""
        return all(s.depth == 0 and s.buffered == 0
                   for s in (d.stats() for d in self.devices.values()))

    def wait_drained(self, timeout: float) -> bool:
        return wait_until(self.drained, timeout, interval=0.5)

    def expected(self) -> dict[str, tuple[str, int]]:
        """Per device: (boot_id, last seq given): the controller must hold 1..last."""
        return {name: (d.boot_id, d.last_seq) for name, d in self.devices.items()}

    def counts(self) -> dict[str, int]:
        """The devices' link counters, summed."""
        total: dict[str, int] = {"loop_errors": self.errors}
        for device in self.devices.values():
            for name, value in list(device.counts.items()):
                total[name] = total.get(name, 0) + value
        return total

    def depth(self) -> int:
        return sum(d.stats().depth for d in self.devices.values())
