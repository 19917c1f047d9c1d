"""The fetch's clock (`cutoff.Cutoff`) against a real socket: a response whose status line
never ends is cut at the instant the fetch falls behind; a fetch on pace, or one between
requests, is never cut."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import urllib3

from edge_agent.fleet.device.release.cutoff import Cutoff


class SlowHeaders:
    """A loopback server that sends its status line a byte every `every_s` seconds, for
    ever (until stopped); or, with `whole`, a complete small response at once."""

    def __init__(self, *, every_s: float = 0.5, whole: bool = False) -> None:
        self.every_s, self.whole = every_s, whole
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.stopping = threading.Event()
        self.closed_by_peer = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/file"

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            if self.whole:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                self.stopping.wait(5)
                return
            line = b"HTTP/1.1 200 OK\r\nX-Padding: " + b"x" * 20  # bounded: ~15 s at most
            try:
                for i in range(len(line)):
                    conn.sendall(line[i:i + 1])
                    if self.stopping.wait(self.every_s):
                        return
            except OSError:
                self.closed_by_peer.set()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def slow() -> Iterator[SlowHeaders]:
    server = SlowHeaders()
    yield server
    server.stop()


def _http(cutoff: Cutoff) -> urllib3.PoolManager:
    return cutoff.pool_manager(retries=False, timeout=urllib3.Timeout(connect=5, read=5))


def test_headers_that_trickle_are_cut_when_the_fetch_falls_behind(slow: SlowHeaders) -> None:
    due = time.monotonic() + 1.0  # behind from one second on, whatever arrives
    cutoff = Cutoff(lambda: due - time.monotonic())
    http = _http(cutoff)
    try:
        with pytest.raises(urllib3.exceptions.HTTPError), cutoff.armed():
            http.request("GET", slow.url, preload_content=False)
        late = time.monotonic() - due  # measured from the instant it fell behind
        assert cutoff.tripped
        # Never before it falls behind; after, within the bound the fetch states (1.5 s on a
        # loaded box), long before the read timeout (5 s) or the trickle's end (~15 s).
        assert 0.0 <= late < 1.5, late
    finally:
        cutoff.close()
        http.clear()


def test_a_fetch_on_pace_is_never_cut(slow: SlowHeaders) -> None:
    """`due_s` moves later as bytes come (here: always 10 s ahead): the read timeout
    (1 s, shorter than the trickle's 2 s a byte), not the clock, ends the request."""
    slow.every_s = 2.0
    cutoff = Cutoff(lambda: 10.0)
    http = cutoff.pool_manager(retries=False, timeout=urllib3.Timeout(connect=5, read=1))
    try:
        with pytest.raises(urllib3.exceptions.ReadTimeoutError), cutoff.armed():
            http.request("GET", slow.url, preload_content=False)
        assert not cutoff.tripped
    finally:
        cutoff.close()
        http.clear()


def test_nothing_is_cut_between_requests() -> None:
    """Behind from the start, but never armed (no request of the fetch under way, as in a
    backoff's sleep): the clock cuts nothing."""
    server = SlowHeaders(whole=True)
    cutoff = Cutoff(lambda: -1.0)
    http = _http(cutoff)
    try:
        resp = http.request("GET", server.url)  # not armed: answered whole
        assert resp.status == 200 and resp.data == b"ok"
        assert not cutoff.tripped
    finally:
        cutoff.close()
        http.clear()
        server.stop()
