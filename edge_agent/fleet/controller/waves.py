"""The controller's wave policy: pure functions of a rollout's per-device states and the
clock. What `fleet rollout start` parses, which device goes in which wave, how a device
counts, and what the engine (`controller.rollouts`) must do next.

    --waves 1,10%,50%,100%   cumulative targets: 1 device, then 10% of the selection,
                             then half, then all (counts are cumulative too; the last
                             must be 100%; a percentage rounds up; a wave that would add
                             no device is dropped)
    --abort-above 10%        abort once the failed share of finished devices exceeds it…
    --min-executed 3         …and at least this many devices have finished
    --soak 10m               a wave's ACTIVE devices must have been ACTIVE this long
                             before the next wave starts
    --device-timeout 2h      a device with no final state this long after its
                             rollout.start was published counts as failed (timed out);
                             longer than a box's hold (its maintenance window, its
                             defer_deadline_s, 1 h by default) or boxes time out waiting

How a device counts (`phase`): ACTIVE succeeded; ROLLED_BACK, REJECTED, FAILED once the
box gave up retrying, REFUSED (the box refused rollout.start) and timed out failed;
CANCELLED (by the controller) neither; everything else still running. A box that refused
as *busy* (another rollout of the name, or a `models pull` of it, under way there) has not
failed: it is sent rollout.start again every `busy_retry_s` while the rollout runs, until
its device timeout (counted from the first start) makes it timed out; a rollout that
stops first skips it. The rollout's failed share is cumulative over every wave started so
far (AWS IoT Jobs' abort criteria: a threshold after a minimum number of executed things).

When the next wave starts (`decide`): every device of the waves started so far finished
(succeeded, or failed within the threshold), no abort, and the last wave's ACTIVE devices
soaked. A failed device does not hold the next wave; the threshold decides.

Must never: read the clock, a database or the network (everything comes in as
arguments), or mutate what it is given.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from edge_agent.config.controller import BUSY_RETRY_S
from edge_agent.errors import InvalidRequest
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVATING,
    ACTIVE,
    CANCELLED,
    DOWNLOADING,
    FAILED,
    GATING,
    RECEIVED,
    REJECTED,
    ROLLED_BACK,
    STAGED,
    VERIFYING,
)

# The controller rollout's states. RUNNING and PAUSED are live (one per model name).
RUNNING, PAUSED, ABORTED, COMPLETED = "RUNNING", "PAUSED", "ABORTED", "COMPLETED"
ROLLOUT_STATES = (RUNNING, PAUSED, ABORTED, COMPLETED, ROLLED_BACK)
LIVE = frozenset({RUNNING, PAUSED})

# A device's state as the controller records it: the box's own (`fleet.device.rollout.store`),
# or one of these before the box said anything.
PENDING = "PENDING"  # its wave has not started: nothing sent
SENT = "SENT"  # rollout.start recorded (and published once `started_at` is set)
REFUSED = "REFUSED"  # the box refused rollout.start (busy, expired, bad signature…)
# Before the switch a box takes rollout.cancel; from ACTIVATING on only a rollback.
BEFORE_SWITCH = frozenset({SENT, RECEIVED, DOWNLOADING, VERIFYING, STAGED, FAILED})
SWITCHING = frozenset({ACTIVATING, GATING})

# Outcomes the controller itself decides (stored; the rest is read from the state).
TIMED_OUT = "timed_out"
SKIPPED = "skipped"  # never sent: the rollout stopped before its wave

# Phases: how `phase` counts a device.
WAITING, IN_FLIGHT, SUCCEEDED, FAILED_PHASE, CANCELLED_PHASE = (
    "waiting", "running", "succeeded", "failed", "cancelled")
PHASES = (WAITING, IN_FLIGHT, SUCCEEDED, FAILED_PHASE, CANCELLED_PHASE)

MAX_WAVES = 32
_STEP = re.compile(r"(\d+(?:\.\d+)?)(%?)")
_SHARE = re.compile(r"(\d+(?:\.\d+)?)%")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class WaveSpecError(InvalidRequest):
    """A --waves, --abort-above, --soak or timeout the policy cannot use."""


# -- parsing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One entry of --waves: a cumulative device count, or a cumulative percentage."""

    count: int | None = None
    percent: float | None = None

    def target(self, total: int) -> int:
        """How many of `total` devices have been started once this wave started."""
        if self.count is not None:
            return min(self.count, total)
        assert self.percent is not None
        # A hair under the exact product first: 10% of 30 is 3, not 4 from float noise.
        return min(total, math.ceil(total * self.percent / 100.0 - 1e-9))

    def __str__(self) -> str:
        if self.count is not None:
            return str(self.count)
        return f"{self.percent:g}%"


def parse_waves(spec: str) -> tuple[Step, ...]:
    """`1,10%,50%,100%` → steps; WaveSpecError unless every entry is a count ≥ 1 or a
    percentage in (0, 100], counts and percentages each increase, and the last is 100%."""
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise WaveSpecError(f"--waves {spec!r}: a comma-separated list such as 1,10%,100%",
                            param="waves")
    if len(parts) > MAX_WAVES:
        raise WaveSpecError(f"--waves: at most {MAX_WAVES} waves", param="waves")
    steps: list[Step] = []
    for part in parts:
        m = _STEP.fullmatch(part)
        if m is None:
            raise WaveSpecError(f"--waves: {part!r} is neither a count nor a percentage",
                                param="waves")
        value, pct = float(m.group(1)), m.group(2) == "%"
        if pct:
            if not 0 < value <= 100:
                raise WaveSpecError(f"--waves: {part} is not in (0%, 100%]", param="waves")
            steps.append(Step(percent=value))
        else:
            if value != int(value) or value < 1:
                raise WaveSpecError(f"--waves: {part} is not a whole count ≥ 1",
                                    param="waves")
            steps.append(Step(count=int(value)))
    for kind in ("count", "percent"):
        seen = [getattr(s, kind) for s in steps if getattr(s, kind) is not None]
        if any(b <= a for a, b in zip(seen, seen[1:], strict=False)):
            raise WaveSpecError(f"--waves {spec}: targets are cumulative, so each "
                                f"{kind} must be larger than the one before", param="waves")
    if steps[-1].percent != 100:
        raise WaveSpecError(f"--waves {spec}: the last wave must be 100% (every selected "
                            "device)", param="waves")
    return tuple(steps)


def format_waves(steps: Sequence[Step]) -> str:
    return ",".join(str(s) for s in steps)


def parse_share(text: str, *, param: str = "abort_above") -> float:
    """`10%` → 0.10 (0% to 100%)."""
    m = _SHARE.fullmatch(text.strip())
    if m is None or float(m.group(1)) > 100:
        raise WaveSpecError(f"{text!r} is not a percentage from 0% to 100%", param=param)
    return float(m.group(1)) / 100.0


def parse_duration(text: str, *, param: str = "soak") -> float:
    """`10m`, `90s`, `1h30m`, `2d`, or plain seconds → seconds (≥ 0)."""
    raw = text.strip().replace(" ", "")
    try:
        seconds = float(raw)
    except ValueError:
        pieces = _DURATION.findall(raw)
        if not pieces or "".join(n + u for n, u in pieces) != raw:
            raise WaveSpecError(f"{text!r} is not a duration such as 90s, 10m, 1h30m",
                                param=param) from None
        seconds = sum(float(n) * _UNITS[u] for n, u in pieces)
    if not math.isfinite(seconds) or seconds < 0:
        raise WaveSpecError(f"{text!r}: a duration is ≥ 0", param=param)
    return seconds


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s and s % 3600 == 0:
        return f"{s // 3600}h"
    if s >= 60 and s % 60 == 0:
        return f"{s // 60}m"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class Policy:
    steps: tuple[Step, ...]
    abort_above: float = 0.10  # a share of finished devices, 0..1
    min_executed: int = 1
    soak_s: float = 0.0
    device_timeout_s: float = 7200.0
    rollback_on_abort: bool = False

    def __post_init__(self) -> None:
        if not self.steps or self.steps[-1].percent != 100:
            raise WaveSpecError("a policy's last wave is 100%", param="waves")
        if not 0 <= self.abort_above <= 1:
            raise WaveSpecError("abort_above is a share from 0 to 1", param="abort_above")
        if self.min_executed < 1:
            raise WaveSpecError("--min-executed is at least 1", param="min_executed")
        if self.soak_s < 0 or self.device_timeout_s <= 0:
            raise WaveSpecError("--soak is ≥ 0 and --device-timeout > 0", param="soak")


# -- waves --------------------------------------------------------------------------------

def wave_sizes(steps: Sequence[Step], total: int) -> list[int]:
    """Devices per wave for a selection of `total` (waves adding nobody dropped)."""
    sizes, done = [], 0
    for step in steps:
        target = max(done, step.target(total))
        if target > done:
            sizes.append(target - done)
            done = target
    return sizes


def assign_waves(rollout_id: str, devices: Iterable[str], steps: Sequence[Step]
                 ) -> dict[str, int]:
    """Each device's wave (1-based). The order is a hash of (rollout id, device): fixed
    for a rollout (a restart or a status assigns the same), and a different first wave
    for each rollout rather than always the first ids in the alphabet."""
    ordered = sorted(set(devices), key=lambda d: (
        hashlib.sha256(f"{rollout_id}/{d}".encode()).hexdigest(), d))
    out: dict[str, int] = {}
    at = 0
    for wave, size in enumerate(wave_sizes(steps, len(ordered)), start=1):
        for device in ordered[at:at + size]:
            out[device] = wave
        at += size
    return out


# -- devices ------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceView:
    """What the policy needs of one device of a rollout."""

    device: str
    wave: int
    state: str = PENDING
    retrying: bool = False  # FAILED with the box still retrying; REFUSED as busy
    commanded: bool = False  # rollout.start recorded (maybe not yet published)
    started_at: float | None = None  # rollout.start published
    active_at: float | None = None  # ACTIVE seen by the controller
    outcome: str | None = None  # TIMED_OUT or SKIPPED, decided by the controller
    cancel_sent: bool = False
    rollback_sent: bool = False
    updated_at: float | None = None  # the controller's clock at the row's last change


def busy(d: DeviceView) -> bool:
    """Refused rollout.start as busy, and neither timed out nor skipped yet."""
    return d.state == REFUSED and d.retrying and d.outcome is None


def phase(d: DeviceView) -> str:
    """How the device counts now (module docstring)."""
    if d.outcome == TIMED_OUT:
        return FAILED_PHASE
    if d.outcome == SKIPPED or not d.commanded:
        return CANCELLED_PHASE if d.outcome == SKIPPED else WAITING
    if d.state == ACTIVE:
        return SUCCEEDED
    if busy(d):
        return IN_FLIGHT
    if d.state in (ROLLED_BACK, REJECTED, REFUSED) or (d.state == FAILED and not d.retrying):
        return FAILED_PHASE
    if d.state == CANCELLED:
        return CANCELLED_PHASE
    return IN_FLIGHT


def timed_out(d: DeviceView, timeout_s: float, now: float) -> bool:
    """Still running `timeout_s` after its rollout.start was published."""
    return (phase(d) == IN_FLIGHT and d.started_at is not None
            and now - d.started_at > timeout_s)


@dataclass(frozen=True)
class Tally:
    counts: Mapping[str, int]

    @property
    def succeeded(self) -> int:
        return self.counts.get(SUCCEEDED, 0)

    @property
    def failed(self) -> int:
        return self.counts.get(FAILED_PHASE, 0)

    @property
    def finished(self) -> int:
        return self.succeeded + self.failed

    @property
    def failed_share(self) -> float:
        return self.failed / self.finished if self.finished else 0.0

    @property
    def executing(self) -> int:
        """The devices the rollout still counts on: all but the cancelled and skipped."""
        return sum(self.counts.values()) - self.counts.get(CANCELLED_PHASE, 0)


def tally(devices: Iterable[DeviceView]) -> Tally:
    counts = dict.fromkeys(PHASES, 0)
    for d in devices:
        counts[phase(d)] += 1
    return Tally(counts)


def needed_to_judge(t: Tally, policy: Policy) -> int:
    """How many finished devices the abort rule waits for: `min_executed`, capped by the
    devices the rollout has (AWS IoT Jobs' minNumberOfExecutedThings over a smaller fleet
    could otherwise never be reached, and a rollout whose every device failed would end
    COMPLETED)."""
    return max(1, min(policy.min_executed, t.executing))


def abort_reason(t: Tally, policy: Policy) -> str | None:
    """Why the rollout must abort now, or None: more than `abort_above` of the finished
    devices failed, once at least `needed_to_judge` finished."""
    if t.finished < needed_to_judge(t, policy) or t.failed_share <= policy.abort_above:
        return None
    return (f"{t.failed} of {t.finished} finished devices failed ({t.failed_share:.0%}), "
            f"above {policy.abort_above:.0%}")


def soak_left(wave_devices: Iterable[DeviceView], soak_s: float, now: float) -> float:
    """Seconds until every ACTIVE device of the wave has been ACTIVE `soak_s` (0: done)."""
    left = 0.0
    for d in wave_devices:
        if phase(d) == SUCCEEDED and d.active_at is not None:
            left = max(left, d.active_at + soak_s - now)
    return left


# -- the decision ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What the engine must do for one rollout at one tick (`decide`)."""

    state: str
    wave: int
    reason: str | None
    start: tuple[str, ...] = ()  # send rollout.start
    retry: tuple[str, ...] = ()  # send rollout.start again (the box said busy)
    cancel: tuple[str, ...] = ()  # send rollout.cancel
    rollback: tuple[str, ...] = ()  # send rollout.rollback
    timed_out: tuple[str, ...] = ()  # mark TIMED_OUT
    skipped: tuple[str, ...] = ()  # mark SKIPPED (never sent; an unpublished start withdrawn)
    settled: bool = False  # nothing left to do or to wait for
    waiting_for: str | None = None  # why the next wave has not started (status)
    counts: Mapping[str, int] = field(default_factory=dict)


def decide(state: str, wave: int, policy: Policy, devices: Sequence[DeviceView],
           now: float, *, busy_retry_s: float = BUSY_RETRY_S) -> Plan:
    """The next step of a rollout in `state` whose waves up to `wave` have started."""
    late = {d.device for d in devices if timed_out(d, policy.device_timeout_s, now)}
    views = [_with(d, outcome=TIMED_OUT) if d.device in late else d for d in devices]
    t = tally(views)
    last = max((d.wave for d in views), default=0)
    reason: str | None = None
    waiting_for: str | None = None
    if state in LIVE:
        reason = abort_reason(t, policy)
        if reason is not None:
            state = ABORTED
    start: list[str] = []
    retry: list[str] = []
    if state == RUNNING:
        if wave == 0:
            wave = 1
        started = [d for d in views if d.wave <= wave]
        if all(phase(d) not in (WAITING, IN_FLIGHT) for d in started):
            if wave >= last and t.succeeded == 0 and t.failed:
                # Every device that finished failed: whatever abort_above allows, that is
                # no completed rollout.
                state, reason = ABORTED, f"none of {len(views)} devices ACTIVE ({t.failed} failed)"
            elif wave >= last:
                state, reason = COMPLETED, f"{t.succeeded} of {len(views)} devices ACTIVE"
            else:
                left = soak_left([d for d in started if d.wave == wave], policy.soak_s, now)
                if left <= 0:
                    wave += 1
                else:
                    waiting_for = f"wave {wave} soaking, {left:.0f}s left"
        else:
            waiting_for = f"wave {wave} in progress"
        start = [d.device for d in views if d.wave <= wave and phase(d) == WAITING]
        retry = [d.device for d in views if busy(d)
                 and (d.updated_at is None or now - d.updated_at >= busy_retry_s)]
    elif state == PAUSED:
        waiting_for = "paused"
    cancel, rollback, skipped = _stops(state, policy, views)
    # Settled: the engine has nothing to send and no device to wait for. A device still
    # in flight keeps a stopped rollout open: its state may still call for a command.
    after = [_with(d, outcome=SKIPPED) if d.device in skipped else d for d in views]
    in_flight = any(phase(d) == IN_FLIGHT for d in after)
    settled = state not in LIVE and not (start or cancel or rollback or in_flight)
    counts = tally(after).counts
    return Plan(state, wave, reason, tuple(start), tuple(retry), tuple(cancel),
                tuple(rollback), tuple(sorted(late)), tuple(skipped), settled, waiting_for,
                counts)


def _stops(state: str, policy: Policy, views: Sequence[DeviceView]
           ) -> tuple[list[str], list[str], list[str]]:
    """Cancels, rollbacks and skips: for a stopped rollout, and for timed-out devices (so
    a late box never switches; derived from the rows each pass, so a cancel a crash cut
    off is sent at the next)."""
    cancel = [d.device for d in views if d.outcome == TIMED_OUT and d.state in BEFORE_SWITCH
              and not d.cancel_sent]
    rollback: list[str] = []
    skipped: list[str] = []
    if state in (ABORTED, ROLLED_BACK):
        # Never sent, or recorded but never taken by the broker (it was away): withdrawn.
        skipped = [d.device for d in views if phase(d) == WAITING or busy(d) or (
            d.commanded and d.started_at is None and d.state == SENT)]
    if state == ABORTED:
        # Not yet switched: cancelled (a box refuses a cancel from ACTIVATING on; the
        # rollback below, or its gate, decides those).
        cancel += [d.device for d in views if d.commanded and d.state in BEFORE_SWITCH
                   and phase(d) == IN_FLIGHT and not d.cancel_sent
                   and d.device not in skipped]
        if policy.rollback_on_abort:
            rollback = [d.device for d in views if d.commanded and not d.rollback_sent
                        and (d.state == ACTIVE or d.state in SWITCHING)]
    elif state == ROLLED_BACK:
        # Every box that may hold the release: ACTIVE ones switch back, switching ones
        # fail their gate, earlier ones cancel (the box's rollback decides by its state).
        rollback = [d.device for d in views if d.commanded and not d.rollback_sent
                    and phase(d) in (IN_FLIGHT, SUCCEEDED) and d.device not in skipped]
    return cancel, rollback, skipped


def _with(d: DeviceView, *, outcome: str) -> DeviceView:
    return replace(d, outcome=outcome)


def device_counts(devices: Iterable[DeviceView]) -> dict[str, int]:
    """Devices per recorded state (PENDING, SENT, the box's states, REFUSED)."""
    out: dict[str, int] = {}
    for d in devices:
        key = d.outcome.upper() if d.outcome else d.state
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))
