"""One simulated device: the agent's own link code (`LinkCore`, `Owner`, `Session`,
`Outbox`, `FleetState`, `CommandGate`) without the box behind it, for `fleet.sim.fleet`.

Its owner shares the simulator's selector and is driven from the simulator's loop thread;
its accepted commands run on the simulator's worker threads, where a `Script` decides their
outcome. Its stores are the real classes, either as files (`<root>/<device>/outbox.db`,
`fleet.db`: what a box has, 6 descriptors and an fsync per commit) or as in-memory SQLite
(the same code and semantics, no descriptor, no fsync, gone at `close`): the simulator
chooses.

Must never: block the loop (nothing here waits on the network or sleeps), or run a
script on the loop thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent.config import FleetSettings
from edge_agent.fleet.device.link.command_gate import CommandGate, Handler
from edge_agent.fleet.device.link.core import LinkCore, LinkOptions
from edge_agent.fleet.device.link.outbox import Outbox, OutboxStats
from edge_agent.fleet.device.link.owner import Owner
from edge_agent.fleet.device.link.state import FleetState
from edge_agent.fleet.protocol.command import Command

if TYPE_CHECKING:
    import selectors

MEMORY = Path(":memory:")  # SQLite's in-memory database: the real schema, no file
Script = Callable[["SimDevice", Command], "Mapping[str, Any] | None"]
"""Decides a simulated device's command: returns the result's JSON object (`ok`), raises
`CommandRefused(reason)` (`refused`) or any other exception (`failed`, reason = its type).
Runs on a worker thread, once per command id, so it may sleep or emit (`device.emit`)."""
Facts = Callable[["SimDevice"], dict[str, Any]]


def default_facts(device: SimDevice) -> dict[str, Any]:
    """A birth's facts as a small box reports them."""
    return {"agent_version": "sim", "llama_cpp_version": None,
            "hardware": {"cpu_count": 4, "ram_bytes": 8 << 30, "gpus": []},
            "models": [{"name": "smollm2:135m", "digest": "0" * 64, "active": True,
                        "loaded": True}],
            "tenants": ["default"], "config_fingerprint": "0" * 64, "simulated": True}


def default_metrics(device: SimDevice, n: int) -> dict[str, Any]:
    """A metrics body shaped as `fleet.device.reporting.sync` sends it (about 700 bytes),
    so that the controller keeps a simulated fleet's service levels as a real one's."""
    stats = device.outbox.stats()
    now = time.time()
    served = 12 + n % 5
    return {"interval": {"start": now - device.sim_interval_s, "end": now},
            "models": {"smollm2:135m": {
                "requests": {"200": served, **({"500": 1} if n % 2 else {})},
                "tokens": {"in": 1500 + n, "out": 2400 + n, "cached": 300,
                           "cached_share": round(300 / (1500 + n), 4)},
                "ttft_ms": {"p50": 81.5, "p95": 152.0, "n": served},
                "tpot_ms": {"p50": 21.0, "p95": 26.5, "n": served},
                "queue": {"waiting": n % 3, "running": 1},
                "feedback": {"good": n % 2, "bad": 0},
                "kinds": {"ollama": 6, "openai": served - 6 + n % 2, "schema": 3, "tools": 1,
                          "long_context": 0}}},
            "rejections": {"queue_full": n % 4},
            "upstream": {"requests": 0, "share": 0.0, "by": {}},
            "degradations": [],
            "hardware": {"cpu_utilization_ratio": 0.125, "memory_used_bytes": 3 << 30,
                         "state_disk_free_bytes": 40 << 30},
            "outbox": {"depth": stats.depth, "oldest_age_s": round(stats.oldest_age_s, 3)}}


class SimDevice(LinkCore):
    """A device of the simulator; `emit` from any thread."""

    def __init__(self, fleet: FleetSettings, *, sel: selectors.BaseSelector,
                 wake: Callable[[SimDevice], None],
                 run: Callable[[SimDevice, Command], None],
                 store: Path | None, public_key: Ed25519PublicKey | None,
                 script: Script | None, script_types: frozenset[str], facts: Facts,
                 options: LinkOptions, interval_s: float) -> None:
        self._script = script
        scripted: dict[str, Handler] = ({t: self._scripted for t in script_types}
                                        if script is not None else {})
        super().__init__(fleet, facts=lambda: facts(self), handlers=scripted,
                         options=options)
        self._wake_sim = wake
        self._run = run
        self.sim_interval_s = interval_s
        self._seq_lock = threading.Lock()
        self.last_seq = 0  # the highest seq this boot's outbox gave
        self.ticks = 0  # metrics messages emitted
        if store is not None:
            store.mkdir(parents=True, exist_ok=True)
        self.state = FleetState(store / "fleet.db" if store is not None else MEMORY)
        self.outbox = Outbox(store / "outbox.db" if store is not None else MEMORY,
                             device=self.device, boot_id=self.boot_id,
                             max_bytes=fleet.outbox_max_bytes)
        self.gate = CommandGate(self.state, fleet=self.fleet_id, device=self.device,
                                public_key=public_key, handlers=self._handlers)
        self.owner = Owner(self, self.outbox, self.gate, self.state, sel=sel)
        self._owner = self.owner
        self.due = 0.0  # when the simulator's loop turns it next without an event
        self.next_metrics: float | None = None  # monotonic time of the next metrics tick
        self.closed = False
        self.offline = False  # its network is cut (`Simulator.take_offline`)

    def emit(self, kind: str, cls: str, body: Mapping[str, Any], *, commit: bool = False
             ) -> bool:
        if self.closed:
            self.count("emit_refused")
            return False
        try:
            seq = self.outbox.append(kind, cls, body, commit=commit)
        except (ValueError, TypeError):  # OutboxFull is a ValueError too
            self.count("emit_refused")
            return False
        with self._seq_lock:
            self.last_seq = max(self.last_seq, seq)
        self._wake()
        return True

    def _wake(self) -> None:
        self._wake_sim(self)

    def _scripted(self, command: Command) -> Mapping[str, Any] | None:
        assert self._script is not None
        return self._script(self, command)

    def dispatch(self, command: Command) -> None:
        self._run(self, command)

    def execute(self, command: Command) -> None:
        """On a worker thread: the gate runs the handler (the script) once, records the
        outcome; the result goes to the outbox."""
        try:
            result = self.gate.execute(command)
        except Exception:
            self.count("errors")
            return
        self._finished(result)

    def stats(self) -> OutboxStats:
        return self.outbox.stats()

    def close(self) -> None:
        self.closed = True
        for closer in (self.outbox, self.state):
            try:
                closer.close()
            except Exception:
                self.count("errors")
