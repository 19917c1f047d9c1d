"""A fetch's floor held by a clock, not by its reads: the connection is cut the moment the
fetch falls behind, whatever the server sends and however it sends it.

Checking the floor after each read (`Pace.behind`) holds only where reads return. They do
not while a response's status line and headers arrive (http.client reads them a line at a
time, and a line sent 1 byte a second never ends before the read timeout), nor while a
chunked body's size line trickles in: a read timeout never fires while a byte comes now
and then, so such a fetch ran on for as long as the server liked, with no byte counted.

So each fetch has a `Cutoff`: a thread that sleeps until the instant the fetch's bytes so
far would put it below the floor (`due_s`, from the fetch's own counters), and then, if a
request is under way (`armed`) and the fetch is still behind, shuts down the socket of
every connection the fetch opened. The blocked read returns at once (end of stream), the
attempt fails, and the caller, seeing `tripped`, gives the fetch up as too slow. The
bound is the floor itself: a fetch is cut within a few milliseconds of
`grace + bytes / rate` seconds after it began (`Pace.deadline_s`).

Connections are tracked through urllib3's own seam: the pool manager's pool classes
name their connection class, and ours records each connection once it has connected.
A connect still under way is not cut (its own timeout, at most the grace, ends it: a
server that is down stays `unreachable`, not `too_slow`), and nothing is cut between
attempts (the backoff's sleep is the caller's).
"""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool


class Cutoff:
    """One fetch's watch (the module's doc). `due_s()`: seconds until the fetch falls
    below its floor at the bytes it has now (<= 0: behind). Call `close()` when done."""

    def __init__(self, due_s: Callable[[], float], *, name: str = "fetch") -> None:
        self._due_s = due_s
        self._name = name
        self._cond = threading.Condition()
        self._conns: weakref.WeakSet[HTTPConnection] = weakref.WeakSet()
        self._armed = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.tripped = False

    def pool_manager(self, **kw: Any) -> urllib3.PoolManager:
        """A urllib3 pool manager whose connections this watch may cut."""
        track = self._track

        class Conn(HTTPConnection):
            def connect(self) -> None:
                super().connect()
                track(self)

        class TLSConn(HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                track(self)

        class Pool(HTTPConnectionPool):
            ConnectionCls = Conn

        class TLSPool(HTTPSConnectionPool):
            ConnectionCls = TLSConn

        manager = urllib3.PoolManager(**kw)
        manager.pool_classes_by_scheme = {"http": Pool, "https": TLSPool}
        return manager

    @contextmanager
    def armed(self) -> Iterator[None]:
        """While a request of the fetch is under way: the only time anything is cut."""
        self.arm()
        try:
            yield
        finally:
            self.disarm()

    def arm(self) -> None:
        """A request begins (`armed`, for one whose end is not a block's)."""
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._watch, daemon=True,
                                                name=f"cutoff {self._name}")
                self._thread.start()
            self._armed = True
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _track(self, conn: HTTPConnection) -> None:
        with self._cond:
            self._conns.add(conn)

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._armed:
                    self._cond.wait()
                    continue
                left = self._due_s()
                if left >= 0:  # cut only once strictly behind (`Pace.behind` agrees)
                    # The fetch's bytes only grow, so `due_s` only moves later: waking at
                    # the present estimate is on time or early, never late.
                    self._cond.wait(max(left, 0.001))
                    continue
                if self._cut():
                    self.tripped = True
                    self._armed = False
                else:  # connecting: its own timeout decides; look again shortly
                    self._cond.wait(0.1)

    def _cut(self) -> bool:
        """Shuts down every live socket of the fetch; whether there was one."""
        cut = False
        for conn in list(self._conns):
            sock = getattr(conn, "sock", None)
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                cut = True
            except OSError:  # closed meanwhile
                pass
        return cut
