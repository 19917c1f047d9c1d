"""The sd_notify protocol: how a service tells systemd that it is ready, what it is doing,
that it is stopping, and that its event loop still turns (the watchdog). No dependency.

A message is one datagram of newline-separated `KEY=value` lines sent to the AF_UNIX socket
that $NOTIFY_SOCKET names: a path, or `@name` for an abstract socket. systemd takes the
sender's PID from the socket's credentials; under `NotifyAccess=main` it hears only the main
process, so the messages go out from the server's own process (any of its threads).

    READY=1          start-up is complete: systemd ends `systemctl start`, starts the
                     units ordered after this one, and arms the watchdog
    STATUS=…         one line for `systemctl status`
    STOPPING=1       the service has begun to stop
    WATCHDOG=1       still alive; due every $WATCHDOG_USEC µs once ready, or systemd
                     kills the service (WatchdogSignal) and Restart= starts it again

It owns: reading $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID; sending one message; and
two coroutines for a server's event loop: `announce_ready` (STATUS= lines with what is still
missing, then READY=1 once) and `keep_alive` (WATCHDOG=1 at half the watchdog timeout, as
sd_watchdog_enabled(3) advises). Because the pings come from a task of the event loop, a loop
wedged by a blocking call stops them, and systemd restarts a process that is alive but no
longer serving.

It must never raise into its caller (the service runs the same with or without systemd),
never block (a datagram that cannot go at once is dropped: a lost STATUS= costs nothing and
a lost WATCHDOG=1 is followed by another well before the deadline), and never send anything
when $NOTIFY_SOCKET is unset (a server started by hand, or by the tests, talks to no one).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

# A STATUS= line longer than this is cut: systemctl shows one line, and the whole datagram
# must stay far below the socket's limit.
_MAX_STATUS = 200


@dataclass(frozen=True)
class Notifier:
    """Where messages go (`address`: a path, or a str starting with NUL for an abstract
    socket; None: nowhere) and how often the watchdog wants a ping (`watchdog_s`: half of
    WATCHDOG_USEC; None: no watchdog)."""

    address: str | None = None
    watchdog_s: float | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, *,
                     pid: int | None = None) -> Notifier:
        """The notifier systemd set up for this process; a disabled one where it did not.

        `environ` and `pid` default to this process's: tests pass their own."""
        env = os.environ if environ is None else environ
        address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        if address is None:
            return cls()
        return cls(address, _watchdog_interval(env, os.getpid() if pid is None else pid))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Sends one message of `lines`; False when disabled or when it could not go now."""
        if self.address is None or not lines:
            return False
        data = "\n".join(lines).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(data, self.address)
        except OSError as exc:  # gone, full, refused: the service goes on regardless
            log.debug("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True

    def status(self, text: str) -> bool:
        return self.send(_status(text))

    def ready(self, status: str) -> bool:
        return self.send("READY=1", _status(status))

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", _status(status))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")


def _status(text: str) -> str:
    line = " ".join(text.split())  # one line: a newline would start another KEY=
    if len(line) > _MAX_STATUS:
        line = line[:_MAX_STATUS - 1] + "…"
    return f"STATUS={line}"


def _socket_address(value: str) -> str | None:
    """`/path` as is, `@name` as the abstract address `\\0name`; anything else (unset, a
    relative path, systemd 254's `vsock:` addresses) means no notifications."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value:
        log.warning("NOTIFY_SOCKET=%r is not a socket path or @name: not notifying", value)
    return None


def _watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Half of WATCHDOG_USEC, when it is meant for `pid` (WATCHDOG_PID unset, or ours: a
    child that inherited the environment must not ping for its parent)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        target = int(env.get("WATCHDOG_PID", "0") or 0)
    except ValueError:
        return None
    if usec <= 0 or (target and target != pid):
        return None
    return usec / 2 / 1_000_000


async def announce_ready(notifier: Notifier, problems: Callable[[], list[str]], *,
                         serving: str, poll_s: float = 0.2) -> None:
    """Polls `problems()` (what still stops the service from being ready: the same check as
    its readiness endpoint) every `poll_s`: a STATUS= line whenever the answer changes, and
    READY=1 with STATUS=`serving` once it is empty; then returns. Does nothing when the
    notifier is disabled. A failing check counts as a problem: the task never dies of it."""
    if not notifier.enabled:
        return
    said = ""
    while True:
        try:
            missing = problems()
        except Exception as exc:  # a broken check must not end the task (or start-up)
            missing = [f"readiness check failed: {exc}"]
        if not missing:
            notifier.ready(serving)
            return
        status = "starting: " + "; ".join(missing)
        if status != said:
            notifier.status(status)
            said = status
        await asyncio.sleep(poll_s)


async def keep_alive(notifier: Notifier) -> None:
    """WATCHDOG=1 every `notifier.watchdog_s` until cancelled; returns at once when systemd
    wants no watchdog. Run it on the event loop the service depends on."""
    interval = notifier.watchdog_s
    if not notifier.enabled or interval is None:
        return
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)
