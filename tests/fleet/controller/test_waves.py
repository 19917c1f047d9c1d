"""The controller's wave policy (`fleet.controller.waves`): parsing, the waves' sizes and
assignment, how a device counts, the abort math with its minimum, the soak, timeouts and
what each decision sends. Pure: no broker, no store."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from edge_agent.fleet.controller.waves import (
    ABORTED,
    COMPLETED,
    PAUSED,
    PENDING,
    REFUSED,
    RUNNING,
    SENT,
    SKIPPED,
    TIMED_OUT,
    DeviceView,
    Policy,
    Step,
    WaveSpecError,
    abort_reason,
    assign_waves,
    decide,
    format_duration,
    format_waves,
    needed_to_judge,
    parse_duration,
    parse_share,
    parse_waves,
    phase,
    tally,
    wave_sizes,
)
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVATING,
    ACTIVE,
    CANCELLED,
    DOWNLOADING,
    FAILED,
    GATING,
    REJECTED,
    ROLLED_BACK,
    STAGED,
)

STEPS = parse_waves("1,10%,50%,100%")


def test_waves_parse_to_cumulative_steps_and_back() -> None:
    assert STEPS == (Step(count=1), Step(percent=10), Step(percent=50), Step(percent=100))
    assert format_waves(STEPS) == "1,10%,50%,100%"
    assert parse_waves(" 5 , 100% ") == (Step(count=5), Step(percent=100))
    assert parse_waves("12.5%,100%")[0] == Step(percent=12.5)


@pytest.mark.parametrize("spec", ["", "1,,100%", "0,100%", "1.5,100%", "10%,5%,100%",
                                  "5,3,100%", "1,50%", "150%", "ten%,100%", "-1,100%",
                                  ",".join(["1%"] * 40)])
def test_bad_waves_are_refused(spec: str) -> None:
    with pytest.raises(WaveSpecError):
        parse_waves(spec)


def test_wave_sizes_round_percentages_up_and_drop_empty_waves() -> None:
    assert wave_sizes(STEPS, 100) == [1, 9, 40, 50]
    assert wave_sizes(STEPS, 120) == [1, 11, 48, 60]
    assert wave_sizes(STEPS, 30) == [1, 2, 12, 15]  # 10% of 30 is 3, not 4
    assert wave_sizes(STEPS, 5) == [1, 2, 2]  # 10% of 5 rounds up to 1: no new device
    assert wave_sizes(STEPS, 1) == [1]
    assert wave_sizes(STEPS, 2) == [1, 1]
    assert wave_sizes(parse_waves("10,100%"), 4) == [4]  # a count past the selection
    assert wave_sizes(STEPS, 0) == []


def test_assignment_is_fixed_per_rollout_and_differs_between_rollouts() -> None:
    devices = [f"store-{i:03d}" for i in range(100)]
    one = assign_waves("r1", devices, STEPS)
    assert one == assign_waves("r1", list(reversed(devices)), STEPS)
    assert Counter(one.values()) == {1: 1, 2: 9, 3: 40, 4: 50}
    assert set(one) == set(devices)
    firsts = {next(d for d, w in assign_waves(f"r{n}", devices, STEPS).items() if w == 1)
              for n in range(20)}
    assert len(firsts) > 10  # not always the same canary


def test_shares_and_durations() -> None:
    assert parse_share("10%") == pytest.approx(0.10)
    assert parse_share("0%") == 0.0
    assert parse_share("12.5%") == pytest.approx(0.125)
    for bad in ("10", "101%", "-5%", "x%"):
        with pytest.raises(WaveSpecError):
            parse_share(bad)
    assert parse_duration("10m") == 600
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90
    assert parse_duration("2d") == 172800
    assert parse_duration("1.5") == 1.5
    assert parse_duration("0") == 0
    for bad in ("10x", "m", "1h-5m", "-3", "nan", "inf"):
        with pytest.raises(WaveSpecError):
            parse_duration(bad)
    assert [format_duration(s) for s in (600, 3600, 90, 0.5, 7200)] == [
        "10m", "1h", "90s", "0.5s", "2h"]


def test_a_policy_checks_itself() -> None:
    with pytest.raises(WaveSpecError):
        Policy(parse_waves("1,100%"), min_executed=0)
    with pytest.raises(WaveSpecError):
        Policy((Step(count=1),))
    with pytest.raises(WaveSpecError):
        Policy(STEPS, abort_above=1.5)
    with pytest.raises(WaveSpecError):
        Policy(STEPS, device_timeout_s=0)


def dev(name: str, wave: int = 1, state: str = PENDING, **kw: object) -> DeviceView:
    commanded = state != PENDING
    fields: dict[str, object] = {"commanded": commanded,
                                 "started_at": 0.0 if commanded else None}
    fields.update(kw)
    return DeviceView(name, wave, state, **fields)  # type: ignore[arg-type]


def test_how_a_device_counts() -> None:
    assert phase(dev("a")) == "waiting"
    assert phase(dev("a", state=SENT)) == "running"
    for state in (DOWNLOADING, STAGED, ACTIVATING, GATING):
        assert phase(dev("a", state=state)) == "running"
    assert phase(dev("a", state=FAILED, retrying=True)) == "running"
    assert phase(dev("a", state=ACTIVE)) == "succeeded"
    for state in (ROLLED_BACK, REJECTED, REFUSED, FAILED):
        assert phase(dev("a", state=state)) == "failed"
    assert phase(dev("a", state=CANCELLED)) == "cancelled"
    assert phase(dev("a", state=ACTIVE, outcome=TIMED_OUT)) == "failed"  # counted once late
    assert phase(dev("a", outcome=SKIPPED)) == "cancelled"


def test_abort_needs_the_minimum_then_a_share_strictly_above() -> None:
    policy = Policy(STEPS, abort_above=0.10, min_executed=3)
    two_failed = tally([dev("a", state=ROLLED_BACK), dev("b", state=REJECTED), dev("c")])
    assert abort_reason(two_failed, policy) is None  # 2 finished < 3
    one_in_ten = tally([dev("f", state=ROLLED_BACK)]
                       + [dev(f"s{i}", state=ACTIVE) for i in range(9)])
    assert one_in_ten.failed_share == pytest.approx(0.10)
    assert abort_reason(one_in_ten, policy) is None  # 10% is not above 10%
    two_in_eleven = tally([dev("f", state=ROLLED_BACK), dev("g", state=FAILED)]
                          + [dev(f"s{i}", state=ACTIVE) for i in range(9)])
    reason = abort_reason(two_in_eleven, policy)
    assert reason is not None and "2 of 11" in reason
    # Running devices and retries are not finished: they do not dilute the share.
    running = tally([dev("f", state=ROLLED_BACK), dev("g", state=ACTIVE),
                     dev("h", state=ACTIVE), dev("r", state=FAILED, retrying=True),
                     dev("x", state=DOWNLOADING)])
    assert running.finished == 3 and abort_reason(running, policy) is not None
    assert abort_reason(tally([dev("f", state=ROLLED_BACK)]),
                        Policy(STEPS, abort_above=0.0, min_executed=1)) is not None
    assert abort_reason(tally([dev("f", state=ROLLED_BACK)]),
                        Policy(STEPS, abort_above=1.0, min_executed=1)) is None


def fleet(states: dict[int, list[str]]) -> list[DeviceView]:
    """Devices per wave with the given states (`w<wave>-<n>`)."""
    return [dev(f"w{wave}-{n}", wave, state) for wave, group in states.items()
            for n, state in enumerate(group)]


def test_the_first_tick_starts_wave_one_only() -> None:
    views = fleet({1: [PENDING], 2: [PENDING] * 3, 3: [PENDING] * 6})
    plan = decide(RUNNING, 0, Policy(STEPS), views, now=100.0)
    assert (plan.state, plan.wave, plan.start) == (RUNNING, 1, ("w1-0",))
    assert not plan.settled


def test_the_next_wave_waits_for_every_device_and_the_soak() -> None:
    policy = Policy(STEPS, abort_above=0.5, min_executed=3, soak_s=60)
    views = fleet({1: [ACTIVE, DOWNLOADING], 2: [PENDING] * 3})
    views = [replace(v, active_at=100.0) for v in views]
    plan = decide(RUNNING, 1, policy, views, now=200.0)
    assert (plan.wave, plan.start, plan.waiting_for) == (1, (), "wave 1 in progress")
    views[1] = replace(views[1], state=ACTIVE, active_at=150.0)
    plan = decide(RUNNING, 1, policy, views, now=200.0)
    assert (plan.wave, plan.start) == (1, ())
    assert plan.waiting_for == "wave 1 soaking, 10s left"
    plan = decide(RUNNING, 1, policy, views, now=210.0)
    assert (plan.wave, plan.start) == (2, ("w2-0", "w2-1", "w2-2"))


def test_a_failure_within_the_threshold_does_not_hold_the_next_wave() -> None:
    policy = Policy(STEPS, abort_above=0.5, min_executed=3)
    views = fleet({1: [ACTIVE, ROLLED_BACK, ACTIVE], 2: [PENDING] * 2})
    plan = decide(RUNNING, 1, policy, views, now=10.0)
    assert (plan.state, plan.wave, len(plan.start)) == (RUNNING, 2, 2)
    # Below the minimum, even a failed first wave goes on (AWS IoT Jobs' semantics).
    views = fleet({1: [ROLLED_BACK], 2: [PENDING] * 2})
    plan = decide(RUNNING, 1, policy, views, now=10.0)
    assert (plan.state, plan.wave) == (RUNNING, 2)


def test_crossing_the_threshold_aborts_inside_the_wave() -> None:
    policy = Policy(STEPS, abort_above=0.10, min_executed=3)
    views = fleet({1: [ACTIVE], 2: [ACTIVE, ROLLED_BACK, REJECTED, STAGED, DOWNLOADING, SENT,
                                    ACTIVATING, ACTIVE],
                   3: [PENDING] * 5})
    plan = decide(RUNNING, 2, policy, views, now=10.0)
    assert plan.state == ABORTED and plan.start == ()
    assert plan.reason is not None and "2 of 5" in plan.reason
    # Not yet switched: cancelled; switching: left to its gate; later waves: skipped.
    assert set(plan.cancel) == {"w2-3", "w2-4", "w2-5"}
    assert plan.rollback == ()
    assert set(plan.skipped) == {f"w3-{n}" for n in range(5)}
    assert not plan.settled  # w2-6 is still switching
    with_rollback = decide(RUNNING, 2, replace(policy, rollback_on_abort=True), views, 10.0)
    assert set(with_rollback.rollback) == {"w1-0", "w2-0", "w2-6", "w2-7"}


def test_a_start_the_broker_never_took_is_withdrawn_on_abort_not_cancelled() -> None:
    views = [dev("a", 1, SENT, started_at=None), dev("b", 1, SENT), dev("c", 2)]
    for stopped in (ABORTED, ROLLED_BACK):
        plan = decide(stopped, 1, Policy(STEPS), views, now=10.0)
        assert set(plan.skipped) == {"a", "c"}
        assert plan.cancel + plan.rollback == ("b",)


def test_an_aborted_rollout_settles_once_nothing_is_in_flight() -> None:
    policy = Policy(STEPS, rollback_on_abort=True)
    views = [dev("a", 1, ROLLED_BACK), dev("b", 1, ACTIVE, rollback_sent=True),
             dev("c", 1, CANCELLED, cancel_sent=True), dev("d", 2, outcome=SKIPPED)]
    plan = decide(ABORTED, 1, policy, views, now=10.0)
    assert (plan.start, plan.cancel, plan.rollback, plan.skipped) == ((), (), (), ())
    assert plan.settled
    # A device that went ACTIVE after the abort (its cancel came too late) is rolled back.
    views[1] = replace(views[1], rollback_sent=False)
    assert decide(ABORTED, 1, policy, views, now=10.0).rollback == ("b",)


def test_a_device_times_out_once_counted_failed_and_cancelled() -> None:
    policy = Policy(STEPS, abort_above=0.5, min_executed=3, device_timeout_s=60)
    views = fleet({1: [ACTIVE, ACTIVE, SENT], 2: [PENDING]})
    views[2] = replace(views[2], started_at=100.0)
    plan = decide(RUNNING, 1, policy, views, now=150.0)
    assert (plan.timed_out, plan.wave) == ((), 1)
    plan = decide(RUNNING, 1, policy, views, now=161.0)
    assert plan.timed_out == ("w1-2",) and plan.cancel == ("w1-2",)
    assert (plan.state, plan.wave, plan.start) == (RUNNING, 2, ("w2-0",))  # 1 of 3: go on
    # An unpublished command (the broker away) does not time out.
    views[2] = replace(views[2], started_at=None)
    assert decide(RUNNING, 1, policy, views, now=10_000.0).timed_out == ()
    # Marked, it stays failed whatever the box says later, and is not cancelled twice.
    views[2] = replace(views[2], started_at=100.0, outcome=TIMED_OUT, state=ACTIVE,
                       cancel_sent=True)
    plan = decide(RUNNING, 1, policy, views, now=200.0)
    assert plan.timed_out == () and plan.cancel == () and plan.counts["failed"] == 1
    # Marked but its cancel never recorded (a crash in between): cancelled at the next pass.
    views[2] = replace(views[2], state=STAGED, cancel_sent=False)
    assert decide(RUNNING, 1, policy, views, now=200.0).cancel == ("w1-2",)


def test_timeouts_can_abort() -> None:
    policy = Policy(STEPS, abort_above=0.10, min_executed=3, device_timeout_s=60)
    views = [dev(f"d{i}", 1, SENT, started_at=0.0) for i in range(3)]
    plan = decide(RUNNING, 1, policy, views, now=61.0)
    assert plan.state == ABORTED and len(plan.timed_out) == 3


def test_a_busy_box_is_asked_again_until_its_device_timeout_and_never_counts_failed() -> None:
    """A box that refused rollout.start as busy (another change of the name under way
    there) is running, not failed: asked again every busy_retry_s while the rollout runs,
    failed only once its device timeout (from the first start) passes."""
    policy = Policy(STEPS, abort_above=0.0, min_executed=1, device_timeout_s=100)
    views = [dev("a", 1, ACTIVE), dev("b", 1, REFUSED, retrying=True, started_at=0.0,
                                       updated_at=50.0)]
    assert phase(views[1]) == "running"
    plan = decide(RUNNING, 1, policy, views, now=60.0, busy_retry_s=30)
    assert (plan.state, plan.retry, plan.waiting_for) == (RUNNING, (), "wave 1 in progress")
    assert plan.counts["failed"] == 0
    plan = decide(RUNNING, 1, policy, views, now=80.0, busy_retry_s=30)
    assert (plan.state, plan.retry, plan.start, plan.cancel) == (RUNNING, ("b",), (), ())
    # Paused: not asked; its clock runs on.
    assert decide(PAUSED, 1, policy, views, now=80.0, busy_retry_s=30).retry == ()
    # Past the device timeout: failed (here that aborts), nothing to cancel on the box.
    plan = decide(RUNNING, 1, policy, views, now=101.0, busy_retry_s=30)
    assert (plan.state, plan.timed_out, plan.retry, plan.cancel) == (ABORTED, ("b",), (), ())
    # A rollout that stops first skips it, and settles.
    for stopped in (ABORTED, ROLLED_BACK):
        plan = decide(stopped, 1, policy, [views[1]], now=60.0)
        assert (plan.skipped, plan.cancel, plan.rollback, plan.settled) == (("b",), (), (),
                                                                           True)
    # Refused for another reason (expired, a bad signature): failed at once.
    assert phase(dev("c", 1, REFUSED, started_at=0.0)) == "failed"


def test_the_last_wave_finished_completes_without_soaking() -> None:
    policy = Policy(STEPS, abort_above=0.5, soak_s=3600)
    views = fleet({1: [ACTIVE], 2: [ACTIVE, ROLLED_BACK]})
    views = [replace(v, active_at=100.0) for v in views]
    plan = decide(RUNNING, 2, policy, views, now=101.0)
    assert plan.state == COMPLETED and plan.settled
    assert plan.reason == "2 of 3 devices ACTIVE"


def test_pause_holds_the_next_wave_but_not_the_abort() -> None:
    policy = Policy(STEPS, abort_above=0.10, min_executed=3)
    views = fleet({1: [ACTIVE, ACTIVE], 2: [PENDING] * 3})
    plan = decide(PAUSED, 1, policy, views, now=10.0)
    assert (plan.state, plan.wave, plan.start, plan.waiting_for) == (PAUSED, 1, (), "paused")
    assert not plan.settled
    views = fleet({1: [ACTIVE, ROLLED_BACK, REJECTED], 2: [PENDING] * 3})
    assert decide(PAUSED, 1, policy, views, now=10.0).state == ABORTED


def test_an_operator_rollback_reaches_every_device_that_may_hold_the_release() -> None:
    views = fleet({1: [ACTIVE, ROLLED_BACK, GATING, STAGED], 2: [PENDING]})
    plan = decide(ROLLED_BACK, 1, Policy(STEPS), views, now=10.0)
    assert set(plan.rollback) == {"w1-0", "w1-2", "w1-3"}
    assert plan.skipped == ("w2-0",) and plan.start == ()


def test_a_hundred_devices_with_a_fifth_failing_abort_in_the_third_wave() -> None:
    """The engine test's scenario, decided tick by tick with devices that answer at once:
    failures placed in waves 3 and 4 cross 10% inside wave 3; wave 4 never starts."""
    policy = Policy(STEPS, abort_above=0.10, min_executed=3)
    devices = [f"sim-{i:03d}" for i in range(100)]
    waves = assign_waves("r-abort", devices, STEPS)
    failing = {d for w in (3, 4) for d in sorted(d for d in devices if waves[d] == w)[:10]}
    views = {d: dev(d, waves[d]) for d in devices}
    state, wave, started = RUNNING, 0, set()
    for tick in range(20):
        plan = decide(state, wave, policy, list(views.values()), now=float(tick))
        state, wave = plan.state, plan.wave
        for d in plan.start:
            started.add(d)
            views[d] = replace(views[d], state=ROLLED_BACK if d in failing else ACTIVE,
                               commanded=True, started_at=float(tick))
        if state != RUNNING:
            break
    assert state == ABORTED and wave == 3
    assert {waves[d] for d in started} == {1, 2, 3}


def test_min_executed_is_capped_by_the_devices_and_none_active_is_no_completion() -> None:
    """One device, --min-executed 3 (the default): its failure aborts the rollout (it
    could never reach 3). With abort_above 100% (never abort on the share), a last wave
    in which nobody ended ACTIVE is ABORTED, not COMPLETED."""
    policy = Policy(STEPS, abort_above=0.10, min_executed=3)
    one = [dev("a", 1, ROLLED_BACK)]
    assert needed_to_judge(tally(one), policy) == 1
    plan = decide(RUNNING, 1, policy, one, now=10.0)
    assert plan.state == ABORTED and plan.reason is not None and "1 of 1" in plan.reason
    lenient = Policy(STEPS, abort_above=1.0, min_executed=3)
    both = fleet({1: [ROLLED_BACK], 2: [FAILED]})
    plan = decide(RUNNING, 2, lenient, both, now=10.0)
    assert (plan.state, plan.reason) == (ABORTED, "none of 2 devices ACTIVE (2 failed)")
    assert needed_to_judge(tally(fleet({1: [ACTIVE], 2: [PENDING] * 9})), policy) == 3
