"""Slow, idle, stalled and surplus clients, with raw sockets against a live server on
loopback: each is cut within its `[server]` deadline instead of holding a connection (or a
generation slot) forever."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.config import load_settings
from tests.conftest import DEFAULT_MODEL, NO_EOS, LiveServer, clone_state, free_port, start_server

pytestmark = pytest.mark.integration

TIMEOUT_S = 1.0  # the head, body and keep-alive deadlines of the server under test
STALL_S = 3.0  # its stall timeout: long enough for a busy box to start a generation
MAX_CONNECTIONS = 4
SLACK_S = 1.5  # the watchdog's tick, a loaded CI box


@pytest.fixture(scope="module")
def guarded(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LiveServer]:
    state = clone_state(model_cache, tmp_path_factory.mktemp("conn") / "state")
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "server.header_timeout_s": TIMEOUT_S,
        "server.body_timeout_s": TIMEOUT_S, "server.keep_alive_timeout_s": TIMEOUT_S,
        "server.stall_timeout_s": STALL_S, "server.max_connections": MAX_CONNECTIONS,
        "runtime.context_length": 2048})
    live = start_server(settings)
    yield live
    live.stop()


def _connect(live: LiveServer, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window it advertises stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", live.settings.server.port))
    return sock


def _until_closed(sock: socket.socket, within_s: float) -> bytes:
    """Everything the server sends until it closes; fails if it has not within `within_s`."""
    data = b""
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the server kept the connection open; got {data[:200]!r}"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            continue
        if not chunk:
            return data
        data += chunk


def _idle(live: LiveServer) -> None:
    """Waits until the server holds no connection (earlier tests' are gone)."""
    deadline = time.monotonic() + 5
    while live.server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live.server.server_state.connections


def _response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, read without waiting for a close."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    length = _status_and_body(data)[1]["content-length"]
    while len(data.partition(b"\r\n\r\n")[2]) < int(length):
        data += sock.recv(65536)
    return data


def _status_and_body(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
        guarded: LiveServer) -> None:
    sock = _connect(guarded)
    start = time.monotonic()
    assert _until_closed(sock, TIMEOUT_S + SLACK_S) == b""
    assert time.monotonic() - start >= TIMEOUT_S * 0.9
    sock.close()


def test_slowloris_headers_get_408_within_the_header_timeout(guarded: LiveServer) -> None:
    sock = _connect(guarded)
    start = time.monotonic()
    sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\n")
    for _ in range(int((TIMEOUT_S + SLACK_S) / 0.2)):  # one header byte every 0.2 s
        if select.select([sock], [], [], 0.2)[0]:
            break
        sock.sendall(b"X")
    response = _until_closed(sock, SLACK_S)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert _status_and_body(response)[0] == 408
    sock.close()


def test_slowloris_headers_after_a_keep_alive_request_are_cut_too(
        guarded: LiveServer) -> None:
    sock = _connect(guarded)
    sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _response(sock).startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /api/version HTTP/1.1\r\n")  # the next head, then a byte a while
    start = time.monotonic()
    for _ in range(int((TIMEOUT_S + SLACK_S) / 0.2)):
        if select.select([sock], [], [], 0.2)[0]:
            break
        sock.sendall(b"X")
    assert _status_and_body(_until_closed(sock, SLACK_S))[0] == 408
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    sock.close()


def test_an_idle_keep_alive_connection_is_closed(guarded: LiveServer) -> None:
    sock = _connect(guarded)
    sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _response(sock).startswith(b"HTTP/1.1 200")
    start = time.monotonic()
    assert _until_closed(sock, TIMEOUT_S + SLACK_S) == b""
    assert time.monotonic() - start >= TIMEOUT_S * 0.9
    sock.close()


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions"])
def test_a_body_trickled_at_one_byte_a_tick_gets_408_after_the_body_timeout(
        guarded: LiveServer, path: str) -> None:
    sock = _connect(guarded)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100\r\n\r\n".encode())
    start = time.monotonic()
    for _ in range(int((TIMEOUT_S + SLACK_S) / 0.25)):
        if select.select([sock], [], [], 0.25)[0]:
            break
        sock.sendall(b" ")
    status, headers, body = _status_and_body(_until_closed(sock, SLACK_S))
    elapsed = time.monotonic() - start
    assert status == 408 and headers["connection"] == "close"
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + SLACK_S
    error = json.loads(body)["error"]
    if path.startswith("/v1/"):
        assert error["code"] == "request_timeout"
    else:
        assert "did not arrive" in error
    sock.close()


def test_a_body_still_trickling_after_its_response_is_cut(guarded: LiveServer) -> None:
    """An endpoint that answers without reading the body: the rest of the body must not
    hold the connection (each byte cancelled uvicorn's keep-alive timer)."""
    sock = _connect(guarded)
    sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    start = time.monotonic()
    received = b""
    for _ in range(int((TIMEOUT_S + SLACK_S) / 0.2)):
        if select.select([sock], [], [], 0.2)[0]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        try:
            sock.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            break
    else:
        pytest.fail("the connection stayed open while the body trickled")
    assert received.startswith(b"HTTP/1.1 200")
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    sock.close()


def test_connections_beyond_the_cap_get_503_at_once(guarded: LiveServer) -> None:
    _idle(guarded)
    held = [_connect(guarded) for _ in range(MAX_CONNECTIONS)]
    deadline = time.monotonic() + 2
    while len(guarded.server.server_state.connections) < MAX_CONNECTIONS:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        for path, shape in (("/api/tags", str), ("/v1/models", dict)):
            sock = _connect(guarded)
            start = time.monotonic()
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            status, headers, body = _status_and_body(_until_closed(sock, 0.5))
            assert time.monotonic() - start < 0.5
            assert status == 503 and headers["connection"] == "close"
            assert int(headers["retry-after"]) >= 1
            assert isinstance(json.loads(body)["error"], shape)
            sock.close()
    finally:
        for sock in held:
            sock.close()
    _idle(guarded)
    sock = _connect(guarded)
    sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert _until_closed(sock, 2).startswith(b"HTTP/1.1 200")
    sock.close()


def test_a_stream_reader_that_stops_reading_frees_its_slot(guarded: LiveServer) -> None:
    """A client that reads nothing: its small receive window is filled first by pipelined
    responses (so the stall does not wait on how fast this box generates), then its
    stream starts. The server must reset it and give the model back within the stall
    timeout, and the job must end at its next step, where 1,900 tokens would keep the
    slot for much longer."""
    registry = guarded.app.state.parts.registry
    model = next(m for m in registry.loaded() if m.info.name == DEFAULT_MODEL)
    worker = model.worker
    body = json.dumps({
        "model": DEFAULT_MODEL, "stream": True, "max_tokens": 1900, "temperature": 1.0,
        "logit_bias": NO_EOS,
        "messages": [{"role": "user", "content": "Write a very long story."}]}).encode()
    sock = _connect(guarded, rcvbuf=4096)
    sent = time.monotonic()
    sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 4
                 + b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    while worker.running == 0:  # the generation holds a slot
        assert time.monotonic() - sent < STALL_S, "the generation did not start in time"
        time.sleep(0.01)
    while model.in_use and time.monotonic() - sent < STALL_S + SLACK_S:
        time.sleep(0.02)
    assert model.in_use == 0, "the stream held its model for a client that reads nothing"
    # The job ends at the scheduler's next step: milliseconds, seconds on a loaded box.
    deadline = time.monotonic() + 10
    while worker.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.running == 0, "the generation ran on for a client that reads nothing"
    with pytest.raises(ConnectionResetError):  # the server reset the stalled connection
        while sock.recv(65536):
            pass
    sock.close()
