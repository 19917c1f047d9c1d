"""One device's end of the link, without threads or sockets of its own: its identity and
options, the birth's facts, the command handlers, counters and log-once, the rebirth and
connected flags, and how a command's result goes back (an outbox row).

`fleet.device.link.owner.Owner` drives one `LinkCore` (connect, publish, acks, commands). Two kinds
exist: `fleet.device.link.link.Link`, the box's own, with its owner thread and a `fleet-commands`
thread; and the simulator's devices (`fleet.sim.fleet`), many driven from one selector loop.
A subclass says how a producer wakes its owner (`_wake`), where an accepted command runs
(`dispatch`) and how a message is queued (`emit`).

Must never: block, touch a file, or raise into a producer (`emit` swallows and counts).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from edge_agent.config import FleetSettings
from edge_agent.fleet.device.link import birth
from edge_agent.fleet.device.link.command_gate import Handler, ping
from edge_agent.fleet.device.link.state import OK
from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.command import Command, Result
from edge_agent.fleet.protocol.command_types import COMMAND_TYPES
from edge_agent.fleet.protocol.envelope import AUDIT

log = logging.getLogger("edge_agent.fleet.device.link.link")
# After these succeed the birth is sent again: its facts (the config fingerprint) changed.
REBIRTH_AFTER = frozenset(t.name for t in COMMAND_TYPES.values() if t.rebirth_after)
# The types every link answers itself, a box's and a simulated device's alike.
OWN_TYPES = frozenset({"ping", "rebirth"})


class BirthCounter(Protocol):
    """What the core reads of its owner: the birth/death sequence of its connection. Only
    this, so the core does not import the owner, which imports the core."""

    bdseq: int


@dataclass(frozen=True)
class LinkOptions:
    """Tunables that are not settings (tests and the bench change them)."""

    window: int = 500  # QoS 1 messages awaiting their PUBACK (measured: see the notes)
    batch: int = 500  # outbox rows read per query
    ack_timeout_s: float = 60.0  # sent, not acknowledged by the controller: send again
    connect_timeout_s: float = 5.0
    connack_timeout_s: float = 10.0
    session_expiry_s: int = 3600  # the broker keeps commands for a box offline this long
    death_wait_s: float = 2.0  # a clean stop waits this long for the death's PUBACK
    command_wait_s: float = 5.0  # a stop lets a running command finish this long
    stable_s: float = 60.0  # a connection this old resets the backoff
    max_early: int = 10_000  # emits held in memory before the outbox is open
    open_wait_s: float = 10.0  # a durable (commit) emit waits this long for the outbox


class LinkCore:
    def __init__(self, fleet: FleetSettings, *, facts: birth.Facts,
                 handlers: Mapping[str, Handler] | None = None,
                 options: LinkOptions | None = None, boot_id: str | None = None) -> None:
        if fleet.fleet_id is None or fleet.device_id is None:
            raise ValueError("the fleet link needs fleet.fleet_id and fleet.device_id")
        self.fleet = fleet
        self.fleet_id: str = fleet.fleet_id
        self.device: str = fleet.device_id
        self.options = options or LinkOptions()
        self.boot_id = boot_id or uuid.uuid4().hex
        self.facts = facts
        own: dict[str, Handler] = {"ping": ping, "rebirth": self._rebirth_handler}
        given = handlers or {}
        twice = sorted(t for t in set(own) & set(given) if given[t] is not own[t])
        if twice:  # one handler per type: a second one would silently win
            raise ValueError(f"the link answers {', '.join(twice)} itself")
        self._handlers: dict[str, Handler] = {**own, **given}
        self._connected = threading.Event()
        self._rebirth = threading.Event()
        self._owner: BirthCounter | None = None  # the subclass's `owner.Owner`
        self._logged: set[str] = set()
        self._count_lock = threading.Lock()
        self.counts: dict[str, int] = {}

    # -- what a subclass provides --------------------------------------------------------

    def emit(self, kind: str, cls: str, body: Mapping[str, Any], *, commit: bool = False
             ) -> bool:
        """Queues one message for the controller; False if it was refused."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Makes the owner take a turn soon (a producer emitted, a rebirth was asked)."""
        raise NotImplementedError

    def dispatch(self, command: Command) -> None:
        """Runs an accepted command away from the owner's loop; its result through
        `_finished`."""
        raise NotImplementedError

    def finish_commands(self) -> None:
        """At a clean stop, before the last flush: let a running command end (bounded)."""

    # -- shared -----------------------------------------------------------------------------

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def bdseq(self) -> int:
        owner = self._owner
        return owner.bdseq if owner is not None else 0

    def mark_connected(self, up: bool) -> None:
        """The owner's: subscribed, so commands can arrive (`wait_connected` returns), or
        not (the connection dropped)."""
        if up:
            self._connected.set()
        else:
            self._connected.clear()

    def take_rebirth(self) -> bool:
        """The owner's: whether a rebirth was asked since it last took one."""
        if not self._rebirth.is_set():
            return False
        self._rebirth.clear()
        return True

    def request_rebirth(self) -> None:
        """The birth is published again (same bdseq) as soon as the link is connected."""
        self._rebirth.set()
        self._wake()

    def _rebirth_handler(self, command: Command) -> dict[str, Any]:
        self.request_rebirth()
        return {"bdseq": self.bdseq}

    def emit_result(self, result: Result) -> None:
        self.emit(topics.RESULT, AUDIT, result.body())

    def _finished(self, result: Result) -> None:
        """An executed command's result goes out; a changed config is born again."""
        self.emit_result(result)
        if result.status == OK and result.type in REBIRTH_AFTER:
            self.request_rebirth()

    def count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def forget_logged(self, prefixes: tuple[str, ...]) -> None:
        """After a recovery: the same failure later is worth a warning again."""
        self._logged = {k for k in self._logged if not k.startswith(prefixes)}

    def log_once(self, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        """Warns the first time; later repeats go to debug (a flapping link is one line)."""
        if key in self._logged:
            log.debug(msg, *args)
            return
        self._logged.add(key)
        log.warning(msg, *args, exc_info=exc_info)
