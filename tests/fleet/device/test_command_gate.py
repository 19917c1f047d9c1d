"""The command gate: every refusal with its exact reason and nothing run; stored before
acknowledged; run once however often delivered; state that survives a restart; numbers
past their range (seq 2**64) refused before fleet.db, and a flaw met while one message is
handled answered and acknowledged — on the real broker too, where such a message was never
answered and came back after every reconnect."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.fleet.device.link.command_gate import CommandGate, Delivery, ping
from edge_agent.fleet.device.link.state import FleetState
from edge_agent.fleet.protocol.command import CLOCK_SKEW_S, MAX_COMMAND_BYTES, MAX_SEQ, Command
from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.fleet.protocol.signing import sign
from tests.support.brokers import Mosquitto
from tests.support.commandbox import CommandBox

FLEET, DEVICE = "f1", "store-042"
OWN = f"edge/v1/{FLEET}/{DEVICE}/cmd"
ALL = f"edge/v1/{FLEET}/all/cmd"
KEY = Ed25519PrivateKey.generate()


class Counter:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, command: Command) -> dict[str, Any]:
        self.calls.append(command.id)
        return {"n": len(self.calls)}


@pytest.fixture
def counter() -> Counter:
    return Counter()


@pytest.fixture
def state(tmp_path: Path) -> Iterator[FleetState]:
    s = FleetState(tmp_path / "fleet.db")
    yield s
    s.close()


def gate_for(state: FleetState, counter: Counter, **extra: Any) -> CommandGate:
    handlers = {"ping": ping, "count": counter, **extra}
    return CommandGate(state, fleet=FLEET, device=DEVICE, public_key=KEY.public_key(),
                       handlers=handlers)


@pytest.fixture
def gate(state: FleetState, counter: Counter) -> CommandGate:
    return gate_for(state, counter)


_seq = iter(range(1, 10**6))


def command(key: Ed25519PrivateKey = KEY, **change: Any) -> dict[str, Any]:
    now = time.time()
    obj = {"v": 1, "id": uuid.uuid4().hex, "fleet": FLEET, "device": DEVICE, "type": "count",
           "seq": next(_seq), "issued_at": now, "expires_at": now + 300, "args": {}}
    obj.update(change)
    return sign(obj, key)


def wire(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def assert_refused(delivery: Delivery, reason: str, counter: Counter) -> None:
    assert not delivery.execute
    assert delivery.result is not None
    assert delivery.result.status == "refused"
    assert delivery.result.reason == reason
    assert counter.calls == []  # the handler did not run


def test_an_accepted_command_is_stored_then_run_once(gate: CommandGate, state: FleetState,
                                                     counter: Counter) -> None:
    obj = command()
    delivery = gate.receive(wire(obj), OWN)
    assert delivery.execute and delivery.result is None
    assert delivery.command is not None and delivery.command.id == obj["id"]
    stored = state.command(obj["id"])
    assert stored is not None and stored.status is None  # stored before it runs
    assert stored.payload == wire(obj)
    result = gate.execute(delivery.command)
    assert result.body() == {"id": obj["id"], "type": "count", "status": "ok", "reason": None,
                             "result": {"n": 1}}
    assert gate.execute(delivery.command) == result  # once
    assert counter.calls == [obj["id"]]
    assert state.last_seq(DEVICE) == obj["seq"]


def test_ping(gate: CommandGate) -> None:
    delivery = gate.receive(wire(command(type="ping")), OWN)
    assert delivery.command is not None
    result = gate.execute(delivery.command)
    assert result.status == "ok" and result.result is not None
    assert result.result["pong"] is True and abs(result.result["ts"] - time.time()) < 5


def test_oversized(gate: CommandGate, counter: Counter) -> None:
    obj = command(args={"pad": "x" * MAX_COMMAND_BYTES})
    assert_refused(gate.receive(wire(obj), OWN), "oversized", counter)


@pytest.mark.parametrize("payload", [
    b"not json", b"[]", b"\xff", b'{"v":1}', b'{"id":"a","id":"b"}',
])
def test_malformed_payloads(gate: CommandGate, counter: Counter, payload: bytes) -> None:
    assert_refused(gate.receive(payload, OWN), "malformed", counter)


@pytest.mark.parametrize("change", [
    {"v": 2}, {"id": "a/b"}, {"id": 5}, {"seq": 0}, {"seq": "3"}, {"seq": True},
    {"issued_at": "now"}, {"expires_at": None}, {"args": []}, {"type": "Ping!"},
    {"extra": 1}, {"expires_at": 1.0, "issued_at": 2.0},
])
def test_malformed_fields(gate: CommandGate, counter: Counter, change: dict[str, Any]) -> None:
    obj = command(**change)
    delivery = gate.receive(wire(obj), OWN)
    assert_refused(delivery, "malformed", counter)
    assert delivery.result is not None and delivery.result.result is not None
    assert delivery.result.result["message"]


@pytest.mark.parametrize("sig", [None, 5, "", "AAAA"])
def test_an_unsigned_command_is_a_bad_signature(gate: CommandGate, counter: Counter,
                                                sig: Any) -> None:
    obj = command()
    del obj["sig"]
    if sig is not None:
        obj["sig"] = sig
    assert_refused(gate.receive(wire(obj), OWN), "bad_signature", counter)


@pytest.mark.parametrize(("change", "topic"), [
    ({"device": "store-043"}, OWN), ({"fleet": "f2"}, OWN),
    ({}, f"edge/v1/{FLEET}/store-043/cmd"), ({}, ALL), ({"device": "all"}, OWN),
    ({}, f"edge/v1/f2/{DEVICE}/cmd"), ({}, f"edge/v1/{FLEET}/{DEVICE}/ack"),
    ({}, "elsewhere/cmd"),
])
def test_wrong_device(gate: CommandGate, counter: Counter, change: dict[str, Any],
                      topic: str) -> None:
    assert_refused(gate.receive(wire(command(**change)), topic), "wrong_device", counter)


def test_bad_signature(gate: CommandGate, state: FleetState, counter: Counter) -> None:
    tampered = command()
    tampered["type"] = "ping"
    assert_refused(gate.receive(wire(tampered), OWN), "bad_signature", counter)
    other = command(key=Ed25519PrivateKey.generate())
    assert_refused(gate.receive(wire(other), OWN), "bad_signature", counter)
    garbage = {**command(), "sig": "AAAA"}
    delivery = gate.receive(wire(garbage), OWN)
    assert_refused(delivery, "bad_signature", counter)
    assert delivery.result is not None and delivery.result.id == garbage["id"]
    # Unauthenticated refusals are not stored: the real command with that id still runs.
    assert state.command(garbage["id"]) is None
    real = {k: v for k, v in garbage.items() if k != "sig"}
    delivery = gate.receive(wire(sign(real, KEY)), OWN)
    assert delivery.execute and delivery.command is not None
    gate.execute(delivery.command)
    assert counter.calls == [garbage["id"]]


def test_no_command_key_refuses_every_command(state: FleetState, counter: Counter) -> None:
    gate = CommandGate(state, fleet=FLEET, device=DEVICE, public_key=None,
                       handlers={"count": counter})
    assert_refused(gate.receive(wire(command()), OWN), "bad_signature", counter)


def test_expired(gate: CommandGate, state: FleetState, counter: Counter) -> None:
    now = time.time()
    obj = command(issued_at=now - 600, expires_at=now - CLOCK_SKEW_S - 1)
    delivery = gate.receive(wire(obj), OWN)
    assert_refused(delivery, "expired", counter)
    stored = state.command(obj["id"])  # authentic: stored with its refusal
    assert stored is not None and (stored.status, stored.reason) == ("refused", "expired")
    # Within the clock-skew allowance: taken.
    recent = command(issued_at=now - 600, expires_at=now - CLOCK_SKEW_S + 5)
    assert gate.receive(wire(recent), OWN).execute


def test_unknown_type(gate: CommandGate, counter: Counter) -> None:
    assert_refused(gate.receive(wire(command(type="rebirth")), OWN), "unknown_type", counter)


def test_replayed_seq(gate: CommandGate, state: FleetState, counter: Counter) -> None:
    first = command(seq=1000)
    delivery = gate.receive(wire(first), OWN)
    assert delivery.command is not None
    gate.execute(delivery.command)
    counter.calls.clear()
    for seq in (1000, 999, 1):
        assert_refused(gate.receive(wire(command(seq=seq)), OWN), "replay", counter)
    assert state.last_seq(DEVICE) == 1000
    assert gate.receive(wire(command(seq=1001)), OWN).execute


def test_a_duplicate_delivery_runs_once(gate: CommandGate, counter: Counter) -> None:
    payload = wire(command())
    first = gate.receive(payload, OWN)
    assert first.execute
    # Redelivered before it ran (no PUBACK reached the broker yet): not handed out again.
    again = gate.receive(payload, OWN)
    assert not again.execute and again.result is None
    assert first.command is not None
    result = gate.execute(first.command)
    # Redelivered after: its stored result is re-published, nothing runs.
    third = gate.receive(payload, OWN)
    assert not third.execute and third.result == result
    assert len(counter.calls) == 1


def test_a_duplicate_of_a_refused_command_returns_the_refusal(gate: CommandGate,
                                                              counter: Counter) -> None:
    payload = wire(command(type="rebirth"))
    first = gate.receive(payload, OWN)
    second = gate.receive(payload, OWN)
    assert first.result == second.result
    assert second.result is not None and second.result.reason == "unknown_type"


def test_a_fleet_wide_command_is_accepted_once(gate: CommandGate, state: FleetState,
                                               counter: Counter) -> None:
    gate.receive(wire(command(seq=50)), OWN)  # the device's own stream is ahead
    obj = command(device="all", seq=1)
    delivery = gate.receive(wire(obj), ALL)
    assert delivery.execute and delivery.command is not None
    assert delivery.command.stream == "all"
    gate.execute(delivery.command)
    assert not gate.receive(wire(obj), ALL).execute
    assert counter.calls == [obj["id"]]
    assert (state.last_seq("all"), state.last_seq(DEVICE)) == (1, 50)
    counter.calls.clear()
    assert_refused(gate.receive(wire(command(device="all", seq=1)), ALL), "replay", counter)


def test_a_handler_that_raises_is_failed_and_the_caller_lives(state: FleetState,
                                                              counter: Counter) -> None:
    def boom(command: Command) -> None:
        raise RuntimeError("disk on fire")

    gate = gate_for(state, counter, boom=boom)
    delivery = gate.receive(wire(command(type="boom")), OWN)
    assert delivery.command is not None
    result = gate.execute(delivery.command)
    assert (result.status, result.reason, result.result) == ("failed", "RuntimeError", None)
    stored = state.command(delivery.command.id)
    assert stored is not None and stored.status == "failed"


def test_a_handler_may_refuse_and_must_return_json(state: FleetState, counter: Counter) -> None:
    def picky(command: Command) -> None:
        raise CommandRefused("malformed", "args.x is missing")

    def odd(command: Command) -> dict[str, Any]:
        return {"when": object()}

    gate = gate_for(state, counter, picky=picky, odd=odd)
    delivery = gate.receive(wire(command(type="picky")), OWN)
    assert delivery.command is not None
    result = gate.execute(delivery.command)
    assert (result.status, result.reason) == ("refused", "malformed")
    assert result.result == {"message": "args.x is missing"}
    delivery = gate.receive(wire(command(type="odd")), OWN)
    assert delivery.command is not None
    assert gate.execute(delivery.command).status == "failed"


def test_refusal_reasons_are_exactly_the_protocols() -> None:
    from edge_agent.fleet.protocol.refusals import REASONS
    assert REASONS == {"bad_signature", "expired", "replay", "unknown_type", "oversized",
                       "wrong_device", "malformed"}
    with pytest.raises(ValueError):
        CommandRefused("nope")


def test_state_survives_reopen(tmp_path: Path, counter: Counter) -> None:
    path = tmp_path / "fleet.db"
    state = FleetState(path)
    gate = gate_for(state, counter)
    done, pending = command(seq=10), command(seq=11)
    delivery = gate.receive(wire(done), OWN)
    assert delivery.command is not None
    gate.execute(delivery.command)
    assert gate.receive(wire(pending), OWN).execute  # stored; the process stops before it ran
    state.close()

    state = FleetState(path)
    gate = gate_for(state, counter)
    redelivered = gate.receive(wire(done), OWN)
    assert not redelivered.execute and redelivered.result is not None
    assert redelivered.result.result == {"n": 1}
    assert_refused(gate.receive(wire(command(seq=11)), OWN), "replay", Counter())
    resumed = gate.resume()
    assert [c.id for c in resumed] == [pending["id"]]
    assert not gate.receive(wire(pending), OWN).execute  # handed out by resume already
    gate.execute(resumed[0])
    gate.execute(resumed[0])
    assert counter.calls == [done["id"], pending["id"]]
    assert gate.resume() == []
    state.close()


def test_bdseq_persists_and_increments_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    state = FleetState(path)
    assert state.bdseq() == 0
    assert (state.next_bdseq(), state.next_bdseq()) == (1, 2)
    state.close()
    state = FleetState(path)
    assert state.bdseq() == 2
    assert state.next_bdseq() == 3
    state.close()


def test_prune_forgets_only_finished_old_commands(gate: CommandGate, state: FleetState) -> None:
    finished, waiting = command(), command()
    delivery = gate.receive(wire(finished), OWN)
    assert delivery.command is not None
    gate.execute(delivery.command)
    gate.receive(wire(waiting), OWN)
    assert state.prune(time.time() + 1) == 1
    assert state.command(finished["id"]) is None
    assert state.command(waiting["id"]) is not None


# -- numbers past their range, and a flaw met while one message is handled ------------------

@pytest.mark.parametrize("change", [
    {"seq": MAX_SEQ + 1}, {"seq": 2**64}, {"seq": 10**400}, {"issued_at": 10**400},
    {"expires_at": 10**400}, {"issued_at": -(10**400)},
])
def test_a_number_past_its_range_is_malformed_before_fleet_db(
        gate: CommandGate, state: FleetState, counter: Counter, change: dict[str, Any]) -> None:
    obj = command(**change)  # validly signed: only its numbers are wrong
    delivery = gate.receive(wire(obj), OWN)
    assert_refused(delivery, "malformed", counter)
    assert delivery.result is not None and delivery.result.result is not None
    field = next(iter(change))
    assert field in delivery.result.result["message"]
    if field == "seq":
        assert str(MAX_SEQ) in delivery.result.result["message"]
    assert state.command(obj["id"]) is None and state.last_seq(DEVICE) == 0
    # The box goes on: the next command of the stream runs.
    follow = gate.receive(wire(command(seq=7)), OWN)
    assert follow.execute and follow.command is not None
    assert gate.execute(follow.command).status == "ok"


def test_the_largest_seq_is_taken(gate: CommandGate, state: FleetState,
                                  counter: Counter) -> None:
    obj = command(seq=MAX_SEQ)
    delivery = gate.receive(wire(obj), OWN)
    assert delivery.execute and delivery.command is not None
    assert gate.execute(delivery.command).status == "ok"
    assert state.last_seq(DEVICE) == MAX_SEQ
    counter.calls.clear()
    assert_refused(gate.receive(wire(command(seq=MAX_SEQ)), OWN), "replay", counter)


class FlawedState(FleetState):
    """fleet.db whose next `accept` raises `error`, as a flaw (or a full disk) would."""

    error: BaseException | None = None

    def accept(self, *args: Any, **kwargs: Any) -> bool:
        error, self.error = self.error, None
        if error is not None:
            raise error
        return super().accept(*args, **kwargs)


def test_an_unexpected_error_is_answered_failed_and_the_gate_goes_on(
        tmp_path: Path, counter: Counter, caplog: pytest.LogCaptureFixture) -> None:
    state = FlawedState(tmp_path / "fleet.db")
    gate = gate_for(state, counter)
    state.error = OverflowError("Python int too large to convert to SQLite INTEGER")
    obj = command()
    with caplog.at_level("ERROR", logger="edge_agent.fleet.device.link.command_gate"):
        delivery = gate.receive(wire(obj), OWN)  # does not raise: the PUBACK goes
    assert not delivery.execute and delivery.result is not None
    assert delivery.result.body() == {"id": obj["id"], "type": "count", "status": "failed",
                                      "reason": "OverflowError", "result": None}
    assert obj["id"] in caplog.text and "OverflowError" in caplog.text
    follow = gate.receive(wire(command()), OWN)
    assert follow.execute and follow.command is not None
    assert gate.execute(follow.command).status == "ok"
    state.close()


@pytest.mark.parametrize("error", [
    sqlite3.OperationalError("database or disk is full"), OSError(28, "No space left"),
    sqlite3.DatabaseError("database disk image is malformed"),
])
def test_fleet_db_that_cannot_be_written_still_withholds_the_puback(
        tmp_path: Path, counter: Counter, error: Exception) -> None:
    state = FlawedState(tmp_path / "fleet.db")
    gate = gate_for(state, counter)
    state.error = error
    payload = wire(command())
    with pytest.raises(type(error)):
        gate.receive(payload, OWN)
    assert gate.receive(payload, OWN).execute  # delivered again once the disk takes it
    state.close()


@pytest.mark.broker
def test_a_seq_past_sqlite_on_the_real_broker_is_refused_and_acknowledged(
        tmp_path: Path, mosquitto_factory: Callable[..., Mosquitto], counter: Counter) -> None:
    """A validly signed command with seq 2**64 is answered (refused, `malformed`), its
    message acknowledged: the next command runs, and after a reconnect the broker delivers
    nothing again."""
    box_id = "store-big"
    broker = mosquitto_factory(devices=(box_id,)).start()
    box = CommandBox(broker, tmp_path, box_id, {"ping": ping, "count": counter})
    try:
        huge = [box.command("count", seq=2**64), box.command("count", seq=10**30),
                box.command("count", issued_at=10**400)]
        for obj in huge:
            box.send(obj)
        for obj in huge:
            got = box.result(obj)
            assert (got["status"], got["reason"]) == ("refused", "malformed"), got
            assert "bad field(s)" in got["result"]["message"]
        assert str(MAX_SEQ) in box.result(huge[0])["result"]["message"]
        follow = box.command("count", seq=3)
        box.send(follow)
        got = box.result(follow)
        assert got["status"] == "ok" and counter.calls == [follow["id"]]
        # Every message was acknowledged: a new session on the same state is sent nothing.
        seen = box.link.counts.get("commands", 0)
        assert seen == len(huge) + 1, box.link.counts
        link = box.restart()
        time.sleep(1.5)
        assert link.counts.get("commands", 0) == 0, link.counts
        assert link.counts.get("errors", 0) == 0, link.counts
    finally:
        box.close()
