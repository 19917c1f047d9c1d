"""The rollout runner on the device: takes `rollout.start` / `rollout.cancel` /
`rollout.rollback` from the fleet link, and drives each rollout through its states
(`rollout_state`), one task per live rollout on the server's event loop.

    RECEIVED     release looked up (TUF-verified facts; the gate spec checked)
    DOWNLOADING  resumable transfer into `<state>/rollouts/<id>/`, progress over the link
                 (the first, at most one per `fleet.progress_interval_s`, the last)
    VERIFYING    length, sha256, GGUF header, then `ModelOps.install_verified` (inactive)
    STAGED       held by the maintenance window and `defer_while_busy`
    ACTIVATING, GATING, ACTIVE | ROLLED_BACK   — `fleet.device.rollout.activation`
    FAILED       retried (back to RECEIVED) after a backoff, up to rollout_max_failures
    REJECTED     final: never retried      CANCELLED  final: an operator's cancel

Restart (`start` → `resume`): DOWNLOADING continues its download from where it stopped;
VERIFYING verifies again (or finds the version installed); STAGED waits again; a rollout
found in ACTIVATING or GATING is never continued: if the pointer already names the new
digest it goes back to the previous one, and the rollout ends ROLLED_BACK ("interrupted
during gating") — a release whose gate did not pass is never left serving. A ROLLED_BACK
row whose switch back a crash cut is finished too.

`defer_while_busy`: STAGED waits while the name has requests running or queued, up to
`defer_deadline_s` after staging; then it activates anyway (a box that is never idle still
gets the release, and the switch fails no request: running ones finish on the old
weights). The maintenance window is never overridden.

Every transition is committed before it is acted on and sent as an `audit` message
(kind `rollout`) through the injected `emit(kind, cls, body)`. The `rollout.*` commands
(`handlers`) run elsewhere: on the fleet link's `fleet-commands` thread, not on the event
loop (tests call them from anywhere). A command commits what it decided, then wakes the
runner (`begin`: `_wake`) or interrupts a rollout's task (`cancel`: `_interrupt`, after
marking its download to stop in `_stop_ids`); a rollback during the switch only asks
(`_aborts`: the health gate fails with `rollback_requested`). Those marks are read on the
loop and in download threads, so they are touched only under `_lock`. A command returns at
once: it never awaits, never downloads, verifies or activates (the runner's). The one
pointer it moves is an ACTIVE rollout's switch back (`rollout.rollback`), committed as
ROLLED_BACK before it. Must never import the registry, the scheduler, the runtime or the request
path's service.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from edge_agent import __version__
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.errors import EdgeAgentError, InvalidRequest
from edge_agent.fleet.device.agent.boot import request_restart
from edge_agent.fleet.device.agent.platform import box_platform
from edge_agent.fleet.device.agent.slots import InstallFailed, Slots
from edge_agent.fleet.device.link.command_gate import Handler, command_args
from edge_agent.fleet.device.release.source import (
    INSTALL_FAILED,
    NOT_CONFIGURED,
    NOT_FOR_THIS_BOX,
)
from edge_agent.fleet.device.rollout import capacity, health_gate
from edge_agent.fleet.device.rollout.activation import (
    SETTLE_S,
    Activation,
    Activator,
    RetryLater,
    interrupted,
)
from edge_agent.fleet.device.rollout.agent_release import AgentRelease
from edge_agent.fleet.device.rollout.capacity_release import CapacityRelease
from edge_agent.fleet.device.rollout.health_gate import Probe
from edge_agent.fleet.device.rollout.model_release import ModelRelease, restore_pointer
from edge_agent.fleet.device.rollout.name_claim import NameHeld, name_claim
from edge_agent.fleet.device.rollout.outcomes import ReleaseFailed, ReleaseRejected
from edge_agent.fleet.device.rollout.progress import Figures, ProgressThrottle
from edge_agent.fleet.device.rollout.rules import (
    Releases,
    backoff_s,
    hold_reason,
    target,
)
from edge_agent.fleet.device.rollout.store import (
    IllegalTransition,
    NameBusy,
    Rollout,
    RolloutStore,
)
from edge_agent.fleet.protocol.agent_release import is_agent_name, refusal
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import StartArgs
from edge_agent.fleet.protocol.envelope import AUDIT
from edge_agent.fleet.protocol.ids import release_version
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVE,
    CANCELLED,
    DOWNLOADING,
    FAILED,
    RECEIVED,
    REJECTED,
    ROLLED_BACK,
    STAGED,
    SWITCHING,
    VERIFYING,
)
from edge_agent.names import ModelName
from edge_agent.priority import run_niced

log = logging.getLogger(__name__)
KIND = "rollout"


Emit = Callable[[str, str, Mapping[str, Any]], Any]


class _Stopped(Exception):
    """Raised in a download's progress callback: the rollout was cancelled or the
    manager is stopping."""


class RolloutManager:
    def __init__(self, settings: Settings, modelops: ModelOps, releases: Releases,
                 probe: Probe, *, emit: Emit | None = None,
                 clock: Callable[[], float] = time.time,
                 local_now: Callable[[], datetime] = datetime.now,
                 poll_s: float = 1.0, retry_base_s: float = 30.0, settle_s: float = SETTLE_S,
                 hook: Callable[[str, Rollout], None] | None = None,
                 hardware: Callable[[], Mapping[str, Any]] | None = None,
                 restart: Callable[[], None] | None = None,
                 ready: Callable[[], bool] = lambda: True,
                 agent_version: str = __version__,
                 running_release: Callable[[], str | None] | None = None) -> None:
        """`emit`: the link's `emit(kind, cls, body)` (None: nothing is published).
        `hook(event, rollout)`: called after each committed transition (event = the new
        state) and after the pointer switch ("switched"), for logs and tests.
        `restart`: how an agent release asks for a new start (default: systemd's, through
        `device.agent.boot.request_restart`); `ready`: whether the box serves (an agent
        release's gate waits for it); `agent_version`, `running_release`: which agent this
        process is and the release it runs from (`AgentRelease`)."""
        self.settings = settings
        self.ops = modelops
        self.releases = releases
        self.emit = emit
        self.clock = clock
        self.local_now = local_now
        self.poll_s = poll_s
        self.retry_base_s = retry_base_s
        self.hook = hook
        self.store = RolloutStore(settings.state_dir / "rollouts.db", clock=clock)
        act = Activation(settings, modelops, self.store, probe, self._move, self._publish,
                         clock=clock, poll_s=poll_s, hook=hook, hardware=hardware,
                         settle_s=settle_s)
        self.agent = AgentRelease(
            act, restart=restart or (lambda: request_restart(settings.state_dir)),
            ready=ready, version=agent_version, running=running_release)
        self.activator = Activator(act, ModelRelease(act), CapacityRelease(act), self.agent)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stop_ids: set[str] = set()  # rollouts whose download must stop
        self._aborts: set[str] = set()  # rollouts asked to roll back while switching
        self._stopping = False
        self._lock = threading.Lock()

    @property
    def work_dir(self) -> Path:
        return self.settings.state_dir / "rollouts"

    # -- life ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """On the server's loop, once (the app's lifespan): `resume`, then commands may
        come (a `begin` before `start` is committed and picked up here)."""
        self._loop = asyncio.get_running_loop()
        await self.resume()

    async def resume(self) -> None:
        """Converges what a stop or a kill left (module docstring), then drives the live
        rollouts on."""
        for r in await asyncio.to_thread(self.store.unfinished):
            try:
                if is_agent_name(r.name) and (
                        r.state in SWITCHING or (r.state == ROLLED_BACK and not r.restored)):
                    await self.agent.converge(r, partial(self._spawn_coro, r.id))
                elif r.state in SWITCHING or (r.state == ROLLED_BACK and not r.restored):
                    await self._converge(r)
                else:
                    self._publish({"event": "rollout.resumed", **r.summary()})
                    self._spawn(r.id)
            except Exception:  # one bad row never keeps the others (or the box) back
                log.exception("rollout %s: not resumed", r.id)

    async def stop(self) -> None:
        self._stopping = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.close)

    async def settled(self, rollout_id: str, timeout: float) -> Rollout:
        """The rollout's row once it is final and its task has ended (the switch back,
        the evidence row done), or when `timeout` passed (tests, tools)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.store.get(rollout_id)
            if r is None:
                raise KeyError(rollout_id)
            if (not r.live and r.restored and rollout_id not in self._tasks) \
                    or time.monotonic() > deadline:
                return r
            await asyncio.sleep(0.02)

    # -- the runner ----------------------------------------------------------------------------
    def _wake(self, rollout_id: str) -> None:
        loop = self._loop
        if loop is not None and not self._stopping:  # not started: `start` picks it up
            loop.call_soon_threadsafe(self._spawn, rollout_id)

    def _interrupt(self, rollout_id: str) -> None:
        loop = self._loop
        task = self._tasks.get(rollout_id)
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)

    def _spawn(self, rollout_id: str) -> None:
        if rollout_id in self._tasks or self._stopping:
            return
        self._spawn_coro(rollout_id, self._drive(rollout_id))

    def _spawn_coro(self, rollout_id: str, coro: Any) -> None:
        if rollout_id in self._tasks or self._stopping:
            coro.close()
            return

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("rollout %s: failed", rollout_id)

        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks[rollout_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(rollout_id, None))

    async def _drive(self, rollout_id: str) -> None:
        try:
            while True:
                r = await asyncio.to_thread(self.store.get, rollout_id)
                if r is None or not r.live:
                    return
                if r.state in (RECEIVED, DOWNLOADING, VERIFYING):
                    await self._fetch(r)
                elif r.state == STAGED:
                    await self._hold_then_activate(r)
                elif r.state == FAILED:
                    await self._retry(r)
                else:  # SWITCHING: only `start` meets them (converged there)
                    return
        except (asyncio.CancelledError, _Stopped, IllegalTransition):
            return  # cancelled, stopping, or moved by a command meanwhile
        except Exception:
            log.exception("rollout %s: runner failed", rollout_id)
        finally:  # a stop mark stays: a download thread may still be running
            with self._lock:
                self._aborts.discard(rollout_id)

    async def _fetch(self, r: Rollout) -> None:
        if is_agent_name(r.name):
            await self._fetch_agent(r)
            return
        try:
            release = await asyncio.to_thread(self.releases.lookup, r.name, r.version)
            digest = release.sha256.lower().removeprefix("sha256:")
            try:
                health_gate.parse_spec((release.manifest or {}).get("gate"))
                if release.name != r.name:
                    raise ReleaseRejected("release_mismatch", release=release.name)
            except ValueError as exc:
                raise ReleaseRejected("bad_gate", error=str(exc)[:300]) from None
            if r.target_digest is not None and r.target_digest != digest:
                raise ReleaseRejected("release_changed", was=r.target_digest, now=digest)
            if r.capacity is not None:  # gated on the version served: nothing to fetch
                serving = self.ops.active_digest(r.name)
                if serving != digest:
                    raise ReleaseRejected(
                        capacity.NOT_SERVING, f"a capacity release is gated on the version "
                        f"served: {r.name}@{r.version} is sha256:{digest[:12]}, this box "
                        f"serves {'sha256:' + serving[:12] if serving else 'none'}",
                        release=digest, serving=serving)
            facts = {"length": release.length, "sha256": digest,
                     "manifest": dict(release.manifest or {})}
            if self._installed(r.name, digest):
                await self._stage(r, release=facts, target_digest=digest,
                                  reason="already installed")
                return
            r, path = await self._download(r, release, facts, digest)
            fleet = self.settings.fleet
            await run_niced(fleet.rollout_nice, self.releases.install, release, path,
                            self.ops, by=f"rollout:{r.id}")
            if not self._installed(r.name, digest):
                raise ReleaseFailed("not_installed", digest=digest)
            await self._stage(r)
        except ReleaseRejected as exc:
            await self._end(r, REJECTED, exc.reason, {**exc.details, "message": exc.message})
        except ReleaseFailed as exc:
            await self._fail(r, exc.reason, {**exc.details, "message": exc.message})
        except InvalidRequest as exc:  # the release's own data refused by the store
            await self._end(r, REJECTED, "invalid_release", {"message": exc.message})
        except EdgeAgentError as exc:  # a file that did not verify, a store error
            await self._fail(r, type(exc).__name__, {"message": exc.message[:300]})

    async def _download(self, r: Rollout, release: Any, facts: Mapping[str, Any],
                        digest: str) -> tuple[Rollout, Path]:
        """RECEIVED → DOWNLOADING → VERIFYING around the resumable download; the file."""
        if r.state == RECEIVED:
            r = await self._move(r, DOWNLOADING, expect=RECEIVED, release=facts,
                                 target_digest=digest, details={"bytes": release.length})
        fleet = self.settings.fleet
        throttle = ProgressThrottle(fleet.progress_interval_s)
        try:
            path = await run_niced(
                fleet.rollout_nice, self.releases.download, release, self.work_dir / r.id,
                progress=self._progress(r, throttle),
                max_bytes_per_s=fleet.max_download_bytes_per_s,
                headroom=fleet.download_headroom_bytes)
        except (ReleaseFailed, ReleaseRejected):
            held = throttle.held()  # where it stopped, if that report was kept back
            if held is not None:
                self._publish_progress(r, held)
            raise
        if r.state == DOWNLOADING:
            r = await self._move(r, VERIFYING, expect=DOWNLOADING)
        self._check_stop(r.id)
        return r, path

    async def _fetch_agent(self, r: Rollout) -> None:
        """An agent release: looked up, refused here if not built for this box (before any
        download), downloaded as a model is, installed beside the running version."""
        try:
            root = self.settings.fleet.agent_releases_dir
            if root is None:
                raise ReleaseRejected(NOT_CONFIGURED, "this box takes no agent releases: "
                                      "fleet.agent_releases_dir is not set")
            release = await asyncio.to_thread(self.releases.lookup_agent, r.version)
            manifest = release.agent
            why = refusal(manifest, await asyncio.to_thread(box_platform))
            if why is not None:
                raise ReleaseRejected(NOT_FOR_THIS_BOX, why, build=manifest.build,
                                      platform=f"{manifest.python}-{manifest.abi}-"
                                      f"{manifest.platform}")
            try:
                health_gate.parse_spec(manifest.gate)
            except ValueError as exc:
                raise ReleaseRejected("bad_gate", error=str(exc)[:300]) from None
            digest = release.sha256.lower().removeprefix("sha256:")
            if r.target_digest is not None and r.target_digest != digest:
                raise ReleaseRejected("release_changed", was=r.target_digest, now=digest)
            facts = {"length": release.length, "sha256": digest,
                     "manifest": dict(release.manifest)}
            slots = Slots(root)
            if r.version == self.agent.version and self.agent.running() in (None, r.version):
                raise ReleaseRejected("already_running",
                                      f"this box runs agent {self.agent.version}")
            if slots.installed(r.version):
                await self._stage(r, release=facts, target_digest=digest,
                                  reason="already installed")
                return
            r, path = await self._download(r, release, facts, digest)
            try:
                await run_niced(self.settings.fleet.rollout_nice, slots.install, path,
                                manifest)
            except InstallFailed as exc:
                raise ReleaseRejected(INSTALL_FAILED, f"{manifest.ref}: {exc}",
                                      step=exc.step) from None
            await self._stage(r)
        except ReleaseRejected as exc:
            await self._end(r, REJECTED, exc.reason, {**exc.details, "message": exc.message})
        except ReleaseFailed as exc:
            await self._fail(r, exc.reason, {**exc.details, "message": exc.message})
        except (_Stopped, asyncio.CancelledError, IllegalTransition):
            raise
        except Exception as exc:  # a flaw must still end in a state the controller sees
            log.exception("rollout %s: fetching agent %s failed", r.id, r.version)
            await self._fail(r, type(exc).__name__, {"message": str(exc)[:300]})

    async def _stage(self, r: Rollout, **fields: Any) -> None:
        r = await self._move(r, STAGED, expect=r.state, staged_at=self.clock(), **fields)
        shutil.rmtree(self.work_dir / r.id, ignore_errors=True)

    async def _hold_then_activate(self, r: Rollout) -> None:
        said = None
        while True:
            fleet = self.settings.fleet
            now = self.local_now()
            name = ModelName.parse(self.settings.default_model) if is_agent_name(r.name) \
                else r.name  # an agent switch stops every model; the default is the busy one
            why = hold_reason(minute=now.hour * 60 + now.minute,
                              window=fleet.maintenance_window, busy=self.ops.busy(name),
                              defer=fleet.defer_while_busy,
                              staged_for_s=self.clock() - (r.staged_at or r.entered_at),
                              deadline_s=fleet.defer_deadline_s)
            if why is None:
                break
            if why != said:  # each new reason once, not every poll
                said = why
                self._publish({"event": "rollout.held", "held_by": why, **r.summary()})
            await asyncio.sleep(self.poll_s)
            self._check_stop(r.id)
        try:
            await self.activator.run(r, lambda: self._aborted(r.id))
        except RetryLater as exc:
            current = await asyncio.to_thread(self.store.get, r.id)
            if current is not None:
                await self._fail(current, exc.reason, exc.details)

    async def _retry(self, r: Rollout) -> None:
        wait = (r.retry_at or 0) - self.clock()
        while wait > 0:
            await asyncio.sleep(min(wait, self.poll_s))
            self._check_stop(r.id)
            wait = (r.retry_at or 0) - self.clock()
        await self._move(r, RECEIVED, expect=FAILED, attempts=r.attempts + 1, retry_at=None,
                         reason=f"retry {r.attempts + 1}")

    async def _fail(self, r: Rollout, reason: str, details: Mapping[str, Any]) -> None:
        failures = r.failures + 1
        limit = self.settings.fleet.rollout_max_failures
        retry_at = self.clock() + backoff_s(failures, self.retry_base_s) \
            if failures < limit else None
        current = await asyncio.to_thread(self.store.get, r.id)
        assert current is not None
        await self._move(current, FAILED, reason=reason, expect=current.state,
                         details={**details, "failures": failures, "limit": limit},
                         failures=failures, retry_at=retry_at)
        if retry_at is None:
            shutil.rmtree(self.work_dir / r.id, ignore_errors=True)

    async def _end(self, r: Rollout, state: str, reason: str,
                   details: Mapping[str, Any]) -> None:
        current = await asyncio.to_thread(self.store.get, r.id)
        assert current is not None
        await self._move(current, state, reason=reason, details=details, expect=current.state)
        shutil.rmtree(self.work_dir / r.id, ignore_errors=True)

    async def _converge(self, r: Rollout) -> None:
        """A rollout a restart found switching, or rolled back with its switch back
        undone: the previous digest serves again; never the new one without its gate (a
        capacity release: the previous settings, `CapacityRelease.restore`)."""
        release = self.activator.release(r)
        if r.state in SWITCHING:
            r = await self._move(r, ROLLED_BACK, reason=interrupted(r.state),
                                 expect=r.state, restored=False)
            release.evidence(r, [])
        await release.restore(r)

    # -- helpers ------------------------------------------------------------------------------
    async def _move(self, r: Rollout, to: str, *, reason: str | None = None,
                    details: Mapping[str, Any] | None = None, expect: str | None = None,
                    **fields: Any) -> Rollout:
        """Commit, then publish, then tell the hook: the order a restart relies on."""
        new = await asyncio.to_thread(self.store.transition, r.id, to, reason=reason,
                                      details=details, expect=expect, **fields)
        self._published(new, r.state)
        return new

    def _published(self, r: Rollout, was: str | None) -> None:
        self._publish({"event": "rollout.transition", "from": was, "to": r.state,
                       "details": _small(r.details), **r.summary()})
        if self.hook is not None:
            self.hook(r.state, r)

    def _publish(self, body: Mapping[str, Any]) -> None:
        if self.emit is None:
            return
        try:
            self.emit(KIND, AUDIT, {**body, "ts": self.clock()})
        except Exception:  # the link counts and logs its own refusals; never stop here
            log.exception("rollout: audit message not emitted")

    def _progress(self, r: Rollout, throttle: ProgressThrottle) -> Callable[[int, int], None]:
        """The download's callback: a stop is checked at every call; what goes over the
        link is the throttle's choice (`fleet.device.rollout.progress`)."""

        def progress(done: int, total: int) -> None:
            self._check_stop(r.id)
            figures = throttle.offer(done, total)
            if figures is not None:
                self._publish_progress(r, figures)

        return progress

    def _publish_progress(self, r: Rollout, figures: Figures) -> None:
        self._publish({"event": "rollout.progress", "rollout_id": r.id, "name": r.name,
                       **figures})

    def _aborted(self, rollout_id: str) -> bool:
        with self._lock:
            return rollout_id in self._aborts

    def _check_stop(self, rollout_id: str) -> None:
        with self._lock:
            if self._stopping or rollout_id in self._stop_ids:
                raise _Stopped(rollout_id)

    def _installed(self, name: ModelName, digest: str) -> bool:
        return any(v.digest == digest for v in self.ops.versions(name, missing_ok=True))

    def release_digest(self, name: ModelName, version: str) -> str | None:
        """The digest of release `name@version` as a rollout of it here recorded it (None:
        never looked up on this box), for `model.verify`."""
        return self.store.release_digest(name, version)


    # -- the `rollout.*` commands, on the link's `fleet-commands` thread ------------------

    def handlers(self) -> dict[str, Handler]:
        """`rollout.start` {rollout_id, name, version}; `rollout.cancel` {rollout_id} or
        {name}; `rollout.rollback` {rollout_id} or {name}. Results: `accepted` and the
        rollout's summary (a refusal says why in `refused`)."""
        return {"rollout.start": self._start_handler, "rollout.cancel": self._cancel_handler,
                "rollout.rollback": self._rollback_handler}

    def _start_handler(self, command: Command) -> dict[str, Any]:
        args = command_args(command, StartArgs)
        return self.begin(args.rollout_id, ModelName.parse(args.name),
                          release_version(args.version), command.id,
                          config=None if args.config is None else dict(args.config))

    def _cancel_handler(self, command: Command) -> dict[str, Any]:
        return self.cancel(**target(command))

    def _rollback_handler(self, command: Command) -> dict[str, Any]:
        return self.rollback(**target(command))

    def begin(self, rollout_id: str, name: str, version: str,
              command_id: str | None = None, *,
              config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A new rollout (RECEIVED, committed) and its task; the same id again reports
        it; refused while another rollout of the name is live, or a `models pull` of it
        runs (its row is created under the name's claim: `fleet.device.rollout.name_claim`).
        `config`: a capacity release of those settings (`fleet.device.rollout.capacity`)."""
        key = ModelName.parse(name)
        claim = name_claim(self.settings.state_dir, key, {"rollout_id": rollout_id}) \
            if self.store.get(rollout_id) is None else nullcontext()
        try:
            with claim:
                r, created = self.store.create(rollout_id, key, version,
                                               command_id=command_id, config=config)
        except NameBusy as busy:
            return self._busy(rollout_id, busy.live.name, busy.live.summary())
        except NameHeld as held:
            return self._busy(rollout_id, key, held.holder)
        if created:
            self._published(r, None)
            self._wake(r.id)
        return {"accepted": True, "created": created, **r.summary()}

    def _busy(self, rollout_id: str, name: str, live: Mapping[str, Any]) -> dict[str, Any]:
        body = {"accepted": False, "refused": "busy", "rollout_id": rollout_id,
                "name": name, "live": dict(live)}
        self._publish({"event": "rollout.refused", **body})
        return body

    def cancel(self, rollout_id: str | None = None, name: str | None = None
               ) -> dict[str, Any]:
        """Before activation: CANCELLED (a download stops at its next chunk, its partial
        file goes). From ACTIVATING on: refused (`rollout.rollback` is the way back)."""
        r = self._find(rollout_id, name)
        if r is None:
            return {"accepted": False, "refused": "unknown", "rollout_id": rollout_id,
                    "name": name}
        if not r.live:
            return {"accepted": r.state == CANCELLED, **r.summary()}
        if r.state in SWITCHING:
            return {"accepted": False, "refused": "activating", **r.summary()}
        with self._lock:
            self._stop_ids.add(r.id)
        try:
            r = self.store.transition(r.id, CANCELLED, reason="cancel requested",
                                      expect=r.state)
        except IllegalTransition:
            return self.cancel(r.id)  # it moved meanwhile: decide again
        self._published(r, None)
        self._interrupt(r.id)
        shutil.rmtree(self.work_dir / r.id, ignore_errors=True)
        return {"accepted": True, **r.summary()}

    def rollback(self, rollout_id: str | None = None, name: str | None = None
                 ) -> dict[str, Any]:
        """ACTIVE: back to the previous digest now (if the name still serves this
        rollout's digest). ACTIVATING/GATING: the gate fails with `rollback_requested`.
        Earlier: the rollout is cancelled."""
        r = self._find(rollout_id, name, prefer=ACTIVE)
        if r is None:
            return {"accepted": False, "refused": "unknown", "rollout_id": rollout_id,
                    "name": name}
        if r.state in SWITCHING:
            with self._lock:
                self._aborts.add(r.id)
            return {"accepted": True, "requested": True, **r.summary()}
        if r.live:
            return self.cancel(r.id)
        if r.state != ACTIVE:
            return {"accepted": r.state == ROLLED_BACK, **r.summary()}
        if is_agent_name(r.name):
            return self._rollback_agent(r)
        if not r.config and self.ops.active_digest(r.name) != r.target_digest:
            return {"accepted": False, "refused": "superseded", **r.summary()}
        try:
            r = self.store.transition(r.id, ROLLED_BACK, reason="rollback requested",
                                      expect=ACTIVE, restored=False)
        except IllegalTransition:
            return self.rollback(r.id)
        self._published(r, None)
        if r.config:
            self._restore_capacity_soon(r)
        else:
            r = restore_pointer(self.ops, self.store, r)
        return {"accepted": True, **r.summary()}

    def _rollback_agent(self, r: Rollout) -> dict[str, Any]:
        """An ACTIVE agent release: `current` back to the version it replaced, committed
        ROLLED_BACK, then a restart into it."""
        refused = self.agent.back_to_previous(r)
        if refused is not None:
            return {"accepted": False, "refused": refused, **r.summary()}
        try:
            r = self.store.transition(r.id, ROLLED_BACK, reason="rollback requested",
                                      expect=ACTIVE, restored=True)
        except IllegalTransition:
            return self.rollback(r.id)
        self._published(r, None)
        self.agent.restart()
        return {"accepted": True, **r.summary()}

    def _restore_capacity_soon(self, r: Rollout) -> None:
        """A capacity release's way back, committed (`restored` 0) and run on the loop:
        the overlay put back as it was for its keys and the model loaded with the previous
        settings (`CapacityRelease.restore`; a restart finishes what a crash cut)."""
        loop = self._loop

        async def finish() -> None:
            try:
                await self.activator.release(r).restore(r)
            except Exception:  # left `restored = 0`: the next start finishes it
                log.exception("rollout %s: restoring the previous settings failed", r.id)

        if loop is not None and not self._stopping:
            loop.call_soon_threadsafe(lambda: loop.create_task(finish()))

    def _find(self, rollout_id: str | None, name: str | None,
              prefer: str | None = None) -> Rollout | None:
        if rollout_id is not None:
            return self.store.get(rollout_id)
        assert name is not None
        key = ModelName.parse(name)
        live = self.store.live_for(key)
        if live is not None:
            return live
        return (self.store.latest_for(key, prefer) if prefer else None) \
            or self.store.latest_for(key)


def _small(details: Mapping[str, Any]) -> dict[str, Any]:
    """A transition's details as sent: strings cut, so a message stays small."""
    return {k: (v[:300] if isinstance(v, str) else v) for k, v in details.items()}

