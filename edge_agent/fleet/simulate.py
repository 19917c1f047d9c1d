"""Many simulated devices in one process on one selector loop, each running the agent's
own link code (`fleet.simdevice`): the fleet behind `edge-agent bench fleet` and behind
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
past descriptor 1,023): here one `sim-loop` thread owns the selector and drives every
device's `Owner` — `connect()` when its reconnect time and a connect slot have come (at most
`connect_rate` a second, so a broker restart's reconnect storm is paced), `turn()` when its
socket is ready, it was woken (an emit, a command's result) or its time has come
(`sweep_s` while connected: keep-alive, the CONNACK deadline, overdue acks). Timers are a
heap, so an idle fleet costs nothing between turns. Scripts run on `workers` threads
(`sim-command`), never on the loop.

Scripted outcomes (`simdevice.Script`): `script(device, command)` returns the result
(status ok), raises `CommandRefused(reason)` (refused) or anything else (failed); called
once per command id for the types in `script_types` (ping and rebirth are the link's own).
It may `device.emit(kind, cls, body)` (e.g. `rollout` transitions) or schedule later ones
with `sim.call_later(delay_s, fn)` (fn runs on the loop thread and must not block).

Must never: block the loop thread (no script, no sleep there), keep a descriptor of a
stopped device, or leave a thread running after `stop()`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent.config import FleetSettings
from edge_agent.fleet.commands import Command
from edge_agent.fleet.core import LinkOptions
from edge_agent.fleet.envelope import METRICS
from edge_agent.fleet.simdevice import Facts, Script, SimDevice, default_facts, default_metrics
from edge_agent.fleet.testbed import raise_nofile

log = logging.getLogger(__name__)
MetricsBody = Callable[[SimDevice, int], dict[str, Any]]
RESERVED_FDS = 256  # the process's own: stdio, logs, a controller or broker client, slack
SCRIPT_TYPES = frozenset({"config.patch", "ledger.purge", "keys.revoke", "rollout.start",
                          "rollout.cancel", "rollout.rollback"})


@dataclass(frozen=True)
class SimOptions:
    store: Literal["memory", "files"] = "memory"
    connect_rate: float = 500.0  # connect attempts a second, at most
    # A connected device turns at least this often without events: keep-alive (a third of
    # it, so a PINGREQ is never late), the CONNACK deadline, overdue acks.
    sweep_s: float = 10.0
    workers: int = 4  # threads running scripts
    keepalive_s: int = 30
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 10.0
    outbox_max_bytes: int = 64 << 20
    stop_wait_s: float = 5.0  # a clean stop waits this long for the deaths' PUBACKs
    link: LinkOptions = field(default_factory=LinkOptions)


class Simulator:
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
        self.root = root
        self.sel = selectors.DefaultSelector()
        self._metrics = metrics
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()  # the woken set, its flag, the call queue
        self._woken: set[SimDevice] = set()
        self._flagged = False
        self._calls: list[Callable[[], None]] = []
        self._heap: list[tuple[float, int, SimDevice | Callable[[], None]]] = []
        self._order = itertools.count()
        self._last_slot = 0.0
        self._slots: dict[SimDevice, float] = {}
        self._turning: SimDevice | None = None
        self._loop_ident = 0
        self._interval: float | None = None
        self._stopping = threading.Event()
        self._clean = True
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, opts.workers),
                                        thread_name_prefix="sim-command")
        self.errors = 0
        self._logged: set[str] = set()
        types = frozenset(script_types)
        self.devices: dict[str, SimDevice] = {}
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
        return _wait(lambda: self.connected() >= want, timeout)

    def drained(self) -> bool:
        """Every outbox empty: all that was emitted is acknowledged by the controller."""
        return all(s.depth == 0 and s.buffered == 0
                   for s in (d.stats() for d in self.devices.values()))

    def wait_drained(self, timeout: float) -> bool:
        return _wait(self.drained, timeout, interval=0.5)

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

    # -- handed in by the devices ------------------------------------------------------------

    def _wake(self, device: SimDevice) -> None:
        if device is self._turning and threading.get_ident() == self._loop_ident:
            return  # emitted during its own turn, before the turn's flush: nothing to do
        with self._lock:
            self._woken.add(device)
        self._poke()

    def _run_command(self, device: SimDevice, command: Command) -> None:
        try:
            self._pool.submit(device.execute, command)
        except RuntimeError:  # stopping: it stays stored, unfinished
            pass

    def _call(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._calls.append(fn)
        self._poke()

    def _poke(self) -> None:
        with self._lock:
            if self._flagged:
                return
            self._flagged = True
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed (stopped)
            pass

    # -- the loop thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        sel = self.sel
        self._loop_ident = threading.get_ident()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        while not self._stopping.is_set():
            ready: dict[SimDevice, int] = {}
            for key, mask in sel.select(self._timeout()):
                if key.data is None:
                    self._drain()
                else:
                    device = key.data.link
                    ready[device] = ready.get(device, 0) | mask
            with self._lock:
                woken, self._woken = self._woken, set()
                calls, self._calls = self._calls, []
            for fn in calls:
                self._guard("call", fn)
            now = time.monotonic()
            for device in self._due(now) | woken | set(ready):
                self._turn(device, ready.get(device, 0), now)
        self._guard("stop", self._shutdown)
        sel.close()

    def _timeout(self) -> float:
        if not self._heap:
            return 1.0
        return min(1.0, max(0.0, self._heap[0][0] - time.monotonic()))

    def _drain(self) -> None:
        with self._lock:
            self._flagged = False  # before reading: no wake is ever lost
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _push(self, due: float, item: SimDevice | Callable[[], None]) -> None:
        if isinstance(item, SimDevice):
            item.due = due
        heapq.heappush(self._heap, (due, next(self._order), item))

    def _due(self, now: float) -> set[SimDevice]:
        """Devices whose time has come (entries superseded by a later push are skipped);
        timers from `call_later` run here."""
        out: set[SimDevice] = set()
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, _, item = heapq.heappop(heap)
            if isinstance(item, SimDevice):
                if item.due == due:
                    item.due = -1.0  # off the heap until `_schedule` pushes it again
                    out.add(item)
            else:
                self._guard("timer", item)
        return out

    def _turn(self, device: SimDevice, mask: int, now: float) -> None:
        if device.closed:
            return
        owner = device.owner
        self._turning = device
        try:
            if device.next_metrics is not None and now >= device.next_metrics:
                interval = self._interval or 1.0
                while device.next_metrics <= now:  # a late loop skips ticks, never bunches
                    device.next_metrics += interval
                device.ticks += 1
                device.emit("metrics", METRICS, self._metrics(device, device.ticks))
            if owner.session is None and not device.offline and self._may_connect(device, now):
                owner.connect()
            owner.turn(bool(mask & selectors.EVENT_READ), bool(mask & selectors.EVENT_WRITE))
        except Exception as exc:  # one device's failure never stops the others
            self.errors += 1
            self._log_once(f"turn:{type(exc).__name__}", "simulator: a device's turn "
                           "failed: %s", exc)
        finally:
            self._turning = None
        self._schedule(device, time.monotonic())

    def _may_connect(self, device: SimDevice, now: float) -> bool:
        """Its reconnect time has come and so has its connect slot (slots are handed out
        `1 / connect_rate` apart)."""
        if now < device.owner.next_connect:
            return False
        slot = self._slots.get(device)
        if slot is None:
            slot = max(now, self._last_slot + 1.0 / self.options.connect_rate)
            self._last_slot = slot
            if slot <= now:
                return True
            self._slots[device] = slot
        if now < slot:
            return False
        del self._slots[device]
        return True

    def _schedule(self, device: SimDevice, now: float) -> None:
        owner = device.owner
        session = owner.session
        if session is None and device.offline:
            due = math.inf  # until `bring_online`; only its metrics ticks wake it
        elif session is None:
            due = self._slots.get(device, owner.next_connect)
        elif not session.established:
            due = min(owner.connack_by, now + self.options.sweep_s)
        else:
            due = now + self.options.sweep_s
        if device.next_metrics is not None:
            due = min(due, device.next_metrics)
        if due == math.inf:
            device.due = due  # every entry of it in the heap is stale now
        elif due != device.due:
            self._push(due, device)

    def _shutdown(self) -> None:
        """On the loop thread, at `stop()`."""
        devices = list(self.devices.values())
        if not self._clean:
            for device in devices:
                if device.owner.session is not None:
                    device.owner.session.close()
            return
        begun = {}
        for device in devices:
            started = device.owner.begin_stop()
            if started is not None:
                begun[device] = started
        waiting = {d for d, (session, mid) in begun.items() if mid is not None}
        deadline = time.monotonic() + self.options.stop_wait_s
        while waiting and time.monotonic() < deadline:
            ready = {key.data.link: mask for key, mask in self.sel.select(0.05)
                     if key.data is not None}
            for device in list(waiting):
                session, mid = begun[device]
                mask = ready.get(device, 0)
                if not mask and not session.want_write():
                    continue
                alive = session.pump(bool(mask & selectors.EVENT_READ), True)
                if not alive or (mid is not None and device.owner.death_acked(session, mid)):
                    waiting.discard(device)
        for device, (session, mid) in begun.items():
            device.owner.end_stop(session, mid is not None and device not in waiting)

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            self.errors += 1
            self._log_once(f"{what}:{type(exc).__name__}", "simulator: %s failed: %s",
                           what, exc)

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args, exc_info=True)


def _wait(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
