"""What the controller's rollouts are as data: a rollout, one device of it, a new one to
write, the conflict error, and the store interface for them (`RolloutRecordStore`, what
`store.ControllerStore.rollouts` is). Plain records: the SQL is `rollout_queries`, the
rules `waves`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from edge_agent.errors import Conflict
from edge_agent.fleet.controller.waves import DeviceView, Policy, parse_waves
from edge_agent.fleet.protocol.rollout_states import DOWNLOADING


class RolloutConflict(Conflict):
    """A live rollout of the name exists already, or the id is taken, or the operator's
    command does not apply to the rollout's state."""


@dataclass(frozen=True)
class RolloutRecord:
    id: str
    name: str
    version: str
    selector: str
    waves: str
    abort_above: float
    min_executed: int
    soak_s: float
    device_timeout_s: float
    rollback_on_abort: bool
    state: str
    live: bool
    settled: bool
    wave: int
    waves_total: int
    devices_total: int
    reason: str | None
    wave_started_at: float | None
    created_at: float
    updated_at: float
    config: dict[str, Any] | None = None  # a capacity release's settings (None: a model's)

    def policy(self) -> Policy:
        return Policy(parse_waves(self.waves), self.abort_above, self.min_executed,
                      self.soak_s, self.device_timeout_s, self.rollback_on_abort)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DownloadProgress:
    """A box's latest `rollout.progress` report (`ts`: the box's clock)."""

    bytes: int
    total: int
    rate_bps: float
    eta_s: float | None
    ts: float

    def to_json(self) -> dict[str, Any]:
        percent = 100.0 * self.bytes / self.total if self.total else 100.0
        return {**asdict(self), "percent": round(percent, 1)}


@dataclass(frozen=True)
class DeviceRecord:
    device: str
    fleet: str
    wave: int
    state: str
    retrying: bool
    reason: str | None
    command_id: str | None
    started_at: float | None
    active_at: float | None
    finished_at: float | None
    outcome: str | None
    reported_ts: float | None
    updated_at: float
    cancel_sent: bool = False
    rollback_sent: bool = False
    progress: DownloadProgress | None = None

    def view(self) -> DeviceView:
        return DeviceView(self.device, self.wave, self.state, self.retrying,
                          self.command_id is not None, self.started_at, self.active_at,
                          self.outcome, self.cancel_sent, self.rollback_sent,
                          self.updated_at)

    def downloading(self) -> DownloadProgress | None:
        """The progress to show: while the box is DOWNLOADING, and only a report sent
        since it said so (an earlier attempt's figures are not this download's)."""
        p = self.progress
        if self.state != DOWNLOADING or p is None or self.outcome is not None:
            return None
        return p if self.reported_ts is None or p.ts >= self.reported_ts else None

    def to_json(self) -> dict[str, Any]:
        shown = self.downloading()
        return {**asdict(self), "progress": None if shown is None else shown.to_json()}


@dataclass(frozen=True)
class NewRollout:
    """What `fleet rollout start` writes; the devices with their fleet and wave."""

    id: str
    name: str
    version: str
    selector: str
    policy: Policy
    devices: Mapping[str, tuple[str, int]]  # device -> (fleet, wave)
    config: Mapping[str, Any] | None = None  # a capacity release: the settings it ships


class RolloutRecordStore(Protocol):
    """The rollouts' queries as callers hold them: `store.rollouts` (`store.ControllerStore`)."""

    def create_rollout(self, new: NewRollout, now: float) -> RolloutRecord: ...

    def set_rollout_state(self, rollout_id: str, to: str, allowed: frozenset[str], *,
                          reason: str, now: float) -> RolloutRecord: ...

    def rollout(self, rollout_id: str) -> RolloutRecord | None: ...

    def rollouts(self, *, unsettled: bool = False, limit: int = 100,
                 name: str | None = None) -> list[RolloutRecord]: ...

    def rollout_devices(self, rollout_id: str) -> list[DeviceRecord]: ...

    def apply_plan(self, rollout_id: str, *, expect: str, state: str, wave: int,
                   reason: str | None, settled: bool, timed_out: Sequence[str],
                   skipped: Sequence[str], now: float) -> bool: ...

    def next_command_seqs(self, streams: Sequence[str]) -> dict[str, int]: ...

    def claim_commands(self, rollout_id: str, commands: Mapping[str, Mapping[str, Any]],
                       now: float, *, require_state: str | None = None,
                       retry: bool = False) -> list[str]: ...

    def unpublished_commands(self, rollout_id: str) -> list[dict[str, Any]]: ...

    def mark_published(self, command_ids: Sequence[str], now: float) -> None: ...


def rollout_from_row(row: Sequence[Any]) -> RolloutRecord:
    (id_, name, version, selector, waves, abort_above, min_executed, soak_s, timeout_s,
     rollback, state, live, settled, wave, waves_total, devices_total, reason,
     wave_started_at, created_at, updated_at, config) = row
    return RolloutRecord(id_, name, version, selector, waves, float(abort_above),
                         int(min_executed), float(soak_s), float(timeout_s), bool(rollback),
                         state, bool(live), bool(settled), int(wave), int(waves_total),
                         int(devices_total), reason, wave_started_at, created_at, updated_at,
                         json.loads(config) if config else None)
