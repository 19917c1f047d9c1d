"""The simulator's loop: one thread (`sim-loop`) and one selector driving every simulated
device's `Owner`, the timers, and the threads that run scripts. `fleet.sim.fleet.Simulator`
is this loop plus the devices and the API around them.

Each pass: wait on the selector (the devices' sockets and the loop's wake socket) until
the earliest timer; then turn every device whose socket is ready, that was woken (an emit
from another thread, a command's result) or whose time has come — `connect()` when its
reconnect time and a connect slot have come (slots are `1 / connect_rate` apart, so a
broker restart's reconnect storm is paced), else `turn()`. Timers are a heap with lazy
deletion (a device's entry counts only if its `due` still matches), so an idle fleet costs
nothing between turns. `call_later` timers run on this thread; scripts never do
(`workers` threads, `sim-command`).

Threads: everything here runs on the loop thread except `_wake`, `_call`, `_poke` and
`_run_command`, which any thread may call (they take `_lock` or hand over to the pool).
Must never: block (a script, a sleep, a wait on the network other than a loopback
connect), or let one device's failure stop the loop.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from edge_agent.fleet.device.link.core import LinkOptions
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.envelope import METRICS
from edge_agent.fleet.sim.device import SimDevice

log = logging.getLogger("edge_agent.fleet.sim.fleet")
MetricsBody = Callable[[SimDevice, int], dict[str, Any]]


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


class SimLoop:
    """The loop's state and its thread; `Simulator` fills `devices`."""

    def __init__(self, options: SimOptions, metrics: MetricsBody) -> None:
        self.options = options
        self.devices: dict[str, SimDevice] = {}
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
        self._pool = ThreadPoolExecutor(max_workers=max(1, options.workers),
                                        thread_name_prefix="sim-command")
        self.errors = 0
        self._logged: set[str] = set()

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
