"""edge_agent.sdnotify against a real AF_UNIX datagram socket, as systemd reads it.

The protocol's own cases first (addresses, the watchdog's interval, one-line STATUS, a full
or missing socket, silence without $NOTIFY_SOCKET); then the real server with the real
default model: STATUS= while it loads, READY=1 only once `/ready` answers 200, WATCHDOG=1 at
the configured rate and none while the event loop is wedged; and `edge-agent serve` as a
subprocess that drains a running stream on SIGTERM, says STOPPING=1 and flushes its ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.app import create_app
from edge_agent.config import load_settings
from edge_agent.sdnotify import Notifier, announce_ready, keep_alive
from edge_agent.server import build_server
from tests.conftest import DEFAULT_MODEL, NO_EOS, clone_state, free_port
from tests.support.pace import Pace, measure


class Receiver:
    """systemd's end: a bound SOCK_DGRAM socket; a thread keeps (arrival time, message)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self.messages.append((time.monotonic(), data.decode()))
                self._cond.notify_all()

    def wait_for(self, line: str, timeout: float) -> float:
        """When the first message holding `line` arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for at, message in self.messages:
                    if line in message.split("\n"):
                        return at
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {line} within {timeout} s: {self.messages}")
                self._cond.wait(left)

    def lines(self) -> list[tuple[float, str]]:
        with self._cond:
            return [(at, line) for at, message in self.messages
                    for line in message.split("\n")]

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture()
def receiver(tmp_path: Path) -> Iterator[tuple[str, Receiver]]:
    path = str(tmp_path / "notify.sock")
    rx = Receiver(path)
    yield path, rx
    rx.close()


# --- the protocol ---------------------------------------------------------------------------

def test_nothing_at_all_without_notify_socket(receiver: tuple[str, Receiver]) -> None:
    _, rx = receiver
    quiet = Notifier.from_environ({"WATCHDOG_USEC": "100000"})
    assert not quiet.enabled
    assert not quiet.ready("x") and not quiet.status("x") and not quiet.watchdog()

    async def both() -> None:  # each returns at once instead of polling or pinging
        await asyncio.wait_for(announce_ready(quiet, lambda: ["never ready"], serving="-"), 1)
        await asyncio.wait_for(keep_alive(quiet), 1)

    asyncio.run(both())
    time.sleep(0.2)
    assert rx.messages == []


def test_a_path_and_an_abstract_socket(receiver: tuple[str, Receiver]) -> None:
    path, rx = receiver
    assert Notifier.from_environ({"NOTIFY_SOCKET": path}).ready("up")
    rx.wait_for("READY=1", 2)
    assert ("STATUS=up" in [line for _, line in rx.lines()])

    name = f"edge-agent-test-{uuid.uuid4().hex}"
    abstract = Receiver("\0" + name)
    try:
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        assert notifier.address == "\0" + name
        assert notifier.stopping("bye")
        abstract.wait_for("STOPPING=1", 2)
    finally:
        abstract.close()


@pytest.mark.parametrize(("env", "expected"), [
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000"}, 15.0),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
    # meant for another process (the parent whose environment a child inherited)
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "soon"}, None),
    ({"NOTIFY_SOCKET": "/run/x"}, None),
])
def test_the_watchdog_interval_is_half_the_timeout(env: dict[str, str],
                                                   expected: float | None) -> None:
    assert Notifier.from_environ(env, pid=4242).watchdog_s == expected


@pytest.mark.parametrize("value", ["", "relative/notify", "@", "vsock:2:1234"])
def test_addresses_it_cannot_use_mean_no_notifications(value: str) -> None:
    assert not Notifier.from_environ({"NOTIFY_SOCKET": value}).enabled


def test_status_is_one_line(receiver: tuple[str, Receiver]) -> None:
    path, rx = receiver
    Notifier(path).status("default model x is loading;\nREADY=1")
    rx.wait_for("STATUS=default model x is loading; READY=1", 2)
    assert "READY=1" not in [line for _, line in rx.lines()]


def test_a_missing_socket_is_no_error(tmp_path: Path) -> None:
    assert Notifier(str(tmp_path / "gone.sock")).watchdog() is False


def test_a_full_socket_drops_the_message_and_never_blocks(tmp_path: Path) -> None:
    path = str(tmp_path / "full.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as unread:
        unread.bind(path)
        notifier = Notifier(path)
        started = time.monotonic()
        sent = [notifier.watchdog() for _ in range(5000)]
        assert time.monotonic() - started < 5
    assert sent[0] and not all(sent)


def test_ready_is_announced_once_the_problems_are_gone(receiver: tuple[str, Receiver]
                                                       ) -> None:
    path, rx = receiver
    answers = [["model a is loading"], ["model a is loading"], ["ledger is not open"], []]
    asked: list[int] = []

    def problems() -> list[str]:
        asked.append(1)
        if len(asked) == 2:
            raise RuntimeError("disk gone")
        return answers[min(len(asked) - 1, len(answers) - 1)]

    asyncio.run(asyncio.wait_for(announce_ready(Notifier(path), problems, serving="serving",
                                                poll_s=0.01), 5))
    rx.wait_for("READY=1", 2)
    assert [line for _, line in rx.lines()] == [
        "STATUS=starting: model a is loading",
        "STATUS=starting: readiness check failed: disk gone",
        "STATUS=starting: ledger is not open",
        "READY=1", "STATUS=serving"]


def test_keep_alive_pings_at_the_interval(receiver: tuple[str, Receiver]) -> None:
    path, rx = receiver
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})

    async def for_a_while() -> None:
        task = asyncio.create_task(keep_alive(notifier))
        await asyncio.sleep(0.52)
        task.cancel()

    asyncio.run(for_a_while())
    time.sleep(0.1)
    pings = [at for at, line in rx.lines() if line == "WATCHDOG=1"]
    assert 6 <= len(pings) <= 12, pings  # every 50 ms, half of WATCHDOG_USEC: 11 when idle


# --- the real server ------------------------------------------------------------------------

@pytest.mark.integration
def test_the_server_is_ready_for_systemd_when_ready_says_so(
        model_cache: Path, tmp_path: Path, receiver: tuple[str, Receiver]) -> None:
    path, rx = receiver
    state = clone_state(model_cache, tmp_path / "state")
    settings = load_settings(None, state_dir=state, **{"server.port": free_port()})
    app = create_app(settings)
    server = build_server(app, settings, log_level="warning", environ={
        "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})  # a ping every 100 ms
    base = f"http://127.0.0.1:{settings.server.port}"
    polls: list[tuple[float, int]] = []  # (when the request began, its status)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            began = time.monotonic()
            try:
                polls.append((began, httpx.get(f"{base}/ready", timeout=5).status_code))
            except httpx.TransportError:
                pass  # not bound yet
            time.sleep(0.02)

    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        ready_at = rx.wait_for("READY=1", 120)
        assert httpx.get(f"{base}/ready", timeout=5).status_code == 200
        before = [line for at, line in rx.lines() if at < ready_at and line != "WATCHDOG=1"]
        assert before and all(line.startswith("STATUS=starting: ") for line in before), before
        assert f"STATUS=starting: default model {DEFAULT_MODEL} is loading" in before
        # The check READY=1 waited for is /ready's: no request begun after it saw a 503.
        assert all(began < ready_at for began, status in polls if status != 200), polls

        time.sleep(1.0)
        window = [at for at, line in rx.lines()
                  if line == "WATCHDOG=1" and ready_at + 0.2 <= at <= ready_at + 1.0]
        assert 5 <= len(window) <= 10, window  # 8 expected, at 100 ms

        # A wedged event loop sends nothing; the pings come back when it turns again.
        loop = server._pinger.get_loop()  # type: ignore[union-attr]
        wedged_at = time.monotonic()
        loop.call_soon_threadsafe(time.sleep, 0.8)
        time.sleep(1.4)
        pings = [at for at, line in rx.lines()
                 if line == "WATCHDOG=1" and at > wedged_at - 0.15]  # the last one before
        gaps = [b - a for a, b in zip(pings, pings[1:], strict=False)]
        assert gaps and max(gaps) >= 0.7, gaps
        assert pings[-1] > wedged_at + 0.9  # alive again
    finally:
        done.set()
        app.state.parts.stop()  # a stop asked from inside, as an agent switch asks it
        serving.join(timeout=30)
        poller.join(timeout=10)
    assert not serving.is_alive()
    assert "STOPPING=1" in [line for _, line in rx.lines()]
    assert [line for _, line in rx.lines()].count("READY=1") == 1


@dataclass
class Served:
    """`edge-agent serve` as systemd starts it: its own process, a notify socket."""

    proc: subprocess.Popen[bytes]
    rx: Receiver
    port: int

    def log(self) -> str:
        return self.proc.stdout.read().decode() if self.proc.stdout else ""


@contextlib.contextmanager
def served(state: Path, config: Path) -> Iterator[Served]:
    """Runs `serve` with `config` on a free port; killed at the end if it still runs."""
    port = free_port()
    name = f"edge-agent-test-{uuid.uuid4().hex}"
    rx = Receiver("\0" + name)
    env = {**os.environ, "NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "2000000"}
    cli = Path(sys.executable).parent / "edge-agent"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "edge_agent"]
    proc = subprocess.Popen([*command, "serve", "--config", str(config), "--state-dir",
                             str(state), "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield Served(proc, rx, port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        rx.close()


@pytest.mark.integration
def test_sigterm_drains_a_running_stream_says_stopping_and_flushes_the_ledger(
        model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    config = tmp_path / "config.toml"
    # Not the machine's /etc/edge-agent/config.toml. The longest drain the setting takes:
    # the stream below is sized at the warm-up's speed, and a box whose load rises meanwhile
    # may take many times as long (seen: 6 tokens in 10 s on a 2-core box running two test
    # suites). It ends the stream only if the drain does not wait for it.
    config.write_text("[server]\nstop_grace_s = 300\n")
    out: dict[str, Any] = {"tokens": 0}
    first = threading.Event()
    request = {"model": DEFAULT_MODEL, "prompt": "Count to one hundred:", "logit_bias": NO_EOS}

    def stream(max_tokens: int, pace: Pace) -> None:
        try:
            with httpx.stream("POST", url, json={**request, "max_tokens": max_tokens,
                                                 "stream": True},
                              timeout=pace.bound(60, max_tokens)) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = time.monotonic()
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:  # the drain ran out: reported by the asserts
                            out["error"] = event["error"]
                            continue
                        choice = event["choices"][0]
                        out["tokens"] += 1
                        out["finish"] = choice.get("finish_reason") or out.get("finish")
                        first.set()
        except httpx.HTTPError as exc:
            out["error"] = exc
        first.set()

    with served(state, config) as server:
        proc, rx = server.proc, server.rx
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        rx.wait_for("READY=1", 180)
        # The warm-up measures this machine's present speed; every bound below is sized
        # from it. A stream of about 3 s at that speed: it outlasts the stop's first moments
        # and ends well within the drain, however the load moves.
        pace = measure(f"http://127.0.0.1:{server.port}")
        tokens = max(16, min(256, int(3 / max(pace.token_s, 1e-3))))
        client = threading.Thread(target=stream, args=(tokens, pace))
        client.start()
        assert first.wait(pace.bound(60))
        term_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stopping_at = rx.wait_for("STOPPING=1", pace.bound(10))
        client.join(timeout=pace.bound(90, tokens))
        assert not client.is_alive(), f"the stream did not end: {out}"
        code = proc.wait(timeout=pace.bound(90, tokens))
    log = server.log()
    assert code in (0, -signal.SIGTERM), log  # systemd counts a SIGTERM death as clean
    assert stopping_at >= term_at
    assert "error" not in out and out.get("done"), (out, log)  # drained, not cut
    assert out["done"] > stopping_at and out["finish"] == "length"  # ran on past the stop
    with sqlite3.connect(state / "ledger.db") as db:
        rows = db.execute("SELECT endpoint, status FROM requests").fetchall()
    # The warm-up's row and the drained stream's, written by the flush at the stop.
    assert [status for endpoint, status in rows if endpoint.endswith("/completions")] == [
        200, 200], rows


@pytest.mark.integration
def test_a_stream_longer_than_the_stop_grace_ends_with_an_error_not_a_cut(
        model_cache: Path, tmp_path: Path) -> None:
    """SIGTERM with two long streams running, one per dialect, and `server.stop_grace_s =
    1`: after the grace each stream gets its dialect's final error (Ollama's `{"error":
    "…shutting down…"}` line; OpenAI's error event, then `[DONE]`), the chunked bodies end
    properly (httpx raises on a body cut short), and each ledger row says status 503,
    done_reason `shutdown`. The whole stop stays well inside the unit's TimeoutStopSec."""
    state = clone_state(model_cache, tmp_path / "state")
    config = tmp_path / "config.toml"
    config.write_text("[server]\nstop_grace_s = 1\n")
    seen: dict[str, list[str]] = {"ollama": [], "openai": []}
    errors: dict[str, BaseException] = {}
    started = {k: threading.Event() for k in seen}
    # Generations that run for minutes: only the stop can end them.
    calls = {
        "ollama": ("/api/generate", {"model": DEFAULT_MODEL, "stream": True, "raw": True,
                                     "prompt": ", ".join(str(i) for i in range(1, 40)) + ",",
                                     "options": {"num_predict": 1800, "temperature": 0}}),
        "openai": ("/v1/chat/completions", {
            "model": DEFAULT_MODEL, "stream": True, "max_tokens": 1800, "temperature": 0,
            "logit_bias": NO_EOS, "messages": [{"role": "user", "content": "Count to 1000."}]}),
    }

    def stream(dialect: str) -> None:
        path, body = calls[dialect]
        try:
            with httpx.stream("POST", base + path, json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        seen[dialect].append(line)
                        started[dialect].set()
        except BaseException as exc:  # noqa: B036 - reported by the asserts below
            errors[dialect] = exc
        started[dialect].set()

    with served(state, config) as server:
        proc, rx = server.proc, server.rx
        base = f"http://127.0.0.1:{server.port}"
        rx.wait_for("READY=1", 180)
        clients = [threading.Thread(target=stream, args=(d,)) for d in seen]
        for client in clients:
            client.start()
        assert all(e.wait(60) for e in started.values())
        term_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(timeout=60)
        code = proc.wait(timeout=60)
        stopped_in = time.monotonic() - term_at
    log = server.log()
    assert errors == {}, (errors, log)  # both bodies ended as HTTP says they must
    assert code in (0, -signal.SIGTERM), log
    assert stopped_in < 20, stopped_in  # grace 1 s, the cut, the flush: not the 30 s bound
    ollama_last = json.loads(seen["ollama"][-1])
    assert set(ollama_last) == {"error"} and "shutting down" in ollama_last["error"], \
        seen["ollama"][-3:]
    assert all('"done":true' not in line for line in seen["ollama"])
    assert seen["openai"][-1] == "data: [DONE]", seen["openai"][-3:]
    event = json.loads(seen["openai"][-2][6:])
    assert event["error"]["code"] == "shutting_down", event
    assert "shutting down" in event["error"]["message"]
    with sqlite3.connect(state / "ledger.db") as db:
        rows = db.execute("SELECT endpoint, status, done_reason, error_type, "
                          "completion_tokens FROM requests").fetchall()
    assert sorted(r[:4] for r in rows) == [
        ("/api/generate", 503, "shutdown", "server_error"),
        ("/v1/chat/completions", 503, "shutdown", "server_error")], rows
    assert "still running after 1 s" in log, log
