"""A TCP proxy on a free loopback port that a test can cut: `cut()` drops every connection
through it and refuses new ones (a link that went down between two hosts), `restore()`
lets them through again. For the bridge between a region's broker and the central one,
cut while both brokers, and everything else, stay up. It also keeps every byte the clients
sent through it (`sent`), for a test that must prove what never went out."""

from __future__ import annotations

import socket
import threading

from tests.conftest import free_port


class TCPProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.port = free_port()
        self._server = socket.create_server((host, self.port))
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._up = True
        self._closed = False
        self.sent = bytearray()  # every byte from the clients to the target, in order
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if not self._up:
                    client.close()  # the link is down: the connect fails at once
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for a, b, keep in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, keep), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, keep: bool) -> None:
        try:
            while data := src.recv(65536):
                if keep:
                    with self._lock:
                        self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self._lock:
            self._up = False
            dropped, self._open = self._open, []
        for s in dropped:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        with self._lock:
            self._up = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._server.close()
