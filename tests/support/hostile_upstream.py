"""An OpenAI-compatible address whose answers go wrong on purpose, one way per model name,
for the box's bounds on what it reads from an upstream: a real socket server, each
connection on a thread of its own, `Connection: close` after every answer.

    hang       reads the request and never answers
    trickle    starts a streamed answer, then one byte a second, never a whole event
    error      500 with an OpenAI error body
    cut        two chunks of a streamed answer, then the connection closed, no [DONE]
    offschema  a whole streamed answer that is not JSON (for a schema request)
    huge       a streamed answer of 50 MB in one line that never ends

`GET /v1/models` answers 200, so a probe finds it healthy.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

from tests.conftest import free_port

HUGE_BYTES = 50 * 1024 * 1024
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"connection: close\r\n\r\n")


def _chunk(text: str) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class HostileUpstream:
    def __init__(self) -> None:
        self.port = free_port()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        self.sent_bytes: dict[str, int] = {}
        threading.Thread(target=self._accept, name="hostile-upstream", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                method, path, body = _request(conn)
                if method == "GET":
                    _send(conn, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                b"content-length: 11\r\nconnection: close\r\n\r\n{\"data\":[]}")
                    return
                self._misbehave(conn, str(body.get("model", "")))
        except OSError:
            pass  # the box gave up on us: that is the point

    def _misbehave(self, conn: socket.socket, mode: str) -> None:
        if mode == "hang":
            self._stop.wait()
        elif mode == "trickle":
            conn.sendall(SSE_HEAD)
            for byte in b'data: {"choices": [{"delta": {"content": "' + b"x" * 10_000:
                if self._stop.wait(1.0):
                    return
                conn.sendall(bytes([byte]))
        elif mode == "error":
            text = json.dumps({"error": {"message": "the pool is on fire",
                                         "type": "server_error"}}).encode()
            _send(conn, b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: "
                        b"application/json\r\ncontent-length: " + str(len(text)).encode()
                  + b"\r\nconnection: close\r\n\r\n" + text)
        elif mode == "cut":
            conn.sendall(SSE_HEAD + _chunk("Hello") + _chunk(" there"))
        elif mode == "offschema":
            conn.sendall(SSE_HEAD + _chunk("this is not JSON") + b"data: [DONE]\n\n")
        elif mode == "huge":
            conn.sendall(SSE_HEAD + b'data: {"choices": [{"delta": {"content": "')
            piece = b"a" * 65536
            sent = 0
            while sent < HUGE_BYTES:
                conn.sendall(piece)
                sent += len(piece)
                self.sent_bytes[mode] = sent

    def close(self) -> None:
        self._stop.set()
        self._server.close()


def _request(conn: socket.socket) -> tuple[str, str, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            raise OSError("closed before its head")
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                   if line.lower().startswith("content-length:")), 0)
    while len(rest) < length:
        more = conn.recv(65536)
        if not more:
            break
        rest += more
    return method, path, json.loads(rest) if rest else {}


def _send(conn: socket.socket, data: bytes) -> None:
    conn.sendall(data)
