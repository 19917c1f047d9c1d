"""Which `fleet serve` acts for the fleet where something must not run twice.

Two or more controllers on one PostgreSQL store all ingest (the broker's shared
subscription gives each report to one of them: `broker.shared_group`) and all answer the
API and the console; only the leader runs the rollout engine (waves, soak timers, abort
decisions, signing and publishing `rollout.*`) and retention. A write through any
controller's API is stored; the leader acts on it at its next tick.

- **PostgreSQL** (`AdvisoryLeadership`): a session-level advisory lock, held on a
  connection of the leader's own. The server releases it the moment that connection ends
  (the process died; the host fell off the network, once TCP keepalive gives up: about
  `keepalive_s` seconds, set on both ends). The leader confirms its connection every
  `poll_s` and stops leading once `lease_s` has passed without a confirmation, which is
  shorter than the keepalive: a leader cut off from the server stops acting before the
  lock can be taken by another. A follower tries for the lock every `poll_s`, so a dead
  leader's place is taken within about `poll_s` (process death) or `keepalive_s + poll_s`
  (a host gone silent). The store's own writes are conditional (a rollout's state, one
  command per device and type), so even two engines ticking at once would not send twice:
  leadership is what keeps them from trying.
- **SQLite** (`FileLeadership`): one machine, one process. An exclusive lock on
  `<state>/controller.lock` for the process's life; a second `fleet serve` on the same
  store is refused at start, naming PostgreSQL as the way to run two.

Each controller also says it is there (`Presence`: a row of `controllers` every
`BEAT_S`), so `fleet controllers`, `GET /controllers` and any controller's console show
every one of them, which leads and since when, and which stopped answering.

Never: act on a stale belief (every `is_leader()` checks the lease), or hold the store's
own connection (its transactions come and go; the lock must not).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent.config import ConfigError

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

LEADER_KEY = 0x6564676C64  # pg_advisory_lock key of the controllers' leader ("edgld")
BEAT_S = 2.0  # a controller's presence row, refreshed this often
GONE_AFTER_S = 15.0  # a row older than this: that controller stopped answering
LOCK_FILE = "controller.lock"


class Leadership(Protocol):
    controller_id: str

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def is_leader(self) -> bool: ...

    def state(self) -> dict[str, Any]: ...


class FileLeadership:
    """The one controller of a SQLite store: leader from `start()` on."""

    def __init__(self, state_dir: Path, controller_id: str) -> None:
        self.path = state_dir / LOCK_FILE
        self.controller_id = controller_id
        self._fd: int | None = None
        self._since: float | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"another fleet serve uses the store in {self.path.parent} "
                              f"({holder}): one controller per SQLite store; two or more "
                              "share a PostgreSQL one (db = postgresql://…)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, {self.controller_id}\n".encode())
        self._fd, self._since = fd, time.time()

    def stop(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd, self._since = None, None

    def is_leader(self) -> bool:
        return self._fd is not None

    def state(self) -> dict[str, Any]:
        return {"controller": self.controller_id, "leader": self.is_leader(),
                "since": self._since, "store": "sqlite"}


class AdvisoryLeadership:
    """Leader while holding `LEADER_KEY` on a connection of its own (module docstring)."""

    def __init__(self, url: str, controller_id: str, *, poll_s: float = 1.0,
                 lease_s: float = 5.0, keepalive_s: int = 10,
                 clock: Any = time.monotonic) -> None:
        if lease_s >= keepalive_s:
            raise ConfigError("leadership: the lease must end before the server's keepalive "
                              f"gives the lock away ({lease_s} s ≥ {keepalive_s} s)")
        self.url = url
        self.controller_id = controller_id
        self.poll_s, self.lease_s, self.keepalive_s = poll_s, lease_s, keepalive_s
        self._clock = clock
        self._conn: psycopg.Connection[Any] | None = None
        self._confirmed: float | None = None  # monotonic time of the last confirmation
        self._since: float | None = None  # wall time leadership began
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said_error = False

    def start(self) -> None:
        self._step()  # lead at once where nobody does
        self._thread = threading.Thread(target=self._run, name="fleet-leadership",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._drop("stopping")

    def is_leader(self) -> bool:
        confirmed = self._confirmed
        return confirmed is not None and self._clock() - confirmed < self.lease_s

    def state(self) -> dict[str, Any]:
        leader = self.is_leader()
        return {"controller": self.controller_id, "leader": leader,
                "since": self._since if leader else None, "store": "postgresql"}

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._step()

    def _step(self) -> None:
        import psycopg

        try:
            conn = self._connection()
            if self._confirmed is None:
                got = conn.execute("SELECT pg_try_advisory_lock(%s)", [LEADER_KEY]).fetchone()
                if got is not None and got[0]:
                    self._confirmed, self._since = self._clock(), time.time()
                    log.info("fleet: this controller (%s) leads: it runs the rollout engine "
                             "and retention", self.controller_id)
            else:
                conn.execute("SELECT 1")  # the lock lives exactly as long as this connection
                self._confirmed = self._clock()
            self._said_error = False
        except psycopg.Error as exc:
            if not self._said_error:
                log.warning("fleet: leadership: the store did not answer (%s); %s",
                            str(exc).strip().splitlines()[0] if str(exc).strip() else exc,
                            "no longer leading" if self._confirmed is not None else
                            "retrying")
                self._said_error = True
            self._drop("the store did not answer")

    def _connection(self) -> psycopg.Connection[Any]:
        import psycopg

        if self._conn is None or self._conn.closed or self._conn.broken:
            idle = max(1, self.keepalive_s // 3)
            self._conn = psycopg.connect(
                self.url, autocommit=True, connect_timeout=max(1, int(self.lease_s)),
                keepalives=1, keepalives_idle=idle, keepalives_interval=1,
                keepalives_count=max(1, self.keepalive_s - idle),
                options=f"-c tcp_keepalives_idle={idle} -c tcp_keepalives_interval=1 "
                        f"-c tcp_keepalives_count={max(1, self.keepalive_s - idle)} "
                        f"-c statement_timeout={int(self.lease_s * 1000)}")
        return self._conn

    def _drop(self, why: str) -> None:
        was = self._confirmed is not None
        self._confirmed, self._since = None, None
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()  # the server releases the lock with the session
            except Exception:  # closing a broken connection: nothing more to release
                pass
        if was:
            log.warning("fleet: this controller (%s) no longer leads: %s", self.controller_id,
                        why)


class Presence:
    """This controller's row in `controllers`, every `beat_s`, from a thread of its own."""

    def __init__(self, store: PresenceStore, leadership: Leadership, *,
                 beat_s: float = BEAT_S) -> None:
        self.store, self.leadership, self.beat_s = store, leadership, beat_s
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fleet-presence", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def beat(self) -> None:
        state = self.leadership.state()
        self.store.controller_seen(self.leadership.controller_id, leader=bool(state["leader"]),
                                   leader_since=state["since"], started=self.started,
                                   now=time.time(), pid=os.getpid(), host=socket.gethostname())

    def _run(self) -> None:
        while True:
            try:
                self.beat()
                self._said = False
            except Exception:  # the store away: the next beat says it again
                if not self._said:
                    log.warning("fleet: could not record this controller's presence",
                                exc_info=True)
                    self._said = True
            if self._stop.wait(self.beat_s):
                return


class PresenceStore(Protocol):
    def controller_seen(self, controller: str, *, leader: bool, leader_since: float | None,
                        started: float, now: float, pid: int, host: str) -> None: ...


def presence_state(row: dict[str, Any], now: float) -> str:
    """leader, follower, or gone (no beat for GONE_AFTER_S)."""
    if now - float(row["last_seen"]) > GONE_AFTER_S:
        return "gone"
    return "leader" if row["leader"] else "follower"


def leadership_for(db: str | None, state_dir: Path, controller_id: str) -> Leadership:
    """PostgreSQL's advisory lock for a `postgresql://` store, else the state dir's file."""
    if db is not None and db.startswith(("postgresql://", "postgres://")):
        return AdvisoryLeadership(db, controller_id)
    return FileLeadership(state_dir, controller_id)
