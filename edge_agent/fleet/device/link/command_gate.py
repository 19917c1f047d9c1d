"""The command gate on the box: the checks every signed command passes before it may run,
and the one place that runs them. The command's wire form is `protocol.command`.

    {"v":1,"id":"<uuid4 hex>","fleet":"f1","device":"store-042"|"all","type":"ping",
     "seq":12,"issued_at":...,"expires_at":...,"args":{...},"sig":"<base64 ed25519>"}

`CommandGate.receive(payload, topic)` checks, in this order, and refuses with the first
reason that applies (`CommandRefused.reason`):

1. size <= 64 KiB (`oversized`), before anything is parsed;
2. strict JSON with exactly the fields above, each of its type and within its range
   (`malformed`): `seq` 1 … 2**63-1 (`MAX_SEQ`: fleet.db keeps it as an SQLite INTEGER,
   signed 64-bit, and a seq beyond would fail the store at every redelivery), the times
   finite numbers — so nothing out of range ever reaches fleet.db; but a missing or
   non-text `sig` is left to step 4;
3. fleet is this box's, device is this box's or `all`, and the topic it came on is that
   same device's (or `all`'s) `cmd` topic (`wrong_device`);
4. the controller's signature (`bad_signature`);
5. a command id already stored: a redelivery — its stored outcome is re-published and it
   is not run again. This comes before expiry and seq on purpose: a redelivered command
   has a seq no longer above the last, and may be past its expiry by now;
6. not past `expires_at` + CLOCK_SKEW_S (`expired`);
7. a registered handler for its type (`unknown_type`);
8. seq above the last accepted in its stream — this device's own, or `all` (`replay`).

An accepted command is committed to fleet.db BEFORE `receive` returns; only then may the
link send the PUBACK (paho `manual_ack=True`). Every outcome of `receive` means "send the
PUBACK now"; `receive` raises only when fleet.db cannot be written (an OSError, sqlite3's
operational errors, a damaged file), and then the PUBACK must not be sent: the broker
delivers the command again once the disk takes it. Any other exception while one message
is handled is a flaw that the same message would meet at every delivery (a poison message,
redelivered after every reconnect and never answered): it is logged and answered `failed`
with the exception's type, not stored, and the PUBACK is sent. Refusals from step 6 on are
stored under the command's id (it is authentic); earlier ones are not — an unauthenticated
message must not be able to occupy the id of a real command to come.

`execute(command)` runs an accepted command's handler once and records its outcome once
(ok / refused / failed). A handler raises CommandRefused to refuse (e.g. `malformed`
args); any other exception is recorded as `failed` with the exception's type and never
reaches the caller. This module never publishes: the link turns `Result.body()` into a
`cmd/result` outbox row.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel

from edge_agent.fleet.device.link.state import FAILED, OK, REFUSED, FleetState, StoredCommand
from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.command import (
    CLOCK_SKEW_S,
    Command,
    Result,
    best_effort_names,
    command_of,
    parse,
)
from edge_agent.fleet.protocol.command_types import BadArgs, typed_args
from edge_agent.fleet.protocol.refusals import (
    EXPIRED,
    MALFORMED,
    REPLAY,
    UNKNOWN_TYPE,
    WRONG_DEVICE,
    CommandRefused,
)
from edge_agent.fleet.protocol.signing import verify

__all__ = ["CommandGate", "Delivery", "Handler", "command_args", "ping"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delivery:
    """What `receive` decided. Always: send the PUBACK now. Then publish `result` if set
    (a refusal, or a redelivered command's stored outcome), and run `execute(command)`
    if `execute`."""

    command: Command | None
    result: Result | None
    execute: bool


Handler = Callable[[Command], "Mapping[str, Any] | None"]
"""Runs one command; returns the result's JSON object (or None). Raises CommandRefused to
refuse it; any other exception makes it `failed`. Called once per command id."""


M = TypeVar("M", bound=BaseModel)


def command_args(command: Command, model: type[M]) -> M:
    """A handler's `args`, read through the registry's schema for its type (the one the
    controller checked before signing): CommandRefused(`malformed`) naming the field, so
    the box and the controller cannot disagree on a shape."""
    try:
        return typed_args(command.type, command.args, model)
    except BadArgs as exc:
        raise CommandRefused(MALFORMED, str(exc)) from None


def ping(command: Command) -> dict[str, Any]:
    return {"pong": True, "ts": time.time()}


def _refused(exc: CommandRefused, command_id: str | None = None,
             type_: str | None = None) -> Result:
    return Result(command_id, type_, REFUSED, exc.reason,
                  {"message": exc.message} if exc.message else None)


class CommandGate:
    def __init__(self, state: FleetState, *, fleet: str, device: str,
                 public_key: Ed25519PublicKey | None, handlers: Mapping[str, Handler],
                 clock: Callable[[], float] = time.time, skew_s: float = CLOCK_SKEW_S) -> None:
        self.state = state
        self.fleet = fleet
        self.device = device
        self.public_key = public_key
        self.handlers = dict(handlers)
        self._clock = clock
        self.skew_s = skew_s
        # Ids handed out for execution and not finished: a redelivery meanwhile is not
        # handed out again.
        self._handed_out: set[str] = set()
        self._lock = threading.Lock()
        self._execute_lock = threading.Lock()  # one command at a time: they are rare

    def receive(self, payload: bytes, topic: str) -> Delivery:
        """Checks a command and stores it before returning (module docstring). Raises only
        when fleet.db cannot be written; any other exception is this message's alone, and
        is answered `failed` so that its PUBACK goes and it is not delivered forever."""
        payload = bytes(payload)
        try:
            return self._receive(payload, topic)
        except Exception as exc:
            if _storage_failed(exc):
                raise
            command_id, type_ = best_effort_names(None, payload)
            log.error("fleet: command %s (%s) could not be handled: %s: %s; answered failed "
                      "and acknowledged", command_id, type_, type(exc).__name__, exc,
                      exc_info=True)
            return Delivery(None, Result(command_id, type_, FAILED, type(exc).__name__, None),
                            False)

    def _receive(self, payload: bytes, topic: str) -> Delivery:
        obj: Any = None
        try:
            obj = parse(payload)
            self._check_addressee(obj, topic)
            verify(obj, self.public_key)
        except CommandRefused as exc:  # unauthenticated: reported, never stored
            return Delivery(None, _refused(exc, *best_effort_names(obj, payload)), False)
        command = command_of(obj, payload)
        stored = self.state.command(command.id)
        if stored is not None:
            return self._redelivered(command, stored)
        try:
            self._check_fresh(command)
        except CommandRefused as exc:
            result = {"message": exc.message} if exc.message else None
            if not self.state.refuse(command.id, command.stream, command.seq, command.type,
                                     payload, exc.reason, result):
                return self._redelivered(command, self.state.command(command.id))
            return Delivery(command, _refused(exc, command.id, command.type), False)
        if not self.state.accept(command.id, command.stream, command.seq, command.type,
                                 payload):
            return self._redelivered(command, self.state.command(command.id))
        with self._lock:
            self._handed_out.add(command.id)
        return Delivery(command, None, True)

    def execute(self, command: Command) -> Result:
        """Runs an accepted command's handler and records the outcome, once: a command
        that already has an outcome is not run again (its stored outcome is returned).
        ValueError for a command `receive` did not accept. Blocks while another command
        runs."""
        with self._execute_lock:
            try:
                stored = self.state.command(command.id)
                if stored is None:
                    raise ValueError(f"command {command.id} was not accepted; not running it")
                if stored.status is not None:
                    return _stored_result(stored)
                result = self._run(command)
                if not self.state.record_result(command.id, result.status, result.reason,
                                                result.result):
                    again = self.state.command(command.id)
                    return _stored_result(again) if again is not None else result
                return result
            finally:
                with self._lock:
                    self._handed_out.discard(command.id)

    def resume(self) -> list[Command]:
        """Commands stored but never finished (the process stopped in between): the link
        executes them at start. Every command type is idempotent, so running one whose
        handler was cut short is safe."""
        commands = [command_of(parse(s.payload), s.payload) for s in self.state.unfinished()]
        with self._lock:
            self._handed_out.update(c.id for c in commands)
        return commands

    def _run(self, command: Command) -> Result:
        handler = self.handlers.get(command.type)
        if handler is None:  # unregistered since it was accepted (a restart, a resume)
            return Result(command.id, command.type, REFUSED, UNKNOWN_TYPE, None)
        try:
            out = handler(command)
            result = dict(out) if out is not None else None
            json.dumps(result, allow_nan=False)  # recorded and published as JSON
        except CommandRefused as exc:
            return _refused(exc, command.id, command.type)
        except Exception as exc:  # a handler's bug never reaches the link's thread
            return Result(command.id, command.type, FAILED, type(exc).__name__, None)
        return Result(command.id, command.type, OK, None, result)

    def _check_addressee(self, obj: dict[str, Any], topic: str) -> None:
        if obj["fleet"] != self.fleet or obj["device"] not in (self.device, topics.ALL):
            raise CommandRefused(WRONG_DEVICE, "command is addressed to another box")
        try:
            where = topics.parse(topic)
        except ValueError:
            raise CommandRefused(WRONG_DEVICE, "not a command topic") from None
        if (where.kind != topics.CMD or where.fleet != self.fleet
                or where.device != obj["device"]):
            raise CommandRefused(WRONG_DEVICE, "command came on another box's topic")

    def _check_fresh(self, command: Command) -> None:
        if self._clock() > command.expires_at + self.skew_s:
            raise CommandRefused(EXPIRED)
        if command.type not in self.handlers:
            raise CommandRefused(UNKNOWN_TYPE, f"no handler for {command.type!r}")
        last = self.state.last_seq(command.stream)
        if command.seq <= last:
            raise CommandRefused(REPLAY, f"seq {command.seq} is not above {last}")

    def _redelivered(self, command: Command, stored: StoredCommand | None) -> Delivery:
        if stored is not None and stored.status is not None:
            return Delivery(command, _stored_result(stored), False)
        # Stored without an outcome: handed out already (its result comes when it has run),
        # or the process stopped before it ran (run it now).
        with self._lock:
            if command.id in self._handed_out:
                return Delivery(command, None, False)
            self._handed_out.add(command.id)
        return Delivery(command, None, True)


def _storage_failed(exc: BaseException) -> bool:
    """fleet.db could not be read or written: a full disk, an I/O error, a lock held past
    its timeout, a damaged file. Those pass, and the message comes again; the other
    sqlite3 errors (a value it cannot bind, a constraint) are the message's own."""
    return (isinstance(exc, OSError | MemoryError | sqlite3.OperationalError
                       | sqlite3.InternalError)
            or type(exc) is sqlite3.DatabaseError)


def _stored_result(stored: StoredCommand) -> Result:
    return Result(stored.id, stored.type, stored.status or FAILED, stored.reason,
                  stored.result)
